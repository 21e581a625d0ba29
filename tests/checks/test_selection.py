"""Selection σ, the gather model and selScatter: the rendered pool backward IS scatter(select(x)).

At σ = argmax (the first maximal cell in row-major window order) selScatter equals the rendered
pool backward at every point, ties included, for the 2×2/s2 pool (`maxPoolBackB`) and the
overlapping 3×3/s2 pad-1 pool (`maxPool3s2BackB`). Two oracles stand apart from the kernels: a
NumPy loop written from the definition, and XLA's own select-and-scatter (the vjp of
`lax.reduce_window` max, which also takes the first maximal cell).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from gradtie import prng
from gradtie.ops import maxpool

SPECS = [maxpool.POOL2, maxpool.POOL3S2]


def first_max_loop(x, dy, spec):
    """The definition, one window at a time: dy[n,c,i,j] lands on the window's first maximal cell
    (row-major, padding excluded); overlapping windows add."""
    x, dy = np.asarray(x), np.asarray(dy)
    k, s, p = spec.size, spec.stride, spec.pad
    dx = np.zeros_like(x)
    n_, c_, h, w = x.shape
    for n in range(n_):
        for c in range(c_):
            for i in range(dy.shape[2]):
                for j in range(dy.shape[3]):
                    best, at = -np.inf, None
                    for a in range(k):
                        for b in range(k):
                            r, q = s * i - p + a, s * j - p + b
                            if 0 <= r < h and 0 <= q < w and x[n, c, r, q] > best:  # strict: first wins
                                best, at = x[n, c, r, q], (r, q)
                    dx[n, c, at[0], at[1]] += dy[n, c, i, j]
    return dx


def xla_select_and_scatter(x, dy, spec):
    pad = ((0, 0), (0, 0), (spec.pad, spec.pad), (spec.pad, spec.pad))
    _, vjp = jax.vjp(lambda a: lax.reduce_window(a, -jnp.inf, lax.max, (1, 1, spec.size, spec.size),
                                                 (1, 1, spec.stride, spec.stride), pad), x)
    return vjp(dy)[0]


def tied_windows_2x2():
    """One example, one channel, four 2×2 windows: strict, a 2-way, a 3-way and a 4-way tie (a dead
    window after ReLU: every cell 0)."""
    x = np.array([[1., 3., 5., 2.],
                  [2., 0., 5., 1.],
                  [4., 4., 0., 0.],
                  [1., 4., 0., 0.]])
    return jnp.asarray(x[None, None])


def _cotangent(spec, x, seed=0):
    n, c, h, w = x.shape
    shape = (n, c, maxpool.out_size(h, spec), maxpool.out_size(w, spec))
    return prng.normal(jax.random.key(seed), shape, jnp.float64)


def test_select_is_the_first_maximal_cell_2x2():
    sigma = maxpool.select(tied_windows_2x2(), maxpool.POOL2)
    # window (0,0) strict at cell 1; (0,1) tie 5/5 at cells 0,2; (1,0) three 4s at 0,1,3; (1,1) all 0
    assert sigma[0, 0].tolist() == [[1, 0], [0, 0]]
    assert maxpool.last_max(tied_windows_2x2(), maxpool.POOL2)[0, 0].tolist() == [[1, 2], [3, 3]]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_scatter_at_argmax_is_the_backward_at_constructed_ties(spec):
    x = tied_windows_2x2()
    x = jnp.concatenate([x, jnp.zeros_like(x), -x], axis=1)   # + a dead channel, + a negated one
    dy = _cotangent(spec, x)
    back = maxpool.backward(maxpool.PoolSaved(x, spec), dy)
    sel = maxpool.scatter(maxpool.select(x, spec), dy, x.shape, spec)
    np.testing.assert_array_equal(sel, back)
    np.testing.assert_array_equal(sel, first_max_loop(x, dy, spec))
    np.testing.assert_array_equal(sel, xla_select_and_scatter(x, dy, spec))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@given(data=st.data())
def test_scatter_at_argmax_is_the_backward_everywhere(spec, data):
    """Small integer values make ties (2-, 3-, 4-way and more) common; odd and even sides for the
    3×3/s2 pool."""
    h = data.draw(st.sampled_from([2, 6] if spec is maxpool.POOL2 else [3, 6]))   # few shapes: few compiles
    w = data.draw(st.sampled_from([4] if spec is maxpool.POOL2 else [5, 6]))
    levels = data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, levels, (2, 2, h, w)).astype(np.float64))
    dy = _cotangent(spec, x, seed)
    sel = maxpool.scatter(maxpool.select(x, spec), dy, x.shape, spec)
    np.testing.assert_array_equal(sel, maxpool.backward(maxpool.PoolSaved(x, spec), dy))
    np.testing.assert_allclose(sel, first_max_loop(x, dy, spec), rtol=0, atol=1e-14)
    np.testing.assert_allclose(sel, xla_select_and_scatter(x, dy, spec), rtol=0, atol=1e-14)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_gather_at_argmax_is_the_forward(spec):
    rng = np.random.default_rng(1)
    for x in (tied_windows_2x2(), jnp.asarray(rng.integers(0, 3, (2, 3, 6, 6)).astype(np.float64)),
              jnp.asarray(rng.standard_normal((2, 3, 8, 8)))):
        y, _ = maxpool.forward(x, spec)
        np.testing.assert_array_equal(maxpool.gather(x, maxpool.select(x, spec), spec), y)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_scatter_is_the_transpose_of_gather_at_any_selection(spec):
    """⟨gather(v, σ), dy⟩ = ⟨v, scatter(σ, dy)⟩ for every σ, not only argmax."""
    rng = np.random.default_rng(2)
    v = jnp.asarray(rng.standard_normal((2, 3, 8, 8)))
    dy = _cotangent(spec, v)
    sigma = jnp.asarray(rng.integers(0, spec.size ** 2, dy.shape))
    # keep σ inside the image: a cell of the −∞ padding becomes the window's centre (always real)
    real = jnp.isfinite(maxpool.windows(jnp.zeros_like(v), spec))
    sigma = jnp.where(jnp.take_along_axis(real, sigma[..., None], -1)[..., 0], sigma, spec.size ** 2 // 2)
    lhs = jnp.vdot(maxpool.gather(v, sigma, spec), dy)
    rhs = jnp.vdot(v, maxpool.scatter(sigma, dy, v.shape, spec))
    assert abs(float(lhs - rhs)) <= 1e-12 * float(jnp.sum(jnp.abs(dy)) * jnp.max(jnp.abs(v)))


def test_overlapping_windows_accumulate_on_a_shared_maximum():
    """3×3/s2 pad 1 on 4×4: cell (1,1) lies in all four windows; as their maximum it receives Σ dy."""
    x = jnp.zeros((1, 1, 4, 4)).at[0, 0, 1, 1].set(5.0)
    dy = jnp.asarray([[[[1.0, 2.0], [3.0, 4.0]]]])
    dx = maxpool.backward(maxpool.PoolSaved(x, maxpool.POOL3S2), dy)
    assert float(dx[0, 0, 1, 1]) == 10.0
    assert float(jnp.sum(jnp.abs(dx))) == 10.0


def test_all_tied_3x3_windows_route_to_their_first_real_cell():
    """A constant input ties every window; the −∞ padding never wins, so each window routes to its
    first cell inside the image: rows 2i−1…2i+1 start at row max(2i−1, 0)."""
    x = jnp.zeros((1, 1, 4, 4))
    dy = jnp.asarray([[[[1.0, 2.0], [3.0, 4.0]]]])
    dx = maxpool.backward(maxpool.PoolSaved(x, maxpool.POOL3S2), dy)
    expected = np.zeros((4, 4))
    expected[0, 0], expected[0, 1], expected[1, 0], expected[1, 1] = 1.0, 2.0, 3.0, 4.0
    np.testing.assert_array_equal(dx[0, 0], expected)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_scatter_at_the_last_maximal_cell_differs_at_a_tie_control(spec):
    """The control: the same scatter at another σ (the LAST maximal cell) is not the backward where a
    window ties, and is where none does."""
    x = tied_windows_2x2()
    dy = _cotangent(spec, x)
    back = maxpool.backward(maxpool.PoolSaved(x, spec), dy)
    last = maxpool.scatter(maxpool.last_max(x, spec), dy, x.shape, spec)
    assert not np.array_equal(last, back)
    strict = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 4, 4)))   # no ties
    dy = _cotangent(spec, strict)
    np.testing.assert_array_equal(maxpool.scatter(maxpool.last_max(strict, spec), dy, strict.shape, spec),
                                  maxpool.backward(maxpool.PoolSaved(strict, spec), dy))


def test_same_padding_reads_windows_one_cell_off():
    """XLA 'SAME' pads a 3×3/s2 pool on an even side at the end only (0 before, 1 after), so window i
    covers rows 2i…2i+2; PyTorch's pad 1 covers 2i−1…2i+1. Read off by pooling the row index."""
    rows = jnp.broadcast_to(jnp.arange(8.0)[:, None], (1, 1, 8, 8))
    same = lax.reduce_window(rows, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")
    sym, _ = maxpool.forward(rows, maxpool.POOL3S2)
    assert same[0, 0, :, 0].tolist() == [2.0, 4.0, 6.0, 7.0]
    assert sym[0, 0, :, 0].tolist() == [1.0, 3.0, 5.0, 7.0]
