"""Several hosts: `jax.distributed` from the environment, the data mesh, each host's rows of a batch.

A run on P hosts is P copies of the same command, one per host, each told where the coordinator
is, how many processes there are and which one it is:

    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=P JAX_PROCESS_ID=p gradtie train ...

(`JAX_COORDINATOR_ADDRESS` is the variable `jax.distributed.initialize` itself reads; the other
two are read here.) With none of the three set the run is one process. On a CPU, collectives
between processes go through gloo.

The mesh is one "data" axis over R devices of every process (`--replicas R`, default every local
device), process by process: replica r·… of process p holds rows p·R·N … (p+1)·R·N − 1 of the
global batch of P·R·N, so each host reads only its own rows (`rows`).

Beyond the suite: the suite states the data-parallel step (`r34_net_syncTiedB`), not how its
replicas are placed on hosts.
"""

from __future__ import annotations

import os
from typing import Mapping, NamedTuple, Optional

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
INIT_TIMEOUT_S = 300


class Cluster(NamedTuple):
    coordinator: str        # host:port of process 0's coordination service
    process_count: int
    process_id: int


def from_environment(env: Optional[Mapping[str, str]] = None) -> Optional[Cluster]:
    """The cluster the environment describes, or None (one process). Some but not all of the three
    variables set, or values that are not a process count and an id below it, is a ValueError
    naming the variable."""
    env = os.environ if env is None else env
    names = (ENV_COORDINATOR, ENV_PROCESSES, ENV_PROCESS_ID)
    given = {n: env.get(n, "").strip() for n in names}
    if not any(given.values()):
        return None
    missing = [n for n in names if not given[n]]
    if missing:
        raise ValueError(f"a run on several hosts needs {', '.join(names)} in each host's environment; "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set")
    if ":" not in given[ENV_COORDINATOR]:
        raise ValueError(f"{ENV_COORDINATOR}={given[ENV_COORDINATOR]!r}: expected host:port of process 0")
    try:
        count, pid = int(given[ENV_PROCESSES]), int(given[ENV_PROCESS_ID])
    except ValueError:
        raise ValueError(f"{ENV_PROCESSES}={given[ENV_PROCESSES]!r} and {ENV_PROCESS_ID}={given[ENV_PROCESS_ID]!r}: "
                         f"expected integers") from None
    if count < 1 or not 0 <= pid < count:
        raise ValueError(f"{ENV_PROCESS_ID}={pid} with {ENV_PROCESSES}={count}: expected 0 ≤ id < count")
    return Cluster(given[ENV_COORDINATOR], count, pid)


def initialize(cluster: Optional[Cluster], *, timeout_s: int = INIT_TIMEOUT_S) -> None:
    """`jax.distributed.initialize` for `cluster` (nothing for None, or when already done); CPU
    collectives through gloo. Must run before JAX's first computation."""
    if cluster is None:
        return
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cluster.coordinator, num_processes=cluster.process_count,
                               process_id=cluster.process_id, initialization_timeout=timeout_s)


def local_replicas(requested: Optional[int]) -> int:
    """R, the devices this process trains on: `requested`, or every local device (None). More than
    the process has is a ValueError naming both counts (and how to get host devices on a CPU)."""
    import jax

    from .parallel import FAKE_DEVICES_HINT

    have = jax.local_device_count()
    if requested is None:
        return have
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"replicas must be a positive integer, got {requested!r}")
    if requested > have:
        platform = jax.local_devices()[0].platform
        raise ValueError(f"--replicas {requested} needs {requested} local devices, but this process has "
                         f"{have} {platform} device{'s' * (have != 1)}"
                         + (f"; {FAKE_DEVICES_HINT}" if platform == "cpu" else ""))
    return requested


def mesh(replicas: int):
    """The data mesh: the first `replicas` local devices of every process, process by process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from .parallel import AXIS

    devices = []
    for p in range(jax.process_count()):
        mine = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(mine) < replicas:
            raise ValueError(f"process {p} has {len(mine)} devices, fewer than --replicas {replicas}")
        devices += mine[:replicas]
    return Mesh(np.array(devices), (AXIS,))


def rows(global_batch: int) -> slice:
    """This process's rows of a global batch (its replicas' rows, in mesh order)."""
    import jax

    p, count = jax.process_index(), jax.process_count()
    if global_batch % count:
        raise ValueError(f"a global batch of {global_batch} does not split over {count} processes")
    local = global_batch // count
    return slice(p * local, (p + 1) * local)


def is_primary() -> bool:
    """Process 0: the one that writes run.json and metrics.jsonl and prints."""
    import jax
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here for the others (nothing on one process)."""
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
