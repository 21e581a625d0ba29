"""The Performance appendix's figures: functions take committed results and return a Figure.

The rendered step in blue, the autodiff step in grey, limits as dashed lines, anything
over its limit in red. Shown in: Performance.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np

from matplotlib.ticker import NullFormatter

from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR, legend_below

AUTODIFF_COLOR = "0.45"
GROUPS = (("cifar8", 32), ("resnet34", 32), ("resnet34", 64))


def _ticks(ax, values, most: int = 4) -> None:
    """Tick labels on a log x axis at `values`, at most `most` of them labelled (every k-th, the
    last always), and no minor labels: on a panel a third of the column wide, more collide."""
    values = sorted(set(values))
    step = max(1, -(-len(values) // most))
    ax.set_xticks(values, [str(v) if (len(values) - 1 - i) % step == 0 else "" for i, v in enumerate(values)])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _group(results, net: str, size: int, replicas: int):
    rows = sorted((r for r in results if r.config.net == net and r.config.image_size == size
                   and r.config.replicas == replicas), key=lambda r: r.config.batch)
    return rows


def figure_time_memory(results: Sequence) -> plt.Figure:
    """ms per step (top) and XLA's compiled temporary memory (bottom) against the batch, for each
    net and image size: the rendered step (blue) under autodiff (grey) on one device (solid) and on
    two host devices (dashed, the batch per replica)."""
    fig, axes = plt.subplots(2, len(GROUPS), figsize=(MAX_WIDTH, 6.4), sharex="col")
    for col, (net, size) in enumerate(GROUPS):
        for replicas, ls, marker in ((1, "-", "o"), (2, "--", "s")):
            rows = _group(results, net, size, replicas)
            if not rows:
                continue
            batch = [r.config.batch for r in rows]
            tag = "" if replicas == 1 else ", R = 2"
            axes[0, col].loglog(batch, [r.rendered_ms for r in rows], ls, marker=marker, color=OK_COLOR,
                                label=f"rendered{tag}")
            axes[0, col].loglog(batch, [r.autodiff_ms for r in rows], ls, marker=marker, color=AUTODIFF_COLOR,
                                label=f"autodiff{tag}")
            if rows[0].rendered_temp_mib is not None:
                axes[1, col].loglog(batch, [r.rendered_temp_mib for r in rows], ls, marker=marker, color=OK_COLOR)
                axes[1, col].loglog(batch, [r.autodiff_temp_mib for r in rows], ls, marker=marker,
                                    color=AUTODIFF_COLOR)
        axes[0, col].set_title(f"{net}, {size} px", fontsize=10)
        axes[1, col].set_xlabel("batch (per replica)")
        for row in (0, 1):
            _ticks(axes[row, col], [r.config.batch for r in results if r.config.net == net])
    axes[0, 0].set_ylabel("ms per step (median)")
    axes[1, 0].set_ylabel("temporary memory (MiB)")
    fig.suptitle("The rendered step is faster than autodiff\nand needs less temporary memory (CPU)", fontsize=11)
    legend_below(fig, ncol=2)
    return fig


def figure_ratios(results: Sequence, limit: float, upstream: Mapping[str, float]) -> plt.Figure:
    """rendered / autodiff per configuration against the limit, parity and upstream's two ratios."""
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 0.32 * len(results) + 1.6))
    labels = [r.config.label() for r in results]
    ratios = np.array([r.ratio for r in results])
    y = np.arange(len(results))[::-1]
    ax.barh(y, ratios, color=[OK_COLOR if q <= limit else CONTROL_COLOR for q in ratios], height=0.6)
    ax.axvline(limit, color="0.2", ls="--", lw=1, label=f"limit {limit:g}")
    ax.axvline(1.0, color="0.5", ls=":", lw=1, label="parity")
    for (name, value), ls in zip(upstream.items(), ("-.", (0, (5, 1, 1, 1)))):
        ax.axvline(value, color="tab:orange", ls=ls, lw=1.2, label=f"upstream {name}: {value:g}")
    ax.set_yticks(y, labels, fontsize=MIN_FONT)
    ax.set_xlabel("rendered / autodiff (ms per step)")
    ax.set_xlim(0, max(1.5, ratios.max() * 1.05))
    ax.set_title("Every configuration under the limit;\nupstream's render was slower than autodiff", fontsize=11)
    legend_below(fig, ncol=2)
    return fig


def figure_gpu(results: Sequence) -> plt.Figure:
    """Images per second on the GPU, rendered against autodiff, per batch and conv dtype."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    labels = [r.config.label() for r in results]
    x = np.arange(len(results))
    ax.bar(x - 0.2, [r.images_per_s[0] for r in results], width=0.4, color=OK_COLOR, label="rendered")
    ax.bar(x + 0.2, [r.images_per_s[1] for r in results], width=0.4, color=AUTODIFF_COLOR, label="autodiff")
    ax.set_xticks(x, labels, fontsize=MIN_FONT, rotation=15)
    ax.set_ylabel("images / s")
    ax.set_title(f"ResNet-34 at 224 px on {results[0].device_kind}")
    legend_below(fig, ncol=2)
    return fig


PEER_STYLE = {"rendered": (OK_COLOR, "o", "rendered"), "autodiff": (AUTODIFF_COLOR, "s", "autodiff (gradtie's forward)"),
              "jax-nchw": ("tab:green", "^", "plain JAX, NCHW"), "jax-nhwc": ("tab:olive", "v", "plain JAX, NHWC"),
              "torch": ("tab:orange", "D", "PyTorch eager")}


def figure_peers(rows: Sequence) -> plt.Figure:
    """Time per image (top) and each process's peak resident memory (bottom) of every side that ran:
    against the batch for cifar8 (32 px) and ResNet-34 (64 px), and against the image side for
    ResNet-34 at batch 8. A side that did not run (PyTorch not installed) is absent."""
    axes_of = (("cifar8", "batch", lambda r: r.config.net == "cifar8"),
               ("resnet34, 64 px", "batch", lambda r: r.config.net == "resnet34" and r.config.image_size == 64),
               ("resnet34, batch 8", "image side (px)", lambda r: r.config.net == "resnet34" and r.config.batch == 8))
    fig, axes = plt.subplots(2, len(axes_of), figsize=(MAX_WIDTH, 6.6), sharex="col")
    for col, (title, xlabel, keep) in enumerate(axes_of):
        group = sorted((r for r in rows if keep(r)),
                       key=lambda r: r.config.batch if xlabel == "batch" else r.config.image_size)
        xs = [r.config.batch if xlabel == "batch" else r.config.image_size for r in group]
        for side, (color, marker, label) in PEER_STYLE.items():
            have = [(x, r) for x, r in zip(xs, group) if r.ms(side) is not None]
            if not have:
                continue
            x = [a for a, _ in have]
            axes[0, col].loglog(x, [r.ms(side) / r.config.batch for _, r in have], "-", marker=marker,
                                color=color, label=label)
            axes[1, col].semilogx(x, [r.sides[side].peak_rss_mib for _, r in have], "-", marker=marker, color=color)
        axes[0, col].set_title(title, fontsize=10)
        axes[1, col].set_xlabel(xlabel)
        for row in (0, 1):
            _ticks(axes[row, col], xs)
    axes[0, 0].set_ylabel("ms per image")
    axes[1, 0].set_ylabel("peak resident MiB (process)")
    legend_below(fig, ncol=3)
    return fig


def figure_limit_fraction(rows: Sequence, goal: Optional[float] = None) -> plt.Figure:
    """Each side's achieved GFLOP/s as a fraction of the run's large float32 matrix product, per
    configuration; the goal (ResNet-34 at batch 32, 64 px) dashed."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    labels = [r.config.label() for r in rows]
    sides = [s for s in PEER_STYLE if any(r.ms(s) is not None for r in rows)]
    width = 0.8 / max(len(sides), 1)
    for i, side in enumerate(sides):
        color, _, label = PEER_STYLE[side]
        vals = [r.limit_fraction(side) or 0.0 for r in rows]
        ax.bar(np.arange(len(rows)) + (i - (len(sides) - 1) / 2) * width, vals, width, color=color, label=label)
    if goal is not None:
        ax.axhline(goal, ls="--", color=CONTROL_COLOR, lw=1, label=f"goal {goal} (resnet34 batch 32, 64 px)")
    ax.set_xticks(np.arange(len(rows)), labels, rotation=30, ha="right", fontsize=MIN_FONT)
    ax.set_ylabel("fraction of the matmul's GFLOP/s")
    legend_below(fig, ncol=2)
    return fig


def figure_conv_floor(rows: Sequence, peer_rows: Sequence = ()) -> plt.Figure:
    """Left: per configuration, ms per image of the convolutions alone (gradtie's conv ops, XLA's
    convolutions channels-last, PyTorch's), PyTorch's whole step and, where the peer run has it, the
    rendered step; the goal (0.95 × PyTorch's step) as a dash. Right: each conv site of the largest
    configuration, GFLOP/s of its nodes timed alone, gradtie against PyTorch."""
    fig, (left, right) = plt.subplots(2, 1, figsize=(MAX_WIDTH, 9.0), gridspec_kw={"height_ratios": [1, 1.2]})
    rendered = {(r.config.net, r.config.batch, r.config.image_size): r.ms("rendered") for r in peer_rows}
    series = (("gradtie's conv ops (NCHW)", PEER_STYLE["rendered"][0], lambda r: r.floor_ms("nchw")),
              ("XLA's convolutions, NHWC", PEER_STYLE["jax-nhwc"][0], lambda r: r.floor_ms("nhwc")),
              ("PyTorch's convolutions", PEER_STYLE["torch"][0], lambda r: r.torch_convs_ms()))
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    for i, (label, color, value) in enumerate(series):
        vals = [(value(r) or 0.0) / r.config.batch for r in rows]
        left.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, color=color, label=label,
                 alpha=1.0 if i != 1 else 0.6)
    for i, r in enumerate(rows):
        if r.torch_step_ms is not None:
            goal = 0.95 * r.torch_step_ms / r.config.batch
            left.plot([i - 0.45, i + 0.45], [goal, goal], "--", color=CONTROL_COLOR, lw=1,
                      label="0.95 × PyTorch's whole step" if i == 0 else None)
        step = rendered.get((r.config.net, r.config.batch, r.config.image_size))
        if step is not None:
            left.plot([i], [step / r.config.batch], "o", color="k", ms=4, label="rendered step" if i == 0 else None)
    left.set_yscale("log")
    left.set_xticks(x, [r.config.label() for r in rows], rotation=30, ha="right", fontsize=MIN_FONT)
    left.set_ylabel("ms per image")
    big = max(rows, key=lambda r: sum(s.count * s.step_gflop() for s in r.sites))
    sites = big.site_gflops()
    y = np.arange(len(sites))
    right.barh(y - 0.2, [g for _, g, _ in sites], 0.4, color=PEER_STYLE["rendered"][0], label="gradtie's conv nodes")
    if all(t is not None for _, _, t in sites):
        right.barh(y + 0.2, [t for _, _, t in sites], 0.4, color=PEER_STYLE["torch"][0], label="PyTorch")
    right.set_yticks(y, [s.label() for s, _, _ in sites], fontsize=MIN_FONT)
    right.invert_yaxis()
    right.set_xlabel("GFLOP/s of the site's nodes")
    right.set_title(f"each conv site of {big.config.label()}", fontsize=MIN_FONT + 1)
    legend_below(fig, ncol=2)
    return fig
