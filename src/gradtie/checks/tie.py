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

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..ops import head, maxpool
from . import fd
from . import tolerances as tol


@dataclass(frozen=True)
class NodeRow:
    name: str
    shape: tuple[int, ...]
    err: float          # max |rendered − oracle|
    scale: float        # the denominator: max |oracle|, or the floor for zero-in-ℝ nodes
    rel: float          # err / scale
    limit: float        # the tolerance rel is held to
    zero_in_reals: bool
    bad: int = 0        # entries off by more than limit·scale (for a β row: the channels wrong)

    @property
    def ok(self) -> bool:
        return bool(self.rel <= self.limit)


def is_beta(name: str, shapes: dict[str, tuple[int, ...]]) -> bool:
    """A BN shift β: a `.bias` whose `.weight` (γ) is a vector; its node is Σ dy over (n,h,w)."""
    gamma = name[: -len("bias")] + "weight"
    return name.endswith(".bias") and len(shapes.get(gamma, ())) == 1


@dataclass
class TieReport:
    net: str
    dtype: str
    rows: list[NodeRow]
    loss: float
    loss_oracle: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> list[NodeRow]:
        return [r for r in self.rows if r.name != "input"]

    @property
    def failed(self) -> list[NodeRow]:
        return [r for r in self.rows if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    def worst(self) -> NodeRow:
        return max(self.rows, key=lambda r: r.rel / r.limit)

    def backward_order(self) -> list[NodeRow]:
        """The rows in the order the rendered chain reaches them: the parameters in reverse signature
        order (head first; within a conv→BN layer β, γ, then the conv), the input cotangent last."""
        inp = [r for r in self.rows if r.name == "input"]
        return list(reversed(self.nodes)) + inp

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

    def summary(self) -> str:
        nodes = self.nodes
        tied = sum(r.ok for r in nodes)
        line = f"tied {tied}/{len(nodes)} nodes"
        inp = [r for r in self.rows if r.name == "input"]
        if inp:
            line += f", input gradient {'tied' if inp[0].ok else 'FAILED'}"
        w = self.worst()
        line += f"; worst rel err {w.rel:.1e} ({w.name}, limit {w.limit:.0e})"
        if self.failed:
            line += f"; first to break in backward order: {self.first_failure().name}"
        return line

    def table(self) -> str:
        head_ = f"{'node':<36} {'shape':<18} {'rel err':>9} {'limit':>7}  ok"
        lines = [head_, "-" * len(head_)]
        for r in self.rows:
            tag = " (0 in ℝ)" if r.zero_in_reals else ""
            lines.append(f"{r.name + tag:<36} {str(r.shape):<18} {r.rel:9.1e} {r.limit:7.0e}  "
                         f"{'yes' if r.ok else 'NO'}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "dtype": self.dtype, "ok": self.ok, "summary": self.summary(),
                "loss": self.loss, "loss_oracle": self.loss_oracle, **self.meta,
                "nodes": [{"name": r.name, "shape": list(r.shape), "err": r.err, "scale": r.scale,
                           "rel": r.rel, "limit": r.limit, "zero_in_reals": r.zero_in_reals,
                           "bad": r.bad, "ok": r.ok} for r in self.rows]}


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


def oracle(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """Loss, parameter gradients and input gradient by autodiff of the forward (never a backward)."""
    net = real_net(net)

    def loss(p, x_):
        logits, _ = net.forward(p, x_, cfg)
        return reference.smoothed_cross_entropy(logits, targets, label_smoothing)

    value, (g, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    return value, g, dx


def rendered(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """Loss, parameter gradients and input gradient from the rendered chain."""
    logits, saved = net.forward(params, x, cfg)
    dlogits = head_cotangent(net)(logits, targets, label_smoothing)
    grads, dx = net.backward(params, saved, dlogits, cfg)
    return head.forward(logits, targets, label_smoothing), grads, dx


# Compiled once per (net, config, shapes) and shared by every call: the forward and the backward
# apart, so that controls planting only the cotangent reuse both, and one oracle serves many ties.
@partial(jax.jit, static_argnums=(0, 3))
def _forward(net, params, x, cfg):
    return net.forward(params, x, cfg)


@partial(jax.jit, static_argnums=(0, 4))
def _backward(backward, params, saved, dlogits, cfg):
    return backward(params, saved, dlogits, cfg)


_oracle = jax.jit(oracle, static_argnums=(0, 4, 5))


def rendered_nodes(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """`rendered`, compiled: (loss, grads, dx). targets: rows [N,K] in x's dtype."""
    logits, saved = _forward(real_net(net), params, x, cfg)
    dlogits = head_cotangent(net)(logits, targets, label_smoothing)
    grads, dx = _backward(net.backward, params, saved, dlogits, cfg)
    return head.forward(logits, targets, label_smoothing), grads, dx


def oracle_nodes(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """`oracle`, compiled: (loss, grads, dx) by autodiff of the real net's forward."""
    return _oracle(real_net(net), params, x, targets, cfg, label_smoothing)


@partial(jax.jit, static_argnums=0)
def _piece(net, saved):
    """The smooth piece of the loss a point lies in: every ReLU input's sign, every pool's choice."""
    return ({k: z > 0 for k, z in net.preactivations(saved).items()},
            {k: maxpool.select(r, net.POOLS[k]) for k, r in net.pool_inputs(saved).items()})


def host_rng(key) -> np.random.Generator:
    """A NumPy generator seeded from a JAX key (typed or legacy uint32), for draws made on the host."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return np.random.default_rng(np.asarray(data).ravel())


def _same_piece(a, b) -> bool:
    return all(np.array_equal(a[i][k], b[i][k]) for i in (0, 1) for k in a[i])


def derivatives(net, params, x, targets, cfg, grads: dict, *, key, names=None,
                label_smoothing: float = 0.0):
    """Each node is the derivative of the whole loss: `fd.FDRow`s, one per node in `names`.

    Central differences of the real loss (the forward's logits through `gradtie.reference`'s loss)
    along a random unit direction v in the node, against ⟨rendered node, v⟩, at O(h²) where the
    loss is smooth. Real batches hold windows within 1e-6 of a tie, and a difference taken across
    a kink measures nothing; so h starts at FD_STEP and shrinks (÷4, down to FD_MIN_STEP) until both
    ends θ ± h·v lie in the smooth piece of θ: every ReLU input with the same sign, every pool
    window with the same choice. The forward that gives the loss gives the piece, so the check
    costs no extra evaluation. float64. Directions are drawn and parameters moved on the host.
    """
    fwd_net = real_net(net)
    t = targets_matrix(targets, cfg.num_classes, x.dtype)

    def evaluate(p):
        logits, saved = _forward(fwd_net, p, x, cfg)
        loss = float(reference.smoothed_cross_entropy(logits, t, label_smoothing))
        return loss, jax.tree.map(np.asarray, _piece(fwd_net, saved))

    names = list(params) if names is None else list(names)
    host = {k: np.asarray(v) for k, v in params.items()}
    _, here = evaluate(host)
    gnorm = max(float(np.linalg.norm(np.asarray(g))) for g in grads.values())
    rng = host_rng(key)
    rows = []
    for name in names:
        v = rng.standard_normal(host[name].shape)
        v /= np.linalg.norm(v)
        h = tol.FD_STEP
        while True:
            plus, piece_plus = evaluate(dict(host, **{name: host[name] + h * v}))
            minus, piece_minus = evaluate(dict(host, **{name: host[name] - h * v}))
            if (_same_piece(piece_plus, here) and _same_piece(piece_minus, here)) or h / 4 < tol.FD_MIN_STEP:
                break
            h /= 4
        value = (plus - minus) / (2 * h)
        dot = float(np.vdot(np.asarray(grads[name]), v))
        scale = max(abs(value), abs(dot), tol.ZERO_NODE_FLOOR * gnorm)
        rows.append(fd.FDRow(name, value, dot, abs(value - dot) / scale, tol.FD_REL))
    return rows


def compare(rendered_grads: dict, oracle_grads: dict, *, limit: float, zero_nodes: set[str],
            dx: Optional[tuple] = None) -> list[NodeRow]:
    """One row per node: max error relative to max|oracle|; a node that is 0 in ℝ is measured
    against the net's largest gradient instead (tolerances.ZERO_NODE_SCALE)."""
    gmax = max(float(np.max(np.abs(np.asarray(g)))) for g in oracle_grads.values())
    rows = []
    pairs = [(k, rendered_grads[k], oracle_grads[k]) for k in oracle_grads]
    if dx is not None:
        pairs.append(("input", dx[0], dx[1]))
    for name, a, b in pairs:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        diff = np.abs(a64 - b64)
        err = float(np.max(diff))
        zero = name in zero_nodes
        scale = float(np.max(np.abs(b64)))
        if zero:
            scale = max(scale, tol.ZERO_NODE_SCALE * gmax)
        scale = scale if scale > 0 else 1.0
        bad = int(np.sum(diff > limit * scale))
        rows.append(NodeRow(name, tuple(a.shape), err, scale, err / scale, limit, zero, bad))
    return rows


def tie(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
        limit: float = tol.REL_F64, reference: Optional[tuple] = None) -> TieReport:
    """Tie every parameter node and the input cotangent of `net` to autodiff at (params, x).

    Runs in the dtype of params and x (float64 needs `jax_enable_x64`). `reference`: the oracle's
    (loss, grads, dx) at this very point, when several ties share it (`oracle_nodes`).
    """
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    loss_r, g_r, dx_r = rendered_nodes(net, params, x, t, cfg, label_smoothing)
    if reference is None:
        reference = oracle_nodes(net, params, x, t, cfg, label_smoothing)
    loss_o, g_o, dx_o = reference
    # compiled code hands dicts back key-sorted: the rows follow the signature order of params
    g_r, g_o = ({name: g[name] for name in params} for g in (g_r, g_o))
    rows = compare(g_r, g_o, limit=limit, zero_nodes=zero_in_reals(params), dx=(dx_r, dx_o))
    return TieReport(net=net_label(net), dtype=str(x.dtype), rows=rows,
                     loss=float(loss_r), loss_oracle=float(loss_o))
