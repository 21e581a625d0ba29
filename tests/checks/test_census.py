"""The smooth-point census (chapter Pools): dead / strict / twin tie / non-twin tie, zero pre-activations,
and the verdicts of the suite's three smooth-point hypotheses.

Constructed windows first (the classifier on hand-made pre-activations and weight draws), then the
nets on real images at drawn weights (γ ≠ 1, β ≠ 0): flat images hold twin ties and no non-twin
tie; photos are mostly dead and strict windows; the convs before pool1 reduced to their centre tap
turn equal PIXELS into ties that are not twins, and the census must refuse the point. Each point
gets one verdict per hypothesis, and every hypothesis is shown both holding and failing:

| point | parameter gradients | ResNet-34 input (h_stem, h_pool) | cifar8 input (Cifar8BbnSmoothAt) |
|---|---|---|---|
| randn, pool-feeding β lifted (no dead window) | holds | holds | holds |
| photos (dead windows) | holds | holds | fails |
| flat images (twin ties) | holds | fails | fails |
| planted non-twin tie | fails | fails | fails |

At a twin tie, routing to the other twin keeps the parameter gradient and moves the input gradient;
at a non-twin tie the parameter gradient moves too, and the one-sided slopes of the loss differ.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data, nets, prng, rendered
from gradtie.checks import census, fd
from gradtie.checks.tie import targets_matrix
from gradtie.kit import KIT
from gradtie.nets import cifar8, resnet34
from gradtie.ops import maxpool

DEAD, STRICT, TWIN, NON_TWIN = census.DEAD, census.STRICT, census.TWIN, census.NON_TWIN


# ---- the classifier on constructed windows ---------------------------------------------------

def _windows_row(*windows):
    """[1,1,2,2·len] pre-activations from 2×2 windows given as (top-left, top-right, bottom-left,
    bottom-right)."""
    z = np.zeros((1, 1, 2, 2 * len(windows)))
    for i, (a, b, c, d) in enumerate(windows):
        z[0, 0, :, 2 * i:2 * i + 2] = [[a, b], [c, d]]
    return z


def test_classify_constructed_windows():
    # actual weights: dead, strict, a tie of two twins, a tie of two non-twins, a 3-way twin tie
    z = _windows_row((-1, -2, -3, -1), (0.5, 2, 1, -1), (3, 3, 1, 0.5), (2, 1, 2, -1), (1, 1, 1, 0.2))
    # a draw of other weights: twins stay equal, the non-twins (window 3, cells 0 and 2) part
    d = _windows_row((-2, -1, -5, -3), (0.1, 4, 2, -3), (5, 5, 2, 1), (2, 1, 7, -1), (4, 4, 4, 3))
    classes, margin, dead_margin = census.classify(z, [d], maxpool.POOL2, rel=1e-9)
    assert classes[0, 0, 0].tolist() == [DEAD, STRICT, TWIN, NON_TWIN, TWIN]
    # live margins: strict 2 − 1, twins 3 − 1, non-twin tie 0, 3-way twins 1 − 0.2
    assert margin == 0.0
    assert dead_margin == 1.0


def test_classify_margin_ignores_twins():
    z = _windows_row((3, 3, 1, 0.5), (1, 1, 1, 0.2))
    classes, margin, _ = census.classify(z, [z * 2.0 + 1.0], maxpool.POOL2, rel=1e-9)
    assert classes[0, 0, 0].tolist() == [TWIN, TWIN]
    assert margin == pytest.approx(0.8)


def test_classify_padded_3x3_windows():
    """The −∞ padding of the stem pool is never a cell: a constant live input ties every window
    (twins when the draws keep the cells equal, non-twins when they part)."""
    z = np.ones((1, 1, 4, 4))
    classes, _, _ = census.classify(z, [2 * z], maxpool.POOL3S2, rel=1e-9)
    assert (classes == TWIN).all()
    rng = np.random.default_rng(0)
    classes, _, _ = census.classify(z, [rng.standard_normal(z.shape)], maxpool.POOL3S2, rel=1e-9)
    assert (classes == NON_TWIN).all()


# ---- the nets on real images ------------------------------------------------------------------

CFG = cifar8.Config()
CFG34 = resnet34.Config(num_classes=10)


@pytest.fixture(scope="module")
def params():
    return {k: v.astype(jnp.float64) for k, v in cifar8.NET.init(jax.random.key(0), CFG, weights="drawn").items()}


@pytest.fixture(scope="module")
def flat():
    return jnp.asarray(data.flat_images(2, 32, seed=0, dtype=np.float64))


@pytest.fixture(scope="module")
def photos():
    return jnp.asarray(data.photos(2, 32, seed=0, dtype=np.float64))


@pytest.fixture(scope="module")
def randn():
    return prng.normal(jax.random.key(0), (2, 3, 32, 32), jnp.float64)


@pytest.fixture(scope="module")
def labels():
    return jnp.asarray([3, 7])


@pytest.fixture(scope="module")
def flat_report(params, flat):
    return census.smoothness(cifar8.NET, params, flat, CFG)


@pytest.fixture(scope="module")
def photo_report(params, photos):
    return census.smoothness(cifar8.NET, params, photos, CFG)


@pytest.fixture(scope="module")
def planted(params):
    return census.planted_tie(cifar8.NET, params)


@pytest.fixture(scope="module")
def planted_report(planted, flat):
    return census.smoothness(cifar8.NET, planted, flat, CFG)


def _total(report, cls):
    return sum(p.counts[cls] for p in report.pools)


def _verdicts(report):
    return {h.key: h.holds for h in report.hypotheses}


def test_counts_cover_every_window(flat_report):
    expected = {"pool1": 2 * 16 * 16 * 16, "pool2": 2 * 16 * 8 * 8, "pool3": 2 * 32 * 4 * 4, "pool4": 2 * 32 * 2 * 2}
    assert {p.pool: p.windows for p in flat_report.pools} == expected
    assert all(sum(p.counts.values()) == p.windows for p in flat_report.pools)
    assert [p.preactivation for p in flat_report.pools] == ["bn2", "bn4", "bn6", "bn8"]


def test_flat_images_hold_twin_ties_and_no_non_twin_tie(flat_report):
    assert _total(flat_report, "twin tie") > 100
    assert _total(flat_report, "non-twin tie") == 0
    assert flat_report.zeros == 0
    assert flat_report.ok and flat_report.summary().startswith("smooth point")


def test_twin_tied_cells_are_bit_equal_on_flat_images(params, flat, flat_report):
    """Nearest-neighbour resampling keeps equal pixels bit-equal; so are the twins' pre-activations."""
    _, saved = cifar8.NET.forward(params, flat, CFG)
    z = np.asarray(cifar8.NET.preactivations(saved)["bn2"])
    win = np.asarray(maxpool.windows(jnp.asarray(z), maxpool.POOL2))
    twin = flat_report.pools[0].classes == TWIN
    assert ((win == win.max(-1, keepdims=True)).sum(-1)[twin] >= 2).all()


def test_photos_are_mostly_dead_and_strict(photo_report):
    report = photo_report
    assert report.ok
    windows = sum(p.windows for p in report.pools)
    assert _total(report, "dead") + _total(report, "strict") >= 0.99 * windows
    assert _total(report, "dead") > 0.2 * windows
    assert all(0 < p.margin < np.inf and p.dead_margin > 0 for p in report.pools)


def test_photo_windows_die_more_often_than_independent_cells_would(photo_report):
    """Neighbouring cells of a photo are correlated: more dead windows than q⁴ per channel predicts."""
    for p in photo_report.pools:
        assert p.dead == p.counts["dead"] / p.windows
        assert 0.3 < p.negative < 0.7 and 0 < p.independent < p.dead and p.lift > 1
    one_in_16 = np.array([[[[DEAD] + [STRICT] * 15]]])
    flat_cells = census.PoolCensus("pool1", "bn2", one_in_16, 1.0, 1.0, 0.5, 0.5 ** 4)   # independent cells: no lift
    assert flat_cells.lift == 1.0


def test_centre_tap_kernels_make_non_twin_ties(params, planted, planted_report, flat):
    # only the off-centre taps of conv1 and conv2 are zeroed
    for name in ("conv1.weight", "conv2.weight"):
        w, w0 = np.asarray(planted[name]), np.asarray(params[name])
        np.testing.assert_array_equal(w[:, :, 1, 1], w0[:, :, 1, 1])
        assert np.count_nonzero(w) == np.count_nonzero(w0[:, :, 1, 1])
    assert all(np.array_equal(planted[k], params[k]) for k in params if k not in ("conv1.weight", "conv2.weight"))
    r = planted_report
    assert r.non_twin_ties > 0 and not r.ok
    assert r.non_twin_ties == _total(r, "non-twin tie")
    v = r.violations[0]
    assert v.kind == "non-twin tie" and v.layer == "pool1"
    assert v.describe() == (f"non-twin tie at pool1, example {v.example}, channel {v.channel}, "
                            f"window {v.where}")
    assert r.summary().startswith(f"NOT smooth: {r.non_twin_ties} non-twin ties")
    # the named window really ties at the point, in the pool's input
    _, saved = cifar8.NET.forward(planted, flat, CFG)
    win = np.asarray(maxpool.windows(cifar8.NET.pool_inputs(saved)["pool1"], maxpool.POOL2))
    cells = win[v.example, v.channel, v.where[0], v.where[1]]
    assert cells.max() > 0 and (cells == cells.max()).sum() >= 2


def _zero_channel(params, bn, channel):
    """γ = β = 0 in one BN channel: that channel reads exactly 0 before the ReLU."""
    return dict(params, **{f"{bn}.weight": params[f"{bn}.weight"].at[channel].set(0.0),
                           f"{bn}.bias": params[f"{bn}.bias"].at[channel].set(0.0)})


def test_zero_pre_activations_are_violations(params, photos):
    r = census.smoothness(cifar8.NET, _zero_channel(params, "bn2", 3), photos, CFG)
    assert not r.ok and r.zeros == 2 * 32 * 32 and r.zero_counts["bn2"] == r.zeros
    zero = [v for v in r.violations if v.kind == "zero pre-activation"]
    assert zero and zero[0].layer == "bn2" and zero[0].channel == 3
    assert zero[0].describe().startswith("zero pre-activation at bn2, example 0, channel 3, cell (")
    assert r.min_abs_preactivation == 0.0


def test_report_as_dict_round_trips_counts(planted_report):
    d = planted_report.as_dict()
    assert d["ok"] is False and d["non_twin_ties"] == planted_report.non_twin_ties
    assert d["pools"][0]["counts"] == planted_report.pools[0].counts
    assert d["violations"][0]["layer"] == "pool1"
    assert [h["key"] for h in d["hypotheses"]] == ["parameters", "cifar8_input"]
    assert d["hypotheses"][0]["holds"] is False and d["hypotheses"][0]["violations"][0]["kind"] == "non-twin tie"
    assert "non-twin tie" in planted_report.table().splitlines()[0]


def test_smoothness_refuses_images_of_another_dtype(params, photos):
    with pytest.raises(ValueError, match="float64 or float32"):
        census.smoothness(cifar8.NET, params, photos.astype(jnp.bfloat16), CFG)


# ---- three hypotheses, three verdicts: cifar8 ---------------------------------------------------

def test_every_hypothesis_holds_where_no_window_is_dead(params, randn):
    """randn has no twins; lifting each pool-feeding β just above its lowest window maximum leaves no
    dead window, and then even MaxPool2Smooth (unique maxima only) holds."""
    before = census.smoothness(cifar8.NET, params, randn, CFG)
    assert _total(before, "dead") > 0 and _verdicts(before) == {"parameters": True, "cifar8_input": False}
    lifted = census.lift_dead_windows(cifar8.NET, params, randn, CFG)
    moved = {k for k in params if not np.array_equal(lifted[k], params[k])}
    assert moved and moved <= {f"bn{2 * k}.bias" for k in range(1, 5)}
    assert all(np.all(np.asarray(lifted[k]) >= np.asarray(params[k])) for k in moved)
    r = census.smoothness(cifar8.NET, lifted, randn, CFG)
    assert _total(r, "dead") == 0 and _total(r, "twin tie") == 0 and r.zeros == 0
    assert _verdicts(r) == {"parameters": True, "cifar8_input": True}
    assert all(h.violated == 0 and h.first is None and h.violations == [] for h in r.hypotheses)
    assert r.summary().endswith("hypotheses: parameter gradients hold, cifar8 input gradient holds")


def test_photos_hold_the_parameter_hypothesis_not_max_pool2_smooth(photo_report):
    """Dead windows tie their zeros: allowed for the parameter gradients, not by MaxPool2Smooth."""
    r = photo_report
    assert _verdicts(r) == {"parameters": True, "cifar8_input": False}
    c8 = r.hypothesis("cifar8_input")
    pools, convs, fcs = c8.clauses
    assert pools.name.startswith("MaxPool2Smooth") and pools.violated == _total(r, "dead") > 0
    assert convs.holds and fcs.holds
    assert c8.first.kind == "dead window" and c8.first.layer == "pool1"
    assert c8.first.describe().startswith("dead window at pool1, example 0, channel ")
    assert c8.summary().startswith(f"cifar8 input gradient: fails (MaxPool2Smooth (pools 1…4) ×{pools.violated})")


def test_flat_images_break_max_pool2_smooth_by_twin_ties_too(flat_report):
    r = flat_report
    assert _verdicts(r) == {"parameters": True, "cifar8_input": False}
    pools = r.hypothesis("cifar8 input gradient").clauses[0]
    assert pools.violated == _total(r, "dead") + _total(r, "twin tie")
    assert _total(r, "twin tie") > 100


def test_a_non_twin_tie_breaks_every_hypothesis(planted_report):
    r = planted_report
    assert _verdicts(r) == {"parameters": False, "cifar8_input": False}
    param = r.hypothesis("parameters")
    assert param.clauses[0].violated == r.non_twin_ties and param.clauses[1].holds
    assert param.first == r.violations[0]
    assert r.hypothesis("cifar8_input").clauses[0].violated == sum(
        _total(r, c) for c in ("dead", "twin tie", "non-twin tie"))


def test_zeros_break_the_clause_of_their_layer(params, photos):
    """A zero in a conv channel breaks c8Z₁…c8Z₈; a zero in a head unit breaks the head clause."""
    r = census.smoothness(cifar8.NET, _zero_channel(params, "bn5", 0), photos, CFG)
    param, c8 = r.hypotheses
    assert not param.holds and [c.holds for c in param.clauses] == [True, False]
    assert [c.violated for c in c8.clauses[1:]] == [2 * 8 * 8, 0]
    assert c8.clauses[1].listed[0].layer == "bn5"
    head_zero = dict(params, **{"fc1.weight": params["fc1.weight"].at[7].set(0.0),
                                "fc1.bias": params["fc1.bias"].at[7].set(0.0)})
    r = census.smoothness(cifar8.NET, head_zero, photos, CFG)
    c8 = r.hypothesis("cifar8_input")
    assert [c.violated for c in c8.clauses[1:]] == [0, 2]
    assert c8.clauses[2].listed[0].describe() == "zero pre-activation at fc1, example 0, unit 7"


def test_hypothesis_lookup_and_table(photo_report):
    r = photo_report
    assert r.hypothesis("cifar8 input gradient").key == census.C8_INPUT     # by name or by key
    assert r.hypothesis(census.C8_INPUT) == r.hypothesis("cifar8 input gradient")
    with pytest.raises(ValueError, match="resnet34_input"):
        r.hypothesis("resnet34_input")
    table = r.table()
    assert "MaxPool2Smooth (pools 1…4)" in table and "→ cifar8BbnInputGradB_correct" in table
    assert "→ cifar8Bbn_net_lossGrad" in table


def test_a_report_without_per_layer_zeros_never_loses_them():
    """A report built by hand (zeros counted, not attributed) charges them to every zero clause."""
    pools = [census.PoolCensus("pool1", "bn2", np.array([[[[STRICT, STRICT]]]]), 1e-3, np.inf)]
    r = census.SmoothReport(pools, 5, 0.0, net="cifar8", suite="cifar8")
    assert not r.ok
    assert [h.holds for h in r.hypotheses] == [False, False]
    assert r.hypothesis("cifar8_input").clauses[1].violated == 5
    generic = census.SmoothReport(pools, 5, 0.0, net="mine")      # a net the suite does not name
    assert [(h.key, h.holds) for h in generic.hypotheses] == [(census.PARAMETERS, False)]
    assert generic.hypothesis(census.PARAMETERS).clauses[1].violated == 5


# ---- three hypotheses, three verdicts: ResNet-34 ------------------------------------------------

@pytest.fixture(scope="module")
def params34():
    return {k: v.astype(jnp.float64) for k, v in resnet34.NET.init(jax.random.key(0), CFG34, weights="drawn").items()}


def _census34(params34, x):
    return census.smoothness(resnet34.NET, params34, x, CFG34, draws=2)


@pytest.fixture(scope="module")
def photo34(params34):
    return _census34(params34, jnp.asarray(data.photos(2, 32, seed=0, dtype=np.float64)))


def test_resnet34_stem_pool_census(photo34):
    r = photo34
    assert [q.pool for q in r.pools] == ["stem.pool"] and r.pools[0].preactivation == "bn1"
    assert r.pools[0].windows == 2 * 64 * 8 * 8
    assert r.ok and r.pools[0].counts["dead"] > 0 and r.pools[0].counts["strict"] > 0


def test_resnet34_dead_windows_satisfy_h_pool(photo34):
    """h_pool allows a window that is all zero: photos hold both ResNet-34 hypotheses."""
    assert _verdicts(photo34) == {"parameters": True, "resnet34_input": True}
    assert [c.name.split(" ")[0] for c in photo34.hypothesis("resnet34_input").clauses] == ["h_stem", "h_pool", "hb₁…hb₁₆"]


def test_resnet34_twin_ties_break_h_pool(params34):
    r = _census34(params34, jnp.asarray(data.flat_images(2, 32, seed=0, dtype=np.float64)))
    assert _verdicts(r) == {"parameters": True, "resnet34_input": False}
    h_stem, h_pool, blocks = r.hypothesis("resnet34_input").clauses
    assert h_stem.holds and blocks.holds
    assert h_pool.violated == r.pools[0].counts["twin tie"] > 0
    assert h_pool.listed[0].kind == "twin tie" and h_pool.listed[0].layer == "stem.pool"


def test_resnet34_non_twin_tie_breaks_both(params34):
    r = _census34(census.planted_tie(resnet34.NET, params34), jnp.asarray(data.flat_images(2, 32, seed=0, dtype=np.float64)))
    assert _verdicts(r) == {"parameters": False, "resnet34_input": False}
    assert r.violations[0].layer == "stem.pool" and r.hypothesis("parameters").first.kind == "non-twin tie"


def test_resnet34_lifted_randn_point_holds_both(params34):
    x = prng.normal(jax.random.key(1), (2, 3, 32, 32), jnp.float64)
    lifted = census.lift_dead_windows(resnet34.NET, params34, x, CFG34)
    r = _census34(lifted, x)
    assert r.pools[0].counts["dead"] == 0 and r.pools[0].counts["twin tie"] == 0
    assert _verdicts(r) == {"parameters": True, "resnet34_input": True}


def test_resnet34_zeros_split_between_h_stem_and_the_blocks(params34):
    x = jnp.asarray(data.photos(2, 32, seed=0, dtype=np.float64))
    stem = _census34(_zero_channel(params34, "bn1", 5), x)
    assert [c.holds for c in stem.hypothesis("resnet34_input").clauses] == [False, True, True]
    block = _census34(_zero_channel(params34, "layer2.1.bn1", 0), x)
    h_stem, _, blocks = block.hypothesis("resnet34_input").clauses
    assert h_stem.holds and not blocks.holds and blocks.listed[0].layer == "layer2.1.bn1"
    assert not block.ok


# ---- routing: which twin the backward picks -----------------------------------------------------

def test_rendered_chain_is_the_gather_model_at_argmax(params, flat, labels, flat_report):
    sigma, _ = census.rerouted(cifar8.NET, params, flat, CFG, flat_report, "twin tie")
    targets = targets_matrix(labels, 10, jnp.float64)
    loss, g, dx, _, _ = rendered.compiled(cifar8.NET, KIT, params, flat, targets, CFG, selections=sigma)
    loss_r, g_r, dx_r, _, _ = rendered.run(cifar8.NET, KIT, params, flat, targets, CFG)
    assert float(loss) == pytest.approx(float(loss_r), rel=1e-14)   # two compilations: ulps
    gmax = max(float(jnp.max(jnp.abs(a))) for a in g_r.values())
    for name in g:   # conv biases are 0 in ℝ: round-off only, judged against the net's largest node
        scale = gmax if name.startswith("conv") and name.endswith(".bias") else float(jnp.max(jnp.abs(g_r[name])))
        np.testing.assert_allclose(g[name], g_r[name], rtol=0, atol=1e-13 * scale)
    np.testing.assert_allclose(dx, dx_r, rtol=0, atol=1e-14 * float(jnp.max(jnp.abs(dx_r))))


def test_twin_routing_keeps_the_parameter_gradient_not_the_input_gradient(params, flat, labels, flat_report):
    r = census.routing(cifar8.NET, params, flat, labels, CFG, flat_report, "twin tie")
    assert r.rerouted["pool1"] > 100 and sum(r.rerouted.values()) == _total(flat_report, "twin tie")
    assert r.loss == r.loss_rerouted
    assert r.param_rel <= census.ROUTE_REL and r.same_parameter_gradient
    assert r.dx_rel > 1e-2 and not r.same_input_gradient
    assert set(r.zero_nodes) == {f"conv{k}.bias" for k in range(1, 9)}


def test_dead_windows_route_anywhere(params, flat, labels, flat_report):
    """The ReLU mask kills a dead window's cotangent wherever it lands: nothing changes at all."""
    r = census.routing(cifar8.NET, params, flat, labels, CFG, flat_report, "dead")
    assert sum(r.rerouted.values()) > 1000
    assert r.param_rel == 0.0 and r.dx_rel == 0.0


def test_non_twin_routing_moves_the_parameter_gradient_control(planted, flat, labels, planted_report):
    r = census.routing(cifar8.NET, planted, flat, labels, CFG, planted_report, "non-twin tie")
    assert sum(r.rerouted.values()) == planted_report.non_twin_ties
    assert r.loss == r.loss_rerouted
    assert r.param_rel > 1e-3 and not r.same_parameter_gradient
    assert r.summary().startswith(f"rerouted {planted_report.non_twin_ties} non-twin tie windows")


def test_rerouted_rejects_an_unknown_class(params, flat, flat_report):
    with pytest.raises(ValueError, match="kind 'tied'"):
        census.rerouted(cifar8.NET, params, flat, CFG, flat_report, "tied")


# ---- one-sided slopes -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v(params):
    return fd.direction(params, ["conv1.weight", "conv2.weight"], jax.random.key(1))


def test_direction_is_a_unit_vector_in_the_named_parameters(v):
    assert float(sum(jnp.sum(a * a) for a in v.values())) == pytest.approx(1.0, rel=1e-12)
    assert all(float(jnp.max(jnp.abs(a))) == 0.0 for k, a in v.items() if k not in ("conv1.weight", "conv2.weight"))


def test_one_sided_slopes_agree_at_a_twin_tie_point(params, flat, labels, v):
    s = census.one_sided_slopes(cifar8.NET, params, flat, labels, CFG, v)
    assert s.smooth
    assert s.right == pytest.approx(s.rendered, rel=census.SLOPE_REL)
    assert 0 < s.h < s.radius


def test_one_sided_slopes_differ_at_a_non_twin_tie_control(planted, flat, labels, v):
    s = census.one_sided_slopes(cifar8.NET, planted, flat, labels, CFG, v)
    assert not s.smooth
    assert abs(s.jump) > 1e-2 * max(abs(s.left), abs(s.right))
    assert s.summary().startswith("one-sided slopes DIFFER")


# ---- a net of your own: only the hypotheses that apply to it --------------------------------------

BOTTLENECK = str(Path(__file__).resolve().parents[2] / "examples" / "bottleneck.py") + ":NET"


@pytest.fixture(scope="module")
def bottleneck():
    net = nets.load(BOTTLENECK)
    params = {k: v.astype(jnp.float64) for k, v in net.init(jax.random.key(0), weights="drawn").items()}
    return net, params


def test_a_net_the_suite_does_not_name_gets_the_generic_hypothesis_only(bottleneck, photos):
    """The suite's three named hypotheses belong to cifar8 and ResNet-34: for the bottleneck net of
    examples/ the census reads its own pool and ReLU inputs and states the parameter-gradient
    hypothesis (smooth ReLU inputs, no non-twin tie) and nothing about cifar8 or ResNet-34."""
    net, params = bottleneck
    r = census.smoothness(net, params, photos, net.config())
    assert r.ok and r.net == "bottleneck" and r.suite is None
    assert [p.pool for p in r.pools] == ["stem.pool"] and r.pools[0].preactivation == "bn1"
    assert [h.key for h in r.hypotheses] == [census.PARAMETERS]
    assert r.summary().endswith("hypotheses: parameter gradients hold")
    assert "cifar8" not in r.table() and "ResNet-34" not in r.table() and "cifar8" not in r.summary()
    with pytest.raises(ValueError, match="does not apply to bottleneck"):
        r.hypothesis(census.C8_INPUT)
    # control: a zero in the net's own depthwise layer breaks it, named there
    zero = _zero_channel(params, "dw.bn", 2)
    bad = census.smoothness(net, zero, photos, net.config())
    assert not bad.ok and bad.zero_counts["dw.bn"] == 2 * 16 * 16
    assert bad.hypothesis(census.PARAMETERS).first.layer == "dw.bn"


def test_a_non_twin_tie_is_planted_before_the_first_pool_of_any_net(bottleneck, flat):
    net, params = bottleneck
    planted = census.planted_tie(net, params)
    assert [k for k in params if not np.array_equal(planted[k], params[k])] == ["conv1.weight"]
    r = census.smoothness(net, planted, flat, net.config())
    assert not r.ok and r.non_twin_ties > 0 and r.violations[0].layer == "stem.pool"
    assert census.smoothness(net, params, flat, net.config()).ok        # the same images at the real weights
