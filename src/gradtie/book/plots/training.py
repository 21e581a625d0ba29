"""The Training appendix's figures: functions take `train` results and return a Figure.

The rendered run and the tie in blue, autodiff in orange, the must-fail control and the lagging
running statistics in red. Shown in: Training with the rendered step.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator
import numpy as np

from gradtie.train import RUNNING_MOMENTUM, Tracking
from ._style import CONTROL_COLOR, FIGSIZE, MAX_WIDTH, MIN_FONT, OK_COLOR, legend_below

AUTODIFF_COLOR = "tab:orange"
OPTIMIZER_COLORS = {"sgd": "tab:green", "nesterov": OK_COLOR, "heavy-ball": "tab:purple", "adamw": "tab:brown"}


def side_by_side(tr: Tracking) -> plt.Figure:
    """Left: the free rendered and autodiff runs' batch loss, step by step. Right: at each step the
    autodiff step's distance from the rendered step (both from the rendered run's state) under the
    bound, the control's far above it, the free runs' drift for comparison, and dotted lines at the
    steps taken where no gradient exists."""
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(MAX_WIDTH, 8.4), sharex=True,
                                   gridspec_kw={"height_ratios": (1.0, 1.4)})
    ax0.plot(tr.steps, tr.loss["rendered"], color=OK_COLOR, lw=1.6, label="rendered step")
    ax0.plot(tr.steps, tr.loss["autodiff"], color=AUTODIFF_COLOR, lw=1.0, ls="--", label="autodiff step")
    ax0.set_ylabel("batch loss (nats)")
    ax0.set_title("Two free runs: the same training curve", fontsize=10)
    ax0.legend(fontsize=MIN_FONT)

    floor = 1e-12   # an exact 0 drawn at the bottom of the log axis
    ax1.semilogy(tr.steps, np.maximum(tr.distance["autodiff"], floor), ".", color=AUTODIFF_COLOR, ms=4,
                 label="autodiff step vs rendered step")
    ax1.semilogy(tr.steps, tr.bound, color="k", ls="--", lw=1,
                 label=f"bound: {tr.factor:g} × one-ulp envelope ({tr.draws} draws)")
    for name in tr.controls:
        ax1.semilogy(tr.steps, tr.distance[name], "x", color=CONTROL_COLOR, ms=4, label=f"control: {name}")
    ax1.semilogy(tr.steps, np.maximum(tr.drift, floor), color="0.6", lw=1, label="free runs apart (drift)")
    for k, t in enumerate(tr.steps[~tr.smooth]):
        ax1.axvline(t, color="0.3", ls=":", lw=1,
                    label="non-twin tie or zero pre-activation: no gradient, not judged" if k == 0 else None)
    ax1.set_xlabel("step")
    ax1.set_ylabel("‖θ − θ_rendered‖₂ / ‖θ_rendered‖₂")
    ax1.set_title("Each step: autodiff within round-off of the rendered step", fontsize=10)
    fig.suptitle(f"Rendered vs autodiff over the first {len(tr.steps)} steps ({tr.dtype})", fontsize=11)
    legend_below(fig, [ax1], ncol=2)
    return fig


def bn_statistics_gap(history: Sequence[Mapping]) -> plt.Figure:
    """Test accuracy per epoch with recomputed (precise) BN statistics and with the running ones,
    and the share 0.99^s of the running statistics that still dates from before the weights moved."""
    epochs = np.array([h["epoch"] for h in history])
    steps = np.array([h["step"] for h in history])
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(epochs, [h["test_accuracy"] for h in history], "o-", color=OK_COLOR,
            label="recomputed statistics (precise BN)")
    ax.plot(epochs, [h["test_accuracy_running"] for h in history], "s-", color=CONTROL_COLOR,
            label=f"running statistics (momentum {RUNNING_MOMENTUM:g})")
    ax.plot(epochs, [h["train_accuracy"] for h in history], ":", color="0.5", label="train accuracy (batches)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(epochs)
    ax2 = ax.twinx()
    ax2.plot(epochs, (1 - RUNNING_MOMENTUM) ** steps, color=CONTROL_COLOR, ls="--", lw=0.8, alpha=0.6)
    ax2.set_ylabel(f"share of old statistics left, {1 - RUNNING_MOMENTUM:g}^step (dashed)", fontsize=MIN_FONT)
    ax2.set_ylim(0, 1.02)
    ax.set_title("The running statistics lag the weights; recomputed ones read the model", fontsize=10)
    ax.legend(fontsize=MIN_FONT, loc="lower right")
    fig.tight_layout()
    return fig


def optimizers(histories: Mapping[str, Sequence[Mapping]]) -> plt.Figure:
    """Mean training loss and test accuracy (recomputed statistics) per epoch, one line per optimizer."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(MAX_WIDTH, FIGSIZE[1]))
    for name, history in histories.items():
        epochs = [h["epoch"] for h in history]
        color = OPTIMIZER_COLORS.get(name)
        ax0.semilogy(epochs, [h["loss"] for h in history], "o-", color=color, label=name)
        ax1.plot(epochs, [h["test_accuracy"] for h in history], "o-", color=color, label=name)
    ax0.set_xlabel("epoch")
    ax0.set_ylabel("mean training loss (nats)")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("test accuracy (recomputed BN statistics)")
    ax1.legend(fontsize=MIN_FONT)
    for ax in (ax0, ax1):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("The four update rules on the rendered gradient, at upstream's learning rates", fontsize=11)
    fig.tight_layout()
    return fig


STEP_GROUPS = (("params", "updated tensors", "o"), ("momentum", "momentum buffers", "s"),
               ("running", "running statistics", "^"))


def step_tie(ties: Sequence, controls: Sequence = ()) -> plt.Figure:
    """One panel per tied train step (`checks.step.StepTieReport`): every row's error over its limit,
    tensor by tensor (updated tensors, then momentum buffers, then running statistics), at every
    step (light: step 1, dark: the last), under the dashed line at 1; the control of the same panel
    in red, far above it."""
    fig, axes = plt.subplots(1, len(ties), figsize=(MAX_WIDTH, FIGSIZE[1] + 0.6), squeeze=False)
    floor = 1e-6   # an exact 0 drawn at the bottom of the log axis
    for k, (ax, rep) in enumerate(zip(axes[0], ties)):
        ctrl = controls[k] if k < len(controls) else None
        offset, ticks = 0, []
        for group, label, marker in STEP_GROUPS:
            n = len(rep.steps[0].groups[group])
            if n == 0:
                continue
            x = offset + np.arange(n)
            for i, s in enumerate(rep.steps):
                shade = 0.35 + 0.65 * i / max(len(rep.steps) - 1, 1)
                y = [max(r.rel / r.limit, floor) for r in s.groups[group]]
                ax.semilogy(x, y, marker, ms=3, color=OK_COLOR, alpha=shade, mfc="none" if i == 0 else OK_COLOR,
                            label=f"step {s.step}" if group == "params" else None)
            if ctrl is not None:
                worst = np.max([[r.rel / r.limit for r in s.groups[group]] for s in ctrl.steps], axis=0)
                ax.semilogy(x, np.maximum(worst, floor), "x", ms=3, color=CONTROL_COLOR,
                            label=f"control: {ctrl.control} (worst step)" if group == "params" else None)
            ticks.append((offset + n / 2, f"{label}\n({n})"))
            offset += n + 6
            ax.axvline(offset - 3, color="0.8", lw=0.8)
        ax.axhline(1.0, color="k", ls="--", lw=1, label="limit")
        ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks], fontsize=MIN_FONT)
        ax.set_xlim(-3, offset - 3)
        ax.set_ylabel("error / limit")
        ax.set_title(f"{rep.net}, {rep.recipe}: {rep.tensors} tensors, {len(rep.steps)} steps", fontsize=9)
        ax.legend(fontsize=MIN_FONT, loc="center right")
    fig.suptitle("The rendered train step against optax on autodiff: every tensor under its limit", fontsize=11)
    fig.tight_layout()
    return fig


def mesh_agreement(distances: Mapping[str, Mapping[str, float]], limit: float) -> plt.Figure:
    """Per tensor (signature order), the relative distance of each run's final weights from the
    single-device run's: the synchronised-BN mesh under the limit (dashed), the per-replica-BN
    control far above it."""
    fig, ax = plt.subplots(figsize=(FIGSIZE[0] + 2.0, FIGSIZE[1]))
    floor = 1e-18   # an exact 0 drawn at the bottom of the log axis
    for (name, d), color, marker in zip(distances.items(), (OK_COLOR, CONTROL_COLOR, "0.5"), ("o", "x", "s")):
        ax.semilogy(np.arange(len(d)), np.maximum(list(d.values()), floor), marker, color=color, ms=4, label=name)
    ax.axhline(limit, color="k", ls="--", lw=1, label=f"limit {limit:g}")
    ax.set_xlabel("tensor (signature order; conv biases behind BatchNorm left out)")
    ax.set_ylabel("max|θ − θ_one device| / max|θ_one device|")
    ax.set_title("Final weights of the data-parallel runs against one device at the same global batch", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
