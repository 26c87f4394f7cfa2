"""`scratchlm sweep`: train every point of a grid of config values, then summarise and plot."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from scratchlm.config import split_overrides
from scratchlm.errors import UserError


def sweep_command(argv: list[str]) -> int:
    """scratchlm sweep [CONFIG] --grid KEY=V1,V2 [--grid ...] [--out DIR] [--section.key=value ...]"""
    from scratchlm.train.sweep import parse_grid, plan_sweep, run_sweep

    parser = argparse.ArgumentParser(
        prog="scratchlm sweep",
        description="Train one run per point of the cartesian product of the --grid values, one after "
                    "another, each in OUT/<key=value__...>; skip points that finished and resume unfinished "
                    "ones, so rerunning the same command continues a killed or interrupted sweep (Ctrl-C or "
                    "SIGTERM checkpoints the point in training and stops the sweep). Writes summary.jsonl, "
                    "summary.md and sweep.png to OUT. Other --section.key=value overrides apply to every point.")
    parser.add_argument("config", nargs="?", help="TOML config or preset name (default: built-in defaults)")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="a swept config key and its comma-separated values (repeat for more keys)")
    parser.add_argument("--out", help="the sweep's folder (default: the config's trainer.out_dir)")
    positional, overrides = split_overrides(argv)
    args = parser.parse_args(positional)
    if args.out is not None and not args.out.strip():  # would be the current directory: an unset $VARIABLE
        raise UserError("--out is empty; name the sweep's folder (e.g. runs/sweep-lr, or . on purpose)")
    axes = parse_grid(args.grid)
    points = plan_sweep(args.config, overrides, axes, args.out)
    out = Path(args.out) if args.out else points[0].run_dir.parent
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"sweep of {len(points)} points into {out}")
    rows = run_sweep(points, out)
    failed = sum("error" in row for row in rows)
    print(f"summary: {out / 'summary.md'}, {out / 'summary.jsonl'}; plot: {out / 'sweep.png'}"
          + (f"; {failed} point(s) failed" if failed else ""))
    return 1 if failed == len(rows) else 0
