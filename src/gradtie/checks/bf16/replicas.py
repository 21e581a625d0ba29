"""Replica sums: the all-reduced bf16 weight gradient is (1/R)·Σ_r rnd(S_r), not rnd(Σ_r S_r)/R.

The difference is exactly (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)], at most 2u·M, and 0 at the identity
rounding. Lean: `DataParallel.SyncBf16` (what the bf16 weight-gradient kinds do under sharding).
Shown in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ...ops import conv
from .kinds import QUICK, U_BF16, _need_x64, _widen
from .sites import Site

@dataclass(frozen=True)
class ReplicaRow:
    name: str
    replicas: int
    nodes_rounded: bool      # each replica's bf16 node is rnd(S_r), bit for bit (the kind's identity)
    max_diff_rel: float      # max |mean_r rnd(S_r) − rnd(Σ_r S_r)/R| / M (M: the node's magnitude sum)
    differing: float         # fraction of entries where the two differ
    identity_zero: bool      # at rnd = identity the difference is exactly 0

    @property
    def ok(self) -> bool:
        """The difference (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)] is at most (1/R)(u·Σ_r|S_r| + u·|Σ_r S_r|)
        ≤ 2u·M: each of the R + 1 roundings moves a value by at most u of its size."""
        return bool(self.nodes_rounded and self.identity_zero and self.max_diff_rel <= 2 * U_BF16)


@partial(jax.jit, static_argnames=("kernel_size", "stride", "replicas", "rnd"), compiler_options=QUICK)
def _replica_nodes(x, dy, *, kernel_size, stride, replicas, rnd):
    """Per replica r: its bf16 weight-gradient node and S_r, its float32 contraction at rounded
    operands. The batch splits into R equal shards; a replica divides its loss by its own N, so its
    cotangent is R times its shard of the single-device one."""
    m = x.shape[0] // replicas
    nodes, partials = [], []
    for r in range(replicas):
        xr, dyr = x[r * m:(r + 1) * m], replicas * dy[r * m:(r + 1) * m]
        nodes.append(conv.grad_weight(xr, dyr, kernel_size=kernel_size, stride=stride, rnd=rnd))
        partials.append(conv.grad_weight(_widen(rnd(xr), x.dtype), _widen(rnd(dyr), x.dtype),
                                         kernel_size=kernel_size, stride=stride))
    mag = conv.grad_weight(jnp.abs(x.astype(jnp.float64)), jnp.abs(dy.astype(jnp.float64)),
                           kernel_size=kernel_size, stride=stride)
    return jnp.stack(nodes), jnp.stack(partials), mag


def replica_difference(x, dy, *, kernel_size: int, stride: int, replicas: int, rnd) -> dict[str, np.ndarray]:
    """The all-reduced bf16 weight gradient mean_r rnd(S_r) against rnd(Σ_r S_r)/R, in float64,
    where R bf16 values and R float32 values sum exactly."""
    _need_x64("the replica sum")
    if replicas < 1 or x.shape[0] % replicas:
        raise ValueError(f"replica sum: batch {x.shape[0]} does not split into {replicas} equal shards")
    nodes, partials, mag = _replica_nodes(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=rnd)
    rnd64 = conv.identity if rnd is conv.identity else conv.round_bf16   # rnd on float64 values
    nodes, s = np.asarray(nodes, np.float64), np.asarray(partials, np.float64)
    rounded = np.asarray(rnd64(jnp.asarray(s)))                       # rnd(S_r)
    mean_of_rounded = nodes.sum(0) / replicas                          # what the all-reduce returns
    rounded_of_sum = np.asarray(rnd64(jnp.asarray(s.sum(0)))) / replicas
    return {"nodes": nodes, "rounded": rounded, "mean_of_rounded": mean_of_rounded,
            "rounded_of_sum": rounded_of_sum, "diff": mean_of_rounded - rounded_of_sum,
            "formula": (rounded.sum(0) - np.asarray(rnd64(jnp.asarray(s.sum(0))))) / replicas,
            "mag": np.asarray(mag)}


def replica_sum(name: str, x, dy, *, kernel_size: int, stride: int, replicas: int, rnd=conv.round_bf16):
    """One weight-gradient site split over R replicas -> (ReplicaRow, the arrays under `rnd`)."""
    d = replica_difference(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=rnd)
    d_id = replica_difference(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=conv.identity)
    live = d["mag"] > 0
    rel = np.abs(d["diff"][live]) / d["mag"][live]
    row = ReplicaRow(name, replicas, bool(np.array_equal(d["nodes"], d["rounded"])), float(rel.max(initial=0.0)),
                     float(np.mean(d["diff"] != 0)), bool(np.all(d_id["diff"] == 0)))
    return row, d


def replica_rows(sites: list[Site], replicas: int, rnd) -> tuple[list[ReplicaRow], dict[str, dict]]:
    """Every weight-gradient site of a net, split over R replicas."""
    rows, arrays = [], {}
    for s in sites:
        if s.op == "grad_weight":
            row, arrays[s.name] = replica_sum(s.name, s.a, s.b, kernel_size=s.kernel_size, stride=s.stride,
                                              replicas=replicas, rnd=rnd)
            rows.append(row)
    return rows, arrays

