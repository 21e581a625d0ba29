"""`train.fit` on a data mesh in a fresh interpreter (the device count is fixed before JAX starts).

    python tests/_train_mesh_worker.py mesh OUT            # one process, 4 host devices: R = 4 and R = 1
    python tests/_train_mesh_worker.py process ID PORT OUT  # one of two processes on 127.0.0.1, 2 devices each

Every run is the same float64 run of cifar8 (no conv biases, whose nodes are round-off only) on 32
digits: one epoch of two global batches of 16, evaluated on 16 test digits. `mesh` trains it on
four replicas (N = 4), on one device (batch 16), on one device with every batch's rows reversed
(the round-off envelope: the same run in ℝ, its sums in another order), and on four replicas with
per-replica BatchNorm (the control that must part from the single-device run), and tries to resume
the four-replica run on two replicas (refused). `process` trains it on two replicas in each of two processes
(gloo collectives). Each writes OUT/<name>.npz: the final parameters, running statistics and the
history's figures, as this process holds them.
"""

import os
import sys

mode = sys.argv[1]
DEVICES = 4 if mode == "mesh" else 2
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

from pathlib import Path  # noqa: E402

from gradtie import cluster  # noqa: E402

if mode == "process":
    pid, port, out = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    cluster.initialize(cluster.Cluster(f"127.0.0.1:{port}", 2, pid), timeout_s=120)
else:
    out = Path(sys.argv[2])

import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from gradtie import data, parallel, train  # noqa: E402
from gradtie.nets import cifar8  # noqa: E402

GLOBAL_BATCH = 16
CFG = cifar8.Config(head_width=16, conv_bias=False)
DIGITS = data.load("digits", n_train=32, n_test=16)


def run(name: str, replicas: int) -> dict:
    config = train.FitConfig(optimizer="nesterov", lr=0.02, epochs=1, batch=GLOBAL_BATCH // (replicas * jax.process_count()),
                             dtype="float64", precise_batches=1, eval_batch=16, replicas=replicas)
    result = train.fit(cifar8.NET, CFG, DIGITS, config, out=out / name, progress=False)
    host = lambda v: np.asarray(v.addressable_data(0)) if isinstance(v, jax.Array) else np.asarray(v)  # noqa: E731
    h = result.history[-1]
    np.savez(out / f"{name}-{jax.process_index()}.npz",
             **{f"params/{k}": host(v) for k, v in result.state.params.items()},
             **{f"running/{k}": host(v) for k, v in result.state.running.items()},
             step=host(result.state.step), loss=h["loss"], test_accuracy=h["test_accuracy"],
             test_top5=h["test_top5"], test_accuracy_running=h["test_accuracy_running"],
             train_accuracy=h["train_accuracy"], devices=h["devices"])
    return h


if mode == "mesh":
    summary = {"r4": run("r4", 4), "r1": run("r1", 1)}
    # the envelope: the single-device run with every batch's rows reversed, the same run in ℝ, its
    # sums (BatchNorm's, the gradient's mean over the batch) taken in another order
    real_batches = train._Plan.batches
    train._Plan.batches = lambda self, epoch, start=0: ((i, x[::-1], t[::-1]) for i, x, t in
                                                         real_batches(self, epoch, start))
    summary["r1_reversed"] = run("r1_reversed", 1)
    train._Plan.batches = real_batches
    real = parallel.make_step
    parallel.make_step = functools.partial(real, sync_bn=False)     # the control: per-replica BatchNorm
    summary["r4_local_bn"] = run("r4_local_bn", 4)
    parallel.make_step = real
    config = train.FitConfig(optimizer="nesterov", lr=0.02, batch=8, dtype="float64", replicas=2)
    try:
        train.fit(cifar8.NET, CFG, DIGITS, config, out=out / "r4", resume=True, progress=False)
    except ValueError as err:
        summary["resume_refused"] = str(err)
    print(json.dumps({k: v if isinstance(v, str) else {"devices": v["devices"]} for k, v in summary.items()}))
else:
    h = run("p2", 2)
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "devices": h["devices"]}))
    jax.distributed.shutdown()
