"""How small a bug the check can see (issue 26 items 9 and 10): each row's threshold is planted at
twice and at half its size, and finite differences reach the nodes of an ill-conditioned point."""

import jax
import jax.numpy as jnp
import pytest

from gradtie import data
from gradtie.checks import bugs, check
from gradtie.checks.tie import reference_at, targets_matrix, tie
from gradtie.nets import cifar8, resnet34


@pytest.fixture(scope="module")
def point8():
    cfg = cifar8.Config()
    params = {k: v.astype(jnp.float64) for k, v in cifar8.NET.init(jax.random.key(0), cfg, weights="drawn").items()}
    x = data.images("photos", 2, 32, seed=0)
    t = targets_matrix(jnp.arange(2) * 3 % 10, 10, jnp.float64)
    point = reference_at(cifar8.NET, params, x, t, cfg)
    return params, x, t, cfg, point, tie(point)


@pytest.mark.parametrize("name", ["conv3.weight", "bn5.weight", "bn5.bias", "fc2.weight"])
def test_a_node_off_by_twice_its_threshold_is_caught_and_by_half_is_not(point8, name):
    params, x, t, cfg, point, real = point8
    row = real.row(name)
    assert 0 < row.sensitivity < 1e-8          # the 1e-10 floor: a tiny error is seen
    verdicts = {}
    for factor in (2.0, 0.5):
        rep = tie(point, bugs.scaled_node(cifar8.NET, name, factor * row.sensitivity))
        verdicts[factor] = rep.row(name).ok
        assert all(r.ok for r in rep.rows if r.name != name)     # only the scaled node moves
    assert verdicts == {2.0: False, 0.5: True}


def test_the_summary_names_the_median_and_the_worst_node(point8):
    *_, real = point8
    median, worst = real.sensitivity()
    assert 0 < median <= worst < float("inf")
    assert "caught from δ" in real.sensitivity_table()


def test_a_zero_in_reals_node_cannot_see_a_relative_error(point8):
    *_, real = point8
    assert real.row("conv1.bias").zero_in_reals and real.row("conv1.bias").sensitivity > 1e-3


@pytest.mark.slow
def test_finite_differences_judge_most_nodes_of_resnet34_flat():
    """At ResNet-34, flat images, batch 2, 32 px (M = 2 in layer4) at most 20 % of the nodes give no
    evidence, and none fails: the step search finds a step inside the piece where the envelope is small."""
    report = check.run_check("resnet34", batch=2, data="flat", image_size=32)
    none = sum(r.verdict == "no evidence" for r in report.fd_rows)
    assert not any(r.verdict == "FAILED" for r in report.fd_rows)
    assert none <= 0.2 * len(report.fd_rows)


def test_finite_differences_tie_the_input_gradient_too():
    report = check.run_check("cifar8", batch=2, data="photos")
    rows = {r.name: r for r in report.fd_rows}
    assert "input" in rows and rows["input"].verdict == "ok" and report.exit_code == 0
    # where pools tie at a positive maximum (flat images) the real loss has no input gradient: no row
    flat = check.run_check("cifar8", batch=2, data="flat")
    assert flat.tie.meta["input_model"] == "frozen" and "input" not in {r.name for r in flat.fd_rows}
