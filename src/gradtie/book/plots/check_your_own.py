"""The Check your own backward chapter's figures: each function takes check results and returns a Figure."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ._style import CONTROL_COLOR, FIGSIZE, MIN_FONT, OK_COLOR, legend_below


def vjp_verdicts(cases: Sequence[tuple[str, Sequence]], names: Sequence[str] = (),
                 title: str = "check_vjp: the hand VJP sits under its limit at every argument;\n"
                              "the planted one fails at the argument it gets wrong") -> plt.Figure:
    """Horizontal bars of err/limit (log scale), one per argument of each case: `cases` holds
    (label, tie rows — a `VJPReport`'s or a `VJPMismatch`'s —); `names` the arguments' names
    (default: the rows' own, arg0, arg1, …). A row over its limit is red; the limit at 1."""
    bars = [(f"{label}: {names[i] if i < len(names) else r.name}", r.ratio)
            for label, rows in cases for i, r in enumerate(rows)]
    if not bars:
        raise ValueError("vjp_verdicts: no rows to draw")
    right = 1e15
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.5 + 0.3 * len(bars)))
    y = np.arange(len(bars))[::-1]
    colors = [CONTROL_COLOR if not b[1] <= 1 else OK_COLOR for b in bars]
    # the axis reaches down to the smallest ratio drawn; a ratio of exactly 0 is said in words
    lo = min([1e-8] + [b[1] / 10 for b in bars if 0 < b[1] < np.inf])
    ax.barh(y, [min(max(b[1], lo * 1e-3), right) for b in bars], color=colors, height=0.6, left=lo * 1e-3)
    for yi, b in zip(y, bars):
        if b[1] == 0:
            ax.text(lo * 1.5, yi, "0: the oracle's value exactly", va="center", fontsize=MIN_FONT, color=OK_COLOR)
    ax.axvline(1.0, color="k", lw=1, ls="--", label="the limit (10 × the point's envelope, floored)")
    ax.set_xscale("log")
    ax.set_xlim(lo, right)
    ax.set_ylim(-0.6, len(bars) - 0.4)
    ax.set_yticks(y, [b[0] for b in bars], fontsize=MIN_FONT)
    ax.set_xlabel("error of the hand cotangent ÷ its limit")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(fig, ncol=3, handles=handles + [Patch(color=OK_COLOR), Patch(color=CONTROL_COLOR)],
                 labels=labels + ["within it", "over it"])
    return fig
