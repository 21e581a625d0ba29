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
