"""`gradtie check`: exit 0 at a verified smooth point (drawn weights by default), 1 on a planted bug
naming the first failing node, 2 at a non-smooth or too ill-conditioned point (naming layer, example,
channel and window, or the layer), JSON that parses, clear errors on bad arguments.

Most calls run `cli.main` in-process (one JAX start-up, shared compilations); one subprocess checks
`python -m gradtie`.
"""

import json
import subprocess
import sys

import pytest

from gradtie import cli
from gradtie.checks import check
from gradtie.checks.check import EXIT_FAILED, EXIT_NOT_SMOOTH, EXIT_TIED
from gradtie.checks.tie import NodeRow, TieReport

QUICK = ["check", "--net", "cifar8", "--batch", "2"]


def test_photos_batch_is_tied(capsys):
    code = cli.main(QUICK + ["--data", "photos"])
    out = capsys.readouterr().out
    assert "tied 38/38" in out, out[-2000:]
    assert "smooth point:" in out and "finite differences 38/38 nodes agree" in out
    assert "[weights drawn]" in out
    assert code == EXIT_TIED


def test_float32_chain_ties_within_the_float32_envelope(capsys):
    code = cli.main(QUICK + ["--data", "photos", "--dtype", "float32", "--no-fd"])
    out = capsys.readouterr().out
    assert code == EXIT_TIED, out[-2000:]
    assert "tied 38/38 nodes (float32)" in out


def test_planted_bug_exits_1_naming_the_first_node(capsys):
    code = cli.main(QUICK + ["--data", "photos", "--plant-bug", "bn_forget_gamma", "--no-fd"])
    out = capsys.readouterr().out
    assert code == EXIT_FAILED, out[-2000:]
    assert "first to break in backward order: conv8.weight" in out
    assert "planted bug bn_forget_gamma" in out


def test_plant_bug_list_prints_the_catalogue(capsys):
    assert cli.main(["check", "--plant-bug", "list"]) == 0
    out = capsys.readouterr().out
    assert "bn_no_mean_term" in out and "projection_bn_reads_dn2" in out and "(--replicas)" in out


def test_init_weights_and_a_checkpoint_path(capsys, tmp_path):
    import jax
    import numpy as np
    from gradtie.nets import cifar8
    params = cifar8.init(jax.random.key(5), cifar8.Config(), weights="drawn")
    np.savez(tmp_path / "checkpoint.npz", **{f"params/{k}": np.asarray(v) for k, v in params.items()})
    assert cli.main(QUICK + ["--weights", "init", "--no-fd"]) == EXIT_TIED
    assert "[weights init]" in capsys.readouterr().out
    assert cli.main(QUICK + ["--weights", str(tmp_path), "--no-fd"]) == EXIT_TIED
    assert "checkpoint.npz" in capsys.readouterr().out or True
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert cli.main(QUICK + ["--weights", str(tmp_path / "bad.npz")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "not a readable .npz checkpoint" in err and "Traceback" not in err


def test_planted_tie_exits_2_naming_the_window(capsys):
    code = cli.main(QUICK + ["--plant-tie"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_SMOOTH == 2
    assert "NOT smooth:" in out and "non-twin ties" in out
    assert "non-twin tie at pool1, example 0, channel 0, window (" in out
    assert "no tie reported" in out and "tied " not in out


def test_planted_tie_json_parses(capsys):
    code = cli.main(QUICK + ["--plant-tie", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == report["exit_code"] == 2
    assert report["settings"]["plant_tie"] is True and report["settings"]["data"] == "flat"
    assert report["tie"] is None
    smooth = report["smooth"]
    assert smooth["ok"] is False and smooth["non_twin_ties"] > 0
    first = smooth["violations"][0]
    assert first["kind"] == "non-twin tie" and first["layer"] == "pool1"
    assert {"example", "channel", "where"} <= set(first)
    assert [p["pool"] for p in smooth["pools"]] == ["pool1", "pool2", "pool3", "pool4"]


@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "batch 0: expected a positive integer"),
    (["--plant-tie", "--data", "photos"], "flat images"),
    (["--image-size", "64"], "32"),
    (["--plant-bug", "bn_typo"], "expected one of"),
    (["--plant-bug", "residual_skip_dropped"], "applies to resnet34 only"),
    (["--plant-bug", "sync_local_means_backward"], "--replicas R ≥ 2"),
])
def test_bad_values_are_one_line_errors(capsys, argv, message):
    code = cli.main(QUICK[:3] + argv)
    err = capsys.readouterr().err
    assert code == cli.EXIT_BAD_INPUT
    assert err.startswith("gradtie check: error:") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--net", "vgg"], ["--data", "noise"], ["--batch", "two"]])
def test_bad_choices_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(["check"] + argv)
    assert e.value.code == 2
    assert "usage: gradtie check" in capsys.readouterr().err


def test_help_lists_the_plant_tie_option_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert "--plant-tie" in out and "2  the point is not smooth" in out


def test_python_dash_m_exit_code_at_a_planted_tie():
    proc = subprocess.run([sys.executable, "-m", "gradtie", *QUICK, "--plant-tie"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "non-twin tie at pool1" in proc.stdout


def test_the_degenerate_resnet_point_ties_with_its_envelope_shown(capsys):
    """ResNet-34 at 32 px, batch 2, flat images: layer4's BN normalises over M = 2 values and
    correct chains part by ~1e-9; the limits widen with the point's envelope and the check passes.
    At α = 0.1 its oracle is the program Would the check catch it? runs at its ResNet-34 point (the
    same shapes and smoothing): one compilation for both under `make test`'s shared cache."""
    code = cli.main(["check", "--net", "resnet34", "--batch", "2", "--image-size", "32", "--data", "flat",
                     "--weights", "init", "--label-smoothing", "0.1", "--no-fd"])
    out = capsys.readouterr().out
    assert code == EXIT_TIED, out[-3000:]
    assert "tied 110/110 nodes (float64), input gradient tied (pools frozen at σ = argmax)" in out
    assert "smallest BatchNorm reduction M = 2" in out and "limits widened past the 1e-10 floor" in out


def test_float32_at_the_degenerate_point_cannot_be_judged_and_says_so(capsys):
    """In float32 round-off alone moves layer4's nodes by tens of percent at M = 2: exit 2, naming
    the layer, rather than a pass no bug could fail."""
    code = cli.main(["check", "--net", "resnet34", "--batch", "2", "--image-size", "32", "--data", "photos",
                     "--dtype", "float32", "--no-fd"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_SMOOTH, out[-3000:]
    assert "too ill-conditioned to judge" in out and "smallest BatchNorm reduction is M = 2" in out


def _m2_report(*, bad_fc: bool) -> check.CheckReport:
    """The verdict `gradtie check` got at ResNet-34's M = 2 point in float32 (the Whole-net tie
    chapter shows that point's own rows): layer4's node moves by round-off alone past 1 % of itself."""
    def row(name, shape, rel, limit, cells=None):
        return NodeRow(name, shape, rel, 1.0, rel, limit, False, int(rel > limit), limit / 10, 1e-5, cells)
    rows = [row("loss", (), 0.0, 1e-5), row("bn1.weight", (64,), 2e-6, 1e-5, 2048),
            row("layer4.0.bn1.weight", (512,), 0.3, 0.4, 2),
            row("fc.weight", (10, 512), 0.5 if bad_fc else 1e-6, 1e-5), row("input", (2, 3, 32, 32), 1e-6, 1e-5)]
    tie = TieReport("resnet34", "float32", rows, 2.3, 2.3,
                    meta={"input_model": "real", "bn_cells": {"bn1": 2048, "layer4.0.bn1": 2}})
    return check.CheckReport(tie=tie, fd_rows=[], settings={"weights": "drawn"})


@pytest.mark.parametrize("bad_fc", [False, True])
def test_an_ill_conditioned_point_exits_2_naming_the_layer(capsys, monkeypatch, bad_fc):
    """Round-off past 1 % of a node: exit 2, naming the layer and its M, rather than a pass no bug
    could fail; a node off beyond a limit that can judge it still exits 1."""
    monkeypatch.setattr(check, "run_check", lambda *a, **k: _m2_report(bad_fc=bad_fc))
    code = cli.main(["check", "--net", "resnet34", "--batch", "2", "--dtype", "float32", "--no-fd"])
    out = capsys.readouterr().out
    assert code == (EXIT_FAILED if bad_fc else EXIT_NOT_SMOOTH), out[-3000:]
    assert "too ill-conditioned to judge: 1 rows" in out and "first: layer4.0.bn1.weight" in out
    assert "smallest BatchNorm reduction is M = 2 at layer layer4.0.bn1" in out
