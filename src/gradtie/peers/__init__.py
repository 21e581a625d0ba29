"""The peers a user would pick instead of gradtie, as code, each checked to compute the same gradient.

`PEERS` holds the steps the benchmark times beside the rendered one (issue 29):

- "jax-nchw", "jax-nhwc": plain JAX (`plain_jax`): `lax.conv_general_dilated`, `lax.reduce_window`,
  autodiff of the loss, jitted; NCHW with OIHW kernels, NHWC with HWIO kernels;
- "torch": PyTorch eager (`torch_eager`): torchvision's resnet34 and a cifar8-BN module, where torch
  is installed (requirements-peers.txt).

One interface: `prepare(peer, net, params, x, targets, ...)` builds a peer from gradtie's parameters
once (`Prepared.step()` one forward and backward, `Prepared.grads()` its loss and gradients in
gradtie's names and layout); `agreement(peer, net, ...)` holds every gradient and the loss to the
float64 oracle (`gradtie.reference.oracle`) within the point's round-off envelope, as the tie holds
a rendered chain (`checks.tie.compare`). `PLANTED` holds peers that are wrong on purpose, for the
agreement to catch. `python -m gradtie.peers '<json>'` times one peer in its own process (`child`).
Shown in: Performance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from .. import prng
from .. import tolerances as tol
from ..checks.tie import Limit, TieReport, compare, need_x64, node_cells, reference_at
from ..host import to_device, tree_to_device
from ..nets.layers import zero_in_reals
from . import plain_jax, torch_eager
from .protocol import DTYPES, Peer, Prepared, check_dtype, host, net_of

PEERS: dict[str, Peer] = {p.name: p for p in (plain_jax.peer("NCHW"), plain_jax.peer("NHWC"), torch_eager.peer())}
NAMES = tuple(PEERS)
# Wrong on purpose (a planted bug each): `agreement` must fail on every one.
PLANTED: dict[str, Peer] = {**plain_jax.PLANTED, **torch_eager.PLANTED}


def get(peer: Union[str, Peer]) -> Peer:
    """A peer by name (`PEERS`, or `PLANTED` by its key), or the `Peer` itself."""
    if isinstance(peer, Peer):
        return peer
    if peer in PEERS:
        return PEERS[peer]
    if peer in PLANTED:
        return PLANTED[peer]
    raise ValueError(f"peers: unknown peer {peer!r}; expected one of {', '.join(NAMES)} "
                     f"(planted: {', '.join(PLANTED)})")


def available(peer: Union[str, Peer]) -> tuple[bool, str]:
    """(True, "") when the peer can run in this process, else (False, why)."""
    return get(peer).available()


def prepare(peer: Union[str, Peer], net_name: str, params: Mapping[str, Any], x, targets, *, num_classes: int,
            dtype: str = "float32", alpha: float = 0.0) -> Prepared:
    """The peer built once at (params, x, targets): gradtie's parameter dict (state_dict names, OIHW
    convs, [out, in] dense), images [N,3,H,W], target rows [N,K]; in `dtype`; α the label smoothing."""
    p = get(peer)
    ok, why = p.available()
    if not ok:
        raise RuntimeError(f"peer {p.name} cannot run here: {why}")
    return p.make(net_name, params, x, targets, num_classes=num_classes, dtype=dtype, alpha=alpha)


def point(net_name: str, *, batch: int, image_size: int, num_classes: int = 10,
          seed: int = 0) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """(params, x, targets) in float32: gradtie's drawn weights (γ ≠ 1, β ≠ 0, biases ≠ 0), images
    uniform in [0, 1), one-hot targets of uniform labels — `gradtie.bench.inputs`' recipe at
    key(seed) (seed 0: the benchmark's own point)."""
    net = net_of(net_name)
    if not net.size_ok(image_size):
        raise ValueError(f"peers: {net_name} takes images of side {net.size_rule}, got {image_size}")
    cfg = net.config(num_classes=num_classes)
    key = jax.random.key(seed)
    params = net.init(key, cfg, weights="drawn")
    x = prng.uniform(jax.random.fold_in(key, 1), (batch, 3, image_size, image_size), jnp.float32)
    labels = prng.randint(jax.random.fold_in(key, 2), (batch,), 0, num_classes)
    return params, x, jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)


# ---- agreement with the oracle ----------------------------------------------------------------------

class Worst(NamedTuple):
    """The row nearest its limit, relative to the node's scale (`checks.tie.NodeRow`): err the max
    |peer − oracle|, envelope the point's round-off there, limit max(factor × envelope, floor)."""
    name: str
    err: float
    limit: float
    envelope: float
    by: str        # what sets the limit: "envelope" or "floor"


@dataclass(frozen=True)
class Agreement:
    """A peer's loss and every parameter gradient against the float64 oracle at one point, each row
    held to max(factor × the point's round-off envelope, the dtype's floor): `checks.tie`'s verdict,
    the input cotangent aside (a peer's step computes none)."""
    peer: str
    net: str
    report: TieReport

    @property
    def ok(self) -> bool:
        return self.report.ok

    @property
    def worst(self) -> Worst:
        w = self.report.worst()
        return Worst(w.name, float(w.rel), float(w.limit), float(w.envelope), w.by)

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.report.failed]

    def describe(self) -> str:
        m, w = self.report.meta, self.worst
        where = f"{self.peer} on {self.net} (batch {m['batch']}, {m['image_size']} px, {self.report.dtype})"
        verdict = (f"agrees with the oracle at the loss and {len(self.report.nodes)} gradients" if self.ok else
                   f"DISAGREES with the oracle at {len(self.failed)} of {len(self.report.rows)} rows "
                   f"(first in backward order: {self.report.first_failure().name})")
        factor = m["factor"]
        limit = (f"{factor:g} × its envelope {w.envelope:.1e}" if w.by == "envelope" else
                 f"the floor; {factor:g} × its envelope is {factor * w.envelope:.1e}")
        return (f"{where}: {verdict}; worst {w.name}, err {w.err:.1e} {'≤' if w.err <= w.limit else '>'} "
                f"limit {w.limit:.1e} ({limit})")


def agreement(peer: Union[str, Peer], net_name: str, *, batch: int, image_size: int, num_classes: int = 10,
              seed: int = 0, alpha: float = 0.0, dtype: str = "float64",
              factor: float = tol.ENVELOPE_FACTOR) -> Agreement:
    """The peer's loss and gradients at `point(net_name, ...)` against the float64 oracle
    (`reference.oracle` via `checks.tie.reference_at`), every row within max(factor × the point's
    envelope, the dtype's floor) (`checks.tie.compare`). dtype: what the peer computes in (float64:
    torch's `.double()`, JAX with x64; float32: held to the float32 envelope). Needs jax_enable_x64."""
    p = get(peer)
    dt = check_dtype(dtype)
    need_x64("peers.agreement")
    net = net_of(net_name)
    cfg = net.config(num_classes=num_classes)
    params, x, targets = point(net_name, batch=batch, image_size=image_size, num_classes=num_classes, seed=seed)
    params, x, targets = host(params, dt), np.asarray(x, dt), np.asarray(targets, dt)
    ref = reference_at(net, tree_to_device(params), to_device(x), targets, cfg, label_smoothing=alpha,
                           key=jax.random.fold_in(jax.random.key(seed), 3))
    loss, grads = prepare(p, net_name, params, x, targets, num_classes=num_classes, dtype=dtype, alpha=alpha).grads()
    loss_o, grads_o, _ = ref.reference
    rows = compare(grads, {name: grads_o[name] for name in params}, zero_nodes=zero_in_reals(params),
                       limit=Limit({**ref.envelope.nodes, "loss": ref.envelope.loss}, factor, tol.FLOORS[ref.dtype]),
                       loss=(loss, loss_o), cells=node_cells(net, ref.cfg, ref.bn_cells))
    meta = {"batch": batch, "image_size": image_size, "num_classes": num_classes, "seed": seed, "alpha": alpha,
            "bn_cells": ref.bn_cells, "envelope_evaluations": list(ref.envelope.evaluations), "factor": factor}
    return Agreement(p.name, net_name, TieReport(p.name, ref.dtype, rows, loss, float(loss_o), meta))


__all__ = ["Agreement", "DTYPES", "NAMES", "PEERS", "PLANTED", "Peer", "Prepared", "Worst", "agreement", "available",
           "get", "plain_jax", "point", "prepare", "torch_eager"]
