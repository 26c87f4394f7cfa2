"""Every benchmark script imports, answers --help, and parses its documented command lines on CPU.

The scripts are programs, not modules of the package: they are loaded from their files here, so a
broken import after code moves between them and `scratchlm.bench` fails this fast test instead of
a GPU run.
"""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))

# Command lines of the docs pages (docs/benchmarks/*.md), parsed but not run.
COMMAND_LINES = {
    "attention": [["--head-dims", "128", "--seqs", "1024", "4096", "--json", "out.json"]],
    "attention_tiles": [["--shapes", "4x16x4096x128", "1x20x32768x128", "--json", "out.json"]],
    "distributed": [["--shape", "reduced", "--skip-memory", "--out", "out.json"]],
    "lm_head": [["--json", "out.json"]],
    "moe": [["layer", "--compile", "--cases", "0,1,3", "--json", "l.json"],
            ["train", "--train-bin", "t.bin", "--val-bin", "v.bin", "--tokenizer-dir", "tok", "--runs", "runs",
             "--budget-s", "300"],
            ["throughput", "--train-bin", "t.bin", "--val-bin", "v.bin", "--tokenizer-dir", "tok", "--runs", "runs",
             "--compile", "0", "--deadline-s", "90"],
            ["report", "runs", "--out", "out"]],
    "post_training": [["--scale", "full", "--device", "cuda", "--json", "out.json", "--plot", "out.png"]],
    "reference_trainer": [["--train-bin", "t.bin", "--val-bin", "v.bin", "--out", "ref", "--compile", "--seed", "1"]],
    "step_breakdown": [["--shape", "gpt2small", "--variant", "cudagraphs", "--json", "out.json"]],
    "train_loop": [["--windows", "3", "--variant", "ro=--trainer.compile_mode=reduce-overhead",
                    "--reference-compiled-loss"]],
    "train_step": [["--variants", "cudagraphs", "--json", "out.json"],
                   ["--shapes", "longctx", "--checkpoint-every", "1", "2", "12"]],
    "training_report": [["runs", "--out", "out", "--seeds", "out/seeds.json"]],
}
# Scripts that stop with a message (exit status 1) where no CUDA device is present.
NEEDS_CUDA = {"attention": [], "attention_tiles": [], "lm_head": [], "step_breakdown": [], "train_loop": [],
              "train_step": []}


def load(stem: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_script_{stem}", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_every_script_with_command_lines_is_listed():
    owned_elsewhere = {"tokenizer", "encode", "generate"}
    assert set(COMMAND_LINES) == set(SCRIPTS) - owned_elsewhere


@pytest.mark.parametrize("stem", SCRIPTS)
def test_script_imports_and_answers_help(stem, capsys, monkeypatch):
    module = load(stem)
    monkeypatch.setattr(sys, "argv", [f"{stem}.py", "--help"])  # as run: some mains read sys.argv only
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("stem", SCRIPTS)
def test_script_neither_edits_sys_path_nor_imports_another_script(stem):
    tree = ast.parse((BENCHMARKS / f"{stem}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            pytest.fail(f"{stem}.py uses sys.path")
    assert not imported & set(SCRIPTS), f"{stem}.py imports another script"


@pytest.mark.parametrize("stem,argv", [(s, a) for s, lines in COMMAND_LINES.items() for a in lines])
def test_documented_command_lines_parse(stem, argv):
    args = load(stem).build_parser().parse_args(argv)
    assert args is not None


@pytest.mark.parametrize("stem,argv", [("train_step", ["--variants", "nonexistent"]),
                                       ("step_breakdown", ["--shape", "longctx"]),
                                       ("moe", ["layer", "--no-such-flag"])])
def test_bad_command_lines_are_refused(stem, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        load(stem).build_parser().parse_args(argv)
    assert exit_.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a CUDA device")
@pytest.mark.parametrize("stem", sorted(NEEDS_CUDA))
def test_gpu_scripts_stop_with_a_message_without_cuda(stem, capsys):
    assert load(stem).main(NEEDS_CUDA[stem]) != 0
    assert "CUDA" in capsys.readouterr().err
