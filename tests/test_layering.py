"""The package layering of scratchlm, checked on the source.

Every module under src/scratchlm is parsed with `ast` and each import it makes is checked
against the rules below: module-level imports, imports inside functions and `if TYPE_CHECKING`
blocks, relative imports, `importlib.import_module("...")` with a literal name, and the names
a package re-exports lazily through `lazy_exports`. Nothing is imported, so a violation is
found even on a path no test runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "scratchlm"

# (package the rule applies to, forbidden module prefixes, why)
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("scratchlm.model", ("scratchlm.train", "scratchlm.parallel", "scratchlm.tokenizer", "scratchlm.cli",
                         "torch.distributed"),
     "the model is plain: parallelism, training and tokenization wrap it from outside"),
    ("scratchlm.tokenizer", ("torch", "scratchlm.model"),
     "the tokenizer is pure Python: no torch, no model"),
    ("scratchlm.kernels", ("scratchlm.train",),
     "kernels are building blocks of the model, not of the training loop"),
    ("scratchlm.infer", ("scratchlm.tokenizer",),
     "decoding deals in token ids only"),
    ("scratchlm.optim", ("scratchlm.model",),
     "optimizers work on any parameters, not on one model"),
]
CLI = "scratchlm.cli"
# Modules that may import the command line: the command line itself and `python -m scratchlm`.
CLI_USERS = (CLI, "scratchlm.__main__")


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of `from <node.module> import ...` written in `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_export_targets(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Modules named by `lazy_exports(__name__, {...})` (a dict literal or a module-level name of one)."""
    dicts = {target.id: node.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_exports"):
            continue
        if len(node.args) < 2:
            continue
        table = node.args[1]
        if isinstance(table, ast.Name):
            table = dicts.get(table.id)
        if isinstance(table, ast.Dict):
            for value in table.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield node.lineno, value.value


def imports_of(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path`, the module `module`.

    `from a import b` yields both `a` and `a.b`, since `b` may be a submodule.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, _is_package(path))
            yield node.lineno, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            yield node.lineno, node.args[0].value
    yield from _lazy_export_targets(tree)


def violations(root: Path = ROOT) -> list[str]:
    """One line per import statement that breaks a rule: `module (file:line) imports name: why`."""
    found: dict[tuple[str, int, str], str] = {}  # (module, line, why) -> the shortest offending name
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root.parent)
        where = path.relative_to(root.parent.parent)
        for line, name in imports_of(path, module):
            broken = [why for package, forbidden, why in RULES
                      if _within(module, package) and any(_within(name, f) for f in forbidden)]
            if _within(name, CLI) and not any(_within(module, user) for user in CLI_USERS):
                broken.append("library code must not depend on the command line")
            for why in broken:
                key = (f"{module} ({where}:{line})", line, why)
                if key not in found or len(name) < len(found[key]):
                    found[key] = name
    return [f"{head} imports {name}: {why}" for (head, _, why), name in sorted(found.items())]


def test_the_packages_respect_the_layering():
    found = violations()
    assert not found, "layering violations:\n" + "\n".join(found)


def test_every_rule_applies_to_an_existing_package():
    # A renamed package would otherwise leave its rule checking nothing.
    for package, _, _ in RULES + [(CLI, (), "")]:
        assert (ROOT / package.split(".", 1)[1] / "__init__.py").is_file(), package


def _write_module(tmp_path: Path, module: str, source: str) -> Path:
    """A source tree holding only `module` (a package when its name is a known package), its root."""
    root = tmp_path / "src" / "scratchlm"
    parts = module.split(".")[1:]
    is_package = module in {package for package, _, _ in RULES}
    path = root.joinpath(*parts, "__init__.py") if is_package else root.joinpath(*parts[:-1], parts[-1] + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")
    return root


@pytest.mark.parametrize("source, module, expected", [
    ("import torch\n", "scratchlm.tokenizer.io", "imports torch"),
    ("def f():\n    import torch.nn.functional as F\n", "scratchlm.tokenizer.io", "imports torch.nn.functional"),
    ("from scratchlm.train.trainer import Trainer\n", "scratchlm.model.hf", "imports scratchlm.train.trainer"),
    ("from ..train import checkpoint\n", "scratchlm.model.hf", "imports scratchlm.train"),
    ("from torch import distributed as dist\n", "scratchlm.model.layers", "imports torch.distributed"),
    ("from scratchlm import cli\n", "scratchlm.data.download", "imports scratchlm.cli"),
    ("def f():\n    from scratchlm.tokenizer.tokenizer import Tokenizer\n", "scratchlm.infer.generate",
     "imports scratchlm.tokenizer"),
    ("import importlib\nm = importlib.import_module('scratchlm.train.metrics')\n", "scratchlm.kernels.x",
     "imports scratchlm.train.metrics"),
    ("from scratchlm.lazy_exports import lazy_exports\n_E = {'M': 'scratchlm.model.layers'}\n"
     "__getattr__, __dir__ = lazy_exports(__name__, _E)\n", "scratchlm.optim", "imports scratchlm.model.layers"),
])
def test_a_forbidden_import_is_reported_with_its_module(tmp_path, source, module, expected):
    root = _write_module(tmp_path, module, source)
    found = violations(root)
    assert len(found) == 1 and found[0].startswith(module + " (") and expected in found[0], found


@pytest.mark.parametrize("source, module", [
    ("import torch\n", "scratchlm.model.layers"),
    ("from scratchlm.model.config import ModelConfig\n", "scratchlm.train.config"),
    ("from scratchlm.cli import main\n", "scratchlm.__main__"),
    ("from scratchlm.train.trainer import Trainer\n", "scratchlm.cli.train"),
    ("from scratchlm.tokenizer.tokenizer import Tokenizer\n", "scratchlm.cli.infer"),
])
def test_allowed_imports_are_not_reported(tmp_path, source, module):
    root = _write_module(tmp_path, module, source)
    assert violations(root) == []
