"""Metrics: one small logger interface, throughput and model-FLOPs utilisation (MFU).

Every event goes to ``RUN/metrics.jsonl`` (one JSON object a line, always on); Weights &
Biases and TensorBoard are optional extra backends, used only when enabled *and* installed.
Records carry an ``event`` ("start", "train", "eval", "resume", "end") and the ``step``.

MFU is the fraction of the device's peak FLOP/s spent on the model's matmuls:
``train_flops_per_token · tokens_per_second / (peak · world_size)``, where a token costs
three forward passes of matmul FLOPs (6·N per token for the N weights of the Transformer and
LM head, plus the full T×T attention products; see `scratchlm.model.accounting`). The peak is
`scratchlm.device.peak_flops`: the dense bf16 tensor-core rate for bf16 training, the plain fp32
rate for fp32 training; an unlisted GPU, or a CPU, reports MFU as n/a unless `trainer.peak_flops`
gives the peak.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from scratchlm.errors import UserError
from scratchlm.fileio import write_text_atomic


def train_flops_per_token(model_cfg: Any, seq_len: int | None = None) -> float:
    """Matmul FLOPs of one training token (forward + backward = 3 forwards)."""
    from scratchlm.model.accounting import TRAIN_FORWARDS, forward_flops

    T = model_cfg.context_length if seq_len is None else seq_len
    return TRAIN_FORWARDS * forward_flops(model_cfg, T)["total"] / T


def memory_gb(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on GPUs, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


class Throughput:
    """Tokens per second and MFU over the interval since the last `measure()`."""

    def __init__(self, flops_per_token: float, peak: float | None, world_size: int = 1) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self._start = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def measure(self, device: torch.device) -> dict[str, float | None]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # time the work, not the launches
        now = time.perf_counter()
        rate = self._tokens / max(now - self._start, 1e-9)
        self._start, self._tokens = now, 0
        mfu = rate * self.flops_per_token / (self.peak * self.world_size) if self.peak else None
        return {"tokens_per_s": rate, "mfu": mfu}


def format_line(record: dict[str, Any]) -> str:
    """The console line of a train or eval record."""
    if record["event"] == "eval":
        return f"step {record['step']:>6} | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
    mfu = record.get("mfu")
    line = (
        f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"grad {record['grad_norm']:.2f} | {record['tokens_per_s']:,.0f} tok/s | "
        f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | mem {record['memory_gb']:.2f} GB"
    )
    if "moe_aux_loss" in record:
        # Expert use as percentages, one group per layer: "util 27/24/25/24 30/20/25/25".
        util = " ".join("/".join(f"{100 * u:.0f}" for u in row) for row in record["moe_expert_util"])
        line += (
            f" | aux {record['moe_aux_loss']:.3f} | z {record['moe_z_loss']:.3g} | "
            f"drop {100 * record['moe_dropped_fraction']:.1f}% | H {record['moe_router_entropy']:.2f} | util {util}"
        )
    return line


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLogger(Protocol):
    """Where metric records go."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """Appends one JSON object per record to a file, flushed at once (a crash loses nothing)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, less a last line cut short by a killed run."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a metrics log (byte {exc.start} is not UTF-8 text)") from None
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines) and not text.endswith("\n"):
                break  # the record the run was writing when it was killed
            record = None
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {number} is not a JSON record")
        records.append(record)
    return records


def _ends_with_whole_line(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


DROPPED = "metrics.dropped.jsonl"


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
    """Move records logged after `step` (by a run that crashed after its last checkpoint, or
    one resumed from an older checkpoint) out of `path`, so that a resumed run's metrics read
    as one uninterrupted run. Nothing is lost: the moved records are appended to
    ``metrics.dropped.jsonl`` beside it."""
    path = Path(path)
    if not path.is_file():
        return
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) == len(records) and _ends_with_whole_line(path):
        return  # (otherwise the cut last line goes, or the next record would be appended to it)
    with open(path.with_name(DROPPED), "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records if r.get("step", 0) > step)
        f.flush()
        os.fsync(f.fileno())
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


class WandbLogger:
    """Weights & Biases backend (numeric fields of train/eval records)."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config, resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        if record["event"] in ("train", "eval"):
            values = {f"{record['event']}/{k}": v for k, v in record.items()
                      if isinstance(v, (int, float)) and k != "step"}
            self._run.log(values, step=record["step"])

    def close(self) -> None:
        self._run.finish()


class TensorBoardLogger:
    """TensorBoard backend, writing events under RUN/tensorboard."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if record["event"] in ("train", "eval"):
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._writer.add_scalar(f"{record['event']}/{key}", value, record["step"])

    def close(self) -> None:
        self._writer.close()


class MultiLogger:
    """Fans records out to several loggers."""

    def __init__(self, loggers: list[MetricsLogger]) -> None:
        self.loggers = loggers

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


class NullLogger:
    """What non-zero ranks log to."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def open_loggers(run_dir: Path, *, wandb_project: str, tensorboard: bool, config: dict[str, Any]) -> MultiLogger:
    """JSONL always; W&B and TensorBoard when enabled and importable (otherwise a warning)."""
    import logging

    log = logging.getLogger("scratchlm.train")
    loggers: list[MetricsLogger] = [JsonlLogger(run_dir / "metrics.jsonl")]
    if wandb_project:
        try:
            loggers.append(WandbLogger(wandb_project, run_dir, config))
        except ImportError:
            log.warning("trainer.wandb_project is set but wandb is not installed; skipping W&B")
    if tensorboard:
        try:
            loggers.append(TensorBoardLogger(run_dir))
        except ImportError:
            log.warning("trainer.tensorboard is on but tensorboard is not installed; skipping it")
    return MultiLogger(loggers)
