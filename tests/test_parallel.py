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
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import parallel
from gradtie import tolerances
from gradtie.checks.tie import reference_at, report
from gradtie.fake_devices import without_device_count
from gradtie.nets import cifar8
from gradtie.ops import batchnorm

HERE = Path(__file__).resolve().parent
MESH_WORKER = HERE / "_mesh_worker.py"
TWO_PROCESS_WORKER = HERE / "_two_process_worker.py"
WORKER_TIMEOUT_S = 300


def worker_env() -> dict:
    env = dict(os.environ)
    # each worker sets its own device count; the other flags (conftest.py's) stay
    env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
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


def test_padding_puts_each_replicas_rows_first_and_marks_them_valid():
    x = np.arange(4.0).reshape(4, 1, 1, 1) + 1
    t = np.eye(2)[[0, 1, 1, 0]]
    xs, ts, valid = parallel.padded(x, t, (3, 0, 1))
    assert xs[:, 0, 0, 0].tolist() == [1, 2, 3, 0, 0, 0, 4, 0, 0]
    assert valid.tolist() == [1, 1, 1, 0, 0, 0, 1, 0, 0]
    assert np.allclose(ts.sum(axis=1), 1)                       # padded rows still sum to 1
    assert parallel.valid_rows((3, 0, 1)).tolist() == [0, 1, 2, 6]


def test_counts_must_hold_the_batch():
    with pytest.raises(ValueError, match="sum to 3, but the batch holds 4"):
        parallel.check_counts("op", (2, 1), 2, 4)
    with pytest.raises(ValueError, match="non-negative integers"):
        parallel.check_counts("op", (2, -1, 3), 3)
    with pytest.raises(ValueError, match="hold no example"):
        parallel.check_counts("op", (0, 0), 2)


@pytest.fixture(scope="module")
def bn_case():
    rng = np.random.default_rng(0)
    x = jnp.asarray(3 + 2 * rng.standard_normal((5, 3, 4, 4)))
    gamma, beta = jnp.asarray(rng.uniform(0.5, 1.5, 3)), jnp.asarray(rng.standard_normal(3))
    dy = jnp.asarray(rng.standard_normal((5, 3, 4, 4)))
    junk = x.at[3:].set(1e3 * jnp.asarray(rng.standard_normal((2, 3, 4, 4))))
    return x, gamma, beta, dy, junk, jnp.asarray([1.0, 1.0, 1.0, 0.0, 0.0])


def test_batchnorm_with_a_validity_mask_is_batchnorm_of_the_valid_rows(bn_case):
    """Statistics, output, input cotangent and dγ over the valid examples only, bit for bit as if
    the padding were not there; padded rows get dx = 0 whatever they hold."""
    x, gamma, beta, dy, junk, valid = bn_case
    y0, s0 = batchnorm.forward(x[:3], gamma, beta)
    y1, s1 = batchnorm.forward(junk, gamma, beta, valid=valid)
    assert np.array_equal(s0.mean, s1.mean) and np.array_equal(s0.var, s1.var)
    assert np.array_equal(y0, y1[:3])
    dy_padded = dy.at[3:].set(0.0)      # the chain hands padding a zero cotangent
    dx0, dx1 = batchnorm.backward(s0, gamma, dy[:3]), batchnorm.backward(s1, gamma, dy_padded)
    assert np.array_equal(dx0, dx1[:3]) and np.all(dx1[3:] == 0)
    assert np.array_equal(batchnorm.grad_weight(s0, dy[:3]), batchnorm.grad_weight(s1, dy))
    # control: the same junk without the mask moves every statistic
    _, s2 = batchnorm.forward(junk, gamma, beta)
    assert np.max(np.abs(s2.var - s0.var)) > 1.0


def test_the_mask_rides_in_the_saved_record_to_the_backward(bn_case):
    """The mask is an argument of the forward only: the saved record carries it, and the backward
    and the γ node read it from there (the nets pass `forward(valid=)` down to every BatchNorm;
    tests/nets/test_cifar8.py ties a padded batch through a whole net)."""
    x, gamma, beta, dy, junk, valid = bn_case
    _, saved = batchnorm.forward(junk, gamma, beta, valid=valid)
    assert np.array_equal(saved.valid, valid)
    dy_padded = dy.at[3:].set(0.0)
    dx = batchnorm.backward(saved, gamma, dy_padded)
    _, s0 = batchnorm.forward(x[:3], gamma, beta)
    assert np.array_equal(dx[:3], batchnorm.backward(s0, gamma, dy[:3])) and np.all(dx[3:] == 0)
    # control: the same record with its mask dropped is another backward (the junk rows count)
    dx_unmasked = batchnorm.backward(saved._replace(valid=None), gamma, dy_padded)
    assert np.max(np.abs(dx_unmasked[:3] - dx[:3])) > 1e-3 * np.max(np.abs(dx[:3]))
    # and a forward without the mask saves none: nothing carries over from an earlier call
    _, plain = batchnorm.forward(junk, gamma, beta)
    assert plain.valid is None


def test_batchnorm_mask_must_match_the_batch(bn_case):
    x, gamma, beta, *_ = bn_case
    with pytest.raises(ValueError, match=r"valid must have shape \(5,\)"):
        batchnorm.forward(x, gamma, beta, valid=jnp.ones(4))


# ---- 8 fake CPU devices, in a fresh interpreter ------------------------------------------------

# the mesh tie at R·N = 8: the Data-parallel chapter sweeps ResNet-34's R·N (R = 2 in its ci profile,
# up to 8 in its cpu profile) and ties cifar8 on a mesh; the mesh step and uneven counts (both at
# R = 4), the per-replica control and two processes stay in `make test`
@pytest.mark.slow
@pytest.mark.parametrize("net", ["cifar8", "resnet34"])
def test_replica_mean_grads_equal_single_device_f64(net):
    """`r34_net_syncTiedB`: the all-reduced nodes ARE the single-device nodes at N := R·N, every
    node held to the point's own envelope (drawn weights, photos, R·N = 8 split 2, 4, 8 ways)."""
    out = run_mesh_worker("tie", net)
    for r in ("2", "4", "8"):
        rep = out[r]
        assert rep["ok"] and rep["ill"] == 0, rep["summary"]
        assert rep["nodes"] == {"cifar8": 38, "resnet34": 110}[net]
        assert rep["loss_ok"] and rep["input_ok"]


def test_uneven_replica_batches_tie_to_one_device_and_the_plain_mean_goes_red():
    """Four replicas holding 1, 2, 0 and 1 examples (one holding nothing) tie; the plain mean of
    replica means goes red at 3+1. The Data-parallel chapter ties ResNet-34 at 3+1 and shows the
    same bug red there and green at 2+2, where it is exactly right."""
    out = run_mesh_worker("uneven")
    tied = out["1+2+0+1"]
    assert tied["ok"] and tied["ill"] == 0 and tied["input_ok"], tied["summary"]
    bug = out["bug 3+1"]
    # not round-off: more than 1 % off, beyond what any envelope of a judgeable point allows
    assert not bug["ok"] and bug["worst_rel"] > tolerances.ILL_CONDITIONED_REL, bug["summary"]
    assert bug["first"] is not None and "input" in bug["failed"]
    assert out["junk_changes_no_bit"] and out["padded_dx_zero"]
    assert out["valid_dx_rows"] == 4


def test_per_replica_batchnorm_control_goes_red():
    out = run_mesh_worker("control")
    rep = out["per_replica"]
    assert not rep["ok"]
    # not round-off: per-replica statistics are a different function of the parameters
    assert rep["worst_rel"] > tolerances.ILL_CONDITIONED_REL, rep["summary"]
    assert not rep["loss_ok"]
    assert {"bn1.weight", "bn1.bias", "conv1.weight", "input"} <= set(rep["failed"])
    # the peer that needs no synchronisation: per-example BN couples no examples
    assert out["per_example"]["ok"], out["per_example"]["summary"]


# Would the check catch it? runs the three sync entries on cifar8 through the same mesh tie
# (`bugs.run`), and test_check_cli_takes_uneven_replica_counts drives one through the command's exit code
@pytest.mark.slow
@pytest.mark.parametrize("net", ["cifar8", "resnet34"])
def test_synchronised_bn_catalogue_entries_exit_1_through_the_check(net):
    out = run_mesh_worker("catalogue", net)
    for bug in ("sync_dgamma_dbeta_reduced_twice", "sync_local_means_backward", "sync_plain_mean_of_means"):
        assert out[bug]["exit"] == 1, out[bug]["summary"]
        assert out[bug]["first"] is not None
    assert out["real 3+1"]["exit"] == 0, out["real 3+1"]["summary"]


def test_check_cli_takes_uneven_replica_counts():
    """`gradtie check --replica-counts 3,1 --plant-bug sync_plain_mean_of_means` exits 1; the same
    bug at an even split is refused (it would plant nothing)."""
    cmd = [sys.executable, "-m", "gradtie", "check", "--net", "cifar8", "--batch", "4", "--data", "photos"]
    red = subprocess.run(cmd + ["--replica-counts", "3,1", "--plant-bug", "sync_plain_mean_of_means"],
                         capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=worker_env(), cwd=HERE.parent)
    assert red.returncode == 1, red.stdout[-3000:] + red.stderr[-3000:]
    assert "first to break in backward order" in red.stdout
    even = subprocess.run(cmd + ["--replicas", "2", "--plant-bug", "sync_plain_mean_of_means"],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, env=worker_env(), cwd=HERE.parent)
    assert even.returncode == 3 and "--replica-counts" in even.stderr, even.stderr[-2000:]


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
    """Rendered against rendered: the two differ only in the order of their sums (float64)."""
    out = run_mesh_worker("step")
    for name in ("sgd", "nesterov", "heavy-ball", "adamw"):
        row = out[name]
        assert row["max_rel"] <= tolerances.REL_F64, row
        assert row["order"] and row["step"] == 2
        assert row["loss_err"] <= 1e-12 and row["accuracy_err"] == 0.0
    uneven = out["uneven"]
    assert max(uneven["grads"], uneven["stats"], uneven["dx"]) <= tolerances.REL_F64, uneven
    assert uneven["loss_err"] <= 1e-12 and uneven["accuracy_err"] == 0.0
    assert out["bf16"] == {"finite": True, "dtypes": ["float32"]}


def test_data_parallel_under_the_bf16_policy_syncs_batchnorm_in_float32():
    """Every local device under `bf16`: BatchNorm statistics and the parameter nodes cross the mesh
    in float32 (the compiled program's all-reduces), and the mesh step sits as far from the float32
    gradient as one device under bf16 does (a bf16 exchange would add its own rounding on top)."""
    out = run_mesh_worker("policy")
    for r in ("2", "4"):
        row = out[r]
        assert row["all_reduce"] == ["f32"] and row["n_all_reduce"] > 0, row
        assert row["dtypes"] == ["float32"] and row["finite"], row
        assert 0 < row["mesh"] <= 3 * row["one"], row


def test_bad_batches_give_clear_errors():
    out = run_mesh_worker("errors")
    assert "divisible by the 4 replicas" in out["indivisible"]
    assert "xla_force_host_platform_device_count" in out["too_many"]
    assert "sum to 1" in out["bad_rows"]
    assert "sum to 4, but the batch holds 6" in out["counts_sum"]
    assert "2 non-negative integers" in out["counts_length"]
    assert "hold no example" in out["counts_empty"]
    assert "1 (a real example) or 0" in out["valid_values"]
    assert "not both" in out["counts_and_valid"]
    assert "replicas 3 but 2 counts" in out["tie_counts_replicas"]


# ---- two processes on 127.0.0.1 (jax.distributed, gloo) ------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_single_device_gradient(tmp_path):
    port = free_port()
    outs = [tmp_path / f"process{i}.npz" for i in range(2)]
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
    first, second = (dict(np.load(path)) for path in outs)
    assert [int(o["process_id"]) for o in (first, second)] == [0, 1]
    assert all(int(o["process_count"]) == 2 and int(o["replicas"]) == 4 for o in (first, second))
    # both processes hold the same replicated gradients and the same gathered input gradient
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first if k != "process_id")
    # ... which tie to the single-device float64 oracle at the whole batch, once
    cfg = cifar8.Config(head_width=64)
    params = {k[len("param:"):]: jnp.asarray(v) for k, v in first.items() if k.startswith("param:")}
    grads = {k[len("grad:"):]: v for k, v in first.items() if k.startswith("grad:")}
    point = reference_at(cifar8.NET, params, jnp.asarray(first["x"]), jnp.asarray(first["labels"]), cfg)
    rep = report("cifar8 on 4 replicas in 2 processes", params, (first["loss"], grads, first["dx"]), point)
    assert len(rep.nodes) == 38 and list(params) == list(cifar8.NET.init(jax.random.key(0), cfg))
    assert rep.ok, rep.summary()
    assert rep.row("loss").ok and rep.row("input").ok, rep.summary()
