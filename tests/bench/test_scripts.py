"""Every benchmark script imports, answers --help, and parses the command lines its page shows, on CPU.

The scripts are programs, not modules of the package: they are loaded from their files here, so a
broken import after code moves between them and `scratchlm.bench` fails this fast test instead of
a GPU run.
"""

import ast
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))

DOCS = BENCHMARKS.parent / "docs" / "benchmarks"
OWNED_ELSEWHERE = {"tokenizer", "encode", "generate"}  # their pages and scripts are kept apart


def documented_command_lines() -> list[tuple[str, list[str], str]]:
    """(script, argv, page) of every `python benchmarks/X.py ...` line in the pages' code blocks,
    continuation lines joined and `$NAME` replaced by the block's `NAME="..."` assignment."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        if page.stem in OWNED_ELSEWHERE:
            continue
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        variables = dict(re.findall(r'^\s+(\w+)="([^"]*)"$', text, re.MULTILINE))
        for line in re.findall(r"^\s{4}python benchmarks/(.+)$", text, re.MULTILINE):
            line = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], line.split("#")[0]).rstrip(" &")
            script, *argv = shlex.split(line)
            found.append((Path(script).stem, argv, page.name))
    return found


COMMAND_LINES = documented_command_lines()

# Scripts that stop with a message (exit status 1) where no CUDA device is present.
NEEDS_CUDA = {"attention": [], "attention_tiles": [], "decode_attention": [], "lm_head": [], "step_breakdown": [],
              "train_loop": [], "train_step": []}


def load(stem: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_script_{stem}", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_every_script_has_a_documented_command_line():
    assert {stem for stem, _, _ in COMMAND_LINES} == set(SCRIPTS) - OWNED_ELSEWHERE


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


@pytest.mark.parametrize("stem,argv,page", COMMAND_LINES)
def test_documented_command_lines_parse(stem, argv, page):
    load(stem).build_parser().parse_args(argv)  # exits with status 2 on a stale option


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
