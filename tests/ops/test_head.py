"""head: the six-op cotangent (p − t̃)/N against jax.grad of the smoothed cross-entropy for one-hot
and mixup targets; the loss value; its minimum H(t̃); one_hot; bad targets; controls."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtie import reference
from gradtie.ops import head
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12
FD_H, FD_TOL = 1e-5, 1e-6
K = 10


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def make_case(seed, n, kind, k=K):
    """Logits and targets: one-hot rows, or mixup rows λ·e_a + (1−λ)·e_b."""
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(0, 2, (n, k)))
    t = np.eye(k)[rng.integers(0, k, n)]
    if kind == "mixup":
        lam = rng.uniform(0, 1, (n, 1))
        t = lam * t + (1 - lam) * np.eye(k)[rng.integers(0, k, n)]
    return rng, z, jnp.asarray(t)


def composed(z, t, alpha, k_shift, n_div):
    """The six kit ops with the shift's K and the divisor as parameters (for the controls)."""
    d1 = head.add(head.sub(head.softmax_row(z), t), head.scale(alpha, t))
    return head.div_const(head.shift(d1, alpha / k_shift), n_div)


oracle = jax.jit(jax.grad(reference.smoothed_cross_entropy), static_argnums=2, compiler_options=QUICK)


@partial(jax.jit, static_argnums=3, compiler_options=QUICK)
def cotangent_and_difference(z, t, u, alpha):
    """head.cotangent and the central difference of head.forward along u, in one compile (inside
    jit the value checks on the targets are skipped)."""
    fd = (head.forward(z + FD_H * u, t, alpha) - head.forward(z - FD_H * u, t, alpha)) / (2 * FD_H)
    return head.cotangent(z, t, alpha), fd


CASES = pytest.mark.parametrize("n,alpha,kind", [(n, a, kind) for n in (3, 4) for a in (0.0, 0.1)
                                                 for kind in ("onehot", "mixup")])


@CASES
def test_cotangent_equals_autodiff_f64(n, alpha, kind):
    _, z, t = make_case(n + int(10 * alpha), n, kind)
    want = oracle(z, t, alpha)
    assert rel_err(head.cotangent(z, t, alpha), want) <= TOL_F64
    # it is (p − t̃)/N
    assert rel_err(head.cotangent(z, t, alpha), (jax.nn.softmax(z) - head.smoothed(t, alpha)) / n) <= TOL_F64


@CASES
def test_forward_equals_reference_loss_f64(n, alpha, kind):
    _, z, t = make_case(2 * n + int(10 * alpha), n, kind)
    want = float(reference.smoothed_cross_entropy(z, t, alpha))
    assert abs(float(head.forward(z, t, alpha)) - want) <= TOL_F64 * abs(want)


@pytest.mark.parametrize("n,kind", [(3, "onehot"), (3, "mixup"), (4, "mixup")])
def test_wrong_cotangent_controls_go_red(n, kind):
    alpha = 0.1
    _, z, t = make_case(5, n, kind)
    want = oracle(z, t, alpha)
    assert rel_err(composed(z, t, alpha, K, n), want) <= TOL_F64  # the composition is the cotangent
    assert rel_err(composed(z, t, alpha, K + 1, n), want) > 1e-3  # wrong K in α/K
    assert rel_err(composed(z, t, alpha, K, 1), want) > 1e-3  # 1/N dropped
    assert rel_err(head.cotangent(z, head.smoothed(t, alpha), alpha), want) > 1e-3  # smoothed twice
    assert rel_err(head.cotangent(z, t, 0.0), want) > 1e-3  # smoothing forgotten


# ---- a padded batch: per-example losses and the cotangent's divisor --------------------------------

@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_masked_loss_cotangent_is_the_divisor_form_f64(alpha):
    """row_losses are the values forward averages, each the loss of its example alone; a padded
    batch's loss Σ valid·rows / D has cotangent(divisor=D)·valid as its autodiff gradient (the
    rendered step's padded head, and the data-parallel step's global count D)."""
    _, z, t = make_case(11, 4, "mixup")
    rows = head.row_losses(z, t, alpha)
    loss = float(head.forward(z, t, alpha))
    assert rows.shape == (4,) and abs(float(jnp.mean(rows)) - loss) <= TOL_F64 * abs(loss)
    alone = np.array([float(head.forward(z[i:i + 1], t[i:i + 1], alpha)) for i in range(4)])
    assert rel_err(rows, alone) <= TOL_F64
    valid = jnp.asarray([1.0, 0.0, 1.0, 1.0])
    want = jax.grad(lambda z_: jnp.sum(valid * head.row_losses(z_, t, alpha)) / 5.0)(z)
    got = head.cotangent(z, t, alpha, divisor=5.0) * valid[:, None]
    assert rel_err(got, want) <= TOL_F64
    # controls: the batch's own N in place of D, and the padded row left unmasked
    assert rel_err(head.cotangent(z, t, alpha) * valid[:, None], want) > 0.1
    assert rel_err(head.cotangent(z, t, alpha, divisor=5.0), want) > 0.1


@settings(max_examples=4)
@given(n=st.integers(1, 5), k=st.integers(2, 12), alpha=st.sampled_from([0.0, 0.1, 0.3]),
       kind=st.sampled_from(["onehot", "mixup"]), seed=st.integers(0, 2**31 - 1))
def test_cotangent_matches_central_differences_f64(n, k, alpha, kind, seed):
    rng, z, t = make_case(seed, n, kind, k)
    u = rng.standard_normal(z.shape)
    g, fd = cotangent_and_difference(z, t, jnp.asarray(u), alpha)
    g, fd = np.asarray(g), float(fd)
    scale = np.linalg.norm(g) * np.linalg.norm(u)
    assert abs(fd - np.vdot(g, u)) <= FD_TOL * scale
    if n > 1:  # control: the 1/N dropped
        assert abs(fd - np.vdot(n * g, u)) > 1e3 * FD_TOL * scale


def test_minimum_of_smoothed_loss_is_entropy_of_smoothed_target():
    alpha = 0.1
    t = head.one_hot(jnp.asarray([3, 0, 9]), K, dtype=jnp.float64)
    tt = head.smoothed(t, alpha)  # 0.91 on the label, 0.01 elsewhere
    entropy = -(0.91 * np.log(0.91) + 9 * 0.01 * np.log(0.01))
    assert abs(entropy - 0.5003) < 5e-5
    z = jnp.log(tt)
    loss = float(head.forward(z, t, alpha))
    assert abs(loss - entropy) <= 1e-12
    assert float(jnp.max(jnp.abs(head.cotangent(z, t, alpha)))) <= 1e-15  # stationary
    rng = np.random.default_rng(6)
    for _ in range(5):  # and a minimum: any nudge raises the loss
        assert float(head.forward(z + 0.1 * jnp.asarray(rng.standard_normal(z.shape)), t, alpha)) > loss
    # control: upstream's ≈0.485 is not the minimum, and confident logits sit above it
    assert abs(loss - 0.485) > 0.01
    assert float(head.forward(20.0 * t, t, alpha)) > loss + 1.0


def test_one_hot_rejects_out_of_range_labels():
    assert np.array_equal(head.one_hot(jnp.asarray([0, 2, 1]), 3), np.eye(3)[[0, 2, 1]])
    for labels in ([0, 3], [-1, 0]):
        with pytest.raises(ValueError, match=r"one_hot: labels must lie in 0…2"):
            head.one_hot(jnp.asarray(labels), 3)
    with pytest.raises(ValueError, match=re.escape("one_hot: labels must be a 1-D integer array, got float")):
        head.one_hot(jnp.asarray([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match=re.escape("one_hot: labels must be a 1-D integer array, got int")):
        head.one_hot(jnp.asarray([[0, 1]]), 3)


@pytest.mark.parametrize("op", ["forward", "cotangent"])
def test_bad_targets_raise_value_error_naming_op_and_shapes(op):
    f = getattr(head, op)
    _, z, t = make_case(7, 3, "mixup")
    z, t = np.asarray(z), np.asarray(t)
    off = t.copy()
    off[1, 0] += 0.01
    with pytest.raises(ValueError, match=msg(f"head.{op}: every target row must sum to 1", "targets (3, 10)")):
        f(z, off)
    with pytest.raises(ValueError, match=msg(f"head.{op}: every target row must sum to 1", "targets (3, 10)")):
        f(z, 0.5 * t)
    with pytest.raises(ValueError, match=msg(f"head.{op}: targets must have the logits' shape (3, 10)",
                                             "got (3, 9)")):
        f(z, t[:, :9] / t[:, :9].sum(axis=1, keepdims=True))
    with pytest.raises(ValueError, match=msg(f"head.{op}: targets must have rank 2, got shape (30,)")):
        f(z, t.reshape(-1))
    with pytest.raises(ValueError, match=msg(f"head.{op}: logits must have rank 2, got shape (3, 10, 1)")):
        f(z[..., None], t)
    for name, bad_z, bad_t in (("logits", np.where(z == z[0, 0], np.nan, z), t),
                               ("targets", z, np.where(t == t[0, 0], np.inf, t))):
        with pytest.raises(ValueError, match=msg(f"head.{op}: {name} of shape (3, 10) contains NaN or Inf")):
            f(bad_z, bad_t)


def msg(*parts):
    """A pattern for a message holding these parts in order (tuples as shapes print)."""
    return ".*".join(re.escape(str(p)) for p in parts)
