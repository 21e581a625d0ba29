"""`gradtie.check_vjp`: a hand-written VJP tied to autodiff and to finite differences at a point,
kink-aware. It passes a right custom VJP, raises `VJPMismatch` on a wrong one (off by a relative
1e-3, or with its sign flipped), raises `NotSmooth` where the point sits on a kink (a ReLU input
exactly 0, a max tied between two inputs), and takes a plain function with its VJP as `vjp=`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradtie
from gradtie import NotSmooth, VJPMismatch, check_vjp


def softplus_with(scale: float = 1.0):
    """softplus(x)·w with a hand-written VJP, its cotangents multiplied by `scale` (1: right)."""
    @jax.custom_vjp
    def f(x, w):
        return jnp.logaddexp(x, 0.0) * w

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, ct):
        x, w = res
        return scale * ct * w * jax.nn.sigmoid(x), scale * ct * jnp.logaddexp(x, 0.0)

    f.defvjp(fwd, bwd)
    return f


def relu_custom():
    @jax.custom_vjp
    def relu(x):
        return jnp.maximum(x, 0.0)

    relu.defvjp(lambda x: (relu(x), x), lambda x, ct: (ct * (x > 0),))
    return relu


def pairwise_max_custom():
    """max(a, b) elementwise, the cotangent routed to a where a ≥ b."""
    @jax.custom_vjp
    def m(a, b):
        return jnp.maximum(a, b)

    m.defvjp(lambda a, b: (m(a, b), (a, b)), lambda r, ct: (ct * (r[0] >= r[1]), ct * (r[0] < r[1])))
    return m


X = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))
W = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, (3, 4)))


def test_a_right_custom_vjp_passes():
    rep = check_vjp(softplus_with(1.0), X, W)
    assert rep.ok and len(rep.rows) == 2 and all(r.agrees for r in rep.rows)
    assert rep.fd.ok and rep.fd.rel <= rep.fd.limit
    assert "2/2 arguments" in rep.summary() and "agree" in rep.summary()
    assert gradtie.check_vjp is check_vjp


@pytest.mark.parametrize("scale", [1.001, -1.0], ids=["scaled-1.001", "sign-flipped"])
def test_a_wrong_custom_vjp_raises(scale):
    with pytest.raises(VJPMismatch, match="not the derivative") as e:
        check_vjp(softplus_with(scale), X, W)
    assert "arg0" in str(e.value) and "arg1" in str(e.value)
    assert isinstance(e.value, AssertionError)     # as jax.test_util.check_grads raises


def test_relu_at_an_input_exactly_zero_is_not_smooth():
    x = X.at[1, 2].set(0.0)
    with pytest.raises(NotSmooth, match="kink"):
        check_vjp(relu_custom(), x)
    # control: the same relu away from 0 is judged, and passes
    assert check_vjp(relu_custom(), X).ok


def test_a_tied_max_is_not_smooth():
    a = X
    b = X.at[0, 0].add(1.0).at[2, 3].set(X[2, 3])     # b = a at every cell but one: ties everywhere else
    b = jnp.where(jnp.arange(12).reshape(3, 4) % 2 == 0, X - 0.5, b)   # half the cells untied
    with pytest.raises(NotSmooth):
        check_vjp(pairwise_max_custom(), a, b)
    # control: the same max with no tie is judged, and passes
    assert check_vjp(pairwise_max_custom(), a, a + 0.25 * jnp.sign(W - 1.0) + 0.1).ok


def test_not_smooth_is_not_a_mismatch():
    """The kink refusal is its own error, not a verdict on the VJP."""
    assert not issubclass(NotSmooth, AssertionError) and not issubclass(VJPMismatch, NotSmooth)


def test_a_plain_function_takes_its_vjp_as_an_argument():
    def f(x, w):
        return jnp.tanh(x) * w

    def right(x, w, ct):
        return ct * w * (1 - jnp.tanh(x) ** 2), ct * jnp.tanh(x)

    def wrong(x, w, ct):        # forgot the chain rule through tanh
        return ct * w, ct * jnp.tanh(x)

    assert check_vjp(f, X, W, vjp=right).ok
    with pytest.raises(VJPMismatch, match="arg0"):
        check_vjp(f, X, W, vjp=wrong)


def test_a_plain_function_without_a_vjp_is_refused():
    with pytest.raises(ValueError, match="custom_vjp"):
        check_vjp(lambda x: x * 2.0, X)


def test_a_hand_vjp_with_the_wrong_shape_fails():
    def f(x):
        return jnp.sin(x)

    with pytest.raises(VJPMismatch, match="shape"):
        check_vjp(f, X, vjp=lambda x, ct: (jnp.sum(ct * jnp.cos(x), axis=0, keepdims=True),))
