"""Fake host devices for a data-parallel mesh on a CPU.

XLA reads `--xla_force_host_platform_device_count` once, when JAX starts its CPU backend, so the
request must come before `import jax`. This module imports nothing of JAX for that reason.
"""

from __future__ import annotations

import os
import sys

FLAG = "--xla_force_host_platform_device_count"


def with_host_devices(flags: str, count: int) -> str:
    """`flags` (an `XLA_FLAGS` value) asking for `count` CPU devices; a device count it already
    sets wins, and every other flag is kept. For this process or a child's environment."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"host devices: count={count!r}, expected a positive int")
    return flags if FLAG.lstrip("-") in flags else f"{flags} {FLAG}={count}".strip()


def without_device_count(flags: str) -> str:
    """`flags` (an `XLA_FLAGS` value) less any CPU device count it sets, every other flag kept: the
    environment of a child that asks for its own count."""
    return " ".join(f for f in flags.split() if not f.startswith(FLAG)).strip()


def request_host_devices(count: int) -> None:
    """Ask XLA for `count` CPU devices in this process, keeping whatever else `XLA_FLAGS` holds.

    A device count the environment already sets wins (the mesh then says how many it found); a
    request after JAX has started its backends cannot take effect and raises.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = with_host_devices(flags, count)
    if wanted == flags:
        return
    if _backends_started():
        raise RuntimeError(f"request_host_devices({count}): JAX has already started its backends, so XLA "
                           f"will not read {FLAG}; call it before the first `import jax`")
    os.environ["XLA_FLAGS"] = wanted


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:   # a JAX without that module: assume the worst only if jax is imported
        return True
    return bool(getattr(xla_bridge, "_backends", None))
