"""The Data-parallel tie chapter's figures: functions take reports and return a Figure.

Synchronised BatchNorm in blues, uneven replica batches in green, controls in red. Shown in:
Data-parallel tie.
"""

from __future__ import annotations

from typing import Mapping

import matplotlib.pyplot as plt
import numpy as np

from gradtie.checks.bf16.kinds import U_BF16
from gradtie.checks.bf16.replicas import MeshReplicaReport
from gradtie.sync_sweep import SweepReport
from gradtie.checks.tie import TieReport
from gradtie.tolerances import CHAN_FACTOR
from gradtie.parallel import UNIT_ROUNDOFF, DriftReport
from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR, legend_below

SYNC_SHADES = ("#9ecae1", "#4292c6", "#08519c", "#08306b")   # light → dark as R grows
UNEVEN_COLOR = "#238b45"
FLOOR = 1e-8   # err/limit of an exact agreement (error 0), drawn at the bottom of the log axis


def figure_sweep(report: SweepReport) -> plt.Figure:
    """The worst row's error over its limit at every split R × N, against R·N: all under 1."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    points = [(t.meta["replicas"], t.meta["per_replica"], max(t.worst().ratio, FLOOR)) for t in report.ties]
    for i, rep in enumerate(sorted({r for r, _, _ in points})):
        rows = [(r * n, n, ratio) for r, n, ratio in points if r == rep]
        ax.semilogy([b for b, _, _ in rows], [ratio for _, _, ratio in rows], "o-", ms=6,
                    color=SYNC_SHADES[min(i + 1, len(SYNC_SHADES) - 1)], label=f"R = {rep} replicas")
        for b, n, ratio in rows:
            ax.annotate(f"N = {n}", (b, ratio), fontsize=MIN_FONT, xytext=(4, 4), textcoords="offset points")
    ax.axhline(1.0, color=CONTROL_COLOR, ls="--", lw=1, label="limit (10 × the point's envelope)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch R·N (the single-device batch each split is tied to)")
    ax.set_ylabel("worst row: error / limit")
    ax.set_title(f"{report.net}: every split R × N ties to one device at R·N")
    ax.set_ylim(min(FLOOR, min(t.worst().ratio for t in report.ties) / 3), 10)
    legend_below(fig, ncol=3)
    return fig


def figure_nodes(reports: Mapping[str, TieReport]) -> plt.Figure:
    """Per row (loss, every node in signature order, the input gradient) its error over its limit:
    the synchronised and uneven steps sit far under 1, the controls far over it."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    styles = [("o", SYNC_SHADES[2]), ("s", UNEVEN_COLOR), ("x", CONTROL_COLOR), ("+", "#a50f15")]
    first = next(iter(reports.values()))
    idx = np.arange(len(first.rows))
    for (label, rep), (marker, color) in zip(reports.items(), styles):
        ratio = np.array([max(r.rel / r.limit, FLOOR) for r in rep.rows])
        ax.semilogy(idx, ratio, marker, ms=4, color=color, label=label, mfc="none" if marker == "s" else None)
    ax.axhline(1.0, color="0.3", ls="--", lw=1, label="limit")
    ax.set_xlabel(f"row of {first.net.split(' ')[0]}: loss, the nodes in signature order, the input gradient")
    ax.set_ylabel("error / limit")
    ax.set_title("Synchronised BN ties at equal and uneven splits; the controls do not")
    legend_below(fig, ncol=2)
    return fig


def figure_sync_bf16(report: MeshReplicaReport) -> plt.Figure:
    """Per conv weight node of the bf16 mesh step: how far (1/R)·Σ_r rnd(S_r) sits from
    rnd(Σ_r S_r)/R (left, in units of its bound 2u·M) and how many entries differ (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(MAX_WIDTH, 1.8 + 0.2 * len(report.rows)), sharey=True)
    names = [r.name for r in report.rows]
    idx = np.arange(len(names))
    left.barh(idx, [r.max_diff_rel / (2 * U_BF16) for r in report.rows], color=SYNC_SHADES[2])
    left.axvline(1.0, color=CONTROL_COLOR, ls="--", lw=1, label="bound 2u·M")
    left.set_xlabel("max |(1/R)Σ rnd(S_r) − rnd(Σ S_r)/R| / (2u·M)")
    right.barh(idx, [100 * r.differing for r in report.rows], color=OK_COLOR)
    right.set_xlabel("entries where the two differ (%)")
    left.set_yticks(idx)
    left.set_yticklabels(names, fontsize=MIN_FONT)
    left.invert_yaxis()
    fig.suptitle(f"{report.net} on {report.replicas} replicas, bf16 flag: the all-reduce averages\n"
                 f"rounded replica nodes, not a rounded sum", fontsize=10)
    legend_below(fig, ncol=1)
    return fig


def figure_drift(report: DriftReport) -> plt.Figure:
    """Relative error of the global variance against float64, as the mean grows: Chan's combine
    grows like u·μ/σ, the one-round E[x²] − μ² like u·(μ/σ)² and loses every digit."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    u = UNIT_ROUNDOFF[report.dtype]
    k = np.array([r.offset for r in report.rows])
    floor = u / 16
    ax.loglog(k, [max(r.chan, floor) for r in report.rows], "o-", color=OK_COLOR,
              label="Chan: mean_r[σ_r² + (μ_r − μ)²]")
    ax.loglog(k, [max(r.one_round, floor) for r in report.rows], "s-", color=CONTROL_COLOR,
              label="one round: E[x²] − μ²")
    ax.loglog(k, CHAN_FACTOR * u * (1 + k), ":", color=OK_COLOR, lw=1,
              label=f"{CHAN_FACTOR:g}·u·(1 + μ/σ)  (Chan's bound)")
    ax.loglog(k, u * k ** 2, ":", color=CONTROL_COLOR, lw=1, label="u·(μ/σ)²")
    ax.axhline(1.0, color="0.3", ls="--", lw=1, label="100 % error")
    ax.set_xlabel("mean / standard deviation of the data, μ/σ")
    ax.set_ylabel(f"relative error of σ² ({report.dtype})")
    ax.set_title(f"E[x²] − μ² drifts as μ/σ grows; Chan's combine stays near {report.dtype} precision")
    legend_below(fig, ncol=2)
    return fig
