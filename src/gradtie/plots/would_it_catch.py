"""The Would the check catch it? chapter's figures: each function takes reports and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ._style import CONTROL_COLOR, FIGSIZE, MIN_FONT, OK_COLOR, legend_below


def caught(reports, title: str = "Every planted bug fails its first node by orders of magnitude; "
                                  "the real chain sits below 1") -> plt.Figure:
    """Horizontal bars of err/limit at the first failing node (log scale), one per bug and net, the
    planted bugs in red; each net's real chain (its worst row) in blue; the limit at 1."""
    rows = []
    for rep in reports:
        worst = rep.real.worst()
        rows.append((f"{rep.net}: real chain", worst.rel / worst.limit, OK_COLOR))
        rows += [(f"{rep.net}: {c.bug}", c.ratio, CONTROL_COLOR) for c in rep.caught]
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
    ax.set_xlabel("error at the first failing node ÷ its limit (real chain: its worst row)")
    ax.set_xlim(1e-8, right)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(color=OK_COLOR), Patch(color=CONTROL_COLOR)]
    labels += ["the real chain", "a planted bug"]
    legend_below(fig, ncol=3, handles=handles, labels=labels)
    return fig
