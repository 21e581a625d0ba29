"""What `gradtie check --bf16` reports, and the catalogue under bf16.

`check` runs the given chain (the net's own, or one with a planted bug) with every conv site a
bf16 kind, in float32, and judges it three ways: erasure at identity (`kinds`), every conv site
against its rounding identity and SPEC §7's bound (`sites`), and every stage against its VJP at the
chain's own input, cotangent and rounding decisions within the point's envelope (`gradient`). `catalogue` plants
every entry of `checks.bugs` in the bf16 chain and says which are caught, and, for any that is
not, how large its effect is against the smallest the bf16 verdict can see there. Shown in: bf16
erasure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...host import to_device, tree_to_device
from ...nets.layers import rounding
from ...nets.protocol import Pass, as_net
from ...ops import conv
from .. import bugs, stages
from ..tie import Chain, NodeRow, need_x64, targets_matrix
from ...kit import KIT
from .gradient import rounding_name, stage_ties
from .kinds import U_BF16, ErasureReport, chain_erasure
from .sites import SiteRow, run, site_rows


@dataclass
class Bf16Report:
    """The bf16 chain at one point: erasure at identity, every conv node against rnd(f32 node at
    rounded operands) and the bound, and every stage against its VJP within the point's envelope."""
    net: str
    rounding: str
    erasure: ErasureReport
    sites: list[SiteRow]
    stages: stages.StageReport
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> list[NodeRow]:
        """Every stage row, the loss cotangent first, then the stages from the head to the input."""
        return [r for t in self.stages.backward_order() for r in t.rows]

    @property
    def failed(self) -> list:
        """Sites and stage rows over their limit (judgeable or not), and a chain that does not erase."""
        return ([] if self.erasure.ok else [self.erasure]) + [r for r in self.sites if not r.ok] + \
            [r for r in self.rows if not r.ok]

    @property
    def ill_conditioned(self) -> list[NodeRow]:
        return [r for r in self.rows if r.ill_conditioned]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        w = max(self.sites, key=lambda r: r.ratio)
        eq = sum(r.equal for r in self.sites)
        inside = sum(r.ratio <= 1 for r in self.sites)
        name, wn = self.stages.worst()
        rows = self.rows
        line = (f"{self.erasure.summary()}; {eq}/{len(self.sites)} conv nodes = rnd(f32 node at rounded "
                f"operands) ({self.rounding}), {inside}/{len(self.sites)} within the bound, worst error/bound "
                f"{w.ratio:.2f} ({w.label}, n={w.n}); stages vs their VJP: {sum(r.ok for r in rows)}/{len(rows)} "
                f"rows within {self.stages.meta['factor']:g}× the envelope, worst {wn.ratio:.2g} of its "
                f"limit ({name}: {wn.name})")
        parting = self.stages.first_parting()
        if parting is not None:
            line += f"; {parting.summary()}"
        bad = [r.label for r in self.sites if not r.ok]
        return line + (f"; FAILED conv sites: {', '.join(bad[:4])}" if bad else "")

    def table(self) -> str:
        head = f"{'conv node':<40} {'n':>7} {'= rnd(f32)':>10} {'max err/M':>10} {'bound':>9} {'ratio':>6}  ok"
        lines = [head, "-" * len(head)]
        for r in self.sites:
            lines.append(f"{r.label:<40} {r.n:>7} {'yes' if r.equal else 'NO':>10} {r.max_rel:10.2e} "
                         f"{r.bound:9.2e} {r.ratio:6.2f}  {'yes' if r.ok else 'NO'}")
        return "\n".join(lines + ["", self.stages.table()])

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "rounding": self.rounding, "ok": self.ok, "summary": self.summary(), **self.meta,
                "erasure": {"ok": self.erasure.ok, "outputs": len(self.erasure.equal),
                            "differing": [n for n, e in zip(self.erasure.names, self.erasure.equal) if not e]},
                "sites": [dict(r.__dict__, ratio=r.ratio, ok=r.ok) for r in self.sites],
                "stages": self.stages.as_dict()}


def _float32_point(params, x, targets, cfg):
    return ({k: to_device(v, np.float32) for k, v in params.items()}, to_device(x, np.float32),
            targets_matrix(targets, cfg.num_classes, jnp.float32))


def check(net, params, x, targets, cfg, *, chain: Optional[Chain] = None, label_smoothing: float = 0.0,
          key: Optional[jax.Array] = None) -> Bf16Report:
    """The bf16 chain (`chain`, default the net's own; cfg.bf16_rounding at every conv site), run in
    float32: everything but the conv sites stays float32 (SPEC §7); errors are measured against
    float64."""
    need_x64("the bf16 check")
    net = as_net(net)
    chain = chain or Chain(net)
    params, x, t = _float32_point(params, x, targets, cfg)
    cfg = replace(cfg, bf16=True)
    erasure = chain_erasure(net, params, x, t, cfg, chain=chain, label_smoothing=label_smoothing)
    ran = run(chain, params, x, t, cfg, label_smoothing=label_smoothing)
    report = stage_ties(net, params, x, t, cfg, chain=chain, label_smoothing=label_smoothing, key=key, ran=ran)
    return Bf16Report(chain.label, rounding_name(cfg), erasure, site_rows(ran[2], rounding(cfg)), report,
                      {"loss": report.meta["loss"], "bn_cells": report.meta["bn_cells"]})


# ---- the catalogue under bf16 ----------------------------------------------------------------------

@dataclass(frozen=True)
class Bf16Caught:
    """One catalogue entry planted in the bf16 chain. size: the entry's own effect at the row where
    it stands out most against that row's threshold: the smallest relative error the bf16 verdict
    catches there (its limit; at least 2⁻⁸ in a stage holding a bf16 conv site)."""
    bug: str
    family: str
    report: stages.StageReport     # the planted bf16 chain's stage ties
    where: str                     # "stage: row"
    size: float                    # max |planted − real| / the row's scale
    threshold: float               # the smallest relative error the bf16 verdict catches at that row

    @property
    def caught(self) -> bool:
        """A stage row fails a limit that can tell a bug apart."""
        return self.report.first_parting() is not None

    @property
    def above(self) -> bool:
        """The entry's effect is above the point's bf16 sensitivity at some row."""
        return self.size > self.threshold

    def summary(self) -> str:
        parting = self.report.first_parting()
        what = f"caught ({parting.summary()})" if parting else "NOT caught"
        return (f"{self.bug}: {what}; its size {self.size:.1e} at {self.where} against the bf16 threshold "
                f"{self.threshold:.1e} ({'above' if self.above else 'below'} sensitivity)")


def _rows(report: stages.StageReport) -> dict[tuple[str, str], NodeRow]:
    return {(t.net, r.name): r for t in report.backward_order() for r in t.rows}


def _stages_alone(net, kit, cfg, params, inputs, cotangents) -> dict:
    """Each stage of a net definition alone, through a kit: its forward at the recorded input, its
    rendered backward at the recorded cotangent -> {stage: (grads, dx)}."""
    out = {}
    for stage in net.stage_list(cfg):
        _, saved = stage.forward(params, inputs[stage.name], cfg, Pass(kit=kit))
        out[stage.name] = stage.backward(params, saved, cotangents[stage.name], cfg, kit)
    return out


def _sizes(net, chain: Chain, params, cfg, tape, out, targets, alpha) -> dict[tuple[str, str], np.ndarray]:
    """The entry's own effect at every row: its stages alone against the real ones, both in float64
    at the bf16 chain's recorded inputs and cotangents (the rounding carried in float64), and its
    loss cotangent against the loss's own; |planted − real| per row (inf where the shapes differ)."""
    wide = lambda tree: tree_to_device(tree, np.float64)   # noqa: E731
    cfg = replace(cfg, bf16_rounding="nearest") if cfg.bf16_rounding in ("bf16", conv.bf16_operand) else cfg
    args = (cfg, wide(params), wide(tape.inputs), wide(tape.cotangents))
    planted = _stages_alone(chain.net, chain.kit, *args)
    real = _stages_alone(net, KIT, *args)
    names = [s.name for s in net.stage_list(cfg)]

    def diff(a, b):
        return np.full(1, np.inf) if np.shape(a) != np.shape(b) else np.abs(np.asarray(a) - np.asarray(b))
    out_ = {}
    for stage in names:
        (gp, dxp), (gr, dxr) = planted[stage], real[stage]
        out_.update({(stage, k): diff(gp[k], gr[k]) for k in gr})
        out_[(stage, "input")] = diff(dxp, dxr)
    z, t = wide(out.logits), wide(targets)
    out_[(stages.LOSS_COTANGENT, "dlogits")] = diff((chain.kit.loss_cotangent or net.loss.cotangent)(z, t, alpha, None),
                                                    net.loss.cotangent(z, t, alpha, None))
    return out_


def catalogue(net, params, x, targets, cfg, *, label_smoothing: float = 0.1, names: Optional[Sequence[str]] = None,
              key: Optional[jax.Array] = None) -> list[Bf16Caught]:
    """Every single-device catalogue entry that applies to `net` (or those of `names`) planted in
    the bf16 chain in turn and tied stage by stage at the same point (each planted chain runs op by
    op: the entries share their ops, not their programs)."""
    net = as_net(net)
    chosen = [b for b in bugs.entries(net, replicas=False, cfg=cfg) if names is None or b.name in names]
    params, x, t = _float32_point(params, x, targets, cfg)
    cfg = replace(cfg, bf16=True)
    # a stage holding a bf16 conv site sees a bug through its rounded tensors only from about one unit
    # roundoff on: below it the bug may hide in the chain's own rounding decisions
    rounded = {s.name for s in net.stage_list(cfg) if any(np.ndim(params[k]) == 4 for k in s.params)}
    out = []
    for b in chosen:
        if b.needs_smoothing and not label_smoothing:
            raise ValueError(f"{b.name} plants nothing at label_smoothing = 0; use α > 0 (e.g. 0.1)")
        chain = bugs.plant(b.name, net, cfg)
        ran = run(chain, params, x, t, cfg, label_smoothing=label_smoothing, how="eager")
        report = stage_ties(net, params, x, t, cfg, chain=chain, label_smoothing=label_smoothing, key=key,
                            how="eager", ran=ran)
        rows = _rows(report)
        limits = {k: max(r.limit, U_BF16) if k[0] in rounded else r.limit for k, r in rows.items()}
        sizes = {k: float(np.max(d)) / rows[k].scale for k, d in
                 _sizes(net, chain, params, cfg, ran[1], ran[0], t, float(label_smoothing)).items()}
        where = max(sizes, key=lambda k: sizes[k] / limits[k])
        out.append(Bf16Caught(b.name, b.family, report, ": ".join(where), sizes[where], limits[where]))
    return out
