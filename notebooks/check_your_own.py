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
# # Check your own backward
#
# Everything the book does to cifar8-BN and ResNet-34 it does to any net built from the same
# parts. This chapter is about a net of ours the Lean suite knows nothing of: a small
# ResNet-50-style bottleneck net (1×1–3×3–1×1 blocks, the stride in the 3×3, projection shortcuts
# with BatchNorm), with one op gradtie's kit does not have — a depthwise 3×3 conv, the op of the
# MobileNet and EfficientNet family — written with its own hand-written backward. It lives in
# `examples/bottleneck.py`, outside the package, and is built only from the public protocol
# (`gradtie.nets.protocol`): a list of stages, each with its forward and, beside it, its rendered
# backward, which calls every op through the kit it is handed.
#
# **Everything in this chapter but its section on other blocks is beyond the suite.** The suite
# states nothing about this net: no named hypothesis, no theorem. (That section puts blocks of our
# own into ResNet-34's sixteen slots, which `r34InputGradB_correct` quantifies over.) What carries
# over is the method — a census of the point, a tie of every node to autodiff within the point's own
# round-off envelope, finite differences of the whole loss, and planted bugs that must go red — and
# `gradtie check --net examples/bottleneck.py:NET` runs it from the command line with the same exit
# codes.

# %% tags=["hide-input"]
import sys

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

import gradtie
from gradtie import book, nets
from gradtie.book import pages, plots
from gradtie.checks import bugs, census, stages
from gradtie.data import images
from gradtie.checks.tie import Point, targets_matrix
from gradtie.nets import protocol

# %% tags=["parameters", "hide-input"]
batch: int = 4    # photo crops
image_size: int = 32  # the net takes any multiple of 4; 32 keeps the chapter quick
seed: int = 0

# %% tags=["hide-input"]
p = book.validated(batch=batch, image_size=image_size, seed=seed)
sys.path.insert(0, str(book.ROOT / "examples"))
import bottleneck as example  # noqa: E402 (the example module)

net = nets.load("bottleneck:NET")  # as `gradtie check --net` loads it
cfg = net.config()
key = jax.random.key(p.seed)
params = {
    k: v.astype(jnp.float64) for k, v in net.init(key, cfg, weights="drawn").items()
}
x = images("photos", p.batch, p.image_size, seed=p.seed)
t = targets_matrix(
    (jnp.arange(p.batch) * 3 + 1) % cfg.num_classes, cfg.num_classes, jnp.float64
)
# what every figure below is glued with (`book.At`): the point it was computed at
at_own = dict(
    net="bottleneck example",
    image_size=p.image_size,
    batch=p.batch,
    classes=cfg.num_classes,
    data="photos",
    dtype="float64",
    weights="drawn",
)

# %% [markdown]
# ## One function at a time: `check_vjp`
#
# The smallest case first: one function with a VJP of your own. Our op is the depthwise 3×3
# conv, written in `examples/bottleneck.py` beside its hand-written backward (the excerpts below
# are read from that file when the book is built, so they cannot drift from the code that runs).
# The input backward correlates the cotangent with the kernel flipped; the weight gradient sums
# the cotangent against the padded input:
#
# ```{literalinclude} ../examples/bottleneck.py
# :language: python
# :pyobject: depthwise_backward
# ```
#
# ```{literalinclude} ../examples/bottleneck.py
# :language: python
# :pyobject: depthwise_grad_weight
# ```
#
# `gradtie.check_vjp` ties the hand VJP to autodiff within the point's round-off envelope and to
# finite differences, raises `VJPMismatch` on a wrong one, and refuses a point on a kink
# (`NotSmooth`) rather than judge it. Here it checks the example's depthwise backward, then the
# one with the kernel unflipped, then a ReLU at an input exactly 0.

# %% tags=["nbval-check-output"]
w = params["dw.conv.weight"]
h = jax.random.normal(jax.random.fold_in(key, 1), (2, w.shape[0], 6, 6), jnp.float64)


def depthwise_vjp(backward):
    return lambda x_, w_, dy: (
        backward(w_, dy),
        example.depthwise_grad_weight(example.DepthwiseSaved(x_), dy),
    )


ok = gradtie.check_vjp(lambda x_, w_: example.depthwise_forward(x_, w_)[0], h, w,
                       vjp=depthwise_vjp(example.depthwise_backward))
print("depthwise backward:", ok.summary().split(";")[0])
try:
    gradtie.check_vjp(lambda x_, w_: example.depthwise_forward(x_, w_)[0], h, w,
                      vjp=depthwise_vjp(example.depthwise_backward_not_flipped))
    wrong, wrong_rows = "passed", []
except gradtie.VJPMismatch as mismatch:
    wrong, wrong_rows = "VJPMismatch", mismatch.rows  # the rows that judged it
try:
    gradtie.check_vjp(lambda z: jnp.maximum(z, 0.0), jnp.array([1.0, 0.0, -2.0]),
                      vjp=lambda z, dy: (dy * (z > 0),))
    kink = "judged"
except gradtie.NotSmooth:
    kink = "NotSmooth"
print(f"unflipped depthwise backward: {wrong}; ReLU at an input exactly 0: {kink}")
assert ok.ok and wrong == "VJPMismatch" and kink == "NotSmooth"
# the unflipped kernel is wrong in the input cotangent alone: the weight gradient is
# untouched
assert not wrong_rows[0].ok and wrong_rows[1].ok

# %% tags=["hide-input"]
plots.check_your_own.vjp_verdicts(
    [("depthwise backward", ok.rows), ("kernel unflipped", wrong_rows)],
    names=("x", "w"),
)
plt.show()

# %% [markdown]
# Near a kink rather than on it, the point has a derivative and a correct VJP must pass. A
# central difference whose ends straddle the kink measures the average of the two one-sided
# slopes, which is no derivative at all, so `check_vjp` counts a step only when its samples stay
# in the point's smooth piece. It reads the piece from the function's own outputs: entry by
# entry, central differences must converge at second order and one-sided slopes agree at third
# order between h and h/2, beyond the entry's round-off. Here relu(x @ W) on a batch of 32 × 64
# with its ReLU input nearest 0 moved to 1e-6 of it: the step shrinks below the kink's distance
# and the correct VJP agrees, while the same VJP off by 1e-3 is still caught. In float32 the
# same call checks the VJP in float32, within float32's envelope, and says so.

# %% tags=["nbval-check-output"]
rng = np.random.default_rng(0)
xm, wm = rng.standard_normal((32, 64)), rng.standard_normal((64, 64)) / 8
n_, j_ = np.unravel_index(np.argmin(np.abs(xm @ wm)), (32, 64))
# that ReLU input moved to 1e-6 of its kink, along W's column
xm[n_] += (1e-6 - (xm @ wm)[n_, j_]) * wm[:, j_] / (wm[:, j_] @ wm[:, j_])
relu_mm = lambda a, b: jnp.maximum(a @ b, 0.0)  # noqa: E731
relu_mm_vjp = lambda a, b, dy: (  # noqa: E731
    (dy * (a @ b > 0)) @ b.T,
    a.T @ (dy * (a @ b > 0)),
)
near = gradtie.check_vjp(relu_mm, xm, wm, vjp=relu_mm_vjp)
near32 = gradtie.check_vjp(
    relu_mm, xm.astype(np.float32), wm.astype(np.float32), vjp=relu_mm_vjp
)
try:
    gradtie.check_vjp(
        relu_mm,
        xm,
        wm,
        vjp=lambda a, b, dy: tuple(1.001 * c for c in relu_mm_vjp(a, b, dy)),
    )
    off = "passed"
except gradtie.VJPMismatch:
    off = "VJPMismatch"
print(f"ReLU input {(xm @ wm)[n_, j_]:.1e} from its kink:", near.summary())
print("the same in float32:", near32.summary())
print(f"the VJP off by 1e-3 there: {off}")
assert near.ok and near.fd.verdict == "ok" and near.fd.h < 1e-5 and off == "VJPMismatch"
assert near32.ok and near32.dtype == "float32"

# %% [markdown]
# ## The net, as the protocol reads it
#
# Five stages: a stem (conv, BatchNorm, ReLU, a 2×2 max pool), the depthwise stage, two bottleneck
# blocks and a head (global average pool, dense). The summary is read off the stages at abstract
# shapes; nothing is computed.

# %% tags=["nbval-check-output", "hide-input"]
rows = net.summary(params, cfg, x.shape)
print(protocol.format_summary(rows))
print(
    f"{len(params)} tensors, {protocol.census(params).floats:,} floats; stages:"
    f" {[r.name for r in rows]}"
)
assert [r.kind for r in rows] == [
    "stem",
    "depthwise",
    "bottleneck",
    "bottleneck",
    "head",
]

# %% [markdown]
# Each stage is a forward that returns what its backward reads, and beside it the backward,
# written by hand: every op it calls goes through the `kit` it is handed, so a check can swap one
# op for a planted bug, and the chain never calls autodiff. One bottleneck block, as the example
# file writes it:
#
# ```{literalinclude} ../examples/bottleneck.py
# :language: python
# :pyobject: _block_forward
# ```
#
# ```{literalinclude} ../examples/bottleneck.py
# :language: python
# :pyobject: _block_backward
# ```
#
# The depthwise stage's backward (`_dw_backward`) calls our own `depthwise_backward` and
# `depthwise_grad_weight` above; the stages are listed in `stage_list`, and `NET` bundles them with
# the net's own planted bug.

# %% [markdown]
# ## The census: which hypothesis applies
#
# The suite's named hypotheses belong to its own two nets. For a net it does not name, the census
# reads the generic smooth-point hypothesis: no ReLU input exactly 0, and every max-pool window
# dead, strict, or tied only between twins (cells equal for every value of the weights upstream).
# That is where the loss is differentiable in every parameter, whatever the net.

# %% tags=["nbval-check-output", "hide-input"]
smooth = census.smoothness(net, params, x, cfg)
print(smooth.summary())
print([h.name for h in smooth.hypotheses])
assert smooth.ok and [h.key for h in smooth.hypotheses] == [census.PARAMETERS]

# %% [markdown]
# ## Every node, tied
#
# ```{admonition} Beyond the suite
# :class: attention
# A net the suite does not name: no statement covers these ties.
# ```
#
# `gradtie.check` runs the census, the tie and the finite differences, as the command line does.
# Every node — the depthwise conv's weight included, whose node comes from our own backward — is
# tied to autodiff of the forward within ten times the point's round-off envelope, and to finite
# differences of the whole loss.

# %% tags=["hide-output"]
report = gradtie.check(net, params, x, t, cfg, key=key)
pages.tie(report.tie)

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"exit code {report.exit_code};"
    f" {sum(r.agrees for r in report.tie.nodes)}/{len(report.tie.nodes)} nodes tied,"
    f" input gradient {report.tie.row('input').verdict}; finite differences:"
    f" {sum(r.verdict == 'FAILED' for r in report.fd_rows)} failed of"
    f" {len(report.fd_rows)}"
)
book.glue(
    "own_tied",
    (sum(r.agrees for r in report.tie.nodes), len(report.tie.nodes)),
    "{}/{} nodes tied",
    at=book.At(**at_own, alpha=0.0, census=book.census_verdicts(smooth)),
)
assert report.exit_code == 0 and report.tie.tied

# %% [markdown]
# Stage by stage: each stage's rendered backward, at the cotangent the chain hands it, against the
# VJP of that stage alone. The depthwise stage is where our own op sits.

# %% tags=["nbval-check-output", "hide-input"]
st = stages.stage_ties(Point.of(net, params, x, t, cfg, key=key))
print(st.summary().split("; worst")[0])
assert st.ok and len(st.ties) == 5

# %% [markdown]
# ## Planted bugs: the catalogue and our own
#
# ```{admonition} Beyond the suite
# :class: attention
# Evidence that the check can fail on this net; not a statement of the suite.
# ```
#
# A catalogue entry applies to a net when the net's chain calls the kit op it replaces; the
# catalogue reads that off the chain itself. Our net has no overlapping pool and no square dense
# layer, so those entries do not apply; it has projection shortcuts, so the projection entry does.
# Our own op brings its own entry (`Net.bugs`): the depthwise input backward correlating with the
# kernel unflipped. Each is planted as data — another kit, or another net definition — and tied at
# the same point against the same reference.

# %% tags=["nbval-check-output", "hide-input"]
display(pages.bugs(net))
caught = bugs.run(Point.of(net, params, x, t, cfg, label_smoothing=0.1))
print(caught.summary())
display(pages.caught(caught))
book.glue(
    "own_bugs",
    caught.summary(),
    at=book.At(**at_own, alpha=0.1, census=book.census_verdicts(smooth)),
)
assert caught.ok and "depthwise_kernel_not_flipped" in {c.bug for c in caught.caught}

# %%
plots.would_it_catch.caught(
    [caught], title="Every planted bug fails its first node by orders of magnitude"
)
plt.show()

# %% [markdown]
# ## Other blocks between ResNet-34's stem and head
#
# `r34InputGradB_correct` keeps ResNet-34's sixteen blocks opaque. They enter as VJP witnesses,
# so the statement holds "for any block maps b1 … b16 carrying `HasVJPDiffAt` witnesses at their
# running activations": only the stem and the head are ResNet-34's own. But the slots are typed: at
# the statement's literal 224 px, b1 … b3 map 64·56·56 to itself, b4 maps it to 128·28·28, b8 to
# 256·14·14, b14 to 512·7·7, and the others keep their width.
#
# ```{admonition} How the slots are filled, and what must hold
# :class: dropdown
# The protocol lets us fill those
# slots with maps of our own that fit those types, each with its own hand-written VJP: the
# identity; a scaled residual y = x + α·conv(x; W), whose VJP is dx = dy + α·convBack(W; dy),
# dW = α·convWeightGrad(x; dy); and bottleneck blocks of the example net above, one at stride 1
# (64 → 64) and three at stride 2 (64 → 128, 128 → 256, 256 → 512) where the slots change shape. We
# put them between the certified stem and head (`companions.stem_head_net`) and run at 224 px, on
# two N(0, 1) images (photos at 224 px meet the stem pool with saturated highlights: twin ties,
# where `h_pool` fails). The census must find `h_stem`, `h_pool` and every block's ReLU off its
# kink. The rendered chain (head backward, then the sixteen block backwards, then the stem's) must
# equal `jax.vjp` of the composed forward, every node and the input cotangent within ten times the
# point's measured envelope. The control swaps in one block whose VJP forgets α in its input
# cotangent. This takes about a minute on a 2-core CPU.
#
# This chapter holds it because its subject is composing stages of your own through the protocol,
# and the third net's block is loaded here.
# ```

# %% tags=["hide-input"]
from gradtie.book import companions
from gradtie.nets import resnet34

# the example's bottlenecks at the slots' widths: b3 keeps 64, b4, b8 and b14 halve the
# side and double the width, as ResNet-34's own downsample blocks do
block_cfg = example.Config(
    stem=resnet34.STEM_WIDTH,
    stages=((16, 64, 1), (16, 128, 2), (32, 256, 2), (64, 512, 2)),
)
identity, bottleneck = companions.identity_slot, (
    lambda i: companions.foreign_slot(net, block_cfg, f"layer{i}.0")
)
# b1 … b3: 64·56·56
slots = [
    identity(),
    companions.residual_slot(resnet34.STEM_WIDTH, 3, 0.5),
    bottleneck(1),
    bottleneck(2),
    identity(),
    identity(),
    identity(),  # b4 … b7: 128·28·28
    # b8 … b13: 256·14·14
    bottleneck(3),
    identity(),
    identity(),
    identity(),
    identity(),
    identity(),
    # b14 … b16: 512·7·7
    bottleneck(4),
    identity(),
    companions.residual_slot(resnet34.WIDTHS[-1], 1, 0.25),
]
slots_bad = [
    slots[0],
    companions.residual_slot(resnet34.STEM_WIDTH, 3, 0.5, forget_alpha=True),
    *slots[2:],
]
between = companions.stem_head_net(slots)
between_bad = companions.stem_head_net(slots_bad, name="scaled residual forgetting α")
cfg_between = resnet34.Config(num_classes=10)
params_between = {
    k: v.astype(jnp.float64)
    for k, v in between.init(key, cfg_between, weights="drawn").items()
}
x_between = images("randn", 2, resnet34.SUITE_IMAGE_SIZE, seed=p.seed)
t_between = targets_matrix(jnp.asarray([1, 4]), 10, jnp.float64)
blocks_smooth = census.smoothness(between, params_between, x_between, cfg_between)
# h_pool: no stem-pool window tied, not even between twins
stem_pool = blocks_smooth.pools[0].counts
h_pool = stem_pool["twin tie"] + stem_pool["non-twin tie"] == 0
blocks_census = dict(
    book.census_verdicts(blocks_smooth),
    resnet34_input=h_pool and blocks_smooth.zeros == 0,
)
# each slot's output, read off the stages at abstract shapes: the types of b1 … b16 at
# 224 px
block_shapes = [
    r.output_shape[1:]
    for r in between.summary(params_between, cfg_between, x_between.shape)[1:-1]
]
SLOT_TYPES = (
    [(64, 56, 56)] * 3 + [(128, 28, 28)] * 4 + [(256, 14, 14)] * 6 + [(512, 7, 7)] * 3
)
blocks_tie = companions.other_blocks(
    between,
    params_between,
    x_between,
    t_between,
    cfg_between,
    label_smoothing=0.1,
    key=jax.random.fold_in(key, 7),
)
blocks_bad = companions.other_blocks(
    between,
    params_between,
    x_between,
    t_between,
    cfg_between,
    label_smoothing=0.1,
    rendered_net=between_bad,
    point=blocks_tie.point,
)

# %% tags=["nbval-check-output", "hide-input"]
print(
    "b1 … b16:",
    ", ".join(
        f"{k} ×{blocks_tie.slots.count(k)}" for k in dict.fromkeys(blocks_tie.slots)
    ),
)
print(
    "stem, sixteen other blocks, head:"
    f" {blocks_tie.report.summary().split('; worst')[0]}"
)
print(
    f"control ({between_bad.name}): {blocks_bad.report.summary().split('; worst')[0]}"
)
slot_types = (
    "as the statement types b1 … b16" if block_shapes == SLOT_TYPES else block_shapes
)
print(
    f"slot types at 224 px: {slot_types};"
    f" census: {blocks_smooth.summary().split('; hypotheses')[0]}; h_stem, h_pool and"
    f" the blocks' ReLUs off their kinks: {blocks_census['resnet34_input']}"
)
print(
    book.glue(
        "other_blocks",
        (
            len(blocks_tie.slots),
            sum(r.ok for r in blocks_tie.report.nodes),
            len(blocks_tie.report.nodes),
            "tied" if blocks_tie.report.row("input").ok else "FAILED",
            "FAILED" if not blocks_bad.ok else "tied",
        ),
        "ResNet-34's stem and head at 224 px around {} other block maps typed as its"
        " slots: {}/{} nodes tied, input {}; a block whose VJP forgets α: {}",
        at=(
            book.At(
                "resnet34",
                image_size=resnet34.SUITE_IMAGE_SIZE,
                batch=2,
                classes=10,
                alpha=0.1,
                data="randn",
                dtype="float64",
                weights="drawn",
                census=blocks_census,
                extra={
                    "widths": list(resnet34.WIDTHS),
                    "blocks": "other maps in the sixteen slots",
                },
            ),
            book.At(
                "resnet34",
                image_size=resnet34.SUITE_IMAGE_SIZE,
                batch=2,
                classes=10,
                alpha=0.1,
                data="randn",
                dtype="float64",
                weights="drawn",
                role="control",
                extra={
                    "widths": list(resnet34.WIDTHS),
                    "blocks": "one planted block VJP",
                },
            ),
        ),
    )
)
assert block_shapes == SLOT_TYPES, (
    f"other_blocks: the slots' outputs {block_shapes} are not r34InputGradB_correct's"
    " types"
)
assert blocks_census[
    "resnet34_input"
], f"other_blocks: h_stem, h_pool or a block ReLU fails: {blocks_smooth.summary()}"
assert blocks_tie.ok and len(blocks_tie.slots) == 16, (
    "other_blocks: the chain must equal the composed forward's VJP within 10"
    f" envelopes, got {blocks_tie.report.summary()}"
)
assert (
    not blocks_bad.ok and not blocks_bad.report.row("input").ok
), "other_blocks: the wrong block VJP tied"

# %% [markdown]
# ## What this chapter showed
#
# Everything here but the other blocks is beyond the suite: the method, not a theorem, applied
# to a net the suite never saw.
#
# - One function: `gradtie.check_vjp` ties the depthwise conv's hand-written VJP to autodiff and
#   to finite differences, calls the unflipped kernel a `VJPMismatch` at the input cotangent
#   alone (the first figure), and refuses a ReLU at 0 as
#   `NotSmooth`; near a kink it judges only inside the smooth piece, so a correct relu(x @ W)
#   1e-6 from its kink agrees and the same VJP off by 1e-3 is still caught
#   ([§ One function at a time](#one-function-at-a-time-check_vjp)).
# - The whole net, written as stages with their backwards beside them: the census finds a smooth
#   point, `gradtie.check` ties {glue:text}`own_tied` to autodiff within the point's envelope and
#   to finite differences, and each stage ties to its own VJP
#   ([§ Every node, tied](#every-node-tied)).
# - The catalogue's entries that apply to this net, and the net's own bug, all go red
#   ({glue:text}`own_bugs`; [§ Planted bugs](#planted-bugs-the-catalogue-and-our-own) and its
#   figure).
# - Blocks of your own, typed as ResNet-34's sixteen slots at the statement's literal 224 px,
#   compose with its certified stem and head through the protocol: at a point where the census
#   finds `h_stem`, `h_pool` and every block's ReLU off its kink, the rendered chain ties to the
#   composed forward's VJP within the point's envelope (what `r34InputGradB_correct` states for
#   any blocks carrying `HasVJPDiffAt` witnesses), and a block whose VJP forgets α goes red
#   ([§ Other blocks](#other-blocks-between-resnet-34s-stem-and-head)).
#
# The same runs from the command line: `gradtie check --net examples/bottleneck.py:NET` exits 0,
# and 1 with `--plant-bug depthwise_kernel_not_flipped`.
