"""The command line: help texts, train and bench end to end at tiny sizes, clear argument errors."""

import json
import subprocess
import sys

import pytest

from gradtie import cli


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "gradtie", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("check", "bench", "train", "book"):
        assert command in out


def test_check_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    out = capsys.readouterr().out
    assert "exit codes" in out and "not smooth" in out


def test_unknown_net_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--net", "vgg"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_train_writes_checkpoint_and_metrics(tmp_path):
    out = tmp_path / "run"
    r = run("train", "--net", "cifar8", "--data", "digits", "--optimizer", "sgd", "--epochs", "1",
            "--batch", "32", "--head-width", "16", "--n-train", "64", "--n-test", "32", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained cifar8 with sgd" in r.stdout
    assert (out / "checkpoint.npz").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics


def test_train_missing_cifar_folder_is_a_clear_error(tmp_path):
    r = run("train", "--net", "cifar8", "--data", f"cifar10:{tmp_path / 'nope'}", "--out", str(tmp_path / "o"))
    assert r.returncode == cli.EXIT_BAD_INPUT
    assert "gradtie train: error:" in r.stderr and "nope" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_reports_both_sides_and_the_ratio():
    r = run("bench", "--net", "cifar8", "--batch", "4", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)
    assert row["rendered_ms"] > 0 and row["autodiff_ms"] > 0
    assert row["ratio"] == pytest.approx(row["rendered_ms"] / row["autodiff_ms"])
