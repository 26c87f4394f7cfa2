"""Loss and learning-rate curves of a run as PNG files (matplotlib, Agg backend: no display)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


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
    fig.savefig(out_dir / "loss.png")
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
    fig.savefig(out_dir / "lr.png")
    plt.close(fig)
    written.append(out_dir / "lr.png")
    return written
