"""batchnorm: dx, dγ, dβ against jax.vjp of the forward and central differences (batch and
per-example statistics); independence of β; dtypes; bad input; a must-fail control for each."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradtie import reference
from gradtie.ops import batchnorm
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12
FD_H, FD_TOL = 1e-5, 1e-6


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def make_case(seed, n, c, h, w, dtype=np.float64):
    """x with a per-channel offset and scale (so the x̂ term matters), γ, β, a cotangent dy and
    one direction per primal."""
    rng = np.random.default_rng(seed)
    offset, scale = rng.normal(0, 3, (1, c, 1, 1)), rng.uniform(0.5, 2, (1, c, 1, 1))
    x = jnp.asarray(offset + scale * rng.standard_normal((n, c, h, w)), dtype)
    gamma, beta = (jnp.asarray(rng.standard_normal(c), dtype) for _ in range(2))
    dy = jnp.asarray(rng.standard_normal((n, c, h, w)), dtype)
    dirs = tuple(jnp.asarray(rng.standard_normal(a.shape), dtype) for a in (x, gamma, beta))
    return rng, x, gamma, beta, dy, dirs


def rendered(x, gamma, beta, dy, per_example):
    _, saved = batchnorm.forward(x, gamma, beta, per_example=per_example)
    return (batchnorm.backward(saved, gamma, dy), batchnorm.grad_weight(saved, dy),
            batchnorm.grad_bias(dy))


def central_differences(probe, primals, directions):
    """(probe(p + h·u) − probe(p − h·u)) / 2h, moving one primal at a time (traced inside jit)."""
    out = []
    for i, u in enumerate(directions):
        plus, minus = list(primals), list(primals)
        plus[i], minus[i] = primals[i] + FD_H * u, primals[i] - FD_H * u
        out.append((probe(*plus) - probe(*minus)) / (2 * FD_H))
    return out


@partial(jax.jit, static_argnames="per_example", compiler_options=QUICK)
def evaluate(x, gamma, beta, dy, directions, per_example):
    """One compile per shape: the rendered nodes, jax.vjp's nodes, and central differences of
    <dy, BN(x; γ, β)> along one direction per primal (what the nodes predict)."""
    def probe(*p):
        return jnp.vdot(dy, batchnorm.forward(*p, per_example=per_example)[0])
    return (rendered(x, gamma, beta, dy, per_example),
            reference.batchnorm_vjp(x, gamma, beta, dy, per_example=per_example),
            central_differences(probe, (x, gamma, beta), directions))


@partial(jax.jit, static_argnames="per_example", compiler_options=QUICK)
def forward_and_rendered(x, gamma, beta, dy, per_example):
    return (batchnorm.forward(x, gamma, beta, per_example=per_example)[0],) + rendered(
        x, gamma, beta, dy, per_example)


def no_xhat_backward(x, gamma, dy, per_example):
    """A deliberately wrong input backward (numpy): s·(t − mean t), the x̂·mean(x̂·t) term dropped."""
    x, gamma, dy = (np.asarray(a, np.float64) for a in (x, gamma, dy))
    axes = (2, 3) if per_example else (0, 2, 3)
    centred = x - x.mean(axis=axes, keepdims=True)
    s = 1 / np.sqrt(np.mean(centred**2, axis=axes, keepdims=True) + batchnorm.EPS)
    t = gamma[None, :, None, None] * dy
    return s * (t - t.mean(axis=axes, keepdims=True))


def fd_gap(fd, grad, direction):
    """|central difference − <grad, direction>| relative to ‖grad‖·‖direction‖."""
    grad, direction = np.asarray(grad), np.asarray(direction)
    return abs(float(fd) - np.vdot(grad, direction)) / (np.linalg.norm(grad) * np.linalg.norm(direction))


cases = st.fixed_dictionaries(dict(
    n=st.integers(1, 3), c=st.integers(1, 4), h=st.integers(4, 12), w=st.integers(4, 12),
    per_example=st.booleans(), seed=st.integers(0, 2**31 - 1)))
EX1 = dict(n=3, c=2, h=5, w=8, per_example=False, seed=1)
EX2 = dict(n=2, c=3, h=7, w=6, per_example=True, seed=2)


def case_of(d, **override):
    d = {**d, **override}
    return make_case(d["seed"], d["n"], d["c"], d["h"], d["w"])


# ---- claim 1: rendered nodes == jax.vjp, float64 ---------------------------------------------

@settings(max_examples=4)
@given(d=cases)
@example(d=EX1)
@example(d=EX2)
def test_backward_equals_vjp_f64(d):
    _, x, gamma, beta, dy, dirs = case_of(d)
    got, want, _ = evaluate(x, gamma, beta, dy, dirs, d["per_example"])
    for g, w_ in zip(got, want):  # dx, dγ, dβ
        assert rel_err(g, w_) <= TOL_F64


@pytest.mark.parametrize("ex", [EX1, EX2])
def test_wrong_backward_controls_go_red(ex):
    """Dropping the x̂ term, swapping γ↔β gradients, or reading the other statistics all fail."""
    pe = ex["per_example"]
    _, x, gamma, beta, dy, dirs = case_of(ex)
    (dx, dg, db), (dx_want, dg_want, db_want), _ = evaluate(x, gamma, beta, dy, dirs, pe)
    assert rel_err(no_xhat_backward(x, gamma, dy, pe), dx_want) > 1e-2
    assert rel_err(db, dg_want) > 0.1 and rel_err(dg, db_want) > 0.1
    (other, _, _), _, _ = evaluate(x, gamma, beta, dy, dirs, not pe)
    assert rel_err(other, dx_want) > 1e-2


# ---- claim 1: central finite differences ----------------------------------------------------

@settings(max_examples=2)
@given(d=cases)
@example(d=EX1)
@example(d=EX2)
def test_backward_matches_central_differences_f64(d):
    _, x, gamma, beta, dy, dirs = case_of(d)
    nodes, _, fds = evaluate(x, gamma, beta, dy, dirs, d["per_example"])
    for node, fd, u in zip(nodes, fds, dirs):  # dx, dγ, dβ
        assert fd_gap(fd, node, u) <= FD_TOL


def test_central_differences_control_goes_red():
    _, x, gamma, beta, dy, dirs = case_of(EX1)
    _, _, fds = evaluate(x, gamma, beta, dy, dirs, False)
    assert fd_gap(fds[0], no_xhat_backward(x, gamma, dy, False), dirs[0]) > 1e3 * FD_TOL


# ---- claim 4: the BN backward does not read β ----------------------------------------------------

@pytest.mark.parametrize("ex", [EX1, EX2])
def test_backward_independent_of_beta(ex):
    pe = ex["per_example"]
    rng, x, gamma, beta, dy, dirs = case_of(ex)
    beta2 = jnp.asarray(np.asarray(beta) + rng.normal(0, 5, beta.shape))
    (dx, _, _), (dx1, _, _), _ = evaluate(x, gamma, beta, dy, dirs, pe)
    _, (dx2, _, _), _ = evaluate(x, gamma, beta2, dy, dirs, pe)
    assert rel_err(dx2, dx1) <= TOL_F64  # the oracle's dx is the same at both β …
    assert rel_err(dx, dx2) <= TOL_F64  # … and the rendered one (which takes no β) equals both
    # control: γ is read — a different γ gives a different dx
    _, (dx3, _, _), _ = evaluate(x, jnp.asarray(np.asarray(gamma) + 1.0), beta, dy, dirs, pe)
    assert rel_err(dx3, dx1) > 0.1


# ---- claim 3: dtype polymorphism ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2.0**-24 * 160), (jnp.bfloat16, 2.0**-8 * 5)])
def test_ops_keep_f32_and_bf16_operand_dtype(dtype, tol):
    _, x, gamma, beta, dy, _ = case_of(EX1)
    # compare at the same (rounded) operands: the op's own error, not the operands' rounding
    rounded = [jnp.asarray(np.asarray(a).astype(dtype)) for a in (x, gamma, beta, dy)]
    want = forward_and_rendered(*(jnp.asarray(np.asarray(a, np.float64)) for a in rounded), False)
    got = forward_and_rendered(*rounded, False)
    # y and dx travel in the activations' dtype; the nodes dγ, dβ are float32 sums even for bf16 input
    assert [g.dtype for g in got] == [dtype, dtype, jnp.float32, jnp.float32]
    for g, w_ in zip(got, want):
        assert rel_err(g, w_) <= tol
    # control: the same tolerance rejects the backward without the x̂ term
    assert rel_err(no_xhat_backward(rounded[0], rounded[1], rounded[3], False), want[1]) > tol


# ---- claim 6: bad input ------------------------------------------------------------------------

def msg(*parts):
    """A pattern for a message holding these parts in order (tuples as shapes print)."""
    return ".*".join(re.escape(str(p)) for p in parts)


def test_bad_input_raises_value_error_naming_op_and_shapes():
    x, g = np.ones((2, 3, 4, 4)), np.ones(3)
    x[0, :, 0, 0] = 2.0
    with pytest.raises(ValueError, match=msg("batchnorm.forward: weight must have shape (3,) for x",
                                             (2, 3, 4, 4), "got (4,)")):
        batchnorm.forward(x, np.ones(4), g)
    with pytest.raises(ValueError, match=msg("batchnorm.forward: bias must have shape (3,) for x",
                                             (2, 3, 4, 4), "got (2,)")):
        batchnorm.forward(x, g, np.ones(2))
    with pytest.raises(ValueError, match=msg("batchnorm.forward: x must have rank 4", (3, 4, 4))):
        batchnorm.forward(np.ones((3, 4, 4)), g, g)
    for bad in (np.nan, np.inf):
        x_bad = x.copy()
        x_bad[1, 1, 1, 1] = bad
        with pytest.raises(ValueError, match=msg("batchnorm.forward: x of shape (2, 3, 4, 4) contains NaN")):
            batchnorm.forward(x_bad, g, g)
    saved = batchnorm.BNSaved(x, x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3)), batchnorm.EPS, False, None)
    # dy of the wrong shape for each backward node
    with pytest.raises(ValueError, match=msg("batchnorm.backward: x and dy must have the same shape",
                                             (2, 3, 4, 4), (2, 3, 4, 5))):
        batchnorm.backward(saved, g, np.ones((2, 3, 4, 5)))
    with pytest.raises(ValueError, match=msg("batchnorm.backward: weight must have shape (4,) for x",
                                             (2, 4, 4, 4), "got (3,)")):
        batchnorm.backward(saved, g, np.ones((2, 4, 4, 4)))
    with pytest.raises(ValueError, match=msg("batchnorm.backward: x must have rank 4", (3, 4, 4))):
        batchnorm.backward(saved, g, np.ones((3, 4, 4)))
    with pytest.raises(ValueError, match=msg("batchnorm.grad_weight: x and dy must have the same shape",
                                             (2, 3, 4, 4), (1, 3, 4, 4))):
        batchnorm.grad_weight(saved, np.ones((1, 3, 4, 4)))
    with pytest.raises(ValueError, match=msg("batchnorm.grad_bias: dy must have rank 4", (3, 4))):
        batchnorm.grad_bias(np.ones((3, 4)))
