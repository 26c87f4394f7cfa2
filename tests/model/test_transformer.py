import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.infer.kv_cache import KVCache
from scratchlm.model.config import ModelConfig
from scratchlm.model.functional import cross_entropy
from scratchlm.model.transformer import TransformerBlock, TransformerLM, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = dict(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64, rope_theta=10_000.0)


def _expected_keys(num_layers, *, norms=True, w3=True, lm_head=True):
    keys = ["token_embeddings.weight"]
    for i in range(num_layers):
        p = f"layers.{i}."
        keys += [p + "ln1.weight"] if norms else []
        keys += [p + f"attn.{n}_proj.weight" for n in ("q", "k", "v", "output")]
        keys += [p + "ln2.weight"] if norms else []
        keys += [p + "ffn.w1.weight", p + "ffn.w2.weight"] + ([p + "ffn.w3.weight"] if w3 else [])
    keys += ["ln_final.weight"] if norms else []
    keys += ["lm_head.weight"] if lm_head else []
    return keys


def test_state_dict_keys_exact():
    model = TransformerLM(**TINY)
    assert list(model.state_dict()) == _expected_keys(2)
    sd = model.state_dict()
    assert sd["layers.0.ffn.w1.weight"].shape == (64, 32)
    assert sd["lm_head.weight"].shape == (50, 32)


def test_variant_state_dict_keys():
    assert list(TransformerLM(**TINY, use_rmsnorm=False).state_dict()) == _expected_keys(2, norms=False)
    assert list(TransformerLM(**TINY, ffn="silu").state_dict()) == _expected_keys(2, w3=False)
    assert list(TransformerLM(**TINY, use_rope=False).state_dict()) == _expected_keys(2)
    assert list(TransformerLM(**TINY, norm_position="post").state_dict()) == _expected_keys(2)
    assert list(TransformerLM(**TINY, tie_embeddings=True).state_dict()) == _expected_keys(2, lm_head=False)


def test_tied_embeddings_share_one_parameter_and_load_both_ways():
    model = TransformerLM(**TINY, tie_embeddings=True)
    assert model.lm_head.weight is model.token_embeddings.weight
    n_untied = sum(p.numel() for p in TransformerLM(**TINY).parameters())
    assert sum(p.numel() for p in model.parameters()) == n_untied - 50 * 32
    other = TransformerLM(**TINY, tie_embeddings=True)
    sd = model.state_dict()
    other.load_state_dict(sd)  # only token_embeddings.weight
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    other = TransformerLM(**TINY, tie_embeddings=True)
    other.load_state_dict({**sd, "lm_head.weight": sd["token_embeddings.weight"].clone()})  # both keys
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert other.lm_head.weight is other.token_embeddings.weight
    untied_sd = TransformerLM(**TINY).state_dict()
    with pytest.raises(ValueError, match="ties lm_head"):
        other.load_state_dict(untied_sd)


def test_load_state_dict_roundtrip_gives_same_logits():
    model, other = TransformerLM(**TINY), TransformerLM(**TINY)
    other.load_state_dict(model.state_dict())
    ids = torch.randint(0, 50, (2, 10))
    torch.testing.assert_close(model(ids), other(ids))


def test_shapes_and_any_length():
    model = TransformerLM(**TINY)
    for T in (1, 7, 16):
        assert model(torch.randint(0, 50, (3, T))).shape == (3, T, 50)
    assert model.hidden_states(torch.randint(0, 50, (3, 5))).shape == (3, 5, 32)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.randint(0, 50, (1, 17)))


def test_forward_is_lm_head_of_hidden_states():
    model = TransformerLM(**TINY)
    ids = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(model(ids), model.hidden_states(ids) @ model.lm_head.weight.t())


def test_head_inputs_are_hidden_states_in_the_heads_dtype():
    from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    torch.manual_seed(0)
    model = TransformerLM(**TINY)
    ids, targets = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(model.head_inputs(ids), model.hidden_states(ids), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.head_inputs(ids)
        ref = model.hidden_states(ids)
        assert h.dtype == torch.bfloat16 and ref.dtype == torch.float32
        torch.testing.assert_close(h, ref.to(torch.bfloat16), rtol=0, atol=0)
        # the fused head casts its input to that dtype itself: loss and gradients are the same
        grads = []
        for fn in (model.head_inputs, model.hidden_states):
            model.zero_grad()
            fused_linear_cross_entropy(fn(ids), model.lm_head.weight, targets).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


VARIANTS = [
    {},
    {"norm_position": "post"},
    {"use_rmsnorm": False},
    {"use_rope": False},
    {"ffn": "silu"},
    {"tie_embeddings": True},
    {"attention_backend": "flash_torch"},
    {"num_kv_heads": 2, "qk_norm": True, "qkv_bias": True, "sliding_window": 5},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_variants_are_causal(variant):
    torch.manual_seed(0)
    model = TransformerLM(**TINY, **variant, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_variants_differ_from_default():
    ids = torch.randint(0, 50, (2, 12))
    base = TransformerLM(**TINY)
    sd = base.state_dict()
    ref = base(ids)
    for variant in VARIANTS[1:5]:
        model = TransformerLM(**TINY, **variant)
        model.load_state_dict({k: v for k, v in sd.items() if k in model.state_dict()})
        assert not torch.allclose(model(ids), ref, atol=1e-4), variant
    flash = TransformerLM(**TINY, attention_backend="flash_torch")
    flash.load_state_dict(sd)
    torch.testing.assert_close(flash(ids), ref, rtol=1e-4, atol=1e-4)  # same function, other kernel


def test_nope_last_position_ignores_order_in_one_layer():
    # Without positions, a one-layer model's last output is invariant to permuting the earlier
    # tokens (deeper, the causal mask makes earlier hidden states order-dependent).
    one_layer = {**TINY, "num_layers": 1}
    model = TransformerLM(**one_layer, use_rope=False, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    perm = torch.tensor([[3, 1, 4, 2, 5]])
    torch.testing.assert_close(model(ids)[:, -1], model(perm)[:, -1])
    rope_model = TransformerLM(**one_layer, dtype=torch.float64)
    assert not torch.allclose(rope_model(ids)[:, -1], rope_model(perm)[:, -1])


def test_moe_ffn_variant_builds_and_is_causal():
    pytest.importorskip("scratchlm.model.moe")
    model = build_model(ModelConfig(**TINY, ffn="moe"), dtype=torch.float64)
    assert not any(k.endswith("ffn.w3.weight") and k.startswith("layers.0.ffn.w") for k in model.state_dict())
    ids = torch.randint(0, 50, (2, 10))
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 50
    torch.testing.assert_close(model(ids)[:, :6], model(changed)[:, :6])


def test_moe_hook_raises_user_error_when_absent(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "scratchlm.model.moe", None)  # import now fails
    with pytest.raises(UserError, match="not available"):
        TransformerLM(**TINY, ffn="moe")


def test_dtype_and_device_kwargs():
    model = TransformerLM(**TINY, device="cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.layers[0].attn.rope.cos.dtype == torch.float32  # RoPE tables stay fp32
    out = model(torch.randint(0, 50, (2, 5)))
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
    assert model.layers[0].attn.rope is model.layers[1].attn.rope  # one table for all blocks


def test_build_model_from_config():
    cfg = ModelConfig(**TINY, ffn="silu", tie_embeddings=True, rmsnorm_eps=1e-6)
    model = build_model(cfg, dtype=torch.float64)
    assert isinstance(model, TransformerLM)
    assert model.lm_head.weight is model.token_embeddings.weight
    assert model.layers[0].ln1.eps == 1e-6
    assert model.lm_head.weight.dtype == torch.float64


def test_block_builds_its_own_rope():
    block = TransformerBlock(32, 4, 64, 16, 10_000.0)
    assert block.attn.rope is not None and block.attn.rope.max_seq_len == 16
    assert sorted(block.state_dict()) == sorted(
        ["ln1.weight", "ln2.weight", "ffn.w1.weight", "ffn.w2.weight", "ffn.w3.weight"]
        + [f"attn.{n}_proj.weight" for n in ("q", "k", "v", "output")]
    )
    x = torch.randn(2, 8, 32)
    assert block(x).shape == x.shape


def test_kv_cache_decoding_matches_full_forward():
    model = TransformerLM(**TINY, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 12))
    full = model(ids)
    cache = KVCache.for_model(model, 2, 16)
    steps = [model(ids[:, :5], kv_cache=cache)] + [model(ids[:, t : t + 1], kv_cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full)
    cache = KVCache.for_model(model, 2, 32)
    model(ids, kv_cache=cache)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.randint(0, 50, (2, 5)), kv_cache=cache)


def test_single_batch_overfits():
    torch.manual_seed(0)
    model = TransformerLM(**TINY)
    ids = torch.randint(0, 50, (4, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(100):
        loss = cross_entropy(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.0  # about log(50) at initialisation
    assert loss.item() < 0.05, loss.item()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["math", "flash_torch", "flash_triton"])
def test_backends_and_compile_on_gpu(backend):
    torch.manual_seed(0)
    kw = dict(vocab_size=512, context_length=256, d_model=256, num_layers=2, num_heads=4, d_ff=704)
    ref = TransformerLM(**kw, device="cuda")
    model = TransformerLM(**kw, attention_backend=backend, device="cuda")
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = cross_entropy(ref(ids[:, :-1]), ids[:, 1:])
        loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        compiled = torch.compile(model)
        loss_c = cross_entropy(compiled(ids[:, :-1]), ids[:, 1:])
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss_c, loss, rtol=2e-2, atol=2e-2)
    loss_c.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_initialisation_matches_the_torch_nn_training_peer():
    """Every weight starts with the std the benchmark peer (benchmarks/reference_trainer.py, built
    from torch.nn with a fused qkv Linear) gives it: a different q/k/v scale costs ~0.02-0.04 of
    validation loss (docs/benchmarks/training.md)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "reference_trainer.py"
    spec = importlib.util.spec_from_file_location("reference_trainer_for_test", path)
    ref_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref_mod)
    d, layers = 256, 2
    torch.manual_seed(0)
    ours = build_model(ModelConfig(vocab_size=2000, context_length=16, d_model=d, num_layers=layers, num_heads=8,
                                   d_ff=688))
    ref = ref_mod.ReferenceLM(2000, 16, d, layers, 8, 688, 10_000.0)
    p, q = dict(ours.named_parameters()), dict(ref.named_parameters())
    pairs = [("token_embeddings.weight", q["embed.weight"]), ("lm_head.weight", q["head.weight"])]
    for i in range(layers):
        qkv = q[f"blocks.{i}.qkv.weight"].split(d)
        pairs += [(f"layers.{i}.attn.{n}_proj.weight", w) for n, w in zip("qkv", qkv)]
        pairs += [(f"layers.{i}.attn.output_proj.weight", q[f"blocks.{i}.out.weight"])]
        pairs += [(f"layers.{i}.ffn.{n}.weight", q[f"blocks.{i}.{n}.weight"]) for n in ("w1", "w2", "w3")]
        pairs += [(f"layers.{i}.ln{n}.weight", q[f"blocks.{i}.ln{n}.weight"]) for n in (1, 2)]
    for name, theirs in pairs:
        mine = p[name]
        assert mine.shape == theirs.shape, name
        assert mine.std().item() == pytest.approx(theirs.std().item(), rel=0.05, abs=1e-6), name
        assert mine.abs().max().item() == pytest.approx(theirs.abs().max().item(), rel=0.1), name


def test_qkv_init_is_a_config_switch():
    torch.manual_seed(0)
    fused = build_model(ModelConfig(**TINY))
    torch.manual_seed(0)
    separate = build_model(ModelConfig(**TINY, qkv_init="separate"))
    for name, w in fused.named_parameters():
        scale = 2 ** 0.5 if any(f"attn.{n}_proj" in name for n in "qkv") else 1.0
        torch.testing.assert_close(dict(separate.named_parameters())[name], w * scale, msg=name)
    with pytest.raises(ValueError, match="model.qkv_init"):
        ModelConfig(qkv_init="xavier")


def test_fused_projections_is_a_config_switch_with_the_same_keys_and_maths():
    torch.manual_seed(0)
    fused = build_model(ModelConfig(**TINY))
    separate = build_model(ModelConfig(**TINY, fused_projections=False))
    assert list(separate.state_dict()) == list(fused.state_dict())
    separate.load_state_dict(fused.state_dict())
    assert fused.layers[0].attn.fused_qkv and fused.layers[0].ffn.fused
    assert not separate.layers[0].attn.fused_qkv and not separate.layers[0].ffn.fused
    assert fused.layers[0].attn.packed_backward
    assert not build_model(ModelConfig(**TINY, packed_qkv_backward=False)).layers[-1].attn.packed_backward
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(fused(ids), separate(ids))


@pytest.mark.gpu
@pytest.mark.parametrize("packed_qkv_backward", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_projections_match_separate_ones_on_gpu(compiled, packed_qkv_backward):
    torch.manual_seed(0)
    torch._dynamo.reset()
    kw = dict(vocab_size=512, context_length=256, d_model=256, num_layers=2, num_heads=4, d_ff=704,
              attention_backend="flash_triton", device="cuda")
    separate = TransformerLM(**kw, fused_projections=False)
    fused = TransformerLM(**kw, packed_qkv_backward=packed_qkv_backward)
    fused.load_state_dict(separate.state_dict())
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    losses = []
    for model in (separate, fused):
        run = torch.compile(model) if compiled else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(run(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    for (name, p), q in zip(separate.named_parameters(), fused.parameters()):
        assert ((p.grad - q.grad).norm() / p.grad.norm()).item() < 2e-2, name


# ---------------------------------------------------------------- speedrun recipe switches


def test_relu2_ffn_variant_has_no_w3_and_builds_from_the_config():
    model = build_model(ModelConfig(**{k: v for k, v in TINY.items()}, ffn="relu2"))
    assert list(model.state_dict()) == _expected_keys(2, w3=False)
    x = torch.randint(0, 50, (2, 7))
    assert model(x).shape == (2, 7, 50)
    with pytest.raises(ValueError, match="relu2"):
        ModelConfig(ffn="relu")


def test_logit_softcap_caps_the_logits_of_the_same_weights_and_decoding_sees_it():
    torch.manual_seed(0)
    plain = TransformerLM(**TINY)
    capped = TransformerLM(**TINY, logit_softcap=0.5)
    capped.load_state_dict(plain.state_dict())  # same keys
    x = torch.randint(0, 50, (2, 9))
    torch.testing.assert_close(capped(x), 0.5 * torch.tanh(plain(x) / 0.5))
    assert capped(x).abs().max() <= 0.5
    # the decoding engine applies lm_head to hidden states itself: the cap is in lm_head
    torch.testing.assert_close(capped.lm_head(capped.hidden_states(x)), capped(x))
    assert build_model(ModelConfig(**TINY, logit_softcap=30.0)).lm_head.cap == 30.0
    with pytest.raises(ValueError, match="logit_softcap"):
        ModelConfig(logit_softcap=-1.0)


@pytest.mark.parametrize("ffn, options", [("swiglu", {}), ("relu2", {}), ("moe", {}),
                                          ("moe", {"moe_shared_experts": 1})])
def test_zero_init_output_makes_every_block_the_identity(ffn, options):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY, ffn=ffn, zero_init_output=True, **options))
    for layer in model.layers:
        assert not layer.attn.output_proj.weight.any()
        w2 = layer.ffn.w2
        assert not (w2.weight if isinstance(w2, torch.nn.Module) else w2).any()
        assert layer.attn.q_proj.weight.any() and layer.ffn.w1 is not None
    assert model.lm_head.weight.any()
    x = torch.randint(0, 50, (2, 5))
    # the residual stream is the embeddings: logits = lm_head(ln_final(embeddings))
    torch.testing.assert_close(model(x), model.lm_head(model.ln_final(model.token_embeddings(x))))
    # the next backward still reaches the zeroed matrices
    cross_entropy(model(x), x).backward()
    assert model.layers[0].attn.output_proj.weight.grad.abs().sum() > 0


def test_attention_variants_from_config_keys_and_validation():
    cfg = ModelConfig(**TINY, num_kv_heads=2, qk_norm=True, qkv_bias=True, sliding_window=5, rmsnorm_eps=1e-6)
    model = build_model(cfg)
    attn = model.layers[1].attn
    assert (attn.num_kv_heads, attn.sliding_window, attn.q_norm.eps) == (2, 5, 1e-6)
    keys = set(model.state_dict())
    for name in ("q_norm.weight", "k_norm.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias"):
        assert f"layers.1.attn.{name}" in keys
    assert "layers.0.attn.output_proj.bias" not in keys
    assert not any("norm" in k and ".attn." in k for k in build_model(ModelConfig(**TINY)).state_dict())
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(**TINY, num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(**TINY, sliding_window=0)


@pytest.mark.parametrize("ffn", ["swiglu", "moe"])
def test_low_precision_residual_keeps_the_stream_in_the_autocast_dtype(ffn):
    torch.manual_seed(0)
    default = TransformerLM(**TINY, ffn=ffn)
    low = TransformerLM(**TINY, ffn=ffn, low_precision_residual=True)
    low.load_state_dict(default.state_dict())
    x = torch.randint(0, 50, (2, 9))
    # without autocast nothing changes
    torch.testing.assert_close(low(x), default(x), rtol=0, atol=0)
    seen = []
    for layer in low.layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = low(x)
        want = default(x)
    assert seen == [torch.bfloat16] * len(low.layers)
    assert low.hidden_states(x).dtype == torch.float32  # outside autocast: float32 again
    if ffn != "moe":  # (a rounding can send a token to another expert)
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
    cross_entropy(got.float(), x).backward()
    assert low.token_embeddings.weight.grad.dtype == torch.float32
    assert low.token_embeddings.weight.grad.abs().sum() > 0
