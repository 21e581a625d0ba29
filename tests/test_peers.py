"""The peers a user would pick instead of gradtie compute gradtie's loss and gradients: plain JAX in
NCHW and NHWC, and PyTorch eager where torch is installed, each held to the float64 oracle within
the point's round-off envelope; a planted wrong peer of each kind goes red. The child process
prints one JSON line, or says it skipped a peer that cannot run. Speed itself is measured in
benchmarks/, never here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gradtie import bench, peers
from gradtie.peers import plain_jax, protocol

CIFAR8 = dict(batch=2, image_size=32)
RESNET34 = dict(batch=2, image_size=32)


def child(spec: dict, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradtie.peers", json.dumps(spec)], capture_output=True, text=True,
                          env=env, check=False, timeout=300)


# ---- plain JAX ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("peer", ["jax-nchw", "jax-nhwc"])
def test_plain_jax_cifar8_agrees_with_the_oracle_f64(peer):
    a = peers.agreement(peer, "cifar8", **CIFAR8)
    assert a.ok, a.describe()
    assert a.report.dtype == "float64" and len(a.report.nodes) == 38
    assert a.worst.err <= a.worst.limit


# NCHW's symmetric padding on ResNet-34 repeats what cifar8's NCHW case and NHWC's ResNet-34 case check
@pytest.mark.parametrize("peer", ["jax-nhwc", pytest.param("jax-nchw", marks=pytest.mark.slow)])
def test_plain_jax_resnet34_agrees_with_the_oracle_f64(peer):
    a = peers.agreement(peer, "resnet34", **RESNET34)
    assert a.ok, a.describe()
    assert len(a.report.nodes) == 110
    # layer4 normalises M = 2 cells per channel at 32 px, batch 2: the envelope, not the floor, sets those limits
    assert any(r.by == "envelope" for r in a.report.rows)


def test_plain_jax_agrees_within_the_float32_envelope_with_label_smoothing():
    a = peers.agreement("jax-nhwc", "cifar8", **CIFAR8, dtype="float32", alpha=0.1)
    assert a.ok, a.describe()
    assert a.report.dtype == "float32" and a.report.meta["alpha"] == 0.1


def test_same_padding_strided_peer_goes_red():
    """'SAME' pads a strided conv (p−1, p): every window of ResNet-34's strided convs one cell off."""
    a = peers.agreement("jax_same_padding_strided", "resnet34", **RESNET34)
    assert not a.ok
    assert a.worst.err > 1e3 * a.worst.limit
    assert "DISAGREES" in a.describe()


def test_layout_conversion_is_exact_and_permutes_fc1_in_nhwc():
    params, _, _ = peers.point("cifar8", batch=1, image_size=32)
    p = protocol.host(params, np.float64)
    for layout in plain_jax.LAYOUTS:
        there = plain_jax.to_layout(p, "cifar8", layout)
        back = plain_jax.from_layout(there, "cifar8", layout)
        assert all(np.array_equal(back[k], p[k]) for k in p)
    nchw, nhwc = (plain_jax.to_layout(p, "cifar8", layout) for layout in plain_jax.LAYOUTS)
    assert nhwc["conv1.weight"].shape == (3, 3, 3, 16) and nchw["conv1.weight"].shape == (16, 3, 3, 3)
    assert nchw["fc1.weight"].shape == nhwc["fc1.weight"].shape == (128, 512)
    assert not np.array_equal(nchw["fc1.weight"], nhwc["fc1.weight"])        # rows permuted to (H,W,C)
    assert np.array_equal(np.sort(nchw["fc1.weight"], axis=0), np.sort(nhwc["fc1.weight"], axis=0))


# ---- PyTorch eager -----------------------------------------------------------------------------------

@pytest.mark.parametrize("net, size, alpha", [("cifar8", CIFAR8, 0.1), ("resnet34", RESNET34, 0.0)])
def test_torch_agrees_with_the_oracle_f64(net, size, alpha):
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    a = peers.agreement("torch", net, **size, alpha=alpha)
    assert a.ok, a.describe()


def test_torch_cifar8_flattened_hwc_goes_red():
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    a = peers.agreement("torch_flatten_hwc", "cifar8", **CIFAR8)
    assert not a.ok
    assert a.worst.err > 1e3 * a.worst.limit
    # the stages' convolutions see fc1's cotangent permuted: the error reaches the first layer
    assert "conv1.weight" in a.failed


# ---- the interface -----------------------------------------------------------------------------------

def test_point_is_the_benchmarks_inputs_at_seed_0():
    params, x, targets = peers.point("cifar8", batch=2, image_size=32)
    b_params, b_x, b_targets = bench.inputs(bench.BenchConfig("cifar8", 2, 32))
    assert list(params) == list(b_params)
    assert all(np.array_equal(params[k], b_params[k]) for k in params)
    assert np.array_equal(x, b_x) and np.array_equal(targets, b_targets)


def test_registry_names_and_errors():
    assert peers.NAMES == ("jax-nchw", "jax-nhwc", "torch")
    assert peers.get("jax-nhwc").layout == "NHWC"
    with pytest.raises(ValueError, match="unknown peer"):
        peers.get("tensorflow")
    params, x, targets = peers.point("cifar8", batch=1, image_size=32)
    del params["fc3.bias"]
    with pytest.raises(ValueError, match="not cifar8's"):
        peers.prepare("jax-nchw", "cifar8", params, x, targets, num_classes=10)


def test_prepared_grads_come_back_in_gradtie_names_order_and_layout():
    params, x, targets = peers.point("cifar8", batch=2, image_size=32)
    prepared = peers.prepare("jax-nhwc", "cifar8", params, x, targets, num_classes=10)
    prepared.step()
    loss, grads = prepared.grads()
    assert isinstance(loss, float) and np.isfinite(loss)
    assert list(grads) == list(params)
    assert all(grads[k].shape == params[k].shape and grads[k].dtype == np.float64 for k in params)


# ---- the child process -------------------------------------------------------------------------------

def test_child_prints_one_json_line_with_the_timings():
    spec = {"peer": "jax-nchw", "net": "cifar8", "batch": 2, "image_size": 32, "num_classes": 10, "repeats": 2,
            "threads": 2}
    out = child(spec)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert {"peer", "times_ms", "peak_rss_mib", "threads", "version", "layout"} <= set(row)
    assert row["peer"] == "jax-nchw" and row["layout"] == "NCHW" and row["version"].startswith("jax ")
    assert len(row["times_ms"]) == 2 and all(t > 0 for t in row["times_ms"])
    assert row["peak_rss_mib"] >= row["rss_before_mib"] > 0
    assert row["threads"] >= 1 and row["threads_requested"] == 2


def test_child_skips_torch_when_it_cannot_be_imported(tmp_path):
    """torch hidden behind a package on PYTHONPATH that fails to import, as a machine without it."""
    (tmp_path / "torch").mkdir()
    hidden = "raise ModuleNotFoundError(\"No module named 'torch' (hidden)\", name='torch')\n"
    (tmp_path / "torch" / "__init__.py").write_text(hidden)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = child({"peer": "torch", "net": "cifar8", "batch": 2, "image_size": 32, "repeats": 1, "threads": 1}, env)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip())
    assert row["peer"] == "torch" and "torch is not installed" in row["skipped"]
    assert set(row) == {"peer", "skipped"}


def test_child_rejects_a_bad_spec():
    out = child({"peer": "jax-nchw", "net": "cifar8", "batch": 2})
    assert out.returncode == 2 and "image_size" in out.stderr
