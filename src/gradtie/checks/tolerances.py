"""Every tolerance the tie kit uses, named, with where it comes from."""

# float64 rendered node vs autodiff node: both sides round at ~1.1e-16 per op; chains of a few
# hundred ops stay many orders below this (SPEC §6).
REL_F64 = 1e-10

# Nodes that are 0 in ℝ (a conv bias behind BatchNorm) carry only round-off on both sides: their
# error is measured against a floor tied to the net's largest gradient, not against themselves.
# (Finite differences: the floor of the denominator, relative to the largest node norm.)
ZERO_NODE_FLOOR = 1e-5

# The tie's scale for a node that is 0 in ℝ: ZERO_NODE_SCALE × max|g| over every node of the net,
# held to the same REL_F64 as every other node. Its value is a Σ over the M = N·H·W cells of a BN
# input cotangent that cancels to 0, so its round-off grows with M: cifar8's conv1.bias at a photo
# batch of 4 (M = 4,096) carries 3e-15·max|g| on each side. SPEC §6's example scale, 1e-5·max|g|
# (an absolute 1e-15·max|g|), sits below float64's own round-off of such a sum.
ZERO_NODE_SCALE = 1.0

# Central finite differences in float64 along a unit direction: truncation O(h²) plus round-off
# O(ε_64·|L|/h); at h = 1e-4 both sit near 1e-8 relative.
FD_STEP = 1e-4
FD_REL = 1e-5
# A step shrunk to keep both ends in the point's smooth piece stops here: below it the
# round-off ε_64·|L|/h (2e-8 absolute at |L| ≈ 2) nears FD_REL of a derivative of 1e-3.
FD_MIN_STEP = 1e-8

# float32 node vs the float64 reference: within this many times the perturbation envelope (the
# spread of the float64 gradient when the input moves by a relative 1e-7, float32's resolution),
# never tighter than the floor relative to the node's scale.
F32_ENVELOPE_FACTOR = 10.0
F32_NUDGE = 1e-7
F32_FLOOR = 1e-5
# The envelope is the largest spread over this many independent nudges (a few, per SPEC §6).
F32_DRAWS = 3

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
# Free float32 runs part at the first kink a difference of one ulp decides: after 100 steps the
# rendered and autodiff runs are apart by more than round-off (1e-6) and less than the weights (1).
TRAIN_DRIFT_BAND = (1e-6, 1.0)

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

# ---- bf16 gradient verdict (checks/bf16/gradient.py) ---------------------------------------------
# Each node of the bf16 chain is held to its op's float64 reference, at the cotangent the chain
# hands it, within this many times the point's envelope: the largest error of the same reference
# evaluated in float32. Measured at 8 points (cifar8 at batch 4 and 8, ResNet-34 at 32 px; photos,
# drawn weights): the chain's error reached 1.0 envelope, a node scaled by 1.01 18.6 or more. 2
# leaves a factor 2 on the one side and 9 on the other.
BF16_GRADIENT_FACTOR = 2.0
# The envelope's float32 evaluations: at the recorded arrays and at 2 copies nudged by 2⁻²⁴·ξ per
# entry (float32's own round-off).
BF16_GRADIENT_DRAWS = 3
BF16_GRADIENT_NUDGE = 2.0 ** -24
# A conv weight node is a bf16 kind's result: two float32 sums of the same products may round an
# entry one bf16 ulp apart (2⁻⁷ of it at most), so the envelope never goes below one entry off by that.
BF16_ONE_ULP = 2.0 ** -7
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
# Upstream's rendered/autodiff ratios (SPEC §10, quoted as upstream's): data-bound and compute-bound.
UPSTREAM_RATIOS = {"data-bound": 1.04, "compute-bound (batch 256)": 1.42}
