"""The whole-net tie: a rendered chain against autodiff of the forward, node by node.

`tie` returns a `TieReport` (one row per parameter node, plus the loss and the input cotangent) and
prints nothing. The rendered side is `gradtie.rendered.step` of a `Chain` — a net definition run
through a kit (`gradtie.kit`): the real one, or one with a planted bug (`checks.bugs`). The
reference is `gradtie.reference.oracle` of the real net's forward and loss, never a backward, and
every row is held to the point's own round-off envelope (`checks.envelope`). Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property, partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import parallel, reference as reference_, rendered
from .. import tolerances as tol
from ..host import to_device, tree_to_device
from ..nets.layers import zero_in_reals
from ..nets.protocol import Net, require_net
from ..ops import maxpool
from ..ops.head import as_targets, targets_matrix  # noqa: F401 (targets_matrix: the checks read it here)
from ..rendered import Chain
from . import envelope as env_


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
    floor: float = 0.0      # the dtype's floor (`tolerances.FLOORS`)
    cells: Optional[int] = None  # M: the cells its BatchNorm layer averages over (None: no BN)
    mismatch: str = ""  # the rendered node's shape or dtype is not its parameter's: a failure whatever its values
    magnitude: float = 0.0  # max |rendered node|

    @property
    def ok(self) -> bool:
        """Within the limit (an ill-conditioned row within it is ok too: see `agrees`)."""
        return not self.mismatch and bool(self.rel <= self.limit)

    @property
    def agrees(self) -> bool:
        """Within a limit that can tell a bug apart: what a chapter or a test means by "tied"."""
        return self.ok and not self.ill_conditioned

    @property
    def ratio(self) -> float:
        return np.inf if self.mismatch else self.rel / self.limit

    @property
    def by(self) -> str:
        """What sets the limit: "envelope" (the point's round-off, widened past the floor) or "floor"."""
        return "floor" if self.limit <= self.floor else "envelope"

    @property
    def ill_conditioned(self) -> bool:
        """Round-off alone moves this node by ILL_CONDITIONED_REL of itself: no bug of that size can
        be told apart from it here."""
        return bool(self.limit >= tol.ILL_CONDITIONED_REL)

    @property
    def verdict(self) -> str:
        return "FAILED" if not self.ok else "ILL" if self.ill_conditioned else "tied"

    @property
    def sensitivity(self) -> float:
        """The smallest relative error δ on this node the verdict catches for sure: the node
        returned as node·(1 + δ) fails its limit for every δ above it, (limit·scale + err) / max|node|.
        Below (limit·scale − err) / max|node| it passes. A node 0 in ℝ is measured against the net's
        scale, so a relative error on it is invisible (a large figure says so)."""
        return (self.limit * self.scale + self.err) / self.magnitude if self.magnitude > 0 else float("inf")

    def describe(self) -> str:
        if self.mismatch:
            return f"{self.name}: {self.mismatch}"
        return f"{self.name}, err {self.rel:.1e} {'≤' if self.ok else '>'} limit {self.limit:.1e}"


def is_beta(name: str, shapes: dict[str, tuple[int, ...]]) -> bool:
    """A BN shift β: a `.bias` whose `.weight` (γ) is a vector; its node is Σ dy over (n,h,w)."""
    return name.endswith(".bias") and len(shapes.get(name[: -len("bias")] + "weight", ())) == 1


def ratio_text(ratio: float) -> str:
    """err/limit for a table: fixed-width, scientific beyond 1e4 (a bug's ratio is 1e9, not 1000000000.00)."""
    return "shape" if not np.isfinite(ratio) else f"{ratio:7.2f}" if ratio < 1e4 else f"{ratio:7.1e}"


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
        """Rows over their limit, judgeable or not (an ill-conditioned row over its limit too)."""
        return [r for r in self.rows if not r.ok]

    @property
    def ill_conditioned(self) -> list[NodeRow]:
        return [r for r in self.rows if r.ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def tied(self) -> bool:
        """Every row within a limit that can tell a bug apart, at a point that is not degenerate."""
        return all(r.agrees for r in self.rows) and not self.degenerate

    @property
    def degenerate(self) -> Optional[tuple[str, int]]:
        """(BN layer, 1) where a BatchNorm layer averages M = 1 cell per channel (`degenerate`)."""
        return degenerate(self.meta.get("bn_cells") or {})

    def row(self, name: str) -> Optional[NodeRow]:
        return next((r for r in self.rows if r.name == name), None)

    def worst(self) -> NodeRow:
        return max(self.rows, key=lambda r: r.ratio)

    def backward_order(self) -> list[NodeRow]:
        """The rows in the order the rendered chain reaches them: the loss (the head's forward), then
        the parameters in reverse signature order (head first; within a conv→BN layer β, γ, then
        the conv), the input cotangent last."""
        return ([r for r in self.rows if r.name == "loss"] + self.nodes[::-1]
                + [r for r in self.rows if r.name == "input"])

    def first_failure(self) -> Optional[NodeRow]:
        """The first row, in backward order, over its limit (None when all are within)."""
        return next((r for r in self.backward_order() if not r.ok), None)

    def beta_rows(self) -> list[NodeRow]:
        """The BN β rows in backward order: dβ = Σ dy has no weight in the way, so the first β row
        that fails is where the cotangent itself first goes wrong."""
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
        line = f"tied {sum(r.agrees for r in self.nodes)}/{len(self.nodes)} nodes ({self.dtype})"
        if self.degenerate:
            line = f"{degenerate_text(self.degenerate)}; not judged: {line}"
        if self.row("input"):
            line += f", input gradient {self.row('input').verdict}"
            if self.meta.get("input_model") == "frozen":
                line += " (pools frozen at σ = argmax)"
        if self.row("loss") and not self.row("loss").ok:
            line += ", LOSS MISMATCH"
        w = self.worst()
        line += f"; {w.describe()}" if w.mismatch else f"; worst {w.ratio:.2g} of its limit ({w.describe()})"
        widened, small = self.widened(), self.smallest_bn()
        if widened:
            wide = max(widened, key=lambda r: r.limit)
            line += (f"; {len(widened)} limits widened past the {self.rows[0].floor:.0e} floor by the point's round-off"
                     f" (widest {wide.limit:.1e} at {wide.name}")
            line += f"; smallest BatchNorm reduction M = {small[1]} at {small[0]})" if small else ")"
        ill = self.ill_conditioned
        if ill:
            line += f"; {len(ill)} rows too ill-conditioned to judge (first: {ill[0].name})"
        if self.failed:
            line += f"; first to break in backward order: {self.first_failure().name}"
        return line

    def sensitivity(self) -> tuple[float, float]:
        """(median, largest) over the parameter nodes that are not 0 in ℝ of the smallest relative
        error each row catches for sure (`NodeRow.sensitivity`): how small a bug the check sees here."""
        values = sorted(r.sensitivity for r in self.nodes if not r.zero_in_reals)
        return (float(np.median(values)), values[-1]) if values else (float("inf"), float("inf"))

    def sensitivity_table(self) -> str:
        lines = [f"{'node':<36} {'limit':>8} {'caught from δ':>14}"]
        lines += [f"{r.name:<36} {r.limit:8.1e} {r.sensitivity:14.1e}" + ("  (0 in ℝ)" if r.zero_in_reals else "")
                  for r in self.rows if r.name != "loss"]
        median, worst = self.sensitivity()
        lines.append(f"a node off by a relative δ is caught from δ = {median:.1e} (median node), every node from "
                     f"δ = {worst:.1e} (nodes 0 in ℝ aside)")
        return "\n".join(lines)

    def table(self) -> str:
        head_ = (f"{'node':<36} {'shape':<18} {'M':>7} {'envelope':>9} {'limit':>8} {'rel err':>9} "
                 f"{'err/lim':>7}  verdict")
        return "\n".join([head_, "-" * len(head_)] + [
            f"{r.name + (' (0 in ℝ)' if r.zero_in_reals else ''):<36} {str(r.shape):<18} {r.cells or '-':>7} "
            f"{r.envelope:9.1e} {r.limit:8.1e} {r.rel:9.1e} {ratio_text(r.ratio)}  {r.verdict}" for r in self.rows])

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "dtype": self.dtype, "ok": self.ok, "summary": self.summary(),
                "loss": self.loss, "loss_oracle": self.loss_oracle, **self.meta,
                "nodes": [dict(asdict(r), shape=list(r.shape), limit_by=r.by, ok=r.ok,
                               ill_conditioned=r.ill_conditioned) for r in self.rows]}


def piece_of(net: Net, saved, stages=None):
    """The smooth piece of the loss a point lies in: every ReLU input's sign, every pool's choice
    (of `stages` only, when given: a suffix of the net run from its input)."""
    return ({k: z > 0 for k, z in net.preactivations(saved, stages).items()},
            {k: maxpool.select(r, net.pools[k]) for k, r in net.pool_inputs(saved, stages).items()})


@partial(jax.jit, static_argnums=0)
def _tied_windows(net: Net, saved):
    """σ = argmax of every pool, and per pool the windows whose positive maximum is attained twice."""
    sel, ties = {}, {}
    for k, r in net.pool_inputs(saved).items():
        win = maxpool.windows(r, net.pools[k])
        top = jnp.max(win, axis=-1, keepdims=True)
        sel[k] = maxpool.select(r, net.pools[k])
        ties[k] = jnp.sum((jnp.sum(win == top, axis=-1) > 1) & (top[..., 0] > 0))
    return sel, ties


def frozen_selections(net: Net, params, x, cfg) -> tuple[Optional[dict], int]:
    """(σ = argmax of every pool, windows tied at a positive maximum) when there are such ties, else
    (None, 0): the input gradient is then tied to the model frozen at σ."""
    sel, ties = _tied_windows(net, rendered.forward(net, params, x, cfg)[1])
    count = sum(int(v) for v in ties.values())
    return (sel, count) if count else (None, 0)


def bn_cells(net: Net, params, x, cfg) -> dict[str, int]:
    """M per BatchNorm layer: the cells each channel's statistics average over (N·H·W; H·W per example)."""
    _, saved = jax.eval_shape(lambda p, a: net.forward(p, a, cfg), params, x)
    per_ex = cfg.per_example_bn
    return {name: (1 if per_ex else layer.c.shape[0]) * layer.c.shape[2] * layer.c.shape[3]
            for name, layer in net.bn_layers(saved).items()}


def degenerate(cells: dict[str, int]) -> Optional[tuple[str, int]]:
    """The first BatchNorm layer whose channels average M = 1 cell (cells: M per layer, `bn_cells`),
    or None. There x̂ = 0 exactly, the layer outputs β whatever its input, and every node upstream
    of it is 0 in ℝ: both sides are round-off, and no tie can judge the point (ResNet-34 at 32 px and
    N = 1: layer4's 1×1 maps)."""
    return next(((name, m) for name, m in cells.items() if m == 1), None)


def degenerate_text(where: tuple[str, int]) -> str:
    return (f"degenerate point: BatchNorm {where[0]} normalises M = {where[1]} value per channel (x̂ = 0), so "
            f"every node upstream of it is 0 in ℝ")


def node_cells(net: Net, cfg, cells: dict[str, int]) -> dict[str, int]:
    """M per node: that of the BatchNorm layer it belongs to or feeds, as the net's parameter specs
    declare (`Net.bn_of`; cells: M per layer); nodes of no BatchNorm left out."""
    return {name: cells[bn] for name, bn in net.bn_of(cfg).items() if bn in cells}


# ---- the verdict -----------------------------------------------------------------------------------

def _mismatch(got, want_shape, want_dtype) -> str:
    shape, dtype = tuple(np.shape(got)), np.dtype(jnp.result_type(got)).name
    if shape != tuple(want_shape):
        return f"shape {shape}, its parameter's is {tuple(want_shape)}"
    return f"dtype {dtype}, the checked dtype is {want_dtype}" if want_dtype not in (None, dtype) else ""


@dataclass(frozen=True)
class Limit:
    """How `compare` holds each row: to max(factor · envelope/scale, floor). `envelope`: node ->
    the largest absolute spread of the node (the point's round-off, `checks.envelope`; the key
    "loss" for the loss row); without it every limit is the floor."""
    envelope: Optional[dict] = None
    factor: float = tol.ENVELOPE_FACTOR
    floor: float = tol.REL_F64


def compare(rendered_grads: dict, oracle_grads: dict, *, limit: Limit = Limit(), zero_nodes: set[str] = frozenset(),
            dx: Optional[tuple] = None, loss: Optional[tuple] = None, cells: Optional[dict] = None,
            dtype: Optional[str] = None) -> list[NodeRow]:
    """One row per node: max error relative to max|oracle|, held to `limit` (max(factor · envelope,
    floor)).

    A node that is 0 in ℝ, or whose oracle is exactly 0, is measured against the net's largest
    gradient (tolerances.ZERO_NODE_SCALE), never against 1.0. `loss`: (rendered, oracle) losses,
    judged the same way (a row "loss" first). `cells`: node -> M of its BatchNorm layer. A rendered
    node whose shape is not its oracle's (its parameter's), or whose dtype is not `dtype` (the
    checked one), fails whatever its values (nothing is broadcast).
    """
    envelope, factor, floor = dict(limit.envelope or {}), limit.factor, limit.floor
    envelope.setdefault("loss", 0.0)
    cells = cells or {}
    gmax = max((float(np.max(np.abs(np.asarray(g)))) for g in oracle_grads.values()), default=0.0)
    net_scale = tol.ZERO_NODE_SCALE * gmax if gmax > 0 else 1.0
    pairs = [("loss", *loss)] if loss is not None else []
    pairs += [(k, rendered_grads[k], oracle_grads[k]) for k in oracle_grads]
    if dx is not None:
        pairs.append(("input", dx[0], dx[1]))
    rows = []
    for name, a, b in pairs:
        b64 = np.asarray(b, np.float64)
        mismatch = _mismatch(a, np.shape(b64), None if name == "loss" else dtype)
        a64 = np.asarray(a, np.float64)
        diff = np.abs(a64 - b64) if not mismatch else np.full(b64.shape, np.inf)
        err = float(np.max(diff)) if diff.size else 0.0
        zero = name in zero_nodes
        scale = float(np.max(np.abs(b64))) if b64.size else 0.0
        if zero or scale == 0:
            scale = max(scale, net_scale)
        env = envelope.get(name, 0.0) / scale
        limit = max(factor * env, floor)
        bad = int(np.sum(diff > limit * scale))
        magnitude = float(np.max(np.abs(a64))) if a64.size and not mismatch else 0.0
        rows.append(NodeRow(name, tuple(np.shape(a)), err, scale, err / scale, limit, zero, bad, env, floor,
                            cells.get(name), mismatch, magnitude))
    return rows


class Measured(NamedTuple):
    """What a point's ties share, measured once: the float64 oracle and the round-off envelope."""
    reference: tuple             # the float64 oracle's (loss, grads, dx)
    envelope: env_.Envelope
    input_model: str             # "real", or "frozen" (pools frozen at σ = argmax: ties at a positive max)
    tied_windows: int


@dataclass(frozen=True, eq=False)
class Point:
    """One checked point, built and validated once where input enters (`Point.of`: `gradtie check`,
    `gradtie.check`, a chapter) and handed to every check: the `Net` and its config, the parameters
    and the images in the checking dtype (float64 or float32), the target rows [N,K] in that dtype,
    α (label smoothing), the key of its envelope's draws, and whether pool ties are read frozen at
    σ. What the checks derive from it is derived once and kept: the exact float64 widening
    (`wide`), the float64 oracle and the point's round-off envelope (`measured`), the BatchNorm
    reduction sizes (`bn_cells`) and the smoothness census (`census`). Built directly (not through
    `of`), `targets` may hold any cotangent-shaped array (a cotangent tie's dlogits)."""
    net: Net
    cfg: Any
    params: dict
    x: jax.Array
    targets: Optional[jax.Array]
    alpha: float = 0.0
    key: Optional[jax.Array] = None
    freeze_ties: bool = True

    @classmethod
    def of(cls, net, params: dict, x, targets=None, cfg=None, *, label_smoothing: float = 0.0,
           key: Optional[jax.Array] = None) -> "Point":
        """The point, validated: `net` a `Net`; x [N,C,H,W] float64 or float32 (which needs
        jax_enable_x64: the oracle is float64); every parameter a float array in x's dtype;
        targets int labels [N] or rows [N,K] summing to 1 (None: no loss at this point);
        0 ≤ label_smoothing < 1. A clear ValueError names what is wrong."""
        require_net(net, "tie.Point.of")
        cfg = net.cfg(cfg)
        dtype = checked_dtype(net.name, x)
        if not isinstance(params, dict) or not params:
            raise ValueError(f"{net.name}: params must be a dict of arrays by name, got "
                             f"{'an empty dict' if isinstance(params, dict) else type(params).__name__}")
        wrong = [f"{k} ({np.dtype(jnp.result_type(v)).name})" for k, v in params.items()
                 if np.dtype(jnp.result_type(v)).name != dtype]
        if wrong:
            raise ValueError(f"{net.name}: the parameters must be in the checked dtype {dtype} (that of x): "
                             f"{', '.join(wrong[:4])}{' …' if len(wrong) > 4 else ''}")
        alpha = float(label_smoothing)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"{net.name}: label_smoothing {label_smoothing}: expected 0 ≤ α < 1")
        if targets is not None:
            targets = as_targets(net.name, targets, int(x.shape[0]), cfg.num_classes, dtype)
        return cls(net, cfg, {k: to_device(v) for k, v in params.items()}, to_device(x), targets, alpha, key)

    def real_input_gradient(self) -> "Point":
        """The same point with its oracle read on the real net even where pool windows tie at a
        positive maximum (no freezing at σ): the non-twin tie control's input row."""
        return replace(self, freeze_ties=False)

    @property
    def dtype(self) -> str:
        """The checked dtype: the rendered chain's, the envelope's."""
        return np.dtype(self.x.dtype).name

    @property
    def batch(self) -> int:
        return int(self.x.shape[0])

    @cached_property
    def wide(self) -> tuple[dict, jax.Array, Optional[jax.Array]]:
        """(params, x, targets) widened exactly to float64: the oracle's and the census's point."""
        return tree_to_device((self.params, self.x, self.targets), np.float64)

    @cached_property
    def bn_cells(self) -> dict[str, int]:
        """M per BatchNorm layer (`bn_cells`), from shapes alone."""
        return bn_cells(self.net, self.params, self.x, self.cfg)

    @cached_property
    def measured(self) -> Measured:
        """The float64 oracle at the widened point and its envelope for the checked dtype; pools
        with a tie at a positive maximum frozen at σ unless freeze_ties is False (the real net's
        input gradient even there: the non-twin tie control)."""
        p64, x64, _ = self.wide
        sel, ties = frozen_selections(self.net, p64, x64, self.cfg) if self.freeze_ties else (None, 0)
        ref = reference_.compiled(self.net, p64, x64, self.wide[2], self.cfg, self.alpha, sel)
        envelope = env_.measure(self, ref, selections=sel)
        return Measured(ref, envelope, "frozen" if sel is not None else "real", ties)

    @property
    def reference(self) -> tuple:
        return self.measured.reference

    @property
    def envelope(self) -> env_.Envelope:
        return self.measured.envelope

    @property
    def input_model(self) -> str:
        return self.measured.input_model

    @property
    def tied_windows(self) -> int:
        return self.measured.tied_windows

    @cached_property
    def census(self):
        """The smooth-point census (`census.smoothness`), read at the float64 point with the real
        loss's precision (a bf16 chain rounds conv outputs to 8 bits, which makes exact ties
        between cells that are not twins)."""
        from . import census
        p64, x64, _ = self.wide
        return census.smoothness(self.net, p64, x64, replace(self.cfg, bf16=False, policy="tie"))

    def with_key(self, key: Optional[jax.Array]) -> "Point":
        """The same point with another key for its envelope's draws (its widening and census kept)."""
        moved = replace(self, key=key)
        for kept in ("wide", "bn_cells", "census"):
            if kept in self.__dict__:
                moved.__dict__[kept] = self.__dict__[kept]
        return moved

    def in_dtype(self, dtype: str) -> "Point":
        """The point rounded to `dtype` (float64 or float32): its own oracle and envelope."""
        if dtype not in tol.FLOORS:
            raise ValueError(f"dtype {dtype!r}: expected float64 or float32")
        return replace(self, params={k: to_device(v, dtype) for k, v in self.params.items()},
                       x=to_device(self.x, dtype), targets=None if self.targets is None else to_device(self.targets, dtype))


def need_x64(op: str) -> None:
    if not jax.config.jax_enable_x64:
        raise ValueError(f"{op}: the reference is float64: it needs jax_enable_x64 "
                         "(jax.config.update('jax_enable_x64', True))")


def checked_dtype(op: str, x) -> str:
    dtype = np.dtype(jnp.result_type(x)).name
    if dtype not in tol.FLOORS:
        raise ValueError(f"{op}: x must be float64 or float32, got {dtype}")
    need_x64(op)
    return dtype


def reference_at(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
                 key: Optional[jax.Array] = None, freeze_ties: bool = True) -> Point:
    """The point (`Point.of`) with its float64 oracle and envelope measured: what several ties
    share. freeze_ties=False keeps the real net's input gradient even where pool windows tie."""
    point = Point.of(net, params, x, targets, cfg, label_smoothing=label_smoothing, key=key)
    point = point if freeze_ties else point.real_input_gradient()
    point.measured
    return point


def report(label: str, params, rendered_side: tuple, point: Point, *, factor: float = tol.ENVELOPE_FACTOR,
           meta: Optional[dict] = None) -> TieReport:
    """The verdict of one rendered (loss, grads, dx) against the point's reference and envelope:
    the one path every tie (single device, data parallel, a planted chain) reports through."""
    loss_r, g_r, dx_r = rendered_side
    loss_o, g_o, dx_o = point.reference
    # compiled code hands dicts back key-sorted: the rows follow the signature order of params
    missing = [name for name in params if name not in g_r]
    if missing:
        raise ValueError(f"tie: the rendered chain returns no node for {missing[:4]}")
    g_r, g_o = ({name: g[name] for name in params} for g in (g_r, g_o))
    limit = Limit({**point.envelope.nodes, "loss": point.envelope.loss}, factor, tol.FLOORS[point.dtype])
    rows = compare(g_r, g_o, limit=limit, zero_nodes=zero_in_reals(params), dx=(dx_r, dx_o), loss=(loss_r, loss_o),
                   cells=node_cells(point.net, point.cfg, point.bn_cells), dtype=point.dtype)
    meta = {"input_model": point.input_model, "tied_windows": point.tied_windows,
            "bn_cells": point.bn_cells, "envelope_evaluations": list(point.envelope.evaluations),
            "factor": factor, **(meta or {})}
    return TieReport(label, point.dtype, rows, float(loss_r), float(loss_o), meta)


def tie(point: Point, chain: Optional[Chain] = None, *, factor: float = tol.ENVELOPE_FACTOR,
        how: Optional[str] = None, replicas: int = 1, counts: Optional[tuple[int, ...]] = None,
        sync_bn: bool = True, devices=None) -> TieReport:
    """Tie every parameter node, the input cotangent and the loss of a rendered chain to autodiff
    of the point's net at the point (`Point`: built once, `Point.of` or `reference_at`), each row
    within max(factor × the point's envelope, the dtype's floor).

    chain: the rendered side (default: the net through the real kit; `checks.bugs.plant` plants a
    bug), run in the point's dtype (float64 or float32); the reference and envelope are the
    point's, measured once however many ties share it. how: `rendered.run`'s (default: compiled for
    the real chain, quick for a planted one where `rendered.quick_pays`, as the mesh step is).
    replicas R > 1, counts (n_1, …, n_R), or devices: the data-parallel step on a mesh of R
    `devices` (default `jax.devices()`; R = 1 too), replica r holding N = batch/R of x's rows, or
    n_r (padded on the mesh), tied to the same single-device oracle at x (`r34_net_syncTiedB`: the
    all-reduced nodes are the single-device nodes at N := R·N); sync_bn=False: per-replica BatchNorm (the control that must fail).
    """
    if not isinstance(point, Point):
        raise TypeError(f"tie: give the Point (tie.Point.of(net, params, x, targets, cfg)), got {type(point).__name__}")
    chain = chain or Chain(point.net)
    if counts is not None:
        counts = parallel.check_counts("tie", counts, len(tuple(counts)), point.batch)
        if replicas not in (1, len(counts)):
            raise ValueError(f"tie: replicas {replicas} but {len(counts)} counts {counts}")
        replicas = len(counts)
    params, x, t, cfg = point.params, point.x, point.targets, point.cfg
    if replicas == 1 and counts is None and devices is None:
        out = rendered.run(chain.net, chain.kit, params, x, t, cfg, alpha=point.alpha,
                           how=how or ("quick" if chain != Chain(point.net) and rendered.quick_pays(x)
                                       else "compiled"))
        return report(chain.label, params, (out.loss, out.grads, out.dx), point, factor=factor)
    out = parallel.forward_backward(chain.net, params, x, t, cfg, mesh=parallel.data_mesh(replicas, devices=devices),
                                    kit=chain.kit, label_smoothing=point.alpha, sync_bn=sync_bn, counts=counts,
                                    quick=rendered.quick_pays(x))
    label = f"{chain.label} on {replicas} replicas" + (f" holding {'+'.join(map(str, counts))}" if counts else "")
    n = point.batch // replicas
    return report(label + ("" if sync_bn else " (per-replica BN)"), params, (out.loss, out.grads, out.dx), point,
                  factor=factor, meta={"replicas": replicas, "per_replica": n, "sync_bn": sync_bn,
                                       "counts": list(counts) if counts is not None else [n] * replicas})


def float32_view(point: Point, chain: Optional[Chain] = None) -> TieReport:
    """The float32 view of the tie: the chain in float32 against the float64 oracle, node by node,
    within the point's float32 envelope (correct float32 evaluations say how close float32 can be:
    a node near a kink or behind a small BatchNorm reduction is asked for less, a well-conditioned
    one for more). Both sides read the float32-rounded point (the reference widens it exactly), so
    the error is the float32 chain's own."""
    return tie(point.in_dtype("float32"), chain)
