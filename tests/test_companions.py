"""The book's Lean companions (`gradtie.book.companions`): each passes at its point and its control fails."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import book, nets, prng
from gradtie.book import companions as C
from gradtie import reference_numpy as rn
from gradtie.checks import bf16, bugs, census
from gradtie.checks.tie import targets_matrix
from gradtie.data import images
from gradtie.nets import cifar8, resnet34
from gradtie.ops import maxpool

KEY = jax.random.key(0)


# ---- Bf16Erasure with bf16-typed kernels ----------------------------------------------------------

def strided_cases():
    """The three strided kinds (their padding is the tricky one), small."""
    return [c for c in bf16.kind_cases(0, n=1, c=4, o=4, size=7) if c.stride == 2]


def test_typed_kernels_are_float32_sums_of_the_exact_products_computed_apart():
    rep = C.typed_erasure(C.with_formulation(strided_cases(), "conv"))
    # against the exact sum of the products (NumPy, float64): within float32's own accumulation bound
    assert rep.ok and all(r.within_exact and r.exact_ratio > 0 for r in rep.erasure())
    # the control: operands that are not bf16-exact are rounded by the cast and not by the exact sum,
    # far outside that bound (the operand rounding is 2⁻⁸, the bound n·2⁻²⁴)
    assert all(r.exact_ratio > 10 for r in rep.controls())
    # on the CPU the typed kernel is the f32 peer's very computation: bit for bit, which is why the
    # verdict does not rest on it
    assert all(r.equal and r.kind_equal for r in rep.erasure()) or not bf16.same_computation()


@pytest.mark.parametrize("op", ["forward", "backward", "grad_weight"])
def test_exact_conv_is_the_kit_conv_in_float64_and_a_planted_padding_is_not(op):
    case = next(c for c in bf16.kind_cases(1, n=1, c=3, o=2, size=7) if c.op == op and c.stride == 2)
    a, b = (np.asarray(v, np.float64) for v in (case.a, case.b))
    exact, mag = C.exact_conv(op, a, b, stride=2, kernel_size=3, out_shape=case.node.shape)
    kit = np.asarray(bf16.kinds.apply(op, jnp.asarray(a), jnp.asarray(b), stride=2, out_shape=case.node.shape))
    n = bf16.contraction_length(op, a.shape, b.shape, 3)
    assert np.all(np.abs(kit - exact) <= 2 * C.gamma(n, 2.0 ** -53) * mag)
    # 'SAME'-style padding (one extra row at the end, none at the start) reads other windows
    shifted = np.pad(a, ((0, 0), (0, 0), (1, 0), (1, 0)))[:, :, :a.shape[2], :a.shape[3]] if op != "grad_weight" \
        else np.roll(a, 1, axis=2)
    off, _ = C.exact_conv(op, shifted, b, stride=2, kernel_size=3, out_shape=case.node.shape)
    assert np.max(np.abs(off - exact)) > 1e-3 * np.max(mag)


def test_typed_patches_sum_in_their_own_order_within_the_order_bound():
    rep = C.typed_erasure(C.with_formulation(strided_cases(), "patches"), controls=False)
    assert rep.ok and all(r.within for r in rep.rows)
    assert {r.formulation for r in rep.rows} == {"patches"}


# ---- selScatter against autodiff of the gather model ----------------------------------------------

@pytest.mark.parametrize("spec", [maxpool.POOL2, maxpool.POOL3S2], ids=["2x2", "3x3s2"])
def test_pool_backward_equals_vjp_of_gather_model_with_controls_red(spec):
    r = jnp.maximum(prng.normal(KEY, (2, 3, 8, 8), jnp.float64), 0.0)   # dead windows: ties of zeros
    dy = prng.normal(jax.random.fold_in(KEY, 1), (2, 3, 4, 4), jnp.float64)
    row = C.pool_vjp_tie("pool", r, dy, spec)
    assert row.equal and row.ok and row.tied_windows > 0
    sigma = C.argmax_selection(r, spec)
    assert np.array_equal(sigma, np.asarray(maxpool.select(r, spec)))
    last = C.pool_vjp_tie("pool", r, dy, spec, sigma=np.asarray(maxpool.last_max(r, spec)))
    shifted = C.pool_vjp_tie("pool", r, dy, spec, sigma=C.shifted_selection(sigma, spec))
    kit = bugs.plant("pool_window_offset", cifar8.NET).kit
    planted = C.pool_vjp_tie("pool", r, dy, spec, backward=lambda s, d: kit.pool_backward("pool", s, d))
    assert not last.ok and not shifted.ok and not planted.ok


# ---- node ties at a non-twin tie ---------------------------------------------------------------------

@pytest.mark.parametrize("net, bug, nodes", [
    (cifar8.NET, "bn_forget_gamma", 38),
    pytest.param(resnet34.NET, "projection_bn_reads_dn2", 110, marks=pytest.mark.slow),   # a whole-net stage tie
], ids=["cifar8", "resnet34"])
def test_node_ties_hold_at_a_non_twin_tie_and_a_planted_bug_parts(net, bug, nodes):
    cfg = net.config(num_classes=10)
    params = {k: v.astype(jnp.float64) for k, v in net.init(KEY, cfg, weights="drawn").items()}
    planted = census.planted_tie(net, params)
    x = images("flat", 2, 32, seed=0)
    t = targets_matrix(jnp.asarray([1, 4]), 10, jnp.float64)
    at = C.node_ties_at_tie(net, planted, x, t, cfg, key=KEY)
    assert not at.smooth.ok and at.smooth.non_twin_ties > 0
    assert at.stages.ok and len(at.nodes) == nodes
    red = C.node_ties_at_tie(net, planted, x, t, cfg, key=KEY, chain=bugs.plant(bug, net))
    assert not red.stages.ok and red.stages.first_parting() is not None


# ---- the eighteen-stage fold against the NumPy ResNet-34 -------------------------------------------

def test_fold_matches_numpy_resnet34_and_controls_go_red():
    cfg = resnet34.Config(num_classes=10)
    params = {k: v.astype(jnp.float64) for k, v in resnet34.NET.init(KEY, cfg, weights="drawn").items()}
    x = images("photos", 2, 32, seed=0)
    ref = rn.resnet34_forward(params, np.asarray(x))
    assert C.forward_tie(params, x, cfg, reference_forward=ref).ok
    assert not C.forward_tie(params, x, cfg, ops=rn.PLANTED["flipped_kernel"], reference_forward=ref).ok
    names = [n for n, _ in resnet34.NET.stages(params, cfg)]
    swapped = [names[0], names[2], names[1], *names[3:]]
    assert not C.forward_tie(params, x, cfg, order=swapped, reference_forward=ref).ok


# ---- the head's exact zero ---------------------------------------------------------------------------

def test_head_zero_is_shared_arithmetic_and_the_control_fails():
    cfg = resnet34.Config(num_classes=4)
    params = {k: v.astype(jnp.float64) for k, v in resnet34.NET.init(KEY, cfg, weights="drawn").items()}
    h = prng.normal(KEY, (2, 512, 3, 3), jnp.float64)
    dz = prng.normal(jax.random.fold_in(KEY, 1), (2, 4), jnp.float64)
    rep = C.head_exact(params, h, dz, cfg)
    assert rep.ok and rep.control_fails
    assert all(r.oracle_bits == 0 for r in rep.rows)                 # rendered == autodiff, bit for bit
    assert sum(r.reordered_bits for r in rep.rows) > 0               # another order rounds otherwise


# ---- other block maps between ResNet-34's stem and head --------------------------------------------

def test_other_blocks_between_stem_and_head_tie_and_a_wrong_block_vjp_fails():
    sys.path.insert(0, str(book.ROOT / "examples"))
    bnet = nets.load("bottleneck:NET")
    # small maps in the slots (the chapter types them as r34InputGradB_correct does, at 224 px)
    bcfg = bnet.config().__class__(stem=64, stages=((8, 512, 2),))

    def slots(forget):
        return ([C.identity_slot(), C.residual_slot(64, 3, 0.5, forget_alpha=forget),
                 C.foreign_slot(bnet, bcfg, "layer1.0")] + [C.identity_slot()] * 12 + [C.residual_slot(512, 1, 0.25)])

    net, wrong = C.stem_head_net(slots(False)), C.stem_head_net(slots(True))
    cfg = resnet34.Config(num_classes=4)
    params = {k: v.astype(jnp.float64) for k, v in net.init(KEY, cfg, weights="drawn").items()}
    x = images("photos", 1, 32, seed=0)
    t = targets_matrix(jnp.asarray([1]), 4, jnp.float64)
    good = C.other_blocks(net, params, x, t, cfg, key=KEY)
    assert good.ok and len(good.slots) == 16
    bad = C.other_blocks(net, params, x, t, cfg, rendered_net=wrong, point=good.point)
    assert not bad.ok and not bad.report.row("input").ok


def test_stem_head_net_takes_sixteen_slots():
    with pytest.raises(ValueError, match="sixteen"):
        C.stem_head_net([C.identity_slot()] * 3)


# ---- cifar8's input gradient inside MaxPool2Smooth ----------------------------------------------------

def test_input_gradient_tied_at_lifted_point_and_photos_not_judged():
    cfg = cifar8.Config()
    params = {k: v.astype(jnp.float64) for k, v in cifar8.NET.init(KEY, cfg, weights="drawn").items()}
    (row,) = C.input_sweep(cifar8.NET, params, cfg, lambda n: images("randn", n, 32, seed=0), [1], key=KEY)
    assert row.holds and row.verdict == "tied"
    x = images("photos", 1, 32, seed=0)
    t = targets_matrix(jnp.asarray([1]), 10, jnp.float64)
    photo = C.input_row(cifar8.NET, params, x, t, cfg, point="photos")
    assert not photo.holds and photo.verdict == "not judged" and photo.report is None
    lifted = census.lift_dead_windows(cifar8.NET, params, images("randn", 1, 32, seed=0), cfg)
    red = C.input_row(cifar8.NET, lifted, images("randn", 1, 32, seed=0), t, cfg, point="randn, β lifted",
                      chain=bugs.plant("bn_forget_gamma", cifar8.NET), key=KEY)
    assert red.holds and red.verdict == "FAILED"
