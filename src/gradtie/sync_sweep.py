"""The data-parallel tie swept over R·N: every split of a global batch tied to one device.

`r34_net_syncTiedB` quantifies over the batch: the all-reduced nodes of R replicas holding N
examples each ARE the single-device nodes at N := R·N, for every R and N. `sweep` runs the mesh
step (`tie.tie` on R replicas, the one verdict path) at several R and N, each against the float64
oracle and round-off envelope of its own global batch (one reference serves every split of the same
batch), and takes the smoothness census of each point (the statement is about smooth points).
Shown in: Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from . import data, parallel
from .checks import census as census_
from .checks.tie import TieReport, bn_cells, degenerate, reference_at, tie
from .nets.protocol import require_net
from .progress import bar


def splits(largest_replicas: int, largest_per_replica: int) -> list[tuple[int, int]]:
    """(R, N) for R = 1, 2, 4, … ≤ largest_replicas and N = 1, 2, 4, … ≤ largest_per_replica (R = 1: a
    mesh of one replica, the statement's R = 1)."""
    if largest_replicas < 1 or largest_per_replica < 1:
        raise ValueError(f"splits: need R ≥ 1 and N ≥ 1, got {largest_replicas} and {largest_per_replica}")
    ns = [n for n in (2 ** k for k in range(0, 13)) if n <= largest_per_replica]
    return [(r, n) for r in [1] + parallel.replica_counts(largest_replicas) for n in ns]


@dataclass
class SweepReport:
    """One `tie` report per split (meta: R "replicas", N "per_replica"); a split ties when
    every row agrees (within its limit and judgeable)."""
    net: str
    ties: list[TieReport]
    smooth_at: dict[int, bool]     # R·N -> the parameter-gradient hypothesis holds at that batch
    # (R, N) -> (BN layer, M = 1): a degenerate global batch, not judged (`tie.degenerate`), never "tied"
    degenerate: dict = field(default_factory=dict)
    # R·N -> (x, targets, `tie.Point`): for further ties at the same point (an uneven split, a control)
    points: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return all(t.tied for t in self.ties)

    @property
    def smooth(self) -> bool:
        return all(self.smooth_at.values())

    def summary(self) -> str:
        """Counts and pass/fail only: stable across machines (what a compared cell prints)."""
        shown = ", ".join(f"{t.meta['replicas']}×{t.meta['per_replica']}" for t in self.ties)
        nodes = {len(t.nodes) for t in self.ties}
        flat = "".join(f"; {r}×{n} degenerate (M = {m} at {layer}), not judged"
                       for (r, n), (layer, m) in self.degenerate.items())
        return (f"{self.net}: {sum(t.tied for t in self.ties)}/{len(self.ties)} splits tied ({shown}; R·N = "
                f"{', '.join(map(str, sorted(self.smooth_at)))}), every node of {'/'.join(map(str, nodes))} and the "
                f"loss within its limit" + flat + ("" if self.ok else "; FAILED"))


def sweep(net, params, cfg, shapes, *, image_size: int = 32, seed: int = 0, label_smoothing: float = 0.0,
          devices=None, progress: bool = True) -> SweepReport:
    """The mesh step at every (R, N) of `shapes` (R = 1 included: a mesh of one) against the
    single-device float64 oracle at R·N (photo crops, one reference, envelope and smoothness census
    per global batch). A global batch where a BatchNorm layer averages M = 1 cell is degenerate:
    reported, not tied. devices: the mesh's devices (default `jax.devices()`)."""
    require_net(net, "sync_sweep.sweep")
    points, smooth_at, ties, flat = {}, {}, [], {}
    for r, n in bar(list(shapes), desc="R·N sweep", enabled=progress):
        b = r * n
        x, t = data.photo_batch(b, image_size, cfg.num_classes, seed=seed)
        if (where := degenerate(bn_cells(net, params, x, cfg))) is not None:
            flat[r, n] = where
            continue
        if b not in points:
            smooth_at[b] = census_.smoothness(net, params, x, cfg).hypothesis(census_.PARAMETERS).holds
            points[b] = (x, t, reference_at(net, params, x, t, cfg, label_smoothing=label_smoothing))
        x, t, point = points[b]
        ties.append(tie(point, replicas=r, devices=list(jax.devices()) if devices is None else devices))
    return SweepReport(net.name, ties, smooth_at, degenerate=flat, points=points)
