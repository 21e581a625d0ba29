"""Chapter asserts that explain themselves: a failing band names its figure, its values and the
chapter's parameters, even where the assert was written bare.

`explain_asserts(params)` (called by `book.validated` when a chapter runs in a kernel) rewrites each
cell's asserts as pytest does, so `assert margin > 1` fails with "assert 0.9 > 1" and the values of
the names and attributes it reads, then appends the parameters the chapter ran at. An assert's own
message is kept and comes first.
"""

from __future__ import annotations

import ast
from typing import Any, Mapping


class _RewriteAsserts(ast.NodeTransformer):
    """pytest's assertion rewriting, applied to each cell a kernel runs."""

    def visit(self, node: ast.AST) -> ast.AST:
        from _pytest.assertion.rewrite import rewrite_asserts   # pytest is pinned: the tests use it
        if isinstance(node, ast.Module) and any(isinstance(n, ast.Assert) for n in ast.walk(node)):
            rewrite_asserts(node, b"", None, None)
            # the imports it inserts carry the first statement's line and no end: after a cell's
            # leading comments that is an end before the start, which compile() refuses
            for n in ast.walk(node):
                if getattr(n, "lineno", None) is not None and (getattr(n, "end_lineno", None) or 0) < n.lineno:
                    n.end_lineno, n.end_col_offset = n.lineno, n.col_offset
        return node


def _describe(params: Mapping[str, Any]) -> str:
    return "chapter parameters: " + ", ".join(f"{k}={v!r}" for k, v in params.items())


def explain_asserts(params: Mapping[str, Any]) -> bool:
    """In an IPython kernel, make every later cell's failing assert carry its values and `params`.
    Outside a kernel (a script, the tests) do nothing and return False. Calling it again replaces
    the parameters shown."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    shell.ast_transformers[:] = [t for t in shell.ast_transformers if not isinstance(t, _RewriteAsserts)]
    shell.ast_transformers.append(_RewriteAsserts())
    described = _describe(params)

    def handler(self, etype, value, tb, tb_offset=None):
        first = str(value.args[0]) if value.args else ""
        value.args = (f"{first}\n({described})" if first else f"({described})",)
        self.showtraceback((etype, value, tb), tb_offset=tb_offset)

    shell.set_custom_exc((AssertionError,), handler)
    return True
