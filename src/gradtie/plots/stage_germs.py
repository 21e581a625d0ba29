"""The Stage germs chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ._style import OK_COLOR, CONTROL_COLOR, FIGSIZE


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
