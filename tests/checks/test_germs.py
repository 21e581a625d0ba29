"""The germ kit (chapter Stage germs; Lean: `c8_germ_stageₖ`): S and G bit for bit below δ and
apart beyond it, δ predicted by the margins to second order along straight and curved paths, finite
differences judged against an independently measured round-off level, and the controls: a wrong
node (×2, ×0) rejected, a close kink giving "no evidence", a non-twin tie giving no germ.

The report's logic runs first on synthetic numbers (no net), then the kit on cifar8 at drawn
weights: germ 8 (bn8, few windows downstream: cheap) on a photo batch, germ 4 on flat images (twin
ties at pool 2), and germ 1 at the planted non-twin tie of `census.planted_tie`. The rendered nodes
come from the one rendered step, so a chain planted from the catalogue (`bugs.plant`) reaches the
walk: its nodes must fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie import tolerances
from gradtie.checks import bugs, census, fd, germs
from gradtie.checks.tie import Point
from gradtie.nets import cifar8, resnet34
from gradtie.nets.protocol import abstract_inputs
from gradtie.ops import head

HS = germs.H_GRID


def _report(errors, *, third=1.0, second=0.0, right=None, left=None, kink=np.inf, delta=np.inf,
            diff=None, ts=germs.T_GRID, node=1.0, eps=1e-15):
    """A GermReport from hand-made numbers: central differences = node + errors."""
    diff = np.zeros(ts.size) if diff is None else diff
    parted = np.nonzero(diff != 0)[0]
    measured = float(ts[parted[0]]) if parted.size else np.inf
    bracket = ((float(ts[parted[0] - 1]) if parted[0] > 0 else 0.0, measured) if parted.size
               else (float(ts[-1]), np.inf))
    zeros = np.zeros(HS.size)
    return germs.GermReport("synthetic", "bn1", "straight", ("w",), ts, diff, measured, bracket, delta, kink, HS,
                            node + np.asarray(errors, float), node, 1.0, (node, second, third),
                            zeros if right is None else right, zeros if left is None else left, eps)


def _roundoff(eps, seed=0):
    """Central-difference round-off of spread eps/(√2·h), as two evaluations give it."""
    return eps / np.sqrt(2) / HS * np.random.default_rng(seed).standard_normal(HS.size)


# ---- the report's logic on synthetic numbers ---------------------------------------------------

def test_window_and_slope_on_truncation_plus_roundoff():
    eps, third = 1e-15, 0.06
    err = third * HS ** 2 / 6 + _roundoff(eps)
    r = _report(err, third=third, kink=1e-2, delta=2e-2, eps=eps)
    assert r.has_window and abs(r.fd_slope - 2) < 0.05
    assert np.all(np.abs(r.truncation_ratios - 1) < 0.15)
    assert r.fd_verdict == "converges"


@pytest.mark.parametrize("scale", [2.0, 0.0, 1.01])
def test_a_wrong_node_fails_where_a_kink_is_close(scale):
    """Stage 1's geometry at init weights (first kink at 6.7e-6): the old verdict, sizing round-off
    from the very errors it judged, let a node wrong by 100 % "converge". ε_L is measured apart."""
    eps, node = 1e-15, 0.3
    central = node + 0.1 * HS ** 2 / 6 + _roundoff(eps)
    r = _report(central - node, third=0.1, kink=6.7e-6, delta=1e-3, node=node, eps=eps)
    assert r.fd_verdict == "converges"
    wrong = r.judged_against(scale)
    assert wrong.fd_verdict == "fails" and wrong.violations.any()


def test_no_evidence_when_no_step_lies_between_roundoff_and_the_kink():
    eps, node = 1e-15, 0.3
    r = _report(_roundoff(eps), kink=1e-12, delta=1e-3, node=node, eps=eps)
    assert r.roundoff_edge > tolerances.GERM_KINK_FRACTION * r.smooth_radius
    assert not r.evidence.any() and r.fd_verdict == "no evidence" and not r.fd_converges


def test_no_evidence_without_a_step_inside_the_kink():
    r = _report(np.zeros(HS.size), kink=1e-14, delta=1e-3)
    assert not r.judged.any() and r.fd_verdict == "no evidence"


def test_kink_shows_as_a_flat_jump():
    smooth = _report(np.zeros(HS.size), second=0.3, right=0.15 * HS + 1e-15 / HS, left=-0.15 * HS)
    kinked = _report(np.zeros(HS.size), right=np.full(HS.size, 1.5), left=np.full(HS.size, -0.5))
    assert not smooth.kinked and kinked.kinked


def test_prediction_consistency_rules():
    diff = np.where(germs.T_GRID >= 1e-3, 1e-6, 0.0)          # S and G part at the 1e-3 grid point
    early = _report(np.zeros(HS.size), diff=diff, delta=6e-4)
    too_late = _report(np.zeros(HS.size), diff=diff, delta=2e-3)   # promised more than holds
    far_early = _report(np.zeros(HS.size), diff=diff, delta=1e-5)
    assert early.prediction_consistent
    assert not too_late.prediction_consistent and not far_early.prediction_consistent


def test_first_crossing_is_the_smallest_root_of_each_gap():
    rng = np.random.default_rng(0)
    g0, g1, g2 = rng.uniform(0.1, 1, 200), rng.standard_normal(200), rng.standard_normal(200)
    t = np.linspace(-5, 5, 2_000_001)
    for i in range(0, 200, 20):
        vals = g0[i] + g1[i] * t + g2[i] * t ** 2
        crossing = np.nonzero(np.diff(np.sign(vals)))[0]
        want = np.min(np.abs(t[crossing])) if crossing.size else np.inf
        got = fd.first_crossing(g0[i:i + 1], g1[i:i + 1], g2[i:i + 1])
        assert (np.isinf(want) and got > 5) or abs(got - want) < 1e-5
    assert fd.first_crossing([1.0], [0.0], [0.0]) == np.inf          # a gap that never moves
    assert fd.first_crossing([1.0], [-2.0], [0.0]) == pytest.approx(0.5)


# ---- the kit on cifar8 --------------------------------------------------------------------------

NET = cifar8.NET
CFG = cifar8.Config(head_width=64)
CFG34 = resnet34.Config(num_classes=10)


@pytest.fixture(scope="module")
def point():
    params = {k: v.astype(jnp.float64) for k, v in NET.init(jax.random.key(0), CFG, weights="drawn").items()}
    x = jnp.asarray(data.photos(2, 32, seed=0), jnp.float64)
    targets = head.one_hot(jnp.array([3, 7]), 10, jnp.float64)
    return params, x, targets, germs.rendered_nodes(NET, params, x, targets, CFG)


@pytest.fixture(scope="module")
def walks(point):
    params, x, targets, grads = point
    return {kind: germs.germ(Point.of(NET, params, x, targets, CFG), grads, "bn8", key=jax.random.key(4),
                             curved=kind == "curved") for kind in ("straight", "curved")}


def test_smooth_point_is_smooth(point):
    params, x, _, _ = point
    assert census.smoothness(NET, params, x, CFG).ok


def test_germ_moves_the_pre_activations_own_weights():
    p = NET.init(jax.random.key(0), CFG)
    assert germs.walk_parameters(cifar8.NET, "bn3", p, CFG) == ("stage2", ("conv3.weight", "conv3.bias",
                                                                       "bn3.weight", "bn3.bias"))
    shapes, _ = abstract_inputs(resnet34.NET, CFG34)
    assert germs.walk_parameters(resnet34.NET, "bn1", shapes, CFG34)[0] == "stem"
    assert germs.walk_parameters(resnet34.NET, "layer2.0.bn1", shapes, CFG34) == (
        "layer2.0", ("layer2.0.conv1.weight", "layer2.0.bn1.weight", "layer2.0.bn1.bias"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["straight", "curved"])
def test_bit_identical_below_delta_and_parts_beyond(walks, kind):
    r = walks[kind]
    assert r.path == kind and r.holds
    assert np.all(r.real_minus_gather[r.ts <= r.delta_bracket[0]] == 0)
    assert np.all(r.real_minus_gather[r.ts >= r.delta_measured] > 0)
    assert r.delta_bracket[0] < r.delta_bracket[1] <= r.delta_measured


@pytest.mark.slow
def test_split_losses_bracket_delta(point, walks):
    params, x, targets, _ = point
    r = walks["curved"]
    sigma = census.selections(NET, params, x, CFG)
    path = fd.make_path(params, r.params, jax.random.key(4))
    straight_delta, _ = fd.radii(NET, params, x, CFG, path, sigma, everywhere=False)
    path = fd.make_path(params, r.params, jax.random.key(4), curved=True, curvature=1 / straight_delta)
    lo, hi = r.delta_bracket
    at = Point.of(NET, params, x, targets, CFG)
    real, gath = germs.split_losses(at, path, [lo, -lo, hi, -hi], sigma, stage="stage4")
    assert np.array_equal(real[:2], gath[:2])
    assert not np.array_equal(real[2:], gath[2:])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["straight", "curved"])
def test_delta_predicted_to_second_order(walks, kind):
    assert walks[kind].prediction_consistent and walks[kind].sharp, walks[kind].summary()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["straight", "curved"])
def test_fd_converges_with_evidence_and_rejects_wrong_nodes(walks, kind):
    r = walks[kind]
    assert r.fd_verdict == "converges", r.summary()
    assert r.resolution < 1e-6                       # the node pinned far below 1 %
    for scale in (2.0, 0.0, 1.01):
        assert r.judged_against(scale).fd_verdict == "fails"


@pytest.mark.slow
def test_a_planted_chains_nodes_fail_the_finite_differences(point, walks):
    """The nodes are the rendered step's of the chain handed in: a BN backward that forgets γ
    (planted from the catalogue) reaches conv8's nodes, and the same walk's differences reject them."""
    params, x, targets, grads = point
    planted = germs.rendered_nodes(NET, params, x, targets, CFG, chain=bugs.plant("bn_forget_gamma", NET))
    assert not np.array_equal(planted["conv8.weight"], grads["conv8.weight"])
    r = germs.germ(Point.of(NET, params, x, targets, CFG), planted, "bn8", key=jax.random.key(4))
    assert walks["straight"].fd_verdict == "converges"
    assert r.fd_verdict == "fails" and r.violations.any()


@pytest.mark.slow
def test_loss_roundoff_is_roundoff(walks):
    for r in walks.values():
        ulp = np.spacing(r.loss)
        assert ulp / 2 <= r.loss_roundoff < 100 * ulp


@pytest.mark.slow
def test_close_kink_gives_no_evidence(point, walks):
    params, x, targets, _ = point
    radius = walks["straight"].roundoff_edge / 3
    near = germs.near_kink(NET, params, x, CFG, "bn8", key=jax.random.key(4), radius=radius)
    assert census.smoothness(NET, near, x, CFG).ok
    grads = germs.rendered_nodes(NET, near, x, targets, CFG)
    r = germs.germ(Point.of(NET, near, x, targets, CFG), grads, "bn8", key=jax.random.key(4))
    assert r.kink_radius == pytest.approx(radius, rel=0.05)
    assert r.judged.any() and not r.evidence.any()
    assert r.fd_verdict == "no evidence"


@pytest.mark.slow
def test_twin_ties_keep_the_germ_bit_for_bit(point):
    params, _, targets, _ = point
    flat = jnp.asarray(data.flat_images(2, 32, seed=0), jnp.float64)
    smooth = census.smoothness(NET, params, flat, CFG)
    assert smooth.ok and smooth.pools[1].counts["twin tie"] > 0     # twins at pool 2
    r = germs.germ(Point.of(NET, params, flat, targets, CFG), None, "bn4", key=jax.random.key(2))
    assert r.holds and r.prediction_consistent


@pytest.fixture(scope="module")
def at_tie(point):
    params, _, targets, _ = point
    planted = census.planted_tie(NET, params)
    flat = jnp.asarray(data.flat_images(2, 32, seed=0), jnp.float64)
    grads = germs.rendered_nodes(NET, planted, flat, targets, CFG)
    return germs.germ(Point.of(NET, planted, flat, targets, CFG), grads, "bn1", key=jax.random.key(1))


@pytest.mark.slow
def test_no_germ_at_a_non_twin_tie(at_tie):
    assert at_tie.parts_at_smallest and at_tie.delta_measured == at_tie.ts[0]
    assert at_tie.kinked
    assert not at_tie.fd_converges and at_tie.fd_verdict == "no evidence"


def test_germ_refuses_bad_input(point):
    params, x, targets, _ = point
    with pytest.raises(ValueError, match="unknown walk"):
        germs.walk_parameters(NET, "bn9", params, CFG)
    with pytest.raises(ValueError, match="unknown walk"):
        germs.walk_parameters(NET, "stage9", params, CFG)
    with pytest.raises(ValueError, match="float32"):
        germs.germ(Point.of(NET, params, x.astype(jnp.float32), targets, CFG), None, "bn8", key=jax.random.key(0))
    with pytest.raises(ValueError, match="x is float32 but the parameters are float64"):   # built directly
        germs.germ(Point(NET, CFG, params, x.astype(jnp.float32), targets), None, "bn8", key=jax.random.key(0))
    with pytest.raises(ValueError, match="BatchNorm layer"):
        germs.near_kink(NET, params, x, CFG, "stage4", key=jax.random.key(0), radius=1e-3)


def _saved(net, cfg):
    params, x = abstract_inputs(net, cfg)
    return jax.eval_shape(lambda p, a: net.forward(p, a, cfg), params, x)[1]


def test_plan_runs_op_by_op_through_the_last_pool(point):
    params, x, _, _ = point
    assert census.pool_stages(NET, CFG, _saved(NET, CFG)) == [0, 1, 2, 3]
    assert [germs._plan(NET, params, x, CFG, f"stage{k}")[1] for k in (1, 4)] == [4, 4]
    assert census.pool_stages(resnet34.NET, CFG34, _saved(resnet34.NET, CFG34)) == [0]   # the stem holds the only pool
