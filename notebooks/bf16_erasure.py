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
# # bf16 erasure
#
# The Lean suite states its ResNet-34 and cifar8 train-step ties "on the renderers' bf16 switch": the
# conv **weight-gradient** nodes are the bf16 kinds (`convWeightGradBBf16`, Foundation.Bf16GradNodes),
# each node stated as `ConvWTiedBAt bf16` / `ConvStridedWTiedBAt bf16` (bf16 := false the f32 node,
# bf16 := true the bf16 one), read over ℝ at the identity rounding: **`Bf16Erasure`**, at the
# identity rounding the bf16 kind denotes what its f32 peer does. Under sharding, what the bf16
# weight-gradient kinds do is **`DataParallel.SyncBf16`**, which states the all-reduced node's
# difference from the rounded sum exactly, for any rounding `rnd`, and bounds nothing. That is the
# suite's scope: its node ties read the bf16 nodes at the identity rounding, while the kinds
# themselves are stated for any `rnd` (`den_convWeightGradBBf16_eq_rnd`: the node is rnd of the f32
# node at rounded operands) and `SyncBf16` holds at any `rnd`. Its float bridge bounds one rounding
# (`rndP_err`) and a mixed-precision conv forward at any leaf float model (`conv_close_mixed`), not
# instantiated at bf16 and not for these nodes. This chapter shows it numerically: erasure at
# identity, kind by kind and along both whole chains, so that the conv weight nodes on the bf16
# switch read the same derivative as the f32 ones (`cifar8Bbn_net_lossGrad`'s
# `convWAt_hasGradAt`); and `SyncBf16`'s formula on a replica split.
#
# The book's nets go further, and **everything marked "beyond the suite" below is ours, not a
# statement of the suite**: they can round every conv site — the forward conv and the input backward
# as well as the weight gradient, strided peers included (the next chapter, [bf16 at real
# rounding](bf16_rounding.ipynb), follows real rounding through the whole chain). Everything else
# stays float32: BatchNorm, ReLU, pools, residual adds, GAP, the dense head and the loss. A bf16
# {term}`kind` takes a rounding function `rnd`, rounds both operands with it, accumulates the
# products in float32 and rounds the result once:
#
# ```{admonition} The kind, and where the weight gradient's rounding sits
# :class: dropdown
#     kind(a, b) = rnd(op(rnd(a), rnd(b)))        op: the f32 conv node (`cInB`, `convWeightGradB`, …)
#
# For the weight gradient the single rounding sits outside the batch sum: the batch is part of the
# one float32 contraction. This chapter shows, on real photos, at **drawn weights** (BatchNorm
# γ ~ U(0.5, 1.5), β ~ N(0, 0.3²), biases ~ N(0, 0.1²): `net.init(key, cfg, weights="drawn")`, a point
# where a backward that mixes up γ, β or a bias cannot hide):
# ```
#
# ```{admonition} The chapter's sections, and which of them go beyond the suite
# :class: dropdown
# - **erasure** (`Bf16Erasure`): at `rnd = identity` the kind computes exactly what its f32 peer
#   computes, bit for bit, for each of the six kinds and along both nets' whole rendered chains,
#   and the real bf16-typed kernels sum the exact products within float32's bound;
# - **rounding**: with bf16 round-to-nearest-even the node is rnd(f32 node at rounded operands),
#   the suite's `den_convWeightGradBBf16_eq_rnd` for the weight gradient (any `rnd`); that the
#   nets' kinds compute it at every conv site is our check, beyond the suite;
# - the replica sum (`SyncBf16`: its exact formula; the 2u·M bound on it is ours, beyond the
#   suite).
# ```
#
# Exact values are float64, so the first cell turns it on; the bf16 chains themselves run in
# float32.

# %% tags=["hide-input"]
import jax
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book
from gradtie.book import bf16_points, pages, plots
from gradtie.checks import bf16
from gradtie.nets import protocol, resnet34
from gradtie.nets.layers import rounding
from gradtie.ops import conv

# %% tags=["parameters", "hide-input"]
batch: int = 4       # examples per batch (both nets)
image_size: int = 32  # ResNet-34's input side (cifar8 always reads 32×32)
data: str = "photos"  # photos, flat or randn
seed: int = 0
replicas: int = 2    # shards of the batch for the replica sum (must divide batch)

# %% tags=["hide-input"]
p = book.validated(
    batch=batch,
    image_size=image_size,
    data=data,
    seed=seed,
    replicas=replicas,
)
key = jax.random.key(p.seed)
# both nets on the bf16 switch at drawn weights; `at_nets`: what every figure below is
# glued with
setup = bf16_points.build(p, key)
nets, points, at_nets = setup.nets, setup.points, setup.at
print("\n".join(setup.lines))

# %% tags=["nbval-check-output", "hide-input"]
# ResNet-34's statements fix 224 px as a literal: a ResNet-34 figure at another side is
# the same architecture beyond them, and says so
print(
    protocol.resolution_note(resnet34.NET, p.image_size)
    or "resnet34 at the statements' own 224 px"
)

# %% [markdown]
# ## Erasure: six kinds at rnd = identity
#
# A kind adds rounding and nothing else: no reassociation, no dropped bias, no moved padding. So at
# `rnd = identity` it must return the f32 peer's bits exactly. We draw float32 operands for each
# kind (forward, input backward, weight grad at strides 1 and 2; an odd side of 9 exercises the
# strided backward's high padding) and compare bit patterns, −0 and +0 included. At the identity
# rounding this package's kinds run their f32 peer's own code, so this checks what a kind adds
# besides rounding (bias, padding, batch sums; the planted kinds below fail it); "Erasure with the
# bf16-typed kernels" runs the real bf16 kernels, where erasure itself could fail.

# %% tags=["nbval-check-output", "hide-input"]
cases = bf16.kind_cases(p.seed)
for c in cases:
    print(
        f"{c.name:20} n ="
        f" {bf16.contraction_length(c.op, c.a.shape, c.b.shape, c.kernel_size):4}:"
        f" identity kind == f32 peer bit for bit: {bf16.case_erasure(c)}"
    )
assert all(bf16.case_erasure(c) for c in cases)

# %% [markdown]
# The comparison is not blind. Three planted kinds, each adding one change besides rounding, fail
# it at identity: a forward that forgets the bias; a forward with XLA's `'SAME'` padding, which on
# a strided conv over an even side pads (0, 1) instead of (1, 1); and a weight gradient that sums
# the batch in float32 after each example's own contraction (what rounding inside the batch sum
# needs), which reassociates the sum.

# %% tags=["nbval-check-output", "hide-input"]
by_label = {c.name: c for c in cases}
even = {c.name: c for c in bf16.kind_cases(p.seed, size=8)}
f1, f2e, g1 = by_label["forward s1"], even["forward s2"], by_label["weight grad s1"]
planted_kinds = {
    "dropped bias": (f1, bf16.drop_bias_forward(f1)),
    "'SAME' padding, stride 2": (f2e, bf16.same_padding_forward(f2e)),
    "batch sum per example": (g1, bf16.grad_weight_rounded_per_example(g1)),
}
controls = {k: bf16.case_erasure(c, node) for k, (c, node) in planted_kinds.items()}
for label, erased in controls.items():
    print(f"control {label:26}: equals the f32 peer: {erased}")
assert not any(controls.values())
ulps = [(c.name, bf16.case_ulps(c), False) for c in cases]
ulps += [
    (f"control: {k}", bf16.case_ulps(c, node), True)
    for k, (c, node) in planted_kinds.items()
]
# the distance agrees with the verdict, row by row: 0 ulps exactly where the bits are
# the same
assert [u == 0 for _, u, _ in ulps] == [True] * len(cases) + [False] * len(
    planted_kinds
)

# %% tags=["hide-input"]
plots.bf16_erasure.kind_erasure(ulps)
plt.show()

# %% [markdown]
# ## Erasure along both whole chains
#
# `Config(bf16=True)` switches every conv site of a net to its kind; `bf16_rounding="identity"`
# makes every one of them erase. The whole rendered chain — forward, head cotangent, every stage's
# backward — must then be the f32 chain bit for bit: the loss, every parameter node and the input
# cotangent.

# %% tags=["nbval-check-output", "hide-input"]
erasure = {
    name: bf16.chain_erasure(net, params, x, t, cfg)
    for name, (net, cfg, params, x, t) in points.items()
}
for name, report in erasure.items():
    print(report.summary())
book.glue(
    "erasure_chains",
    (
        sum(erasure["cifar8"].equal),
        len(erasure["cifar8"].equal),
        sum(erasure["resnet34"].equal),
        len(erasure["resnet34"].equal),
    ),
    "at identity: cifar8 {}/{}, ResNet-34 {}/{} outputs bit for bit (loss, nodes,"
    " input)",
    at=at_nets,
)
assert all(report.ok for report in erasure.values())

# %% [markdown]
# ## Erasure with the bf16-typed kernels
#
# At `bf16_rounding="identity"` the kind runs the very code of its f32 peer (`rnd or identity`),
# so the two sections above could not have come out otherwise. `Bf16Erasure` is about the bf16
# kind: at the identity rounding it denotes what its f32 peer does. A rounding is the identity on
# values already exact in bf16, so we run the **real bf16-typed kernels** there: operands drawn,
# rounded to bf16, then typed `bfloat16` so the conv reads bf16 and accumulates in float32, exactly
# as the nets' `"bf16"` rounding does (`companions.typed_operands`).
#
# ```{admonition} What the typed kernel is compared with, and the control
# :class: dropdown
# What do we compare it with? Not the f32 peer: on this CPU backend XLA widens bf16-exact operands
# and runs the very float32 convolution the peer runs, so "equal to the peer bit for bit" would be
# one computation compared with itself. Over ℝ both the kind at the identity rounding and its f32
# peer denote the sum of the exact products of the operands. So we compute that sum apart: in NumPy,
# float64, windows read by index arithmetic over the symmetric zero padding
# (`companions.exact_conv`, which shares no code with the kit's convolutions or with XLA). Every
# product of two bf16 values is exact in float64, and the float64 sum errs by at most
# γ_n(2⁻⁵³)·Σ|a||b|. The typed kernel is a float32 sum of those same exact products, in some order,
# so it must lie within γ_n(2⁻²⁴)·Σ|a||b| of the exact sum (γ_n = n·u/(1 − n·u)): the bound we hold
# every output to, with the float64 term added. We run each of the six kinds in both formulations the
# kit has, XLA's convolution and patches · weights.
#
# The control: operands that are NOT bf16-exact (the draws themselves). The typed kernel's cast
# then rounds them and the exact sum does not, so it must land outside float32's accumulation
# bound, by the operand rounding, about 2⁻⁷ of Σ|a||b|.
# ```

# %% tags=["hide-input"]
from gradtie.book import companions

typed = companions.typed_erasure(companions.with_formulation(cases, "conv")
                                 + companions.with_formulation(cases, "patches"))

# %% tags=["nbval-check-output", "hide-input"]
rows = [("yes" if r.within_exact else "NO", r.name, r.formulation, str(r.n),
         "yes" if r.peer_exact_ratio <= 1 else "NO") for r in typed.erasure()]
rows += [("outside" if not r.within_exact else "INSIDE", "control: " + r.name,
          r.formulation, str(r.n), "–") for r in typed.controls()]
columns = ("within γ_n·Σ|a||b|", "site", "ran as", "n", "f32 peer within")
plots.bf16_erasure.typed_erasure(typed)
plt.show()
display(
    pages.folded(
        pages.Table(columns, tuple(rows), right=frozenset({3})),
        f"the {len(rows)} sites and controls, one row each",
    )
)
print(
    book.glue(
        "typed_erasure",
        (
            sum(r.within_exact for r in typed.erasure()),
            len(typed.erasure()),
            sum(not r.within_exact for r in typed.controls()),
            len(typed.controls()),
        ),
        "bf16-typed kernels at bf16-exact operands: {}/{} sites within float32's"
        " accumulation bound γ_n·Σ|a||b| of the exact sum of their products (NumPy,"
        " float64, computed apart); controls (operands not bf16-exact) outside it at"
        " {}/{}",
        at=book.At(
            "conv kinds (six, two formulations)",
            batch=2,
            data="standard normal draws",
            dtype="bfloat16 operands, float32 accumulation",
        ),
    )
)
assert typed.ok, f"typed_erasure: {typed.summary()}"

# %% [markdown]
# ```{admonition} Beyond the suite
# :class: attention
# The typed kernel against its f32 peer, which on this backend runs the same computation at the
# XLA-convolution sites: equal bit for bit there, as it must be, and at the patches · weights sites,
# where a product of bf16-typed operands is summed in its own order (a GPU's bf16 kernels do the same
# at every site), within 2·γ_n·Σ|a||b| of it: both are float32 sums of the same exact products. The
# table further below gives each site's largest difference over that bound. This bound is ours, not
# the suite's.
# ```

# %% tags=["nbval-check-output", "hide-input"]
conv_rows = [r for r in typed.erasure() if r.formulation == "conv"]
order_rows = [r for r in typed.erasure() if not r.equal]
print(
    "XLA-convolution sites equal to the f32 peer bit for bit:"
    f" {sum(r.equal and r.kind_equal for r in conv_rows)}/{len(conv_rows)}; sites"
    " summing in their own order: all within the order bound:"
    f" {all(r.within for r in order_rows)}"
)
if bf16.same_computation():  # the CPU: a kind and its f32 peer run the same sums
    assert all(r.equal and r.kind_equal for r in conv_rows), (
        "typed_erasure: XLA-convolution sites must equal the f32 peer bit for bit on"
        f" this backend, got {conv_rows}"
    )
else:
    print(
        "bit for bit not asserted on this backend: its bf16 kernels sum in their own"
        " order (bf16.same_computation()); the order bound below is"
    )
assert all(
    r.within for r in order_rows
), "typed_erasure: a site past 2·γ_n(2⁻²⁴)·Σ|a||b| of its f32 peer"

# %% [markdown]
# The measured numbers (they move with the backend's summation order; the verdicts above do not):
# outputs whose bits differ from the f32 peer, the largest difference over the order bound, and
# whether the typed kind rounded to bf16 still equals round_bf16 of the f32 peer.

# %% tags=["hide-input", "hide-output"]
print(
    f"{'site':30} {'ran as':8} {'n':>4} {'vs exact':>8} {'differing':>9}"
    f" {'over bound':>10}  rounded kind == rnd(peer)"
)
for r in typed.erasure():
    print(
        f"{r.name:30} {r.formulation:8} {r.n:4} {r.exact_ratio:8.2g} {r.differing:9}"
        f" {r.ratio:10.2g}  {r.kind_equal}"
    )
for r in typed.controls():
    print(f"control {r.name:22} {r.formulation:8} {r.n:4} {r.exact_ratio:8.2g}")

# %% [markdown]
# ## With bf16 rounding: node = rnd(f32 node at rounded operands)
#
# ```{admonition} Beyond the suite
# :class: attention
# Real bf16 rounding: the suite's node ties read its bf16 nodes at the identity rounding
# (`Bf16Erasure`). The identity below is the suite's own for the weight-gradient kind, at any
# rounding (`den_convWeightGradBBf16_eq_rnd`, a definitional equation); that the nets' kinds
# compute it, at every conv site, is our check.
# ```
#
# With real rounding the kind is not its f32 peer, but it is the f32 peer run on rounded operands
# and rounded once. The nets' default rounding keeps the operands bf16-typed, so the conv itself
# reads bf16 and accumulates into float32; the reference runs the f32 op on the same values held
# in float32 (products of two bf16 values are exact in float32) and rounds the result once. Where
# the two run the same sums in the same order — on a CPU, where XLA widens the rounded operands and
# runs the very f32 convolution the reference runs (see the HLO below) — we ask for equality of
# bits. Two kinds of site sum in their own order: those the op kit runs as a matrix product of
# patches and weights (XLA's CPU convolution is pathologically slow on ResNet-34's tiny deep grids,
# and a product of bf16-typed operands is not the f32 product), and every site on a GPU, which runs
# bf16 kernels. There the identity holds to the bound shown in the next chapter.
#
# ```{admonition} How every conv call of a chain is read
# :class: dropdown
# Every conv call of a rendered chain is read in one run: `bf16.conv_sites` hands the chain a
# recording kit (`gradtie.kit.recording`), and each conv call of the kit carries its layer's name,
# so every site comes with its operands, stride and node, named `conv3` or `layer2.0.downsample.0`.
# ```

# %% tags=["nbval-check-output", "hide-input"]
sites, site_rows, chains = bf16_points.conv_sites(points)
for name in points:
    same = [r for r in site_rows[name] if r.equal_required]
    per_op = ", ".join(
        f"{sum(s.op == op for s in sites[name])} {bf16.OP_LABELS[op]}"
        for op in bf16.OPS
    )
    print(
        f"{name}: {len(sites[name])} conv sites ({per_op}); where the kind and the"
        f" reference run the same sums, {sum(r.equal for r in same)}/{len(same)} equal"
        " rnd(f32 node at rounded operands)"
    )
    assert all(r.equal for r in same)
kinds_rounded = {c.name: bf16.case_row(c, conv.round_bf16).equal for c in cases}
print(f"six kinds with round_bf16: {sum(kinds_rounded.values())}/6 equal")
if bf16.same_computation():
    assert all(kinds_rounded.values()), f"six kinds with round_bf16: {kinds_rounded}"
else:
    print("not asserted on this backend: its bf16 kernels sum in their own order")

# %% [markdown]
# Two controls: a forward that rounds only its result, rnd(conv(x, W)), and a weight gradient that
# rounds inside the batch sum, Σ_n rnd(S_n). Neither is rnd(f32 node at rounded operands).

# %% tags=["nbval-check-output", "hide-input"]
wrong = {
    "result-only rounding": bf16.case_row(
        f1, conv.round_bf16, bf16.forward_result_only(f1)
    ),
    "rounding inside the batch sum": bf16.case_row(
        g1, conv.round_bf16, bf16.grad_weight_rounded_per_example(g1, conv.round_bf16)
    ),
}
for label, row in wrong.items():
    print(f"control {label:30}: equals rnd(f32 node at rounded operands): {row.equal}")
assert not any(row.equal for row in wrong.values())

# %% [markdown]
# ## The replica sum (`SyncBf16`)
#
# Under data parallelism each of R replicas runs the weight-gradient kind on its own shard (its
# loss divided by its own N, so its cotangent is R times its shard of the single-device one) and
# the all-reduce averages the rounded nodes in float32. With S_r the float32 contraction of replica
# r at rounded operands, the all-reduced gradient is
#
#     (1/R)·Σ_r rnd(S_r),   not   rnd(Σ_r S_r)/R,
#
# the difference being exactly (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)]: that formula is what `SyncBf16`
# states, and at `rnd = identity` it is 0.
#
# ```{admonition} Beyond the suite
# :class: attention
# A bound on the difference, and the rounding itself: R + 1 roundings, each moving a value by at most
# u of its size, so at most 2u·M. `SyncBf16` gives the difference exactly and no bound.
# ```
# We split the batch
# into explicit shards at every weight-gradient site of cifar8, run each replica's kind, and compute
# both sides in float64 (where R bf16 values and R float32 values add exactly).

# %% tags=["nbval-check-output", "hide-input"]
replica = bf16.replica_rows(
    sites["cifar8"], p.replicas, rounding(nets["cifar8"][1]), net="cifar8"
)
yes = {True: "yes", False: "NO"}
display(
    pages.Table(
        (
            "ok",
            "conv",
            "nodes = rnd(S_r)",
            "difference = formula",
            "nonzero",
            "≤ 2u·M",
            "0 at id",
        ),
        tuple(
            (
                yes[row.ok],
                row.name,
                yes[row.nodes_rounded],
                yes[
                    bool(
                        np.array_equal(
                            replica.arrays[row.name]["diff"],
                            replica.arrays[row.name]["formula"],
                        )
                    )
                ],
                yes[row.differing > 0],
                yes[row.max_diff_rel <= 2 * bf16.U_BF16],
                yes[row.identity_zero],
            )
            for row in replica.rows
        ),
    )
)
for row in replica.rows:
    d = replica.arrays[row.name]
    assert row.ok and np.array_equal(d["diff"], d["formula"]) and row.differing > 0

# %% tags=["hide-input", "hide-output"]
for row in replica.rows:
    print(f"{row.name}: R = {row.replicas}, entries differing {row.differing:.0%}, "
          f"max |difference| / M = {row.max_diff_rel:.2e} (2u = {2 * bf16.U_BF16:.2e})")

# %% tags=["hide-input"]
plots.bf16_erasure.bf16_replica(replica.arrays, p.replicas)
plt.show()

# %% [markdown]
# ## What this chapter showed
#
# At `rnd = identity` every bf16 kind, and both nets' whole chains, are their f32 peers bit for
# bit: the kinds add rounding and nothing else (`Bf16Erasure`; the first figure, where every planted
# kind lies many ulps away), so the suite's bf16 nodes, read at the identity rounding, are the f32
# ones, and the conv weight nodes on the bf16 switch read the same derivative as the f32 ones. The
# real bf16-typed kernels at bf16-exact operands sum the exact products within float32's own
# accumulation bound, and operands that are not bf16-exact land far outside it (the second figure).
# With real rounding the weight-gradient node is rnd(f32 node at rounded operands), the suite's
# `den_convWeightGradBBf16_eq_rnd`; that every conv site of both nets computes it is our check,
# beyond the suite. The all-reduced bf16 weight gradient is the mean of rounded replica nodes, off
# from the rounded sum by exactly `SyncBf16`'s formula and by nothing at identity (the histogram;
# the 2u·M bound on it is ours, beyond the suite).
#
# What happens at real rounding across the whole chain, beyond the suite, is the next chapter:
# [bf16 at real rounding](bf16_rounding.ipynb).
