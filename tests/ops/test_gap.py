"""gap: dx = dg/(H·W) against jax.vjp and central differences; dtypes; bad input; controls."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtie import reference
from gradtie.ops import gap
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12
FD_H, FD_TOL = 1e-5, 1e-6


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@partial(jax.jit, compiler_options=QUICK)
def rendered_and_oracle(x, dg):
    _, shape = gap.forward(x)
    return gap.backward(shape, dg), reference.gap_vjp(x, dg)


def make_case(seed, shape):
    rng = np.random.default_rng(seed)
    return rng, jnp.asarray(rng.standard_normal(shape)), jnp.asarray(rng.standard_normal(shape[:2]))


shapes = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(4, 12), st.integers(4, 12))


@settings(max_examples=6)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_backward_equals_vjp_f64(shape, seed):
    _, x, dg = make_case(seed, shape)
    got, want = rendered_and_oracle(x, dg)
    assert rel_err(got, want) <= TOL_F64
    assert rel_err(gap.forward(x)[0], np.asarray(x).mean(axis=(2, 3))) <= TOL_F64


def test_wrong_divisor_controls_go_red():
    _, x, dg = make_case(1, (2, 3, 4, 6))
    _, want = rendered_and_oracle(x, dg)
    h, w = x.shape[2:]
    for wrong in (dg / h, dg / (2 * h * w), dg):  # H only, N·H·W, no division
        assert rel_err(jnp.broadcast_to(wrong[:, :, None, None], x.shape), want) > 0.1


def test_backward_matches_central_differences_f64():
    rng, x, dg = make_case(2, (2, 3, 5, 7))
    u = jnp.asarray(rng.standard_normal(x.shape))
    dx, _ = rendered_and_oracle(x, dg)

    def probe(p):
        return float(jnp.vdot(dg, gap.forward(p)[0]))

    fd = (probe(x + FD_H * u) - probe(x - FD_H * u)) / (2 * FD_H)
    scale = float(jnp.linalg.norm(dx) * jnp.linalg.norm(u))
    assert abs(fd - float(jnp.vdot(dx, u))) <= FD_TOL * scale
    assert abs(fd - float(jnp.vdot(dx * 5 / 7, u))) > 1e3 * FD_TOL * scale  # control: ÷H instead of ÷H·W


@pytest.mark.parametrize("dtype,unit", [(jnp.float32, 2.0**-24), (jnp.bfloat16, 2.0**-8)])
def test_ops_keep_f32_and_bf16_operand_dtype(dtype, unit):
    """float32 stays float32; a bf16 activation is averaged in float32 (the head's dtype)."""
    _, x64, dg64 = make_case(3, (2, 3, 6, 6))
    g, shape = gap.forward(x64.astype(dtype))
    dx = gap.backward(shape, dg64.astype(dtype))
    assert (g.dtype, dx.dtype) == (jnp.float32, dtype)
    assert rel_err(g, gap.forward(x64)[0]) <= 16 * unit
    assert rel_err(dx, gap.backward(shape, dg64)) <= 4 * unit


def test_bad_input_raises_value_error_naming_op_and_shapes():
    with pytest.raises(ValueError, match=re.escape("gap.forward: x must have rank 4, got shape (2, 3, 4)")):
        gap.forward(np.ones((2, 3, 4)))
    for dg in (np.ones((2, 4)), np.ones((2, 3, 1, 1))):
        message = f"gap.backward: dg must have shape (2, 3), got {dg.shape}"
        with pytest.raises(ValueError, match=re.escape(message)):
            gap.backward((2, 3, 4, 4), dg)
