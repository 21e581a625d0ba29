"""Every conv site of a net: node = rnd(f32 node at rounded operands), under SPEC §7's bound.

With bf16 rounding a kind is not its f32 peer, but it is the f32 peer run on rounded operands and
rounded once (`site_row`, bit for bit where the backend runs the same sums: `same_computation`).
Its error against the exact (float64) value, relative to the magnitude sum Σ|a|·|b| of its n
products, stays under `node_bound(n)` (derivation below). The sites of a net are read from one run
of its rendered chain with the op kit's three conv entry points wrapped (`conv_sites`): every
forward conv, input backward and weight gradient, with its operands, strides and node. The bound
and the forward and input-backward sites go beyond the suite, whose bf16 switch is on the conv
weight-gradient nodes only (`ConvWTiedBAt bf16`, `convWeightGradBBf16`). Shown in: bf16 erasure.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Optional
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from ...ops import conv
from ..tie import rendered
from .kinds import OP_LABELS, OPS, QUICK, U_BF16, U_F32, KindCase, _bits, _need_x64, apply, rounded_node

# ---- the bound ------------------------------------------------------------------------------------
#
# One output s = Σ_{i≤n} a_i·b_i of float32 operands. Rounding the operands gives â = a(1+α),
# b̂ = b(1+β), |α|, |β| ≤ u = 2⁻⁸, so |Σ âb̂ − Σ ab| ≤ (2u + u²)·M with M = Σ|a|·|b|. The products
# âb̂ of two bf16 values (8 significant bits each) are exact in float32; summing n of them in float32,
# in any order, errs by at most ((1+v)^(n−1) − 1)·Σ|âb̂| ≤ ((1+v)^(n−1) − 1)(1+u)²·M, v = 2⁻²⁴ (we
# keep SPEC's (n+1), which also covers rounded products: the f32 peer at rnd = identity). Together:
#     |ŝ − s| ≤ B(n)·M,   B(n) = ((1+v)^(n+1) − 1)(1+u)² + 2u + u².
# The result's single rounding adds u·|ŝ| ≤ u(|s| + B·M) ≤ u(1 + B)·M, so the node obeys
#     |rnd(ŝ) − s| ≤ (B(n) + u(1 + B(n)))·M.
# n is the contraction length, zero terms included (adding an exact 0 is exact):
#     forward      y[n,o,i,j]   n = C·k·k
#     input bwd    dx[n,c,h,w]  n = O·k·k   (the stride-1 correlation of the zero-upsampled dy)
#     weight grad  dW[o,c,p,q]  n = N·H'·W' (the batch sum is inside the one contraction)


def accumulation_bound(n) -> np.ndarray:
    """B(n) = ((1+2⁻²⁴)^(n+1) − 1)(1+2⁻⁸)² + 2·2⁻⁸ + 2⁻¹⁶: rounded operands, float32 accumulation."""
    n = np.asarray(n, np.float64)
    return np.expm1((n + 1) * np.log1p(U_F32)) * (1 + U_BF16) ** 2 + 2 * U_BF16 + U_BF16 ** 2


def node_bound(n) -> np.ndarray:
    """B(n) + 2⁻⁸·(1 + B(n)): the bound with the result's single rounding."""
    b = accumulation_bound(n)
    return b + U_BF16 * (1 + b)


def contraction_length(op: str, a_shape, b_shape, kernel_size: int) -> int:
    """Products per output: C·k² (forward), O·k² (input backward), N·H'·W' (weight grad)."""
    if op == "forward":          # a = x [N,C,H,W], b = W [O,C,k,k]
        return a_shape[1] * kernel_size ** 2
    if op == "backward":         # a = dy [N,O,H',W'], b = W [O,C,k,k]
        return b_shape[0] * kernel_size ** 2
    if op == "grad_weight":      # a = x [N,C,H,W], b = dy [N,O,H',W']
        return b_shape[0] * b_shape[2] * b_shape[3]
    raise ValueError(f"op {op!r}: expected one of {', '.join(OPS)}")



# ---- one conv node against its rounding identity and the bound ---------------------------------

@partial(jax.jit, static_argnames=("op", "stride", "kernel_size", "out_shape", "rnd"), compiler_options=QUICK)
def _site_numbers(a, b, bias, node, *, op, stride, kernel_size, out_shape, rnd):
    """(node == rnd(f32 node at rounded operands) [+ bias] bit for bit, per output: |error| against
    the exact value and the magnitude sum M). With a bias, the error is the kind's contraction's:
    the bias is a float32 add after the kind, outside SPEC §7's bound."""
    statics = dict(stride=stride, kernel_size=kernel_size, out_shape=out_shape)
    want = rounded_node(op, a, b, rnd=rnd, bias=bias, **statics)
    equal = jnp.array_equal(_bits(node), _bits(want))
    core = node if bias is None else apply(op, a, b, rnd=rnd, **statics)
    a64, b64 = a.astype(jnp.float64), b.astype(jnp.float64)
    exact = apply(op, a64, b64, **statics)                    # f32 products are exact in float64
    mag = apply(op, jnp.abs(a64), jnp.abs(b64), **statics)    # Σ|a|·|b| per output
    err = jnp.abs(core.astype(jnp.float64) - exact)
    return equal, err, mag


@dataclass(frozen=True)
class SiteRow:
    name: str          # the conv's parameter prefix: "conv3", "layer2.0.downsample.0"
    op: str            # "forward", "backward", "grad_weight"
    stride: int
    n: int             # contraction length
    equal: bool        # node == rnd(f32 node at rounded operands), bit for bit
    max_rel: float     # max over outputs of |node − exact| / Σ|a|·|b|
    median_rel: float
    bound: float       # node_bound(n)
    zero_mag_errors: int = 0   # outputs with Σ|a|·|b| = 0 but a nonzero node (must be 0)
    equal_required: bool = True  # the kind and the reference run the same computation (see below)

    @property
    def ratio(self) -> float:
        return self.max_rel / self.bound

    @property
    def ok(self) -> bool:
        return bool((self.equal or not self.equal_required) and self.ratio <= 1.0 and self.zero_mag_errors == 0)

    @property
    def label(self) -> str:
        return f"{self.name} {OP_LABELS[self.op]}"


def runs_as_product(op: str, a_shape, b_shape, node_shape, kernel_size: int) -> bool:
    """Whether the op kit runs this conv site as patches · weights (`conv.use_patches`, the kit's
    rule: XLA's CPU convolution is pathological on tiny output grids) rather than XLA's convolution."""
    use = getattr(conv, "use_patches", None)
    if use is None:
        return False
    k = kernel_size
    if op == "forward":          # a = x, node = y
        return bool(use(node_shape[2] * node_shape[3], a_shape[1] * k * k, k))
    if op == "backward":         # a = dy, b = W, node = dx
        return bool(use(node_shape[2] * node_shape[3], b_shape[0] * k * k, k))
    if op == "grad_weight":      # a = x, b = dy: the forward's rule at this site
        return bool(use(b_shape[2] * b_shape[3], a_shape[1] * k * k, k))
    raise ValueError(f"op {op!r}: expected one of {', '.join(OPS)}")


def same_computation(op: Optional[str] = None, a_shape=None, b_shape=None, node_shape=None, kernel_size: int = 3,
                     rnd=None) -> bool:
    """Whether a bf16 kind and its reference run the same sums in the same order, so that node =
    rnd(f32 node at rounded operands) holds bit for bit. On CPU XLA widens rounded bf16 operands and
    runs the very f32 convolution the reference runs; a matrix product of bf16-typed operands (a site
    the kit runs as patches · weights) sums in its own order, as a GPU's bf16 kernels do, and there
    the identity holds to the bound only. Without a site: whether the backend is the CPU's."""
    if jax.default_backend() != "cpu":
        return False
    if op is None or rnd is not conv.bf16_operand:
        return True
    return not runs_as_product(op, a_shape, b_shape, node_shape, kernel_size)


def site_row(name: str, op: str, a, b, node, *, stride: int, kernel_size: int, rnd, bias=None) -> SiteRow:
    """Check one conv node: the rounding identity (bit for bit) and the bound against float64."""
    _need_x64("the bf16 bound")
    out_shape = tuple(node.shape)
    equal, err, mag = _site_numbers(a, b, bias, node, op=op, stride=stride, kernel_size=kernel_size,
                                    out_shape=out_shape, rnd=rnd)
    err, mag = np.asarray(err), np.asarray(mag)
    live = mag > 0
    rel = err[live] / mag[live]
    n = contraction_length(op, a.shape, b.shape, kernel_size)
    return SiteRow(name, op, stride, n, bool(equal), float(rel.max(initial=0.0)),
                   float(np.median(rel)) if rel.size else 0.0, float(node_bound(n)),
                   int(np.sum(err[~live] > 0)),
                   same_computation(op, a.shape, b.shape, node.shape, kernel_size, rnd))


def case_row(case: KindCase, rnd, node=None) -> SiteRow:
    """The kind under `rnd` (or a given node) against rnd(f32 node at rounded operands) and the bound."""
    node = case.node(rnd) if node is None else node
    return site_row(case.label, case.op, case.a, case.b, node, stride=case.stride,
                    kernel_size=case.kernel_size, rnd=rnd, bias=case.bias)


# ---- the sites of a net ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Site:
    """One conv call of a net's rendered chain: its operands, statics and node."""
    name: str
    op: str
    a: jax.Array
    b: jax.Array
    bias: Optional[jax.Array]
    node: jax.Array
    stride: int
    kernel_size: int


@contextmanager
def _logged_convs(log: list):
    """Wrap conv.forward / backward / grad_weight: each call appends (op, a, b, bias, node, stride, k, W)."""
    forward, backward, grad_weight = conv.forward, conv.backward, conv.grad_weight

    def forward_(x, weight, bias=None, *, stride=1, rnd=None):
        y, saved = forward(x, weight, bias, stride=stride, rnd=rnd)
        log.append(("forward", x, weight, bias, y, stride, weight.shape[2], weight))
        return y, saved

    def backward_(weight, dy, *, input_shape, stride=1, rnd=None):
        dx = backward(weight, dy, input_shape=input_shape, stride=stride, rnd=rnd)
        log.append(("backward", dy, weight, None, dx, stride, weight.shape[2], weight))
        return dx

    def grad_weight_(x, dy, *, kernel_size, stride=1, rnd=None):
        dw = grad_weight(x, dy, kernel_size=kernel_size, stride=stride, rnd=rnd)
        log.append(("grad_weight", x, dy, None, dw, stride, kernel_size, None))
        return dw

    with mock.patch.object(conv, "forward", forward_), mock.patch.object(conv, "backward", backward_), \
            mock.patch.object(conv, "grad_weight", grad_weight_):
        yield log


def _site_names(log: list, params: dict) -> list[str]:
    """Name each call by its weight (the same array object the net passed); a weight gradient by
    the forward conv that read the same input with the same kernel and output width."""
    by_weight = {id(v): k[: -len(".weight")] for k, v in params.items() if k.endswith(".weight")}
    by_input, names = {}, []
    for op, a, b, _, node, _, k, weight in log:
        if op == "grad_weight":
            names.append(by_input[(id(a), k, b.shape[1])])
            continue
        name = by_weight[id(weight)]
        if op == "forward":
            by_input[(id(a), k, weight.shape[0])] = name
        names.append(name)
    return names


_SITE_RUNS: dict = {}   # (net, cfg, α) -> (the jitted logged chain, the statics its trace read)


def conv_sites(net, params, x, targets, cfg, *, label_smoothing: float = 0.0):
    """Run the rendered chain once (jitted) and read every conv site -> (sites, (loss, grads, dx))."""
    key = (net, cfg, label_smoothing)
    if key not in _SITE_RUNS:
        statics: list = []

        def run(p, x_, t_):
            log: list = []
            with _logged_convs(log):
                out = rendered(net, p, x_, t_, cfg, label_smoothing)
            names = _site_names(log, p)
            statics[:] = [(name, op, stride, k) for name, (op, *_, stride, k, _w) in zip(names, log)]
            return out, [(a, b, bias, node) for _, a, b, bias, node, *_ in log]

        _SITE_RUNS[key] = (jax.jit(run, compiler_options=QUICK), statics)
    run, statics = _SITE_RUNS[key]
    out, arrays = run(params, x, targets)
    sites = [Site(name, op, a, b, bias, node, stride, k)
             for (name, op, stride, k), (a, b, bias, node) in zip(statics, arrays)]
    return sites, out



def site_rows(sites: list[Site], rnd) -> list[SiteRow]:
    """Every conv site of a net: the rounding identity and the bound."""
    return [site_row(s.name, s.op, s.a, s.b, s.node, stride=s.stride, kernel_size=s.kernel_size,
                     rnd=rnd, bias=s.bias) for s in sites]

