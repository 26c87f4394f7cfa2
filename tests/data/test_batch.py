"""Batches: get_batch, open_tokens, the resumable rank-aware sampler and evaluation windows."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from scratchlm.data.batch import BatchSampler, get_batch, iterate_eval_batches, open_tokens
from scratchlm.errors import UserError


def write_tokens(path, tokens, dtype="uint16", sidecar=True):
    arr = np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<"))
    arr.tofile(path)
    if sidecar:
        path.with_suffix(".json").write_text(json.dumps({"dtype": dtype, "num_tokens": int(arr.size)}))
    return arr


def test_get_batch_shapes_shift_and_uniform_starts():
    tokens = np.arange(100)
    context_length, batch_size = 7, 32
    np.random.seed(0)
    starts = Counter()
    for _ in range(200):
        x, y = get_batch(tokens, batch_size, context_length, "cpu")
        assert x.shape == y.shape == (batch_size, context_length)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(y, x + 1)  # tokens[i] == i, so the shifted window is x + 1
        assert torch.equal(x, x[:, :1] + torch.arange(context_length))
        starts.update(x[:, 0].tolist())
    # every valid start (0 .. 100 - 7 - 1) appears, none beyond, counts near uniform
    assert sorted(starts) == list(range(len(tokens) - context_length))
    expected = 200 * batch_size / (len(tokens) - context_length)
    assert max(abs(c - expected) for c in starts.values()) < 5 * expected ** 0.5


def test_get_batch_is_repeatable_with_a_seed_or_generator():
    tokens = np.arange(1000)
    np.random.seed(3)
    a = get_batch(tokens, 4, 16, "cpu")
    np.random.seed(3)
    b = get_batch(tokens, 4, 16, "cpu")
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    c = get_batch(tokens, 4, 16, "cpu", rng=np.random.default_rng(1))
    d = get_batch(tokens, 4, 16, "cpu", rng=np.random.default_rng(1))
    assert all(torch.equal(u, v) for u, v in zip(c, d))


def test_get_batch_on_memmap_of_uint16(tmp_path):
    arr = write_tokens(tmp_path / "t.bin", np.arange(60_000) % 65_536)
    tokens = open_tokens(tmp_path / "t.bin")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype("<u2")
    x, y = get_batch(tokens, 8, 128, "cpu")
    for row_x, row_y in zip(x, y):
        start = int(row_x[0])
        np.testing.assert_array_equal(row_x.numpy(), arr[start:start + 128])
        np.testing.assert_array_equal(row_y.numpy(), arr[start + 1:start + 129])


def test_unavailable_device_raises_torchs_error():
    tokens = np.arange(100)
    try:
        torch.zeros(1).to("cuda:99")
    except (RuntimeError, AssertionError) as exc:
        expected = type(exc)
    else:  # pragma: no cover - a machine with 100 GPUs
        pytest.skip("cuda:99 exists here")
    with pytest.raises(expected):
        get_batch(tokens, 2, 4, "cuda:99")
    with pytest.raises(RuntimeError):  # a device string torch cannot parse
        get_batch(tokens, 2, 4, "not-a-device")


def test_get_batch_rejects_too_short_tokens():
    with pytest.raises(UserError, match="too few"):
        get_batch(np.arange(8), 2, 8, "cpu")
    get_batch(np.arange(9), 2, 8, "cpu")  # exactly one window fits


def test_open_tokens_reads_sidecar_dtype_and_falls_back_to_uint16(tmp_path):
    big = write_tokens(tmp_path / "big.bin", [1, 70_000, 3], dtype="uint32")
    np.testing.assert_array_equal(open_tokens(tmp_path / "big.bin"), big)
    write_tokens(tmp_path / "plain.bin", [5, 6, 7, 8], sidecar=False)
    plain = open_tokens(tmp_path / "plain.bin")
    assert plain.dtype == np.dtype("<u2")
    np.testing.assert_array_equal(plain, [5, 6, 7, 8])


def test_open_tokens_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        open_tokens(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(UserError, match="not a multiple of 2"):
        open_tokens(tmp_path / "odd.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(UserError, match="empty"):
        open_tokens(tmp_path / "empty.bin")
    write_tokens(tmp_path / "short.bin", [1, 2, 3, 4])
    with pytest.raises(UserError, match="too few"):
        open_tokens(tmp_path / "short.bin", context_length=4)
    assert len(open_tokens(tmp_path / "short.bin", context_length=3)) == 4
    write_tokens(tmp_path / "cut.bin", [1, 2, 3, 4])
    (tmp_path / "cut.json").write_text(json.dumps({"dtype": "uint16", "num_tokens": 10}))
    with pytest.raises(UserError, match="incomplete"):
        open_tokens(tmp_path / "cut.bin")
    (tmp_path / "cut.json").write_text(json.dumps({"dtype": "float32"}))
    with pytest.raises(UserError, match="dtype"):
        open_tokens(tmp_path / "cut.bin")


def test_sampler_resume_continues_the_same_stream():
    tokens = np.arange(10_000)
    straight = BatchSampler(tokens, 8, 32, seed=7)
    expected = [straight.next_batch("cpu") for _ in range(6)]

    first = BatchSampler(tokens, 8, 32, seed=7)
    got = [first.next_batch("cpu") for _ in range(3)]
    state = first.state_dict()
    assert state["step"] == 3
    json.dumps(state)  # plain values
    resumed = BatchSampler(tokens, 8, 32, seed=12345)  # the state, not the seed, decides
    resumed.load_state_dict(state)
    got += [resumed.next_batch("cpu") for _ in range(3)]
    for (ex, ey), (gx, gy) in zip(expected, got):
        assert torch.equal(gx, ex)
        assert torch.equal(gy, ey)
    assert resumed.step == 6
    other = BatchSampler(tokens, 8, 32, seed=8).next_batch("cpu")
    assert not torch.equal(other[0], expected[0][0])


def test_sampler_state_must_match_the_run():
    tokens = np.arange(1000)
    state = BatchSampler(tokens, 8, 32, seed=0).state_dict()
    with pytest.raises(UserError, match="batch_size"):
        BatchSampler(tokens, 4, 32, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="num_tokens"):
        BatchSampler(np.arange(999), 8, 32, seed=0).load_state_dict(state)
    with pytest.raises(UserError, match="not one this sampler wrote"):
        BatchSampler(tokens, 8, 32, seed=0).load_state_dict({"step": 1})


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_split_the_global_batch_exactly(world_size):
    tokens = np.arange(50_000)
    single = BatchSampler(tokens, 8, 16, seed=1)
    ranks = [BatchSampler(tokens, 8, 16, seed=1, rank=r, world_size=world_size) for r in range(world_size)]
    for _ in range(5):
        x, y = single.next_batch("cpu")
        parts = [s.next_batch("cpu") for s in ranks]
        assert all(px.shape == (8 // world_size, 16) for px, _ in parts)
        assert torch.equal(torch.cat([px for px, _ in parts]), x)
        assert torch.equal(torch.cat([py for _, py in parts]), y)
    # a run resumed on another number of ranks continues the same global stream
    state = ranks[0].state_dict()
    x, _ = single.next_batch("cpu")
    regrouped = BatchSampler(tokens, 8, 16, seed=99, rank=1, world_size=2)
    regrouped.load_state_dict(state)
    assert torch.equal(regrouped.next_batch("cpu")[0], x[4:])


def test_sampler_rejects_uneven_split_and_bad_rank():
    with pytest.raises(UserError, match="divisible"):
        BatchSampler(np.arange(100), 6, 4, seed=0, world_size=4)
    with pytest.raises(UserError, match="rank"):
        BatchSampler(np.arange(100), 8, 4, seed=0, rank=4, world_size=4)


def test_eval_batches_are_sequential_non_overlapping_and_cover_everything():
    tokens = np.arange(103)
    batches = list(iterate_eval_batches(tokens, 4, 10, None))
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert [len(x) for x, _ in batches] == [4, 4, 2]  # (103 - 1) // 10 = 10 windows
    assert torch.equal(xs.flatten(), torch.arange(100))
    assert torch.equal(ys.flatten(), torch.arange(1, 101))
    assert len(list(iterate_eval_batches(tokens, 4, 10, 2))) == 2
    again = list(iterate_eval_batches(tokens, 4, 10, 2))
    assert torch.equal(again[1][0], batches[1][0])
    # exactly divisible: the last window's target is the last token
    last_x, last_y = list(iterate_eval_batches(np.arange(21), 2, 10, None))[-1]
    assert last_y[-1, -1].item() == 20
