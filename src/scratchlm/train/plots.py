"""Loss and learning-rate curves of a run as PNG files (matplotlib, Agg backend: no display).

Figures are written whole (`save_figure`): plots are redrawn during a run, and a process killed
or a disk filled while one is drawn leaves the previous picture, not a cut file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from scratchlm.fileio import atomic_open


def plot_metrics(records: list[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """Write ``loss.png`` (train and validation loss against step) and ``lr.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    train = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", linewidth=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, out_dir / "loss.png")
    plt.close(fig)
    written.append(out_dir / "loss.png")

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    if train:
        ax.plot([r["step"] for r in train], [r["lr"] for r in train])
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("learning-rate schedule")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out_dir / "lr.png")
    plt.close(fig)
    written.append(out_dir / "lr.png")
    return written


def save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure as PNG, replacing `path` in one step (`scratchlm.fileio.atomic_open`)."""
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    return Path(path)
