"""``scratchlm encode`` and ``scratchlm download``.

    scratchlm encode data/TinyStoriesV2-GPT4-valid.txt --tokenizer data/tok --out data/valid.bin
    scratchlm download tinystories-valid --out-dir data
    scratchlm download --list
"""

from __future__ import annotations

import argparse
import math
import sys

from scratchlm.errors import UserError

MAX_TIMEOUT = 1e9  # seconds (about 30 years)


def encode_command(argv: list[str]) -> int:
    """Encode a UTF-8 text file to a flat token file plus its .json sidecar, on all cores."""
    parser = argparse.ArgumentParser(
        prog="scratchlm encode",
        description="Encode a UTF-8 text corpus to OUT.bin (uint16, or uint32 for vocabularies "
                    "over 65,536) plus the sidecar OUT.json. Parallel output is identical to "
                    "encoding the whole text at once; an interrupted run resumes.")
    parser.add_argument("input", help="text file (documents separated by <|endoftext|>)")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory")
    parser.add_argument("--out", required=True, metavar="OUT.bin", help="token file to write")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="encoding processes (default: all usable cores)")
    parser.add_argument("--chunk-mb", type=float, default=None, metavar="MB",
                        help="target size of one unit of work (default: automatic, at most 16)")
    parser.add_argument("--errors", choices=("strict", "replace"), default="strict",
                        help="invalid UTF-8: stop with an error (default) or encode U+FFFD")
    parser.add_argument("--overwrite", action="store_true", help="replace a token file already at --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    if args.chunk_mb is not None and not (math.isfinite(args.chunk_mb) and args.chunk_mb > 0):
        raise UserError(f"--chunk-mb must be a positive number of MB, got {args.chunk_mb}")

    from scratchlm.data.token_file import is_token_file, sidecar_path
    from scratchlm.tokenizer.encode_corpus import encode_corpus

    # (An interrupted encode, whose sidecar is gone until it finishes, resumes without --overwrite.)
    if not args.overwrite and is_token_file(args.out):
        raise UserError(f"{args.out} already holds a token file (with its sidecar {sidecar_path(args.out).name}); "
                        "pass --overwrite to replace it, or choose another --out")

    chunk = None if args.chunk_mb is None else max(1, int(args.chunk_mb * (1 << 20)))
    meta = encode_corpus(args.input, args.tokenizer, args.out, num_workers=args.workers,
                         chunk_bytes=chunk, errors=args.errors, progress=not args.no_progress)
    seconds = max(meta["seconds"], 1e-9)
    rate = meta["encoded_bytes"] / seconds / 1e6
    per_token = meta["source_bytes"] / meta["num_tokens"]  # an empty input is refused
    print(f"wrote {args.out}: {meta['num_tokens']:,} tokens ({meta['dtype']}), "
          f"{meta['num_documents']:,} documents, {meta['source_bytes'] / 1e6:.1f} MB in {seconds:.1f} s "
          f"= {rate:.2f} MB/s, {per_token:.2f} bytes/token")
    return 0


def download_command(argv: list[str]) -> int:
    """Download a registered dataset, or list the registry."""
    from scratchlm.data.registry import DATASETS, MIRROR_ENV

    parser = argparse.ArgumentParser(
        prog="scratchlm download",
        description="Download a registered dataset with resume and checksum. "
                    f"Set ${MIRROR_ENV} or --mirror to fetch from another base URL "
                    "(MIRROR/<served file name>).")
    parser.add_argument("name", nargs="?", help=f"dataset name: {', '.join(DATASETS)}")
    parser.add_argument("--list", action="store_true", help="list the registered datasets")
    parser.add_argument("--out-dir", default="data", help="folder to write into (default: data)")
    parser.add_argument("--mirror", default=None, metavar="URL", help="base URL replacing the registry's")
    parser.add_argument("--sha256", default=None, metavar="HEX", help="expected sha256 of the served file")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="seconds to wait on a connect or read (default: 30)")
    parser.add_argument("--retries", type=int, default=3, help="resumed attempts after a failure (default: 3)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)

    if args.list:
        width = max(len(name) for name in DATASETS)
        for entry in DATASETS.values():
            pinned = entry.sha256 or "sha256 not pinned"
            print(f"{entry.name:<{width}}  {entry.description}\n{'':<{width}}  {entry.url()}  ({pinned})")
        return 0
    if not args.name:
        parser.error("give a dataset NAME or --list")
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT):
        # (a socket takes no timeout past ~9.2e9 s: an OverflowError at the first connect)
        raise UserError(f"--timeout must be a positive number of seconds, at most {MAX_TIMEOUT:g}, "
                        f"got {args.timeout}")
    if args.retries < 0:
        raise UserError(f"--retries must be >= 0, got {args.retries}")

    from scratchlm.data.download import download_dataset

    result = download_dataset(args.name, args.out_dir, mirror=args.mirror, sha256=args.sha256,
                              progress=not args.no_progress, timeout=args.timeout, retries=args.retries)
    status = "downloaded" if result.fetched else "already present"
    print(f"{status}: {result.path}")
    if result.sha256:
        check = "verified" if result.verified else "not verified: pass --sha256 HEX to check it"
        print(f"sha256 {result.sha256} ({check})", file=sys.stdout)
    return 0
