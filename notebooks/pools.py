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
# # Pools
#
# A max pool is the one layer of both nets whose derivative can fail to exist on real data, and it
# fails exactly where a window's maximum is attained twice. This chapter shows, in float64 on real
# photos, what the Lean suite proves about the two pools:
#
# - the rendered pool backward is a selection followed by a scatter: at σ = argmax (the first
#   maximal cell in row-major window order) it IS selScatter, the transpose of the gather model,
#   at every point, ties included (`maxPoolBackB` for cifar8's 2×2/s2 pools, `maxPool3s2BackB` for
#   ResNet-34's overlapping 3×3/s2 stem pool);
# - at a real batch every window is dead, strict or a twin tie, and none of these breaks the
#   derivative; a twin tie is harmless for the parameter gradient, not for the input gradient;
# - at a non-twin tie the derivative does not exist, and `gradtie check` says so.
#
# The first cell turns on float64: every equality below is meant to the last few bits.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from jax import lax

from gradtie import book, cli, plots
from gradtie.checks import census, check
from gradtie.nets import cifar8, resnet34
from gradtie.ops import head, maxpool

# %% tags=["parameters"]
batch = 4            # examples per census batch (both nets)
image_size = 64      # ResNet-34's input side (cifar8 always reads 32×32)
data = "photos"       # the census batch: photos, flat or randn
seed = 0

# %%
p = book.validated(batch=batch, image_size=image_size, data=data, seed=seed)
key = jax.random.key(p.seed)
cfg8, cfg34 = cifar8.Config(), resnet34.Config(num_classes=10)
params8 = {k: v.astype(jnp.float64) for k, v in cifar8.init(key, cfg8).items()}
params34 = {k: v.astype(jnp.float64) for k, v in resnet34.init(key, cfg34).items()}
x8 = check.make_batch(p.data, p.batch, 32, p.seed)            # float64 images in [0,1] (randn: N(0,1))
x34 = check.make_batch(p.data, p.batch, p.image_size, p.seed)
flat8 = check.make_batch("flat", p.batch, 32, p.seed)
flat34 = check.make_batch("flat", p.batch, p.image_size, p.seed)
labels = jax.random.randint(jax.random.fold_in(key, 1), (p.batch,), 0, 10)
targets = head.one_hot(labels, 10, jnp.float64)
print(f"cifar8 on {p.data} {tuple(x8.shape)}: pools {', '.join(cifar8.POOLS)} (2×2/s2); "
      f"ResNet-34 on {p.data} {tuple(x34.shape)}: {', '.join(resnet34.POOLS)} (3×3/s2 pad 1)")

# %% [markdown]
# ## Why a max pool has no derivative at a tie
#
# Take one 2×2 window with cells a, b, c, d and y = max(a, b, c, d). Where a is strictly the
# largest, y = a nearby and ∂y/∂a = 1, the rest 0. Where a = b > c, d, moving the cells by
# (δa, δb, δc, δd) moves y by max(δa, δb): piecewise linear in the direction, not linear, so no
# gradient exists. Any backward that sends the window's cotangent to one cell is then choosing a
# one-sided derivative.
#
# Three kinds of tie are harmless, and a real batch is made of them:
#
# - a **dead** window: after a ReLU every cell whose pre-activation z is negative reads 0, so a window
#   with all z < 0 is a four-way tie at 0. But nearby every cell stays negative, the pooled value
#   stays 0 whatever moves, and the ReLU mask kills the cotangent wherever the pool routes it.
# - a **strict** window: the maximum stays the maximum nearby.
# - a **twin** tie: the maximal cells are **twins**, equal for every value of every weight upstream
#   (their zero-padded receptive fields in the image are identical, as in the flat regions of a
#   photo). Then y = max(a(θ), a(θ)) = a(θ) is as smooth as a, in the parameters θ. It is not smooth
#   in the image, which can move one twin without the other.
#
# What is left, a tie between cells that are NOT twins (and any pre-activation exactly 0), breaks
# the derivative.

# %% [markdown]
# ## The backward is selScatter at σ = argmax
#
# The gather model freezes a pool at a selection σ (one cell per window): y = x[σ], a linear map.
# Its transpose, selScatter, puts each window's cotangent on the one cell that window read;
# overlapping 3×3/s2 windows add. The Lean render's pool backward (`maxPoolBackB`,
# `maxPool3s2BackB`) routes to the first maximal cell of the window on the pool's own saved input.
# So at σ = argmax the two must agree at every point, ties included. A hand-sized window shows the
# rule: one strict window, a two-way tie, a three-way tie and a dead (all-zero) window.

# %% tags=["nbval-check-output"]
toy = jnp.asarray([[1.0, 3.0, 5.0, 2.0],
                   [2.0, 0.0, 5.0, 1.0],
                   [4.0, 4.0, 0.0, 0.0],
                   [1.0, 4.0, 0.0, 0.0]])[None, None]
dtoy = jnp.asarray([[1.0, -2.0], [3.0, -4.0]])[None, None]
toy_back = maxpool.backward(maxpool.PoolSaved(toy, maxpool.POOL2), dtoy)
toy_first = maxpool.scatter(maxpool.select(toy, maxpool.POOL2), dtoy, toy.shape, maxpool.POOL2)
toy_last = maxpool.scatter(census.last_max(toy, maxpool.POOL2), dtoy, toy.shape, maxpool.POOL2)
print("sigma = argmax:", maxpool.select(toy, maxpool.POOL2)[0, 0].tolist(),
      " last max:", census.last_max(toy, maxpool.POOL2)[0, 0].tolist())
print("backward == selScatter(argmax):", bool(jnp.array_equal(toy_back, toy_first)))
print("backward == selScatter(last max):", bool(jnp.array_equal(toy_back, toy_last)))
assert jnp.array_equal(toy_back, toy_first)
assert not jnp.array_equal(toy_back, toy_last)      # the control: another σ is another backward

# %%
plots.pools.selection_example(np.asarray(toy[0, 0]), np.asarray(dtoy[0, 0]), np.asarray(toy_first[0, 0]),
                        np.asarray(toy_last[0, 0]))
plt.show()

# %% [markdown]
# Now the same on every pool of both nets, at the real batch: the pool inputs of cifar8's four
# 2×2 pools and of ResNet-34's stem pool, a random cotangent per pool, the rendered backward
# against selScatter at σ = argmax (bit for bit), and the gather model at σ = argmax against the
# forward. The control routes to the last maximal cell instead: it differs wherever a window ties,
# which after a ReLU means wherever a window is dead.

# %% tags=["nbval-check-output"]
inputs = {**{("cifar8", k): v for k, v in census.pool_inputs(cifar8, params8, x8, cfg8).items()},
          **{("resnet34", k): v for k, v in census.pool_inputs(resnet34, params34, x34, cfg34).items()}}
for i, ((net_name, pool), r) in enumerate(inputs.items()):
    spec = (cifar8.POOLS | resnet34.POOLS)[pool]
    y, saved = maxpool.forward(r, spec)
    dy = jax.random.normal(jax.random.fold_in(key, 100 + i), y.shape, jnp.float64)
    sigma = maxpool.select(r, spec)
    back = maxpool.backward(saved, dy)
    same_back = bool(jnp.array_equal(back, maxpool.scatter(sigma, dy, r.shape, spec)))
    same_fwd = bool(jnp.array_equal(y, maxpool.gather(r, sigma, spec)))
    tied = int(jnp.sum(jnp.sum(maxpool.windows(r, spec) == y[..., None], axis=-1) > 1))
    last = maxpool.scatter(census.last_max(r, spec), dy, r.shape, spec)
    moved = int(jnp.sum(last != back))
    print(f"{net_name:8} {pool:9} {spec.name:13} windows {y.size:6}, tied {tied:6}: backward == selScatter "
          f"{same_back}, gather == forward {same_fwd}; last-max control differs at {moved} cells")
    assert same_back and same_fwd
    assert tied > 0 and moved > 0

# %% [markdown]
# ## The census on real photos, both nets
#
# `census.smoothness` classifies every window of every pool, per example and channel, from the
# pre-activations z feeding ReLU → pool, and finds twins by equality under the actual weights and
# under fresh random draws of every upstream weight (conv weights and biases, γ, β): functions of
# the weights that are equal stay equal under every draw, others part. It also counts ReLU inputs
# that are exactly 0. The margin column is the smallest gap, over live windows, between a window's
# maximum and its nearest non-twin cell: how far the point sits from a tie.
#
# On photos at the default init we expect many dead windows: BatchNorm centres each channel, so
# about half the cells are negative; four independent cells would all be negative in 1/16 of the
# windows, but neighbouring cells of a photo are strongly correlated, which lifts that towards a
# quarter or a third. The rest should be strict, with no tie beyond rare twins (photos are
# resampled with interpolation, so exactly equal neighbourhoods are rare).

# %% tags=["nbval-check-output"]
photo8 = census.smoothness(cifar8, params8, x8, cfg8)
photo34 = census.smoothness(resnet34, params34, x34, cfg34)
for name, r in (("cifar8", photo8), ("ResNet-34", photo34)):
    print(f"{name} on {p.data}: {r.summary()}")
    print(r.table())
assert photo8.ok and photo34.ok
assert all(q.counts["non-twin tie"] == 0 and q.counts["dead"] > 0 for q in photo8.pools + photo34.pools)

# %% [markdown]
# ## Flat images: twins abound
#
# Flat images (the binary horse, a scanned page, upsampled digits, resampled without
# interpolation) have large regions of equal pixels. Cells inside such a region have identical
# zero-padded receptive fields, so after conv→BN→ReLU they are twins, and a window inside the
# region ties among twins. The census must find many twin ties and still no non-twin tie.

# %% tags=["nbval-check-output"]
twin8 = census.smoothness(cifar8, params8, flat8, cfg8)
twin34 = census.smoothness(resnet34, params34, flat34, cfg34)
for name, r in (("cifar8", twin8), ("ResNet-34", twin34)):
    print(f"{name} on flat images: {r.summary()}")
    print(r.table())
assert twin8.ok and twin34.ok
assert sum(q.counts["twin tie"] for q in twin8.pools) > 0 and twin34.pools[0].counts["twin tie"] > 0

# %%
plots.pools.pool_census({f"cifar8, {p.data}": photo8, f"ResNet-34, {p.data}": photo34,
                   "cifar8, flat": twin8, "ResNet-34, flat": twin34})
plt.show()

# %% [markdown]
# ## At a twin tie: the same parameter gradient, a different input gradient
#
# A twin tie never breaks as the parameters move, so routing the cotangent to either twin must
# give the same parameter gradient: the twins carry the same values forward, and the same
# receptive fields backward into every weight node. It need not give the same input gradient: the
# twins sit on different pixels. We run the rendered chain twice with the pools frozen by the
# gather model (`forward(..., selections=σ)`, whose backward is selScatter): at σ = argmax, and
# at σ′, which sends every twin-tied window to its LAST maximal cell, the other twin.
#
# A parameter node should move only by float64 round-off (summation order), below
# `census.ROUTE_REL` = 1e-12 relative; the input gradient should move by O(1). Dead windows are
# the other harmless tie: rerouting them changes nothing at all, since the ReLU mask zeroes the
# cotangent wherever it lands.

# %% tags=["nbval-check-output"]
twin_route = census.routing(cifar8, params8, flat8, targets, cfg8, twin8, "twin tie")
dead_route = census.routing(cifar8, params8, flat8, targets, cfg8, twin8, "dead")
print(twin_route.summary())
print(f"  rerouted per pool {twin_route.rerouted}; input gradient moves by {twin_route.dx_rel:.2f} of its max; "
      f"parameter nodes within 1e-12: {twin_route.same_parameter_gradient}")
print(dead_route.summary())
print(f"  dead reroute changes parameter nodes by exactly 0: {dead_route.param_rel == 0.0}, input gradient "
      f"by exactly 0: {dead_route.dx_rel == 0.0}")
assert twin_route.same_parameter_gradient and not twin_route.same_input_gradient
assert sum(twin_route.rerouted.values()) > 0 and twin_route.loss == twin_route.loss_rerouted
assert dead_route.param_rel == 0.0 and dead_route.dx_rel == 0.0

# %% [markdown]
# ## A non-twin tie: no derivative, and the check says so
#
# To build a point where the hypothesis fails we reduce cifar8's conv1 and conv2 to their centre
# taps (`census.planted_tie`: the other taps set to 0) and feed flat images. Now each cell of
# pool1's input reads a single pixel, so cells with equal pixels tie. They are not twins: their
# receptive fields differ, and the off-centre taps, 0 but free to move, tell them apart. The
# census must refuse the point and name the first offending window.

# %% tags=["nbval-check-output"]
planted8 = census.planted_tie(cifar8, params8)
planted = census.smoothness(cifar8, planted8, flat8, cfg8)
print(planted.summary())
print(planted.table())
assert not planted.ok and planted.non_twin_ties > 0
assert planted.violations[0].kind == "non-twin tie" and planted.violations[0].layer == "pool1"

# %% [markdown]
# Routing a non-twin tie to its other cell now moves the parameter gradient itself: the control
# that the twin result above is not automatic.

# %% tags=["nbval-check-output"]
nontwin_route = census.routing(cifar8, planted8, flat8, targets, cfg8, planted, "non-twin tie")
print(nontwin_route.summary())
print(f"  largest parameter node change {nontwin_route.param_rel:.2f} of its max ({nontwin_route.worst})")
assert not nontwin_route.same_parameter_gradient and nontwin_route.param_rel > 1e-3

# %%
plots.pools.routing_nodes({"twin ties (flat images)": twin_route, "non-twin ties (planted)": nontwin_route},
                    census.ROUTE_REL)
plt.show()

# %% [markdown]
# The loss itself shows the kink. Along a random unit direction v in the conv1 and conv2 weights
# (every tap), we take one-sided second-order differences at a step h a tenth of the first-order
# distance to the nearest kink that is NOT at the point (`census.kink_radius`), so each side sees one
# smooth piece. At the twin-tie point both sides agree with each other and with the rendered
# ⟨∇L, v⟩. At the planted point they differ: no gradient exists.

# %% tags=["nbval-check-output"]
v = census.direction(params8, ["conv1.weight", "conv2.weight"], jax.random.fold_in(key, 2))
slopes_twin = census.one_sided_slopes(cifar8, params8, flat8, targets, cfg8, v)
slopes_planted = census.one_sided_slopes(cifar8, planted8, flat8, targets, cfg8, v)
print(f"twin-tie point:     {slopes_twin.summary()}")
print(f"non-twin tie point: {slopes_planted.summary()}")
assert slopes_twin.smooth and abs(slopes_twin.right - slopes_twin.rendered) <= census.SLOPE_REL * abs(slopes_twin.rendered)
assert not slopes_planted.smooth

# %%
plots.pools.one_sided_slopes({"twin ties (flat images)": slopes_twin, "non-twin ties (planted)": slopes_planted})
plt.show()

# %% [markdown]
# `gradtie check --plant-tie` builds exactly this point (same seed, same flat batch) and must exit
# with code 2, naming the layer, example, channel and window of the first violation; it computes
# no tie, since there is no gradient to tie. We run the command line in-process.

# %% tags=["nbval-check-output"]
code = cli.main(["check", "--net", "cifar8", "--batch", str(p.batch), "--seed", str(p.seed), "--plant-tie"])
print(f"exit code {code}")
report = check.run_check("cifar8", batch=p.batch, seed=p.seed, plant_tie=True)
assert code == report.exit_code == check.EXIT_NOT_SMOOTH
assert report.smooth.non_twin_ties == planted.non_twin_ties and report.tie is None

# %% [markdown]
# ## The grids: 2×2/s2, 3×3/s2 with padding 1, and XLA's 'SAME'
#
# The 2×2/s2 pool reads disjoint windows, rows 2i and 2i + 1. The stem pool is PyTorch's
# `MaxPool2d(3, 2, 1)`: padding 1 on each side with −∞, so window i covers rows 2i − 1 … 2i + 1 and
# neighbouring windows share a row (hence the accumulation in `maxPool3s2BackB`). XLA's
# `padding='SAME'` is a different pool on an even side: it needs one row of padding in total and
# puts it at the END, so window i covers rows 2i … 2i + 2, one cell off. We read each pool's
# windows by pooling the row index itself (the max gives a window's last row, the max of the
# negated index its first), and compare with those formulas.

# %% tags=["nbval-check-output"]
side = 8
rows = jnp.broadcast_to(jnp.arange(side, dtype=jnp.float64)[:, None], (1, 1, side, side))
same = (lax.reduce_window(rows, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")[0, 0, :, 0],
        -lax.reduce_window(-rows, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")[0, 0, :, 0])
pad1 = (maxpool.forward(rows, maxpool.POOL3S2)[0][0, 0, :, 0], -maxpool.forward(-rows, maxpool.POOL3S2)[0][0, 0, :, 0])
two = (maxpool.forward(rows, maxpool.POOL2)[0][0, 0, :, 0], -maxpool.forward(-rows, maxpool.POOL2)[0][0, 0, :, 0])
i = np.arange(side // 2)
spans = {"2×2/s2": (2 * i, 2 * i + 1), "3×3/s2 pad 1 (PyTorch, Lean)": (2 * i - 1, 2 * i + 1),
         "3×3/s2 'SAME' (XLA): control": (2 * i, 2 * i + 2)}
for (label, (first, last)), (m_last, m_first) in zip(spans.items(), (two, pad1, same)):
    print(f"{label:30} first rows {np.asarray(m_first).astype(int).tolist()}, "
          f"last rows {np.asarray(m_last).astype(int).tolist()}")
    assert np.array_equal(np.clip(first, 0, side - 1), m_first) and np.array_equal(np.clip(last, 0, side - 1), m_last)
assert not np.array_equal(np.asarray(same[0]), np.asarray(pad1[0]))

# %%
plots.pools.window_grids(side, spans)
plt.show()

# %% [markdown]
# On the real stem-pool input the offset is no rounding matter: the 'SAME' pool reads other cells
# and returns other values, so a backward built for it would route to other cells too.

# %% tags=["nbval-check-output"]
r34 = inputs[("resnet34", "stem.pool")]
y_pad1 = maxpool.forward(r34, maxpool.POOL3S2)[0]
y_same = lax.reduce_window(r34, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2), "SAME")
differ = int(jnp.sum(y_same != y_pad1))
print(f"stem pool on {tuple(r34.shape)}: 'SAME' and pad 1 give the same shape {y_same.shape == y_pad1.shape}; "
      f"they differ at {differ / y_pad1.size:.0%} of the outputs")
assert y_same.shape == y_pad1.shape and differ > 0

# %% [markdown]
# ## What this chapter showed
#
# | claim | Lean | shown by |
# |---|---|---|
# | the pool backward is selScatter at σ = argmax, ties included | `maxPoolBackB`, `maxPool3s2BackB` | bit-equal on every pool of both nets; the last-max control differs |
# | real batches hold dead, strict and twin-tied windows only | the smooth-point hypothesis | the census on photos and flat images, both nets |
# | at a twin tie the parameter gradient does not depend on the twin | eventual equality of the gather model | rerouted gradients equal to 1e-12; the input gradient moves |
# | at a non-twin tie there is no derivative | the hypothesis fails | one-sided slopes differ; `gradtie check` exits 2 |
# | the stem pool is the symmetric pad-1 pool | `maxPool3s2BackB`'s windows 2i − 1 … 2i + 1 | XLA 'SAME' reads windows one cell off |
