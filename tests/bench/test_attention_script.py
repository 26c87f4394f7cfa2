"""benchmarks/attention.py's `--atomic-dq` helpers leave the backward's dQ mode as they found it."""

import pytest
import torch

from scratchlm.kernels import flash_attention_triton as fa
from tests.bench.test_scripts import load


def test_atomic_dq_timing_helpers_restore_the_mode():
    script = load("attention")
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 2, 16, 8)
    assert fa.backward_dq() == "recompute"
    # on the CPU the op takes the torch path, so the two backwards agree exactly
    assert script._atomic_dq_error(q, k, v, g, True) < 1e-6
    assert fa.backward_dq() == "recompute"
    with fa.using_backward_dq("atomic"):
        script._atomic_dq_error(q, k, v, g, False)
        assert fa.backward_dq() == "atomic"


def test_atomic_dq_is_a_documented_option():
    args = load("attention").build_parser().parse_args(["--modes", "forward_backward", "--atomic-dq"])
    assert args.atomic_dq and args.modes == ["forward_backward"]


def test_tuned_configs_reads_what_each_autotuner_chose(monkeypatch):
    if not hasattr(fa, "_dq_tuned"):  # no Triton: no tuners, nothing chosen
        assert load("attention").tuned_configs() == {}
        return

    class Chosen:  # a triton.Config's fields that the script reads
        kwargs = {"BLOCK_M": 64, "BLOCK_N": 32}
        num_warps, num_stages = 4, 3

    monkeypatch.setattr(fa._dq_tuned, "cache", {(1024, 64, True, False, "torch.bfloat16"): Chosen()})
    monkeypatch.setattr(fa._fwd_tuned, "cache", {})
    chosen = load("attention").tuned_configs()
    assert chosen["dq_tuned 1024,64,True,False"] == [64, 32, 4, 3]
    assert not any(k.startswith("fwd_tuned ") for k in chosen)


def test_cuda_graphs_is_a_documented_option():
    args = load("attention").build_parser().parse_args(["--seqs", "1024", "--cuda-graphs"])
    assert args.cuda_graphs and not load("attention").build_parser().parse_args([]).cuda_graphs


@pytest.mark.gpu
def test_graphed_step_replays_the_same_gradients():
    script = load("attention")
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    grads = []

    def step():
        out = script.IMPLS["scratchlm_triton"](q, k, v, True)
        grads[:] = torch.autograd.grad(out, (q, k, v), g)

    step()
    want = [t.clone() for t in grads]
    replay = script.graph_replay(step)
    for t in grads:
        t.zero_()
    replay()
    torch.cuda.synchronize()
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)
    assert script._time(script.IMPLS["scratchlm_triton"], "forward_backward", q, k, v, g, True, graphs=True) > 0
