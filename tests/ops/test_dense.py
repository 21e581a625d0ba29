"""dense (y = x @ Wᵀ + b, W [out,in]): dx, dW, db against jax.vjp and central differences;
dtypes; bad input; a must-fail control for each."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradtie import reference
from gradtie.ops import dense
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12
FD_H, FD_TOL = 1e-5, 1e-6


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def rendered(x, wt, b, dy):
    return dense.backward(wt, dy), dense.grad_weight(x, dy), (dense.grad_bias(dy) if b is not None else None)


@partial(jax.jit, compiler_options=QUICK)
def evaluate(x, wt, b, dy, directions):
    """One compile per shape: y, the rendered nodes, jax.vjp's nodes, and central differences of
    <dy, dense(x, W, b)> along one direction per primal."""
    def probe(*p):
        return jnp.vdot(dy, dense.forward(*p)[0])
    fds = []
    for i, u in enumerate(directions):
        plus, minus = [x, wt, b], [x, wt, b]
        if u is not None:
            plus[i], minus[i] = plus[i] + FD_H * u, minus[i] - FD_H * u
        fds.append(None if u is None else (probe(*plus) - probe(*minus)) / (2 * FD_H))
    return dense.forward(x, wt, b)[0], rendered(x, wt, b, dy), reference.dense_vjp(x, wt, b, dy), fds


@partial(jax.jit, compiler_options=QUICK)
def forward_and_rendered(x, wt, b, dy):
    return (dense.forward(x, wt, b)[0],) + rendered(x, wt, b, dy)


def make_case(seed, n, d_in, d_out, bias=True, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x, wt, dy = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((n, d_in), (d_out, d_in), (n, d_out)))
    b = jnp.asarray(rng.standard_normal(d_out), dtype) if bias else None
    dirs = tuple(None if a is None else jnp.asarray(rng.standard_normal(a.shape), dtype) for a in (x, wt, b))
    return x, wt, b, dy, dirs


def fd_gap(fd, grad, direction):
    """|central difference − <grad, direction>| relative to ‖grad‖·‖direction‖."""
    grad, direction = np.asarray(grad), np.asarray(direction)
    return abs(float(fd) - np.vdot(grad, direction)) / (np.linalg.norm(grad) * np.linalg.norm(direction))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6))
SQUARE = (3, 4, 4)


@settings(max_examples=5)
@given(shape=shapes, bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
@example(shape=SQUARE, bias=True, seed=1)
def test_backward_equals_vjp_f64(shape, bias, seed):
    x, wt, b, dy, dirs = make_case(seed, *shape, bias=bias)
    y, got, want, _ = evaluate(x, wt, b, dy, dirs)
    assert rel_err(got[0], want[0]) <= TOL_F64
    assert rel_err(got[1], want[1]) <= TOL_F64
    if bias:
        assert rel_err(got[2], want[2]) <= TOL_F64
    y_loop = np.asarray(x) @ np.asarray(wt).T + (0 if b is None else np.asarray(b))
    assert rel_err(y, y_loop) <= TOL_F64


def test_wrong_layout_controls_go_red():
    """Square W so the wrong layouts type-check: dx = dy @ Wᵀ, dW = xᵀ @ dy, db = mean."""
    x, wt, b, dy, dirs = make_case(1, *SQUARE)
    _, _, (dx, dw, db), _ = evaluate(x, wt, b, dy, dirs)
    x, wt, dy = np.asarray(x), np.asarray(wt), np.asarray(dy)
    assert rel_err(dy @ wt.T, dx) > 0.1
    assert rel_err(x.T @ dy, dw) > 0.1
    assert rel_err(dy.mean(axis=0), db) > 0.1


@settings(max_examples=2)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
@example(shape=SQUARE, seed=1)
def test_backward_matches_central_differences_f64(shape, seed):
    x, wt, b, dy, dirs = make_case(seed, *shape)
    _, nodes, _, fds = evaluate(x, wt, b, dy, dirs)
    for node, fd, u in zip(nodes, fds, dirs):  # dx, dW, db
        assert fd_gap(fd, node, u) <= FD_TOL


def test_central_differences_control_goes_red():
    x, wt, b, dy, dirs = make_case(1, *SQUARE)
    _, nodes, _, fds = evaluate(x, wt, b, dy, dirs)
    dy, wt = np.asarray(dy), np.asarray(wt)
    assert fd_gap(fds[0], dy @ wt.T, dirs[0]) > 1e3 * FD_TOL  # dx with the transposed layout
    assert fd_gap(fds[1], 2 * np.asarray(nodes[1]), dirs[1]) > 1e3 * FD_TOL  # a doubled dW


@pytest.mark.parametrize("dtype,unit", [(jnp.float32, 2.0**-24), (jnp.bfloat16, 2.0**-8)])
def test_ops_keep_f32_and_bf16_operand_dtype(dtype, unit):
    x64, w64, b64, dy64, _ = make_case(1, *SQUARE)
    want = forward_and_rendered(x64, w64, b64, dy64)
    got = forward_and_rendered(*(jnp.asarray(np.asarray(a).astype(dtype)) for a in (x64, w64, b64, dy64)))
    assert [g.dtype for g in got] == [dtype] * 4
    for g, w_ in zip(got, want):
        assert rel_err(g, w_) <= 8 * unit


def msg(*parts):
    """A pattern for a message holding these parts in order (tuples as shapes print)."""
    return ".*".join(re.escape(str(p)) for p in parts)


def test_bad_input_raises_value_error_naming_op_and_shapes():
    x, wt = np.ones((3, 5)), np.ones((4, 5))
    with pytest.raises(ValueError, match=msg("dense.forward: x", (3, 6), "has 6 features but weight", (4, 5),
                                             "expects 5")):
        dense.forward(np.ones((3, 6)), wt)
    with pytest.raises(ValueError, match=msg("dense.forward: x must have rank 2", (3, 5, 1))):
        dense.forward(np.ones((3, 5, 1)), wt)
    with pytest.raises(ValueError, match=msg("dense.forward: weight must have rank 2", (5,))):
        dense.forward(x, np.ones(5))
    with pytest.raises(ValueError, match=msg("dense.forward: bias must have shape (4,), got (5,)")):
        dense.forward(x, wt, np.ones(5))
    for bad in (np.nan, np.inf):
        x_bad = x.copy()
        x_bad[2, 1] = bad
        with pytest.raises(ValueError, match=msg("dense.forward: x of shape (3, 5) contains NaN or Inf")):
            dense.forward(x_bad, wt)
    # dy of the wrong shape for each backward node
    with pytest.raises(ValueError, match=msg("dense.backward: dy", (3, 5), "does not match weight", (4, 5))):
        dense.backward(wt, np.ones((3, 5)))
    with pytest.raises(ValueError, match=msg("dense.backward: dy must have rank 2", (4,))):
        dense.backward(wt, np.ones(4))
    with pytest.raises(ValueError, match=msg("dense.grad_weight: x", (3, 5), "and dy", (2, 4), "differ")):
        dense.grad_weight(x, np.ones((2, 4)))
    with pytest.raises(ValueError, match=msg("dense.grad_weight: dy must have rank 2", (3,))):
        dense.grad_weight(x, np.ones(3))
    with pytest.raises(ValueError, match=msg("dense.grad_bias: dy must have rank 2", (4,))):
        dense.grad_bias(np.ones(4))
