"""Mixture-of-experts Hugging Face bridge: same logits as Mixtral / Qwen2-MoE, round trips, refusals."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.model import hf_moe
from scratchlm.model.config import ModelConfig
from scratchlm.model.hf import (
    check_exportable,
    export_hf,
    from_hf_state_dict,
    hf_config,
    model_config_from_hf,
    to_hf_state_dict,
)
from scratchlm.model.transformer import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=101, context_length=32, d_model=48, num_layers=2, num_heads=4, d_ff=40, rope_theta=500.0,
            ffn="moe", moe_num_experts=4)

# (ModelConfig options, Hugging Face class it exports to)
CASES = {
    "mixtral": (dict(moe_top_k=2), "MixtralForCausalLM"),
    "mixtral-tied": (dict(moe_top_k=2, tie_embeddings=True), "MixtralForCausalLM"),
    "mixtral-top1-renormalised": (dict(moe_top_k=1, moe_renormalize=True), "MixtralForCausalLM"),
    "mixtral-no-drop-capacity": (dict(moe_top_k=2, moe_capacity_factor=2.0), "MixtralForCausalLM"),
    "qwen-raw": (dict(moe_top_k=2, moe_renormalize=False), "Qwen2MoeForCausalLM"),
    "qwen-raw-shared": (dict(moe_top_k=2, moe_renormalize=False, moe_shared_experts=2), "Qwen2MoeForCausalLM"),
    "qwen-renormalised-shared": (dict(moe_top_k=3, moe_shared_experts=1), "Qwen2MoeForCausalLM"),
    "qwen-top1": (dict(moe_top_k=1), "Qwen2MoeForCausalLM"),  # top-1 gates are raw by default
}


def _model(seed: int = 0, **kwargs):
    cfg = ModelConfig(**{**TINY, **kwargs})
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)  # RMSNorm weights start at 1; make them matter
            if name.endswith("router.weight"):
                p.mul_(8.0)  # uneven routing, gates far from 1/k
    return model.eval(), cfg


def _load(path):
    with warnings.catch_warnings():
        # A Qwen2-MoE shared expert of width 0 (no shared experts) has zero-element weights.
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits if hasattr(model, "generation_config") else model(ids)


@pytest.mark.parametrize("name", list(CASES))
def test_exported_directory_gives_the_same_logits(name, tmp_path):
    options, architecture = CASES[name]
    model, cfg = _model(**options)
    export_hf(model, cfg, tmp_path)
    theirs = _load(tmp_path)
    assert type(theirs).__name__ == architecture
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["num_experts_per_tok"] == cfg.moe_top_k
    if architecture == "Qwen2MoeForCausalLM":
        assert config["norm_topk_prob"] == (cfg.moe_renormalize is not False and cfg.moe_top_k > 1)
        assert config["shared_expert_intermediate_size"] == cfg.moe_shared_experts * cfg.d_ff
        assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.context_length))
    torch.testing.assert_close(_logits(theirs, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_every_expert_is_used_so_the_comparison_covers_routing():
    # Guards the test above: with the sharpened router, each layer sends tokens to every expert
    # and the gates are far from uniform, so a wrong expert order or gate would show.
    model, cfg = _model(moe_top_k=2)
    model(torch.randint(0, cfg.vocab_size, (3, cfg.context_length)))
    for layer in model.layers:
        aux = layer.ffn.last_aux
        assert (aux["expert_fraction"] > 0).all()
        assert aux["router_entropy"] < 0.75 * math.log(cfg.moe_num_experts)  # sharp, far from uniform


def _qwen(cfg, state, **config_changes):
    config = transformers.Qwen2MoeConfig(**{**hf_config(cfg), **config_changes})
    config._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        qwen = transformers.Qwen2MoeForCausalLM(config).eval()
    qwen.load_state_dict(_fused(state, cfg), strict=True)
    return qwen


def _fused(state, cfg):
    """The published per-expert layout -> transformers 5's stacked gate_up_proj / down_proj."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        E = cfg.moe_num_experts
        gate = torch.stack([state[f"{p}{j}.gate_proj.weight"] for j in range(E)])
        up = torch.stack([state[f"{p}{j}.up_proj.weight"] for j in range(E)])
        out[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[p + "down_proj"] = torch.stack([state[f"{p}{j}.down_proj.weight"] for j in range(E)])
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def test_qwen_logits_need_the_doubled_shared_expert_and_the_gate_normalisation_flag():
    # Guards the mapping: without the factor 2 that sigmoid(0) = 1/2 undoes, or with the other
    # norm_topk_prob, the logits are far apart (so the exact-match tests can fail).
    model, cfg = _model(moe_top_k=2, moe_renormalize=False, moe_shared_experts=1)
    state = to_hf_state_dict(model.state_dict(), cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    ours = _logits(model, ids)
    torch.testing.assert_close(_logits(_qwen(cfg, state), ids), ours, rtol=1e-5, atol=1e-5)
    halved = dict(state)
    for i in range(cfg.num_layers):
        key = f"model.layers.{i}.mlp.shared_expert.down_proj.weight"
        halved[key] = state[key] / 2
    assert (_logits(_qwen(cfg, halved), ids) - ours).abs().max() > 1e-3
    assert (_logits(_qwen(cfg, state, norm_topk_prob=True), ids) - ours).abs().max() > 1e-3


def test_shared_expert_mapping_is_exact_to_the_bit():
    # sigmoid(0) · (2 w2) h == w2 h exactly: scaling by powers of two is exact in floating point.
    model, cfg = _model(moe_top_k=2, moe_renormalize=False, moe_shared_experts=1)
    shared = model.layers[0].ffn.shared
    x = torch.randn(64, cfg.d_model)
    h = torch.nn.functional.silu(x @ shared.w1.weight.t()) * (x @ shared.w3.weight.t())
    state = to_hf_state_dict(model.state_dict(), cfg)
    down = state["model.layers.0.mlp.shared_expert.down_proj.weight"]
    gate = torch.sigmoid(x @ state["model.layers.0.mlp.shared_expert_gate.weight"].t())
    assert torch.equal(gate * (h @ down.t()), h @ shared.w2.weight.t())


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip(name, tmp_path):
    options, architecture = CASES[name]
    model, cfg = _model(seed=1, **options)
    sd = model.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, cfg), cfg)
    assert set(back) == set(sd) | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    # Through a directory and transformers (its fused in-memory layout) into a fresh model.
    export_hf(model, cfg, tmp_path)
    theirs = _load(tmp_path)
    cfg2 = model_config_from_hf(theirs.config.to_dict())
    assert cfg2.moe_aux_scope == "model" and cfg2.moe_aux_coef == pytest.approx(cfg.moe_aux_coef)
    assert cfg2.moe_capacity_factor is None
    # Qwen2-MoE has q/k/v biases (exported as zeros): they come back as model.qkv_bias
    expected = {**vars(cfg), "moe_aux_scope": "model", "moe_aux_coef": cfg2.moe_aux_coef, "moe_capacity_factor": None,
                "moe_renormalize": cfg2.moe_renormalize, "qkv_bias": architecture == "Qwen2MoeForCausalLM"}
    assert vars(cfg2) == expected
    assert cfg2.moe_renormalize == model.layers[0].ffn.renormalize
    fresh = build_model(cfg2).eval()
    fresh.load_state_dict(from_hf_state_dict(theirs.state_dict(), cfg2))
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    torch.testing.assert_close(_logits(fresh, ids), _logits(model, ids), rtol=0, atol=0)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(moe_top_k=2, moe_capacity_factor=1.0), "can drop assignments"),
        (dict(moe_top_k=2, moe_capacity_factor=1.999), "can drop assignments"),
        (dict(moe_top_k=2, norm_position="post"), "default Llama architecture"),
        (dict(moe_top_k=2, use_rope=False), "default Llama architecture"),
    ],
)
def test_inexpressible_models_refused(options, match, tmp_path):
    model, cfg = _model(**options)
    with pytest.raises(UserError, match=match) as info:
        check_exportable(cfg)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=match):
        export_hf(model, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _exported_config(**options):
    return hf_config(ModelConfig(**{**TINY, "moe_top_k": 2, **options}))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(mlp_only_layers=[1]), "dense layers"),
        (dict(decoder_sparse_step=2), "dense layers"),
        (dict(use_sliding_window=True, sliding_window=8), "sliding-window"),
        (dict(shared_expert_intermediate_size=60), "not a multiple"),
        (dict(hidden_act="gelu"), "silu"),
        (dict(num_experts_per_tok=5), "moe_top_k"),
    ],
)
def test_qwen_configs_scratchlm_cannot_express_are_refused(changes, match):
    config = {**_exported_config(moe_renormalize=False, moe_shared_experts=1), **changes}
    with pytest.raises(UserError, match=match):
        model_config_from_hf(config)


def test_mixtral_sliding_window_is_refused_unless_it_covers_the_context():
    config = _exported_config()
    assert model_config_from_hf({**config, "sliding_window": 32}).moe_top_k == 2
    with pytest.raises(UserError, match="sliding-window"):
        model_config_from_hf({**config, "sliding_window": 16})


def test_import_refuses_weights_scratchlm_cannot_express():
    model, cfg = _model(moe_top_k=2, moe_renormalize=False, moe_shared_experts=1)
    state = to_hf_state_dict(model.state_dict(), cfg)
    gated = {**state, "model.layers.1.mlp.shared_expert_gate.weight": torch.full((1, cfg.d_model), 0.1)}
    with pytest.raises(UserError, match="shared_expert_gate is not zero"):
        from_hf_state_dict(gated, cfg)
    biased = {**state, "model.layers.0.self_attn.k_proj.bias": torch.ones(cfg.d_model)}
    with pytest.raises(UserError, match="k_proj.bias is not zero"):
        from_hf_state_dict(biased, cfg)


def test_export_format_follows_the_gating():
    def fmt(**options):
        return hf_moe.export_format(ModelConfig(**{**TINY, **options}))

    assert fmt(moe_top_k=2) == "mixtral"
    assert fmt(moe_top_k=2, moe_renormalize=True) == "mixtral"
    assert fmt(moe_top_k=2, moe_renormalize=False) == "qwen2_moe"
    assert fmt(moe_top_k=2, moe_shared_experts=1) == "qwen2_moe"
    assert fmt(moe_top_k=1) == "qwen2_moe"
    assert fmt(moe_top_k=1, moe_renormalize=True) == "mixtral"
    assert fmt(moe_top_k=3, moe_capacity_factor=4 / 3) == "mixtral"  # capacity >= every token: never drops


def test_hf_training_loss_coefficient_matches_the_model_scope_loss():
    # transformers adds router_aux_loss_coef · (k · scratchlm's model-scope loss).
    model, cfg = _model(moe_top_k=2, moe_aux_scope="model", moe_aux_coef=0.02)
    state = to_hf_state_dict(model.state_dict(), cfg)
    config = transformers.MixtralConfig(**{**hf_config(cfg), "output_router_logits": True})
    mixtral = transformers.MixtralForCausalLM(config).eval()
    mixtral.load_state_dict({k: v for k, v in _fused_mixtral(state, cfg).items()}, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        out = mixtral(input_ids=ids, output_router_logits=True)
        model(ids)
        from scratchlm.model.moe import moe_aux_loss

        ours = moe_aux_loss(model, cfg.moe_aux_coef, 0.0)
    torch.testing.assert_close(config.router_aux_loss_coef * out.aux_loss, ours, rtol=1e-5, atol=1e-7)


def _fused_mixtral(state, cfg):
    out = {}
    for k, v in state.items():
        if ".block_sparse_moe.experts." not in k:
            out[k.replace(".block_sparse_moe.", ".mlp.")] = v
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.block_sparse_moe.experts."
        E = cfg.moe_num_experts
        w1 = torch.stack([state[f"{p}{j}.w1.weight"] for j in range(E)])
        w3 = torch.stack([state[f"{p}{j}.w3.weight"] for j in range(E)])
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([state[f"{p}{j}.w2.weight"] for j in range(E)])
    return out


# ---------------------------------------------------------------- policies


class _Tokenizer:
    """Writes a byte-level BPE tokenizer.json, as the scratchlm Tokenizer directory holds."""

    def __init__(self, vocab_size: int) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(["the cat sat on the mat", "a dog ate the hat"] * 20, trainer)
        self.hf = tok

    def save(self, directory) -> None:
        self.hf.save(f"{directory}/tokenizer.json")


@pytest.mark.parametrize("name", ["mixtral", "qwen-raw-shared"])
def test_hf_policy_samples_through_a_scratchlm_twin(name, tmp_path):
    from scratchlm.align.policy import HFPolicy, load_policy

    model, cfg = _model(seed=2, vocab_size=300, **CASES[name][0])  # room for the 257 byte-level tokens
    export_hf(model, cfg, tmp_path, tokenizer=_Tokenizer(cfg.vocab_size))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        policy = load_policy(tmp_path)
    assert isinstance(policy, HFPolicy)
    twin = policy._engine_twin()
    assert twin is not None
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    torch.testing.assert_close(_logits(twin, ids), _logits(policy.model, ids), rtol=1e-5, atol=1e-5)
    prompts = ["the cat", "a dog ate"]
    engine = [c.text for c in policy.generate(prompts, max_new_tokens=6, temperature=0.0)]
    plain = HFPolicy(policy.model, policy.tokenizer, use_engine=False)
    assert engine == [c.text for c in plain.generate(prompts, max_new_tokens=6, temperature=0.0)]
    if name.startswith("qwen"):
        # A trained shared-expert gate has no scratchlm counterpart: sampling falls back to transformers.
        with torch.no_grad():
            policy.model.model.layers[0].mlp.shared_expert_gate.weight.fill_(1e-3)
        assert policy._engine_twin() is None
        assert len(policy.generate(prompts, max_new_tokens=4, temperature=0.0)) == 2


# ---------------------------------------------------------------- `scratchlm export`


def _cli(args: list[str]) -> int:
    from scratchlm.cli import main

    return main(["export", *args])


def _run_dir(tmp_path, model, cfg):
    from scratchlm.config import config_to_toml
    from scratchlm.train.checkpoint import save_run_checkpoint
    from scratchlm.train.config import TrainConfig

    run = tmp_path / "run"
    save_run_checkpoint(run, 7, model_state=model.state_dict(), optimizer_state=None, state={"step": 7},
                        config_text=config_to_toml(TrainConfig(model=cfg)), keep=1)
    return run


@pytest.mark.parametrize("name", ["mixtral", "qwen-raw"])
def test_export_command_on_an_moe_run_directory(name, tmp_path, capsys):
    options, architecture = CASES[name]
    model, cfg = _model(seed=3, **options)
    run = _run_dir(tmp_path, model, cfg)
    out = tmp_path / "hf"
    assert _cli([str(run), "--to", "hf", str(out)]) == 0
    assert f"as {architecture}" in capsys.readouterr().out
    theirs = _load(out)
    assert type(theirs).__name__ == architecture
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    torch.testing.assert_close(_logits(theirs, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def test_export_command_refuses_a_model_that_drops_assignments(tmp_path, capsys):
    model, cfg = _model(seed=4, moe_top_k=2, moe_capacity_factor=1.25)
    run = _run_dir(tmp_path, model, cfg)
    assert _cli([str(run), "--to", "hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scratchlm export: error: model.moe_capacity_factor=1.25 can drop assignments")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- Qwen2-MoE as published


def test_a_qwen2_moe_with_trained_qkv_biases_and_gqa_imports_with_the_same_logits(tmp_path):
    # Published Qwen2-MoE checkpoints have non-zero q/k/v biases (and grouped-query attention):
    # they become model.qkv_bias, as for a dense Qwen2, and export back to the same weights.
    model, cfg = _model(seed=3, moe_top_k=2, moe_renormalize=False, moe_shared_experts=1, num_kv_heads=2)
    state = to_hf_state_dict(model.state_dict(), cfg)
    qwen = _qwen(cfg, state)
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    config = qwen.config.to_dict()
    cfg2 = model_config_from_hf(config)
    assert (cfg2.qkv_bias, cfg2.num_kv_heads, cfg2.moe_shared_experts) == (True, 2, 1)
    ours = build_model(cfg2).eval()
    ours.load_state_dict(from_hf_state_dict(qwen.state_dict(), cfg2))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(_logits(ours, ids), _logits(qwen, ids), rtol=1e-5, atol=1e-5)
    # the biases matter: without them the logits are far apart
    unbiased = {k: (torch.zeros_like(v) if k.endswith("_proj.bias") else v) for k, v in ours.state_dict().items()}
    plain = build_model(cfg2).eval()
    plain.load_state_dict(unbiased)
    assert (_logits(plain, ids) - _logits(qwen, ids)).abs().max() > 1e-3
    # and back: a Qwen2-MoE directory with the same biases
    export_hf(ours, cfg2, tmp_path)
    theirs = _load(tmp_path)
    assert type(theirs).__name__ == "Qwen2MoeForCausalLM"
    torch.testing.assert_close(_logits(theirs, ids), _logits(qwen, ids), rtol=1e-5, atol=1e-5)


def test_qkv_biases_export_as_qwen2_moe_even_with_mixtral_gating():
    model, cfg = _model(moe_top_k=2, qkv_bias=True)  # renormalised, no shared experts: Mixtral's gating
    assert hf_moe.export_format(cfg) == "qwen2_moe"
    config = hf_config(cfg)
    assert config["norm_topk_prob"] is True and config["qkv_bias"] is True
