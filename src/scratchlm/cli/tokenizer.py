"""``scratchlm train-bpe`` and ``scratchlm tokenizer-stats``."""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path

from scratchlm.errors import UserError
from scratchlm.fileio import check_writable_dir, resolve_path, write_text_atomic

SUMMARY_FILE = "train_bpe.json"  # what train-bpe writes beside the tokenizer files


def _peak_rss_mb() -> tuple[float, float]:
    """Peak resident memory (MB) of this process and of its largest finished child (Linux: KB units)."""
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / (1024 * 1024)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    return own, children


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def train_bpe_command(argv: list[str]) -> int:
    """Train a byte-level BPE tokenizer on a text file and save it as a tokenizer directory."""
    parser = argparse.ArgumentParser(
        prog="scratchlm train-bpe",
        description="Train a byte-level BPE tokenizer (GPT-2 pretokenization) on a UTF-8 text file.",
    )
    parser.add_argument("input", type=Path, help="UTF-8 text file (documents separated by a special token)")
    parser.add_argument("--vocab-size", type=_positive, required=True,
                        help="256 bytes + merges + special tokens")
    parser.add_argument("--special-token", action="append", default=[], dest="special_tokens",
                        metavar="TOKEN", help="special token, e.g. '<|endoftext|>' (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="tokenizer directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --out")
    parser.add_argument("--workers", type=_positive, default=None, help="pretokenization processes (default: all cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    from scratchlm.data.token_file import is_token_file
    from scratchlm.tokenizer.io import TOKENIZER_FILES
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe

    if is_token_file(args.input):
        raise UserError(f"{args.input} is a token file (written by `scratchlm encode`), not text; "
                        "train-bpe reads a UTF-8 text file, such as the file that was encoded")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"{args.out}: exists and is not a directory")
    check_writable_dir(args.out, f"--out {args.out}")  # now, not once the training is done
    source = resolve_path(args.input, str(args.input))
    for name in (*TOKENIZER_FILES, SUMMARY_FILE):
        if resolve_path(args.out / name, f"--out {args.out}") == source:
            raise UserError(f"{args.input} is the {name} that train-bpe writes in --out {args.out}: it would be "
                            "overwritten; move the text or choose another --out")
    found = [name for name in TOKENIZER_FILES if (args.out / name).exists()]
    if found and not args.overwrite:
        raise UserError(f"{args.out} already holds a tokenizer: {', '.join(found)} (pass --overwrite to replace it)")
    start = time.perf_counter()
    timings: dict[str, float] = {}
    vocab, merges = train_bpe(args.input, args.vocab_size, args.special_tokens, workers=args.workers,
                              progress=not args.quiet, timings=timings)
    t_save = time.perf_counter()
    tokenizer = Tokenizer(vocab, merges, args.special_tokens)
    tokenizer.save(args.out)
    total = time.perf_counter() - start
    own_mb, child_mb = _peak_rss_mb()
    summary = {
        "input": str(args.input),
        "input_bytes": args.input.stat().st_size,
        "vocab_size": tokenizer.vocab_size,
        "requested_vocab_size": args.vocab_size,
        "num_merges": len(merges),
        "special_tokens": tokenizer.special_token_ids,
        "workers": int(timings["workers"]),
        "pretokenize_s": round(timings["pretokenize_s"], 3),
        "merge_s": round(timings["merge_s"], 3),
        "save_s": round(time.perf_counter() - t_save, 3),
        "total_s": round(total, 3),
        "peak_rss_mb": round(own_mb, 1),
        "peak_rss_worker_mb": round(child_mb, 1),
        "tokenizer_hash": tokenizer.hash,
    }
    write_text_atomic(args.out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    if len(merges) < args.vocab_size - 256 - len(tokenizer.special_tokens):
        print(f"note: the corpus ran out of pairs after {len(merges):,} merges; "
              f"vocabulary has {tokenizer.vocab_size:,} tokens", file=sys.stderr)
    mb = summary["input_bytes"] / 1e6
    print(f"trained {tokenizer.vocab_size:,} tokens on {mb:,.1f} MB -> {args.out}")
    print(f"  pretokenize {summary['pretokenize_s']:.2f} s ({mb / max(timings['pretokenize_s'], 1e-9):.1f} MB/s, "
          f"{summary['workers']} worker{'s' if summary['workers'] > 1 else ''})")
    print(f"  merges      {summary['merge_s']:.2f} s ({len(merges):,} merges)")
    print(f"  save        {summary['save_s']:.2f} s")
    print(f"  total       {total:.2f} s")
    print(f"  peak RSS    {own_mb:,.0f} MB (main), {child_mb:,.0f} MB (largest worker)")
    print(f"  hash        {tokenizer.hash[:16]}")
    return 0


def tokenizer_stats_command(argv: list[str]) -> int:
    """Print compression and vocabulary statistics of a tokenizer on the start of a text file."""
    parser = argparse.ArgumentParser(
        prog="scratchlm tokenizer-stats",
        description="Compression (bytes/token), token lengths, vocabulary usage and frequent tokens on a sample.",
    )
    parser.add_argument("tokenizer_dir", type=Path, help="directory written by train-bpe")
    parser.add_argument("sample", type=Path, help="UTF-8 text file; its first --max-mb MB are used")
    parser.add_argument("--max-mb", type=float, default=10.0, help="sample size in MB (default 10)")
    parser.add_argument("--top", type=_positive, default=20, help="entries in the top lists (default 20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a report")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.max_mb) and args.max_mb > 0):
        raise UserError(f"--max-mb must be a positive number, got {args.max_mb}")

    from scratchlm.tokenizer.stats import format_stats, read_sample, tokenizer_stats
    from scratchlm.tokenizer.tokenizer import Tokenizer

    from scratchlm.data.token_file import read_sidecar

    if args.sample.suffix == ".bin" and args.sample.is_file() and read_sidecar(args.sample) is not None:
        raise UserError(f"{args.sample} is a token file (written by `scratchlm encode`), not text; "
                        "tokenizer-stats reads a UTF-8 text sample, such as the file that was encoded")
    tokenizer = Tokenizer.load(args.tokenizer_dir)
    text = read_sample(args.sample, int(args.max_mb * 1e6))
    if not text and args.sample.stat().st_size:
        raise UserError(f"{args.sample}: --max-mb {args.max_mb:g} reads no whole character of it; "
                        "give a larger --max-mb")
    if not text:
        raise UserError(f"{args.sample}: the sample is empty")
    stats = tokenizer_stats(tokenizer, text, top=args.top)
    stats["sample_file"] = str(args.sample)
    print(json.dumps(stats, indent=2, ensure_ascii=False) if args.json else format_stats(stats))
    return 0
