"""Every conv site of a chain: node = rnd(f32 node at rounded operands), under the bound B(n).

Bit for bit where the backend runs the kind's and the reference's sums alike (`same_computation`);
the error against the exact value, relative to the magnitude sum M = Σ|a|·|b| of its n products,
stays under `node_bound(n)`. The sites are a chain's conv calls read through a recording kit. The
bound, and the forward and input-backward sites, go beyond the suite (`ConvWTiedBAt bf16`). Shown
in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ... import kit as kit_
from ... import rendered
from ...ops import conv
from ..tie import need_x64
from .kinds import OP_LABELS, OPS, U_BF16, U_F32, Site, same_bits

# ---- the bound ------------------------------------------------------------------------------------
#
# One output s = Σ_{i≤n} a_i·b_i. Rounded operands â = a(1+α), b̂ = b(1+β), |α|, |β| ≤ u = 2⁻⁸, give
# |Σ âb̂ − Σ ab| ≤ (2u + u²)·M. The products âb̂ of two bf16 values are exact in float32; a float32
# sum of n of them, in any order, errs by at most ((1+v)^(n−1) − 1)(1+u)²·M, v = 2⁻²⁴ (the book keeps
# (n+1), which also covers rounded products). So |ŝ − s| ≤ B(n)·M, B(n) = ((1+v)^(n+1) − 1)(1+u)²
# + 2u + u², and the result's single rounding adds u(1 + B)·M. n counts zero terms too (adding an
# exact 0 is exact): C·k·k (forward), O·k·k (input backward: the stride-1 correlation of the
# zero-upsampled dy), N·H'·W' (weight grad: the batch sum is inside the one contraction).


def accumulation_bound(n) -> np.ndarray:
    """B(n) = ((1+2⁻²⁴)^(n+1) − 1)(1+2⁻⁸)² + 2·2⁻⁸ + 2⁻¹⁶: rounded operands, float32 accumulation."""
    n = np.asarray(n, np.float64)
    return np.expm1((n + 1) * np.log1p(U_F32)) * (1 + U_BF16) ** 2 + 2 * U_BF16 + U_BF16 ** 2


def node_bound(n) -> np.ndarray:
    """B(n) + 2⁻⁸·(1 + B(n)): the bound with the result's single rounding."""
    b = accumulation_bound(n)
    return b + U_BF16 * (1 + b)


def contraction_length(op: str, a_shape, b_shape, kernel_size: int) -> int:
    """Products per output: C·k² (forward: a = x, b = W), O·k² (input backward: a = dy, b = W),
    N·H'·W' (weight grad: a = x, b = dy)."""
    return {"forward": a_shape[1] * kernel_size ** 2, "backward": b_shape[0] * kernel_size ** 2,
            "grad_weight": b_shape[0] * b_shape[2] * b_shape[3]}[op]


@partial(jax.jit, static_argnums=1, compiler_options={**rendered.QUICK, **rendered.EXACT_ROUNDING})
def _numbers(sites: list[Site], rnd) -> list[tuple]:
    """Per site, in one program for a whole net: (rnd(S) [+ bias]; per output |error| against the
    exact value, and M). With a bias the error is the kind's contraction's: the bias is a float32 add
    after the kind, outside the bound."""
    out = []
    for s in sites:
        nb = s.numbers(rnd)
        want = rnd(nb["s"]).astype(s.a.dtype)
        # the bias is added as the conv adds it, in the result's dtype (bf16 activations: the bias
        # rounded to bf16, then one more rounding of the sum, after the kind's)
        out.append((want if s.bias is None else (want + s.bias.astype(want.dtype)[None, :, None, None]).astype(s.node.dtype),
                    jnp.abs((s.node if s.bias is None else nb["kind"]).astype(jnp.float64) - nb["exact"]), nb["mag"]))
    return out


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


def same_computation(site: Optional[Site] = None, rnd=None) -> bool:
    """Whether a kind and its reference run the same sums in the same order (node = rnd(S) bit for
    bit): on CPU XLA widens rounded bf16 operands and runs the reference's f32 convolution, but a
    product of bf16-typed operands (a site the kit runs as patches · weights: `conv.use_patches`, by
    its output grid and terms per output) sums in its own order, as a GPU's bf16 kernels do. Without
    a site: whether the backend is the CPU."""
    if jax.default_backend() != "cpu":
        return False
    if site is None or rnd is not conv.bf16_operand:
        return True
    grid = (site.b if site.op == "grad_weight" else site.node).shape
    terms = site.b.shape[0] if site.op == "backward" else site.a.shape[1]
    return not conv.use_patches(grid[2] * grid[3], terms * site.kernel_size ** 2, site.kernel_size, site.formulation)


def site_rows(sites: list[Site], rnd) -> list[SiteRow]:
    """Every site against the rounding identity (bit for bit) and the bound, against float64."""
    need_x64("the bf16 bound")
    rows = []
    for s, (want, err, mag) in zip(sites, _numbers(sites, rnd)):
        err, mag = np.asarray(err), np.asarray(mag)
        live = mag > 0
        n = contraction_length(s.op, s.a.shape, s.b.shape, s.kernel_size)
        rows.append(SiteRow(s.name, s.op, s.stride, n, same_bits(s.node, want),
                            float((err[live] / mag[live]).max(initial=0.0)), float(node_bound(n)),
                            int(np.sum(err[~live] > 0)), same_computation(s, rnd)))
    return rows


def case_row(case: Site, rnd, node=None) -> SiteRow:
    """The kind under `rnd` (or a given node) against rnd(f32 node at rounded operands) and the bound."""
    return site_rows([replace(case, node=case.kind(rnd) if node is None else node)], rnd)[0]


# ---- the sites of a chain: its conv calls through a recording kit ------------------------------------

CONV_OPS = tuple(f"conv_{op}" for op in OPS)


def recorded(log: list) -> list[Site]:
    """The conv calls of a recording, in call order (under a trace: a pytree a jitted function hands
    back). forward(name, x, W, b) -> (y, saved); backward(name, W, dy); grad_weight(name, x, dy)."""
    out = []
    for c in (c for c in log if c.op in CONV_OPS):
        name, p, q, *bias = c.args
        op, kw = c.op[len("conv_"):], c.kwargs
        a, b = (q, p) if op == "backward" else (p, q)
        k = kw["kernel_size"] if op == "grad_weight" else b.shape[2]
        bias, node = ((bias[0] if bias else kw.get("bias")), c.out[0]) if op == "forward" else (None, c.out)
        out.append(Site(name, op, a, b, bias, node, kw.get("stride", 1), k, kw.get("formulation")))
    return out


BN_OPS = ("bn_forward", "bn_backward")


def bn_recorded(log: list) -> dict[str, tuple]:
    """{BN layer: (n, dn)}: each BatchNorm's output and the cotangent the chain handed back at it
    (what its backward read) — the values the bf16 policy rounds around a BatchNorm."""
    outs = {c.args[0]: c.out[0] for c in log if c.op == "bn_forward"}
    dys = {c.args[0]: c.args[3] for c in log if c.op == "bn_backward"}
    return {name: (outs[name], dys[name]) for name in outs if name in dys}


def _run(net, kit, params, x, t, cfg, alpha, ops=CONV_OPS):
    log, tape = [], rendered.new_tape()
    out = rendered.step(net, kit_.recording(kit, log, ops), params, x, t, cfg, alpha=alpha, tape=tape)
    return (recorded(log), out, tape) if ops == CONV_OPS else (recorded(log), out, tape, bn_recorded(log))


_run_quick = jax.jit(_run, static_argnums=(0, 1, 5, 6, 7), compiler_options={**rendered.QUICK, **rendered.EXACT_ROUNDING})


def conv_sites(chain, params, x, targets, cfg, *, label_smoothing: float = 0.0, how: str = "quick"):
    """A chain (`tie.Chain`) run once with a tape and a recording kit -> (its conv sites, Rendered, Tape).
    how: "quick" (one program) or "eager" (op by op: planted chains share their ops, not programs)."""
    return {"quick": _run_quick, "eager": _run}[how](chain.net, chain.kit, params, x, targets, cfg,
                                                     float(label_smoothing))


def policy_sites(chain, params, x, targets, cfg, *, label_smoothing: float = 0.0, how: str = "quick"):
    """`conv_sites` and, fourth, every BatchNorm's output and the cotangent handed back at it
    (`bn_recorded`): what the bf16 execution policy rounds beyond its conv sites."""
    return {"quick": _run_quick, "eager": _run}[how](chain.net, chain.kit, params, x, targets, cfg,
                                                     float(label_smoothing), CONV_OPS + BN_OPS)
