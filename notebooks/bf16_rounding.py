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
# # bf16 at real rounding
#
# ```{admonition} Beyond the suite
# :class: attention
# Everything in this chapter is ours, not a statement of the suite. The suite's bf16 node ties
# read its bf16 nodes at the identity rounding (`Bf16Erasure`: the previous chapter, [bf16
# erasure](bf16_erasure.ipynb)); it bounds one rounding (`rndP_err`) and a mixed-precision conv
# forward at any leaf float model (`conv_close_mixed`), not instantiated at bf16 and not for these
# nodes.
# ```
#
# The book's nets round every conv site at real bf16 rounding — the forward conv, the input
# backward and the weight gradient, strided peers included — and keep everything else in float32.
# This chapter takes them at the same points as the previous one (both nets on the bf16 switch, at
# **drawn weights**, on real photos) and shows:
#
# - **the bound**: each conv output's error against the exact value, relative to the magnitude sum
#   Σ|a|·|b| of its products, stays under the mixed-precision bound B(n) at its contraction
#   length n;
# - **the whole gradient, stage by stage**: every stage of the bf16 chain — its nodes and the
#   cotangent it hands on — is the VJP of that stage at the input and cotangent the chain hands it,
#   and every catalogue bug planted in the bf16 chain parts from it;
# - how far the whole bf16 gradient sits from the f32 one, what a compiler keeps of a rounding,
#   and the execution policies people train with.
#
# Exact values are float64, so the first cell turns it on; the bf16 chains themselves run in
# float32.

# %% tags=["hide-input"]
import dataclasses

import jax
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book
from gradtie.book import bf16_points, pages, plots
from gradtie.checks import bf16, bugs, policies
from gradtie.checks.tie import Point
from gradtie.nets import protocol, resnet34
from gradtie.ops import conv

# %% tags=["parameters", "hide-input"]
batch: int = 4       # examples per batch (both nets)
image_size: int = 32  # ResNet-34's input side (cifar8 always reads 32×32)
data: str = "photos"  # photos, flat or randn
seed: int = 0
policy: str = "bf16"  # the fast execution policy tied in its own section: bf16 or tf32

# %% tags=["hide-input"]
p = book.validated(
    batch=batch,
    image_size=image_size,
    data=data,
    seed=seed,
    policy=policy,
)
key = jax.random.key(p.seed)
# both nets on the bf16 switch at drawn weights; `at_nets`: what every figure below is
# glued with
setup = bf16_points.build(p, key)
points, at_nets = setup.points, setup.at
print("\n".join(setup.lines))
sites, site_rows, chains = bf16_points.conv_sites(points)  # every conv site

# %% tags=["nbval-check-output", "hide-input"]
# ResNet-34's statements fix 224 px as a literal: a ResNet-34 figure at another side is
# the same architecture beyond them, and says so
print(
    protocol.resolution_note(resnet34.NET, p.image_size)
    or "resnet34 at the statements' own 224 px"
)

# %% [markdown]
# ## The bound (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# The suite bounds one rounding (`rndP_err`: |rndP p x − x| ≤ 2^−(p+1)·|x|, bf16 at p = 7) and the
# forward of a mixed-precision conv at any leaf and accumulate float models
# (`FloatModel.conv_close_mixed`); it does not instantiate that at bf16 (its `Bf16Fold` says so) and
# bounds no input-backward or weight-gradient kind. The bound below, for all three kinds, is ours.
# ```
#
# ```{admonition} The bound B(n), and the bf16-accumulation control
# :class: dropdown
# Take one output s = Σ_{i≤n} a_i·b_i. Rounding the operands gives â = a(1+α), b̂ = b(1+β) with
# |α|, |β| ≤ u = 2⁻⁸ (bf16 keeps 8 significant bits), so |Σ âb̂ − Σ ab| ≤ (2u + u²)·M with the
# **magnitude sum** M = Σ|a|·|b|. The products âb̂ of two bf16 values are exact in float32, and a
# float32 sum of n terms, in any order, errs by at most ((1+v)^(n−1) − 1)·Σ|âb̂|, v = 2⁻²⁴; we
# keep the exponent n+1, which also covers rounded products. Together
#
#     |ŝ − s| ≤ B(n)·M,    B(n) = ((1+2⁻²⁴)^(n+1) − 1)(1+2⁻⁸)² + 2·2⁻⁸ + 2⁻¹⁶,
#
# and the single rounding of the result adds u·|ŝ| ≤ u(1 + B(n))·M. The error is measured against
# M, not against |s|: an output whose products cancel can be near 0 while its rounding errors are
# not. The contraction length n is C·k² for the forward, O·k² for the input backward (the stride-1
# correlation of the zero-upsampled cotangent: the zeros are exact) and N·H'·W' for the weight
# gradient, whose batch sum is inside the one contraction. For ResNet-34's 7×7 and 3×3 forward
# convs, n = 147 … 4608, and B(n) stays just above 2u = 0.0078 over that range (the cell below
# computes both ends and asserts they lie within 0.0078 … 0.0082): the float32 term is small next
# to the operand rounding until n reaches the weight gradients of large batches and images.
#
# As a control, a forward that accumulates in bf16 — every partial sum rounded — on positive
# operands, where each step can lose u of a growing sum: its error grows like n·u.
# ```

# %% tags=["nbval-check-output", "hide-input"]
b_short, b_long = float(bf16.accumulation_bound(147)), float(
    bf16.accumulation_bound(4608)
)
print(f"B(147) = {b_short:.4f}, B(4608) = {b_long:.4f}")
assert 2 * bf16.U_BF16 < b_short < b_long < 0.0082, (
    f"B(147) = {b_short:.5f}, B(4608) = {b_long:.5f}: expected 2u ="
    f" {2 * bf16.U_BF16:.5f} < B(147) < B(4608) < 0.0082"
)
for name, rows in site_rows.items():
    inside = sum(r.ratio <= 1 for r in rows)
    print(f"{name}: {inside}/{len(rows)} conv nodes under the bound")
    assert inside == len(rows)
book.glue(
    "bf16_bound",
    (
        sum(r.ratio <= 1 for rows in site_rows.values() for r in rows),
        sum(len(rows) for rows in site_rows.values()),
    ),
    "{}/{} conv nodes of both nets under the bound",
    at=at_nets,
)
pos = dataclasses.replace(
    bf16.kind_cases(p.seed, c=16, positive=True)[0], name="bf16 accumulation", bias=None
)
acc = bf16.case_row(pos, conv.round_bf16, bf16.forward_bf16_accumulation(pos.a, pos.b))
print(f"control, bf16 accumulation at n = {acc.n}: under the bound: {acc.ratio <= 1}")
assert acc.ratio > 1

# %% [markdown]
# The measured worst error over each node's outputs, against the bound, layer by layer. We expect
# ratios well below 1: the bound adds every rounding error at its worst, and real ones partly
# cancel. Weight gradients of the deep layers sit closest to it: at 32 px their contraction is
# short (N·1·1 at ResNet-34's layer 4), so one output carries the operand rounding of a few
# products with nothing to average it.

# %% tags=["hide-input", "hide-output"]
for name, rows in site_rows.items():
    for op in bf16.OPS:
        pick = [r for r in rows if r.op == op]
        worst = max(pick, key=lambda r: r.ratio)
        print(
            f"{name:8} {bf16.OP_LABELS[op]:15} n ="
            f" {min(r.n for r in pick)}…{max(r.n for r in pick)}: error/bound max"
            f" {worst.ratio:.2f} ({worst.name}), median"
            f" {np.median([r.ratio for r in pick]):.2f}"
        )
print(f"control, bf16 accumulation: error/bound {acc.ratio:.1f}")

# %% tags=["hide-input"]
plots.bf16_rounding.bf16_bound(site_rows, controls=[acc])
plt.show()

# %% [markdown]
# ## The whole gradient, stage by stage (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# These ties run the bf16 chain at real rounding. The suite's bf16 node tie (`ConvWTiedBAt bf16`) is
# read at the identity rounding, where erasure (the previous chapter) makes it the f32 node; at
# real rounding the node ties below are ours.
# ```
#
# ```{admonition} What is tied stage by stage, and the frozen reference
# :class: dropdown
# The suite's statement about the bf16 gradient is a node tie: each weight-gradient node, at the
# cotangent the rendered chain threads to it, is the derivative of its op (`ConvWTiedBAt bf16`, at
# the identity rounding; the book's nets round the other conv sites too, and so the cotangents
# themselves).
# A tie that only looks at the conv nodes cannot see a wrong cotangent: a BatchNorm backward that
# forgets γ hands every conv below it a wrong cotangent, and each conv node is still its own op's
# derivative at that wrong cotangent. So we tie the bf16 chain stage by stage, as the chapter Stage
# by stage does in float64: run the chain once with a tape (every stage's input, and the cotangent each stage
# is handed) and a recording kit (every conv site's operands and results), and hold each stage — its
# nodes *and the cotangent it hands on* — to the VJP of that stage's forward alone at the same input
# and cotangent (the autodiff oracle, float64). A wrong BatchNorm, pool, ReLU, residual or head
# backward parts from the VJP at the stage that holds it; the loss cotangent is tied to autodiff of
# the loss in the logits.
#
# Each conv site of the reference is a bf16 kind **frozen at the chain's own rounding decisions**:
# its rounded input, weight and output are the chain's, and every cotangent into and out of the
# contraction is rounded as the kit's conv backwards round it — the chain's way wherever the chain's
# value lies within one bf16 ulp of it. Why frozen? Two evaluations of one bf16 chain that differ by
# a float32 ulp somewhere (a BatchNorm statistic summed in another order) round the odd entry one
# bf16 ulp apart, and BatchNorm over few cells spreads it: left free, the reference would differ
# from a correct chain by such flips, and no envelope of a few evaluations sees a rare flip. Frozen,
# what is left to tie is float32 arithmetic, held to the point's float32 envelope as in the float32
# view of the Whole-net tie: the reference evaluated in float32 at the point, with the batch
# reversed and at float32-unit nudges, times ten, floored at float32's floor. A conv backward off by
# more than an ulp anywhere is not taken over and fails; a bug that stays under one ulp wherever it
# meets a rounding can hide in the chain's rounding: that is bf16's resolution.
# ```

# %% tags=["nbval-check-output", "hide-input"]
ties = {
    name: bf16.stage_ties(Point.of(net, params, x, t, cfg))
    for name, (net, cfg, params, x, t) in points.items()
}
for name, report in ties.items():
    rows = [r for tie in report.backward_order() for r in tie.rows]
    print(
        f"{name}: {sum(tie.ok for tie in report.ties)}/{len(report.ties)} stages and"
        f" the loss cotangent {'tied' if report.cotangent.ok else 'FAILED'};"
        f" {sum(r.ok for r in rows)}/{len(rows)} rows within {report.meta['factor']:g}×"
        " the envelope"
    )
    assert report.ok
print(
    book.glue(
        "bf16_stage_ties",
        tuple(
            x for r in ties.values() for x in (sum(t.ok for t in r.ties), len(r.ties))
        ),
        "bf16 chains at real rounding, stage by stage: cifar8 {}/{} stages, ResNet-34"
        " {}/{} stages tied to their VJP",
        at=at_nets,
    )
)

# %% tags=["hide-input", "hide-output"]
# the measured figures below depend on the machine's round-off, so nbval does not
# compare them
for name, report in ties.items():
    rows = [r for tie in report.backward_order() for r in tie.rows]
    stage, worst = report.worst()
    ill = [r for r in rows if r.ill_conditioned]
    print(
        f"{name}: worst row at {worst.ratio:.2f} of its limit ({stage}: {worst.name});"
        f" limits from {min(r.limit for r in rows):.0e} to"
        f" {max(r.limit for r in rows):.0e} of the node; {len(ill)} rows too"
        " ill-conditioned to judge a 1 % bug"
    )
display(pages.stages(ties["cifar8"]))

# %% [markdown]
# A limit that nothing can fail is no limit. The controls are the catalogue of *Would the check
# catch it?*: every single-device entry that applies to cifar8 — BatchNorm, pool, conv, dense, head
# and the ReLU mask read off the wrong tensor — planted in the bf16 chain in turn and tied stage by
# stage at the same point (α = 0.1, so that the smoothing entry plants something). For each, its
# **size** is its own effect at the row where it stands out most — the planted stage against the
# real one at the same recorded input and cotangent, both in float64 — and its **threshold** the
# smallest relative error the bf16 verdict can see at that row: its limit, and in a stage holding a
# bf16 conv site at least 2⁻⁸, bf16's own resolution. An entry above its threshold must be caught;
# one below it, if any, is listed with both numbers.

# %% tags=["nbval-check-output", "hide-input"]
net8, cfg8, params8, x8, t8 = points["cifar8"]
caught = bf16.catalogue(net8, params8, x8, t8, cfg8, label_smoothing=0.1)
for c in caught:
    print(
        f"{c.bug:32} {c.family:14} caught: {'yes' if c.caught else 'NO':3}  above its"
        f" threshold: {'yes' if c.above else 'no'}"
    )
below = [c for c in caught if not c.above]
print(
    f"{sum(c.caught for c in caught)}/{len(caught)} entries caught under bf16; below"
    f" the point's bf16 sensitivity: {', '.join(c.bug for c in below) or 'none'}"
)
assert all(c.caught for c in caught if c.above)

# %% tags=["hide-input", "hide-output"]
pages.Table(
    ("caught", "bug", "size", "threshold", "at", "first parting"),
    tuple(
        (
            "yes" if c.caught else "NO",
            c.bug,
            f"{c.size:.1e}",
            f"{c.threshold:.1e}",
            c.where,
            c.report.first_parting().summary() if c.caught else "–",
        )
        for c in caught
    ),
    right=frozenset({2, 3}),
)

# %% tags=["hide-input"]
plots.bf16_rounding.bf16_stages({"cifar8": ties["cifar8"]}, {"cifar8": caught})
plt.show()

# %% [markdown]
# Every blue point, a row of the real bf16 chain, sits below its limit; every red one, the row where
# a planted bug first parts from the VJP walking backward, far above its own. The stage holding the
# bug is the one that parts: the stages above it are handed the right cotangent, the stages below it
# a wrong one, at which they are still right.
#
# ## Beyond the suite: how far the bf16 gradient sits from the f32 one
#
# ```{admonition} Beyond the suite
# :class: attention
# A description of the bf16 gradient at real rounding, not a statement of the suite.
# ```
#
# The stage-by-stage verdict is needed because the whole bf16 gradient is not close to the f32 gradient at
# such a point, nor to itself: rounding to 8 bits flips ReLU masks, and BatchNorm over few cells
# spreads each flip. How many of cifar8's ReLU inputs change sign between the bf16 and the f32
# forward?

# %% tags=["nbval-check-output", "hide-input"]
net8, cfg8, params8, x8, _ = points["cifar8"]
flipped, total = bf16.relu_flips(net8, params8, x8, cfg8)
print(f"cifar8: some ReLU masks differ between the bf16 and f32 forward: {flipped > 0}")
assert flipped > 0

# %% tags=["hide-input"]
print(
    f"cifar8: {flipped:,} of {total:,} ReLU inputs change sign ({flipped / total:.2%})"
)

# %% [markdown]
# Each flipped mask moves a whole entry of a cotangent between 0 and its value. We measure each
# node's distance to the f32 node by its largest entry, next to the f32 chain's own spread when
# every weight and pixel moves by a relative 2⁻⁸ (bf16's unit roundoff; two random nudges). This is
# a description, not a verdict: a node returned as all zeros sits at distance 1 of itself, and here
# most of the correct nodes sit more than 1 % away.

# %% tags=["nbval-check-output", "hide-input"]
distance = {}
for name, (net, cfg, params, x, t) in points.items():
    g16, dx16 = chains[name].grads, chains[name].dx
    distance[name] = bf16.f32_distance(
        Point.of(net, params, x, t, cfg, key=jax.random.fold_in(key, 2)),
        bf16_grads=(g16, dx16),
    )
    rel = np.median([r.rel for r in distance[name] if not r.zero_in_reals])
    print(
        f"{name}: median |bf16 − f32| / max|f32| over the nodes"
        f" {'above' if rel > 0.01 else 'below'} 1 %"
    )
    assert rel > 0.01

# %% tags=["hide-input"]
for name, rows in distance.items():
    ratios = np.array([r.ratio for r in rows])
    rel = np.array([r.rel for r in rows])
    spread = np.median([r.envelope for r in rows])
    print(
        f"{name}: |bf16 − f32| / max|f32| median {np.median(rel):.2f}, max"
        f" {rel.max():.2f}; over the 2⁻⁸ spread median {np.median(ratios):.2f}, max"
        f" {ratios.max():.2f}; the spread itself median {spread:.2f} of the node"
    )
    assert 0.1 <= np.median(ratios) <= 10
    if name == "resnet34" and p.image_size == 32:
        assert spread > 0.1

# %% [markdown]
# The bf16 nodes sit about as far from the f32 nodes as a 2⁻⁸ nudge of the f32 chain moves them,
# often a good fraction of the node itself (the medians above). ResNet-34 at 32 px is the extreme:
# its layer 4 works on 1×1 maps, each of those BatchNorms normalises over only N cells per channel,
# and the nudge alone moves its nodes by a large fraction of their size. At such a point no bf16 chain can be
# close to the f32 gradient, and no verdict can be read off the distance; the stage-by-stage tie above
# is what the bf16 chain can be held to. The cpu and gpu profiles use larger images.

# %% tags=["hide-input"]
plots.bf16_rounding.bf16_f32_distance(distance)
plt.show()

# %% [markdown]
# ## What a compiler does to a cast round-trip (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# What a compiler keeps of a rounding is no statement of the suite.
# ```
#
# ```{admonition} What XLA does to a cast round-trip, and why bf16-typed operands
# :class: dropdown
# A rounding written as a cast round-trip, `x.astype(bf16).astype(f32)`, is a pair of `convert`
# ops, and a compiler allowed to keep excess precision may delete the pair: XLA's GPU backend does
# (its `SimplifyFPConversions` pass, on by default through `xla_allow_excess_precision`), as
# upstream measured, so there such a "rounding" does not round. XLA's CPU backend keeps the pair.
# We compile the round-trip on the backend this notebook runs on, count the converts in the
# optimized HLO and check whether the compiled function rounds.
#
# That is why real bf16 needs bf16-typed operands with float32 accumulation: the conv reads the
# bf16 values themselves, with no convert back for a compiler to fold. The program as written says
# so on every backend — `convolution(bf16, bf16) -> f32` — and the optimized HLO keeps bf16
# values. (This CPU backend then widens the rounded operands to run an f32 convolution: the
# rounding has already happened. The result's single rounding, a convert pair after the float32
# accumulator, is kept here too; it is the one place a GPU compiler could still erase, which the
# node identity (the previous chapter) and the bound above would catch. `round_bf16`, integer arithmetic on the bits,
# leaves nothing to fold: the "nearest" rounding of `Config.bf16_rounding`.)
# ```

# %% tags=["nbval-check-output", "hide-input"]
backend = jax.default_backend()
probe = points["cifar8"][3]
cast = bf16.hlo_cast_roundtrip(probe)
nearest = bf16.hlo_nearest(probe)
typed = bf16.hlo_typed_kind(probe, points["cifar8"][2]["conv1.weight"])
print(cast.summary())
print(nearest.summary())
print(typed.summary())
assert typed.written == ("bf16", "bf16", "f32") and typed.compiled_bf16 > 0
assert nearest.converts == [] and nearest.rounds
if backend == "cpu":
    assert cast.pair_kept and cast.rounds

# %% [markdown]
# The optimized HLO itself is the backend's own text; here are its `convert` and `convolution`
# lines on this machine's backend.

# %% tags=["hide-input", "hide-output"]
print(f"backend: {backend}")
for facts in (cast.text, typed.text):
    print("\n".join(line.strip()[:160] for line in facts.splitlines()
                    if " convert(" in line or " convolution(" in line))
    print()

# %% [markdown]
# ## The chains people train with: execution policies (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# Execution policies are the book's; the suite's node ties read its bf16 nodes at the identity
# rounding.
# ```
#
# ```{admonition} The policies, and what each is checked against
# :class: dropdown
# The same rendered chain runs under an execution policy (`gradtie.policy`), chosen by name:
# `tie` (float64 or float32, every contraction at HIGHEST: every other tie in this book), `tf32`
# (float32, contractions at default precision: TF32 tensor cores on a GPU) and `bf16` (bf16
# activations, cotangents and convolutions whose bf16 result comes from the contraction itself,
# float32 accumulation and one rounding, which is the kind above with `rnd` the bf16 rounding;
# BatchNorm statistics, x̂, the parameter nodes, the head and the loss in float32). The policy
# named by this chapter's `policy` parameter is tied here on cifar8: `bf16` stage by stage at the
# chain's own rounding decisions, as the kinds above, with every conv site checked against
# rnd(f32 node at rounded operands); `tf32` within the envelope measured where it runs (a CPU has
# no TF32 units, so float32's here). Every rounding the program names is kept: the checks compile
# with excess precision off, since by default XLA may compute a bf16 value in float32 and drop the
# rounding. The control is a catalogue bug planted in the same chain under the same policy.
# ```

# %% tags=["nbval-check-output", "hide-input"]
net, cfg8, params8, x8, t8 = points["cifar8"]
pcfg = dataclasses.replace(cfg8, bf16=False, policy=p.policy)
tied = policies.check(net, params8, x8, t8, pcfg, label_smoothing=0.1, key=key)
planted = policies.check(net, params8, x8, t8, pcfg, label_smoothing=0.1, key=key,
                         chain=bugs.plant("bn_unbiased_variance_backward", net, pcfg))
for label, rep in (
    ("cifar8", tied),
    ("cifar8 + bn_unbiased_variance_backward", planted),
):
    rows = rep.rows
    line = (
        f"{label} under policy {p.policy}: {sum(r.ok for r in rows)}/{len(rows)} stage"
        " rows within their limits"
    )
    if hasattr(rep, "sites"):
        line += (
            f"; {sum(r.equal for r in rep.sites)}/{len(rep.sites)} conv nodes = rnd(f32"
            " node at rounded operands)"
        )
    print(line + ("" if rep.ok else " -> FAILED"))
assert tied.ok and not tied.ill_conditioned and not planted.ok
assert not hasattr(tied, "sites") or all(r.equal for r in tied.sites)

# %% [markdown]
# ## What this chapter showed
#
# All of it is beyond the suite, whose bf16 node ties read the bf16 nodes at the identity rounding
# (`Bf16Erasure`, the previous chapter). At real bf16 rounding every conv node of both nets stays
# under the bound B(n) relative to the magnitude sum of its products, with room to spare, and a
# forward accumulating in bf16 breaks it (the first figure). Every stage of the bf16 chain — its
# nodes and the cotangent it hands on — is the VJP of that stage at the input, cotangent and
# rounding decisions the chain hands it, to within the point's envelope, and every catalogue bug
# planted in the bf16 chain, a wrong cotangent included, parts from it at its own stage (the
# second figure). The whole bf16 gradient sits as far from the f32 one as a 2⁻⁸ nudge moves it (the
# third). A bf16 rounding meant to survive a compiler is written as bf16-typed operands or as
# integer arithmetic, never as a cast round-trip. The bf16 execution policy people train with is
# the same chain and is tied the same way, every conv site the suite's kind; a bug planted under it
# parts.
