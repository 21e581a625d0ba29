"""SyncBf16's exact difference, against the mesh's bits.

`DataParallel.SyncBf16` (`den_allReduceMeanF_convWeightGradBBf16_sub_global` and its strided peer)
states, with no bound, the difference between the all-reduced bf16 weight gradient G of R replicas
and the one-device bf16 node at R·N over R:

    G − rnd(Σ_r S_r)/R = (1/R)·(Σ_r rnd(S_r) − rnd(Σ_r S_r)),

S_r being replica r's contraction at its rounded operands. So the statement predicts G from the
one-device node and the replicas' partial sums: P = rnd(Σ_r S_r)/R + (1/R)(Σ_r rnd(S_r) − rnd(Σ_r S_r)).
Every term is a bf16 value or a sum of R of them, exact in float64; the mesh's float32 all-reduce
rounds once at R = 2 (a sum of two, then a power of two), so P rounded to float32 must be G bit
for bit. The controls drop a piece of the formula: without the difference term P is the one-device
node (the rounding outside the replica sum), and without the per-replica rounding it is
(1/R)·Σ_r S_r; both must miss G's bits.

The partial sums S_r are recomputed from the operands each replica's kind read (`checks.bf16`):
where the kind sums in its own order (patches · weights with bf16-typed operands), its rnd(S_r) may
sit a bf16 ulp from the recomputed one at a few entries, a float32 summation order the statement
(over ℝ) does not see; those sites are reported apart. Shown in: Data-parallel tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks.bf16.replicas import ReplicaReport


@dataclass(frozen=True)
class ExactRow:
    name: str                # the conv weight node
    entries: int
    same_sums: bool          # every replica's node is the recomputed rnd(S_r) bit for bit
    exact: int               # entries where the prediction, rounded to float32, is G bit for bit
    no_term: int             # the control without the difference term: rnd(Σ_r S_r)/R
    no_rounding: int         # the control without the per-replica rounding: (1/R)·Σ_r S_r
    nonzero: int             # entries where the difference (1/R)(Σ_r rnd(S_r) − rnd(Σ_r S_r)) is not 0


@dataclass
class ExactReport:
    net: str
    replicas: int
    rows: list[ExactRow]

    def at(self, same_sums: bool) -> list[ExactRow]:
        return [r for r in self.rows if r.same_sums == same_sums]

    @property
    def exact(self) -> bool:
        """The prediction is G bit for bit at every entry of every node whose sums the kind and the
        recomputation share."""
        return all(r.exact == r.entries for r in self.at(True))

    @property
    def controls_red(self) -> bool:
        """Each control misses G's bits at some entry of every node."""
        return all(r.no_term < r.entries and r.no_rounding < r.entries for r in self.rows)

    def share(self, field: str, rows=None) -> float:
        rows = self.rows if rows is None else rows
        return sum(getattr(r, field) for r in rows) / max(sum(r.entries for r in rows), 1)

    def summary(self) -> str:
        same, other = self.at(True), self.at(False)
        line = (f"{self.net}, R = {self.replicas}: the formula predicts G bit for bit at "
                f"{sum(r.exact == r.entries for r in same)}/{len(same)} nodes whose sums the kind shares "
                f"({self.share('exact', same):.2%} of their entries)")
        if other:
            line += (f"; at the {len(other)} nodes the kind sums in its own order: "
                     f"{self.share('exact', other):.2%} of entries")
        return (line + f"; controls: without the difference term {self.share('no_term'):.1%} of entries, "
                f"without the per-replica rounding {self.share('no_rounding'):.1%}")

    def table(self) -> str:
        head = f"{'node':<30} {'entries':>8} {'shared sums':>11} {'exact':>8} {'no term':>8} {'no rnd':>8} {'F ≠ 0':>7}"
        return "\n".join([head, "-" * len(head)] + [
            f"{r.name + '.weight':<30} {r.entries:>8} {'yes' if r.same_sums else 'no':>11} {r.exact / r.entries:8.2%} "
            f"{r.no_term / r.entries:8.2%} {r.no_rounding / r.entries:8.2%} {r.nonzero / r.entries:7.1%}"
            for r in self.rows])


def exact_difference(replica_report: ReplicaReport) -> ExactReport:
    """SyncBf16's formula against the mesh's bits, node by node, from `checks.bf16.replicas
    .mesh_replica_sum`'s report (its arrays: G, Σ_r S_r, Σ_r rnd(S_r), rnd(Σ_r S_r), float64)."""
    rep, rows = replica_report, []
    if rep.replicas != 2:
        raise ValueError(f"exact_difference: the float32 all-reduce rounds once only at R = 2, got R = {rep.replicas}")
    for row in rep.rows:
        a, r = rep.arrays[row.name], rep.replicas
        g32 = a["g"].astype(np.float32)

        def hits(prediction):
            return int(np.sum(prediction.astype(np.float32) == g32))

        formula = (a["replica_rounded"] - a["rounded_sum"]) / r
        rows.append(ExactRow(row.name, int(g32.size), row.nodes_rounded, hits(a["rounded_sum"] / r + formula),
                             hits(a["rounded_sum"] / r), hits(a["sum"] / r), int(np.sum(formula != 0))))
    return ExactReport(rep.net, rep.replicas, rows)
