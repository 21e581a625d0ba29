"""The catalogue of planted backward bugs: every entry goes red on both nets where it applies, at
drawn weights, and the real chain ties at the same point; two entries hide at init weights; the
Whole-net tie's controls (`bugs.CONTROLS`) go red first at the node where their bug enters the chain; a node
of the wrong shape is caught by its shape; planting is data (a kit or a net definition), so
nothing is patched and the real chain runs beside a planted one.

Points: cifar8 on photos (batch 4) and ResNet-34 at 32 px, batch 2, on flat images — the point
where layer4's BatchNorm normalises over M = 2 values and the envelope widens every limit; a bug
must still stand out there. One reference and envelope per point serve every entry (each compiles
only its own planted backward). The synchronised-BN entries run through the data-parallel tie
(tests/test_parallel.py). The ResNet-34 cases are slow: Would the check catch it? ties and plants
the same catalogue at the same point under nbval, and the Whole-net tie chapter shows its two
controls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradtie import data, prng
from gradtie.checks import bugs, census
from gradtie.checks.tie import Chain, Point, TieReport, reference_at, targets_matrix, tie
from gradtie.kit import KIT, Kit
from gradtie.nets import cifar8, resnet34
from gradtie.ops import conv, head

ALPHA = 0.1   # head_smoothing_wrong_k plants nothing at α = 0
NET8, NET34 = cifar8.NET, resnet34.NET
CFG8, CFG34 = cifar8.Config(), resnet34.Config(num_classes=10)
NETS = {"cifar8": (NET8, CFG8), "resnet34": (NET34, CFG34)}
# (net, images, batch, weights): the catalogue's points, and the point of ResNet-34's two controls
POINTS = {"cifar8": ("cifar8", data.photos, 4, "drawn"), "resnet34": ("resnet34", data.flat_images, 2, "drawn"),
          "resnet34-controls": ("resnet34", data.photos, 4, "init"), "cifar8-init": ("cifar8", data.photos, 4, "init")}


def _point(which):
    name, make, n, weights = POINTS[which]
    net, cfg = NETS[name]
    params = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in net.init(jax.random.key(0), cfg, weights=weights).items()}
    x = jnp.asarray(make(n, 32, seed=0), jnp.float64)
    t = targets_matrix(jnp.arange(n) * 3 % 10, 10, jnp.float64)
    return net, cfg, params, x, t, reference_at(net, params, x, t, cfg, label_smoothing=ALPHA)


@pytest.fixture(scope="module")
def points():
    return {}


def point(points, which):
    if which not in points:
        points[which] = _point(which)
    return points[which]


def slow_on_resnet34(cases):
    return [pytest.param(*c, marks=pytest.mark.slow) if c[-1] == "resnet34" else c for c in cases]


CASES = [(b.name, name) for name, (net, _) in NETS.items() for b in bugs.entries(net, replicas=False)]


# ---- every entry, both nets ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cifar8", pytest.param("resnet34", marks=pytest.mark.slow)])
def test_real_chains_tie_at_the_catalogue_points(points, name):
    net, cfg, params, x, t, pt = point(points, name)
    report = tie(pt)
    assert report.tied, report.summary()
    if name == "resnet34":
        # the ResNet-34 point is the ill-conditioned one: its limits widen past the floor
        assert report.smallest_bn()[1] == 2 and len(report.widened()) > 50


@pytest.mark.parametrize("bug, name", slow_on_resnet34(CASES), ids=[f"{b}-{n}" for b, n in CASES])
def test_every_catalogue_entry_goes_red(points, bug, name):
    net, cfg, params, x, t, pt = point(points, name)
    # op by op, as `bugs.run` plants them: the entries of a point share their ops, not their programs
    report = tie(pt, bugs.plant(bug, net), how="eager")
    first = report.first_failure()
    assert first is not None, f"{bug} on {name}: not caught ({report.summary()})"
    assert not first.ill_conditioned
    assert first.ratio > 1e3      # far out, not at the edge of round-off


def test_catalogue_covers_the_issue_and_both_nets():
    names = set(bugs.CATALOGUE)
    assert {"bn_no_mean_term", "bn_no_xhat_term", "bn_unbiased_variance_backward", "bn_rsqrt_twice",
            "bn_swap_dgamma_dbeta", "bn_forget_gamma", "bn_dgamma_from_y", "sync_dgamma_dbeta_reduced_twice",
            "sync_local_means_backward", "pool3x3_scatter_overwrite", "pool_window_offset",
            "relu_mask_from_conv_output", "conv_kernel_not_flipped", "conv_padding_off_by_one",
            "dense_weight_grad_transposed", "dense_bias_grad_keepdims", "head_no_batch_divisor",
            "head_smoothing_wrong_k", "residual_skip_dropped", "projection_bn_reads_dn2",
            *bugs.CONTROLS} <= names
    assert len(bugs.entries(NET8, replicas=False)) >= 15 and len(bugs.entries(NET34, replicas=False)) >= 19
    assert "bn_forget_gamma" in bugs.listing() and "dense_bias_grad_keepdims" in bugs.listing(NET8)


def test_entries_apply_where_the_chain_calls_what_they_replace():
    """Read off each net's kit calls: cifar8 has no residual, no projection and no 3×3 pool; its
    fc2 is square, ResNet-34's one dense layer is not."""
    on8 = {b.name for b in bugs.entries(NET8)}
    on34 = {b.name for b in bugs.entries(NET34)}
    assert {"residual_skip_dropped", "projection_bn_reads_dn2", "pool3x3_scatter_overwrite",
            "pool2x2_backward_on_3x3", "same_padding_strided"}.isdisjoint(on8)
    assert {"residual_skip_dropped", "projection_bn_reads_dn2", "pool3x3_scatter_overwrite"} <= on34
    assert "dense_weight_grad_transposed" in on8 and "dense_weight_grad_transposed" not in on34


@pytest.mark.parametrize("bug", ["bn_forget_gamma", "bn_dgamma_from_y"])
def test_gamma_bugs_hide_at_init_weights_and_show_at_drawn_ones(points, bug):
    """At init every γ = 1 and β = 0: these two backwards are bit for bit the right one there, which
    is why the check runs at drawn weights by default (test_every_catalogue_entry_goes_red)."""
    net, cfg, params, x, t, pt = point(points, "cifar8-init")
    assert tie(pt, bugs.plant(bug, net)).tied


def test_unknown_or_inapplicable_bug_is_a_clear_error():
    with pytest.raises(ValueError, match="expected one of"):
        bugs.plant("bn_typo", NET8)
    with pytest.raises(ValueError, match="plants nothing in cifar8"):
        bugs.plant("residual_skip_dropped", NET8)


def test_run_plants_op_by_op_with_the_compiled_verdict(points):
    """`bugs.run` (the chapter's catalogue) runs each planted backward op by op: the same verdict as
    the compiled chain, a hiding entry still ties at init weights, and the real chain ties."""
    net, cfg, params, x, t, pt = point(points, "cifar8")
    rep = bugs.run(pt, names=("bn_no_mean_term",))
    assert rep.real.tied and [c.bug for c in rep.caught] == ["bn_no_mean_term"]
    c = rep.caught[0]
    compiled = tie(pt, bugs.plant(c.bug, net), how="compiled").first_failure()
    assert c.red and c.first.name == compiled.name
    assert c.ratio == pytest.approx(compiled.ratio, rel=1e-6)
    net, cfg, params, x, t, pt = point(points, "cifar8-init")
    hidden = bugs.run(pt, names=("bn_forget_gamma",))
    assert hidden.real.tied and not hidden.caught[0].red and hidden.caught[0].report.tied
    assert "NOT caught" in hidden.caught[0].summary()


# ---- a node of the wrong shape (issue 26, item 3) ------------------------------------------------------

def test_a_bias_node_of_shape_1_by_out_is_caught_by_its_shape(points):
    """dense_bias_grad_keepdims returns Σ dy as [1, out] for an [out] bias: the right numbers, which
    broadcast against the oracle. The row fails by its shape, and only that row."""
    net, cfg, params, x, t, pt = point(points, "cifar8")
    rep = tie(pt, bugs.plant("dense_bias_grad_keepdims", net))
    assert {r.name for r in rep.failed} == {"fc1.bias", "fc2.bias", "fc3.bias"}
    row = rep.first_failure()
    assert row.name == "fc3.bias" and row.shape == (1, 10)
    assert row.mismatch == "shape (1, 10), its parameter's is (10,)"
    assert "its parameter's is" in rep.summary() and "first to break in backward order: fc3.bias" in rep.summary()
    assert rep.table().count("shape  FAILED") == 3
    assert not rep.ok and rep.as_dict()["nodes"][[r.name for r in rep.rows].index("fc3.bias")]["mismatch"]


# ---- the Whole-net tie's controls, where they first go red ---------------------------------------------------------

CONTROLS8 = [n for n in bugs.CONTROLS if bugs.CATALOGUE[n].applies(NET8)]
CONTROLS34 = [n for n in bugs.CONTROLS if n not in CONTROLS8]


@pytest.fixture(scope="module")
def controls8(points):
    net, cfg, params, x, t, pt = point(points, "cifar8")
    return bugs.run(pt, names=CONTROLS8)


@pytest.fixture(scope="module")
def controls34(points):
    net, cfg, params, x, t, pt = point(points, "resnet34-controls")
    return bugs.run(pt, names=CONTROLS34)


def failing(caught) -> set[str]:
    return {r.name for r in caught.report.failed}


def gamma_beta(params) -> set[str]:
    return {n for n in params if params[n].ndim == 1 and not n.startswith("fc") and
            not (n.endswith(".bias") and params[n[:-4] + "weight"].ndim == 4)}


def test_the_controls_split_between_the_nets():
    assert CONTROLS8 == ["bn_swap_dgamma_dbeta", "head_no_batch_divisor", "head_smoothing_wrong_k"]
    assert CONTROLS34 == ["pool2x2_backward_on_3x3", "same_padding_strided"]
    assert all(bugs.CATALOGUE[n].applies(NET34) for n in bugs.CONTROLS)


def test_real_chain_ties_where_the_controls_run(controls8):
    assert controls8.real.tied and controls8.ok
    assert [c.bug for c in controls8.caught] == CONTROLS8


@pytest.mark.slow
def test_resnet34_real_chain_ties_where_its_controls_run(controls34):
    assert controls34.real.tied and controls34.ok
    assert [c.bug for c in controls34.caught] == CONTROLS34


def test_swapped_dgamma_dbeta_goes_red_at_the_last_bn_shift(controls8, points):
    r = controls8["bn_swap_dgamma_dbeta"]
    assert r.red and r.first.name == "bn8.bias" and r.first_beta.name == "bn8.bias"
    assert failing(r) == gamma_beta(point(points, "cifar8")[2])     # beside the chain: nothing else moves
    assert r.first_beta.bad == 32                                   # every channel of the row


def test_head_without_the_batch_divisor_goes_red_at_fc3(controls8):
    r = controls8["head_no_batch_divisor"]
    assert r.red and r.first.name == "fc3.bias" and r.first_beta.name == "bn8.bias"
    # the loss comes from the forward, and conv biases feeding a BatchNorm have zero gradient
    assert {row.name for row in r.report.rows if row.ok} == {"loss"} | {f"conv{k}.bias" for k in range(1, 9)}
    assert r.report.row("fc3.bias").rel == pytest.approx(3.0, rel=1e-9)    # N·g − g = 3g at N = 4


def test_smoothing_over_k_minus_1_goes_red_at_fc3(controls8):
    r = controls8["head_smoothing_wrong_k"]
    assert r.red and r.first.name == "fc3.bias" and r.first_beta.name == "bn8.bias"
    logits = prng.normal(jax.random.key(1), (4, 10), jnp.float64)
    t = targets_matrix(jnp.arange(4), 10, jnp.float64)
    planted = bugs.plant("head_smoothing_wrong_k", NET8).kit.loss_cotangent(logits, t, ALPHA, None)
    # t̃ with α/(K−1) sums to 1 + α/(K−1): each row of dy sums to −α/((K−1)·N) instead of 0
    np.testing.assert_allclose(jnp.sum(planted, axis=1), -ALPHA / (9 * 4), rtol=1e-12)
    np.testing.assert_allclose(jnp.sum(head.cotangent(logits, t, ALPHA), axis=1), 0.0, atol=1e-16)


@pytest.mark.slow
def test_pool2x2_backward_on_3x3_control_goes_red(controls34):
    r = controls34["pool2x2_backward_on_3x3"]
    assert r.red and r.first.name == "bn1.bias" and r.first_beta.name == "bn1.bias"
    assert failing(r) == {"bn1.bias", "bn1.weight", "conv1.weight", "input"}   # the stem and after


@pytest.mark.slow
def test_same_padding_strided_control_goes_red(controls34):
    r = controls34["same_padding_strided"]
    assert r.red and r.first.name == "layer4.0.conv1.weight"
    assert r.first_beta.name == "layer3.5.bn2.bias"      # layer4.0's input backward feeds layer3
    bad = failing(r)
    assert {"conv1.weight", "layer2.0.conv1.weight", "layer3.0.conv1.weight", "input"} <= bad
    # layer4 is downstream of nothing wrong but its own 3×3/s2 weight grad; its 1×1/s2 projection
    # reads the same cells under both paddings and ties
    assert {n for n in bad if n.startswith("layer4")} == {"layer4.0.conv1.weight"}
    assert not any(n.startswith("fc") for n in bad)


def test_non_twin_tie_control_goes_red(points):
    """A point, not a bug: the census refuses it, and the tie does not pass there."""
    net, cfg, params, _, _, _ = point(points, "cifar8")
    x = jnp.asarray(data.flat_images(4, 32, seed=0), jnp.float64)
    t = targets_matrix(jnp.arange(4) * 3 % 10, 10, jnp.float64)
    r = bugs.non_twin_tie(net, params, x, t, cfg, label_smoothing=ALPHA)
    assert not r.smooth.ok and r.smooth.non_twin_ties > 0 and r.red
    assert r.smooth.violations[0].layer == "pool1"
    # rerouting between cells that hold one pixel: only the off-centre taps' weights and the input
    # can tell, and there one-ulp nudges of the point already flip the oracle's routing, so the
    # envelope calls those rows ill-conditioned (gradtie check exits 2) rather than tied
    assert {row.name for row in r.report.ill_conditioned} | failing(r) == {"conv2.weight", "conv1.weight", "input"}
    assert census.smoothness(net, params, x, cfg).ok   # the same images at the real weights


# ---- planting is data -------------------------------------------------------------------------------------

def test_a_planted_chain_is_a_kit_or_a_net_definition_and_the_real_one_is_untouched(points):
    net, cfg, params, x, t, pt = point(points, "cifar8")
    swap = bugs.plant("bn_swap_dgamma_dbeta", net)
    assert isinstance(swap, Chain) and swap.net is net and swap.planted == "bn_swap_dgamma_dbeta"
    changed = [f for f in Kit._fields if getattr(swap.kit, f) is not getattr(KIT, f)]
    assert changed == ["bn_nodes"]                                         # one field of the kit, nothing else
    divisor = bugs.plant("head_no_batch_divisor", net)
    assert [f for f in Kit._fields if getattr(divisor.kit, f) is not getattr(KIT, f)] == ["loss_cotangent"]
    mask = bugs.plant("relu_mask_from_conv_output", net)                  # another net definition
    assert mask.kit is KIT and mask.net is not net and mask.net.param_specs is net.param_specs
    before = tie(pt)
    report = tie(pt, swap)
    assert isinstance(report, TieReport) and report.net == "cifar8 + bn_swap_dgamma_dbeta"
    assert not report.ok and report.first_failure().name == "bn8.bias"
    after = tie(pt)  # side by side: nothing poisoned
    assert after.tied and [r.err for r in after.rows] == [r.err for r in before.rows]
    assert KIT == Kit() and KIT.conv_backward.__module__ == "gradtie.kit"


def test_entries_that_plant_nothing_are_refused(points):
    with pytest.raises(ValueError, match="plants nothing"):
        bugs.plant("same_padding_strided", NET8)
    with pytest.raises(ValueError, match="plants nothing"):
        bugs.plant("pool2x2_backward_on_3x3", NET8)
    net, cfg, params, x, t, pt = point(points, "cifar8")
    with pytest.raises(ValueError, match="label_smoothing"):
        bugs.run(Point.of(net, params, x, t, cfg), names=("head_smoothing_wrong_k",))
    with pytest.raises(ValueError, match="batch 1"):
        bugs.run(Point.of(net, params, x[:1], t[:1], cfg, label_smoothing=0.1), names=("head_no_batch_divisor",))
    with pytest.raises(ValueError, match="plant nothing"):
        bugs.run(Point.of(net, params, x, t, cfg, label_smoothing=0.1), names=("residual_skip_dropped",))


@pytest.mark.parametrize("size,k", [(2, 3), (16, 7), (8, 1)])
def test_same_pads_are_xlas(size, k):
    x = prng.normal(jax.random.key(0), (1, 2, size, size), jnp.float64)
    w = prng.normal(jax.random.key(1), (3, 2, k, k), jnp.float64)
    dims = ("NCHW", "OIHW", "NCHW")
    same = lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=dims)
    pads = bugs.same_pads(size, k, 2)
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
    kit = bugs.plant("same_padding_strided", NET34).kit
    dx = kit.conv_backward("layer2.0.conv1", w, dy, input_shape=x.shape, stride=2)
    dw = kit.conv_grad_weight("layer2.0.conv1", x, dy, kernel_size=3, stride=2)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-12, atol=1e-12)
    assert not np.allclose(conv.backward(w, dy, input_shape=x.shape, stride=2), dx_ref)
