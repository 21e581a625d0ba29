"""bf16 erasure: the bf16 conv kinds against their f32 peers, the exact values, SPEC §7's bound and
the whole bf16 gradient, one module per claim:

- `kinds`: a kind is rnd(op(rnd(a), rnd(b))) with float32 accumulation; at rnd = identity it is its
  f32 peer bit for bit, per kind and along both nets' whole chains (Lean: `Bf16Erasure`);
- `sites`: with bf16 rounding every conv site of a net is rnd(f32 node at rounded operands), and its
  error against the exact value stays under SPEC §7's bound (beyond the suite for the forward and
  input-backward sites: its bf16 switch, `ConvWTiedBAt bf16` / `convWeightGradBBf16`, is on the conv
  weight-gradient nodes);
- `gradient`: every node of the bf16 chain against the VJP of its own stage at the chain's own
  activations, within the point's measured envelope; a node zeroed, sign-flipped or scaled by 1.01
  fails (controls); and, beyond the suite and without a verdict, how far it sits from the f32 chain;
- `replicas`: the all-reduced bf16 weight gradient is (1/R)·Σ_r rnd(S_r) (Lean: `SyncBf16`);
- `hlo`: what a compiler keeps of a cast round-trip and of the bf16-typed kind;
- `controls`: planted kinds, each breaking one claim;
- `report`: `check`, what `gradtie check --bf16` prints.

Functions return reports and print nothing. Exact values need float64 (`jax_enable_x64`). Shown in:
bf16 erasure.
"""

from .controls import (drop_bias_forward, forward_bf16_accumulation, forward_result_only,
                       grad_weight_rounded_per_example, same_padding_forward)
from .gradient import (CONTROLS, F32DistanceRow, GradientRow, controls, f32_distance, gradient_rows,
                       node_floors, relu_flips)
from .hlo import HloFacts, KindProgram, convert_ops, hlo_cast_roundtrip, hlo_nearest, hlo_typed_kind
from .kinds import (OP_LABELS, OPS, QUICK, U_BF16, U_F32, ErasureReport, KindCase, _chain, apply,  # noqa: F401
                    case_erasure, chain_erasure, kind_cases, rounded_node, same_bits)
from .replicas import ReplicaRow, replica_difference, replica_rows, replica_sum
from .report import Bf16Report, check, rounding_name
from .sites import (Site, SiteRow, accumulation_bound, case_row, contraction_length, conv_sites, node_bound,
                    runs_as_product, same_computation, site_row, site_rows)

__all__ = [
    "Bf16Report", "CONTROLS", "ErasureReport", "F32DistanceRow", "GradientRow", "HloFacts", "KindCase",
    "KindProgram", "OPS", "OP_LABELS", "QUICK", "ReplicaRow", "Site", "SiteRow", "U_BF16", "U_F32",
    "accumulation_bound", "apply", "case_erasure", "case_row", "chain_erasure", "check", "contraction_length",
    "controls", "conv_sites", "convert_ops", "drop_bias_forward", "f32_distance", "forward_bf16_accumulation",
    "forward_result_only", "grad_weight_rounded_per_example", "gradient_rows", "hlo_cast_roundtrip",
    "hlo_nearest", "hlo_typed_kind", "kind_cases", "node_bound", "node_floors", "relu_flips",
    "replica_difference", "replica_rows", "replica_sum", "rounded_node", "rounding_name", "runs_as_product", "same_bits",
    "same_computation", "same_padding_forward", "site_row", "site_rows",
]
