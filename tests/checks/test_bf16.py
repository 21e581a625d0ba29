"""bf16 erasure on the nets: the whole rendered chains at rnd = identity are the f32 chains bit for
bit; every conv site of a net is rnd(f32 node at rounded operands) and under SPEC §7's bound; every
node of the bf16 gradient against its op's reference within the point's envelope, and a node zeroed,
sign-flipped or scaled by 1.01 failing; the replica sum; the compiler facts on CPU; `gradtie check
--bf16`. Each claim with a control that fails. Drawn weights (γ ≠ 1, β ≠ 0) throughout.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import cli, data, prng
from gradtie.checks import bf16
from gradtie.checks.check import EXIT_TIED, run_check
from gradtie.checks.tie import targets_matrix
from gradtie.nets import cifar8, resnet34, stages
from gradtie.ops import conv

K = 10


def point(net, cfg, n, size):
    params = net.init(jax.random.key(0), cfg, weights="drawn")
    x = jnp.asarray(data.photos(n, size, seed=0), jnp.float32)
    t = targets_matrix(prng.randint(jax.random.key(1), (n,), 0, K), K, jnp.float32)
    return params, x, t


@pytest.fixture(scope="module")
def c8():
    cfg = cifar8.Config(bf16=True)
    return (cifar8, cfg, *point(cifar8, cfg, 4, 32))


@pytest.fixture(scope="module")
def r34():
    cfg = resnet34.Config(num_classes=K, bf16=True)
    return (resnet34, cfg, *point(resnet34, cfg, 2, 32))


@pytest.fixture(scope="module")
def c8_sites(c8):
    net, cfg, params, x, t = c8
    return bf16.conv_sites(net, params, x, t, cfg)


# ---- erasure of the whole chains ----------------------------------------------------------------

@pytest.mark.parametrize("which", ["c8", "r34"])
def test_whole_chain_at_identity_is_the_f32_chain_bit_for_bit(which, request):
    net, cfg, params, x, t = request.getfixturevalue(which)
    report = bf16.chain_erasure(net, params, x, t, cfg)
    assert report.names == ["loss", *params, "input"]
    assert report.ok, report.summary()


def test_control_bf16_rounding_is_not_erased(c8, c8_sites):
    """The same comparison sees a difference: the chain with real bf16 rounding is not the f32 chain."""
    net, cfg, params, x, t = c8
    _, f32_grads, _ = bf16._chain(net, params, x, t, cfg.__class__(), 0.0)
    _, (_, bf16_grads, _) = c8_sites
    assert not bf16.same_bits(f32_grads["conv1.weight"], bf16_grads["conv1.weight"])


# ---- every conv site of a net -------------------------------------------------------------------

def test_sites_cover_every_conv_node(c8_sites, c8):
    sites, _ = c8_sites
    convs = [f"conv{j}" for j in range(1, 9)]
    for op in bf16.OPS:
        assert sorted(s.name for s in sites if s.op == op) == sorted(convs)
    assert all(s.node.dtype == jnp.float32 for s in sites)


def test_resnet_sites_cover_every_conv_node(r34):
    net, cfg, params, x, t = r34
    sites, _ = bf16.conv_sites(net, params, x, t, cfg)
    convs = sorted(name[: -len(".weight")] for name, p in params.items() if p.ndim == 4)
    assert len(convs) == 36
    for op in bf16.OPS:
        assert sorted(s.name for s in sites if s.op == op) == convs
    strided = {s.name for s in sites if s.stride == 2}
    assert strided == {"conv1", "layer2.0.conv1", "layer3.0.conv1", "layer4.0.conv1",
                       "layer2.0.downsample.0", "layer3.0.downsample.0", "layer4.0.downsample.0"}
    # the stem, a downsample block and an identity block against the rounding identity and the bound
    picked = [s for s in sites if s.name.startswith(("conv1", "layer2.0.", "layer4.2.conv2"))]
    rows = bf16.site_rows(picked, stages.rounding(cfg))
    assert len(rows) == 3 * 5 and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_every_site_is_rounded_f32_node_and_under_the_bound(c8, c8_sites):
    net, cfg, params, x, t = c8
    rows = bf16.site_rows(c8_sites[0], stages.rounding(cfg))
    assert all(r.equal for r in rows), [r.label for r in rows if not r.equal]
    assert max(r.ratio for r in rows) <= 1.0
    assert min(r.max_rel for r in rows) > 2.0 ** -16    # bf16-sized errors: the bound is not vacuous


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's formulation rule")
def test_bit_identity_is_required_where_kind_and_reference_run_the_same_sums():
    """A tiny deep grid runs as patches · weights on CPU: a product of bf16-typed operands sums in its
    own order, so there the identity is held to the bound only; the f32-carried rounding keeps it."""
    deep = ("forward", (2, 512, 1, 1), (512, 512, 3, 3), (2, 512, 1, 1), 3)
    shallow = ("forward", (2, 16, 32, 32), (16, 16, 3, 3), (2, 16, 32, 32), 3)
    assert bf16.runs_as_product(*deep) and not bf16.runs_as_product(*shallow)
    assert not bf16.same_computation(*deep, conv.bf16_operand)
    assert bf16.same_computation(*deep, conv.round_bf16) and bf16.same_computation(*shallow, conv.bf16_operand)


def test_site_bound_is_the_spec_formula():
    assert bf16.contraction_length("forward", (2, 64, 8, 8), (128, 64, 3, 3), 3) == 576
    assert bf16.contraction_length("backward", (2, 128, 4, 4), (128, 64, 3, 3), 3) == 1152
    assert bf16.contraction_length("grad_weight", (2, 64, 8, 8), (2, 128, 4, 4), 3) == 32
    n = np.array([147, 4608])
    assert np.allclose(bf16.accumulation_bound(n), [0.0078366, 0.0081047], atol=1e-7)
    assert np.allclose(bf16.node_bound(n) - bf16.accumulation_bound(n), 2.0 ** -8 * (1 + bf16.accumulation_bound(n)))


# ---- controls on the six kinds --------------------------------------------------------------------

@pytest.fixture(scope="module")
def cases():
    return {c.label: c for c in bf16.kind_cases(0)}


def test_six_kinds_erase_round_and_stay_bounded(cases):
    assert list(cases) == ["forward s1", "input backward s1", "weight grad s1",
                           "forward s2", "input backward s2", "weight grad s2"]
    for c in cases.values():
        assert bf16.case_erasure(c), c.label
        row = bf16.case_row(c, conv.round_bf16)
        assert row.ok, row


def test_control_dropped_bias_breaks_erasure(cases):
    c = cases["forward s1"]
    assert not bf16.case_erasure(c, bf16.drop_bias_forward(c.a, c.b, c.bias, stride=1))


def test_control_same_padding_breaks_erasure_on_even_strided():
    c = {c.label: c for c in bf16.kind_cases(0, size=8)}["forward s2"]
    assert not bf16.case_erasure(c, bf16.same_padding_forward(c.a, c.b, c.bias, stride=2))


@pytest.mark.parametrize("label", ["weight grad s1", "weight grad s2"])
def test_control_rounding_inside_the_batch_sum(cases, label):
    """Σ_n rnd(S_n): at identity it reassociates (not the f32 peer's bits), under bf16 it is not
    rnd(f32 node at rounded operands)."""
    c = cases[label]
    at_identity = bf16.grad_weight_rounded_per_example(c.a, c.b, kernel_size=3, stride=c.stride)
    assert not bf16.case_erasure(c, at_identity)
    rounded = bf16.grad_weight_rounded_per_example(c.a, c.b, kernel_size=3, stride=c.stride, rnd=conv.round_bf16)
    assert not bf16.case_row(c, conv.round_bf16, rounded).equal


def test_control_result_only_rounding_breaks_the_identity(cases):
    c = cases["forward s1"]
    assert not bf16.case_row(c, conv.round_bf16, bf16.forward_result_only(c.a, c.b, c.bias)).equal


def test_control_bf16_accumulation_breaks_the_bound():
    c = bf16.kind_cases(0, c=16, positive=True)[0]
    node = bf16.forward_bf16_accumulation(c.a, c.b)
    row = bf16.site_row("accumulated in bf16", "forward", c.a, c.b, node, stride=1, kernel_size=3,
                        rnd=conv.round_bf16)
    assert row.ratio > 1.0
    assert bf16.case_row(bf16.KindCase("proper", "forward", c.a, c.b, None, 1, 3, c.out_shape),
                         conv.round_bf16).ratio <= 1.0


# ---- the whole bf16 gradient ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def c8_gradient(c8):
    net, cfg, params, x, t = c8
    return bf16.gradient_rows(net, params, x, t, cfg)


@pytest.fixture(scope="module")
def r34_gradient(r34):
    net, cfg, params, x, t = r34
    return bf16.gradient_rows(net, params, x, t, cfg)


@pytest.mark.parametrize("which", ["c8_gradient", "r34_gradient"])
def test_every_bf16_node_is_its_ops_derivative_within_the_envelope(which, request):
    rows = request.getfixturevalue(which)
    assert [r.name for r in rows][-1] == "input"
    assert all(r.ok for r in rows), [(r.name, r.ratio) for r in rows if not r.ok]
    # not vacuous: every limit is far below the node itself
    assert all(r.limit < 1e-2 * r.scale for r in rows if not r.zero_in_reals)


@pytest.mark.parametrize("which", ["c8_gradient", "r34_gradient"])
@pytest.mark.parametrize("control", list(bf16.CONTROLS))
def test_control_zeroed_flipped_or_scaled_node_fails(which, control, request):
    rows = request.getfixturevalue(which)
    planted = bf16.controls(rows)[control]
    assert len(planted) == sum(not r.zero_in_reals for r in rows)
    assert not any(r.ok for r in planted), [r.name for r in planted if r.ok]


def test_a_scaled_row_is_the_row_of_the_scaled_node(c8):
    """`GradientRow.scaled` follows from ‖g‖², ⟨g, r⟩, ‖r‖²: the same numbers as judging s·g directly."""
    net, cfg, params, x, t = c8
    calls = bf16.gradient.node_calls(net, params, x, t, cfg)
    r = np.asarray(bf16.gradient.reference_nodes(calls, cfg, jnp.float64)["conv3.weight"], np.float64)
    g = np.asarray(calls["conv3.weight"][-1], np.float64)
    row = next(w for w in bf16.gradient_rows(net, params, x, t, cfg) if w.name == "conv3.weight")
    for s_ in (0.0, -1.0, 1.01):
        planted = row.scaled(s_)
        assert planted.err == pytest.approx(np.linalg.norm(s_ * g - r), rel=1e-9)
        assert planted.along == pytest.approx(np.vdot(s_ * g - r, r) / np.vdot(r, r), rel=1e-9, abs=1e-12)


def test_the_f32_distance_cannot_judge_a_node(c8):
    """Why the verdict is per op: the bf16 gradient's distance to the f32 one is of the order of the
    node (a zeroed node would sit about as far), while per op it is far below it."""
    net, cfg, params, x, t = c8
    far = bf16.f32_distance(net, params, x, t, cfg)
    assert np.median([r.rel for r in far if not r.zero_in_reals]) > 0.01


def test_gradient_verdict_refuses_a_custom_rounding(c8):
    net, cfg, params, x, t = c8
    with pytest.raises(ValueError, match="named rounding"):
        bf16.gradient_rows(net, params, x, t, cfg.__class__(bf16=True, bf16_rounding=conv.round_bf16))


# ---- replica sums -----------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas", [2, 4])
def test_replica_sum_differs_from_rounding_the_sum_exactly_as_spec_says(c8_sites, replicas):
    sites, _ = c8_sites
    s = next(s for s in sites if s.name == "conv6" and s.op == "grad_weight")
    row, d = bf16.replica_sum(s.name, s.a, s.b, kernel_size=3, stride=1, replicas=replicas, rnd=conv.bf16_operand)
    assert row.nodes_rounded and row.identity_zero and row.ok
    assert np.array_equal(d["diff"], d["formula"])
    assert row.differing > 0.5                      # mean_r rnd(S_r) is not rnd(Σ_r S_r)/R
    assert 0 < row.max_diff_rel <= 2 * bf16.U_BF16


def test_replica_sum_needs_equal_shards(c8_sites):
    s = next(s for s in c8_sites[0] if s.op == "grad_weight")
    with pytest.raises(ValueError, match="batch 4 does not split into 3 equal shards"):
        bf16.replica_sum(s.name, s.a, s.b, kernel_size=3, stride=1, replicas=3)


# ---- what the CPU compiler keeps -------------------------------------------------------------------

@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the facts are the CPU backend's")
def test_cpu_keeps_the_cast_pair_and_the_typed_kind():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 8, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 3, 3, 3)), jnp.float32)
    cast = bf16.hlo_cast_roundtrip(x)
    assert cast.pair_kept and cast.rounds and cast.converts.count("bf16") >= 1
    nearest = bf16.hlo_nearest(x)
    assert nearest.converts == [] and nearest.rounds
    typed = bf16.hlo_typed_kind(x, w)
    assert typed.operand_dtypes == ("bf16", "bf16") and typed.result_dtype == "f32"
    assert typed.compiled_bf16 > 0


def test_hlo_convert_parser():
    text = ("%a = bf16[2,3]{1,0} convert(f32[2,3]{1,0} %p)\n  ROOT %b = f32[2,3]{1,0} convert(%a)\n"
            "%c = f32[2,3]{1,0} add(%b, %b)")
    assert bf16.convert_ops(text) == ["bf16", "f32"]


# ---- gradtie check --bf16 --------------------------------------------------------------------------

def test_check_bf16_reports_the_bf16_chain(capsys):
    """The CLI at the fixtures' shapes (batch 4, 32 px): the compiled chains are reused."""
    code = cli.main(["check", "--bf16", "--net", "cifar8", "--batch", "4", "--data", "photos"])
    out = capsys.readouterr().out
    assert code == EXIT_TIED, out
    assert "conv8 weight grad" in out and "= rnd(f32)" in out and "envelope" in out
    assert "erasure at identity 40/40" in out and "24/24 conv nodes = rnd(f32 node at rounded operands)" in out


def test_check_bf16_report_as_json():
    report = run_check("cifar8", batch=4, data="photos", bf16=True, smoothness=False)
    d = json.loads(json.dumps(report.as_dict(), default=float))
    assert d["exit_code"] == EXIT_TIED and d["settings"]["bf16"] is True
    assert d["tie"]["ok"] and d["tie"]["erasure"]["ok"] and len(d["tie"]["sites"]) == 24
    assert len(d["tie"]["nodes"]) == 39    # 38 parameter nodes and the input cotangent
