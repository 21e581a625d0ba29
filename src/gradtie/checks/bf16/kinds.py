"""bf16 kinds and their erasure: a kind is its f32 peer plus rounding, and nothing else.

A bf16 kind computes rnd(op(rnd(a), rnd(b))) with float32 accumulation (`gradtie.ops.conv`, bf16
section). At rnd = identity it must be its f32 peer bit for bit, per kind (`case_erasure` on the six
`kind_cases`) and along a whole rendered chain (`chain_erasure`). Lean: `Bf16Erasure` (at the
identity rounding the bf16 kind denotes what its f32 peer does). The planted kinds at the end each
break one claim: erasure, the rounding identity or the bound. Shown in: bf16 erasure.
"""

from __future__ import annotations

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


def apply(op: str, a, b, *, stride: int, kernel_size: int, out_shape, rnd=None, bias=None, formulation=None):
    """The conv op `op` at operands (a, b): forward (x, W), backward (dy, W), grad_weight (x, dy);
    `rnd` None is the f32 peer, else the bf16 kind."""
    kw = dict(stride=stride, rnd=rnd, formulation=formulation)
    if op == "forward":
        return conv.forward(a, b, bias, **kw)[0]
    if op == "backward":
        return conv.backward(b, a, input_shape=tuple(out_shape), **kw)
    if op == "grad_weight":
        return conv.grad_weight(a, b, kernel_size=kernel_size, **kw)
    raise ValueError(f"op {op!r}: expected one of {', '.join(OPS)}")


def bits(a):
    """The bit patterns of a float array: equality of these is bit-for-bit equality (−0 ≠ +0)."""
    return lax.bitcast_convert_type(a, {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[a.dtype.itemsize])


def rounded_node(op, a, b, *, stride, kernel_size, out_shape, rnd, bias=None, formulation=None):
    """rnd(f32 node at rounded operands) [+ bias]: the f32 peer run on rnd(a), rnd(b), rounded once
    (bf16 → float32 widening is exact)."""
    ra, rb = rnd(a).astype(a.dtype), rnd(b).astype(a.dtype)
    y = apply(op, ra, rb, stride=stride, kernel_size=kernel_size, out_shape=out_shape, formulation=formulation)
    y = rnd(y).astype(a.dtype)
    return y if bias is None else y + bias[None, :, None, None]


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (shape, dtype and every bit: −0 ≠ +0)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


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

    def draw(*shape):
        z = rng.standard_normal(shape)
        return jnp.asarray(np.abs(z) if positive else z, jnp.float32)
    cases = []
    for s in (1, 2):
        h2 = conv.out_size(size, k, s)
        x, w, b, dy = draw(n, c, size, size), draw(o, c, k, k), draw(o), draw(n, o, h2, h2)
        cases += [KindCase(f"forward s{s}", "forward", x, w, b, s, k, (n, o, h2, h2)),
                  KindCase(f"input backward s{s}", "backward", dy, w, None, s, k, (n, c, size, size)),
                  KindCase(f"weight grad s{s}", "grad_weight", x, dy, None, s, k, (o, c, k, k))]
    return cases


def case_erasure(case: KindCase, node=None) -> bool:
    """The kind at rnd = identity (or a given node) against the f32 peer, bit for bit."""
    return same_bits(case.node(conv.identity) if node is None else node, case.node(None))


# ---- whole chains -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ErasureReport:
    net: str
    names: list[str]        # "loss", every parameter node, "input"
    equal: list[bool]

    name = "erasure at identity"    # what a list of failed rows calls it

    @property
    def ok(self) -> bool:
        return all(self.equal)

    def summary(self) -> str:
        line = f"{self.net}: erasure at identity {sum(self.equal)}/{len(self.equal)} outputs bit for bit"
        bad = [n for n, e in zip(self.names, self.equal) if not e]
        return line + (f"; first differing: {bad[0]}" if bad else "")


def chain_erasure(net, params, x, targets, cfg, *, chain: Optional[Chain] = None,
                  label_smoothing: float = 0.0) -> ErasureReport:
    """A rendered chain (default: the net's own) with every conv a bf16 kind at rnd = identity,
    against the same chain with the f32 ops: loss, every parameter node and the input cotangent,
    bit for bit."""
    chain = chain or Chain(net)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    run = partial(rendered.quick, chain.net, chain.kit, params, x, t, alpha=float(label_smoothing))
    f32 = run(cfg=replace(cfg, bf16=False))
    kind = run(cfg=replace(cfg, bf16=True, bf16_rounding="identity"))
    names = ["loss", *params, "input"]
    flat = lambda r: [r.loss, *(r.grads[k] for k in params), r.dx]   # noqa: E731
    return ErasureReport(chain.label, names, [same_bits(u, v) for u, v in zip(flat(f32), flat(kind))])


# ---- planted kinds, each breaking one claim ---------------------------------------------------------

def drop_bias_forward(x, weight, bias, *, stride: int = 1, rnd=conv.identity):
    """The forward kind that forgets the bias: breaks erasure (conv biases of cifar8)."""
    return conv.forward(x, weight, None, stride=stride, rnd=rnd)[0]


def same_padding_forward(x, weight, bias=None, *, stride: int = 1, rnd=conv.identity):
    """The forward kind with XLA 'SAME' padding (asymmetric on strided convs): breaks erasure."""
    y = lax.conv_general_dilated(rnd(x).astype(x.dtype), rnd(weight).astype(x.dtype), (stride, stride), "SAME",
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=x.dtype)
    y = rnd(y).astype(x.dtype)
    return y if bias is None else y + bias[None, :, None, None]


def grad_weight_rounded_per_example(x, dy, *, kernel_size: int, stride: int = 1, rnd=conv.identity):
    """The weight-grad kind rounding INSIDE the batch sum, Σ_n rnd(S_n): at identity it reassociates
    the float32 sum (breaks erasure), under bf16 it is not rnd(f32 node at rounded operands)."""
    parts = [conv.grad_weight(x[i:i + 1], dy[i:i + 1], kernel_size=kernel_size, stride=stride, rnd=rnd)
             for i in range(x.shape[0])]
    return sum(parts[1:], parts[0])


def forward_result_only(x, weight, bias=None, *, stride: int = 1, rnd=conv.round_bf16):
    """The forward kind rounding only its result, rnd(conv(x, W)): not rnd(f32 node at rounded operands)."""
    y = rnd(conv.forward(x, weight, None, stride=stride)[0]).astype(x.dtype)
    return y if bias is None else y + bias[None, :, None, None]


@partial(jax.jit, static_argnames=("stride",))
def forward_bf16_accumulation(x, weight, *, stride: int = 1):
    """The forward kind accumulating in bf16 (every partial sum rounded, one product at a time):
    its error grows like n·u on positive data and breaks the bound."""
    k = weight.shape[2]
    p = conv.padding(k)
    patches = lax.conv_general_dilated_patches(conv.round_bf16(x), (k, k), (stride, stride), ((p, p), (p, p)),
                                               dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                               precision=lax.Precision.HIGHEST)   # [N, C·k·k, H', W']
    w = conv.round_bf16(weight).reshape(weight.shape[0], -1)                     # [O, C·k·k]
    prods = patches[:, None] * w[None, :, :, None, None]                          # exact: bf16·bf16
    acc, _ = lax.scan(lambda acc, p_i: (conv.round_bf16(acc + p_i), None), jnp.zeros_like(prods[:, :, 0]),
                      jnp.moveaxis(prods, 2, 0))
    return acc


# the planted kinds, by the claim each breaks (what tests/conftest.py and the chapter iterate over)
CONTROLS = {"drop_bias_forward": "erasure", "same_padding_forward": "erasure",
            "grad_weight_rounded_per_example": "erasure and the rounding identity",
            "forward_result_only": "the rounding identity", "forward_bf16_accumulation": "the bound"}
