"""One of two processes of a `jax.distributed` run on 127.0.0.1 (CPU, gloo collectives).

    python tests/_two_process_worker.py PROCESS_ID PORT OUT.json [DEVICES_PER_PROCESS]

Each process holds DEVICES_PER_PROCESS fake CPU devices; the mesh spans both processes. Both build
the same global batch from a seed, hand `jax.make_array_from_process_local_data` their own rows,
and run `parallel.forward_backward` (synchronised BatchNorm). Each writes what it holds to OUT.npz:
the replicated loss and parameter gradients, the input gradient gathered from both processes, and
the point (drawn weights, the batch). tests/test_parallel.py runs both, checks that the two hold the
same result, and ties it once to the single-device float64 oracle through the tie kit's one verdict
path (`checks.tie.report`).
"""

import os
import sys

process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
per_process = int(sys.argv[4]) if len(sys.argv) > 4 else 1
from gradtie.fake_devices import request_host_devices  # noqa: E402  (no JAX yet: it reads the count)

request_host_devices(per_process)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=60)

from jax.experimental import multihost_utils  # noqa: E402

from gradtie import parallel  # noqa: E402
from gradtie.nets import cifar8  # noqa: E402

PER_REPLICA = 2
cfg = cifar8.Config(head_width=64)
replicas = jax.device_count()
mesh = parallel.data_mesh(replicas)
net = cifar8.NET
params = {k: np.asarray(v, np.float64) for k, v in net.init(jax.random.key(0), cfg, weights="drawn").items()}
rng = np.random.default_rng(1)
x = rng.uniform(size=(replicas * PER_REPLICA, 3, 32, 32))
labels = rng.integers(0, cfg.num_classes, size=len(x))   # int labels: one-hot on the global array

# this process's rows: the replicas (devices) it owns, in mesh order
rows_per_process = len(x) // jax.process_count()
mine = slice(process_id * rows_per_process, (process_id + 1) * rows_per_process)
gx, gt = parallel.global_batch(mesh, (x[mine], labels[mine]))
out = parallel.forward_backward(net, parallel.replicate(mesh, params), gx, gt, cfg, mesh=mesh)
# replicated results: any local shard; the input gradient: every process's rows gathered
loss = np.asarray(out.loss.addressable_data(0))
grads = {k: np.asarray(v.addressable_data(0)) for k, v in out.grads.items()}
dx = np.asarray(multihost_utils.process_allgather(out.dx, tiled=True))

np.savez(out_path, process_id=process_id, process_count=jax.process_count(), replicas=replicas,
         loss=loss, dx=dx, x=x, labels=labels, **{f"grad:{k}": v for k, v in grads.items()},
         **{f"param:{k}": v for k, v in params.items()})
jax.distributed.shutdown()
