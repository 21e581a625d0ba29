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
# # Stage by stage
#
# The chapter {doc}`Whole-net tie <whole_net_tie>` tied each net's rendered backward to autodiff of
# the whole forward. Here we take the chains apart: each stage's rendered backward, its nodes and
# the cotangent it hands on, tied to `jax.vjp` of that stage ALONE at the cotangent the chain hands
# it (`r34_net_tiedB`, `cifar8Bbn_train_step_tiedB`, the block input cotangents
# `r34IdCotIn_eq_vjp` and `r34DownCotIn_eq_vjp`, cifar8's seventeen CertLayers of
# `cifar8BbnInputGradB_correct`), a planted bug that goes red at the stage that holds it, and the
# quantifiers "at every batch size N" and "at every loss cotangent". Every tie runs at
# {term}`drawn weights`, in float64, each row within 10 × the stage's own
# {term}`round-off envelope <envelope>`.

# %% tags=["hide-input"]
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book, pages, plots, prng, rendered
from gradtie import tolerances
from gradtie.checks import bugs, census, stages
from gradtie.data import images
from gradtie.checks.fd import derivatives
from gradtie.checks.tie import (
    Point,
    float32_view,
    is_beta,
    reference_at,
    targets_matrix,
    tie,
)
from gradtie.kit import KIT
from gradtie.nets import cifar8, protocol, resnet34

# %% tags=["parameters"]
batch: int = 4         # cifar8 examples (photos, 32 px)
image_size: int = 32  # ResNet-34's side in the per-stage figures (224: the statements')
resnet_batch: int = 4  # ResNet-34 examples at image_size
statement_batch: int = 2  # ResNet-34 examples at the statements' own 224 px
num_classes: int = 10  # ResNet-34 classes K (1000 for ImageNet)
label_smoothing: float = 0.1  # α, both nets (ResNet-34 bakes 0.1; cifar8's runs use 0)
weights: str = "drawn"  # the only choice: bugs hide at init, where every γ is 1, β 0
every_n: bool = False  # the N sweep: every N of 1…8 (False: 1, 2, 4)
seed: int = 0

# %% tags=["hide-input"]
p = book.validated(
    batch=batch,
    image_size=image_size,
    resnet_batch=resnet_batch,
    statement_batch=statement_batch,
    num_classes=num_classes,
    label_smoothing=label_smoothing,
    weights=weights,
    every_n=every_n,
    seed=seed,
)
key = jax.random.key(p.seed)


def fold(i):
    return jax.random.fold_in(key, i)


alpha = p.label_smoothing
cfg8, cfg34 = cifar8.Config(), resnet34.Config(num_classes=p.num_classes)
params8 = {
    k: v.astype(jnp.float64)
    for k, v in cifar8.init(key, cfg8, weights=p.weights).items()
}
params34 = {
    k: v.astype(jnp.float64)
    for k, v in resnet34.init(key, cfg34, weights=p.weights).items()
}
x8 = images("photos", p.batch, 32, seed=p.seed)  # float64 photo crops in [0, 1]
x34 = images("photos", p.resnet_batch, p.image_size, seed=p.seed)
# the statements' 224 px
x224 = images("randn", p.statement_batch, resnet34.SUITE_IMAGE_SIZE, seed=p.seed)
# the label every smaller-size figure carries
small34 = protocol.resolution_note(resnet34, p.image_size)
randn8 = images("randn", p.batch, 32, seed=p.seed)  # N(0, 1) pixels: no twins
# pool-feeding β raised: no dead window
lifted8 = census.lift_dead_windows(cifar8, params8, randn8, cfg8)
t8 = targets_matrix((jnp.arange(p.batch) * 3 + 1) % 10, 10, jnp.float64)
t34 = targets_matrix(
    (jnp.arange(p.resnet_batch) * 3 + 1) % p.num_classes, p.num_classes, jnp.float64
)
t224 = targets_matrix(
    (jnp.arange(p.statement_batch) * 3 + 1) % p.num_classes, p.num_classes, jnp.float64
)
# the census of each point (chapter Whole-net tie shows it): what every figure is glued
# with
points = {
    ("cifar8", "photos"): census.smoothness(cifar8, params8, x8, cfg8),
    ("cifar8", "randn, β lifted"): census.smoothness(cifar8, lifted8, randn8, cfg8),
    ("ResNet-34", "randn, 224 px"): census.smoothness(resnet34, params34, x224, cfg34),
    ("ResNet-34", "photos"): census.smoothness(resnet34, params34, x34, cfg34),
}
smooth8 = points["cifar8", "photos"]
verdicts = {k: book.census_verdicts(s) for k, s in points.items()}
at8 = dict(net="cifar8", image_size=32, classes=10, dtype="float64", weights=p.weights)
at34 = dict(net="resnet34", classes=p.num_classes, dtype="float64", weights=p.weights,
            extra={"widths": list(resnet34.WIDTHS)})
at_photos8 = book.At(**at8, batch=p.batch, alpha=alpha, data="photos",
                     census=verdicts["cifar8", "photos"])
at_lifted8 = book.At(**at8, batch=p.batch, alpha=alpha, data="randn, β lifted",
                     census=verdicts["cifar8", "randn, β lifted"])
at224 = book.At(
    **at34,
    image_size=resnet34.SUITE_IMAGE_SIZE,
    batch=p.statement_batch,
    alpha=alpha,
    data="randn",
    census=verdicts["ResNet-34", "randn, 224 px"],
)
at_photos34 = book.At(
    **at34,
    image_size=p.image_size,
    batch=p.resnet_batch,
    alpha=alpha,
    data="photos",
    census=verdicts["ResNet-34", "photos"],
)

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"cifar8: photos {tuple(x8.shape)}; ResNet-34: photos {tuple(x34.shape)} and randn"
    f" {tuple(x224.shape)} (the statements' 224 px), K = {p.num_classes}; α = {alpha}"
)
print(f"ResNet-34 figures at {p.image_size} px: {small34 or 'the literal resolution'}")
for (net_name, point), s in points.items():
    print(f"{net_name:<10} {point:<16} " + "; ".join(
        f"{h.name} {'holds' if h.holds else 'FAILS'}" for h in s.hypotheses))
assert all(s.hypothesis(census.PARAMETERS).holds for s in points.values())
assert points["cifar8", "randn, β lifted"].hypothesis(census.C8_INPUT).holds
assert points["ResNet-34", "randn, 224 px"].hypothesis(census.R34_INPUT).holds

# %% [markdown]
# ## Every stage against its own VJP
#
# `stages.stage_ties` runs the rendered chain once, records the cotangent it hands every stage,
# and ties each stage's rendered backward to `jax.vjp` of that stage alone at that cotangent; the
# loss cotangent (the head's six kit ops) is tied to autodiff of the loss in the logits first. We
# run it on ResNet-34's eighteen stages (photos at `image_size`) and cifar8's five, for the real
# chain and for a chain with one bug planted (section
# [A planted bug](#a-planted-bug-red-and-where-it-parts)). The figure: each stage's worst error
# over its limit, in backward order.

# %%
pt8 = Point.of(cifar8, params8, x8, t8, cfg8, label_smoothing=alpha, key=fold(12))
pt34 = Point.of(resnet34, params34, x34, t34, cfg34, label_smoothing=alpha, key=fold(9))
st34, st8 = stages.stage_ties(pt34), stages.stage_ties(pt8)
bug8 = bugs.plant("bn_forget_gamma", cifar8)
bug34 = bugs.plant("projection_bn_reads_dn2", resnet34)
# the planted chains, run once
rec8 = stages.record(
    cifar8, params8, x8, cfg8, targets=t8, label_smoothing=alpha, chain=bug8
)
rec34 = stages.record(
    resnet34, params34, x34, cfg34, targets=t34, label_smoothing=alpha, chain=bug34
)
part8, part34 = stages.stage_ties(pt8, rec=rec8), stages.stage_ties(pt34, rec=rec34)

# %%
beyond224 = " (beyond the literal 224 px)" if small34 else ""
plots.whole_net_tie.stage_ratios({
    f"ResNet-34, photos, {p.image_size} px{beyond224}: eighteen stages": (st34, part34),
    "cifar8, photos: five stages": (st8, part8),
})
plt.show()

# %% [markdown]
# ### ResNet-34's eighteen stages
#
# What the suite states stage by stage is split over two modules. `r34InputGradB_correct` peels
# the backward of the eighteen-stage composition into eighteen stage backwards, and ties only the
# endpoints concretely (the stem, `cbReluStridedBBack_eq_vjp_backward`, and the head,
# `r34HeadBBack_eq_vjp_backward`); the sixteen blocks stay opaque `HasVJPDiffAt` witnesses. The
# step-tie module says what they are: `r34IdCotIn_eq_vjp` (thirteen identity blocks) and
# `r34DownCotIn_eq_vjp` (three downsample blocks) make a block's input cotangent its certified
# VJP's backward, under `R34IdPos`/`R34DownPos` and `R34IdSmoothAt`/`R34DownSmoothAt`; and
# `r34_net_tiedB` ties every node of a stage at the cotangent the chain hands it, with no
# smoothness clause. The run above, at `image_size` (32 px at ci: the same architecture beyond
# the literal resolution), on photos:

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"photos, N = {p.resnet_batch}: {small34 or 'ResNet-34 at its literal resolution'}"
)
for kind in ("stem", "identity", "downsample", "head"):
    ties_ = st34.kind(kind)
    ins = st34.inputs(kind)
    print(
        f"{kind:<10} {len(ties_):>2} stages: {sum(t.ok for t in ties_)}/{len(ties_)}"
        " tied to their VJP alone; input cotangents"
        f" {sum(r.ok for r in ins)}/{len(ins)}; nodes"
        f" {sum(len(t.nodes) for t in ties_)} ({st34.kind(kind)[0].meta['lean']})"
    )
print(
    "loss cotangent (the six-op head fold)"
    f" {'tied' if st34.cotangent.ok else 'FAILED'}; first parting:"
    f" {st34.first_parting()}"
)
print(
    book.glue(
        "r34_stage_ties",
        (
            sum(t.ok for t in st34.ties),
            len(st34.ties),
            sum(r.ok for r in st34.inputs("identity")),
            len(st34.inputs("identity")),
            sum(r.ok for r in st34.inputs("downsample")),
            len(st34.inputs("downsample")),
        ),
        "{}/{} stages tied to their VJP alone; block input cotangents: identity {}/{},"
        " downsample {}/{}",
        at=at_photos34,
    )
)
assert st34.ok and len(st34.ties) == 18 and st34.first_parting() is None
assert (len(st34.inputs("identity")), len(st34.inputs("downsample"))) == (13, 3)
assert sum(len(t.nodes) for t in st34.ties) == 110
assert st34["stem"].ok and st34["head"].ok

# %% [markdown]
# Per stage, in backward order: the largest cotangent it was handed, its input row's error and
# limit, and its worst row over its limit.

# %% tags=["hide-input", "hide-output"]
pages.stages(st34)

# %% [markdown]
# ### ResNet-34's eighteen stages at 224 px
#
# `r34_net_tiedB` fixes 224 px, so we tie the stages once there, at the whole-net tie's point
# (randn, `statement_batch` = 2 examples). Those nodes are the 110 the committed artifacts emit.
# The theorem has 146 conjuncts: the other 36 are the conv biases at `convBias := true`, which the
# artifacts do not emit and this net, like them, does not have; no figure here shows them.

# %%
pt224 = Point.of(
    resnet34, params34, x224, t224, cfg34, label_smoothing=alpha, key=fold(19)
)
st224 = stages.stage_ties(pt224)

# %% tags=["nbval-check-output", "hide-input"]
ins224 = st224.inputs("identity") + st224.inputs("downsample")
print(
    book.glue(
        "r34_stage_ties_224",
        (
            sum(t.ok for t in st224.ties),
            len(st224.ties),
            sum(len(t.nodes) for t in st224.ties),
            sum(r.ok for r in ins224),
            len(ins224),
        ),
        "at 224 px: {}/{} stages tied to their VJP alone, {} nodes; block input"
        " cotangents {}/{}",
        at=at224,
    )
)
assert (
    st224.ok and len(st224.ties) == 18 and sum(len(t.nodes) for t in st224.ties) == 110
), st224.summary()

# %% [markdown]
# ### cifar8's seventeen layers
#
# cifar8's `cifar8BbnInputGradB_correct` is seventeen CertLayers: eight conv→BN→ReLU layers, four
# 2×2 pools (`maxPool2Layer`), dense, ReLU, dense, ReLU, dense, all concrete. We tie each layer
# alone at the cotangent the chain hands it, at the point where `MaxPool2Smooth` holds (randn, β
# lifted), and check that the layers compose to each stage. On photos the five stages (figure
# above) tie the same way: their 38 nodes, at the cotangent the chain hands them, which is what
# `cifar8Bbn_train_step_tiedB` states (no hypothesis in its module docs; our reading: none needed).

# %%
pt_lifted = Point.of(
    cifar8, lifted8, randn8, t8, cfg8, label_smoothing=alpha, key=fold(12)
)
layers8 = stages.stage_ties(pt_lifted, level="layers")
layers8_photos = stages.stage_ties(pt8, level="layers")

# %% tags=["nbval-check-output", "hide-input"]
print(layers8.summary().split("; worst")[0])
print(f"  the layers compose to each stage: {all(r.ok for r in layers8.composition)} "
      f"({len(layers8.composition)} rows: 38 nodes and 5 handed-on cotangents)")
print(
    book.glue(
        "c8_layer_ties",
        (sum(t.ok for t in layers8.ties), len(layers8.ties)),
        "{}/{} CertLayers tied to their VJP alone where MaxPool2Smooth holds (randn, β"
        " lifted)",
        at=at_lifted8,
    )
)
assert layers8.ok and len(layers8.ties) == 17 and len(layers8.composition) == 38 + 5
assert st8.ok and len(st8.ties) == 5 and sum(len(t.nodes) for t in st8.ties) == 38
print(
    book.glue(
        "c8_stage_nodes",
        (
            sum(t.ok for t in st8.ties),
            len(st8.ties),
            sum(len(t.nodes) for t in st8.ties),
        ),
        "on photos {}/{} stages tied to their VJP alone at the cotangent the chain"
        " hands them, {} nodes",
        at=at_photos8,
    )
)

# %% [markdown]
# ```{admonition} Beyond the suite
# :class: attention
# The layer-by-layer ties on photos: a pool alone has no derivative at a dead window, outside
# `MaxPool2Smooth`.
# ```
#
# Then **beyond the suite**, at photos: a pool alone has no derivative at a dead window (autodiff's
# max splits the tie, the render routes it to one cell), so the four pool layers part from their
# VJPs there, while every stage, whose ReLU kills those cells, still ties. That is exactly why
# `MaxPool2Smooth` is the hypothesis of the layer-by-layer statement, and why the parameter
# statement can allow dead windows.

# %% tags=["nbval-check-output", "hide-input"]
print(
    "photos: layers parting from their VJP alone:"
    f" {sorted(t.net for t in layers8_photos.failed)}; stages tied:"
    f" {sum(t.ok for t in st8.ties)}/{len(st8.ties)}"
)
print(
    book.glue(
        "c8_layer_photos",
        (len(layers8_photos.failed), sum(t.ok for t in st8.ties), len(st8.ties)),
        "on photos, outside MaxPool2Smooth, {} pool layers part from their VJP alone;"
        " the stages tie {}/{}",
        at=at_photos8,
    )
)
assert {t.net for t in layers8_photos.failed} == {"pool1", "pool2", "pool3", "pool4"}

# %% [markdown]
# ### The head needs no hypothesis
#
# GAP and dense are smooth, and each is a per-example map batched: `r34HeadBHasVJP` is **global**,
# the one place in the net where the certified backward comes with nothing attached. So the head
# must tie wherever it is asked, not only at points the body reaches: we tie it at a random GAP
# input (negative entries, which no ReLU output holds) and at an all-zero one (where every ReLU
# of the body sits at its kink), each with a random cotangent at the logits. The control is a GAP
# backward that forgets its 1/(H·W): at 32 px the net's own GAP sees 1×1 maps, where that bug is
# invisible, so we ask at 2×2 maps.

# %%
h_any = prng.normal(
    fold(10), (3, resnet34.WIDTHS[-1], 2, 2), jnp.float64
)
dy_any = stages.random_cotangent(fold(11), (3, p.num_classes))
head_any = stages.tie_at(resnet34, params34, "head", h_any, dy_any, cfg34)
head_zero = stages.tie_at(
    resnet34, params34, "head", jnp.zeros_like(h_any), dy_any, cfg34
)
# the net's own head: forward, rendered backward
head_stage = resnet34.stage_list(cfg34)[-1]
_, head_saved = head_stage.forward(params34, h_any, cfg34, protocol.Pass())
head_grads, head_dx = head_stage.backward(params34, head_saved, dy_any, cfg34, KIT)
head_bug = stages.tie_at(
    resnet34,
    params34,
    "head",
    h_any,
    dy_any,
    cfg34,
    rendered_side=(head_grads, head_dx * (h_any.shape[2] * h_any.shape[3])),
)

# %% tags=["nbval-check-output", "hide-input"]
for label, rep in (("random GAP input", head_any), ("all-zero GAP input", head_zero),
                   ("control: GAP backward without 1/(H·W)", head_bug)):
    print(
        f"{label:<38} {'tied' if rep.ok else 'FAILED'}: rows"
        f" {', '.join(r.name for r in rep.rows)}; failing"
        f" {[r.name for r in rep.failed]}"
    )
print(
    book.glue(
        "head_global",
        (head_any.ok and head_zero.ok, [r.name for r in head_bug.failed]),
        "head tied at arbitrary GAP inputs and cotangents: {}; control (no 1/(H·W))"
        " fails at {}",
        at=book.At(
            "resnet34 head (GAP, fc)",
            batch=3,
            classes=p.num_classes,
            data="randn and zero GAP inputs, 2×2",
            dtype="float64",
            weights=p.weights,
        ),
    )
)
assert head_any.ok and head_zero.ok
# the weights never see the GAP backward
assert [r.name for r in head_bug.failed] == ["input"]

# %% [markdown]
# ### Why the head's tie reads exactly 0
#
# ```{admonition} Beyond the suite
# :class: attention
# The suite's head tie is over ℝ (`r34HeadBBack_eq_vjp_backward`, global). Where float64 round-off
# lands, and why both sides land in the same place, is ours.
# ```
#
# In the stage table the head's input row reads an error of exactly 0, and at 32 px so do its
# nodes. That is no sign of exactness. It happens because the two sides run the same float64
# operations in the same order: the rendered GAP backward and autodiff's transpose of the mean
# both broadcast dg/(H·W), and the rendered dense backward and autodiff's transpose of the dense
# layer issue the same matrix products. We check this where round-off can show: at a GAP input of
# 7×7 maps (layer4's output at 224 px, where 1/49 is inexact) and a random cotangent. Each of
# fc.weight, fc.bias and the input cotangent is computed three ways: the rendered backward,
# autodiff, and the same sums with their terms in reversed order. Each is compared with the exact
# values, computed in rational arithmetic and rounded once. All three must lie within
# γ_n·Σ|a||b| of exact. The rendered side and autodiff must agree bit for bit. The reversed order
# must differ from them in some bits: the round-off is there, and both sides share it. The control
# is the GAP backward without its 1/(H·W).

# %%
from gradtie import companions

h_exact = prng.normal(fold(15), (2, resnet34.WIDTHS[-1], 7, 7), jnp.float64)
dy_exact = stages.random_cotangent(fold(16), (2, p.num_classes))
head_ex = companions.head_exact(params34, h_exact, dy_exact, cfg34)

# %% tags=["nbval-check-output", "hide-input"]
print(f"GAP input {head_ex.shape}")
for r in head_ex.rows:
    print(
        f"{r.node:10} rendered vs autodiff: {r.oracle_bits} entries differ; within γ_n"
        f" of exact: rendered {r.rendered_ulps <= 1}, autodiff {r.oracle_ulps <= 1},"
        f" reversed order {r.reordered_ulps <= 1} (differs from autodiff in some bits:"
        f" {r.reordered_bits > 0})"
    )
print(
    "control, GAP backward without 1/(H·W): within γ_n of exact:"
    f" {not head_ex.control_fails}"
)
print(
    book.glue(
        "head_exact_zero",
        (
            sum(r.oracle_bits for r in head_ex.rows),
            sum(r.reordered_bits for r in head_ex.rows) > 0,
            "fails" if head_ex.control_fails else "passes",
        ),
        "head at 7×7 maps: rendered vs autodiff differ in {} entries (same arithmetic,"
        " same order); reversed order rounds otherwise: {}; all within γ_n of exact;"
        " control (no 1/(H·W)) {}",
        at=book.At(
            "resnet34 head (GAP, fc)",
            batch=2,
            classes=p.num_classes,
            data="randn GAP input, 7×7",
            dtype="float64",
            weights=p.weights,
        ),
    )
)
assert (
    head_ex.ok
), f"head_exact_zero: a head output past γ_n·Σ|a||b| of the exact value: {head_ex.rows}"
assert all(
    r.oracle_bits == 0 for r in head_ex.rows
), "head_exact_zero: rendered and autodiff differ in bits"
assert any(
    r.reordered_bits > 0 for r in head_ex.rows
), "head_exact_zero: the reversed order shows no round-off"
assert (
    head_ex.control_fails
), "head_exact_zero: the GAP backward without 1/(H·W) stayed within γ_n of exact"

# %% [markdown]
# ## A planted bug: red, and where it parts
#
# A check is worth the bugs it is seen to catch. The figure above plants one bug from the catalogue
# (`checks.bugs`; the chapter "Would the check catch it?" runs them all) in each net's rendered
# backward, never in the forward or the oracle:
#
# - cifar8, `bn_forget_gamma`: the BatchNorm input backward drops γ (`t = dy` instead of γ·dy).
#   At the initial weights, γ = 1, this bug is bit for bit the right chain; at drawn weights it
#   must go red.
# - ResNet-34, `projection_bn_reads_dn2`: the downsample blocks' projection BatchNorm reads bn₂'s
#   output cotangent instead of `da`, the wiring `r34DownCotIn_eq_vjp` pins down.
#
# The whole-net tie (at cifar8's photos and ResNet-34's 224-px point) fails from the first node the
# bug reaches, and every node behind it. The per-stage ties say more: a stage handed a wrong
# cotangent is still a correct VJP of what it was handed, so only the stages holding the bug part
# (every conv stage of cifar8, whose BatchNorms all forget γ; ResNet-34's three downsample
# blocks). `first_parting` names the first of them in backward order: where to start looking.

# %%
point8 = reference_at(cifar8, params8, x8, t8, cfg8, label_smoothing=alpha, key=fold(1))
point34 = reference_at(
    resnet34, params34, x224, t224, cfg34, label_smoothing=alpha, key=fold(2)
)
tie8, tie34 = tie(point8), tie(point34)
red8 = stages.whole_tie(rec8, cfg8, point=point8)
# at 224 px the planted chain runs compiled (LLVM on): quick compilation runs too slowly
red34 = tie(point34, bug34, how="compiled")

# %% tags=["nbval-check-output", "hide-input"]
for real, red, part in ((tie8, red8, part8), (tie34, red34, part34)):
    parting = part.first_parting()
    first = red.first_failure()
    print(
        f"{red.net}: whole-net tie {'tied' if red.ok else 'FAILED'} (the real chain at"
        f" the same point: {'tied' if real.ok else 'FAILED'}); first failing node in"
        f" backward order: {None if first is None else first.name}"
    )
    print(f"  per stage{' (' + small34 + ')' if part is part34 and small34 else ''}: "
          f"{sum(t.ok for t in part.ties)}/{len(part.ties)} stages tie; first parting: "
          f"{parting and (parting.stage, parting.kind, parting.row.name)}")
print(
    book.glue(
        "bug_parting",
        (
            part8.first_parting().stage,
            part34.first_parting().stage,
            part34.first_parting().kind,
        ),
        "planted bugs red; first parting: bn_forget_gamma at cifar8's {},"
        " projection_bn_reads_dn2 at ResNet-34's {} ({})",
        at=(
            dataclasses.replace(at_photos8, role="control"),
            dataclasses.replace(at_photos34, role="control"),
            dataclasses.replace(at224, role="control"),
        ),
    )
)
assert not red8.ok and not red34.ok and tie8.ok and tie34.ok
assert part8.first_parting().stage == "stage4" and {t.net for t in part8.failed} == {
    "stage1",
    "stage2",
    "stage3",
    "stage4",
}
assert (part34.first_parting().stage, part34.first_parting().kind) == (
    "layer4.0",
    "downsample",
)
assert {t.net for t in part34.failed} == {"layer4.0", "layer3.0", "layer2.0"}

# %% [markdown]
# ## Eighteen stages
#
# ResNet-34 is a list of eighteen named stages: the stem (conv 7×7/s2, BN, ReLU and the 3×3/s2
# pool), sixteen basic blocks and the head (GAP, fc). `resnet34ForwardBFull_eq_slots` says the
# composition of exactly these eighteen callables IS the forward: we compose them by hand and
# compare the logits bit for bit, and list each stage's kind, output shape and parameter count. The
# composition runs stage by stage, uncompiled, so we take it on the 32-px photos (beyond the
# statement's literal resolution: at 32 px every map below is 7 times smaller in each side than at
# the statement's 224 px). The net's forward is itself a fold over this list, so this comparison
# lists the slots rather than tests them; the next section compares the fold with a forward
# written apart, which can disagree.

# %% tags=["nbval-check-output", "hide-input"]
named = resnet34.stages(params34, cfg34)
h = x34
for _, stage in named:
    h = stage(h)
logits34, _ = resnet34.forward(params34, x34, cfg34)
rows34 = resnet34.summary(params34, cfg34, x34.shape)
kinds = [r.kind for r in rows34]
print(f"{small34 or 'at the literal resolution'}:")
print(protocol.format_summary(rows34))
print(
    book.glue(
        "r34_stages",
        f"{len(named)} stages; composition == forward bit for bit: "
        f"{bool(jnp.array_equal(h, logits34))}",
        at=dataclasses.replace(at_photos34, alpha=None),
    )
)
assert len(named) == 18 and [n for n, _ in named] == [r.name for r in rows34]
assert jnp.array_equal(h, logits34)
assert (
    kinds.count("stem"),
    kinds.count("identity"),
    kinds.count("downsample"),
    kinds.count("head"),
) == (1, 13, 3, 1)
assert sum(r.params for r in rows34) == protocol.census(params34).floats

# %% [markdown]
# ### The eighteen stages against a forward written apart
#
# The fold above is built from the same stage list as `resnet34.forward`, so "bit for bit" could
# not have come out otherwise. `resnet34ForwardBFull_eq_slots` says the eighteen slots ARE the
# committed forward. We read "the committed forward" as the formulas, and tie the fold to the
# independent NumPy ResNet-34 (`gradtie.reference_numpy`: float64, im2col convolutions, BatchNorm
# from its formula, index-gathered pool windows; it imports nothing from gradtie). Each logit is
# held to `tolerances.FORWARD_NET_SIGMAS`·√2 standard deviations of the NumPy forward's first-order
# round-off envelope. We run it at the statement's own resolution, 224 px (a literal of
# ResNet-34's statements), on two photos. Three controls must go red: the NumPy net with its
# kernels flipped (a true convolution), with every pool window one cell off, and the fold with
# `layer1.0` and `layer1.1` swapped.

# %%
from gradtie import companions
from gradtie import reference_numpy

x_fold = images("photos", 2, resnet34.SUITE_IMAGE_SIZE, seed=p.seed)          # 224 px
numpy_ref = reference_numpy.resnet34_forward(params34, np.asarray(x_fold))
fold_tie = companions.forward_tie(params34, x_fold, cfg34, reference_forward=numpy_ref)
stage_names = [n for n, _ in named]
fold_controls = [
    companions.forward_tie(
        params34,
        x_fold,
        cfg34,
        ops=reference_numpy.PLANTED[m],
        reference_forward=numpy_ref,
        label=f"NumPy net with {m}",
    )
    for m in ("flipped_kernel", "pool_window_offset")
]
fold_controls.append(
    companions.forward_tie(
        params34,
        x_fold,
        cfg34,
        reference_forward=numpy_ref,
        order=[stage_names[0], stage_names[2], stage_names[1], *stage_names[3:]],
        label="fold with layer1.0 and layer1.1 swapped",
    )
)

# %% tags=["nbval-check-output", "hide-input"]
print(f"{fold_tie.label} at {fold_tie.image}: {'tied' if fold_tie.ok else 'FAILED'}")
for c in fold_controls:
    print(
        f"control {c.label:42} {'tied' if c.ok else 'FAILED'}: off by more than 1e6 ×"
        f" its limit: {c.ratio > 1e6}"
    )
print(
    book.glue(
        "fold_numpy",
        (
            fold_tie.image[2],
            fold_tie.image[0],
            "tied" if fold_tie.ok else "FAILED",
            sum(not c.ok for c in fold_controls),
            len(fold_controls),
        ),
        "eighteen-stage fold against the NumPy ResNet-34 at {} px, batch {}: {};"
        " controls red {}/{}",
        at=book.At(
            **at34, image_size=fold_tie.image[2], batch=fold_tie.image[0], data="photos"
        ),
    )
)
assert fold_tie.ok and fold_tie.image == (2, 3, 224, 224), (
    f"fold_numpy: logits at {fold_tie.image} off the NumPy forward by"
    f" {fold_tie.ratio:.2g} × 5√2 envelopes"
)
assert all(
    not c.ok for c in fold_controls
), f"fold_numpy: a control tied: {[c.label for c in fold_controls if c.ok]}"

# %% tags=["hide-input", "hide-output"]
print(
    f"largest logit error {fold_tie.err_max:.1e}, {fold_tie.ratio:.1e} of its limit"
    f" (the limit up to {fold_tie.limit_max:.1e})"
)

# %% [markdown]
# ## Every batch size N
#
# "At every batch size N" is a quantifier over N, and a tie at one N shows one instance. We tie
# both nets on photos over a range of N, taking the census at each N first, and state the smallest
# N from which every N of the sweep keeps each hypothesis and ties (`Sweep.smallest`); the node
# ties of `r34_net_tiedB` (no hypothesis; its binders are N, nCls, α, B, w, x, t) are the nodes of
# each row. With `every_n = True` (the cpu and gpu profiles) both nets run every N from 1 to 8;
# the ci defaults keep the compile count down (each new N is a new shape to compile) and run
# N = 1, 2, 4.
#
# What to expect: the parameter hypothesis only asks that no ReLU input be exactly 0 and no tie be a
# non-twin one, which a photo batch meets at every N, even N = 1. ResNet-34's sweep runs at
# `image_size` (32 px by default: **beyond the statement's literal resolution**). There, at N = 1,
# layer4's BatchNorm sees M = 1 value per channel, whose x̂ is exactly 0: every node upstream of it
# is 0 in ℝ, and a tie would compare two round-off-sized answers. That point is **degenerate**: it
# is reported with the layer and M, not tied, and never counted as tied (`gradtie check` exits 2
# there). At N = 2, M = 2 (chapter Whole-net tie). `MaxPool2Smooth` fails on photos at every N
# (dead windows), so for cifar8's input gradient no N of this sweep is smooth: its tie inside the
# hypothesis is the next section.

# %% tags=["remove-stderr"]
ns = list(range(1, 9)) if p.every_n else [1, 2, 4]
sw8 = stages.sweep(
    cifar8,
    params8,
    cfg8,
    lambda n: images("photos", n, 32, seed=p.seed),
    ns,
    label_smoothing=alpha,
    key=fold(13),
)
sw34 = stages.sweep(
    resnet34,
    params34,
    cfg34,
    lambda n: images("photos", n, p.image_size, seed=p.seed),
    ns,
    label_smoothing=alpha,
    key=fold(14),
)

# %% tags=["nbval-check-output", "hide-input"]
for sw, hyps in (
    (sw8, (census.PARAMETERS, census.C8_INPUT)),
    (sw34, (census.PARAMETERS, census.R34_INPUT)),
):
    print(f"{sw.net}:")
    for r in sw.rows:
        verdicts = ", ".join(
            f"{r.smooth.hypothesis(k).name} {'holds' if r.holds(k) else 'FAILS'}"
            for k in hyps
        )
        tied = (
            f"degenerate (M = {r.degenerate[1]} at {r.degenerate[0]}), not judged"
            if r.degenerate
            else (
                "-"
                if r.tie is None
                else f"{sum(x.agrees for x in r.tie.nodes)}/{len(r.tie.nodes)} tied"
            )
        )
        small_m = (
            r.tie.smallest_bn()[1]
            if r.tie is not None
            else r.degenerate[1] if r.degenerate else "-"
        )
        print(f"  N = {r.n}: {verdicts}; {tied}; smallest M = {small_m}")
    for k in hyps:
        print(
            f"  smallest N keeping {sw.rows[0].smooth.hypothesis(k).name}:"
            f" {sw.smallest(k)}"
            f"{'' if sw.below(k) is None else '; at ' + sw.below(k).split(';')[0]}"
        )
flat_ns = [r.n for r in sw34.rows if r.degenerate]
print(
    book.glue(
        "n_sweep",
        (
            ", ".join(map(str, ns)),
            p.image_size,
            ", ".join(str(r.n) for r in sw34.rows if r.tie is not None),
            ", ".join(map(str, flat_ns)) or "none",
            sw8.smallest(census.PARAMETERS),
            sw34.smallest(census.PARAMETERS),
            sw34.smallest(census.R34_INPUT),
        ),
        "cifar8 tied at N = {}; ResNet-34 at {} px tied at N = {}, degenerate (M = 1,"
        " not judged) at N = {}; smallest N keeping the parameter hypothesis and tied:"
        " cifar8 {}, ResNet-34 {}; keeping h_stem and h_pool: ResNet-34 {}",
        at=tuple(
            book.At(
                **(at8 if sw is sw8 else dict(at34, image_size=p.image_size)),
                batch=r.n,
                alpha=alpha,
                data="photos",
                census=book.census_verdicts(r.smooth),
                role="control" if r.degenerate else "evidence",
            )
            for sw in (sw8, sw34)
            for r in sw.rows
        ),
    )
)
assert sw8.ok and sw34.ok and [r.n for r in sw8.rows] == [r.n for r in sw34.rows] == ns
assert all(
    r.tie is not None and r.tie.ok
    for sw in (sw8, sw34)
    for r in sw.rows
    if not r.degenerate
)
assert flat_ns == (
    [1] if p.image_size == 32 else []
), f"N sweep at {p.image_size} px: degenerate N {flat_ns}"
assert sw8.smallest(census.PARAMETERS) == 1 and sw34.smallest(census.PARAMETERS) == (
    2 if flat_ns else 1
)
assert sw8.smallest(census.C8_INPUT) is None

# %% [markdown]
# The sweeps row by row, the verdict first (the worst error over its limit moves with the
# machine's round-off; the verdicts do not):

# %% tags=["hide-input", "hide-output"]
display(pages.sweep(sw8), pages.sweep(sw34))

# %%
plots.whole_net_tie.sweep_ratios(
    [sw8, sw34],
    title="Every batch size ties: worst error over its limit against N"
    + (
        f"\n(ResNet-34 at {p.image_size} px: beyond the literal 224 px)"
        if small34
        else ""
    ),
)
plt.show()

# %% [markdown]
# ### cifar8's input gradient at every N, inside `MaxPool2Smooth`
#
# The sweep above ties cifar8's input gradient on photos, where `MaxPool2Smooth` fails at every N.
# `cifar8BbnInputGradB_correct` is stated "at every batch size N" inside its hypothesis, so we take
# the constructed point at each N of the sweep: N(0, 1) pixels, and the pool-feeding β lifted at
# that batch until no window is dead (`census.lift_dead_windows`; batch statistics change with N,
# so the lift does too). The census must find `MaxPool2Smooth` holding, and the tie (input row and
# every node) must hold. Two controls: the photo batch at each N is reported as not judged (the
# statement says nothing there), and `bn_forget_gamma` planted at the first lifted point goes red.

# %%
lifted_rows = companions.input_sweep(
    cifar8,
    params8,
    cfg8,
    lambda n: images("randn", n, 32, seed=p.seed),
    ns,
    label_smoothing=alpha,
    key=fold(17),
)
photo_rows = [
    companions.input_row(
        cifar8,
        params8,
        images("photos", n, 32, seed=p.seed),
        targets_matrix((jnp.arange(n) * 3 + 1) % 10, 10, jnp.float64),
        cfg8,
        point="photos",
    )
    for n in ns
]
x_l = images("randn", ns[0], 32, seed=p.seed)
lifted_bug = companions.input_row(
    cifar8,
    census.lift_dead_windows(cifar8, params8, x_l, cfg8),
    x_l,
    targets_matrix((jnp.arange(ns[0]) * 3 + 1) % 10, 10, jnp.float64),
    cfg8,
    point="randn, β lifted",
    label_smoothing=alpha,
    chain=bug8,
    key=fold(17),
)

# %% tags=["nbval-check-output", "hide-input"]
for r in lifted_rows + photo_rows:
    print(
        f"N = {r.n}, {r.point:<16} MaxPool2Smooth {'holds' if r.holds else 'FAILS'}:"
        f" {r.verdict}{'' if r.holds else ' (first: ' + r.first.split(',')[0] + ')'}"
    )
print(
    f"control {bug8.label} at N = {lifted_bug.n}, randn, β lifted: {lifted_bug.verdict}"
)
print(
    book.glue(
        "c8_input_every_n",
        (
            ", ".join(str(r.n) for r in lifted_rows if r.verdict == "tied"),
            sum(r.verdict == "not judged" for r in photo_rows),
            len(photo_rows),
        ),
        "cifar8's input gradient tied inside MaxPool2Smooth (randn, β lifted) at N ="
        " {}; photos not judged at {}/{} N",
        at=tuple(
            book.At(
                **at8,
                batch=r.n,
                alpha=alpha if r.point != "photos" else None,
                data=r.point,
                census={"cifar8_input": r.holds},
                role="evidence" if r.point != "photos" else "control",
            )
            for r in lifted_rows + photo_rows
        ),
    )
)
assert all(r.holds and r.verdict == "tied" for r in lifted_rows), (
    f"c8_input_every_n: a lifted point at N in {ns} is not smooth or not tied:"
    f" {[(r.n, r.verdict) for r in lifted_rows]}"
)
assert all(
    r.verdict == "not judged" for r in photo_rows
), "c8_input_every_n: a photo batch was judged"
assert (
    lifted_bug.verdict == "FAILED"
), "c8_input_every_n: the bn_forget_gamma control tied"

# %% [markdown]
# ## Every loss cotangent
#
# `r34InputGradB_correct` and `cifar8BbnInputGradB_correct` hold "at every loss cotangent": the
# chain is the Jacobian-transpose of the forward, whatever cotangent arrives at the logits, not
# only the smoothed cross-entropy's (p − t̃)/N, whose rows sum to 0 and are small. We start both
# chains from three cotangents no loss of ours hands them (`stages.random_cotangent`): N(0, 1)
# entries (rows not summing to 0), one spike of 1e3 per row, and N(0, 1) × 1e6. Each is tied to
# `jax.vjp` of the whole forward at it, every node and the input, within 10 × the point's envelope.
# The control runs the planted ResNet-34 chain from the first of them.
#
# For the nodes this is `cifar8Bbn_net_lossGrad`'s and `r34_net_lossGrad`'s "any loss L of the
# logits with gradient g" clause: g is whatever L's gradient is. For ResNet-34's input row it is
# `r34InputGradB_correct` at every loss cotangent, on photos where `h_stem` and `h_pool` hold. The
# ResNet-34 rows run at `image_size` (32 px at ci): the same architecture beyond the literal
# resolution, and the claim map labels them so.

# %%
kinds_ = ("normal", "spike", "scaled")
cot = {}
for net_name, mod, params, x, cfg in (
    ("cifar8", cifar8, params8, x8, cfg8),
    ("ResNet-34", resnet34, params34, x34, cfg34),
):
    for i, kind in enumerate(kinds_):
        d = stages.random_cotangent(
            fold(20 + i), (x.shape[0], cfg.num_classes), kind=kind
        )
        cot[net_name, kind] = stages.cotangent_tie(
            Point.of(mod, params, x, None, cfg, key=fold(30 + i)), d
        )
cot_bug = stages.cotangent_tie(
    Point.of(resnet34, params34, x34, None, cfg34, key=fold(30)),
    stages.random_cotangent(
        fold(20), (p.resnet_batch, p.num_classes)
    ),
    chain=bug34,
)

# %% tags=["nbval-check-output", "hide-input"]
for (net_name, kind), rep in cot.items():
    print(
        f"{net_name:<10} {kind:<7} {sum(r.ok for r in rep.nodes)}/{len(rep.nodes)}"
        f" nodes tied, input {'tied' if rep.row('input').ok else 'FAILED'}"
    )
print(f"control {bug34.label}, normal cotangent: {'tied' if cot_bug.ok else 'FAILED'}; "
      f"first failing node {cot_bug.first_failure().name}")
in_suite = [
    all(r.ok for r in rep.nodes) and (net_name == "cifar8" or rep.row("input").ok)
    for (net_name, _), rep in cot.items()
]  # cifar8's input row: the next cell
print(
    book.glue(
        "cotangent_ties",
        (sum(in_suite), len(cot)),
        "{}/{} ties at random loss cotangents (normal, spike, ×1e6): every node of both"
        " nets and ResNet-34's input cotangent",
        at=(
            dataclasses.replace(at_photos8, alpha=None),
            dataclasses.replace(at_photos34, alpha=None),
        ),
    )
)
assert all(rep.ok for rep in cot.values()) and not cot_bug.ok

# %% [markdown]
# ```{admonition} Beyond the suite
# :class: attention
# cifar8's input row at these cotangents: the photos break `MaxPool2Smooth` (dead windows), so
# `cifar8BbnInputGradB_correct` says nothing here. The rows tie all the same.
# ```

# %% tags=["nbval-check-output", "hide-input"]
c8_cot_inputs = [cot["cifar8", kind].row("input") for kind in kinds_]
print(
    book.glue(
        "c8_cotangent_input",
        (
            sum(r.ok for r in c8_cot_inputs),
            len(c8_cot_inputs),
            smooth8.hypothesis(census.C8_INPUT).violated,
        ),
        "cifar8's input cotangent tied at {}/{} random loss cotangents on photos,"
        " outside MaxPool2Smooth ({} windows break it)",
        at=dataclasses.replace(at_photos8, alpha=None),
    )
)
assert all(r.ok for r in c8_cot_inputs)

# %% [markdown]
# ## What this chapter showed
#
# At drawn weights, every one of ResNet-34's eighteen stages and cifar8's five ties to its own VJP
# at the cotangent the rendered chain hands it (first figure): every node, at 224 px as
# `r34_net_tiedB` fixes it and at 32 px beyond that literal resolution, with
# `cifar8Bbn_train_step_tiedB` for cifar8's; the input cotangents of the identity and downsample
# blocks (`r34IdCotIn_eq_vjp`, `r34DownCotIn_eq_vjp`); cifar8's seventeen CertLayers where
# `MaxPool2Smooth` holds (`cifar8BbnInputGradB_correct`); the head anywhere (`r34HeadBHasVJP`). The
# eighteen stages compose to a forward written apart (`resnet34ForwardBFull_eq_slots`). The ties
# hold at every N of the sweep (second figure; N = 1 at 32 px is degenerate and reported so) and
# at cotangents no loss hands them. A planted bug goes red, and the per-stage tie names the stage
# that holds it.
#
# Beyond the suite: on photos cifar8's pool layers part from their VJPs alone at dead windows
# while the stages tie, its input gradient ties at every cotangent, and the head's ties read
# exactly 0 because both sides round alike. The chapter's `gpu` profile runs ResNet-34 at
# ImageNet shapes (224 px, batch 64, K = 1000).
