"""The bf16 gradient, stage by stage, and what `gradtie check --bf16` reports.

A bf16 chain is close neither to the f32 chain on a small batch (`f32_distance`: no verdict stands
on it) nor to itself: a float32 ulp next to a rounding boundary moves an entry by a bf16 ulp, which
BatchNorm over few cells spreads. So each stage is tied where the suite ties it (`ConvWTiedBAt
bf16`) with `checks.stages`' ties, every conv site of the reference a kind frozen at the chain's
rounding decisions (`_frozen_kit`): what is left is float32 arithmetic, held to F32_ENVELOPE_FACTOR
× the point's float32 envelope. A bug parts at its stage unless it stays under one bf16 ulp wherever
it meets a rounding: bf16's resolution. Shown in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ... import rendered
from ... import tolerances as tol
from ...host import to_device, tree_to_device
from ... import policy as policy_
from ...kit import KIT
from ...nets.layers import rounding, zero_in_reals
from ...nets.protocol import Pass
from ...ops import conv, maxpool
from .. import bugs, stages
from .. import envelope as env_
from ..tie import Chain, Limit, NodeRow, Point, bn_cells, compare, need_x64, node_cells, targets_matrix
from .kinds import U_BF16, U_F32, ErasureReport, chain_erasure
from .sites import SiteRow, conv_sites, policy_sites, site_rows

@jax.custom_vjp
def _frozen(value, v, target, pre):
    """`value` going forward; coming back, v's cotangent rounded to bf16 as a kind rounds it: the
    chain's rounded value `target` wherever the cotangent lies within one ulp of the chain's `pre`."""
    return value


def _frozen_bwd(res, ct):
    target, pre = res
    ulp = jnp.exp2(jnp.floor(jnp.log2(jnp.abs(target))) - 7)     # one bf16 ulp of each entry (0 at 0)
    snapped = jnp.where(jnp.abs(ct - pre) <= ulp, target, conv.round_bf16(ct))
    return jnp.zeros_like(ct), snapped, jnp.zeros_like(target), jnp.zeros_like(pre)


_frozen.defvjp(lambda value, v, target, pre: (value, (target, pre)), _frozen_bwd)


def _frozen_kit(acts: Optional[dict], dws: Optional[dict], *, bias_rounded: bool = False):
    """KIT with every conv forward a bf16 kind frozen at the chain's rounding decisions (None: KIT):
    its rounded input, weight and output are the chain's (acts[layer]: x, y and the backward's dc,
    dx; dws[layer]: dw), its derivative the kind's (every cotangent into and out of the contraction
    rounded as the kit's conv backwards round, the chain's way where it lies within one ulp). Under
    the bf16 execution policy every BatchNorm output is frozen too (acts[bn layer]: n and the
    cotangent the chain handed back at it): the policy rounds it to bf16, and a conv's bias node
    (`bias_rounded`) sums the bf16 cotangent the chain rounded at the conv output, as the conv's own
    backward reads it (in a float32 chain it sums the float32 one)."""
    if acts is None:
        return KIT

    def bn_forward(name, c, gamma, beta, **kw):
        n, saved = KIT.bn_forward(name, c, gamma, beta, **kw)
        if name not in acts:
            return n, saved
        n0, dn = acts[name]
        return _frozen(n0, n, conv.round_bf16(dn), dn), saved

    def conv_forward(name, x, w, b=None, *, stride=1, rnd=None, formulation=None, precision=None):
        (x0, y0, dc, dx), dw = acts[name], dws[name]
        xs, ws = _frozen(conv.round_bf16(x0), x, dx, dx), _frozen(conv.round_bf16(w), w, dw, dw)
        y = conv.forward(xs, ws, None, stride=stride, formulation=formulation)[0]
        zero_bias = None if b is None else (b - lax.stop_gradient(b))[None, :, None, None]   # 0, carrying db
        if b is not None and bias_rounded:
            return _frozen(y0, y + zero_bias, conv.round_bf16(dc), dc), conv.ConvSaved(x, stride)
        y = _frozen(y0, y, conv.round_bf16(dc), dc)
        return (y if b is None else y + zero_bias), conv.ConvSaved(x, stride)
    return KIT._replace(conv_forward=conv_forward, bn_forward=bn_forward)


def _frozen_policy_kit(acts: Optional[dict], dws: Optional[dict]):
    """`_frozen_kit` for the bf16 execution policy's chain (its conv biases read bf16 cotangents)."""
    return _frozen_kit(acts, dws, bias_rounded=True)


def _recorded(sites, bn: Optional[dict] = None) -> tuple[dict, dict]:
    """The chain's conv sites -> ({layer: (x, y: the forward's input and output, bias included; dc, dx:
    its backward's cotangent and result)} and {bn layer: (n, dn)} from `bn`, batched; {layer: its
    weight node dw})."""
    by = {(s.name, s.op): s for s in sites}
    names = {s.name for s in sites}
    return ({**{k: (by[k, "forward"].a, by[k, "forward"].node, by[k, "backward"].a, by[k, "backward"].node)
                for k in names}, **(bn or {})}, {k: by[k, "grad_weight"].node for k in names})


@partial(jax.jit, static_argnums=(0, 1))
def _selections(net, cfg, params, inputs, kit_args):
    """σ = argmax of every pool, read off each stage's frozen reference forward at its recorded input."""
    how = Pass(kit=_frozen_kit(*kit_args))
    return {k: maxpool.select(r, net.pools[k]) for st in net.stage_list(cfg)
            for k, r in st.pool_inputs(st.forward(params, inputs[st.name], cfg, how)[1]).items()}


def float32_point(params, x, targets, cfg):   # the parameters in signature order (a tree map sorts them)
    return ({k: to_device(v, np.float32) for k, v in params.items()}, to_device(x, np.float32),
            targets_matrix(targets, cfg.num_classes, jnp.float32))


def under_policy(cfg) -> bool:
    """Whether the chain runs under the bf16 execution policy (bf16 activations, every conv site a
    bf16-typed kind, BatchNorm outputs rounded) rather than as bf16 conv kinds in a float32 chain."""
    return policy_.get(cfg.policy).activations == "bfloat16"


def _kinds_config(cfg):
    """The configuration the bf16 chain runs at: cfg itself under the bf16 policy, else its conv
    sites as bf16 kinds (cfg.bf16) inside the float32 chain."""
    return cfg if under_policy(cfg) else replace(cfg, bf16=True)


def _run(chain, params, x, t, cfg, label_smoothing, how="quick"):
    """(sites, Rendered, Tape, {bn layer: (n, dn)}): the chain run once with a recording kit."""
    if under_policy(cfg):
        return policy_sites(chain, params, x, t, cfg, label_smoothing=label_smoothing, how=how)
    return (*conv_sites(chain, params, x, t, cfg, label_smoothing=label_smoothing, how=how), {})


def stage_ties(point: Point, *, chain: Optional[Chain] = None, factor: float = tol.F32_ENVELOPE_FACTOR,
               ran: Optional[tuple] = None) -> stages.StageReport:
    """Every stage of the bf16 chain (`chain`, default the net's own), run in float32, tied to its
    float64 VJP at the chain's own stage input, cotangent and rounding decisions within `factor` ×
    the point's envelope, and the loss cotangent to autodiff of the loss. ran: `_run`'s output. The
    point (`tie.Point.of`, or built directly) carries the net, its config, the parameters, x and the
    targets (read at float32 here), α and the key of the envelope's draws (None: key(0)).

    Under the bf16 execution policy (cfg.policy "bf16") the chain is the policy's: its BatchNorm
    outputs are frozen at the chain's too, and a residual block's input cotangent, a bf16 sum of
    its two branches' cotangents, is held to at least one bf16 rounding (U_BF16)."""
    need_x64("the bf16 stage ties")
    net, params, x, targets, cfg = point.net, point.params, point.x, point.targets, point.cfg
    label_smoothing, key = point.alpha, point.key
    policy = under_policy(cfg)
    chain, cfg = chain or Chain(net), _kinds_config(cfg)
    r = "bf16" if policy else cfg.bf16_rounding
    if r not in ("identity", "bf16", "nearest", conv.bf16_operand, conv.round_bf16):
        raise ValueError(f"the bf16 stage ties freeze a named rounding ('bf16', 'nearest' or 'identity'), got {r!r}")
    params, x, t = float32_point(params, x, targets, cfg)
    sites, out, tape, bn = ran or _run(chain, params, x, t, cfg, label_smoothing)
    kit_args = (None, None) if r == "identity" else _recorded(sites, bn)
    p64, i64, k64 = tree_to_device((params, tape.inputs, kit_args), np.float64)
    cells = bn_cells(net, p64, to_device(x, np.float64), cfg)
    rec = stages.Record(net, chain, params, x, tape.inputs, tape.cotangents, out.grads, out.dx, out.logits,
                        tape.cotangents[net.stage_list(cfg)[-1].name], float(out.loss), t, label_smoothing)
    ties, cot = stages._ties(cfg, rec, dtype="float32", key=jax.random.key(0) if key is None else key,
                             factor=factor, selections=_selections(net, cfg, p64, i64, k64) or None,
                             cells=node_cells(net, cfg, cells),
                             kit=(_frozen_policy_kit if policy else _frozen_kit, kit_args))
    if policy:
        ties = [_residual_input_rounded(t_) for t_ in ties]
    return stages.StageReport(chain.label, "bf16", "stages", ties, cot, meta={
        "loss": float(out.loss), "bn_cells": cells, "factor": factor, "policy": cfg.policy,
        "rounding": r if isinstance(r, str) else r.__name__})


RESIDUAL_KINDS = ("identity", "downsample")


def _residual_input_rounded(report: TieReport) -> TieReport:
    """A residual block's input cotangent is the bf16 sum of its branches' (one rounding the frozen
    reference does not make): its row is held to at least one bf16 unit roundoff."""
    if report.meta.get("kind") not in RESIDUAL_KINDS:
        return report
    rows = [replace(r, limit=max(r.limit, U_BF16), floor=max(r.floor, U_BF16), bad=0 if r.rel <= U_BF16 else r.bad)
            if r.name == "input" else r for r in report.rows]
    return replace(report, rows=rows)


# ---- what `gradtie check --bf16` reports -------------------------------------------------------

@dataclass
class Bf16Report:
    """The bf16 chain at one point: erasure at identity, every conv node against rnd(f32 node at
    rounded operands) and the bound, and every stage against its VJP within the point's envelope."""
    net: str
    erasure: ErasureReport
    sites: list[SiteRow]
    stages: stages.StageReport

    @property
    def meta(self) -> dict[str, Any]:
        return self.stages.meta

    @property
    def rows(self) -> list[NodeRow]:
        """Every stage row, the loss cotangent first, then the stages from the head to the input."""
        return [r for t in self.stages.backward_order() for r in t.rows]

    @property
    def failed(self) -> list:
        """Sites and stage rows over their limit (judgeable or not), and a chain that does not erase."""
        return ([] if self.erasure.ok else [self.erasure]) + [r for r in self.sites + self.rows if not r.ok]

    @property
    def ill_conditioned(self) -> list[NodeRow]:
        return [r for r in self.rows if r.ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        w, n, rows = max(self.sites, key=lambda r: r.ratio), len(self.sites), self.rows
        (name, wn), parting = self.stages.worst(), self.stages.first_parting()
        bad = [r.label for r in self.sites if not r.ok]
        return (f"{self.erasure.summary()}; {sum(r.equal for r in self.sites)}/{n} conv nodes = rnd(f32 node at "
                f"rounded operands) ({self.meta['rounding']}), {sum(r.ratio <= 1 for r in self.sites)}/{n} within the "
                f"bound, worst error/bound {w.ratio:.2f} ({w.label}, n={w.n}); stages vs their VJP: "
                f"{sum(r.ok for r in rows)}/{len(rows)} rows within {self.meta['factor']:g}× the envelope, worst "
                f"{wn.ratio:.2g} of its limit ({name}: {wn.name})" + (f"; {parting.summary()}" if parting else "")
                + (f"; FAILED conv sites: {', '.join(bad[:4])}" if bad else ""))

    def table(self) -> str:
        head = f"{'conv node':<40} {'n':>7} {'= rnd(f32)':>10} {'max err/M':>10} {'bound':>9} {'ratio':>6}  ok"
        return "\n".join([head, "-" * len(head)] + [
            f"{r.label:<40} {r.n:>7} {'yes' if r.equal else 'NO':>10} {r.max_rel:10.2e} {r.bound:9.2e} {r.ratio:6.2f}  "
            f"{'yes' if r.ok else 'NO'}" for r in self.sites] + ["", self.stages.table()])

    def as_dict(self) -> dict[str, Any]:
        e = self.erasure
        differing = [n for n, q in zip(e.names, e.equal) if not q]
        return {"net": self.net, "ok": self.ok, "summary": self.summary(), **self.meta, "stages": self.stages.as_dict(),
                "erasure": {"ok": e.ok, "outputs": len(e.equal), "differing": differing},
                "sites": [dict(r.__dict__, ratio=r.ratio, ok=r.ok) for r in self.sites]}


def check(net, params, x, targets, cfg, *, chain: Optional[Chain] = None, label_smoothing: float = 0.0,
          key: Optional[jax.Array] = None) -> Bf16Report:
    """The bf16 chain (`chain`, default the net's own; cfg.bf16_rounding at every conv site), run in
    float32: everything but the conv sites stays float32 (chapter bf16 erasure); errors are measured against
    float64. Under the bf16 execution policy (cfg.policy "bf16") the chain is the policy's, every conv
    site a bf16-typed kind with a bf16 result (checked = rnd(f32 node at rounded operands) and under
    the bound), and the erasure is the policy's own: with its roundings off (the tie policy in
    float32) it is the float32 chain, which is the same code (`chain_erasure` at identity)."""
    chain, (params, x, t), cfg = chain or Chain(net), float32_point(params, x, targets, cfg), _kinds_config(cfg)
    ran = _run(chain, params, x, t, cfg, label_smoothing)
    tied = stage_ties(Point(net, cfg, params, x, t, label_smoothing, key), chain=chain, ran=ran)
    exact = replace(cfg, policy="tie") if under_policy(cfg) else cfg
    return Bf16Report(chain.label, chain_erasure(net, params, x, t, exact, chain=chain, label_smoothing=label_smoothing),
                      site_rows(ran[0], conv.bf16_operand if under_policy(cfg) else rounding(cfg)), tied)


# ---- the catalogue under bf16 ----------------------------------------------------------------------

@dataclass(frozen=True)
class Bf16Caught:
    """One catalogue entry planted in the bf16 chain: its stage ties, and its own effect (`size`) at
    the row where it stands out most against `threshold`, the smallest relative error the verdict
    catches there (the row's limit; at least 2⁻⁸ in a stage holding a bf16 conv site)."""
    bug: str
    family: str
    report: stages.StageReport     # the planted bf16 chain's stage ties
    where: str                     # "stage: row"
    size: float                    # max |planted − real| / the row's scale
    threshold: float

    @property
    def caught(self) -> bool:
        """A stage row fails a limit that can tell a bug apart."""
        return self.report.first_parting() is not None

    @property
    def above(self) -> bool:
        """The entry's effect is above the point's bf16 sensitivity at some row."""
        return self.size > self.threshold


def _sizes(net, chain: Chain, params, cfg, ran, targets, alpha) -> dict[tuple[str, str], np.ndarray]:
    """The entry's own effect at every row: its stages alone against the real ones, both in float64
    at the bf16 chain's recorded inputs and cotangents (the rounding carried in float64), and its
    loss cotangent against the loss's own; |planted − real| per row (inf where the shapes differ)."""
    cfg = replace(cfg, bf16_rounding="nearest") if cfg.bf16_rounding in ("bf16", conv.bf16_operand) else cfg
    cfg = replace(cfg, policy="tie") if under_policy(cfg) else cfg
    _, out, tape, _ = ran
    p, inputs, dys, z, t = tree_to_device((params, tape.inputs, tape.cotangents, out.logits, targets), np.float64)

    def diff(a, b):
        return np.full(1, np.inf) if np.shape(a) != np.shape(b) else np.abs(np.asarray(a) - np.asarray(b))
    sizes = {}
    for st in (s.name for s in net.stage_list(cfg)):
        (gp, dxp), (gr, dxr) = (stages._stage_alone(n, st, p, inputs[st], dys[st], cfg, kit)
                                for n, kit in ((chain.net, chain.kit), (net, KIT)))
        sizes.update({(st, k): diff(gp[k], gr[k]) for k in gr} | {(st, "input"): diff(dxp, dxr)})
    return sizes | {(stages.LOSS_COTANGENT, "dlogits"): diff((chain.kit.loss_cotangent or net.loss.cotangent)(
        z, t, alpha, None), net.loss.cotangent(z, t, alpha, None))}


def catalogue(net, params, x, targets, cfg, *, label_smoothing: float = 0.1, names: Optional[Sequence[str]] = None,
              key: Optional[jax.Array] = None) -> list[Bf16Caught]:
    """Every single-device catalogue entry that applies to `net` (or those of `names`) planted in
    the bf16 chain in turn and tied stage by stage at the same point (each planted chain runs op by
    op: the entries share their ops, not their programs)."""
    chosen = bugs.chosen(net, names, label_smoothing=label_smoothing, batch=x.shape[0], cfg=cfg)
    (params, x, t), cfg = float32_point(params, x, targets, cfg), _kinds_config(cfg)
    # a stage with a bf16 conv site sees a bug from about one unit roundoff on (below: in its rounding)
    rounded = {s.name for s in net.stage_list(cfg) if any(np.ndim(params[k]) == 4 for k in s.params)}
    out = []
    for b in chosen:
        chain = bugs.plant(b.name, net, cfg)
        ran = _run(chain, params, x, t, cfg, label_smoothing, how="eager")
        report = stage_ties(Point(net, cfg, params, x, t, label_smoothing, key), chain=chain, ran=ran)
        rows = {(tr.net, r.name): r for tr in report.backward_order() for r in tr.rows}
        limits = {k: max(r.limit, U_BF16) if k[0] in rounded else r.limit for k, r in rows.items()}
        sizes = {k: float(np.max(d)) / rows[k].scale
                 for k, d in _sizes(net, chain, params, cfg, ran, t, float(label_smoothing)).items()}
        where = max(sizes, key=lambda k: sizes[k] / limits[k])
        out.append(Bf16Caught(b.name, b.family, report, ": ".join(where), sizes[where], limits[where]))
    return out


# ---- how far the bf16 gradient sits from the f32 one (beyond the suite; no verdict) -------------

def f32_distance(point: Point, *, bf16_grads=None, draws: int = tol.BF16_F32_DISTANCE_DRAWS,
                 nudge: float = tol.BF16_F32_DISTANCE_NUDGE) -> list[NodeRow]:
    """Whole-net bf16 nodes (and the input cotangent) against the f32 chain at the point (`Point`:
    its net, config, float32 parameters and images, target rows, α and key), each with the f32
    chain's spread under `draws` random relative nudges of every weight and pixel as its envelope
    (`NodeRow.ratio`: about 1 when the bf16 chain moves the node as a bf16 nudge does)."""
    net, params, x, t, cfg = point.net, point.params, point.x, point.targets, point.cfg
    label_smoothing, key = point.alpha, point.key

    def nodes(p, x_, c, grads=None, dx=None):
        if grads is None:
            out = rendered.quick(net, KIT, p, x_, t, c, alpha=float(label_smoothing))
            grads, dx = out.grads, out.dx
        return {**{k: np.asarray(grads[k], np.float64) for k in params}, "input": np.asarray(dx, np.float64)}
    cfg32 = replace(cfg, bf16=False)
    g32 = nodes(params, x, cfg32)
    # no batched names: `samples` adds one nudge to the draws - 1 asked for (and the point itself)
    spread = env_.spread(g32, [nodes(tree_to_device(s.values["params"]), to_device(s.values["x"]), cfg32)
                               for s in env_.samples({"params": params, "x": x}, dtype=np.dtype(x.dtype).name,
                                                     key=jax.random.key(0) if key is None else key,
                                                     nudged=("params", "x"), nudges=draws - 1, unit=nudge)])
    return compare(nodes(params, x, replace(cfg, bf16=True), *(bf16_grads or (None, None))), g32,
                   limit=Limit(spread, 1.0, U_F32), zero_nodes=zero_in_reals(params))


def relu_flips(net, params, x, cfg) -> tuple[int, int]:
    """ReLU inputs whose sign differs between the bf16 and the f32 forward (nearer their kink than
    bf16's rounding moves them), and all ReLU inputs."""
    z16, z32 = (net.preactivations(rendered.forward(net, params, x, replace(cfg, bf16=b))[1]) for b in (True, False))
    return (sum(int(np.sum((np.asarray(z16[k]) > 0) != (np.asarray(z32[k]) > 0))) for k in z32),
            sum(int(z.size) for z in z32.values()))
