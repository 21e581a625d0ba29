"""The bf16 erasure chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ._style import CONTROL_COLOR, FIGSIZE, MIN_FONT, OK_COLOR, legend_below


def kind_erasure(rows, title: str = "At rnd = identity each bf16 kind is its f32 peer bit for bit;\n"
                                     "each planted kind is not") -> plt.Figure:
    """One row per kind case: the most ulps its output lies from the f32 peer's (0: bit for bit),
    `rows` holding (label, ulps, planted?); the planted kinds in red. The axis is symmetric-log, so
    that 0 has its own place left of 1 ulp."""
    if not rows:
        raise ValueError("kind_erasure: no rows to draw")
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.3 + 0.22 * len(rows)))
    y = np.arange(len(rows))[::-1]
    ulps = np.array([r[1] for r in rows], float)
    colors = [CONTROL_COLOR if r[2] else OK_COLOR for r in rows]
    ax.scatter(ulps, y, color=colors, s=30, zorder=3)
    for yi, u, c in zip(y, ulps, colors):
        ax.plot([0, u], [yi, yi], color=c, lw=1.5)
        ax.text(u * 1.6 + 0.6, yi, "0 ulp: same bits" if u == 0 else f"{u:,.0f} ulp", va="center",
                fontsize=MIN_FONT, color=c)
    ax.set_xscale("symlog", linthresh=1)
    top = max(10.0, ulps.max()) * 1e3
    ax.set_xlim(-0.3, top)
    ax.set_xticks([0] + [10.0 ** k for k in range(0, int(np.log10(top)) + 1, 3)])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_yticks(y, [r[0] for r in rows], fontsize=MIN_FONT)
    ax.set_xlabel("ulps from the f32 peer (the most over the outputs)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def typed_erasure(report, title: str = "The bf16-typed kernels at bf16-exact operands sum the exact "
                                       "products\nwithin float32's bound; operands not bf16-exact land "
                                       "far outside") -> plt.Figure:
    """One row per site (six kinds × two formulations): each output's worst error against the exact
    sum of its products, over γ_n·Σ|a||b| (≤ 1: within float32's accumulation bound), for the typed
    kernel (blue dot), its f32 peer (ring) and the control at operands not bf16-exact (red cross);
    a `companions.TypedReport`."""
    sites, controls = report.erasure(), {r.name: r for r in report.controls()}
    if not sites:
        raise ValueError("typed_erasure: no sites to draw")
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.7 + 0.24 * len(sites)))
    y = np.arange(len(sites))[::-1]
    floor = 1e-4
    ax.scatter([max(r.exact_ratio, floor) for r in sites], y, color=OK_COLOR, s=28, zorder=3,
               label="the typed kernel")
    ax.scatter([max(r.peer_exact_ratio, floor) for r in sites], y, facecolors="none", edgecolors="k", s=60,
               zorder=2, label="its f32 peer")
    ys = [yi for yi, r in zip(y, sites) if r.name in controls]
    ax.scatter([controls[r.name].exact_ratio for r in sites if r.name in controls], ys, marker="x",
               color=CONTROL_COLOR, s=40, label="control: operands not bf16-exact")
    ax.axvline(1.0, color="k", lw=1, ls="--", label="γ_n·Σ|a||b| (float32's bound)")
    ax.set_xscale("log")
    ax.set_xlim(floor / 2, 1e4)
    ax.set_ylim(-0.6, len(sites) - 0.4)
    ax.set_yticks(y, [r.name for r in sites], fontsize=MIN_FONT)
    ax.set_xlabel("max |output − exact sum of its products| ÷ γ_n·Σ|a||b|")
    ax.set_title(title, fontsize=10)
    legend_below(fig, ncol=2)
    return fig


def bf16_replica(arrays: dict, replicas: int, title: str = "The all-reduced bf16 gradient is mean_r rnd(S_r), "
                                                            "not rnd(Σ_r S_r)/R: the gap is real and under 2u·M") -> plt.Figure:
    """Histogram over every weight-gradient entry of the named sites (`ReplicaReport.arrays`) of
    (mean_r rnd(S_r) − rnd(Σ_r S_r)/R) / M, with the ±2u lines; identity's difference (all 0) noted."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    vals = np.concatenate([(d["diff"] / np.where(d["mag"] > 0, d["mag"], 1)).ravel() for d in arrays.values()])
    u = 2.0 ** -8
    ax.hist(vals, bins=81, range=(-2.2 * u, 2.2 * u), color=OK_COLOR)
    for v in (-2 * u, 2 * u):
        ax.axvline(v, color="k", ls="--", lw=1)
    ax.text(0.02, 0.95, f"R = {replicas}, {vals.size:,} entries, {np.mean(vals != 0):.0%} nonzero\n"
                        f"at rnd = identity: every difference is exactly 0", transform=ax.transAxes,
            va="top", fontsize=MIN_FONT)
    ax.set_xlabel("(mean_r rnd(S_r) − rnd(Σ_r S_r)/R) / Σ|a|·|b|    (dashed: ±2u, u = 2⁻⁸)")
    ax.set_ylabel("entries")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
