"""`gradtie train` on a data mesh in a fresh interpreter (the device count is fixed before JAX starts).

    python tests/_train_mesh_worker.py mesh OUT             # one process, 4 host devices
    python tests/_train_mesh_worker.py process ID PORT OUT  # one of two processes on 127.0.0.1, 2 devices each

Every run is the same float64 run of cifar8 (head width 16) on 32 digits: one epoch of two global
batches of 16, evaluated on 16 test digits, written to OUT/<name>/ (orbax checkpoints).

`mesh`: `gradtie train --replicas 4 --batch 4` (r4); the same run with per-replica BatchNorm
(`--no-sync-bn`: r4_local_bn, the control that must part from one device); and `gradtie train --out OUT/r4 --resume --replicas 2`, which
must be refused (its exit code and message are printed as JSON).

`process`: `gradtie train --replicas 2 --batch 4` as one host of two runs it, told the coordinator,
the process count and its id in JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (p2).
"""

import contextlib
import io
import json
import os
import sys

mode = sys.argv[1]
from gradtie.fake_devices import request_host_devices  # noqa: E402  (no JAX yet: it reads the count)

request_host_devices(4 if mode == 'mesh' else 2)
os.environ["JAX_PLATFORMS"] = "cpu"
if mode == "process":
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{sys.argv[3]}", JAX_NUM_PROCESSES="2",
                      JAX_PROCESS_ID=sys.argv[2])
OUT = sys.argv[-1]

from gradtie import cli  # noqa: E402

RUN = ["train", "--net", "cifar8", "--head-width", "16", "--data", "digits", "--n-train", "32", "--n-test", "16",
       "--epochs", "1", "--precise-batches", "1", "--dtype", "float64", "--batch", "4"]


def train(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([*RUN, *args])
    return code, out.getvalue(), err.getvalue()


if mode == "mesh":
    code, out, err = train("--replicas", "4", "--out", f"{OUT}/r4")
    assert code == 0, err
    control = train("--replicas", "4", "--no-sync-bn", "--out", f"{OUT}/r4_local_bn")
    assert control[0] == 0, control[2]
    import jax
    refused = train("--replicas", "2", "--out", f"{OUT}/r4", "--resume")
    print(json.dumps({"devices": jax.device_count(), "last_line": out.strip().splitlines()[-1],
                      "refused": {"code": refused[0], "err": refused[2]}}))
else:
    code, out, err = train("--replicas", "2", "--out", f"{OUT}/p2")
    assert code == 0, err
    import jax
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count(), "out": out}))
    jax.distributed.shutdown()
