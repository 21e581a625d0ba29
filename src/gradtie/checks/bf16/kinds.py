"""bf16 kinds and their erasure: a kind is its f32 peer plus rounding, and nothing else.

A bf16 kind computes rnd(op(rnd(a), rnd(b))) with float32 accumulation (`gradtie.ops.conv`, bf16
section). At rnd = identity it must be its f32 peer bit for bit, per kind (`case_erasure` on the six
`kind_cases`) and along both nets' whole rendered chains (`chain_erasure`). Lean: `Bf16Erasure`
(at the identity rounding the bf16 kind denotes what its f32 peer does). Shown in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...ops import conv
from ..tie import QUICK, rendered, targets_matrix

U_BF16 = 2.0 ** -8    # bf16 unit roundoff, round to nearest (8 significant bits)
U_F32 = 2.0 ** -24    # float32 unit roundoff

# The checks are compile-bound on CPU: LLVM optimisation off (tie.QUICK). It changes no IEEE result
# (no fast-math either way), and the site identity is checked across separately compiled programs.

OPS = ("forward", "backward", "grad_weight")
OP_LABELS = {"forward": "forward", "backward": "input backward", "grad_weight": "weight grad"}


def _need_x64(what: str) -> None:
    if not jax.config.jax_enable_x64:
        raise ValueError(f"{what} measures errors against float64 exact values: it needs "
                         f"jax_enable_x64 (jax.config.update('jax_enable_x64', True))")


# ---- one conv node: the f32 peer or the kind --------------------------------------------------

def apply(op: str, a, b, *, stride: int, kernel_size: int, out_shape, rnd=None, bias=None):
    """The conv op `op` of the kit at operands (a, b): forward (x, W), backward (dy, W), grad_weight
    (x, dy); `rnd` None is the f32 peer, else the bf16 kind."""
    if op == "forward":
        return conv.forward(a, b, bias, stride=stride, rnd=rnd)[0]
    if op == "backward":
        return conv.backward(b, a, input_shape=tuple(out_shape), stride=stride, rnd=rnd)
    if op == "grad_weight":
        return conv.grad_weight(a, b, kernel_size=kernel_size, stride=stride, rnd=rnd)
    raise ValueError(f"op {op!r}: expected one of {', '.join(OPS)}")


def _bits(a):
    """The bit patterns of a float array: equality of these is bit-for-bit equality (−0 ≠ +0)."""
    return lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[a.dtype.itemsize])


def _widen(a, dtype):
    return a.astype(dtype)  # bf16 → float32/float64 is exact


def rounded_node(op, a, b, *, stride, kernel_size, out_shape, rnd, bias=None):
    """rnd(f32 node at rounded operands) [+ bias]: the f32 peer run on rnd(a), rnd(b), rounded once."""
    dtype = a.dtype
    ra, rb = _widen(rnd(a), dtype), _widen(rnd(b), dtype)
    y = apply(op, ra, rb, stride=stride, kernel_size=kernel_size, out_shape=out_shape)
    y = _widen(rnd(y), dtype)
    return y if bias is None else y + bias[None, :, None, None]


# ---- the six kinds on random operands --------------------------------------------------------------

@dataclass(frozen=True)
class KindCase:
    """Operands of one conv kind: forward (x, W, b), input backward (dy, W), weight grad (x, dy)."""
    label: str
    op: str
    a: jax.Array
    b: jax.Array
    bias: Optional[jax.Array]
    stride: int
    kernel_size: int
    out_shape: tuple[int, ...]

    def node(self, rnd=None) -> jax.Array:
        """The f32 peer (rnd None) or the bf16 kind at these operands."""
        return apply(self.op, self.a, self.b, stride=self.stride, kernel_size=self.kernel_size,
                     out_shape=self.out_shape, rnd=rnd, bias=self.bias)


def kind_cases(seed: int = 0, *, n: int = 2, c: int = 8, o: int = 8, size: int = 9, k: int = 3,
               positive: bool = False) -> list[KindCase]:
    """The six kinds — forward, input backward, weight grad at strides 1 and 2 — on random float32
    operands (standard normal; |·| of it with `positive`). An odd `size` exercises the strided
    backward's high padding."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(np.abs(rng.standard_normal(shape)) if positive else rng.standard_normal(shape),
                                      jnp.float32)
    cases = []
    for s in (1, 2):
        h2 = conv.out_size(size, k, s)
        x, w, b, dy = draw(n, c, size, size), draw(o, c, k, k), draw(o), draw(n, o, h2, h2)
        cases += [KindCase(f"forward s{s}", "forward", x, w, b, s, k, (n, o, h2, h2)),
                  KindCase(f"input backward s{s}", "backward", dy, w, None, s, k, (n, c, size, size)),
                  KindCase(f"weight grad s{s}", "grad_weight", x, dy, None, s, k, (o, c, k, k))]
    return cases


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (shape, dtype and every bit: −0 ≠ +0)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def case_erasure(case: KindCase, node=None) -> bool:
    """The kind at rnd = identity (or a given node) against the f32 peer, bit for bit."""
    return same_bits(case.node(conv.identity) if node is None else node, case.node(None))


# ---- whole chains -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ErasureReport:
    net: str
    names: list[str]        # "loss", every parameter node, "input"
    equal: list[bool]

    name = "erasure at identity"

    @property
    def ok(self) -> bool:
        return all(self.equal)

    def summary(self) -> str:
        line = f"{self.net}: erasure at identity {sum(self.equal)}/{len(self.equal)} outputs bit for bit"
        bad = [n for n, e in zip(self.names, self.equal) if not e]
        return line + (f"; first differing: {bad[0]}" if bad else "")


_chain = jax.jit(rendered, static_argnums=(0, 4, 5), compiler_options=QUICK)  # (net, p, x, t, cfg, α)


def chain_erasure(net, params, x, targets, cfg, *, label_smoothing: float = 0.0) -> ErasureReport:
    """The rendered chain with every conv a bf16 kind at rnd = identity against the f32 chain:
    loss, every parameter node and the input cotangent, bit for bit."""
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    f32 = _chain(net, params, x, t, replace(cfg, bf16=False), label_smoothing)
    kind = _chain(net, params, x, t, replace(cfg, bf16=True, bf16_rounding="identity"), label_smoothing)
    names = ["loss", *params, "input"]
    equal = [same_bits(u, v) for u, v in zip([f32[0], *f32[1].values(), f32[2]], [kind[0], *kind[1].values(), kind[2]])]
    return ErasureReport(net.__name__.rsplit(".", 1)[-1], names, equal)

