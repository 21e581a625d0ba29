"""The report `gradtie check --bf16` prints: erasure at identity, every conv site against its
rounding identity and SPEC §7's bound, and every node of the bf16 gradient against its own stage's
reference (`gradient`). Shown in: bf16 erasure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import jax
import jax.numpy as jnp

from ... import prng
from ...nets import stages
from ..tie import targets_matrix
from ...tolerances import BF16_GRADIENT_FACTOR
from .gradient import GradientRow, gradient_rows
from .kinds import ErasureReport, _need_x64, chain_erasure
from .sites import SiteRow, conv_sites, site_rows


@dataclass
class Bf16Report:
    """The bf16 chain of one net: erasure at identity, every conv node against rnd(f32 node at
    rounded operands) and the bound, and every gradient node against its stage's reference."""
    net: str
    rounding: str
    erasure: ErasureReport
    sites: list[SiteRow]
    nodes: list[GradientRow]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> list:
        """Every judged row: the erasure, each conv node, each gradient node (the input last)."""
        return [self.erasure, *self.sites, *self.nodes]

    @property
    def failed(self) -> list:
        return [r for r in self.sites if not r.ok] + [r for r in self.nodes if not r.ok]

    @property
    def ok(self) -> bool:
        return self.erasure.ok and not self.failed

    def worst(self) -> SiteRow:
        return max(self.sites, key=lambda r: r.ratio)

    def summary(self) -> str:
        w = self.worst()
        eq = sum(r.equal for r in self.sites)
        inside = sum(r.ratio <= 1 for r in self.sites)
        wn = max(self.nodes, key=lambda r: r.ratio)
        line = (f"{self.erasure.summary()}; {eq}/{len(self.sites)} conv nodes = rnd(f32 node at rounded "
                f"operands) ({self.rounding}), {inside}/{len(self.sites)} within the bound, worst "
                f"error/bound {w.ratio:.2f} ({w.label}, n={w.n}); gradient vs its stages' reference: "
                f"{sum(r.ok for r in self.nodes)}/{len(self.nodes)} nodes within {BF16_GRADIENT_FACTOR:g}× the "
                f"envelope, worst {wn.ratio:.2f} of the limit ({wn.name})")
        if self.failed:
            first = self.failed[0]
            line += f"; first failing: {getattr(first, 'label', first.name)}"
        return line

    def table(self) -> str:
        head = f"{'conv node':<40} {'n':>7} {'= rnd(f32)':>10} {'max err/M':>10} {'bound':>9} {'ratio':>6}  ok"
        lines = [head, "-" * len(head)]
        for r in self.sites:
            lines.append(f"{r.label:<40} {r.n:>7} {'yes' if r.equal else 'NO':>10} {r.max_rel:10.2e} "
                         f"{r.bound:9.2e} {r.ratio:6.2f}  {'yes' if r.ok else 'NO'}")
        head = (f"{'gradient node':<40} {'‖g − r‖/‖r‖':>11} {'envelope':>9} {'along':>9} {'envelope':>9} "
                f"{'of limit':>8}  ok")
        lines += ["", head, "-" * len(head)]
        for r in self.nodes:
            tag = " (0 in ℝ)" if r.zero_in_reals else ""
            scale = r.scale or 1.0
            lines.append(f"{r.name + tag:<40} {r.rel:11.2e} {max(r.envelope, r.floor) / scale:9.2e} "
                         f"{r.along:+9.1e} {max(r.envelope_along, r.floor_along):9.1e} {r.ratio:8.2f}  "
                         f"{'yes' if r.ok else 'NO'}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "rounding": self.rounding, "ok": self.ok, "summary": self.summary(),
                **self.meta,
                "erasure": {"ok": self.erasure.ok, "outputs": len(self.erasure.equal),
                            "differing": [n for n, e in zip(self.erasure.names, self.erasure.equal) if not e]},
                "sites": [dict(r.__dict__, ratio=r.ratio, ok=r.ok) for r in self.sites],
                "nodes": [dict(r.__dict__, rel=r.rel, ratio=r.ratio, limit=r.limit, limit_along=r.limit_along,
                               ok=r.ok) for r in self.nodes]}


def rounding_name(cfg) -> str:
    r = getattr(cfg, "bf16_rounding", "bf16")
    return r if isinstance(r, str) else getattr(r, "__name__", "custom")


def check(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, key: Optional[jax.Array] = None) -> Bf16Report:
    """The bf16 chain of `net` (cfg.bf16_rounding at every conv site), run in float32: everything
    but the conv sites stays float32 (SPEC §7); errors are measured against float64."""
    _need_x64("the bf16 check")
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    x = jnp.asarray(x, jnp.float32)
    t = targets_matrix(targets, cfg.num_classes, jnp.float32)
    cfg = replace(cfg, bf16=True)
    erasure = chain_erasure(net, params, x, t, cfg, label_smoothing=label_smoothing)
    sites, (loss, _, _) = conv_sites(net, params, x, t, cfg, label_smoothing=label_smoothing)
    rows = site_rows(sites, stages.rounding(cfg))
    seed = int(prng.randint(jax.random.key(0) if key is None else key, (), 0, 2 ** 31 - 1))
    nodes = gradient_rows(net, params, x, t, cfg, label_smoothing=label_smoothing, seed=seed)
    return Bf16Report(erasure.net, rounding_name(cfg), erasure, rows, nodes, {"loss": float(loss)})
