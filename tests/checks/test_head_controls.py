"""The head fold (chapter Head fold) against autodiff, and its planted bugs: each goes red where it should
and hides exactly where the maths says it must (a control is only as good as its point).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradtie import data, prng
from gradtie.checks import head as hc
from gradtie import tolerances
from gradtie.ops import head


def _batch(n, k, seed=0, scale=3.0):
    key = jax.random.key(seed)
    z = scale * prng.normal(key, (n, k), jnp.float64)
    labels = prng.randint(jax.random.fold_in(key, 1), (n,), 0, k)
    return z, labels, head.one_hot(labels, k, jnp.float64)


@given(n=st.sampled_from([1, 3, 6, 7]), k=st.sampled_from([2, 5, 10]), alpha=st.sampled_from([0.0, 0.1, 0.3]),
       seed=st.integers(0, 2**16))
def test_fold_equals_autodiff_of_the_smoothed_loss(n, k, alpha, seed):
    z, _, t = _batch(n, k, seed)
    assert hc.tie_fold(z, t, alpha).ok


def test_fold_matches_head_cotangent_bit_for_bit():
    z, _, t = _batch(6, 10)
    assert np.array_equal(hc.fold_steps(z, t, 0.1).dy, np.asarray(head.cotangent(z, t, 0.1)))


def test_fold_cases_with_mixup_and_cutmix_targets():
    cases = hc.fold_cases(jax.random.key(0), batches=(3,))
    assert cases.ok and len(cases.rows) == 6
    for kind in data.TARGET_KINDS:
        assert head.row_sum_error(data.batch_targets(kind, 6, 10, jax.random.key(2))) <= 1e-15


def test_rows_not_summing_to_one_break_the_tie_and_are_refused():
    z, _, t = _batch(3, 10)
    assert not hc.tie_fold(z, 1.2 * t, 0.1).ok
    assert "sum to 1" in hc.refusal(z, 1.2 * t, 0.1)
    assert hc.refusal(z, t, 0.1) == ""


def test_alpha_zero_is_plain_cross_entropy():
    z, labels, t = _batch(3, 10)
    s = hc.fold_steps(z, t, 0.0)
    assert np.all(s.a == 0) and np.array_equal(s.d2, s.d0)
    assert hc.tie_plain(z, labels).ok


def test_true_division_is_inexact_unless_n_is_a_power_of_two():
    z3, _, t3 = _batch(3, 10)
    z4, _, t4 = _batch(4, 10)
    assert hc.fold_steps(z3, t3, 0.1).inexact_divisions > 0
    assert hc.fold_steps(z4, t4, 0.1).inexact_divisions == 0


@pytest.mark.parametrize("name", sorted(hc.CONTROLS))
def test_planted_bug_goes_red(name):
    z, _, t = _batch(6, 10)
    assert not hc.tie_fold(z, t, 0.1, fold=hc.CONTROLS[name]).ok


def test_controls_hide_where_the_maths_says():
    z, _, t = _batch(10, 10)                        # N = K: the wrong axis gives the right α/K
    assert hc.tie_fold(z, t, 0.1, fold=hc.smoothing_wrong_k).ok
    z, _, t = _batch(6, 10)                         # α = 0: nothing to smooth twice
    assert hc.tie_fold(z, t, 0.0, fold=hc.smoothing_twice).ok
    assert not hc.tie_fold(z, t, 0.0, fold=hc.drop_batch_divisor).ok   # 1/N matters at any α


def test_control_table_reads_red_for_every_bug():
    z, _, t = _batch(6, 10)
    table = hc.control_cases(z, t, 0.1)
    assert [row.ok for row in table.rows] == [True, False, False, False]
    assert "red: smoothing_wrong_k, drop_batch_divisor, smoothing_twice" in table.summary()


def test_smoothed_minimum_is_the_entropy_of_t_tilde():
    curve = hc.margin_curve(10, 0.1)
    assert round(curve.entropy, 4) == 0.5003
    assert curve.ok
    assert curve.minimum > 0.485 + 0.01
    assert curve.best_margin == pytest.approx(np.log(91.0))


def test_entropy_splits_into_the_label_and_the_other_classes():
    """0.0858 + 0.4145 = 0.5003 at K = 10, α = 0.1; the split adds up to H(t̃) at other K and α too."""
    terms = hc.entropy_terms(10, 0.1)
    assert (terms.label_share, terms.other_share) == pytest.approx((0.91, 0.01), abs=1e-15)
    assert [round(v, 4) for v in (terms.label_term, terms.others_term, terms.total)] == [0.0858, 0.4145, 0.5003]
    assert terms.best_margin == pytest.approx(np.log(91.0), rel=1e-15)
    for k, alpha in [(5, 0.2), (100, 0.1), (10, 1.0)]:
        assert hc.entropy_terms(k, alpha).total == pytest.approx(hc.smoothed_entropy(k, alpha), rel=1e-14)
    with pytest.raises(ValueError, match="0 < alpha"):
        hc.entropy_terms(10, 0.0)


@pytest.mark.parametrize("k, alpha", [(5, 0.2), (100, 0.1), (10, 0.5)])
def test_smoothed_entropy_is_the_loss_at_log_t_tilde(k, alpha):
    curve = hc.margin_curve(k, alpha, descent_steps=10)
    assert curve.at_log_target == pytest.approx(curve.entropy, rel=tolerances.REL_F64, abs=1e-15)


def test_linear_head_ties_at_tied_features_and_its_control_goes_red():
    good = hc.linear_head_cases(jax.random.key(0))
    bad = hc.linear_head_cases(jax.random.key(0), gap_backward=hc.gap_without_area)
    assert good.ok and good.meta["feature_ties"] > 0
    assert not bad.rows[0].ok and all(r.ok for r in bad.rows[1:])
