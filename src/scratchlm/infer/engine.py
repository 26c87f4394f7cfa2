"""The decoding engine: a static KV cache, a captured decode step, batched rollouts.

Why it looks like this. Decoding a small model one token at a time is bound by the host: each
step launches hundreds of small kernels, and Python issuing them costs far more than the GPU
running them. So the per-token work is made replayable:

- The KV cache is static (`static_cache.StaticKVCache`): fixed buffers, each row's length a
  device tensor, so a step's shapes depend only on (b, L): the number of slots stepped and the
  number of cache slots attention reads. L grows in steps of `len_bucket`, b is a power of
  two (or the whole batch), so few distinct steps exist.
- On CUDA each (b, L) step is captured once in a CUDA graph and replayed (optionally after
  `torch.compile`, which fuses the elementwise work of the layers into few kernels). A greedy
  step's graph also takes the argmax and records the token; a sampled step draws on the GPU
  just after the replay (`sampling.sample_next` never synchronises). Greedy steps are captured
  up to `GREEDY_STEPS_PER_REPLAY` to a graph where the window and the next finished-row check
  allow: one replay, one gap on the host, for several steps. On the CPU the same step runs
  eagerly.
- Each layer's q|k|v and SwiGLU w1|w3 projections run as one matmul each, through stacked
  copies of their weights refreshed at every run (`stacked.StackedProjections`): at small batch
  a step is bound by how many kernels it launches.
- Where the vocabulary size is not a multiple of 64, the LM head multiplies by a copy of its
  weight padded with zero rows to one (`padded_head.PaddedHead`, refreshed like the stacked
  copies): an odd row stride of the logits sends cuBLAS to a slow unaligned GEMM at batch > 1.
- Finished rows are found on the host only every `check_every` steps (one sync). Then the
  finished rows' tokens are read back, their slots are refilled with waiting prompts (prefill
  of just those rows), and once no prompt waits, the live rows are compacted into the first
  slots so that the step shrinks to the next smaller batch size.

Prefill runs the model's ordinary forward over right-padded prompts (causal attention only),
writing each row's keys/values to slots 0 .. len - 1 of its slot (the padding's go to the slots
after, masked until decoding overwrites them). Row results do not depend on which other rows
share the batch, except for the random stream when sampling. With `compile` on CUDA the prefill
forward is compiled too (dynamic in the number of rows and the width), its width rounded up to a
multiple of `PREFILL_BUCKET`: a small model's eager prefill is all host overhead (some 26 ms a
call for an 11M-parameter, 6-layer model on an H100, a third of a batch of short rollouts).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch._inductor.config
from torch import Tensor, nn

from scratchlm.infer.padded_head import PaddedHead
from scratchlm.infer.sampling import chunked_argmax, sample_next
from scratchlm.infer.stacked import StackedProjections
from scratchlm.infer.static_cache import DecodeView, PrefillView, StaticKVCache
from scratchlm.kernels.decode_linear_triton import MAX_ROWS
from scratchlm.kernels.triton_support import can_use_triton, pdl_supported


# torch.compile modes a DecodeEngine may use: none captures CUDA graphs of its own (the engine
# captures its steps itself). "max-autotune-no-cudagraphs" benchmarks Triton templates against
# cuBLAS for each matmul shape (with their epilogues fused) at compile time: a longer start.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")

# `DecodeEngine(fused_blocks=...)`: off, on, on for the projections only (RoPE, the cache write
# and attention left to torch), or "auto" (`fused_blocks_default`)
FUSED_BLOCKS = (False, True, "projections", "auto")

# The compiled prefill pads its prompts to a multiple of this many tokens: never a width of 1,
# which torch.compile would specialise on, for little padding.
PREFILL_BUCKET = 16

# Greedy decode steps captured in one CUDA graph (`DecodeEngine.steps_per_replay`)
GREEDY_STEPS_PER_REPLAY = 8

# The most (rows, width) shapes of prefill an engine captures in CUDA graphs (`prefill_graphs`):
# rollouts repeat a few shapes; prompts of many lengths would otherwise capture graph after graph.
PREFILL_GRAPHS_KEPT = 8


def batch_buckets(slots: int) -> list[int]:
    """The step sizes a batch of `slots` rows shrinks through: powers of two below it, then it.

    Example: batch_buckets(6) -> [1, 2, 4, 6].
    """
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def _lm_logits(model: nn.Module, ids: Tensor, positions: Tensor, view, last: Tensor | None,
               head: PaddedHead | None = None) -> Tensor:
    """Logits (n, V) at index `last` (n,) of each row (the final index when None); through
    `head` (the padded copy of lm_head, a strided (n, V) view) when given."""
    if hasattr(model, "hidden_states") and hasattr(model, "lm_head"):
        h = model.hidden_states(ids, positions, view)  # (n, T, d_model)
        h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
        return model.lm_head(h) if head is None else head(h)
    logits = model(ids, positions, view)  # (n, T, V)
    return logits[:, -1] if last is None else logits[torch.arange(logits.shape[0], device=logits.device), last]


def _recompile_limits(at_least: int) -> dict[str, int]:
    """torch._dynamo's recompile limits (per code object, and accumulated), raised to `at_least`.
    The keys are `recompile_limit` in torch >= 2.7, `cache_size_limit` before."""
    config = torch._dynamo.config
    names = (("recompile_limit", "accumulated_recompile_limit") if hasattr(config, "recompile_limit")
             else ("cache_size_limit", "accumulated_cache_size_limit"))
    return {name: max(getattr(config, name), at_least) for name in names}


def _warn_prefilling_eagerly(what: str, exc: Exception, stacklevel: int) -> None:
    """The one-line warning of a faster prefill path (`what`) that failed and is dropped for the
    eager one; `stacklevel` as the caller would pass it to `warnings.warn`."""
    why = " ".join(str(exc).split())[:300]
    warnings.warn(f"{what} failed ({type(exc).__name__}: {why}); prefilling eagerly", RuntimeWarning,
                  stacklevel=stacklevel + 1)


@contextlib.contextmanager
def _uncached_autocast(device_type: str):
    """The caller's autocast, if any, with its cache of cast weights off: for warming up and
    capturing a CUDA graph. A cast weight that the cache serves inside a capture is read by the
    graph at the cached copy's address, which never sees the weight's later updates and which the
    cache frees when the caller's autocast region ends (torch versions that cache under
    inference mode, and every version under no_grad); uncached, the graph casts the weights as
    they are at every replay."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield


def fused_blocks_default(param: Tensor, slots: int, compile: bool, cuda_graphs: bool) -> bool:
    """`DecodeEngine(fused_blocks="auto")`: on for a compiled engine with CUDA graphs of at most
    MAX_ROWS slots whose weights Triton can run on, where they were measured to pay (one and four
    rows of GPT-2-small on an H100, docs/benchmarks/generate.md)."""
    return compile and cuda_graphs and slots <= MAX_ROWS and can_use_triton(param)


def default_decode_attention(model: nn.Module, device: torch.device) -> str:
    """The decode attention an engine uses unless told: "triton" on CUDA for a model whose query
    heads each have their own key/value head, "sdpa" otherwise.

    Measured on an H100 (docs/benchmarks/decode_attention.md), the Triton kernel is 1.1-2.3x
    torch's fused attention for multi-head attention wherever rows hold different numbers of
    keys (rollouts) and at batch 1-8, and 0.90-0.99x where a large batch of full rows reads the
    whole window. With grouped-query attention it lost from batch 8 on, when each query head
    read its kv head's keys again; the grouped kernel that reads them once per kv head is not
    measured yet, so grouped models keep torch's fused attention.
    """
    from scratchlm.kernels.triton_support import triton_available

    attn = model.layers[0].attn
    grouped = getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads
    return "triton" if device.type == "cuda" and triton_available() and not grouped else "sdpa"


class DecodeEngine:
    """Batched generation over `slots` rows with a static cache of `max_len` positions per row.

    One engine can serve many `run` calls with the same slot count and maximum length; its
    captured steps are kept. `compile` wraps the step's forward and the prefill's in
    `torch.compile` (CUDA only), in `compile_mode` (None: torch's default; `COMPILE_MODES`) and
    with `inductor_options` (``torch._inductor.config`` settings in effect while they compile, e.g.
    {"decompose_mem_bound_mm": True, "coordinate_descent_tuning": True});
    `cuda_graphs` (default: on CUDA) captures steps in CUDA graphs. `decode_attention`: "sdpa"
    (torch's fused attention over the step's window, masked), "triton" (a kernel that reads
    each row's keys up to its own position: `scratchlm.kernels.decode_attention_triton`) or
    "auto" (the default: `default_decode_attention`). `prefill_graphs` (default, with CUDA graphs
    and without compile) replays each prefill forward from a CUDA graph captured for its number
    of rows (padded to a power of two) and its width (padded to a multiple of PREFILL_BUCKET):
    rollouts prefill batches of the same shapes step after step, and the eager forward's kernel
    launches cost more host time than its kernels take on the GPU.
    `stack_projections` (default) keeps each layer's q|k|v and w1|w3 weights as one matrix each,
    refreshed from the model at every `run` (`scratchlm.infer.stacked`): fewer, larger matmuls a
    step, for a copy of those weights in memory (in the autocast dtype under autocast), made only
    where it takes at most a quarter of the GPU memory free when the engine is built.
    `pad_lm_head` (default) does the same for the LM head where the vocabulary size is not a
    multiple of 64: a copy of its weight with zero rows up to one (`scratchlm.infer.padded_head`),
    for aligned logits rows; it counts against the same quarter with the stacked copies.
    `fused_blocks` runs decode steps of at most 8 rows through `scratchlm.infer.fused_block`:
    each pre-norm block's norms, SwiGLU gate and residual adds inside its four matmul kernels
    (with the stacked copies, where Triton runs; off by default until measured on a GPU), RoPE
    and the cache write inside the q|k|v kernel, and (with the Triton decode attention) the
    attention's split combine inside the output projection's; `fused_blocks="projections"`
    leaves RoPE, the cache write and attention to torch (to Inductor when compiled), for
    comparison. The default, "auto", turns them on where they were measured to pay
    (`fused_blocks_default`): a compiled engine of at most 8 slots with CUDA graphs, where Triton
    runs (GPT-2-small on an H100: 1.23x the compiled step's tokens/s at one row, 1.15x at four;
    docs/benchmarks/generate.md). An engine of more slots (rollouts) leaves them off: it
    steps at most 8 rows only in the tails of its runs, where fused steps would be compiled for
    little time. `pdl` launches those kernels with programmatic dependent launch
    (`scratchlm.kernels.triton_support.pdl_supported`, Hopper on) in one-row steps: each starts
    while the one before it finishes and loads its weights meanwhile (1.07x the compiled fused
    step at one row). With CUDA graphs it needs `compile` (eager steps launched with PDL did not
    capture); "auto" (the default) is on where the fused blocks are, with compile and CUDA graphs,
    and the device supports it.
    """

    def __init__(self, model: nn.Module, slots: int, max_len: int, *, compile: bool = False,
                 cuda_graphs: bool | None = None, len_bucket: int = 256, check_every: int = 16,
                 stack_projections: bool = True, pad_lm_head: bool = True,
                 compile_mode: str | None = None, inductor_options: dict | None = None,
                 decode_attention: str = "auto", prefill_graphs: bool = True, fused_blocks: bool | str = "auto",
                 pdl: bool | str = "auto") -> None:
        if compile_mode is not None and compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)} or None, got {compile_mode!r}")
        if decode_attention not in ("sdpa", "triton", "auto"):
            raise ValueError(f"decode_attention must be 'sdpa', 'triton' or 'auto', got {decode_attention!r}")
        if fused_blocks not in FUSED_BLOCKS:
            raise ValueError(f"fused_blocks must be True, False, 'projections' or 'auto', got {fused_blocks!r}")
        if pdl not in (False, True, "auto"):
            raise ValueError(f"pdl must be True, False or 'auto', got {pdl!r}")
        self.compile_mode = compile_mode
        self.inductor_options = dict(inductor_options or {})
        unknown = sorted(set(self.inductor_options) - set(torch._inductor.config.get_config_copy()))
        if unknown:
            raise ValueError(f"unknown inductor option(s) {', '.join(unknown)}")
        self.model = model
        self.device = next(model.parameters()).device
        self.slots = slots
        self.max_len = max_len
        self.len_bucket = len_bucket
        self.check_every = check_every
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda if cuda_graphs is None else (cuda_graphs and cuda)
        self.cache = StaticKVCache.for_model(model, slots, max_len, device=self.device)
        if decode_attention == "auto":
            decode_attention = default_decode_attention(model, self.device)
        self.cache.decode_attention = decode_attention
        param = next(model.parameters())
        if fused_blocks == "auto":
            fused_blocks = fused_blocks_default(param, slots, compile, self.cuda_graphs)
        self.cache.fused_blocks = fused_blocks
        if pdl == "auto":
            pdl = bool(fused_blocks) and compile and self.cuda_graphs and pdl_supported(param)
        if pdl and not (fused_blocks and pdl_supported(param)):
            raise ValueError("pdl=True needs fused_blocks and a CUDA device of compute capability 9 or more "
                             "with a Triton that has tl.extra.cuda.gdc_wait")
        if pdl and self.cuda_graphs and not compile:
            raise ValueError("pdl=True with CUDA graphs needs compile=True: eager steps launched with PDL failed to "
                             "capture on an H100 (torch 2.11, Triton 3.6)")
        self.cache.pdl = pdl
        if stack_projections:  # q|k|v and w1|w3 as one matmul each (a copy of those weights)
            projections = StackedProjections.for_model(model)
            self.cache.projections = projections if len(projections) and projections.fits(self.device) else None
        # the LM head through a copy padded to HEAD_ROW_MULTIPLE rows, where V is not a multiple
        self.head = PaddedHead.for_model(model) if pad_lm_head else None
        if self.head is not None:
            stacked = self.cache.projections.nbytes() if self.cache.projections is not None else 0
            self.head = self.head if self.head.fits(self.device, reserved=stacked) else None
        self._forward = self._decode_eager  # the step's (logits, argmax or None)
        self._advance = self._record  # the bookkeeping after a step
        self._prefill_forward = self._prefill_logits
        self._prefill_compiled_ran = False  # whether the compiled prefill has run once (`_prefill_call`)
        self.prefill_bucket = 1  # prefill widths are rounded up to a multiple of this
        # the widest prefill: within the cache and the model's positions
        self._prefill_cap = min(max_len, getattr(model, "context_length", max_len))
        # Uncompiled prefills replayed from CUDA graphs, one per (rows, width) bucket (`_prefill_replayed`)
        self.prefill_graphs = prefill_graphs and self.cuda_graphs and not (compile and cuda)
        self._pad_prefill_rows = self.prefill_graphs  # chunks padded to a power of two of rows
        if compile and cuda:
            self._forward = self._compiled_step()
            # (entries: b == 1 and b > 1, each of which may come again in and out of inference mode)
            self._advance = self._own_compiled(DecodeEngine._record, 2 * len(batch_buckets(slots)), "inductor")
            self._prefill_forward = self._compiled_prefill()
        if (compile and cuda) or self.prefill_graphs:
            self.prefill_bucket = PREFILL_BUCKET
        self._graphs: dict[tuple[int, int, bool, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        # Greedy steps a replay runs where the window L and the next check allow (`run`): at batch 1
        # a step's GPU time is ~0.4 ms, and the host's ~25 us between two replays is a gap of
        # its own per replay.
        self.steps_per_replay = GREEDY_STEPS_PER_REPLAY if self.cuda_graphs else 1
        self._prefill_graph_cache: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], Tensor]] = {}
        self._pool = None
        dev, S = self.device, slots
        # The state is updated in place by every run: normal tensors even for an engine built
        # under inference mode (see `run`).
        with torch.inference_mode(False):
            self.tokens = torch.zeros(S, dtype=torch.long, device=dev)  # next input token of each slot
            self.lens = torch.zeros(S, dtype=torch.long, device=dev)  # tokens in the cache of each slot
            self.n_out = torch.zeros(S, dtype=torch.long, device=dev)  # tokens generated so far
            self.budget = torch.zeros(S, dtype=torch.long, device=dev)
            self.done = torch.ones(S, dtype=torch.bool, device=dev)
            # Generated tokens; a row never has more than max_len, and the last column takes the
            # writes of finished rows. Fixed tensors, so captured steps stay valid across runs.
            self.out = torch.zeros(S, max_len + 1, dtype=torch.long, device=dev)
            self.stop_ids = torch.full((8,), -1, dtype=torch.long, device=dev)

    # ---- the step -------------------------------------------------------------------------

    def _decode_logits(self, tokens: Tensor, pos: Tensor, L: int) -> Tensor:
        view = DecodeView(self.cache, pos, L)
        return _lm_logits(self.model, tokens[:, None], pos[:, None], view, None, self.head).float()  # (b, V)

    def _positions(self, lens: Tensor) -> Tensor:
        """Where rows of `lens` cached tokens write their next one: finished rows may run past
        their end, so the position is clamped to the cache."""
        return lens.clamp(max=self.max_len - 1)

    def _decode_eager(self, tokens: Tensor, lens: Tensor, L: int) -> tuple[Tensor, None]:
        return self._decode_logits(tokens, self._positions(lens), L), None  # a greedy step takes the argmax itself

    def _decode_next(self, tokens: Tensor, lens: Tensor, L: int) -> tuple[Tensor, Tensor]:
        """The step's logits (b, V) and their argmax (b,) for rows of `lens` cached tokens:
        compiled, the argmax is two fused reductions (`chunked_argmax`) instead of eager kernels
        after the graph's matmuls (unused by a sampled step)."""
        logits = self._decode_logits(tokens, self._positions(lens), L)
        return logits, chunked_argmax(logits)

    def _compiled_step(self, backend="inductor"):
        """`_decode_next` under `torch.compile`, compiled for this engine alone (`_own_compiled`).

        With dynamic shapes one engine needs few entries: one for b == 1 (sizes 0 and 1 are
        always specialised) and one for every other b; the cache buffers are one position longer
        than max_len (`StaticKVCache.buffers`) so that the window of L <= max_len slots never
        covers a whole buffer, whose layout (contiguous or not) would otherwise be a guard of its
        own. The recompile limit is raised to the number of (b, L) buckets the engine can step: a
        bound on what it can ever need, should a torch version specialise on more than the above.
        `backend`: torch.compile's (tests pass a counter).
        """
        buckets = len(batch_buckets(self.slots)) * -(-self.max_len // self.len_bucket)
        return self._own_compiled(DecodeEngine._decode_next, buckets, backend)

    def _own_compiled(self, fn, limit: int, backend):
        """`fn` (a method of the engine) under `torch.compile(dynamic=True)`, bound to this engine
        and compiled for it alone; around its calls the recompile limit is at least `limit`.

        Dynamo keeps its compiled entries on the function's code object and falls back to eager
        (inside our CUDA graphs: the slow uncompiled step) once one code object holds
        `recompile_limit` (8) entries whose guards failed. All engines of a process would share
        the one code object of a method, and an engine whose cache has another shape fails the
        guards of the other engines' entries and adds its own: benchmarks/generate.py, which
        builds five compiled engines, hit the limit in its last. So each engine compiles its own
        copy of the function (same code, its own code object, hence its own entries), and the
        limit is raised, for its calls only, to a bound on the entries this engine can need.

        Duck sizing is off while it compiles: by default sizes of the same value share one symbol,
        so a batch or width that happens to equal a size of the weights (the stacked projections
        are plain tensors, dynamic too) would be specialised to that value by the matmul.
        """
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        own.__qualname__ = fn.__qualname__
        mode = self.compile_mode if backend == "inductor" else None  # (a test's backend takes no mode)
        compiled = torch.compile(types.MethodType(own, self), dynamic=True, backend=backend, mode=mode)
        fx_config = torch.fx.experimental._config
        no_duck = {"use_duck_shape": False} if hasattr(fx_config, "use_duck_shape") else {}

        inductor = self.inductor_options

        def call(*args):
            with (torch._dynamo.config.patch(_recompile_limits(limit)), fx_config.patch(no_duck),
                  torch._inductor.config.patch(inductor)):
                return compiled(*args)

        return call

    def _record(self, nxt: Tensor, b: int) -> None:
        """After a decode step of the first b rows: count the token it cached in each, append nxt
        (b,) to the unfinished ones and mark the rows it finishes. The engine calls it through
        `_advance`: compiled with the engine, a few fused kernels where eagerly it is a dozen."""
        self.lens[:b] = self._positions(self.lens[:b]) + 1
        live = ~self.done[:b]
        rows = torch.arange(b, device=nxt.device)
        self.out[rows, self.n_out[:b]] = nxt  # a finished row writes past its end: ignored
        self.n_out[:b] += live
        stop = (self.n_out[:b] >= self.budget[:b]) | self._is_stop(nxt)
        self.done[:b] |= live & stop
        self.tokens[:b] = nxt

    def _is_stop(self, ids: Tensor) -> Tensor:
        # A plain (n, K) comparison: torch.isin switches to a sorting algorithm for long tables,
        # whose `unique` reads a size back to the host (not allowed inside a graph capture).
        return (ids[:, None] == self.stop_ids).any(dim=-1)

    def _step_body(self, b: int, L: int, greedy: bool) -> Tensor:
        logits, argmax = self._forward(self.tokens[:b], self.lens[:b], L)
        if greedy:  # (a sampled step's caller samples, then advances)
            self._advance(logits.argmax(dim=-1) if argmax is None else argmax, b)
        return logits

    def _state(self) -> list[Tensor]:
        return [self.tokens, self.lens, self.n_out, self.done, self.out]

    def _steps(self, b: int, L: int, greedy: bool, n: int) -> Tensor:
        for _ in range(n):
            logits = self._step_body(b, L, greedy)
        return logits

    def _step(self, b: int, L: int, greedy: bool, n: int = 1) -> Tensor:
        """n decode steps of the first b rows over L cache slots (n > 1: greedy steps only), the
        last one's logits: one replay of the graph captured for (b, L, greedy, n) with CUDA graphs."""
        if not self.cuda_graphs:
            return self._steps(b, L, greedy, n)
        key = (b, L, greedy, n)
        if key not in self._graphs:
            self._graphs[key] = self._capture(b, L, greedy, n)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture(self, b: int, L: int, greedy: bool, n: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        saved = [t.clone() for t in self._state()]

        def restore() -> None:  # the warm-up steps and the capture leave the state as they found it
            for t, s in zip(self._state(), saved):
                t.copy_(s)

        graph, logits = self._record_graph(lambda: self._steps(b, L, greedy, n), warmups=2, after_warmup=restore)
        restore()
        return graph, logits

    def _record_graph(self, body, *, warmups: int, after_warmup=None) -> tuple[torch.cuda.CUDAGraph, Any]:
        """`body()` captured in a CUDA graph from the engine's memory pool, and its output, after
        `warmups` runs on a side stream (compilation, library handles), each followed by
        `after_warmup()`; all with autocast's cache of cast weights off (`_uncached_autocast`)."""
        with _uncached_autocast(self.device.type):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmups):
                    body()
                    if after_warmup is not None:
                        after_warmup()
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = body()
        return graph, out

    # ---- prefill, refill, compaction ------------------------------------------------------

    def _prefill(self, slots: list[int], prompts: list[Sequence[int]], max_tokens: int = 16384) -> Tensor:
        """Prefill `prompts` into `slots`; their next-token logits (n, V), in order."""
        n = len(prompts)
        order = sorted(range(n), key=lambda i: len(prompts[i]))
        chunks, chunk = [], []
        for i in order:  # similar lengths together, at most ~max_tokens padded tokens a forward
            if chunk and len(prompts[i]) * (len(chunk) + 1) > max_tokens:  # sorted: the longest yet
                chunks.append(chunk)
                chunk = []
            chunk.append(i)
        chunks.append(chunk)
        parts = []
        for chunk in chunks:
            T = max(len(prompts[i]) for i in chunk)
            T = min(-(-T // self.prefill_bucket) * self.prefill_bucket, self._prefill_cap)
            # With padded rows the chunk's last prompt fills the bucket again: its copies write
            # the same keys and values into the same slot, and their logits are dropped.
            padded = chunk + [chunk[-1]] * ((1 << (len(chunk) - 1).bit_length()) - len(chunk)
                                            if self._pad_prefill_rows else 0)
            ids = torch.tensor([list(prompts[i]) + [0] * (T - len(prompts[i])) for i in padded],
                               dtype=torch.long, device=self.device)
            last = torch.tensor([len(prompts[i]) - 1 for i in padded], device=self.device)
            rows = torch.tensor([slots[i] for i in padded], device=self.device)
            parts.append(self._prefill_call(ids, rows, last)[:len(chunk)])
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # (n, V), the prompts in `order`
        if order == list(range(n)):
            return logits
        inverse = sorted(range(n), key=order.__getitem__)  # prompt i's row of `logits`
        return logits[torch.tensor(inverse, device=self.device)]

    def _prefill_call(self, ids: Tensor, rows: Tensor, last: Tensor) -> Tensor:
        """The prefill forward of one chunk: compiled where it is. The first prefill allocates the
        cache's buffers (in its keys' dtype) eagerly, then runs compiled on the same chunk too,
        rewriting the same slots: the compilation belongs to the engine's first run, with the
        decode steps', not to a later one that a caller may be timing. A compiled prefill whose
        first call fails (a compiler that cannot take the graph) is dropped, with a warning, for
        the eager one: prefill is a small share of decoding, not worth failing a run for. Once
        it has worked, its errors are raised."""
        compiled = self._prefill_forward
        if compiled == self._prefill_logits:
            if self.prefill_graphs and self.cache.k[0] is not None:  # (the first allocates the cache eagerly)
                return self._prefill_replayed(ids, rows, last)
            return self._prefill_logits(ids, rows, last)
        if self.cache.k[0] is None:
            self._prefill_logits(ids, rows, last)
        if self._prefill_compiled_ran:
            return compiled(ids, rows, last)
        try:
            out = compiled(ids, rows, last)
        except Exception as exc:  # (rerunning eagerly rewrites the same cache slots)
            _warn_prefilling_eagerly("compiled prefill", exc, stacklevel=2)
            self._prefill_forward = self._prefill_logits
            return self._prefill_logits(ids, rows, last)
        self._prefill_compiled_ran = True
        return out

    def _prefill_logits(self, ids: Tensor, rows: Tensor, last: Tensor) -> Tensor:
        """Prefill right-padded prompts ids (n, T) into the cache rows `rows` (n,); the logits
        (n, V) at index last (n,) of each row (its final token)."""
        T = ids.shape[1]
        view = PrefillView(self.cache, rows, T)
        return _lm_logits(self.model, ids, torch.arange(T, device=ids.device), view, last, self.head).float()

    def _prefill_replayed(self, ids: Tensor, rows: Tensor, last: Tensor) -> Tensor:
        """`_prefill_logits` replayed from the CUDA graph of its (n, T) (captured on first use,
        with its own input buffers); the logits are copied out of the graph's output, which the
        next replay overwrites. At most PREFILL_GRAPHS_KEPT shapes are captured (each keeps its
        output and inputs, and capturing costs a forward's time); others run eagerly. A capture
        that fails turns prefill graphs off, with a warning."""
        key = tuple(ids.shape)
        held = self._prefill_graph_cache.get(key)
        if held is None:
            if len(self._prefill_graph_cache) >= PREFILL_GRAPHS_KEPT:
                return self._prefill_logits(ids, rows, last)  # a shape past the kept ones: eagerly
            try:
                held = self._prefill_graph_cache[key] = self._capture_prefill(ids, rows, last)
            except Exception as exc:  # (the eager forward below rewrites the same cache slots)
                _warn_prefilling_eagerly("prefill graph capture", exc, stacklevel=3)
                self.prefill_graphs = False
                return self._prefill_logits(ids, rows, last)
        graph, inputs, logits = held
        for buffer, value in zip(inputs, (ids, rows, last)):
            buffer.copy_(value)
        graph.replay()
        return logits.clone()

    def _capture_prefill(self, ids: Tensor, rows: Tensor, last: Tensor):
        with torch.inference_mode(False):  # input buffers written in or out of inference mode
            inputs = tuple(x.clone() for x in (ids, rows, last))
        # (the warm-up writes into the cache what the call will)
        graph, logits = self._record_graph(lambda: self._prefill_logits(*inputs), warmups=1)
        return graph, inputs, logits

    def _compiled_prefill(self, backend="inductor"):
        """`_prefill_logits` under `torch.compile`, compiled for this engine alone (`_own_compiled`).

        The number of rows n and the width T are dynamic: the entries are n == 1 and n > 1 (sizes
        1 are specialised; `_prefill` rounds T up to a multiple of `prefill_bucket`, so T > 1 while
        max_len allows), each for T at most the sliding window and above it, where the model has
        one (`PrefillView` builds a mask only for the latter). The recompile limit is raised to
        two entries a width: a bound, should a torch version specialise on T. Padding the width
        is safe because attention is causal: the padding changes no real token's logits, and its
        keys and values land in slots past the row's length, masked in decoding until overwritten,
        as the right padding of the shorter prompts always was. `backend`: torch.compile's.
        """
        widths = -(-self._prefill_cap // self.prefill_bucket)
        return self._own_compiled(DecodeEngine._prefill_logits, 2 * widths, backend)

    def _start_rows(self, slots: list[int], prompts: list[Sequence[int]], budgets: list[int], sampling) -> None:
        """Prefill prompts into slots and sample their first tokens."""
        with torch.profiler.record_function("engine.prefill"):
            logits = self._prefill(slots, prompts)  # (n, V)
        idx = torch.tensor(slots, device=self.device)
        self.lens[idx] = torch.tensor([len(p) for p in prompts], device=self.device)
        self.budget[idx] = torch.tensor(budgets, device=self.device)
        nxt = sample_next(logits, *sampling)  # (n,)
        self.out[idx, 0] = nxt
        self.n_out[idx] = 1
        self.tokens[idx] = nxt
        self.done[idx] = (self.budget[idx] <= 1) | self._is_stop(nxt)

    def _compact(self, live: list[int], hi: int) -> None:
        """Move the live slots (ascending) to slots 0 .. len(live) - 1."""
        n = len(live)
        src = torch.tensor(live, device=self.device)
        for t in (self.tokens, self.lens, self.n_out, self.budget, self.done, self.out):
            t[:n] = t[src]
        self.done[n:] = True
        self.cache.move_rows(0, src, min(hi, self.max_len))

    def _refresh_projections(self) -> None:
        """The stacked weights and the padded head take the model's current ones (it may have
        trained since the last run), in the autocast dtype when autocast is on; new buffers void
        the captured steps."""
        kind = self.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        new = False
        for copies in (self.cache.projections, self.head):
            if copies is not None:
                new = copies.refresh(dtype) or new
        if new:
            self._graphs.clear()
            self._prefill_graph_cache.clear()

    # ---- the loop -------------------------------------------------------------------------

    @torch.no_grad()  # never a graph for backward: torch.compile would try to build one through the kernels
    def run(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], *, temperature: float = 1.0,
            top_k: int | None = None, top_p: float | None = None, stop_ids: Sequence[int] = (),
            generator: torch.Generator | None = None) -> list[list[int]]:
        """New tokens for each prompt: up to budgets[i] of them, ending at the first stop id.

        Each prompt plus its budget must fit in max_len. Prompts beyond the slot count wait and
        take the slots of rows that finish.

        Runs without autograd (under `torch.no_grad` at least), inside `torch.inference_mode` or
        not, either in turn: the tensors the engine keeps across runs (its state, the cache, the
        stacked and padded weight copies) are allocated outside inference mode, even when that
        happens inside a run under it, so they are normal tensors, which may be updated in place
        in either mode (an inference tensor only inside inference mode).
        """
        n_req = len(prompts)
        self._refresh_projections()
        for i, (p, g) in enumerate(zip(prompts, budgets)):
            if len(p) + g > self.max_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + {g} new exceed the engine's max_len={self.max_len}")
        outs: list[list[int]] = [[] for _ in range(n_req)]
        queue = [i for i in range(n_req) if budgets[i] > 0]
        if not queue:
            return outs
        sampling = (temperature, top_k, top_p, generator)
        greedy = temperature == 0
        stops = sorted(set(int(t) for t in stop_ids))
        if len(stops) > self.stop_ids.numel():  # a bigger table: steps captured with the old one go
            with torch.inference_mode(False):
                self.stop_ids = torch.full((len(stops),), -1, dtype=torch.long, device=self.device)
            self._graphs.clear()
        self.stop_ids.fill_(-1)
        self.stop_ids[:len(stops)] = torch.tensor(stops, dtype=torch.long, device=self.device)
        self.done.fill_(True)
        buckets = batch_buckets(self.slots)
        owner = [-1] * self.slots  # request index held by each slot
        # The highest cache length among live rows is (offset + steps taken): an upper bound
        # that sizes the attention window L without reading lengths back.
        offset, step = 0, 0

        def admit(free: list[int]) -> None:
            nonlocal offset
            take, queue[:] = queue[:len(free)], queue[len(free):]
            if not take:
                return
            slots = free[:len(take)]
            self._start_rows(slots, [prompts[r] for r in take], [budgets[r] for r in take], sampling)
            for s, r in zip(slots, take):
                owner[s] = r
            offset = max(offset, max(len(prompts[r]) for r in take) - step)

        admit(list(range(self.slots)))
        b, check_at = self.slots, 0
        while True:
            if step >= check_at:  # one sync: harvest finished rows, refill, compact
                done = self.done.tolist()
                finished = [s for s in range(self.slots) if done[s] and owner[s] >= 0]
                if finished:
                    idx = torch.tensor(finished, device=self.device)
                    counts = self.n_out[idx].tolist()
                    rows = self.out[idx].tolist()
                    for s, n, row in zip(finished, counts, rows):
                        outs[owner[s]] = row[:n]
                        owner[s] = -1
                if queue:
                    admit([s for s in range(self.slots) if owner[s] < 0])
                live = [s for s in range(self.slots) if owner[s] >= 0]
                if not live:
                    break
                b = next(x for x in buckets if x >= len(live))  # the step shrinks with the live rows
                if live[-1] >= b:
                    self._compact(live, offset + step + 1)
                    owner[:] = [owner[s] for s in live] + [-1] * (self.slots - len(live))
                check_at = step + self.check_every
            hi = min(offset + step + 1, self.max_len)
            L = min(self.max_len, -(-hi // self.len_bucket) * self.len_bucket)
            n = self.steps_per_replay if greedy else 1
            if n > 1 and (step + n > check_at or min(offset + step + n, self.max_len) > L):
                n = 1  # the next check, or a wider window, comes first
            logits = self._step(b, L, greedy, n)
            if not greedy:
                self._advance(sample_next(logits, *sampling), b)
            step += n
        return outs
