"""The whole-net tie kit: both nets tie to autodiff in float64 at photo and flat points (drawn
weights), nodes that are 0 in ℝ are judged against the net's scale, rows come in backward order,
finite differences agree, and the float32 view passes for the real chain and fails for a control.

Kept quick: cifar8 at batch 4; ResNet-34 at 32 px, batch 4, K = 10 (M = 4 in layer4's BatchNorm:
see `test_two_cell_batchnorm_scales_its_cotangent_by_eps` for batch 2); each point is built once
per module, and the compiled chains are shared across the tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie import tolerances
from gradtie.checks import controls
from gradtie.checks.float32 import float32_view
from gradtie.checks.fd import derivatives
from gradtie.checks.tie import (NodeRow, TieReport, oracle_nodes, reference_at,
                                rendered_nodes, targets_matrix, tie, zero_in_reals)
from gradtie.nets import cifar8, resnet34
from gradtie.ops import batchnorm

ALPHA = 0.1
CFG8 = cifar8.Config()
CFG34 = resnet34.Config(num_classes=10)


def f64(params):
    return {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in params.items()}


def images(kind: str, n: int, size: int):
    make = data.photos if kind == "photos" else data.flat_images
    return jnp.asarray(make(n, size, seed=0), jnp.float64)


def labels(n: int, k: int = 10):
    return targets_matrix(jnp.arange(n) * 3 % k, k, jnp.float64)


@pytest.fixture(scope="module")
def params8():
    return f64(cifar8.init(jax.random.key(0), CFG8, weights="drawn"))


@pytest.fixture(scope="module")
def params34():
    return f64(resnet34.init(jax.random.key(0), CFG34, weights="drawn"))


@pytest.fixture(scope="module")
def ties8(params8):
    return {kind: tie(cifar8, params8, images(kind, 4, 32), labels(4), CFG8, label_smoothing=ALPHA)
            for kind in ("photos", "flat")}


@pytest.fixture(scope="module")
def ties34(params34):
    return {kind: tie(resnet34, params34, images(kind, 4, 32), labels(4), CFG34, label_smoothing=ALPHA)
            for kind in ("photos", "flat")}


# ---- float64: every node ------------------------------------------------------------------------

def test_cifar8_ties_every_node_and_the_input_at_photos_f64(ties8):
    report = ties8["photos"]
    assert report.ok, report.summary()
    assert [r.name for r in report.nodes] == list(cifar8.init(jax.random.key(0), CFG8))
    assert [r.name for r in report.rows][::len(report.rows) - 1] == ["loss", "input"]
    assert max(r.rel for r in report.rows) <= tolerances.REL_F64
    assert report.meta["input_model"] == "real"


def test_resnet34_ties_every_node_and_the_input_at_photos_f64(ties34):
    report = ties34["photos"]
    assert report.ok, report.summary()
    assert len(report.nodes) == 110 and report.nodes[0].name == "conv1.weight"
    assert report.row("loss").ok and report.row("input").ok
    assert report.smallest_bn() == ("layer4.0.bn1", 4)


@pytest.mark.parametrize("net", ["cifar8", "resnet34"])
def test_twin_ties_tie_every_node_and_the_input_of_the_frozen_model(net, request):
    """Flat images: twin ties route to either twin with the same parameter gradient; moving the
    image breaks twins, so the input gradient is tied to the model frozen at σ = argmax. Control:
    the real net's autodiff input gradient (its max splits a tie) is not what the chain computes."""
    # only the net's own fixtures: the cifar8 case must not build the ResNet-34 ties
    report = request.getfixturevalue("ties8" if net == "cifar8" else "ties34")["flat"]
    assert report.ok, report.summary()
    assert report.meta["input_model"] == "frozen" and report.meta["tied_windows"] > 0
    mod, cfg = (cifar8, CFG8) if net == "cifar8" else (resnet34, CFG34)
    params = request.getfixturevalue("params8" if net == "cifar8" else "params34")
    x, t = images("flat", 4, 32), labels(4)
    _, _, dx_real = oracle_nodes(mod, params, x, t, cfg, ALPHA)
    _, _, dx = rendered_nodes(mod, params, x, t, cfg, ALPHA)
    assert float(jnp.max(jnp.abs(dx - dx_real))) > 1e3 * report.row("input").limit * report.row("input").scale


def test_conv_biases_behind_bn_are_judged_against_the_net_scale(ties8):
    report = ties8["photos"]
    zero = [r for r in report.rows if r.zero_in_reals]
    assert [r.name for r in zero] == [f"conv{k}.bias" for k in range(1, 9)]
    gmax = max(r.scale for r in report.nodes if not r.zero_in_reals)
    assert all(r.scale == pytest.approx(tolerances.ZERO_NODE_SCALE * gmax) for r in zero)
    assert all(r.err <= r.limit * gmax for r in zero)


def test_zero_in_reals_finds_conv_biases_only(params8, params34):
    assert zero_in_reals(params8) == {f"conv{k}.bias" for k in range(1, 9)}
    assert zero_in_reals(params34) == set()
    with_bias = jax.eval_shape(lambda: resnet34.init(jax.random.key(0), resnet34.Config(conv_bias=True)))
    assert len(zero_in_reals(with_bias)) == 36


def test_two_cell_batchnorm_scales_its_cotangent_by_eps():
    """Why the ResNet-34 tests avoid batch 2 at 32 px: layer4 sees 1×1 maps, so each BN channel
    normalises M = 2 numbers, x̂ = ±d/√(d²+ε), and its backward multiplies the cotangent by
    ε/(d²+ε): everything upstream is a near-total cancellation, tied only to ~1e-8."""
    x = jnp.asarray([[[[0.3]], [[-1.0]]], [[[0.7]], [[2.0]]]], jnp.float64)   # [N=2, C=2, 1, 1]
    dy = jnp.asarray([[[[1.0]], [[0.5]]], [[[-2.0]], [[3.0]]]], jnp.float64)
    gamma = jnp.ones(2, jnp.float64)
    _, saved = batchnorm.forward(x, gamma, jnp.zeros(2, jnp.float64), eps=1e-5)
    dx = batchnorm.backward(saved, gamma, dy)
    d = (x[0] - x[1])[:, 0, 0] / 2
    s = 1 / jnp.sqrt(d ** 2 + 1e-5)
    expected = s * 1e-5 / (d ** 2 + 1e-5) * (dy[0] - dy[1])[:, 0, 0] / 2
    np.testing.assert_allclose(dx[0, :, 0, 0], expected, rtol=1e-6)
    assert float(jnp.max(jnp.abs(dx))) < 1e-3 * float(jnp.max(jnp.abs(dy)))


# ---- backward order and the β trace -------------------------------------------------------------

def _report(names_shapes, failing=()):
    rows = [NodeRow(n, s, 1.0 if n in failing else 0.0, 1.0, 1.0 if n in failing else 0.0, 1e-10, False)
            for n, s in names_shapes]
    return TieReport("toy", "float64", rows, 0.0, 0.0)


def test_rows_come_in_backward_order_with_the_input_last():
    rep = _report([("conv1.weight", (4, 3, 3, 3)), ("bn1.weight", (4,)), ("bn1.bias", (4,)),
                   ("fc.weight", (2, 4)), ("fc.bias", (2,)), ("input", (1, 3, 8, 8))],
                  failing=("bn1.weight", "conv1.weight", "input"))
    assert [r.name for r in rep.backward_order()] == ["fc.bias", "fc.weight", "bn1.bias", "bn1.weight",
                                                      "conv1.weight", "input"]
    assert rep.first_failure().name == "bn1.weight"
    assert [r.name for r in rep.beta_rows()] == ["bn1.bias"]      # fc.bias is no BN shift
    assert rep.first_beta_failure() is None


# ---- finite differences -------------------------------------------------------------------------

def test_nodes_are_derivatives_of_the_whole_loss_f64(params8):
    x, t = images("photos", 4, 32), labels(4)
    _, grads, _ = rendered_nodes(cifar8, params8, x, t, CFG8, ALPHA)
    names = ["fc3.bias", "fc1.weight", "bn8.bias", "conv5.weight", "bn1.weight", "conv1.weight"]
    point = reference_at(cifar8, params8, x, t, CFG8, label_smoothing=ALPHA)
    rows = derivatives(cifar8, params8, x, t, CFG8, grads, key=jax.random.key(2), names=names,
                       label_smoothing=ALPHA, loss_roundoff=point.envelope.loss)
    assert [r.name for r in rows] == names
    assert all(r.ok for r in rows), [(r.name, r.rel) for r in rows]


def test_census_tie_and_finite_differences_share_one_compiled_forward(params8, monkeypatch):
    """The census, the rendered chain and the finite differences of one point read one compiled
    forward (`gradtie check`'s first run compiled it three times)."""
    import importlib

    from gradtie.checks import census
    tie_module = importlib.import_module("gradtie.checks.tie")
    forward = tie_module._forward
    x, t = images("photos", 4, 32), labels(4)
    _, grads, _ = rendered_nodes(cifar8, params8, x, t, CFG8, ALPHA)
    compiled = forward._cache_size()
    calls = []

    def counted(*args):
        calls.append(args[0])
        return forward(*args)
    monkeypatch.setattr(tie_module, "_forward", counted)
    assert census.smoothness(cifar8, params8, x, CFG8).ok
    census_calls = len(calls)
    rows = derivatives(cifar8, params8, x, t, CFG8, grads, key=jax.random.key(2), names=["fc3.bias"],
                       label_smoothing=ALPHA)
    assert rows[0].ok
    assert census_calls >= 1 and len(calls) > census_calls     # both read the tie's forward …
    assert forward._cache_size() == compiled                   # … compiled once, for the tie


def test_finite_differences_see_a_planted_bug(params8):
    x, t = images("photos", 4, 32), labels(4)
    _, grads, _ = rendered_nodes(controls.drop_batch_divisor(cifar8), params8, x, t, CFG8, ALPHA)
    rows = derivatives(cifar8, params8, x, t, CFG8, grads, key=jax.random.key(2), names=["fc3.bias"],
                       label_smoothing=ALPHA)
    assert not rows[0].ok and rows[0].rendered == pytest.approx(4 * rows[0].fd, rel=1e-6)


# ---- the float32 view ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def view8(params8):
    return float32_view(cifar8, params8, images("photos", 4, 32), labels(4), CFG8, label_smoothing=ALPHA)


def test_float32_view_passes_for_the_real_chain(view8):
    assert view8.ok, view8.summary()
    assert view8.dtype == "float32" and len(view8.rows) == 40          # loss, 38 nodes, input
    envelope = [r for r in view8.rows if r.by == "envelope"]
    assert len(envelope) > len(view8.rows) // 2                   # the floor is not what admits most
    assert all(r.rel <= r.limit == tolerances.ENVELOPE_FACTOR * r.envelope for r in envelope)
    assert not view8.ill_conditioned


def test_float32_view_fails_for_a_control(params8):
    view = float32_view(controls.drop_batch_divisor(cifar8), params8, images("photos", 4, 32), labels(4),
                        CFG8, label_smoothing=ALPHA)
    assert not view.ok
    assert {r.name for r in view.failed} >= {"fc3.bias", "fc3.weight", "bn8.bias", "conv1.weight", "input"}
    assert all(r.zero_in_reals or r.name == "loss" for r in view.rows if r.ok)   # only round-off rows survive


def test_float32_view_reads_the_float32_point(params8, view8):
    """Both sides run at the float32-rounded point: the float64 reference reads the float32 values."""
    x = images("photos", 4, 32)
    _, g64, _ = oracle_nodes(cifar8, f64({k: v.astype(jnp.float32) for k, v in params8.items()}),
                             x.astype(jnp.float32).astype(jnp.float64), labels(4), CFG8, ALPHA)
    row = view8.row("fc3.weight")
    assert row.scale == pytest.approx(float(jnp.max(jnp.abs(g64["fc3.weight"]))), rel=1e-12)


def test_float32_view_needs_float64():
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            float32_view(cifar8, {}, jnp.zeros((1, 3, 32, 32)), jnp.zeros(1, jnp.int32), CFG8)
    finally:
        jax.config.update("jax_enable_x64", True)
