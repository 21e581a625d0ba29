"""The Head fold chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR


def fold_row(steps, example: int = 0) -> plt.Figure:
    """One example of `checks.head.FoldSteps`: p and t̃ side by side per class, and N·dy = p − t̃."""
    k = np.arange(steps.k)
    t_smooth = (1 - steps.alpha) * steps.targets[example] + steps.alpha / steps.k
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(MAX_WIDTH, 3.4))
    ax0.bar(k - 0.2, steps.p[example], width=0.4, color=OK_COLOR, label="p = softmaxRow(z)")
    ax0.bar(k + 0.2, t_smooth, width=0.4, color="0.6", label="t̃ = (1−α)t + α/K")
    ax0.set_xlabel("class k")
    ax0.set_ylabel("probability")
    ax0.legend(fontsize=MIN_FONT)
    ax1.bar(k, steps.n * steps.dy[example], color=OK_COLOR, label="N·dy (the six kit ops)")
    ax1.plot(k, steps.p[example] - t_smooth, "k_", ms=18, mew=2, label="p − t̃")
    ax1.axhline(0, color="0.5", lw=0.8)
    ax1.set_xlabel("class k")
    ax1.set_ylabel("cotangent × N")
    ax1.legend(fontsize=MIN_FONT)
    fig.suptitle(f"The fold lands on (p − t̃)/N (example {example}, N = {steps.n}, K = {steps.k}, "
                 f"α = {steps.alpha:g})", fontsize=10)
    fig.tight_layout()
    return fig


def fold_ties(tables: dict, limit: float,
              title: str = "The six kit ops equal ∂/∂z of the mean smoothed cross-entropy; "
                           "each planted bug goes red") -> plt.Figure:
    """Relative error against autodiff per row of labelled `checks.head.HeadTies`; rows over the
    limit (the planted bugs) in red, exact zeros at the left edge."""
    rows = [(f"{name}: {r.name}", r.rel, r.ok) for name, table in tables.items() for r in table.rows]
    floor = 1e-18
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.0 + 0.26 * len(rows)))
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [max(r, floor) - floor for _, r, _ in rows], left=floor, height=0.7,
            color=[OK_COLOR if ok else CONTROL_COLOR for _, _, ok in rows])
    for yi, (_, r, _) in zip(y, rows):
        if r == 0:
            ax.text(floor * 2, yi, "exact 0", va="center", fontsize=MIN_FONT, color=OK_COLOR)
    ax.axvline(limit, color="k", ls="--", lw=1, label=f"limit {limit:.0e} (float64 node vs autodiff)")
    ax.set_xscale("log")
    ax.set_xlim(floor, 1e2)
    ax.set_yticks(y, [label for label, _, _ in rows], fontsize=MIN_FONT)
    ax.set_xlabel("max |rendered − autodiff| / max |autodiff|   (exact zeros at the left edge)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=MIN_FONT, loc="lower right")
    fig.tight_layout()
    return fig


def smoothed_minimum(curve, upstream: float = 0.485) -> plt.Figure:
    """Loss vs logit margin for a one-hot target (`checks.head.MarginCurve`): the curve bottoms out
    at H(t̃) and never reaches the value upstream's book prints (in red); the inset zooms in."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    top, rest = 1 - curve.alpha + curve.alpha / curve.num_classes, curve.alpha / curve.num_classes
    for a in (ax, ax.inset_axes([0.45, 0.45, 0.35, 0.4])):
        a.plot(curve.margins, curve.losses, color=OK_COLOR, lw=1.5, label="smoothed loss at z = m·e_label")
        a.axhline(curve.entropy, color="k", ls="--", lw=1, label=f"H(t̃) = {curve.entropy:.4f} nats, the minimum")
        a.axhline(upstream, color=CONTROL_COLOR, ls=":", lw=1.5, label=f"upstream's {upstream}: never reached")
        a.plot([curve.best_margin], [curve.entropy], "ko", ms=4,
               label=f"m* = ln({top:.2f}/{rest:.2f}) = {curve.best_margin:.2f}")
    inset = ax.child_axes[0]
    inset.set_xlim(curve.best_margin - 1.5, curve.best_margin + 1.5)
    inset.set_ylim(upstream - 0.01, curve.entropy + 0.03)
    inset.tick_params(labelsize=MIN_FONT)
    ax.indicate_inset_zoom(inset, edgecolor="0.5")
    ax.set_ylim(0.4, min(2.5, float(np.max(curve.losses)) + 0.1))
    ax.set_xlabel("logit margin m (the label's logit above the others, which are 0)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"α = {curve.alpha:g}, K = {curve.num_classes}: the loss never goes below "
                 f"H(t̃) = {curve.entropy:.4f}; {upstream} is out of reach", fontsize=10)
    ax.legend(fontsize=MIN_FONT, loc="upper left")
    fig.tight_layout()
    return fig
