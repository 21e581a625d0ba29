"""The execution policies' programs as a GPU would compile them, read on this CPU machine.

The rendered step is lowered for CUDA from shapes alone (`gradtie.lowered`): under `bf16` every
convolution must read bf16 and return bf16 at DEFAULT precision (a (bf16, bf16) -> f32 convolution
is a float32 one on XLA's GPU backend) and every strided input backward must read its kernel straight
from a `reverse`; under `tf32` nothing runs at HIGHEST; under `tie` everything does; the bf16 saved
record is about half the float32 one. Each promise is shown failing on a program that breaks it.
"""

from __future__ import annotations

import dataclasses

import pytest

from gradtie import lowered, policy
from gradtie.checks import bugs
from gradtie.nets import cifar8, resnet34

SIZES = {"resnet34": 224, "cifar8": 32}


@pytest.fixture(scope="module")
def programs():
    out = {}
    for net in (resnet34.NET, cifar8.NET):
        for name in policy.NAMES:
            out[net.name, name] = lowered.program(net, net.config(policy=name), batch=2, image_size=SIZES[net.name])
        out[net.name, "bf16 sites"] = lowered.program(net, net.config(bf16=True), batch=2,
                                                      image_size=SIZES[net.name])
    return out


@pytest.mark.parametrize("net", ["resnet34", "cifar8"])
def test_bf16_policy_runs_every_convolution_bf16_in_bf16_out_at_default(programs, net):
    p = programs[net, "bf16"]
    convs = p.convolutions
    # ResNet-34: 36 forwards, 36 weight gradients, 35 input backwards (the image's own is not needed)
    assert len(convs) == {"resnet34": 107, "cifar8": 23}[net]
    assert p.signatures() == {"(bf16, bf16) -> bf16": len(convs)}
    assert all(c.precision == ("DEFAULT", "DEFAULT") for c in convs)
    strided = [c for c in convs if c.lhs_dilation > 1]
    assert len(strided) == {"resnet34": 6, "cifar8": 0}[net]   # layer2-4's conv1 and projection
    assert all(c.kernel_from == "stablehlo.reverse" for c in strided)
    assert lowered.violations(p) == [], lowered.violations(p)[:3]


@pytest.mark.parametrize("net", ["resnet34", "cifar8"])
def test_tf32_policy_has_no_highest_and_tie_has_only_highest(programs, net):
    tf32, tie = programs[net, "tf32"], programs[net, "tie"]
    assert not any("HIGHEST" in c.precision for c in tf32.contractions)
    assert all(c.precision == ("HIGHEST", "HIGHEST") for c in tie.contractions)
    assert len(tf32.contractions) == len(tie.contractions) > len(tie.convolutions)   # the dense head too
    assert lowered.violations(tf32) == [] and lowered.violations(tie) == []


@pytest.mark.parametrize("net", ["resnet34", "cifar8"])
def test_bf16_saved_record_is_about_half_of_float32(programs, net):
    ratio = programs[net, "bf16"].saved_bytes / programs[net, "tie"].saved_bytes
    # the activations halve; the BatchNorm statistics (float32, per channel) are a sliver on top
    assert 0.5 <= ratio < 0.52


@pytest.mark.parametrize("net", ["resnet34", "cifar8"])
def test_control_the_float32_chain_with_bf16_conv_sites_breaks_the_bf16_promise(programs, net):
    """Today's `--bf16` conv sites emit (bf16, bf16) -> f32 convolutions at HIGHEST: judged as a bf16
    policy's program, every convolution is named."""
    old = dataclasses.replace(programs[net, "bf16 sites"], policy="bf16")
    assert old.signatures() == {"(bf16, bf16) -> f32": len(old.convolutions)}
    found = lowered.violations(old)
    assert sum("expected (bf16, bf16) -> bf16" in v for v in found) == len(old.convolutions)
    assert any("at HIGHEST under policy 'bf16'" in v for v in found)
    # and the same float32 chain is not a tf32 program either
    assert lowered.violations(dataclasses.replace(programs[net, "tie"], policy="tf32"))


def test_control_a_kernel_not_read_from_reverse_is_named():
    """A strided input backward whose kernel is not flipped reads it from a convert, not a reverse."""
    net = resnet34.NET
    chain = bugs.plant("conv_kernel_not_flipped", net)
    p = lowered.program(net, net.config(policy="bf16"), batch=2, image_size=64, kit=chain.kit)
    found = [v for v in lowered.violations(p) if "reads its kernel" in v]
    assert len(found) == 6


def test_contraction_parser_reads_both_precision_spellings():
    conv = ('%5 = stablehlo.convolution(%3, %4) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1], window = '
            '{stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [2, 2]} {batch_group_count = 1 : i64, '
            'precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : '
            '(tensor<2x4x8x8xbf16>, tensor<4x4x3x3xbf16>) -> tensor<2x4x16x16xf32>')
    dot = ('%7 = stablehlo.dot_general %1, %2, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : '
           '(tensor<2x512xf32>, tensor<512x10xf32>) -> tensor<2x10xf32>')
    text = "\n".join(["%4 = stablehlo.reverse %0, dims = [2, 3] : tensor<4x4x3x3xbf16>", conv, dot])
    c, d = lowered.contractions(text)
    assert (c.op, c.operands, c.result, c.precision, c.lhs_dilation, c.kernel_from) == (
        "convolution", ("bf16", "bf16"), "f32", ("HIGHEST", "HIGHEST"), 2, "stablehlo.reverse")
    assert (d.op, d.precision, d.result) == ("dot_general", ("DEFAULT", "DEFAULT"), "f32")


def test_policy_names_and_refusals():
    from gradtie import cli
    assert cli.POLICY_NAMES == policy.NAMES
    with pytest.raises(ValueError, match="execution policy 'fp8'"):
        cifar8.NET.config(policy="fp8")
    with pytest.raises(ValueError, match="runs under the 'tie' policy only"):
        resnet34.NET.config(bf16=True, policy="bf16")
