"""Tables and curves for the training benchmark (docs/benchmarks/training.md).

Reads ``RUNS/<name>/metrics.jsonl`` of scratchlm runs (train records carry ``tokens_per_s`` over
the window since the previous record; eval records ``val_loss``) and of the torch.nn reference
(``RUNS/reference``: eval records carry ``tokens`` and ``train_seconds``), rebuilds each run's
validation loss against tokens and against training seconds, and writes ``training.json``,
``training.md`` (the table) and ``training_curves.png`` to ``--out``.

With ``--seeds FILE``, also the seed study: the runs named ``scratchlm_s<N>`` and
``reference_s<N>`` (the same seed N on both sides), each side's final validation loss per seed,
their difference and its mean, written to FILE as ``{"val_loss_by_step": {run: {step: loss}}}``.

    python benchmarks/training_report.py RUNS --out OUT [--seeds OUT/seeds.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tomllib
from pathlib import Path

from scratchlm.bench.results import read_jsonl


def scratchlm_curve(run: Path) -> dict:
    cfg = tomllib.loads((run / "config.toml").read_text())
    tokens_per_step = cfg["trainer"]["batch_size"] * cfg["model"]["context_length"]
    records = read_jsonl(run / "metrics.jsonl")
    seconds, prev_step, at_step, rates = 0.0, 0, {0: 0.0}, []
    for r in records:
        if r["event"] == "train" and r["step"] > prev_step:
            seconds += (r["step"] - prev_step) * tokens_per_step / r["tokens_per_s"]
            rates.append(r["tokens_per_s"])
            prev_step = r["step"]
            at_step[r["step"]] = seconds
    evals = [r for r in records if r["event"] == "eval"]
    points = [{"step": e["step"], "tokens": e["step"] * tokens_per_step,
               "seconds": at_step.get(e["step"]), "val_loss": e["val_loss"]} for e in evals]
    total_tokens = prev_step * tokens_per_step
    return {"points": points, "tokens": total_tokens, "seconds": seconds,
            "tokens_per_s": total_tokens / seconds if seconds else None,
            "steady_tokens_per_s": statistics.median(rates[2:]) if len(rates) > 4 else None,
            "final_val_loss": points[-1]["val_loss"] if points else None,
            "peak_memory_gb": max((r.get("memory_gb") or 0) for r in records if r["event"] == "train")}


def reference_curve(run: Path) -> dict:
    records = read_jsonl(run / "metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text())
    points = [{"step": r["step"], "tokens": r["tokens"], "seconds": r["train_seconds"], "val_loss": r["val_loss"]}
              for r in records if r["event"] == "eval"]
    return {"points": points, "tokens": summary["tokens"], "seconds": summary["train_seconds"],
            "tokens_per_s": summary["tokens_per_second"], "steady_tokens_per_s": None,
            "final_val_loss": summary["final_val_loss"],
            "peak_memory_gb": (summary.get("peak_memory_bytes") or 0) / 1e9}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=Path, metavar="FILE",
                        help="also compare the seed runs (scratchlm_sN, reference_sN) and write them to FILE")
    return parser


def seed_study(runs: Path) -> tuple[dict[str, dict[int, float]], list[str]]:
    """({run: {step: val_loss}} of the seed runs under ``runs``, the printed comparison lines)."""
    final = {}
    for run in sorted(runs.iterdir()):
        if not re.search(r"_s\d+$", run.name) or not (run / "metrics.jsonl").is_file():
            continue
        evals = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "eval"]
        final[run.name] = {e["step"]: e["val_loss"] for e in evals}
    seeds = sorted({name.rsplit("_s", 1)[-1] for name in final}, key=int)

    def last(name):
        return final[name][max(final[name])] if final.get(name) else None

    pairs = {s: (last(f"scratchlm_s{s}"), last(f"reference_s{s}")) for s in seeds}
    lines = []
    for s, (a, b) in pairs.items():
        lines.append(f"seed {s}: scratchlm {a}  reference {b}" + (f"  delta {a - b:+.4f}" if a and b else ""))
    both = [(a, b) for a, b in pairs.values() if a and b]
    if both:
        lines.append(f"mean: scratchlm {statistics.mean(a for a, _ in both):.4f}  reference "
                     f"{statistics.mean(b for _, b in both):.4f}  delta {statistics.mean(a - b for a, b in both):+.4f}")
    return final, lines


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    results = {}
    for run in sorted(p for p in args.runs.iterdir() if p.is_dir()):
        try:
            results[run.name] = (reference_curve(run) if run.name.split("_s")[0] == "reference"
                              else scratchlm_curve(run))
        except (OSError, KeyError, ValueError) as exc:
            results[run.name] = {"error": f"{type(exc).__name__}: {exc}"}
    (args.out / "training.json").write_text(json.dumps(results, indent=2))
    if args.seeds:
        final, lines = seed_study(args.runs)
        print("\n".join(lines))
        args.seeds.parent.mkdir(parents=True, exist_ok=True)
        args.seeds.write_text(json.dumps({"val_loss_by_step": final}, indent=2))

    base = results.get("scratchlm", {})
    ref = results.get("reference", {})
    lines = ["| run | final val loss | Δ vs scratchlm | tokens/s | train s | peak GB |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | |")
            continue
        delta = (r["final_val_loss"] - base["final_val_loss"]) if base.get("final_val_loss") else float("nan")
        lines.append(f"| {name} | {r['final_val_loss']:.4f} | {delta:+.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['seconds']:.1f} | {r['peak_memory_gb']:.2f} |")
    if base.get("tokens_per_s") and ref.get("tokens_per_s"):
        lines.append("")
        lines.append(f"scratchlm / reference tokens/s: {base['tokens_per_s'] / ref['tokens_per_s']:.3f}x; "
                     f"val loss difference {base['final_val_loss'] - ref['final_val_loss']:+.4f}")
    table = "\n".join(lines)
    (args.out / "training.md").write_text(table + "\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tok, ax_sec) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        pts = [p for p in r.get("points", []) if p["step"] > 0]
        if not pts:
            continue
        ax_tok.plot([p["tokens"] / 1e6 for p in pts], [p["val_loss"] for p in pts], marker="o", label=name)
        if name in ("scratchlm", "reference"):
            ax_sec.plot([p["seconds"] for p in pts if p["seconds"] is not None],
                        [p["val_loss"] for p in pts if p["seconds"] is not None], marker="o", label=name)
    ax_tok.set(xlabel="tokens (M)", ylabel="validation loss", title="validation loss vs tokens")
    ax_sec.set(xlabel="training seconds (H200)", ylabel="validation loss", title="validation loss vs wall-clock")
    for ax in (ax_tok, ax_sec):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "training_curves.png", dpi=110)


if __name__ == "__main__":
    main()
