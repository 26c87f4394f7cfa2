"""The decode attention kernel against torch's fused attention over the masked window.

Against a loop over (row, head) in float64. On CPU these run the kernel under TRITON_INTERPRET=1
where triton is installed, else the op's torch path (fused attention over a mask built from
pos); `pytest -m gpu` runs the kernel on CUDA."""

import pytest
import torch

from scratchlm.kernels.decode_attention_triton import decode_attention, decode_attention_reference
from scratchlm.kernels.triton_support import interpreting, triton_available


def _case(b, H, Hkv, max_len, L, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # windows (b, Hkv, L, d) of bigger buffers (slots, Hkv, max_len + 1, d), as the engine passes them
    k_buf = torch.randn(b + 2, Hkv, max_len + 1, d, generator=g).to(device=device, dtype=dtype)
    v_buf = torch.randn(b + 2, Hkv, max_len + 1, d, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(b, 1, H, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)  # (b, H, 1, d), strided
    pos = torch.randint(0, L, (b,), generator=g).to(device)
    pos[0] = L - 1  # one row at the end of the window, one at its start
    if b > 1:
        pos[1] = 0
    return q, k_buf[:b, :, :L], v_buf[:b, :, :L], pos


CASES = [  # (b, H, Hkv, max_len, L, d, window)
    (3, 4, 4, 80, 70, 16, 0),
    (5, 6, 2, 200, 192, 32, 0),  # grouped-query attention, several tiles a row
    (4, 4, 1, 100, 96, 24, 0),  # a head dim that is not a power of two
    (4, 4, 2, 150, 130, 16, 37),  # sliding window
    (1, 2, 1, 200, 200, 16, 9),  # batch 1: split among programs, three of four with no keys in the window
    (32, 4, 2, 40, 33, 16, 0),  # rows x heads enough programs: no split
    (40, 4, 4, 70, 64, 8, 9),
    (33, 4, 4, 600, 520, 8, 0),  # a few hundred programs over long rows: split in four
]


def _loop_reference(q, k, v, pos, window):
    """Each (row, head) on its own, in float64: softmax(q · keys / √d) · values over its keys."""
    b, H, _, d = q.shape
    group = H // k.shape[1]
    out = torch.empty(b, H, 1, d, dtype=torch.float64)
    for r in range(b):
        p = int(pos[r])
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            keys, values = k[r, h // group, lo:p + 1].double(), v[r, h // group, lo:p + 1].double()
            weights = torch.softmax(keys @ q[r, h, 0].double() / d ** 0.5, dim=0)
            out[r, h, 0] = weights @ values
    return out


def _check(device, dtype, atol):
    for b, H, Hkv, max_len, L, d, window in CASES:
        q, k, v, pos = _case(b, H, Hkv, max_len, L, d, dtype, device)
        got = decode_attention(q, k, v, pos, window)
        expected = _loop_reference(q.cpu(), k.cpu(), v.cpu(), pos.cpu(), window).to(device)
        assert got.shape == (b, H, 1, d) and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol, msg=str((b, H, Hkv, L, d, window)))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_equals_the_masked_window_attention(dtype, atol):
    _check("cpu", dtype, atol)


def test_runs_the_kernel_where_it_can():
    # under the interpreter the kernel itself ran above; say so rather than pass silently
    if not (triton_available() and interpreting()):
        pytest.skip("the kernel runs on CUDA or under TRITON_INTERPRET=1 with triton installed")
    from scratchlm.kernels import decode_attention_triton as mod

    q, k, v, pos = _case(2, 4, 2, 40, 33, 16, torch.float32, "cpu")
    assert mod._can_use_triton(k)
    torch.testing.assert_close(mod._decode_attention_impl(q, k, v, pos, 0),
                               decode_attention_reference(q, k, v, pos), rtol=0, atol=2e-5)


def test_bad_shapes_are_refused():
    q, k, v, pos = _case(2, 4, 2, 40, 33, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="Hkv dividing H"):
        decode_attention(q, k[:, :1].expand(2, 3, 33, 16), v[:, :1].expand(2, 3, 33, 16), pos)
    with pytest.raises(ValueError, match="pos must be"):
        decode_attention(q, k, v, pos[:1])


@pytest.mark.gpu
def test_decode_attention_on_cuda():
    _check("cuda", torch.bfloat16, 2e-2)
    _check("cuda", torch.float32, 1e-4)


def test_keys_are_split_only_where_programs_are_few():
    from scratchlm.kernels import decode_attention_triton as mod

    assert mod.splits_for(64, 12) == 1  # 768 programs
    assert mod.splits_for(1, 12) == mod.SPLITS_WHEN_FEW > 1
    assert mod.splits_for(10, 12) > 1 and mod.splits_for(11, 12) == 1
    # a few hundred programs: split only where rows may be long (by the window, when it is shorter)
    assert mod.splits_for(8, 32, 1024) == mod.SPLITS_WHEN_LONG > 1
    assert mod.splits_for(8, 32, 256) == 1 and mod.splits_for(16, 32, 1024) == 1


def test_one_rows_splits_follow_its_keys_where_asked():
    """`by_keys` (the opaque fused op's launches, with concrete sizes): one split a KEYS_A_SPLIT
    keys at one row, up to SPLITS_WHEN_FEW; several rows, or a traced launch, keep the fixed count."""
    if not triton_available():
        pytest.skip("the count is rounded with triton's helpers")
    from scratchlm.kernels import decode_attention_triton as mod

    assert mod.KEYS_A_SPLIT == 64 and mod.SPLITS_WHEN_FEW == 8
    counts = {keys: mod.splits_for(1, 12, keys, by_keys=True) for keys in (33, 64, 65, 192, 320, 1024)}
    assert counts == {33: 1, 64: 1, 65: 2, 192: 4, 320: 8, 1024: 8}
    assert mod.splits_for(4, 12, 64, by_keys=True) == mod.splits_for(1, 12, 64) == 8
