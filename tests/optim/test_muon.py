"""Muon: Newton-Schulz against the SVD, one step against a hand-written reference, the AdamW
groups against AdamW, and training, checkpoints and refusals through the trainer."""

from __future__ import annotations

import io
import math
from dataclasses import replace

import pytest
import torch

from scratchlm.optim.adamw import AdamW
from scratchlm.optim.muon import Muon, muon_param_groups, newton_schulz


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (32, 48), (256, 96), (300, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_values_near_one(shape, dtype):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
    o = newton_schulz(g, dtype=dtype)
    assert o.dtype == g.dtype and o.shape == g.shape
    P, S, Qh = torch.linalg.svd(g, full_matrices=False)
    # In g's singular basis the output is diagonal: the same singular vectors, new values.
    d = P.mT @ o @ Qh.mT
    values = torch.diagonal(d)
    off = d - torch.diag(values)
    assert off.abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)
    assert 0.5 <= values.min() and values.max() <= 1.5, (values.min(), values.max())
    assert torch.linalg.svdvals(o).min() >= 0.5 and torch.linalg.svdvals(o).max() <= 1.5


def test_newton_schulz_on_square_matrices_and_stacks():
    g = torch.randn(3, 128, 128, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g)
    s = torch.linalg.svdvals(o.float())
    # a random square matrix has a few tiny singular values that five steps do not lift; the bulk is near 1
    assert ((s >= 0.5) & (s <= 1.5)).float().mean() > 0.9
    assert torch.allclose(o[1], newton_schulz(g[1]))  # a stack is each matrix on its own


def _reference_ns(u, dtype=torch.float32):
    """Five quintic Newton-Schulz steps, each product and sum on its own, in `dtype`."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.to(dtype)
    x = x.T if u.shape[0] > u.shape[1] else x
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        A = x @ x.T
        x = a * x + (b * A + c * (A @ A)) @ x
    return (x.T if u.shape[0] > u.shape[1] else x).to(u.dtype)


def _reference_muon(w, grads, lr, momentum, wd, *, nesterov=True, buf=None):
    """Muon by hand, float32, one matrix: momentum (Nesterov or plain), five quintic Newton-Schulz
    steps, RMS scale, decoupled decay. A None gradient skips the step. Returns (w, buffer)."""
    w = w.clone()
    for g in grads:
        if g is None:
            continue
        buf = g.clone() if buf is None else momentum * buf + g
        u = g + momentum * buf if nesterov else buf
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(w.shape)) * _reference_ns(u)
    return w, buf


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_steps_equal_the_hand_written_reference(shape):
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected, _ = _reference_muon(w0, grads, lr=0.05, momentum=0.9, wd=0.1)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-5)
    # the update's RMS is what the scale promises: 0.2 per unit of lr
    q = torch.nn.Parameter(w0.clone())
    step = Muon([q], lr=1.0, momentum=0.0)
    q.grad = grads[0].clone()
    step.step()
    assert (q.detach() - w0).pow(2).mean().sqrt() == pytest.approx(0.2, rel=0.15)


def test_matrices_of_one_shape_are_stepped_together_each_as_on_its_own():
    """Same-shaped matrices are orthogonalised as one stack; each still gets its own reference step."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(24, 40), (40, 24), (24, 40), (24, 40)]
    w0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for _ in range(3)] for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    for step in range(3):
        for p, g in zip(params, grads):
            p.grad = g[step].clone()
        params[3].grad = None if step == 1 else params[3].grad  # a matrix without a gradient is skipped
        opt.step()
    for i, (p, w, g) in enumerate(zip(params, w0, grads)):
        g = [g[0], g[2]] if i == 3 else g
        torch.testing.assert_close(p.detach(), _reference_muon(w, g, lr=0.05, momentum=0.9, wd=0.1)[0],
                                   rtol=1e-5, atol=1e-5)


# Shapes of a block in miniature: square attention matrices, FFN w1/w3 (tall) and w2 (wide), plus
# a shape of its own. Gradients: None skips a matrix at that step; matrix 5 starts late, 6 never.
MIXED = [(24, 40), (40, 24), (24, 40), (32, 32), (40, 24), (16, 48), (32, 32)]
NO_GRAD = {(2, 1), (5, 0), (5, 1), (6, 0), (6, 1), (6, 2), (6, 3), (6, 4), (6, 5)}  # (matrix, step)


def _mixed_problem(steps, seed=3):
    gen = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=gen) for s in MIXED]
    grads = [[None if (i, t) in NO_GRAD else torch.randn(s, generator=gen) for t in range(steps)]
             for i, s in enumerate(MIXED)]
    return w0, grads


def _run(opt, params, grads, steps):
    for t in steps:
        for p, g in zip(params, grads):
            p.grad = None if g[t] is None else g[t].clone()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_mixed_shapes_and_transposes_step_as_each_matrix_on_its_own(nesterov, wd):
    """Transposed shapes share a stack, matrices without a gradient sit a step out: every matrix
    and its momentum still follow the per-matrix reference, and the state holds a buffer for
    exactly the matrices that had a gradient."""
    w0, grads = _mixed_problem(5)
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = Muon(params, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=wd, ns_dtype=torch.float32)
    _run(opt, params, grads, range(5))
    for p, w, g in zip(params, w0, grads):
        expected, buf = _reference_muon(w, g, lr=0.05, momentum=0.9, wd=wd, nesterov=nesterov)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-5)
        if buf is None:
            assert p not in opt.state and torch.equal(p.detach(), w)
        else:
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, rtol=1e-6, atol=1e-6)
    saved = opt.state_dict()["state"]
    assert sorted(saved) == [0, 1, 2, 3, 4, 5]
    assert all(saved[i]["momentum_buffer"].shape == MIXED[i] for i in saved)


def test_a_matrix_and_its_transpose_share_one_newton_schulz_stack(monkeypatch):
    from scratchlm.optim import muon

    stacks = []
    real = muon.orthogonalise_stack

    def recorded(x, *args, **kwargs):
        stacks.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(muon, "orthogonalise_stack", recorded)
    w0, grads = _mixed_problem(3)
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = Muon(params, lr=0.05)
    _run(opt, params, grads, range(3))
    # (24, 40) and (40, 24) in one stack; matrix 2 sits step 1 out, 5 starts at step 2, 6 never does
    assert stacks == [(4, 24, 40), (1, 32, 32), (3, 24, 40), (1, 32, 32), (4, 24, 40), (1, 32, 32), (1, 16, 48)]


def test_state_dicts_save_load_and_resume_exactly():
    w0, grads = _mixed_problem(6)
    straight = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = Muon(straight, lr=0.05, momentum=0.9, weight_decay=0.1)
    _run(opt, straight, grads, range(3))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in straight]
    _run(opt, straight, grads, range(3, 6))

    saved.seek(0)
    again = Muon(resumed, lr=0.05, momentum=0.9, weight_decay=0.1)
    again.load_state_dict(torch.load(saved))
    _run(again, resumed, grads, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert all(torch.equal(opt.state[a]["momentum_buffer"], again.state[b]["momentum_buffer"])
               for a, b in zip(straight, resumed) if a in opt.state)


def test_a_state_dict_of_separate_per_matrix_buffers_loads_and_resumes():
    """A checkpoint whose buffers are one independent tensor per matrix (the layout every Muon
    state dict has had) carries on as the reference does."""
    w0, grads = _mixed_problem(6)
    reference = [_reference_muon(w, g[:3], lr=0.05, momentum=0.9, wd=0.1) for w, g in zip(w0, grads)]
    params = [torch.nn.Parameter(w.clone()) for w, _ in reference]
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    state_dict = opt.state_dict()
    state_dict["state"] = {i: {"momentum_buffer": buf.clone()} for i, (_, buf) in enumerate(reference)
                           if buf is not None}
    opt.load_state_dict(state_dict)
    _run(opt, params, grads, range(3, 6))
    for p, (w, buf), g in zip(params, reference, grads):
        expected, _ = _reference_muon(w, g[3:], lr=0.05, momentum=0.9, wd=0.1, buf=buf)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-5)


def test_parameters_added_later_are_stepped_too():
    gen = torch.Generator().manual_seed(4)
    a = torch.nn.Parameter(torch.randn(24, 40, generator=gen))
    b = torch.nn.Parameter(torch.randn(40, 24, generator=gen))
    a0, b0 = a.detach().clone(), b.detach().clone()
    ga, gb = torch.randn(24, 40, generator=gen), torch.randn(40, 24, generator=gen)
    opt = Muon([a], lr=0.05, ns_dtype=torch.float32)
    a.grad = ga.clone()
    opt.step()
    opt.add_param_group({"params": [b]})
    a.grad, b.grad = ga.clone(), gb.clone()
    opt.step()
    torch.testing.assert_close(a.detach(), _reference_muon(a0, [ga, ga], lr=0.05, momentum=0.95, wd=0.0)[0],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.detach(), _reference_muon(b0, [gb], lr=0.05, momentum=0.95, wd=0.0)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96), (4, 96, 256)])
def test_bfloat16_newton_schulz_is_as_close_to_the_exact_iteration_as_one_op_at_a_time(shape):
    """The products with their scaled sums fused (`baddbmm`) round less than the iteration
    written one op at a time: in bfloat16, no farther from the float64 iteration than that is."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(shape, generator=gen) * torch.logspace(-2, 0, shape[-1])  # singular values over 100x
    flat = g.reshape(-1, *shape[-2:])
    exact = torch.stack([_reference_ns(m, torch.float64) for m in flat])
    one_op = torch.stack([_reference_ns(m, torch.bfloat16) for m in flat])
    fused = newton_schulz(g).reshape(flat.shape)

    def error(o):
        return ((o - exact).norm() / exact.norm()).item()

    assert error(fused) <= error(one_op) < 0.05
    torch.testing.assert_close(newton_schulz(g, dtype=torch.float32).reshape(flat.shape),
                               torch.stack([_reference_ns(m) for m in flat]), rtol=1e-5, atol=1e-5)


def test_non_muon_groups_are_adamw_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    a = [torch.nn.Parameter(p.clone()) for p in params]
    b = [torch.nn.Parameter(p.clone()) for p in params]
    ref = AdamW([{"params": a[:1], "weight_decay": 0.1}, {"params": a[1:], "weight_decay": 0.0}],
                lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    muon = Muon([{"params": b[:1], "weight_decay": 0.1, "muon": False},
                 {"params": b[1:], "weight_decay": 0.0, "muon": False}], lr=1e-2, betas=(0.9, 0.95))
    for gs in grads:
        for x, y, g in zip(a, b, gs):
            x.grad, y.grad = g.clone(), g.clone()
        ref.step()
        muon.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_param_groups_put_only_the_blocks_matrices_under_muon():
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import build_model

    model = build_model(ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=2, num_heads=2, d_ff=24))
    groups = muon_param_groups(model, 0.1, lr=1e-3, muon_lr=2e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in groups[0]["params"])
    assert groups[0]["muon"] and groups[0]["lr"] == 2e-3 and groups[0]["lr_scale"] == pytest.approx(2.0)
    assert muon == sorted(n for n in names.values() if n.startswith("layers.") and n.endswith("_proj.weight")
                          or ".ffn.w" in n)
    rest = {names[id(p)] for g in groups[1:] for p in g["params"]}
    assert {"token_embeddings.weight", "lm_head.weight", "ln_final.weight", "layers.0.ln1.weight"} <= rest
    assert len(muon) + len(rest) == len(names)
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(3))])


# ---------------------------------------------------------------- through the trainer


def _muon_cfg(tmp_path, **optim):
    from tests.train.small_runs import make_cfg

    cfg = make_cfg(tmp_path)
    return replace(cfg, optim=replace(cfg.optim, name="muon", **optim))


def test_a_tiny_model_learns_with_muon_on_cpu(tmp_path):
    from scratchlm.cli.train import run_training
    from tests.train.small_runs import losses

    cfg = _muon_cfg(tmp_path, muon_lr=2e-2)
    run_training(cfg)
    evals = losses(tmp_path / "run", "eval", "val_loss")
    assert evals[-1][1] < evals[0][1] - 0.5
    assert all(math.isfinite(loss) for _, loss in losses(tmp_path / "run"))


def test_an_interrupted_muon_run_resumes_exactly(tmp_path, monkeypatch):
    from scratchlm.cli.train import run_training
    from scratchlm.train import checkpoint as ckpt
    from tests.train.small_runs import crash_at_step_7_then_resume, losses

    cfg = _muon_cfg(tmp_path)
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_training(replace(cfg, trainer=replace(cfg.trainer, out_dir=str(straight))))
    state = ckpt.read_torch(ckpt.latest_step_dir(straight) / ckpt.OPTIMIZER)
    kinds = {frozenset(s) for s in state["state"].values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}
    crash_at_step_7_then_resume(cfg, broken, monkeypatch)
    assert losses(broken) == losses(straight)  # bitwise: momentum and moments came back
    a, b = (ckpt.load_weights(ckpt.latest_step_dir(r) / ckpt.WEIGHTS) for r in (straight, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_muon_is_refused_under_a_sharded_strategy(tmp_path):
    from scratchlm.cli.train import run_training
    from scratchlm.errors import UserError

    cfg = _muon_cfg(tmp_path)
    cfg = replace(cfg, parallel=replace(cfg.parallel, strategy="zero1", backend="gloo"))
    with pytest.raises(UserError, match="optim.name='muon'.*zero1"):
        run_training(cfg)



@pytest.mark.parametrize("first, then", [("adamw", "muon"), ("muon", "adamw")])
def test_resuming_with_the_other_optimizer_is_refused_in_one_line(tmp_path, first, then):
    # AdamW's moments cannot become Muon's momentum (nor the other way round): the optimizer
    # state of the checkpoint would not load, so the resume names the setting instead.
    from scratchlm.cli.train import run_training
    from scratchlm.errors import UserError

    cfg = _muon_cfg(tmp_path)
    cfg = replace(cfg, trainer=replace(cfg.trainer, max_steps=2, checkpoint_interval=2, eval_interval=0))
    run_training(replace(cfg, optim=replace(cfg.optim, name=first)))
    resumed = replace(cfg, optim=replace(cfg.optim, name=then), trainer=replace(cfg.trainer, max_steps=4))
    with pytest.raises(UserError, match=f"optim.name.*'{first}'.*'{then}'") as err:
        run_training(resumed, resume=True)
    assert "\n" not in str(err.value)
