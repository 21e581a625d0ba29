"""Fake host devices for a data-parallel mesh on a CPU.

XLA reads `--xla_force_host_platform_device_count` once, when JAX starts its CPU backend, so the
request must come before `import jax`. This module imports nothing of JAX for that reason.
"""

from __future__ import annotations

import os
import sys

FLAG = "--xla_force_host_platform_device_count"


def request_host_devices(count: int) -> None:
    """Ask XLA for `count` CPU devices, keeping whatever else `XLA_FLAGS` holds.

    A device count the environment already sets wins (the mesh then says how many it found); a
    request after JAX has started its backends cannot take effect and raises.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"request_host_devices: count={count!r}, expected a positive int")
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG.lstrip("-") in flags:
        return
    if _backends_started():
        raise RuntimeError(f"request_host_devices({count}): JAX has already started its backends, so XLA "
                           f"will not read {FLAG}; call it before the first `import jax`")
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={count}".strip()


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:   # a JAX without that module: assume the worst only if jax is imported
        return True
    return bool(getattr(xla_bridge, "_backends", None))
