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
# # Would the check catch it?
#
# A tie is worth only as much as the bugs it is seen to catch. The Lean suite proves that the
# rendered chain IS the gradient — `cifar8Bbn_train_step_tiedB` and `r34_net_tiedB` tie every node,
# `cifar8Bbn_net_lossGrad` and `r34_net_lossGrad` make each node the loss's derivative,
# `cifar8BbnInputGradB_correct` and `r34InputGradB_correct` tie the input cotangent, and
# `r34_net_syncTiedB` ResNet-34's data-parallel step. A numerical check of the same claim says nothing until we have watched
# it fail on chains that are *almost* right. This chapter plants, one at a time, a catalogue of
# real backward bugs — each modelled on a bug that shipped in a major framework or that
# hand-written backwards commonly have — in the rendered backward (never in the forward, never in
# the oracle), runs the very verdict `gradtie check` runs, and shows each one going red at the first
# node it reaches in backward order. The catalogue and its verdicts go beyond the suite: they are
# the evidence that our numerical reading of the suite's statements can fail.
#
# Every verdict here is the check's: each node is held to ten times the round-off envelope
# measured at the point itself (the float64 oracle with the batch reversed and at ulp-nudged inputs
# and parameters), floored at `tolerances.REL_F64` = 1e-10. We plant at two points, both at **drawn weights**
# (γ ~ U(0.5, 1.5), β ~ N(0, 0.3²), biases ~ N(0, 0.1²)): cifar8 on photo crops, and ResNet-34 at
# 32 px with two flat images — where layer4's BatchNorm normalises over M = 2 values, round-off is
# amplified and every limit widens. A bug must stand out even there.

# %% tags=["hide-input"]
from gradtie.fake_devices import request_host_devices

# eight host devices for the synchronised-BN entries (R ≤ 8), read by XLA when JAX
# starts; other XLA_FLAGS in the environment are kept
request_host_devices(8)

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book, data
from gradtie.book import pages, plots
from gradtie import tolerances
from gradtie.checks import bugs
from gradtie.checks.tie import reference_at, targets_matrix, tie
from gradtie.nets import cifar8, protocol, resnet34

# %% tags=["parameters", "hide-input"]
batch: int = 4       # cifar8 photo crops
resnet_batch: int = 2  # ResNet-34 flat images (at 32 px, layer4's BN averages N cells)
image_size: int = 32  # ResNet-34's image side
replicas: int = 2    # the synchronised-BN entries: R replicas on host devices
seed: int = 0

# %% tags=["hide-input"]
p = book.validated(
    batch=batch,
    resnet_batch=resnet_batch,
    image_size=image_size,
    replicas=replicas,
    seed=seed,
)
assert (
    2 <= p.replicas <= 8
), "the synchronised-BN entries run on the 8 host devices this chapter sets up"
key = jax.random.key(p.seed)
alpha = 0.1  # label smoothing on: the head entry α/(K−1) plants nothing at α = 0
cfg8, cfg34 = cifar8.Config(), resnet34.Config(num_classes=10)
params8 = {
    k: jnp.asarray(np.asarray(v, np.float64))
    for k, v in cifar8.NET.init(key, cfg8, weights="drawn").items()
}
params34 = {
    k: jnp.asarray(np.asarray(v, np.float64))
    for k, v in resnet34.NET.init(key, cfg34, weights="drawn").items()
}
x8 = jnp.asarray(data.photos(p.batch, 32, seed=p.seed), jnp.float64)
x34 = jnp.asarray(
    data.flat_images(p.resnet_batch, p.image_size, seed=p.seed), jnp.float64
)
t8 = targets_matrix(jnp.arange(p.batch) * 3 % 10, 10, jnp.float64)
t34 = targets_matrix(jnp.arange(p.resnet_batch) * 3 % 10, 10, jnp.float64)

# %% tags=["nbval-check-output", "hide-input"]
# ResNet-34's statements fix 224 px as a literal: a ResNet-34 figure at another side is
# the same architecture beyond them, and says so
print(
    protocol.resolution_note(resnet34.NET, p.image_size)
    or "resnet34 at the statements' own 224 px"
)

# %% [markdown]
# ## The catalogue
#
# Twenty-odd entries in six families. Some apply to one net only: cifar8 has no residual blocks,
# no projection and no overlapping pool; ResNet-34's only dense layer is not square, so a
# transposed weight gradient would raise a shape error rather than hide.

# %% tags=["nbval-check-output", "hide-input"]
display(
    pages.folded(pages.bugs(), "the catalogue: family, bug, what is wrong, which nets")
)
print(
    f"\n{len(bugs.CATALOGUE)} entries: {len(bugs.entries(cifar8.NET))} apply to cifar8,"
    f" {len(bugs.entries(resnet34.NET))} to ResNet-34,"
    f" {len(bugs.entries(replicas=True))} through the data-parallel step"
)
assert len(bugs.CATALOGUE) >= 20

# %% [markdown]
# ## The real chains tie at both points
#
# First the control of the controls: with nothing planted, both chains tie. At the ResNet-34 point
# of the default parameters (two flat images at 32 px) the smallest BatchNorm reduction is M = 2, the
# envelope widens most limits past the 1e-10 floor, and the chain still ties.

# %% tags=["nbval-check-output", "hide-input"]
point8 = reference_at(cifar8.NET, params8, x8, t8, cfg8, label_smoothing=alpha)
point34 = reference_at(resnet34.NET, params34, x34, t34, cfg34, label_smoothing=alpha)
real8 = tie(point8)
real34 = tie(point34)
for r in (real8, real34):
    print(
        f"{r.net}: {'tied' if r.ok else 'FAILED'}"
        f" {sum(x.ok for x in r.nodes)}/{len(r.nodes)} nodes, input"
        f" {'tied' if r.row('input').ok else 'FAILED'}, loss"
        f" {'tied' if r.row('loss').ok else 'FAILED'}; limits widened past the floor at"
        f" {len(r.widened())} rows; smallest BN reduction M = {r.smallest_bn()[1]}"
    )
assert real8.ok and real34.ok
# layer4's BatchNorm reduces over N·(side/32)² cells
m34 = p.resnet_batch * (p.image_size // 32) ** 2
assert real34.smallest_bn()[1] == m34
if m34 == 2:    # the ci point: round-off at M = 2 widens most limits past the floor
    assert len(real34.widened()) > len(real34.rows) // 2

# %% [markdown]
# ## Every bug, planted
#
# ```{admonition} Beyond the suite
# :class: attention
# The catalogue is not a statement of the suite: it is evidence that our numerical reading of the
# suite's statements can fail.
# ```
#
# ```{admonition} How each entry is tied, and what the tables show
# :class: dropdown
# Each entry's chain is tied at the same point, against the same reference and envelope. The
# table shows whether it was caught and the first node, in backward order, that fails — where the
# bug first enters the chain. Where should that be? A BatchNorm bug enters at the last BatchNorm
# layer the backward reaches: either in that layer's own γ or β node, or in the cotangent its
# backward hands to the conv just before it, whose weight and bias nodes read it. The cell after
# the table reads, family by family, where the entries first show. The error over the limit (the
# figure) is many orders of magnitude for every entry: these bugs are not subtle next to round-off.
# ```

# %% tags=["nbval-check-output", "hide-input"]
caught8 = bugs.run(point8)
caught34 = bugs.run(point34)
sync8 = bugs.run(point8, replicas=p.replicas)  # its own section below
for rep in (caught8, caught34):
    print(rep.summary())
    display(
        pages.folded(
            pages.caught(rep), f"{rep.net}: the {len(rep.caught)} bugs, one row each"
        )
    )
book.glue(
    "bugs_caught",
    f"{caught8.summary()}; {caught34.summary()}",
    at=(
        book.At(
            "cifar8",
            image_size=32,
            batch=p.batch,
            classes=10,
            alpha=alpha,
            data="photos",
            dtype="float64",
            weights="drawn",
            role="control",
        ),
        book.At(
            "resnet34",
            image_size=p.image_size,
            batch=p.resnet_batch,
            classes=10,
            alpha=alpha,
            data="flat",
            dtype="float64",
            weights="drawn",
            role="control",
            extra={"widths": list(resnet34.WIDTHS)},
        ),
    ),
)
assert caught8.ok and caught34.ok
assert min(c.ratio for rep in (caught8, caught34) for c in rep.caught) > 1e3

# %% [markdown]
# All of them at a glance, one row per point: each dot a planted bug, the diamond the real chain's
# worst node (the book's headline figure, on its first page); the third row plants the
# synchronised-BatchNorm entries in the data-parallel step (its section is below).

# %% tags=["hide-input"]
headline = plots.would_it_catch.overview([caught8, caught34, sync8])
book.glue_figure("headline_catch", headline)  # the intro's headline figure
plt.show()

# %% tags=["nbval-check-output", "hide-input"]
last_bn = {
    "cifar8": ("conv8.", "bn8."),
    "resnet34": ("layer4.2.conv2.", "layer4.2.bn2."),
}
for rep, net_name in ((caught8, "cifar8"), (caught34, "resnet34")):
    firsts = {}
    for c in rep.caught:
        firsts.setdefault(c.family, []).append(c.first.name)
    for family, names in firsts.items():
        print(f"{net_name} {family}: first failing nodes {sorted(set(names))}")
    assert all(n.startswith(last_bn[net_name]) for n in firsts["BatchNorm"]), (
        f"{net_name}: a BatchNorm entry first shows outside the last BatchNorm layer"
        f" and its conv: {firsts['BatchNorm']}"
    )

# %% tags=["hide-input", "hide-output"]
# the first failing node's error over its limit moves with the machine's round-off:
# nbval does not compare these tables
display(pages.caught(caught8, ratios=True, caption="cifar8, with err/limit"))
display(pages.caught(caught34, ratios=True, caption="ResNet-34, with err/limit"))

# %% [markdown]
# ## Synchronised BatchNorm: through the data-parallel step
#
# ```{admonition} Beyond the suite
# :class: attention
# These entries are planted in cifar8's data-parallel step, and cifar8 has no data-parallel render:
# no statement of the suite covers this mesh step. (For ResNet-34, `r34_net_syncTiedB` says the
# all-reduced nodes are the single-device nodes at N := R·N; the chapter Data-parallel tie shows it.)
# ```
#
# ```{admonition} The three data-parallel entries
# :class: dropdown
# Three entries live in the data-parallel step, where each replica holds N of the R·N examples and
# BatchNorm's statistics and backward means are all-reduced: dγ and dβ reduced twice (R× too
# large), and the backward's means taken over the replica's own cells. `gradtie check --replicas R`
# ties the mesh step to the single-device oracle at batch R·N, through the same verdict; here on
# cifar8, whose mesh step is the suite's ResNet-34 statement carried to a net it does not state it
# for.
# ```

# %% tags=["nbval-check-output", "hide-input"]
print(sync8.summary())
display(
    pages.folded(
        pages.caught(sync8), f"{sync8.net}: the {len(sync8.caught)} bugs, one row each"
    )
)
assert sync8.ok

# %% [markdown]
# ## Why drawn weights
#
# At a net's initial weights every γ is exactly 1 and every β and bias 0. Two entries are then
# bit for bit the right chain: a BN backward that forgets γ (t = dy instead of γ·dy), and dγ formed
# from the BN output y = γx̂ + β instead of x̂. Checked at init, both would pass — which is why the
# check, and every tie in this book, runs at drawn weights unless it says otherwise.

# %% tags=["nbval-check-output", "hide-input"]
init8 = {
    k: jnp.asarray(np.asarray(v, np.float64))
    for k, v in cifar8.NET.init(key, cfg8, weights="init").items()
}
point_init = reference_at(cifar8.NET, init8, x8, t8, cfg8, label_smoothing=alpha)
hidden = bugs.run(point_init, names=("bn_forget_gamma", "bn_dgamma_from_y"))
for c in hidden.caught:
    drawn = next(d for d in caught8.caught if d.bug == c.bug)
    print(
        f"{c.bug}: at init {'caught' if c.red else 'passes (hidden)'}; at drawn weights"
        f" {'caught' if drawn.red else 'passes'}"
    )
assert hidden.real.ok and not any(c.red for c in hidden.caught)

# %% [markdown]
# ## How small a bug the check can see
#
# The catalogue's bugs are large. How small may one be? Each row's limit says it: a node returned
# as node·(1 + δ) fails once δ·max|node| exceeds the limit in the node's scale, so every row has a
# threshold, `(limit·scale + err) / max|node|` (`gradtie check --sensitivity`). Where every limit
# is the 1e-10 floor (cifar8 on photos) a node off by about 1e-10 is caught; where round-off
# widens the limits (ResNet-34's flat point, M = 2 in layer4) only far larger errors are. Conv
# biases behind BatchNorm are 0 in ℝ and measured against the net's scale: no relative error on
# them can be seen, and they are left out of the figures. We check the threshold by planting it:
# one node scaled at twice its threshold, and at half of it.

# %% tags=["nbval-check-output", "hide-input"]
sens8, sens34 = real8.sensitivity(), real34.sensitivity()
print(
    f"cifar8 (photos): a node off by δ is caught from δ ≈ {sens8[0]:.0e} (median),"
    f" every node from δ ≈ {sens8[1]:.0e}"
)
# the flat point's thresholds follow its measured round-off, which moves by a small
# factor from one CPU to another: printed as the decade they fall in (the values
# themselves below)
print(
    f"ResNet-34 (flat, M = {m34}): from δ in {book.decade(sens34[0])} (median), every"
    f" node from δ in {book.decade(sens34[1])}"
)
assert sens8[0] < 1e-9 < sens34[1]
row = real34.row("layer3.0.conv1.weight")
at2 = tie(point34, bugs.scaled_node(resnet34.NET, row.name, 2 * row.sensitivity))
at_half = tie(point34, bugs.scaled_node(resnet34.NET, row.name, 0.5 * row.sensitivity))
print(
    f"{row.name} scaled by 1 + 2δ*: {at2.row(row.name).verdict}; by 1 + δ*/2:"
    f" {at_half.row(row.name).verdict}"
)
assert not at2.row(row.name).ok and at_half.row(row.name).ok

# %% tags=["hide-input"]
print(
    f"ResNet-34 thresholds on this machine: {sens34[0]:.1e} (median), {sens34[1]:.1e}"
    " (every node)"
)
print(
    f"the threshold δ* of {row.name}: {row.sensitivity:.2e} (its limit {row.limit:.1e})"
)

# %% tags=["hide-input"]
plots.would_it_catch.caught([caught8, caught34, sync8])
plt.show()

# %% [markdown]
# ## What this chapter showed
#
# At the same points where both real chains tie, every entry of the catalogue of backward bugs,
# each modelled on a bug that shipped or that hand-written backwards commonly have, goes red at
# its first node in backward order, by many orders of magnitude over its limit (the overview
# under "Every bug, planted", the book's headline figure, and the bars above, bug by bug); the
# synchronised-BatchNorm entries go red through the
# data-parallel step; two of the bugs are invisible at the initial weights, which is why every
# tie runs at drawn weights; and each node's limit says how small a bug it can see, checked by
# planting a node error at twice and at half its threshold.
#
# All of it is beyond the suite: the catalogue is evidence that our numerical reading of
# `cifar8Bbn_train_step_tiedB`, `r34_net_tiedB`, the `*_lossGrad` statements and the input-gradient
# ties can fail, not a statement of the suite. `gradtie check --plant-bug list` prints the
# catalogue; `gradtie check --plant-bug NAME` runs one entry and exits 1 naming the first failing
# node.
