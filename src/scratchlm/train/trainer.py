"""The training loop: builds model, optimizer and data sampler from a TrainConfig and runs them.

One optimizer step = `grad_accum_steps` micro-batches forward/backward (loss scaled by
1/accum), gradient sync (parallel runs), global-norm clipping, an AdamW (or, with
``optim.name = "muon"``, Muon) step with the scheduled learning rate. Update number ``s``
(1-based) uses ``learning_rate(s)``, so the first update is not wasted at lr 0 and the last one
uses `min_lr`.

Resuming is exact: a checkpoint holds weights, optimizer state, RNG states, the sampler's
position and the partial train-loss window, and on resume metrics.jsonl is cut back to the
checkpoint's step; with `trainer.deterministic` an interrupted-and-resumed run logs bitwise the
same losses as an uninterrupted one (tests/train/test_trainer.py checks this). Resuming a run that
already logged its "end" and has nothing left to train writes nothing and only says so.

Order at a step: log, then checkpoint, then evaluate — so a crash in evaluation or sampling
never costs the newest checkpoint. A NaN or infinite training loss or gradient norm stops the run
with a one-line error when it is logged or before a checkpoint is written, so `latest` stays the
last checkpoint with finite weights.

Ctrl-C (SIGINT) or SIGTERM during the loop is noted, not acted on at once
(`scratchlm.train.interrupt`): the optimizer step in progress finishes and is checkpointed, then
`fit` raises `TrainingInterrupted` naming the checkpoint, so `--resume` continues exactly as after
any checkpoint; the evaluation due at that step runs when the run resumes. In parallel runs the
ranks agree at each logging step on whether to stop, so they all stop at the same one.

The training clock (``elapsed_s`` in every train and eval record) runs from the first step of
`fit`, compilation and warm-up included, and stops during evaluations and checkpoint writes
(after waiting for the GPU's queued work), so evaluating more often does not change how much a
time budget trains; a resumed run continues it from the checkpoint. With
``trainer.time_budget_s`` the run stops when the clock reaches the budget and the learning-rate
decay follows elapsed / budget (`scratchlm.optim.schedule.budget_lr`); in parallel runs the
ranks average their clocks once a step, so they agree on the rate and on when to stop. Records
also carry ``tokens`` (trained so far); eval records carry ``tokens_per_s``, the mean rate on the
training clock, and ``val_tokens``, the number of tokens scored.

Mixture-of-experts models (``model.ffn="moe"``): each micro-batch backpropagates
``cross_entropy + moe_aux_coef · load_balance + moe_z_coef · Σ_layers z_loss`` (scaled by 1/accum
like the rest; load_balance is Σ_layers of each layer's loss, or one loss over all layers' routing
with ``model.moe_aux_scope="model"``: ``scratchlm.model.moe.moe_aux_loss``), read from the MoE layers' ``last_aux`` right after the forward and
before the backward, so the recomputation of activation checkpointing (which runs the forward
again inside the backward) never adds them twice; under ``torch.compile`` ``last_aux`` is set
by the compiled forward and holds its real output tensors. ``loss`` in the log stays the
cross-entropy alone; ``moe_aux_loss`` and ``moe_z_loss`` are the unweighted losses averaged over
layers (1.0 is perfectly uniform routing for the first), with the dropped-assignment fraction,
router entropy and per-layer expert utilisation (`scratchlm.model.moe.moe_record`), all averaged
over the micro-batches of the log window. The router statistics are summed on the device and
read once per log interval, like the loss.

Sequence-length warm-up (``trainer.seq_len_warmup_steps``): early steps train on the same
tokens cut into shorter windows (`warmup_seq_len`, `split_windows`): attention over a short
context is cheaper and the early model learns mostly local statistics anyway. Only the window
shape changes with the step, so resuming stays exact; under torch.compile the four shapes give
at most a few recompilations (Dynamo turns the shape dynamic at the second one).

Every run goes through a parallel strategy (`scratchlm.parallel.strategy.Strategy`; the
single-process one for ``parallel.strategy = "none"``), and `scratchlm.parallel.parallelize`
applies activation checkpointing, torch.compile and the strategy's wrapper to the plain model.
Rank 0 logs and writes checkpoints; each rank draws its disjoint slice of the same global batch,
so the global batch is `trainer.batch_size` whatever the world size (micro-batch per rank =
batch_size / (grad_accum_steps · world_size)).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from scratchlm.config import changed_fields, config_to_dict, config_to_toml, settings_text
from scratchlm.device import peak_flops
from scratchlm.errors import UserError
from scratchlm.fileio import write_text_atomic
from scratchlm.model.moe import moe_aux_loss, moe_layers, moe_record, moe_stats
from scratchlm.model.transformer import blocks_run_by
from scratchlm.optim import learning_rate, optimizer_spec
from scratchlm.parallel.parallelize import parallelize
from scratchlm.parallel.strategy import Strategy, init_strategy
from scratchlm.train import checkpoint as ckpt
from scratchlm.train.config import TrainConfig
from scratchlm.train.data_feed import TrainData, evaluation_totals
from scratchlm.train.interrupt import StopSignals, TrainingInterrupted, signal_name, stop_signals
from scratchlm.train.metrics import (
    MetricsLogger, NullLogger, Throughput, format_line, memory_gb, open_loggers, perplexity,
    read_metrics, train_flops_per_token, truncate_metrics,
)
from scratchlm.train.run_dir import copy_tokenizer, environment_info

log = logging.getLogger("scratchlm.train")
_clock = time.perf_counter  # the training clock's time source (tests substitute a fake one)
PLOT_EVERY_S = 300.0  # plots are redrawn at an evaluation at most this often (and at the end)


__all__ = ["Trainer", "check_combinations", "deterministic_algorithms", "ignored_options", "seed_everything",
           "warmup_seq_len"]

SEQ_LEN_STAGES = 4  # trainer.seq_len_warmup_steps: windows of 1/8, 1/4, 1/2, then all of context_length


def warmup_seq_len(step: int, context_length: int, warmup_steps: int, stages: int = SEQ_LEN_STAGES) -> int:
    """Training window length of update `step` (1-based) under a sequence-length warm-up.

    The first `warmup_steps` updates are split into `stages` equal spans using
    context_length / 2^(stages-1), ..., / 2, then whole windows (also after the warm-up).
    Example: [warmup_seq_len(s, 16, 8) for s in range(1, 10)] == [2, 2, 4, 4, 8, 8, 16, 16, 16].
    """
    if step > warmup_steps:
        return context_length
    stage = (step - 1) * stages // warmup_steps  # 0 .. stages-1
    return context_length >> (stages - 1 - stage)


def split_windows(x: torch.Tensor, y: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) inputs and targets as (B·T/length, length): the same tokens and targets, each row
    cut into consecutive windows (y is x shifted by one, so every piece keeps its own targets)."""
    B, T = x.shape
    if length == T:
        return x, y
    return x.reshape(B * T // length, length), y.reshape(B * T // length, length)


def check_combinations(cfg: TrainConfig) -> None:
    """Refuse option pairs that cannot work together, before anything is built or written."""
    tc = cfg.trainer
    if tc.fused_lm_head and cfg.model.logit_softcap:
        raise UserError("trainer.fused_lm_head computes the loss from uncapped logits: turn it off to train "
                        "with model.logit_softcap")
    stages = 2 ** (SEQ_LEN_STAGES - 1)
    if tc.seq_len_warmup_steps and cfg.model.context_length % stages:
        raise UserError(f"trainer.seq_len_warmup_steps cuts windows to 1/{stages} of model.context_length, "
                        f"so context_length must divide by {stages}, not {cfg.model.context_length}")
    if tc.fp8 and cfg.parallel.strategy in ("fsdp", "torch_fsdp2"):
        raise UserError(f"trainer.fp8 casts whole weight matrices, which parallel.strategy="
                        f"{cfg.parallel.strategy!r} shards: use 'none' or a DDP strategy")
    if tc.time_budget_s and cfg.optim.cosine_steps is not None:
        raise UserError("optim.cosine_steps sets the decay in steps, but with trainer.time_budget_s the decay "
                        "follows the clock: leave optim.cosine_steps unset")


def ignored_options(cfg: TrainConfig, device: torch.device) -> list[str]:
    """One line for each option `cfg` sets (away from its default) that this run never reads,
    because another option or the device makes it have no effect; the trainer logs them as notes
    so that such an option is not ignored silently."""
    tc = cfg.trainer
    changed = changed_fields(tc)
    notes = cfg.model.ignored_options() + cfg.optim.ignored_options() + cfg.parallel.ignored_options()
    compile_options = [name for name in ("compile_mode", "compile_backend", "compile_scope", "compile_cache_dir",
                                         "compile_eval") if name in changed]
    if compile_options and not tc.compile:
        notes.append(f"{settings_text('trainer', tc, compile_options)} no effect (trainer.compile=false: "
                     "the model runs eagerly)")
    elif tc.compile and tc.compile_backend == "cudagraphs":
        if device.type != "cuda":
            notes.append(f"trainer.compile_backend=\"cudagraphs\" has no effect on {device.type} (it replays CUDA "
                         "graphs); the model runs eagerly")
        if "compile_mode" in changed:
            notes.append(f"{settings_text('trainer', tc, ['compile_mode'])} no effect (compile_mode is Inductor's; "
                         "trainer.compile_backend=\"cudagraphs\" generates no code)")
    elif tc.compile and tc.compile_mode == "reduce-overhead" and device.type != "cuda":
        notes.append(f"trainer.compile_mode=\"reduce-overhead\" has no effect on {device.type} (its CUDA graphs "
                     "need a CUDA device); the model compiles as with \"default\"")
    if "fp8_recipe" in changed and not tc.fp8:
        notes.append(f"{settings_text('trainer', tc, ['fp8_recipe'])} no effect (trainer.fp8=false: the matmuls "
                     "run in the compute dtype)")
    if "activation_checkpointing_every" in changed and not tc.activation_checkpointing:
        notes.append(f"{settings_text('trainer', tc, ['activation_checkpointing_every'])} no effect "
                     "(trainer.activation_checkpointing=false: no block is checkpointed)")
    sampling = [name for name in ("sample_prompts", "sample_temperature", "sample_top_p") if name in changed]
    if sampling and not tc.sample_tokens:
        notes.append(f"{settings_text('trainer', tc, sampling)} no effect (trainer.sample_tokens=0: the run draws "
                     "no samples)")
    elif "sample_top_p" in changed and tc.sample_temperature == 0:
        notes.append(f"{settings_text('trainer', tc, ['sample_top_p'])} no effect (trainer.sample_temperature=0 "
                     "samples greedily)")
    evaluation = [name for name in ("eval_interval", "eval_batches", "final_eval_full", "eval_at_start")
                  if name in changed]
    if evaluation and not cfg.data.val_path:
        notes.append(f"{settings_text('trainer', tc, evaluation)} no effect (data.val_path is empty: the run "
                     "never evaluates)")
    return notes


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python's, NumPy's and torch's generators; with `deterministic`, also turn torch's
    deterministic algorithms on (and cuDNN's autotuner off) for the rest of the process.

    `Trainer` seeds with this but holds the deterministic mode only while `fit` runs
    (`deterministic_algorithms`), so code after a run finds the modes it had before.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        _use_deterministic_algorithms()


def _deterministic_cublas() -> None:
    # cuBLAS needs this workspace setting before its first use to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _use_deterministic_algorithms() -> None:
    _deterministic_cublas()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """Within the block, torch's deterministic algorithms on and cuDNN's autotuner off when `on`
    (nothing changes otherwise); the modes found on entry are restored on exit."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.benchmark)
    _use_deterministic_algorithms()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]


class Trainer:
    """Trains `cfg.model` on `cfg.data` into `run_dir`; `fit()` runs the loop.

    `strategy` is the parallel strategy to train with (joined already, e.g. by
    `init_strategy(cfg.parallel)`); without one the trainer builds `cfg.parallel`'s itself.
    `engine` is the same argument under its older name.
    """

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, resume: bool | int | str = False,
                 strategy: Strategy | None = None, engine: Strategy | None = None,
                 logger: MetricsLogger | None = None) -> None:
        from scratchlm.model.transformer import build_model

        tc = cfg.trainer
        check_combinations(cfg)
        strategy = strategy or engine or init_strategy(cfg.parallel, device=tc.device)
        self.cfg, self.run_dir, self.strategy = cfg, Path(run_dir), strategy
        self.rank, self.world_size, self.is_main = strategy.rank, strategy.world_size, strategy.is_main
        self.device = strategy.device
        self.bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and self.device.type == "cuda")
        seed_everything(tc.seed, deterministic=False)
        if tc.deterministic:  # before cuBLAS starts; the deterministic modes themselves are fit()'s
            _deterministic_cublas()

        self.data = TrainData(cfg.data, cfg.model, batch_size=tc.batch_size // tc.grad_accum_steps,
                              seed=tc.seed, rank=self.rank, world_size=self.world_size)
        self.raw_model = build_model(cfg.model, device=self.device)
        if tc.fp8:
            self._use_fp8()
        if tc.compile:
            self._use_compile_cache()
        run = parallelize(self.raw_model, tc, strategy)
        self.model, self._loss_fn, self._head_inputs = run.model, run.loss_fn, run.head_inputs
        self._cudagraphs = run.cudagraphs
        self.optimizer = self._build_optimizer()
        self.step = 0
        self._tokens = 0  # tokens trained on so far (all ranks)
        self._elapsed = 0.0  # the training clock after the last step, agreed by the ranks
        self._clock_start: float | None = None  # _clock() when this fit() started the clock
        self._clock_base = 0.0  # seconds on the clock before that (earlier fits, a resumed run)
        self._clock_paused = 0.0  # seconds of evaluation and checkpointing since _clock_start
        self._last_plot = time.monotonic()
        self._window_loss = torch.zeros((), device=self.device)
        self._window_steps = 0
        self._moe_layers = moe_layers(self.raw_model)
        # Running sum of the router statistics of the window (see scratchlm.model.moe.moe_stats).
        self._moe_window = (torch.zeros(4 + len(self._moe_layers) * cfg.model.moe_num_experts, device=self.device)
                            if self._moe_layers else None)
        self.config_text = config_to_toml(cfg)
        # Found and verified before anything in the run directory changes: a refusal loses nothing.
        resume_dir = ckpt.find_resume_checkpoint(self.run_dir, None if resume is True else resume,
                                                 set_aside_newer=self.is_main) if resume else None
        if resume:
            self._resume(resume_dir)
        # A resumed run that already logged its end at this step, with nothing left to train, is
        # complete: nothing more is written to it and `fit` only says so.
        self.finished = bool(resume) and (self.step >= tc.max_steps or self._budget_spent()) \
            and self._has_record("end", self.step)
        warmup = cfg.optim.warmup_steps
        if self.is_main and not self.finished and not tc.time_budget_s and warmup >= tc.max_steps > 0:
            log.warning("optim.warmup_steps=%d is not below trainer.max_steps=%d: the learning rate rises for the "
                        "whole run (to %.0f%% of optim.lr=%g) and never decays; lower optim.warmup_steps",
                        warmup, tc.max_steps, 100 * tc.max_steps / warmup, cfg.optim.lr)
        if self.is_main and not self.finished:
            for note in ignored_options(cfg, self.device):
                log.warning("note: %s", note)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "config.toml", self.config_text)
            copy_tokenizer(cfg.data.tokenizer_dir, self.run_dir)
        if not resume and self.is_main and (self.run_dir / "metrics.jsonl").exists():
            truncate_metrics(self.run_dir / "metrics.jsonl", -1)  # a fresh run starts a fresh log
        if logger is None:
            logger = NullLogger() if not self.is_main or self.finished else open_loggers(
                self.run_dir, wandb_project=tc.wandb_project, tensorboard=tc.tensorboard, config=config_to_dict(cfg))
        self.logger = logger
        num_params = sum(p.numel() for p in self.raw_model.parameters())
        self.throughput = Throughput(train_flops_per_token(cfg.model), world_size=self.world_size,
                                     peak=peak_flops(self.device, "bf16" if self.bf16 else "fp32", override=tc.peak_flops))
        if not self.finished:
            self.logger.log({"event": "resume" if self.step else "start", "step": self.step,
                             "num_params": num_params, "device": str(self.device), "world_size": self.world_size,
                             "precision": "bf16" if self.bf16 else "fp32", **environment_info()})

    # ------------------------------------------------------------------ setup

    @property
    def engine(self) -> Strategy:
        """The strategy (its older name)."""
        return self.strategy

    def _use_compile_cache(self) -> None:
        """`trainer.compile_cache_dir`, with a job name from what the compiled graphs depend on."""
        from scratchlm.train.compile_cache import use_compile_cache

        tc = self.cfg.trainer
        shape = {k: getattr(tc, k) for k in ("batch_size", "grad_accum_steps", "compile_mode", "compile_scope",
                                             "fused_lm_head",
                                             "activation_checkpointing", "activation_checkpointing_every",
                                             "seq_len_warmup_steps")}
        if tc.compile_backend != "inductor":  # (named only when set, so Inductor runs keep their caches' names)
            shape["compile_backend"] = tc.compile_backend
        job = config_to_toml(self.cfg.model) + repr(sorted(shape.items())) + f"{self.world_size} {self.device.type}"
        use_compile_cache(tc.compile_cache_dir, job_text=job)

    def _use_fp8(self) -> None:
        from scratchlm.model.fp8 import convert_to_float8

        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            name = torch.cuda.get_device_name(self.device)
            raise UserError(f"trainer.fp8 needs FP8 tensor cores (compute capability 8.9+); {name} has none")
        convert_to_float8(self.raw_model, recipe=self.cfg.trainer.fp8_recipe)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one micro-batch (forward under autocast, the loss in float32)."""
        if self._head_inputs is not None:
            from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

            with self._autocast():  # the head's matmuls run in the autocast dtype, as F.linear's would
                return fused_linear_cross_entropy(self._head_inputs(x), self.raw_model.lm_head.weight, y)
        with self._autocast():
            logits = self.model(x)
        return self._loss_fn(logits, y)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        from scratchlm.parallel.strategies.sharded import ShardedStateStrategy

        oc = self.cfg.optim
        if oc.name == "muon" and isinstance(self.strategy, ShardedStateStrategy):
            raise UserError(f"optim.name='muon' needs whole matrices on every rank, which "
                            f"parallel.strategy={self.strategy.name!r} shards: use 'none' or a DDP strategy, or adamw")
        optimizer_cls, groups, kwargs = optimizer_spec(oc)
        return self.strategy.build_optimizer(self.model, optimizer_cls, params=groups, **kwargs)

    # ------------------------------------------------------------------ the loop

    def fit(self, *, until: int | None = None, deadline: float | None = None) -> dict[str, Any]:
        """Train up to `trainer.max_steps`; returns the last train and eval records.

        `until` stops early at that step (checkpointing there, to resume later). `deadline`
        (a `time.monotonic()` value) is a time budget: once past it the run checkpoints,
        evaluates and finishes (plots, samples) at the step it reached. On SIGINT or SIGTERM
        (see `scratchlm.train.interrupt`) it finishes the optimizer step in progress, checkpoints
        it and raises `TrainingInterrupted`; a second signal raises at once.

        With `trainer.deterministic`, torch's deterministic algorithms are on while it runs and
        the modes found before are restored when it returns or raises.
        """
        with deterministic_algorithms(self.cfg.trainer.deterministic):
            return self._fit(until, deadline)

    def _fit(self, until: int | None, deadline: float | None) -> dict[str, Any]:
        tc = self.cfg.trainer
        if self.finished:
            log.info("%s already finished at step %d; nothing to do (raise trainer.max_steps%s to train on)",
                     self.run_dir, self.step, " or trainer.time_budget_s" if tc.time_budget_s else "")
            return {}
        stop = tc.max_steps if until is None else min(until, tc.max_steps)
        last: dict[str, Any] = {}
        spent = self._budget_spent()  # a resumed run whose time budget ran out before
        if self.step == 0 and tc.eval_at_start and self.data.has_validation:
            last["eval"] = self._evaluate()
        elif (self.step and (self._eval_due(self.step) or (spent and self.data.has_validation))
              and not self._has_eval_record(self.step)):
            # the run stopped between its checkpoint and this eval
            last["eval"] = self._evaluate(final=spent or self.step == tc.max_steps)
        if spent:
            log.info("the time budget of %s was spent at step %d; nothing to train", self.run_dir, self.step)
            if until is None:  # it may have stopped between its last checkpoint and its end
                self._finish()
            return last
        bar = self._progress_bar(stop)
        out_of_time = False
        stop_signal: int | None = None  # SIGINT or SIGTERM received: checkpoint this step and stop
        saved: Path | None = None
        self._start_clock()
        try:
            with stop_signals(announce=self.is_main) as signals:
                while self.step < stop and not out_of_time:
                    self._train_step()
                    bar.update(1)
                    stop_signal = self._agreed_stop_signal(signals)
                    out_of_time = ((deadline is not None and time.monotonic() > deadline) or self._budget_spent()) \
                        and self.step < stop
                    if self.step % tc.log_interval == 0 or self.step == tc.max_steps or out_of_time:
                        last["train"] = self._log_train()
                        bar.set_postfix(loss=f"{last['train']['loss']:.3f}")
                    # An interrupted step logs only as usual: its checkpoint carries the loss window, so
                    # the resumed run logs what an uninterrupted one would.
                    at_end = self.step == stop or out_of_time or stop_signal is not None
                    if (tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0) or at_end:
                        saved = self.save_checkpoint()
                    if stop_signal is not None:
                        break  # no evaluation: a resumed run runs the one that is due
                    if self._eval_due(self.step) or (out_of_time and self.data.has_validation):
                        last["eval"] = self._evaluate(final=out_of_time or self.step == tc.max_steps)
        finally:
            bar.close()
            self._stop_clock()
        if stop_signal is not None:
            self._stop_interrupted(stop_signal, saved)  # raises TrainingInterrupted
        if out_of_time:
            log.info("time budget reached at step %d of %d (%.1f s)", self.step, tc.max_steps, self._elapsed)
        if (self.step == tc.max_steps and until is None) or out_of_time:
            self._finish()
        return last

    def _agreed_stop_signal(self, signals: StopSignals) -> int | None:
        """The signal to stop on after this step, if any. Ranks receive a signal at different
        moments, so in parallel runs they agree on it and all stop at the same step to write the
        checkpoint together, instead of some waiting forever in a collective the others never
        reach. The agreement is one small all-reduce, which waits for the device: it runs only at
        logging steps (which wait for the loss anyway), so a signal takes effect within
        `trainer.log_interval` steps. A single process reads the note after every step."""
        if self.world_size == 1:
            return signals.signum
        if self.step % self.cfg.trainer.log_interval:
            return None
        sigint, sigterm = self.strategy.all_reduce_means([float(signals.signum == signal.SIGINT),
                                                          float(signals.signum == signal.SIGTERM)])
        return signal.SIGTERM if sigterm else signal.SIGINT if sigint else None

    def _stop_interrupted(self, signum: int, checkpoint: Path | None) -> NoReturn:
        resume = f"scratchlm train {shlex.quote(str(self.run_dir / 'config.toml'))} --resume"
        log.info("stopped by %s at step %d; checkpoint %s; resume with: %s",
                 signal_name(signum), self.step, checkpoint, resume)
        raise TrainingInterrupted(f"interrupted by {signal_name(signum)} at step {self.step}; checkpoint saved to "
                                  f"{checkpoint}, resume with: {resume}",
                                  signum=signum, step=self.step, checkpoint=checkpoint)

    # ------------------------------------------------------------------ the training clock

    def _train_seconds(self) -> float:
        """This rank's training clock now (see the module docstring)."""
        if self._clock_start is None:
            return self._clock_base
        return self._clock_base + _clock() - self._clock_start - self._clock_paused

    def _start_clock(self) -> None:
        self._clock_start, self._clock_paused = _clock(), 0.0

    def _stop_clock(self) -> None:
        self._clock_base = self._train_seconds()
        self._clock_start = None

    @contextlib.contextmanager
    def _clock_paused_for(self):
        """Stop the training clock inside (evaluation, checkpoints), once the device's queued work is done."""
        if self._clock_start is None:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps' queued kernels are training time
        start = _clock()
        try:
            yield
        finally:
            self._clock_paused += _clock() - start

    def _read_clock(self) -> None:
        """Set `_elapsed` after a step: with a time budget the ranks' mean, so they all agree."""
        elapsed = self._train_seconds()
        if self.cfg.trainer.time_budget_s and self.world_size > 1:
            elapsed = self.strategy.all_reduce_mean(elapsed)
        self._elapsed = elapsed

    def _budget_spent(self) -> bool:
        budget = self.cfg.trainer.time_budget_s
        return budget > 0 and self._elapsed >= budget

    def _scheduled_lr(self) -> float:
        """The learning rate of the next update: by step, or with a time budget by the clock."""
        tc = self.cfg.trainer
        progress = self._elapsed / tc.time_budget_s if tc.time_budget_s else None
        return learning_rate(self.cfg.optim, self.step + 1, tc.max_steps, progress=progress)

    # ------------------------------------------------------------------ one step

    def _train_step(self) -> None:
        tc, oc = self.cfg.trainer, self.cfg.optim
        lr = self._scheduled_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's matrices: optim.muon_lr / optim.lr
        accum = tc.grad_accum_steps
        step_loss = torch.zeros((), device=self.device)
        for micro in range(accum):
            if self._cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()  # last micro-step's graph outputs may be reused
            x, y = self.data.next_batch(self.device)
            if tc.seq_len_warmup_steps:
                length = warmup_seq_len(self.step + 1, self.cfg.model.context_length, tc.seq_len_warmup_steps)
                x, y = split_windows(x, y, length)
            with self._no_sync(micro < accum - 1):
                loss = self._loss(x, y) / accum
            step_loss += loss.detach()
            if self._moe_layers:
                mc = self.cfg.model
                loss = loss + moe_aux_loss(self._moe_layers, mc.moe_aux_coef, mc.moe_z_coef) / accum
                self._moe_window += moe_stats(self._moe_layers) / accum
            loss.backward()
        self.strategy.sync_gradients(self.model)
        max_norm = oc.grad_clip if oc.grad_clip > 0 else math.inf
        self._grad_norm = self.strategy.clip_grad_norm(self.model, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._lr = lr
        self._window_loss += step_loss
        self._window_steps += 1
        tokens = tc.batch_size * self.cfg.model.context_length
        self._tokens += tokens
        self.throughput.add(tokens)
        self._read_clock()

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _no_sync(self, skip: bool):
        return self.strategy.no_sync(self.model) if skip else contextlib.nullcontext()

    def _log_train(self) -> dict[str, Any]:
        loss = self.strategy.all_reduce_mean((self._window_loss / self._window_steps).item())
        moe: dict[str, Any] = {}
        if self._moe_window is not None:
            values = self.strategy.all_reduce_means((self._moe_window / self._window_steps).tolist())
            moe = moe_record(values, self.cfg.model.moe_num_experts)
            self._moe_window.zero_()
        self._check_finite(loss)
        record = {"event": "train", "step": self.step, "loss": loss, "lr": self._lr,
                  "grad_norm": float(self._grad_norm), **self.throughput.measure(self.device),
                  "memory_gb": memory_gb(self.device), "elapsed_s": self._elapsed, "tokens": self._tokens, **moe}
        self._window_loss.zero_()
        self._window_steps = 0
        self._emit(record)
        return record

    def _check_finite(self, loss: float | None) -> None:
        """Stop a diverged run: a NaN or infinite loss, or gradient norm (whose update has turned
        the weights NaN), before it is logged as training or saved as a checkpoint."""
        grad_norm = float(getattr(self, "_grad_norm", 0.0))
        if loss is not None and not math.isfinite(loss):
            raise UserError(f"the training loss became {loss} at step {self.step}; try a lower optim.lr")
        if not math.isfinite(grad_norm):
            raise UserError(f"the gradient norm became {grad_norm} at step {self.step}, which made the weights "
                            "NaN; try a lower optim.lr")

    def _eval_due(self, step: int) -> bool:
        if not self.data.has_validation:
            return False
        interval = self.cfg.trainer.eval_interval
        return step == self.cfg.trainer.max_steps or (interval > 0 and step % interval == 0)

    def _has_eval_record(self, step: int) -> bool:
        return self._has_record("eval", step)

    def _has_record(self, event: str, step: int) -> bool:
        path = self.run_dir / "metrics.jsonl"
        return path.is_file() and any(r.get("event") == event and r.get("step") == step
                                      for r in read_metrics(path))

    def _evaluate(self, *, final: bool = False) -> dict[str, Any]:
        """Validation loss over the first eval_batches x batch_size windows; with `final` and
        `trainer.final_eval_full`, over the whole validation file. The training clock stops meanwhile."""
        with self._clock_paused_for():
            return self._evaluate_now(final)

    def _evaluate_now(self, final: bool) -> dict[str, Any]:
        # Distributed wrappers must run the forward (FSDP gathers the weights); alone, the eager
        # module gives the same loss without compiling a no_grad graph.
        eager = self.strategy.eval_plain_model and not self.cfg.trainer.compile_eval
        model = self.raw_model if eager else self.model
        # compile_scope="blocks": the eager evaluation runs the plain blocks, not their compiled call
        blocks = (blocks_run_by(self.raw_model, None) if eager and hasattr(self.raw_model, "block_runner")
                  else contextlib.nullcontext())
        model.eval()
        try:
            # A fixed set of windows (eval_batches global batches), so the loss does not depend on
            # the micro-batch size or the number of ranks; ranks add up their token sums.
            tc = self.cfg.trainer
            windows = None if final and tc.final_eval_full else tc.eval_batches * tc.batch_size
            with blocks, self._autocast():
                total, count = evaluation_totals(model, self.data.eval_batches(windows, self.device))
        finally:
            model.train()
        total, count = self.strategy.all_reduce_means([total, float(count)])
        if count == 0:
            raise UserError("the validation set yields no batch; is data.val_path shorter than one context?")
        loss = total / count
        rate = self._tokens / self._elapsed if self._elapsed > 0 else None
        record = {"event": "eval", "step": self.step, "val_loss": loss, "val_ppl": perplexity(loss),
                  "val_tokens": round(count * self.world_size), "elapsed_s": self._elapsed, "tokens": self._tokens,
                  "tokens_per_s": rate}
        self._emit(record)
        if self.is_main and time.monotonic() - self._last_plot > PLOT_EVERY_S:
            self._plot()  # mid-run plots of long runs; the end of training always plots
        return record

    def _emit(self, record: dict[str, Any]) -> None:
        self.logger.log(record)
        if self.is_main:
            from tqdm import tqdm

            tqdm.write(format_line(record), file=sys.stdout)

    def _progress_bar(self, stop: int):
        from tqdm import tqdm

        # None lets tqdm show the bar on terminals only (logs of batch jobs stay clean).
        disable = None if self.is_main and self.cfg.trainer.progress else True
        return tqdm(total=stop, initial=self.step, desc="train", unit="step", disable=disable,
                    dynamic_ncols=True, leave=False)

    def _plot(self) -> None:
        from scratchlm.train.plots import plot_metrics

        self._last_plot = time.monotonic()
        try:
            plot_metrics(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir)
        except Exception as exc:  # a plotting problem must never stop training
            log.warning("could not write plots: %s", exc)

    def _finish(self) -> None:
        if self.is_main:
            self._plot()
            if self.cfg.trainer.sample_tokens > 0:
                from scratchlm.train.samples import write_samples

                write_samples(self.raw_model, self.cfg, self.run_dir, self.device)
        self.logger.log({"event": "end", "step": self.step})

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Write RUN/checkpoints/step_N atomically (all ranks call this in parallel runs)."""
        with self._clock_paused_for():
            return self._save_checkpoint()

    def _save_checkpoint(self) -> Path:
        # A diverged run keeps its last finite checkpoint as `latest` (the loss of the steps
        # since the last log, which is not checked yet, and the last update's gradient norm).
        window = self.strategy.all_reduce_mean((self._window_loss / self._window_steps).item()) \
            if self._window_steps else None
        self._check_finite(window)
        model_state = self.strategy.full_state_dict(self.model)
        optim_state = self.strategy.optimizer_state_dict(self.optimizer)
        state = {"step": self.step, "world_size": self.world_size, "rng": ckpt.rng_state(),
                 "parallel": {"strategy": self.strategy.name, "optimizer_state": self.cfg.parallel.optimizer_state,
                              "per_rank": self.strategy.optimizer_state_per_rank},
                 "sampler": self.data.state_dict(),
                 "loop": {"window_loss": self._window_loss.item(), "window_steps": self._window_steps,
                          "moe_window": None if self._moe_window is None else self._moe_window.tolist(),
                          "elapsed_s": self._elapsed, "tokens": self._tokens}}
        if self.is_main:
            staging = ckpt.staging_dir(self.run_dir, self.step)
        self.strategy.barrier()
        if not self.is_main:
            staging = ckpt.staging_dir(self.run_dir, self.step, create=False)
            if optim_state is not None:
                ckpt.write_torch(optim_state, staging / f"optimizer.rank{self.rank}.pt")
            ckpt.write_torch(state, staging / f"state.rank{self.rank}.pt")
        else:
            ckpt.write_step_files(staging, model_state=model_state, optimizer_state=optim_state,
                                  state={**state, **environment_info()}, config_text=self.config_text)
        self.strategy.barrier()
        path = ckpt.staging_dir(self.run_dir, self.step, create=False).parent / ckpt.step_dir_name(self.step)
        if self.is_main:
            ckpt.commit_step(self.run_dir, self.step, keep=self.cfg.trainer.keep_checkpoints)
        self.strategy.barrier()
        return path

    def _check_same_stream(self, sampler: dict[str, Any], step_dir: Path) -> None:
        """The resumed run continues the checkpoint's data stream: refuse, naming the config keys,
        a seed (which would be recorded, not used), micro-batch or training file it cannot continue."""
        tc = self.cfg.trainer
        seed = sampler.get("seed", tc.seed)
        if seed != tc.seed:
            raise UserError(f"{step_dir} trained with trainer.seed={seed}; a resumed run continues its data stream "
                            f"and random state, so trainer.seed={tc.seed} would not take effect: keep "
                            f"trainer.seed={seed}, or start a new run")
        micro = sampler.get("batch_size", self.data.batch_size)
        if micro != self.data.batch_size:
            raise UserError(f"{step_dir} trained on micro-batches of {micro} sequences (trainer.batch_size / "
                            f"trainer.grad_accum_steps = {tc.batch_size} / {tc.grad_accum_steps} = "
                            f"{self.data.batch_size} here); its data stream continues only with {micro}")
        tokens = sampler.get("num_tokens", len(self.data.train_tokens))
        if tokens != len(self.data.train_tokens):
            raise UserError(f"{step_dir} trained on a file of {tokens:,} tokens, but data.train_path "
                            f"{self.cfg.data.train_path} holds {len(self.data.train_tokens):,}: resume with the "
                            "training file the run started with")

    def _check_same_optimizer_layout(self, state: dict[str, Any], step_dir: Path) -> bool:
        """Per-rank optimizer files load only into the strategy, `parallel.optimizer_state` and
        number of ranks that wrote them: refuse another, naming what to resume with. Returns
        whether the checkpoint's optimizer state is per rank (else any strategy loads it)."""
        saved = state.get("parallel")
        if saved is None:  # written before the layout was recorded: the step's config.toml names it
            from scratchlm.config import read_toml

            config = step_dir / ckpt.CONFIG
            section = read_toml(config).get("parallel", {}) if config.is_file() else {}
            section = section if isinstance(section, dict) else {}
            saved = {"strategy": section.get("strategy"), "optimizer_state": section.get("optimizer_state", "full"),
                     "per_rank": (step_dir / "optimizer.rank1.pt").is_file()}
        if not saved["per_rank"]:
            return False  # one optimizer.pt in the single-process layout: any strategy and world size
        here = (self.strategy.name, self.cfg.parallel.optimizer_state, self.world_size)
        there = (saved["strategy"] or self.strategy.name, saved["optimizer_state"], state["world_size"])
        if here != there:
            raise UserError(f"{step_dir} holds sharded optimizer state, one part per rank, written by "
                            f"parallel.strategy={there[0]!r} on {there[2]} ranks; resume it with "
                            f"--parallel.strategy={there[0]} --parallel.optimizer_state={there[1]} on {there[2]} "
                            f"ranks, not parallel.strategy={here[0]!r} with parallel.optimizer_state={here[1]!r} "
                            f"on {here[2]} ranks")
        return True

    def _resume(self, step_dir: Path | None) -> None:
        from scratchlm.model.transformer import build_model

        if step_dir is None:
            log.warning("--resume: %s has no checkpoint yet; starting from step 0", self.run_dir)
            if self.is_main:
                truncate_metrics(self.run_dir / "metrics.jsonl", -1)
            return
        suffix = f".rank{self.rank}.pt"
        state_file = step_dir / (f"state{suffix}" if self.rank else ckpt.STATE)
        optim_file = step_dir / f"optimizer{suffix}"
        optim_file = optim_file if optim_file.is_file() else step_dir / ckpt.OPTIMIZER
        state = ckpt.read_torch(state_file)
        if not isinstance(state, dict) or not {"world_size", "sampler", "rng", "loop"} <= state.keys():
            raise UserError(f"{step_dir} holds no training state (optimizer, data position, RNG): it was not "
                            "written by `scratchlm train` (e.g. the output of sft, grpo or dpo), so it cannot be "
                            "resumed; train into another trainer.out_dir")
        per_rank = self._check_same_optimizer_layout(state, step_dir)
        self._check_same_stream(state["sampler"], step_dir)
        step, max_steps = int(state["step"]), self.cfg.trainer.max_steps
        if step > max_steps and not self._has_record("end", step):
            # fit would train nothing and end nothing, after rewriting config.toml with this max_steps
            raise UserError(f"{step_dir} is at step {step}, past trainer.max_steps={max_steps}: set "
                            f"trainer.max_steps above {step} to train on, or --resume-from an earlier step")
        weights = ckpt.load_weights(step_dir / ckpt.WEIGHTS)
        # The run's config.toml, which `run_training` compares first, may be missing or edited.
        ckpt.check_weights_fit(build_model(self.cfg.model, device="meta"), weights, step_dir / ckpt.WEIGHTS,
                               model_is="this config's model",
                               hint="resume with the model settings the run trained with")
        self.strategy.load_full_state_dict(self.model, weights)
        # Loading the state also loads the checkpoint's hyperparameters into the groups: this config's
        # (weight decay, betas, eps, Muon's rate and momentum), which config.toml records, go back on.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        try:
            self.strategy.load_optimizer_state_dict(self.optimizer, ckpt.read_torch(optim_file), per_rank=per_rank)
        except ValueError as exc:  # other parameter groups: the run's config.toml, compared first, may be missing
            raise UserError(f"{optim_file} does not fit this config's optimizer ({exc}); resume with the "
                            "optim.name and optim.decay_vectors the run trained with") from None
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)
        self.data.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self._window_loss.fill_(state["loop"]["window_loss"])
        self._window_steps = int(state["loop"]["window_steps"])
        # Checkpoints written before the clock was saved restart it at 0.
        self._elapsed = self._clock_base = float(state["loop"].get("elapsed_s", 0.0))
        self._tokens = int(state["loop"].get("tokens", self.step * self.cfg.trainer.batch_size
                                             * self.cfg.model.context_length))
        if self._moe_window is not None and state["loop"].get("moe_window") is not None:
            self._moe_window.copy_(torch.tensor(state["loop"]["moe_window"]))
        if self.is_main:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
            log.info("resumed %s at step %d", self.run_dir, self.step)
