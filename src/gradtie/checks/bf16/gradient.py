"""The bf16 gradient, stage by stage: each stage of the bf16 chain against the VJP of that stage
alone, at the input, the cotangent and the rounding decisions the chain hands it.

A bf16 chain is not the f32 chain, and on a small batch not even close to it (`f32_distance`:
rounding flips ReLU masks, and BatchNorm over few cells moves whole nodes; beyond the suite, and
no verdict can stand on it). Nor is it close to itself: one float32 ulp next to a bf16 rounding
boundary moves a rounded entry by a bf16 ulp, which BatchNorm over few cells spreads.

So we tie it where the suite does (`cifar8Bbn_train_step_tiedB`, `r34_net_tiedB` at the bf16 flag:
`ConvWTiedBAt bf16`, `convWeightGradBBf16`), stage by stage as `checks.stages` does in float64: the
chain runs once with a tape (each stage's input and cotangent) and a recording kit (each conv
site's operands and results), and each stage's nodes and the cotangent it hands on are tied to the
float64 VJP of the stage's forward there (`gradtie.reference`), every conv site a kind frozen at
the chain's rounding decisions: its rounded input, weight and output are the chain's, and each
cotangent into and out of its contraction is rounded as the kit's backwards round it — the chain's
way where the chain's value lies within one ulp. No rounding can flip between the two sides; what
is left is float32 arithmetic, held to the point's float32 envelope (`checks.envelope`) times
F32_ENVELOPE_FACTOR, floored at float32's floor. A wrong BatchNorm, pool, ReLU, residual or head
backward parts at the stage holding it, and so does a conv backward off by more than an ulp; under
one ulp a bug can hide in the chain's rounding, bf16's resolution. The loss cotangent is tied to
autodiff of the loss. Rounding the forward and input-backward sites goes beyond the suite, whose
bf16 switch is on the weight-gradient nodes. Shown in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ... import reference, rendered
from ... import tolerances as tol
from ...host import to_device, tree_to_device
from ...kit import KIT
from ...nets.protocol import Pass, as_net
from ...ops import conv, maxpool
from .. import envelope as env_
from .. import stages
from ..tie import Chain, TieReport, bn_cells, bn_of, compare, need_x64, targets_matrix, zero_in_reals
from .kinds import U_F32
from .sites import run


# ---- the reference: each stage's VJP with the chain's rounding decisions --------------------------

NEAREST = ("bf16", "nearest", conv.bf16_operand, conv.round_bf16)   # roundings to nearest bf16


def _ulp(t):
    """One bf16 ulp of each entry of a bf16-valued array (0 at 0)."""
    return jnp.exp2(jnp.floor(jnp.log2(jnp.abs(t))) - 7)


@jax.custom_vjp
def _rounded_cotangent(v, target, pre):
    """v going forward; coming back, the cotangent rounded to bf16 as a kind rounds it — the chain's
    rounded value `target` wherever the cotangent lies within one ulp of the chain's own `pre`."""
    return v


def _rounded_cotangent_bwd(res, ct):
    target, pre = res
    snapped = jnp.where(jnp.abs(ct - pre) <= _ulp(target), target, conv.round_bf16(ct))
    return snapped, jnp.zeros_like(target), jnp.zeros_like(pre)


_rounded_cotangent.defvjp(lambda v, target, pre: (v, (target, pre)), _rounded_cotangent_bwd)


def _frozen_kit(rec: dict):
    """KIT with every conv forward a bf16 kind frozen at the chain's rounding decisions: its rounded
    input, weight and output are the chain's (`rec[name]`: x, y, and the backward's dc, dx, dw), its
    derivative the kind's (every cotangent into and out of the contraction rounded, as the kit's conv
    backwards round, and rounded the chain's way where the chain's value lies within one ulp)."""
    def conv_forward(name, x, w, b=None, *, stride=1, rnd=None, formulation=None):
        r = rec[name]
        def frozen(value, v, target, pre):   # value going forward, v's derivative coming back
            return value + (_rounded_cotangent(v, target, pre) - lax.stop_gradient(v))
        xs = frozen(conv.round_bf16(r["x"]), x, r["dx"], r["dx"])
        ws = frozen(conv.round_bf16(w), w, r["dw"], r["dw"])
        z = conv.forward(xs, ws, None, stride=stride, formulation=formulation)[0]
        y = frozen(r["y"], z, conv.round_bf16(r["dc"]), r["dc"])
        return (y if b is None else y + (b - lax.stop_gradient(b))[None, :, None, None]), conv.ConvSaved(x, stride)
    return KIT._replace(conv_forward=conv_forward)


def _kit(acts, nodes):
    return KIT if acts is None else _frozen_kit({k: {**acts[k], **nodes[k]} for k in acts})


@partial(jax.jit, static_argnums=(0, 1))
def _selections(net, cfg, params, inputs, acts, nodes):
    """σ = argmax of every pool, read off each stage's reference forward at its recorded input."""
    sel = {}
    for stage in net.stage_list(cfg):
        _, saved = stage.forward(params, inputs[stage.name], cfg, Pass(kit=_kit(acts, nodes)))
        sel.update({k: maxpool.select(r, net.pools[k]) for k, r in stage.pool_inputs(saved).items()})
    return sel


@partial(jax.jit, static_argnums=(0, 1))
def _vjps(net, cfg, params, inputs, dys, acts, nodes, sel):
    """Every stage's VJP alone at its input and cotangent, the chain's rounding decisions frozen
    (`acts`, `nodes`: `_recorded`; None: no bf16 site) and its pools at σ (`sel`)."""
    how = Pass(kit=_kit(acts, nodes), selections=sel or None)
    return {stage.name: reference.vjp(lambda p, a, st=stage: st.forward(p, a, cfg, how)[0],
                                      {k: params[k] for k in stage.params}, inputs[stage.name],
                                      cotangent=dys[stage.name])
            for stage in net.stage_list(cfg)}


def _recorded(sites) -> tuple[dict, dict]:
    """The chain's conv sites by layer -> ({layer: the forward's input x and rounded output y, the
    cotangent dc its backwards read, the input cotangent dx they return}, {layer: the weight node dw})."""
    rec: dict = {}
    for s in sites:
        r = rec.setdefault(s.name, {})
        if s.op == "forward":
            r.update(x=s.a, y=s.node)       # with its bias: the frozen kit adds the bias's derivative only
        elif s.op == "backward":
            r.update(dc=s.a, dx=s.node)
        else:
            r.update(dw=s.node)
    return ({k: {f: r[f] for f in ("x", "y", "dc", "dx")} for k, r in rec.items()},
            {k: {"dw": r["dw"]} for k, r in rec.items()})


def stage_ties(net, params, x, targets, cfg, *, chain: Optional[Chain] = None, label_smoothing: float = 0.0,
               key: Optional[jax.Array] = None, factor: float = tol.F32_ENVELOPE_FACTOR, how: str = "quick",
               ran: Optional[tuple] = None) -> stages.StageReport:
    """Tie every stage of the bf16 chain (`chain`, default the net's own; cfg.bf16_rounding at every
    conv site), run in float32, to its stage's float64 VJP at the chain's own stage input, cotangent
    and rounding decisions, within `factor` × the point's envelope; and the loss cotangent to
    autodiff of the loss. ran: `sites.run`'s output at this point, when already run."""
    need_x64("the bf16 stage ties")
    net = as_net(net)
    chain = chain or Chain(net)
    key = jax.random.key(0) if key is None else key
    cfg = replace(cfg, bf16=True)
    if cfg.bf16_rounding not in ("identity", *NEAREST):
        raise ValueError(f"the bf16 stage ties freeze a named rounding ('bf16', 'nearest' or 'identity'), "
                         f"got {cfg.bf16_rounding!r}")
    params = {k: to_device(v, np.float32) for k, v in params.items()}
    x = to_device(x, np.float32)
    t = targets_matrix(targets, cfg.num_classes, jnp.float32)
    out, tape, sites = ran or run(chain, params, x, t, cfg, label_smoothing=label_smoothing, how=how)
    stage_list = net.stage_list(cfg)
    names = [s.name for s in stage_list]
    acts, nodes = (None, None) if cfg.bf16_rounding == "identity" else _recorded(sites)
    values = {"params": params, "inputs": tape.inputs, "dys": tape.cotangents, "acts": acts, "nodes": nodes}
    wide = {k: tree_to_device(v, np.float64) for k, v in values.items()}
    values["sel"] = _selections(net, cfg, wide["params"], wide["inputs"], wide["acts"], wide["nodes"])
    vjps = lambda v: _vjps(net, cfg, v["params"], v["inputs"], v["dys"], v["acts"], v["nodes"], v["sel"])  # noqa: E731
    ref = vjps({**wide, "sel": values["sel"]})
    outputs = []
    for smp in env_.samples(values, dtype="float32", key=key, nudged=("params", "inputs", "dys"),
                            batched=("inputs", "dys", "acts", "sel")):
        o = vjps(tree_to_device(smp.values))
        outputs.append({k: (g, env_.unorder(dx, smp.order)) for k, (g, dx) in o.items()})
    worst = env_.spread(ref, outputs)
    cells_ = bn_cells(net, wide["params"], to_device(x, np.float64), cfg)
    cells = {k: cells_[b] for k in params if (b := bn_of(k, cells_)) is not None}
    zero, ties = zero_in_reals(params), []
    for i, stage in enumerate(stage_list):
        (g_o, dx_o), (g_w, dx_w) = ref[stage.name], worst[stage.name]
        handed_on = out.dx if i == 0 else tape.cotangents[names[i - 1]]
        rows = compare({k: out.grads[k] for k in stage.params}, g_o, envelope={**g_w, "input": dx_w}, factor=factor,
                       floor=tol.FLOORS["float32"], zero_nodes=zero & set(stage.params), dx=(handed_on, dx_o),
                       cells={k: cells[k] for k in stage.params if k in cells},
                       shapes={k: tuple(np.shape(params[k])) for k in stage.params} | {"input": tuple(np.shape(dx_o))})
        ties.append(TieReport(stage.name, "bf16", rows, 0.0, 0.0, meta={
            "kind": stage.kind, "lean": net.stage_lean.get(stage.kind, ""), "factor": factor,
            "cotangent_max": float(np.max(np.abs(np.asarray(tape.cotangents[stage.name], np.float64))))}))
    record = stages.Record(net, chain, params, x, tape.inputs, tape.cotangents, out.grads, out.dx, out.logits,
                           tape.cotangents[names[-1]], float(out.loss), t, label_smoothing)
    cot = stages._cotangent_report(net, record, dtype="float32", key=jax.random.fold_in(key, 1), factor=factor)
    return stages.StageReport(chain.label, "bf16", "stages", ties, cot,
                              meta={"loss": float(out.loss), "bn_cells": cells_, "factor": factor,
                                    "rounding": rounding_name(cfg)})


def rounding_name(cfg) -> str:
    r = cfg.bf16_rounding
    return r if isinstance(r, str) else getattr(r, "__name__", "custom")


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


def f32_distance(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, bf16_grads=None,
                 key: Optional[jax.Array] = None, draws: int = tol.BF16_F32_DISTANCE_DRAWS,
                 nudge: float = tol.BF16_F32_DISTANCE_NUDGE) -> list[F32DistanceRow]:
    """Whole-net bf16 nodes (and the input cotangent) against the f32 chain at the same point, each
    with the f32 chain's spread under `draws` random relative nudges of every weight and pixel."""
    net = as_net(net)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    alpha = float(label_smoothing)
    cfg32 = replace(cfg, bf16=False)

    def host(grads, dx):
        return {**{k: np.asarray(grads[k], np.float64) for k in params}, "input": np.asarray(dx, np.float64)}

    def nodes(p, x_, c):
        out = rendered.quick(net, Chain(net).kit, p, x_, t, c, alpha=alpha)
        return host(out.grads, out.dx)
    g32 = nodes(params, x, cfg32)
    g16 = nodes(params, x, replace(cfg, bf16=True)) if bf16_grads is None else host(*bf16_grads)
    spread = {name: 0.0 for name in g32}
    rng = env_.host_rng(jax.random.key(0) if key is None else key)
    nudged = lambda a: to_device(np.asarray(a) * (1 + nudge * rng.standard_normal(np.shape(a))), a.dtype)  # noqa: E731
    for _ in range(draws):
        gn = nodes(jax.tree.map(nudged, params), nudged(x), cfg32)
        spread = {k: max(v, float(np.max(np.abs(gn[k] - g32[k])))) for k, v in spread.items()}
    zero = zero_in_reals(params)
    return [F32DistanceRow(k, g32[k].shape, float(np.max(np.abs(g16[k] - g32[k]))), spread[k],
                           float(np.max(np.abs(g32[k]))), k in zero) for k in g32]


def relu_flips(net, params, x, cfg) -> tuple[int, int]:
    """ReLU inputs whose sign differs between the bf16 and the f32 forward, of all ReLU inputs: the
    cells closer to their kink than bf16's rounding moves them."""
    net = as_net(net)
    z16 = net.preactivations(rendered.forward(net, params, x, replace(cfg, bf16=True))[1])
    z32 = net.preactivations(rendered.forward(net, params, x, replace(cfg, bf16=False))[1])
    return (sum(int(np.sum((np.asarray(z16[k]) > 0) != (np.asarray(z32[k]) > 0))) for k in z32),
            sum(int(z.size) for z in z32.values()))

