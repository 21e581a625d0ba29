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
# # Head fold
#
# Both nets end in a loss: the mean over the batch of the cross-entropy against label-smoothed
# soft targets, t̃ = (1−α)t + α/K. This chapter shows, numerically, these statements of the Lean
# suite:
#
# - **the six-op head fold** of `r34_net_tiedB` (module `ResNet34StepTieB`): the loss cotangent at
#   the logits z [N,K] is not written as one formula in the render (`ResNet34RenderB`); it is folded
#   from six kit ops, α baked at 0.1, the target a graph input that mixup or cutmix may make soft.
#   The head fold is stated at that smoothed cotangent, not at softmax − oneHot. "The six-op head
#   fold" is our name: the statement that proves it is `smoothedLossCotGraph_row`
#   (`Foundation/SmoothedLossCot`), for any N, K, α and divisor B, with the hypotheses 0 < K and
#   each target row summing to 1; `r34_lossCot_is_smoothedCE_grad` reads it at ResNet-34's logits:
#
#   | step | op (Lean) | computes |
#   |---|---|---|
#   | 1 | `softmaxRow` | p = softmax(z), row by row, the row maximum subtracted |
#   | 2 | `subB` | d0 = p − t |
#   | 3 | `scaleB` | a = α·t |
#   | 4 | `addVB` | d1 = d0 + a |
#   | 5 | `shiftB` | d2 = d1 − α/K |
#   | 6 | `divConstB` | dy = d2 / B (the render's B = N) |
#
# - **`cifar8Bbn_net_lossGrad_CE`**: `cifar8Bbn_net_lossGrad` holds for any loss of the logits with
#   gradient g at them; `_CE` instantiates it at the smoothed cross-entropy, at the artifacts' own
#   cotangent (cifar8's runs use α = 0, the plain cross-entropy). The step-tie module documents
#   the six-op fold for ResNet-34's render only; the book computes cifar8's cotangent with the same six kit ops, and
#   what this chapter shows of it is that the result is ∂/∂z of the smoothed cross-entropy.
# - **`r34HeadBHasVJP`**, ResNet-34's head (global average pool, then one dense layer): the one
#   place in that net whose certified backward comes with **no hypothesis at all**, since both maps
#   are linear and taken example by example.
#
# So dy = (p − (1−α)t − α/K)/B = (p − t̃)/B, and at the render's divisor B = N, (p − t̃)/N. We show
# that this fold, at B = N, IS ∂/∂z of the mean smoothed
# cross-entropy — under one assumption, that every row of t sums to 1 — for hard and soft (mixup,
# cutmix) targets, with α = 0 and α = 0.1, at batch sizes where 1/N is not a binary fraction; that
# three planted bugs in the fold go red; and that the GAP and dense layer tie at any point, ties
# among their features included. **Beyond the suite**: where the smoothed loss bottoms out (its
# minimum H(t̃), and upstream's quoted plateau), and the hypothesis shown failing on rows that do
# not sum to 1.
#
# Nothing here depends on the net's weights: the fold reads logits and targets only, and the GAP
# and dense ties run at random weights.
#
# The first cell turns on float64.

# %% tags=["hide-input"]
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

jax.config.update("jax_enable_x64", True)

from gradtie import book, data, prng
from gradtie.book import pages, plots
from gradtie.checks import head as head_checks
from gradtie import tolerances
from gradtie.ops import head

# %% tags=["parameters"]
num_classes: int = 10  # K of the fold cases (the smoothed minimum is stated at K 10)
seed: int = 0

# %% tags=["hide-input"]
p = book.validated(num_classes=num_classes, seed=seed)
key = jax.random.key(p.seed)
labels3 = prng.randint(jax.random.fold_in(key, 0), (3,), 0, p.num_classes)
z3 = 2.0 * prng.normal(jax.random.fold_in(key, 1), (3, p.num_classes), jnp.float64)
t3 = head.one_hot(labels3, p.num_classes, jnp.float64)

# %% [markdown]
# ## The six kit ops, step by step
#
# A batch of N = 3 examples with one-hot targets and α = 0.1: each line below is one kit op applied
# to the line above it (example 0's row). Read the label's column: `subB` takes 1 away, `scaleB`
# and `addVB` give α back, `shiftB` takes α/K from every class; the label's entry ends at
# p − (1 − α + α/K), every other entry at p − α/K. `divConstB` divides by N = 3 — a true division,
# because 1/3 has no exact binary representation: multiplying by a rounded 1/N instead would move
# some entries by an ulp, and the render's lemma is about division.

# %% tags=["nbval-check-output", "hide-input"]
steps = head_checks.fold_steps(z3, t3, 0.1)
display(pages.fold_steps(steps))
print(
    f"entries where d2/N ≠ d2·(1/N): {steps.inexact_divisions} of {steps.n * steps.k}"
)

# %%
plots.head_fold.fold_row(steps)
plt.show()

# %% [markdown]
# ## The fold is the gradient
#
# The oracle is independent of the fold: `gradtie.reference` writes the loss as users write it,
# mean_n −Σ_k t̃·log_softmax(z), and `jax.grad` differentiates it. Differentiating by hand,
# ∂/∂z_j of −Σ_k t̃_k log p_k is p_j·Σ_k t̃_k − t̃_j, and Σ_k t̃_k = (1−α)Σ_k t_k + α = 1 exactly
# when Σ_k t_k = 1: that is the fold's one hypothesis. We tie the fold to the oracle for α ∈ {0,
# 0.1}, N ∈ {3, 6} (neither a power of two) and three kinds of target: one-hot rows, and the soft
# rows mixup and cutmix make from them (`gradtie.data`, on a photo batch). Mixup's rows are
# λ·t + (1−λ)·t[π], cutmix's use the exact kept-area fraction as λ: both are convex combinations of
# rows summing to 1, so they sum to 1. The limit is the float64 node-vs-autodiff tolerance
# (`tolerances.REL_F64`); the fold's six roundings should leave it within a few units of float64's
# round-off, far below.

# %%
cases = head_checks.fold_cases(key, num_classes=p.num_classes)
# what every figure below is glued with (`book.At`): the point it was computed at
# (logits, no net)
at_fold = book.At(
    "logits",
    batch=(3, 6),
    classes=p.num_classes,
    alpha=(0.0, 0.1),
    data="one-hot, mixup, cutmix targets",
    dtype="float64",
)
display(pages.tie(cases))
row_sums = {
    kind: head.row_sum_error(data.batch_targets(kind, 6, p.num_classes, key))
    for kind in data.TARGET_KINDS
}

# %% tags=["nbval-check-output", "hide-input"]
print(book.glue("fold_tied", cases.summary(), at=at_fold))
print(
    f"worst relative error at most 1e-14, float64's unit roundoff ({2.0 ** -53:.1e})"
    f" times 90: {cases.worst().rel <= 1e-14}; limit tolerances.REL_F64 ="
    f" {tolerances.REL_F64:.0e}"
)
print(
    "rows sum to 1 within 1e-15:",
    {kind: err <= 1e-15 for kind, err in row_sums.items()},
)
assert cases.ok and cases.worst().rel <= 1e-14
assert all(err <= 1e-15 for err in row_sums.values())

# %% tags=["hide-input"]
# the measured error is the machine's round-off (its exp and sums), so nbval does not
# compare it
print(f"worst relative error {cases.worst().rel:.0e}")

# %% [markdown]
# The hypothesis is not decoration. Rows that do not sum to 1 — here one-hot rows scaled by 1.2 —
# break the tie: the oracle's p·Σt̃ − t̃ is no longer p − t̃. `head.cotangent` therefore refuses
# such targets with an error that says why, instead of returning a wrong cotangent.

# %% tags=["nbval-check-output", "hide-input"]
unnormalised = head_checks.tie_fold(z3, 1.2 * t3, 0.1, label="rows summing to 1.2")
print(f"{unnormalised.name}: tied {unnormalised.ok}")
print(head_checks.refusal(z3, 1.2 * t3, 0.1))
assert not unnormalised.ok
assert "sum to 1" in head_checks.refusal(z3, 1.2 * t3, 0.1)

# %% [markdown]
# ## α = 0 is plain cross-entropy
#
# With α = 0, `scaleB` produces exact zeros and `addVB`, `shiftB` add and subtract exact zeros, so
# d2 is d0 bit for bit and dy = (p − t)/N: the plain cross-entropy cotangent. We tie it to autodiff
# of plain cross-entropy written with integer labels, −mean_n log p[n, label_n], which never forms
# a target row.

# %% tags=["nbval-check-output", "hide-input"]
steps0 = head_checks.fold_steps(z3, t3, 0.0)
plain = head_checks.tie_plain(z3, labels3)
print(
    f"α = 0: a is all zero {bool(np.all(steps0.a == 0))}; d2 equals d0 bit for bit"
    f" {bool(np.array_equal(steps0.d2, steps0.d0))}; tied to plain cross-entropy"
    f" {plain.ok}"
)
assert (
    np.all(steps0.a == 0)
    and np.array_equal(steps0.d1, steps0.d0)
    and np.array_equal(steps0.d2, steps0.d0)
)
assert plain.ok

# %% [markdown]
# ## Planted bugs go red
#
# Three ways to get the fold wrong, each a function in `gradtie.checks.head` named for what it
# breaks: `smoothing_wrong_k` shifts by α/N (K read off the wrong axis), `drop_batch_divisor`
# returns d2 (the gradient of the batch SUM), `smoothing_twice` feeds the already smoothed t̃ into
# the fold. Each must fail the same tie the fold passes. We run them at α = 0.1 and N = 6 ≠ K:
# at α = 0 the two smoothing bugs are invisible, and at N = K so is the wrong axis — a control is
# only as good as the point it runs at.

# %%
z6 = 3.0 * prng.normal(jax.random.fold_in(key, 2), (6, p.num_classes), jnp.float64)
t6 = data.batch_targets("mixup", 6, p.num_classes, jax.random.fold_in(key, 3))
controls = head_checks.control_cases(z6, t6, 0.1)
pages.tie(controls)

# %% tags=["nbval-check-output", "hide-input"]
fold, planted = controls.rows[0], controls.rows[1:]
red = [r.name for r in planted if not r.ok]
print(
    book.glue(
        "fold_controls",
        f"the fold tied at rel err ≤ {fold.limit:.0e}; {len(red)}/{len(planted)}"
        f" planted controls red: {', '.join(red)}",
        at=book.At(
            "logits",
            batch=6,
            classes=p.num_classes,
            alpha=0.1,
            data="mixup targets",
            dtype="float64",
        ),
    )
)
assert fold.ok and len(red) == len(planted), (
    "head-fold controls: expected the fold tied and every control red, got"
    f" {controls.summary()}"
)

# %%
plots.head_fold.fold_ties(
    {"case": cases, "α=0.1 N=6 mixup": controls}, tolerances.REL_F64
)
plt.show()

# %% [markdown]
# ## Where the smoothed loss bottoms out (beyond the suite)
#
# ```{admonition} Beyond the suite
# :class: attention
# The suite states the cotangent, not where the loss it is the gradient of bottoms out.
# ```
#
# The smoothed loss of one example is a cross-entropy, so it splits as
# −Σ t̃ log p = H(t̃) + KL(t̃ ‖ p) ≥ H(t̃), with equality exactly when p = t̃, i.e. z = log t̃ + c.
# For a one-hot target with K = 10 and α = 0.1, t̃ puts 1 − α + α/K on the label and α/K on each
# other class, so the minimum is
#
# H(t̃) = −(1 − α + α/K)·ln(1 − α + α/K) − (K − 1)·(α/K)·ln(α/K),
#
# the label's term plus the other nine classes' terms, reached at the logit margin
# m* = ln((1 − α + α/K)/(α/K)). The cell below computes both terms, their sum and m*. A model
# trained with α = 0.1 on separable data should see its training loss flatten at H(t̃): the
# optimum, not a stall. The upstream book prints ≈ 0.485 for this plateau; no logits reach it.

# %% tags=["nbval-check-output", "hide-input"]
terms = head_checks.entropy_terms(10, 0.1)
print(
    f"K = {terms.num_classes}, α = {terms.alpha:g}: t̃ = {terms.label_share:.2f} on the"
    f" label, {terms.other_share:.2f} on each other class"
)
print(
    book.glue(
        "smoothed_minimum",
        f"H(t̃) = {terms.label_term:.4f} (label) + {terms.others_term:.4f} (the other "
        f"{terms.num_classes - 1}) = {terms.total:.4f} nats, at the margin m* = ln "
        f"{terms.label_share / terms.other_share:.0f} = {terms.best_margin:.2f}",
        at=book.At(
            "logits", classes=10, alpha=0.1, data="one-hot target", dtype="float64"
        ),
    )
)
assert abs(terms.label_share - 0.91) <= 1e-12 and abs(terms.other_share - 0.01) <= 1e-12
assert (
    abs(terms.label_term - 0.0858) <= 5e-5 and abs(terms.others_term - 0.4145) <= 5e-5
)
assert (
    abs(terms.total - 0.5003) <= 5e-5
    and abs(terms.total - head_checks.smoothed_entropy(10, 0.1)) <= 1e-15
)
assert abs(terms.best_margin - 4.51) <= 5e-3

# %% [markdown]
# We find the minimum three more ways: the loss at z = log t̃, plain gradient descent from z = 0
# along the fold's own cotangent, and the lowest loss along the margin (for the figure).

# %%
curve = head_checks.margin_curve(10, 0.1)

# %% tags=["nbval-check-output", "hide-input"]
print(
    f"H(t̃) = {curve.entropy:.4f} nats; loss at z = log t̃: {curve.at_log_target:.4f};"
    f" after descent along the fold: {curve.descent:.4f}; lowest on the margin grid:"
    f" {curve.minimum:.4f}"
)
print(
    f"best margin {curve.best_margin:.2f}; upstream's 0.485 lies"
    f" {curve.entropy - 0.485:.4f} nats below the minimum"
)
assert (
    curve.ok
    and abs(curve.entropy - terms.total) <= 1e-15
    and abs(curve.best_margin - terms.best_margin) <= 1e-12
)
assert 0.485 < curve.entropy - 0.01

# %%
plots.head_fold.smoothed_minimum(curve)
plt.show()

# %% [markdown]
# ## The rest of the head needs no hypothesis: `r34HeadBHasVJP`
#
# ResNet-34's head is a global average pool and one dense layer, and `r34HeadBHasVJP` certifies its
# backward globally: no smooth-point clause at all. (cifar8's head flattens into three dense layers
# with ReLUs between them; their kinks are clauses of its hypotheses, chapter Pools.) The GAP and
# the dense layer themselves are linear: `gapBack` spreads dg[n,c]/(H·W) over the H×W cells,
# `rowDenseBackFlat` is dy @ W, the dense nodes are dyᵀ @ x and Σ_n dy. A linear map is its own
# derivative everywhere, so there is no point where they could fail — not even where features tie.
# We tie each to `jax.vjp` of its forward at random inputs whose GAP features hold many exact ties
# (channels constant at small integers, one example repeated), and plant one bug: a GAP backward
# that forgets the 1/(H·W).

# %%
linear = head_checks.linear_head_cases(jax.random.fold_in(key, 4))
linear_bug = head_checks.linear_head_cases(
    jax.random.fold_in(key, 4), gap_backward=head_checks.gap_without_area
)
pages.tie(linear)

# %% tags=["nbval-check-output", "hide-input"]
print(
    book.glue(
        "head_linear",
        f"{linear.summary()}; {linear.meta['feature_ties']} tied feature pairs",
        at=book.At(
            "GAP + dense head",
            data="random inputs with tied GAP features",
            dtype="float64",
        ),
    )
)
print(f"gap_without_area: {linear_bug.summary()}")
assert linear.ok and linear.meta["feature_ties"] > 0
assert not linear_bug.rows[0].ok and all(r.ok for r in linear_bug.rows[1:])

# %%
plots.head_fold.fold_ties(
    {"GAP + dense": linear, "gap_without_area": linear_bug},
    tolerances.REL_F64,
    title=(
        "GAP and dense tie to autodiff at tied features; the planted GAP bug goes red"
    ),
)
plt.show()

# %% [markdown]
# ## What this chapter showed
#
# | what holds | statement | shown in |
# |---|---|---|
# | the six kit ops fold to (p − t̃)/N, the gradient at the logits of the mean smoothed cross-entropy, for one-hot, mixup and cutmix targets, α ∈ {0, 0.1}, N ∈ {3, 6} | the head fold of `r34_net_tiedB` (its lemma in `Foundation/SmoothedLossCot`); `cifar8Bbn_net_lossGrad_CE` | [§ The fold is the gradient](#the-fold-is-the-gradient): every case tied to autodiff of the loss written apart, at float64's round-off |
# | the fold's one hypothesis, rows summing to 1, is needed: scaled rows break the tie, and `head.cotangent` refuses them | the same | the same section |
# | at α = 0 the fold is the plain cross-entropy cotangent bit for bit | the same, at α = 0 | [§ α = 0 is plain cross-entropy](#α--0-is-plain-cross-entropy) |
# | three planted fold bugs go red at the point where each can show | controls | [§ Planted bugs go red](#planted-bugs-go-red) and its figure |
# | GAP and the dense layer tie anywhere, tied features included; a GAP backward without 1/(H·W) goes red | `r34HeadBHasVJP` (no hypothesis) | [§ The rest of the head](#the-rest-of-the-head-needs-no-hypothesis-r34headbhasvjp) and its figure |
#
# Beyond the suite: the smoothed loss cannot fall below H(t̃), {glue:text}`smoothed_minimum`; a run
# trained with α = 0.1 that flattens there has reached the optimum, not a stall.
