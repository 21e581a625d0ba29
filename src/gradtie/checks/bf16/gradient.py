"""The whole bf16 gradient: every node of the bf16 chain against its own op's derivative.

A bf16 chain rounds every conv operand and result to 8 bits, so it is not the f32 chain, and on a
small batch it is not even close to it: a 2⁻⁸ change of the inputs flips ReLU masks and, through
BatchNorm over few cells, moves whole nodes (`f32_distance` measures how far; it is beyond the suite,
and no verdict can stand on it: a node returned as zeros sits about as far from the f32 node). It is
not close to itself either: a bf16 rounding that lands one ulp apart spreads, so two float32
evaluations of one whole bf16 chain differ by percents.

The verdict holds each node where the suite does (`cifar8Bbn_train_step_tiedB`, `r34_net_tiedB`,
at the bf16 flag: `ConvWTiedBAt bf16`, `convWeightGradBBf16`): at the cotangent the rendered chain
threads to it. We run the chain once and record every parameter node's call — its input and the
cotangent it reads — and the input cotangent's; the reference is the VJP of that one op's forward
(the autodiff oracle) at those same arrays, in float64, with a bf16 rounding point rounding the value
going forward and the cotangent coming back, as a bf16 kind does to its operands and its result. No
rounding decision is shared across ops, so nothing spreads: a node differs from its reference only
by float32 arithmetic and, for a kind, by an entry whose result rounds one bf16 ulp the other way.

The limit is the point's own envelope: the same reference run in float32, the chain's precision,
against float64 (its accumulation may round a kind's entry the other way too), at the recorded
arrays and at `BF16_GRADIENT_DRAWS` − 1 copies nudged by float32's own round-off. Per node we compare
two numbers, each within `BF16_GRADIENT_FACTOR` times its envelope (floored, `node_floors`): the
error's size ‖g − r‖ and its component along the node, c = ⟨g − r, r⟩/‖r‖². A node zeroed (c = −1),
sign-flipped (c = −2) or scaled by 1.01 (c = 0.01) fails; so the controls (`controls`). Rounding
the forward and input-backward sites goes beyond the suite, whose bf16 switch is on the conv
weight-gradient nodes. Shown in: bf16 erasure.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Optional
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from ... import prng, reference
from ...ops import batchnorm, conv, dense
from ..tie import rendered, targets_matrix, zero_in_reals
from ...tolerances import (BF16_F32_DISTANCE_DRAWS, BF16_F32_DISTANCE_NUDGE, BF16_GRADIENT_DRAWS, BF16_GRADIENT_FACTOR,
                          BF16_GRADIENT_NUDGE, BF16_ONE_ULP)
from .kinds import QUICK, U_F32, _chain


# ---- the reference's rounding ------------------------------------------------------------------

@jax.custom_vjp
def _rne_both(a):
    """bf16 round-to-nearest-even of the value; the cotangent coming back is rounded too."""
    return conv.round_bf16(a)


_rne_both.defvjp(lambda a: (conv.round_bf16(a), None), lambda _, ct: (conv.round_bf16(ct),))


def _reference_rounding(cfg):
    """The reference's rounding: the same values as the chain's, differentiable."""
    rounding = getattr(cfg, "bf16_rounding", "bf16")
    if not cfg.bf16 or rounding == "identity":
        return None
    if rounding not in ("bf16", "nearest"):
        raise ValueError(f"the bf16 gradient verdict replays a named rounding ('bf16', 'nearest' or "
                         f"'identity'), got {rounding!r}")
    return _rne_both


# ---- the chain, with every node's call recorded -------------------------------------------------
#
# The nets call the op kit through its modules, so wrapping the entry points that make a node sees
# each call with its arguments; a node is then named by the very array the backward returns.

NODE_OPS = {"conv.grad_weight": (conv, "grad_weight"), "conv.grad_bias": (conv, "grad_bias"),
            "conv.backward": (conv, "backward"), "batchnorm.grad_weight": (batchnorm, "grad_weight"),
            "batchnorm.grad_bias": (batchnorm, "grad_bias"), "dense.grad_weight": (dense, "grad_weight"),
            "dense.grad_bias": (dense, "grad_bias")}


@contextmanager
def _recording(log: list):
    originals = {label: getattr(module, attr) for label, (module, attr) in NODE_OPS.items()}

    def wrap(label):
        def recorded(*args, **kwargs):
            out = originals[label](*args, **kwargs)
            log.append((label, args, kwargs, out))
            return out
        return recorded

    patches = [mock.patch.object(module, attr, wrap(label)) for label, (module, attr) in NODE_OPS.items()]
    for p in patches:
        p.start()
    try:
        yield log
    finally:
        for p in reversed(patches):
            p.stop()


_TAPES: dict = {}   # (net, cfg, α) -> (the jitted recorded chain, the statics its trace read)


def _arrays(tree):
    return [a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)]


def node_calls(net, params, x, targets, cfg, *, label_smoothing: float = 0.0) -> dict:
    """Run the rendered chain once (jitted) -> {node name: (op, array arguments, static keywords,
    node)}, every parameter node and "input", the input cotangent."""
    key = (net, cfg, label_smoothing)
    if key not in _TAPES:
        statics: dict = {}

        def run(p, x_, t_):
            log: list = []
            with _recording(log):
                _, grads, dx = rendered(net, p, x_, t_, cfg, label_smoothing)
            by_id = {id(out): i for i, (*_, out) in enumerate(log)}
            picked = {name: by_id[id(g)] for name, g in {**grads, "input": dx}.items()}
            statics.clear()
            out = {}
            for name, i in picked.items():
                label, args, kwargs, node = log[i]
                arrays = [a for a in args if not isinstance(a, batchnorm.BNSaved)]
                bn = [a for a in args if isinstance(a, batchnorm.BNSaved)]
                bn_statics = (bn[0].eps, bn[0].per_example) if bn else None
                arrays = ([bn[0].x, bn[0].mean, bn[0].var] if bn else []) + arrays
                statics[name] = (label, {k: v for k, v in kwargs.items() if k != "rnd"}, bn_statics)
                out[name] = (arrays, node)
            return out

        _TAPES[key] = (jax.jit(run, compiler_options=QUICK), statics)
    run, statics = _TAPES[key]
    out = run(params, x, targets)
    return {name: (statics[name][0], arrays, statics[name][1], statics[name][2], node)
            for name, (arrays, node) in out.items()}


def _reference(label: str, arrays: list, kw: dict, bn_statics, node_shape, rnd):
    """The VJP of the op that made a node, at its recorded arrays (all of one float dtype)."""
    if label == "conv.grad_weight":
        x, dy = arrays
        w = jnp.zeros(node_shape, x.dtype)        # dW does not depend on W
        _, pull = jax.vjp(lambda w_: conv.forward(x, w_, None, stride=kw.get("stride", 1), rnd=rnd)[0], w)
        return pull(dy)[0]
    if label == "conv.backward":
        w, dy = arrays
        x = jnp.zeros(kw["input_shape"], dy.dtype)
        _, pull = jax.vjp(lambda x_: conv.forward(x_, w, None, stride=kw.get("stride", 1), rnd=rnd)[0], x)
        return pull(dy)[0]
    if label in ("conv.grad_bias", "batchnorm.grad_bias", "dense.grad_bias"):
        (dy,) = arrays
        c = dy.shape[1]
        if label == "dense.grad_bias":
            return reference.dense_vjp(jnp.zeros((dy.shape[0], 1), dy.dtype), jnp.zeros((c, 1), dy.dtype),
                                       jnp.zeros(c, dy.dtype), dy)[2]
        x = jnp.zeros(dy.shape, dy.dtype)       # the bias is added after the kind: Σ dy, unrounded
        w = jnp.zeros((c, c, 1, 1), dy.dtype)
        _, pull = jax.vjp(lambda b_: conv.forward(x, w, b_, rnd=rnd)[0], jnp.zeros(c, dy.dtype))
        return pull(dy)[0]
    if label == "batchnorm.grad_weight":
        # ∂/∂γ of the BN output γ·x̂ + β, x̂ from the statistics the forward computed at this point
        x, mean, var, dy = arrays
        eps, per_example = bn_statics
        stat = (lambda v: v[:, :, None, None]) if per_example else (lambda v: v[None, :, None, None])
        xhat = (x - stat(mean)) * jax.lax.rsqrt(stat(var) + eps)
        gamma = jnp.ones(x.shape[1], x.dtype)
        _, pull = jax.vjp(lambda g: g[None, :, None, None] * xhat, gamma)
        return pull(dy)[0]
    if label == "dense.grad_weight":
        x, dy = arrays
        return reference.dense_vjp(x, jnp.zeros(node_shape, x.dtype), jnp.zeros(node_shape[0], x.dtype), dy)[1]
    raise ValueError(f"no reference for {label}")


@partial(jax.jit, static_argnums=(1, 2), compiler_options=QUICK)
def _references(arrays: dict, specs: tuple, rnd) -> dict:
    return {name: _reference(label, arrays[name], dict(kw), bn_statics, shape, rnd)
            for name, label, kw, bn_statics, shape in specs}


def reference_nodes(calls: dict, cfg, dtype, *, nudge: float = 0.0, seed: int = 0) -> dict:
    """Every recorded node's reference (one compiled program), its arrays cast to `dtype` and, with
    `nudge`, each entry moved by a relative nudge·ξ (ξ standard normal, drawn on the host)."""
    rng = np.random.default_rng(seed)

    def prepare(a):
        if not nudge:
            return a.astype(dtype)
        a = np.asarray(a)
        return jnp.asarray((a * (1 + nudge * rng.standard_normal(a.shape))).astype(dtype))
    specs = tuple((name, label, tuple(sorted(kw.items())), bn_statics, tuple(node.shape))
                  for name, (label, _, kw, bn_statics, node) in calls.items())
    arrays = {name: [prepare(a) for a in arrays] for name, (_, arrays, *_) in calls.items()}
    return _references(arrays, specs, _reference_rounding(cfg))


# ---- one node's verdict -------------------------------------------------------------------------

@dataclass(frozen=True)
class GradientRow:
    """One node of the bf16 chain against its op's float64 reference r."""
    name: str
    size: int
    zero_in_reals: bool      # 0 in ℝ (a conv bias behind BN): both sides are round-off
    err: float               # ‖g − r‖
    along: float             # c = ⟨g − r, r⟩ / ‖r‖²: the error along the node (0 for 0-in-ℝ nodes)
    scale: float             # ‖r‖
    envelope: float          # max ‖r32 − r‖: the reference in float32 against float64
    envelope_along: float    # max |⟨r32 − r, r⟩| / ‖r‖²
    floor: float             # the smallest envelope we allow (see `node_floors`)
    floor_along: float
    gg: float                # ‖g‖², ⟨g, r⟩: what a scaled node's numbers follow from
    gr: float
    control: str = ""        # "" for the chain's own node, else what was planted

    @property
    def limit(self) -> float:
        return BF16_GRADIENT_FACTOR * max(self.envelope, self.floor)

    @property
    def limit_along(self) -> float:
        return BF16_GRADIENT_FACTOR * max(self.envelope_along, self.floor_along)

    @property
    def ratio(self) -> float:
        """The larger of err/limit and |c|/limit_along: ≤ 1 passes."""
        r = self.err / self.limit if self.limit > 0 else (0.0 if self.err == 0 else np.inf)
        if not self.zero_in_reals:
            r = max(r, abs(self.along) / self.limit_along)
        return float(r)

    @property
    def rel(self) -> float:
        return self.err / self.scale if self.scale > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    def scaled(self, s: float, control: Optional[str] = None) -> "GradientRow":
        """The same node returned as s·g: zeroed (0), sign-flipped (−1), scaled (1.01)."""
        rr = self.scale ** 2
        err = float(np.sqrt(max(s * s * self.gg - 2 * s * self.gr + rr, 0.0)))
        along = (s * self.gr - rr) / rr if rr > 0 else 0.0
        return replace(self, err=err, along=along, gg=s * s * self.gg, gr=s * self.gr,
                       control=control or f"×{s:g}")


def node_floors(name: str, r: np.ndarray, zero: bool) -> tuple[float, float]:
    """(floor, floor along) for a node whose reference is r. A conv weight node is a bf16 kind's
    result: two float32 sums of the same products may round one entry one bf16 ulp apart, so we never
    ask for less than one entry off by BF16_ONE_ULP (the largest entry, the worst case). Every other
    node is float32 arithmetic: float32's resolution of the node."""
    rr = float(np.vdot(r, r))
    if zero or rr == 0:
        return 0.0, 0.0
    if r.ndim == 4:
        big = float(np.max(np.abs(r)))
        return BF16_ONE_ULP * big, BF16_ONE_ULP * big * big / rr
    return U_F32 * np.sqrt(rr), U_F32


def gradient_rows(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, seed: int = 0,
                  draws: int = BF16_GRADIENT_DRAWS) -> list[GradientRow]:
    """Every node of the bf16 chain (and the input cotangent, last) against its op's reference."""
    cfg = replace(cfg, bf16=True)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    calls = node_calls(net, params, x, t, cfg, label_smoothing=label_smoothing)
    r64 = reference_nodes(calls, cfg, jnp.float64)
    r32 = [reference_nodes(calls, cfg, jnp.float32)]
    r32 += [reference_nodes(calls, cfg, jnp.float32, nudge=BF16_GRADIENT_NUDGE, seed=seed + d)
            for d in range(draws - 1)]
    zero = zero_in_reals(params)
    rows = []
    for name in [*params, "input"]:
        g = np.asarray(calls[name][-1], np.float64)
        r = np.asarray(r64[name], np.float64)
        z = name in zero
        rr = float(np.vdot(r, r))
        along = rr > 0 and not z
        env, env_along = 0.0, 0.0
        for other in r32:
            d = np.asarray(other[name], np.float64) - r
            env = max(env, float(np.linalg.norm(d)))
            env_along = max(env_along, abs(float(np.vdot(d, r))) / rr if along else 0.0)
        floor, floor_along = node_floors(name, r, z)
        rows.append(GradientRow(name, int(r.size), z, float(np.linalg.norm(g - r)),
                                float(np.vdot(g - r, r)) / rr if along else 0.0, float(np.sqrt(rr)),
                                env, env_along, floor, floor_along, float(np.vdot(g, g)), float(np.vdot(g, r))))
    return rows


CONTROLS = {"zeroed": 0.0, "sign-flipped": -1.0, "scaled ×1.01": 1.01}


def controls(rows: list[GradientRow]) -> dict[str, list[GradientRow]]:
    """Each control applied to every node that is not 0 in ℝ (there a zeroed or flipped node is as
    right as the chain's: both are round-off): {control: rows}. Every one of them must fail."""
    return {label: [r.scaled(s, label) for r in rows if not r.zero_in_reals] for label, s in CONTROLS.items()}


# ---- how far the bf16 gradient sits from the f32 one (beyond the suite; no verdict) -------------

@dataclass(frozen=True)
class F32DistanceRow:
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
    def ratio(self) -> float:
        """err / envelope: about 1 when the bf16 chain moves the node as a bf16 nudge does."""
        return self.err / max(self.envelope, U_F32 * self.scale, np.finfo(np.float64).tiny)


def _nudged(tree, seed: int, nudge: float):
    """Every entry times (1 + nudge·ξ), ξ standard normal, drawn on the host (no compile per shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a) * (1 + nudge * rng.standard_normal(a.shape)).astype(a.dtype)),
                        tree)


def f32_distance(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, bf16_grads=None,
                 key: Optional[jax.Array] = None, draws: int = BF16_F32_DISTANCE_DRAWS,
                 nudge: float = BF16_F32_DISTANCE_NUDGE) -> list[F32DistanceRow]:
    """Whole-net bf16 nodes (and the input cotangent) against the f32 chain at the same point, each
    with the f32 chain's spread under `draws` random relative nudges of every weight and pixel."""
    seed = int(prng.randint(jax.random.key(0) if key is None else key, (), 0, 2 ** 31 - 1))
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
    return [F32DistanceRow(name, g32[name].shape, float(np.max(np.abs(g16[name] - g32[name]))),
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
