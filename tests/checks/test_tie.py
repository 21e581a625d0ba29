"""The whole-net tie: both nets tie to autodiff in float64 at photo and flat points (drawn
weights), nodes that are 0 in ℝ are judged against the net's scale, a node of the wrong shape or
dtype fails whatever its values, rows come in backward order and say what they mean, finite
differences agree (their scale read off the oracle, their steps kept inside the smooth piece), and
the float32 view passes for the real chain and fails for a planted one.

Kept quick: cifar8 at batch 4; ResNet-34 at 32 px, batch 4, K = 10 (M = 4 in layer4's BatchNorm:
see `test_two_cell_batchnorm_scales_its_cotangent_by_eps` for batch 2); each point is built once
per module, and the compiled chains are shared across the tests. ResNet-34's ties are slow (the
Whole-net tie chapter ties it at the same points).
"""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data, reference, rendered, tolerances
from gradtie.checks import bugs, census, check
from gradtie.checks.fd import derivatives
from gradtie.checks.envelope import Envelope
from gradtie.checks.tie import (Chain, Measured, NodeRow, Point, TieReport, compare, float32_view, ratio_text,
                                reference_at, targets_matrix, tie, zero_in_reals)
from gradtie.kit import KIT
from gradtie.nets import cifar8, resnet34
from gradtie.ops import batchnorm

ALPHA = 0.1
NET8, NET34 = cifar8.NET, resnet34.NET
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
    return f64(NET8.init(jax.random.key(0), CFG8, weights="drawn"))


@pytest.fixture(scope="module")
def params34():
    return f64(NET34.init(jax.random.key(0), CFG34, weights="drawn"))


@pytest.fixture(scope="module")
def ties8(params8):
    return {kind: tie(Point.of(NET8, params8, images(kind, 4, 32), labels(4), CFG8, label_smoothing=ALPHA))
            for kind in ("photos", "flat")}


@pytest.fixture(scope="module")
def ties34(params34):
    return {kind: tie(Point.of(NET34, params34, images(kind, 4, 32), labels(4), CFG34, label_smoothing=ALPHA))
            for kind in ("photos", "flat")}


@pytest.fixture(scope="module")
def point8(params8):
    x, t = images("photos", 4, 32), labels(4)
    return x, t, reference_at(NET8, params8, x, t, CFG8, label_smoothing=ALPHA)


# ---- float64: every node ------------------------------------------------------------------------

def test_cifar8_ties_every_node_and_the_input_at_photos_f64(ties8):
    report = ties8["photos"]
    assert report.tied and report.ok, report.summary()
    assert [r.name for r in report.nodes] == list(NET8.init(jax.random.key(0), CFG8))
    assert [r.name for r in report.rows][::len(report.rows) - 1] == ["loss", "input"]
    assert max(r.rel for r in report.rows) <= tolerances.REL_F64
    assert report.meta["input_model"] == "real"
    assert all(not r.mismatch for r in report.rows)


@pytest.mark.slow
def test_resnet34_ties_every_node_and_the_input_at_photos_f64(ties34):
    report = ties34["photos"]
    assert report.tied, report.summary()
    assert len(report.nodes) == 110 and report.nodes[0].name == "conv1.weight"
    assert report.row("loss").agrees and report.row("input").agrees
    assert report.smallest_bn() == ("layer4.0.bn1", 4)


@pytest.mark.parametrize("net", ["cifar8", pytest.param("resnet34", marks=pytest.mark.slow)])
def test_twin_ties_tie_every_node_and_the_input_of_the_frozen_model(net, request):
    """Flat images: twin ties route to either twin with the same parameter gradient; moving the
    image breaks twins, so the input gradient is tied to the model frozen at σ = argmax. Control:
    the real net's autodiff input gradient (its max splits a tie) is not what the chain computes."""
    # only the net's own fixtures: the cifar8 case must not build the ResNet-34 ties
    report = request.getfixturevalue("ties8" if net == "cifar8" else "ties34")["flat"]
    assert report.tied, report.summary()
    assert report.meta["input_model"] == "frozen" and report.meta["tied_windows"] > 0
    assert "(pools frozen at σ = argmax)" in report.summary()
    the_net, cfg = (NET8, CFG8) if net == "cifar8" else (NET34, CFG34)
    params = request.getfixturevalue("params8" if net == "cifar8" else "params34")
    x, t = images("flat", 4, 32), labels(4)
    _, _, dx_real = reference.compiled(the_net, params, x, t, cfg, ALPHA, None)
    dx = rendered.run(the_net, KIT, params, x, t, cfg, alpha=ALPHA).dx
    row = report.row("input")
    assert float(jnp.max(jnp.abs(dx - dx_real))) > 1e3 * row.limit * row.scale


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
    with_bias = jax.eval_shape(lambda: NET34.init(jax.random.key(0), resnet34.Config(conv_bias=True)))
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


# ---- shapes and dtypes are compared, never broadcast (issue 26, item 3) ------------------------------

def test_a_node_of_the_wrong_shape_fails_whatever_its_values():
    """A [1, out] bias node for an [out] parameter holds the right numbers and broadcasts against
    the oracle: it must fail anyway, its row naming the shape."""
    g = {"fc.weight": jnp.ones((3, 4)), "fc.bias": jnp.arange(3.0)}
    wrong = dict(g, **{"fc.bias": g["fc.bias"][None, :]})
    rows = compare(wrong, g, dtype="float64")
    bad = {r.name: r for r in rows if not r.ok}
    assert list(bad) == ["fc.bias"] and "shape (1, 3)" in bad["fc.bias"].mismatch and "(3,)" in bad["fc.bias"].mismatch
    assert bad["fc.bias"].verdict == "FAILED" and not bad["fc.bias"].agrees and bad["fc.bias"].ratio == np.inf
    assert bad["fc.bias"].describe() == f"fc.bias: {bad['fc.bias'].mismatch}"
    assert all(r.ok for r in compare(g, g, dtype="float64"))      # control: right shapes tie


def test_a_node_of_another_dtype_fails():
    g = {"w": jnp.ones((2, 2), jnp.float64)}
    rows = compare({"w": g["w"].astype(jnp.float32)}, g, dtype="float64")
    assert not rows[0].ok and "dtype float32" in rows[0].mismatch
    assert compare(g, g, dtype="float64")[0].ok


# ---- what a row says (issue 26, item 7) ---------------------------------------------------------------

def _row(name, rel, limit, shape=(4,)):
    return NodeRow(name, shape, rel, 1.0, rel, limit, False, int(rel > limit), limit / 10, 1e-10)


def test_a_row_says_what_its_verdict_is():
    failing, tied, ill = _row("a", 7.3e-1, 1e-10), _row("b", 1e-12, 1e-10), _row("c", 1e-3, 5e-2)
    assert failing.describe() == "a, err 7.3e-01 > limit 1.0e-10" and failing.verdict == "FAILED"
    assert tied.describe() == "b, err 1.0e-12 ≤ limit 1.0e-10" and tied.verdict == "tied" and tied.agrees
    # within a limit so wide that round-off hides a 1 % bug: ok, but it does not agree
    assert ill.ok and ill.ill_conditioned and not ill.agrees and ill.verdict == "ILL"


def test_the_err_over_limit_column_keeps_its_width():
    assert ratio_text(7300586509.17) == "7.3e+09" and len(ratio_text(7300586509.17)) == 7
    assert ratio_text(0.5) == "   0.50" and ratio_text(np.inf) == "shape"
    table = TieReport("toy", "float64", [_row("loss", 0.0, 1e-10, ()), _row("a", 0.73, 1e-10)], 0.0, 0.0).table()
    verdict_at = {len(line) - len(line.split()[-1]) for line in table.splitlines()[2:]}   # the column lines up
    assert len(verdict_at) == 1 and "7.3e+09" in table and "7300586509" not in table


def test_an_ill_conditioned_input_row_is_not_called_tied():
    rows = [_row("loss", 0.0, 1e-10, ()), _row("w", 1e-12, 1e-10), _row("input", 1e-3, 5e-2, (2, 3))]
    rep = TieReport("toy", "float64", rows, 0.0, 0.0)
    assert rep.ok and not rep.tied
    assert "input gradient ILL" in rep.summary() and "input gradient tied" not in rep.summary()
    assert "1 rows too ill-conditioned to judge (first: input)" in rep.summary()


def test_failed_holds_every_row_over_its_limit_judgeable_or_not():
    rows = [_row("loss", 0.0, 1e-10, ()), _row("w", 0.5, 0.05), _row("v", 1e-12, 1e-10)]
    rep = TieReport("toy", "float64", rows, 0.0, 0.0)
    assert [r.name for r in rep.failed] == ["w"] and rep.failed[0].ill_conditioned and not rep.ok


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

FD_NAMES = ["fc3.bias", "fc1.weight", "bn8.bias", "conv5.weight", "bn1.weight", "conv1.weight"]


def test_nodes_are_derivatives_of_the_whole_loss_f64(params8, point8):
    x, t, point = point8
    grads = rendered.run(NET8, KIT, params8, x, t, CFG8, alpha=ALPHA).grads
    rows = derivatives(point, grads, key=jax.random.key(2), names=FD_NAMES)
    assert [r.name for r in rows] == FD_NAMES
    assert all(r.verdict == "ok" for r in rows), [(r.name, r.verdict, r.rel, r.limit) for r in rows]


def test_census_tie_and_finite_differences_share_one_compiled_forward(params8, compilations):
    """The census and the finite differences of a point read the forward the tie's module compiles
    (`rendered.forward`): once either has run at a point, that forward compiles nothing there.
    Control: the same forward at another configuration does compile. Batches no other test of this
    module runs (3 and 5), so that nothing else compiled them first."""
    forward = lambda x, cfg=CFG8: jax.block_until_ready(rendered.forward(NET8, params8, x, cfg))  # noqa: E731
    x3 = images("photos", 3, 32)
    some = {"fc3.bias": jnp.ones(10, jnp.float64)}     # the verdict is not what this test reads
    unmeasured = Measured((0.0, some, None), Envelope({}, 0.0, ()), "real", 0)   # no oracle run
    derivatives(Point.of(NET8, params8, x3, labels(3), CFG8, label_smoothing=ALPHA), some, key=jax.random.key(2),
                names=["fc3.bias"], measured=unmeasured)
    assert compilations(lambda: forward(x3))[1] == 0
    x5 = images("photos", 5, 32)
    census.smoothness(NET8, params8, x5, CFG8)
    assert compilations(lambda: forward(x5))[1] == 0
    assert compilations(lambda: forward(x3, replace(CFG8, eps=2e-5)))[1] >= 1


def test_finite_differences_see_a_planted_bug(params8, point8):
    x, t, point = point8
    chain = bugs.plant("head_no_batch_divisor", NET8)
    grads = rendered.run(chain.net, chain.kit, params8, x, t, CFG8, alpha=ALPHA, how="quick").grads
    rows = derivatives(point, grads, key=jax.random.key(2), names=["fc3.bias"])
    assert rows[0].verdict == "FAILED" and rows[0].rendered == pytest.approx(4 * rows[0].fd, rel=1e-6)


def _inflating_kit(layer: str, factor: float):
    """A kit whose dense weight node of `layer` comes out `factor` times too large."""
    def grad_weight(name, x, dy):
        out = KIT.dense_grad_weight(name, x, dy)
        return out * factor if name == layer else out
    return KIT._replace(dense_grad_weight=grad_weight)


def test_finite_difference_floors_read_the_oracle_not_the_chain(params8, point8):
    """Issue 26, item 6: one node inflated a millionfold fails on its own row and leaves every other
    row's scale, limit and verdict as they are with the real chain. Control: with the scale read
    off the inflated chain, the conv-bias rows (0 in ℝ, judged against the net's largest node)
    would move."""
    x, t, point = point8
    names = ["fc3.weight", "fc3.bias", "conv1.bias", "conv4.bias", "bn1.weight"]
    real = rendered.run(NET8, KIT, params8, x, t, CFG8, alpha=ALPHA).grads
    inflated = rendered.run(NET8, _inflating_kit("fc3", 1e6), params8, x, t, CFG8, alpha=ALPHA, how="quick").grads
    assert float(jnp.max(jnp.abs(inflated["fc3.weight"]))) > 1e5 * float(jnp.max(jnp.abs(real["fc3.weight"])))

    def rows(grads, ref):
        measured = point.measured._replace(reference=(point.reference[0], ref, point.reference[2]))
        return {r.name: r for r in derivatives(point, grads, key=jax.random.key(3), names=names, measured=measured)}
    good, bad = rows(real, point.reference[1]), rows(inflated, point.reference[1])
    assert bad["fc3.weight"].verdict == "FAILED" and good["fc3.weight"].verdict == "ok"
    for name in names[1:]:   # the same scale (envelope = its spread / scale), limit and verdict
        assert (bad[name].envelope, bad[name].limit, bad[name].verdict) == (good[name].envelope, good[name].limit,
                                                                            good[name].verdict), name
        # the errors differ by the round-off of two compilations only (the conv biases are 0 in ℝ)
        assert abs(bad[name].rel - good[name].rel) <= 1e-2 * good[name].limit
        assert good[name].verdict == "ok", (name, good[name])
    misread = rows(inflated, inflated)      # what reading the chain would do
    assert any(misread[n].rel < 1e-3 * good[n].rel for n in ("conv1.bias", "conv4.bias"))


def _bn1_cell_at(params, x, z: float):
    """params with bn1's β set, channel by channel, so that one cell of every channel of bn1's
    output (the first ReLU's input) sits at z: a kink 1e-11 from the point in every channel."""
    pre = census.preactivations(NET8, params, x, CFG8)["bn1"]                  # [N,C,H,W]
    beta = np.asarray(params["bn1.bias"])
    flat = np.abs(pre).reshape(pre.shape[0], pre.shape[1], -1).transpose(1, 0, 2).reshape(pre.shape[1], -1)
    cells = np.asarray(pre).transpose(1, 0, 2, 3).reshape(pre.shape[1], -1)[np.arange(pre.shape[1]),
                                                                           np.argmin(flat, axis=1)]
    return dict(params, **{"bn1.bias": jnp.asarray(beta - cells + z)})


def test_a_step_never_inside_the_smooth_piece_is_no_evidence_not_a_failure(params8):
    """Issue 26, item 4: a cell of every bn1 channel at z = 1e-11 (β of bn1 moved by each channel's
    smallest |z|): the census calls the point smooth and the tie holds, but every finite difference
    of conv1 and bn1 crosses that kink at every step down to FD_MIN_STEP. Those rows are "no
    evidence (kink)", never FAILED, and the check exits 0."""
    x = images("photos", 4, 32)
    p = _bn1_cell_at(params8, x, 1e-11)
    pre = census.preactivations(NET8, p, x, CFG8)["bn1"]
    per_channel = np.min(np.abs(pre), axis=(0, 2, 3))
    assert np.all((per_channel > 0) & (per_channel < 1e-10)), per_channel
    t = labels(4)
    rep = check.check(NET8, p, x, t, CFG8, label_smoothing=ALPHA)
    assert rep.smooth.ok and rep.tie.tied, rep.summary()
    fd = {r.name: r for r in rep.fd_rows}
    for name in ("conv1.weight", "bn1.weight", "bn1.bias"):
        assert fd[name].kinked and fd[name].verdict == "no evidence", fd[name]
    assert not [r for r in rep.fd_rows if r.verdict == "FAILED"]
    assert rep.exit_code == check.EXIT_TIED, rep.summary()
    assert "no evidence (a kink within the smallest step)" in rep.summary()
    # control: away from the kink (z = 1e-3) the same nodes are judged, and agree
    far = check.check(NET8, _bn1_cell_at(params8, x, 1e-3), x, t, CFG8, label_smoothing=ALPHA,
                      options=check.CheckOptions(smoothness=False))
    far_fd = {r.name: r for r in far.fd_rows}
    assert all(far_fd[n].verdict == "ok" and not far_fd[n].kinked for n in ("conv1.weight", "bn1.weight", "bn1.bias"))


# ---- the float32 view ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def view8(params8):
    return float32_view(Point.of(NET8, params8, images("photos", 4, 32), labels(4), CFG8, label_smoothing=ALPHA))


def test_float32_view_passes_for_the_real_chain(view8):
    assert view8.tied, view8.summary()
    assert view8.dtype == "float32" and len(view8.rows) == 40          # loss, 38 nodes, input
    envelope = [r for r in view8.rows if r.by == "envelope"]
    assert len(envelope) > len(view8.rows) // 2                   # the floor is not what admits most
    assert all(r.rel <= r.limit == tolerances.ENVELOPE_FACTOR * r.envelope for r in envelope)
    assert not view8.ill_conditioned


def test_float32_view_fails_for_a_planted_bug(params8):
    chain = bugs.plant("head_no_batch_divisor", NET8)
    view = float32_view(Point.of(NET8, params8, images("photos", 4, 32), labels(4), CFG8, label_smoothing=ALPHA), chain)
    assert not view.ok and view.net == "cifar8 + head_no_batch_divisor"
    assert {r.name for r in view.failed} >= {"fc3.bias", "fc3.weight", "bn8.bias", "conv1.weight", "input"}
    assert all(r.zero_in_reals or r.name == "loss" for r in view.rows if r.ok)   # only round-off rows survive


def test_float32_view_reads_the_float32_point(params8, view8):
    """Both sides run at the float32-rounded point: the float64 reference reads the float32 values."""
    x = images("photos", 4, 32)
    _, g64, _ = reference.compiled(NET8, f64({k: v.astype(jnp.float32) for k, v in params8.items()}),
                                   x.astype(jnp.float32).astype(jnp.float64), labels(4), CFG8, ALPHA, None)
    row = view8.row("fc3.weight")
    assert row.scale == pytest.approx(float(jnp.max(jnp.abs(g64["fc3.weight"]))), rel=1e-12)


def test_float32_view_needs_float64():
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            float32_view(Point.of(NET8, {}, jnp.zeros((1, 3, 32, 32)), jnp.zeros(1, jnp.int32), CFG8))
    finally:
        jax.config.update("jax_enable_x64", True)


def test_a_chain_names_what_is_planted_in_it():
    assert Chain(NET8).label == "cifar8" and Chain(NET8) == Chain(NET8, KIT, "")
    assert bugs.plant("bn_forget_gamma", NET8).label == "cifar8 + bn_forget_gamma"
