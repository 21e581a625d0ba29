"""The points the two bf16 chapters (bf16 erasure, bf16 at real rounding) run both nets at, built once
here so that neither chapter copies the other's setup: cifar8 and ResNet-34 on the bf16 switch
(`Config(bf16=True)`: every conv site a bf16 kind), float32 parameters at drawn weights, float32
images, one-hot targets; and every conv site of each net's rendered chain, read in one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradtie import prng
from gradtie.checks import bf16
from gradtie.checks.tie import Chain, targets_matrix
from gradtie.data import images
from gradtie.nets import cifar8, resnet34
from gradtie.nets.layers import rounding


@dataclass(frozen=True)
class Bf16Points:
    """nets: {name: (net, cfg, image side)}; points: {name: (net, cfg, params, x, targets)};
    at: what every figure is glued with (`book.At`, one per net); lines: one line per net saying
    what it was built from."""
    nets: dict
    points: dict
    at: tuple
    lines: tuple


def build(p: Any, key: jax.Array) -> Bf16Points:
    """Both nets at the chapter's validated parameters `p` (batch, image_size, data, seed). Raises
    if a drawn γ is 1: the point must be one where a backward mixing up γ cannot hide."""
    from gradtie import book

    nets = {"cifar8": (cifar8.NET, cifar8.Config(bf16=True), 32),
            "resnet34": (resnet34.NET, resnet34.Config(num_classes=10, bf16=True), p.image_size)}
    points, lines = {}, []
    for name, (net, cfg, size) in nets.items():
        params = net.init(key, cfg, weights="drawn")   # float32
        x = images(p.data, p.batch, size, seed=p.seed).astype(jnp.float32)
        labels = prng.randint(jax.random.fold_in(key, 1), (p.batch,), 0, cfg.num_classes)
        points[name] = (net, cfg, params, x, targets_matrix(labels, cfg.num_classes, jnp.float32))
        roles = net.roles(cfg)
        gammas = np.concatenate([np.asarray(v) for k, v in params.items() if roles.get(k) == "gamma"])
        if np.any(gammas == 1):
            raise ValueError(f"bf16 points: {name} drew a γ of exactly 1; a drawn point must not")
        lines.append(f"{name}: {p.data} {tuple(x.shape)}, {len(params)} parameter tensors, drawn weights "
                     f"(γ in [{gammas.min():.2f}, {gammas.max():.2f}]), bf16 rounding {cfg.bf16_rounding!r} "
                     f"(bf16-typed operands, float32 accumulation)")
    extra = {"resnet34": {"widths": list(resnet34.WIDTHS)}}
    at = tuple(book.At(name, image_size=size, batch=p.batch, classes=cfg.num_classes, data=p.data,
                       dtype="float32, bf16 kinds", weights="drawn", extra=extra.get(name))
               for name, (_, cfg, size) in nets.items())
    return Bf16Points(nets, points, at, tuple(lines))


def conv_sites(points: dict) -> tuple[dict, dict, dict]:
    """({net: every conv site of its rendered bf16 chain}, {net: each site's row against
    rnd(f32 node at rounded operands)}, {net: the chain's result}), read in one run per net."""
    sites, rows, chains = {}, {}, {}
    for name, (net, cfg, params, x, t) in points.items():
        sites[name], chains[name], _ = bf16.conv_sites(Chain(net), params, x, t, cfg)
        rows[name] = bf16.site_rows(sites[name], rounding(cfg))
    return sites, rows, chains
