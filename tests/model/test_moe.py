"""MoEFFN: grouped dispatch against the naive per-expert loop, capacity, aux losses, errors."""

from __future__ import annotations

import math

import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.model.functional import silu
from scratchlm.model.layers import SwiGLU
from scratchlm.model.moe import MoEFFN, expert_capacity, grouped_mm_supported, moe_aux_loss, moe_reference

D, F = 16, 24


def _make(seed: int = 0, **kwargs) -> MoEFFN:
    torch.manual_seed(seed)
    kwargs.setdefault("num_experts", 4)
    kwargs.setdefault("top_k", 2)
    moe = MoEFFN(D, F, dtype=torch.float64, **kwargs)
    # A sharper router than the default init, so routing is uneven and capacity bites.
    with torch.no_grad():
        moe.router.weight.mul_(4.0)
    return moe


def _grads(module: torch.nn.Module, x: torch.Tensor, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y, aux = fn(x)
    # A loss touching output and both aux losses, with weights that do not cancel.
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype, device=y.device).view_as(y)
    loss = (y * w).sum() + 0.3 * aux["load_balance"] + 0.7 * aux["z_loss"]
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    return y.detach(), grads, x.grad.detach().clone()


def _grouped(moe: MoEFFN):
    def fn(x):
        y = moe(x)
        return y, moe.last_aux

    return fn


def _naive(moe: MoEFFN):
    return lambda x: moe_reference(moe, x)


CASES = [
    dict(),  # dropless top-2
    dict(top_k=1),
    dict(top_k=4),  # every expert
    dict(capacity_factor=0.5),  # many drops
    dict(capacity_factor=1.0),
    dict(capacity_factor=4.0),  # no drops through the padded path
    dict(num_shared_experts=2),
    dict(num_shared_experts=1, capacity_factor=0.75, renormalize=False),
    dict(top_k=3, num_experts=6, capacity_factor=1.25),
]


@pytest.mark.parametrize("kwargs", CASES, ids=[str(c) or "default" for c in CASES])
def test_grouped_matches_naive_forward_and_backward(kwargs):
    moe = _make(**kwargs)
    x = torch.randn(3, 10, D, dtype=torch.float64)
    y1, g1, gx1 = _grads(moe, x, _grouped(moe))
    aux1 = {k: v.detach().clone() for k, v in moe.last_aux.items()}
    y2, g2, gx2 = _grads(moe, x, _naive(moe))
    _, aux2 = moe_reference(moe, x)
    assert y1.shape == x.shape
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx1, gx2, rtol=1e-10, atol=1e-10)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-10, atol=1e-10, msg=name)
    for name in aux1:
        torch.testing.assert_close(aux1[name], aux2[name].detach(), rtol=1e-10, atol=1e-10, msg=name)


def test_capacity_drops_tokens_and_they_contribute_zero():
    moe = _make(capacity_factor=0.5)
    x = torch.randn(40, D, dtype=torch.float64)
    y = moe(x)
    dropped = moe.last_aux["dropped_fraction"].item()
    # Each expert takes at most C assignments, so at least 1 - E·C/(k·N) of them are dropped.
    C = expert_capacity(40, 4, 2, 0.5)
    assert C == 10
    assert dropped >= 1 - 4 * C / 80 - 1e-12 and dropped > 0
    # Tokens whose both choices were dropped give exactly zero (the residual carries them).
    probs = torch.softmax(moe.router(x), dim=-1)
    experts = probs.topk(2, dim=-1).indices
    assignments = experts.t().reshape(-1)  # priority order: first choices, then second
    seen = torch.zeros(4, dtype=torch.long)
    kept = torch.zeros(80, dtype=torch.bool)
    for i, e in enumerate(assignments.tolist()):
        kept[i] = seen[e] < C
        seen[e] += 1
    kept = kept.view(2, 40)
    fully_dropped = ~kept.any(dim=0)
    assert fully_dropped.any(), "the test needs a token with every choice dropped"
    assert torch.all(y[fully_dropped] == 0)
    assert torch.all(y[~fully_dropped].abs().sum(-1) > 0)
    assert (~kept).float().mean().item() == pytest.approx(dropped)


def test_dropless_equals_huge_capacity():
    x = torch.randn(2, 9, D, dtype=torch.float64)
    a = _make(seed=3)
    b = _make(seed=3, capacity_factor=100.0)
    torch.testing.assert_close(a(x), b(x))
    assert a.last_aux["dropped_fraction"].item() == 0.0
    assert b.last_aux["dropped_fraction"].item() == 0.0


def test_single_expert_top1_is_a_swiglu():
    torch.manual_seed(0)
    moe = MoEFFN(D, F, num_experts=1, top_k=1, dtype=torch.float64)
    ref = SwiGLU(D, F, dtype=torch.float64)
    with torch.no_grad():
        ref.w1.weight.copy_(moe.w1[0])
        ref.w3.weight.copy_(moe.w3[0])
        ref.w2.weight.copy_(moe.w2[0])
    x = torch.randn(5, D, dtype=torch.float64)
    torch.testing.assert_close(moe(x), ref(x))
    assert moe.last_aux["load_balance"].item() == pytest.approx(1.0)


def test_shared_experts_add_to_every_token():
    moe = _make(num_shared_experts=2)
    assert moe.shared.w1.weight.shape == (2 * F, D)
    x = torch.randn(6, D, dtype=torch.float64)
    with_shared = moe(x)
    shared = moe.shared
    moe.shared = None
    routed = moe(x)
    moe.shared = shared
    torch.testing.assert_close(with_shared - routed, shared(x))


def test_aux_losses_values():
    moe = _make()
    x = torch.randn(64, D, dtype=torch.float64)
    moe(x)
    aux = moe.last_aux
    logits = moe.router(x)
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, -1).indices
    f = torch.stack([(top == e).sum() for e in range(4)]).double() / top.numel()
    torch.testing.assert_close(aux["expert_fraction"], f)
    torch.testing.assert_close(aux["load_balance"], 4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(aux["z_loss"], (torch.logsumexp(logits, -1) ** 2).mean())
    entropy = -(probs * probs.log()).sum(-1).mean()
    torch.testing.assert_close(aux["router_entropy"], entropy)
    assert 0 < aux["router_entropy"].item() <= math.log(4) + 1e-9
    assert aux["expert_fraction"].sum().item() == pytest.approx(1.0)
    # Uniform router (zero weights): every probability 1/E, so the loss is exactly 1.
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(x)
    assert moe.last_aux["load_balance"].item() == pytest.approx(1.0)
    assert moe.last_aux["z_loss"].item() == pytest.approx(math.log(4) ** 2)


def test_aux_loss_sums_layers_and_trains_router():
    layers = torch.nn.ModuleList([_make(seed=1), _make(seed=2)])
    x = torch.randn(12, D, dtype=torch.float64)
    for layer in layers:
        layer(x)
    expected = sum(0.01 * m.last_aux["load_balance"] + 0.001 * m.last_aux["z_loss"] for m in layers)
    loss = moe_aux_loss(layers, 0.01, 0.001)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert layers[0].router.weight.grad.abs().sum() > 0
    assert moe_aux_loss(torch.nn.Linear(2, 2), 0.01, 0.001) is None


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_experts=4, top_k=5), dict(num_experts=4, top_k=0), dict(num_experts=4, top_k=2, capacity_factor=0.0),
     dict(num_experts=4, top_k=2, capacity_factor=-1.0), dict(num_experts=0, top_k=1)],
)
def test_bad_arguments_raise_user_error(kwargs):
    with pytest.raises(UserError):
        MoEFFN(D, F, **kwargs)


def test_float32_and_parameter_shapes():
    torch.manual_seed(0)
    moe = MoEFFN(D, F, num_experts=3, top_k=2, num_shared_experts=1)
    shapes = {n: tuple(p.shape) for n, p in moe.named_parameters()}
    assert shapes == {
        "router.weight": (3, D), "w1": (3, F, D), "w3": (3, F, D), "w2": (3, D, F),
        "shared.w1.weight": (F, D), "shared.w2.weight": (D, F), "shared.w3.weight": (F, D),
    }
    x = torch.randn(2, 7, D)
    y = moe(x)
    ref, _ = moe_reference(moe, x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_moe_transformer_trains_with_aux_loss():
    import types

    from scratchlm.model.config import ModelConfig
    from scratchlm.model.functional import cross_entropy
    from scratchlm.model.moe import moe_layers, moe_options, moe_record, moe_stats
    from scratchlm.model.transformer import TransformerLM

    shape = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=48)
    moe = dict(moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_shared_experts=1)
    cfg = types.SimpleNamespace(**{**vars(ModelConfig(**shape, ffn="moe")), **moe})
    torch.manual_seed(0)
    model = TransformerLM(**shape, ffn="moe", moe_options=moe_options(cfg))
    assert all(isinstance(layer.ffn, MoEFFN) for layer in model.layers)
    assert model.layers[0].ffn.capacity_factor == 1.0 and model.layers[0].ffn.shared is not None
    x = torch.randint(0, 64, (2, 16))
    logits = model(x)
    stats = moe_stats(moe_layers(model))
    assert stats.shape == (4 + 2 * 4,) and stats.dtype == torch.float32 and not stats.requires_grad
    metrics = moe_record(stats.tolist(), num_experts=4)
    assert set(metrics) == {"moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_router_entropy",
                            "moe_expert_util", "moe_max_expert_util"}
    util = metrics["moe_expert_util"]
    assert len(util) == 2 and all(len(row) == 4 and sum(row) == pytest.approx(1.0) for row in util)
    assert 0.25 <= metrics["moe_max_expert_util"] <= 1.0
    layer0 = model.layers[0].ffn.last_aux
    assert metrics["moe_router_entropy"] == pytest.approx(
        (layer0["router_entropy"] + model.layers[1].ffn.last_aux["router_entropy"]).item() / 2)
    assert util[0] == pytest.approx(layer0["expert_fraction"].tolist())
    aux = moe_aux_loss(model, 0.01, 0.001)
    loss = cross_entropy(logits, torch.roll(x, -1, 1)) + aux
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert moe_layers(torch.nn.Linear(2, 2)) == []


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_cuda_matches_reference_and_runs_under_autocast(capacity_factor):
    torch.manual_seed(0)
    moe = MoEFFN(D, F, 8, 2, capacity_factor=capacity_factor, num_shared_experts=1, device="cuda",
                 dtype=torch.float64)
    x = torch.randn(4, 50, D, device="cuda", dtype=torch.float64)
    y1, g1, gx1 = _grads(moe, x, _grouped(moe))
    y2, g2, gx2 = _grads(moe, x, _naive(moe))
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(gx1, gx2)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], msg=name)
    # Under bf16 autocast the experts' outputs are bf16 while x is fp32.
    moe32 = MoEFFN(D, F, 8, 2, capacity_factor=capacity_factor, device="cuda")
    x32 = torch.randn(4, 50, D, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = moe32(x32)
        ref, _ = moe_reference(moe32, x32)
    y.float().sum().backward()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


GROUPED_CASES = [dict(), dict(top_k=1), dict(capacity_factor=0.5), dict(capacity_factor=1.25, num_shared_experts=1),
                 dict(top_k=3, num_experts=6, capacity_factor=1.0, renormalize=False), dict(num_experts=8, top_k=2)]


def _needs(gemm: str):
    if gemm == "grouped_mm" and not grouped_mm_supported():
        pytest.skip("torch has no _grouped_mm")


# The grouped paths: torch._grouped_mm, and scratchlm's Triton kernels (run under TRITON_INTERPRET=1
# with triton installed, else as the ops' torch formula, which still tests the 128-row layout).
GROUPED_GEMMS = ["grouped_mm", "triton"]


@pytest.mark.parametrize("gemm", GROUPED_GEMMS)
@pytest.mark.parametrize("kwargs", GROUPED_CASES, ids=[str(c) or "default" for c in GROUPED_CASES])
def test_grouped_mm_path_matches_naive_forward_and_backward(kwargs, gemm):
    """The grouped dispatch (fp32 on CPU here; bf16 on CUDA) against the per-expert loop."""
    _needs(gemm)
    torch.manual_seed(0)
    kwargs.setdefault("num_experts", 4)
    kwargs.setdefault("top_k", 2)
    moe = MoEFFN(D, F, gemm=gemm, **kwargs)
    with torch.no_grad():
        moe.router.weight.mul_(4.0)
    x = torch.randn(3, 37, D)  # 111 tokens: blocks of every size, none a multiple of 16
    y1, g1, gx1 = _grads(moe, x, _grouped(moe))
    dropped = moe.last_aux["dropped_fraction"].item()
    y2, g2, gx2 = _grads(moe, x, _naive(moe))
    _, aux2 = moe_reference(moe, x)
    assert (dropped > 0) == (kwargs.get("capacity_factor", 9) < 1.1)
    assert dropped == pytest.approx(aux2["dropped_fraction"].item())
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx1, gx2, rtol=1e-5, atol=1e-5)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("gemm", GROUPED_GEMMS)
def test_grouped_mm_path_under_bf16_autocast_on_cpu(gemm):
    _needs(gemm)
    torch.manual_seed(0)
    moe = MoEFFN(D, F, 4, 2, capacity_factor=1.0, gemm=gemm)
    x = torch.randn(2, 40, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
        ref, _ = moe_reference(moe, x)
    y.float().sum().backward()
    assert moe.w1.grad is not None and moe.w1.grad.dtype == torch.float32
    torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2, atol=3e-2)


def _kept_in_priority_order(assignments: list[int], capacity: int) -> list[bool]:
    """Whether each assignment (in the order given) finds room: a plain running count per expert."""
    seen: dict[int, int] = {}
    kept = []
    for e in assignments:
        kept.append(seen.get(e, 0) < capacity)
        seen[e] = seen.get(e, 0) + 1
    return kept


@pytest.mark.parametrize("gemm", GROUPED_GEMMS)
@pytest.mark.parametrize("top_k,capacity_factor", [(2, 0.5), (1, 0.75), (3, 0.75)])
def test_grouped_mm_routing_under_skew_keeps_assignments_in_priority_order(top_k, capacity_factor, gemm):
    """Every token wants experts 0 and 1 (some 0 first, some 1 first), far beyond their capacity:
    the grouped path must keep exactly the first C assignments of each expert, first choices in
    token order, then second choices."""
    _needs(gemm)
    torch.manual_seed(0)
    E, N = 4, 90
    moe = MoEFFN(D, F, E, top_k, capacity_factor=capacity_factor, gemm=gemm)
    v, u = torch.randn(D), torch.randn(D)
    with torch.no_grad():
        moe.router.weight[0] = 2.0 * v
        moe.router.weight[1] = 2.0 * v + u
    x = torch.randn(N, D) + v
    y = moe(x)

    gates, experts = torch.softmax(x @ moe.router.weight.t(), dim=-1).topk(top_k, dim=-1)
    if moe.renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    C = expert_capacity(N, E, top_k, capacity_factor)
    priority = experts.t().reshape(-1).tolist()  # first choices in token order, then second ones
    assert min(priority.count(0), priority.count(1)) > 1.5 * C, "the test needs experts 0 and 1 to overflow"
    kept = torch.tensor(_kept_in_priority_order(priority, C)).view(top_k, N)
    # The data must tell priority orders apart: later tokens first, or later choices first, keep others.
    by_reversed_tokens = torch.tensor(_kept_in_priority_order(experts.flip(0).t().reshape(-1).tolist(), C))
    by_reversed_choices = torch.tensor(_kept_in_priority_order(experts.flip(1).t().reshape(-1).tolist(), C))
    assert not torch.equal(by_reversed_tokens.view(top_k, N).flip(1), kept)
    if top_k > 1:
        assert not torch.equal(by_reversed_choices.view(top_k, N).flip(0), kept)

    every_expert = torch.stack([(silu(x @ moe.w1[e].t()) * (x @ moe.w3[e].t())) @ moe.w2[e].t()
                                for e in range(E)])  # (E, N, D)
    expected = torch.zeros(N, D)
    for j in range(top_k):
        chosen = every_expert[experts[:, j], torch.arange(N)]  # (N, D)
        expected = expected + torch.where(kept[j, :, None], chosen * gates[:, j, None], torch.zeros(()))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, moe_reference(moe, x)[0], rtol=1e-5, atol=1e-5)
    assert moe.last_aux["dropped_fraction"].item() == pytest.approx((~kept).float().mean().item())
    assert torch.all(y[~kept.any(dim=0)] == 0)


def test_auto_gemm_uses_the_portable_path_on_cpu_and_bad_gemm_is_an_error(monkeypatch):
    moe = MoEFFN(D, F, 4, 2)
    called = []
    monkeypatch.setattr(MoEFFN, "_grouped_experts", lambda *a: called.append(1))
    moe(torch.randn(2, 5, D))
    assert not called
    with pytest.raises(UserError, match="gemm"):
        MoEFFN(D, F, 4, 2, gemm="cutlass")


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_cuda_bf16_autocast_takes_the_grouped_gemm_and_compiles(capacity_factor, monkeypatch):
    torch.manual_seed(0)
    moe = MoEFFN(64, 96, 8, 2, capacity_factor=capacity_factor, device="cuda")
    calls = []
    real = MoEFFN._grouped_experts
    monkeypatch.setattr(MoEFFN, "_grouped_experts", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 200, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = moe(x)
        ref, _ = moe_reference(moe, x)
    assert calls
    torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2, atol=3e-2)
    compiled = torch.compile(moe)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yc = compiled(x)
    yc.float().sum().backward()
    torch.testing.assert_close(yc.float(), y.float(), rtol=3e-2, atol=3e-2)


def test_top1_gate_is_the_router_probability_so_the_router_learns_from_the_output():
    torch.manual_seed(0)
    moe = MoEFFN(D, F, 4, 1)
    assert not moe.renormalize and MoEFFN(D, F, 4, 2).renormalize
    x = torch.randn(2, 9, D)
    moe(x).pow(2).sum().backward()  # the output alone, no auxiliary loss
    learnt = moe.router.weight.grad.abs().sum()
    forced = MoEFFN(D, F, 4, 1, renormalize=True)
    forced.load_state_dict(moe.state_dict())
    forced(x).pow(2).sum().backward()
    # Gate p/p = 1 always: nothing but rounding reaches the router (why it is not the default).
    assert forced.router.weight.grad.abs().sum() < 1e-4 * learnt


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_load_balance_is_transformers_loss_divided_by_k(top_k):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    moe = _make(top_k=top_k)
    x = torch.randn(50, D, dtype=torch.float64)
    moe(x)
    theirs = mixtral.load_balancing_loss_func((moe.router(x).float(),), 4, top_k)
    torch.testing.assert_close(moe.last_aux["load_balance"].float(), theirs / top_k)
    assert moe.last_aux["load_balance"].item() == pytest.approx(theirs.item() / top_k, rel=1e-6)


def test_model_scope_pools_the_layers_as_transformers_does():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from scratchlm.model.moe import model_load_balance

    layers = [_make(seed=s) for s in range(3)]
    x = torch.randn(40, D, dtype=torch.float64)
    for layer in layers:
        layer(x)
    logits = tuple(layer.router(x).float() for layer in layers)
    theirs = mixtral.load_balancing_loss_func(logits, 4, 2) / 2
    torch.testing.assert_close(model_load_balance(layers).float(), theirs)
    z = sum(m.last_aux["z_loss"] for m in layers)
    torch.testing.assert_close(moe_aux_loss(layers, 0.1, 0.01, scope="model").float(), 0.1 * theirs + 0.01 * z.float())
    per_layer = sum(m.last_aux["load_balance"] for m in layers)
    torch.testing.assert_close(moe_aux_loss(layers, 0.1, 0.01, scope="layer"), 0.1 * per_layer + 0.01 * z)
    # Layers that favour different experts balance each other in the pooled form only.
    for layer, favourite in zip(layers[:2], (0, 3)):
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[favourite] = 1.0
    x = torch.ones(8, D, dtype=torch.float64)
    for layer in layers[:2]:
        layer(x)
    assert min(m.last_aux["load_balance"].item() for m in layers[:2]) > 1.5
    assert model_load_balance(layers[:2]).item() < 1.2


def test_aux_scope_is_checked():
    with pytest.raises(UserError, match="aux_scope"):
        MoEFFN(D, F, 4, 2, aux_scope="global")
    layers = [_make(seed=1), _make(seed=2, aux_scope="model")]
    for layer in layers:
        layer(torch.randn(6, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="disagree"):
        moe_aux_loss(layers, 0.01, 0.001)
    assert moe_aux_loss(layers, 0.01, 0.001, scope="layer") is not None
