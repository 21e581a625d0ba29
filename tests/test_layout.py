"""The kit does not know the book: `gradtie.book` (the chapters' figures, pages, companions, claim map,
parameters and build) imports the kit, and no module of the kit imports it, at import time or lazily.

The kit is every module of src/gradtie outside src/gradtie/book/. The command line (`gradtie.cli`) is
the front end: it may read the book inside a command (`gradtie book`, `gradtie bench --abstract`),
never on import. Two checks, each shown failing on a planted import:

- every kit module imported in a fresh interpreter loads no `gradtie.book` module;
- no kit source file (the front end aside) imports the book: `import gradtie.book…`,
  `from gradtie import book` (or the names that moved with it), a relative import that resolves into
  `gradtie.book`, or `importlib.import_module` / `__import__` of such a name.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gradtie"
BOOK = "gradtie.book"
# the names that left the kit for the book: `from gradtie import <one of them>` is a book import
MOVED = ("book", "plots", "pages", "companions", "claims", "assertions", "workloads")
FRONT_END = ("gradtie.cli", "gradtie.__main__")   # may import the book inside a command function
# modules whose import runs a program (`python -m …`): their code is scanned, not imported
RUNS_ON_IMPORT = ("gradtie.peers.__main__",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def kit_modules() -> list[tuple[str, Path]]:
    """(dotted name, file) of every module of the package outside gradtie.book, sorted."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name != BOOK and not name.startswith(BOOK + "."):
            out.append((name, path))
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import …` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _is_book(name: str) -> bool:
    return name == BOOK or name.startswith(BOOK + ".")


def book_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every place `source` (the code of kit module `module`) imports the book, as "line: what";
    empty when it never does. Docstrings and comments may name the book; only imports count."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_book(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            dots = "." * node.level + (node.module or "")
            if _is_book(base):
                found.append(f"{node.lineno}: from {dots} import …")
            elif base == "gradtie":
                found += [f"{node.lineno}: from {dots} import {a.name}" for a in node.names if a.name in MOVED]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if called not in ("import_module", "__import__"):
                continue
            text = node.args[0].value
            package = module if is_package else module.rpartition(".")[0]
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                package = node.args[1].value   # import_module(".x", package)
            if text.startswith("."):
                level = len(text) - len(text.lstrip("."))
                name = _resolve(package + ".x", False, level, text[level:] or None)
            else:
                name = text
            if _is_book(name) or (name.startswith("gradtie.") and name.split(".")[1] in MOVED):
                found.append(f"{node.lineno}: {called}({text!r})")
    return found


def _loaded_after_import(modules: list[str]) -> dict:
    """Import `modules` in a fresh interpreter; the gradtie.book modules loaded then, and any that
    failed to import (so that none is silently left out)."""
    code = ("import importlib, json, sys\n"
            "failed = {}\n"
            "for m in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except Exception as e:\n"
            "        failed[m] = f'{type(e).__name__}: {e}'\n"
            f"book = sorted(m for m in sys.modules if m == {BOOK!r} or m.startswith({BOOK + '.'!r}))\n"
            "print(json.dumps({'book': book, 'failed': failed, 'loaded': len(sys.modules)}))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(modules)], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kit_module_imports_without_loading_the_book():
    names = [n for n, _ in kit_modules() if n not in RUNS_ON_IMPORT]
    # the kit as a reader of the checker meets it, and the benchmark's and training's modules too
    assert {"gradtie.ops.conv", "gradtie.nets.resnet34", "gradtie.checks.check", "gradtie.checks.vjp",
            "gradtie.rendered", "gradtie.reference", "gradtie.kit", "gradtie.train", "gradtie.parallel",
            "gradtie.bench", "gradtie.cli"} <= set(names)
    result = _loaded_after_import(names)
    assert result["failed"] == {}
    assert result["book"] == [], f"importing the kit loaded {result['book']}"


def test_the_fresh_import_sees_a_book_module_when_one_is_loaded():
    # control: the same probe, asked to import a book module, reports the book
    result = _loaded_after_import(["gradtie.ops.relu", "gradtie.book.pages"])
    assert result["failed"] == {} and BOOK in result["book"] and "gradtie.book.pages" in result["book"]


def test_no_kit_source_imports_the_book():
    found = {}
    for name, path in kit_modules():
        if name in FRONT_END:
            continue
        hits = book_imports(path.read_text(), name, path.name == "__init__.py")
        if hits:
            found[str(path.relative_to(SRC.parent))] = hits
    assert found == {}


def test_the_front_end_reads_the_book_only_inside_its_commands():
    # `gradtie.cli` may import the book, but never at module level: `import gradtie.cli` stays book-free
    for name in FRONT_END:
        path = PACKAGE / (name.split(".", 1)[1].replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        top = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                         type_ignores=[])
        assert book_imports(ast.unparse(top), name) == []


PLANTED = [
    ("from gradtie import book\n", "gradtie.checks.tie", False),
    ("from gradtie import nets, plots\n", "gradtie.train", False),
    ("from gradtie.book import pages\n", "gradtie.bench", False),
    ("import gradtie.book.plots as p\n", "gradtie.kit", False),
    ("from . import book\n", "gradtie.bench", False),
    ("from . import companions\n", "gradtie.bench", False),
    ("from .book import workloads\n", "gradtie.parallel", False),
    ("from ..book.claims import CLAIMS\n", "gradtie.checks.tie", False),
    ("from ...book import plots\n", "gradtie.checks.bf16.sites", False),
    ("from .. import book\n", "gradtie.nets", True),
    ("def f():\n    from .. import book   # lazily, inside a function\n    return book\n", "gradtie.ops.conv", False),
    ("import importlib\nm = importlib.import_module('gradtie.book.companions')\n", "gradtie.data", False),
    ("import importlib\nm = importlib.import_module('.book', 'gradtie')\n", "gradtie.policy", False),
    ("m = __import__('gradtie.claims')\n", "gradtie.policy", False),
]


@pytest.mark.parametrize("source, module, is_package", PLANTED)
def test_a_planted_book_import_is_found(source, module, is_package):
    assert book_imports(source, module, is_package)


def test_what_is_not_a_book_import_is_not_flagged():
    source = ('"""Shown in the book (`gradtie.book.plots.pools`); `from gradtie import book` in prose."""\n'
              "# from gradtie import book\n"
              "from gradtie import bench, nets\n"
              "from . import rendered\n"
              "from .checks import bugs\n"
              "from .bookkeeping import ledger\n"
              "import gradtie.bookmarks\n"
              "x = 'gradtie.book'\n")
    assert book_imports(source, "gradtie.train") == []


def test_a_kit_file_with_a_planted_import_fails_the_scan(tmp_path):
    # the scan itself, on a copy of a real kit module with one import added
    path = PACKAGE / "checks" / "vjp.py"
    planted = path.read_text() + "\n\ndef _figure():\n    from ..book import plots\n    return plots\n"
    assert book_imports(path.read_text(), "gradtie.checks.vjp") == []
    assert book_imports(planted, "gradtie.checks.vjp") != []
