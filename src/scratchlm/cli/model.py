"""`scratchlm account` (params, FLOPs, memory of a shape) and `scratchlm export` (to Hugging Face).

Both are thin: they parse flags, load a config or a trained model, and call
``scratchlm.model.accounting`` or ``scratchlm.model.hf``. `account` never imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from scratchlm.errors import UserError
from scratchlm.fileio import check_writable_dir

_TRAIN_SECTIONS = {"model", "data", "optim", "trainer", "parallel"}


def load_model_config(config: str | None, overrides: list[str]) -> Any:
    """ModelConfig from a preset (a full train config or a bare [model] table), a run or step
    directory (its ``config.toml``), or the defaults; then ``--model.key=value`` overrides."""
    return load_account_config(config, overrides)[0]


def load_account_config(config: str | None, overrides: list[str]) -> tuple[Any, str]:
    """(ModelConfig, optimizer name) as `load_model_config` finds them: the optimizer is the
    config's ``optim.name`` ("adamw" for a bare [model] table), then ``--optim.name=NAME``."""
    from scratchlm.config import ConfigError, load_config, parse_override, read_toml, resolve_preset
    from scratchlm.model.config import ModelConfig
    from scratchlm.optim.config import OptimConfig

    preset: Path | None = None
    if config is not None:
        path = Path(config)
        if path.name == "latest" and path.parent.name == "checkpoints" and path.is_file():
            from scratchlm.train.checkpoint import resolve_checkpoint

            path = resolve_checkpoint(path)  # RUN/checkpoints/latest names the newest step directory
        if path.is_dir():
            if not (path / "config.toml").is_file():
                raise UserError(f"{path} is a directory without a config.toml")
            path = path / "config.toml"
        preset = resolve_preset(path)
    optimizer_overrides = [text for text in overrides if text.split("=", 1)[0] == "--optim.name"]
    for text in overrides:
        if not text.startswith("--model.") and text not in optimizer_overrides:
            raise ConfigError(f"override {text.split('=', 1)[0]!r}: account only reads --model.* keys "
                              f"and --optim.name")
    data: dict[str, Any] = {}
    if preset is not None:
        data = read_toml(preset)
    if not data or set(data) & _TRAIN_SECTIONS:
        from scratchlm.train.config import TrainConfig

        train = load_config(TrainConfig, preset, overrides)
        return train.model, train.optim.name
    # A file holding only the model's keys.
    bare = [f"--{text[len('--model.'):]}" for text in overrides if text not in optimizer_overrides]
    optim = load_config(OptimConfig, None, [f"--name={parse_override(text)[1]}" for text in optimizer_overrides])
    return load_config(ModelConfig, preset, bare), optim.name


def _si(n: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def format_report(cfg: Any, report: dict[str, Any]) -> str:
    """The human-readable table of `scratchlm account`."""
    p = report["params_breakdown"]
    f = report["forward_flops_breakdown"]
    m = report["train_memory_bytes"]
    total_flops = report["forward_flops"]
    rows: list[tuple[str, str, str]] = []
    shape = (f"V={cfg.vocab_size} T={cfg.context_length} D={cfg.d_model} L={cfg.num_layers} "
             f"H={cfg.num_heads} F={cfg.d_ff} ffn={cfg.ffn} attention={cfg.attention_backend}"
             f"{' tied' if cfg.tie_embeddings else ''}{'' if cfg.use_rmsnorm else ' no-rmsnorm'}")
    if "moe" in report:
        moe = report["moe"]
        capacity = "dropless" if moe["capacity_factor"] is None else f"capacity {moe['capacity_factor']:g}"
        shape += f" (experts={moe['num_experts']} top_k={moe['top_k']} shared={moe['shared']} {capacity})"
    lines = [f"model: {shape}", ""]
    rows.append(("parameters", f"{p['total']:,}", _si(p["total"])))
    for key in ("embedding", "attention", "ffn", "norm", "lm_head"):
        rows.append((f"  {key}", f"{p[key]:,}", f"{100 * p[key] / p['total']:.1f}%"))
    rows.append(("  non-embedding", f"{p['non_embedding']:,}", _si(p["non_embedding"])))
    if p["active"] != p["total"]:
        rows.append(("  active per token", f"{p['active']:,}", _si(p["active"])))
    rows.append(("forward FLOPs / sequence", f"{total_flops:,}", _si(total_flops, "FLOP")))
    for key in ("qkvo", "attention", "ffn", "lm_head"):
        rows.append((f"  {key}", f"{f[key]:,}", f"{100 * f[key] / total_flops:.1f}%"))
    rows.append(("forward FLOPs / token", f"{report['forward_flops_per_token']:,}",
                 _si(report["forward_flops_per_token"], "FLOP")))
    rows.append(("train FLOPs / token (3x)", f"{report['train_flops_per_token']:,}",
                 _si(report["train_flops_per_token"], "FLOP")))
    per_param = m["static"] / p["total"]
    rows.append((f"static memory ({report['optimizer']}, {per_param:.3g} B/param)", f"{m['static']:,}",
                 _gib(m["static"])))
    rows.append(("activations / sequence (fp32)", f"{m['activations_per_sequence']:,}",
                 _gib(m["activations_per_sequence"])))
    if "max_batch_size" in report:
        rows.append((f"max batch in {report['memory_budget_gib']:g} GiB", str(report["max_batch_size"]), ""))
    width = max(len(r[0]) for r in rows)
    num = max(len(r[1]) for r in rows)
    lines += [f"{a:<{width}}  {b:>{num}}  {c}".rstrip() for a, b, c in rows]
    lines += ["", "attention FLOPs count the full T x T products (no causal halving)."]
    return "\n".join(lines)


def account_command(argv: list[str]) -> int:
    """`scratchlm account [CONFIG] [--model.key=value ...] [--optim.name=NAME] [--json] [--memory-gib N]`."""
    from scratchlm.config import split_overrides
    from scratchlm.model.accounting import account, max_batch_size

    positional, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(
        prog="scratchlm account",
        description="Parameters, forward FLOPs and training memory of a model shape. "
        "Override the shape with --model.key=value (e.g. --model.d_model=768), and the optimizer "
        "whose state the memory counts with --optim.name=adamw|muon (default: the config's).",
    )
    parser.add_argument("config", nargs="?", help="preset name or TOML file, or a run/step directory")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="also report the largest fp32 batch that fits in this much memory")
    args = parser.parse_args(positional)
    if args.memory_gib is not None and not (math.isfinite(args.memory_gib * 2**30) and args.memory_gib > 0):
        raise UserError(f"--memory-gib must be a positive number of GiB, got {args.memory_gib}")
    cfg, optimizer = load_account_config(args.config, overrides)
    report = account(cfg, optimizer)
    if args.memory_gib is not None:
        report["memory_budget_gib"] = args.memory_gib
        report["max_batch_size"] = max_batch_size(cfg, int(args.memory_gib * 2**30), optimizer)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(cfg, report))
    return 0


def export_command(argv: list[str]) -> int:
    """`scratchlm export RUN_OR_CHECKPOINT --to hf OUT [--overwrite]`."""
    parser = argparse.ArgumentParser(
        prog="scratchlm export",
        description="Export a trained model as a Hugging Face directory (config.json, generation_config.json, "
        "model.safetensors, tokenizer files): Llama, or for a mixture-of-experts model Mixtral (renormalised "
        "top-k gates, no shared experts) or Qwen2-MoE (raw top-k probabilities or shared experts).",
    )
    parser.add_argument("source", help="run directory, step directory or checkpoint file")
    parser.add_argument("--to", choices=["hf"], default="hf", help="target format (only 'hf')")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty OUT")
    args = parser.parse_args(argv)

    out = Path(args.out)
    check_writable_dir(out, f"output {out}")  # before the model loads (also a symbolic link loop)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory")
    if (out / "model.safetensors").is_file() and (out / "config.toml").is_file():
        raise UserError(f"{out} is a scratchlm checkpoint: exporting into it would replace its weights; "
                        "choose another output directory")
    if (out / "checkpoints").is_dir() or (out / "config.toml").is_file():
        # Its weights beside config.toml would make it read as a step directory, not as the run.
        raise UserError(f"{out} is a scratchlm run directory: exporting into it would hide its checkpoints; "
                        "choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"{out} is not empty (pass --overwrite to replace its files)")
    source = Path(args.source)
    if not source.exists():
        raise FileNotFoundError(2, "No such file or directory", str(source))

    from scratchlm.model.hf import EXPORT_FILES, check_exportable, export_hf
    from scratchlm.train.checkpoint import load_trained_model

    model, cfg, tokenizer = load_trained_model(source, device="cpu")
    check_exportable(cfg)
    if tokenizer is not None:
        from scratchlm.cli.infer import check_tokenizer_fits
        from scratchlm.tokenizer.io import hf_unsupported

        check_tokenizer_fits(tokenizer, cfg.vocab_size, args.source)
        why = hf_unsupported(tokenizer)
        if why is not None:
            raise UserError(f"cannot export the tokenizer: {why}")
    created = not out.exists()
    if out.is_dir():
        # Files of an earlier export that this one might not rewrite (e.g. tokenizer files).
        for name in EXPORT_FILES:
            (out / name).unlink(missing_ok=True)
    try:
        written = export_hf(model, cfg, out, tokenizer=tokenizer)
    except BaseException:
        # A disk that fills up, or Ctrl-C: leave no half-written export behind.
        for name in EXPORT_FILES:
            (out / name).unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    architecture = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    print(f"exported {source} to {out} as {architecture} ({', '.join(sorted(p.name for p in written))})")
    return 0
