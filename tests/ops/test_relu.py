"""relu: the strict mask `pre > 0` against jax.vjp (zeros included) and central differences;
dtypes; bad input; a must-fail control for each."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtie import reference
from gradtie.ops import relu
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

FD_H, FD_TOL = 1e-5, 1e-6


@partial(jax.jit, compiler_options=QUICK)
def rendered_and_oracle(x, dy):
    return relu.backward(relu.forward(x)[1], dy), reference.relu_vjp(x, dy)


def make_case(seed, shape):
    """Pre-activations with exact zeros, and |x| ≥ 0.1 elsewhere (no kink within FD reach)."""
    rng = np.random.default_rng(seed)
    x = np.sign(rng.standard_normal(shape)) * (0.1 + np.abs(rng.standard_normal(shape)))
    x[rng.random(shape) < 0.2] = 0.0
    return rng, jnp.asarray(x), jnp.asarray(rng.standard_normal(shape))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(4, 12), st.integers(4, 12))


@settings(max_examples=6)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_backward_equals_vjp_f64(shape, seed):
    _, x, dy = make_case(seed, shape)
    got, want = rendered_and_oracle(x, dy)
    assert np.array_equal(got, want)  # a selection: exact, zeros included


def test_mask_is_strict_at_zero():
    x = jnp.asarray([-1.0, 0.0, -0.0, 2.0])
    dy = jnp.ones(4)
    assert np.array_equal(relu.backward(relu.forward(x)[1], dy), [0.0, 0.0, 0.0, 1.0])
    assert np.array_equal(relu.forward(x)[0], [0.0, 0.0, 0.0, 2.0])
    assert np.array_equal(reference.relu_vjp(x, dy), [0.0, 0.0, 0.0, 1.0])


def test_wrong_mask_controls_go_red():
    _, x, dy = make_case(1, (2, 3, 6, 6))
    _, want = rendered_and_oracle(x, dy)
    assert not np.array_equal(jnp.where(x >= 0, dy, 0.0), want)  # non-strict mask: 1 at 0
    assert not np.array_equal(dy, want)  # no mask


def test_backward_matches_central_differences_f64():
    rng, x, dy = make_case(2, (2, 3, 5, 7))
    x = jnp.where(x == 0, 0.5, x)  # differentiable point
    u = jnp.asarray(rng.standard_normal(x.shape))
    dx, _ = rendered_and_oracle(x, dy)

    def probe(p):
        return float(jnp.vdot(dy, relu.forward(p)[0]))

    fd = (probe(x + FD_H * u) - probe(x - FD_H * u)) / (2 * FD_H)
    scale = float(jnp.linalg.norm(dx) * jnp.linalg.norm(u))
    assert abs(fd - float(jnp.vdot(dx, u))) <= FD_TOL * scale
    assert abs(fd - float(jnp.vdot(dy, u))) > 1e3 * FD_TOL * scale  # control: no mask


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ops_keep_f32_and_bf16_operand_dtype(dtype):
    _, x64, dy64 = make_case(3, (2, 3, 4, 4))
    x, dy = x64.astype(dtype), dy64.astype(dtype)
    y, saved = relu.forward(x)
    dx = relu.backward(saved, dy)
    assert (y.dtype, dx.dtype) == (dtype, dtype)
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    assert np.array_equal(np.asarray(y, np.float64), np.maximum(x, 0))
    assert np.array_equal(np.asarray(dx, np.float64), np.where(x > 0, dy, 0))


def test_bad_input_raises_value_error_naming_op_and_shapes():
    saved = relu.ReluSaved(np.ones((2, 3, 4, 4)))
    with pytest.raises(ValueError, match=re.escape("relu.backward: pre and dy must have the same shape, "
                                                   "got (2, 3, 4, 4), (2, 3, 4, 5)")):
        relu.backward(saved, np.ones((2, 3, 4, 5)))
