"""Execution policies: one rendered chain, run three ways.

The chain's code is the same under every policy; a policy is configuration (a net `Config`'s
`policy` field, by name) that says the dtype the activations and cotangents travel in between ops
and the precision of every contraction (convolutions and dense layers):

| policy | activations, cotangents, saved record | contractions                                  | for              |
|--------|---------------------------------------|-----------------------------------------------|------------------|
| `tie`  | the parameters' dtype (float64/32)    | `Precision.HIGHEST`: true float32 / float64   | every check      |
| `tf32` | float32                               | `Precision.DEFAULT`: TF32 tensor cores on GPUs | fast float32     |
| `bf16` | bfloat16                              | bf16 × bf16 → bf16 at `DEFAULT` (float32       | training speed   |
|        |                                       | accumulation inside the convolution, rounded  |                  |
|        |                                       | once: the suite's `rnd(conv(rnd(a), rnd(b)))`) |                  |

Under every policy the parameters, their gradient nodes, the BatchNorm statistics, x̂, the dense
head and the loss stay in the parameters' dtype (float32 for `bf16`): the ops compute BatchNorm in
at least float32 from bf16 inputs and round only what they hand on. What rounds where under `bf16`
beyond the conv sites (BatchNorm outputs, residual sums, the cotangents between ops) goes beyond
the Lean suite, whose bf16 statements are about the conv sites' kinds; the `tie` policy is what
the suite's statements are shown at. Shown in: bf16 erasure, Performance.

On a CPU `tf32` computes exactly what `tie` does in float32 (the CPU has no TF32 units); `bf16`
runs in bf16 there too, slower than float32 (a GPU win).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class Policy:
    """name; activations: the dtype activations and cotangents travel in (None: the parameters');
    precision: of every convolution and dense contraction; units: the arithmetic units a GPU runs
    its contractions on ("FP32", "TF32", "BF16": the peak its model FLOP utilisation is read
    against); unit_roundoff: of those contractions' operands (the size of a correct evaluation's
    nudges when a check measures this policy's envelope)."""
    name: str
    activations: Optional[str]
    precision: lax.Precision
    units: str
    unit_roundoff: float
    summary: str

    def activation_dtype(self, param_dtype) -> jnp.dtype:
        """The dtype the chain's activations travel in, for parameters of `param_dtype`."""
        return jnp.dtype(self.activations or param_dtype)


POLICIES: dict[str, Policy] = {
    "tie": Policy("tie", None, lax.Precision.HIGHEST, "FP32", 2.0 ** -24,
                  "the parameters' dtype throughout, every contraction at HIGHEST (what the checks tie)"),
    "tf32": Policy("tf32", None, lax.Precision.DEFAULT, "TF32", 2.0 ** -11,
                   "float32 throughout, contractions at DEFAULT precision (TF32 tensor cores on a GPU)"),
    "bf16": Policy("bf16", "bfloat16", lax.Precision.DEFAULT, "BF16", 2.0 ** -8,
                   "bf16 activations, cotangents and convolutions (float32 accumulation, one rounding); "
                   "float32 parameters, nodes, BatchNorm statistics, head and loss"),
}
NAMES = tuple(POLICIES)


def unit_roundoff_here(policy, backend: Optional[str] = None) -> float:
    """The unit roundoff the policy's contractions have on `backend` (default JAX's): its own on a
    GPU; on a CPU, which runs every float32 contraction in full float32 whatever the precision,
    float32's for the float32 policies (tf32 on a CPU is float32 arithmetic), bf16's for bf16."""
    import jax

    pol = get(policy)
    if (backend or jax.default_backend()) == "cpu" and pol.activations is None:
        return 2.0 ** -24
    return pol.unit_roundoff


def get(policy) -> Policy:
    """A policy by name (a `Policy` passes through); ValueError naming the choices."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"execution policy {policy!r}: expected one of {', '.join(map(repr, NAMES))}")
    return POLICIES[policy]
