"""The rendered chain under a fast execution policy (`tf32`, `bf16`), tied stage by stage to float64.

A `bf16` chain is close neither to the float32 chain nor to the float64 gradient of the whole net
(a bf16 ulp at a rounding boundary, spread by BatchNorm over few cells), so, as the suite ties a
chain, each stage is tied on its own: the chain is run once under the policy, recording every
stage's input and the cotangent it is handed (`stages.record`); then each stage's rendered nodes and
input cotangent are held to the float64 VJP of that stage alone at the same input and cotangent.

The limit of each row is a multiple of the policy's own envelope, measured at the point: the
largest distance from the float64 VJP of correct evaluations of the stage under the same policy —
`jax.vjp` of the stage's forward run in the policy's dtypes and precision (a backward written by
autodiff, rounding where the policy rounds), at the point itself, with the batch in reverse order,
and at inputs, parameters and cotangent nudged by the policy's unit roundoff (2⁻⁸ for bf16, 2⁻¹¹ for
TF32's operands). Pools are read at the chain's own selection σ (the gather model: where two cells
of a window are within one rounding of each other, the float64 VJP takes the branch the chain
took). Everything a bug breaks by more than the policy's resolution parts its stage; `catalogue`
plants every entry of `checks.bugs` under the policy and says where each one stands out.

On a CPU `tf32` runs the float32 arithmetic of `tie` (no TF32 units): its envelope is measured with
float32's nudges there (`policy.unit_roundoff_here`), TF32's (2⁻¹¹) on a GPU.

The `bf16` policy is not tied this way: an honest bf16 envelope at a small batch is as wide as the
gradient itself (autodiff under the policy rounds other values than the rendered chain, and a nudge
of 2⁻⁸ crosses ReLU kinks), so no row could be judged. `check` ties it as the suite ties its bf16
kinds (`checks.bf16`): every stage's float64 VJP at the chain's own rounding decisions, what is left
held to the float32 envelope. Shown in: bf16 erasure (the bf16 execution policy, beyond the
suite), Performance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import policy as policy_
from .. import rendered
from .. import tolerances as tol
from ..host import tree_to_device
from ..ops import maxpool
from . import bugs, stages
from . import envelope as env_
from .tie import Chain, Limit, Point, TieReport, bn_cells, compare, need_x64, node_cells, targets_matrix, zero_in_reals


def _cast_like(tree, like):
    """Every floating leaf of `tree` in the dtype of its counterpart in `like` (a sample's leaves come
    back float32; the chain handed some of them over in bf16)."""
    def cast(a, b):
        a = np.asarray(a)
        return a.astype(np.asarray(b).dtype) if np.issubdtype(a.dtype, np.floating) else a
    return jax.tree.map(cast, tree, like)


def _selections(net, params, x, cfg) -> Optional[dict]:
    """σ = argmax of every pool at the chain's own pool inputs (the policy's forward)."""
    if not net.pools:
        return None
    _, saved, _ = rendered.forward(net, params, x, cfg)
    return {name: maxpool.select(r, net.pools[name]) for name, r in net.pool_inputs(saved).items()}


def stage_ties(point: Point, *, chain: Optional[Chain] = None, factor: float = tol.POLICY_ENVELOPE_FACTOR,
               nudges: int = tol.POLICY_NUDGES) -> stages.StageReport:
    """Every stage of the chain (`chain`, default the net's own) run under `cfg.policy` at float32
    parameters, tied to its float64 VJP at the chain's own stage input and cotangent, each row within
    `factor` × the policy's envelope at the point (the module docstring), and the loss cotangent
    (float32 under every policy) to autodiff of the loss within float32's. The point (`tie.Point`,
    built directly: its parameters, x and targets are read at float32 here) carries the net, its
    config (`cfg.policy`), α and the key of the envelope's draws (None: key(0))."""
    net, params, x, targets, cfg = point.net, point.params, point.x, point.targets, point.cfg
    label_smoothing, key = point.alpha, point.key
    need_x64("the policy stage ties")
    pol = policy_.get(cfg.policy)
    unit = policy_.unit_roundoff_here(pol)   # measured where it runs: a CPU has no TF32 units
    chain = chain or Chain(net)
    key = jax.random.key(0) if key is None else key
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float32)
    t = targets_matrix(targets, cfg.num_classes, jnp.float32)
    rec = stages.record(net, params, x, cfg, targets=t, label_smoothing=label_smoothing, chain=chain)
    sel = _selections(net, params, x, cfg)
    stage_list = net.stage_list(cfg)
    names = tuple(s.name for s in stage_list)
    exact = replace(cfg, policy="tie")
    ref = stages._stage_vjps(net, exact, names, None,
                             (*tree_to_device((params, rec.inputs, rec.cotangents), np.float64), sel, (None, None)))
    # each stage's VJP reads its cotangent in the dtype of the stage's output (the next stage's input;
    # the head's logits are float32): the head hands the last conv stage a float32 cotangent
    outputs_dtype = [rec.inputs[n].dtype for n in names[1:]] + [rec.logits.dtype]
    dys = {n: rec.cotangents[n].astype(dt) for n, dt in zip(names, outputs_dtype)}
    values = {"params": params, "inputs": rec.inputs, "dys": dys, "selections": sel}
    outputs, labels = [], []
    for s in env_.samples(values, dtype="float32", key=key, nudged=("dys",),
                          batched=("inputs", "dys", "selections"), nudges=nudges, unit=unit):
        v = _cast_like(s.values, values)
        out = stages._stage_vjps(net, cfg, names, None,
                                 (*tree_to_device((v["params"], v["inputs"], v["dys"])), v["selections"], (None, None)))
        outputs.append({k: (g, env_.unorder(dx, s.order)) for k, (g, dx) in out.items()})
        labels.append(s.label)
    worst = env_.spread(ref, outputs)
    cells = node_cells(net, exact, bn_cells(net, *tree_to_device((params, x), np.float64), replace(exact, bf16=False)))
    zero = zero_in_reals(params)
    ties = []
    for stage in stage_list:
        (g_o, dx_o), (g_w, dx_w) = ref[stage.name], worst[stage.name]
        rows = compare({k: rec.grads[k] for k in stage.params}, {k: g_o[k] for k in stage.params},
                       limit=Limit({**g_w, "input": dx_w}, factor, tol.F32_FLOOR),
                       zero_nodes=zero & set(stage.params), dx=(rec.handed_on(stage.name), dx_o),
                       cells={k: cells[k] for k in stage.params if k in cells})
        ties.append(TieReport(stage.name, pol.name, rows, 0.0, 0.0, meta={
            "kind": stage.kind, "lean": net.stage_lean.get(stage.kind, ""), "factor": factor,
            "cotangent_max": float(np.max(np.abs(np.asarray(rec.cotangents[stage.name], np.float64)))),
            "envelope_evaluations": labels}))
    cot = stages._cotangent_report(net, rec, dtype="float32", key=jax.random.fold_in(key, 1), factor=factor)
    return stages.StageReport(chain.label, pol.name, "stages", ties, cot, meta={
        "policy": pol.name, "loss": rec.loss, "factor": factor, "unit_roundoff": unit,
        "envelope_evaluations": labels})


# ---- the catalogue under a policy ------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyCaught:
    """One catalogue entry planted in the chain under a policy: its stage ties, the row where it
    parts first (walking backward), and its own size there against that row's limit."""
    bug: str
    family: str
    report: stages.StageReport

    @property
    def caught(self) -> bool:
        return self.report.first_parting() is not None

    @property
    def where(self) -> str:
        p = self.report.first_parting()
        return "" if p is None else f"{p.stage}: {p.row.name} ({p.row.ratio:.3g}× its limit)"


def catalogue(net, params, x, targets, cfg, *, label_smoothing: float = 0.1, names: Optional[Sequence[str]] = None,
              key: Optional[jax.Array] = None) -> list[PolicyCaught]:
    """Every single-device catalogue entry that applies to `net` (or those of `names`) planted in the
    chain under `cfg.policy` and tied stage by stage at the same point."""
    chosen = bugs.chosen(net, names, label_smoothing=label_smoothing, batch=np.shape(x)[0], cfg=cfg)
    return [PolicyCaught(b.name, b.family, stage_ties(Point(net, cfg, params, x, targets, label_smoothing, key),
                                                      chain=bugs.plant(b.name, net, cfg)))
            for b in chosen]


def summary(report: stages.StageReport) -> str:
    """One line: the policy, how many stages and rows tie, the worst row against its limit."""
    rows = [r for t in report.backward_order() for r in t.rows]
    name, w = report.worst()
    parting = report.first_parting()
    return (f"{report.net} under policy {report.meta['policy']!r}: {sum(t.ok for t in report.ties)}/"
            f"{len(report.ties)} stages tied to their float64 VJP, {sum(r.ok for r in rows)}/{len(rows)} rows "
            f"within {report.meta['factor']:g}× the policy's envelope (u = 2^{int(np.log2(report.meta['unit_roundoff']))}), "
            f"worst {w.ratio:.2g} of its limit ({name}: {w.name})" + (f"; {parting.summary()}" if parting else ""))


def as_dict(report: stages.StageReport) -> dict[str, Any]:
    return {**report.as_dict(), "policy": report.meta["policy"], "summary": summary(report)}


# ---- one check for every policy ------------------------------------------------------------------

@dataclass
class PolicyReport:
    """A chain under the `tf32` policy tied stage by stage (`stage_ties`): what `gradtie check
    --policy tf32` reports (the `bf16` policy's is `checks.bf16.Bf16Report`)."""
    stages: stages.StageReport

    @property
    def meta(self) -> dict[str, Any]:
        return self.stages.meta

    @property
    def rows(self) -> list:
        return [r for t in self.stages.backward_order() for r in t.rows]

    @property
    def failed(self) -> list:
        return [r for r in self.rows if not r.ok]

    @property
    def ill_conditioned(self) -> list:
        return [r for r in self.rows if r.ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        return summary(self.stages)

    def table(self) -> str:
        return self.stages.table()

    def as_dict(self) -> dict[str, Any]:
        return as_dict(self.stages)


def check(net, params, x, targets, cfg, *, chain: Optional[Chain] = None, label_smoothing: float = 0.0,
          key: Optional[jax.Array] = None):
    """The chain under `cfg.policy`, tied stage by stage on the CPU: `bf16` with `checks.bf16.check`
    (stages at the chain's own rounding decisions, every conv site = rnd(f32 node at rounded
    operands)), `tf32` with `stage_ties` (the policy's own envelope). `tie` is `checks.tie`'s."""
    from . import bf16   # the bf16 package reads this module's neighbours

    pol = policy_.get(cfg.policy)
    if pol.name == "tie":
        raise ValueError("policies.check ties the fast policies (tf32, bf16); the tie policy is checks.tie's")
    if pol.activations == "bfloat16":
        return bf16.check(net, params, x, targets, cfg, chain=chain, label_smoothing=label_smoothing, key=key)
    return PolicyReport(stage_ties(Point(net, cfg, params, x, targets, label_smoothing, key), chain=chain))


def caught(net, params, x, targets, cfg, *, label_smoothing: float = 0.1, names: Optional[Sequence[str]] = None,
           key: Optional[jax.Array] = None) -> list:
    """The catalogue planted under `cfg.policy`, one entry per row with `.bug`, `.caught`, `.where`:
    `bf16` through `checks.bf16.catalogue`, `tf32` through `catalogue`."""
    from . import bf16

    if policy_.get(cfg.policy).activations == "bfloat16":
        return bf16.catalogue(net, params, x, targets, cfg, label_smoothing=label_smoothing, names=names, key=key)
    return catalogue(net, params, x, targets, cfg, label_smoothing=label_smoothing, names=names, key=key)
