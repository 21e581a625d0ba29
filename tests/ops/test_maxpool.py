"""maxpool (2×2/s2 and 3×3/s2 pad 1): the backward against jax.vjp and central differences away
from ties; at ties and dead windows against an explicit first-max loop; overlap accumulation;
symmetric padding vs XLA 'SAME'; dtypes; bad input; a must-fail control for each.

Everything a test reads comes from one jitted `evaluate` per (shape, pool, dtype), and the fixed
cases reuse the explicit examples' shapes: XLA compiles dominate the runtime on CPU.
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
from gradtie.ops import maxpool
from gradtie.ops.maxpool import POOL2, POOL3S2
from gradtie.rendered import QUICK  # compile-bound checks: LLVM's optimisation off

TOL_F64 = 1e-12
FD_H, FD_TOL = 1e-5, 1e-6
SPECS = {"2x2": POOL2, "3x3s2": POOL3S2}


def rel_err(got, want):
    """max|got − want| relative to max|want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def pool_loop(x, dy, spec):
    """The definition, independently of the kernel: −∞ padding, window (i,j) from row s·i−p, the
    first maximal cell in row-major window order (strict >), overlapping cotangents added.
    Returns (y, dx, σ)."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    k, s, p = spec.size, spec.stride, spec.pad
    n, c, h, w = x.shape
    xp = np.full((n, c, h + 2 * p, w + 2 * p), -np.inf)
    xp[:, :, p:p + h, p:p + w] = x
    ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    y, sigma, dxp = np.empty((n, c, ho, wo)), np.empty((n, c, ho, wo), int), np.zeros_like(xp)
    for a, b, i, j in np.ndindex(n, c, ho, wo):
        win = xp[a, b, s * i:s * i + k, s * j:s * j + k]
        best = (0, 0)
        for kh, kw in np.ndindex(k, k):
            if win[kh, kw] > win[best]:
                best = (kh, kw)
        y[a, b, i, j], sigma[a, b, i, j] = win[best], best[0] * k + best[1]
        dxp[a, b, s * i + best[0], s * j + best[1]] += dy[a, b, i, j]
    return y, dxp[:, :, p:p + h, p:p + w], sigma


# ---- deliberately wrong backwards (the controls) --------------------------------------------

def last_max_backward(x, dy, spec):
    """Route to the LAST maximal cell of each window."""
    sigma = spec.size**2 - 1 - jnp.argmax(maxpool.windows(x, spec)[..., ::-1], axis=-1)
    return maxpool.scatter(sigma, dy, x.shape, spec)


def top_left_backward(x, dy, spec):
    """Route every window to its first cell, max or not."""
    return maxpool.scatter(jnp.zeros(dy.shape, int), dy, x.shape, spec)


def overwrite_backward(x, dy, spec):
    """Overlapping windows overwrite instead of adding."""
    sigma = maxpool.select(x, spec)
    k, s, p = spec.size, spec.stride, spec.pad
    n, c, h, w = x.shape
    ho, wo = dy.shape[2:]
    dxp = jnp.zeros((n, c, h + 2 * p, w + 2 * p), dy.dtype)
    for kh in range(k):
        for kw in range(k):
            cells = (slice(None), slice(None), slice(kh, kh + s * (ho - 1) + 1, s),
                     slice(kw, kw + s * (wo - 1) + 1, s))
            dxp = dxp.at[cells].set(jnp.where(sigma == kh * k + kw, dy, dxp[cells]))
    return dxp[:, :, p:p + h, p:p + w]


def other_kind_backward(x, dy, spec):
    """The other pool's backward paired with this forward (same output shape at even H and W)."""
    other = POOL3S2 if spec is POOL2 else POOL2
    if maxpool.out_size(x.shape[2], other) != dy.shape[2] or maxpool.out_size(x.shape[3], other) != dy.shape[3]:
        return None
    return maxpool.backward(maxpool.PoolSaved(x, other), dy)


@partial(jax.jit, static_argnames="spec", compiler_options=QUICK)
def evaluate(x, dy, u, spec):
    """y, the rendered dx, the autodiff dx, σ, the gather model at σ, and the central difference
    of <dy, pool(x)> along u."""
    y, saved = maxpool.forward(x, spec)
    sigma = maxpool.select(x, spec)

    def probe(p):
        return jnp.vdot(dy, maxpool.forward(p, spec)[0])

    return dict(y=y, dx=maxpool.backward(saved, dy), vjp=reference.maxpool_vjp(x, dy, spec), sigma=sigma,
                gathered=maxpool.gather(x, sigma, spec),
                fd=(probe(x + FD_H * u) - probe(x - FD_H * u)) / (2 * FD_H))


@partial(jax.jit, static_argnames="spec", compiler_options=QUICK)
def controls(x, dy, spec):
    """The wrong backwards at the same point."""
    return dict(last=last_max_backward(x, dy, spec), top_left=top_left_backward(x, dy, spec),
                overwrite=overwrite_backward(x, dy, spec), other_kind=other_kind_backward(x, dy, spec))


@partial(jax.jit, static_argnames="spec", compiler_options=QUICK)
def forward_backward(x, dy, spec):
    y, saved = maxpool.forward(x, spec)
    return y, maxpool.backward(saved, dy)


def run(x, dy, spec, u=None, wrong=False):
    x = jnp.asarray(x)
    dy = jnp.asarray(dy, x.dtype)
    out = evaluate(x, dy, jnp.zeros_like(x) if u is None else jnp.asarray(u), spec)
    return {**out, **controls(x, dy, spec)} if wrong else out


def make_case(seed, n, c, h, w, kind):
    """Input values a permutation of a grid 0.01 apart (no ties, none within FD reach), dy and a
    direction u."""
    spec = SPECS[kind]
    rng = np.random.default_rng(seed)
    x = rng.permutation(n * c * h * w).reshape(n, c, h, w) * 0.01 - 1.0
    dy = rng.standard_normal((n, c, maxpool.out_size(h, spec), maxpool.out_size(w, spec)))
    return spec, rng, x, dy, rng.standard_normal(x.shape)


cases = st.fixed_dictionaries(dict(
    n=st.integers(1, 3), c=st.integers(1, 4), h=st.integers(4, 12), w=st.integers(4, 12),
    kind=st.sampled_from(sorted(SPECS)), seed=st.integers(0, 2**31 - 1)))
ODD = dict(n=2, c=3, h=9, w=7, kind="3x3s2", seed=1)   # odd H and W
EVEN = dict(n=2, c=2, h=8, w=6, kind="3x3s2", seed=2)  # even: the 3×3/s2 grid has the 2×2 shape
POOL2_EX = dict(n=3, c=2, h=6, w=10, kind="2x2", seed=3)


def case_of(d):
    h, w = (d["h"] - d["h"] % 2, d["w"] - d["w"] % 2) if d["kind"] == "2x2" else (d["h"], d["w"])
    return make_case(d["seed"], d["n"], d["c"], h, w, d["kind"])


# ---- claim 1: away from ties, the rendered backward == jax.vjp, float64 ------------------------

@settings(max_examples=3)
@given(d=cases)
@example(d=ODD)
@example(d=EVEN)
@example(d=POOL2_EX)
def test_backward_equals_vjp_f64(d):
    spec, _, x, dy, _ = case_of(d)
    r = run(x, dy, spec)
    assert rel_err(r["dx"], r["vjp"]) <= TOL_F64
    y_loop, dx_loop, _ = pool_loop(x, dy, spec)  # the explicit definition agrees too
    assert np.array_equal(r["y"], y_loop)
    assert rel_err(r["dx"], dx_loop) <= TOL_F64


@pytest.mark.parametrize("d", [EVEN, POOL2_EX], ids=["3x3s2", "2x2"])
def test_wrong_backward_controls_go_red(d):
    """Routing to the top-left cell, or the other pool's backward with this forward, both fail."""
    spec, _, x, dy, _ = case_of(d)
    r = run(x, dy, spec, wrong=True)
    assert rel_err(r["top_left"], r["vjp"]) > 0.1
    assert rel_err(r["other_kind"], r["vjp"]) > 0.1


# ---- claim 1: central finite differences (the pool is linear near a tie-free point) -------------

@settings(max_examples=1)
@given(d=cases)
@example(d=EVEN)
@example(d=POOL2_EX)
def test_backward_matches_central_differences_f64(d):
    spec, _, x, dy, u = case_of(d)
    r = run(x, dy, spec, u)
    fd, dx = float(r["fd"]), np.asarray(r["dx"])
    scale = np.linalg.norm(dx) * np.linalg.norm(u)
    assert abs(fd - np.vdot(dx, u)) <= FD_TOL * scale


@pytest.mark.parametrize("d", [EVEN, POOL2_EX], ids=["3x3s2", "2x2"])
def test_central_differences_control_goes_red(d):
    spec, _, x, dy, u = case_of(d)
    r = run(x, dy, spec, u, wrong=True)
    scale = np.linalg.norm(np.asarray(r["dx"])) * np.linalg.norm(u)
    assert abs(float(r["fd"]) - np.vdot(np.asarray(r["top_left"]), u)) > 1e3 * FD_TOL * scale


# ---- claim 3: ties and dead windows route to the first maximal cell --------------------------

TIES_2X2 = [  # (window, first maximal cell)
    ([[1, 1], [1, 1]], (0, 0)),  # 4-way
    ([[0, 2], [2, 0]], (0, 1)),  # 2-way, anti-diagonal
    ([[0, 3], [3, 3]], (0, 1)),  # 3-way
    ([[0, 0], [0, 0]], (0, 0)),  # dead (post-ReLU zeros)
    ([[0, 0], [5, 5]], (1, 0)),  # 2-way, bottom row
    ([[0, 4], [0, 4]], (0, 1)),  # 2-way, right column
    ([[6, 0], [0, 6]], (0, 0)),  # 2-way, diagonal
    ([[0, 0], [0, 7]], (1, 1)),  # strict
]


def test_2x2_ties_and_dead_windows_route_to_first_max():
    """The windows above in example 0, channel 0; every other window dead (all zero)."""
    spec, rng, x, dy, _ = case_of(POOL2_EX)  # [3,2,6,10]: 3×5 windows per channel
    x, want = np.zeros_like(x), np.zeros_like(x)
    routes = {}
    for m, (win, cell) in enumerate(TIES_2X2):
        i, j = divmod(m, 5)
        x[0, 0, 2 * i:2 * i + 2, 2 * j:2 * j + 2] = win
        routes[(0, 0, i, j)] = cell
    for a, b, i, j in np.ndindex(dy.shape):
        r, c = routes.get((a, b, i, j), (0, 0))  # dead windows: the top-left cell
        want[a, b, 2 * i + r, 2 * j + c] = dy[a, b, i, j]
    r = run(x, dy, spec, wrong=True)
    assert np.array_equal(r["dx"], want)
    assert np.array_equal(pool_loop(x, dy, spec)[1], want)
    assert not np.array_equal(r["last"], want)  # control: the last maximal cell


@pytest.mark.parametrize("d", [ODD, EVEN], ids=["odd", "even"])
def test_3x3s2_dead_windows_route_to_first_real_cell(d):
    """All-zero input: window (i,j)'s first real cell is (max(2i−1, 0), max(2j−1, 0)): the
    padding is −∞, so a dead window routes past it."""
    spec, _, x, dy, _ = case_of(d)
    x, want = np.zeros_like(x), np.zeros_like(x)
    for a, b, i, j in np.ndindex(dy.shape):
        want[a, b, max(2 * i - 1, 0), max(2 * j - 1, 0)] += dy[a, b, i, j]
    r = run(x, dy, spec, wrong=True)
    assert rel_err(r["dx"], want) <= TOL_F64
    assert rel_err(r["last"], want) > 0.1  # control: the last maximal cell


@settings(max_examples=3)
@given(d=cases, levels=st.integers(2, 4))
@example(d=ODD, levels=2)
@example(d=POOL2_EX, levels=2)
def test_tied_inputs_match_first_max_loop(d, levels):
    """Post-ReLU-like inputs with few levels: many 2-, 3- and 4-way ties and dead windows."""
    spec, rng, x, dy, _ = case_of(d)
    x = np.maximum(rng.integers(-levels, levels, x.shape), 0).astype(float)
    r = run(x, dy, spec)
    y_loop, dx_loop, sigma_loop = pool_loop(x, dy, spec)
    assert np.array_equal(r["y"], y_loop)
    assert rel_err(r["dx"], dx_loop) <= TOL_F64
    # σ = argmax is the first maximal cell, and the gather model at σ is the pool
    assert np.array_equal(r["sigma"], sigma_loop)
    assert np.array_equal(r["gathered"], y_loop)


@pytest.mark.parametrize("d", [ODD, POOL2_EX], ids=["3x3s2", "2x2"])
def test_last_max_control_goes_red_on_tied_inputs(d):
    spec, rng, x, dy, _ = case_of(d)
    x = np.maximum(rng.integers(-2, 2, x.shape), 0).astype(float)
    assert rel_err(run(x, dy, spec, wrong=True)["last"], pool_loop(x, dy, spec)[1]) > 0.1


@pytest.mark.parametrize("spec", [maxpool.PoolSpec("3x3/s1 pad 1", 3, 1, 1), maxpool.PoolSpec("3x3/s2", 3, 2, 0)],
                         ids=["3x3s1p1", "3x3s2p0"])
def test_other_windows_take_the_strided_path_and_match_the_loop(spec):
    """Pools the nets do not use run through the generic strided cells and padded placement; the
    nets' two pools have their own reshape paths. Tied post-ReLU-like inputs, overlapping windows."""
    rng = np.random.default_rng(7)
    x = np.maximum(rng.integers(-2, 3, (2, 3, 8, 6)), 0).astype(float)
    dy = rng.standard_normal((2, 3, maxpool.out_size(8, spec), maxpool.out_size(6, spec)))
    r = run(x, dy, spec)
    y_loop, dx_loop, sigma_loop = pool_loop(x, dy, spec)
    assert np.array_equal(r["y"], y_loop) and np.array_equal(r["sigma"], sigma_loop)
    assert rel_err(r["dx"], dx_loop) <= TOL_F64
    assert rel_err(r["dx"], r["vjp"]) > 0.1  # control: autodiff splits tied windows' cotangents


# ---- claim 3: overlapping 3×3/s2 windows accumulate -----------------------------------------

def test_3x3s2_overlaps_accumulate():
    spec, rng, x, dy, _ = case_of(EVEN)  # [2,2,8,6]: 4×3 windows, rows/cols 2i−1 … 2i+1
    x[0, 0, 3, 3] = 10.0  # the max of windows (1,1), (1,2), (2,1), (2,2)
    x[0, 0, 1, 0] = 9.0   # the max of windows (0,0), (1,0)
    r = run(x, dy, spec, wrong=True)
    got, d = np.asarray(r["dx"])[0, 0], dy[0, 0]
    assert got[3, 3] == d[1, 1] + d[1, 2] + d[2, 1] + d[2, 2]
    assert got[1, 0] == d[0, 0] + d[1, 0]
    assert rel_err(r["dx"], r["vjp"]) <= TOL_F64
    assert rel_err(r["dx"], pool_loop(x, dy, spec)[1]) <= TOL_F64
    # control: overwriting keeps one window's cotangent only
    wrong = np.asarray(r["overwrite"])[0, 0]
    assert wrong[3, 3] != got[3, 3] and wrong[1, 0] != got[1, 0]


# ---- claim 3: the symmetric 3×3/s2 pool is not XLA 'SAME' -------------------------------------

@pytest.mark.parametrize("d", [EVEN, ODD], ids=["even", "odd"])
def test_3x3s2_symmetric_padding_is_not_xla_same(d):
    spec, _, x, dy, _ = case_of(d)
    y = run(x, dy, spec)["y"]
    assert np.array_equal(y, pool_loop(x, dy, spec)[0])  # the explicit −∞-padded definition
    window, strides = (1, 1, 3, 3), (1, 1, 2, 2)
    explicit = lax.reduce_window(x, -np.inf, lax.max, window, strides, ((0, 0), (0, 0), (1, 1), (1, 1)))
    assert np.array_equal(y, explicit)
    same = lax.reduce_window(x, -np.inf, lax.max, window, strides, "SAME")
    assert same.shape == y.shape
    # even size: 'SAME' pads (0, 1), a window grid one cell off; odd size: it pads (1, 1) too
    assert np.array_equal(same, y) == (d is ODD)


# ---- claim 3: dtype polymorphism ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [EVEN, POOL2_EX], ids=["3x3s2", "2x2"])
def test_ops_keep_f32_and_bf16_operand_dtype(dtype, d):
    spec, rng, x, dy, _ = case_of(d)
    x = rng.integers(-128, 128, x.shape).astype(float)  # exact in bfloat16 (ties too)
    dy = rng.integers(-8, 8, dy.shape).astype(float)
    y, dx = forward_backward(jnp.asarray(x, dtype), jnp.asarray(dy, dtype), spec)
    assert (y.dtype, dx.dtype) == (dtype, dtype)
    y_loop, dx_loop, _ = pool_loop(x, dy, spec)
    assert np.array_equal(np.asarray(y, np.float64), y_loop)
    assert np.array_equal(np.asarray(dx, np.float64), dx_loop)


# ---- claim 6: bad input ------------------------------------------------------------------------

def msg(*parts):
    """A pattern for a message holding these parts in order (tuples as shapes print)."""
    return ".*".join(re.escape(str(p)) for p in parts)


def test_bad_input_raises_value_error_naming_op_and_shapes():
    x = np.ones((2, 3, 8, 8))
    with pytest.raises(ValueError, match=msg("maxpool.forward: x must have rank 4", (3, 8, 8))):
        maxpool.forward(np.ones((3, 8, 8)))
    with pytest.raises(ValueError, match=msg("maxpool.forward: 2x2/s2 pool needs even H and W", (2, 3, 7, 8))):
        maxpool.forward(np.ones((2, 3, 7, 8)), POOL2)
    with pytest.raises(ValueError, match=msg("maxpool.forward: x", (1, 1, 0, 4), "is smaller than the 2x2/s2")):
        maxpool.forward(np.ones((1, 1, 0, 4)), POOL2)
    for bad in (np.nan, np.inf, -np.inf):
        x_bad = x.copy()
        x_bad[0, 0, 0, 0] = bad
        with pytest.raises(ValueError, match=msg("maxpool.forward: x of shape (2, 3, 8, 8) contains NaN")):
            maxpool.forward(x_bad, POOL3S2)
    for spec in (POOL2, POOL3S2):  # dy of the wrong shape
        with pytest.raises(ValueError, match=msg("maxpool.backward: dy must have shape", (2, 3, 4, 4),
                                                 f"for the {spec.name} pool of x", (2, 3, 8, 8),
                                                 "got", (2, 3, 8, 8))):
            maxpool.backward(maxpool.PoolSaved(x, spec), np.ones((2, 3, 8, 8)))
    with pytest.raises(ValueError, match=msg("maxpool.scatter: sigma and dy must have the same shape",
                                             (2, 3, 4, 4), (2, 3, 4, 3))):
        maxpool.scatter(np.zeros((2, 3, 4, 4), int), np.ones((2, 3, 4, 3)), x.shape)


@pytest.mark.parametrize("spec, shape", [(POOL2, (2, 3, 8, 6)), (POOL3S2, (2, 3, 8, 8)), (POOL3S2, (1, 2, 7, 5))])
def test_windows_on_the_host_are_the_device_windows(spec, shape, compilations):
    """A NumPy array in, the same windows out (−∞ padding included), with no program to compile."""
    x = np.asarray(jax.random.normal(jax.random.key(0), shape, jnp.float64))
    host, compiled = compilations(lambda: maxpool.windows(x, spec))
    assert isinstance(host, np.ndarray) and compiled == 0
    np.testing.assert_array_equal(host, np.asarray(maxpool.windows(jnp.asarray(x), spec)))
