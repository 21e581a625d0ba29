"""The peer benchmark's arithmetic and verdict, on rows built by hand (no timing in tests), and its
child processes on tiny inputs: the matrix product's rate, one gradtie side's record, a peer's check."""

import json
import subprocess
import sys

import pytest

from gradtie import peer_bench
from gradtie.peer_bench import PeerConfig, PeerRow, SideResult


def row(rendered=(10.0, 11.0, 12.0), torch=(20.0, 21.0, 22.0), nchw=(30.0, 30.0, 30.0),
        nhwc=(25.0, 26.0, 24.0), net="cifar8", batch=32, size=32, torch_skipped=""):
    def side(name, ms):
        return SideResult(name, sorted(ms)[len(ms) // 2], list(ms), 500.0)
    sides = {"rendered": side("rendered", rendered), "autodiff": side("autodiff", (15.0, 15.0, 15.0)),
             "jax-nchw": side("jax-nchw", nchw), "jax-nhwc": side("jax-nhwc", nhwc),
             "torch": SideResult("torch", None, skipped=torch_skipped) if torch_skipped else side("torch", torch)}
    return PeerRow(PeerConfig(net, batch, size), sides, model_gflop=2.0, matmul_gflops=200.0)


def test_ratio_is_the_median_of_same_round_ratios():
    r = row(rendered=(10.0, 30.0, 12.0), torch=(20.0, 20.0, 10.0))
    # per round 0.5, 1.5, 1.2 -> median 1.2 (not 12 / 20 from the medians)
    assert r.ratio("torch") == pytest.approx(1.2)


def test_plain_jax_is_the_faster_layout_and_the_limit_fraction():
    r = row()
    assert r.plain_jax() == "jax-nhwc"
    assert r.limit_fraction() == pytest.approx(2.0 / 0.011 / 200.0)


def test_verdict_passes_ahead_and_fails_behind_and_names_a_peer_not_run():
    assert peer_bench.verdict([row()]) == []
    behind = peer_bench.verdict([row(rendered=(20.0, 21.0, 22.0))])
    assert behind == ["cifar8 batch 32 32px: rendered / PyTorch eager = 1.00 > 0.95"]
    assert peer_bench.verdict([row(torch_skipped="torch is not installed")]) == [
        "cifar8 batch 32 32px: PyTorch eager not run"]


def test_round_trip_and_table_say_not_run():
    r = row(torch_skipped="torch is not installed")
    again = PeerRow.from_dict(json.loads(json.dumps(r.as_dict())))
    assert again.ratio("jax-nhwc") == r.ratio("jax-nhwc") and again.sides["torch"].skipped
    text = peer_bench.table([again])
    assert "not run" in text and "(NHWC)" in text


def test_suite_holds_every_configuration_the_goal_names():
    have = {(c.net, c.batch, c.image_size) for c in peer_bench.PEER_SUITE}
    assert {("cifar8", b, 32) for b in (32, 64, 128)} <= have
    assert {("resnet34", 8, 64), ("resnet34", 32, 64), ("resnet34", 8, 224)} <= have


def test_bad_side_and_rounds_are_refused():
    with pytest.raises(ValueError, match="side must be one of"):
        peer_bench.measure_side("tensorflow", PeerConfig())
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        peer_bench.run([PeerConfig()], rounds=0)


def _child(spec):
    out = subprocess.run([sys.executable, "-m", "gradtie.peer_bench", json.dumps(spec)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_children_report_a_rate_a_side_and_a_check():
    mm = _child({"matmul": 64})
    assert mm["gflops"] > 0 and len(mm["times_ms"]) == 10
    side = _child({"side": "rendered", "net": "cifar8", "batch": 2, "image_size": 32, "repeats": 2})
    assert len(side["times_ms"]) == 2 and side["peak_rss_mib"] > 0 and side["temp_mib"] is not None
    check = _child({"check": "jax-nhwc", "net": "cifar8"})
    assert check["ok"] and "agrees with the oracle" in check["describe"]


def test_scaled_controls_turn_the_verdict_red_and_green():
    rows = [row(), row(rendered=(19.0, 20.0, 21.0))]
    # twice as slow: behind PyTorch at both rows, and behind plain JAX at the second (40 ms against 25)
    assert len(peer_bench.verdict(peer_bench.scaled(rows, {"rendered": 2.0}))) == 3
    assert peer_bench.verdict(peer_bench.scaled(rows, {"torch": 2.0, "jax-nchw": 2.0, "jax-nhwc": 2.0})) == []
    assert rows[0].ms("rendered") == 11.0   # the originals are untouched
