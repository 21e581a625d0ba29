"""bf16 erasure: the bf16 conv kinds against their f32 peers, the exact values and SPEC §7's bound.

A bf16 kind computes rnd(op(rnd(a), rnd(b))) with float32 accumulation (`gradtie.ops.conv`, bf16
section). The claims, each with a check here and a control in the last section that breaks it:

- erasure: at rnd = identity the kind is its f32 peer bit for bit, per kind and along both nets'
  whole rendered chains (`erasure`, `chain_erasure`);
- rounding: with bf16 rounding the node is rnd(f32 node at rounded operands) (`site_rows`);
- the bound: each output's error against the exact (float64) value, relative to the magnitude sum
  Σ|a|·|b| of its n products, stays under `node_bound(n)` (`site_rows`, derivation below);
- replica sums: (1/R)·Σ_r rnd(S_r) − rnd(Σ_r S_r)/R is exactly (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)],
  nonzero under bf16 and 0 at identity (`replica_sum`);
- compilers: what the optimized HLO keeps of a cast round-trip and of the bf16-typed kind (`hlo_*`).

The sites of a net are read from one run of its rendered chain with the op kit's three conv entry
points wrapped (`conv_sites`): the nets call them through the module, so every forward conv, input
backward and weight gradient is seen with its operands, strides and node. Functions return reports
and print nothing. Exact values need float64 (`jax_enable_x64`). Shown in: bf16 erasure.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Optional
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..nets import stages
from ..ops import conv
from .tie import rendered, targets_matrix, zero_in_reals

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

U_BF16 = 2.0 ** -8    # bf16 unit roundoff, round to nearest (8 significant bits)
U_F32 = 2.0 ** -24    # float32 unit roundoff

# The whole-net bf16 nodes against the f32 chain: within this many times the f32 chain's own spread
# when every weight and pixel moves by a relative 2⁻⁸ (bf16's resolution), as SPEC §6 holds float32
# to 10× its 1e-7 envelope; the spread is the max over a few random nudges. Never tighter than
# float32's resolution of the node.
ENVELOPE_FACTOR = 10.0
ENVELOPE_NUDGE = U_BF16
ENVELOPE_DRAWS = 2

# The checks are compile-bound on CPU: LLVM optimisation off. It changes no IEEE result (no
# fast-math either way), and the site identity is checked across separately compiled programs.
QUICK = {"xla_backend_optimization_level": 0}

OPS = ("forward", "backward", "grad_weight")
OP_LABELS = {"forward": "forward", "backward": "input backward", "grad_weight": "weight grad"}


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


def _need_x64(what: str) -> None:
    if not jax.config.jax_enable_x64:
        raise ValueError(f"{what} measures errors against float64 exact values: it needs "
                         f"jax_enable_x64 (jax.config.update('jax_enable_x64', True))")


# ---- one conv node, f32 peer / kind / exact / magnitude sum --------------------------------------

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


def same_computation() -> bool:
    """Whether a bf16 kind and its reference run the same sums in the same order, so that node =
    rnd(f32 node at rounded operands) holds bit for bit: on CPU, where XLA widens the rounded bf16
    operands and runs the very f32 convolution the reference runs. A GPU runs a bf16 convolution
    kernel (and autotunes its algorithm per program), so there the identity holds to the bound only."""
    return jax.default_backend() == "cpu"


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
                   int(np.sum(err[~live] > 0)), same_computation())


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


@dataclass(frozen=True)
class NodeEnvelopeRow:
    name: str
    shape: tuple[int, ...]
    err: float          # max |bf16 node − f32 node|
    envelope: float     # max |f32 node at nudged weights and pixels − f32 node|
    scale: float        # max |f32 node|
    zero_in_reals: bool

    @property
    def rel(self) -> float:
        return self.err / self.scale if self.scale > 0 else 0.0

    @property
    def limit(self) -> float:
        return ENVELOPE_FACTOR * max(self.envelope, U_F32 * self.scale)

    @property
    def ratio(self) -> float:
        """err / envelope: about 1 when the bf16 chain moves the node as a bf16 nudge does."""
        return self.err / max(self.envelope, U_F32 * self.scale, np.finfo(np.float64).tiny)

    @property
    def ok(self) -> bool:
        return bool(self.err <= self.limit)


def _nudged(tree, seed: int, nudge: float):
    """Every entry times (1 + nudge·ξ), ξ standard normal, drawn on the host (no compile per shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a) * (1 + nudge * rng.standard_normal(a.shape)).astype(a.dtype)),
                        tree)


def node_errors(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, bf16_grads=None,
                key: Optional[jax.Array] = None, draws: int = ENVELOPE_DRAWS,
                nudge: float = ENVELOPE_NUDGE) -> list[NodeEnvelopeRow]:
    """Whole-net bf16 nodes (and the input cotangent) against the f32 chain at the same point, each
    with the f32 chain's spread under `draws` random relative nudges of every weight and pixel."""
    seed = int(jax.random.randint(jax.random.key(0) if key is None else key, (), 0, 2 ** 31 - 1))
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    cfg32 = replace(cfg, bf16=False)
    _, g32, dx32 = _chain(net, params, x, t, cfg32, label_smoothing)
    if bf16_grads is None:
        _, g16, dx16 = _chain(net, params, x, t, replace(cfg, bf16=True), label_smoothing)
    else:
        g16, dx16 = bf16_grads
    host = lambda g, dx: {**{k: np.asarray(v, np.float64) for k, v in g.items()}, "input": np.asarray(dx, np.float64)}
    g32, g16 = host(g32, dx32), host(g16, dx16)
    envelope = {name: 0.0 for name in g32}
    for d in range(draws):
        _, gn, dxn = _chain(net, _nudged(params, seed + 2 * d, nudge), _nudged(x, seed + 2 * d + 1, nudge), t,
                            cfg32, label_smoothing)
        for name, g in host(gn, dxn).items():
            envelope[name] = max(envelope[name], float(np.max(np.abs(g - g32[name]))))
    zero = zero_in_reals(params)
    return [NodeEnvelopeRow(name, g32[name].shape, float(np.max(np.abs(g16[name] - g32[name]))),
                            envelope[name], float(np.max(np.abs(g32[name]))), name in zero)
            for name in g32]


def relu_flips(net, params, x, cfg) -> tuple[int, int]:
    """ReLU inputs whose sign differs between the bf16 and the f32 forward, of all ReLU inputs: the
    cells closer to their kink than bf16's rounding moves them."""
    fwd = jax.jit(net.forward, static_argnums=2, compiler_options=QUICK)
    z16 = net.preactivations(fwd(params, x, replace(cfg, bf16=True))[1])
    z32 = net.preactivations(fwd(params, x, replace(cfg, bf16=False))[1])
    return (sum(int(np.sum((np.asarray(z16[k]) > 0) != (np.asarray(z32[k]) > 0))) for k in z32),
            sum(int(z.size) for z in z32.values()))


# ---- the report `gradtie check --bf16` prints --------------------------------------------------

@dataclass
class Bf16Report:
    """The bf16 chain of one net: erasure at identity, every conv node against rnd(f32 node at
    rounded operands) and the bound, and every gradient node against the f32 chain's envelope."""
    net: str
    rounding: str
    erasure: ErasureReport
    sites: list[SiteRow]
    nodes: list[NodeEnvelopeRow]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> list:
        """Every judged row: the erasure, each conv node, each gradient node (the input last)."""
        return [self.erasure, *self.sites, *self.nodes]

    @property
    def failed(self) -> list:
        return [r for r in self.sites if not r.ok] + [r for r in self.nodes if not r.ok]

    @property
    def ok(self) -> bool:
        return self.erasure.ok and not self.failed

    def worst(self) -> SiteRow:
        return max(self.sites, key=lambda r: r.ratio)

    def summary(self) -> str:
        w = self.worst()
        eq = sum(r.equal for r in self.sites)
        inside = sum(r.ratio <= 1 for r in self.sites)
        wn = max(self.nodes, key=lambda r: r.ratio)
        line = (f"{self.erasure.summary()}; {eq}/{len(self.sites)} conv nodes = rnd(f32 node at rounded "
                f"operands) ({self.rounding}), {inside}/{len(self.sites)} within the bound, worst "
                f"error/bound {w.ratio:.2f} ({w.label}, n={w.n}); gradient vs f32: "
                f"{sum(r.ok for r in self.nodes)}/{len(self.nodes)} nodes within {ENVELOPE_FACTOR:g}× the "
                f"2⁻⁸-nudge envelope, worst {wn.ratio:.2f}× ({wn.name})")
        if self.failed:
            first = self.failed[0]
            line += f"; first failing: {getattr(first, 'label', first.name)}"
        return line

    def table(self) -> str:
        head = f"{'conv node':<40} {'n':>7} {'= rnd(f32)':>10} {'max err/M':>10} {'bound':>9} {'ratio':>6}  ok"
        lines = [head, "-" * len(head)]
        for r in self.sites:
            lines.append(f"{r.label:<40} {r.n:>7} {'yes' if r.equal else 'NO':>10} {r.max_rel:10.2e} "
                         f"{r.bound:9.2e} {r.ratio:6.2f}  {'yes' if r.ok else 'NO'}")
        head = f"{'gradient node':<40} {'rel vs f32':>10} {'envelope':>9} {'err/env':>8}  ok"
        lines += ["", head, "-" * len(head)]
        for r in self.nodes:
            tag = " (0 in ℝ)" if r.zero_in_reals else ""
            lines.append(f"{r.name + tag:<40} {r.rel:10.2e} {r.envelope / r.scale if r.scale else 0:9.2e} "
                         f"{r.ratio:8.2f}  {'yes' if r.ok else 'NO'}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "rounding": self.rounding, "ok": self.ok, "summary": self.summary(),
                **self.meta,
                "erasure": {"ok": self.erasure.ok, "outputs": len(self.erasure.equal),
                            "differing": [n for n, e in zip(self.erasure.names, self.erasure.equal) if not e]},
                "sites": [dict(r.__dict__, ratio=r.ratio, ok=r.ok) for r in self.sites],
                "nodes": [dict(r.__dict__, shape=list(r.shape), rel=r.rel, ratio=r.ratio, limit=r.limit, ok=r.ok)
                          for r in self.nodes]}


def site_rows(sites: list[Site], rnd) -> list[SiteRow]:
    """Every conv site of a net: the rounding identity and the bound."""
    return [site_row(s.name, s.op, s.a, s.b, s.node, stride=s.stride, kernel_size=s.kernel_size,
                     rnd=rnd, bias=s.bias) for s in sites]


def rounding_name(cfg) -> str:
    r = getattr(cfg, "bf16_rounding", "bf16")
    return r if isinstance(r, str) else getattr(r, "__name__", "custom")


def check(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, key: Optional[jax.Array] = None) -> Bf16Report:
    """The bf16 chain of `net` (cfg.bf16_rounding at every conv site), run in float32: everything
    but the conv sites stays float32 (SPEC §7); errors are measured against float64."""
    _need_x64("the bf16 check")
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float32)
    t = targets_matrix(targets, cfg.num_classes, jnp.float32)
    cfg = replace(cfg, bf16=True)
    erasure = chain_erasure(net, params, x, t, cfg, label_smoothing=label_smoothing)
    sites, (loss, g16, dx16) = conv_sites(net, params, x, t, cfg, label_smoothing=label_smoothing)
    rows = site_rows(sites, stages.rounding(cfg))
    nodes = node_errors(net, params, x, t, cfg, label_smoothing=label_smoothing, bf16_grads=(g16, dx16), key=key)
    return Bf16Report(erasure.net, rounding_name(cfg), erasure, rows, nodes, {"loss": float(loss)})


# ---- replica sums -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplicaRow:
    name: str
    replicas: int
    nodes_rounded: bool      # each replica's bf16 node is rnd(S_r), bit for bit (the kind's identity)
    max_diff_rel: float      # max |mean_r rnd(S_r) − rnd(Σ_r S_r)/R| / M (M: the node's magnitude sum)
    differing: float         # fraction of entries where the two differ
    identity_zero: bool      # at rnd = identity the difference is exactly 0

    @property
    def ok(self) -> bool:
        """The difference (1/R)[Σ_r rnd(S_r) − rnd(Σ_r S_r)] is at most (1/R)(u·Σ_r|S_r| + u·|Σ_r S_r|)
        ≤ 2u·M: each of the R + 1 roundings moves a value by at most u of its size."""
        return bool(self.nodes_rounded and self.identity_zero and self.max_diff_rel <= 2 * U_BF16)


@partial(jax.jit, static_argnames=("kernel_size", "stride", "replicas", "rnd"), compiler_options=QUICK)
def _replica_nodes(x, dy, *, kernel_size, stride, replicas, rnd):
    """Per replica r: its bf16 weight-gradient node and S_r, its float32 contraction at rounded
    operands. The batch splits into R equal shards; a replica divides its loss by its own N, so its
    cotangent is R times its shard of the single-device one."""
    m = x.shape[0] // replicas
    nodes, partials = [], []
    for r in range(replicas):
        xr, dyr = x[r * m:(r + 1) * m], replicas * dy[r * m:(r + 1) * m]
        nodes.append(conv.grad_weight(xr, dyr, kernel_size=kernel_size, stride=stride, rnd=rnd))
        partials.append(conv.grad_weight(_widen(rnd(xr), x.dtype), _widen(rnd(dyr), x.dtype),
                                         kernel_size=kernel_size, stride=stride))
    mag = conv.grad_weight(jnp.abs(x.astype(jnp.float64)), jnp.abs(dy.astype(jnp.float64)),
                           kernel_size=kernel_size, stride=stride)
    return jnp.stack(nodes), jnp.stack(partials), mag


def replica_difference(x, dy, *, kernel_size: int, stride: int, replicas: int, rnd) -> dict[str, np.ndarray]:
    """The all-reduced bf16 weight gradient mean_r rnd(S_r) against rnd(Σ_r S_r)/R, in float64,
    where R bf16 values and R float32 values sum exactly."""
    _need_x64("the replica sum")
    if replicas < 1 or x.shape[0] % replicas:
        raise ValueError(f"replica sum: batch {x.shape[0]} does not split into {replicas} equal shards")
    nodes, partials, mag = _replica_nodes(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=rnd)
    rnd64 = conv.identity if rnd is conv.identity else conv.round_bf16   # rnd on float64 values
    nodes, s = np.asarray(nodes, np.float64), np.asarray(partials, np.float64)
    rounded = np.asarray(rnd64(jnp.asarray(s)))                       # rnd(S_r)
    mean_of_rounded = nodes.sum(0) / replicas                          # what the all-reduce returns
    rounded_of_sum = np.asarray(rnd64(jnp.asarray(s.sum(0)))) / replicas
    return {"nodes": nodes, "rounded": rounded, "mean_of_rounded": mean_of_rounded,
            "rounded_of_sum": rounded_of_sum, "diff": mean_of_rounded - rounded_of_sum,
            "formula": (rounded.sum(0) - np.asarray(rnd64(jnp.asarray(s.sum(0))))) / replicas,
            "mag": np.asarray(mag)}


def replica_sum(name: str, x, dy, *, kernel_size: int, stride: int, replicas: int, rnd=conv.round_bf16):
    """One weight-gradient site split over R replicas -> (ReplicaRow, the arrays under `rnd`)."""
    d = replica_difference(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=rnd)
    d_id = replica_difference(x, dy, kernel_size=kernel_size, stride=stride, replicas=replicas, rnd=conv.identity)
    live = d["mag"] > 0
    rel = np.abs(d["diff"][live]) / d["mag"][live]
    row = ReplicaRow(name, replicas, bool(np.array_equal(d["nodes"], d["rounded"])), float(rel.max(initial=0.0)),
                     float(np.mean(d["diff"] != 0)), bool(np.all(d_id["diff"] == 0)))
    return row, d


def replica_rows(sites: list[Site], replicas: int, rnd) -> tuple[list[ReplicaRow], dict[str, dict]]:
    """Every weight-gradient site of a net, split over R replicas."""
    rows, arrays = [], {}
    for s in sites:
        if s.op == "grad_weight":
            row, arrays[s.name] = replica_sum(s.name, s.a, s.b, kernel_size=s.kernel_size, stride=s.stride,
                                              replicas=replicas, rnd=rnd)
            rows.append(row)
    return rows, arrays


# ---- what the compiler keeps ------------------------------------------------------------------

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


def _rounds(f, x) -> bool:
    y = np.asarray(f(x))
    want = np.asarray(conv.round_bf16(x))
    return bool(np.array_equal(y, want) and not np.array_equal(y, np.asarray(x)))


def hlo_cast_roundtrip(x) -> HloFacts:
    """x.astype(bf16).astype(f32) under jit: does the optimized HLO keep the convert pair, and does
    the compiled function round? (CPU: kept, it rounds; upstream measured XLA GPU deleting it.)"""
    f = jax.jit(lambda a: a.astype(jnp.bfloat16).astype(a.dtype))
    text = f.lower(x).compile().as_text()
    return HloFacts("cast round-trip f32→bf16→f32", jax.default_backend(), convert_ops(text), _rounds(f, x), text)


def hlo_nearest(x) -> HloFacts:
    """conv.round_bf16 under jit: integer ops on the bits, no convert for a compiler to fold."""
    f = jax.jit(conv.round_bf16)
    text = f.lower(x).compile().as_text()
    return HloFacts("round_bf16 (integer ops)", jax.default_backend(), convert_ops(text), _rounds(f, x), text)


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


# ---- controls: planted bugs, each named for what it breaks ------------------------------------

def drop_bias_forward(x, weight, bias, *, stride: int = 1, rnd=conv.identity):
    """The forward kind that forgets the bias: breaks erasure (conv biases of cifar8)."""
    return conv.forward(x, weight, None, stride=stride, rnd=rnd)[0]


def same_padding_forward(x, weight, bias=None, *, stride: int = 1, rnd=conv.identity):
    """The forward kind with XLA 'SAME' padding (asymmetric on strided convs): breaks erasure."""
    y = lax.conv_general_dilated(_widen(rnd(x), x.dtype), _widen(rnd(weight), x.dtype), (stride, stride), "SAME",
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=x.dtype)
    y = _widen(rnd(y), x.dtype)
    return y if bias is None else y + bias[None, :, None, None]


def grad_weight_rounded_per_example(x, dy, *, kernel_size: int, stride: int = 1, rnd=conv.identity):
    """The weight-grad kind rounding INSIDE the batch sum, Σ_n rnd(S_n): at identity it reassociates
    the float32 sum (breaks erasure), under bf16 it is not rnd(f32 node at rounded operands)."""
    parts = [conv.grad_weight(x[i:i + 1], dy[i:i + 1], kernel_size=kernel_size, stride=stride, rnd=rnd)
             for i in range(x.shape[0])]
    return sum(parts[1:], parts[0])


def forward_result_only(x, weight, bias=None, *, stride: int = 1, rnd=conv.round_bf16):
    """The forward kind rounding only its result, rnd(conv(x, W)): not rnd(f32 node at rounded operands)."""
    y = conv.forward(x, weight, None, stride=stride)[0]
    y = _widen(rnd(y), x.dtype)
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

    def step(acc, p_i):
        return conv.round_bf16(acc + p_i), None

    acc, _ = lax.scan(step, jnp.zeros_like(prods[:, :, 0]), jnp.moveaxis(prods, 2, 0))
    return acc
