"""The germ kit (SPEC §5, "Stage germs"): S and G bit for bit below δ, apart beyond it, δ predicted
by the margins, finite differences at O(h²) where float64 can see it, and the control at a non-twin
tie where no germ exists.

The report's logic runs first on synthetic numbers (no net), then the kit on cifar8 at a real photo
batch: stage 4 (few windows, its first kink far out, so the h² window is wide) and stage 1 at the
planted non-twin tie of `census.planted_tie`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie.checks import census, germs
from gradtie.nets import cifar8, resnet34
from gradtie.ops import head

HS = germs.H_GRID


def _report(fd_errors, *, third=1.0, second=0.0, right=None, left=None, kink=np.inf, delta=np.inf,
            diff=None, ts=germs.T_GRID):
    """A GermReport from hand-made numbers (the fields the properties read)."""
    diff = np.zeros(ts.size) if diff is None else diff
    parted = np.nonzero(diff != 0)[0]
    measured = float(ts[parted[0]]) if parted.size else np.inf
    bracket = (float(ts[parted[0] - 1]), measured) if parted.size and parted[0] > 0 else (0.0, measured)
    zeros = np.zeros(HS.size)
    return germs.GermReport("synthetic", ("w",), ts, diff, measured, bracket, delta, kink, HS,
                            np.asarray(fd_errors, float), 0.0, 1.0, (0.0, second, third),
                            zeros if right is None else right, zeros if left is None else left)


# ---- the report's logic on synthetic numbers ---------------------------------------------------

def test_window_and_slope_on_truncation_plus_roundoff():
    eps, third = 1e-15, 0.06
    err = third * HS**2 / 6 + eps / HS * np.where(np.arange(HS.size) % 2, 0.3, 0.9)   # noisy round-off
    r = _report(err, third=third, kink=1e-2, delta=2e-2)
    assert r.roundoff_clean and r.has_window
    assert abs(r.fd_slope - 2) < 0.05
    assert np.all(np.abs(r.truncation_ratios - 1) < 0.15)
    assert r.fd_converges


def test_no_window_when_the_kink_comes_before_the_crossover():
    eps, third = 1e-15, 0.1
    err = third * HS**2 / 6 + 0.8 * eps / HS
    err[HS > 3e-5] = 1e-3                        # past the first kink the error is first order
    r = _report(err, third=third, kink=3e-5, delta=1e-3)
    assert not r.has_window and np.isnan(r.fd_slope)
    assert r.fd_converges                         # round-off agreement below the kink is all we claim


def test_a_constant_error_is_not_convergence():
    # a wrong node: the FD error levels off at |Δ| instead of falling under the h² line
    err = 0.06 * HS**2 / 6 + 1e-15 / HS + 1e-6
    r = _report(err, third=0.06, kink=1e-2, delta=2e-2)
    assert not r.fd_converges


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


# ---- the kit on cifar8 --------------------------------------------------------------------------

CFG = cifar8.Config(head_width=64)


@pytest.fixture(scope="module")
def point():
    params = {k: v.astype(jnp.float64) for k, v in cifar8.init(jax.random.key(0), CFG).items()}
    x = jnp.asarray(data.photos(2, 32, seed=0), jnp.float64)
    targets = head.one_hot(jnp.array([3, 7]), 10, jnp.float64)
    return params, x, targets


@pytest.fixture(scope="module")
def stage4(point):
    params, x, targets = point
    grads = germs.rendered_nodes(cifar8, params, x, targets, CFG)
    return germs.germ(cifar8, params, x, targets, CFG, grads, "stage4", key=jax.random.key(4))


@pytest.fixture(scope="module")
def at_tie(point):
    params, _, targets = point
    planted = census.planted_tie(cifar8, params)
    flat = jnp.asarray(data.flat_images(2, 32, seed=0), jnp.float64)
    grads = germs.rendered_nodes(cifar8, planted, flat, targets, CFG)
    return germs.germ(cifar8, planted, flat, targets, CFG, grads, "stage1", key=jax.random.key(1),
                      ts=germs.T_GRID_COARSE, hs=np.logspace(-8, -4, 9))


def test_smooth_point_is_smooth(point):
    params, x, _ = point
    assert census.smoothness(cifar8, params, x, CFG).ok


def test_bit_identical_below_delta_and_parts_beyond(stage4):
    below = stage4.ts < stage4.delta_bracket[0] * (1 + 1e-12)
    assert stage4.bit_identical_below and stage4.parted
    assert np.all(stage4.real_minus_gather[below] == 0)
    assert np.all(stage4.real_minus_gather[stage4.ts >= stage4.delta_measured] > 0)
    assert stage4.delta_bracket[0] < stage4.delta_bracket[1] <= stage4.delta_measured


def test_split_losses_bracket_delta(point, stage4):
    params, x, targets = point
    v = germs.unit_direction(params, stage4.params, jax.random.key(4))
    sigma = germs.selections(cifar8, params, x, CFG)
    lo, hi = stage4.delta_bracket
    real, gath = germs.split_losses(cifar8, params, x, targets, CFG, v, [lo, -lo, hi, -hi], sigma, stage="stage4")
    assert np.array_equal(real[:2], gath[:2])
    assert not np.array_equal(real[2:], gath[2:])


def test_delta_predicted_matches_measured(stage4):
    assert stage4.prediction_consistent
    assert stage4.first_order          # the margins predict δ to first order here


def test_fd_slope_two_where_the_window_is_visible(stage4):
    assert stage4.roundoff_clean
    assert stage4.has_window, stage4.summary()
    assert abs(stage4.fd_slope - 2) <= germs.SLOPE_TOL
    assert np.all(np.abs(stage4.truncation_ratios - 1) <= germs.TRUNCATION_REL)
    assert stage4.fd_converges and not stage4.kinked


def test_no_germ_at_a_non_twin_tie(at_tie):
    assert at_tie.parts_at_smallest and at_tie.delta_measured == at_tie.ts[0]
    assert at_tie.kinked
    assert abs(at_tie.right[0] - at_tie.left[0]) > 1e3 * abs(at_tie.right[0] - at_tie.right[1])
    assert not at_tie.fd_converges


def test_germ_refuses_bad_input(point):
    params, x, targets = point
    with pytest.raises(ValueError, match="unknown stage"):
        germs.stage_parameters(cifar8, "stage9", params, CFG)
    with pytest.raises(ValueError, match="float32"):
        germs.germ(cifar8, params, x.astype(jnp.float32), targets, CFG, None, "stage4", key=jax.random.key(0))


def test_plan_runs_op_by_op_through_the_last_pool(point):
    params, x, _ = point
    assert [germs._plan(cifar8, params, x, CFG, f"stage{k}").stop for k in (1, 4)] == [4, 4]
    cfg34 = resnet34.Config(num_classes=10)
    shapes = jax.eval_shape(lambda: resnet34.init(jax.random.key(0), cfg34))
    p34 = {k: jax.ShapeDtypeStruct(s.shape, jnp.float64) for k, s in shapes.items()}
    assert germs._pool_stages(resnet34, p34, x, cfg34) == [0]      # the stem holds the only pool
