"""Data parallel with synchronised BatchNorm: the mesh step against one device at batch R·N.

The fake device count (XLA_FLAGS=--xla_force_host_platform_device_count=8) must be set before jax
initialises, and conftest.py has imported jax for the whole session, so the multi-device checks run
in fresh interpreters (tests/_mesh_worker.py, tests/_two_process_worker.py) that print JSON.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from gradtie import parallel

HERE = Path(__file__).resolve().parent
MESH_WORKER = HERE / "_mesh_worker.py"
TWO_PROCESS_WORKER = HERE / "_two_process_worker.py"
WORKER_TIMEOUT_S = 300


def worker_env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)          # each worker sets its own device count
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_mesh_worker(*args) -> dict:
    proc = subprocess.run([sys.executable, str(MESH_WORKER), *args], capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S, env=worker_env(), cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- in this process (one CPU device) ------------------------------------------------------------

def test_data_mesh_is_a_classic_1d_mesh_named_data():
    mesh = parallel.data_mesh(1)
    assert mesh.axis_names == ("data",)
    assert parallel.replica_count(mesh) == 1


def test_data_mesh_says_how_to_get_fake_devices():
    too_many = len(jax.devices()) + 1
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        parallel.data_mesh(too_many)
    with pytest.raises(ValueError, match="positive integer"):
        parallel.data_mesh(0)


def test_chan_bound_is_linear_and_one_round_scale_quadratic_in_the_offset():
    assert parallel.chan_bound(1e4) / parallel.chan_bound(1e2) == pytest.approx(1e4 / 1e2, rel=0.02)
    assert parallel.one_round_scale(1e4) / parallel.one_round_scale(1e2) == pytest.approx(1e4)


# ---- 8 fake CPU devices, in a fresh interpreter ------------------------------------------------

@pytest.mark.parametrize("net", ["cifar8", "resnet34"])
def test_replica_mean_grads_equal_single_device_f64(net):
    out = run_mesh_worker("tie", net)
    for r in ("2", "4", "8"):
        assert out[r]["ok"], out[r]["summary"]
        assert out[r]["max_rel"] <= parallel.REL_F64, out[r]["summary"]
        assert out[r]["nodes"] == {"cifar8": 38, "resnet34": 110}[net] + 1   # + the input gradient
        assert out[r]["loss_err"] <= 1e-12


def test_per_replica_batchnorm_control_goes_red():
    out = run_mesh_worker("control", "cifar8")
    assert not out["ok"]
    # not round-off: per-replica statistics are a different function of the parameters
    assert out["max_rel"] > 1e6 * parallel.REL_F64, out["summary"]
    assert {"bn1.weight", "bn1.bias", "conv1.weight", "input"} <= set(out["failed_names"])
    # the peer that needs no synchronisation: per-example BN couples no examples
    assert out["per_example"]["ok"], out["per_example"]["summary"]


def test_chan_combine_stays_at_float32_precision_where_one_round_drifts():
    out = run_mesh_worker("drift")
    for row in out["rows"]:
        assert row["chan"] <= parallel.chan_bound(row["offset"]), row
    far = out["rows"][-1]
    assert far["offset"] == 1e4
    assert far["one_round"] > 0.1                       # E[x²] − μ²: more than 10% off
    assert far["one_round"] > 1e-2 * parallel.one_round_scale(far["offset"])
    assert far["one_round"] > 1e3 * far["chan"]
    (row64,) = out["rows64"]                           # float64: the same ratio, 2⁻⁵³ instead of 2⁻²⁴
    assert row64["chan"] <= parallel.chan_bound(row64["offset"], "float64")
    assert row64["one_round"] > 1e3 * row64["chan"]


def test_train_step_on_mesh_matches_single_device_for_every_optimizer():
    out = run_mesh_worker("step")
    for name in ("sgd", "nesterov", "heavy-ball", "adamw"):
        row = out[name]
        assert row["max_rel"] <= parallel.REL_F64, row
        assert row["order"] and row["step"] == 2
        assert row["loss_err"] <= 1e-12 and row["accuracy_err"] == 0.0
    assert out["bf16"] == {"finite": True, "dtypes": ["float32"]}


def test_bad_batches_give_clear_errors():
    out = run_mesh_worker("errors")
    assert "divisible by the 4 replicas" in out["indivisible"]
    assert "xla_force_host_platform_device_count" in out["too_many"]
    assert "sum to 1" in out["bad_rows"]


# ---- two processes on 127.0.0.1 (jax.distributed, gloo) ------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_single_device_gradient(tmp_path):
    port = free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(TWO_PROCESS_WORKER), str(i), str(port), str(outs[i]), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
                              cwd=HERE.parent) for i in range(2)]
    try:
        logs = [p.communicate(timeout=WORKER_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, logs):
        assert p.returncode == 0, err[-4000:]
    for path in outs:
        out = json.loads(path.read_text())
        assert out["process_count"] == 2 and out["replicas"] == 4 and out["nodes"] == 38
        assert out["max_rel"] <= parallel.REL_F64, out
        assert abs(out["loss"] - out["loss_single"]) <= 1e-12
