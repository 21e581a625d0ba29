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
# # Whole-net tie
#
# The claim: the rendered backward chain of each net, written by hand from the op kit, IS the
# gradient of the loss. Every parameter node (38 for cifar8, 110 for ResNet-34) and the input
# cotangent (`r34InputGradB` for ResNet-34) equal what autodiff of the forward gives, `jax.vjp`,
# at a real photo batch; each node is the derivative of the whole loss in its parameter; and the
# check that says so goes red for every bug we plant.
#
# Statements shown: `cifar8Bbn_net_lossGrad_CE` (cifar8's 38 nodes at the smoothed cross-entropy),
# `r34_net_tiedB` (ResNet-34's 110 nodes), `r34InputGradB_correct` (its input gradient, at a point
# where `h_stem` and `h_pool` hold) and `resnet34ForwardBFull_eq_slots` (the eighteen stages).
# Beyond the suite: cifar8's input gradient on photos, whose dead windows break `MaxPool2Smooth`,
# the hypothesis of `cifar8BbnInputGradB_correct`; the float32 view; the must-fail controls.
#
# The oracle never reads a backward: it differentiates the forward's logits through a loss written
# in plain `jnp` (`gradtie.reference`). A bug both sides shared could not be seen, so the two
# sides share nothing but the forward. The first cell turns on float64: the tie is meant to the
# last few bits.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book, data, plots
from gradtie.checks import census, controls, tolerances
from gradtie.checks.float32 import float32_view
from gradtie.checks.tie import derivatives, rendered_nodes, targets_matrix, tie
from gradtie.nets import cifar8, resnet34, stages

# %% tags=["parameters"]
batch = 4              # cifar8 examples (photos; flat images for the non-twin control)
image_size = 64        # ResNet-34's input side (any multiple of 32; see "Why 64 px" below)
resnet_batch = 2       # ResNet-34 examples
num_classes = 10       # ResNet-34 classes K (1000 for ImageNet)
label_smoothing = 0.1  # alpha, for both nets (smoothed targets, SPEC §1)
fd_nodes = 4           # ResNet-34 nodes checked by finite differences (0: all 110)
seed = 0

# %%
p = book.validated(batch=batch, image_size=image_size, resnet_batch=resnet_batch,
                   num_classes=num_classes, label_smoothing=label_smoothing, fd_nodes=fd_nodes, seed=seed)
key = jax.random.key(p.seed)
alpha = p.label_smoothing
cfg8, cfg34 = cifar8.Config(), resnet34.Config(num_classes=p.num_classes)
params8 = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in cifar8.init(key, cfg8).items()}
params34 = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in resnet34.init(key, cfg34).items()}
x8 = jnp.asarray(data.photos(p.batch, 32, seed=p.seed), jnp.float64)
x34 = jnp.asarray(data.photos(p.resnet_batch, p.image_size, seed=p.seed), jnp.float64)
flat8 = jnp.asarray(data.flat_images(p.batch, 32, seed=p.seed), jnp.float64)
t8 = targets_matrix(jax.random.randint(jax.random.fold_in(key, 1), (p.batch,), 0, 10), 10, jnp.float64)
t34 = targets_matrix(jax.random.randint(jax.random.fold_in(key, 2), (p.resnet_batch,), 0, p.num_classes),
                     p.num_classes, jnp.float64)
print(f"cifar8: photos {tuple(x8.shape)}; ResNet-34: photos {tuple(x34.shape)}, K = {p.num_classes}; "
      f"α = {alpha}")

# %% [markdown]
# ## The point is smooth
#
# A tie between two gradients means something only where the gradient exists. ReLU and max pool
# make the loss piecewise smooth, so we first take the census of the point (chapter Pools): every
# pool window must be dead, strict or a twin tie, and no ReLU input exactly 0. Real photos give
# thousands of dead windows (every cell negative before the ReLU) and no tie that breaks.

# %% tags=["nbval-check-output"]
smooth8 = census.smoothness(cifar8, params8, x8, cfg8)
smooth34 = census.smoothness(resnet34, params34, x34, cfg34)
for name, s in (("cifar8", smooth8), ("ResNet-34", smooth34)):
    c = {k: sum(q.counts[k] for q in s.pools) for k in census.CLASSES}
    print(f"{name}: {'smooth' if s.ok else 'NOT smooth'}; non-twin ties {c['non-twin tie']}, "
          f"zero pre-activations {s.zeros}; dead windows present: {c['dead'] > 0}")
assert smooth8.ok and smooth34.ok

# %% [markdown]
# ## Every tensor, every float
#
# Before tying nodes we count them. The parameter signature is PyTorch's `state_dict` order, and
# the census reads it from shapes alone (`jax.eval_shape`: nothing is allocated, so ResNet-34 at
# K = 1000 costs nothing). cifar8 has 8 conv layers with a bias, 8 BN layers with γ and β, and three
# dense layers: 8·4 + 3·2 = 38 tensors. ResNet-34 has a stem (conv, γ, β), 13 identity blocks of
# two conv→BN layers, 3 downsample blocks with a projection conv→BN as well, and the fc layer:
# 3 + 13·6 + 3·9 + 2 = 110 tensors; a bias on each of its 36 convs makes 146.

# %% tags=["nbval-check-output"]
shapes = {
    "cifar8 (d = 512)": jax.eval_shape(lambda: cifar8.init(jax.random.key(0), cifar8.Config())),
    "ResNet-34, K = 1000": jax.eval_shape(lambda: resnet34.init(jax.random.key(0), resnet34.Config())),
    "ResNet-34, K = 1000, conv biases": jax.eval_shape(
        lambda: resnet34.init(jax.random.key(0), resnet34.Config(conv_bias=True))),
    "ResNet-34, K = 10": jax.eval_shape(lambda: resnet34.init(jax.random.key(0), resnet34.Config(num_classes=10))),
}
counts = {name: stages.census(s) for name, s in shapes.items()}
for name, c in counts.items():
    print(f"{name:<34} {c.tensors:>4} tensors {c.floats:>12,} floats")
assert (counts["cifar8 (d = 512)"].tensors, counts["cifar8 (d = 512)"].floats) == (38, 374_010)
assert (counts["ResNet-34, K = 1000"].tensors, counts["ResNet-34, K = 1000"].floats) == (110, 21_797_672)
assert counts["ResNet-34, K = 1000, conv biases"].tensors == 146
assert counts["ResNet-34, K = 1000, conv biases"].floats - counts["ResNet-34, K = 1000"].floats == 8_512
assert counts["ResNet-34, K = 10"].floats == 21_289_802

# %% [markdown]
# ## Eighteen stages
#
# ResNet-34 is a list of eighteen named stages: the stem (conv 7×7/s2, BN, ReLU and the 3×3/s2
# pool), sixteen basic blocks and the head (GAP, fc). The shape check says the composition of
# exactly these eighteen callables IS the forward: we compose them by hand and compare the logits
# bit for bit, and list each stage's kind, output shape and parameter count.

# %% tags=["nbval-check-output"]
named = resnet34.stages(params34, cfg34)
h = x34
for _, stage in named:
    h = stage(h)
logits34, _ = resnet34.forward(params34, x34, cfg34)
rows34 = resnet34.summary(params34, cfg34, x34.shape)
kinds = [r.kind for r in rows34]
print(stages.format_summary(rows34))
print(book.glue("r34_stages", f"{len(named)} stages; composition == forward bit for bit: "
                              f"{bool(jnp.array_equal(h, logits34))}"))
assert len(named) == 18 and [n for n, _ in named] == [r.name for r in rows34]
assert jnp.array_equal(h, logits34)
assert (kinds.count("stem"), kinds.count("identity"), kinds.count("downsample"), kinds.count("head")) == (1, 13, 3, 1)
assert sum(r.params for r in rows34) == stages.census(params34).floats

# %% [markdown]
# ## The tie in float64
#
# `tie` runs the rendered chain (the forward, the head's six kit ops for dy = (p − t̃)/N, then each
# stage's backward in reverse) and the oracle (`jax.value_and_grad` of the forward's loss), and
# compares them node by node: the largest entry error relative to the node's largest oracle
# entry. Both sides round at 1.1e-16 per operation, over chains of a few hundred operations, so
# the limit 1e-10 leaves five orders of magnitude for error growth and still catches any real
# bug, which moves a node by O(1).
#
# One kind of node needs care: a conv bias behind BatchNorm. BN subtracts the batch mean, so the
# loss does not depend on the bias at all, and its node, Σ of the BN input cotangent over the
# channel's M = N·H·W cells, is 0 in ℝ. Both sides return round-off there (a few 1e-15 of the
# net's largest gradient at M = 4,096, printed below), and a relative error of round-off against
# round-off means nothing. Those nodes are measured against the net's largest gradient, at the
# same 1e-10.

# %% tags=["nbval-check-output"]
tie8 = tie(cifar8, params8, x8, t8, cfg8, label_smoothing=alpha)
tie34 = tie(resnet34, params34, x34, t34, cfg34, label_smoothing=alpha)
for report in (tie8, tie34):
    zero = sum(r.zero_in_reals for r in report.rows)
    print(f"{report.net}: {sum(r.ok for r in report.nodes)}/{len(report.nodes)} nodes tied "
          f"({zero} zero in ℝ), input cotangent {'tied' if report.rows[-1].ok else 'FAILED'}; "
          f"worst rel err below 1e-12: {report.worst().rel < 1e-12}")
book.glue("c8_nodes_tied", (sum(r.ok for r in tie8.nodes), len(tie8.nodes)), "{}/{} nodes tied")
book.glue("r34_nodes_tied", (sum(r.ok for r in tie34.nodes), len(tie34.nodes)), "{}/{} nodes tied")
assert tie8.ok and tie34.ok
assert len(tie8.nodes) == 38 and len(tie34.nodes) == 110
assert abs(tie8.loss - tie8.loss_oracle) <= tolerances.REL_F64 * abs(tie8.loss_oracle)
assert abs(tie34.loss - tie34.loss_oracle) <= tolerances.REL_F64 * abs(tie34.loss_oracle)

# %% [markdown]
# The worst rows of each net and the whole cifar8 table (numbers vary in the last digits with the
# CPU; the verdicts do not):

# %%
print(tie8.summary())
print(tie34.summary())
print(f"cifar8 conv biases (0 in ℝ): largest error {max(r.err for r in tie8.rows if r.zero_in_reals):.1e}"
      f" = {max(r.rel for r in tie8.rows if r.zero_in_reals):.1e} × the net's largest gradient")
print(tie8.table())

# %%
plots.whole_net_tie.tie_nodes([tie8, tie34])
plt.show()

# %% [markdown]
# **Why 64 px for ResNet-34.** At 32 px the maps reaching `layer4` are 1×1, so with two examples
# each of its BN layers normalises M = 2 numbers per channel: x̂ = ±d/√(d² + ε) whatever the input,
# and the BN backward scales its cotangent by ε/(d² + ε). Everything upstream of `layer4` is then
# a quantity that cancels down to about 1e-5 of its terms, and the float64 tie there reaches only
# ~1e-8 (see `tests/checks/test_tie.py`). At 64 px `layer4` normalises M = 8 cells and the tie is
# at round-off again. Batch statistics need enough cells to be statistics.
#
# ## The input gradient
#
# The input cotangent is the last thing the chain computes (`r34InputGradB` for ResNet-34): the
# stem's strided conv input backward after the pool scatter, ReLU mask and BN backward. It is the
# last row of each report, tied like the parameter nodes. At a twin tie it would not exist (moving
# the image breaks twins); this batch has none.

# %% tags=["nbval-check-output"]
book.glue("c8_input_tied", (tie8.rows[-1].shape, "tied" if tie8.rows[-1].ok else "FAILED"),
          "input cotangent {} {} at 1e-10")
book.glue("r34_input_tied", (tie34.rows[-1].shape, "tied" if tie34.rows[-1].ok else "FAILED"),
          "input cotangent {} {} at 1e-10")
for report, s in ((tie8, smooth8), (tie34, smooth34)):
    inp = report.rows[-1]
    twins = sum(q.counts["twin tie"] for q in s.pools)
    print(f"{report.net}: input cotangent {inp.shape} {'tied' if inp.ok else 'FAILED'} at 1e-10; "
          f"twin ties in the batch: {twins}")
    assert inp.name == "input" and inp.ok and twins == 0

# %% [markdown]
# ## Each node is the derivative of the whole loss
#
# The oracle above is autodiff, itself a chain of rules. Finite differences ask the loss directly:
# along a random unit direction v in one node, (L(θ + h·v) − L(θ − h·v))/2h → ⟨∇L, v⟩ at O(h²).
# Real batches put kinks close: some pool windows here are within 1e-6 of a tie, and a difference
# taken across a kink measures the average of two slopes. So each step h starts at 1e-4 and
# shrinks (÷4) until both ends θ ± h·v lie in the smooth piece of θ: every ReLU input keeps its
# sign and every pool window its choice. The limit is 1e-5 relative. cifar8: every node;
# ResNet-34: `fd_nodes` nodes spread over the backward order (all 110 at `fd_nodes = 0`).

# %% tags=["nbval-check-output"]
_, grads8, _ = rendered_nodes(cifar8, params8, x8, t8, cfg8, alpha)
_, grads34, _ = rendered_nodes(resnet34, params34, x34, t34, cfg34, alpha)
order34 = list(reversed(list(params34)))
picked = order34 if p.fd_nodes == 0 else [order34[i] for i in np.linspace(0, 109, min(p.fd_nodes, 110)).astype(int)]
fd8 = derivatives(cifar8, params8, x8, t8, cfg8, grads8, key=jax.random.fold_in(key, 3), label_smoothing=alpha)
fd34 = derivatives(resnet34, params34, x34, t34, cfg34, grads34, key=jax.random.fold_in(key, 4),
                   names=picked, label_smoothing=alpha)
for name, rows in (("cifar8", fd8), ("ResNet-34", fd34)):
    print(f"{name}: {sum(r.ok for r in rows)}/{len(rows)} nodes match central differences "
          f"to {tolerances.FD_REL:.0e}")
assert all(r.ok for r in fd8 + fd34) and len(fd8) == 38

# %%
for r in fd34:
    print(f"{r.name:<30} fd {r.fd:+.6e}  rendered {r.rendered:+.6e}  rel {r.rel:.1e}")

# %% [markdown]
# ## The float32 view
#
# The nets train in float32, where no node ties to 1e-10. How close should a float32 node be? We
# let the float64 gradient say. Nudge the input by a relative 1e-7, float32's resolution,
# x·(1 + 1e-7·u) with u ~ N(0, 1) per pixel, and record how far each float64 node moves; the
# largest move over three draws is that node's **envelope**. A float32 chain rounds every
# intermediate at about that relative size, so its node should sit within a few envelopes of the
# float64 node: we require 10, with a floor of 1e-5 of the node's scale (of the net's largest
# gradient for nodes that are 0 in ℝ, which have no envelope of their own). A well-conditioned
# node gets a tight envelope; a node near a kink, where a nudge can flip a pool's choice, a wide
# one. Both sides run at the same float32-rounded point.
#
# The control: `drop_batch_divisor` in float32, against the same float64 reference.

# %% tags=["nbval-check-output"]
f32_8 = float32_view(cifar8, params8, x8, t8, cfg8, label_smoothing=alpha, key=jax.random.fold_in(key, 5))
f32_34 = float32_view(resnet34, params34, x34, t34, cfg34, label_smoothing=alpha, key=jax.random.fold_in(key, 6))
f32_ctl = float32_view(controls.drop_batch_divisor(cifar8), params8, x8, t8, cfg8, label_smoothing=alpha,
                       key=jax.random.fold_in(key, 5))
for v in (f32_8, f32_34, f32_ctl):
    print(f"{v.net}: {'within' if v.ok else 'OUTSIDE'} the view; "
          f"{len(v.rows) - len(v.failed)}/{len(v.rows)} rows within 10 envelopes or the floor")
book.glue("f32_view", (len(f32_8.rows) - len(f32_8.failed), len(f32_8.rows), len(f32_34.rows) - len(f32_34.failed),
                       len(f32_34.rows), "within" if f32_ctl.ok else "OUTSIDE"),
          "rows within 10 envelopes or the floor: cifar8 {}/{}, ResNet-34 {}/{}; control drop_batch_divisor {} the view")
assert f32_8.ok and f32_34.ok
assert not f32_ctl.ok and len(f32_ctl.failed) > len(f32_ctl.rows) // 2

# %%
for v in (f32_8, f32_34, f32_ctl):
    print(v.summary())

# %%
plots.whole_net_tie.float32_envelopes([f32_8, f32_34, f32_ctl])
plt.show()

# %% [markdown]
# ## Must-fail controls
#
# A check is worth the bugs it is seen to catch. `gradtie.checks.controls` plants one bug each in
# the rendered side, never in a kernel (the forward stays the real one, so the oracle is
# untouched):
#
# - `swap_gamma_beta`: every BN layer hands back dγ as dβ and dβ as dγ (same shape, nothing
#   complains);
# - `drop_batch_divisor`: the head cotangent skips `divConstB`, the ÷N;
# - `smoothing_wrong_k`: `shiftB` subtracts α/(K − 1) instead of α/K;
# - `pool2x2_backward_on_3x3`: ResNet-34's 3×3/s2 stem pool routed by the 2×2/s2 pool backward
#   (same shapes on even maps, other windows, no accumulation);
# - `same_padding_strided`: the strided convs' input backward and weight gradient padded as XLA's
#   `'SAME'` (0 before, 1 after for 3×3/s2; 2 and 3 for the 7×7/s2 stem) instead of PyTorch's
#   symmetric padding;
# - a non-twin tie point: the convs before the first pool reduced to their centre tap, on flat
#   images. Cells sharing a pixel tie without being twins; the census must refuse the point.
#
# For each we report the first node that breaks in backward order (head first) and the first
# BN β row: dβ = Σ dy has no weight in the way, so it traces where the cotangent itself goes
# wrong, and a wiring bug shows there as whole channels wrong.

# %% tags=["nbval-check-output"]
ctl8 = controls.run(cifar8, params8, x8, t8, cfg8, label_smoothing=alpha,
                    controls=[controls.swap_gamma_beta(cifar8), controls.drop_batch_divisor(cifar8),
                              controls.smoothing_wrong_k(cifar8)])
ctl34 = controls.run(resnet34, params34, x34, t34, cfg34, label_smoothing=alpha,
                     controls=[controls.pool2x2_backward_on_3x3(resnet34),
                               controls.same_padding_strided(resnet34)])
nontwin = controls.non_twin_tie(cifar8, params8, flat8, t8, cfg8, label_smoothing=alpha)
results = ctl8.results + ctl34.results + [nontwin]
print(controls.format_table(results))
print(f"real chains at the same points: cifar8 {'tied' if ctl8.real.ok else 'FAILED'}, "
      f"ResNet-34 {'tied' if ctl34.real.ok else 'FAILED'}")
print(f"non-twin point: {nontwin.smooth.summary().split(';')[0]}")
assert ctl8.ok and ctl34.ok and nontwin.red
first = {r.name: r.first.name for r in results}
assert first == {"swap_gamma_beta": "bn8.bias", "drop_batch_divisor": "fc3.bias",
                 "smoothing_wrong_k": "fc3.bias", "pool2x2_backward_on_3x3": "bn1.bias",
                 "same_padding_strided": "layer4.0.conv1.weight", "non_twin_tie": "conv2.weight"}
failed = {r.name: {row.name for row in r.report.failed} for r in results}
gamma_beta = {n for n in params8 if n.startswith("bn")}
assert failed["swap_gamma_beta"] == gamma_beta                 # beside the chain: nothing else moves
assert failed["pool2x2_backward_on_3x3"] == {"bn1.bias", "bn1.weight", "conv1.weight", "input"}
assert ctl34["same_padding_strided"].first_beta.name == "layer3.5.bn2.bias"
assert {n for n in failed["same_padding_strided"] if n.startswith("layer4")} == {"layer4.0.conv1.weight"}
assert failed["non_twin_tie"] == {"conv2.weight", "conv1.weight", "input"}
assert nontwin.first_beta is None                              # no β row can see it (below)

# %% [markdown]
# Reading the table from the head down:
#
# - the two head-cotangent bugs break the very first node, `fc3.bias` = Σ_n dy, and every node
#   behind it: all of dy is wrong;
# - `swap_gamma_beta` breaks exactly the γ and β rows and nothing else: the swap sits beside the
#   chain, not in it, so the cotangent flowing on is still right;
# - the pool control breaks nothing until the stem, then `bn1.bias` (whole channels of it) and
#   everything behind: the stem's conv weight and the input cotangent;
# - `'SAME'` padding first breaks `layer4.0.conv1.weight`, the weight gradient of the last strided
#   3×3 conv; its input backward then hands a wrong cotangent to `layer3`, whose last β row is the
#   first to show it. The 1×1/s2 projections read the same cells under both paddings and tie;
# - at the non-twin point the census refuses the point, and the tie fails, but only at
#   `conv2.weight`, `conv1.weight` and the input: a tie between cells holding one pixel sends the
#   cotangent to one cell or (autodiff's max) splits it evenly, and the two cells have the same x̂
#   in every layer that reads them through centre taps, so no β or γ row, and no bias, can tell.
#   Only the weights of the off-centre taps, zero but not absent, see the cells' neighbourhoods
#   differ. That is the non-twin tie: equal now, not equal for every weight.

# %%
plots.whole_net_tie.control_nodes(results, {"cifar8": ctl8.real, "resnet34": ctl34.real})
plt.show()

# %% [markdown]
# ## What this chapter showed
#
# At a verified smooth point of a real photo batch, every one of cifar8's 38 nodes and ResNet-34's
# 110 nodes, and both input cotangents, equal autodiff of the forward to round-off in float64;
# each node is the central-difference derivative of the whole loss; float32 sits within a few
# perturbation envelopes of float64; and each of the six must-fail controls goes red at the node
# where its bug enters the chain. `gradtie check --net resnet34 --data photos` runs the same tie
# from the command line, and the `gpu` profile of this chapter runs ResNet-34 at ImageNet shapes
# (224 px, batch 64, K = 1000).
