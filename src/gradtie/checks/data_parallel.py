"""The data-parallel tie swept over R·N: every split of a global batch tied to one device.

`r34_net_syncTiedB` quantifies over the batch: the all-reduced nodes of R replicas holding N
examples each ARE the single-device nodes at N := R·N, for every R and N. `sweep` runs the mesh
step (`tie.tie_replicas`, the one verdict path) at several R and N, each against the float64
oracle and round-off envelope of its own global batch (one reference serves every split of the same
batch), and takes the smoothness census of each point (the statement is about smooth points).
Shown in: Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from .. import data
from ..progress import bar
from ..nets.protocol import as_net
from . import census as census_
from .tie import TieReport, reference_at, targets_matrix, tie_replicas


def splits(largest_replicas: int, largest_per_replica: int) -> list[tuple[int, int]]:
    """(R, N) for R = 2, 4, … ≤ largest_replicas and N = 1, 2, 4, … ≤ largest_per_replica."""
    if largest_replicas < 2 or largest_per_replica < 1:
        raise ValueError(f"splits: need R ≥ 2 and N ≥ 1, got {largest_replicas} and {largest_per_replica}")
    rs = [r for r in (2 ** k for k in range(1, 11)) if r <= largest_replicas]
    ns = [n for n in (2 ** k for k in range(0, 13)) if n <= largest_per_replica]
    return [(r, n) for r in rs for n in ns]


@dataclass(frozen=True)
class SweepRow:
    replicas: int
    per_replica: int
    report: TieReport
    smooth: Optional[bool]     # the parameter-gradient hypothesis holds at the point (None: not taken)

    @property
    def global_batch(self) -> int:
        return self.replicas * self.per_replica

    @property
    def ratio(self) -> float:
        """The worst row's error over its limit (< 1: tied)."""
        w = self.report.worst()
        return w.rel / w.limit

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.report.ill_conditioned


@dataclass
class SweepReport:
    net: str
    rows: list[SweepRow]
    # R·N -> (x, targets, the `tie.Point`): each global batch with its reference and envelope, for
    # further ties at the same point (an uneven split of it, a control)
    points: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def smooth(self) -> bool:
        return all(r.smooth is not False for r in self.rows)

    @property
    def worst(self) -> SweepRow:
        return max(self.rows, key=lambda r: r.ratio)

    def summary(self) -> str:
        """Counts and pass/fail only: stable across machines (what a compared cell prints)."""
        tied = sum(r.ok for r in self.rows)
        batches = sorted({r.global_batch for r in self.rows})
        nodes = {len(r.report.nodes) for r in self.rows}
        return (f"{self.net}: {tied}/{len(self.rows)} splits tied ({', '.join(f'{r.replicas}×{r.per_replica}' for r in self.rows)}; "
                f"R·N = {', '.join(map(str, batches))}), every node of {'/'.join(map(str, nodes))} and the loss "
                f"within its limit" + ("" if self.ok else "; FAILED"))

    def table(self) -> str:
        head = f"{'R':>3} {'N':>3} {'R·N':>4} {'smooth':>7} {'tied':>9} {'worst node':<30} {'err/limit':>9}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            w = r.report.worst()
            tied = sum(x.ok for x in r.report.nodes)
            smooth = "-" if r.smooth is None else ("yes" if r.smooth else "NO")
            lines.append(f"{r.replicas:>3} {r.per_replica:>3} {r.global_batch:>4} {smooth:>7} "
                         f"{f'{tied}/{len(r.report.nodes)}':>9} {w.name:<30} {r.ratio:9.1e}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "ok": self.ok, "rows": [
            {"replicas": r.replicas, "per_replica": r.per_replica, "ratio": r.ratio, "ok": r.ok,
             "smooth": r.smooth, "tie": r.report.as_dict()} for r in self.rows]}


def photo_batch(batch: int, image_size: int, num_classes: int, *, seed: int = 0):
    """Photo crops in float64 and one-hot rows of the photo each was cut from (7 photos ≤ K)."""
    x, labels = data.photo_labels(batch, image_size, seed=seed)
    return jnp.asarray(x, jnp.float64), targets_matrix(jnp.asarray(labels), num_classes, jnp.float64)


def sweep(net, params, cfg, shapes: Sequence[tuple[int, int]], *, image_size: int = 32, seed: int = 0,
          label_smoothing: float = 0.0, devices=None, census: bool = True, progress: bool = True) -> SweepReport:
    """The mesh step at every (R, N) of `shapes` against the single-device float64 oracle at R·N
    (photo crops, one reference and envelope per global batch), with the smoothness census of each
    global batch when `census`. devices: the mesh's devices (a chapter passes the host CPU's)."""
    net = as_net(net)
    points: dict[int, Any] = {}
    rows = []
    for r, n in bar(list(shapes), desc="R·N sweep", enabled=progress):
        b = r * n
        if b not in points:
            x, t = photo_batch(b, image_size, cfg.num_classes, seed=seed)
            smooth = census_.smoothness(net, params, x, cfg).hypothesis(census_.PARAMETERS).holds if census else None
            points[b] = (x, t, reference_at(net, params, x, t, cfg, label_smoothing=label_smoothing), smooth)
        x, t, point, smooth = points[b]
        rep = tie_replicas(net, params, x, t, cfg, replicas=r, label_smoothing=label_smoothing, point=point,
                           devices=devices)
        rows.append(SweepRow(r, n, rep, smooth))
    return SweepReport(net.name, rows, {b: v[:3] for b, v in points.items()})
