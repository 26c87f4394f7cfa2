"""Corpus encoding throughput: `encode_corpus` with 1..N workers beside tiktoken and HF tokenizers.

    python benchmarks/encode.py --tokenizer DIR [--input FILE] [--workers 1 2] [--repeats 2]

Without --input, the Gutenberg validation books (../shared/data/gutenberg/valid.txt.zst) are
decompressed into a temporary folder. The peers load the same vocabulary and merges (tiktoken
from the byte ranks, `tokenizers` from the exported tokenizer.json) and must give the same ids;
they encode the text in memory, while `encode_corpus` reads the file and writes the token file,
so its figures include I/O and process start-up. Best of --repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from scratchlm.tokenizer.encode_corpus import encode_corpus
from scratchlm.tokenizer.pretokenize import GPT2_PAT
from scratchlm.tokenizer.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
GUTENBERG_VALID = REPO.parent / "shared" / "data" / "gutenberg" / "valid.txt.zst"
EOT = "<|endoftext|>"


def decompress(src: Path, dest: Path) -> Path:
    import zstandard

    with open(src, "rb") as f, open(dest, "wb") as out:
        zstandard.ZstdDecompressor().copy_stream(f, out)
    return dest


def best_of(repeats: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (Tokenizer.save)")
    parser.add_argument("--input", default=None, help="UTF-8 text file (default: Gutenberg valid)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=str(REPO / "docs" / "benchmarks" / "encode.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = Path(args.input) if args.input else decompress(GUTENBERG_VALID, tmp / "valid.txt")
        text = src.read_text(encoding="utf-8")
        size = src.stat().st_size
        tok = Tokenizer.load(args.tokenizer)
        rows: list[dict] = []
        reference = None
        for workers in args.workers:
            seconds, _ = best_of(args.repeats, lambda: encode_corpus(
                src, args.tokenizer, tmp / "out.bin", num_workers=workers, progress=False))
            ids = np.fromfile(tmp / "out.bin", dtype="<u2")
            reference = ids if reference is None else reference
            rows.append({"name": f"scratchlm encode_corpus, {workers} worker(s)", "seconds": seconds,
                         "same_ids": bool(np.array_equal(ids, reference))})

        try:
            import tiktoken

            specials = set(tok.special_token_ids.values())
            enc = tiktoken.Encoding(name="scratchlm", pat_str=GPT2_PAT,
                                    mergeable_ranks={t: i for i, t in tok.vocab.items() if i not in specials},
                                    special_tokens=dict(tok.special_token_ids))
            seconds, ids = best_of(args.repeats, lambda: enc.encode(text, allowed_special="all"))
            rows.append({"name": "tiktoken encode, 1 thread", "seconds": seconds,
                         "same_ids": bool(np.array_equal(np.asarray(ids), reference))})
            docs = text.split(EOT)
            threads = max(args.workers)
            seconds, _ = best_of(args.repeats, lambda: enc.encode_ordinary_batch(docs, num_threads=threads))
            rows.append({"name": f"tiktoken encode_ordinary_batch, {threads} threads", "seconds": seconds,
                         "same_ids": None})
        except ImportError:
            pass
        try:
            from tokenizers import Tokenizer as HFTokenizer

            hf = HFTokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
            docs = text.split(EOT)
            seconds, _ = best_of(args.repeats, lambda: hf.encode_batch(docs, add_special_tokens=False))
            rows.append({"name": "HF tokenizers encode_batch (its own threads)", "seconds": seconds,
                         "same_ids": None})
        except ImportError:
            pass

    base = rows[0]["seconds"]
    print(f"{size / 1e6:.1f} MB, {len(reference):,} tokens, {size / len(reference):.2f} bytes/token, "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
    print(f"{'':48} {'seconds':>8} {'MB/s':>7} {'vs 1 worker':>11}  same ids")
    for row in rows:
        row["mb_per_s"] = size / row["seconds"] / 1e6
        row["speedup_vs_first"] = base / row["seconds"]
        same = "-" if row["same_ids"] is None else ("yes" if row["same_ids"] else "NO")
        print(f"{row['name']:48} {row['seconds']:8.2f} {row['mb_per_s']:7.2f} {row['speedup_vs_first']:10.2f}x  {same}")
    result = {"input": str(args.input or GUTENBERG_VALID), "bytes": size, "tokens": int(len(reference)),
              "cpus": os.cpu_count(), "repeats": args.repeats, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
