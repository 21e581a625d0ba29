"""The Would the check catch it? chapter's figures: each function takes reports and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ._style import CONTROL_COLOR, FIGSIZE, MIN_FONT, OK_COLOR, legend_below


def caught(reports, title: str = "Every planted bug fails its first node by orders of magnitude;\n"
                                  "the real chain sits below 1") -> plt.Figure:
    """Horizontal bars of err/limit at the first failing node (log scale), one per bug and net, the
    planted bugs in red; each net's real chain (its worst row) in blue; the limit at 1."""
    rows = []
    for rep in reports:   # each net's real chain heads its group, its bugs follow by name alone
        worst = rep.real.worst()
        rows.append((f"{rep.net}: real chain", worst.rel / worst.limit, OK_COLOR))
        rows += [(c.bug, c.ratio, CONTROL_COLOR) for c in rep.caught]
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.6 + 0.24 * len(rows)))
    y = np.arange(len(rows))[::-1]
    # a node of the wrong shape has no ratio (inf): drawn to the axis' end and labelled
    right = 1e15
    ax.barh(y, [min(max(r[1], 1e-12), right) for r in rows], color=[r[2] for r in rows], height=0.7, left=1e-12)
    for yi, r in zip(y, rows):
        if not np.isfinite(r[1]):
            ax.text(right / 3, yi, "wrong shape", ha="right", va="center", fontsize=MIN_FONT, color="white")
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=1, ls="--", label="the limit (10 × the point's envelope, floored)")
    ax.set_yticks(y, [r[0] for r in rows], fontsize=MIN_FONT)
    for yi, r in zip(y, rows):
        if r[2] == OK_COLOR and yi != y[0]:
            ax.axhline(yi + 0.5, color="0.6", lw=0.8)
    ax.set_xlabel("error at the first failing node ÷ its limit (real chain: its worst row)")
    ax.set_xlim(1e-8, right)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(color=OK_COLOR), Patch(color=CONTROL_COLOR)]
    labels += ["the real chain", "a planted bug"]
    legend_below(fig, ncol=3, handles=handles, labels=labels)
    return fig


def overview(reports, title: str = "Real chains sit under their limits; every planted bug lands\n"
                                    "orders of magnitude over") -> plt.Figure:
    """One row per point (net, or net on a mesh): each planted bug's error over its limit at its
    first failing node (red dots), the real chain's worst row (blue diamond), the limit at 1."""
    right = 1e15
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.9 + 0.6 * len(reports)))
    jitter = np.random.default_rng(0)
    for i, rep in enumerate(reports):
        y = len(reports) - 1 - i
        ratios = np.array([min(max(c.ratio, 1e-12), right / 3) for c in rep.caught])   # inf: a wrong shape
        ax.scatter(ratios, y + jitter.uniform(-0.18, 0.18, ratios.size), s=22, color=CONTROL_COLOR, alpha=0.8,
                   label="a planted bug (its first failing node)" if i == 0 else None)
        worst = rep.real.worst()
        ax.scatter([max(worst.rel / worst.limit, 1e-12)], [y], marker="D", s=48, color=OK_COLOR, zorder=3,
                   label="the real chain (its worst node)" if i == 0 else None)
    ax.axvline(1.0, color="k", lw=1, ls="--", label="the limit")
    ax.set_xscale("log")
    ax.set_xlim(1e-8, right)
    ax.set_ylim(-0.6, len(reports) - 0.4)
    ax.set_yticks(range(len(reports))[::-1], [f"{rep.net}\n{len(rep.caught)} bugs" for rep in reports],
                  fontsize=MIN_FONT)
    ax.set_xlabel("error ÷ its limit (10 × the point's round-off envelope)")
    ax.set_title(title, fontsize=10)
    legend_below(fig, ncol=2)
    return fig
