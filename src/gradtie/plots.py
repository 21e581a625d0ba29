"""Every figure a chapter draws: functions take a report and return a matplotlib Figure.

One message per figure, said in its title; labelled axes with units; convergence on log–log with an
O(h²) reference slope; controls in red; fixed size. Chapters show them with `plt.show()` (PNG).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

OK_COLOR = "tab:blue"
CONTROL_COLOR = "tab:red"
FIGSIZE = (7.0, 4.0)


# ---- Pools ---------------------------------------------------------------------------------------

CLASS_COLORS = {"dead": "0.65", "strict": OK_COLOR, "twin tie": "tab:green", "non-twin tie": CONTROL_COLOR}


def pool_census(reports: dict, title: str = "Photos: dead and strict windows; flat images: twin ties; "
                                              "no non-twin tie") -> plt.Figure:
    """Stacked bars: each window class's share of every pool, for labelled censuses
    ({"cifar8, photos": census.SmoothReport, …}); non-twin ties in red."""
    from .checks.census import CLASSES
    rows = [(f"{label}: {p.pool}", p.counts, p.windows) for label, r in reports.items() for p in r.pools]
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.2 + 0.32 * len(rows)))
    y = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for cls in CLASSES:
        share = np.array([counts[cls] / n for _, counts, n in rows])
        ax.barh(y, share, left=left, color=CLASS_COLORS[cls], label=cls, height=0.8)
        left += share
    ax.set_yticks(y, [label for label, _, _ in rows], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the pool's windows (examples × channels × output cells)")
    ax.set_title(title, fontsize=10)
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)))
    fig.tight_layout()
    return fig


def selection_example(x: np.ndarray, dy: np.ndarray, dx_first: np.ndarray, dx_last: np.ndarray) -> plt.Figure:
    """One channel of a 2×2/s2 pool: its input (ties included), the rendered backward (= selScatter at
    σ = argmax) and, in red, selScatter at the last maximal cell, which is not the backward."""
    fig, axes = plt.subplots(1, 4, figsize=(FIGSIZE[0] + 1.5, 2.6))
    panels = [(x, "pool input x (ties)", "black"), (dy, "cotangent dy per window", "black"),
              (dx_first, "backward = selScatter(σ = first max)", OK_COLOR),
              (dx_last, "selScatter(last max): control", CONTROL_COLOR)]
    for ax, (a, label, color) in zip(axes, panels):
        ax.imshow(a, cmap="Greys" if a is x else "RdBu", vmin=None if a is x else -np.max(np.abs(dy)),
                  vmax=None if a is x else np.max(np.abs(dy)))
        for (i, j), v in np.ndenumerate(a):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=8,
                    color="tab:orange" if a is x else "black")
        step = 1 if a is dy else 2
        for k in np.arange(-0.5, a.shape[0], step):
            ax.axhline(k, color="0.3", lw=0.8)
            ax.axvline(k, color="0.3", lw=0.8)
        ax.set_title(label, fontsize=8, color=color)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("The backward routes each window's cotangent to its FIRST maximal cell", fontsize=10)
    fig.tight_layout()
    return fig


def window_grids(size: int, spans: dict) -> plt.Figure:
    """The diagonal windows (i, i) of pools on a size×size input. spans: {label: (first_rows,
    last_rows)} per output index, as measured (rows outside 0…size−1 are padding). The XLA 'SAME'
    panel is the control, in red."""
    fig, axes = plt.subplots(1, len(spans), figsize=(FIGSIZE[0] + 1.0, 3.2))
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
    fig, ax = plt.subplots(figsize=(FIGSIZE[0] + 1.5, FIGSIZE[1]))
    for k, (label, r) in enumerate(reports.items()):
        color = CONTROL_COLOR if "non-twin" in label else OK_COLOR
        names = list(r.nodes)
        vals = np.maximum([r.nodes[n] for n in names] + [r.dx_rel], floor)
        xs = np.arange(len(vals)) + 0.25 * (k - (len(reports) - 1) / 2)   # side by side, not on top
        ax.semilogy(xs[:-1], vals[:-1], "o", color=color, ms=4, label=f"{label}: parameter nodes")
        ax.semilogy(xs[-1:], vals[-1:], "s", color=color, ms=8, mfc="none", label=f"{label}: input gradient")
    ax.axhline(limit, color="black", ls="--", lw=1, label=f"round-off bound {limit:.0e}")
    ax.set_xticks(np.arange(len(vals)), names + ["input"], rotation=90, fontsize=6)
    ax.set_ylabel("max |g − g′| (relative)")
    ax.set_ylim(floor / 3, 10)
    ax.set_title("Rerouting twin ties moves only the input gradient; rerouting non-twin ties moves "
                 "parameter nodes", fontsize=10)
    ax.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    return fig


def one_sided_slopes(reports: dict) -> plt.Figure:
    """The loss along t·v (a unit direction; t in units of the radius to the next kink) minus the mean
    of the one-sided slopes, one panel per labelled `census.SlopeReport`: O(t²) where the loss is
    differentiable, a V of slope ±½(right − left) at a kink. Labels with "non-twin" are the control,
    in red."""
    fig, axes = plt.subplots(1, len(reports), figsize=(FIGSIZE[0] + 2.0, 3.6))
    for ax, (label, s) in zip(np.atleast_1d(axes), reports.items()):
        color = CONTROL_COLOR if "non-twin" in label else OK_COLOR
        mean = 0.5 * (s.left + s.right)
        ax.plot(s.ts / s.radius, s.losses - mean * s.ts, "o-", color=color, ms=3, lw=1,
                label="L(θ+tv) − L(θ) − s̄·t,  s̄ = ½(left + right)")
        ax.plot(s.ts / s.radius, 0.5 * s.jump * np.abs(s.ts), "k--", lw=1, label="½(right − left)·|t|")
        ax.axvline(0, color="0.7", lw=0.8)
        ax.set_xlabel("t / r   (r: first-order distance to the next kink)", fontsize=8)
        ax.set_title(f"{label}, r = {s.radius:.1e}\nleft slope {s.left:.3f}, right slope {s.right:.3f}",
                     fontsize=9, color=color)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(fontsize=7)
    np.atleast_1d(axes)[0].set_ylabel("loss minus the mean slope (nats)")
    fig.suptitle("A twin tie leaves the loss smooth; a non-twin tie puts a kink in it", fontsize=10)
    fig.tight_layout()
    return fig


# ---- Head fold -----------------------------------------------------------------------------------

def fold_row(steps, example: int = 0) -> plt.Figure:
    """One example of `checks.head.FoldSteps`: p and t̃ side by side per class, and N·dy = p − t̃."""
    k = np.arange(steps.k)
    t_smooth = (1 - steps.alpha) * steps.targets[example] + steps.alpha / steps.k
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(FIGSIZE[0] + 1.0, 3.4))
    ax0.bar(k - 0.2, steps.p[example], width=0.4, color=OK_COLOR, label="p = softmaxRow(z)")
    ax0.bar(k + 0.2, t_smooth, width=0.4, color="0.6", label="t̃ = (1−α)t + α/K")
    ax0.set_xlabel("class k")
    ax0.set_ylabel("probability")
    ax0.legend(fontsize=8)
    ax1.bar(k, steps.n * steps.dy[example], color=OK_COLOR, label="N·dy (the six kit ops)")
    ax1.plot(k, steps.p[example] - t_smooth, "k_", ms=18, mew=2, label="p − t̃")
    ax1.axhline(0, color="0.5", lw=0.8)
    ax1.set_xlabel("class k")
    ax1.set_ylabel("cotangent × N")
    ax1.legend(fontsize=8)
    fig.suptitle(f"The fold lands on (p − t̃)/N (example {example}, N = {steps.n}, K = {steps.k}, "
                 f"α = {steps.alpha:g})", fontsize=10)
    fig.tight_layout()
    return fig


def fold_ties(tables: dict, limit: float,
              title: str = "The six kit ops equal ∂/∂z of the mean smoothed cross-entropy; "
                           "each planted bug goes red") -> plt.Figure:
    """Relative error against autodiff per row of labelled `checks.head.TieTable`s; rows over the
    limit (the planted bugs) in red, exact zeros at the left edge."""
    rows = [(f"{name}: {t.label}", t.rel, t.ok) for name, table in tables.items() for t in table.ties]
    floor = 1e-18
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.0 + 0.26 * len(rows)))
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [max(r, floor) - floor for _, r, _ in rows], left=floor, height=0.7,
            color=[OK_COLOR if ok else CONTROL_COLOR for _, _, ok in rows])
    for yi, (_, r, _) in zip(y, rows):
        if r == 0:
            ax.text(floor * 2, yi, "exact 0", va="center", fontsize=7, color=OK_COLOR)
    ax.axvline(limit, color="k", ls="--", lw=1, label=f"limit {limit:.0e} (float64 node vs autodiff)")
    ax.set_xscale("log")
    ax.set_xlim(floor, 1e2)
    ax.set_yticks(y, [label for label, _, _ in rows], fontsize=7)
    ax.set_xlabel("max |rendered − autodiff| / max |autodiff|   (exact zeros at the left edge)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
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
    inset.tick_params(labelsize=7)
    ax.indicate_inset_zoom(inset, edgecolor="0.5")
    ax.set_ylim(0.4, min(2.5, float(np.max(curve.losses)) + 0.1))
    ax.set_xlabel("logit margin m (the label's logit above the others, which are 0)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"α = {curve.alpha:g}, K = {curve.num_classes}: the loss never goes below "
                 f"H(t̃) = {curve.entropy:.4f}; {upstream} is out of reach", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# ---- Stage germs ---------------------------------------------------------------------------------

GERM_ZERO_FLOOR = 1e-19   # where exact zeros of |S − G| are drawn, below every nonzero difference


def germ_parting(reports, title: str = "S and G are bit-identical below δ and part beyond it") -> plt.Figure:
    """|S(t) − G(t)| (max over ±t) against |t|, one line per `checks.germs.GermReport`; exact zeros
    on the bottom row, the bisected δ as a dotted line. Reports with "tie" in the stage are the
    control, in red."""
    fig, ax = plt.subplots(figsize=(FIGSIZE[0] + 1.0, 4.2))
    cmap = plt.get_cmap("viridis")
    for i, r in enumerate(reports):
        color = CONTROL_COLOR if "tie" in r.stage else cmap(i / max(1, len(reports) - 1) * 0.9)
        d = np.where(r.real_minus_gather == 0, GERM_ZERO_FLOOR, r.real_minus_gather)
        ax.plot(r.ts, d, "o-", color=color, ms=4, lw=1, label=f"{r.stage} (δ = {r.delta:.1e})")
        if not r.parts_at_smallest and r.parted:
            ax.axvline(r.delta, color=color, ls=":", lw=1)
    ax.axhline(GERM_ZERO_FLOOR, color="0.7", lw=0.6)
    ax.text(reports[0].ts[0], GERM_ZERO_FLOOR * 3, "S = G bit for bit", fontsize=8, color="0.4")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|t| along a unit direction in the stage's parameters")
    ax.set_ylabel("max over ±t of |S(t) − G(t)| (nats)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def germ_radii(reports) -> plt.Figure:
    """δ predicted from the window margins against δ found (bisection bracket as the error bar);
    the shaded band runs from agreement to a decade later than predicted."""
    fig, ax = plt.subplots(figsize=(5.5, 4.6))
    pred = np.array([r.delta_predicted for r in reports])
    found = np.array([r.delta for r in reports])
    lo = np.array([r.delta_bracket[0] for r in reports])
    hi = np.array([r.delta_bracket[1] for r in reports])
    span = np.array([min(pred.min(), lo.min()) / 3, max(pred.max(), hi.max()) * 3])
    ax.fill_between(span, span, span * 10, color="0.9", label="up to a decade later than predicted")
    ax.plot(span, span, "k--", lw=1, label="predicted = found")
    ax.errorbar(pred, found, yerr=[found - lo, hi - found], fmt="o", color=OK_COLOR, ms=5, capsize=3)
    for r, p, f in zip(reports, pred, found):
        ax.annotate(r.stage, (p, f), xytext=(4, -10), textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*span)
    ax.set_ylim(*span)
    ax.set_xlabel("δ predicted: min over windows of gap / |d gap/dt|")
    ax.set_ylabel("δ found: S and G part (bisection)")
    ax.set_title("The window margins predict where S and G part", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def germ_fd(reports) -> plt.Figure:
    """Central-difference error against h, one panel per report: the O(h²) truncation line
    |S'''|·h²/6 (S''' by autodiff, not fitted), the round-off envelope ε̂/h, the smooth radius
    (dotted) and the truncation window (filled markers)."""
    cols = 2 if len(reports) <= 4 else 3
    rows_ = int(np.ceil(len(reports) / cols))
    fig, axes = plt.subplots(rows_, cols, figsize=(3.6 * cols, 2.9 * rows_ + 0.6), squeeze=False)
    for ax, r in zip(axes.ravel(), reports):
        h = r.hs
        w = r.fd_window
        ax.loglog(h, r.fd_errors, "o", color="0.55", ms=3, mfc="none", label="|FD − ⟨g, v⟩|")
        ax.loglog(h[w], r.fd_errors[w], "o", color=OK_COLOR, ms=4, label="truncation window")
        ax.loglog(h, r.truncation(h), "k-", lw=1, label="|S'''|·h²/6  (slope 2)")
        ax.loglog(h, r.roundoff / h, "k:", lw=1, label="ε̂/h (round-off)")
        ax.axvline(r.smooth_radius, color=CONTROL_COLOR, ls="--", lw=1, label="first kink (1st order)")
        ax.set_ylim(max(1e-16, float(np.min(r.fd_errors[r.fd_errors > 0])) / 10), 1.0)
        slope = f"slope {r.fd_slope:.2f}" if r.has_window else "no window"
        ax.set_title(f"{r.stage}: {slope}", fontsize=9)
        ax.set_xlabel("step h", fontsize=8)
    for ax in axes.ravel()[len(reports):]:
        ax.axis("off")
    axes[0, 0].set_ylabel("|central difference − rendered node|")
    axes[0, 0].legend(fontsize=6, loc="upper left")
    fig.suptitle("Central differences: O(h²) where it rises above round-off before the first kink; "
                 "round-off agreement where it cannot", fontsize=10)
    fig.tight_layout()
    return fig


def germ_control(smooth, tie) -> plt.Figure:
    """Left: |S − G| against |t| at a smooth point and at a non-twin tie (red). Right: the jump
    |right slope − left slope| against h: it falls with h (then rises as round-off) where S is
    smooth, and stays put at a kink."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(FIGSIZE[0] + 2.0, 3.8))
    for r, color, label in ((smooth, OK_COLOR, f"smooth point ({smooth.stage})"),
                            (tie, CONTROL_COLOR, f"non-twin tie ({tie.stage})")):
        d = np.where(r.real_minus_gather == 0, GERM_ZERO_FLOOR, r.real_minus_gather)
        ax0.loglog(r.ts, d, "o-", color=color, ms=4, lw=1, label=label)
        j = np.where(r.jumps == 0, GERM_ZERO_FLOOR, r.jumps)
        ax1.loglog(r.hs, j, "o-", color=color, ms=3, lw=1, label=label)
    ax0.axhline(GERM_ZERO_FLOOR, color="0.7", lw=0.6)
    ax0.set_xlabel("|t|")
    ax0.set_ylabel("max over ±t of |S − G| (nats; zeros at the bottom)")
    ax0.legend(fontsize=8)
    ax1.set_xlabel("step h")
    ax1.set_ylabel("|(S(h) − S(0))/h − (S(0) − S(−h))/h|")
    ax1.legend(fontsize=8)
    fig.suptitle("At a non-twin tie the germ fails: S ≠ G at every |t|, and the one-sided slopes differ",
                 fontsize=10)
    fig.tight_layout()
    return fig


# ---- Whole-net tie -------------------------------------------------------------------------------

def _backward_rows(report):
    """Rows in backward order, with the x positions and the BN β rows flagged."""
    from .checks.tie import is_beta
    rows = report.backward_order()
    shapes = {r.name: r.shape for r in rows}
    return rows, np.arange(len(rows)), np.array([is_beta(r.name, shapes) for r in rows])


def tie_nodes(reports, title: str = "Every rendered node equals autodiff far below the 1e-10 limit "
                                    "(float64)") -> plt.Figure:
    """Relative error per node in backward order (head → input), one panel per TieReport; nodes
    that are 0 in ℝ (measured against the net's largest gradient) hollow; the limit dashed."""
    fig, axes = plt.subplots(len(reports), 1, figsize=(FIGSIZE[0], 1.0 + 2.2 * len(reports)), squeeze=False)
    for ax, report in zip(axes[:, 0], reports):
        rows, x, _ = _backward_rows(report)
        rel = np.array([max(r.rel, 1e-18) for r in rows])
        zero = np.array([r.zero_in_reals for r in rows])
        ax.semilogy(x[~zero], rel[~zero], "o", ms=3.5, color=OK_COLOR, label="node")
        if zero.any():
            ax.semilogy(x[zero], rel[zero], "o", ms=5, mfc="none", color=OK_COLOR,
                        label="0 in ℝ (vs the net's max|g|)")
        ax.axhline(rows[0].limit, color="0.3", ls="--", lw=1, label=f"limit {rows[0].limit:.0e}")
        ax.set_xlim(-1, len(rows))
        ax.set_ylim(1e-18, 1e-8)
        ax.set_ylabel("relative error")
        ax.set_title(f"{report.net}: {len(report.nodes)} nodes and the input cotangent", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("node, in backward order (head first, input cotangent last)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def float32_envelopes(reports, labels=None,
                      title: str = "float32 nodes sit a few envelopes from float64; a planted bug, "
                                   "far outside") -> plt.Figure:
    """Strip plot of err/envelope per node, one row per Float32Report; rows admitted by the
    envelope in blue, by the floor alone in grey, failing rows in red; the 10× limit dashed."""
    labels = labels or [r.net for r in reports]
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.4 + 0.7 * len(reports)))
    rng = np.random.default_rng(0)
    factor = reports[0].factor
    for i, report in enumerate(reports):
        y0 = len(reports) - 1 - i
        for kind, color, label in (("envelope", OK_COLOR, "within 10 envelopes"),
                                   ("floor", "0.6", "admitted by the floor only"),
                                   ("FAILED", CONTROL_COLOR, "outside")):
            ratios = np.array([min(r.ratio, 1e12) for r in report.rows if r.by == kind])
            if ratios.size:
                ax.semilogx(np.maximum(ratios, 1e-3), y0 + rng.uniform(-0.25, 0.25, ratios.size), "o",
                            ms=3, color=color, alpha=0.8, label=label if i == 0 or kind == "FAILED" else None)
    ax.axvline(factor, color="0.3", ls="--", lw=1, label=f"limit: {factor:g} envelopes")
    ax.set_yticks(range(len(reports)))
    ax.set_yticklabels(labels[::-1], fontsize=8)
    ax.set_xlabel("float32 error / float64 perturbation envelope (per node)")
    handles, names = ax.get_legend_handles_labels()
    keep = dict(zip(names, handles))
    ax.legend(keep.values(), keep.keys(), fontsize=7, loc="center")   # the empty decades between
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def control_nodes(results, reals, title: str = "Every planted bug goes red; the first node to break "
                                               "says where") -> plt.Figure:
    """One panel per control (checks.controls.ControlResult): error/limit per node in backward
    order, the control in red over the real chain at the same point in blue (`reals`: net label ->
    TieReport); β rows as squares; the first failing node marked and named."""
    cols = 2
    nrows = -(-len(results) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(FIGSIZE[0] + 1.5, 0.6 + 2.1 * nrows), squeeze=False)
    for ax, res in zip(axes.ravel(), results):
        rows, x, beta = _backward_rows(res.report)
        real = reals.get(res.net)
        if real is not None and res.smooth is None:
            real_rows, rx, _ = _backward_rows(real)
            ax.semilogy(rx, [max(r.rel / r.limit, 1e-9) for r in real_rows], "-", lw=1, color=OK_COLOR,
                        label="real chain")
        ratio = np.array([max(r.rel / r.limit, 1e-9) for r in rows])
        ax.semilogy(x[~beta], ratio[~beta], "o", ms=2.5, color=CONTROL_COLOR, label="control")
        ax.semilogy(x[beta], ratio[beta], "s", ms=3.5, color=CONTROL_COLOR, mfc="none", label="β rows")
        ax.axhline(1.0, color="0.3", ls="--", lw=1)
        first = res.first
        if first is not None:
            i = [r.name for r in rows].index(first.name)
            ax.annotate(first.name, (i, ratio[i]), xytext=(0.02, 0.9), textcoords="axes fraction",
                        fontsize=7, color=CONTROL_COLOR, va="top",
                        arrowprops=dict(arrowstyle="->", color=CONTROL_COLOR, lw=0.8))
        ax.set_ylim(1e-9, 1e16)
        ax.set_title(f"{res.name} ({res.net})", fontsize=8, color=CONTROL_COLOR)
        ax.tick_params(labelsize=7)
        ax.set_ylabel("error / limit", fontsize=7)
        ax.set_xlabel("node, backward order", fontsize=7)
    for ax in axes.ravel()[len(results):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ---- bf16 erasure --------------------------------------------------------------------------------

BF16_OP_MARKERS = {"forward": "o", "backward": "s", "grad_weight": "^"}


def bf16_bound(rows_by_net: dict, controls: list = (), title: str = "Every bf16 conv node sits under "
                                                                    "SPEC §7's bound at its contraction length") -> plt.Figure:
    """Max |node − exact| / Σ|a|·|b| per conv node against its contraction length n (log–log), one
    marker per kind, one colour per net ({"cifar8": [SiteRow], …}); the bound with and without the
    result's rounding as curves; control nodes (e.g. bf16 accumulation) in red."""
    from .checks.bf16 import OP_LABELS, accumulation_bound, node_bound
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ns = [r.n for rows in rows_by_net.values() for r in rows] + [r.n for r in controls]
    grid = np.logspace(0, np.log10(max(ns) * 4), 200)
    ax.plot(grid, node_bound(grid), color="k", lw=1.5, label="bound B(n) + 2⁻⁸(1 + B(n))")
    ax.plot(grid, accumulation_bound(grid), color="k", lw=1, ls="--", label="B(n): before the result's rounding")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (net, rows) in enumerate(rows_by_net.items()):
        for op, marker in BF16_OP_MARKERS.items():
            pick = [r for r in rows if r.op == op]
            if pick:
                ax.scatter([r.n for r in pick], [r.max_rel for r in pick], marker=marker, s=22,
                           color=colors[i % len(colors)], alpha=0.8, label=f"{net}: {OP_LABELS[op]}")
    for r in controls:
        ax.scatter([r.n], [r.max_rel], marker="x", s=60, color=CONTROL_COLOR, label=f"control: {r.name}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    low = min(r.max_rel for rows in rows_by_net.values() for r in rows if r.max_rel > 0)
    ax.set_ylim(bottom=low / 10)   # room for the legend below the points
    ax.set_xlabel("contraction length n (products per output)")
    ax.set_ylabel("max |node − exact| / Σ|a|·|b|")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    return fig


def bf16_nodes(rows_by_net: dict, factor: float, title: str = "bf16 moves each gradient node about as "
                                                               "much as a 2⁻⁸ nudge of the f32 chain") -> plt.Figure:
    """Per gradient node: |bf16 − f32| against the f32 chain's spread under a relative 2⁻⁸ nudge of
    every weight and pixel (both relative to max|f32 node|), one colour per net; the limit
    factor × envelope as a dashed line; nodes beyond it in red."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lo, hi = np.inf, 0.0
    for i, (net, rows) in enumerate(rows_by_net.items()):
        env = np.array([r.envelope / r.scale for r in rows if r.scale > 0])
        err = np.array([r.rel for r in rows if r.scale > 0])
        ok = np.array([r.ok for r in rows if r.scale > 0])
        ax.scatter(env[ok], err[ok], s=18, color=colors[i % len(colors)], alpha=0.8, label=f"{net} ({len(rows)} nodes)")
        if (~ok).any():
            ax.scatter(env[~ok], err[~ok], s=30, marker="x", color=CONTROL_COLOR, label=f"{net}: beyond the limit")
        pos = np.concatenate([env[env > 0], err[err > 0]])
        if pos.size:
            lo, hi = min(lo, pos.min()), max(hi, pos.max())
    grid = np.array([lo / 2, hi * 2]) if np.isfinite(lo) else np.array([1e-8, 1.0])
    ax.plot(grid, grid, color="0.5", lw=1, label="error = envelope")
    ax.plot(grid, factor * grid, color="k", lw=1, ls="--", label=f"limit: {factor:g} × envelope")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("f32 envelope: max |f32 node(nudged) − f32 node| / max |f32 node|")
    ax.set_ylabel("max |bf16 node − f32 node| / max |f32 node|")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bf16_replica(arrays: dict, replicas: int, title: str = "The all-reduced bf16 gradient is mean_r rnd(S_r), "
                                                            "not rnd(Σ_r S_r)/R: the gap is real and under 2u·M") -> plt.Figure:
    """Histogram over every weight-gradient entry of the named sites ({"conv1": replica arrays, …}) of
    (mean_r rnd(S_r) − rnd(Σ_r S_r)/R) / M, with the ±2u lines; identity's difference (all 0) noted."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    vals = np.concatenate([(d["diff"] / np.where(d["mag"] > 0, d["mag"], 1)).ravel() for d in arrays.values()])
    u = 2.0 ** -8
    ax.hist(vals, bins=81, range=(-2.2 * u, 2.2 * u), color=OK_COLOR)
    for v in (-2 * u, 2 * u):
        ax.axvline(v, color="k", ls="--", lw=1)
    ax.text(0.02, 0.95, f"R = {replicas}, {vals.size:,} entries, {np.mean(vals != 0):.0%} nonzero\n"
                        f"at rnd = identity: every difference is exactly 0", transform=ax.transAxes,
            va="top", fontsize=8)
    ax.set_xlabel("(mean_r rnd(S_r) − rnd(Σ_r S_r)/R) / Σ|a|·|b|    (dashed: ±2u, u = 2⁻⁸)")
    ax.set_ylabel("entries")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
