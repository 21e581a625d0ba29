"""What a compiler keeps: a cast round-trip's converts, and the bf16-typed kind as written and
compiled. (XLA's GPU backend may delete a convert(f32→bf16)→convert(bf16→f32) pair; the CPU
backend keeps it.) Beyond the suite. Shown in: bf16 erasure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ...ops import conv

_CONVERT = re.compile(r"=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+convert\(")


def convert_ops(hlo_text: str) -> list[str]:
    """The result dtype of every `convert` instruction in an HLO module's text (fusions included)."""
    return _CONVERT.findall(hlo_text)


@dataclass(frozen=True)
class HloFacts:
    what: str
    backend: str
    converts: list[str]     # result dtypes of the optimized HLO's converts, in text order
    rounds: bool            # the compiled function's output is x rounded to bf16 (and not x itself)
    text: str               # the optimized HLO (backend-specific: print it, never compare it)

    @property
    def pair_kept(self) -> bool:
        """A convert to bf16 and one back to float32 are both still there."""
        return "bf16" in self.converts and "f32" in self.converts

    def summary(self) -> str:
        return (f"{self.what}: {len(self.converts)} convert ops in the optimized HLO, convert pair kept: "
                f"{self.pair_kept}, output rounded to bf16: {self.rounds}")


def _facts(what: str, f, x) -> HloFacts:
    f = jax.jit(f)
    text = f.lower(x).compile().as_text()
    y, want = np.asarray(f(x)), np.asarray(conv.round_bf16(x))
    rounds = bool(np.array_equal(y, want) and not np.array_equal(y, np.asarray(x)))
    return HloFacts(what, jax.default_backend(), convert_ops(text), rounds, text)


def hlo_cast_roundtrip(x) -> HloFacts:
    """x.astype(bf16).astype(f32) under jit: does the optimized HLO keep the convert pair, and does
    the compiled function round? (CPU: kept, it rounds; upstream measured XLA GPU deleting it.)"""
    return _facts("cast round-trip f32→bf16→f32", lambda a: a.astype(jnp.bfloat16).astype(a.dtype), x)


def hlo_nearest(x) -> HloFacts:
    """conv.round_bf16 under jit: integer ops on the bits, no convert for a compiler to fold."""
    return _facts("round_bf16 (integer ops)", conv.round_bf16, x)


_STABLEHLO_CONV = re.compile(r"stablehlo\.convolution.*:\s*\(tensor<[^>]*x(\w+)>,\s*tensor<[^>]*x(\w+)>\)\s*->\s*tensor<[^>]*x(\w+)>")


@dataclass(frozen=True)
class KindProgram:
    """The bf16-typed forward kind as written (StableHLO, every backend alike) and as compiled."""
    operand_dtypes: tuple[str, str]   # the convolution's operands in the program as written
    result_dtype: str                 # its accumulator/result type
    compiled_bf16: int                # bf16-typed instructions in the optimized HLO
    compiled_converts: list[str]
    lowered: str
    compiled: str

    def summary(self) -> str:
        a, b = self.operand_dtypes
        return (f"bf16-typed kind as written: convolution({a}, {b}) -> {self.result_dtype}; "
                f"bf16 kept in the optimized HLO: {self.compiled_bf16 > 0}")


def hlo_typed_kind(x, weight) -> KindProgram:
    """The forward kind with bf16-typed operands: the conv reads bf16 and accumulates in float32."""
    f = jax.jit(lambda a, w: conv.forward(a, w, rnd=conv.bf16_operand)[0])
    lowered = f.lower(x, weight)
    written = lowered.as_text()
    m = _STABLEHLO_CONV.search(written)
    if m is None:
        raise RuntimeError("no stablehlo.convolution in the lowered bf16 kind")
    compiled = lowered.compile().as_text()
    bf16_instr = len(re.findall(r"=\s*bf16\[", compiled))
    return KindProgram((m.group(1), m.group(2)), m.group(3), bf16_instr, convert_ops(compiled), written, compiled)

