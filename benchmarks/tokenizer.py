"""BPE training and encoding, side by side with Hugging Face tokenizers and tiktoken.

For each corpus and vocabulary size:
- training: scratchlm ``train_bpe`` vs ``tokenizers`` BpeTrainer (GPT-2 split regex, byte-level
  alphabet, same special token, same number of threads), wall time and peak RSS, each in a
  fresh subprocess so memory figures do not mix;
- encoding: our Tokenizer (fresh, cold cache), then the same again (warm), vs tiktoken built
  from our own merges, one thread each, on the whole corpus, interleaved ``--encode-repeats``
  times (best of each kept, all in the JSON; each pass's CPU time is recorded too); the ids
  must be identical;
- streaming: ``encode_iterable`` over the file object, sampling RSS as it goes (flat = constant
  memory);
- long pretokens: 100K spaces, 100K newlines and 1 MB of random letters (one pretoken each),
  ours (fresh tokenizer) against Hugging Face ``tokenizers`` loaded from our ``tokenizer.json``,
  ids identical; a check that no input is quadratic.

The encoding line prints ``cold vs tiktoken``, the ratio of speeds (tiktoken time / ours) of a
fresh tokenizer's first pass over the corpus; ``--encode-only`` skips training (it trains our
tokenizer once if the work directory lacks it) and the HF training comparison.

Corpora are Project Gutenberg files from ../shared/data/gutenberg, decompressed once into a
temporary directory (never into the repository).

    python benchmarks/tokenizer.py --quick          # valid.txt (10.7 MB), 10K vocab
    python benchmarks/tokenizer.py                  # also train_00.txt (170 MB), 32K vocab
    python benchmarks/tokenizer.py --quick --encode-only --skip-stream   # the encoding ratio only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gutenberg"
EOT = "<|endoftext|>"


def decompress(name: str, workdir: Path) -> Path:
    """DATA/name.txt.zst -> workdir/name.txt (once)."""
    import zstandard

    out = workdir / f"{name}.txt"
    if not out.exists():
        tmp = out.with_suffix(".part")
        with open(DATA / f"{name}.txt.zst", "rb") as src, open(tmp, "wb") as dst:
            zstandard.ZstdDecompressor().copy_stream(src, dst)
        tmp.rename(out)
    return out


def _peak_rss_mb() -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"peak_rss_mb": round(own, 1), "peak_rss_children_mb": round(children, 1)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --- jobs, each run in a fresh interpreter ---------------------------------------------------

def job_train_ours(corpus: str, vocab_size: int, threads: int, save: str) -> dict:
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe

    timings: dict = {}
    start = time.perf_counter()
    vocab, merges = train_bpe(corpus, vocab_size, [EOT], workers=threads, timings=timings)
    seconds = time.perf_counter() - start
    Tokenizer(vocab, merges, [EOT]).save(save)
    return {"seconds": seconds, "pretokenize_s": timings["pretokenize_s"], "merge_s": timings["merge_s"],
            "num_merges": len(merges), **_peak_rss_mb()}


def job_train_hf(corpus: str, vocab_size: int, threads: int, save: str) -> dict:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # before the library starts its pool
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from scratchlm.tokenizer.pretokenize import GPT2_PAT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_PAT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    start = time.perf_counter()
    tok.train([corpus], trainer)
    seconds = time.perf_counter() - start
    tok.save(save)
    return {"seconds": seconds, "vocab_size": tok.get_vocab_size(), **_peak_rss_mb()}


def job_encode(corpus: str, tokenizer_dir: str, repeats: int = 3) -> dict:
    """Cold pass (fresh Tokenizer), warm pass, tiktoken pass, interleaved ``repeats`` times.

    Times are best-of-repeats for each side; the first cold pass also pays for importing numpy
    (the bulk merger's), reported on its own as ``ours_first_s``.
    """
    import tiktoken

    from scratchlm.tokenizer.pretokenize import GPT2_PAT
    from scratchlm.tokenizer.tokenizer import Tokenizer

    text = Path(corpus).read_text(encoding="utf-8")
    mb = len(text.encode("utf-8")) / 1e6
    first = Tokenizer.load(tokenizer_dir)
    specials = set(first.special_token_ids.values())
    enc = tiktoken.Encoding(name="ours", pat_str=GPT2_PAT,
                            mergeable_ranks={t: i for i, t in first.vocab.items() if i not in specials},
                            special_tokens=dict(first.special_token_ids))
    cold, warm, ref_s = [], [], []
    cpu: dict[str, list[float]] = {"ours": [], "ours_warm": [], "tiktoken": []}
    identical = True

    def timed(fn, wall: list[float], cpu_s: list[float]):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - start_cpu)
        return result

    for _ in range(repeats):
        ours = Tokenizer.load(tokenizer_dir)
        ids = timed(lambda: ours.encode(text), cold, cpu["ours"])
        ids_warm = timed(lambda: ours.encode(text), warm, cpu["ours_warm"])
        ref = timed(lambda: enc.encode(text, allowed_special="all"), ref_s, cpu["tiktoken"])
        identical = identical and ids == ref and ids_warm == ref
        num_tokens = len(ids)
        del ids, ids_warm, ref
    ours_s, warm_s, tiktoken_s = min(cold), min(warm), min(ref_s)
    return {"mb": mb, "num_tokens": num_tokens, "identical": identical, "repeats": repeats,
            "ours_s": ours_s, "ours_warm_s": warm_s, "tiktoken_s": tiktoken_s, "ours_first_s": cold[0],
            "ours_all_s": cold, "ours_warm_all_s": warm, "tiktoken_all_s": ref_s,
            "ours_mb_s": mb / ours_s, "ours_warm_mb_s": mb / warm_s, "tiktoken_mb_s": mb / tiktoken_s,
            "warm_ratio": tiktoken_s / warm_s, "first_ratio": tiktoken_s / cold[0],
            # CPU time of this process per pass: less sensitive than wall time to other jobs
            # taking the cores (all three run on one thread).
            "cpu_all_s": cpu, "cpu_ratio": min(cpu["tiktoken"]) / min(cpu["ours"]),
            "cpu_warm_ratio": min(cpu["tiktoken"]) / min(cpu["ours_warm"]), **_peak_rss_mb()}


def job_stream(corpus: str, tokenizer_dir: str) -> dict:
    from scratchlm.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    samples = []
    count = 0
    start_rss = _rss_mb()
    start = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        for _ in tok.encode_iterable(f):
            count += 1
            if count % 1_000_000 == 0:
                samples.append(round(_rss_mb(), 1))
    seconds = time.perf_counter() - start
    mb = Path(corpus).stat().st_size / 1e6
    return {"num_tokens": count, "seconds": seconds, "mb_s": mb / seconds, "rss_start_mb": round(start_rss, 1),
            "rss_samples_mb": samples, "rss_max_mb": max(samples, default=start_rss)}


def job_long(tokenizer_dir: str) -> dict:
    """Single long pretokens: ours (fresh tokenizer each) against HF tokenizers, same ids."""
    import random

    from tokenizers import Tokenizer as HFTokenizer

    from scratchlm.tokenizer.tokenizer import Tokenizer

    hf = HFTokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    rng = random.Random(0)
    inputs = {"100K spaces": " " * 100_000, "100K newlines": "\n" * 100_000,
              "1 MB random letters": "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=1_000_000))}
    Tokenizer.load(tokenizer_dir).encode("import numpy")  # not timed
    rows = []
    for name, text in inputs.items():
        ours = Tokenizer.load(tokenizer_dir)
        start = time.perf_counter()
        ids = ours.encode(text)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        ref = hf.encode(text).ids
        hf_s = time.perf_counter() - start
        rows.append({"input": name, "ours_s": ours_s, "hf_s": hf_s, "num_tokens": len(ids), "identical": ids == ref})
    return {"rows": rows}


JOBS = {"train_ours": job_train_ours, "train_hf": job_train_hf, "encode": job_encode, "stream": job_stream,
        "long": job_long}


def run_job(name: str, **kwargs) -> dict:
    """Run one job in a fresh interpreter; its JSON result comes back on stdout."""
    cmd = [sys.executable, __file__, "--job", name, "--job-args", json.dumps(kwargs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="valid.txt (10.7 MB) at 10K vocab only")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=1, help="training runs per configuration (best is kept)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "scratchlm-bench-tokenizer")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "tokenizer.json")
    parser.add_argument("--encode-repeats", type=int, default=3,
                        help="interleaved cold/warm/tiktoken encoding passes (best of each is kept)")
    parser.add_argument("--skip-stream", action="store_true")
    parser.add_argument("--encode-only", action="store_true",
                        help="no training comparison: encode with our tokenizer (trained once if missing)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--job-args", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        print(json.dumps(JOBS[args.job](**json.loads(args.job_args))))
        return
    if not DATA.is_dir():
        sys.exit(f"{DATA} not found")
    args.workdir.mkdir(parents=True, exist_ok=True)

    configs = [("valid", 10_000)]
    if not args.quick:
        configs.append(("train_00", 32_000))
    results: dict = {"machine": {"cpus": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
                                 "platform": platform.platform(), "loadavg_start": loadavg()},
                     "train": [], "encode": [], "stream": []}
    for name, vocab_size in configs:
        corpus = decompress(name, args.workdir)
        mb = corpus.stat().st_size / 1e6
        tok_dir = args.workdir / f"ours_{name}_{vocab_size}"
        if args.encode_only:
            if not (tok_dir / "vocab.json").is_file():
                run_job("train_ours", corpus=str(corpus), vocab_size=vocab_size, threads=args.threads,
                        save=str(tok_dir))
            _encode_rows(args, results, corpus, name, vocab_size, tok_dir)
            continue
        ours_runs, hf_runs = [], []
        for _ in range(args.repeats):
            hf_runs.append(run_job("train_hf", corpus=str(corpus), vocab_size=vocab_size, threads=args.threads,
                                   save=str(args.workdir / f"hf_{name}_{vocab_size}.json")))
            ours_runs.append(run_job("train_ours", corpus=str(corpus), vocab_size=vocab_size, threads=args.threads,
                                     save=str(tok_dir)))
        ours = min(ours_runs, key=lambda r: r["seconds"])
        hf = min(hf_runs, key=lambda r: r["seconds"])
        row = {"corpus": name, "mb": mb, "vocab_size": vocab_size, "ours": ours, "hf": hf,
               "ours_all_s": [r["seconds"] for r in ours_runs], "hf_all_s": [r["seconds"] for r in hf_runs],
               "speed_ratio": hf["seconds"] / ours["seconds"], "loadavg": loadavg()}
        results["train"].append(row)
        print(f"train {name} {mb:.1f} MB vocab {vocab_size}: ours {ours['seconds']:.2f} s "
              f"(pretokenize {ours['pretokenize_s']:.2f} + merges {ours['merge_s']:.2f}, "
              f"peak RSS {ours['peak_rss_mb']:.0f} MB main / {ours['peak_rss_children_mb']:.0f} MB worker), "
              f"HF {hf['seconds']:.2f} s (peak RSS {hf['peak_rss_mb']:.0f} MB) -> {row['speed_ratio']:.2f}x HF speed "
              f"[load {row['loadavg']}]", flush=True)

        _encode_rows(args, results, corpus, name, vocab_size, tok_dir)

    results["machine"]["loadavg_end"] = loadavg()
    _print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")


def _encode_rows(args, results: dict, corpus: Path, name: str, vocab_size: int, tok_dir: Path) -> None:
    """The encoding, streaming and long-pretoken jobs for one corpus, printed and added to results."""
    enc = run_job("encode", corpus=str(corpus), tokenizer_dir=str(tok_dir), repeats=args.encode_repeats)
    enc.update(corpus=name, vocab_size=vocab_size, speed_ratio=enc["ours_mb_s"] / enc["tiktoken_mb_s"],
               loadavg=loadavg())
    results["encode"].append(enc)
    print(f"encode {name}: ours {enc['ours_mb_s']:.2f} MB/s cold, {enc['ours_warm_mb_s']:.2f} MB/s warm; "
          f"tiktoken {enc['tiktoken_mb_s']:.2f} MB/s -> {enc['speed_ratio']:.2f}x tiktoken cold, "
          f"{enc['warm_ratio']:.2f}x warm, {enc['first_ratio']:.2f}x first cold pass "
          f"(CPU time: {enc['cpu_ratio']:.2f}x cold, {enc['cpu_warm_ratio']:.2f}x warm); "
          f"identical ids: {enc['identical']} [load {enc['loadavg']}]", flush=True)

    if not args.skip_stream:
        stream = run_job("stream", corpus=str(corpus), tokenizer_dir=str(tok_dir))
        stream.update(corpus=name, vocab_size=vocab_size)
        results["stream"].append(stream)
        print(f"stream {name}: encode_iterable {stream['mb_s']:.2f} MB/s, RSS start {stream['rss_start_mb']:.0f} MB, "
              f"max {stream['rss_max_mb']:.0f} MB over {len(stream['rss_samples_mb'])} samples", flush=True)

    long = run_job("long", tokenizer_dir=str(tok_dir))
    results.setdefault("long", []).append({"corpus": name, "vocab_size": vocab_size, **long})
    for row in long["rows"]:
        print(f"long {row['input']}: ours {row['ours_s']:.3f} s, HF tokenizers {row['hf_s']:.3f} s, "
              f"{row['num_tokens']:,} tokens, identical ids: {row['identical']}", flush=True)


def _print_table(results: dict) -> None:
    for en in results["encode"]:
        print(f"\ncold encoding vs tiktoken ({en['corpus']}, vocab {en['vocab_size']:,}): "
              f"{en['speed_ratio']:.2f}x wall, {en['cpu_ratio']:.2f}x CPU time")
    if not results["train"]:
        return
    print("\n| corpus | vocab | ours train s | HF train s | ratio (HF/ours) | ours peak RSS MB | "
          "ours encode MB/s | tiktoken MB/s | ratio | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tr, en in zip(results["train"], results["encode"]):
        print(f"| {tr['corpus']} ({tr['mb']:.1f} MB) | {tr['vocab_size']:,} | {tr['ours']['seconds']:.2f} | "
              f"{tr['hf']['seconds']:.2f} | {tr['speed_ratio']:.2f}x | "
              f"{max(tr['ours']['peak_rss_mb'], tr['ours']['peak_rss_children_mb']):.0f} | {en['ours_mb_s']:.2f} | "
              f"{en['tiktoken_mb_s']:.2f} | {en['speed_ratio']:.2f}x | {en['identical']} |")


if __name__ == "__main__":
    main()
