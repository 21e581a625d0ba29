"""Every tolerance the tie kit uses, named, with where it comes from.

A verdict's limit is never one fixed number: it is a stated multiple of the round-off envelope
measured at the point itself (`checks.envelope`), floored at a fixed figure. The sections below the
tie kit's hold each claim's own constants.
"""

# ---- the tie: rendered node vs autodiff node (checks/envelope.py, checks/tie.py) ------------------

# The float64 figure, the floor of every float64 limit: rendered and autodiff round at
# ~1.1e-16 per op; a well-conditioned point keeps chains of a few hundred ops many orders below it.
REL_F64 = 1e-10
# The floor of a float32 limit, relative to the node's scale: float32's unit roundoff 6e-8 times
# the ~100 roundings a node's longest sum carries.
F32_FLOOR = 1e-5
FLOORS = {"float64": REL_F64, "float32": F32_FLOOR}

# Unit roundoff of each dtype: the size of the nudges that measure a point's envelope.
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24}
# The envelope of a node is the largest distance from the float64 reference over a few correct
# evaluations at the point's own round-off: the oracle with the batch in reverse order (a second
# evaluation order of every batch sum) and at inputs and parameters nudged by one unit roundoff
# (ENVELOPE_NUDGES draws), run in the checked dtype. Measured on both nets (photos, flat images,
# the M = 2 ResNet-34 point; float64 and float32): a correct rendered node sits at most 1.75
# envelopes from the reference (median 0.5–1.0).
ENVELOPE_NUDGES = 2
# The limit is this many envelopes: 5.7× headroom over the worst correct node measured, while the
# planted bugs of the catalogue sit far out (`gradtie check --plant-bug list`).
ENVELOPE_FACTOR = 10.0
# A node whose limit reaches this fraction of its own scale cannot tell a 1 % bug from round-off:
# the point is too ill-conditioned to judge it, and the check says so (exit code 2) rather than pass.
ILL_CONDITIONED_REL = 1e-2
# The float32 view uses the same multiple and draws (the names the training appendix's lockstep
# bound reads).
F32_ENVELOPE_FACTOR = ENVELOPE_FACTOR
F32_DRAWS = ENVELOPE_NUDGES + 1

# Nodes that are 0 in ℝ (a conv bias behind BatchNorm, or an oracle node that is exactly 0) carry
# only round-off: their scale is ZERO_NODE_SCALE × the net's largest gradient, never 1.0. Their
# value is a Σ over the M = N·H·W cells of a BN input cotangent that cancels to 0, so its round-off
# grows with M (cifar8's conv1.bias at a photo batch of 4, M = 4,096: 3e-15·max|g| on each side);
# A fixed 1e-5·max|g|, sits below float64's own round-off of such a sum.
ZERO_NODE_SCALE = 1.0

# ---- finite differences (checks/fd.py) ------------------------------------------------------------

# Central differences along a unit direction start at this step: truncation O(h²) and round-off
# O(ε_L/h) both near 1e-8 relative in float64.
FD_STEP = 1e-4
# A step whose ends leave the point's smooth piece is halved, never below this: there the round-off
# ε_L/h (2e-8 at |L| ≈ 2) nears the floor below. A step still outside is no evidence (a kink).
FD_MIN_STEP = 1e-8
# The finite-difference envelope is the truncation seen between h and h/2 (Richardson: the error
# of D(h) is 4/3·|D(h) − D(h/2)|) plus the round-off 2·ε_L/h, ε_L the spread of the loss over the
# envelope's evaluations. The limit is FD_FACTOR of it, floored at FD_REL of the node's scale; a
# row whose limit reaches ILL_CONDITIONED_REL is reported as no evidence, never as a pass.
FD_FACTOR = 10.0
FD_REL = 1e-6
# The scale of a directional derivative: the larger of |fd|, |⟨g, v⟩| and this fraction of the
# largest node norm (a direction nearly orthogonal to its node is not judged on noise).
ZERO_NODE_FLOOR = 1e-5

# A function the checker cannot see inside (`check_vjp`) shows its smooth piece through its outputs
# (`fd.SampledPiece`): at every output entry, central differences converge at second order and
# one-sided slopes agree at third order between h and h/2. A smooth entry keeps each ratio to
# O(h²) of the terms compared; this fraction of them is allowed (a kink near the point halves the
# differences instead of quartering them, or keeps its slope jump at every step: 7/9 of the terms
# off) ...
PIECE_SCALING_REL = 0.25
# ... plus this many times the entry's round-off carried through the differences (the entry's
# spread over the point's correct evaluations, bounded term by term): the few nudges may see less
# than the worst rounding.
PIECE_NOISE_FACTOR = 4.0
# An entry's round-off is its largest move over this many copies of the point with every entry one
# ulp up or down (the rounding of a moved point's entries), and over as many pairs a± of copies,
# every entry moved by a relative ±PIECE_NOISE_NUDGE·ξ, as (Y(a⁺) + Y(a⁻))/2 − Y(a): each
# rounding inside f re-rolls (8,192 ulps in float64, as GERM_ROUNDOFF_NUDGE; 8 in float32, where
# more would carry a point within 1e-6 of a kink across it), the first-order change cancels and
# the second order (the nudge squared) stays under the unit roundoff.
PIECE_NOISE_DRAWS = 4
PIECE_NOISE_NUDGE = {"float64": 2.0 ** -40, "float32": 2.0 ** -21}
# `check_vjp`'s central differences start at this step along a direction as long as the largest
# argument, and halve down to the smallest: in float64 the round-off ε_L/h at 1e-9 is still ~1e-7
# of L; in float32 (unit roundoff 6e-8) steps below 1e-5 measure round-off alone.
VJP_FD_STEP = {"float64": 1e-3, "float32": 3e-2}
VJP_FD_MIN_STEP = {"float64": 1e-9, "float32": 1e-5}

# ---- census (checks/census.py): twins, rerouting, one-sided slopes --------------------------------
# Two cells are twins when they agree under the actual weights (relative to the maximum) and under
# every fresh draw of the upstream weights (relative to the channel's largest |z|) within this.
# Measured (flat images, drawn weights, both nets, float64 and float32): twins stay bit-equal under
# every draw (spread 0), while cells tied at the planted point that are not twins part by ≥ 9.7e-4 of
# the channel's scale; the limit sits between, a decade or more below the smallest parting.
TWIN_REL = {"float64": 1e-9, "float32": 1e-4}
# Rerouting a twin-tied window's cotangent to the other twin changes only the order of float sums in
# the parameter nodes. Measured (cifar8, flat images, drawn weights, batch 2 and 4, 2 seeds): twin
# reroutes move a node by ≤ 4.6e-15 of its scale (200× under this), non-twin reroutes by ≥ 0.79.
ROUTE_REL = 1e-12
# One-sided slopes take their step h at this fraction of the first-order radius to the nearest kink
# that is not at the point itself, so [−2h, 2h] holds no other kink (as FD_RADIUS_FRACTION does).
RADIUS_FRACTION = 0.1
# The two one-sided second-order slopes carry O(h²·|L'''|) truncation and O(ε·|L|/h) round-off;
# measured at twin-tie points (cifar8, flat, drawn weights, batch 2 and 4, 2 seeds) they differ by
# ≤ 2.0e-7 of the larger slope (500× under this), at the planted non-twin tie by ≥ 0.43.
SLOPE_REL = 1e-4

# ---- Training with the rendered step (`train.side_by_side`) ----
# Rendered vs autodiff float32 runs in lockstep: their relative parameter distance must stay within
# this many times the envelope (the largest distance of rendered runs on one-ulp nudged inputs from
# the rendered run, step by step) — the same multiple the float32 view of a single gradient uses.
TRAIN_TRACK_FACTOR = F32_ENVELOPE_FACTOR
# Nudged runs the envelope is the maximum over (a few, as for the float32 view).
TRAIN_TRACK_DRAWS = F32_DRAWS
# Acceptance on digits within 8 epochs (Nesterov, lr 0.02, batch 64), test accuracy read with
# recomputed BN statistics: cifar8-BN and ResNet-34 at 32 px (issue 12).
TRAIN_DIGITS_ACCURACY = {"cifar8": 0.97, "resnet34": 0.95}
# Shorter runs (the book's ci profile, three epochs) must still clearly learn: 9 in 10 digits.
TRAIN_SHORT_ACCURACY = 0.90
# The running statistics' lag shows: after epoch 1 (0.99^s ≥ 0.41 of them still from before the
# weights moved) they cost at least 10 points of test accuracy against recomputed ones.
TRAIN_LAG_GAP = 0.10
# Free float32 runs part at the first kink a difference of one ulp decides: after the Training
# chapter's side-by-side steps (88 in its ci profile, 100 in cpu and gpu) the rendered and autodiff
# runs are apart by more than round-off (1e-6) and less than the weights (1).
TRAIN_DRIFT_BAND = (1e-6, 1.0)

# ---- train step tie (checks/step.py) ----------------------------------------------------------------
# The rendered train step against optax on autodiff gradients, consecutive steps in float64: each
# updated tensor, momentum buffer, running statistic and the loss is held to max(STEP_TIE_FACTOR ×
# its envelope, REL_F64) (`tie.compare`). The envelope is the optax run's own spread when every
# gradient of it is another correct evaluation: the batch reversed, and STEP_TIE_NUDGES runs with
# weights and pixels nudged by one unit roundoff at every step. The same multiple and draws as a
# single gradient's tie. Measured (drawn weights, photos, 2 steps): ResNet-34 at 32 px, batch 4,
# heavy ball, worst correct row 0.0017 of its limit (layer4, M = 4, envelope-widened); cifar8,
# Nesterov, 0.0001. The controls reach ≥ 1e6 of theirs.
STEP_TIE_FACTOR = ENVELOPE_FACTOR
STEP_TIE_NUDGES = ENVELOPE_NUDGES

# ---- germ finite differences (checks/germs.py) --------------------------------------------------
# ε_L, the spread of one loss evaluation's round-off: the root mean square of
# (S(θ+δ) + S(θ−δ))/2 − S(θ) over this many random nudges δ of the walk's own weights (over √(3/2),
# the spread that combination adds up), each entry moved by a relative 2⁻⁴⁰: every rounding
# downstream re-rolls (thousands of ulps), the first-order change cancels between ±δ and the second
# order (~1e-23) sits far below round-off.
GERM_ROUNDOFF_DRAWS = 24
GERM_ROUNDOFF_NUDGE = 2.0 ** -40
# A central difference carries (e(h) − e(−h))/2h, spread ε_L/(√2·h). Six spreads would do for a
# Gaussian error (one step in 5e8; a sweep has ~40), but a float64 loss's error is a sum of a few
# dominant roundings with heavier tails: over 24 cifar8 walks (photos, drawn weights) the largest
# step reached 5.0 spreads. We allow 8.
GERM_ROUNDOFF_SIGMAS = 8.0
# A step is evidence when its allowance (truncation + round-off) pins ⟨g, v⟩ to 1 %: a node wrong
# by 1 % or more (the planted ×2 and ×0 are 100 %) then lies outside it.
GERM_EVIDENCE_REL = 1e-2
# Steps are judged only inside half the smooth radius: the radius is the margins' second-order
# model, and past an upstream kink a gap can close a little earlier than the model says.
GERM_KINK_FRACTION = 0.5
# The O(h²) window: judged steps where the predicted truncation |S'''|h²/6 beats the round-off
# allowance tenfold (round-off is then under a tenth of the error) …
GERM_WINDOW_MARGIN = 10.0
# … at least this many (two thirds of a decade at third-decade steps) for a slope fit,
GERM_MIN_WINDOW = 3
# where |error| / (|S'''|h²/6) lies within 1 ± this (round-off adds ≤ 1/10, the h⁴ term a few %,
# the rest headroom for round-off excursions) …
GERM_TRUNCATION_REL = 0.25
# … and the log-log slope is 2 within this (the same budget over ≥ two thirds of a decade).
GERM_SLOPE_TOL = 0.25
# A kink at t = 0 shows as a one-sided jump |right − left| that does not shrink with h: over these
# two decades a smooth S gives |S''|h + round-off/h, which changes ≥ 5× across the range, a kink
# the same jump at every step: max/min within this factor.
GERM_KINK_STEPS = (1e-8, 1e-6)
GERM_KINK_FLATNESS = 2.0
# δ found may come later than the margins predict (a ReLU crossing upstream bends the gaps), never
# earlier: within a decade of it (one step of the decade grid) …
GERM_PREDICTION_SPAN = 10.0
# … and "sharp" when within 5 % of it (the bracket resolves 2.3 %).
GERM_SHARP_REL = 0.05

# ---- bf16 (checks/bf16/) -------------------------------------------------------------------------
# How far the bf16 gradient sits from the f32 one (described, not judged): the f32 chain's spread when
# every weight and pixel moves by a relative 2⁻⁸ (bf16's unit roundoff), the largest over 2 draws.
BF16_F32_DISTANCE_NUDGE = 2.0 ** -8
BF16_F32_DISTANCE_DRAWS = 2

# ---- forward independence (the project's forward against `gradtie.reference_numpy`) ----------------
# An op (conv, BN, pool scatter) against the NumPy formula or direct loop: each float64 evaluation is
# within its proven first-order bound γ_n·Σ|a||b| (BN: the rounding count of `batchnorm_roundoff`)
# of the exact value, so two evaluations differ by at most twice it. Max pools round nothing: 0.
FORWARD_OP_EVALUATIONS = 2.0
# Net logits against the NumPy net: each side's round-off has standard deviation at most the
# propagated envelope (√n·ε·Σ|a||b| per sum, carried through the signed linearisation), so their
# difference has at most √2 of it; the limit is this many of those sds (a 5-sd excursion over a few
# dozen logits has Gaussian odds below 1e-5). Measured: the difference stays under 0.01 of the limit
# at 90 points (both nets and their variants, 3 seeds, batch 2, 3, 5, photos and flat images); a
# float64 evaluation sits within 0.03 envelopes of the 80-bit one.
FORWARD_NET_SIGMAS = 5.0

# ---- speed and memory (benchmarks/, the Performance appendix) -------------------------------------
# Issue 11's target: the rendered step takes at most this fraction of the autodiff step's time at
# every CPU configuration of benchmarks/ (medians of interleaved repeats in one process).
SPEED_RATIO_LIMIT = 0.95
# A chapter's gpu profile must fit one accelerator with room to spare: an H200 holds ~139 GiB; the
# abstract compile's footprint (arguments + outputs + temporaries) must stay under this.
GPU_FIT_GIB = 120.0
# Upstream's rendered/autodiff ratios (quoted as upstream's): data-bound and compute-bound.
UPSTREAM_RATIOS = {"data-bound": 1.04, "compute-bound (batch 256)": 1.42}

# ---- data parallel (gradtie/parallel.py, the Data-parallel tie chapter) ---------------------------
# The mesh step is tied to the single-device float64 oracle at R·N by the tie kit itself
# (ENVELOPE_FACTOR × the point's envelope, floored at REL_F64): it differs from one device only in
# the order of its sums, which is what the envelope's batch-reversed evaluation measures.
# Chan's combine: each replica's mean μ_r carries a few ulps of |μ| (u·|μ| per rounding through its
# sum); it enters σ² only through (μ_r − μ)², i.e. as 2(μ_r − μ)·δ_r ≲ 2σ·few·u|μ|, and the centred
# sums add a few u·σ². Relative to σ²: below CHAN_FACTOR·u·(1 + |μ|/σ).
CHAN_FACTOR = 4.0

# ---- the execution policies' stage ties (checks/policies.py) --------------------------------------

# A fast policy's envelope is measured with correct evaluations under the policy itself: autodiff of
# each stage's forward in the policy's dtypes and precision at the point, with the batch reversed,
# and at this many nudges of the policy's unit roundoff.
POLICY_NUDGES = 2
# The limit in envelopes: the float32 tie's multiple. Measured on both nets (photos and flat images,
# drawn weights, bf16 and tf32, seeds 0-2; tests/checks/test_policies.py): see that file for the
# worst correct row and the catalogue's smallest parting.
POLICY_ENVELOPE_FACTOR = ENVELOPE_FACTOR
