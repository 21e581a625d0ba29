"""The project's forward against a forward written apart from it (`gradtie.reference_numpy`).

The autodiff oracle differentiates the project's own forward, so a forward bug would sit on both
sides of every tie. Here the forward ops and both nets' logits are tied to NumPy float64 formulas and
direct loops that share no code with `gradtie.ops`, at weights that can reveal a bug (γ ≠ 1, β ≠ 0),
each within the round-off the sums allow; and each tie is shown to see a planted mistake.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie import reference_numpy as rn
from gradtie import tolerances as tol
from gradtie.nets import cifar8, resnet34
from gradtie.ops import batchnorm, conv, maxpool
# compile-bound on CPU: the jitted forwards compile with LLVM optimisation off (the values are the same ops)
from gradtie.rendered import QUICK

K = 10


def over_limit(got, want, limit) -> float:
    """max |got − want| / limit: ≤ 1 is tied; a limit of 0 (exact ops) asks for equality."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert diff.shape == np.shape(limit), (diff.shape, np.shape(limit))
    return float(np.max(np.where(diff == 0, 0.0, diff / np.where(limit > 0, limit, np.finfo(float).tiny))))


def drawn_bn(rng, c):
    """γ ~ U(0.5, 1.5), β ~ N(0, 0.3²): the drawn weights of the nets."""
    return rng.uniform(0.5, 1.5, c), 0.3 * rng.standard_normal(c)


# ---- BatchNorm forward against its formula ------------------------------------------------------

@pytest.mark.parametrize("per_example", [False, True], ids=["batch", "per-example"])
def test_batchnorm_forward_matches_numpy_formula_f64(per_example):
    rng = np.random.default_rng(0)
    x = 3.0 + 2.0 * rng.standard_normal((3, 4, 5, 6))   # an offset mean: x − μ cancels
    gamma, beta = drawn_bn(rng, 4)
    y, _ = batchnorm.forward(jnp.asarray(x), jnp.asarray(gamma), jnp.asarray(beta), per_example=per_example)
    want = rn.batchnorm(x, gamma, beta, per_example=per_example)
    limit = tol.FORWARD_OP_EVALUATIONS * rn.batchnorm_roundoff(x, gamma, beta, per_example=per_example)
    assert over_limit(y, want, limit) <= 1
    # controls: the planted BN mistakes, and statistics over the other axes
    for name in ("unbiased_variance", "eps_tenth"):
        wrong = rn.PLANTED[name].batchnorm(x, gamma, beta, eps=batchnorm.EPS, per_example=per_example)
        assert over_limit(y, wrong, limit) > 1, name
    assert over_limit(y, rn.batchnorm(x, gamma, beta, per_example=not per_example), limit) > 1


# ---- conv forward against the direct loop ---------------------------------------------------------

# (kernel, stride, H, W): every conv the nets use (3×3/s1, 3×3/s2, 7×7/s2, 1×1/s2), odd and even sizes
CONVS = [(3, 1, 7, 7), (3, 1, 6, 8), (3, 2, 7, 7), (3, 2, 8, 6), (7, 2, 9, 9), (7, 2, 8, 8),
         (1, 2, 7, 7), (1, 2, 8, 6)]


def conv_case(k, stride, h, w, bias):
    rng = np.random.default_rng(1000 * k + 100 * stride + 10 * h + w)
    x = rng.standard_normal((2, 2, h, w))
    wt = rng.standard_normal((3, 2, k, k))
    b = 0.1 * rng.standard_normal(3) if bias else None
    return x, wt, b


def planted_conv_applies(name, k, stride, h, w) -> bool:
    """Whether the planted conv reads other windows than the render's at this shape."""
    if name == "flipped_kernel":
        return k > 1
    if name == "same_padding_strided":   # 'SAME' is asymmetric only on strided convs of even sides
        return k > 1 and stride > 1 and (h % 2 == 0 or w % 2 == 0)
    return True


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("k,stride,h,w", CONVS, ids=[f"{k}x{k}s{s}-{h}x{w}" for k, s, h, w in CONVS])
def test_conv_forward_matches_direct_loop_f64(k, stride, h, w, bias):
    x, wt, b = conv_case(k, stride, h, w, bias)
    want, mag = rn.conv2d_loop(x, wt, b, stride=stride)
    n = 2 * k * k + bias
    limit = tol.FORWARD_OP_EVALUATIONS * rn.gamma_n(n) * mag
    y, _ = conv.forward(jnp.asarray(x), jnp.asarray(wt), None if b is None else jnp.asarray(b), stride=stride)
    assert over_limit(y, want, limit) <= 1
    # the NumPy nets' im2col conv is the loop too, and its bound is the loop's magnitude sum
    assert over_limit(rn.conv2d(x, wt, b, stride=stride), want, limit) <= 1
    np.testing.assert_allclose(rn.conv2d_roundoff(x, wt, b, stride=stride), rn.gamma_n(n) * mag, rtol=1e-12)
    # controls: every planted conv that reads other windows here goes red against the loop
    planted = [name for name in ("flipped_kernel", "conv_window_offset", "same_padding_strided")
               if planted_conv_applies(name, k, stride, h, w)]
    for name in planted:
        assert over_limit(rn.PLANTED[name].conv2d(x, wt, b, stride=stride), want, limit) > 1, name


# ---- max pools against the direct loop, tie-break included ---------------------------------------

POOLS = {"2x2": (maxpool.POOL2, (2, 3, 6, 8)), "3x3s2": (maxpool.POOL3S2, (2, 3, 7, 8))}


def tied_input(shape, seed):
    """Post-ReLU values on a coarse grid: dead windows (all 0) and tied maxima everywhere."""
    rng = np.random.default_rng(seed)
    return np.maximum(rng.integers(-2, 3, shape), 0).astype(np.float64)


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("inputs", ["tied", "normal"])
def test_maxpool_forward_matches_direct_loop_exactly(kind, inputs):
    spec, shape = POOLS[kind]
    x = tied_input(shape, 2) if inputs == "tied" else np.random.default_rng(3).standard_normal(shape)
    want = rn.maxpool_loop(x, size=spec.size, stride=spec.stride, pad=spec.pad)
    y, _ = maxpool.forward(jnp.asarray(x), spec)
    np.testing.assert_array_equal(np.asarray(y), want)   # max rounds nothing
    np.testing.assert_array_equal(rn.maxpool(x, size=spec.size, stride=spec.stride, pad=spec.pad), want)
    # control: every window one cell down-right
    wrong = rn.PLANTED["pool_window_offset"].maxpool(x, size=spec.size, stride=spec.stride, pad=spec.pad)
    assert over_limit(wrong, want, np.zeros_like(want)) > 1


def last_max_backward(x, dy, spec):
    """A wrong backward: each window's cotangent onto its LAST maximal cell."""
    win = np.asarray(maxpool.windows(jnp.asarray(x), spec))
    sigma = win.shape[-1] - 1 - np.argmax(win[..., ::-1], axis=-1)
    return np.asarray(maxpool.scatter(jnp.asarray(sigma), jnp.asarray(dy), x.shape, spec))


def overwrite_backward(x, dy, spec):
    """A wrong backward: the first-max scatter with assignment, so overlapping windows overwrite."""
    k, s, p = spec.size, spec.stride, spec.pad
    sigma = np.asarray(maxpool.select(jnp.asarray(x), spec))
    dxpad = np.zeros((x.shape[0], x.shape[1], x.shape[2] + 2 * p, x.shape[3] + 2 * p))
    n, c, i, j = np.indices(sigma.shape).reshape(4, -1)
    cell = sigma.reshape(-1)
    dxpad[n, c, s * i + cell // k, s * j + cell % k] = dy.reshape(-1)
    return dxpad[:, :, p:p + x.shape[2], p:p + x.shape[3]]


@pytest.mark.parametrize("kind", list(POOLS))
def test_maxpool_backward_routes_to_first_max_and_accumulates(kind):
    spec, shape = POOLS[kind]
    x = tied_input(shape, 4)
    dy = np.random.default_rng(5).standard_normal(
        (shape[0], shape[1], maxpool.out_size(shape[2], spec), maxpool.out_size(shape[3], spec)))
    want, bound = rn.maxpool_backward_loop(x, dy, size=spec.size, stride=spec.stride, pad=spec.pad)
    limit = tol.FORWARD_OP_EVALUATIONS * bound
    dx = maxpool.backward(maxpool.PoolSaved(jnp.asarray(x), spec), jnp.asarray(dy))
    assert over_limit(dx, want, limit) <= 1
    assert over_limit(last_max_backward(x, dy, spec), want, limit) > 1
    if spec.stride < spec.size:   # overlapping windows: a cell that collects from several must add
        assert np.any(bound > 0)
        assert over_limit(overwrite_backward(x, dy, spec), want, limit) > 1


# ---- both nets' logits against the NumPy nets -----------------------------------------------------

def as_f64(params):
    return {name: jnp.asarray(np.asarray(p, np.float64)) for name, p in params.items()}


class NetPoint:
    """Drawn float64 weights, real photos, the project's logits and the NumPy forward with its envelope."""

    def __init__(self, net, cfg, numpy_forward, n, seed, **kw):
        self.params = as_f64(net.init(jax.random.key(seed), cfg, weights="drawn"))
        self.x = data.photos(n, 32, seed=seed, dtype=np.float64)
        forward = jax.jit(lambda p, x: net.forward(p, x, cfg)[0], compiler_options=QUICK)
        self.logits = np.asarray(forward(self.params, jnp.asarray(self.x)))
        self.forward = lambda **more: numpy_forward(self.params, self.x, **kw, **more)
        self.reference = self.forward()
        self.limit = tol.FORWARD_NET_SIGMAS * np.sqrt(2.0) * self.reference.envelope


@pytest.fixture(scope="module")
def cifar8_point():
    return NetPoint(cifar8.NET, cifar8.Config(num_classes=K), rn.cifar8_forward, 3, 0)


@pytest.fixture(scope="module")
def resnet34_point():
    # batch 2 at 32 px: layer4's BNs normalise over M = 2 cells, the ill-conditioned point of issue 9
    return NetPoint(resnet34.NET, resnet34.Config(num_classes=K), rn.resnet34_forward, 2, 1)


def assert_drawn(params):
    """Every BN γ (a 1-D `.weight`) is off 1 and every β (its `.bias`) off 0."""
    gammas = [name for name, p in params.items() if name.endswith(".weight") and np.ndim(p) == 1]
    assert gammas
    for name in gammas:
        assert np.all(np.asarray(params[name]) != 1.0), name
        assert np.all(np.asarray(params[name[:-len("weight")] + "bias"]) != 0.0), name


@pytest.mark.parametrize("net", ["cifar8", "resnet34"])
def test_logits_match_numpy_forward_f64(net, request):
    point = request.getfixturevalue(f"{net}_point")
    assert_drawn(point.params)
    assert point.logits.shape == point.reference.logits.shape == (point.x.shape[0], K)
    assert over_limit(point.logits, point.reference.logits, point.limit) <= 1


CONTROLS = {"cifar8": ["unbiased_variance", "eps_tenth", "flipped_kernel", "conv_window_offset",
                       "pool_window_offset", "flatten_hwc"],
            "resnet34": ["unbiased_variance", "eps_tenth", "flipped_kernel", "conv_window_offset",
                         "same_padding_strided", "pool_window_offset"]}


@pytest.mark.parametrize("net,mistake", [(net, m) for net, ms in CONTROLS.items() for m in ms])
def test_planted_forward_mistake_goes_red(net, mistake, request):
    point = request.getfixturevalue(f"{net}_point")
    wrong = point.forward(ops=rn.PLANTED[mistake], envelope=False).logits
    assert over_limit(point.logits, wrong, point.limit) > 1


def test_cifar8_per_example_logits_match_numpy_forward_f64(cifar8_point):
    cfg = cifar8.Config(num_classes=K, bn="example")
    forward = jax.jit(lambda p, x: cifar8.NET.forward(p, x, cfg)[0], compiler_options=QUICK)
    logits = forward(cifar8_point.params, jnp.asarray(cifar8_point.x))
    ref = rn.cifar8_forward(cifar8_point.params, cifar8_point.x, bn="example")
    limit = tol.FORWARD_NET_SIGMAS * np.sqrt(2.0) * ref.envelope
    assert over_limit(logits, ref.logits, limit) <= 1
    assert over_limit(logits, cifar8_point.reference.logits, limit) > 1   # batch statistics are not it


# ---- the NumPy forward stands apart, and refuses bad input ----------------------------------------

def imported_modules(text: str) -> list[str]:
    tree = ast.parse(text)
    names = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    return names + ["." * node.level + (node.module or "") for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom)]


def foreign_imports(text: str) -> list[str]:
    """Imports of the project (absolute or relative) or of JAX."""
    return [m for m in imported_modules(text) if m.startswith(("gradtie", "jax", "."))]


def test_numpy_forward_imports_nothing_from_gradtie():
    text = Path(rn.__file__).read_text()
    assert "numpy" in imported_modules(text)
    assert foreign_imports(text) == []


@pytest.mark.parametrize("line", ["from gradtie.ops import conv", "from .ops import conv",
                                  "import jax.numpy as jnp", "from . import nets"])
def test_import_scan_catches_a_planted_import(line):
    assert foreign_imports(f"import numpy as np\n{line}\n")


def test_bad_input_raises_value_error(cifar8_point):
    with pytest.raises(ValueError, match="conv2d: x has 2 channels, weight expects 3"):
        rn.conv2d(np.zeros((1, 2, 5, 5)), np.zeros((4, 3, 3, 3)))
    with pytest.raises(ValueError, match="square odd kernel"):
        rn.conv2d_loop(np.zeros((1, 2, 5, 5)), np.zeros((4, 2, 2, 2)))
    with pytest.raises(ValueError, match=r"γ and β must have shape \(4,\)"):
        rn.batchnorm(np.zeros((2, 4, 3, 3)), np.ones(3), np.zeros(4))
    with pytest.raises(ValueError, match="smaller than the 3×3 window"):
        rn.maxpool_loop(np.zeros((1, 1, 1, 1)), size=3, stride=2)
    params = dict(cifar8_point.params)
    del params["bn3.bias"]
    with pytest.raises(ValueError, match="params lack bn3.bias"):
        rn.cifar8_forward(params, cifar8_point.x)
    with pytest.raises(ValueError, match=r"x must be images \[N,3,S,S\].*got shape \(3, 3, 30, 30\)"):
        rn.cifar8_forward(cifar8_point.params, cifar8_point.x[:, :, :30, :30])
    with pytest.raises(ValueError, match="multiple of 32"):
        rn.resnet34_forward({}, np.zeros((1, 3, 48, 48)))
