"""The kernels never call autodiff: a text scan of gradtie.ops and gradtie.nets."""

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gradtie"
FORBIDDEN = re.compile(r"\b(grad|value_and_grad|vjp|jvp|linearize|custom_vjp|custom_jvp)\s*[\(\.]|"
                       r"\bjax\.(grad|value_and_grad|vjp|jvp|linearize|custom_vjp|custom_jvp)\b|"
                       r"from jax(\.\w+)* import .*\b(grad|value_and_grad|vjp|jvp|linearize|custom_vjp)\b")


def offending_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if FORBIDDEN.search(line)]


def kernel_files():
    return sorted((SRC / "ops").rglob("*.py")) + sorted((SRC / "nets").rglob("*.py"))


@pytest.mark.parametrize("path", kernel_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_kernel_module_has_no_autodiff(path):
    assert offending_lines(path.read_text()) == []


@pytest.mark.parametrize("snippet", [
    "g = jax.grad(loss)(p)", "_, f = jax.vjp(fwd, x)", "from jax import vjp\nvjp(f, x)",
    "jax.linearize(f, x)", "from jax import grad as g", "@jax.custom_vjp", "jax.value_and_grad(f)", "jax.jvp(f, (x,), (t,))",
])
def test_scan_catches_planted_autodiff(snippet):
    assert offending_lines(snippet), snippet


def test_scan_covers_the_kernels():
    names = {p.name for p in kernel_files()}
    assert {"conv.py", "batchnorm.py", "maxpool.py", "relu.py", "head.py"} <= names
