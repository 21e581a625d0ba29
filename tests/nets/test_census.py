"""Census: tensor and float counts of both nets (chapter Whole-net tie), from shapes only."""

import jax
import pytest

from gradtie.nets import cifar8, protocol, resnet34


def _shapes(net, cfg):
    """The params' shapes without allocating them (K = 1000 ResNet-34 is 87 MB in float32), in
    signature order (eval_shape hands a dict back with its keys sorted)."""
    shapes = jax.eval_shape(lambda k: net.init(k, cfg), jax.random.PRNGKey(0))
    return {spec.name: shapes[spec.name] for spec in net.param_specs(cfg)}


def _torchvision_resnet34_names(conv_bias=False):
    """The state_dict keys of torchvision's resnet34() without running statistics, written out here."""
    def conv(name):
        return [f"{name}.weight"] + ([f"{name}.bias"] if conv_bias else [])

    def bn(name):
        return [f"{name}.weight", f"{name}.bias"]

    names = conv("conv1") + bn("bn1")
    for layer, blocks in enumerate([3, 4, 6, 3], start=1):
        for i in range(blocks):
            p = f"layer{layer}.{i}"
            names += conv(f"{p}.conv1") + bn(f"{p}.bn1") + conv(f"{p}.conv2") + bn(f"{p}.bn2")
            if layer > 1 and i == 0:
                names += conv(f"{p}.downsample.0") + bn(f"{p}.downsample.1")
    return names + ["fc.weight", "fc.bias"]


@pytest.mark.parametrize("cfg, tensors, floats", [
    (cifar8.Config(), 38, 374_010),
    (cifar8.Config(head_width=64), 38, 53_242),
    (cifar8.Config(conv_bias=False), 30, 374_010 - 2 * (16 + 16 + 32 + 32)),
])
def test_cifar8_census(cfg, tensors, floats):
    c = protocol.census(_shapes(cifar8.NET, cfg))
    assert (c.tensors, c.floats) == (tensors, floats)
    assert c.table().endswith(f"{tensors} tensors, {floats:,} floats")


@pytest.mark.parametrize("cfg, tensors, floats", [
    (resnet34.Config(), 110, 21_797_672),
    (resnet34.Config(num_classes=10), 110, 21_289_802),
    (resnet34.Config(conv_bias=True), 146, 21_797_672 + 8_512),
])
def test_resnet34_census(cfg, tensors, floats):
    shapes = _shapes(resnet34.NET, cfg)
    c = protocol.census(shapes)
    assert (c.tensors, c.floats) == (tensors, floats)
    assert [spec.name for spec in resnet34.param_specs(cfg)] == _torchvision_resnet34_names(conv_bias=cfg.conv_bias)
    assert str(c).endswith(f"{tensors} tensors, {floats:,} floats")


def test_resnet34_layouts():
    shapes = _shapes(resnet34.NET, resnet34.Config())
    assert shapes["conv1.weight"].shape == (64, 3, 7, 7)
    assert shapes["layer2.0.conv1.weight"].shape == (128, 64, 3, 3)
    assert shapes["layer2.0.downsample.0.weight"].shape == (128, 64, 1, 1)
    assert shapes["layer4.2.bn2.bias"].shape == (512,)
    assert shapes["fc.weight"].shape == (1000, 512)
    # the protocol's abstract point reads the same shapes off the specs, in the same order
    abstract, x = protocol.abstract_inputs(resnet34.NET, resnet34.Config())
    assert [(k, v.shape) for k, v in abstract.items()] == [(k, v.shape) for k, v in shapes.items()]
    assert x.shape == (1, 3, 224, 224)


def test_resnet34_summary_at_imagenet_shapes():
    cfg = resnet34.Config()
    rows = resnet34.NET.summary(_shapes(resnet34.NET, cfg), cfg, (8, 3, 224, 224))
    by_name = {r.name: r for r in rows}
    assert len(rows) == 18
    assert by_name["stem"].output_shape == (8, 64, 56, 56)
    assert by_name["layer1.2"].output_shape == (8, 64, 56, 56)
    assert by_name["layer2.0"].output_shape == (8, 128, 28, 28) and by_name["layer2.0"].kind == "downsample"
    assert by_name["layer3.5"].output_shape == (8, 256, 14, 14) and by_name["layer3.5"].kind == "identity"
    assert by_name["layer4.2"].output_shape == (8, 512, 7, 7)
    assert by_name["head"].output_shape == (8, 1000)
    assert sum(r.params for r in rows) == 21_797_672
    assert protocol.format_summary(rows).splitlines()[-1].endswith("21,797,672")


def test_census_control_goes_red():
    """A missing tensor or a wrong head width shows in the counts."""
    shapes = _shapes(resnet34.NET, resnet34.Config())
    c = protocol.census({k: v for k, v in shapes.items() if k != "layer3.4.bn1.bias"})
    assert (c.tensors, c.floats) == (109, 21_797_672 - 256)
    assert protocol.census(_shapes(cifar8.NET, cifar8.Config(head_width=256))).floats != 374_010
