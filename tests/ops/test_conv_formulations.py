"""conv's two formulations of one contraction — XLA's convolution and patches · weights — compute the
same three nodes: each against jax.vjp of the forward traced in the same formulation, each against
the other, and the bf16 kinds' erasure and rounding identity in both. The shape rule picks the
product only where XLA's CPU convolution is slow. A control: patches read in the wrong tap order.

Each formulation is pinned by the ops' `formulation=` argument (a static argument of the jit; a
net reads it from `cfg.conv_formulation`).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import reference
from gradtie.nets import cifar8
from gradtie.ops import conv
from gradtie.rendered import QUICK

TOL_F64 = 1e-12
# (N, C, O, size, k, stride): odd and even sizes, the three kernel sizes of the nets, a 1×1 grid
CASES = [(2, 3, 4, 9, 3, 1), (2, 3, 5, 8, 3, 2), (2, 4, 3, 7, 1, 2), (1, 3, 4, 10, 7, 2), (2, 6, 5, 1, 3, 1)]
IDS = [f"N{n}C{c}O{o}s{h}k{k}st{s}" for n, c, o, h, k, s in CASES]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def operands(case, dtype, seed=0):
    n, c, o, h, k, s = case
    rng = np.random.default_rng(seed)
    h2 = conv.out_size(h, k, s)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
                 for shape in ((n, c, h, h), (o, c, k, k), (n, o, h2, h2)))


def nodes(x, w, dy, stride, formulation, rnd=None):
    return (conv.forward(x, w, stride=stride, rnd=rnd, formulation=formulation)[0],
            conv.backward(w, dy, input_shape=x.shape, stride=stride, rnd=rnd, formulation=formulation),
            conv.grad_weight(x, dy, kernel_size=w.shape[2], stride=stride, rnd=rnd, formulation=formulation))


@partial(jax.jit, static_argnames=("stride", "formulation"), compiler_options=QUICK)
def evaluate(x, w, dy, x32, w32, dy32, stride, formulation):
    """f64 nodes and jax.vjp's of the forward in the same formulation; f32 nodes, the kinds at
    identity and under bf16 rounding, and the rounded reference rnd(f32 node at rounded operands)."""
    dx_ref, dw_ref = reference.vjp(lambda x_, w_: conv.forward(x_, w_, stride=stride, formulation=formulation)[0],
                                   x, w, cotangent=dy)
    rnd = conv.round_bf16
    rx, rw, rdy = rnd(x32), rnd(w32), rnd(dy32)
    rounded = tuple(rnd(a) for a in nodes(rx, rw, rdy, stride, formulation))
    return dict(f64=nodes(x, w, dy, stride, formulation), vjp=(dx_ref, dw_ref),
                f32=nodes(x32, w32, dy32, stride, formulation),
                identity=nodes(x32, w32, dy32, stride, formulation, conv.identity),
                kind=nodes(x32, w32, dy32, stride, formulation, rnd), rounded=rounded)


def evaluate_in(formulation, case):
    x, w, dy = operands(case, jnp.float64)
    x32, w32, dy32 = (a.astype(jnp.float32) for a in (x, w, dy))
    return evaluate(x, w, dy, x32, w32, dy32, stride=case[5], formulation=formulation)


@pytest.fixture(scope="module", params=list(zip(CASES, IDS)), ids=IDS)
def both(request):
    case, _ = request.param
    return case, {f: evaluate_in(f, case) for f in conv.FORMULATIONS}


@pytest.mark.parametrize("formulation", conv.FORMULATIONS)
def test_backward_nodes_equal_vjp_f64(both, formulation):
    _, out = both
    r = out[formulation]
    assert rel_err(r["f64"][1], r["vjp"][0]) <= TOL_F64
    assert rel_err(r["f64"][2], r["vjp"][1]) <= TOL_F64


def test_formulations_agree_f64(both):
    _, out = both
    for op, a, b in zip(("forward", "backward", "grad_weight"), out["conv"]["f64"], out["patches"]["f64"]):
        assert rel_err(a, b) <= TOL_F64, op


@pytest.mark.parametrize("formulation", conv.FORMULATIONS)
def test_bf16_erasure_and_rounding_identity_in_both(both, formulation):
    _, out = both
    r = out[formulation]
    for a, b in zip(r["identity"], r["f32"]):
        assert same_bits(a, b)
    for a, b in zip(r["kind"], r["rounded"]):
        assert same_bits(a, b)


def test_control_transposed_taps_go_red():
    """Patches whose taps are read (kw, kh) instead of (kh, kw): the forward no longer agrees."""
    case = (2, 3, 4, 6, 3, 1)
    x, w, _ = operands(case, jnp.float64)
    right = jax.jit(lambda a, b: conv.forward(a, b, formulation="patches")[0])(x, w)
    wrong = jax.jit(lambda a, b: conv.forward(a, jnp.swapaxes(b, 2, 3), formulation="patches")[0])
    assert rel_err(wrong(x, w), right) > 0.1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the rule is the CPU backend's")
def test_rule_picks_the_product_only_where_xla_convolution_is_slow():
    k = 3
    # ResNet-34 layer4 at 64 px: 2×2 outputs, 512·9 terms each -> the product
    assert conv.use_patches(2 * 2, 512 * k * k, k)
    # cifar8's widest early layer: 32×32 outputs, 16·9 terms -> XLA's convolution
    assert not conv.use_patches(32 * 32, 16 * k * k, k)
    assert conv.use_patches(16 * 16, 64, 1)   # a 1×1 kernel is a product outright


def test_formulation_rejects_unknown_names():
    x, w, dy = operands(CASES[0], jnp.float64)
    with pytest.raises(ValueError, match="conv formulation: expected one of 'conv', 'patches'"):
        conv.forward(x, w, formulation="winograd")
    with pytest.raises(ValueError, match="conv formulation: expected one of 'conv', 'patches'"):
        conv.grad_weight(x, dy, kernel_size=3, formulation="winograd")
    with pytest.raises(ValueError, match="conv_formulation must be one of 'conv', 'patches'"):
        cifar8.Config(conv_formulation="winograd")
    # control: the named formulations and the shape rule (None) are taken
    for formulation in (*conv.FORMULATIONS, None):
        cifar8.Config(conv_formulation=formulation)
        conv.forward(x, w, formulation=formulation)


@pytest.mark.parametrize("node", ["forward", "grad_weight"])
def test_the_product_reads_the_weights_in_place(node):
    # channel-major patches make W[O, C·k·k] · P a plain product: XLA plans no weight-sized temporary
    # (a cell-major layout had it transpose, i.e. copy, the weights at every call). Control: the
    # same product with the weights transposed first plans the copy.
    x = jnp.ones((2, 64, 2, 2), jnp.float32)
    w = jnp.ones((256, 64, 3, 3), jnp.float32)
    dy = jnp.ones((2, 256, 2, 2), jnp.float32)
    patches = partial(conv.forward, formulation="patches")
    if node == "forward":
        fn = jax.jit(lambda a, b: patches(a, b)[0]).lower(x, w).compile()
        copied = jax.jit(lambda a, b: patches(a, jnp.transpose(b, (0, 2, 3, 1)).reshape(b.shape) * 2)[0])
        assert copied.lower(x, w).compile().memory_analysis().temp_size_in_bytes >= w.nbytes
    else:
        fn = jax.jit(lambda a, d: conv.grad_weight(a, d, kernel_size=3, formulation="patches")).lower(x, dy).compile()
    assert fn.memory_analysis().temp_size_in_bytes < w.nbytes / 4


# ---- the weight gradient one image (and band of rows) at a time: the CPU's fast form ---------------

# (N, C, O, size, k, stride): one band per image, several bands (40×40 > TILE_CELLS), strided, 7×7,
# several images per call (N > MAX_TILES)
TILED = [(3, 2, 3, 24, 3, 1), (2, 2, 3, 40, 3, 1), (2, 3, 2, 48, 3, 2), (2, 3, 4, 64, 7, 2), (20, 2, 2, 16, 3, 1)]


def _tiled_and_bound(case):
    """The f32 weight gradient as the shape rule runs it, the exact (f64) one at the same operands,
    and the f32 summation bound n·u·Σ|dy||xpad| (n terms per entry, u = 2⁻²⁴)."""
    n, c, o, h, k, s = case
    x, _, dy = operands(case, jnp.float64)
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    exact = conv.grad_weight(x32.astype(jnp.float64), dy32.astype(jnp.float64), kernel_size=k, stride=s)
    magnitude = conv.grad_weight(jnp.abs(x32.astype(jnp.float64)), jnp.abs(dy32.astype(jnp.float64)),
                                 kernel_size=k, stride=s)
    terms = n * dy.shape[2] * dy.shape[3]
    got = jax.jit(lambda a, b: conv.grad_weight(a, b, kernel_size=k, stride=s))(x32, dy32)
    return got, exact, terms * 2.0 ** -24 * magnitude


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the tiling is the CPU backend's")
@pytest.mark.parametrize("case", TILED, ids=[f"N{n}C{c}O{o}s{h}k{k}st{s}" for n, c, o, h, k, s in TILED])
def test_tiled_weight_gradient_within_float32_summation_bound(case):
    n, _, _, h, k, s = case
    ho = conv.out_size(h, k, s)
    tiles = conv.grad_weight_tiles(n, ho, ho, jnp.float32)
    assert tiles is not None and (tiles[1] < ho) == (ho * ho > conv.TILE_CELLS)   # the tiled form runs
    got, exact, bound = _tiled_and_bound(case)
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(exact)) <= np.asarray(bound))


def test_tiled_weight_gradient_control_dropped_band_goes_red():
    """The sum without the last band's terms (what a tiling that skips that band computes) breaks the
    bound by orders of magnitude."""
    n, c, o, h, k, s = case = TILED[1]
    got, exact, bound = _tiled_and_bound(case)
    x, _, dy = operands(case, jnp.float32)
    dy = dy.at[:, :, -8:].set(0.0)   # the last band's cotangents never reach the sum
    dropped = jax.jit(lambda a, b: conv.grad_weight(a, b, kernel_size=k, stride=s))(x, dy)
    assert np.max(np.abs(np.asarray(dropped, np.float64) - np.asarray(exact)) / np.asarray(bound)) > 100


def test_tiling_only_for_float32_and_bf16_on_the_rule():
    assert conv.grad_weight_tiles(64, 32, 32, jnp.float64) is None   # the checks' dtype: one call
    assert conv.grad_weight_tiles(64, 32, 32, jnp.float32, "conv") is None   # pinned formulation
    assert conv.grad_weight_tiles(64, 8, 8, jnp.float32) is None      # small grid: one call is faster
    if jax.default_backend() == "cpu":
        assert conv.grad_weight_tiles(64, 32, 32, jnp.float32) == (4, 32)      # 16 calls of 4 images
        assert conv.grad_weight_tiles(2, 56, 56, jnp.bfloat16) == (1, conv.TILE_CELLS // 56)   # 2 × 4 bands
