"""Tables and curves for the training benchmark (benchmarks/training_h200.sh).

Reads ``RUNS/<name>/metrics.jsonl`` of scratchlm runs (train records carry ``tokens_per_s`` over
the window since the previous record; eval records ``val_loss``) and of the torch.nn reference
(``RUNS/reference``: eval records carry ``tokens`` and ``train_seconds``), rebuilds each run's
validation loss against tokens and against training seconds, and writes ``training.json``,
``training.md`` (the table) and ``training_curves.png``.

    python benchmarks/training_report.py /tmp/gutenberg/runs --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    results = {}
    for run in sorted(p for p in args.runs.iterdir() if p.is_dir()):
        try:
            results[run.name] = reference_curve(run) if run.name == "reference" else scratchlm_curve(run)
        except (OSError, KeyError, ValueError) as exc:
            results[run.name] = {"error": f"{type(exc).__name__}: {exc}"}
    (args.out / "training.json").write_text(json.dumps(results, indent=2))

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
