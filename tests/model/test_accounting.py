"""Accounting: hand-checked GPT-2-XL figures, and params/FLOPs/activations against built models."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scratchlm.model.accounting import (
    account,
    activation_bytes_per_sequence,
    count_params,
    forward_flops,
    max_batch_size,
    optimizer_state_bytes,
    param_count,
    train_memory_bytes,
)
from scratchlm.model.config import ModelConfig
from scratchlm.model.functional import cross_entropy
from scratchlm.model.moe import moe_options
from scratchlm.model.transformer import TransformerLM, build_model

GPT2_XL = dict(vocab_size=50257, context_length=1024, d_model=1600, num_layers=48, num_heads=25, d_ff=6400)
SMALL = dict(vocab_size=256, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=128)
VARIANTS = [
    dict(),
    dict(tie_embeddings=True),
    dict(ffn="silu"),
    dict(use_rmsnorm=False),
    dict(norm_position="post"),
    dict(use_rope=False),
    dict(ffn="silu", use_rmsnorm=False, tie_embeddings=True),
    dict(ffn="relu2"),
    dict(ffn="relu2", tie_embeddings=True, logit_softcap=15.0, zero_init_output=True),
    dict(ffn="moe"),  # through build_model, with whatever moe_* fields ModelConfig has
    dict(num_kv_heads=2),
    dict(num_kv_heads=1, qk_norm=True, qkv_bias=True),
    dict(sliding_window=16, qk_norm=True),
]
MOE_VARIANTS = [
    dict(moe_num_experts=4, moe_top_k=2),
    dict(moe_num_experts=4, moe_top_k=1, moe_shared_experts=1),
]


def _moe_cfg(**moe) -> types.SimpleNamespace:
    """A ModelConfig with ffn="moe" plus moe_* fields (ModelConfig itself may not carry them)."""
    return types.SimpleNamespace(**{**vars(ModelConfig(**SMALL, ffn="moe")), **moe})


def _build_moe(cfg) -> TransformerLM:
    return TransformerLM(**SMALL, ffn="moe", moe_options=moe_options(cfg))


def test_gpt2_xl_params_by_hand():
    # embedding 50257·1600 = 80,411,200 (and the same again for the untied lm_head);
    # per layer: attention 4·1600² = 10,240,000, SwiGLU 3·1600·6400 = 30,720,000, two norms
    # 3,200 -> 40,963,200; 48 layers -> 1,966,233,600; final norm 1,600.
    cfg = ModelConfig(**GPT2_XL)
    p = count_params(cfg)
    assert p["embedding"] == 80_411_200
    assert p["lm_head"] == 80_411_200
    assert p["attention"] == 491_520_000
    assert p["ffn"] == 1_474_560_000
    assert p["norm"] == 155_200
    assert p["total"] == 2_127_057_600 == param_count(cfg)
    assert p["active"] == p["total"]
    assert p["non_embedding"] == 2_127_057_600 - 80_411_200
    assert param_count(ModelConfig(**GPT2_XL, tie_embeddings=True)) == 2_127_057_600 - 80_411_200


def test_gpt2_xl_forward_flops_by_hand():
    # T = 1024. Per layer: q,k,v,o 4 · 2·T·D² = 20,971,520,000; QKᵀ and PV 2 · 2·T²·D =
    # 6,710,886,400 (full T×T); SwiGLU 3 · 2·T·D·F = 62,914,560,000. lm_head 2·T·D·V.
    cfg = ModelConfig(**GPT2_XL)
    f = forward_flops(cfg)
    assert f["qkvo"] == 48 * 20_971_520_000 == 1_006_632_960_000
    assert f["attention"] == 48 * 6_710_886_400 == 322_122_547_200
    assert f["ffn"] == 48 * 62_914_560_000 == 3_019_898_880_000
    assert f["lm_head"] == 164_682_137_600
    assert f["total"] == 4_513_336_524_800  # ≈ 4.51 TFLOPs per 1024-token sequence
    # Half the context: the linear terms halve, the attention term quarters.
    half = forward_flops(cfg, seq_len=512)
    assert half["qkvo"] * 2 == f["qkvo"] and half["attention"] * 4 == f["attention"]


def test_gpt2_xl_memory_by_hand():
    cfg = ModelConfig(**GPT2_XL)
    mem = train_memory_bytes(cfg)
    assert mem["static"] == 16 * 2_127_057_600 == 34_032_921_600
    # Elements: norms 97 · 3·T·D = 476,774,400; attention 48 · (4·T·D + 3·H·T²) =
    # 4,089,446,400; SwiGLU 48 · 5·T·F = 1,572,864,000; loss 2·T·V = 102,926,336.
    assert mem["activations_per_sequence"] == 4 * 6_242_011_136
    assert max_batch_size(cfg, 80 * 2**30) == (80 * 2**30 - 34_032_921_600) // (4 * 6_242_011_136)


OPTIMIZER_VARIANTS = [
    dict(),
    dict(tie_embeddings=True, ffn="relu2"),
    dict(num_kv_heads=2, qk_norm=True, qkv_bias=True, use_rmsnorm=False),
    dict(ffn="moe", moe_num_experts=4, moe_top_k=2, moe_shared_experts=1),
]


@pytest.mark.parametrize("name", ["adamw", "muon"])
@pytest.mark.parametrize("kwargs", OPTIMIZER_VARIANTS, ids=[str(v) or "default" for v in OPTIMIZER_VARIANTS])
def test_optimizer_state_matches_a_step_of_the_optimizer(name, kwargs):
    from scratchlm.optim import build_optimizer
    from scratchlm.optim.config import OptimConfig

    cfg = ModelConfig(**SMALL, **kwargs)
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, OptimConfig(name=name, foreach=False, fused=False))
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    assert optimizer_state_bytes(cfg, name) == state
    weights_and_grads = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert train_memory_bytes(cfg, name)["static"] == weights_and_grads + state
    assert account(cfg, name)["train_memory_bytes"]["static"] == weights_and_grads + state


def test_muon_needs_less_static_memory_than_adamw():
    # Muon's matrices keep one momentum buffer instead of two moments: 12 bytes each, not 16.
    from scratchlm.model.accounting import muon_param_count

    cfg = ModelConfig(**GPT2_XL)
    adamw, muon = train_memory_bytes(cfg)["static"], train_memory_bytes(cfg, "muon")["static"]
    assert adamw - muon == 4 * muon_param_count(cfg) == 4 * (491_520_000 + 1_474_560_000)
    assert max_batch_size(cfg, 80 * 2**30, "muon") >= max_batch_size(cfg, 80 * 2**30)
    with pytest.raises(ValueError, match="optimizer"):
        optimizer_state_bytes(cfg, "sgd")


@pytest.mark.parametrize("kwargs", VARIANTS, ids=[str(v) or "default" for v in VARIANTS])
def test_params_and_flops_match_built_model(kwargs):
    cfg = ModelConfig(**SMALL, **kwargs)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (1, cfg.context_length)))
    assert forward_flops(cfg)["total"] == counter.get_total_flops()


@pytest.mark.parametrize("moe", MOE_VARIANTS, ids=str)
def test_moe_params_and_flops_match_built_model(moe):
    cfg = _moe_cfg(**moe)
    torch.manual_seed(0)
    model = _build_moe(cfg)
    p = count_params(cfg)
    assert p["total"] == sum(q.numel() for q in model.parameters())
    E, k, S = moe["moe_num_experts"], moe["moe_top_k"], moe.get("moe_shared_experts", 0)
    D, F, L = SMALL["d_model"], SMALL["d_ff"], SMALL["num_layers"]
    assert p["total"] - p["active"] == L * (E - k) * 3 * D * F
    # Dropless routing computes exactly k experts per token: FLOPs match the counter.
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, SMALL["vocab_size"], (1, SMALL["context_length"])))
    flops = forward_flops(cfg)
    assert flops["total"] == counter.get_total_flops()
    T = SMALL["context_length"]
    assert flops["ffn"] == L * (2 * T * D * E + (k + S) * 6 * T * D * F)


def _saved_activation_bytes(model: torch.nn.Module, T: int, V: int) -> int:
    """Bytes of distinct float storages autograd saves for one forward + loss (params excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.dtype.is_floating_point and ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, V, (1, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(model(x), torch.roll(x, -1, 1))
    return sum(seen.values())


ACTIVATION_VARIANTS = [dict(), dict(ffn="silu"), dict(use_rmsnorm=False), dict(attention_backend="flash_torch"),
                       dict(ffn="relu2"), dict(logit_softcap=15.0),
                       dict(num_kv_heads=2), dict(num_kv_heads=1, qk_norm=True),
                       dict(num_kv_heads=2, attention_backend="flash_torch")]


@pytest.mark.parametrize("kwargs", ACTIVATION_VARIANTS, ids=[str(v) or "default" for v in ACTIVATION_VARIANTS])
def test_activation_bytes_match_saved_tensors(kwargs):
    cfg = ModelConfig(**SMALL, **kwargs)
    torch.manual_seed(0)
    measured = _saved_activation_bytes(build_model(cfg), cfg.context_length, cfg.vocab_size)
    expected = activation_bytes_per_sequence(cfg)["total"]
    # The formula leaves out O(T·H) row statistics and the RoPE rows: a few percent here.
    assert expected <= measured <= 1.05 * expected


@pytest.mark.parametrize("moe", [*MOE_VARIANTS, dict(moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.5)],
                         ids=str)
def test_moe_activation_bytes_match_saved_tensors(moe):
    cfg = _moe_cfg(**moe)
    torch.manual_seed(0)
    measured = _saved_activation_bytes(_build_moe(cfg), SMALL["context_length"], SMALL["vocab_size"])
    expected = activation_bytes_per_sequence(cfg)["total"]
    assert expected <= measured <= 1.05 * expected


def test_report_keys_and_consistency():
    cfg = ModelConfig(**SMALL)
    report = account(cfg)
    assert {"params", "forward_flops", "forward_flops_breakdown", "train_memory_bytes"} <= set(report)
    assert set(report["forward_flops_breakdown"]) == {"qkvo", "attention", "ffn", "lm_head"}
    assert set(report["train_memory_bytes"]) == {"static", "activations_per_sequence"}
    assert sum(report["forward_flops_breakdown"].values()) == report["forward_flops"]
    assert report["train_flops_per_sequence"] == 3 * report["forward_flops"]


def test_matmul_and_attention_flops_by_hand():
    from scratchlm.model.accounting import attention_flops, matmul_flops

    assert matmul_flops(3, 5, 7) == 2 * 3 * 5 * 7
    full = 4 * 2 * 3 * 128 * 128 * 64  # q·kᵀ and p·v over (B=2, H=3, T=128, d=64)
    assert attention_flops(2, 3, 128, 64) == full
    assert attention_flops(2, 3, 128, 64, True) == full // 2
    assert attention_flops(2, 3, 128, 64, True, "backward") == 2.5 * full // 2
    assert attention_flops(2, 3, 128, 64, False, "forward_backward") == 3.5 * full
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 1, 8, 8, mode="sideways")


@pytest.mark.parametrize("tie", [False, True])
def test_model_flops_per_token_of_a_built_model_by_hand(tie):
    from scratchlm.model.accounting import model_flops_per_token

    cfg = ModelConfig(vocab_size=100, d_model=8, num_layers=1, num_heads=2, d_ff=16, tie_embeddings=tie)
    model = build_model(cfg)
    # q, k, v, o (4·8·8) + SwiGLU (3·8·16) + the LM head (100·8), which the tied embedding shares
    matrices = 4 * 64 + 3 * 8 * 16 + 100 * 8
    assert model_flops_per_token(model, 4) == 2 * matrices + 2 * 1 * 4 * 8  # + causal attention 2·L·T·D


def test_ffn_flops_by_hand():
    from scratchlm.model.accounting import ffn_flops

    D, F, T = 8, 16, 5
    assert ffn_flops("swiglu", D, F, T) == 3 * 2 * T * D * F
    assert ffn_flops("silu", D, F, T) == 2 * 2 * T * D * F
    assert ffn_flops("relu2", D, F, T) == 2 * 2 * T * D * F  # w1 and w2, no w3
    # router (D -> 4) plus two routed and one shared SwiGLU expert per token
    assert ffn_flops("moe", D, F, T, num_experts=4, top_k=2, shared=1) == 2 * T * D * 4 + 3 * (3 * 2 * T * D * F)
    with pytest.raises(ValueError, match="unknown ffn"):
        ffn_flops("relu", D, F)


def test_gqa_params_by_hand():
    cfg = ModelConfig(**{**SMALL, "num_kv_heads": 1, "qk_norm": True, "qkv_bias": True})
    D, L, hd = 64, 2, 16
    # q and output D·D, k and v D·16, biases D + 2·16, two norms of head_dim
    assert count_params(cfg)["attention"] == L * (2 * D * D + 2 * D * hd + D + 2 * hd + 2 * hd)
    assert forward_flops(cfg)["qkvo"] == L * 2 * 64 * D * (2 * D + 2 * hd)


def test_kv_cache_bytes_match_the_static_cache():
    from scratchlm.infer.static_cache import PrefillView, StaticKVCache
    from scratchlm.model.accounting import kv_cache_bytes

    cfg = ModelConfig(**{**SMALL, "num_kv_heads": 2})
    model = build_model(cfg).eval()
    cache = StaticKVCache.for_model(model, slots=3, max_len=40, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():  # a prefill allocates every layer's buffers
        model(torch.randint(0, cfg.vocab_size, (1, 5)), None, PrefillView(cache, torch.tensor([0]), 5))
    held = sum(b.numel() * b.element_size() for bufs in (cache.k, cache.v) for b in bufs)
    assert held == kv_cache_bytes(cfg, seq_len=40 + 1, batch_size=3)  # the static cache keeps one spare position
    assert kv_cache_bytes(cfg) * 2 == kv_cache_bytes(ModelConfig(**SMALL))  # 2 of 4 heads: half
    assert account(cfg)["kv_cache_bytes_per_sequence"] == kv_cache_bytes(cfg)


def test_model_flops_per_token_counts_only_the_window():
    from scratchlm.model.accounting import model_flops_per_token

    cfg = ModelConfig(vocab_size=100, d_model=8, num_layers=1, num_heads=2, d_ff=16, num_kv_heads=1,
                      sliding_window=2)
    model = build_model(cfg)
    matrices = 2 * 64 + 2 * 8 * 4 + 3 * 8 * 16 + 100 * 8  # q, o; k, v of one head of 4; SwiGLU; head
    # T = 4, W = 2: the queries see 1, 2, 2, 2 keys, 7 of the causal 10; causal is 2·T·D per token
    assert model_flops_per_token(model, 4) == pytest.approx(2 * matrices + 2 * 4 * 8 * 7 / 10)
    assert model_flops_per_token(model, 2) == 2 * matrices + 2 * 2 * 8  # the window covers it all
