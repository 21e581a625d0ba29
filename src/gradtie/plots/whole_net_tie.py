"""The Whole-net tie chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ._style import OK_COLOR, CONTROL_COLOR, FIGSIZE


def _backward_rows(report):
    """Rows in backward order, with the x positions and the BN β rows flagged."""
    from ..checks.tie import is_beta
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
