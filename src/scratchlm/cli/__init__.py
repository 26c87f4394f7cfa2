"""The ``scratchlm`` console script.

All command-line code lives in this package, one module per command group (``cli/train.py``
holds ``train`` and ``eval``, ``cli/tokenizer.py`` holds ``train-bpe`` and
``tokenizer-stats``, ...): argument parsing, printing and the orchestration of library calls.
The library packages hold no command-line code and never import this package.

This module only maps names to ``module:function`` and imports the one that runs, so
``scratchlm --help`` starts instantly and a tokenizer command never imports torch. Command
functions take ``argv`` (the words after the command name) and return an exit code.
"""

from __future__ import annotations

import errno
import importlib
import sys
from collections.abc import Sequence

from scratchlm.errors import UserError

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "quickstart": ("scratchlm.cli.quickstart", "quickstart_command",
                   "run the whole pipeline offline on CPU in a few minutes"),
    "download": ("scratchlm.cli.data", "download_command",
                 "download a registered dataset (with resume and checksum)"),
    "train-bpe": ("scratchlm.cli.tokenizer", "train_bpe_command",
                  "train a byte-level BPE tokenizer on a text file"),
    "tokenizer-stats": ("scratchlm.cli.tokenizer", "tokenizer_stats_command",
                        "compression and vocabulary statistics of a tokenizer on a sample"),
    "encode": ("scratchlm.cli.data", "encode_command",
               "encode a text corpus to a flat token file (uint16; uint32 past 65,536 ids), on all cores"),
    "train": ("scratchlm.cli.train", "train_command",
              "train a Transformer LM from a TOML config"),
    "sweep": ("scratchlm.cli.sweep", "sweep_command", "train a run per point of a grid of config values"),
    "eval": ("scratchlm.cli.train", "eval_command",
             "validation loss of a trained model on a token file"),
    "generate": ("scratchlm.cli.infer", "generate_command",
                 "sample text from a trained model (KV cache, top-k, top-p)"),
    "account": ("scratchlm.cli.model", "account_command",
                "parameters, FLOPs and training memory of a model shape"),
    "export": ("scratchlm.cli.model", "export_command",
               "export a trained model as a Hugging Face Llama directory"),
    "bench": ("scratchlm.cli.bench", "bench_command",
              "time forward, backward and training steps of a model shape"),
    "sft": ("scratchlm.cli.align", "sft_command",
            "supervised fine-tuning on prompt/response pairs"),
    "expert-iteration": ("scratchlm.cli.align", "expert_iteration_command",
                         "expert iteration with verifiable rewards"),
    "grpo": ("scratchlm.cli.align", "grpo_command",
             "GRPO with verifiable rewards"),
    "dpo": ("scratchlm.cli.align", "dpo_command", "direct preference optimisation on chosen/rejected pairs"),
    "eval-math": ("scratchlm.cli.align", "eval_math_command",
                  "evaluate a model on GSM8K / MATH with answer checking"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: scratchlm <command> [args] [--section.key=value ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `scratchlm <command> --help` for a command's options."]
    return "\n".join(lines)


def _resolve(name: str):
    module_name, func_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        return getattr(module, func_name)
    except (ImportError, AttributeError) as exc:
        missing = getattr(exc, "name", None)
        if missing and not str(missing).startswith("scratchlm"):
            raise UserError(f"command {name!r} needs the package {missing!r}; install it first") from exc
        raise UserError(f"command {name!r} is not available in this installation ({exc})") from exc


def _debug_requested(args: list[str]) -> bool:
    """`--debug` anywhere on the line (removed from `args`) or SCRATCHLM_DEBUG=1: show tracebacks."""
    import os

    flag = "--debug" in args
    while "--debug" in args:
        args.remove("--debug")
    return flag or os.environ.get("SCRATCHLM_DEBUG", "") not in ("", "0")


def _one_line(exc: BaseException) -> str:
    """The exception as one line: its type and the first line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(args)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from scratchlm import __version__

        print(f"scratchlm {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if hasattr(sys.stdout, "reconfigure"):
        # Piped into a file or `tee`, stdout would hold whole blocks of the log back: flush each line.
        sys.stdout.reconfigure(line_buffering=True)
    if name not in COMMANDS:
        print(f"scratchlm: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        result = _resolve(name)(rest)
    except Exception as exc:
        if debug:
            raise
        return _report(name, exc)
    except KeyboardInterrupt as exc:
        # Training stops on SIGINT or SIGTERM with a TrainingInterrupted naming its checkpoint and
        # the signal's exit code (128 + the signal number).
        print(f"scratchlm {name}: {str(exc) or 'interrupted'}", file=sys.stderr)
        return getattr(exc, "exit_code", 130)
    return int(result or 0)


def _report(name: str, exc: Exception) -> int:
    """Print `exc` as one line on stderr; return the exit code."""
    if isinstance(exc, BrokenPipeError):
        # `scratchlm ... | head` closed the pipe: stop quietly, as Unix tools do.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if isinstance(exc, UserError):
        message, code = str(exc), 2
    elif isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)) or (
            isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG):  # a path given with a name too long
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        message, code = f"{exc.strerror or exc}{where}", 2
    else:
        message, code = f"{_one_line(exc)} (rerun with --debug for the traceback)", 1
    print(f"scratchlm {name}: error: {message}", file=sys.stderr)
    return code

if __name__ == "__main__":
    raise SystemExit(main())
