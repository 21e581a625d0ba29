"""Host arrays onto the device without compiling anything.

`jnp.asarray(numpy_array)` stages the copy as a program of its own, compiled once per shape and
dtype in each process (a `jit(stage)`); `jax.device_put` is a plain transfer. A check that moves
a net's parameters, a batch and a few random draws to the device meets dozens of shapes, so the
difference is a second or more of compilation on a first run. Values are the same bits either
way, in the dtype JAX gives the host array (float64 needs `jax_enable_x64`, as with `jnp.asarray`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np


def to_device(a: Any, dtype: Any = None) -> jax.Array:
    """`a` (a NumPy array, a scalar or a `jax.Array`) as a `jax.Array`, in `dtype` when given."""
    if isinstance(a, jax.Array) and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    return jax.device_put(np.asarray(a, dtype))


def tree_to_device(tree: Any, dtype: Any = None) -> Any:
    """`to_device` on every leaf of a tree (a dict of parameters, a selection per pool)."""
    return jax.tree.map(lambda a: to_device(a, dtype), tree)


def process_seconds() -> Optional[float]:
    """Wall seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime), or None where they cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> Optional[int]:
    """Bytes of memory available now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
