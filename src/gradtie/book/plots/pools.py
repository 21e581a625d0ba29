"""The Pools chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from gradtie.checks.census import CLASSES
from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR


CLASS_COLORS = {"dead": "0.65", "strict": OK_COLOR, "twin tie": "tab:green", "non-twin tie": CONTROL_COLOR}


def pool_census(reports: dict, title: str = "Photos: dead and strict windows; flat images: twin ties; "
                                              "no non-twin tie") -> plt.Figure:
    """Stacked bars: each window class's share of every pool, for labelled censuses
    ({"cifar8, photos": census.SmoothReport, …}); non-twin ties in red."""
    rows = [(f"{label}: {p.pool}", p.counts, p.windows) for label, r in reports.items() for p in r.pools]
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.2 + 0.32 * len(rows)))
    y = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for cls in CLASSES:
        share = np.array([counts[cls] / n for _, counts, n in rows])
        ax.barh(y, share, left=left, color=CLASS_COLORS[cls], label=cls, height=0.8)
        left += share
    ax.set_yticks(y, [label for label, _, _ in rows], fontsize=MIN_FONT)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the pool's windows (examples × channels × output cells)")
    ax.set_title(title, fontsize=10)
    ax.legend(ncol=4, fontsize=MIN_FONT, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)))
    fig.tight_layout()
    return fig


def selection_example(x: np.ndarray, dy: np.ndarray, dx_first: np.ndarray, dx_last: np.ndarray) -> plt.Figure:
    """One channel of a 2×2/s2 pool: its input (ties included), the rendered backward (= selScatter at
    σ = argmax) and, in red, selScatter at the last maximal cell, which is not the backward."""
    fig, axes = plt.subplots(1, 4, figsize=(MAX_WIDTH, 2.6))
    panels = [(x, "pool input x (ties)", "black"), (dy, "cotangent dy per window", "black"),
              (dx_first, "backward = selScatter(σ = first max)", OK_COLOR),
              (dx_last, "selScatter(last max): control", CONTROL_COLOR)]
    for ax, (a, label, color) in zip(axes, panels):
        ax.imshow(a, cmap="Greys" if a is x else "RdBu", vmin=None if a is x else -np.max(np.abs(dy)),
                  vmax=None if a is x else np.max(np.abs(dy)))
        for (i, j), v in np.ndenumerate(a):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=MIN_FONT,
                    color="tab:orange" if a is x else "black")
        step = 1 if a is dy else 2
        for k in np.arange(-0.5, a.shape[0], step):
            ax.axhline(k, color="0.3", lw=0.8)
            ax.axvline(k, color="0.3", lw=0.8)
        ax.set_title(label, fontsize=MIN_FONT, color=color)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("The backward routes each window's cotangent to its FIRST maximal cell", fontsize=10)
    fig.tight_layout()
    return fig


def window_grids(size: int, spans: dict) -> plt.Figure:
    """The diagonal windows (i, i) of pools on a size×size input. spans: {label: (first_rows,
    last_rows)} per output index, as measured (rows outside 0…size−1 are padding). The XLA 'SAME'
    panel is the control, in red."""
    fig, axes = plt.subplots(1, len(spans), figsize=(MAX_WIDTH, 3.2))
    colors = plt.get_cmap("tab10")
    for ax, (label, (first, last)) in zip(np.atleast_1d(axes), spans.items()):
        lo = min(-1, int(np.min(first)))
        hi = max(size, int(np.max(last)) + 1)
        ax.add_patch(plt.Rectangle((lo - 0.5, lo - 0.5), hi - lo, hi - lo, color="0.9", hatch="//", fill=False))
        ax.add_patch(plt.Rectangle((-0.5, -0.5), size, size, facecolor="white", edgecolor="black"))
        for k in range(size + 1):
            ax.plot([-0.5, size - 0.5], [k - 0.5, k - 0.5], color="0.8", lw=0.6)
            ax.plot([k - 0.5, k - 0.5], [-0.5, size - 0.5], color="0.8", lw=0.6)
        for i, (a, b) in enumerate(zip(first, last)):
            ax.add_patch(plt.Rectangle((a - 0.5 + 0.08 * i, a - 0.5 + 0.08 * i), b - a + 1 - 0.16 * i,
                                       b - a + 1 - 0.16 * i, fill=False, lw=1.8, edgecolor=colors(i)))
        ax.set_xlim(lo - 0.7, hi - 0.3)
        ax.set_ylim(hi - 0.3, lo - 0.7)
        ax.set_aspect("equal")
        ax.set_xticks(range(0, size, 2))
        ax.set_yticks(range(0, size, 2))
        ax.set_xlabel("column")
        ax.set_ylabel("row")
        ax.set_title(label, fontsize=9, color=CONTROL_COLOR if "SAME" in label else "black")
    fig.suptitle(f"Windows (i, i) on a {size}×{size} input (hatched: padding): "
                 "XLA 'SAME' sits one cell off the pad-1 pool", fontsize=10)
    fig.tight_layout()
    return fig


def routing_nodes(reports: dict, limit: float) -> plt.Figure:
    """Per parameter node, max|g − g′| relative to the node (zero-in-ℝ nodes: to the net's largest)
    after rerouting tied windows ({label: census.RoutingReport}; labels with "non-twin" in red), and
    the same for the input gradient; exact zeros sit on the floor."""
    floor = 1e-18
    fig, ax = plt.subplots(figsize=(MAX_WIDTH, FIGSIZE[1]))
    for k, (label, r) in enumerate(reports.items()):
        color = CONTROL_COLOR if "non-twin" in label else OK_COLOR
        names = list(r.nodes)
        vals = np.maximum([r.nodes[n] for n in names] + [r.dx_rel], floor)
        xs = np.arange(len(vals)) + 0.25 * (k - (len(reports) - 1) / 2)   # side by side, not on top
        ax.semilogy(xs[:-1], vals[:-1], "o", color=color, ms=4, label=f"{label}: parameter nodes")
        ax.semilogy(xs[-1:], vals[-1:], "s", color=color, ms=8, mfc="none", label=f"{label}: input gradient")
    ax.axhline(limit, color="black", ls="--", lw=1, label=f"round-off bound {limit:.0e}")
    ax.set_xticks(np.arange(len(vals)), names + ["input"], rotation=90, fontsize=MIN_FONT)
    ax.set_ylabel("max |g − g′| (relative)")
    ax.set_ylim(floor / 3, 10)
    ax.set_title("Rerouting twin ties moves only the input gradient; rerouting non-twin ties moves "
                 "parameter nodes", fontsize=10)
    ax.legend(fontsize=MIN_FONT, loc="center left")
    fig.tight_layout()
    return fig


def one_sided_slopes(reports: dict) -> plt.Figure:
    """The loss along t·v (a unit direction; t in units of the radius to the next kink) minus the mean
    of the one-sided slopes, one panel per labelled `census.SlopeReport`: O(t²) where the loss is
    differentiable, a V of slope ±½(right − left) at a kink. Labels with "non-twin" are the control,
    in red."""
    fig, axes = plt.subplots(1, len(reports), figsize=(MAX_WIDTH, 3.6))
    for ax, (label, s) in zip(np.atleast_1d(axes), reports.items()):
        color = CONTROL_COLOR if "non-twin" in label else OK_COLOR
        mean = 0.5 * (s.left + s.right)
        ax.plot(s.ts / s.radius, s.losses - mean * s.ts, "o-", color=color, ms=3, lw=1,
                label="L(θ+tv) − L(θ) − s̄·t,  s̄ = ½(left + right)")
        ax.plot(s.ts / s.radius, 0.5 * s.jump * np.abs(s.ts), "k--", lw=1, label="½(right − left)·|t|")
        ax.axvline(0, color="0.7", lw=0.8)
        ax.set_xlabel("t / r   (r: first-order distance to the next kink)", fontsize=MIN_FONT)
        ax.set_title(f"{label}, r = {s.radius:.1e}\nleft slope {s.left:.3f}, right slope {s.right:.3f}",
                     fontsize=9, color=color)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(fontsize=MIN_FONT)
    np.atleast_1d(axes)[0].set_ylabel("loss minus the mean slope (nats)")
    fig.suptitle("A twin tie leaves the loss smooth; a non-twin tie puts a kink in it", fontsize=10)
    fig.tight_layout()
    return fig


def hypotheses_grid(points: dict, title: str = "Which smooth-point hypothesis holds where") -> plt.Figure:
    """A grid: one row per point, one column per (net, hypothesis); a cell is blue where the
    hypothesis holds and red where it fails, with each broken clause and the windows or cells
    that break it.
    points: {point label: {net label: census.SmoothReport}}, every row with the same nets."""
    first = next(iter(points.values()))
    columns = [(net, h.key, f"{net}\n{h.name}\n({h.lean})") for net, r in first.items() for h in r.hypotheses]
    fig, ax = plt.subplots(figsize=(MAX_WIDTH, 1.4 + 0.75 * len(points)))
    for i, (label, reports) in enumerate(points.items()):
        for j, (net, key, _) in enumerate(columns):
            h = reports[net].hypothesis(key)
            color = OK_COLOR if h.holds else CONTROL_COLOR
            ax.add_patch(plt.Rectangle((j, i), 0.96, 0.92, color=color, alpha=0.85))
            broken = [f"{c.name.split(' (')[0]}: {c.violated:,}" for c in h.clauses if not c.holds]
            text = "holds" if h.holds else "fails\n" + "\n".join(broken)
            ax.text(j + 0.48, i + 0.46, text, ha="center", va="center", fontsize=MIN_FONT, color="white")
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(points), 0)
    ax.set_xticks(np.arange(len(columns)) + 0.48, [c[2] for c in columns], fontsize=MIN_FONT)
    ax.xaxis.tick_top()
    ax.set_yticks(np.arange(len(points)) + 0.46, list(points), fontsize=MIN_FONT)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=10, pad=12)
    fig.tight_layout()
    return fig
