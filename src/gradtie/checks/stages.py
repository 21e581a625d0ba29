"""Per-stage ties: every stage's rendered backward against the VJP of that stage alone, at the
cotangent the rendered chain hands it.

The suite does not compare endpoints only. ResNet-34's input-gradient tie (`r34InputGradB_correct`)
is eighteen stage ties peeled one by one: the stem (its conv→BN→ReLU, `cbReluStridedBBack_eq_vjp_backward`,
then the 3×3/s2 pool), sixteen opaque blocks whose input cotangents are `r34IdCotIn_eq_vjp` (identity)
and `r34DownCotIn_eq_vjp` (downsample), and the head (`r34HeadBBack_eq_vjp_backward`; `r34HeadBHasVJP`
is global, it takes no hypothesis). cifar8's (`cifar8BbnInputGradB_correct`) is seventeen CertLayers:
eight conv→BN→ReLU layers, four 2×2 pools (`maxPool2Layer`), dense, ReLU, dense, ReLU, dense. Here:

- `chain` runs the rendered chain once and records the cotangent it hands every stage;
- `stage_ties` ties each stage (ResNet-34: 18; cifar8: its 5 stages, or `level="layers"`: its 17
  layers) to `jax.vjp` of that piece's forward alone at that cotangent. Each row is held to
  ENVELOPE_FACTOR × the piece's own round-off envelope, measured the way `checks.envelope`
  measures a whole net's: the piece's oracle with the batch reversed and at unit-roundoff nudges of
  its input, its cotangent and its parameters, in the checked dtype; floored at the dtype's floor;
- `first_parting` names the stage where a failing chain first parts from the VJP (backward order:
  the loss cotangent, then the head, … the first stage): a stage handed a wrong cotangent still
  ties at it, so only the stage holding the bug parts;
- `cotangent_tie` ties the whole chain from an arbitrary loss cotangent (the suite's ties hold for
  any dy, not only the cross-entropy one);
- `sweep` ties the whole net at every batch size N of a range, with the census's hypotheses.

Shown in: Whole-net tie.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng, reference
from ..host import to_device
from ..nets import stages as net_stages
from ..ops import batchnorm, conv, dense, head, maxpool, relu
from . import controls
from . import tolerances as tol
from .tie import (NodeRow, TieReport, _forward, bn_cells, bn_of, compare, frozen_selections, head_cotangent,
                  host_rng, net_label, real_net, reference_at, report, targets_matrix, zero_in_reals)

LEVELS = ("stages", "layers")
LOSS_COTANGENT = "loss cotangent"


# ---- pieces: a stage or a layer, its forward alone and where its input sits in `saved` -----------

@dataclass(frozen=True, eq=False)
class Piece:
    """One stage (or cifar8 layer) of a net, as the tie reads it. Hashed by identity: the pieces of
    a (net, config, level) are built once, so their compiled oracle is shared."""
    name: str
    kind: str                   # "stem", "identity", "downsample", "head"; cifar8 layers: "conv-bn-relu",
                                # "pool", "dense", "relu"; "net" for the whole net
    stage: str                  # the net stage it sits in
    params: tuple[str, ...]
    forward: Callable           # (params, x, cfg, selections) -> y: the piece alone (autodiff reads it)
    read_input: Callable        # (saved, x) -> the piece's input at the point
    backward: Optional[Callable] = None  # (params, saved[stage], dy, cfg) -> (grads, dx): a rendered layer
    lean: str = ""


def _stage_forward(stage, params, x, cfg, selections):
    return stage.forward(params, x, cfg, selections=selections)[0]


def _stage_input(stage_name: str, saved, x):
    """A stage's input, read from what its forward saved (the stem reads the image itself)."""
    s = saved[stage_name]
    if hasattr(s, "layer1"):        # cifar8 stages, ResNet-34 blocks: the first conv's input
        return s.layer1.x
    if hasattr(s, "layer"):         # ResNet-34's stem
        return s.layer.x
    if hasattr(s, "f"):             # cifar8's head reads stage 4's [N,C,2,2], flattened in (C,H,W) order
        from ..nets import cifar8
        return s.f.reshape(s.f.shape[0], cifar8.WIDTHS[-1], 2, 2)
    return s.x                      # ResNet-34's head: the GAP input


_STAGE_LEAN = {"stem": "cbReluStridedBBack_eq_vjp_backward + the stem pool (StemPoolSmoothAt)",
               "identity": "r34IdCotIn_eq_vjp", "downsample": "r34DownCotIn_eq_vjp",
               "head": "r34HeadBBack_eq_vjp_backward (r34HeadBHasVJP: global)"}


@lru_cache(maxsize=None)
def _stage_pieces(net, cfg) -> tuple[Piece, ...]:
    lean = _STAGE_LEAN if net.NAME == "resnet34" else {}
    return tuple(Piece(s.name, s.kind, s.name, tuple(s.params), partial(_stage_forward, s),
                       partial(_stage_input, s.name), lean=lean.get(s.kind, ""))
                 for s in net.stage_list(cfg))


def _net_forward(net, params, x, cfg, selections):
    return net.forward(params, x, cfg, selections=selections)[0]


@lru_cache(maxsize=None)
def _net_piece(net, cfg) -> tuple[Piece, ...]:
    lean = "r34InputGradB_correct, r34_net_tiedB" if net.NAME == "resnet34" else \
        "cifar8BbnInputGradB_correct, cifar8Bbn_train_step_tiedB"
    names = tuple(spec.name for spec in net.param_specs(cfg))
    return (Piece(net.NAME, "net", "net", names, partial(_net_forward, net), lambda saved, x: x, lean=lean),)


# ---- cifar8's seventeen CertLayers ----------------------------------------------------------------

def _cbr_forward(j: int, params, x, cfg, selections):
    n, _ = net_stages.conv_bn(params, f"conv{j}", f"bn{j}", x, cfg)
    return relu.forward(n)[0]


# the stage's own chain, split at the layer: reluMaskB, bnBackB, cInB, then the layer's four nodes
def _cbr_backward(j: int, first: bool, params, s, dy, cfg):
    layer, n = (s.layer1, s.n1) if first else (s.layer2, s.n2)
    bn = net_stages.bn_saved(layer, cfg)
    dr = relu.backward(relu.ReluSaved(n), dy)
    dn = batchnorm.backward(bn, params[f"bn{j}.weight"], dr)
    dx = conv.backward(params[f"conv{j}.weight"], dn, input_shape=layer.x.shape, rnd=net_stages.rounding(cfg))
    grads = {**net_stages.conv_nodes(params, f"conv{j}", layer.x, dn, cfg), **net_stages.bn_nodes(f"bn{j}", bn, dr)}
    return grads, dx


def _pool_forward(k: int, params, x, cfg, selections):
    from ..nets import cifar8
    return net_stages.pool(f"pool{k}", cifar8.POOLS[f"pool{k}"], x, selections)[0]


def _pool_backward(k: int, params, s, dy, cfg):
    from ..nets import cifar8
    return {}, net_stages.pool_backward(cifar8.POOLS[f"pool{k}"], s.r2, s.sigma, dy)


def _dense_forward(name: str, params, x, cfg, selections):
    return dense.forward(x, params[f"{name}.weight"], params[f"{name}.bias"])[0]


def _dense_backward(name: str, field_: str, params, s, dy, cfg):
    x = getattr(s, field_)
    return ({f"{name}.weight": dense.grad_weight(x, dy), f"{name}.bias": dense.grad_bias(dy)},
            dense.backward(params[f"{name}.weight"], dy))


def _relu_forward(params, x, cfg, selections):
    return relu.forward(x)[0]


def _relu_backward(field_: str, params, s, dy, cfg):
    return {}, relu.backward(relu.ReluSaved(getattr(s, field_)), dy)


def _field(stage: str, *path: str):
    def read(saved, x):
        v = saved[stage]
        for p in path:
            v = getattr(v, p)
        return v
    return read


@lru_cache(maxsize=None)
def _cifar8_layers(net, cfg) -> tuple[Piece, ...]:
    """The seventeen layers in forward order: (conv→BN→ReLU)², pool per stage; fc1, ReLU, fc2, ReLU, fc3."""
    specs = {spec.name for spec in net.param_specs(cfg)}

    def own(*names):
        return tuple(n for n in names if n in specs)

    out = []
    for k in range(1, 5):
        stage = f"stage{k}"
        for j, first, read in ((2 * k - 1, True, ("layer1", "x")), (2 * k, False, ("layer2", "x"))):
            out.append(Piece(f"conv{j}-bn{j}-relu", "conv-bn-relu", stage,
                             own(f"conv{j}.weight", f"conv{j}.bias", f"bn{j}.weight", f"bn{j}.bias"),
                             partial(_cbr_forward, j), _field(stage, *read), partial(_cbr_backward, j, first),
                             lean="cbReluLayer"))
        out.append(Piece(f"pool{k}", "pool", stage, (), partial(_pool_forward, k), _field(stage, "r2"),
                         partial(_pool_backward, k), lean="maxPool2Layer (MaxPool2Smooth)"))
    for name, x_field, relu_after in (("fc1", "f", "h1"), ("fc2", "r1", "h2"), ("fc3", "r2", None)):
        out.append(Piece(name, "dense", "head", own(f"{name}.weight", f"{name}.bias"), partial(_dense_forward, name),
                         _field("head", x_field), partial(_dense_backward, name, x_field), lean="denseLayer"))
        if relu_after:
            out.append(Piece(f"relu({name})", "relu", "head", (), _relu_forward, _field("head", relu_after),
                             partial(_relu_backward, relu_after), lean="reluOut"))
    return tuple(out)


def pieces(net, cfg, level: str = "stages") -> tuple[Piece, ...]:
    """The pieces a per-stage tie walks, in forward order: the net's stages, or (cifar8, "layers")
    its seventeen CertLayers."""
    net = real_net(net)
    if level not in LEVELS:
        raise ValueError(f"level {level!r}: expected one of {', '.join(LEVELS)}")
    if level == "layers":
        if net.NAME != "cifar8":
            raise ValueError(f"level 'layers' splits cifar8's stages into its seventeen CertLayers; "
                             f"{net.NAME}'s pieces are its stages (level 'stages')")
        return _cifar8_layers(net, cfg)
    return _stage_pieces(net, cfg)


# ---- the rendered chain, run once, recording what it hands each stage ------------------------------

def _recording(records: dict):
    """A patch of the stage fold that records, per stage, the cotangent it is handed and the one it
    hands on; the fold itself (and every stage's backward) is the net's own."""
    real_fold = net_stages.fold_backward

    def fold(stage_list, params, saved, dy, cfg):
        def wrap(stage):
            def backward(p, s, d, c):
                grads, dx = stage.backward(p, s, d, c)
                records[stage.name] = (d, dx)
                return grads, dx
            return dataclasses.replace(stage, backward=backward)
        return real_fold([wrap(s) for s in stage_list], params, saved, dy, cfg)

    return ((net_stages, "fold_backward", fold),)


@partial(jax.jit, static_argnums=(0, 4))
def _recorded_backward(net, params, saved, dlogits, cfg):
    records: dict = {}
    with controls.planted(_recording(records)):
        grads, dx = net.backward(params, saved, dlogits, cfg)
    return grads, dx, records


@dataclass
class Chain:
    """The rendered chain at one point: the cotangent at the logits, every node, and the cotangent
    each stage was handed (at its output) and handed on (at its input)."""
    net: Any                        # the net (or a control) whose backward ran
    cfg: Any
    params: dict
    x: jax.Array
    saved: dict
    logits: jax.Array
    dlogits: jax.Array
    loss: Optional[float]           # the head's loss; None when the chain starts from a given cotangent
    targets: Optional[jax.Array]
    label_smoothing: float
    grads: dict                     # params' keys, signature order
    dx: jax.Array
    handed: dict[str, tuple[jax.Array, jax.Array]]   # stage -> (dy at its output, dx at its input)


def chain(net, params, x, cfg, *, targets=None, label_smoothing: float = 0.0, dlogits=None) -> Chain:
    """Run the rendered chain of `net` at (params, x) from the loss's cotangent (`targets`) or from
    any cotangent at the logits (`dlogits` [N,K]), recording the cotangent each stage is handed."""
    if (targets is None) == (dlogits is None):
        raise ValueError("chain: give targets (the loss's own cotangent) or dlogits (any cotangent), not both")
    real = real_net(net)
    logits, saved, _ = _forward(real, params, x, cfg)
    loss = None
    if dlogits is None:
        targets = targets_matrix(targets, cfg.num_classes, x.dtype)
        dlogits = head_cotangent(net)(logits, targets, label_smoothing)
        loss = float(head.forward(logits, targets, label_smoothing))
    else:
        dlogits = jnp.asarray(dlogits)
        if tuple(dlogits.shape) != tuple(logits.shape):
            raise ValueError(f"chain: dlogits must have the logits' shape {tuple(logits.shape)}, "
                             f"got {tuple(dlogits.shape)}")
        if not jnp.issubdtype(dlogits.dtype, jnp.floating) or not bool(jnp.all(jnp.isfinite(dlogits))):
            raise ValueError("chain: dlogits must hold finite floats")
        dlogits = dlogits.astype(logits.dtype)
    grads, dx, handed = _recorded_backward(net, params, saved, dlogits, cfg)
    grads = {name: grads[name] for name in params}
    handed = {p.name: handed[p.name] for p in reversed(_stage_pieces(real, cfg))}   # backward order
    return Chain(net, cfg, params, x, saved, logits, dlogits, loss, targets, label_smoothing, grads, dx, handed)


def whole_tie(ch: Chain, *, key: Optional[jax.Array] = None, point=None) -> TieReport:
    """The whole-net tie (`tie.tie`'s verdict) of a chain run from the loss's cotangent."""
    if ch.loss is None:
        raise ValueError("whole_tie: the chain starts from a given cotangent; use cotangent_tie")
    if point is None:
        point = reference_at(ch.net, ch.params, ch.x, ch.targets, ch.cfg, label_smoothing=ch.label_smoothing,
                             key=key)
    return report(net_label(ch.net), ch.params, (ch.loss, ch.grads, ch.dx), point)


# cifar8's layers, each stage's chain split at its layers and seeded with the cotangent the stage was
# handed: what each layer hands the next, and each layer's nodes
@partial(jax.jit, static_argnums=(0, 4))
def _layer_chain(layer_pieces, params, saved, stage_dy, cfg):
    out = {}
    for stage in dict.fromkeys(p.stage for p in layer_pieces):
        dy = stage_dy[stage]
        for piece in reversed([p for p in layer_pieces if p.stage == stage]):
            grads, dx = piece.backward(params, saved[stage], dy, cfg)
            out[piece.name] = (grads, dy, dx)
            dy = dx
    return out


# ---- the oracle: each piece's VJP alone, and its envelope -----------------------------------------

@partial(jax.jit, static_argnums=(0, 5))
def _piece_vjps(piece_list, params, inputs, dys, selections, cfg):
    out = {}
    for piece in piece_list:
        sub = {k: params[k] for k in piece.params}
        _, pullback = jax.vjp(lambda p, a, f=piece.forward: f(p, a, cfg, selections), sub, inputs[piece.name])
        out[piece.name] = pullback(dys[piece.name])
    return out


def _host(tree, dtype):
    return jax.tree.map(lambda a: np.asarray(a, dtype), tree)


def _device(tree):
    return jax.tree.map(jnp.asarray, tree)


def _samples(params, inputs, dys, selections, *, dtype: str, key, nudges: int = tol.ENVELOPE_NUDGES):
    """The correct evaluations a piece's envelope is the spread of, as `envelope.samples` draws them
    for a whole net, over every piece at once: (label, params, inputs, cotangents, σ, order)."""
    dt = np.dtype(dtype)
    p64, i64, d64 = _host(params, np.float64), _host(inputs, np.float64), _host(dys, np.float64)
    out = []
    if dt != np.float64:
        out.append(("the point", _host(p64, dt), _host(i64, dt), _host(d64, dt), selections, None))
    n = next(iter(i64.values())).shape[0]
    if n > 1:
        rev = np.arange(n)[::-1].copy()
        sel = None if selections is None else {k: np.asarray(v)[rev] for k, v in selections.items()}
        out.append(("batch reversed", _host(p64, dt), {k: v[rev].astype(dt) for k, v in i64.items()},
                    {k: v[rev].astype(dt) for k, v in d64.items()}, sel, rev))
    else:
        nudges += 1
    u = tol.UNIT_ROUNDOFF[dt.name]
    rng = host_rng(key)

    def nudge(tree):
        return {k: (v * (1 + u * rng.standard_normal(v.shape))).astype(dt) for k, v in tree.items()}

    for r in range(nudges):
        out.append((f"nudge {r + 1} (u = 2^{int(np.log2(u))})", nudge(p64), nudge(i64), nudge(d64), selections, None))
    return out


def _tie_pieces(piece_list, params, inputs, dys, rendered, cfg, *, dtype: str, key, selections,
                cells: dict, factor: float, zero_nodes: set) -> list[TieReport]:
    """One TieReport per piece: the rendered (grads, dx) against the piece's float64 VJP at the same
    (exactly widened) input and cotangent, each row within factor × the piece's envelope."""
    p64 = {k: to_device(v, np.float64) for k, v in params.items()}
    i64 = {k: to_device(v, np.float64) for k, v in inputs.items()}
    d64 = {k: to_device(v, np.float64) for k, v in dys.items()}
    ref = _piece_vjps(piece_list, p64, i64, d64, selections, cfg)
    worst = {p.name: dict.fromkeys(list(p.params) + ["input"], 0.0) for p in piece_list}
    labels = []
    for label, ps, xs, ds, sel, order in _samples(params, inputs, dys, selections, dtype=dtype, key=key):
        got = _piece_vjps(piece_list, _device(ps), _device(xs), _device(ds), None if sel is None else _device(sel), cfg)
        for piece in piece_list:
            g, dx = got[piece.name]
            g_ref, dx_ref = ref[piece.name]
            dx = np.asarray(dx, np.float64)
            if order is not None:
                dx = dx[np.argsort(order)]
            w = worst[piece.name]
            for name in piece.params:
                w[name] = max(w[name], float(np.max(np.abs(np.asarray(g[name], np.float64) - np.asarray(g_ref[name])))))
            w["input"] = max(w["input"], float(np.max(np.abs(dx - np.asarray(dx_ref)))))
        labels.append(label)
    floor = tol.FLOORS[np.dtype(dtype).name]
    out = []
    for piece in piece_list:
        g_r, dx_r = rendered[piece.name]
        g_o, dx_o = ref[piece.name]
        rows = compare({k: g_r[k] for k in piece.params}, {k: g_o[k] for k in piece.params},
                       envelope=worst[piece.name], factor=factor, floor=floor,
                       zero_nodes=zero_nodes & set(piece.params), dx=(dx_r, dx_o),
                       cells={k: cells[k] for k in piece.params if k in cells})
        cot = float(np.max(np.abs(np.asarray(dys[piece.name], np.float64))))
        out.append(TieReport(piece.name, np.dtype(dtype).name, rows, 0.0, 0.0,
                             meta={"kind": piece.kind, "stage": piece.stage, "lean": piece.lean,
                                   "cotangent_max": cot, "envelope_evaluations": labels, "factor": factor}))
    return out


# the loss cotangent: the head's six kit ops against autodiff of the loss in the logits
@jax.jit
def _loss_cotangent(logits, targets, alpha):
    return jax.grad(reference.smoothed_cross_entropy)(logits, targets, alpha)


def _cotangent_report(net, ch: Chain, *, dtype: str, key, factor: float) -> TieReport:
    z64, t64 = np.asarray(ch.logits, np.float64), np.asarray(ch.targets, np.float64)
    ref = np.asarray(_loss_cotangent(jnp.asarray(z64), jnp.asarray(t64), ch.label_smoothing))
    dt = np.dtype(dtype)
    evaluations = [] if dt == np.float64 else [(z64.astype(dt), t64.astype(dt), None)]
    n = z64.shape[0]
    if n > 1:
        rev = np.arange(n)[::-1].copy()
        evaluations.append((z64[rev].astype(dt), t64[rev].astype(dt), rev))
    u, rng = tol.UNIT_ROUNDOFF[dt.name], host_rng(key)
    for _ in range(tol.ENVELOPE_NUDGES + (n == 1)):
        evaluations.append(((z64 * (1 + u * rng.standard_normal(z64.shape))).astype(dt), t64.astype(dt), None))
    spread = 0.0
    for z, t, order in evaluations:
        d = np.asarray(_loss_cotangent(jnp.asarray(z), jnp.asarray(t), ch.label_smoothing), np.float64)
        spread = max(spread, float(np.max(np.abs((d if order is None else d[np.argsort(order)]) - ref))))
    rows = compare({"dlogits": ch.dlogits}, {"dlogits": ref}, envelope={"dlogits": spread}, factor=factor,
                   floor=tol.FLOORS[dt.name])
    return TieReport(LOSS_COTANGENT, dt.name, rows, 0.0, 0.0,
                     meta={"kind": "head fold", "stage": "loss", "factor": factor,
                           "lean": "the six-op head fold (SmoothedLossCot)"})


# ---- the verdicts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parting:
    """Where rendered and VJP first part, walking the chain backward."""
    stage: str          # LOSS_COTANGENT, or the stage (layer) name
    kind: str
    row: NodeRow        # its first failing row in backward order

    def summary(self) -> str:
        return (f"rendered and VJP first part at {self.stage} ({self.kind}): {self.row.name} off by "
                f"{self.row.rel / self.row.limit:.2g}× its limit")


@dataclass
class StageReport:
    net: str
    dtype: str
    level: str                      # "stages" or "layers"
    ties: list[TieReport]           # one per piece, in forward order
    cotangent: Optional[TieReport] = None   # the loss cotangent (the head fold), when the chain starts there
    composition: list[NodeRow] = field(default_factory=list)  # cifar8 layers composed against each stage
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> TieReport:
        return next(t for t in self.ties if t.net == name)

    def backward_order(self) -> list[TieReport]:
        """The loss cotangent first (when there is one), then the pieces from the head to the input."""
        return ([self.cotangent] if self.cotangent is not None else []) + list(reversed(self.ties))

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.backward_order()) and all(r.ok for r in self.composition)

    @property
    def failed(self) -> list[TieReport]:
        return [t for t in self.backward_order() if not t.ok]

    def first_parting(self) -> Optional[Parting]:
        """The first piece, in backward order, whose rendered backward parts from its VJP at the
        cotangent it was handed (rows too ill-conditioned to judge are not a parting)."""
        for t in self.backward_order():
            bad = [r for r in t.backward_order() if not r.ok and not r.ill_conditioned]
            if bad:
                return Parting(t.net, t.meta.get("kind", ""), bad[0])
        return None

    def kind(self, kind: str) -> list[TieReport]:
        return [t for t in self.ties if t.meta.get("kind") == kind]

    def inputs(self, kind: str) -> list[NodeRow]:
        """The input-cotangent rows of every piece of a kind (identity, downsample blocks …)."""
        return [t.row("input") for t in self.kind(kind)]

    def rows(self) -> list[NodeRow]:
        return [r for t in self.ties for r in t.rows]

    def worst(self) -> tuple[str, NodeRow]:
        """(piece, row) with the largest error over its limit."""
        return max(((t.net, r) for t in self.backward_order() for r in t.rows), key=lambda tr: tr[1].rel / tr[1].limit)

    def summary(self) -> str:
        kinds = list(dict.fromkeys(t.meta.get("kind") for t in self.ties))
        tied = sum(t.ok for t in self.ties)
        line = f"{self.net}: {tied}/{len(self.ties)} {self.level} tied to their VJP alone ({self.dtype})"
        line += " (" + ", ".join(f"{sum(t.ok for t in self.kind(k))}/{len(self.kind(k))} {k}" for k in kinds) + ")"
        if self.cotangent is not None:
            line += f"; loss cotangent {'tied' if self.cotangent.ok else 'FAILED'}"
        name, w = self.worst()
        line += f"; worst {w.rel / w.limit:.2g} of its limit ({name}: {w.name})"
        if self.composition:
            worst = max(r.rel for r in self.composition)
            line += f"; the layers compose to each stage ({'yes' if all(r.ok for r in self.composition) else 'NO'}, worst {worst:.1e})"
        parting = self.first_parting()
        if parting is not None:
            line += f"; {parting.summary()}"
        return line

    def table(self) -> str:
        head_ = (f"{'piece':<18} {'kind':<13} {'nodes':>5} {'max|dy|':>9} {'input err':>9} {'input lim':>9} "
                 f"{'worst err/lim':>13}  ok")
        lines = [head_, "-" * len(head_)]
        for t in self.backward_order():
            inp = t.row("input") if "input" in {r.name for r in t.rows} else t.rows[0]
            w = t.worst()
            lines.append(f"{t.net:<18} {t.meta.get('kind', ''):<13} {len(t.nodes):>5} "
                         f"{t.meta.get('cotangent_max', float('nan')):9.1e} {inp.rel:9.1e} {inp.limit:9.1e} "
                         f"{w.rel / w.limit:13.2g}  {'yes' if t.ok else 'NO'}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        parting = self.first_parting()
        return {"net": self.net, "dtype": self.dtype, "level": self.level, "ok": self.ok, "summary": self.summary(),
                "first_parting": None if parting is None else {"stage": parting.stage, "kind": parting.kind,
                                                               "node": parting.row.name},
                "cotangent": None if self.cotangent is None else self.cotangent.as_dict(),
                "pieces": [t.as_dict() for t in self.ties]}


def _check_dtype(op: str, x) -> str:
    dtype = np.dtype(x.dtype).name
    if dtype not in tol.FLOORS:
        raise ValueError(f"{op}: x must be float64 or float32, got {dtype}")
    if not jax.config.jax_enable_x64:
        raise ValueError(f"{op}: the reference is float64: it needs jax_enable_x64 "
                         "(jax.config.update('jax_enable_x64', True))")
    return dtype


def _point(net, params, x, cfg):
    """σ at the float64 point (where a window ties at a positive maximum), and M per BN layer."""
    real = real_net(net)
    p64 = {k: to_device(v, np.float64) for k, v in params.items()}
    x64 = to_device(x, np.float64)
    sel, ties = frozen_selections(real, p64, x64, cfg)
    bn = bn_cells(real, p64, x64, cfg)
    cells = {name: bn[b] for name in params if (b := bn_of(name, bn)) is not None}
    return sel, ties, cells


def stage_ties(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, dlogits=None,
               level: str = "stages", key: Optional[jax.Array] = None, factor: float = tol.ENVELOPE_FACTOR,
               chain_: Optional[Chain] = None) -> StageReport:
    """Tie every stage (or cifar8 layer) of `net`'s rendered backward to the VJP of that piece alone,
    at the cotangent the rendered chain hands it.

    The chain starts from the loss's cotangent (`targets`, `label_smoothing`; the head's six kit ops
    are then tied too, as the loss-cotangent row) or from any cotangent at the logits (`dlogits`,
    with targets None). It runs in the dtype of params and x; each piece's reference is its float64
    VJP at the exactly widened input and cotangent. Where a pool window ties at a positive maximum,
    every piece holding that pool is read frozen at σ = argmax (the gather model), as the whole-net
    tie reads its input gradient. `net` may be a control (`checks.controls`, `checks.bugs`): its
    planted backward runs, the reference is the real net's.
    """
    dtype = _check_dtype("stage_ties", x)
    key = jax.random.key(0) if key is None else key
    real = real_net(net)
    piece_list = pieces(real, cfg, level)
    ch = chain_ or chain(net, params, x, cfg, targets=targets, label_smoothing=label_smoothing, dlogits=dlogits)
    sel, ties, cells = _point(real, params, x, cfg)
    inputs = {p.name: p.read_input(ch.saved, ch.x) for p in piece_list}
    composition: list[NodeRow] = []
    if level == "stages":
        dys = {p.name: ch.handed[p.name][0] for p in piece_list}
        rendered = {p.name: ({k: ch.grads[k] for k in p.params}, ch.handed[p.name][1]) for p in piece_list}
    else:
        stage_dy = {s: d for s, (d, _) in ch.handed.items()}
        layers = _layer_chain(piece_list, ch.params, ch.saved, stage_dy, cfg)
        dys = {name: dy for name, (_, dy, _) in layers.items()}
        rendered = {name: (g, dx) for name, (g, _, dx) in layers.items()}
        # the layers, composed, are the stage: each stage's nodes and the cotangent it hands on
        for stage in dict.fromkeys(p.stage for p in piece_list):
            layers_ = [p for p in piece_list if p.stage == stage]
            g = {k: v for p in layers_ for k, v in rendered[p.name][0].items()}
            stage_dx = ch.handed[stage][1]
            rows = compare(g, {k: ch.grads[k] for k in g}, floor=tol.FLOORS[dtype],
                           zero_nodes=zero_in_reals(params) & set(g),
                           dx=(jnp.reshape(rendered[layers_[0].name][1], stage_dx.shape), stage_dx))
            composition += rows[:-1] + [dataclasses.replace(rows[-1], name=f"{stage}.input")]
    reports = _tie_pieces(piece_list, ch.params, inputs, dys, rendered, cfg, dtype=dtype, key=key,
                          selections=sel, cells=cells, factor=factor, zero_nodes=zero_in_reals(params))
    cot = None
    if ch.loss is not None:
        cot = _cotangent_report(net, ch, dtype=dtype, key=jax.random.fold_in(key, 1), factor=factor)
    return StageReport(net_label(net), dtype, level, reports, cot, composition,
                       meta={"input_model": "frozen" if sel is not None else "real", "tied_windows": ties})


def first_parting(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
                  key: Optional[jax.Array] = None) -> Optional[Parting]:
    """Where the rendered chain of `net` (a real net or one with a planted bug) first parts from the
    VJP, walking backward: the loss cotangent, then each stage at the cotangent it was handed. None
    when every stage ties."""
    return stage_ties(net, params, x, targets, cfg, label_smoothing=label_smoothing, key=key).first_parting()


def cotangent_tie(net, params, x, dlogits, cfg, *, key: Optional[jax.Array] = None,
                  factor: float = tol.ENVELOPE_FACTOR, chain_: Optional[Chain] = None) -> TieReport:
    """The whole rendered chain from an arbitrary cotangent at the logits, against `jax.vjp` of the
    forward at it: every parameter node and the input cotangent, each within factor × the point's
    envelope (the VJP with the batch reversed and at unit-roundoff nudges of the image, the
    cotangent and the parameters). `r34InputGradB_correct` and `cifar8BbnInputGradB_correct` hold
    at every loss cotangent dy, not only at the cross-entropy one."""
    dtype = _check_dtype("cotangent_tie", x)
    key = jax.random.key(0) if key is None else key
    real = real_net(net)
    (piece,) = _net_piece(real, cfg)
    ch = chain_ or chain(net, params, x, cfg, dlogits=dlogits)
    sel, ties, cells = _point(real, params, x, cfg)
    (rep,) = _tie_pieces((piece,), ch.params, {piece.name: ch.x}, {piece.name: ch.dlogits},
                         {piece.name: (ch.grads, ch.dx)}, cfg, dtype=dtype, key=key, selections=sel, cells=cells,
                         factor=factor, zero_nodes=zero_in_reals(params))
    rep.net = f"{net_label(net)} at a given cotangent"
    rep.meta.update(input_model="frozen" if sel is not None else "real", tied_windows=ties)
    return rep


@lru_cache(maxsize=None)
def _stage_records(net, cfg) -> dict:
    return {s.name: s for s in net.stage_list(cfg)}


@partial(jax.jit, static_argnums=(0, 4))
def _stage_at(stage, params, h, dy, cfg):
    _, saved = stage.forward(params, h, cfg)
    return stage.backward(params, saved, dy, cfg)


def tie_at(net, params, stage: str, h, dy, cfg, *, key: Optional[jax.Array] = None,
           factor: float = tol.ENVELOPE_FACTOR, rendered: Optional[tuple] = None) -> TieReport:
    """One stage of `net` tied alone at ANY input h and cotangent dy at its output (not necessarily
    a point the net reaches): the stage's rendered backward, after its own forward at h, against
    the stage's VJP there. The head (GAP, fc) needs no hypothesis at all: `r34HeadBHasVJP` is
    global, so its tie holds wherever it is asked, even where the body sits at a kink. `rendered`:
    (grads, dx) computed elsewhere, in place of the net's own stage backward."""
    dtype = _check_dtype("tie_at", h)
    key = jax.random.key(0) if key is None else key
    real = real_net(net)
    by_name = {p.name: p for p in pieces(real, cfg)}
    if stage not in by_name:
        raise ValueError(f"tie_at: stage {stage!r}: expected one of {', '.join(by_name)}")
    piece = by_name[stage]
    grads, dx = rendered if rendered is not None else _stage_at(_stage_records(real, cfg)[stage], params, h, dy, cfg)
    (rep,) = _tie_pieces((piece,), params, {stage: h}, {stage: dy}, {stage: (grads, dx)}, cfg, dtype=dtype,
                         key=key, selections=None, cells={}, factor=factor, zero_nodes=zero_in_reals(params))
    return rep


def random_cotangent(key, shape, dtype=jnp.float64, kind: str = "normal") -> jax.Array:
    """A cotangent at the logits no loss of ours would hand the chain: "normal" (N(0,1) entries,
    rows not summing to 0), "spike" (one large entry per row), "scaled" (normal × 1e6)."""
    z = prng.normal(key, shape, dtype)
    if kind == "normal":
        return z
    if kind == "scaled":
        return 1e6 * z
    if kind == "spike":
        cls = prng.randint(jax.random.fold_in(key, 1), (shape[0],), 0, shape[1])
        return jax.nn.one_hot(cls, shape[1], dtype=dtype) * 1e3 + 1e-3 * z
    raise ValueError(f"random_cotangent: kind {kind!r}: expected normal, spike or scaled")


# ---- the range of N ------------------------------------------------------------------------------

@dataclass
class SweepRow:
    n: int
    smooth: Any                     # census.SmoothReport
    tie: Optional[TieReport]        # None where the parameter-gradient hypothesis fails

    def holds(self, key: str) -> bool:
        return self.smooth.hypothesis(key).holds

    @property
    def ratio(self) -> float:
        """Worst error over its limit (nan without a tie)."""
        if self.tie is None:
            return float("nan")
        w = self.tie.worst()
        return w.rel / w.limit


@dataclass
class Sweep:
    net: str
    rows: list[SweepRow]

    @property
    def ok(self) -> bool:
        """Every N where the parameter-gradient hypothesis holds ties."""
        return all(r.tie is not None and r.tie.ok for r in self.rows if r.smooth.ok)

    def smallest(self, key: str) -> Optional[int]:
        """The smallest N from which on every N of the sweep keeps hypothesis `key` (and ties)."""
        best = None
        for r in sorted(self.rows, key=lambda r: -r.n):
            if not (r.holds(key) and r.tie is not None and r.tie.ok):
                break
            best = r.n
        return best

    def below(self, key: str) -> Optional[str]:
        """What fails at the largest N below `smallest(key)` (None when nothing below it fails)."""
        n = self.smallest(key)
        under = [r for r in self.rows if n is None or r.n < n]
        if not under:
            return None
        r = max(under, key=lambda r: r.n)
        h = r.smooth.hypothesis(key)
        if not h.holds:
            return f"N = {r.n}: {h.summary()}"
        return f"N = {r.n}: {h.name} holds, but the tie fails ({r.tie.summary() if r.tie else 'no tie'})"

    def table(self) -> str:
        keys = [h.key for h in self.rows[0].smooth.hypotheses]
        names = [self.rows[0].smooth.hypothesis(k).name for k in keys]
        head_ = f"{'N':>3} " + " ".join(f"{n[:24]:>24}" for n in names) + f" {'tied':>9} {'worst err/lim':>13} {'min M':>6}"
        lines = [head_]
        for r in self.rows:
            tied = "-" if r.tie is None else f"{sum(x.ok for x in r.tie.nodes)}/{len(r.tie.nodes)}"
            small = r.tie.smallest_bn() if r.tie is not None else None
            lines.append(f"{r.n:>3} " + " ".join(f"{'holds' if r.holds(k) else 'FAILS':>24}" for k in keys)
                         + f" {tied:>9} {r.ratio:13.2g} {small[1] if small else '-':>6}")
        return "\n".join(lines)


def sweep(net, params, cfg, images: Callable[[int], jax.Array], ns: Sequence[int], *,
          label_smoothing: float = 0.0, labels: Optional[Callable[[int], jax.Array]] = None,
          key: Optional[jax.Array] = None, progress: bool = False) -> Sweep:
    """The whole-net tie at every batch size N in `ns`: the census's hypotheses at each point, and
    the tie wherever the parameter-gradient hypothesis holds. images(N) -> x [N,3,S,S] (its dtype is
    the chain's); labels(N) -> int labels or target rows (default (3n + 1) mod K)."""
    from . import census
    from .tie import tie
    ns = [int(n) for n in ns]
    if not ns or min(ns) < 1:
        raise ValueError(f"sweep: ns must be positive batch sizes, got {ns}")
    key = jax.random.key(0) if key is None else key
    labels = labels or (lambda n: (jnp.arange(n) * 3 + 1) % cfg.num_classes)
    rows = []
    it = ns
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(ns, desc=f"{net_label(net)}: N sweep")
    p64 = {k: to_device(v, np.float64) for k, v in params.items()}
    for n in it:
        x = images(n)
        smooth = census.smoothness(real_net(net), p64, to_device(x, np.float64), cfg)
        rep = None
        if smooth.ok:
            rep = tie(net, params, x, labels(n), cfg, label_smoothing=label_smoothing,
                      key=jax.random.fold_in(key, n))
        rows.append(SweepRow(n, smooth, rep))
    return Sweep(net_label(net), rows)
