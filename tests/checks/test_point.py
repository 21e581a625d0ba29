"""`tie.Point`: one checked point, built and validated once where input enters, handed to every check.

Bad input is refused at the door with a message naming what is wrong; what the checks derive from
the point (its float64 widening, its oracle and envelope, its census) is derived once and kept,
however many checks read it; and no function of `gradtie.checks` takes a long parameter list.
"""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradtie
from gradtie import data
from gradtie.checks import bugs, stages
from gradtie.checks.check import CheckOptions, check_point
from gradtie.checks.tie import Point, tie
from gradtie.nets import cifar8

CFG = cifar8.Config()
CHECKS = Path(gradtie.__file__).parent / "checks"


@pytest.fixture(scope="module")
def params():
    return {k: v.astype(jnp.float64) for k, v in cifar8.NET.init(jax.random.key(0), CFG, weights="drawn").items()}


@pytest.fixture(scope="module")
def x():
    return jnp.asarray(data.images("photos", 2, 32, seed=0), jnp.float64)


def test_the_point_is_validated_at_the_door(params, x):
    labels = jnp.array([1, 7])
    point = Point.of(cifar8.NET, params, x, labels, CFG, label_smoothing=0.1)
    assert point.dtype == "float64" and point.batch == 2 and point.alpha == 0.1
    assert point.targets.shape == (2, 10) and point.targets.dtype == jnp.float64      # rows, once
    assert gradtie.Point is Point
    with pytest.raises(ValueError, match="x must be float64 or float32, got float16"):
        Point.of(cifar8.NET, params, x.astype(jnp.float16), labels, CFG)
    with pytest.raises(ValueError, match=r"checked dtype float32 \(that of x\): conv1.weight \(float64\)"):
        Point.of(cifar8.NET, params, x.astype(jnp.float32), labels, CFG)
    with pytest.raises(ValueError, match="labels must have shape"):
        Point.of(cifar8.NET, params, x, jnp.array([1, 2, 3]), CFG)
    with pytest.raises(ValueError, match="sum to 1"):
        Point.of(cifar8.NET, params, x, jnp.ones((2, 10)), CFG)
    with pytest.raises(ValueError, match="label_smoothing 1.0"):
        Point.of(cifar8.NET, params, x, labels, CFG, label_smoothing=1.0)
    with pytest.raises(ValueError, match="params must be a dict"):
        Point.of(cifar8.NET, [1.0], x, labels, CFG)
    with pytest.raises(TypeError, match="give the Point"):
        tie(cifar8.NET)


def test_what_the_checks_derive_is_derived_once(params, x):
    """Two ties, the catalogue's and the stage ties at one point read one widening and one oracle;
    a point with another key for its draws keeps the widening and the census."""
    point = Point.of(cifar8.NET, params, x, jnp.array([1, 7]), CFG, label_smoothing=0.1)
    first = tie(point)
    measured, wide = point.measured, point.wide
    second = tie(point, bugs.plant("bn_forget_gamma", cifar8.NET))
    assert point.measured is measured and point.wide is wide
    assert first.ok and not second.ok
    census = point.census
    moved = point.with_key(jax.random.key(3))
    assert moved.wide is wide and moved.census is census and "measured" not in moved.__dict__
    st = stages.stage_ties(point, chain=bugs.plant("bn_forget_gamma", cifar8.NET))
    assert st.first_parting() is not None and point.wide is wide


def test_check_point_reads_the_point_it_is_given(params, x):
    point = Point.of(cifar8.NET, params, x, jnp.array([1, 7]), CFG, label_smoothing=0.1)
    rep = check_point(point, CheckOptions(finite_differences=False))
    assert rep.exit_code == 0 and rep.smooth is point.census, rep.summary()
    red = gradtie.check(cifar8.NET, params, x, jnp.array([1, 7]), CFG, label_smoothing=0.1,
                        options=CheckOptions(plant_bug="bn_forget_gamma", finite_differences=False,
                                             smoothness=False))
    assert red.exit_code == 1 and "first differ at" in red.summary()


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def test_no_check_takes_a_long_parameter_list():
    nine = ast.parse("def f(a, b, /, c, *d, e, f=1, g, h, **k): pass").body[0]
    assert _parameters(nine) == 9 and _parameters(ast.parse("def m(cls, a): pass").body[0]) == 1   # it counts
    counted = {}
    for path in sorted(CHECKS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > 8:
                counted[f"{path.relative_to(CHECKS).as_posix()}:{node.name}"] = _parameters(node)
    assert not counted, f"functions of gradtie.checks over eight parameters (pass a Point): {counted}"
