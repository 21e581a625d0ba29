"""The Stage germs chapter's figures: each function takes reports (`checks.germs.GermReport`) and
returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from gradtie.tolerances import GERM_ROUNDOFF_SIGMAS, GERM_TRUNCATION_REL
from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR, legend_below


GERM_ZERO_FLOOR = 1e-19   # where exact zeros of |S − G| are drawn, below every nonzero difference
PATH_STYLES = {"straight": "-", "curved": "--"}


def _germ_colors(reports) -> dict[str, tuple]:
    germs = list(dict.fromkeys(r.germ for r in reports))
    cmap = plt.get_cmap("viridis")
    return {g: cmap(i / max(1, len(germs) - 1) * 0.9) for i, g in enumerate(germs)}


def germ_parting(reports, title: str = "S and G are bit-identical below δ and part beyond it") -> plt.Figure:
    """|S(t) − G(t)| (max over ±t) against |t|, one line per walk: colour by germ, dashed for a
    curved path; exact zeros on the bottom row."""
    fig, ax = plt.subplots(figsize=(MAX_WIDTH, 4.4))
    colors = _germ_colors(reports)
    seen = set()
    for r in reports:
        d = np.where(r.real_minus_gather == 0, GERM_ZERO_FLOOR, r.real_minus_gather)
        label = r.germ if r.germ not in seen else None
        seen.add(r.germ)
        ax.plot(r.ts, d, marker="o", ls=PATH_STYLES[r.path], color=colors[r.germ], ms=3, lw=1, label=label)
    ax.plot([], [], "k--", lw=1, label="curved path")
    ax.axhline(GERM_ZERO_FLOOR, color="0.7", lw=0.6)
    ax.text(reports[0].ts[0], GERM_ZERO_FLOOR * 3, "S = G bit for bit", fontsize=MIN_FONT, color="0.4")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|t| along the path θ + t·v (+ t²·w)")
    ax.set_ylabel("max over ±t of |S(t) − G(t)| (nats)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=MIN_FONT, loc="upper left", ncol=2)
    fig.tight_layout()
    return fig


def germ_radii(reports, extra=(), extra_label: str = "") -> plt.Figure:
    """δ predicted from the window margins against δ found (bracket as the error bar), one point
    per walk (squares: curved paths); `extra` walks (e.g. at twin ties) as open circles. The shaded
    band runs from agreement to a decade later than predicted."""
    fig, ax = plt.subplots(figsize=(5.6, 4.6))
    everything = list(reports) + list(extra)
    pred = np.array([r.delta_predicted for r in everything])
    lo = np.array([r.delta_bracket[0] for r in everything])
    hi = np.array([r.delta_bracket[1] for r in everything])
    span = np.array([min(pred.min(), lo.min()) / 3, max(pred.max(), hi.max()) * 3])
    ax.fill_between(span, span, span * 10, color="0.92", label="up to a decade later than predicted")
    ax.plot(span, span, "k--", lw=1, label="predicted = found")
    colors = _germ_colors(reports)
    for r in reports:
        ax.errorbar([r.delta_predicted], [r.delta], yerr=[[r.delta - r.delta_bracket[0]], [r.delta_bracket[1] - r.delta]],
                    fmt="s" if r.path == "curved" else "o", color=colors[r.germ], ms=5, capsize=2)
    for r in extra:
        ax.plot([r.delta_predicted], [r.delta], "o", mfc="none", mec=OK_COLOR, ms=8)
    ax.plot([], [], "ko", ms=5, label="straight path")
    ax.plot([], [], "ks", ms=5, label="curved path")
    if extra:
        ax.plot([], [], "o", mfc="none", mec=OK_COLOR, ms=8, label=extra_label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*span)
    ax.set_ylim(*span)
    ax.set_xlabel("δ predicted: first gap to close (second order in t)")
    ax.set_ylabel("δ found: S and G part (bracketed)")
    ax.set_title("The window margins predict where S and G part", fontsize=10)
    ax.legend(fontsize=MIN_FONT, loc="upper left")
    fig.tight_layout()
    return fig


def _fd_panel(ax, r, *, color=OK_COLOR, label="|FD − ⟨g, v⟩|", lines: bool = True):
    h = r.hs
    e = np.where(r.fd_errors > 0, r.fd_errors, np.nan)
    ax.loglog(h, e, "o", color="0.6", ms=3, mfc="none")
    ax.loglog(h[r.evidence], e[r.evidence], "o", color=color, ms=4, label=label)
    if lines:
        ax.loglog(h, r.allowance(h), "k-", lw=1,
                  label=f"allowance: {1 + GERM_TRUNCATION_REL:g}·|S'''|h²/6 + round-off")
        ax.loglog(h, r.roundoff_term(h), "k:", lw=1, label=f"round-off: {GERM_ROUNDOFF_SIGMAS:g}·ε_L/(√2·h)")
        ax.axvline(r.smooth_radius, color=CONTROL_COLOR, ls="--", lw=1, label="first kink")


def germ_fd(reports, title: str = "Central differences stay inside the allowance and pin the node "
                                  "between round-off and the first kink") -> plt.Figure:
    """Central-difference error against h, one panel per walk: the allowance (predicted truncation
    plus the round-off measured apart), the round-off term alone, the first kink; evidence steps
    (allowance ≤ 1 % of the node) filled."""
    cols = 2    # two panels across the column: each at the page's full size, its text readable
    rows_ = int(np.ceil(len(reports) / cols))
    fig, axes = plt.subplots(rows_, cols, figsize=(MAX_WIDTH, 2.3 * rows_ + 1.6), squeeze=False, sharey=True,
                             sharex=True)
    for ax, r in zip(axes.ravel(), reports):
        _fd_panel(ax, r)
        ax.set_ylim(1e-14, 1e2)
        ax.set_title(f"{r.label}: {r.fd_verdict}", fontsize=MIN_FONT)
        ax.tick_params(labelsize=MIN_FONT)
    for ax in axes.ravel()[len(reports):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("step h", fontsize=MIN_FONT)
    for ax in axes[:, 0]:
        ax.set_ylabel("|FD − node|", fontsize=MIN_FONT)
    fig.suptitle(title.replace(" and pin", "\nand pin"), fontsize=10)
    legend_below(fig, axes.ravel()[:1], ncol=2)
    return fig


def germ_fd_controls(walk, wrong: dict, near) -> plt.Figure:
    """Left: one walk's central differences judged against the rendered node and against planted
    wrong nodes ({"×2": report, …}, red): the wrong ones leave the allowance wherever a step is
    evidence. Right: a walk whose first kink sits inside round-off: no step is evidence."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(MAX_WIDTH, 5.2), sharey=True)
    _fd_panel(ax0, walk, label="rendered node: evidence steps")
    for i, (name, r) in enumerate(wrong.items()):
        ax0.loglog(r.hs[r.judged], r.fd_errors[r.judged], "x^v"[i % 3], color=CONTROL_COLOR, ms=4,
                   label=f"node {name}: outside at {int(r.violations.sum())} steps")
    ax0.set_title(f"{walk.label}: wrong nodes fail", fontsize=MIN_FONT)
    _fd_panel(ax1, near, label="evidence steps (none)")
    ax1.axvline(near.roundoff_edge, color="0.4", ls="-.", lw=1, label="round-off edge")
    ax1.set_title(f"{near.label}: {near.fd_verdict}", fontsize=MIN_FONT)
    for ax in (ax0, ax1):
        ax.set_xlabel("step h")
        ax.set_ylim(1e-14, 1e2)
    ax0.set_ylabel("|central difference − node|")
    fig.suptitle("The finite-difference verdict can fail, and says \"no evidence\" when it has none",
                 fontsize=10)
    legend_below(fig, ncol=2)
    return fig


def germ_control(smooth, tie) -> plt.Figure:
    """Left: |S − G| against |t| at a smooth point and at a non-twin tie (red). Right: the jump
    |right slope − left slope| against h: it falls with h (then rises as round-off) where S is
    smooth, and stays put at a kink."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(MAX_WIDTH, 3.8))
    for r, color, label in ((smooth, OK_COLOR, f"smooth point ({smooth.label})"),
                            (tie, CONTROL_COLOR, f"non-twin tie ({tie.label})")):
        d = np.where(r.real_minus_gather == 0, GERM_ZERO_FLOOR, r.real_minus_gather)
        ax0.loglog(r.ts, d, "o-", color=color, ms=4, lw=1, label=label)
        j = np.where(r.jumps == 0, GERM_ZERO_FLOOR, r.jumps)
        ax1.loglog(r.hs, j, "o-", color=color, ms=3, lw=1, label=label)
    ax0.axhline(GERM_ZERO_FLOOR, color="0.7", lw=0.6)
    ax0.set_xlabel("|t|")
    ax0.set_ylabel("max over ±t of |S − G| (nats; zeros at the bottom)")
    ax0.legend(fontsize=MIN_FONT)
    ax1.set_xlabel("step h")
    ax1.set_ylabel("|(S(h) − S(0))/h − (S(0) − S(−h))/h|")
    ax1.legend(fontsize=MIN_FONT)
    fig.suptitle("At a non-twin tie the germ fails: S ≠ G at every |t|, and the one-sided slopes differ",
                 fontsize=10)
    fig.tight_layout()
    return fig
