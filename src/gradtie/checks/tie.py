"""The whole-net tie: the rendered chain against autodiff of the forward, node by node.

`tie` returns a `TieReport` (one row per parameter node, plus the input cotangent) and prints
nothing. The oracle is built from the net's forward and `gradtie.reference`'s loss, never from a
backward. Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference
from ..ops import head
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

    @property
    def ok(self) -> bool:
        return bool(self.rel <= self.limit)


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
            line += f"; first failing node: {self.failed[0].name}"
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
                           "ok": r.ok} for r in self.rows]}


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


def oracle(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """Loss, parameter gradients and input gradient by autodiff of the forward (never a backward)."""
    def loss(p, x_):
        logits, _ = net.forward(p, x_, cfg)
        return reference.smoothed_cross_entropy(logits, targets, label_smoothing)

    value, (g, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    return value, g, dx


def rendered(net, params, x, targets, cfg, label_smoothing: float = 0.0):
    """Loss, parameter gradients and input gradient from the rendered chain."""
    logits, saved = net.forward(params, x, cfg)
    dlogits = head.cotangent(logits, targets, label_smoothing)
    grads, dx = net.backward(params, saved, dlogits, cfg)
    return head.forward(logits, targets, label_smoothing), grads, dx


def compare(rendered_grads: dict, oracle_grads: dict, *, limit: float, zero_nodes: set[str],
            dx: Optional[tuple] = None) -> list[NodeRow]:
    """One row per node: max error relative to max|oracle| (floored for zero-in-ℝ nodes)."""
    gmax = max(float(jnp.max(jnp.abs(g))) for g in oracle_grads.values())
    rows = []
    pairs = [(k, rendered_grads[k], oracle_grads[k]) for k in oracle_grads]
    if dx is not None:
        pairs.append(("input", dx[0], dx[1]))
    for name, a, b in pairs:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = float(np.max(np.abs(a64 - b64)))
        zero = name in zero_nodes
        scale = float(np.max(np.abs(b64)))
        if zero:
            scale = max(scale, tol.ZERO_NODE_FLOOR * gmax)
        scale = scale if scale > 0 else 1.0
        rows.append(NodeRow(name, tuple(a.shape), err, scale, err / scale, limit, zero))
    return rows


def tie(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
        limit: float = tol.REL_F64) -> TieReport:
    """Tie every parameter node and the input cotangent of `net` to autodiff at (params, x).

    Runs in the dtype of params and x (float64 needs `jax_enable_x64`).
    """
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    loss_r, g_r, dx_r = jax.jit(rendered, static_argnums=(0, 4, 5))(net, params, x, t, cfg, label_smoothing)
    loss_o, g_o, dx_o = jax.jit(oracle, static_argnums=(0, 4, 5))(net, params, x, t, cfg, label_smoothing)
    rows = compare(g_r, g_o, limit=limit, zero_nodes=zero_in_reals(params), dx=(dx_r, dx_o))
    return TieReport(net=net.__name__.rsplit(".", 1)[-1], dtype=str(x.dtype), rows=rows,
                     loss=float(loss_r), loss_oracle=float(loss_o))
