"""One of two processes of a `jax.distributed` run on 127.0.0.1 (CPU, gloo collectives).

    python tests/_two_process_worker.py PROCESS_ID PORT OUT.json [DEVICES_PER_PROCESS]

Each process holds DEVICES_PER_PROCESS fake CPU devices; the mesh spans both processes. Both build
the same global batch from a seed, hand `jax.make_array_from_process_local_data` their own rows,
and run `parallel.loss_and_grads` (synchronised BatchNorm). Each then computes the single-device
rendered gradient at the whole batch locally and writes the worst relative error per node to
OUT.json. Run by tests/test_parallel.py.
"""

import json
import os
import sys

process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
per_process = int(sys.argv[4]) if len(sys.argv) > 4 else 1
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_process}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=60)

from gradtie import parallel  # noqa: E402
from gradtie.nets import cifar8  # noqa: E402

PER_REPLICA = 2
cfg = cifar8.Config(head_width=64)
replicas = jax.device_count()
mesh = parallel.data_mesh(replicas)
params = {k: np.asarray(v, np.float64) for k, v in cifar8.init(jax.random.key(0), cfg).items()}
rng = np.random.default_rng(1)
x = rng.uniform(size=(replicas * PER_REPLICA, 3, 32, 32))
labels = rng.integers(0, cfg.num_classes, size=len(x))   # int labels: one-hot on the global array

# this process's rows: the replicas (devices) it owns, in mesh order
rows_per_process = len(x) // jax.process_count()
mine = slice(process_id * rows_per_process, (process_id + 1) * rows_per_process)
gx, gt = parallel.global_batch(mesh, (x[mine], labels[mine]))
loss, grads = parallel.loss_and_grads(cifar8, parallel.replicate(mesh, params), gx, gt, cfg, mesh=mesh)

local = jax.local_devices()[0]
with jax.default_device(local):
    ref = parallel.single_device(cifar8, {k: jnp.asarray(v) for k, v in params.items()},
                                 jnp.asarray(x), jnp.asarray(labels), cfg)
g1 = {k: np.asarray(v) for k, v in ref.grads.items()}
gmax = max(float(np.max(np.abs(v))) for v in g1.values())
zero = parallel.zero_in_reals(params)
rel = {}
for k in params:
    a = np.asarray(grads[k].addressable_data(0), np.float64)   # replicated: any local shard
    scale = float(np.max(np.abs(g1[k])))
    if k in zero:
        scale = max(scale, parallel.ZERO_NODE_FLOOR * gmax)
    rel[k] = float(np.max(np.abs(a - g1[k]))) / scale

with open(out, "w") as f:
    json.dump({"process_id": process_id, "process_count": jax.process_count(), "replicas": replicas,
               "loss": float(np.asarray(loss.addressable_data(0))), "loss_single": float(ref.loss),
               "max_rel": max(rel.values()), "nodes": len(rel)}, f)
jax.distributed.shutdown()
