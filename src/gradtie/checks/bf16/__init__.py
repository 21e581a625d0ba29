"""bf16 erasure: the bf16 conv kinds against their f32 peers, the exact values, SPEC §7's bound and
the bf16 chain stage by stage, one module per claim:

- `kinds`: a kind is rnd(op(rnd(a), rnd(b))) with float32 accumulation; at rnd = identity it is its
  f32 peer bit for bit, per kind and along a whole chain (Lean: `Bf16Erasure`); planted kinds;
- `sites`: with bf16 rounding every conv site of a chain is rnd(f32 node at rounded operands), and
  its error against the exact value stays under SPEC §7's bound (beyond the suite for the forward
  and input-backward sites: its bf16 switch, `ConvWTiedBAt bf16`, is on the weight-gradient nodes);
- `gradient`: every stage of the bf16 chain against its own VJP at the chain's input, cotangent and
  rounding decisions, within the point's envelope (a cotangent bug parts at its stage); and, beyond
  the suite and without a verdict, how far the bf16 gradient sits from the f32 one;
- `replicas`: the all-reduced bf16 weight gradient is (1/R)·Σ_r rnd(S_r) (Lean: `SyncBf16`);
- `hlo`: what a compiler keeps of a cast round-trip and of the bf16-typed kind;
- `report`: `check`, what `gradtie check --bf16` reports, and `catalogue`, the catalogue under bf16.

Functions return reports and print nothing. Exact values need float64 (`jax_enable_x64`). Shown in:
bf16 erasure.
"""

from .gradient import F32DistanceRow, f32_distance, relu_flips, stage_ties
from .hlo import HloFacts, KindProgram, convert_ops, hlo_cast_roundtrip, hlo_nearest, hlo_typed_kind
from .kinds import (CONTROLS, OP_LABELS, OPS, U_BF16, U_F32, ErasureReport, KindCase, case_erasure, chain_erasure,
                    drop_bias_forward, forward_bf16_accumulation, forward_result_only, grad_weight_rounded_per_example,
                    kind_cases, rounded_node, same_bits, same_padding_forward)
from .replicas import ReplicaReport, ReplicaRow, mesh_replica_sum, replica_rows
from .report import Bf16Caught, Bf16Report, catalogue, check
from .sites import (Site, SiteRow, accumulation_bound, case_row, contraction_length, conv_sites, node_bound, run,
                    runs_as_product, same_computation, site_row, site_rows)

__all__ = [
    "Bf16Caught", "Bf16Report", "CONTROLS", "ErasureReport", "F32DistanceRow", "HloFacts", "KindCase", "KindProgram",
    "OPS", "OP_LABELS", "ReplicaReport", "ReplicaRow", "Site", "SiteRow", "U_BF16", "U_F32", "accumulation_bound",
    "case_erasure", "case_row", "catalogue", "chain_erasure", "check", "contraction_length", "conv_sites",
    "convert_ops", "drop_bias_forward", "f32_distance", "forward_bf16_accumulation", "forward_result_only",
    "grad_weight_rounded_per_example", "hlo_cast_roundtrip", "hlo_nearest", "hlo_typed_kind", "kind_cases",
    "mesh_replica_sum", "node_bound", "relu_flips", "replica_rows",
    "rounded_node", "run", "runs_as_product", "same_bits", "same_computation", "same_padding_forward", "site_row",
    "site_rows", "stage_ties",
]
