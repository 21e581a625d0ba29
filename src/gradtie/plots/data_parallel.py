"""The Data-parallel tie chapter's figures: functions take reports and return a Figure.

Synchronised BatchNorm in blue, the
per-replica control in red. Shown in: Data-parallel tie.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..checks.tie import TieReport
from ..checks.tolerances import CHAN_FACTOR
from ..parallel import UNIT_ROUNDOFF, DriftReport
from ._style import CONTROL_COLOR, FIGSIZE, OK_COLOR

SYNC_SHADES = ("#9ecae1", "#4292c6", "#08519c", "#08306b")   # light → dark as R grows


def figure_tie(reports: Sequence[TieReport], control: TieReport) -> plt.Figure:
    """Per-node relative error against one device: every synchronised R (blues) sits at round-off,
    far under the limit; per-replica BatchNorm (red) misses by order one."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    names = [r.name for r in control.rows]
    idx = np.arange(len(names))
    floor = 1e-18   # exact agreement (error 0) drawn at the bottom of the log axis
    for i, rep in enumerate(reports):
        rel = np.array([max(r.rel, floor) for r in rep.rows])
        ax.semilogy(idx, rel, "o", ms=3.5, color=SYNC_SHADES[min(i, len(SYNC_SHADES) - 1)],
                    label=f"sync BN, R = {rep.replicas} × N = {rep.per_replica}")
    rel = np.array([max(r.rel, floor) for r in control.rows])
    ax.semilogy(idx, rel, "x", ms=5, color=CONTROL_COLOR,
                label=f"per-replica BN (control), R = {control.replicas}")
    ax.axhline(control.rows[0].limit, color="0.3", ls="--", lw=1, label="limit (float64)")
    ax.set_xlabel(f"node (signature order; last: input gradient) of {control.net}")
    ax.set_ylabel("max |data parallel − one device| / scale")
    ax.set_title("Synchronised BN ties every node; per-replica BN does not")
    ax.set_ylim(floor / 2, 1e2)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
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
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
