"""Progress bars on long work: on stderr, and only where stderr is a terminal.

A notebook's stderr is not a terminal, so an executed chapter carries no progress frames and no
warning about a missing widget; a terminal sees the bar. `tqdm.std`, never `tqdm.auto` (the
notebook flavour needs ipywidgets and warns without it).
"""

from __future__ import annotations

import sys
from typing import Iterable, Optional, TypeVar

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
