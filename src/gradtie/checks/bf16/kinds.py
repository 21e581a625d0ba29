"""bf16 kinds and their erasure: a kind is its f32 peer plus rounding, and nothing else.

A kind computes rnd(op(rnd(a), rnd(b))) with float32 accumulation (`gradtie.ops.conv`); at
rnd = identity it is its f32 peer bit for bit, per kind (`case_erasure`) and along a whole chain
(`chain_erasure`). Lean: `Bf16Erasure`. A `Site`, one conv call, carries the numbers every conv node
is measured by. Planted kinds each break one claim; beyond the suite, what a compiler keeps of a
rounding (`hlo_*`). Shown in: bf16 erasure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ... import rendered
from ...ops import conv
from ..tie import Chain, targets_matrix

U_BF16 = 2.0 ** -8    # bf16 unit roundoff, round to nearest (8 significant bits)
U_F32 = 2.0 ** -24    # float32 unit roundoff
OPS = ("forward", "backward", "grad_weight")
OP_LABELS = {"forward": "forward", "backward": "input backward", "grad_weight": "weight grad"}


def apply(op: str, a, b, *, stride: int, out_shape=None, rnd=None, bias=None, formulation=None):
    """The conv op `op` at operands (a, b): forward (x, W), backward (dy, W; out_shape: x's shape),
    grad_weight (x, dy; out_shape: W's shape, whose last axis is the kernel size); `rnd` None is
    the f32 peer, else the bf16 kind."""
    kw = dict(stride=stride, rnd=rnd, formulation=formulation)
    if op == "grad_weight" and (out_shape is None or len(out_shape) != 4):
        raise ValueError(f"grad_weight: out_shape must be the weight's [O, C, k, k], got {out_shape}")
    kernel_size = out_shape[-1] if op == "grad_weight" else b.shape[-1]
    if op == "forward":
        return conv.forward(a, b, bias, **kw)[0]
    if op == "backward":
        return conv.backward(b, a, input_shape=tuple(out_shape), **kw)
    if op == "grad_weight":
        return conv.grad_weight(a, b, kernel_size=kernel_size, **kw)
    raise ValueError(f"op {op!r}: expected one of {', '.join(OPS)}")


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (shape, dtype and every bit: −0 ≠ +0)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def ulps_apart(a, b) -> int:
    """The most units in the last place between two float arrays of one shape and dtype, entry by
    entry: 0 exactly when `same_bits` (−0 and +0 are one apart). Floats are ordered by their bits
    (sign-magnitude turned into one ordered integer line), so the count is exact, however large."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype.kind != "f":
        raise ValueError(f"ulps_apart: two float arrays of one shape and dtype, got {a.dtype}{a.shape} "
                         f"and {b.dtype}{b.shape}")
    if np.isnan(a).any() or np.isnan(b).any():
        raise ValueError("ulps_apart: NaN has no place on the line of floats")
    if a.size == 0:
        return 0
    signed = np.dtype(f"int{8 * a.dtype.itemsize}")

    def line(v):    # +0 -> 0, −0 -> −1, and on outwards
        i = v.view(signed).astype(object)
        return np.where(i >= 0, i, -(i & (2 ** (8 * a.dtype.itemsize - 1) - 1)) - 1)
    return int(np.max(np.abs(line(a) - line(b))))


@partial(jax.tree_util.register_dataclass, data_fields=["a", "b", "bias", "node"],
         meta_fields=["name", "op", "stride", "kernel_size", "formulation"])
@dataclass(frozen=True)
class Site:
    """One conv call: its operands, node and statics (a pytree whose statics stay static under jit).
    A chain's sites are read through a recording kit; a kind case's node is the f32 peer."""
    name: str            # the layer name the kit call carries ("conv3"), or a case's ("forward s2")
    op: str              # "forward", "backward", "grad_weight"
    a: jax.Array         # x (forward, weight grad) or dy (input backward)
    b: jax.Array         # W (forward, input backward) or dy (weight grad)
    bias: Optional[jax.Array]
    node: jax.Array
    stride: int
    kernel_size: int
    formulation: Optional[str] = None

    @property
    def out_shape(self) -> Optional[tuple]:
        """What `apply` reads besides the operands: None forward; x's shape (the node's) for the
        input backward; the weight's [O, C, k, k] for the weight grad, from its operands (x, dy) and
        kernel_size, so that a site whose node is dropped (a replica's share) still runs."""
        if self.op == "grad_weight":
            return (self.b.shape[1], self.a.shape[1], self.kernel_size, self.kernel_size)
        return self.node.shape if self.op == "backward" else None

    def _apply(self, a, b, **kw):
        return apply(self.op, a, b, stride=self.stride, formulation=self.formulation, out_shape=self.out_shape, **kw)

    def kind(self, rnd=None) -> jax.Array:
        """The f32 peer (rnd None) or the bf16 kind at these operands."""
        return self._apply(self.a, self.b, rnd=rnd, bias=self.bias)

    def numbers(self, rnd) -> dict:
        """The bias-free kind under `rnd`; S = the f32 peer at rnd(a), rnd(b) (widening bf16 is exact:
        rnd(S) is the rounding identity's right side); per output the exact value and the magnitude
        sum M = Σ|a|·|b|, in float64 (float32 products are exact there)."""
        a, b, a64, b64 = self.a, self.b, self.a.astype(jnp.float64), self.b.astype(jnp.float64)
        return {"kind": self._apply(a, b, rnd=rnd), "s": self._apply(rnd(a).astype(a.dtype), rnd(b).astype(a.dtype)),
                "exact": self._apply(a64, b64), "mag": self._apply(jnp.abs(a64), jnp.abs(b64))}


def kind_cases(seed: int = 0, *, n: int = 2, c: int = 8, o: int = 8, size: int = 9, k: int = 3,
               positive: bool = False) -> list[Site]:
    """The six kinds — forward, input backward, weight grad at strides 1 and 2 — on random float32
    operands (standard normal; |·| of it with `positive`), each node its f32 peer. An odd `size`
    exercises the strided backward's high padding."""
    rng, sign = np.random.default_rng(seed), (np.abs if positive else np.asarray)
    draw = lambda *shape: jnp.asarray(sign(rng.standard_normal(shape)), jnp.float32)   # noqa: E731
    cases = []
    for s in (1, 2):
        x, w, b, dy = draw(n, c, size, size), draw(o, c, k, k), draw(o), draw(n, o, *(2 * [conv.out_size(size, k, s)]))
        for label, op, a, b_, bias in (("forward", "forward", x, w, b), ("input backward", "backward", dy, w, None),
                                       ("weight grad", "grad_weight", x, dy, None)):
            peer = apply(op, a, b_, stride=s, out_shape=w.shape if op == "grad_weight" else x.shape, bias=bias)
            cases.append(Site(f"{label} s{s}", op, a, b_, bias, peer, s, k))
    return cases


def case_erasure(case: Site, node=None) -> bool:
    """The kind at rnd = identity (or a given node) against the f32 peer, bit for bit."""
    return same_bits(case.kind(conv.identity) if node is None else node, case.node)


def case_ulps(case: Site, node=None) -> int:
    """How far the kind at rnd = identity (or a given node) lies from the f32 peer: the most units in
    the last place over its outputs (0 exactly when `case_erasure`)."""
    return ulps_apart(case.kind(conv.identity) if node is None else node, case.node)


@dataclass(frozen=True)
class ErasureReport:
    net: str
    names: list[str]        # "loss", every parameter node, "input"
    equal: list[bool]

    @property
    def ok(self) -> bool:
        return all(self.equal)

    def summary(self) -> str:
        bad = [n for n, e in zip(self.names, self.equal) if not e]
        return (f"{self.net}: erasure at identity {sum(self.equal)}/{len(self.equal)} outputs bit for bit"
                + (f"; first differing: {bad[0]}" if bad else ""))


def chain_erasure(net, params, x, targets, cfg, *, chain: Optional[Chain] = None,
                  label_smoothing: float = 0.0) -> ErasureReport:
    """A rendered chain (default: the net's own) with every conv a bf16 kind at rnd = identity against
    the same chain with the f32 ops: loss, every parameter node and the input cotangent, bit for bit."""
    chain = chain or Chain(net)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    run = partial(rendered.quick, chain.net, chain.kit, params, x, t, alpha=float(label_smoothing))
    f32, kind = run(cfg=replace(cfg, bf16=False)), run(cfg=replace(cfg, bf16=True, bf16_rounding="identity"))
    flat = lambda r: [r.loss, *(r.grads[k] for k in params), r.dx]   # noqa: E731
    return ErasureReport(chain.label, ["loss", *params, "input"], list(map(same_bits, flat(f32), flat(kind))))


# ---- planted kinds, each breaking one claim: a kind case's node computed another way --------------

def drop_bias_forward(case: Site, rnd=conv.identity):
    """The forward kind that forgets the bias: breaks erasure (conv biases of cifar8)."""
    return replace(case, bias=None).kind(rnd)


def same_padding_forward(case: Site, rnd=conv.identity):
    """The forward kind with XLA 'SAME' padding (asymmetric on strided convs): breaks erasure."""
    x, w, s = rnd(case.a).astype(case.a.dtype), rnd(case.b).astype(case.a.dtype), case.stride
    y = lax.conv_general_dilated(x, w, (s, s), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                 precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    return rnd(y).astype(x.dtype) + case.bias[None, :, None, None]


def grad_weight_rounded_per_example(case: Site, rnd=conv.identity):
    """The weight-grad kind rounding INSIDE the batch sum, Σ_n rnd(S_n): at identity it reassociates
    the float32 sum (breaks erasure), under bf16 it is not rnd(f32 node at rounded operands)."""
    parts = [replace(case, a=case.a[i:i + 1], b=case.b[i:i + 1]).kind(rnd) for i in range(case.a.shape[0])]
    return sum(parts[1:], parts[0])


def forward_result_only(case: Site, rnd=conv.round_bf16):
    """The forward kind rounding only its result, rnd(conv(x, W)): not rnd(f32 node at rounded operands)."""
    return rnd(replace(case, bias=None).kind()).astype(case.a.dtype) + case.bias[None, :, None, None]


@partial(jax.jit, static_argnames=("stride",))
def forward_bf16_accumulation(x, weight, *, stride: int = 1):
    """The forward kind accumulating in bf16 (every partial sum rounded, one product at a time):
    its error grows like n·u on positive data and breaks the bound."""
    k, p = weight.shape[2], conv.padding(weight.shape[2])
    patches = lax.conv_general_dilated_patches(conv.round_bf16(x), (k, k), (stride, stride), ((p, p), (p, p)),
                                               dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                               precision=lax.Precision.HIGHEST)   # [N, C·k·k, H', W']
    w = conv.round_bf16(weight).reshape(weight.shape[0], -1)                     # [O, C·k·k]
    prods = patches[:, None] * w[None, :, :, None, None]                          # exact: bf16·bf16
    acc, _ = lax.scan(lambda acc, p_i: (conv.round_bf16(acc + p_i), None), jnp.zeros_like(prods[:, :, 0]),
                      jnp.moveaxis(prods, 2, 0))
    return acc


# ---- what a compiler keeps of a rounding (beyond the suite) ------------------------------------------

_CONVERT = re.compile(r"=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+convert\(")
_STABLEHLO_CONV = re.compile(r"stablehlo\.convolution.*:\s*\(tensor<[^>]*x(\w+)>,\s*tensor<[^>]*x(\w+)>\)\s*->\s*tensor<[^>]*x(\w+)>")


def convert_ops(hlo_text: str) -> list[str]:
    """The result dtype of every `convert` instruction in an HLO module's text (fusions included)."""
    return _CONVERT.findall(hlo_text)


@dataclass(frozen=True)
class HloFacts:
    what: str
    converts: list[str]     # result dtypes of the optimized HLO's converts, in text order
    rounds: bool            # the compiled function's output is x rounded to bf16 (and not x itself)
    text: str               # the optimized HLO (backend-specific: print it, never compare it)
    written: tuple = ()     # a convolution's (operand, operand, result) dtypes as written (StableHLO)

    @property
    def pair_kept(self) -> bool:   # a convert to bf16 and one back to float32 are both still there
        return "bf16" in self.converts and "f32" in self.converts

    @property
    def compiled_bf16(self) -> int:   # bf16-typed instructions in the optimized HLO
        return len(re.findall(r"=\s*bf16\[", self.text))

    def summary(self) -> str:
        if self.written:
            return (f"{self.what} as written: convolution({self.written[0]}, {self.written[1]}) -> {self.written[2]}; "
                    f"bf16 kept in the optimized HLO: {self.compiled_bf16 > 0}")
        return (f"{self.what}: {len(self.converts)} convert ops in the optimized HLO, convert pair kept: "
                f"{self.pair_kept}, output rounded to bf16: {self.rounds}")


def _facts(what: str, f, x, *more) -> HloFacts:
    f = jax.jit(f)
    lowered = f.lower(x, *more)
    text, written = lowered.compile().as_text(), _STABLEHLO_CONV.search(lowered.as_text())
    y = np.asarray(f(x, *more))
    rounds = np.array_equal(y, np.asarray(conv.round_bf16(x))) and not np.array_equal(y, np.asarray(x))
    return HloFacts(what, convert_ops(text), bool(rounds), text, written.groups() if written else ())


def hlo_cast_roundtrip(x) -> HloFacts:
    """x.astype(bf16).astype(f32) under jit: does the optimized HLO keep the convert pair, and does
    the compiled function round? (CPU: kept, it rounds; upstream measured XLA GPU deleting it.)"""
    return _facts("cast round-trip f32→bf16→f32", lambda a: a.astype(jnp.bfloat16).astype(a.dtype), x)


def hlo_nearest(x) -> HloFacts:
    """conv.round_bf16 under jit: integer ops on the bits, no convert for a compiler to fold."""
    return _facts("round_bf16 (integer ops)", conv.round_bf16, x)


def hlo_typed_kind(x, weight) -> HloFacts:
    """The forward kind with bf16-typed operands: the conv reads bf16 and accumulates in float32."""
    return _facts("bf16-typed kind", lambda a, w: conv.forward(a, w, rnd=conv.bf16_operand)[0], x, weight)
