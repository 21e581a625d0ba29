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
# as well as the weight gradient, strided peers included — and we bound the rounding error against
# exact values, measure how far the bf16 gradient sits from the f32 one, and look at what a
# compiler keeps. Everything else stays float32: BatchNorm, ReLU, pools, residual adds, GAP, the
# dense head and the loss. A bf16 {term}`kind` takes a rounding function `rnd`, rounds both operands
# with it, accumulates the products in float32 and rounds the result once:
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
#   computes, bit for bit, for each of the six kinds and along both nets' whole rendered chains;
# - **rounding**: with bf16 round-to-nearest-even the node is rnd(f32 node at rounded operands),
#   the suite's `den_convWeightGradBBf16_eq_rnd` for the weight gradient (any `rnd`); that the
#   nets' kinds compute it at every conv site is our check, beyond the suite;
# - **the bound** (beyond the suite): each output's error against the exact value, relative to the
#   magnitude sum Σ|a|·|b| of its products, stays under the mixed-precision bound B(n) at its
#   contraction length n;
# - **the whole gradient, stage by stage, at real rounding** (beyond the suite: `ConvWTiedBAt bf16`
#   is read at the identity rounding): every stage of the bf16 chain — its nodes and the cotangent
#   it hands on — is the VJP of that stage at the input and cotangent the chain hands it, and every
#   catalogue bug planted in the bf16 chain parts from it;
# - the replica sum (`SyncBf16`: its exact formula; the 2u·M bound on it is ours, beyond the
#   suite), and a compiler that is allowed to delete casts (beyond the suite).
# ```
#
# Exact values are float64, so the first cell turns it on; the bf16 chains themselves run in
# float32.

# %% tags=["hide-input"]
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book, prng
from gradtie.book import pages, plots
from gradtie.checks import bf16, bugs, policies
from gradtie.data import images
from gradtie.checks.tie import Chain, Point, targets_matrix
from gradtie.nets import cifar8, protocol, resnet34
from gradtie.nets.layers import rounding
from gradtie.ops import conv

# %% tags=["parameters", "hide-input"]
batch: int = 4       # examples per batch (both nets)
image_size: int = 32  # ResNet-34's input side (cifar8 always reads 32×32)
data: str = "photos"  # photos, flat or randn
seed: int = 0
replicas: int = 2    # shards of the batch for the replica sum (must divide batch)
policy: str = "bf16"  # the fast execution policy tied in its own section: bf16 or tf32

# %% tags=["hide-input"]
p = book.validated(
    batch=batch,
    image_size=image_size,
    data=data,
    seed=seed,
    replicas=replicas,
    policy=policy,
)
key = jax.random.key(p.seed)
nets = {
    "cifar8": (cifar8.NET, cifar8.Config(bf16=True), 32),
    "resnet34": (
        resnet34.NET,
        resnet34.Config(num_classes=10, bf16=True),
        p.image_size,
    ),
}
points = {}
for name, (net, cfg, size) in nets.items():
    params = net.init(key, cfg, weights="drawn")  # float32
    x = images(p.data, p.batch, size, seed=p.seed).astype(jnp.float32)
    labels = prng.randint(jax.random.fold_in(key, 1), (p.batch,), 0, cfg.num_classes)
    points[name] = (
        net,
        cfg,
        params,
        x,
        targets_matrix(labels, cfg.num_classes, jnp.float32),
    )
    gammas = np.concatenate([
        np.asarray(v)
        for k, v in params.items()
        if v.ndim == 1 and k.endswith("weight") and not k.startswith("fc")
    ])
    print(
        f"{name}: {p.data} {tuple(x.shape)}, {len(params)} parameter tensors, drawn"
        f" weights (γ in [{gammas.min():.2f}, {gammas.max():.2f}]), bf16 rounding"
        f" {cfg.bf16_rounding!r} (bf16-typed operands, float32 accumulation)"
    )
    assert not np.any(gammas == 1)
# what every figure below is glued with (`book.At`): the points it was computed at
at_nets = tuple(
    book.At(
        name,
        image_size=size,
        batch=p.batch,
        classes=cfg.num_classes,
        data=p.data,
        dtype="float32, bf16 kinds",
        weights="drawn",
        extra={"widths": list(resnet34.WIDTHS)} if name == "resnet34" else None,
    )
    for name, (_, cfg, size) in nets.items()
)

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
# bf16 kernels. There the identity holds to the bound of the next section.
#
# ```{admonition} How every conv call of a chain is read
# :class: dropdown
# Every conv call of a rendered chain is read in one run: `bf16.conv_sites` hands the chain a
# recording kit (`gradtie.kit.recording`), and each conv call of the kit carries its layer's name,
# so every site comes with its operands, stride and node, named `conv3` or `layer2.0.downsample.0`.
# ```

# %% tags=["nbval-check-output", "hide-input"]
sites, site_rows, chains = {}, {}, {}
for name, (net, cfg, params, x, t) in points.items():
    sites[name], chains[name], _ = bf16.conv_sites(Chain(net), params, x, t, cfg)
    site_rows[name] = bf16.site_rows(sites[name], rounding(cfg))
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
plots.bf16_erasure.bf16_bound(site_rows, controls=[acc])
plt.show()

# %% [markdown]
# ## The whole gradient, stage by stage (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# These ties run the bf16 chain at real rounding. The suite's bf16 node tie (`ConvWTiedBAt bf16`) is
# read at the identity rounding, where the erasure above makes it the f32 node; at real rounding
# the node ties below are ours.
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
plots.bf16_erasure.bf16_stages({"cifar8": ties["cifar8"]}, {"cifar8": caught})
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
plots.bf16_erasure.bf16_f32_distance(distance)
plt.show()

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
# node identity and the bound above would catch. `round_bf16`, integer arithmetic on the bits,
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
# At `rnd = identity` every bf16 kind, and both nets' whole chains, are their f32 peers bit for
# bit: the kinds add rounding and nothing else (`Bf16Erasure`), so the suite's bf16 nodes, read at
# the identity rounding, are the f32 ones. Beyond the suite, at real rounding: every conv node of
# both nets is rnd(f32 node at rounded operands), and its error against the exact value stays under
# the bound B(n) relative to the magnitude sum of its products, with room to spare; every stage of
# the bf16 chain — its nodes and the cotangent it hands on — is the VJP of that stage at the input,
# cotangent and rounding decisions the chain hands it, to within the point's envelope, and every
# catalogue bug planted in the bf16 chain, a wrong cotangent included, parts from it at its own
# stage; the whole bf16 gradient sits as far from the f32 one as a 2⁻⁸ nudge moves it. The
# all-reduced bf16 weight gradient is the mean of rounded replica nodes, off from the rounded sum by
# exactly `SyncBf16`'s formula, by nothing at identity, and (our bound, beyond the suite) by at most
# 2u·M; and a bf16 rounding meant to survive a compiler is written as bf16-typed operands or as
# integer arithmetic, never as a cast round-trip. The bf16 execution policy people train with is the
# same chain and is tied the same way, every conv site the suite's kind; a bug planted under it
# parts.
