"""Every must-fail control goes red, first at the node where its bug enters the chain.

The points are those of test_tie.py (cifar8 photos at batch 4, ResNet-34 photos at 32 px, batch 4,
K = 10), so the compiled real chains and the oracle are shared; each control compiles at most its
own backward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradtie import data, prng
from gradtie.checks import census, controls
from gradtie.checks.tie import TieReport, targets_matrix, tie
from gradtie.nets import cifar8, resnet34
from gradtie.ops import conv, head

ALPHA = 0.1
CFG8 = cifar8.Config()
CFG34 = resnet34.Config(num_classes=10)


def f64(params):
    return {k: v.astype(jnp.float64) for k, v in params.items()}


def point(make, n, size):
    return jnp.asarray(make(n, size, seed=0), jnp.float64), targets_matrix(jnp.arange(n) * 3 % 10, 10, jnp.float64)


@pytest.fixture(scope="module")
def params8():
    return f64(cifar8.init(jax.random.key(0), CFG8))


@pytest.fixture(scope="module")
def params34():
    return f64(resnet34.init(jax.random.key(0), CFG34))


@pytest.fixture(scope="module")
def report8(params8):
    x, t = point(data.photos, 4, 32)
    return controls.run(cifar8, params8, x, t, CFG8, label_smoothing=ALPHA)


@pytest.fixture(scope="module")
def report34(params34):
    x, t = point(data.photos, 4, 32)
    return controls.run(resnet34, params34, x, t, CFG34, label_smoothing=ALPHA,
                        controls=[controls.pool2x2_backward_on_3x3(resnet34),
                                  controls.same_padding_strided(resnet34)])


def failing(result) -> set[str]:
    return {r.name for r in result.report.failed}


def gamma_beta(params) -> set[str]:
    return {n for n in params if params[n].ndim == 1 and not n.startswith("fc") and
            not (n.endswith(".bias") and params[n[:-4] + "weight"].ndim == 4)}


def test_real_chain_ties_where_the_controls_run(report8):
    assert report8.real.ok and report8.ok
    assert [r.name for r in report8.results] == ["swap_gamma_beta", "drop_batch_divisor", "smoothing_wrong_k"]


def test_resnet34_real_chain_ties_where_its_controls_run(report34):
    assert report34.real.ok and report34.ok
    assert [r.name for r in report34.results] == ["pool2x2_backward_on_3x3", "same_padding_strided"]


def test_swap_gamma_beta_control_goes_red(report8, params8):
    r = report8["swap_gamma_beta"]
    assert r.red and r.first.name == "bn8.bias" and r.first_beta.name == "bn8.bias"
    assert failing(r) == gamma_beta(params8)             # beside the chain: nothing else moves
    assert r.first_beta.bad == 32                        # every channel of the row


def test_drop_batch_divisor_control_goes_red(report8):
    r = report8["drop_batch_divisor"]
    assert r.red and r.first.name == "fc3.bias" and r.first_beta.name == "bn8.bias"
    # the loss comes from the forward, and conv biases feeding a BatchNorm have zero gradient
    assert {row.name for row in r.report.rows if row.ok} == {"loss"} | {f"conv{k}.bias" for k in range(1, 9)}
    fc3 = next(row for row in r.report.rows if row.name == "fc3.bias")
    assert fc3.rel == pytest.approx(3.0, rel=1e-9)       # N·g − g = 3g at N = 4


def test_smoothing_wrong_k_control_goes_red(report8):
    r = report8["smoothing_wrong_k"]
    assert r.red and r.first.name == "fc3.bias" and r.first_beta.name == "bn8.bias"
    logits = prng.normal(jax.random.key(1), (4, 10), jnp.float64)
    t = targets_matrix(jnp.arange(4), 10, jnp.float64)
    planted = controls.smoothing_wrong_k(cifar8).head_cotangent(logits, t, ALPHA)
    # t̃ with α/(K−1) sums to 1 + α/(K−1): each row of dy sums to −α/((K−1)·N) instead of 0
    np.testing.assert_allclose(jnp.sum(planted, axis=1), -ALPHA / (9 * 4), rtol=1e-12)
    np.testing.assert_allclose(jnp.sum(head.cotangent(logits, t, ALPHA), axis=1), 0.0, atol=1e-16)


def test_pool2x2_backward_on_3x3_control_goes_red(report34):
    r = report34["pool2x2_backward_on_3x3"]
    assert r.red and r.first.name == "bn1.bias" and r.first_beta.name == "bn1.bias"
    assert failing(r) == {"bn1.bias", "bn1.weight", "conv1.weight", "input"}   # the stem and after


def test_same_padding_strided_control_goes_red(report34):
    r = report34["same_padding_strided"]
    assert r.red and r.first.name == "layer4.0.conv1.weight"
    assert r.first_beta.name == "layer3.5.bn2.bias"      # layer4.0's input backward feeds layer3
    bad = failing(r)
    assert {"conv1.weight", "layer2.0.conv1.weight", "layer3.0.conv1.weight", "input"} <= bad
    # layer4 is downstream of nothing wrong but its own 3×3/s2 weight grad; its 1×1/s2 projection
    # reads the same cells under both paddings and ties
    assert {n for n in bad if n.startswith("layer4")} == {"layer4.0.conv1.weight"}
    assert not any(n.startswith("fc") for n in bad)


def test_non_twin_tie_control_goes_red(params8):
    x, t = point(data.flat_images, 4, 32)
    r = controls.non_twin_tie(cifar8, params8, x, t, CFG8, label_smoothing=ALPHA)
    assert not r.smooth.ok and r.smooth.non_twin_ties > 0 and r.red
    assert r.smooth.violations[0].layer == "pool1"
    # rerouting between cells that hold one pixel: only the off-centre taps' weights and the input
    # can tell, and there one-ulp nudges of the point already flip the oracle's routing, so the
    # envelope calls those rows ill-conditioned (gradtie check exits 2) rather than tied
    assert {row.name for row in r.report.ill_conditioned} | failing(r) == {"conv2.weight", "conv1.weight", "input"}
    assert census.smoothness(cifar8, params8, x, CFG8).ok   # the same images at the real weights


def test_controls_apply_to_the_tie_kit(params8):
    x, t = point(data.photos, 4, 32)
    control = controls.swap_gamma_beta(cifar8)
    report = tie(control, params8, x, t, CFG8, label_smoothing=ALPHA)
    assert isinstance(report, TieReport) and report.net == "cifar8 + swap_gamma_beta"
    assert not report.ok and report.first_failure().name == "bn8.bias"
    assert control.Config is cifar8.Config and control.POOLS is cifar8.POOLS    # the real net's
    assert tie(cifar8, params8, x, t, CFG8, label_smoothing=ALPHA).ok              # caches not poisoned


def test_cotangent_controls_share_the_real_backward():
    assert controls.drop_batch_divisor(cifar8).backward is cifar8.backward
    assert controls.swap_gamma_beta(cifar8).backward is not cifar8.backward


def test_controls_that_plant_nothing_are_refused(params8):
    with pytest.raises(ValueError, match="strided"):
        controls.same_padding_strided(cifar8)
    with pytest.raises(ValueError, match="2×2"):
        controls.pool2x2_backward_on_3x3(cifar8)
    assert [c.name for c in controls.applicable(cifar8)] == ["swap_gamma_beta", "drop_batch_divisor",
                                                             "smoothing_wrong_k"]
    assert len(controls.applicable(resnet34)) == 5
    x, t = point(data.photos, 2, 32)
    with pytest.raises(ValueError, match="label_smoothing"):
        controls.run(cifar8, params8, x, t, CFG8, label_smoothing=0.0)
    with pytest.raises(ValueError, match="batch 1"):
        controls.run(cifar8, params8, x[:1], t[:1], CFG8, controls=[controls.drop_batch_divisor(cifar8)])


def test_planted_restores_the_module_even_on_error():
    original = conv.backward
    with pytest.raises(RuntimeError):
        with controls.planted(((conv, "backward", lambda *a, **k: None),)):
            assert conv.backward is not original
            raise RuntimeError("inside")
    assert conv.backward is original


@pytest.mark.parametrize("size,k", [(2, 3), (16, 7), (8, 1)])
def test_same_pads_are_xlas(size, k):
    x = prng.normal(jax.random.key(0), (1, 2, size, size), jnp.float64)
    w = prng.normal(jax.random.key(1), (3, 2, k, k), jnp.float64)
    dims = ("NCHW", "OIHW", "NCHW")
    same = lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=dims)
    pads = controls.same_pads(size, k, 2)
    explicit = lax.conv_general_dilated(x, w, (2, 2), (pads, pads), dimension_numbers=dims)
    np.testing.assert_array_equal(same, explicit)


def test_same_padding_backward_is_the_vjp_of_a_same_forward():
    """The planted backward is a correct backward, of the wrong forward: the vjp of a 'SAME' conv."""
    x = prng.normal(jax.random.key(0), (2, 3, 8, 8), jnp.float64)
    w = prng.normal(jax.random.key(1), (4, 3, 3, 3), jnp.float64)
    dims = ("NCHW", "OIHW", "NCHW")
    y, pullback = jax.vjp(lambda x_, w_: lax.conv_general_dilated(x_, w_, (2, 2), "SAME", dimension_numbers=dims),
                          x, w)
    dy = prng.normal(jax.random.key(2), y.shape, jnp.float64)
    dx_ref, dw_ref = pullback(dy)
    dx = controls._same_input_backward(conv.backward)(w, dy, input_shape=x.shape, stride=2)
    dw = controls._same_grad_weight(conv.grad_weight)(x, dy, kernel_size=3, stride=2)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-12, atol=1e-12)
    assert not np.allclose(conv.backward(w, dy, input_shape=x.shape, stride=2), dx_ref)
