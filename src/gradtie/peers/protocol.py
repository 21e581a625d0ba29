"""What every peer is: a name, a layout, whether it can run here, and how it is built.

A peer is the step a user would write instead of gradtie's: the same net, the same loss, forward
and backward by its own framework's means. `Peer.make` builds it once from gradtie's parameters
(state_dict names, OIHW and [out, in] weights) and a batch; the `Prepared` it returns runs one step
(`step`) and gives the loss and every parameter gradient back in gradtie's names and layout
(`grads`). Shown in: Performance.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol

import jax
import numpy as np

from .. import nets
from ..nets.protocol import Config, Net

DTYPES = ("float32", "float64")


class Prepared(Protocol):
    """One peer, built at one point (its parameters, images and targets held in its own layout)."""

    def step(self) -> None:
        """One forward and backward: the loss and every parameter gradient, blocking until done."""

    def grads(self) -> tuple[float, dict[str, np.ndarray]]:
        """(loss, gradients) of one step: float64 NumPy arrays, gradtie's names, order and layout."""


@dataclass(frozen=True, eq=False)
class Peer:
    """name: what the benchmark's columns say ("jax-nchw", "torch"); layout: of the activations;
    make(net_name, params, x, targets, *, num_classes, dtype, alpha) -> Prepared; available() ->
    (runs here, why not); version() -> "jax 0.10.2"; threads(n) sets the step's intra-op threads
    to n where the framework takes a count at run time (torch; XLA sizes its own pool; None: leave
    it) and returns the count the step runs with; device() -> where the step runs ("cpu", "gpu")."""
    name: str
    layout: str
    make: Callable[..., Prepared]
    available: Callable[[], tuple[bool, str]]
    version: Callable[[], str]
    threads: Callable[[Optional[int]], int]
    device: Callable[[], str]


def config_of(net: Net, params: Mapping[str, Any], num_classes: int) -> Config:
    """The net's config that `params` were drawn for: conv biases and the head width read off the
    parameters, the classes given; checked against the net's parameter list (names, order, shapes)."""
    fields = {f.name for f in dataclasses.fields(net.config)}
    kw: dict[str, Any] = {"num_classes": num_classes}
    if "conv_bias" in fields:
        kw["conv_bias"] = "conv1.bias" in params
    if "head_width" in fields and "fc1.weight" in params:
        kw["head_width"] = int(np.shape(params["fc1.weight"])[0])
    cfg = net.cfg(net.config(**kw))
    want = [(s.name, tuple(s.shape)) for s in net.param_specs(cfg)]
    got = [(name, tuple(np.shape(v))) for name, v in params.items()]
    for g, w in itertools.zip_longest(got, want):
        if g != w:
            raise ValueError(f"peers: the parameters are not {net.name}'s at {num_classes} classes "
                             f"(first difference: got {g}, expected {w})")
    if cfg.bn_mode != "batch":
        raise ValueError(f"peers: the peers run batch BatchNorm, got the BatchNorm mode {cfg.bn_mode!r}")
    return cfg


def net_of(net_name: str) -> Net:
    """cifar8 or resnet34: the two nets every peer writes out."""
    if net_name not in nets.NETS:
        raise ValueError(f"peers: net must be one of {', '.join(nets.NETS)}, got {net_name!r}")
    return nets.NETS[net_name]


def check_dtype(dtype: str) -> np.dtype:
    if str(dtype) not in DTYPES:
        raise ValueError(f"peers: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return np.dtype(dtype)


def host(tree: Mapping[str, Any], dtype) -> dict[str, np.ndarray]:
    """Every leaf as a NumPy array of `dtype` (float64 for `Prepared.grads`)."""
    return {name: np.asarray(v, dtype) for name, v in tree.items()}


class Jitted:
    """`Prepared` for a jitted JAX step fn(*args) -> (loss, grads) whose arguments already sit on the
    device in the peer's layout; `back` turns its gradients into gradtie's layout (host arrays)."""

    def __init__(self, fn: Callable, args: tuple, back: Callable[[dict], dict], order: list[str]):
        self.fn, self.args, self.back, self.order = fn, args, back, order

    def step(self) -> None:
        jax.block_until_ready(self.fn(*self.args))

    def grads(self) -> tuple[float, dict[str, np.ndarray]]:
        loss, g = self.fn(*self.args)
        g = self.back(host(g, np.float64))
        return float(loss), {name: g[name] for name in self.order}


def xla_threads() -> int:
    """The intra-op threads XLA's CPU client runs with when left to itself: one per CPU this process
    may be scheduled on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
