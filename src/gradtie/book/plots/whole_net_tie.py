"""The Whole-net tie chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from gradtie.checks.tie import is_beta
from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR, legend_below


def _backward_rows(report):
    """Rows in backward order, with the x positions and the BN β rows flagged."""
    rows = report.backward_order()
    shapes = {r.name: r.shape for r in rows}
    return rows, np.arange(len(rows)), np.array([is_beta(r.name, shapes) for r in rows])


def tie_nodes(reports, labels=None,
              title: str = "Every node within its limit; where round-off grows (M = 2), the limit grows "
                           "with it") -> plt.Figure:
    """Relative error per row in backward order (loss, head → input), one panel per TieReport,
    with each row's limit (ENVELOPE_FACTOR × the point's envelope, floored) as a grey step; nodes
    that are 0 in ℝ (measured against the net's largest gradient) hollow; limits the envelope
    widened past the floor shaded."""
    labels = labels or [r.net for r in reports]
    fig, axes = plt.subplots(len(reports), 1, figsize=(FIGSIZE[0], 1.0 + 2.2 * len(reports)), squeeze=False)
    for ax, report, label in zip(axes[:, 0], reports, labels):
        rows, x, _ = _backward_rows(report)
        rel = np.array([max(r.rel, 1e-18) for r in rows])
        limit = np.array([r.limit for r in rows])
        zero = np.array([r.zero_in_reals for r in rows])
        wide = np.array([r.by == "envelope" for r in rows])
        ax.step(x, limit, where="mid", color="0.35", lw=1, label="limit: 10 × envelope, floored")
        if wide.any():
            ax.fill_between(x, rows[0].floor, limit, where=wide, step="mid", color="0.85",
                            label="widened past the floor by the point's round-off")
        ax.semilogy(x[~zero], rel[~zero], "o", ms=3.5, color=OK_COLOR, label="rendered vs autodiff")
        if zero.any():
            ax.semilogy(x[zero], rel[zero], "o", ms=5, mfc="none", color=OK_COLOR,
                        label="0 in ℝ (vs the net's max|g|)")
        ax.set_xlim(-1, len(rows))
        ax.set_ylim(1e-18, max(1e-8, 10 * limit.max()))
        ax.set_ylabel("relative error")
        ax.set_title(f"{label}: loss, {len(report.nodes)} nodes, input", fontsize=MIN_FONT)
    axes[-1, 0].set_xlabel("row, in backward order (loss, head first, input cotangent last)")
    fig.suptitle(title, fontsize=10)
    legend_below(fig, ncol=2)
    return fig


def float32_envelopes(reports, labels=None,
                      title: str = "float32 nodes sit a few envelopes from float64; a planted bug, "
                                   "far outside") -> plt.Figure:
    """Strip plot of err/envelope per node, one row per Float32Report; rows admitted by the
    envelope in blue, by the floor alone in grey, failing rows in red; the 10× limit dashed."""
    labels = labels or [r.net for r in reports]
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.4 + 0.7 * len(reports)))
    rng = np.random.default_rng(0)
    factor = reports[0].meta.get("factor", 10.0)
    for i, report in enumerate(reports):
        y0 = len(reports) - 1 - i
        for kind, color, label in (("envelope", OK_COLOR, "within 10 envelopes"),
                                   ("floor", "0.6", "admitted by the floor only"),
                                   ("FAILED", CONTROL_COLOR, "outside")):
            picked = [r for r in report.rows if (not r.ok if kind == "FAILED" else r.ok and r.by == kind)]
            ratios = np.array([min(r.rel / max(r.envelope, 1e-300), 1e12) for r in picked])
            if ratios.size:
                ax.semilogx(np.maximum(ratios, 1e-3), y0 + rng.uniform(-0.25, 0.25, ratios.size), "o",
                            ms=3, color=color, alpha=0.8, label=label if i == 0 or kind == "FAILED" else None)
    ax.axvline(factor, color="0.3", ls="--", lw=1, label=f"limit: {factor:g} envelopes")
    ax.set_yticks(range(len(reports)))
    ax.set_yticklabels(labels[::-1], fontsize=MIN_FONT)
    ax.set_xlabel("float32 error / float32 round-off envelope (per node)")
    handles, names = ax.get_legend_handles_labels()
    keep = dict(zip(names, handles))
    ax.legend(keep.values(), keep.keys(), fontsize=MIN_FONT, loc="center")   # the empty decades between
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def stage_ratios(panels: dict, title: str = "Each stage ties to its own VJP; a planted bug parts at "
                                            "the stage that holds it") -> plt.Figure:
    """One panel per net: `panels` maps a label to (real StageReport, planted StageReport or None).
    Per piece in backward order (the loss cotangent, the head … the first stage) the worst row's
    error over its limit: the real chain in blue, the planted one in red, the stage where it first
    parts named."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(MAX_WIDTH, 1.2 + 2.6 * len(panels)), squeeze=False)
    for ax, (label, (real, planted)) in zip(axes[:, 0], panels.items()):
        pieces = real.backward_order()
        x = np.arange(len(pieces))
        ratio = np.array([max(t.worst().rel / t.worst().limit, 1e-9) for t in pieces])
        ax.semilogy(x, ratio, "o-", ms=4, lw=1, color=OK_COLOR, label="real chain")
        if planted is not None:
            bad = planted.backward_order()
            pr = np.array([max(t.worst().rel / t.worst().limit, 1e-9) for t in bad])
            ax.semilogy(x, pr, "s", ms=4, mfc="none", color=CONTROL_COLOR, label=f"planted: {planted.net}")
            parting = planted.first_parting()
            if parting is not None:
                i = [t.net for t in bad].index(parting.stage)
                ax.annotate(f"first parts at {parting.stage}", (i, pr[i]), xytext=(0.55, 0.9),
                            textcoords="axes fraction", fontsize=MIN_FONT, color=CONTROL_COLOR, va="top",
                            arrowprops=dict(arrowstyle="->", color=CONTROL_COLOR, lw=0.8))
        ax.axhline(1.0, color="0.3", ls="--", lw=1, label="limit")
        ax.set_xticks(x)
        ax.set_xticklabels([t.net for t in pieces], rotation=60, ha="right", fontsize=MIN_FONT)
        ax.set_ylim(1e-9, max(1e3, 10 * ratio.max()) if planted is None else 1e16)
        ax.set_ylabel("worst error / limit", fontsize=MIN_FONT)
        ax.set_title(label, fontsize=MIN_FONT)
    fig.suptitle(title, fontsize=10)
    legend_below(fig, ncol=2)
    return fig


def sweep_ratios(sweeps, title: str = "Every batch size ties: worst error over its limit against N") -> plt.Figure:
    """Worst error over its limit against N, one line per `stages.Sweep` (only N where the
    parameter-gradient hypothesis holds carry a point); each point labelled with the smallest
    BatchNorm reduction M at that N; the limit dashed."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for i, (sw, marker) in enumerate(zip(sweeps, "os^v")):
        rows = [r for r in sw.rows if r.tie is not None]
        n = np.array([r.n for r in rows])
        ratio = np.array([max(r.ratio, 1e-9) for r in rows])
        ax.semilogy(n, ratio, marker + "-", ms=5, lw=1, label=sw.net)
        for r, y in zip(rows, ratio):
            small = r.tie.smallest_bn()
            if small is not None:
                # the second net's labels below its points: two nets at one N do not overprint
                ax.annotate(f"M={small[1]}", (r.n, y), xytext=(3, 4 if i % 2 == 0 else -12), textcoords="offset points",
                            fontsize=MIN_FONT)
    ax.axhline(1.0, color="0.3", ls="--", lw=1, label="limit (10 × envelope, floored)")
    ax.set_xlabel("batch size N")
    ax.set_ylabel("worst error / limit (all rows)")
    ax.set_xticks(sorted({r.n for sw in sweeps for r in sw.rows}))
    ax.set_ylim(1e-8, 10)
    ax.legend(fontsize=MIN_FONT, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
