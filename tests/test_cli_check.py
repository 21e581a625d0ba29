"""`gradtie check`: exit 0 at a verified smooth point (drawn weights by default), 1 on a planted bug
naming the first failing node, 2 at a non-smooth or too ill-conditioned point (naming layer,
example, channel and window, or the layer), 3 for input it refuses; JSON that parses; and the same
for a net of your own (`--net examples/bottleneck.py:NET`).

Each exit code means one thing (issue 26, item 5): 1 when any tie row, judgeable or not, is over
its limit or a finite difference FAILED; else 2 when the point cannot be judged; else 0. A finite
difference with no evidence never changes it.

Most calls run `cli.main` in-process (one JAX start-up, shared compilations); the net of your own,
`--replicas` and one planted tie run `python -m gradtie` in a subprocess from the repository root.
"""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradtie import cli, nets
from gradtie.checks import bugs, check
from gradtie.checks.check import EXIT_FAILED, EXIT_NOT_SMOOTH, EXIT_TIED
from gradtie.checks.fd import FDRow
from gradtie.host import process_seconds
from gradtie.checks.tie import NodeRow, TieReport, degenerate
from gradtie.nets import protocol

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["check", "--net", "cifar8", "--batch", "2"]
BOTTLENECK = ["check", "--net", "examples/bottleneck.py:NET", "--batch", "2"]


def gradtie(*args, timeout=600):
    """`python -m gradtie …` from the repository root: (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "gradtie", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


# ---- cifar8, in-process ------------------------------------------------------------------------

def test_photos_batch_is_tied(capsys):
    code = cli.main(QUICK + ["--data", "photos"])
    out = capsys.readouterr().out
    assert "tied 38/38" in out, out[-2000:]
    agree = re.search(r"finite differences (\d+)/(\d+) nodes agree", out)
    assert "smooth point:" in out and agree and agree[1] == agree[2] and int(agree[1]) >= 38
    assert "[weights drawn]" in out and "exit 0: tied" in out
    assert code == EXIT_TIED


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_each_phase_in_a_terminal_only(capsys, monkeypatch):
    # a terminal's stderr sees the phase bar and the finite differences' bar over the nodes
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(QUICK + ["--data", "photos"]) == EXIT_TIED
    shown = terminal.getvalue()
    for phase in ("census", "reference + envelope", "tie", "finite differences"):
        assert phase in shown, shown[-2000:]
    # tqdm redraws at most every 0.1 s, so the inner bar may be cleared before it draws 39/39
    assert re.search(r"finite differences: +\d+%.* \d+/39 ", shown), shown[-2000:]
    # stderr that is not a terminal (a notebook, a pipe) sees nothing
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert cli.main(QUICK + ["--data", "photos", "--no-fd"]) == EXIT_TIED
    assert sys.stderr.getvalue() == ""


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
    assert "planted bug bn_forget_gamma" in out and "exit 1: a row failed" in out


def test_plant_bug_list_prints_the_catalogue(capsys):
    assert cli.main(["check", "--plant-bug", "list"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.strip().splitlines()[1:]]
    assert listed == [b.name for b in bugs.entries(nets.load("cifar8"))]
    assert "bn_no_mean_term" in listed and "dense_bias_grad_keepdims" in listed
    assert "projection_bn_reads_dn2" not in listed                  # cifar8 has no projection
    assert "--replicas" in out and "--replica-counts" in out


def test_init_weights_and_a_checkpoint_path(capsys, tmp_path):
    import jax
    import numpy as np
    from gradtie.nets import cifar8
    params = cifar8.NET.init(jax.random.key(5), cifar8.Config(), weights="drawn")
    np.savez(tmp_path / "checkpoint.npz", **{f"params/{k}": np.asarray(v) for k, v in params.items()})
    assert cli.main(QUICK + ["--weights", "init", "--no-fd"]) == EXIT_TIED
    assert "[weights init]" in capsys.readouterr().out
    assert cli.main(QUICK + ["--weights", str(tmp_path), "--no-fd"]) == EXIT_TIED
    assert f"[weights {tmp_path}]" in capsys.readouterr().out       # the folder it was given
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
    (["--plant-tie", "--data", "photos"], "flat images"),
    (["--image-size", "64"], "32"),
    (["--plant-bug", "bn_typo"], "expected one of"),
    (["--plant-bug", "residual_skip_dropped"], "plants nothing in cifar8"),
    (["--plant-bug", "sync_local_means_backward"], "--replicas R ≥ 2"),
    (["--net", "vgg"], "expected cifar8, resnet34, path/to/file.py:NAME or package.module:NAME"),
    (["--net", "examples/nothing_here.py:NET"], "no such file"),
    (["--net", "examples/bottleneck.py:NOPE"], "defines no NOPE"),
    (["--net", "gradtie.nets.cifar8:Config"], "not a gradtie.nets.protocol.Net"),
])
def test_bad_values_are_one_line_errors(capsys, argv, message, monkeypatch):
    monkeypatch.chdir(ROOT)     # the example's path is relative to the repository root
    code = cli.main((["check"] if argv[0] == "--net" else QUICK[:3]) + argv)
    err = capsys.readouterr().err
    assert code == cli.EXIT_BAD_INPUT
    assert err.startswith("gradtie check: error:") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, option", [(["--data", "noise"], "--data"), (["--batch", "two"], "--batch"),
                                           (["--batch", "0"], "--batch"), (["--dtype", "float16"], "--dtype")])
def test_bad_choices_are_usage_errors(capsys, argv, option):
    # usage errors are invalid input (exit 3), one line naming the option; exit 2 means "not smooth"
    with pytest.raises(SystemExit) as e:
        cli.main(["check"] + argv)
    err = capsys.readouterr().err
    assert e.value.code == cli.EXIT_BAD_INPUT == 3
    assert err.startswith("gradtie check: error: argument " + option) and len(err.strip().splitlines()) == 1


def test_help_lists_the_plant_tie_option_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert "--plant-tie" in out and "2  the point is not smooth" in out and "3  invalid input" in out
    assert "examples/bottleneck.py:NET" in out


def test_python_dash_m_exit_code_at_a_planted_tie():
    code, out, err = gradtie(*QUICK, "--plant-tie")
    assert code == 2, err[-2000:]
    assert "non-twin tie at pool1" in out


# ---- bf16 runs the chain it is given, or refuses (issue 26, item 1) ---------------------------------------

def test_bf16_runs_the_planted_bug(capsys):
    """`--bf16 --plant-bug bn_forget_gamma` used to exit 0 without running the bug."""
    code = cli.main(QUICK + ["--data", "photos", "--bf16", "--plant-bug", "bn_forget_gamma", "--no-fd"])
    out = capsys.readouterr().out
    assert code == EXIT_FAILED, out[-3000:]
    assert "bn_forget_gamma" in out


def test_bf16_with_replicas_is_refused_with_exit_3():
    code, out, err = gradtie(*QUICK, "--bf16", "--replicas", "2", "--plant-bug", "sync_local_means_backward",
                             "--no-fd")
    assert code == cli.EXIT_BAD_INPUT, (out[-2000:], err[-2000:])
    assert err.startswith("gradtie check: error:") and "bf16" in err and "replicas" in err
    assert "Traceback" not in err


# ---- what each exit code means (issue 26, item 5) ------------------------------------------------------------

def _row(name, shape, rel, limit, cells=None):
    return NodeRow(name, shape, rel, 1.0, rel, limit, False, int(rel > limit), limit / 10, 1e-5, cells)


def _m2_report(*, ill_rel: float = 0.3, ill_limit: float = 0.4, fc_rel: float = 1e-6, fd_rows=()) -> check.CheckReport:
    """The verdict `gradtie check` got at ResNet-34's M = 2 point in float32 (the Whole-net tie
    chapter shows that point's own rows): layer4's node moves by round-off alone past 1 % of itself,
    its limit 0.4 (ill_limit 1e-5: a point where it is judgeable)."""
    rows = [_row("loss", (), 0.0, 1e-5), _row("bn1.weight", (64,), 2e-6, 1e-5, 2048),
            _row("layer4.0.bn1.weight", (512,), ill_rel, ill_limit, 2),
            _row("fc.weight", (10, 512), fc_rel, 1e-5), _row("input", (2, 3, 32, 32), 1e-6, 1e-5)]
    tie = TieReport("resnet34", "float32", rows, 2.3, 2.3,
                    meta={"input_model": "real", "bn_cells": {"bn1": 2048, "layer4.0.bn1": 2}})
    return check.CheckReport(tie=tie, fd_rows=list(fd_rows), settings={"weights": "drawn"})


def test_an_ill_conditioned_point_exits_2_naming_the_layer():
    """Round-off past 1 % of a node, every row within its limit: exit 2, naming the layer and its M,
    rather than a pass no bug could fail."""
    rep = _m2_report()
    assert rep.exit_code == EXIT_NOT_SMOOTH and not rep.failed
    s = rep.summary()
    assert "too ill-conditioned to judge: 1 rows" in s and "first: layer4.0.bn1.weight" in s
    assert "smallest BatchNorm reduction is M = 2 at layer layer4.0.bn1" in s
    assert s.endswith("exit 2: the point cannot be judged")


@pytest.mark.parametrize("ill_rel, fc_rel", [(20.0, 1e-6), (0.3, 0.5)], ids=["ill-row-over", "judgeable-row-over"])
def test_a_row_over_its_limit_exits_1_even_where_the_point_is_ill_conditioned(ill_rel, fc_rel):
    """An ill-conditioned row at 50× its limit is a failure, not "cannot be judged": the summary's
    "first to break" and the exit code say the same thing."""
    rep = _m2_report(ill_rel=ill_rel, fc_rel=fc_rel)
    assert rep.exit_code == EXIT_FAILED
    first = "layer4.0.bn1.weight" if ill_rel > 0.4 else "fc.weight"
    assert f"first to break in backward order: {first}" in rep.summary()
    assert rep.summary().endswith("exit 1: a row failed")


def _fd(name, verdict):
    rel, limit, kinked = {"ok": (1e-9, 1e-6, False), "FAILED": (0.5, 1e-6, False),
                          "no evidence": (0.5, 0.5, False), "kink": (0.5, 1e-6, True)}[verdict]
    return FDRow(name, 1.0, 1.0, rel, limit, kinked=kinked)


def test_a_finite_difference_that_failed_exits_1():
    rep = _m2_report(ill_rel=1e-6, ill_limit=1e-5, fd_rows=[_fd("fc.weight", "ok"), _fd("bn1.weight", "FAILED")])
    assert not rep.tie.failed and not rep.ill_conditioned and rep.exit_code == EXIT_FAILED
    assert _m2_report(ill_rel=1e-6, ill_limit=1e-5).exit_code == EXIT_TIED      # the same tie without it
    assert "1 FAILED (first in backward order: bn1.weight)" in rep.summary()


def test_the_first_failing_difference_is_the_first_the_backward_computes():
    """The rows run in signature order with the input last; the backward computes the head first
    and the input cotangent last, so a failing input row is named only when nothing above it fails."""
    rows = [_fd("conv1.weight", "FAILED"), _fd("fc.weight", "ok"), _fd("input", "FAILED")]
    rep = _m2_report(ill_rel=1e-6, ill_limit=1e-5, fd_rows=rows)
    assert "2 FAILED (first in backward order: conv1.weight)" in rep.summary()
    rows[1] = _fd("fc.weight", "FAILED")
    assert "(first in backward order: fc.weight)" in _m2_report(ill_rel=1e-6, ill_limit=1e-5, fd_rows=rows).summary()
    only_input = [_fd("conv1.weight", "ok"), _fd("input", "FAILED")]
    assert "(first in backward order: input)" in _m2_report(ill_rel=1e-6, ill_limit=1e-5,
                                                            fd_rows=only_input).summary()


def test_timings_account_for_the_whole_process():
    """`--timings` once summed the phases alone (2.5 s for a process of 10.4 s): the time before the
    check (Python, the imports, the point) is a row of its own and the total is the process's."""
    rep = _m2_report(ill_rel=1e-6, ill_limit=1e-5)
    rep.timings.update({"census": 1.0, "tie": 1.5, "compilation": 2.0})
    table = rep.timing_table(10.4)
    assert "start, imports, the point" in table and " 7.9" in table
    assert table.splitlines()[-1].split()[-1] == "10.4" and "whole process" in table.splitlines()[-1]
    assert rep.timing_table().splitlines()[-1].split()[-1] == "2.5"          # no process figure: the phases
    seconds = process_seconds()
    assert seconds is not None and 0 < seconds < 24 * 3600


@pytest.mark.parametrize("ill_limit, code", [(1e-5, EXIT_TIED), (0.4, EXIT_NOT_SMOOTH)], ids=["tied", "ill"])
def test_no_evidence_never_changes_the_exit_code(ill_limit, code):
    fd = [_fd("fc.weight", "ok"), _fd("bn1.weight", "no evidence"), _fd("layer4.0.bn1.weight", "kink")]
    assert [r.verdict for r in fd] == ["ok", "no evidence", "no evidence"]
    bare, with_fd = _m2_report(ill_rel=1e-6, ill_limit=ill_limit), _m2_report(ill_rel=1e-6, ill_limit=ill_limit, fd_rows=fd)
    assert with_fd.exit_code == bare.exit_code == code
    s = with_fd.summary()
    assert "1 no evidence (round-off too large)" in s and "1 no evidence (a kink within the smallest step)" in s


# ---- ResNet-34 at its degenerate point (slow: the Whole-net tie chapter shows it) ---------------------------

@pytest.mark.slow
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


@pytest.mark.slow
def test_float32_at_the_degenerate_point_cannot_be_judged_and_says_so(capsys):
    """In float32 round-off alone moves layer4's nodes by tens of percent at M = 2: exit 2, naming
    the layer, rather than a pass no bug could fail."""
    code = cli.main(["check", "--net", "resnet34", "--batch", "2", "--image-size", "32", "--data", "photos",
                     "--dtype", "float32", "--no-fd"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_SMOOTH, out[-3000:]
    assert "too ill-conditioned to judge" in out and "smallest BatchNorm reduction is M = 2" in out


def test_resnet_at_n1_and_32px_is_degenerate_exit_2_naming_the_layer(capsys):
    """At 32 px layer4's maps are 1×1: at N = 1 its BatchNorm averages M = 1 value, x̂ = 0, and every
    node upstream is 0 in ℝ. Reported as degenerate (exit 2, the layer and M named), never tied; and
    a size other than the statement's literal 224 px says so, in the text and in the JSON."""
    code = cli.main(["check", "--net", "resnet34", "--batch", "1", "--image-size", "32"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_SMOOTH, out[-3000:]
    assert "degenerate point: BatchNorm layer4.0.bn1 normalises M = 1 value per channel" in out
    assert "tied" not in out.replace("not judged", "")
    assert "resnet34 at 32 px: the same architecture beyond the statement's literal 224-px resolution" in out
    code = cli.main(["check", "--net", "resnet34", "--batch", "1", "--image-size", "32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == report["exit_code"] == EXIT_NOT_SMOOTH and report["tie"] is None
    assert report["degenerate"] == {"bn_layer": "layer4.0.bn1", "cells": 1}
    assert "beyond the statement's literal 224-px" in report["settings"]["beyond_literal_resolution"]


def test_the_resolution_label_is_empty_only_at_the_literal_resolution():
    assert protocol.resolution_note(nets.load("resnet34"), 224) == ""
    assert "beyond the statement's literal 224-px resolution" in protocol.resolution_note(nets.load("resnet34"), 64)
    assert protocol.resolution_note(nets.load("cifar8"), 32) == ""


def test_a_bn_layer_with_one_cell_anywhere_is_degenerate():
    """Generalised: any BatchNorm layer with M = 1, the first in forward order named; M = 2 is not."""
    assert degenerate({"bn1": 2048, "layer4.0.bn1": 1, "layer4.0.bn2": 1}) == ("layer4.0.bn1", 1)
    assert degenerate({"bn1": 2048, "layer4.0.bn1": 2}) is None
    rows = [NodeRow("loss", (), 0.0, 1.0, 0.0, 1e-10, False)]
    flat = TieReport("net", "float64", rows, 0.0, 0.0, {"bn_cells": {"stage1.bn": 1}})
    assert flat.ok and not flat.tied and flat.summary().startswith("degenerate point: BatchNorm stage1.bn")
    assert TieReport("net", "float64", rows, 0.0, 0.0, {"bn_cells": {"stage1.bn": 3}}).tied


# ---- a net of your own: examples/bottleneck.py, from the repository root -------------------------------------

def test_a_net_of_your_own_is_checked_and_ties():
    """Census, tie and finite differences of the bottleneck net (built from the public protocol, with
    a depthwise conv the kit lacks): exit 0."""
    code, out, err = gradtie(*BOTTLENECK)
    assert code == EXIT_TIED, (out[-3000:], err[-2000:])
    net = nets.load(str(ROOT / "examples" / "bottleneck.py") + ":NET")
    nodes = len(net.param_specs(net.config()))
    assert nodes == 32
    agree = re.search(r"finite differences (\d+)/(\d+) nodes agree", out)
    assert f"tied {nodes}/{nodes} nodes (float64)" in out and agree and agree[1] == agree[2] and int(agree[1]) >= nodes
    assert "hypotheses: parameter gradients hold" in out and "cifar8" not in out


@pytest.mark.parametrize("bug, first", [("projection_bn_reads_dn2", "layer2.0.downsample.0.weight"),
                                        ("depthwise_kernel_not_flipped", "bn1.bias")],
                         ids=["catalogue-entry", "own-op"])
def test_a_net_of_your_own_goes_red_on_a_planted_bug(bug, first):
    """A catalogue entry planted in the net's kit ops, and the net's own entry planted in its own op
    (the depthwise backward with its kernel unflipped): exit 1, naming the first failing node."""
    code, out, err = gradtie(*BOTTLENECK, "--plant-bug", bug, "--no-fd")
    assert code == EXIT_FAILED, (out[-3000:], err[-2000:])
    assert f"planted bug {bug}" in out and f"first to break in backward order: {first}" in out


def test_a_net_of_your_own_at_a_planted_tie_exits_2():
    code, out, err = gradtie(*BOTTLENECK, "--plant-tie", "--no-fd")
    assert code == EXIT_NOT_SMOOTH, (out[-3000:], err[-2000:])
    assert "non-twin tie at stem.pool" in out and "no tie reported" in out


def test_plant_bug_list_shows_exactly_the_entries_that_apply_to_a_net_of_your_own():
    code, out, err = gradtie("check", "--net", "examples/bottleneck.py:NET", "--plant-bug", "list")
    assert code == 0, err[-2000:]
    listed = [line.split()[0] for line in out.strip().splitlines()[1:]]
    net = nets.load(str(ROOT / "examples" / "bottleneck.py") + ":NET")
    assert listed == [b.name for b in bugs.entries(net)]
    assert {"projection_bn_reads_dn2", "residual_skip_dropped", "depthwise_kernel_not_flipped",
            "same_padding_strided"} <= set(listed)
    # cifar8's own: its ReLU masks read off its saved records, its square dense layer
    assert {"relu_mask_from_conv_output", "dense_weight_grad_transposed", "pool3x3_scatter_overwrite",
            "pool2x2_backward_on_3x3"}.isdisjoint(listed)


def test_a_batch_too_large_is_refused_before_anything_is_allocated(monkeypatch):
    """The memory estimate (abstract shapes only) refuses the point before an image exists or a
    program compiles: with the machine's memory said to be 1 GiB and the image batch a trap, a
    batch of 4,096 is refused by its estimate and the trap never springs."""
    from gradtie import data, nets
    from gradtie.checks import check as check_mod

    def trap(*args, **kwargs):
        raise AssertionError("the batch was built")
    monkeypatch.setattr(check_mod, "available_memory", lambda: 2 ** 30)
    monkeypatch.setattr(data, "images", trap)
    need = check_mod.memory_estimate(nets.load("cifar8"), 4096, 32)
    assert need > 2 ** 30
    with pytest.raises(ValueError, match=r"needs about .* GiB, this machine has 1\.0 GiB available"):
        check_mod.run_check("cifar8", batch=4096)
    assert check_mod.memory_estimate(nets.load("cifar8"), 4, 32) < 2 ** 30   # a small batch fits
