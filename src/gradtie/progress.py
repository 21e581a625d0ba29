"""Progress on long work: bars on stderr, only where stderr is a terminal, and where the time goes.

A notebook's stderr is not a terminal, so an executed chapter carries no progress frames and no
warning about a missing widget; a terminal sees the bar. `tqdm.std`, never `tqdm.auto` (the
notebook flavour needs ipywidgets and warns without it).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterable, Optional, TypeVar

import jax
from tqdm.std import tqdm

T = TypeVar("T")


def shown(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: asked for, and stderr is a terminal."""
    return bool(enabled) and sys.stderr.isatty()


def bar(iterable: Optional[Iterable[T]] = None, *, desc: str, total: Optional[int] = None, enabled: bool = True,
        initial: int = 0) -> tqdm:
    """A tqdm bar on stderr (disabled, and silent, unless `shown(enabled)`); iterate it or `.update`."""
    return tqdm(iterable, desc=desc, total=total, initial=initial, leave=False, file=sys.stderr,
                disable=not shown(enabled))


@contextmanager
def phase(timings: dict, name: str, shown: Optional[tqdm] = None):
    """Adds the wall seconds of the block to timings[name]; names the block on the bar `shown`, if any."""
    if shown is not None:
        shown.set_description_str(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        if shown is not None:
            shown.update()


@contextmanager
def compile_clock(timings: dict):
    """Sets timings["compilation"] to the backend's compile seconds (jax.monitoring events) in the block."""
    total = [0.0]

    def listener(event, duration, **_):
        if "backend_compile" in event:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        timings["compilation"] = total[0]
        try:
            jax.monitoring.unregister_event_duration_listener(listener)
        except Exception:  # older JAX: listeners cannot be removed; it only counts
            pass
