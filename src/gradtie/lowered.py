"""What the rendered step compiles to on a GPU, read on any machine.

`jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))` gives the StableHLO a CUDA backend
would compile, on a CPU machine with no GPU. `program` lowers a net's rendered step under an
execution policy (every conv site as XLA's convolution: what an accelerator runs) and reads off
every convolution and dot product (operand and result dtypes, precision, input dilation, the op
that defines its kernel) and the bytes of the saved record the backward reads. `violations` says
where the program departs from what its policy promises:

- `bf16`: every convolution `(bf16, bf16) -> bf16` at DEFAULT precision (a `(bf16, bf16) -> f32`
  convolution is upcast to a float32 one by XLA's GPU backend: no bf16 tensor cores), and every
  strided input-backward convolution reading its kernel straight from a `reverse` (the pattern
  XLA's GPU convolution rewriter turns into cuDNN's backward-data convolution);
- `tf32`: no contraction at HIGHEST (HIGHEST forces true float32 on the GPU: no TF32 units);
- `tie`: every contraction at HIGHEST (the checks' arithmetic).

Shown in: Performance.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Optional

import jax
import jax.numpy as jnp

from . import policy as policy_
from . import rendered
from .kit import KIT

_SSA = re.compile(r"^\s*(%[\w#.]+)(?::\d+)?\s*=\s*\"?([\w.]+)\"?")
_CONV = re.compile(r"stablehlo\.convolution\((%[\w#.]+), (%[\w#.]+)\)")
_TYPES = re.compile(r":\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")
# convolutions write `precision_config = [#stablehlo<precision HIGHEST>, …]`, dot products
# `precision = [HIGHEST, HIGHEST]`
_PRECISION = re.compile(r"precision(?:_config)?\s*=\s*\[([^\]]*)\]")
_LHS_DILATE = re.compile(r"lhs_dilate\s*=\s*\[(\d+),\s*(\d+)\]")
_DOT = re.compile(r"stablehlo\.dot_general")


def _dtype(tensor_type: str) -> str:
    return tensor_type.rsplit("x", 1)[-1]


def _precisions(line: str) -> tuple[str, ...]:
    m = _PRECISION.search(line)
    return tuple(re.findall(r"(DEFAULT|HIGH|HIGHEST)\b", m.group(1))) if m else ("DEFAULT",)


@dataclass(frozen=True)
class Contraction:
    """One convolution or dot product of a lowered program."""
    op: str                       # "convolution" or "dot_general"
    operands: tuple[str, str]     # dtypes as written: ("bf16", "bf16")
    result: str
    precision: tuple[str, ...]    # per operand; DEFAULT when the op names none
    lhs_dilation: int = 1         # > 1: a strided conv's input backward (the zeros between cotangents)
    kernel_from: str = ""         # the op defining the kernel operand ("stablehlo.reverse", …)

    def signature(self) -> str:
        return f"({self.operands[0]}, {self.operands[1]}) -> {self.result}"


def contractions(text: str) -> list[Contraction]:
    """Every convolution and dot product of a StableHLO module's text, in text order."""
    defined: dict[str, str] = {}
    out = []
    for line in text.splitlines():
        m = _SSA.match(line)
        if m:
            defined[m.group(1)] = m.group(2)
        conv_m = _CONV.search(line)
        if conv_m:
            types = _TYPES.search(line)
            dil = _LHS_DILATE.search(line)
            out.append(Contraction("convolution", (_dtype(types.group(1)), _dtype(types.group(2))),
                                   _dtype(types.group(3)), _precisions(line),
                                   int(dil.group(1)) if dil else 1, defined.get(conv_m.group(2), "")))
        elif _DOT.search(line):
            types = _TYPES.search(line)
            if types:
                out.append(Contraction("dot_general", (_dtype(types.group(1)), _dtype(types.group(2))),
                                       _dtype(types.group(3)), _precisions(line)))
    return out


@dataclass(frozen=True)
class Program:
    """A net's rendered step lowered for a platform under a policy."""
    net: str
    policy: str
    platform: str
    batch: int
    image_size: int
    contractions: tuple[Contraction, ...]
    saved_bytes: int              # the forward's saved record: what the backward reads back
    text: str

    @property
    def convolutions(self) -> list[Contraction]:
        return [c for c in self.contractions if c.op == "convolution"]

    def signatures(self) -> dict[str, int]:
        """How many convolutions have each (operand, operand) -> result signature."""
        out: dict[str, int] = {}
        for c in self.convolutions:
            out[c.signature()] = out.get(c.signature(), 0) + 1
        return out

    def summary(self) -> str:
        convs = self.convolutions
        highest = sum("HIGHEST" in c.precision for c in self.contractions)
        sigs = ", ".join(f"{n} × {s}" for s, n in self.signatures().items())
        return (f"{self.net} {self.image_size} px batch {self.batch}, policy {self.policy!r}, lowered for "
                f"{self.platform}: {len(convs)} convolutions ({sigs}); {highest} of {len(self.contractions)} "
                f"contractions at HIGHEST; saved record {self.saved_bytes / 2**20:.1f} MiB")


def program(net, cfg, *, batch: int = 8, image_size: Optional[int] = None, platform: str = "cuda",
            param_dtype=jnp.float32, kit=KIT) -> Program:
    """Lower the rendered step (loss and every node) of `net` at `cfg` for `platform` from shapes
    alone; every conv site as XLA's convolution (what an accelerator runs, whatever this machine is).
    kit: the ops the chain calls (a planted bug's, for a control)."""
    cfg = replace(cfg, conv_formulation="conv")
    size = image_size or net.default_size
    params = {s.name: jax.ShapeDtypeStruct(s.shape, param_dtype) for s in net.param_specs(cfg)}
    x = jax.ShapeDtypeStruct((batch, net.channels, size, size), param_dtype)
    t = jax.ShapeDtypeStruct((batch, cfg.num_classes), param_dtype)

    def step(p, a, targets):
        out = rendered.step(net, kit, p, a, targets, cfg)
        return out.loss, out.grads

    text = jax.jit(step).trace(params, x, t).lower(lowering_platforms=(platform,)).as_text()
    _, saved = jax.eval_shape(lambda p, a: net.forward(p, a, cfg), params, x)
    nbytes = sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(saved))
    return Program(net.name, cfg.policy, platform, batch, size, tuple(contractions(text)), nbytes, text)


def violations(p: Program) -> list[str]:
    """Where the program breaks its policy's promise (see the module docstring); empty: it keeps it."""
    pol = policy_.get(p.policy)
    out = []
    for i, c in enumerate(p.contractions):
        where = f"{c.op} #{i} {c.signature()}"
        if pol.precision == jax.lax.Precision.HIGHEST and any(q != "HIGHEST" for q in c.precision):
            out.append(f"{where} at {'/'.join(c.precision)}, not HIGHEST")
        if pol.precision != jax.lax.Precision.HIGHEST and "HIGHEST" in c.precision:
            out.append(f"{where} at HIGHEST under policy {pol.name!r}")
        if pol.activations == "bfloat16" and c.op == "convolution":
            if c.signature() != "(bf16, bf16) -> bf16":
                out.append(f"{where}: expected (bf16, bf16) -> bf16")
            if c.lhs_dilation > 1 and c.kernel_from != "stablehlo.reverse":
                out.append(f"{where}: strided input backward reads its kernel from {c.kernel_from or '?'}, "
                           f"not straight from a reverse")
    return out
