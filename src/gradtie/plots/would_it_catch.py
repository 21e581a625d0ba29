"""The Would the check catch it? chapter's figures: each function takes reports and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ._style import CONTROL_COLOR, FIGSIZE, OK_COLOR


def caught(reports, title: str = "Every planted bug fails its first node by orders of magnitude; "
                                  "the real chain sits below 1") -> plt.Figure:
    """Horizontal bars of err/limit at the first failing node (log scale), one per bug and net, the
    planted bugs in red; each net's real chain (its worst row) in blue; the limit at 1."""
    rows = []
    for rep in reports:
        worst = rep.real.worst()
        rows.append((f"{rep.net}: real chain", worst.rel / worst.limit, OK_COLOR))
        # a node of the wrong shape has no ratio (inf): drawn at the axis' end
        rows += [(f"{rep.net}: {c.bug}", min(max(c.ratio, 1e-12), 1e13), CONTROL_COLOR) for c in rep.caught]
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.0 + 0.22 * len(rows)))
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [r[1] for r in rows], color=[r[2] for r in rows], height=0.7, left=1e-12)
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=1, ls="--", label="the limit (10 × the point's envelope, floored)")
    ax.set_yticks(y, [r[0] for r in rows], fontsize=7)
    ax.set_xlabel("error at the first failing node ÷ its limit (real chain: its worst row)")
    ax.set_xlim(1e-8, 1e13)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
