"""bf16 erasure, one module per claim: `kinds` (erasure at identity, Lean `Bf16Erasure`; what a
compiler keeps), `sites` (every conv site of a chain is rnd(f32 node at rounded operands), under
the bound B(n)), `gradient` (every stage ties to its VJP; `gradtie check --bf16`; the catalogue
under bf16), `replicas` (`SyncBf16`). Exact values need float64. Shown in: bf16 erasure.
"""

from .gradient import catalogue, check, f32_distance, relu_flips, stage_ties  # noqa: F401
from .kinds import (OP_LABELS, OPS, U_BF16, Site, case_erasure, case_ulps, chain_erasure, convert_ops,  # noqa: F401
                    drop_bias_forward, forward_bf16_accumulation, forward_result_only, grad_weight_rounded_per_example,
                    hlo_cast_roundtrip, hlo_nearest, hlo_typed_kind, kind_cases, same_bits, same_padding_forward,
                    ulps_apart)
from .replicas import mesh_replica_sum, replica_rows  # noqa: F401
from .sites import (accumulation_bound, case_row, contraction_length, conv_sites, node_bound,  # noqa: F401
                    same_computation, site_rows)
