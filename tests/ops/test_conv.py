"""conv: every rendered node (dx, dW, db) against jax.vjp of the forward and central differences;
the forward's symmetric padding against a numpy loop; the conv bias behind BN; dtypes; bad input.

Each check runs as one jitted function per shape: XLA compiles dominate the runtime on CPU.
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax import lax

from gradtie import reference
from gradtie.ops import batchnorm, conv
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12
FD_H, FD_TOL = 1e-5, 1e-6


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def make_case(seed, n, c, o, h, w, k, stride, bias=True, dtype=np.float64):
    """x [N,C,H,W], W [O,C,k,k], b [O] or None, dy [N,O,H',W'] and one direction per primal."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, c, h, w)), dtype)
    wt = jnp.asarray(rng.standard_normal((o, c, k, k)), dtype)
    b = jnp.asarray(rng.standard_normal(o), dtype) if bias else None
    dy = jnp.asarray(rng.standard_normal((n, o, conv.out_size(h, k, stride), conv.out_size(w, k, stride))),
                     dtype)
    dirs = tuple(None if a is None else jnp.asarray(rng.standard_normal(a.shape), dtype) for a in (x, wt, b))
    return rng, x, wt, b, dy, dirs


def cast(a, dtype):
    """A host-side cast (round to nearest even): no eager XLA compile."""
    return jnp.asarray(np.asarray(a).astype(dtype))


def rendered(x, wt, b, dy, stride):
    """The rendered nodes: input backward, weight gradient, bias gradient (None without a bias)."""
    dx = conv.backward(wt, dy, input_shape=x.shape, stride=stride)
    dw = conv.grad_weight(x, dy, kernel_size=wt.shape[2], stride=stride)
    return dx, dw, (conv.grad_bias(dy) if b is not None else None)


def central_differences(probe, primals, directions):
    """(probe(p + h·u) − probe(p − h·u)) / 2h, moving one primal at a time (traced inside jit)."""
    out = []
    for i, u in enumerate(directions):
        plus, minus = list(primals), list(primals)
        if u is not None:
            plus[i], minus[i] = primals[i] + FD_H * u, primals[i] - FD_H * u
        out.append(None if u is None else (probe(*plus) - probe(*minus)) / (2 * FD_H))
    return out


@partial(jax.jit, static_argnames="stride", compiler_options=QUICK)
def evaluate(x, wt, b, dy, directions, stride):
    """One compile per shape: the rendered nodes, jax.vjp's nodes, and central differences of
    <dy, conv(x, W, b)> along one direction per primal (what the nodes predict)."""
    def probe(*p):
        return jnp.vdot(dy, conv.forward(*p, stride=stride)[0])
    return (rendered(x, wt, b, dy, stride), reference.conv_vjp(x, wt, b, dy, stride=stride),
            central_differences(probe, (x, wt, b), directions))


@partial(jax.jit, static_argnames="stride", compiler_options=QUICK)
def forward_and_rendered(x, wt, b, dy, stride):
    return (conv.forward(x, wt, b, stride=stride)[0],) + rendered(x, wt, b, dy, stride)


def fd_gap(fd, grad, direction):
    """|central difference − <grad, direction>| relative to ‖grad‖·‖direction‖."""
    grad, direction = np.asarray(grad), np.asarray(direction)
    return abs(float(fd) - np.vdot(grad, direction)) / (np.linalg.norm(grad) * np.linalg.norm(direction))


cases = st.fixed_dictionaries(dict(
    n=st.integers(1, 3), c=st.integers(1, 4), o=st.integers(1, 4), h=st.integers(4, 12),
    w=st.integers(4, 12), k=st.sampled_from([1, 3, 7]), stride=st.sampled_from([1, 2]),
    bias=st.booleans(), seed=st.integers(0, 2**31 - 1)))
EX1 = dict(n=2, c=3, o=2, h=8, w=11, k=7, stride=2, bias=True, seed=1)
EX2 = dict(n=1, c=2, o=3, h=9, w=6, k=3, stride=2, bias=False, seed=2)
EX3 = dict(n=3, c=1, o=4, h=5, w=12, k=1, stride=2, bias=True, seed=3)


def case_of(d, **override):
    d = {**d, **override}
    return make_case(d["seed"], d["n"], d["c"], d["o"], d["h"], d["w"], d["k"], d["stride"], d["bias"])


# ---- claim 1: rendered nodes == jax.vjp of the forward, float64 ------------------------------

@settings(max_examples=5)
@given(d=cases)
@example(d=EX1)
@example(d=EX2)
@example(d=EX3)
def test_backward_equals_vjp_f64(d):
    _, x, wt, b, dy, dirs = case_of(d)
    got, want, _ = evaluate(x, wt, b, dy, dirs, d["stride"])
    assert rel_err(got[0], want[0]) <= TOL_F64  # dx
    assert rel_err(got[1], want[1]) <= TOL_F64  # dW
    if d["bias"]:
        assert rel_err(got[2], want[2]) <= TOL_F64  # db


def test_unflipped_kernel_control_goes_red():
    """Deliberately wrong nodes fail the same comparison: an input backward whose kernel is
    transposed O↔I but not flipped, a spatially flipped weight gradient, a mean for the bias sum."""
    _, x, wt, b, dy, dirs = case_of(EX1)
    (dx, dw, _), (dx_want, dw_want, db_want), _ = evaluate(x, wt, b, dy, dirs, 2)
    unflipped = conv.backward(wt[:, :, ::-1, ::-1], dy, input_shape=x.shape, stride=2)
    assert rel_err(unflipped, dx_want) > 0.1
    assert rel_err(np.asarray(dw)[:, :, ::-1, ::-1], dw_want) > 0.1
    assert rel_err(np.asarray(dy).mean(axis=(0, 2, 3)), db_want) > 0.1


# ---- claim 1: central finite differences ----------------------------------------------------

@settings(max_examples=2)
@given(d=cases)
@example(d=EX1)
@example(d=EX3)
def test_backward_matches_central_differences_f64(d):
    _, x, wt, b, dy, dirs = case_of(d)
    nodes, _, fds = evaluate(x, wt, b, dy, dirs, d["stride"])
    for node, fd, u in zip(nodes, fds, dirs):  # dx, dW, db
        if u is not None:
            assert fd_gap(fd, node, u) <= FD_TOL


def test_central_differences_control_goes_red():
    _, x, wt, b, dy, dirs = case_of(EX1)
    _, _, fds = evaluate(x, wt, b, dy, dirs, 2)
    unflipped = conv.backward(wt[:, :, ::-1, ::-1], dy, input_shape=x.shape, stride=2)
    assert fd_gap(fds[0], unflipped, dirs[0]) > 1e3 * FD_TOL


# ---- claim 1: the forward's padding against a plain numpy loop -------------------------------

def conv_loop(x, wt, b, stride):
    """PyTorch-style conv: symmetric (k−1)//2 zero padding, then a loop over output cells."""
    x, wt = np.asarray(x), np.asarray(wt)
    n, c, h, w = x.shape
    o, _, k, _ = wt.shape
    p = (k - 1) // 2
    xp = np.zeros((n, c, h + 2 * p, w + 2 * p))
    xp[:, :, p:p + h, p:p + w] = x
    ho, wo = (h + 2 * p - k) // stride + 1, (w + 2 * p - k) // stride + 1
    y = np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, :, stride * i:stride * i + k, stride * j:stride * j + k]
            for oo in range(o):
                y[:, oo, i, j] = np.sum(patch * wt[oo], axis=(1, 2, 3))
    if b is not None:
        y += np.asarray(b)[None, :, None, None]
    return y


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("h,w", [(8, 9), (11, 10)])  # even and odd in each spatial axis
def test_forward_padding_matches_numpy_loop(k, h, w):
    _, x, wt, b, _, _ = make_case(3, 2, 2, 3, h, w, k, 2)
    y = conv.forward(x, wt, b, stride=2)[0]
    assert y.shape == (2, 3, (h - 1) // 2 + 1, (w - 1) // 2 + 1)
    assert rel_err(y, conv_loop(x, wt, b, 2)) <= TOL_F64


@pytest.mark.parametrize("k", [3, 7])
def test_xla_same_padding_control_goes_red(k):
    """At an even size XLA's 'SAME' pads a stride-2 conv asymmetrically and reads other windows."""
    _, x, wt, _, _, _ = make_case(4, 2, 2, 3, 8, 9, k, 2, bias=False)
    same = lax.conv_general_dilated(x, wt, (2, 2), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                    precision=lax.Precision.HIGHEST)
    want = conv_loop(x, wt, None, 2)
    assert same.shape == want.shape
    assert rel_err(same, want) > 0.1


# ---- claim 4: the conv bias gradient behind BatchNorm is round-off ---------------------------

@partial(jax.jit, static_argnames=("stride", "per_example"), compiler_options=QUICK)
def bias_behind_bn(x, wt, b, gamma, beta, r, stride, per_example):
    """conv(+bias) → BN → <r, ·>: the rendered (db, dW) and the autodiff db of the whole chain."""
    y = conv.forward(x, wt, b, stride=stride)[0]
    _, saved = batchnorm.forward(y, gamma, beta, per_example=per_example)
    dy = batchnorm.backward(saved, gamma, r)
    (db_oracle,) = reference.vjp(
        lambda b_: batchnorm.forward(conv.forward(x, wt, b_, stride=stride)[0], gamma, beta,
                                     per_example=per_example)[0], b, cotangent=r)
    return conv.grad_bias(dy), conv.grad_weight(x, dy, kernel_size=wt.shape[2], stride=stride), db_oracle


@settings(max_examples=3)
@given(d=cases, per_example=st.booleans())
@example(d=dict(n=2, c=3, o=4, h=7, w=8, k=3, stride=2, bias=True, seed=5), per_example=True)
def test_bias_grad_behind_batchnorm_is_roundoff_f64(d, per_example):
    # k = 3: with a 1×1 single-channel conv dW is itself 0 in ℝ and there is no scale to compare to
    rng, x, wt, b, r, _ = case_of(d, k=3, bias=True)
    gamma, beta = (jnp.asarray(rng.standard_normal(wt.shape[0])) for _ in range(2))
    db, dw, db_oracle = bias_behind_bn(x, wt, b, gamma, beta, r, d["stride"], per_example)
    floor = 1e-12 * np.max(np.abs(dw))
    assert np.max(np.abs(db)) < floor
    assert np.max(np.abs(db_oracle)) < floor  # autodiff through conv→BN sees the same zero


def test_bias_grad_without_batchnorm_is_nonzero_control():
    _, x, wt, b, r, _ = make_case(5, 2, 3, 4, 8, 8, 3, 1)
    db, dw = conv.grad_bias(r), conv.grad_weight(x, r, kernel_size=3)
    assert np.max(np.abs(db)) > 1e-2 * np.max(np.abs(dw))


# ---- claim 3: dtype polymorphism ---------------------------------------------------------------

def within_rounding(got, want, mag, n, unit):
    """|got − want| ≤ (4 roundings of `unit` + n float32 accumulations)·Σ|a|·|b|, entry by entry."""
    bound = (4 * unit + (n + 1) * 2.0**-24) * np.asarray(mag, np.float64)
    return bool(np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= bound))


def test_ops_keep_f32_and_bf16_operand_dtype():
    k, s = 3, 2
    _, x64, w64, b64, dy64, _ = make_case(6, 2, 3, 4, 9, 8, k, s)
    want = forward_and_rendered(x64, w64, b64, dy64, s)
    mag = forward_and_rendered(*(cast(np.abs(a), np.float64) for a in (x64, w64, b64, dy64)), s)  # Σ|a|·|b|
    n_out = dy64.shape[0] * dy64.shape[2] * dy64.shape[3]
    lengths = (3 * k * k, 4 * k * k, n_out, n_out)  # contraction length of y, dx, dW, db
    for dtype, unit in ((jnp.float32, 2.0**-24), (jnp.bfloat16, 2.0**-8)):
        got = forward_and_rendered(*(cast(a, dtype) for a in (x64, w64, b64, dy64)), s)
        # y, dx, dW travel in the operands' dtype; the bias node db is a sum in at least float32
        assert [g.dtype for g in got] == [dtype, dtype, dtype, jnp.promote_types(dtype, jnp.float32)]
        for g, w_, m, n in zip(got, want, mag, lengths):
            assert within_rounding(g, w_, m, n, unit)
    # controls: bf16 really rounds (it is not the f32 result) and the bound is not vacuous
    got32 = forward_and_rendered(*(cast(a, jnp.float32) for a in (x64, w64, b64, dy64)), s)
    got16 = forward_and_rendered(*(cast(a, jnp.bfloat16) for a in (x64, w64, b64, dy64)), s)
    assert rel_err(got16[0], got32[0]) > 2.0**-12
    assert not within_rounding(np.asarray(got16[1])[:, :, ::-1, ::-1], want[1], mag[1], lengths[1], 2.0**-8)


def test_bf16_rounding_function_keeps_f32_dtype():
    _, x, wt, _, _, _ = make_case(7, 1, 2, 3, 6, 6, 3, 1, bias=False, dtype=np.float32)
    y, _ = conv.forward(x, wt, rnd=conv.bf16_operand)
    assert y.dtype == jnp.float32
    assert np.array_equal(np.asarray(y), np.asarray(y).astype(jnp.bfloat16).astype(np.float32))


# ---- claim 6: bad input ------------------------------------------------------------------------

def msg(*parts):
    """A pattern for a message holding these parts in order (tuples as shapes print)."""
    return ".*".join(re.escape(str(p)) for p in parts)


def test_bad_input_raises_value_error_naming_op_and_shapes():
    x, wt = np.ones((2, 3, 8, 8)), np.ones((4, 3, 3, 3))
    with pytest.raises(ValueError, match=msg("conv.forward: x has 3 channels", (2, 3, 8, 8), (4, 5, 3, 3))):
        conv.forward(x, np.ones((4, 5, 3, 3)))
    with pytest.raises(ValueError, match=msg("conv.forward: x must have rank 4", (3, 8, 8))):
        conv.forward(np.ones((3, 8, 8)), wt)
    with pytest.raises(ValueError, match=msg("conv.forward: weight must have rank 4", (4, 3, 3))):
        conv.forward(x, np.ones((4, 3, 3)))
    with pytest.raises(ValueError, match=msg("conv.forward: bias must have shape (4,), got (3,)")):
        conv.forward(x, wt, np.ones(3))
    with pytest.raises(ValueError, match=msg("conv.forward: kernel must be square and odd", (4, 3, 2, 2))):
        conv.forward(x, np.ones((4, 3, 2, 2)))
    for bad in (np.nan, np.inf, -np.inf):
        x_bad = x.copy()
        x_bad[1, 2, 3, 4] = bad
        with pytest.raises(ValueError, match=msg("conv.forward: x of shape (2, 3, 8, 8) contains NaN or Inf")):
            conv.forward(x_bad, wt)
    # dy of the wrong shape for each backward node
    with pytest.raises(ValueError, match=msg("conv.backward: dy must have shape", (2, 4, 4, 4), (2, 4, 8, 8))):
        conv.backward(wt, np.ones((2, 4, 8, 8)), input_shape=x.shape, stride=2)
    with pytest.raises(ValueError, match=msg("conv.backward: dy must have shape", (2, 4, 8, 8), (2, 5, 8, 8))):
        conv.backward(wt, np.ones((2, 5, 8, 8)), input_shape=x.shape)
    with pytest.raises(ValueError, match=msg("conv.backward: dy must have rank 4", (4, 8, 8))):
        conv.backward(wt, np.ones((4, 8, 8)), input_shape=x.shape)
    with pytest.raises(ValueError, match=msg("conv.grad_weight: dy", (2, 4, 7, 8), "x", (2, 3, 8, 8))):
        conv.grad_weight(x, np.ones((2, 4, 7, 8)), kernel_size=3)
    with pytest.raises(ValueError, match=msg("conv.grad_weight: dy", (1, 4, 8, 8), "x", (2, 3, 8, 8))):
        conv.grad_weight(x, np.ones((1, 4, 8, 8)), kernel_size=3)
    with pytest.raises(ValueError, match=msg("conv.grad_bias: dy must have rank 4", (4, 8, 8))):
        conv.grad_bias(np.ones((4, 8, 8)))
