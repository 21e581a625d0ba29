"""The smooth-point census (SPEC §5): dead / strict / twin tie / non-twin tie, zero pre-activations.

Constructed windows first (the classifier on hand-made pre-activations and weight draws), then the
nets on real images: flat images at the default init hold twin ties and no non-twin tie; photos
are mostly dead and strict windows; the convs before pool1 reduced to their centre tap turn equal
PIXELS into ties that are not twins, and the census must refuse the point. At a twin tie, routing
to the other twin keeps the parameter gradient and moves the input gradient; at a non-twin tie the
parameter gradient moves too, and the one-sided slopes of the loss differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie.checks import census
from gradtie.checks.tie import rendered, targets_matrix
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


@pytest.fixture(scope="module")
def params():
    return {k: v.astype(jnp.float64) for k, v in cifar8.init(jax.random.key(0), CFG).items()}


@pytest.fixture(scope="module")
def flat():
    return jnp.asarray(data.flat_images(2, 32, seed=0, dtype=np.float64))


@pytest.fixture(scope="module")
def photos():
    return jnp.asarray(data.photos(2, 32, seed=0, dtype=np.float64))


@pytest.fixture(scope="module")
def labels():
    return jnp.asarray([3, 7])


@pytest.fixture(scope="module")
def flat_report(params, flat):
    return census.smoothness(cifar8, params, flat, CFG)


@pytest.fixture(scope="module")
def planted(params):
    return census.planted_tie(cifar8, params)


@pytest.fixture(scope="module")
def planted_report(planted, flat):
    return census.smoothness(cifar8, planted, flat, CFG)


def _total(report, cls):
    return sum(p.counts[cls] for p in report.pools)


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
    _, saved = cifar8.forward(params, flat, CFG)
    z = np.asarray(cifar8.preactivations(saved)["bn2"])
    win = np.asarray(maxpool.windows(jnp.asarray(z), maxpool.POOL2))
    twin = flat_report.pools[0].classes == TWIN
    assert ((win == win.max(-1, keepdims=True)).sum(-1)[twin] >= 2).all()


def test_photos_are_mostly_dead_and_strict(params, photos):
    report = census.smoothness(cifar8, params, photos, CFG)
    assert report.ok
    windows = sum(p.windows for p in report.pools)
    assert _total(report, "dead") + _total(report, "strict") >= 0.99 * windows
    assert _total(report, "dead") > 0.2 * windows
    assert all(0 < p.margin < np.inf and p.dead_margin > 0 for p in report.pools)


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
    _, saved = cifar8.forward(planted, flat, CFG)
    win = np.asarray(maxpool.windows(cifar8.pool_inputs(saved)["pool1"], maxpool.POOL2))
    cells = win[v.example, v.channel, v.where[0], v.where[1]]
    assert cells.max() > 0 and (cells == cells.max()).sum() >= 2


def test_zero_pre_activations_are_violations(params, photos):
    """γ = β = 0 in one BN channel makes that channel exactly 0 before the ReLU."""
    p = dict(params, **{"bn2.weight": params["bn2.weight"].at[3].set(0.0)})
    r = census.smoothness(cifar8, p, photos, CFG)
    assert not r.ok and r.zeros == 2 * 32 * 32
    zero = [v for v in r.violations if v.kind == "zero pre-activation"]
    assert zero and zero[0].layer == "bn2" and zero[0].channel == 3
    assert zero[0].describe().startswith("zero pre-activation at bn2, example 0, channel 3, cell (")
    assert r.min_abs_preactivation == 0.0


def test_report_as_dict_round_trips_counts(planted_report):
    d = planted_report.as_dict()
    assert d["ok"] is False and d["non_twin_ties"] == planted_report.non_twin_ties
    assert d["pools"][0]["counts"] == planted_report.pools[0].counts
    assert d["violations"][0]["layer"] == "pool1"
    assert "non-twin tie" in planted_report.table().splitlines()[0]


def test_resnet34_stem_pool_census():
    """64 px, batch 1: layer4 keeps 2×2 cells per BN channel. (At 32 px and batch 1 it normalises a
    single cell, x̂ = 0, and its ReLUs read exactly β = 0: the census refuses that point.)"""
    cfg = resnet34.Config(num_classes=10)
    p = {k: v.astype(jnp.float64) for k, v in resnet34.init(jax.random.key(0), cfg).items()}
    x = jnp.asarray(data.photos(1, 64, seed=0, dtype=np.float64))
    r = census.smoothness(resnet34, p, x, cfg, draws=2)
    assert [q.pool for q in r.pools] == ["stem.pool"] and r.pools[0].preactivation == "bn1"
    assert r.pools[0].windows == 64 * 16 * 16
    assert r.ok and r.pools[0].counts["dead"] > 0 and r.pools[0].counts["strict"] > 0
    planted = census.smoothness(resnet34, census.planted_tie(resnet34, p),
                                jnp.asarray(data.flat_images(1, 64, seed=0, dtype=np.float64)), cfg, draws=2)
    assert not planted.ok and planted.violations[0].layer == "stem.pool"


# ---- routing: which twin the backward picks -----------------------------------------------------

def test_rendered_chain_is_the_gather_model_at_argmax(params, flat, labels, flat_report):
    sigma, _ = census.rerouted(cifar8, params, flat, CFG, flat_report, "twin tie")
    targets = targets_matrix(labels, 10, jnp.float64)
    loss, g, dx = census.gradients_at(cifar8, params, flat, targets, CFG, sigma)
    loss_r, g_r, dx_r = rendered(cifar8, params, flat, targets, CFG)
    assert float(loss) == pytest.approx(float(loss_r), rel=1e-14)   # two compilations: ulps
    gmax = max(float(jnp.max(jnp.abs(a))) for a in g_r.values())
    for name in g:   # conv biases are 0 in ℝ: round-off only, judged against the net's largest node
        scale = gmax if name.startswith("conv") and name.endswith(".bias") else float(jnp.max(jnp.abs(g_r[name])))
        np.testing.assert_allclose(g[name], g_r[name], rtol=0, atol=1e-13 * scale)
    np.testing.assert_allclose(dx, dx_r, rtol=0, atol=1e-14 * float(jnp.max(jnp.abs(dx_r))))


def test_twin_routing_keeps_the_parameter_gradient_not_the_input_gradient(params, flat, labels, flat_report):
    r = census.routing(cifar8, params, flat, labels, CFG, flat_report, "twin tie")
    assert r.rerouted["pool1"] > 100 and sum(r.rerouted.values()) == _total(flat_report, "twin tie")
    assert r.loss == r.loss_rerouted
    assert r.param_rel <= census.ROUTE_REL and r.same_parameter_gradient
    assert r.dx_rel > 1e-2 and not r.same_input_gradient
    assert set(r.zero_nodes) == {f"conv{k}.bias" for k in range(1, 9)}


def test_dead_windows_route_anywhere(params, flat, labels, flat_report):
    """The ReLU mask kills a dead window's cotangent wherever it lands: nothing changes at all."""
    r = census.routing(cifar8, params, flat, labels, CFG, flat_report, "dead")
    assert sum(r.rerouted.values()) > 1000
    assert r.param_rel == 0.0 and r.dx_rel == 0.0


def test_non_twin_routing_moves_the_parameter_gradient_control(planted, flat, labels, planted_report):
    r = census.routing(cifar8, planted, flat, labels, CFG, planted_report, "non-twin tie")
    assert sum(r.rerouted.values()) == planted_report.non_twin_ties
    assert r.loss == r.loss_rerouted
    assert r.param_rel > 1e-3 and not r.same_parameter_gradient
    assert r.summary().startswith(f"rerouted {planted_report.non_twin_ties} non-twin tie windows")


def test_rerouted_rejects_an_unknown_class(params, flat, flat_report):
    with pytest.raises(ValueError, match="kind 'tied'"):
        census.rerouted(cifar8, params, flat, CFG, flat_report, "tied")


# ---- one-sided slopes -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v(params):
    return census.direction(params, ["conv1.weight", "conv2.weight"], jax.random.key(1))


def test_direction_is_a_unit_vector_in_the_named_parameters(v):
    assert float(sum(jnp.sum(a * a) for a in v.values())) == pytest.approx(1.0, rel=1e-12)
    assert all(float(jnp.max(jnp.abs(a))) == 0.0 for k, a in v.items() if k not in ("conv1.weight", "conv2.weight"))


def test_one_sided_slopes_agree_at_a_twin_tie_point(params, flat, labels, v):
    s = census.one_sided_slopes(cifar8, params, flat, labels, CFG, v)
    assert s.smooth
    assert s.right == pytest.approx(s.rendered, rel=census.SLOPE_REL)
    assert 0 < s.h < s.radius


def test_one_sided_slopes_differ_at_a_non_twin_tie_control(planted, flat, labels, v):
    s = census.one_sided_slopes(cifar8, planted, flat, labels, CFG, v)
    assert not s.smooth
    assert abs(s.jump) > 1e-2 * max(abs(s.left), abs(s.right))
    assert s.summary().startswith("one-sided slopes DIFFER")
