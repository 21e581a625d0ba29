"""The bf16 at real rounding chapter's figures: each function takes a report and returns a Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from gradtie.checks.bf16.kinds import OP_LABELS
from gradtie.checks.bf16.sites import accumulation_bound, node_bound
from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR

BF16_OP_MARKERS = {"forward": "o", "backward": "s", "grad_weight": "^"}


def bf16_bound(rows_by_net: dict, controls: list = (), title: str = "Every bf16 conv node sits under "
                                                                    "the bound B(n) at its contraction length") -> plt.Figure:
    """Max |node − exact| / Σ|a|·|b| per conv node against its contraction length n (log–log), one
    marker per kind, one colour per net ({"cifar8": [SiteRow], …}); the bound with and without the
    result's rounding as curves; control nodes (e.g. bf16 accumulation) in red."""
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
    ax.legend(fontsize=MIN_FONT, ncol=2, loc="lower left")
    fig.tight_layout()
    return fig


def bf16_f32_distance(rows_by_net: dict, title: str = "Beyond the suite: the bf16 gradient sits as far from "
                                                       "the f32 one as a 2⁻⁸ nudge moves it") -> plt.Figure:
    """Per gradient node: |bf16 − f32| against the f32 chain's spread under a relative 2⁻⁸ nudge of
    every weight and pixel (both relative to the node's scale), one colour per net ({"cifar8":
    [NodeRow] from `bf16.f32_distance`, …}). A description, not a verdict: at a small batch both are
    of the node's size."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lo, hi = np.inf, 0.0
    for i, (net, rows) in enumerate(rows_by_net.items()):
        env, err = np.array([r.envelope for r in rows]), np.array([r.rel for r in rows])
        ax.scatter(env, err, s=18, color=colors[i % len(colors)], alpha=0.8, label=f"{net} ({len(rows)} nodes)")
        pos = np.concatenate([env[env > 0], err[err > 0]])
        if pos.size:
            lo, hi = min(lo, pos.min()), max(hi, pos.max())
    grid = np.array([lo / 2, hi * 2]) if np.isfinite(lo) else np.array([1e-8, 1.0])
    ax.plot(grid, grid, color="0.5", lw=1, label="distance = nudge spread")
    ax.axhline(1.0, color=CONTROL_COLOR, lw=1, ls=":", label="a zeroed node's distance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("f32 spread: max |f32 node(nudged 2⁻⁸) − f32 node| / max |f32 node|")
    ax.set_ylabel("max |bf16 node − f32 node| / max |f32 node|")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=MIN_FONT)
    fig.tight_layout()
    return fig


def bf16_stages(reports_by_net: dict, caught_by_net: dict,
                title: str = "Every bf16 stage ties to its VJP; planted bugs part from it") -> plt.Figure:
    """Per stage row (the loss cotangent, then the stages from the head down, each its nodes and the
    cotangent it hands on), its error over its limit: the real chain's rows (blue, ≤ 1) and, for each
    planted catalogue entry, the row where it first parts (red), one panel per net ({"cifar8": the
    chain's stage ties (`bf16.stage_ties`), …}, {"cifar8": [Bf16Caught], …})."""
    nets = list(reports_by_net)
    fig, axes = plt.subplots(1, len(nets), figsize=(MAX_WIDTH, 4.2), squeeze=False, sharey=True)
    for ax, net in zip(axes[0], nets):
        pairs = [(t.net, r) for t in reports_by_net[net].backward_order() for r in t.rows]
        idx = {(stage, r.name): i for i, (stage, r) in enumerate(pairs)}
        rows = [r for _, r in pairs]
        ax.scatter(np.arange(len(rows)), [max(r.ratio, 1e-6) for r in rows], s=10, color=OK_COLOR,
                   label="the chain's rows")
        parted = [(c.bug, c.report.first_parting()) for c in caught_by_net.get(net, [])]
        parted = [(bug, p) for bug, p in parted if p is not None]
        ax.scatter([idx[(p.stage, p.row.name)] for _, p in parted], [min(p.row.ratio, 1e6) for _, p in parted],
                   s=18, marker="x", color=CONTROL_COLOR, label=f"planted: first parting ({len(parted)} bugs)")
        ax.axhline(1.0, color="k", lw=1, ls="--", label="limit")
        ax.set_yscale("log")
        ax.set_xlabel(f"{net}: row (loss cotangent, then head → input)")
        ax.set_title(net, fontsize=9)
    axes[0, 0].set_ylabel("error / limit (capped at 1e6)")
    axes[0, 0].legend(fontsize=MIN_FONT, loc="center left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
