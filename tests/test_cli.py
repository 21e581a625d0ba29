"""The command line: help texts, train and bench end to end at tiny sizes, clear argument errors."""

import json
import re
import subprocess
import sys

import numpy as np
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
    """`check --net` takes a net of your own too (FILE.py:NAME, MODULE:NAME), so an unknown name is
    a one-line error (exit 3) saying what is expected; `train --net` takes the book's two only."""
    assert cli.main(["check", "--net", "vgg"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("gradtie check: error: net 'vgg': expected cifar8, resnet34, path/to/file.py:NAME")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--net", "vgg", "--out", "nowhere"])
    assert e.value.code == cli.EXIT_BAD_INPUT      # a usage error is invalid input, never check's 2
    err = capsys.readouterr().err
    assert "invalid choice: 'vgg'" in err and len(err.strip().splitlines()) == 1


BAD_INPUTS = [
    (["check", "--image-size", "0"], "--image-size"),
    (["check", "--image-size", "48"], "image-size 48"),
    (["check", "--label-smoothing", "2"], "label-smoothing 2.0"),
    (["check", "--label-smoothing", "-0.5"], "label-smoothing -0.5"),
    (["check", "--seed", "-1"], "--seed"),
    (["check", "--batch", "0"], "--batch"),
    (["check", "--batch", "100000"], "GiB available"),
    (["check", "--dtype", "float16"], "--dtype"),
    (["check", "--net", "nofile.py:NET"], "no such file"),
    (["check", "--bf16", "--replicas", "2"], "bf16 and replicas"),
    (["check", "--plant-bug", "nope"], "plant-bug 'nope'"),
    (["check", "--weights", "/nonexistent/ckpt"], "no such checkpoint"),
    (["bench", "--batch", "0"], "--batch"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--net", "vgg"], "--net"),
    (["train", "--seed", "-1", "--out", "x"], "--seed"),
    (["train", "--optimizer", "lbfgs", "--out", "x"], "--optimizer"),
    (["book", "--profile", "tpu"], "--profile"),
    (["nosuch"], "invalid choice"),
]


@pytest.mark.parametrize("argv, says", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_every_bad_input_is_one_line_and_exit_3(argv, says):
    """Each subcommand refuses bad input with one line naming what is wrong and exit 3, never a
    traceback; nothing is computed or allocated first (the batch of 100,000 is refused by its
    memory estimate before any image exists)."""
    out = run(*argv)
    err = out.stderr.strip()
    assert out.returncode == cli.EXIT_BAD_INPUT, (out.returncode, err)
    assert says in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_a_non_empty_folder_without_a_run_is_refused_unless_forced(tmp_path, capsys):
    keep = tmp_path / "run" / "checkpoint.npz"
    keep.parent.mkdir()
    keep.write_bytes(b"someone's file")
    code, _, err = train_main(capsys, *TINY_TRAIN, "--epochs", "1", "--out", str(keep.parent))
    assert code == cli.EXIT_BAD_INPUT and "not empty and holds no run" in err
    assert keep.read_bytes() == b"someone's file"
    (tmp_path / "file").write_text("x")
    code, _, err = train_main(capsys, *TINY_TRAIN, "--epochs", "1", "--out", str(tmp_path / "file" / "run"))
    assert code == cli.EXIT_BAD_INPUT and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_version_is_the_package_s(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    from gradtie import __version__
    assert capsys.readouterr().out.strip() == f"gradtie {__version__}"


TINY_TRAIN = ("--net", "cifar8", "--data", "digits", "--optimizer", "sgd", "--batch", "16", "--head-width", "16",
              "--n-train", "64", "--n-test", "32", "--precise-batches", "2")
LAST_LINE = re.compile(r"^test accuracy: [01]\.\d{4}$")


def train_main(capsys, *args):
    """`gradtie train` in this process (compiled steps are shared between calls): (code, out, err)."""
    code = cli.main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def checkpoint_arrays(folder):
    with np.load(folder / "checkpoint.npz") as z:
        return {k: z[k] for k in z.files if k != "meta"}


def test_train_run_contract_and_an_exact_resume(tmp_path, capsys):
    code, out, err = train_main(capsys, *TINY_TRAIN, "--epochs", "3", "--out", str(tmp_path / "a"))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-1]
    assert [line.split(" (")[0] for line in lines[:-1]] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and lines[-1] == f"test accuracy: {rows[-1]['test_accuracy']:.4f}"
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["net"] == "cifar8" and run["config"]["head_width"] == 16 and run["epochs"] == 3
    assert run["flip"] is False                      # digits: a mirrored digit is no digit
    # stopped after epoch 2, resumed with nothing but the folder: the same run, bit for bit
    code, out, _ = train_main(capsys, *TINY_TRAIN, "--epochs", "3", "--stop-after", "2", "--out", str(tmp_path / "b"))
    assert code == 0 and len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 2
    code, out, err = train_main(capsys, "--out", str(tmp_path / "b"), "--resume")
    assert code == 0, err
    assert LAST_LINE.match(out.strip().splitlines()[-1]) and out.strip().splitlines()[0].startswith("epoch 3/3")
    a, b = checkpoint_arrays(tmp_path / "a"), checkpoint_arrays(tmp_path / "b")
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # a different total is a one-line error (exit 3) that says how to extend
    code, _, err = train_main(capsys, "--out", str(tmp_path / "b"), "--resume", "--epochs", "5")
    assert code == cli.EXIT_BAD_INPUT and "fixed by its total of 3 epochs" in err and "--extend-epochs" in err
    assert len(err.strip().splitlines()) == 1
    # a corrupt checkpoint names the file, in one line
    (tmp_path / "b" / "checkpoint.npz").write_bytes(b"not a zip")
    code, _, err = train_main(capsys, "--out", str(tmp_path / "b"), "--resume", "--extend-epochs", "1")
    assert code == cli.EXIT_BAD_INPUT and "checkpoint.npz" in err and "not a readable" in err
    assert len(err.strip().splitlines()) == 1


def test_train_divergence_exits_4_naming_the_step(tmp_path, capsys):
    code, out, err = train_main(capsys, *TINY_TRAIN, "--lr", "1e30", "--out", str(tmp_path))
    assert code == cli.EXIT_NOT_FINITE
    assert re.search(r"at step \d+ \(epoch 1, batch \d+ of 4", err) and "test accuracy" not in out


def test_train_on_photos_as_a_command(tmp_path):
    """The real entry point, on the photos dataset (a class per shipped photo, K = 7)."""
    out = tmp_path / "run"
    r = run("train", "--net", "cifar8", "--data", "photos", "--optimizer", "sgd", "--epochs", "1",
            "--batch", "7", "--head-width", "16", "--n-train", "28", "--n-test", "14", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert LAST_LINE.match(r.stdout.strip().splitlines()[-1])
    assert json.loads((out / "run.json").read_text())["data"]["num_classes"] == 7
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


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
