"""`gradtie check`: build a batch, tie every node to autodiff and to finite differences.

Exit codes: 0 every node tied at a smooth point, 1 a node failed, 2 the point is not smooth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import jax
import jax.numpy as jnp

from . import fd as fd_
from . import tolerances as tol
from .tie import TieReport, rendered, targets_matrix, tie

EXIT_TIED, EXIT_FAILED, EXIT_NOT_SMOOTH = 0, 1, 2


@dataclass
class CheckReport:
    tie: Optional[TieReport]              # None when the census found the point not smooth
    fd_rows: list
    smooth: Optional[Any] = None          # the smoothness verdict, when the census has run
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def input_defined(self) -> bool:
        """The input gradient exists only where no window is a twin tie: twins are equal for every
        weight, but moving the IMAGE breaks them (and autodiff's max splits a tie evenly)."""
        return self.smooth is None or sum(p.counts["twin tie"] for p in self.smooth.pools) == 0

    @property
    def tie_ok(self) -> bool:
        return all(r.ok for r in self.tie.rows if r.name != "input" or self.input_defined)

    @property
    def exit_code(self) -> int:
        if self.smooth is not None and not self.smooth.ok:
            return EXIT_NOT_SMOOTH
        if not self.tie_ok or not all(r.ok for r in self.fd_rows):
            return EXIT_FAILED
        return EXIT_TIED

    def summary(self) -> str:
        lines = [] if self.smooth is None else [self.smooth.summary()]
        if self.tie is None:
            lines.append("no tie reported: the loss is not differentiable at this point")
            return "\n".join(lines)
        fd_ok = sum(r.ok for r in self.fd_rows)
        line = f"{self.tie.summary()}; finite differences {fd_ok}/{len(self.fd_rows)}"
        if not self.input_defined:
            line += "; input gradient not defined at twin ties (left out of the verdict)"
        return "\n".join(lines + [line])

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "settings": self.settings,
                "tie": None if self.tie is None else self.tie.as_dict(),
                "input_gradient_defined": self.input_defined,
                "finite_differences": [r.__dict__ for r in self.fd_rows],
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
        return jax.random.normal(jax.random.key(seed), (batch, 3, image_size, image_size), jnp.float64)
    if data == "photos":
        return jnp.asarray(data_.photos(batch, image_size, seed=seed), jnp.float64)
    if data == "flat":
        return jnp.asarray(data_.flat_images(batch, image_size, seed=seed), jnp.float64)
    raise ValueError(f"data {data!r}: expected one of randn, photos, flat")


def finite_differences(net, params, x, targets, cfg, grads: dict, *, key,
                       label_smoothing: float = 0.0) -> list:
    """Central differences of the real loss along a random unit direction per node.

    The step is FD_STEP or, where a kink lies closer along that direction, a fraction of the
    first-order radius to it (`census.kink_radius`): real batches have windows within 1e-6 of a
    tie, and a difference across a kink measures nothing.
    """
    from . import census
    loss = jax.jit(fd_.loss_fn(net, x, targets, cfg, label_smoothing))
    gnorm = max(float(jnp.linalg.norm(g.ravel())) for g in grads.values())
    rows = []
    for i, name in enumerate(params):
        v = fd_.unit_direction(jax.random.fold_in(key, i), params[name].shape, params[name].dtype)
        full = {k: (v if k == name else jnp.zeros_like(p)) for k, p in params.items()}
        h = min(tol.FD_STEP, census.RADIUS_FRACTION * census.kink_radius(net, params, x, cfg, full))
        fd = fd_.central_difference(loss, params, name, v, h)
        dot = float(jnp.vdot(grads[name], v))
        scale = max(abs(fd), abs(dot), tol.ZERO_NODE_FLOOR * gnorm)
        rows.append(fd_.FDRow(name, fd, dot, abs(fd - dot) / scale, tol.FD_REL))
    return rows


def run_check(net: str = "cifar8", *, batch: int = 4, image_size: Optional[int] = None,
              data: Optional[str] = None, dtype: str = "float64", bf16: bool = False, seed: int = 0,
              label_smoothing: float = 0.0, smoothness: bool = True, plant_tie: bool = False) -> CheckReport:
    """Tie every node of `net` at a fresh batch; float64 needs `jax_enable_x64`.

    data: "randn" (the default), "photos" or "flat". plant_tie: the convs before the first pool
    reduced to their centre tap, on flat images (`census.planted_tie`): a non-twin tie point, which
    the census must refuse (exit code 2). When the census finds the point not smooth, no tie is
    computed: there is no gradient to tie.
    """
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype {dtype!r}: expected float64 or float32")
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch {batch!r}: expected a positive integer")
    if plant_tie and data not in (None, "flat"):
        raise ValueError(f"plant_tie builds its point on flat images; got data {data!r} (use flat)")
    if plant_tie and not smoothness:
        raise ValueError("plant_tie needs the smoothness census (it exists to be refused by it)")
    data = data or ("flat" if plant_tie else "randn")
    mod = net_module(net)
    image_size = image_size or 32
    kwargs = {"num_classes": 10} if net == "resnet34" else {}
    cfg = mod.Config(bf16=bf16, **kwargs)
    key = jax.random.key(seed)
    dt = jnp.dtype(dtype)
    params = {k: v.astype(dt) for k, v in mod.init(key, cfg).items()}
    x = make_batch(data, batch, image_size, seed).astype(dt)
    labels = jax.random.randint(jax.random.fold_in(key, 1), (batch,), 0, cfg.num_classes)
    targets = targets_matrix(labels, cfg.num_classes, dt)
    settings = dict(net=net, batch=batch, image_size=image_size, data=data, dtype=dtype, bf16=bf16,
                    seed=seed, label_smoothing=label_smoothing, plant_tie=plant_tie)
    smooth = None
    if smoothness:
        from . import census
        if plant_tie:
            params = census.planted_tie(mod, params)
        # the point's smoothness is the real loss's: a bf16 chain rounds conv outputs to 8 bits,
        # which makes exact ties between cells that are not twins (its forward is a step function)
        smooth = census.smoothness(mod, params, x, replace(cfg, bf16=False))
        if not smooth.ok:
            return CheckReport(None, [], smooth, settings)
    if bf16:  # a bf16 chain does not tie to float64 autodiff: check SPEC §7's claims instead
        from . import bf16 as bf16_
        report = bf16_.check(mod, params, x, targets, cfg, label_smoothing=label_smoothing,
                             key=jax.random.fold_in(key, 2))
        return CheckReport(report, [], smooth, settings)
    report = tie(mod, params, x, targets, cfg, label_smoothing=label_smoothing)
    fd_rows = []
    if dtype == "float64":
        _, grads, _ = jax.jit(rendered, static_argnums=(0, 4, 5))(mod, params, x, targets, cfg,
                                                                   label_smoothing)
        fd_rows = finite_differences(mod, params, x, targets, cfg, grads, key=jax.random.fold_in(key, 2),
                                     label_smoothing=label_smoothing)
    return CheckReport(report, fd_rows, smooth, settings)
