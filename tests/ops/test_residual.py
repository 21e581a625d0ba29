"""residual: the block input's cotangent is the sum of both branches' cotangents (against jax.vjp
of a conv branch plus identity skip); dtypes; bad input; the dropped-skip control."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtie import reference
from gradtie.ops import conv, residual
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def block(x, wt):
    """a = conv(x) + x: a branch and an identity skip meeting at the fan-in."""
    return residual.forward(conv.forward(x, wt)[0], x)


@partial(jax.jit, compiler_options=QUICK)
def rendered_and_oracle(x, wt, dy):
    d_branch = conv.backward(wt, dy, input_shape=x.shape)
    (dx_want,) = reference.vjp(lambda x_: block(x_, wt), x, cotangent=dy)
    fan_in = reference.vjp(residual.forward, x, x, cotangent=dy)
    return residual.backward(d_branch, dy), dx_want, d_branch, fan_in


def make_case(seed, n, c, h, w):
    rng = np.random.default_rng(seed)
    x, dy = (jnp.asarray(rng.standard_normal((n, c, h, w))) for _ in range(2))
    return x, jnp.asarray(rng.standard_normal((c, c, 3, 3))), dy


@settings(max_examples=4)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(4, 12), st.integers(4, 12)),
       seed=st.integers(0, 2**31 - 1))
def test_backward_equals_vjp_f64(shape, seed):
    x, wt, dy = make_case(seed, *shape)
    got, want, d_branch, (d_b, d_s) = rendered_and_oracle(x, wt, dy)
    assert rel_err(got, want) <= TOL_F64
    assert rel_err(d_branch, want) > 1e-3  # control: dropping the skip's cotangent goes red
    # the fan-in itself: the cotangent reaches both summands unchanged
    assert np.array_equal(d_b, dy) and np.array_equal(d_s, dy)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ops_keep_f32_and_bf16_operand_dtype(dtype):
    x, _, dy = make_case(1, 2, 3, 4, 4)
    a, b = np.asarray(x).astype(dtype), np.asarray(dy).astype(dtype)
    want = (a.astype(np.float64) + b.astype(np.float64)).astype(dtype)  # one rounding of the exact sum
    a, b = jnp.asarray(a), jnp.asarray(b)
    for out in (residual.forward(a, b), residual.backward(a, b)):
        assert out.dtype == dtype
        assert np.array_equal(np.asarray(out), want)


def test_bad_input_raises_value_error_naming_op_and_shapes():
    a, b = np.ones((2, 3, 4, 4)), np.ones((2, 3, 2, 2))
    with pytest.raises(ValueError, match=re.escape("residual.forward: branch and skip must have the same "
                                                   "shape, got (2, 3, 4, 4), (2, 3, 2, 2)")):
        residual.forward(a, b)
    with pytest.raises(ValueError, match=re.escape("residual.backward: branch cotangent and skip cotangent "
                                                   "must have the same shape, got (2, 3, 4, 4), (2, 3, 2, 2)")):
        residual.backward(a, b)
