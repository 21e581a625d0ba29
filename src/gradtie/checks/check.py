"""`gradtie check`: build a point, take its census, tie every node to autodiff and to finite
differences, each held to the point's own round-off envelope.

Exit codes: 0 every node tied at a smooth point; 1 a node failed (the first in backward order is
named); 2 the point is not smooth, or so ill-conditioned that round-off alone hides a 1 % bug (the
report names the hypothesis or the layer). By default the point is drawn weights (γ ≠ 1, β and
biases ≠ 0), where a backward that confuses γ, β or a bias cannot hide.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng
from ..host import to_device
from . import tolerances as tol
from .tie import QUICK, TieReport, reference_at, report, targets_matrix, tie

EXIT_TIED, EXIT_FAILED, EXIT_NOT_SMOOTH = 0, 1, 2
WEIGHTS = ("drawn", "init")


@dataclass
class CheckReport:
    tie: Optional[TieReport]              # None when the census found the point not smooth
    fd_rows: list
    smooth: Optional[Any] = None          # the smoothness verdict, when the census has run
    settings: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    parting: Optional[Any] = None         # a failing tie: the stage where rendered and VJP first part

    @property
    def ill_conditioned(self) -> list:
        return [] if self.tie is None else getattr(self.tie, "ill_conditioned", [])

    @property
    def failed(self) -> list:
        """Rows (tie and finite differences) that fail a limit that can tell a bug apart."""
        if self.tie is not None and not isinstance(self.tie, TieReport):   # the bf16 report
            rows = [] if self.tie.ok else [self.tie]
        else:
            rows = [] if self.tie is None else [r for r in self.tie.failed if not r.ill_conditioned]
        return rows + [r for r in self.fd_rows if not r.ok and not r.ill_conditioned]

    @property
    def exit_code(self) -> int:
        if self.smooth is not None and not self.smooth.ok:
            return EXIT_NOT_SMOOTH
        if self.failed:
            return EXIT_FAILED
        if self.ill_conditioned:
            return EXIT_NOT_SMOOTH
        return EXIT_TIED

    def ill_summary(self) -> str:
        rows = self.ill_conditioned
        if not rows:
            return ""
        cells = (self.tie.meta.get("bn_cells") or {}) if self.tie else {}
        small = min(cells.items(), key=lambda kv: kv[1]) if cells else None
        line = (f"too ill-conditioned to judge: {len(rows)} rows where round-off alone moves the node by "
                f"≥ {tol.ILL_CONDITIONED_REL:.0%} of itself (first: {rows[0].name}, limit {rows[0].limit:.1e}")
        line += f", its BatchNorm M = {rows[0].cells})" if rows[0].cells else ")"
        if small:
            line += f"; the net's smallest BatchNorm reduction is M = {small[1]} at layer {small[0]}"
        return line

    def summary(self) -> str:
        lines = [] if self.smooth is None else [self.smooth.summary()]
        if self.tie is None:
            lines.append("no tie reported: the loss is not differentiable at this point")
            return "\n".join(lines)
        s = self.settings
        where = f"weights {s.get('weights', '?')}"
        if s.get("plant_bug"):
            where += f", planted bug {s['plant_bug']}"
        lines.append(f"{self.tie.summary()} [{where}]" if isinstance(self.tie, TieReport) else self.tie.summary())
        if self.parting is not None:
            lines.append(self.parting.summary())
        if self.fd_rows:
            ok = sum(r.verdict == "ok" for r in self.fd_rows)
            none = sum(r.verdict == "no evidence" for r in self.fd_rows)
            bad = [r for r in self.fd_rows if r.verdict == "FAILED"]
            line = f"finite differences {ok}/{len(self.fd_rows)} nodes agree"
            if none:
                line += f", {none} no evidence (round-off too large)"
            if bad:
                line += f", {len(bad)} FAILED (first in backward order: {bad[-1].name})"
            lines.append(line)
        if self.ill_conditioned:
            lines.append(self.ill_summary())
        return "\n".join(lines)

    def timing_table(self) -> str:
        total = sum(v for k, v in self.timings.items() if k != "compilation")
        lines = [f"{'phase':<22} {'seconds':>8}"]
        lines += [f"{k:<22} {v:8.1f}" for k, v in self.timings.items()]
        lines.append(f"{'total (wall)':<22} {total:8.1f}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "settings": self.settings, "timings": self.timings,
                "tie": None if self.tie is None else self.tie.as_dict(),
                "first_parting": None if self.parting is None else {
                    "stage": self.parting.stage, "kind": self.parting.kind, "node": self.parting.row.name},
                "finite_differences": [dict(r.__dict__, verdict=r.verdict) for r in self.fd_rows],
                "smooth": None if self.smooth is None else self.smooth.as_dict()}


def net_module(name: str):
    from ..nets import cifar8, resnet34
    nets = {"cifar8": cifar8, "resnet34": resnet34}
    if name not in nets:
        raise ValueError(f"net {name!r}: expected one of {', '.join(nets)}")
    return nets[name]


def make_batch(data: str, batch: int, image_size: int, seed: int):
    """Images in [0,1] (photos, flat) or standard normal (randn), as float64 NumPy-backed arrays."""
    from .. import data as data_
    if data == "randn":
        return prng.normal(jax.random.key(seed), (batch, 3, image_size, image_size), jnp.float64)
    if data == "photos":
        return to_device(data_.photos(batch, image_size, seed=seed), np.float64)
    if data == "flat":
        return to_device(data_.flat_images(batch, image_size, seed=seed), np.float64)
    raise ValueError(f"data {data!r}: expected one of randn, photos, flat")


def checkpoint_params(path, net) -> tuple[dict, dict]:
    """(params, Config overrides) from a training checkpoint (`gradtie train`'s checkpoint.npz, or a
    folder holding one, or an .npz of state_dict names). One-line errors name the file and what is wrong."""
    file = Path(path)
    if file.is_dir():
        file = file / "checkpoint.npz"
    if not file.is_file():
        raise FileNotFoundError(f"weights {str(path)!r}: no such checkpoint (expected a .npz file or a "
                                f"folder holding checkpoint.npz)")
    try:
        with np.load(file) as z:
            flat = {k: z[k] for k in z.files}
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"weights {str(file)!r}: not a readable .npz checkpoint ({type(e).__name__}: {e})") from None
    params = {k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")} or flat
    names = [spec.name for spec in net.param_specs(net.Config(conv_bias="conv1.bias" in params))]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"weights {str(file)!r}: lacks {missing[0]} ({len(missing)} of {net.NAME}'s tensors "
                         f"missing): a checkpoint of another net?")
    overrides = {"conv_bias": "conv1.bias" in params}
    if net.NAME == "cifar8":
        overrides.update(head_width=int(params["fc1.weight"].shape[0]), num_classes=int(params["fc3.weight"].shape[0]))
    else:
        overrides.update(num_classes=int(params["fc.weight"].shape[0]))
    return {n: params[n] for n in names}, overrides


@contextmanager
def _phase(timings: dict, name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


@contextmanager
def _compile_clock(timings: dict):
    """Adds up the backend's compile time (jax.monitoring events) while the check runs."""
    total = [0.0]

    def listener(event, duration, **_):
        if "backend_compile" in event:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield
    finally:
        timings["compilation"] = total[0]
        try:
            jax.monitoring.unregister_event_duration_listener(listener)
        except Exception:  # older JAX: listeners cannot be removed; it only counts
            pass


def _validate(net, batch, dtype, plant_tie, data, smoothness, weights, replicas):
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype {dtype!r}: expected float64 or float32")
    if not jax.config.jax_enable_x64:
        raise ValueError("the check's reference is float64: it needs jax_enable_x64 "
                         "(jax.config.update('jax_enable_x64', True))")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch {batch!r}: expected a positive integer")
    if plant_tie and data not in (None, "flat"):
        raise ValueError(f"plant_tie builds its point on flat images; got data {data!r} (use flat)")
    if plant_tie and not smoothness:
        raise ValueError("plant_tie needs the smoothness census (it exists to be refused by it)")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas {replicas!r}: expected a positive integer")
    if replicas > 1 and replicas > len(jax.devices()):
        raise ValueError(f"replicas {replicas}: only {len(jax.devices())} devices (on a CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={replicas} before JAX starts; "
                         f"`gradtie check --replicas` does)")


def run_check(net: str = "cifar8", *, batch: int = 4, image_size: Optional[int] = None,
              data: Optional[str] = None, dtype: str = "float64", bf16: bool = False, seed: int = 0,
              label_smoothing: Optional[float] = None, smoothness: bool = True, plant_tie: bool = False,
              weights: str = "drawn", plant_bug: Optional[str] = None, replicas: int = 1,
              replica_counts: Optional[tuple[int, ...]] = None,
              finite_differences: bool = True, x: Optional[jax.Array] = None) -> CheckReport:
    """Tie every node of `net` at a fresh point; needs `jax_enable_x64` (the reference is float64).

    weights: "drawn" (the default: γ ~ U(0.5,1.5), β and biases nonzero), "init" (γ = 1, β = 0,
    biases 0) or a checkpoint path. data: "randn" (the default), "photos" or "flat"; `x` overrides
    the images. dtype: the rendered chain's dtype, tied to the float64 oracle within that dtype's
    envelope. plant_bug: a `checks.bugs` catalogue entry planted in the rendered backward.
    replicas: R > 1 ties the data-parallel step (synchronised BN) at R·N = batch to one device.
    replica_counts: (n_1, …, n_R) summing to batch, uneven replica batches (sets R).
    plant_tie: the convs before the first pool reduced to their centre tap, on flat images
    (`census.planted_tie`): a non-twin tie point, which the census must refuse (exit code 2).
    """
    if replica_counts is not None:   # uneven replica batches: R from the counts, which hold the batch
        from ..parallel import check_counts
        replica_counts = check_counts("replica-counts", replica_counts, len(tuple(replica_counts)), batch)
        replicas = len(replica_counts)
    _validate(net, batch, dtype, plant_tie, data, smoothness, weights, replicas)
    from . import bugs
    data = data or ("flat" if plant_tie else "randn")
    mod = net_module(net)
    image_size = image_size or 32
    timings: dict[str, float] = {}
    key = jax.random.key(seed)
    overrides = {"num_classes": 10} if net == "resnet34" else {}
    if weights in WEIGHTS:
        cfg = mod.Config(bf16=bf16, **overrides)
        params = mod.init(key, cfg, weights=weights)
    else:
        loaded, ckpt = checkpoint_params(weights, mod)
        cfg = mod.Config(bf16=bf16, **ckpt)
        params = {k: to_device(v) for k, v in loaded.items()}
    if plant_bug is not None:
        checked_net = bugs.plant(plant_bug, mod)   # ValueError: unknown, or not for this net
        planted = bugs.CATALOGUE[plant_bug]
        if planted.replicas and replicas < 2:
            raise ValueError(f"plant-bug {plant_bug} lives in the data-parallel step: use --replicas R ≥ 2")
        if getattr(planted, "needs_uneven", False) and len(set(replica_counts or ())) < 2:
            raise ValueError(f"plant-bug {plant_bug} plants nothing where every replica holds the same "
                             f"count: use --replica-counts (e.g. 3,1)")
        if planted.needs_smoothing and not label_smoothing:
            label_smoothing = 0.1   # the bug plants nothing at α = 0
    else:
        checked_net = mod
    label_smoothing = 0.0 if label_smoothing is None else float(label_smoothing)
    if replicas > 1 and batch % replicas and replica_counts is None:
        raise ValueError(f"batch {batch} (= R·N) must be divisible by replicas {replicas}")
    dt = jnp.dtype(dtype)
    params = {k: to_device(v, dtype) for k, v in params.items()}
    x = to_device(make_batch(data, batch, image_size, seed) if x is None else x, dtype)
    labels = prng.randint(jax.random.fold_in(key, 1), (batch,), 0, cfg.num_classes)
    targets = targets_matrix(labels, cfg.num_classes, dt)
    settings = dict(net=net, batch=batch, image_size=image_size, data=data, dtype=dtype, bf16=bf16,
                    seed=seed, label_smoothing=label_smoothing, plant_tie=plant_tie,
                    weights=weights if weights in WEIGHTS else str(weights), plant_bug=plant_bug,
                    replicas=replicas, replica_counts=replica_counts)
    smooth = None
    with _compile_clock(timings):
        if smoothness:
            from . import census
            if plant_tie:
                params = census.planted_tie(mod, params)
            with _phase(timings, "census"):
                # the point's smoothness is the real loss's, read in float64: a bf16 chain rounds conv
                # outputs to 8 bits, which makes exact ties between cells that are not twins
                p64 = {k: to_device(v, np.float64) for k, v in params.items()}
                smooth = census.smoothness(mod, p64, to_device(x, np.float64), replace(cfg, bf16=False))
            if not smooth.ok:
                return CheckReport(None, [], smooth, settings, timings)
        if bf16:  # a bf16 chain does not tie to float64 autodiff: check SPEC §7's claims instead
            from . import bf16 as bf16_
            with _phase(timings, "bf16 check"):
                rep = bf16_.check(mod, params, x, targets, cfg, label_smoothing=label_smoothing,
                                  key=jax.random.fold_in(key, 2))
            return CheckReport(rep, [], smooth, settings, timings)
        with _phase(timings, "reference + envelope"):
            point = reference_at(mod, params, x, targets, cfg, label_smoothing=label_smoothing,
                                 key=jax.random.fold_in(key, 3))
        with _phase(timings, "tie"):
            if replicas > 1:
                result = tie_replicas(checked_net, params, x, targets, cfg, replicas=replicas, counts=replica_counts,
                                      label_smoothing=label_smoothing, point=point)
            else:
                result = tie(checked_net, params, x, targets, cfg, label_smoothing=label_smoothing, point=point)
        parting = None
        if replicas == 1 and any(not r.ill_conditioned for r in result.failed):
            from . import stages   # the stage where rendered and VJP first part
            with _phase(timings, "first parting"):
                parting = stages.first_parting(checked_net, params, x, targets, cfg,
                                               label_smoothing=label_smoothing, key=jax.random.fold_in(key, 4))
        fd_rows = []
        if finite_differences and dtype == "float64" and replicas == 1:
            from . import fd
            with _phase(timings, "finite differences"):
                from .tie import rendered_nodes
                _, grads, _ = rendered_nodes(checked_net, params, x, targets, cfg, label_smoothing)
                fd_rows = fd.derivatives(mod, params, x, targets, cfg, grads, key=jax.random.fold_in(key, 2),
                                         label_smoothing=label_smoothing, loss_roundoff=point.envelope.loss)
    return CheckReport(result, fd_rows, smooth, settings, timings, parting)


def tie_replicas(net, params, x, targets, cfg, *, replicas: Optional[int] = None, label_smoothing: float = 0.0,
                 point=None, sync_bn: bool = True, counts: Optional[tuple[int, ...]] = None,
                 devices=None) -> TieReport:
    """The data-parallel rendered step (R replicas of N = batch/R, synchronised BN) against the
    single-device float64 oracle at batch R·N, through the same verdict as every tie
    (`r34_net_syncTiedB`: the all-reduced nodes are the single-device nodes at N := R·N).

    counts (n_1, …, n_R): uneven replica batches, x the concatenated valid batch (replica r holds
    n_r of its rows, padded to max n_r on the mesh); the oracle is the single device at x.
    sync_bn=False: per-replica BatchNorm (the control that must fail). devices: the mesh's devices
    (default `jax.devices()`; a chapter on a GPU machine passes the host CPU devices)."""
    from .. import parallel
    from .tie import net_label
    if counts is not None:
        counts = parallel.check_counts("tie_replicas", counts, len(tuple(counts)), int(x.shape[0]))
        if replicas is not None and replicas != len(counts):
            raise ValueError(f"tie_replicas: replicas {replicas} but {len(counts)} counts {counts}")
        replicas = len(counts)
    if replicas is None:
        raise ValueError("tie_replicas: give replicas R (equal split) or counts (n_1, …, n_R)")
    mesh = parallel.data_mesh(replicas, devices=devices)
    if point is None:
        point = reference_at(net, params, x, targets, cfg, label_smoothing=label_smoothing)
    # evaluated once at the point: LLVM's optimisation off halves the compile (tie.QUICK)
    out = parallel.forward_backward(net, params, x, targets, cfg, mesh=mesh, label_smoothing=label_smoothing,
                                    sync_bn=sync_bn, counts=counts, compiler_options=QUICK)
    split = "+".join(map(str, counts)) if counts is not None else None
    label = f"{net_label(net)} on {replicas} replicas" + (f" holding {split}" if split else "")
    return report(label + ("" if sync_bn else " (per-replica BN)"),
                  params, (out.loss, out.grads, out.dx), point,
                  meta={"replicas": replicas, "per_replica": int(x.shape[0]) // replicas, "sync_bn": sync_bn,
                        "counts": list(counts) if counts is not None else [int(x.shape[0]) // replicas] * replicas})
