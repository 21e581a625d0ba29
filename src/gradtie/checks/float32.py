"""The float32 view of the whole-net tie: each float32 node against the float64 reference, measured
in units of the node's own perturbation envelope.

A float32 chain cannot tie to 1e-10; how close should it be? We let the float64 gradient say. Nudge
the input by a relative 1e-7 (float32's resolution: its unit roundoff is 6e-8), x·(1 + 1e-7·u) with
u ~ N(0,1) per pixel, and watch how far each float64 node moves; the largest move over a few draws
is the node's envelope E. A float32 chain rounds every intermediate at about that relative size, so
its error against float64 should be a small multiple of E: a node is within the view when

    max|g32 − g64| ≤ max(F32_ENVELOPE_FACTOR · E, F32_FLOOR · scale),

scale = max|g64| of the node (the net's largest gradient for nodes that are 0 in ℝ, whose float64
values are round-off and have no envelope of their own). A node near a kink has a large E (a nudge
can flip a ReLU or a pool's choice), a well-conditioned node a small one; either way the view asks
float32 to be as good as the conditioning allows, no better and no worse. Shown in: Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import tolerances as tol
from .tie import host_rng, net_label, oracle_nodes, real_net, rendered_nodes, targets_matrix, zero_in_reals


@dataclass(frozen=True)
class F32Row:
    name: str
    shape: tuple[int, ...]
    err: float          # max |g32 − g64|
    envelope: float     # max over draws of max |g64(nudged x) − g64(x)|
    scale: float        # max |g64| (the net's max|g| for zero-in-ℝ nodes)
    factor: float
    floor: float
    zero_in_reals: bool

    @property
    def limit(self) -> float:
        return max(self.factor * self.envelope, self.floor * self.scale)

    @property
    def ratio(self) -> float:
        """err / envelope: how many envelopes the float32 node sits from float64."""
        return self.err / self.envelope if self.envelope > 0 else np.inf

    @property
    def ok(self) -> bool:
        return bool(self.err <= self.limit)

    @property
    def by(self) -> str:
        """What admits the node: "envelope", "floor" (only the floor), or "FAILED"."""
        if self.err <= self.factor * self.envelope:
            return "envelope"
        return "floor" if self.ok else "FAILED"


@dataclass
class Float32Report:
    net: str
    rows: list[F32Row]
    nudge: float
    draws: int
    factor: float
    floor: float

    @property
    def nodes(self) -> list[F32Row]:
        return [r for r in self.rows if r.name != "input"]

    @property
    def failed(self) -> list[F32Row]:
        return [r for r in self.rows if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    def backward_order(self) -> list[F32Row]:
        return list(reversed(self.nodes)) + [r for r in self.rows if r.name == "input"]

    def ratios(self, kind: str = "all") -> np.ndarray:
        """err/envelope per row (inf where the envelope is 0); kind "all", "envelope" or "floor"."""
        return np.array([r.ratio for r in self.rows if kind == "all" or r.by == kind])

    def summary(self) -> str:
        by_env = sum(r.by == "envelope" for r in self.rows)
        by_floor = sum(r.by == "floor" for r in self.rows)
        finite = [r.ratio for r in self.rows if r.by == "envelope"]
        line = (f"{self.net} float32: {len(self.rows) - len(self.failed)}/{len(self.rows)} rows within "
                f"view ({by_env} by the {self.factor:g}× envelope, {by_floor} by the floor)")
        if finite:
            line += f"; err/envelope median {np.median(finite):.1f}, max {max(finite):.1f}"
        if self.failed:
            worst = max(self.failed, key=lambda r: r.err / r.limit)
            line += f"; FAILED {len(self.failed)}, worst {worst.name} at {worst.err / worst.limit:.1e}× its limit"
        return line

    def table(self) -> str:
        head = f"{'node':<34} {'err/scale':>10} {'env/scale':>10} {'err/env':>8}  by"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            tag = " (0 in ℝ)" if r.zero_in_reals else ""
            lines.append(f"{r.name + tag:<34} {r.err / r.scale:10.1e} {r.envelope / r.scale:10.1e} "
                         f"{r.ratio:8.2f}  {r.by}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "ok": self.ok, "summary": self.summary(), "nudge": self.nudge,
                "draws": self.draws, "factor": self.factor, "floor": self.floor,
                "nodes": [{"name": r.name, "err": r.err, "envelope": r.envelope, "scale": r.scale,
                           "ratio": r.ratio, "limit": r.limit, "by": r.by, "ok": r.ok}
                          for r in self.rows]}


def _max_abs(a) -> float:
    return float(np.max(np.abs(a)))


def float32_view(net, params, x, targets, cfg, *, label_smoothing: float = 0.0,
                 key: Optional[jax.Array] = None, draws: int = tol.F32_DRAWS,
                 nudge: float = tol.F32_NUDGE, factor: float = tol.F32_ENVELOPE_FACTOR,
                 floor: float = tol.F32_FLOOR) -> Float32Report:
    """The rendered chain of `net` in float32 against the float64 oracle, node by node, in envelopes.

    params, x: any float dtype; both sides run at the float32-rounded point (the float64 reference
    reads exactly the float32 values), so the error is the float32 chain's own. Needs
    `jax_enable_x64`. A control (`checks.controls`) runs its planted float32 chain against the real
    float64 reference.
    """
    if not jax.config.jax_enable_x64:
        raise ValueError("float32_view needs jax_enable_x64 for its float64 reference "
                         "(jax.config.update('jax_enable_x64', True))")
    if draws < 1:
        raise ValueError(f"float32_view: draws must be at least 1, got {draws}")
    key = jax.random.key(0) if key is None else key
    # casts on the host: no per-shape conversion kernels to compile
    p32 = {k: np.asarray(v, np.float32) for k, v in params.items()}
    x32 = np.asarray(x, np.float32)
    t32 = np.asarray(targets_matrix(targets, cfg.num_classes, jnp.float32))
    p64 = {k: v.astype(np.float64) for k, v in p32.items()}
    x64, t64 = x32.astype(np.float64), t32.astype(np.float64)
    p32, p64 = ({k: jnp.asarray(v) for k, v in d.items()} for d in (p32, p64))
    x32, t32, t64 = jnp.asarray(x32), jnp.asarray(t32), jnp.asarray(t64)

    _, g32, dx32 = rendered_nodes(net, p32, x32, t32, cfg, label_smoothing)
    _, g64, dx64 = oracle_nodes(real_net(net), p64, x64, t64, cfg, label_smoothing)
    names = list(params)
    envelope = dict.fromkeys(names + ["input"], 0.0)
    g64, dx64 = {k: np.asarray(v) for k, v in g64.items()}, np.asarray(dx64)
    rng = host_rng(key)
    for _ in range(draws):
        nudged = x64 * (1 + nudge * rng.standard_normal(x64.shape))
        _, gr, dxr = oracle_nodes(real_net(net), p64, jnp.asarray(nudged), t64, cfg, label_smoothing)
        for name in names:
            envelope[name] = max(envelope[name], _max_abs(np.asarray(gr[name]) - g64[name]))
        envelope["input"] = max(envelope["input"], _max_abs(np.asarray(dxr) - dx64))

    gmax = max(_max_abs(g64[name]) for name in names)
    zero = zero_in_reals(p64)
    rows = []
    for name in names + ["input"]:
        a, b = (dx32, dx64) if name == "input" else (g32[name], g64[name])
        err = _max_abs(np.asarray(a, np.float64) - b)
        scale = tol.ZERO_NODE_SCALE * gmax if name in zero else _max_abs(b)
        rows.append(F32Row(name, tuple(b.shape), err, envelope[name], scale if scale > 0 else 1.0,
                           factor, floor, name in zero))
    return Float32Report(net_label(net), rows, nudge, draws, factor, floor)

