"""Loss and learning-rate plots, and the sweep's plot: written whole or not at all."""

import errno
import io
import os

import pytest

from scratchlm.train import sweep as sweep_mod
from scratchlm.train.plots import plot_metrics


@pytest.fixture
def disk_fills_while_saving(monkeypatch):
    """From then on, a figure saves half its PNG bytes wherever it is saved, then fails."""
    from matplotlib.figure import Figure

    real = Figure.savefig

    def fill() -> None:
        def savefig(self, fname, **kwargs):
            data = io.BytesIO()
            real(self, data, **{**kwargs, "format": "png"})
            half = data.getvalue()[: len(data.getvalue()) // 2]
            if hasattr(fname, "write"):
                fname.write(half)
            else:
                with open(fname, "wb") as f:
                    f.write(half)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(Figure, "savefig", savefig)

    return fill


RECORDS = [{"event": "train", "step": s, "loss": 5.0 - s / 10, "lr": 1e-3} for s in range(1, 5)] + \
          [{"event": "eval", "step": 4, "val_loss": 4.8}]


def test_plots_are_png_files(tmp_path):
    paths = plot_metrics(RECORDS, tmp_path)
    assert [p.name for p in paths] == ["loss.png", "lr.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_a_plot_that_fails_midway_keeps_the_previous_picture(tmp_path, disk_fills_while_saving):
    # The figures were saved straight into loss.png and lr.png: a full disk (or a kill) while a
    # plot was redrawn left a cut PNG in place of the last good one.
    plot_metrics(RECORDS, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    disk_fills_while_saving()
    with pytest.raises(OSError, match="No space left"):
        plot_metrics(RECORDS[:2], tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary file either


def test_a_sweep_plot_that_fails_midway_keeps_the_previous_picture(tmp_path, disk_fills_while_saving):
    rows = [{"values": {"optim.lr": lr}, "final_val_loss": loss} for lr, loss in ((1e-3, 4.0), (3e-3, 3.5))]
    path = sweep_mod.plot_sweep(rows, tmp_path / "sweep.png")
    before = path.read_bytes()
    disk_fills_while_saving()
    with pytest.raises(OSError, match="No space left"):
        sweep_mod.plot_sweep(rows[:1], path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["sweep.png"]
