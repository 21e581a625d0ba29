"""The conv floor: its sites are every conv of the nets (their FLOPs are the model's), its one program
does all of the step's conv work, its arithmetic and verdict on rows built by hand (no timing in
tests), and its child process on tiny sites."""

import json
import math
from functools import partial

import jax
import pytest

from gradtie import bench, cli, conv_floor
from gradtie.conv_floor import ConvSite, FloorRow
from gradtie.peer_bench import PeerConfig
from gradtie.rendered import QUICK


def _dense_gflop(config: bench.BenchConfig) -> float:
    params, x, _ = bench.inputs(config, abstract=True)
    return sum(2 * config.batch * math.prod(p.shape) for p in params.values() if len(p.shape) == 2) / 1e9


@pytest.mark.parametrize("net,batch,size,convs", [("cifar8", 4, 32, 8), ("resnet34", 2, 64, 36),
                                                  ("resnet34", 2, 224, 36)])
def test_sites_are_every_conv_of_the_net(net, batch, size, convs):
    sites = conv_floor.sites(net, batch, size)
    assert sum(s.count for s in sites) == convs
    assert [s.input_grad for s in sites].count(False) == 1 and not sites[0].input_grad
    config = bench.BenchConfig(net, batch, size)
    # the model's FLOPs (read off the forward's jaxpr) are the sites' and the dense head's, exactly
    conv = sum(s.count * s.gflop() for s in sites)
    assert 3 * (conv + _dense_gflop(config)) == pytest.approx(bench.model_gflop(config), rel=1e-12)


@partial(jax.jit, static_argnums=0, compiler_options=QUICK)
def _both_layouts(site, x, w, dy):
    """One site's nodes in gradtie's layout and channels-last: one program per site, not one per op."""
    return conv_floor._nodes(site, x, w, dy), conv_floor._nodes_nhwc(site, *conv_floor.to_nhwc(x, w, dy))


def test_the_channels_last_nodes_are_the_same_contractions():
    # float64 (the suite's conftest enables it): the two layouts agree to round-off
    back = {"forward": (0, 3, 1, 2), "backward": (0, 3, 1, 2), "grad_weight": (3, 2, 0, 1)}
    for site in (ConvSite(2, 3, 4, 9, 3, 1), ConvSite(2, 4, 6, 9, 3, 2), ConvSite(2, 4, 6, 8, 1, 2),
                 ConvSite(2, 3, 5, 16, 7, 2)):
        x, w, dy = (a.astype("float64") for a in conv_floor._site_arrays(site, jax.random.key(1)))
        ref, nhwc = _both_layouts(site, x, w, dy)
        assert set(nhwc) == set(ref)
        for name, value in ref.items():
            assert float(abs(nhwc[name].transpose(back[name]) - value).max()) <= 1e-12 * float(abs(value).max())
    # control: an input backward read with the kernel unflipped is another contraction
    site = ConvSite(2, 4, 6, 9, 3, 1)
    x, w, dy = (a.astype("float64") for a in conv_floor._site_arrays(site, jax.random.key(1)))
    right = _both_layouts(site, x, w, dy)[0]["backward"]
    wrong = _both_layouts(site, x, w[:, :, ::-1, ::-1], dy)[1]["backward"]
    assert float(abs(wrong.transpose(0, 3, 1, 2) - right).max()) > 1e-3


def test_the_one_program_does_every_conv_node_of_the_step():
    sites = [ConvSite(2, 3, 4, 8, 3, 1, input_grad=False), ConvSite(2, 4, 4, 8, 3, 1, count=3)]
    instances = [(s, conv_floor._site_arrays(s, jax.random.key(i))) for i, s in enumerate(sites)
                 for _ in range(s.count)]
    counted = bench.forward_flops(lambda arrays: [conv_floor._nodes(s, *a) for (s, _), a in zip(instances, arrays)],
                                  [a for _, a in instances]) / 1e9
    assert counted == pytest.approx(sum(s.count * s.step_gflop() for s in sites), rel=1e-12)
    assert sites[0].step_gflop() == pytest.approx(2 * sites[0].gflop())


def row(floor=(100.0, 110.0), step=(200.0, 200.0), torch_ms=({"forward_backward": 30.0},), count=2,
        nhwc=(120.0, 130.0)):
    site = ConvSite(8, 64, 64, 56, 3, 1, count=count)
    return FloorRow(PeerConfig("resnet34", 8, 224), [site], [{"forward": 10.0, "backward": 10.0, "grad_weight": 20.0}],
                    None if torch_ms is None else list(torch_ms), None if not step else sorted(step)[0],
                    list(floor), list(step), list(nhwc))


def test_arithmetic_and_round_trip():
    r = row()
    assert r.floor_ms() == pytest.approx(105.0)
    assert r.sites_sum_ms() == pytest.approx(2 * 40.0)
    assert r.torch_convs_ms() == pytest.approx(60.0)
    assert r.fraction() == pytest.approx(0.525)        # median of 0.5 and 0.55, the NCHW floor (lower)
    assert r.floor_ms("nhwc") == pytest.approx(125.0) and r.fraction("nhwc") == pytest.approx(0.625)
    assert row(nhwc=(50.0, 60.0)).best_layout() == "nhwc" and row(nhwc=()).best_layout() == "nchw"
    gflop = r.sites[0].step_gflop()
    assert r.site_gflops()[0][1:] == pytest.approx((gflop / 0.040, gflop / 0.030))
    again = FloorRow.from_dict(json.loads(json.dumps(r.as_dict())))
    assert again.fraction() == r.fraction() and again.floor_ms() == r.floor_ms()


def test_verdict_goes_red_and_green_with_the_floor():
    assert conv_floor.kernel_bound([row()]) == []
    assert conv_floor.kernel_bound(conv_floor.scaled([row()], 2.0)) == [
        "resnet34 batch 8 224px: conv floor (NCHW) / PyTorch step = 1.05 > 0.95"]
    # the lower layout decides: a slow NCHW floor with a fast NHWC one is not kernel-bound
    assert conv_floor.kernel_bound([row(floor=(400.0, 400.0), nhwc=(150.0, 150.0))]) == []
    assert conv_floor.kernel_bound(conv_floor.scaled([row(floor=(400.0, 400.0), nhwc=(400.0, 400.0))], 0.25)) == []


def test_table_says_not_run_without_pytorch():
    text = conv_floor.table([row(step=(), torch_ms=None)])
    assert text.count("not run") == 2 and "| — |" in text
    assert conv_floor.kernel_bound([row(step=(), torch_ms=None)]) == []


def test_child_times_gradtie_sites_and_the_one_program():
    sites = [ConvSite(2, 3, 4, 8, 3, 1, input_grad=False), ConvSite(2, 4, 8, 8, 3, 2)]
    out = conv_floor.measure({"side": "gradtie", "sites": [s.__dict__ for s in sites], "repeats": 1})
    assert set(out["ms"][0]) == {"forward", "grad_weight"}
    assert set(out["ms"][1]) == {"forward", "backward", "grad_weight"}
    assert out["all_convs_ms"] > 0 and all(v > 0 for ms in out["ms"] for v in ms.values())
    with pytest.raises(ValueError, match="side must be one of"):
        conv_floor.measure({"side": "tensorflow", "sites": [], "repeats": 1})
    with pytest.raises(ValueError, match="net must be cifar8 or resnet34"):
        conv_floor.sites("vgg", 2, 32)


def test_cli_refuses_two_runs_at_once_and_a_plain_suite(capsys):
    assert cli.main(["bench", "--peers", "--conv-floor"]) == cli.EXIT_BAD_INPUT
    assert cli.main(["bench", "--conv-floor", "--suite", "cpu"]) == cli.EXIT_BAD_INPUT
    assert "--conv-floor" in capsys.readouterr().err
