"""`gradtie check`: exit 0 at a verified smooth point, 2 at a non-smooth one (naming layer, example,
channel and window), JSON that parses, clear errors on bad arguments.

Most calls run `cli.main` in-process (one JAX start-up, shared compilations); one subprocess checks
`python -m gradtie`.
"""

import json
import subprocess
import sys

import pytest

from gradtie import cli
from gradtie.checks.check import EXIT_NOT_SMOOTH, EXIT_TIED

QUICK = ["check", "--net", "cifar8", "--batch", "2"]


def test_photos_batch_is_tied(capsys):
    code = cli.main(QUICK + ["--data", "photos"])
    out = capsys.readouterr().out
    assert "tied 38/38" in out, out[-2000:]
    assert "smooth point:" in out and "finite differences 38/38" in out
    assert code == EXIT_TIED


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


def test_input_gradient_is_left_out_of_the_verdict_only_at_twin_ties():
    """At a twin tie the loss is differentiable in the parameters but not in the image (moving a pixel
    breaks the twins; autodiff's max splits the tie evenly), so the input row cannot fail the check."""
    import numpy as np

    from gradtie.checks.census import PoolCensus, SmoothReport
    from gradtie.checks.check import EXIT_FAILED, CheckReport
    from gradtie.checks.tie import NodeRow, TieReport

    rows = [NodeRow("fc3.bias", (10,), 0.0, 1.0, 0.0, 1e-10, False),
            NodeRow("input", (2, 3, 32, 32), 0.4, 1.0, 0.4, 1e-10, False)]
    tie_report = TieReport("cifar8", "float64", rows, 2.3, 2.3)
    twin = SmoothReport([PoolCensus("pool1", "bn2", np.array([[[[2, 1]]]]), 1e-3, 1e-3)], 0, 1e-3)
    strict = SmoothReport([PoolCensus("pool1", "bn2", np.array([[[[1, 1]]]]), 1e-3, 1e-3)], 0, 1e-3)
    at_twins = CheckReport(tie_report, [], twin)
    assert at_twins.exit_code == EXIT_TIED and not at_twins.input_defined
    assert "input gradient not defined at twin ties" in at_twins.summary()
    assert at_twins.as_dict()["input_gradient_defined"] is False
    assert CheckReport(tie_report, [], strict).exit_code == EXIT_FAILED
