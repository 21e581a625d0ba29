"""`gradtie check` and `gradtie.check`: take a point's census, tie every node of a rendered chain to
autodiff and to finite differences, each held to the point's own round-off envelope.

Exit codes, one meaning each:
  0  every row within its limit at a verified smooth point;
  1  a tie row (judgeable or not) over its limit, or a finite difference that FAILED: a wrong chain
     (the first node in backward order is named);
  2  the point cannot be judged: not smooth (the census names the hypothesis, layer, example,
     channel and window), degenerate (a BatchNorm layer averaging M = 1 cell: the layer is named),
     or a row so ill-conditioned that round-off hides a 1 % bug (the layer is named). A finite
     difference with no evidence never changes the code.
By default the point is drawn weights (γ ≠ 1, β and biases ≠ 0), where a backward that confuses γ,
β or a bias cannot hide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import jax
import numpy as np

from .. import data as data_
from .. import nets, parallel, prng, rendered, train
from .. import tolerances as tol
from ..host import available_memory, to_device
from ..nets.protocol import Net, resolution_note
from ..progress import bar, compile_clock, phase
from . import bugs, census, fd, policies, stages
from .bf16 import check as bf16_check
from .tie import Chain, Point, degenerate, degenerate_text, tie

EXIT_TIED, EXIT_FAILED, EXIT_NOT_SMOOTH = 0, 1, 2
WEIGHTS = ("drawn", "init")


@dataclass
class CheckReport:
    """What `gradtie.check` (and `gradtie check` on the command line) found at one point.

    `tie` holds one row per node, the loss and the input gradient, each held to ten times the
    point's round-off envelope (a `TieReport`; None when the census refused the point), `fd_rows`
    the finite differences of the whole loss, `smooth` the census of the point's hypotheses. Read
    `exit_code` (0 tied, 1 a row or a finite difference failed, 2 the point cannot be judged: not
    smooth, too ill-conditioned, or degenerate) and `summary()`, the lines the command prints.
    Mirrors the node ties (`r34_net_tiedB`, `cifar8Bbn_train_step_tiedB`) and, at a smooth point,
    the whole-loss statements (`r34_net_lossGrad`, `cifar8Bbn_net_lossGrad`)."""

    tie: Optional[Any]                    # TieReport (or the bf16 report); None when the point is not smooth
    fd_rows: list
    smooth: Optional[Any] = None          # the census, when it has run
    settings: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    parting: Optional[Any] = None         # a failing tie: the stage where rendered and VJP first part
    degenerate: Optional[tuple] = None    # (BN layer, M = 1): a point no tie can judge (`tie.degenerate`)

    @property
    def ill_conditioned(self) -> list:
        return [] if self.tie is None else list(getattr(self.tie, "ill_conditioned", []))

    @property
    def failed(self) -> list:
        """Rows over their limit: every tie row (judgeable or not) and every finite difference FAILED."""
        rows = [] if self.tie is None else list(self.tie.failed)
        return rows + [r for r in self.fd_rows if r.verdict == "FAILED"]

    @property
    def exit_code(self) -> int:
        """0 (`EXIT_TIED`), 1 (`EXIT_FAILED`: a row over its limit) or 2 (`EXIT_NOT_SMOOTH`: the point
        cannot be judged); a failure wins over a point that cannot be judged."""
        if self.failed:
            return EXIT_FAILED
        if (self.smooth is not None and not self.smooth.ok) or self.tie is None or self.ill_conditioned:
            return EXIT_NOT_SMOOTH
        return EXIT_TIED

    def ill_summary(self) -> str:
        rows = self.ill_conditioned
        if not rows:
            return ""
        cells = self.tie.meta.get("bn_cells") or {}
        line = (f"too ill-conditioned to judge: {len(rows)} rows where round-off alone moves the node by "
                f"≥ {tol.ILL_CONDITIONED_REL:.0%} of itself (first: {rows[0].name}, limit {rows[0].limit:.1e}")
        line += f", its BatchNorm M = {rows[0].cells})" if rows[0].cells else ")"
        if cells:
            layer, m = min(cells.items(), key=lambda kv: kv[1])
            line += f"; the net's smallest BatchNorm reduction is M = {m} at layer {layer}"
        return line

    def summary(self) -> str:
        """The lines `gradtie check` prints: the census, the tie (or why the point is not judged),
        the finite differences and the exit code with its meaning."""
        lines = [] if self.smooth is None else [self.smooth.summary()]
        if self.tie is None:
            lines.append(f"{degenerate_text(self.degenerate)}: not judged (exit 2)" if self.degenerate else
                         "no tie reported: the loss is not differentiable at this point")
            return "\n".join(lines)
        s = self.settings
        where = f"weights {s.get('weights', '?')}" + (f", planted bug {s['plant_bug']}" if s.get("plant_bug") else "")
        lines.append(f"{self.tie.summary()} [{where}]")
        if self.parting is not None:
            lines.append(self.parting.summary())
        if self.fd_rows:
            verdicts, kinks = [r.verdict for r in self.fd_rows], sum(r.kinked for r in self.fd_rows)
            bad = [r for r in self.fd_backward_order() if r.verdict == "FAILED"]
            line = f"finite differences {verdicts.count('ok')}/{len(verdicts)} nodes agree"
            for n, why in ((verdicts.count("no evidence") - kinks, "round-off too large"),
                           (kinks, "a kink within the smallest step")):
                line += f", {n} no evidence ({why})" if n else ""
            if bad:
                line += f", {len(bad)} FAILED (first in backward order: {bad[0].name})"
            lines.append(line)
        if self.ill_conditioned:
            lines.append(self.ill_summary())
        lines.append(f"exit {self.exit_code}: " + {EXIT_TIED: "tied", EXIT_FAILED: "a row failed",
                                                   EXIT_NOT_SMOOTH: "the point cannot be judged"}[self.exit_code])
        return "\n".join(lines)

    def fd_backward_order(self) -> list:
        """The finite-difference rows in the order the backward computes their nodes (the tie's
        `backward_order`): the parameters from the head down, the input cotangent last."""
        return ([r for r in reversed(self.fd_rows) if r.name != "input"]
                + [r for r in self.fd_rows if r.name == "input"])

    def timing_table(self, process: Optional[float] = None) -> str:
        """Where the time went: each phase, the compilation inside them, and, given the process's
        wall seconds so far (`host.process_seconds`), what came before the check (starting Python,
        importing JAX and the kit, drawing or loading the point) and the whole process's total."""
        phases = sum(v for k, v in self.timings.items() if k != "compilation")
        rows = [(k + (" (within the phases)" if k == "compilation" else ""), v) for k, v in self.timings.items()]
        if process is not None and process >= phases:
            rows.insert(0, ("start, imports, the point", process - phases))
        total = process if process is not None and process >= phases else phases
        width = max(22, *(len(k) for k, _ in rows))
        return "\n".join([f"{'phase':<{width}} {'seconds':>8}"] + [f"{k:<{width}} {v:8.1f}" for k, v in rows]
                         + [f"{'total (wall, the whole process)' if process is not None else 'total (wall)':<{width}} "
                            f"{total:8.1f}"])

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "settings": self.settings, "timings": self.timings,
                "degenerate": self.degenerate and {"bn_layer": self.degenerate[0], "cells": self.degenerate[1]},
                "tie": None if self.tie is None else self.tie.as_dict(),
                "first_parting": self.parting and self.parting.as_dict(),
                "finite_differences": [dict(r.__dict__, verdict=r.verdict) for r in self.fd_rows],
                "smooth": None if self.smooth is None else self.smooth.as_dict()}


# ---- the check ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckOptions:
    """What `check` runs at a point besides the census and the tie.

    plant_bug: a catalogue entry (`checks.bugs`) planted in the chain; chain: any rendered side
    (`tie.Chain`) instead. smoothness: take the census first (False: skip it). finite_differences:
    the nodes' central differences (float64, one device). replicas R > 1 (or counts): the
    data-parallel step on R host devices at R·N = batch, tied to one device. bf16: the chain's conv
    sites as bf16 kinds, judged stage by stage (`checks.bf16`); a point whose cfg.policy is tf32 or
    bf16 runs the chain under that execution policy, judged stage by stage (`checks.policies`).
    settings: what the report states
    about how the point was made; timings: a dict the phases' seconds go into; progress: bars on
    stderr, in a terminal."""
    plant_bug: Optional[str] = None
    chain: Optional[Chain] = None
    smoothness: bool = True
    finite_differences: bool = True
    replicas: int = 1
    counts: Optional[tuple[int, ...]] = None
    bf16: bool = False
    settings: Optional[dict] = None
    timings: Optional[dict] = None
    progress: bool = False


def check(net, params, x, targets, cfg=None, *, label_smoothing: float = 0.0, key: Optional[jax.Array] = None,
          options: Optional[CheckOptions] = None) -> CheckReport:
    """Census, tie and finite differences of a rendered chain of `net` at (params, x, targets):
    the point is built and validated here (`tie.Point.of`), then checked (`check_point`).

    net: a `Net` (yours or the book's); params and x in the checked dtype (float64 or float32);
    targets: int labels [N] or rows [N,K]. options: `CheckOptions` (a planted bug, the census, the
    finite differences, replicas, bf16 …). The reference is float64: needs `jax_enable_x64`.
    Returns the report (`.exit_code`)."""
    point = Point.of(net, params, x, targets, cfg, label_smoothing=label_smoothing, key=key)
    return check_point(point, options or CheckOptions())


def check_point(point: Point, options: CheckOptions = CheckOptions()) -> CheckReport:
    """`check` at a point already built (`tie.Point`): the census (`point.census`), then the tie of
    the chain against the point's oracle within its envelope, the first stage where rendered and
    VJP part when a row fails, and the nodes' finite differences, each phase timed."""
    net, o = point.net, options
    if o.plant_bug is not None and o.chain is not None:
        raise ValueError("give plant_bug or chain, not both")
    chain = o.chain
    if o.plant_bug is not None:
        chain = bugs.plant(o.plant_bug, net, point.cfg)
        why = bugs.catalogue(net)[o.plant_bug].refusal(point.alpha, point.batch,
                                                       len(o.counts) if o.counts else o.replicas,
                                                       uneven=len(set(o.counts or ())) > 1)
        if why:
            raise ValueError(f"plant-bug {why}")
    fast = point.cfg.policy != "tie"   # a fast execution policy: tied stage by stage, like bf16 kinds
    if (o.bf16 or fast) and o.replicas > 1:
        what = "bf16" if o.bf16 else f"policy {point.cfg.policy}"
        raise ValueError(f"{what} and replicas together: the {what} check runs one device (check the "
                         f"data-parallel step in float32 or float64)")
    chain, single = chain or Chain(net), o.replicas == 1 and o.counts is None
    key = jax.random.key(0) if point.key is None else point.key
    timings = {} if o.timings is None else o.timings
    settings = dict(o.settings or {}, net=net.name, plant_bug=chain.planted or None)
    smooth, parting, fd_rows = None, None, []
    run_fd = o.finite_differences and point.dtype == "float64" and single
    phases = o.smoothness + (1 if o.bf16 or fast else 2 + run_fd)   # census; bf16/policy, or reference, tie, differences
    flat = degenerate(point.bn_cells)   # M = 1 somewhere: nothing to judge, nothing to run
    if flat:
        return CheckReport(None, [], None, settings, timings, degenerate=flat)
    with compile_clock(timings), bar(desc="check", total=phases, enabled=o.progress) as steps:
        if o.smoothness:
            with phase(timings, "census", steps):
                smooth = point.census
            if not smooth.ok:
                return CheckReport(None, [], smooth, settings, timings)
        if o.bf16:   # a bf16 chain does not tie to float64 autodiff: its stages do, within a bf16 envelope
            with phase(timings, "bf16 check", steps):
                rep = bf16_check(net, point.params, point.x, point.targets, point.cfg, chain=chain,
                                 label_smoothing=point.alpha, key=jax.random.fold_in(key, 2))
            return CheckReport(rep, [], smooth, settings, timings)
        if fast:   # a fast policy's chain ties stage by stage within its own envelope
            with phase(timings, f"{point.cfg.policy} check", steps):
                rep = policies.check(net, point.params, point.x, point.targets, point.cfg, chain=chain,
                                     label_smoothing=point.alpha, key=jax.random.fold_in(key, 2))
            return CheckReport(rep, [], smooth, settings, timings)
        measured = point.with_key(jax.random.fold_in(key, 3))
        with phase(timings, "reference + envelope", steps):
            measured.measured
        with phase(timings, "tie", steps):
            result = tie(measured, chain, replicas=o.replicas, counts=o.counts)
        if single and result.failed:
            steps.total += 1
            with phase(timings, "first parting", steps):
                parting = stages.stage_ties(point.with_key(jax.random.fold_in(key, 4)), chain=chain).first_parting()
        if run_fd:
            with phase(timings, "finite differences", steps):
                out = rendered.run(chain.net, chain.kit, point.params, point.x, point.targets, point.cfg,
                                   alpha=point.alpha, how="compiled" if not chain.planted else "quick")
                # the input row only where the real loss has an input gradient (no tie at a positive max)
                fd_rows = fd.derivatives(measured, out.grads, dx=out.dx, key=jax.random.fold_in(key, 2),
                                         progress=o.progress)
    return CheckReport(result, fd_rows, smooth, settings, timings, parting)


# What one example costs the check, in multiples of its saved activations: the rendered chain and
# the oracle each hold the forward's saved record and about as much again in the backward, and the
# float64 reference and the envelope's evaluations run beside a chain in the checked dtype.
CHECK_MEMORY_FACTOR = 6


def memory_estimate(net: Net, batch: int, image_size: int) -> int:
    """Bytes a check at this batch and size needs, from shapes alone (nothing allocated or compiled):
    CHECK_MEMORY_FACTOR × batch × one example's saved floats, plus the weights (4 copies), at 8
    bytes (the reference is float64 whatever the chain's dtype)."""
    per_example, weights = net.floats(image_size)
    return 8 * (CHECK_MEMORY_FACTOR * batch * per_example + 4 * weights)


def _integer(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} {value!r}: expected a {'positive' if least else 'non-negative'} integer")
    return int(value)


@dataclass(frozen=True)
class CheckRequest:
    """What `gradtie check` is asked, validated where it enters (`run_check`, the CLI).

    batch, image_size (default: the net's), data: "randn" (the default), "photos" or "flat"; `x`
    overrides the images. dtype: the rendered chain's (float64 or float32), tied to the float64
    oracle within that dtype's envelope. bf16: the conv sites as bf16 kinds. policy: the execution
    policy (`gradtie.policy`: tie, tf32, bf16); tf32 and bf16 run the chain from float32 and tie it
    stage by stage (`checks.policies`). seed: the weights',
    images' and labels' draws. weights: "drawn" (the default: γ ~ U(0.5,1.5), β and biases
    nonzero), "init" (γ = 1, β = 0, biases 0) or a checkpoint path. label_smoothing: α (None: 0, or
    0.1 for a planted bug that needs it). plant_bug: a catalogue entry planted in the rendered chain.
    replicas: R > 1 ties the data-parallel step (synchronised BN) at R·N = batch to one device;
    replica_counts: (n_1, …, n_R) summing to batch, uneven replica batches (sets R). plant_tie: the
    convs before the first pool reduced to their centre tap, on flat images (`census.planted_tie`):
    a non-twin tie point, which the census must refuse (exit code 2). smoothness,
    finite_differences, progress: as `CheckOptions`."""
    batch: int = 4
    image_size: Optional[int] = None
    data: Optional[str] = None
    dtype: str = "float64"
    bf16: bool = False
    policy: str = "tie"
    seed: int = 0
    label_smoothing: Optional[float] = None
    smoothness: bool = True
    plant_tie: bool = False
    weights: str = "drawn"
    plant_bug: Optional[str] = None
    replicas: int = 1
    replica_counts: Optional[tuple[int, ...]] = None
    finite_differences: bool = True
    x: Optional[Any] = None
    progress: bool = False

    def __post_init__(self):
        fix = partial(object.__setattr__, self)
        fix("batch", _integer("batch", self.batch))
        fix("replicas", _integer("replicas", self.replicas))
        fix("seed", _integer("seed", self.seed, 0))
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"dtype {self.dtype!r}: expected float64 or float32")
        if self.plant_tie and (self.data not in (None, "flat") or not self.smoothness):
            raise ValueError(f"plant_tie builds its point on flat images (got data {self.data!r}) for the smoothness "
                             f"census to refuse (smoothness {self.smoothness})")
        if self.replica_counts is not None:   # uneven replica batches: R from the counts, which hold the batch
            counts = tuple(self.replica_counts)
            fix("replica_counts", parallel.check_counts("replica-counts", counts, len(counts), self.batch))
            fix("replicas", len(self.replica_counts))
        if self.replicas > 1 and (self.bf16 or self.policy != "tie"):
            what = "bf16" if self.bf16 else f"policy {self.policy}"
            raise ValueError(f"{what} and replicas together: the {what} check runs one device (check the "
                             f"data-parallel step in float32 or float64)")
        if self.replicas > 1:
            parallel.data_mesh(self.replicas)   # more replicas than devices: refused before any work
        if self.replicas > 1 and self.batch % self.replicas and self.replica_counts is None:
            raise ValueError(f"batch {self.batch} (= R·N) must be divisible by replicas {self.replicas}")
        fix("data", self.data or ("flat" if self.plant_tie else "randn"))


def run_check(net="cifar8", **request) -> CheckReport:
    """Build a point and `check` it: what `gradtie check` runs. net: "cifar8", "resnet34", or
    `path.py:NAME` / `module:NAME` (a `Net` of your own); request: the fields of `CheckRequest`
    (batch, image_size, data, dtype, seed, weights, plant_bug, replicas …), validated there."""
    net, req = nets.load(net), CheckRequest(**request)
    point, settings = requested_point(net, req)
    return check_point(point, CheckOptions(plant_bug=req.plant_bug, smoothness=req.smoothness,
                                           finite_differences=req.finite_differences,
                                           replicas=req.replicas if req.replica_counts is None else 1,
                                           counts=req.replica_counts, bf16=req.bf16, settings=settings,
                                           progress=req.progress))


def requested_point(net: Net, req: CheckRequest) -> tuple[Point, dict]:
    """(the point, what the report states about it) for a request: the net's config, weights drawn,
    initialised or loaded, images and labels drawn from the seed, all in the requested dtype."""
    image_size = (32 if net.suite else net.default_size) if req.image_size is None else req.image_size
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or not net.size_ok(image_size):
        raise ValueError(f"image-size {image_size!r}: {net.name} takes {net.size_rule}")
    need, have = memory_estimate(net, req.batch, image_size), available_memory()
    if have is not None and need > have:
        raise ValueError(f"batch {req.batch} at {image_size} px: the check needs about {need / 2**30:.1f} GiB, "
                         f"this machine has {have / 2**30:.1f} GiB available; use a smaller --batch or --image-size")
    key = jax.random.key(req.seed)
    if req.weights in WEIGHTS:
        cfg = net.check_config(bf16=req.bf16, policy=req.policy)
        params = net.init(key, cfg, weights=req.weights)
    else:
        loaded, overrides = train.checkpoint_params(req.weights, net)
        cfg = net.config(bf16=req.bf16, policy=req.policy, **overrides)
        params = {k: to_device(v) for k, v in loaded.items()}
    entry = bugs.catalogue(net).get(req.plant_bug)
    alpha = req.label_smoothing
    if alpha is None and entry is not None and entry.needs_smoothing:
        alpha = 0.1   # the entry plants nothing at α = 0
    alpha = 0.0 if alpha is None else float(alpha)
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"label-smoothing {alpha}: expected 0 ≤ α < 1")
    if req.plant_tie:
        params = census.planted_tie(net, params)
    params = {k: to_device(v, req.dtype) for k, v in params.items()}
    x = data_.images(req.data, req.batch, image_size, seed=req.seed, channels=net.channels) if req.x is None else req.x
    labels = prng.randint(jax.random.fold_in(key, 1), (req.batch,), 0, cfg.num_classes)
    settings = dict(batch=req.batch, image_size=image_size, data=req.data, dtype=req.dtype, bf16=req.bf16,
                    policy=req.policy, seed=req.seed, label_smoothing=alpha, plant_tie=req.plant_tie,
                    weights=req.weights if req.weights in WEIGHTS else str(req.weights), replicas=req.replicas,
                    replica_counts=req.replica_counts, beyond_literal_resolution=resolution_note(net, image_size))
    point = Point.of(net, params, to_device(x, req.dtype), labels, cfg, label_smoothing=alpha, key=key)
    return point, settings
