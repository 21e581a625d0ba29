# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Training with the rendered step
#
# The Lean suite's statements are about one train step, and about its RAW gradient nodes.
# `cifar8Bbn_train_step_tiedB` ties the 38 gradient nodes of the cifar8-BN train step, and
# `r34_net_tiedB` the 110 of ResNet-34's: each node is its op's derivative contracted with the
# cotangent the rendered chain hands it. The update rule and the BatchNorm running averages sit
# downstream of those nodes, and no statement of the suite is about them. The chapter Whole-net
# tie checks the node ties at fixed points, stage by stage.
#
# Most of this appendix takes many steps in a row, and that goes beyond the suite. Nothing in it
# proves that the tied step trains well, and training accuracy is no theorem. It is the engineering
# check a reader of the proof wants next: does the step the proof is about behave like the step
# everybody trains with?
#
# ```{admonition} What it shows on sklearn's handwritten digits, in six parts
# :class: dropdown
# 1. the rendered step and the autodiff step, side by side over the first steps of a run, with a
#    float32 bound that a wrong gradient breaks;
# 2. why test accuracy must be read with recomputed BatchNorm statistics, not the running ones the
#    training step keeps (downstream of the tied nodes);
# 3. the four update rules on the rendered gradient;
# 4. CIFAR-10, when you point the chapter at its files, and upstream's own CIFAR-10 and ImageNet
#    results, quoted as theirs;
# 5. two train steps of each net, tied tensor by tensor to optax on autodiff gradients: the
#    updated weights, momentum buffers and running statistics (beyond the suite, whose step ties
#    stop at the raw gradient nodes of `r34_net_tiedB` and `cifar8Bbn_train_step_tiedB`);
# 6. the same run on several devices (the data-parallel step on a mesh of host devices) against
#    one device, and the input pipeline an image folder is read through.
# ```
#
# The same runs are a command away: `gradtie train` (see the README) writes `run.json`,
# `metrics.jsonl` and resumable checkpoints.

# %% tags=["hide-input"]
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import jax
import matplotlib.pyplot as plt

from gradtie import book, data, folder, pipeline, train
from gradtie.book import plots
from gradtie.checks import bugs, step
from gradtie import tolerances as tol
from gradtie.nets import cifar8, protocol, resnet34
from gradtie.nets.layers import zero_in_reals

# %% tags=["parameters", "hide-input"]
net: str = "cifar8"   # or "resnet34" (32 px digits)
batch: int = 32       # examples per step
epochs: int = 2       # the runs' length; it fixes the cosine schedule
steps: int = 88       # steps the rendered and autodiff runs are followed side by side
lr: float = 0.02      # Nesterov's base rate (the upstream cifar8 recipe)
seed: int = 0
cifar10_path: str = ""  # cifar-10-batches-py or -bin folder; empty skips CIFAR-10
tie_batch: int = 4    # photos per step in the two step ties (the last section)
image_size: int = 32  # their side in pixels
conv_bias: bool = False  # True: the 146-tensor ResNet-34 step (a bias on every conv)
replicas: int = 4     # host devices of the data-parallel run (Every device, every host)

# %% tags=["hide-input"]
p = book.validated(
    net=net,
    batch=batch,
    epochs=epochs,
    steps=steps,
    lr=lr,
    seed=seed,
    cifar10_path=cifar10_path,
    tie_batch=tie_batch,
    image_size=image_size,
    conv_bias=conv_bias,
    replicas=replicas,
)
assert (
    p.epochs >= 2
), "the chapter interrupts its run after epoch 1 and resumes it: epochs ≥ 2"
model = {"cifar8": cifar8.NET, "resnet34": resnet34.NET}[p.net]
cfg = model.config(num_classes=10)
digits = data.load("digits", seed=p.seed)
# the run every section follows: upstream's cifar8 recipe, Nesterov with a cosine
# schedule
run = train.FitConfig(
    optimizer="nesterov", lr=p.lr, epochs=p.epochs, batch=p.batch, seed=p.seed
)
steps_per_epoch = len(digits.split.y_train) // p.batch
assert p.steps <= p.epochs * steps_per_epoch, "steps must fit in the run"
print(
    f"digits: {len(digits.split.y_train)} training and {len(digits.split.y_test)} test"
    f" images, 3×32×32 in [0, 1]; {p.net} at batch {p.batch}: {steps_per_epoch} steps"
    f" an epoch, {p.epochs} epochs"
)

# %% tags=["nbval-check-output", "hide-input"]
# ResNet-34's statements fix 224 px as a literal: a ResNet-34 figure at another side is
# the same architecture beyond them, and says so
print(
    "the step ties below: "
    + (
        protocol.resolution_note(resnet34.NET, p.image_size)
        or "resnet34 at the statements' own 224 px"
    )
)

# %% [markdown]
# ## Rendered and autodiff, side by side
#
# Start two float32 runs from the same weights and feed them the same batches, flips and
# learning rates. One steps with the rendered chain, the other with `jax.value_and_grad` of the
# same forward. In ℝ they are the same run, and in floats they are not: the two gradients round
# differently, by a few units in the last place.
#
# ```{admonition} How far may the two runs drift? The bound, step by step
# :class: dropdown
# How far apart may they drift? Left alone, they part like any two runs one ulp apart. Training
# keeps passing near kinks: a pre-activation a hair from zero, a pool window a hair from a tie.
# A difference of one ulp can decide which side of such a kink a step lands on, and the next
# gradient then differs by far more than an ulp. After the first such step the two runs are
# different samples of the same training noise, and no bound on their distance can come from
# round-off alone.
#
# So we state the bound step by step along the run, where it can fail. At every step t we take
# the autodiff step from the rendered run's own state θ₍t−1₎ and compare it with the rendered step
# from that same state. The yardstick is the rendered step's own round-off envelope. We move every
# weight of θ₍t−1₎ by one unit in the last place, up or down at random: that is the smallest change
# float32 can make, and the size of the disagreement two roundings of one update leave. Then we
# take the rendered step from there. The envelope is the largest distance of such a step from the
# rendered one, over three draws. The bound is ten times the envelope, the same multiple the
# float32 view of a single gradient uses (chapter Whole-net tie). We never tune it.
#
# Distances are relative, ‖θ − θ_rendered‖₂ / ‖θ_rendered‖₂, and they leave out the conv biases
# behind BatchNorm. Those nodes are 0 in ℝ and carry round-off only.
#
# Some steps are not judged, because no gradient exists there (chapter Pools). A live pool window can
# hold two cells that are equal in float32 without being twins, or a pre-activation can be exactly
# 0. The rendered backward routes a tied window to its first maximal cell (`maxPoolBackB`), while
# autodiff of the max splits the cotangent between the tied cells. Both are legal one-sided
# answers at a kink, and they differ by far more than round-off. A tie is non-twin when a one-ulp
# weight nudge breaks it (twins stay equal under every weight). Such steps are counted and drawn,
# not hidden; digits are full of twin ties (flat strokes and background), which are harmless. The
# control is the catalogue's `bn_swap_dgamma_dbeta` planted in the rendered step: every BN layer
# hands back dγ as dβ and dβ as dγ. It has the same shapes and raises no error, so only the bound
# can catch it.
# ```

# %% tags=["hide-input"]
tracking = train.side_by_side(model, cfg, digits, run, steps=p.steps, progress=False,
                              controls=[bugs.plant("bn_swap_dgamma_dbeta", model)])
print(tracking.summary())

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"{tracking.dtype}: bound = {tracking.factor:g} × the one-ulp envelope"
    f" ({tracking.draws} draws)"
)
print(
    "autodiff step within the bound at every smooth step:"
    f" {tracking.first_over('autodiff') is None}"
)
print(
    f"control {tracking.controls[0]} out of the bound:"
    f" {tracking.first_over(tracking.controls[0]) is not None}"
)
low, high = tol.TRAIN_DRIFT_BAND
drift = float(tracking.drift[-1])
print(
    f"free runs after {p.steps} steps: {low:g} < relative distance < {high:g}:"
    f" {low < drift < high}"
)
assert tracking.ok
assert low < drift < high

# %%
plots.training.side_by_side(tracking)
plt.show()

# %% [markdown]
# Left: the batch losses of the two free runs lie on top of each other, then wander apart as two
# independent runs would. Right: the autodiff step (orange) stays under the bound (dashed) at every
# smooth step; the γ↔β control (red) sits above it at nearly every smooth step, mostly by orders of
# magnitude. The bound spikes where a nudged step crosses a kink (the envelope is measured, so it
# widens exactly where one ulp can change the step, and there it can swallow even the control). A
# dotted line marks each step at a non-twin tie, where the two steps part by more. The free runs'
# drift (grey) climbs far past the bound within a few steps: hence a bound per step from a shared
# state, not on the free runs.

# %% [markdown]
# ## Evaluation that reflects the model
#
# ```{admonition} Beyond the suite
# :class: attention
# Test accuracy, and the BatchNorm statistics it is read with: the suite states one step, and
# accuracy is no theorem.
# ```
#
# ```{admonition} Why the running statistics mislead, and what train.fit reads instead
# :class: dropdown
# BatchNorm's running statistics are part of the training step, downstream of the gradient nodes the
# suite ties (its step ties stop at the raw nodes). Every step moves them 1% of the way
# toward the batch's: `running ← 0.99·running + 0.01·batch`, the upstream recipe, which we keep as
# it is. After s steps they still carry 0.99^s of their starting point. Meanwhile the weights move
# fast early in training, so the running statistics describe weights from many steps ago. Read
# test accuracy through them and you measure that lag, not the model.
#
# So before every evaluation `train.fit` recomputes each BN layer's population statistics with the
# current weights. It uses a fixed set of training batches (16 by default; the "precise BN" of
# Wu and Johnson, 2021). The batches run through the train-mode forward, and their means and
# variances are combined with Chan's rule. `test_accuracy` reads these statistics;
# `test_accuracy_running` reads the running ones, and `bn_gap` is the difference. Test images
# never normalise with their own batch's statistics.
# ```
#
# The run below is the run the side-by-side figure started: the same `train.FitConfig`. We
# interrupt it after epoch 1 and resume it from its folder, as `gradtie train --out DIR --resume`
# does. The epochs that follow the resume must repeat, bit for bit, the rendered run followed above.

# %% tags=["hide-input", "hide-output"]
run_dir = Path(tempfile.mkdtemp(prefix="gradtie-training-")) / "digits"
first = train.fit(model, cfg, digits, run, out=run_dir, stop_after=1, progress=False)
result = train.fit(model, cfg, digits, run, out=run_dir, resume=True, progress=False)
history = result.history
for h in history:
    print(train.epoch_line(h, p.epochs))

# %% tags=["nbval-check-output", "hide-input"]
lines = (run_dir / train.METRICS).read_text().splitlines()
print(
    f"{train.METRICS}: {len(lines)} lines for {p.epochs} epochs; the first run stopped"
    f" after {len(first.history)}"
)
# every epoch after the resume that lies within the side-by-side steps, against those
# steps
resumed = [h for h in history[1:] if h["step"] <= p.steps]
same = all(
    h["loss"]
    == sum(tracking.loss["rendered"][h["step"] - steps_per_epoch : h["step"]])
    / steps_per_epoch
    and h["train_accuracy"]
    == sum(tracking.accuracy["rendered"][h["step"] - steps_per_epoch : h["step"]])
    / steps_per_epoch
    for h in resumed
)
print(
    f"resumed epochs inside the first {p.steps} steps: {[h['epoch'] for h in resumed]};"
    " their mean loss and accuracy equal the side-by-side's rendered steps bit for"
    f" bit: {same}"
)
left = (1 - train.RUNNING_MOMENTUM) ** history[0]["step"]
print(f"after epoch 1 ({history[0]['step']} steps) the running statistics still carry "
      f"0.99^{history[0]['step']} = {left:.2f} of their start")
print(f"epoch 1: recomputed statistics beat running ones by ≥ {tol.TRAIN_LAG_GAP:g}: "
      f"{history[0]['bn_gap'] >= tol.TRAIN_LAG_GAP}")
band = tol.TRAIN_DIGITS_ACCURACY[p.net] if p.epochs >= 8 else tol.TRAIN_SHORT_ACCURACY
final = history[-1]["test_accuracy"]
print(
    f"test accuracy after {p.epochs} epochs, recomputed statistics, ≥ {band:g}:"
    f" {final >= band}"
)
book.glue(
    "digits_accuracy",
    (p.net, band, p.epochs, final >= band),
    "{}: test accuracy on digits ≥ {:g} after {} epochs (recomputed statistics): {}",
    at=book.At(
        p.net,
        image_size=32,
        batch=p.batch,
        classes=10,
        data="digits",
        dtype="float32",
        weights="init",
        extra={"epochs": p.epochs},
    ),
)
assert len(lines) == p.epochs and len(first.history) == 1 and resumed and same
assert history[0]["bn_gap"] >= tol.TRAIN_LAG_GAP
assert final >= band

# %%
plots.training.bn_statistics_gap(history)
plt.show()

# %% [markdown]
# Red: what a user would have seen had evaluation read the running statistics; it says the model
# is broken while blue, the same weights evaluated properly, says it has learnt. Dashed: the share
# 0.99^s of the running statistics that still dates from before the weights moved. The gap closes
# only as that share fades and the cosine schedule slows the weights. With 8 epochs at batch 64
# (the `cpu` and `gpu` profiles) the cell holds the run to `tolerances.TRAIN_DIGITS_ACCURACY`
# instead of the short-run band.

# %% [markdown]
# ## The optimizers side by side
#
# The rendered gradient feeds each of the book's four update rules unchanged, at upstream's learning
# rates: SGD 0.1, Nesterov 0.02, heavy ball 0.1 with coupled weight decay, and AdamW 10⁻³ with
# decoupled decay. AdamW is optax's own; the three SGD rules are written out, and the last section
# ties them to optax's. Here they train the same net on the same batches for the same epochs, and
# we read each with recomputed statistics.

# %% tags=["hide-input", "hide-output"]
histories = {"nesterov": history}
for name in ("sgd", "heavy-ball", "adamw"):
    histories[name] = train.fit(
        model, cfg, digits, replace(run, optimizer=name, lr=None), progress=False
    ).history
for name, h in histories.items():
    print(f"{name:10s} " + train.epoch_line(h[-1], p.epochs))

# %% tags=["nbval-check-output", "hide-input"]
for name, h in histories.items():
    rate = p.lr if name == "nesterov" else train.DEFAULT_LR[name]
    print(f"{name} (lr {rate:g}): test accuracy ≥ {tol.TRAIN_SHORT_ACCURACY:g}: "
          f"{h[-1]['test_accuracy'] >= tol.TRAIN_SHORT_ACCURACY}")
assert all(
    h[-1]["test_accuracy"] >= tol.TRAIN_SHORT_ACCURACY for h in histories.values()
)

# %%
plots.training.optimizers(histories)
plt.show()

# %% [markdown]
# ## CIFAR-10
#
# ```{admonition} Running it on CIFAR-10
# :class: dropdown
# CIFAR-10 does not ship with any package, so this section runs only when `cifar10_path` names
# the files. Use either version from https://www.cs.toronto.edu/~kriz/cifar.html: the python
# version (`cifar-10-batches-py`) or the binary version (`cifar-10-batches-bin`). For example:
# `papermill notebooks/training.ipynb out.ipynb -p cifar10_path /data/cifar-10-batches-py -p
# epochs 40 -p batch 128`. Upstream's recipe is 40 epochs at batch 128 with left–right flips.
# ```

# %% tags=["nbval-check-output", "hide-input"]
if p.cifar10_path:
    cifar = data.load(f"cifar10:{p.cifar10_path}")
    cifar_run = train.fit(model, cfg, cifar, run, progress=False)
    for h in cifar_run.history:
        print(train.epoch_line(h, p.epochs))
    print(f"CIFAR-10, {p.net}, {p.epochs} epochs: test accuracy "
          f"{cifar_run.history[-1]['test_accuracy']:.4f} (recomputed statistics)")
else:
    print(
        "CIFAR-10: skipped, no files given (set cifar10_path to the cifar-10-batches-py"
        " or cifar-10-batches-bin folder)"
    )

# %% [markdown]
# ## Every device, every host
#
# ```{admonition} Beyond the suite, in part
# :class: attention
# The suite ties the data-parallel step's all-reduced nodes to the single-device nodes at batch
# R·N (`r34_net_syncTiedB`; chapter Data-parallel tie). A run of many such steps, its evaluation,
# the input pipeline, the checkpoints and the hosts lie beyond it.
# ```
#
# ```{admonition} How the mesh trains, and the three runs below
# :class: dropdown
# `gradtie train --replicas R` trains with the data-parallel step that chapter ties
# (`parallel.make_step`): R replicas on a data mesh, each running the rendered chain on its own N
# examples, every BatchNorm layer normalising with the statistics of the whole global batch of
# R·N, the gradients all-reduced. The precise BN statistics and the evaluation run on the mesh
# too. In ℝ this is the single-device run at batch R·N, step for step; in float64 the two may
# part only by round-off. `--replicas 1` is the single-device run, bit for bit.
#
# Here are three runs of that command on this machine's host devices, in float64 (a short run of
# cifar8 on digits, one epoch): R replicas of N examples, the same with per-replica BatchNorm
# (`--no-sync-bn`, each replica normalising with its own N examples), and one device at R·N. The
# limit is the float64 floor of the tie kit. The control is per-replica BatchNorm, which is
# another function of the weights and must leave the limit far behind.
# ```

# %% tags=["hide-input", "hide-output"]
scale_dir = Path(tempfile.mkdtemp(prefix="gradtie-scale-"))
per_replica = 4
scale_command = [
    sys.executable,
    "-m",
    "gradtie",
    "train",
    "--net",
    "cifar8",
    "--head-width",
    "32",
    "--data",
    "digits",
    "--n-train",
    str(4 * p.replicas * per_replica),
    "--n-test",
    "64",
    "--epochs",
    "1",
    "--precise-batches",
    "1",
    "--dtype",
    "float64",
    "--seed",
    str(p.seed),
]
scale_runs = {
    "mesh": ["--replicas", str(p.replicas), "--batch", str(per_replica)],
    "per-replica BN": [
        "--replicas",
        str(p.replicas),
        "--batch",
        str(per_replica),
        "--no-sync-bn",
    ],
    "one device": ["--replicas", "1", "--batch", str(p.replicas * per_replica)],
}
# the three commands at once, each on this CPU's host devices
launched = {
    name: subprocess.Popen(
        scale_command + args + ["--out", str(scale_dir / name)],
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for name, args in scale_runs.items()
}
finished = {
    name: (*proc.communicate(), proc.returncode) for name, proc in launched.items()
}
assert all(code == 0 for _, _, code in finished.values()), {
    n: e[-800:] for n, (_, e, c) in finished.items() if c
}
scale_params = {
    name: train.checkpoint_params(scale_dir / name, cifar8.NET)[0]
    for name in scale_runs
}
scale_last = {
    name: json.loads((scale_dir / name / train.METRICS).read_text().splitlines()[-1])
    for name in scale_runs
}
reference = scale_params["one device"]
distances = {
    name: train.tensor_distances(
        scale_params[name], reference, skip=set(zero_in_reals(reference))
    )
    for name in ("mesh", "per-replica BN")
}
for name, d in distances.items():
    print(
        f"{name} ({scale_last[name]['devices']} devices): worst tensor"
        f" {max(d, key=d.get)} at {max(d.values()):.1e}; test accuracy"
        f" {scale_last[name]['test_accuracy']:.4f}"
    )
print(f"one device: test accuracy {scale_last['one device']['test_accuracy']:.4f}")

# %% tags=["nbval-check-output", "hide-input"]
mesh_limit = tol.FLOORS["float64"]
worst = {name: max(d.values()) for name, d in distances.items()}
same_figures = all(
    scale_last["mesh"][k] == scale_last["one device"][k]
    for k in ("test_accuracy", "test_top5", "test_accuracy_running", "train_accuracy")
)
print(
    f"{p.replicas} replicas × {per_replica} against one device at"
    f" {p.replicas * per_replica}, float64, {scale_last['mesh']['step']} steps: every"
    f" tensor within {mesh_limit:g}: {worst['mesh'] <= mesh_limit}"
)
print(
    "the mesh's evaluation counts the same hits (top-1, top-5, running statistics) and"
    f" the same training accuracy: {same_figures}"
)
print(
    "control, per-replica BatchNorm: some tensor off by more than 1e-3:"
    f" {worst['per-replica BN'] > 1e-3}"
)
book.glue(
    "mesh_run",
    (p.replicas, per_replica, worst["mesh"] <= mesh_limit),
    "{} replicas × {} within the float64 floor of one device at the same global"
    " batch: {}",
    at=book.At(
        "cifar8",
        image_size=32,
        batch=p.replicas * per_replica,
        classes=10,
        data="digits",
        dtype="float64",
        replicas=p.replicas,
        extra={"head_width": 32, "steps": scale_last["mesh"]["step"]},
    ),
)
assert worst["mesh"] <= mesh_limit and same_figures
assert worst["per-replica BN"] > 1e-3

# %%
plots.training.mesh_agreement(distances, mesh_limit)
plt.show()

# %% [markdown]
# Every tensor of the mesh run sits at round-off from the single-device run's, and the
# per-replica BatchNorm run sits orders of magnitude above the limit: its statistics come from N
# examples, not R·N, so its gradients are those of another loss.
#
# ```{admonition} Checkpoints, and the same run across hosts
# :class: dropdown
# Both runs wrote their
# checkpoints with orbax (`checkpoints/<step>/`, every process its share, asynchronously, the
# last `--keep` and the best kept); the single-device run wrote `checkpoint.npz` as every run
# before it did. `gradtie check --weights RUN` reads either.
#
# Across hosts the command is the same, started once per host with the coordinator, the process
# count and the process id in the environment (`JAX_COORDINATOR_ADDRESS=host0:1234
# JAX_NUM_PROCESSES=P JAX_PROCESS_ID=p`, see the README). The mesh then spans every host's
# devices and each host reads only its own rows of each global batch. `tests/test_train_mesh.py`
# starts two such processes on 127.0.0.1 with two host devices each (gloo collectives) and holds
# their run to one process of four devices and to one device, within ten times the
# single-device run's own round-off envelope.
# ```
#
# ### The input pipeline
#
# ```{admonition} What the pipeline does, and what is measured below
# :class: dropdown
# ImageNet arrives as a folder of JPEGs, one subfolder per class (`--data folder:PATH`, as
# torchvision's `ImageFolder` reads it). `gradtie.pipeline` decodes and augments it in worker
# processes with grain, JAX's data library: a random resized crop and a flip for training, the
# centre crop for evaluation, per-channel normalisation. The order is fixed by the seed and the
# epoch, whatever the number of workers or hosts, and its position is checkpointed with the
# weights, so a run resumed mid-epoch reads exactly the batches it would have read. A file that
# does not decode is skipped and named. Below, the pipeline alone on JPEGs of ImageNet's most
# common size (500×375) cut from the shipped photos, at 224 px, in this process's thread and in
# one worker process. Set the figure against the step's own images per second (the
# `step_images_per_second` of `metrics.jsonl`) to tell a data-bound run from a compute-bound
# one; `gradtie bench --input` measures the same on any folder.
# ```

# %% tags=["hide-input", "hide-output"]
photo_folder = folder.write_photo_folder(
    scale_dir / "photos", per_class=16, val_per_class=1, size=(500, 375)
)
input_rates = [
    pipeline.measure(photo_folder.train, workers=w, size=224, batch=16, batches=4)
    for w in (0, 1)
]
for rate in input_rates:
    print(rate.row())
print(
    "the mesh run's step alone, cifar8 at 32 px:"
    f" {scale_last['mesh']['step_images_per_second_per_device']:.0f} images/s per"
    " device"
)
assert all(r.images_per_second > 0 for r in input_rates)

# %% [markdown]
# ## Upstream's results, quoted
#
# The figures below are upstream's, from its own runs. This book did not produce them and does
# not re-run them. ImageNet needs a GPU cluster, and the CIFAR-10 medians need five 40-epoch runs
# per optimizer.
#
# ```{admonition} Upstream's CIFAR-10 and ImageNet accuracies, and what the suite covers of those runs
# :class: dropdown
# | upstream run | SGD | Nesterov | AdamW |
# |---|---|---|---|
# | cifar8-BN on CIFAR-10, wide head, 40 epochs, median of 5 | 74.5 | 76.3 | 74.3 |
# | the same, batched op family, float32 | 74.39 | 76.72 | 74.48 |
# | the same, batched op family, bf16 convs | 74.70 | 76.70 | 74.15 |
#
# | upstream ResNet-34 on ImageNet (90 epochs, 4 GPUs, bf16) | top-1 | top-5 |
# |---|---|---|
# | JAX reference | 72.02 | 90.62 |
# | the verified bf16 path, per-replica BatchNorm | 74.064 | 91.754 |
# | the verified bf16 path, synchronised BatchNorm | 74.168 | 91.894 |
#
# What the suite covers of these runs is narrower than the runs. It ties the raw gradient nodes of
# the cifar8-BN train step (`cifar8Bbn_train_step_tiedB`; cifar8 has no data-parallel render) and
# of ResNet-34's (`r34_net_tiedB`), read over ℝ, the bf16 nodes at the identity rounding
# (`Bf16Erasure`; the kinds' rounding itself is stated for any rounding, but tied nowhere). Every
# ResNet-34 data-parallel render synchronises BatchNorm, and its
# all-reduced nodes are `r34_net_syncTiedB`'s. So the "verified bf16 path, synchronised BatchNorm"
# run took steps whose raw gradient nodes the suite states, read at the identity rounding. It does
# not cover the JAX reference run (autodiff, not the render), the per-replica BatchNorm run (every
# data-parallel render the suite states synchronises BatchNorm), the bf16 rounding itself, the
# update rules or the running statistics. The accuracies themselves, theirs and ours, lie beyond
# what it states.
# ```

# %% [markdown]
# ## The train step is tied
#
# The suite's statements about training are about one step, and stop at its raw gradient nodes:
# `r34_net_tiedB` (ResNet34StepTieB) ties the gradient nodes of ResNet-34's train step, 110 tensors
# (146 at `convBias := true`, when every conv carries a bias), and `cifar8Bbn_train_step_tiedB`
# the 38 of cifar8-BN's, each node at the cotangent the rendered chain hands it ("optimizer form:
# the RAW gradient", as the step-tie module puts it). The chapter Stage by stage ties those nodes
# stage by stage, at the cotangent the chain hands each stage.
#
# ```{admonition} Beyond the suite
# :class: attention
# The rest of this section ties what the step does with those nodes: the update rule and the
# BatchNorm running averages. No statement of the suite is about them.
# ```
#
# ```{admonition} The step a user of the usual tools takes, and the census of what a step updates
# :class: dropdown
# We tie the whole step as `train.make_step` takes it: one forward, the rendered chain, the update
# rule, the running statistics. We tie it to the step a user of the usual tools takes:
# `jax.value_and_grad` of the forward-based loss, fed to optax, with the running averages
# recomputed from each BatchNorm input in plain jnp (the book's convention: copied on the first
# step, then 0.99·old + 0.01·batch, biased variance).
#
# First the census of the tensors a step updates, read from each net's parameter list.
# ```

# %% tags=["nbval-check-output", "hide-input"]
census = {
    "resnet34": len(resnet34.NET.param_specs(resnet34.Config(conv_bias=False))),
    "resnet34, conv_bias": len(
        resnet34.NET.param_specs(resnet34.Config(conv_bias=True))
    ),
    "cifar8": len(cifar8.NET.param_specs(cifar8.Config())),
}
print(f"tensors a step updates: {census}")
assert census == {"resnet34": 110, "resnet34, conv_bias": 146, "cifar8": 38}

# %% [markdown]
# ### The update rules are optax's
#
# ```{admonition} The two recipes, term by term against optax
# :class: dropdown
# Before any gradient, the rules themselves. ResNet-34's ImageNet recipe is the heavy ball with
# coupled weight decay: g ← g + wd·θ on every tensor, v ← 0.9v + g, θ ← θ − lr·v. In
# optax that is `chain(add_decayed_weights(wd), sgd(lr, momentum=0.9))`: the decay is added to the
# gradient before the momentum trace sees it. cifar8's recipe is Nesterov, v ← μv + g and
# θ ← θ − lr·(g + μv). optax's `sgd(lr, momentum=0.9, nesterov=True)` forms the new trace as
# g + μ·t and steps along g + μ·(new trace), scaled by −lr. That is the same formula, term by term,
# with no different formulation to reconcile. So on the same gradients (here N(0, 1) draws shaped
# like cifar8's 38 tensors) the two should agree bit for bit, and they do. The control is decoupled decay, where the decay skips the buffer; it parts from
# optax's rule.
# ```

# %% tags=["nbval-check-output", "hide-input"]
jax.config.update("jax_enable_x64", True)   # the step tie runs in float64
step_cfg = {
    "resnet34": resnet34.Config(num_classes=7, conv_bias=p.conv_bias),
    "cifar8": cifar8.Config(num_classes=7),
}
r34_params = resnet34.NET.init(
    jax.random.key(p.seed), step_cfg["resnet34"], weights="drawn"
)
c8_params = cifar8.NET.init(jax.random.key(p.seed), step_cfg["cifar8"], weights="drawn")
rule_grads = step.random_gradients(c8_params, 3, seed=p.seed)
for recipe in step.RECIPES:
    d = step.rule_difference(recipe, c8_params, rule_grads)
    print(
        f"{recipe}: train.make_optimizer({recipe!r}) vs {step.optax_text(recipe)}, 3"
        f" steps on the same gradients: bit for bit: {d == 0.0}"
    )
    assert d == 0.0
decoupled = step.control(cifar8.NET, "heavy-ball", "decoupled_weight_decay").optimizer
d = step.rule_difference("heavy-ball", c8_params, rule_grads, optimizer=decoupled)
print(
    f"control decoupled_weight_decay vs {step.optax_text('heavy-ball')}: bit for bit:"
    f" {d == 0.0}"
)
assert d != 0.0

# %% [markdown]
# ### ResNet-34's heavy-ball step against optax (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# The updated tensors, momentum buffers and running statistics of ResNet-34's step: downstream of
# `r34_net_tiedB`'s raw gradient nodes, which the suite ties and this section does not isolate.
# ```
#
# ```{admonition} The two steps and each row's limit
# :class: dropdown
# Two steps of the heavy-ball recipe (lr 0.1, wd 10⁻⁴, label smoothing 0.1), in float64, from drawn
# weights (γ ≠ 1, β ≠ 0) on crops of the shipped photos, with one class per photo. Two steps,
# because the momentum buffer carries step 1 into step 2. The rendered run and the optax run each
# go on their own from the same start. After every step we compare each updated tensor, each
# momentum buffer, each running statistic and the loss.
#
# Each row's limit is ten times its envelope, floored at 10⁻¹⁰ (the tie kit's `compare`). The
# envelope is how far the optax run itself lands when each of its gradients is taken another
# correct way. In one run every batch is reversed, so every batch sum is taken in another order. In
# two more runs the weights and pixels are nudged by one unit roundoff at every step. Each of these
# runs goes to the last step, so the envelope also holds what step 1's round-off grows into by
# step 2. Where a BatchNorm layer averages few cells (layer4 here sees 4 values per channel), the
# envelope widens past the floor, and the printed table says so.
# ```

# %% tags=["hide-input", "hide-output"]
r34_batches = data.photo_batches(2, p.tie_batch, p.image_size, seed=p.seed)
r34_reference = step.reference_run(
    resnet34.NET, r34_params, r34_batches, step_cfg["resnet34"], recipe="heavy-ball"
)
r34_tie = step.tie_step(
    resnet34.NET,
    r34_params,
    r34_batches,
    step_cfg["resnet34"],
    recipe="heavy-ball",
    reference=r34_reference,
)
print(r34_tie.summary())
widened = [r for _, _, r in r34_tie.rows() if r.by == "envelope"]
print(
    f"{len(widened)} of {len(r34_tie.rows())} rows have limits the envelope widened"
    f" past the 1e-10 floor (widest {max(r.limit for r in widened):.1e})"
    if widened
    else "every limit at the 1e-10 floor"
)

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"beyond the suite: ResNet-34, {r34_tie.recipe} ({r34_tie.optax}, lr"
    f" {r34_tie.lr:g}), {len(r34_tie.steps)} steps at batch {p.tie_batch},"
    f" {p.image_size} px, float64, drawn weights"
)
for line in r34_tie.verdict_lines():
    print(line)
print(
    f"tied: {r34_tie.ok}; rows too ill-conditioned to judge:"
    f" {len(r34_tie.ill_conditioned)}"
)
book.glue(
    "r34_step_tied",
    (*r34_tie.counts("params"), len(r34_tie.steps)),
    "{}/{} updated tensors within their limits at each of {} steps",
    at=book.At(
        "resnet34",
        image_size=p.image_size,
        batch=p.tie_batch,
        data="photos",
        dtype="float64",
        weights="drawn",
        extra={"conv_bias": p.conv_bias, "optimizer": r34_tie.optax},
    ),
)
assert r34_tie.ok and not r34_tie.ill_conditioned
assert r34_tie.tensors == census["resnet34, conv_bias" if p.conv_bias else "resnet34"]
assert all(s.moved == r34_tie.movers for s in r34_tie.steps)

# %% [markdown]
# ```{admonition} The control: decoupled decay passes step 1 and fails step 2
# :class: dropdown
# The control takes the decay out of the buffer: v ← 0.9v + g, θ ← θ − lr·v − lr·wd·θ. In ℝ its
# first step is the right one, and so every updated tensor passes at step 1. Only the momentum
# buffer gives it away there, since it lacks wd·θ. At step 2 that missing term reaches the weights
# and every tensor fails. A tie that compared the parameters after one step would have passed it.
# ```

# %% tags=["nbval-check-output", "hide-input"]
r34_control = step.tie_step(
    resnet34.NET,
    r34_params,
    r34_batches,
    step_cfg["resnet34"],
    recipe="heavy-ball",
    reference=r34_reference,
    control=step.control(resnet34.NET, "heavy-ball", "decoupled_weight_decay"),
)
for line in r34_control.verdict_lines():
    print(f"control {r34_control.control}, {line}")
first_step, first_group, _ = r34_control.first_failure()
print(
    f"red: {r34_control.red}; first to break: step {first_step}, the"
    f" {step.GROUP_NAMES[first_group]}s"
)
assert r34_control.red and (first_step, first_group) == (1, "momentum")
assert r34_control.steps[0].within("params") == (r34_tie.tensors, r34_tie.tensors)
assert r34_control.steps[1].within("params")[0] == 0

# %% [markdown]
# ### cifar8-BN's Nesterov step against optax (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# The updated tensors, momentum buffers and running statistics of cifar8-BN's step, and the
# `no_lookahead` control, which changes only the update rule: downstream of
# `cifar8Bbn_train_step_tiedB`'s raw gradient nodes.
# ```
#
# ```{admonition} The step and its control
# :class: dropdown
# The same tie for cifar8's Nesterov step (lr 0.02, no smoothing), on the same number of photos.
# Its control steps with Nesterov's buffer but drops the look-ahead, θ ← θ − lr·v. That is the
# plain heavy ball, the formulation a Nesterov step is most easily confused with.
# ```

# %% tags=["hide-input", "hide-output"]
c8_batches = data.photo_batches(2, p.tie_batch, 32, seed=p.seed)
c8_reference = step.reference_run(
    cifar8.NET, c8_params, c8_batches, step_cfg["cifar8"], recipe="nesterov"
)
c8_tie = step.tie_step(
    cifar8.NET,
    c8_params,
    c8_batches,
    step_cfg["cifar8"],
    recipe="nesterov",
    reference=c8_reference,
)
c8_control = step.tie_step(
    cifar8.NET,
    c8_params,
    c8_batches,
    step_cfg["cifar8"],
    recipe="nesterov",
    reference=c8_reference,
    control=step.control(cifar8.NET, "nesterov", "no_lookahead"),
)
print(c8_tie.summary())
print(c8_control.summary())

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"beyond the suite: cifar8-BN, {c8_tie.recipe} ({c8_tie.optax}, lr {c8_tie.lr:g}), "
    f"{len(c8_tie.steps)} steps at batch {p.tie_batch}, float64, drawn weights"
)
for line in c8_tie.verdict_lines():
    print(line)
print(
    f"tied: {c8_tie.ok}; rows too ill-conditioned to judge:"
    f" {len(c8_tie.ill_conditioned)}"
)
print(
    f"control {c8_control.control}: red: {c8_control.red}, first at step"
    f" {c8_control.first_failure()[0]}"
)
book.glue(
    "c8_step_tied",
    (
        *c8_tie.counts("params"),
        len(c8_tie.steps),
        c8_control.control,
        "red" if c8_control.red else "NOT red",
    ),
    "{}/{} updated tensors within their limits at each of {} steps; control {} {}",
    at=book.At(
        "cifar8",
        image_size=32,
        batch=p.tie_batch,
        data="photos",
        dtype="float64",
        weights="drawn",
        extra={"optimizer": c8_tie.optax},
    ),
)
assert c8_tie.ok and not c8_tie.ill_conditioned and c8_tie.tensors == census["cifar8"]
assert all(s.moved == c8_tie.movers for s in c8_tie.steps)
assert c8_control.red and c8_control.first_failure()[0] == 1

# %%
plots.training.step_tie([r34_tie, c8_tie], [r34_control, c8_control])
plt.show()

# %% [markdown]
# Every row of both steps sits far under its limit (blue, hollow at step 1, filled at step 2); the
# controls (red crosses) sit orders of magnitude above. In ResNet-34's panel the control passes the
# running statistics (step 2 reads its batch statistics at the weights after step 1, which decoupled
# decay gets right in ℝ) and fails every updated tensor and momentum buffer. `tests/checks/test_step.py`
# runs the tie too: the 146-tensor step with conv biases, plain SGD, and every control of each recipe
# (decoupled decay, dampened momentum, no look-ahead, the learning rate applied twice, a skipped
# tensor, the unbiased running variance).

# %% [markdown]
# ## What this chapter showed
#
# The suite's statements stop at one step's raw gradient nodes (`r34_net_tiedB`,
# `cifar8Bbn_train_step_tiedB`, shown in the chapter Stage by stage); this appendix is about what
# the step does with them, and all of it is beyond the suite:
#
# - over the first steps of a run, the autodiff step from the rendered run's own state stays
#   within ten times the rendered step's envelope at every smooth step, and a γ↔β bug does not
#   ([§ Rendered and autodiff, side by side](#rendered-and-autodiff-side-by-side) and its figure);
# - test accuracy must be read with recomputed BatchNorm statistics: the running ones lag the
#   weights by 0.99ˢ ([§ Evaluation that reflects the model](#evaluation-that-reflects-the-model));
# - the four update rules train on the rendered gradient
#   ([§ The optimizers side by side](#the-optimizers-side-by-side));
# - two steps of each net's recipe, updated tensors, momentum buffers and running statistics,
#   tie to optax on autodiff gradients, and each recipe's control goes red
#   ([§ The train step is tied](#the-train-step-is-tied) and its figure).
#
# Upstream's CIFAR-10 and ImageNet accuracies are quoted as theirs; the book does not re-run them.
