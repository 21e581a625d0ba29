"""Every conv site of a chain: node = rnd(f32 node at rounded operands), under SPEC §7's bound.

With bf16 rounding a kind is not its f32 peer, but it is the f32 peer run on rounded operands and
rounded once (`site_row`, bit for bit where the backend runs the same sums: `same_computation`).
Its error against the exact (float64) value, relative to the magnitude sum Σ|a|·|b| of its n
products, stays under `node_bound(n)` (derivation below). The sites are the conv calls a chain
makes through a recording kit (`gradtie.kit.recording`), each named by the layer name every kit
conv call carries (`conv1`, `layer2.0.downsample.0`). The bound and the forward and input-backward
sites go beyond the suite, whose bf16 switch is on the conv weight-gradient nodes only
(`ConvWTiedBAt bf16`, `convWeightGradBBf16`). Shown in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ... import kit as kit_
from ... import rendered
from ...ops import conv
from ..tie import need_x64
from .kinds import OP_LABELS, OPS, U_BF16, U_F32, KindCase, apply, bits, rounded_node

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

@dataclass(frozen=True)
class Site:
    """One conv call of a rendered chain: its operands, statics and node."""
    name: str            # the layer name the kit call carries: "conv3", "layer2.0.downsample.0"
    op: str              # "forward", "backward", "grad_weight"
    a: jax.Array         # x (forward, weight grad) or dy (input backward)
    b: jax.Array         # W (forward, input backward) or dy (weight grad)
    bias: Optional[jax.Array]
    node: jax.Array
    stride: int
    kernel_size: int
    formulation: Optional[str] = None

    @property
    def statics(self) -> tuple:
        return self.op, self.stride, self.kernel_size, tuple(self.node.shape), self.formulation


def _numbers(a, b, bias, node, statics, rnd):
    """(node == rnd(f32 node at rounded operands) [+ bias] bit for bit, per output: |error| against
    the exact value and the magnitude sum M). With a bias, the error is the kind's contraction's:
    the bias is a float32 add after the kind, outside SPEC §7's bound."""
    op, stride, k, out_shape, formulation = statics
    kw = dict(stride=stride, kernel_size=k, out_shape=out_shape, formulation=formulation)
    want = rounded_node(op, a, b, rnd=rnd, bias=bias, **kw)
    equal = jnp.array_equal(bits(node), bits(want))
    core = node if bias is None else apply(op, a, b, rnd=rnd, **kw)
    a64, b64 = a.astype(jnp.float64), b.astype(jnp.float64)
    exact = apply(op, a64, b64, **kw)                     # f32 products are exact in float64
    mag = apply(op, jnp.abs(a64), jnp.abs(b64), **kw)     # Σ|a|·|b| per output
    return equal, jnp.abs(core.astype(jnp.float64) - exact), mag


@partial(jax.jit, static_argnums=(1, 2), compiler_options=rendered.QUICK)
def _all_numbers(arrays, statics, rnd):
    """Every site's numbers in one program: one compile for a whole net."""
    return [_numbers(*arr, st, rnd) for arr, st in zip(arrays, statics)]


@dataclass(frozen=True)
class SiteRow:
    name: str
    op: str
    stride: int
    n: int             # contraction length
    equal: bool        # node == rnd(f32 node at rounded operands), bit for bit
    max_rel: float     # max over outputs of |node − exact| / Σ|a|·|b|
    bound: float       # node_bound(n)
    zero_mag_errors: int = 0     # outputs with Σ|a|·|b| = 0 but a nonzero node (must be 0)
    equal_required: bool = True  # the kind and the reference run the same computation

    @property
    def ratio(self) -> float:
        return self.max_rel / self.bound

    @property
    def ok(self) -> bool:
        return bool((self.equal or not self.equal_required) and self.ratio <= 1.0 and self.zero_mag_errors == 0)

    @property
    def label(self) -> str:
        return f"{self.name} {OP_LABELS[self.op]}"


def runs_as_product(op: str, a_shape, b_shape, node_shape, kernel_size: int, formulation=None) -> bool:
    """Whether the op kit runs this conv site as patches · weights (`conv.use_patches`) rather than
    XLA's convolution: by its output grid and its terms per output (the weight grad: the forward's)."""
    grid = b_shape if op == "grad_weight" else node_shape
    terms = b_shape[0] if op == "backward" else a_shape[1]
    return bool(conv.use_patches(grid[2] * grid[3], terms * kernel_size ** 2, kernel_size, formulation))


def same_computation(op: Optional[str] = None, a_shape=None, b_shape=None, node_shape=None, kernel_size: int = 3,
                     rnd=None, formulation=None) -> bool:
    """Whether a bf16 kind and its reference run the same sums in the same order, so that node =
    rnd(f32 node at rounded operands) holds bit for bit. On CPU XLA widens rounded bf16 operands and
    runs the very f32 convolution the reference runs; a matrix product of bf16-typed operands (a site
    the kit runs as patches · weights) sums in its own order, as a GPU's bf16 kernels do, and there
    the identity holds to the bound only. Without a site: whether the backend is the CPU's."""
    if jax.default_backend() != "cpu":
        return False
    if op is None or rnd is not conv.bf16_operand:
        return True
    return not runs_as_product(op, a_shape, b_shape, node_shape, kernel_size, formulation)


def site_rows(sites: list[Site], rnd) -> list[SiteRow]:
    """Every site against the rounding identity (bit for bit) and the bound, against float64."""
    need_x64("the bf16 bound")
    numbers = _all_numbers([(s.a, s.b, s.bias, s.node) for s in sites], tuple(s.statics for s in sites), rnd)
    rows = []
    for s, (equal, err, mag) in zip(sites, numbers):
        err, mag = np.asarray(err), np.asarray(mag)
        live = mag > 0
        rel = err[live] / mag[live]
        n = contraction_length(s.op, s.a.shape, s.b.shape, s.kernel_size)
        rows.append(SiteRow(s.name, s.op, s.stride, n, bool(equal), float(rel.max(initial=0.0)), float(node_bound(n)),
                            int(np.sum(err[~live] > 0)),
                            same_computation(s.op, s.a.shape, s.b.shape, s.node.shape, s.kernel_size, rnd,
                                             s.formulation)))
    return rows


def site_row(name: str, op: str, a, b, node, *, stride: int, kernel_size: int, rnd, bias=None) -> SiteRow:
    """One conv node (a planted kind's, say) against the rounding identity and the bound."""
    return site_rows([Site(name, op, a, b, bias, node, stride, kernel_size)], rnd)[0]


def case_row(case: KindCase, rnd, node=None) -> SiteRow:
    """The kind under `rnd` (or a given node) against rnd(f32 node at rounded operands) and the bound."""
    node = case.node(rnd) if node is None else node
    return site_row(case.label, case.op, case.a, case.b, node, stride=case.stride, kernel_size=case.kernel_size,
                    rnd=rnd, bias=case.bias)


# ---- the sites of a chain: its conv calls through a recording kit ------------------------------------

CONV_OPS = ("conv_forward", "conv_backward", "conv_grad_weight")


def sites_of(log: list) -> dict:
    """The conv calls of a recording -> {(i, op, name, stride, k, formulation): (a, b, bias, node)}: the
    statics as dict keys, so a jitted function hands them back with the arrays (a tree's keys are
    static). forward(name, x, W, b) -> (y, saved); backward(name, W, dy); grad_weight(name, x, dy)."""
    out = {}
    for i, c in enumerate(c for c in log if c.op in CONV_OPS):
        name, p, q, *bias = c.args
        op, kw = c.op[len("conv_"):], c.kwargs
        a, b = (q, p) if op == "backward" else (p, q)
        k = kw["kernel_size"] if op == "grad_weight" else b.shape[2]
        bias, node = ((bias[0] if bias else kw.get("bias")), c.out[0]) if op == "forward" else (None, c.out)
        out[(i, op, name, kw.get("stride", 1), k, kw.get("formulation"))] = (a, b, bias, node)
    return out


def as_sites(recorded: dict) -> list[Site]:
    return [Site(name, op, a, b, bias, node, stride, k, form)
            for (_, op, name, stride, k, form), (a, b, bias, node) in sorted(recorded.items(), key=lambda kv: kv[0][0])]


def _run(net, kit, params, x, t, cfg, alpha):
    log, tape = [], rendered.new_tape()
    out = rendered.step(net, kit_.recording(kit, log, CONV_OPS), params, x, t, cfg, alpha=alpha, tape=tape)
    return out, tape, sites_of(log)


_run_quick = jax.jit(_run, static_argnums=(0, 1, 5, 6), compiler_options=rendered.QUICK)


def run(chain, params, x, targets, cfg, *, label_smoothing: float = 0.0, how: str = "quick"):
    """A rendered chain (a `tie.Chain`) run once with a tape and a recording kit -> (Rendered, Tape,
    sites). how: "quick" (one program, LLVM's optimisation off) or "eager" (op by op: planted chains
    at one point share their ops, not their programs)."""
    fn = {"quick": _run_quick, "eager": _run}[how]
    out, tape, recorded = fn(chain.net, chain.kit, params, x, targets, cfg, float(label_smoothing))
    return out, tape, as_sites(recorded)


def conv_sites(chain, params, x, targets, cfg, *, label_smoothing: float = 0.0):
    """Every conv site of a rendered chain (a `tie.Chain`) at one point -> (sites, Rendered)."""
    out, _, sites = run(chain, params, x, targets, cfg, label_smoothing=label_smoothing)
    return sites, out
