"""`scratchlm bench`: time forward, forward+backward and full training steps of the model.

    scratchlm bench [CONFIG] [--size small] [--model.KEY=VALUE ...] [--mode all]
                    [--batch-size 4] [--context-length 512] [--precision bf16_autocast]
                    [--compile] [--attention-backend flash_triton] [--activation-checkpointing N]
                    [--fused-lm-head] [--profile] [--memory-snapshot FILE] [--json]

Reports mean ± std per mode, peak memory, tokens/s and MFU (see `scratchlm.bench.run`, which
builds the model and times it; this module parses the flags and prints the results).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scratchlm.bench.run import MODES, PRECISIONS, SIZES, BenchOptions, run_bench
from scratchlm.model.attention_backends import attention_backend_names


def _parser() -> argparse.ArgumentParser:
    d = BenchOptions()  # the defaults live in one place: BenchOptions
    p = argparse.ArgumentParser(prog="scratchlm bench", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="TOML preset (its [model] section is used)")
    p.add_argument("--size", choices=sorted(SIZES), help="model shape (default: small without a config)")
    p.add_argument("--mode", choices=(*MODES, "all"), default=d.mode)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--vocab-size", type=int, help="overrides model.vocab_size (default 10000 without a config)")
    p.add_argument("--precision", choices=PRECISIONS, help="default: bf16_autocast on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attention-backend", choices=attention_backend_names())
    p.add_argument("--activation-checkpointing", type=int, default=d.activation_checkpointing, metavar="N",
                   help="checkpoint every N-th block (0: off)")
    p.add_argument("--fused-lm-head", action="store_true", help="chunked fused linear + cross-entropy loss")
    p.add_argument("--optimizer", choices=("scratchlm", "scratchlm_fused", "torch_fused"), default=d.optimizer,
                   help="scratchlm.optim.AdamW (multi-tensor on CUDA), the same with fused=True (one Triton "
                        "kernel per group on CUDA) or torch.optim.AdamW(fused=True)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--profile", action="store_true",
                   help="NVTX ranges (forward/backward/optimizer, per layer) and a torch.profiler table")
    p.add_argument("--memory-snapshot", metavar="FILE", help="dump a CUDA allocator snapshot of one train step")
    p.add_argument("--json", action="store_true", help="print results as one JSON object")
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def _print_table(results: dict[str, Any]) -> None:
    m = results["model"]
    print(f"{results['device']}: d_model {m['d_model']}, {m['num_layers']} layers, {m['num_heads']} heads, "
          f"d_ff {m['d_ff']}, vocab {m['vocab_size']}, {results['params'] / 1e6:.1f}M params; batch "
          f"{results['batch_size']} x {results['context_length']}, {results['precision']}, "
          f"attention {m['attention_backend']}, compile {results['compile']}")
    print(f"{'mode':<18}{'mean ± std (ms)':>22}{'min (ms)':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}")
    for mode, r in results["modes"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r["peak_memory_bytes"] is not None else "-"
        print(f"{mode:<18}{r['mean'] * 1e3:>12.2f} ± {r['std'] * 1e3:<7.2f}{r['min'] * 1e3:>10.2f}"
              f"{r['tokens_per_s']:>12.0f}{r['tflops']:>9.1f}{mfu:>7}{mem:>10}")
    if "profile" in results:
        print(results["profile"])


def bench_command(argv: list[str]) -> int:
    """Entry point of `scratchlm bench`."""
    from scratchlm.config import split_overrides

    positional, overrides = split_overrides(argv)
    args = _parser().parse_args(positional)
    options = BenchOptions(**{k: v for k, v in vars(args).items() if k != "json"})
    results = run_bench(options, overrides)
    if args.json:
        json.dump(results, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(results)
    return 0
