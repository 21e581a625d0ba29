"""The whole-net tie: the rendered chain against autodiff of the forward, node by node.

`tie` returns a `TieReport` (one row per parameter node, plus the input cotangent) and prints
nothing. The oracle is built from the net's forward and `gradtie.reference`'s loss, never from a
backward. Shown in: Whole-net tie.

Besides the nets themselves (`gradtie.nets.cifar8`, `resnet34`), the kit accepts a net-like object
that plants a bug in the rendered side (`gradtie.checks.controls`): it may carry `real_net` (the net
whose forward the oracle differentiates) and `head_cotangent` (the cotangent at the logits, in place
of `ops.head.cotangent`); its `forward` is the real one and its `backward` may be planted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..host import to_device
from ..ops import head, maxpool
from . import envelope as env_
from . import tolerances as tol


@dataclass(frozen=True)
class NodeRow:
    """One node's verdict: its error against the float64 reference, in units of its scale, held to
    max(ENVELOPE_FACTOR × the point's envelope, the dtype's floor)."""
    name: str
    shape: tuple[int, ...]
    err: float          # max |rendered − oracle|
    scale: float        # the denominator: max |oracle|, or the net's max|g| for zero-in-ℝ nodes
    rel: float          # err / scale
    limit: float        # the tolerance rel is held to: max(factor · envelope, floor)
    zero_in_reals: bool
    bad: int = 0        # entries off by more than limit·scale (for a β row: the channels wrong)
    envelope: float = 0.0   # the point's round-off envelope of this node, / scale
    floor: float = 0.0      # the dtype's floor (SPEC's figure)
    cells: Optional[int] = None  # M: the cells its BatchNorm layer averages over (None: no BN)

    @property
    def ok(self) -> bool:
        return bool(self.rel <= self.limit)

    @property
    def by(self) -> str:
        """What sets the limit: "envelope" (the point's round-off, widened past the floor) or "floor"."""
        return "floor" if self.limit <= self.floor else "envelope"

    @property
    def ill_conditioned(self) -> bool:
        """Round-off alone moves this node by ILL_CONDITIONED_REL of itself: no bug of that size can
        be told apart from it here."""
        return bool(self.limit >= tol.ILL_CONDITIONED_REL)


def is_beta(name: str, shapes: dict[str, tuple[int, ...]]) -> bool:
    """A BN shift β: a `.bias` whose `.weight` (γ) is a vector; its node is Σ dy over (n,h,w)."""
    gamma = name[: -len("bias")] + "weight"
    return name.endswith(".bias") and len(shapes.get(gamma, ())) == 1


@dataclass
class TieReport:
    net: str
    dtype: str
    rows: list[NodeRow]             # "loss" first, the parameters in signature order, "input" last
    loss: float
    loss_oracle: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> list[NodeRow]:
        return [r for r in self.rows if r.name not in ("input", "loss")]

    @property
    def failed(self) -> list[NodeRow]:
        return [r for r in self.rows if not r.ok]

    @property
    def ill_conditioned(self) -> list[NodeRow]:
        return [r for r in self.rows if r.ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    def row(self, name: str) -> NodeRow:
        return next(r for r in self.rows if r.name == name)

    def worst(self) -> NodeRow:
        return max(self.rows, key=lambda r: r.rel / r.limit)

    def backward_order(self) -> list[NodeRow]:
        """The rows in the order the rendered chain reaches them: the loss (the head's forward), then
        the parameters in reverse signature order (head first; within a conv→BN layer β, γ, then
        the conv), the input cotangent last."""
        by_name = {r.name: r for r in self.rows}
        first = [by_name["loss"]] if "loss" in by_name else []
        last = [by_name["input"]] if "input" in by_name else []
        return first + list(reversed(self.nodes)) + last

    def first_failure(self) -> Optional[NodeRow]:
        """The first node, in backward order, that fails its tolerance (None when all tie)."""
        return next((r for r in self.backward_order() if not r.ok), None)

    def beta_rows(self) -> list[NodeRow]:
        """The BN β rows in backward order: dβ = Σ dy has no weight in the way, so the first β row
        that fails is where the cotangent itself first goes wrong (SPEC §11)."""
        shapes = {r.name: r.shape for r in self.rows}
        return [r for r in self.backward_order() if is_beta(r.name, shapes)]

    def first_beta_failure(self) -> Optional[NodeRow]:
        return next((r for r in self.beta_rows() if not r.ok), None)

    def widened(self) -> list[NodeRow]:
        """Rows whose limit the point's envelope widened past the floor."""
        return [r for r in self.rows if r.by == "envelope"]

    def smallest_bn(self) -> Optional[tuple[str, int]]:
        """(BN layer, M) with the fewest cells: where a batch statistic is most ill-conditioned."""
        cells = self.meta.get("bn_cells") or {}
        return min(cells.items(), key=lambda kv: kv[1]) if cells else None

    def summary(self) -> str:
        nodes = self.nodes
        ill = self.ill_conditioned
        tied = sum(r.ok and not r.ill_conditioned for r in nodes)
        line = f"tied {tied}/{len(nodes)} nodes ({self.dtype})"
        if "input" in {r.name for r in self.rows}:
            inp = self.row("input")
            line += f", input gradient {'tied' if inp.ok else 'FAILED'}"
            if self.meta.get("input_model") == "frozen":
                line += " (pools frozen at σ = argmax)"
        if "loss" in {r.name for r in self.rows} and not self.row("loss").ok:
            line += ", LOSS MISMATCH"
        w = self.worst()
        line += f"; worst {w.rel / w.limit:.2g} of its limit ({w.name}, err {w.rel:.1e} ≤ {w.limit:.1e})"
        widened = self.widened()
        if widened:
            wide = max(widened, key=lambda r: r.limit)
            line += f"; {len(widened)} limits widened past the {self.rows[0].floor:.0e} floor by the point's round-off"
            small = self.smallest_bn()
            line += f" (widest {wide.limit:.1e} at {wide.name}"
            line += f"; smallest BatchNorm reduction M = {small[1]} at {small[0]})" if small else ")"
        if ill:
            line += f"; {len(ill)} rows too ill-conditioned to judge (first: {ill[0].name})"
        if self.failed:
            line += f"; first to break in backward order: {self.first_failure().name}"
        return line

    def table(self) -> str:
        head_ = (f"{'node':<36} {'shape':<18} {'M':>7} {'envelope':>9} {'limit':>8} {'rel err':>9} "
                 f"{'err/lim':>7}  ok")
        lines = [head_, "-" * len(head_)]
        for r in self.rows:
            tag = " (0 in ℝ)" if r.zero_in_reals else ""
            verdict = "ILL" if r.ill_conditioned else ("yes" if r.ok else "NO")
            lines.append(f"{r.name + tag:<36} {str(r.shape):<18} {r.cells if r.cells else '-':>7} "
                         f"{r.envelope:9.1e} {r.limit:8.1e} {r.rel:9.1e} {r.rel / r.limit:7.2f}  {verdict}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "dtype": self.dtype, "ok": self.ok, "summary": self.summary(),
                "loss": self.loss, "loss_oracle": self.loss_oracle, **self.meta,
                "nodes": [{"name": r.name, "shape": list(r.shape), "err": r.err, "scale": r.scale,
                           "rel": r.rel, "limit": r.limit, "envelope": r.envelope, "floor": r.floor,
                           "limit_by": r.by, "cells": r.cells, "zero_in_reals": r.zero_in_reals,
                           "bad": r.bad, "ok": r.ok, "ill_conditioned": r.ill_conditioned}
                          for r in self.rows]}


def zero_in_reals(params: dict[str, jax.Array]) -> set[str]:
    """Conv biases (a `.bias` beside a rank-4 `.weight`): every conv in both nets feeds BatchNorm,
    so their gradient is Σ of a BN input cotangent, which is 0 in ℝ."""
    out = set()
    for name in params:
        if name.endswith(".bias"):
            w = params.get(name[: -len("bias")] + "weight")
            if w is not None and w.ndim == 4:
                out.add(name)
    return out


def targets_matrix(targets: jax.Array, num_classes: int, dtype) -> jax.Array:
    targets = jnp.asarray(targets)
    if targets.ndim == 1:
        return head.one_hot(targets, num_classes, dtype)
    return targets.astype(dtype)


def real_net(net):
    """The net whose forward the oracle differentiates (a planted control wraps the real net)."""
    return getattr(net, "real_net", net)


def net_label(net) -> str:
    """"cifar8", "resnet34", or a control's "resnet34 + same_padding_strided"."""
    return getattr(net, "label", None) or net.__name__.rsplit(".", 1)[-1]


def head_cotangent(net):
    """The cotangent at the logits the rendered chain starts from: the head's six kit ops, unless
    a control plants its own."""
    return getattr(net, "head_cotangent", head.cotangent)


# ---- the two sides --------------------------------------------------------------------------------

def oracle(net, params, x, targets, cfg, label_smoothing: float = 0.0, selections=None):
    """Loss, parameter gradients and input gradient by autodiff of the forward (never a backward).

    The parameter gradients are the real net's. The input gradient is the real net's too, unless
    `selections` {pool: σ} is given: then it is the vector–Jacobian product of the model with those
    pools frozen at σ (the gather model). At a twin tie the input gradient of the real net does not
    exist (moving the image breaks the twins), and the frozen model's is what the rendered chain
    computes at σ = argmax (`batchMapAux_maxPoolBackFlat_eq_selScatter`).
    """
    net = real_net(net)

    def loss(p, x_, sel=None):
        logits, _ = net.forward(p, x_, cfg, selections=sel)
        return reference.smoothed_cross_entropy(logits, targets, label_smoothing)

    if selections is None:
        value, (g, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    else:
        value, g = jax.value_and_grad(loss)(params, x)
        dx = jax.grad(loss, argnums=1)(params, x, selections)
    return value, g, dx


def rendered(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """Loss, parameter gradients and input gradient from the rendered chain."""
    logits, saved = net.forward(params, x, cfg)
    dlogits = head_cotangent(net)(logits, targets, label_smoothing)
    grads, dx = net.backward(params, saved, dlogits, cfg)
    return head.forward(logits, targets, label_smoothing), grads, dx


# Compiled once per (net, config, shapes) and shared by every call: the forward and the backward
# apart, so that controls planting only the cotangent reuse both, and one oracle serves many ties.
# The forward is also the census's and the finite differences' (hence every stage's input too):
# one program where there were three.
@partial(jax.jit, static_argnums=(0, 3))
def _forward(net, params, x, cfg):
    """(logits, saved, [every stage's input]) of the train-mode forward."""
    return net.forward(params, x, cfg, stage_inputs=True)


def _backward_of(backward, params, saved, dlogits, cfg):
    return backward(params, saved, dlogits, cfg)


_backward = jax.jit(_backward_of, static_argnums=(0, 4))
# A planted control's backward runs once or twice at its point, and compiling it dominates: LLVM's
# optimisation passes off halve the compile (ResNet-34, N = 2: 5.7 → 3.0 s) and slow the run ~4×,
# well under a second at a control's shapes. Rounding moves within the point's envelope, so a
# control that hides (init weights) still ties, and one that is caught stays orders beyond it.
QUICK = {"xla_backend_optimization_level": 0}
_backward_control = jax.jit(_backward_of, static_argnums=(0, 4), compiler_options=QUICK)


_oracle = jax.jit(oracle, static_argnums=(0, 4, 5))


@partial(jax.jit, static_argnums=(0, 3))
def _head(cotangent, logits, targets, label_smoothing):
    """(loss, dlogits): the head's forward and the cotangent the chain starts from, one program
    (op by op they were a dozen small ones to compile). The targets are checked before the trace."""
    return head.forward(logits, targets, label_smoothing), cotangent(logits, targets, label_smoothing)


def rendered_nodes(net, params, x, targets, cfg, label_smoothing: float = 0.0, *, op_by_op: bool = False):
    """`rendered`, compiled: (loss, grads, dx). targets: rows [N,K] in x's dtype.

    op_by_op: a planted backward runs op by op instead of as one compiled program. A catalogue
    plants many backwards at one point: their whole-chain programs share nothing, their ops (each
    compiled once per shape, also by the persistent cache) almost everything. ResNet-34's 18
    entries at N = 2, 32 px, on an empty cache: 104 s compiled, 57 s op by op; 0.6 s an entry once
    the ops are compiled. The real chain is always the compiled one."""
    real = real_net(net)
    logits, saved, _ = _forward(real, params, x, cfg)
    head.check_targets("head.cotangent", logits, targets)
    loss, dlogits = _head(head_cotangent(net), logits, targets, float(label_smoothing))
    backward = _backward if real is net else (_backward_of if op_by_op else _backward_control)
    grads, dx = backward(net.backward, params, saved, dlogits, cfg)
    return loss, grads, dx


def oracle_nodes(net, params, x, targets, cfg, label_smoothing: float = 0.0, selections=None):
    """`oracle`, compiled: (loss, grads, dx) by autodiff of the real net's forward."""
    return _oracle(real_net(net), params, x, targets, cfg, label_smoothing, selections)


def piece_of(net, saved):
    """The smooth piece of the loss a point lies in: every ReLU input's sign, every pool's choice."""
    return ({k: z > 0 for k, z in net.preactivations(saved).items()},
            {k: maxpool.select(r, net.POOLS[k]) for k, r in net.pool_inputs(saved).items()})


_piece = jax.jit(piece_of, static_argnums=0)


@partial(jax.jit, static_argnums=0)
def _tied_windows(net, saved):
    """σ = argmax of every pool, and per pool the windows whose positive maximum is attained twice."""
    sel, ties = {}, {}
    for k, r in net.pool_inputs(saved).items():
        win = maxpool.windows(r, net.POOLS[k])
        top = jnp.max(win, axis=-1, keepdims=True)
        sel[k] = maxpool.select(r, net.POOLS[k])
        ties[k] = jnp.sum((jnp.sum(win == top, axis=-1) > 1) & (top[..., 0] > 0))
    return sel, ties


def frozen_selections(net, params, x, cfg) -> tuple[Optional[dict], int]:
    """(σ = argmax of every pool, windows tied at a positive maximum) when there are such ties, else
    (None, 0): the input gradient is then tied to the model frozen at σ."""
    net = real_net(net)
    _, saved, _ = _forward(net, params, x, cfg)
    sel, ties = _tied_windows(net, saved)
    count = sum(int(v) for v in ties.values())
    return (sel, count) if count else (None, 0)


def bn_cells(net, params, x, cfg) -> dict[str, int]:
    """M per BatchNorm layer: the cells each channel's statistics average over (N·H·W; H·W per example)."""
    net = real_net(net)
    _, saved = jax.eval_shape(lambda p, a: net.forward(p, a, cfg), params, x)
    per_ex = getattr(cfg, "bn", "batch") == "example"
    return {name: (1 if per_ex else layer.c.shape[0]) * layer.c.shape[2] * layer.c.shape[3]
            for name, layer in net.bn_layers(saved).items()}


def bn_of(name: str, bn_names) -> Optional[str]:
    """The BatchNorm layer a node belongs to: its own (γ, β) or the one its conv feeds."""
    prefix = name.rsplit(".", 1)[0]
    for cand in (prefix, re.sub(r"conv(\d*)$", r"bn\1", prefix), re.sub(r"downsample\.0$", "downsample.1", prefix)):
        if cand in bn_names:
            return cand
    return None


def host_rng(key) -> np.random.Generator:
    """A NumPy generator seeded from a JAX key (typed or legacy uint32), for draws made on the host."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return np.random.default_rng(np.asarray(data).ravel())


# ---- the verdict -----------------------------------------------------------------------------------

def compare(rendered_grads: dict, oracle_grads: dict, *, envelope: Optional[dict] = None,
            factor: float = tol.ENVELOPE_FACTOR, floor: float = tol.REL_F64, zero_nodes: set[str] = frozenset(),
            dx: Optional[tuple] = None, loss: Optional[tuple] = None, loss_envelope: float = 0.0,
            cells: Optional[dict] = None) -> list[NodeRow]:
    """One row per node: max error relative to max|oracle|, held to max(factor · envelope, floor).

    A node that is 0 in ℝ, or whose oracle is exactly 0, is measured against the net's largest
    gradient (tolerances.ZERO_NODE_SCALE), never against 1.0. `envelope`: node -> max |spread| (the
    point's round-off, `checks.envelope`); without it every limit is the floor. `loss`: (rendered,
    oracle) losses, judged the same way. `cells`: node -> M of its BatchNorm layer.
    """
    envelope = envelope or {}
    cells = cells or {}
    gmax = max((float(np.max(np.abs(np.asarray(g)))) for g in oracle_grads.values()), default=0.0)
    net_scale = tol.ZERO_NODE_SCALE * gmax if gmax > 0 else 1.0
    rows = []
    if loss is not None:
        lr, lo = float(loss[0]), float(loss[1])
        scale = abs(lo) if lo != 0 else 1.0
        env = loss_envelope / scale
        limit = max(factor * env, floor)
        rows.append(NodeRow("loss", (), abs(lr - lo), scale, abs(lr - lo) / scale, limit, False,
                            int(abs(lr - lo) > limit * scale), env, floor))
    pairs = [(k, rendered_grads[k], oracle_grads[k]) for k in oracle_grads]
    if dx is not None:
        pairs.append(("input", dx[0], dx[1]))
    for name, a, b in pairs:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff = np.abs(a64 - b64)
        err = float(np.max(diff))
        zero = name in zero_nodes
        scale = float(np.max(np.abs(b64)))
        if zero or scale == 0:
            scale = max(scale, net_scale)
        env = envelope.get(name, 0.0) / scale
        limit = max(factor * env, floor)
        bad = int(np.sum(diff > limit * scale))
        rows.append(NodeRow(name, tuple(np.shape(a)), err, scale, err / scale, limit, zero, bad, env, floor,
                            cells.get(name)))
    return rows


def tie(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, point: Optional[Point] = None,
        key: Optional[jax.Array] = None, factor: float = tol.ENVELOPE_FACTOR,
        freeze_ties: bool = True, op_by_op: bool = False) -> TieReport:
    """Tie every parameter node, the input cotangent and the loss of `net` to autodiff at (params, x).

    The rendered chain runs in the dtype of params and x (float64 or float32); the reference is the
    float64 oracle at the same (exactly widened) point, so this needs `jax_enable_x64`. Each row is
    held to max(factor × the point's envelope in that dtype, the dtype's floor) (`checks.envelope`).
    Where a pool window ties at a positive maximum, the input cotangent is tied to the model frozen
    at σ = argmax (`freeze_ties=False`: to the real net's autodiff even there, which is the
    derivative only where the ties are twins' — the non-twin tie control). `point`: `reference_at`'s
    reference and envelope, when several ties share them (the controls of one point). `op_by_op`: a
    planted backward runs op by op (`rendered_nodes`), for many controls at one point.
    """
    dtype = np.dtype(x.dtype).name
    if dtype not in tol.FLOORS:
        raise ValueError(f"tie: x must be float64 or float32, got {dtype}")
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    if point is None:
        point = reference_at(net, params, x, t, cfg, label_smoothing=label_smoothing, key=key,
                             freeze_ties=freeze_ties)
    elif point.dtype != dtype:
        raise ValueError(f"tie: the shared point was measured for {point.dtype}, the chain runs in {dtype}")
    return report(net_label(net), params, rendered_nodes(net, params, x, t, cfg, label_smoothing, op_by_op=op_by_op),
                  point, factor=factor)


def report(label: str, params, rendered_side: tuple, point: "Point", *, factor: float = tol.ENVELOPE_FACTOR,
           meta: Optional[dict] = None) -> TieReport:
    """The verdict of one rendered (loss, grads, dx) against the point's reference and envelope:
    the one path every tie (single device, data parallel, a control) reports through."""
    loss_r, g_r, dx_r = rendered_side
    loss_o, g_o, dx_o = point.reference
    # compiled code hands dicts back key-sorted: the rows follow the signature order of params
    g_r, g_o = ({name: g[name] for name in params} for g in (g_r, g_o))
    cells = {name: point.bn_cells[b] for name in params if (b := bn_of(name, point.bn_cells)) is not None}
    rows = compare(g_r, g_o, envelope=point.envelope.nodes, factor=factor, floor=tol.FLOORS[point.dtype],
                   zero_nodes=zero_in_reals(params), dx=(dx_r, dx_o), loss=(loss_r, loss_o),
                   loss_envelope=point.envelope.loss, cells=cells)
    meta = {"input_model": point.input_model, "tied_windows": point.tied_windows,
            "bn_cells": point.bn_cells, "envelope_evaluations": list(point.envelope.evaluations),
            "factor": factor, **(meta or {})}
    return TieReport(net=label, dtype=point.dtype, rows=rows, loss=float(loss_r),
                     loss_oracle=float(loss_o), meta=meta)


@dataclass(frozen=True)
class Point:
    """What every tie at one point shares: the float64 reference and the point's envelope."""
    dtype: str                   # the dtype the envelope was measured for
    reference: tuple             # the float64 oracle's (loss, grads, dx)
    envelope: env_.Envelope
    input_model: str             # "real", or "frozen" (pools frozen at σ = argmax: ties at a positive max)
    tied_windows: int
    bn_cells: dict[str, int]     # M per BatchNorm layer


def reference_at(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
                 key: Optional[jax.Array] = None, freeze_ties: bool = True) -> Point:
    """The float64 oracle at the exactly widened (params, x) and the point's envelope for the dtype
    of x, with what the report states about them (the input model, the BatchNorm reduction sizes).
    freeze_ties=False keeps the real net's input gradient even where pool windows tie."""
    if not jax.config.jax_enable_x64:
        raise ValueError("the tie's reference is float64: it needs jax_enable_x64 "
                         "(jax.config.update('jax_enable_x64', True))")
    dtype = np.dtype(x.dtype).name
    key = jax.random.key(0) if key is None else key
    p64 = {k: to_device(v, np.float64) for k, v in params.items()}
    x64 = to_device(x, np.float64)
    t64 = targets_matrix(targets, cfg.num_classes, jnp.float64)
    real = real_net(net)
    sel, ties = frozen_selections(real, p64, x64, cfg) if freeze_ties else (None, 0)
    reference = oracle_nodes(real, p64, x64, t64, cfg, label_smoothing, sel)

    def evaluate(p, x_, t_, s_):
        return oracle_nodes(real, p, x_, t_, cfg, label_smoothing, s_)

    envelope = env_.measure(evaluate, p64, x64, t64, reference, dtype=dtype, key=key, selections=sel)
    return Point(dtype, reference, envelope, "frozen" if sel is not None else "real", ties,
                 bn_cells(real, p64, x64, cfg))
