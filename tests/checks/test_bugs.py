"""The catalogue of planted backward bugs: every entry goes red on both nets where it applies, at
drawn weights, and the real chain ties at the same point; two entries hide at init weights.

Points: cifar8 on photos (batch 4) and ResNet-34 at 32 px, batch 2, on flat images — the point
where layer4's BatchNorm normalises over M = 2 values and the envelope widens every limit; a bug
must still stand out there. One reference and envelope per point serve every entry (each compiles
only its own planted backward). The synchronised-BN entries run through the data-parallel tie
(tests/test_parallel.py). `make test` leaves the ResNet-34 rows to Would the check catch it?, which
ties and plants the same catalogue at the same two points under nbval (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data
from gradtie.checks import bugs
from gradtie.checks.tie import reference_at, targets_matrix, tie
from gradtie.nets import cifar8, resnet34

NETS = {"cifar8": (cifar8, cifar8.Config(), data.photos, 4), "resnet34": (resnet34, resnet34.Config(num_classes=10), data.flat_images, 2)}


def _point(name, weights="drawn"):
    net, cfg, make, n = NETS[name]
    params = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in net.init(jax.random.key(0), cfg, weights=weights).items()}
    x = jnp.asarray(make(n, 32, seed=0), jnp.float64)
    t = targets_matrix(jnp.arange(n) * 3 % 10, 10, jnp.float64)
    alpha = 0.1   # head_smoothing_wrong_k plants nothing at α = 0
    return net, cfg, params, x, t, alpha, reference_at(net, params, x, t, cfg, label_smoothing=alpha)


@pytest.fixture(scope="module")
def points():
    return {}


def point(points, name, weights="drawn"):
    if (name, weights) not in points:
        points[name, weights] = _point(name, weights)
    return points[name, weights]


CASES = [(b.name, net) for b in bugs.entries(replicas=False) for net in b.nets]


@pytest.mark.parametrize("name", list(NETS))
def test_real_chains_tie_at_the_catalogue_points(points, name):
    net, cfg, params, x, t, alpha, pt = point(points, name)
    report = tie(net, params, x, t, cfg, label_smoothing=alpha, point=pt)
    assert report.ok and not report.ill_conditioned, report.summary()
    if name == "resnet34":
        # the ResNet-34 point is the ill-conditioned one: its limits widen past the floor
        assert report.smallest_bn()[1] == 2 and len(report.widened()) > 50


@pytest.mark.parametrize("bug, name", CASES, ids=[f"{b}-{n}" for b, n in CASES])
def test_every_catalogue_entry_goes_red(points, bug, name):
    net, cfg, params, x, t, alpha, pt = point(points, name)
    report = tie(bugs.plant(bug, net), params, x, t, cfg, label_smoothing=alpha, point=pt)
    first = report.first_failure()
    assert first is not None, f"{bug} on {name}: not caught ({report.summary()})"
    assert not first.ill_conditioned
    assert first.rel / first.limit > 1e3      # far out, not at the edge of round-off


def test_catalogue_covers_the_issue_and_both_nets():
    names = set(bugs.CATALOGUE)
    assert {"bn_no_mean_term", "bn_no_xhat_term", "bn_unbiased_variance_backward", "bn_rsqrt_twice",
            "bn_swap_dgamma_dbeta", "bn_forget_gamma", "bn_dgamma_from_y", "sync_dgamma_dbeta_reduced_twice",
            "sync_local_means_backward", "pool3x3_scatter_overwrite", "pool_window_offset",
            "relu_mask_from_conv_output", "conv_kernel_not_flipped", "conv_padding_off_by_one",
            "dense_weight_grad_transposed", "head_no_batch_divisor", "head_smoothing_wrong_k",
            "residual_skip_dropped", "projection_bn_reads_dn2"} <= names
    assert len(bugs.entries("cifar8")) >= 14 and len(bugs.entries("resnet34")) >= 17
    assert "bn_forget_gamma" in bugs.listing()


@pytest.mark.parametrize("bug", ["bn_forget_gamma", "bn_dgamma_from_y"])
def test_gamma_bugs_hide_at_init_weights_and_show_at_drawn_ones(points, bug):
    """At init every γ = 1 and β = 0: these two backwards are bit for bit the right one there, which
    is why the check runs at drawn weights by default."""
    net, cfg, params, x, t, alpha, pt = point(points, "cifar8", "init")
    assert tie(bugs.plant(bug, net), params, x, t, cfg, label_smoothing=alpha, point=pt).ok


def test_unknown_or_inapplicable_bug_is_a_clear_error():
    with pytest.raises(ValueError, match="expected one of"):
        bugs.plant("bn_typo", cifar8)
    with pytest.raises(ValueError, match="applies to resnet34 only"):
        bugs.plant("residual_skip_dropped", cifar8)


def test_run_plants_op_by_op_with_the_compiled_verdict(points):
    """`bugs.run` (the chapter's catalogue) runs each planted backward op by op: the same verdict as
    the compiled control, a hiding entry still ties at init weights, and the real chain ties."""
    net, cfg, params, x, t, alpha, pt = point(points, "cifar8")
    rep = bugs.run(net, params, x, t, cfg, label_smoothing=alpha, point=pt, names=("bn_no_mean_term",))
    assert rep.real.ok and [c.bug for c in rep.caught] == ["bn_no_mean_term"]
    c = rep.caught[0]
    compiled = tie(bugs.plant(c.bug, net), params, x, t, cfg, label_smoothing=alpha, point=pt).first_failure()
    assert c.red and c.first.name == compiled.name
    assert c.ratio == pytest.approx(compiled.rel / compiled.limit, rel=1e-6)
    net, cfg, params, x, t, alpha, pt = point(points, "cifar8", "init")
    hidden = bugs.run(net, params, x, t, cfg, label_smoothing=alpha, point=pt, names=("bn_forget_gamma",))
    assert hidden.real.ok and not hidden.caught[0].red and hidden.caught[0].report.ok
