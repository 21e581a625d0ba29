"""Per-stage ties: every stage's rendered backward against the VJP of that stage alone, at the
cotangent the rendered chain hands it.

The suite does not compare endpoints only. ResNet-34's input-gradient tie (`r34InputGradB_correct`)
peels the eighteen-stage composition's backward into eighteen stage backwards: the stem and the
head are tied concretely, the stem pool's endpoint is `rfl`, and the sixteen blocks stay opaque
`HasVJPDiffAt` witnesses; the block input cotangents are `r34IdCotIn_eq_vjp` and
`r34DownCotIn_eq_vjp` (the step-tie module's). cifar8's (`cifar8BbnInputGradB_correct`) is
seventeen CertLayers (`Net.layers`). For any net built from the protocol, `stage_ties` ties each
stage of a recorded chain (`record`) to the VJP of its forward alone (`reference.vjp`) at the
cotangent the chain handed it, within ENVELOPE_FACTOR × the stage's own round-off envelope; a stage
handed a wrong cotangent still ties at it, so only the stage holding a bug parts from its VJP
(`StageReport.first_parting`). `cotangent_tie`, `tie_at` and `sweep` tie the whole chain from any
cotangent, one stage at any input, and the whole net at every batch size of a range.

Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng, reference, rendered
from .. import tolerances as tol
from ..host import to_device, tree_to_device
from ..kit import KIT
from ..nets.protocol import Net, Pass
from . import census, envelope as env_
from .tie import (Chain, Limit, NodeRow, Point, TieReport, bn_cells, checked_dtype, compare, degenerate,
                  degenerate_text, frozen_selections, node_cells, reference_at, report, targets_matrix, tie, zero_in_reals)

LEVELS = ("stages", "layers")
LOSS_COTANGENT = "loss cotangent"


class Record(NamedTuple):
    """A rendered chain run once at a point: every stage's input and the cotangent it was handed at
    its output, the nodes, the input cotangent and (from a loss) the loss and dlogits."""
    net: Net
    chain: Chain
    params: dict
    x: jax.Array
    inputs: dict
    cotangents: dict
    grads: dict
    dx: jax.Array
    logits: jax.Array
    dlogits: jax.Array
    loss: Optional[float]
    targets: Optional[jax.Array]
    label_smoothing: float

    def handed_on(self, stage: str) -> jax.Array:
        """The cotangent a stage hands on (at its input): the next stage down's, or dx."""
        names = [s.name for s in self.chain.net.stage_list(self.chain.net.config())]
        i = names.index(stage)
        return self.dx if i == 0 else self.cotangents[names[i - 1]]


@partial(jax.jit, static_argnums=(0, 1, 4), compiler_options=rendered.QUICK)
def _chain_from(net: Net, kit, params, x, cfg, dlogits):
    inputs, cotangents = {}, {}
    logits, saved = net.forward(params, x, cfg, kit=kit, inputs=inputs)
    grads, dx = net.backward(params, saved, dlogits.astype(logits.dtype), cfg, kit=kit, cotangents=cotangents)
    return logits, grads, dx, inputs, cotangents


def record(net, params, x, cfg, *, targets=None, label_smoothing: float = 0.0, dlogits=None,
           chain: Optional[Chain] = None) -> Record:
    """Run the rendered chain (`chain`, default the net's own) at (params, x) from the loss's
    cotangent (`targets`) or from any cotangent at the logits (`dlogits` [N,K]), with a tape."""
    chain = chain or Chain(net)
    if (targets is None) == (dlogits is None):
        raise ValueError("record: give targets (the loss's own cotangent) or dlogits (any cotangent), not both")
    if dlogits is None:
        targets = targets_matrix(targets, cfg.num_classes, x.dtype)
        args = (chain.net, chain.kit, params, x, targets, cfg)
        if rendered.quick_pays(x):
            out, tape = rendered.taped(*args, alpha=float(label_smoothing))
        else:   # large images: the optimised program's run is the cheaper
            out, tape = rendered.taped_compiled(*args, alpha=float(label_smoothing))
        logits, grads, dx, inputs, cotangents, loss = out.logits, out.grads, out.dx, *tape, float(out.loss)
        dlogits = cotangents[chain.net.stage_list(cfg)[-1].name]
    else:
        dlogits, shape = jnp.asarray(dlogits), (x.shape[0], cfg.num_classes)
        if tuple(dlogits.shape) != shape:
            raise ValueError(f"record: dlogits must have the logits' shape {shape}, got {tuple(dlogits.shape)}")
        if not jnp.issubdtype(dlogits.dtype, jnp.floating) or not bool(jnp.all(jnp.isfinite(dlogits))):
            raise ValueError("record: dlogits must hold finite floats")
        logits, grads, dx, inputs, cotangents = _chain_from(chain.net, chain.kit, params, x, cfg, dlogits)
        dlogits, loss = dlogits.astype(logits.dtype), None
    return Record(net, chain, params, x, inputs, cotangents, {k: grads[k] for k in params}, dx, logits, dlogits,
                  loss, targets, label_smoothing)


# ---- the oracle: each stage's VJP alone, and its envelope -------------------------------------------

@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _stage_vjps(net: Net, cfg, names: tuple, kit_at, args: tuple):
    """Each named stage's float64 VJP alone; args = (params, inputs, dys, selections, kit_args)."""
    params, inputs, dys, selections, kit_args = args
    how = Pass(kit=KIT if kit_at is None else kit_at(*kit_args), selections=selections)
    return {s.name: reference.vjp(lambda p, a, s=s: s.forward(p, a, cfg, how)[0], {k: params[k] for k in s.params},
                                  inputs[s.name], cotangent=dys[s.name])
            for s in net.stage_list(cfg) if s.name in names}


class StageSide(NamedTuple):
    """What stage ties read at a point: the parameters, each stage's input and the cotangent at its
    output, the rendered (grads, dx) of each stage (`got`), σ where pools tie (or None) and M per node."""
    params: dict
    inputs: dict
    dys: dict
    got: dict
    selections: Optional[dict] = None
    cells: Optional[dict] = None


def _tie_stages(net: Net, cfg, side: StageSide, *, dtype: str, key, factor: float,
                kit: tuple = (None, (None, None))) -> list[TieReport]:
    """One TieReport per stage in `side.got`: the rendered (grads, dx) against the stage's float64
    VJP at the same (exactly widened) input and cotangent, each row within factor × the stage's
    envelope. kit = (kit_at, kit_args): the kit the stages' forwards run through, kit_at(*kit_args)
    (None: KIT); kit_args: (arrays batched on axis 0, the rest), reversed with the batch, never nudged."""
    kit_at, kit_args = kit
    names = tuple(side.got)
    cells, zero_nodes = side.cells or {}, zero_in_reals(side.params)
    values = {"params": side.params, "inputs": {k: side.inputs[k] for k in names},
              "dys": {k: side.dys[k] for k in names}, "selections": side.selections,
              "kit_batched": kit_args[0], "kit_fixed": kit_args[1]}
    vjps = lambda v: _stage_vjps(net, cfg, names, kit_at, (v["params"], v["inputs"], v["dys"],  # noqa: E731
                                                           v["selections"], (v["kit_batched"], v["kit_fixed"])))
    ref = vjps({k: tree_to_device(v, None if k == "selections" else np.float64) for k, v in values.items()})
    outputs, labels = [], []
    for s in env_.samples(values, dtype=dtype, key=key, nudged=("params", "inputs", "dys"),
                          batched=("inputs", "dys", "selections", "kit_batched")):
        outputs.append({k: (g, env_.unorder(dx, s.order)) for k, (g, dx) in vjps(tree_to_device(s.values)).items()})
        labels.append(s.label)
    worst = env_.spread(ref, outputs)
    floor = tol.FLOORS[np.dtype(dtype).name]
    reports = []
    for stage in (st for st in net.stage_list(cfg) if st.name in names):
        name = stage.name
        (g_r, dx_r), (g_o, dx_o), (g_w, dx_w) = side.got[name], ref[name], worst[name]
        rows = compare({k: g_r[k] for k in stage.params}, {k: g_o[k] for k in stage.params},
                       limit=Limit({**g_w, "input": dx_w}, factor, floor),
                       zero_nodes=zero_nodes & set(stage.params), dx=(dx_r, dx_o),
                       cells={k: cells[k] for k in stage.params if k in cells})
        cot = float(np.max(np.abs(np.asarray(side.dys[name], np.float64))))
        reports.append(TieReport(name, np.dtype(dtype).name, rows, 0.0, 0.0,
                                 meta={"kind": stage.kind, "lean": net.stage_lean.get(stage.kind, ""),
                                       "cotangent_max": cot, "envelope_evaluations": labels, "factor": factor}))
    return reports


def _ties(cfg, rec: Record, *, dtype: str, key, factor: float, selections, cells: dict,
          kit: tuple = (None, (None, None))):
    """Every stage of a recorded chain tied at the cotangent it was handed (`_tie_stages`), and its
    loss cotangent when it starts from the loss -> (stage reports, loss-cotangent report or None).
    The oracle is the record's net (`rec.net`, never a planted chain's); kit = (kit_at, kit_args) as
    in `_tie_stages`."""
    net = rec.net
    stage_list = net.stage_list(cfg)
    got = {s.name: ({k: rec.grads[k] for k in s.params}, rec.handed_on(s.name)) for s in stage_list}
    reports = _tie_stages(net, cfg, StageSide(rec.params, rec.inputs, rec.cotangents, got, selections, cells),
                          dtype=dtype, key=key, factor=factor, kit=kit)
    return reports, None if rec.loss is None else _cotangent_report(net, rec, dtype=dtype, factor=factor,
                                                                    key=jax.random.fold_in(key, 1))


def _cotangent_report(net: Net, rec: Record, *, dtype: str, key, factor: float) -> TieReport:
    """The loss cotangent (the loss's own, e.g. the head's six kit ops) against autodiff of the loss
    in the logits, within its envelope."""
    alpha = rec.label_smoothing

    def grad(z, t):
        return reference.vjp(lambda z_: net.loss.value(z_, t, alpha), z, cotangent=jnp.ones((), z.dtype))[0]

    z64, t64 = np.asarray(rec.logits, np.float64), np.asarray(rec.targets, np.float64)
    ref = np.asarray(grad(jnp.asarray(z64), jnp.asarray(t64)))
    outputs = []
    for s in env_.samples({"z": z64, "t": t64}, dtype=dtype, key=key, nudged=("z",), batched=("z", "t")):
        d = grad(jnp.asarray(s.values["z"]), jnp.asarray(s.values["t"]))
        outputs.append(env_.unorder(d, s.order))
    rows = compare({"dlogits": rec.dlogits}, {"dlogits": ref},
                   limit=Limit({"dlogits": env_.spread(ref, outputs)}, factor, tol.FLOORS[np.dtype(dtype).name]))
    return TieReport(LOSS_COTANGENT, np.dtype(dtype).name, rows, 0.0, 0.0,
                     meta={"kind": "loss cotangent", "factor": factor,
                           "lean": "the six-op head fold (SmoothedLossCot)" if net.loss.name.startswith("label") else ""})


# ---- the verdicts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parting:
    """Where rendered and VJP first part, walking the chain backward."""
    stage: str          # LOSS_COTANGENT, or the stage (layer) name
    kind: str
    row: NodeRow        # its first failing row in backward order

    def summary(self) -> str:
        return (f"rendered and VJP first differ at {self.stage} ({self.kind}): {self.row.name} off by "
                f"{self.row.ratio:.2g}× its limit")

    def as_dict(self) -> dict[str, str]:
        return {"stage": self.stage, "kind": self.kind, "node": self.row.name}


@dataclass
class StageReport:
    net: str
    dtype: str
    level: str                      # "stages" or "layers"
    ties: list[TieReport]           # one per stage, in forward order
    cotangent: Optional[TieReport] = None   # the loss cotangent, when the chain starts there
    composition: list[NodeRow] = field(default_factory=list)  # finer stages composed against the stages
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> TieReport:
        return next(t for t in self.ties if t.net == name)

    def backward_order(self) -> list[TieReport]:
        """The loss cotangent first (when there is one), then the stages from the head to the input."""
        return ([self.cotangent] if self.cotangent is not None else []) + list(reversed(self.ties))

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.backward_order()) and all(r.ok for r in self.composition)

    @property
    def failed(self) -> list[TieReport]:
        return [t for t in self.backward_order() if not t.ok]

    def first_parting(self) -> Optional[Parting]:
        """The first stage, in backward order, whose rendered backward parts from its VJP at the
        cotangent it was handed (rows too ill-conditioned to judge are not a parting)."""
        for t in self.backward_order():
            bad = [r for r in t.backward_order() if not r.ok and not r.ill_conditioned]
            if bad:
                return Parting(t.net, t.meta.get("kind", ""), bad[0])
        return None

    def kind(self, kind: str) -> list[TieReport]:
        return [t for t in self.ties if t.meta.get("kind") == kind]

    def inputs(self, kind: str) -> list[NodeRow]:
        """The input-cotangent rows of every stage of a kind (identity, downsample blocks …)."""
        return [t.row("input") for t in self.kind(kind)]

    def worst(self) -> tuple[str, NodeRow]:
        """(stage, row) with the largest error over its limit."""
        return max(((t.net, r) for t in self.backward_order() for r in t.rows), key=lambda tr: tr[1].ratio)

    def summary(self) -> str:
        kinds = list(dict.fromkeys(t.meta.get("kind") for t in self.ties))
        tied = sum(t.ok for t in self.ties)
        line = f"{self.net}: {tied}/{len(self.ties)} {self.level} tied to their VJP alone ({self.dtype})"
        line += " (" + ", ".join(f"{sum(t.ok for t in self.kind(k))}/{len(self.kind(k))} {k}" for k in kinds) + ")"
        if self.cotangent is not None:
            line += f"; loss cotangent {'tied' if self.cotangent.ok else 'FAILED'}"
        name, w = self.worst()
        line += f"; worst {w.ratio:.2g} of its limit ({name}: {w.name})"
        if self.composition:
            worst = max(r.rel for r in self.composition)
            line += (f"; the layers compose to each stage ({'yes' if all(r.ok for r in self.composition) else 'NO'}, "
                     f"worst {worst:.1e})")
        parting = self.first_parting()
        if parting is not None:
            line += f"; {parting.summary()}"
        return line

    def table(self) -> str:
        head_ = (f"{'stage':<18} {'kind':<13} {'nodes':>5} {'max|dy|':>9} {'input err':>9} {'input lim':>9} "
                 f"{'worst err/lim':>13}  ok")
        lines = [head_, "-" * len(head_)]
        for t in self.backward_order():
            inp, cot = t.row("input") or t.rows[0], t.meta.get("cotangent_max")
            lines.append(f"{t.net:<18} {t.meta.get('kind', ''):<13} {len(t.nodes):>5} "
                         f"{'-' if cot is None else f'{cot:9.1e}':>9} {inp.rel:9.1e} {inp.limit:9.1e} "
                         f"{t.worst().ratio:13.2g}  {'yes' if t.ok else 'NO'}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        parting = self.first_parting()
        return {"net": self.net, "dtype": self.dtype, "level": self.level, "ok": self.ok, "summary": self.summary(),
                "first_parting": parting and parting.as_dict(),
                "cotangent": None if self.cotangent is None else self.cotangent.as_dict(),
                "stages": [t.as_dict() for t in self.ties]}


def _point(net: Net, point) -> tuple[Optional[dict], int, dict]:
    """σ at the float64 point (where a window ties at a positive maximum) and M per node, for `net`
    (the point's net or its finer stages) at the point's exact widening."""
    p64, x64, _ = point.wide
    sel, ties = frozen_selections(net, p64, x64, point.cfg)
    return sel, ties, node_cells(net, point.cfg, bn_cells(net, p64, x64, point.cfg))


def _composition(rec: Record, fine: Record, cfg) -> list[NodeRow]:
    """The finer stages composed against the stages: each stage's nodes and the cotangent it hands on."""
    dtype = np.dtype(rec.x.dtype).name
    rows = compare(fine.grads, rec.grads, limit=Limit(floor=tol.FLOORS[dtype]), zero_nodes=zero_in_reals(rec.params))
    fine_names = [s.name for s in fine.chain.net.stage_list(cfg)]
    for stage in rec.chain.net.stage_list(cfg):
        given = rec.inputs[stage.name]
        first = next(n for n in fine_names if fine.inputs[n].shape == given.shape
                     and bool(jnp.all(fine.inputs[n] == given)))
        rows += compare({f"{stage.name}.input": fine.handed_on(first).reshape(given.shape)},
                        {f"{stage.name}.input": rec.handed_on(stage.name)}, limit=Limit(floor=tol.FLOORS[dtype]))
    return rows


def stage_ties(point: Point, *, chain: Optional[Chain] = None, level: str = "stages", dlogits=None,
               factor: float = tol.ENVELOPE_FACTOR, rec: Optional[Record] = None) -> StageReport:
    """Tie every stage of a rendered chain of the point's net (`record`'s) to the float64 VJP of that
    stage alone at the cotangent the chain hands it, from the loss's cotangent (the point's targets;
    the loss cotangent is then tied too) or from `dlogits` (a point without targets). level
    "layers": the net's finer stages (`Net.layers`), their composition checked against the stages.
    Where a pool window ties at a positive maximum, the stages read it frozen at σ = argmax, as the
    whole-net tie does. The envelopes' draws come from the point's key (None: key(0))."""
    net, cfg = point.net, point.cfg
    dtype, key = point.dtype, jax.random.key(0) if point.key is None else point.key
    if level not in LEVELS:
        raise ValueError(f"level {level!r}: expected one of {', '.join(LEVELS)}")
    if level == "layers" and net.layers is None:
        raise ValueError(f"level 'layers': {net.name} defines no finer stages (Net.layers); its pieces are "
                         f"its stages (level 'stages')")
    fine_net = net.layers if level == "layers" else net
    if chain is not None and level == "layers" and chain.net is not net:
        raise ValueError("stage_ties: a planted net definition has no finer stages; plant a kit bug instead")
    targets = None if dlogits is not None else point.targets
    rec = rec or record(net, point.params, point.x, cfg, targets=targets, label_smoothing=point.alpha,
                        dlogits=dlogits, chain=chain)
    composition = []
    if level == "layers":
        fine = record(fine_net, point.params, point.x, cfg, targets=targets, label_smoothing=point.alpha,
                      dlogits=dlogits, chain=Chain(fine_net, rec.chain.kit, rec.chain.planted))
        composition = _composition(rec, fine, cfg)
        rec = fine
    sel, ties, cells = _point(fine_net, point)
    reports, cot = _ties(cfg, rec, dtype=dtype, key=key, factor=factor, selections=sel, cells=cells)
    return StageReport(rec.chain.label, dtype, level, reports, cot, composition,
                       meta={"input_model": "frozen" if sel is not None else "real", "tied_windows": ties})


def whole_tie(rec: Record, cfg, *, key: Optional[jax.Array] = None, point=None) -> TieReport:
    """The whole-net tie (`tie.tie`'s verdict) of a recorded chain run from the loss's cotangent."""
    if rec.loss is None:
        raise ValueError("whole_tie: the chain starts from a given cotangent; use cotangent_tie")
    point = point or reference_at(rec.net, rec.params, rec.x, rec.targets, cfg, label_smoothing=rec.label_smoothing,
                                  key=key)
    return report(rec.chain.label, rec.params, (rec.loss, rec.grads, rec.dx), point)


@partial(jax.jit, static_argnums=(0, 4))
def _net_vjp(net: Net, params, x, dy, cfg, alpha, selections):
    """(0, grads, dx): the VJP of the forward at dy, as an envelope's oracle (`envelope.measure`)."""
    return (0.0, *reference.vjp(lambda p, a: net.forward(p, a, cfg, selections=selections)[0], params, x,
                                cotangent=dy))


def cotangent_tie(point: Point, dlogits, *, chain: Optional[Chain] = None, factor: float = tol.ENVELOPE_FACTOR,
                  rec: Optional[Record] = None) -> TieReport:
    """The whole rendered chain from an arbitrary cotangent at the logits, against `jax.vjp` of the
    forward at it: every parameter node and the input cotangent, each within factor × the point's
    envelope (the VJP with the batch reversed and at unit-roundoff nudges of the image, the
    cotangent and the parameters; draws from the point's key). `r34InputGradB_correct` and
    `cifar8BbnInputGradB_correct` hold at every loss cotangent dy, not only at the cross-entropy one."""
    net, params, dtype = point.net, point.params, point.dtype
    rec = rec or record(net, params, point.x, point.cfg, dlogits=dlogits, chain=chain)
    sel, ties, cells = _point(net, point)
    at_dy = Point(net, point.cfg, params, point.x, rec.dlogits, 0.0, point.key)   # the cotangent where targets sit
    p64, x64, d64 = at_dy.wide
    ref = _net_vjp(net, p64, x64, d64, point.cfg, 0.0, sel)
    envelope = env_.measure(at_dy, ref, selections=sel, oracle=_net_vjp, nudged=("params", "x", "targets"))
    rows = compare(rec.grads, {k: ref[1][k] for k in params},
                   limit=Limit(envelope.nodes, factor, tol.FLOORS[dtype]), zero_nodes=zero_in_reals(params),
                   dx=(rec.dx, ref[2]), cells=cells)
    return TieReport(f"{rec.chain.label} at a given cotangent", dtype, rows, 0.0, 0.0,
                     meta={"input_model": "frozen" if sel is not None else "real", "tied_windows": ties,
                           "factor": factor})


def _stage_alone(net: Net, name: str, params, h, dy, cfg, kit=KIT):
    """One stage of a net definition alone, through a kit: its forward at h, its backward at dy."""
    stage = next(s for s in net.stage_list(cfg) if s.name == name)
    return stage.backward(params, stage.forward(params, h, cfg, Pass(kit=kit))[1], dy, cfg, kit)


_stage_at = jax.jit(_stage_alone, static_argnums=(0, 1, 5, 6))


def tie_at(net, params, stage: str, h, dy, cfg, *, key: Optional[jax.Array] = None,
           rendered_side: Optional[tuple] = None) -> TieReport:
    """One stage of `net` tied alone at ANY input h and cotangent dy at its output (not necessarily
    a point the net reaches): the stage's rendered backward, after its own forward at h, against
    the stage's VJP there. The head (GAP, fc) needs no hypothesis at all: `r34HeadBHasVJP` is
    global, so its tie holds wherever it is asked, even where the body sits at a kink.
    rendered_side: (grads, dx) computed elsewhere, in place of the net's own stage backward. Each row
    is held to tolerances.ENVELOPE_FACTOR × the stage's envelope, as the whole-net tie's."""
    dtype = checked_dtype("tie_at", h)
    names = [s.name for s in net.stage_list(cfg)]
    if stage not in names:
        raise ValueError(f"tie_at: stage {stage!r}: expected one of {', '.join(names)}")
    got = rendered_side if rendered_side is not None else _stage_at(net, stage, params, h, dy, cfg)
    (rep,) = _tie_stages(net, cfg, StageSide(params, {stage: h}, {stage: dy}, {stage: got}), dtype=dtype, key=key,
                         factor=tol.ENVELOPE_FACTOR)
    return rep


def random_cotangent(key, shape, dtype=jnp.float64, kind: str = "normal") -> jax.Array:
    """A cotangent at the logits no loss of ours would hand the chain: "normal" (N(0,1) entries,
    rows not summing to 0), "spike" (one large entry per row), "scaled" (normal × 1e6)."""
    z = prng.normal(key, shape, dtype)
    if kind == "spike":
        cls = prng.randint(jax.random.fold_in(key, 1), (shape[0],), 0, shape[1])
        return jax.nn.one_hot(cls, shape[1], dtype=dtype) * 1e3 + 1e-3 * z
    if kind in ("normal", "scaled"):
        return z if kind == "normal" else 1e6 * z
    raise ValueError(f"random_cotangent: kind {kind!r}: expected normal, spike or scaled")


# ---- the range of N ------------------------------------------------------------------------------

@dataclass
class SweepRow:
    n: int
    smooth: Any                     # census.SmoothReport
    tie: Optional[TieReport]        # None where the parameter-gradient hypothesis fails, or degenerate
    degenerate: Optional[tuple] = None   # (BN layer, M = 1): not judged (`tie.degenerate`), never "tied"

    def holds(self, key: str) -> bool:
        return self.smooth.hypothesis(key).holds

    @property
    def ratio(self) -> float:
        """Worst error over its limit (nan without a tie)."""
        return float("nan") if self.tie is None else self.tie.worst().ratio


@dataclass
class Sweep:
    net: str
    rows: list[SweepRow]

    @property
    def ok(self) -> bool:
        """Every N where the parameter-gradient hypothesis holds ties."""
        return all(r.tie is not None and r.tie.ok for r in self.rows if r.smooth.ok and not r.degenerate)

    def smallest(self, key: str) -> Optional[int]:
        """The smallest N from which on every N of the sweep keeps hypothesis `key` (and ties)."""
        kept = list(takewhile(lambda r: r.holds(key) and r.tie is not None and r.tie.ok,
                              sorted(self.rows, key=lambda r: -r.n)))
        return kept[-1].n if kept else None

    def below(self, key: str) -> Optional[str]:
        """What fails at the largest N below `smallest(key)` (None when nothing below it fails)."""
        n = self.smallest(key)
        under = [r for r in self.rows if n is None or r.n < n]
        if not under:
            return None
        r = max(under, key=lambda r: r.n)
        h = r.smooth.hypothesis(key)
        if r.degenerate:
            return f"N = {r.n}: {degenerate_text(r.degenerate)}; not judged"
        return f"N = {r.n}: " + (h.summary() if not h.holds else
                                 f"{h.name} holds, but the tie fails ({r.tie.summary() if r.tie else 'no tie'})")

    def table(self) -> str:
        hyps = self.rows[0].smooth.hypotheses
        lines = [f"{'N':>3} " + " ".join(f"{h.name[:24]:>24}" for h in hyps) + f" {'tied':>9} {'worst err/lim':>13} "
                 f"{'min M':>6}"]
        for r in self.rows:
            tied = "degenerate" if r.degenerate else "-" if r.tie is None else \
                f"{sum(x.agrees for x in r.tie.nodes)}/{len(r.tie.nodes)}"
            small = r.degenerate or (r.tie.smallest_bn() if r.tie is not None else None)
            lines.append(f"{r.n:>3} " + " ".join(f"{'holds' if r.holds(h.key) else 'FAILS':>24}" for h in hyps)
                         + f" {tied:>9} {r.ratio:13.2g} {small[1] if small else '-':>6}")
        return "\n".join(lines)


def sweep(net, params, cfg, images: Callable[[int], jax.Array], ns: Sequence[int], *,
          label_smoothing: float = 0.0, labels: Optional[Callable[[int], jax.Array]] = None,
          key: Optional[jax.Array] = None) -> Sweep:
    """The whole-net tie at every batch size N in `ns`: the census's hypotheses at each point, and
    the tie wherever the parameter-gradient hypothesis holds. images(N) -> x [N,C,S,S] (its dtype is
    the chain's); labels(N) -> int labels or target rows (default (3n + 1) mod K)."""
    ns = [int(n) for n in ns]
    if not ns or min(ns) < 1:
        raise ValueError(f"sweep: ns must be positive batch sizes, got {ns}")
    key = jax.random.key(0) if key is None else key
    labels = labels or (lambda n: (jnp.arange(n) * 3 + 1) % cfg.num_classes)
    rows, p64 = [], {k: to_device(v, np.float64) for k, v in params.items()}
    for n in ns:
        x = images(n)
        smooth = census.smoothness(net, p64, to_device(x, np.float64), cfg)
        flat = degenerate(bn_cells(net, p64, x, cfg))
        at = Point.of(net, params, x, labels(n), cfg, label_smoothing=label_smoothing, key=jax.random.fold_in(key, n))
        rows.append(SweepRow(n, smooth, tie(at) if smooth.ok and not flat else None, flat))
    return Sweep(net.name, rows)
