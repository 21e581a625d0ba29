"""`gradtie check`: build a batch, tie every node to autodiff and to finite differences.

Exit codes: 0 every node tied at a smooth point, 1 a node failed, 2 the point is not smooth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp

from . import fd as fd_
from .tie import TieReport, rendered, targets_matrix, tie

EXIT_TIED, EXIT_FAILED, EXIT_NOT_SMOOTH = 0, 1, 2


@dataclass
class CheckReport:
    tie: TieReport
    fd_rows: list
    smooth: Optional[Any] = None          # the smoothness verdict, when the census has run
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.smooth is not None and not self.smooth.ok:
            return EXIT_NOT_SMOOTH
        if not self.tie.ok or not all(r.ok for r in self.fd_rows):
            return EXIT_FAILED
        return EXIT_TIED

    def summary(self) -> str:
        fd_ok = sum(r.ok for r in self.fd_rows)
        line = f"{self.tie.summary()}; finite differences {fd_ok}/{len(self.fd_rows)}"
        if self.smooth is not None:
            line = f"{self.smooth.summary()}\n{line}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "settings": self.settings, "tie": self.tie.as_dict(),
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


def run_check(net: str = "cifar8", *, batch: int = 4, image_size: Optional[int] = None,
              data: str = "randn", dtype: str = "float64", bf16: bool = False, seed: int = 0,
              label_smoothing: float = 0.0, smoothness: bool = True) -> CheckReport:
    """Tie every node of `net` at a fresh batch; float64 needs `jax_enable_x64`."""
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype {dtype!r}: expected float64 or float32")
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
    if batch < 1:
        raise ValueError(f"batch {batch}: expected a positive integer")
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
    smooth = None
    if smoothness:
        from . import census
        smooth = census.smoothness(mod, params, x, cfg)
    report = tie(mod, params, x, targets, cfg, label_smoothing=label_smoothing)
    fd_rows = []
    if dtype == "float64":
        _, grads, _ = jax.jit(rendered, static_argnums=(0, 4, 5))(mod, params, x, targets, cfg,
                                                                   label_smoothing)
        fd_rows = fd_.directional(mod, params, x, targets, cfg, grads, key=jax.random.fold_in(key, 2),
                                  label_smoothing=label_smoothing)
    settings = dict(net=net, batch=batch, image_size=image_size, data=data, dtype=dtype, bf16=bf16,
                    seed=seed, label_smoothing=label_smoothing)
    return CheckReport(report, fd_rows, smooth, settings)
