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
    # the rows that judged it travel with it: both arguments over their limits
    assert [r.name for r in e.value.rows] == ["arg0", "arg1"] and not any(r.ok for r in e.value.rows)
    assert all(r.ratio > 1 for r in e.value.rows) and e.value.fd is not None


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


def test_a_hand_vjp_with_the_wrong_dtype_fails():
    def f(x):
        return jnp.sin(x)

    with pytest.raises(VJPMismatch, match="dtype float32"):
        check_vjp(f, X, vjp=lambda x, ct: ((ct * jnp.cos(x)).astype(jnp.float32),))


# ---- judged only inside the smooth piece -----------------------------------------------------------

def relu_matmul(x, w):
    return jnp.maximum(x @ w, 0.0)


def relu_matmul_vjp(x, w, ct):
    """The exact VJP of relu(x @ W) (equal to autodiff's to ~1e-15), scaled by nothing."""
    g = ct * (x @ w > 0)
    return g @ w.T, x.T @ g


def scaled(vjp, by: float):
    return lambda *a: tuple(by * c for c in vjp(*a))


def matmul_point(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """x [32, 64] and W [64, 64] ~ N(0, 1), W scaled by 1/8: ~2,000 ReLU inputs, the nearest to its
    kink typically within 1e-3 (seed by seed, as a user's batch would be)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((32, 64)), rng.standard_normal((64, 64)) / 8


def near_the_kink(seed: int, distance: float) -> tuple[np.ndarray, np.ndarray]:
    """`matmul_point(seed)` with its ReLU input nearest 0 moved to `distance` above it (x's row moved
    along W's column)."""
    x, w = matmul_point(seed)
    z = x @ w
    n, j = np.unravel_index(np.argmin(np.abs(z)), z.shape)
    x[n] += (distance - z[n, j]) * w[:, j] / (w[:, j] @ w[:, j])
    assert abs((x @ w)[n, j] - distance) <= 1e-3 * distance
    return x, w


def test_a_correct_relu_matmul_vjp_passes_at_every_seed():
    """Before the step kept to the smooth piece, 3 seeds in 10 of this point raised VJPMismatch and
    others passed only under a limit of up to 480 % of the value."""
    verdicts = []
    for seed in range(10):
        rep = check_vjp(relu_matmul, *matmul_point(seed), vjp=relu_matmul_vjp)
        assert rep.ok and all(r.agrees for r in rep.rows), rep.summary()
        assert rep.fd.limit < gradtie.tolerances.ILL_CONDITIONED_REL or rep.fd.no_evidence, rep.summary()
        verdicts.append(rep.fd.verdict)
    assert verdicts.count("ok") >= 9, verdicts      # evidence at (nearly) every seed: measured 10/10


@pytest.mark.parametrize("distance", [1e-8, 1e-7, 1e-6, 1e-5])
def test_near_a_relu_kink_a_correct_vjp_is_never_called_wrong(distance):
    """The nearest ReLU input 1e-8…1e-5 from 0: the step shrinks below the kink's distance (or the
    row is no evidence); before, each of these raised VJPMismatch."""
    for seed in range(3):
        rep = check_vjp(relu_matmul, *near_the_kink(seed, distance), vjp=relu_matmul_vjp)
        assert rep.ok and rep.fd.verdict in ("ok", "no evidence"), rep.summary()
        if rep.fd.verdict == "ok":
            assert rep.fd.rel <= rep.fd.limit < gradtie.tolerances.ILL_CONDITIONED_REL


@pytest.mark.parametrize("distance", [1e-7, 1e-5])
def test_near_a_relu_kink_a_wrong_vjp_is_still_caught(distance):
    x, w = near_the_kink(0, distance)
    for by, where in [(1 + 1e-7, "arg0"), (1.001, "arg1"), (-1.0, "finite differences")]:
        with pytest.raises(VJPMismatch, match=where):
            check_vjp(relu_matmul, x, w, vjp=scaled(relu_matmul_vjp, by))
    # the autodiff tie loosened out of the way, finite differences alone catch a VJP off by 1e-3
    with pytest.raises(VJPMismatch, match="finite differences along a random direction"):
        check_vjp(relu_matmul, x, w, vjp=scaled(relu_matmul_vjp, 1.001), factor=1e12)
    with pytest.raises(VJPMismatch, match="shape"):
        check_vjp(relu_matmul, x, w, vjp=lambda x_, w_, ct: (relu_matmul_vjp(x_, w_, ct)[0][:1], w_))


def _pool(x):
    """2×2 max pool of [N, C, H, W]."""
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def _pool_vjp(x, ct):
    n, c, h, w = x.shape
    win = x.reshape(n, c, h // 2, 2, w // 2, 2)
    chosen = win == _pool(x)[:, :, :, None, :, None]
    return ((chosen * ct[:, :, :, None, :, None]).reshape(x.shape),)


def _leaky(z):
    return jnp.where(z > 0, z, 0.1 * z)


def _composed(x, w):
    """clip(|leaky(x @ W)|, 0, 0.6) pooled over pairs of columns: every kink of the family at once."""
    y = jnp.clip(jnp.abs(_leaky(x @ w)), 0.0, 0.6)
    return jnp.maximum(y[:, 0::2], y[:, 1::2])


def _composed_vjp(x, w, ct):
    z = x @ w
    a = jnp.abs(_leaky(z))
    y = jnp.clip(a, 0.0, 0.6)
    left = y[:, 0::2] >= y[:, 1::2]
    dy = jnp.zeros_like(y).at[:, 0::2].set(ct * left).at[:, 1::2].set(ct * ~left)
    dz = dy * (a < 0.6) * jnp.sign(z) * jnp.where(z > 0, 1.0, 0.1)
    return dz @ w.T, x.T @ dz


def _pool_near_a_tie(gap: float) -> np.ndarray:
    """[2, 3, 8, 8] images whose first window's runner-up sits `gap` below its maximum."""
    x = np.random.default_rng(5).standard_normal((2, 3, 8, 8))
    x[0, 0, 0, 1] = x[0, 0, :2, :2].max() - gap if x[0, 0, 0, 1] != x[0, 0, :2, :2].max() else x[0, 0, 0, 1]
    x[0, 0, 0, 0] = x[0, 0, :2, :2].max() + 0.0 if x[0, 0, 0, 0] == x[0, 0, :2, :2].max() else x[0, 0, 0, 0]
    top = np.unravel_index(np.argmax(x[0, 0, :2, :2]), (2, 2))
    runner = (0, 1) if top != (0, 1) else (0, 0)
    x[0, 0][runner] = x[0, 0][top] - gap
    return x


def _near(kind: str, gap: float):
    """(f, vjp, args): one piecewise-smooth function a user would bring, its point `gap` from a kink."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 8))
    if kind == "max pool near a tie":
        return _pool, _pool_vjp, (_pool_near_a_tie(gap),)
    z0 = x.copy()
    z0[2, 3] = gap
    if kind == "leaky relu":
        return _leaky, lambda z, ct: (ct * jnp.where(z > 0, 1.0, 0.1),), (z0,)
    if kind == "abs":
        return jnp.abs, lambda z, ct: (ct * jnp.sign(z),), (z0,)
    if kind == "clip":
        z0[4, 5] = 0.5 - gap
        return (lambda z: jnp.clip(z, 0.0, 0.5)), (lambda z, ct: (ct * ((z > 0) & (z < 0.5)),)), (z0,)
    if kind == "max of two":
        b = x + rng.uniform(-1, 1, x.shape)
        b[1, 1] = x[1, 1] - gap
        return (lambda a, b_: jnp.maximum(a, b_)), (lambda a, b_, ct: (ct * (a >= b_), ct * (a < b_))), (x, b)
    w = rng.standard_normal((8, 8)) / 3
    z = x @ w
    n, j = np.unravel_index(np.argmin(np.abs(z)), z.shape)
    x[n] += (gap - z[n, j]) * w[:, j] / (w[:, j] @ w[:, j])
    return _composed, _composed_vjp, (x, w)


KINDS = ["max pool near a tie", "leaky relu", "abs", "clip", "max of two", "composed"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_piecewise_smooth_kind_is_judged_inside_its_piece(kind):
    """Max pools near a tie, leaky ReLU, abs, clip, a pairwise max and a composition of them, each at
    1e-8…1e-4 from its kink: a correct VJP passes or is no evidence, never a mismatch; a wrong one
    (off by 1e-3, or its sign flipped) is caught at each distance."""
    for gap in (1e-8, 1e-6, 1e-4):
        f, vjp, args = _near(kind, gap)
        rep = check_vjp(f, *args, vjp=vjp)
        assert rep.ok and rep.fd.verdict in ("ok", "no evidence"), (gap, rep.summary())
        for by in (1.001, -1.0):
            with pytest.raises(VJPMismatch):
                check_vjp(f, *args, vjp=scaled(vjp, by))


def test_no_step_inside_the_piece_is_no_evidence_never_a_failure():
    """In float32 a step below 1e-5 measures round-off alone: a ReLU input 8e-6·|v| from its kink
    (not on it: the float64 point is smooth there) leaves no step inside the piece."""
    x = np.asarray([0.7, -1.3, 0.4], np.float32)
    rng = gradtie.prng.host_rng(jax.random.key(0))
    rng.standard_normal(3)                                   # the cotangent check_vjp draws first,
    v = rng.standard_normal(3)                               # then the direction, as long as max|x|
    v *= max(1.0, float(np.max(np.abs(x)))) / np.linalg.norm(v)
    shift = (x.astype(np.float64) + 8e-6 * v).astype(np.float32)   # entry 0 … 2 crosses at t ≈ 8e-6

    def f(z):
        return jnp.maximum(z - shift, 0.0)

    rep = check_vjp(f, jnp.asarray(x), vjp=lambda z, ct: (ct * (z - shift > 0),))
    assert rep.ok and rep.fd.kinked and rep.fd.verdict == "no evidence" and rep.fd.no_evidence == "kink"
    assert "no evidence (kink)" in rep.summary()


def test_a_limit_the_size_of_the_value_is_no_evidence():
    """A function flat along every direction (clip with every input saturated): its finite
    difference is round-off against a value of 0, and the row says so instead of passing."""
    z = jnp.asarray(np.random.default_rng(0).choice([-2.0, 2.0], (4, 5)))
    rep = check_vjp(lambda a: jnp.clip(a, -1.0, 1.0), z, vjp=lambda a, ct: (ct * (jnp.abs(a) < 1),))
    assert rep.ok and rep.fd.verdict == "no evidence" and rep.fd.no_evidence == "round-off"
    assert "no evidence (round-off)" in rep.summary()


# ---- the dtype it was given ------------------------------------------------------------------------

def test_a_float32_vjp_is_checked_in_float32():
    seen = []

    def right(x, w, ct):
        seen.append({np.dtype(a.dtype).name for a in (x, w, ct)})
        return ct * w * jax.nn.sigmoid(x), ct * jnp.logaddexp(x, 0.0)

    def f(x, w):
        return jnp.logaddexp(x, 0.0) * w

    x32, w32 = X.astype(jnp.float32), W.astype(jnp.float32)
    rep = check_vjp(f, x32, w32, vjp=right)
    assert rep.ok and rep.dtype == "float32" and seen == [{"float32"}]
    assert rep.summary().startswith("float32 VJP checked in float32")
    # held to float32's envelope, floored at F32_FLOOR: far looser than float64's, still catches 1e-3
    assert all(r.floor == gradtie.tolerances.F32_FLOOR for r in rep.rows)
    with pytest.raises(VJPMismatch):
        check_vjp(f, x32, w32, vjp=scaled(right, 1.001))
    with pytest.raises(VJPMismatch, match="dtype float64"):     # a float64 cotangent for float32 arguments
        check_vjp(f, x32, w32, vjp=lambda x, w, ct: tuple(c.astype(jnp.float64) for c in right(x, w, ct)))
    assert check_vjp(f, X, W, vjp=right).dtype == "float64"


def test_mixed_or_integer_arguments_are_refused():
    with pytest.raises(ValueError, match="mix float32 and float64"):
        check_vjp(lambda a, b: a * b, X.astype(jnp.float32), W, vjp=lambda a, b, ct: (ct * b, ct * a))
    with pytest.raises(ValueError, match="arg0 is int"):
        check_vjp(lambda a: a * 2.0, jnp.arange(3), vjp=lambda a, ct: (2.0 * ct,))


def test_within_float32_round_off_of_a_kink_the_tie_is_no_evidence():
    """A ReLU input 1e-8 from 0 is at the kink as far as float32 can tell where rounding the point
    moves it across (by ~1e-7): the point's float32 envelope then says so and the tie reads no
    evidence. Nothing is called wrong, and a VJP off by 1e-3 is caught or no evidence, never tied."""
    outcomes = set()
    for seed in range(6):
        x, w = (a.astype(np.float32) for a in near_the_kink(seed, 1e-8))
        rep = check_vjp(relu_matmul, x, w, vjp=relu_matmul_vjp)
        assert rep.ok, rep.summary()
        try:
            wrong = check_vjp(relu_matmul, x, w, vjp=scaled(relu_matmul_vjp, 1.001))
        except VJPMismatch:
            outcomes.add("caught")
        else:
            assert wrong.no_evidence and "no evidence (round-off" in wrong.summary(), wrong.summary()
            assert not any(r.agrees for r in wrong.rows if r.rel > 1e-4)
            outcomes.add("no evidence")
        with pytest.raises(VJPMismatch):              # a sign flip is larger than any envelope
            check_vjp(relu_matmul, x, w, vjp=scaled(relu_matmul_vjp, -1.0))
    assert outcomes == {"caught", "no evidence"}, outcomes    # both occur among these seeds
