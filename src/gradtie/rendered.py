"""The rendered step: one forward, the loss's own cotangent, one rendered backward — written once.

`step(net, kit, params, x, targets, cfg)` is what every consumer runs: the tie and the census, the
germs and the stage ties, finite differences, training, the data-parallel step (inside
`shard_map`), the benchmark and the bf16 check. It returns the loss, the gradient of every
parameter, the input cotangent, this batch's BatchNorm statistics and the logits. `compiled` is
the same function under `jax.jit`, with the net, the kit, the config and α static: one program
per (net, kit, config, α, shapes), found again by JAX's own cache, never by an `id()`.

No autodiff here: the cotangent at the logits is the loss's own (`net.loss.cotangent`, or a
planted kit's `loss_cotangent`) and the backward is the net's stages through `kit`.
Shown in: Whole-net tie, Check your own backward.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from .kit import KIT, Kit
from .ops.head import as_targets

# A program that runs once or twice (a planted control, a check's one evaluation) is compile-bound:
# LLVM's optimisation passes off halve the compile (ResNet-34, N = 2: 5.7 → 3.0 s) and slow the run
# ~4×, well under a second at a check's shapes. It changes no IEEE result (no fast-math either way).
# The fused-elementwise emitters are named because the tests' XLA_FLAGS choose the older ones (the
# tests/conftest.py says why): with the optimisation off those returned NaN for some BatchNorm gradients
# (float32 autodiff step, jax 0.10.2), and two programs no longer agreed bit for bit on a forward.
QUICK = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": True}
# ... but the slower run grows with the images and the saving does not: ResNet-34's data-parallel
# step (R = 2, float64, 2-core CPU) at 32 px, N = 2: compile and run 5.9 s quick, 7.8 s optimised;
# at 224 px: one run 34.6 s quick, 2.1 s optimised, for about the same compile. Above this many
# image cells (N·H·W) a program run once is compiled with the optimisation on (`quick_pays`).
QUICK_MAX_CELLS = 4096
# Every bf16 rounding the program names, kept: by default XLA may compute a bf16 value in float32
# and drop the f32 -> bf16 -> f32 convert pair ("excess precision"). On the CPU the bf16 policy's
# cifar8 nodes then move by 20-50 % against the same chain run op by op, and a check reading the
# recorded bf16 values would tie them to a computation that never used them. No effect on a program
# without bf16 values.
EXACT_ROUNDING = {"xla_allow_excess_precision": False}


def quick_pays(x) -> bool:
    """Whether LLVM's optimisation off (`QUICK`) pays for a program run once on images x
    [N,C,H,W]: at most `QUICK_MAX_CELLS` cells N·H·W (above, its slower run outweighs the compile
    it saves). No IEEE result depends on it."""
    n, _, h, w = x.shape
    return n * h * w <= QUICK_MAX_CELLS


class Rendered(NamedTuple):
    loss: jax.Array
    grads: dict          # params' keys, in their order
    dx: jax.Array        # the cotangent at the input
    stats: dict          # `<bn>.running_mean/var`: this batch's BatchNorm statistics
    logits: jax.Array


class Tape(NamedTuple):
    """What a traced step records when it is handed one: every stage's input, and the cotangent
    each stage is handed at its output."""
    inputs: dict
    cotangents: dict


def new_tape() -> Tape:
    return Tape({}, {})


class Chain(NamedTuple):
    """The rendered side of a check: a net definition run through a kit (`checks.bugs` plants a bug
    as either). `planted` names what is wrong in it ("" for the real chain)."""
    net: Any
    kit: Kit = KIT
    planted: str = ""

    @property
    def label(self) -> str:
        return self.net.name + (f" + {self.planted}" if self.planted else "")


def step(net, kit: Kit, params, x, targets, cfg, *, alpha: float = 0.0, selections=None, valid=None,
         divisor=None, tape: Optional[Tape] = None, after_stage=None) -> Rendered:
    """The rendered train step's gradient computation at (params, x).

    targets: int labels [N] or rows summing to 1 [N,K]. alpha: label smoothing. selections {pool:
    σ}: those pools frozen at σ (the gather model) in the forward and, through selScatter, in the
    backward. valid [N] (a padded batch: 1 real, 0 padding): BatchNorm counts the real examples,
    the loss is Σ valid·rows / divisor and padded rows get a zero cotangent. divisor: the N of the
    cotangent's ÷N (default: the batch, or Σ valid). tape: filled with every stage's input and
    cotangent (pass it to the un-jitted function). after_stage(nodes, dx) -> (nodes, dx): sees each
    stage's nodes as soon as they exist (`protocol.fold_backward`)."""
    cfg = net.cfg(cfg)
    logits, saved = net.forward(params, x, cfg, kit=kit, selections=selections, valid=valid,
                                inputs=None if tape is None else tape.inputs)
    t = as_targets(net.name, targets, x.shape[0], cfg.num_classes, logits.dtype)
    cotangent = kit.loss_cotangent or net.loss.cotangent
    if valid is None:
        loss = net.loss.value(logits, t, alpha)
        dlogits = cotangent(logits, t, alpha, divisor)
    else:
        v = jnp.asarray(valid).astype(logits.dtype)
        divisor = jnp.sum(v) if divisor is None else divisor
        loss = jnp.sum(v * net.loss.rows(logits, t, alpha)) / divisor
        dlogits = cotangent(logits, t, alpha, divisor) * v[:, None]
    grads, dx = net.backward(params, saved, dlogits, cfg, kit=kit,
                             cotangents=None if tape is None else tape.cotangents, after_stage=after_stage)
    return Rendered(loss, grads, dx, net.batch_stats(saved), logits)


_STATIC = ("net", "kit", "cfg", "alpha")
compiled = jax.jit(step, static_argnames=_STATIC)
# the same, LLVM's optimisation off: a planted chain or a one-off evaluation
quick = jax.jit(step, static_argnames=_STATIC, compiler_options=QUICK)


def _taped(net, kit, params, x, targets, cfg, alpha=0.0, selections=None):
    tape = new_tape()
    return step(net, kit, params, x, targets, cfg, alpha=alpha, selections=selections, tape=tape), tape


taped = jax.jit(_taped, static_argnames=_STATIC, compiler_options=QUICK)
# the same, optimised: images above `quick_pays`' size
taped_compiled = jax.jit(_taped, static_argnames=_STATIC)


def _forward(net, params, x, cfg, selections=None):
    inputs: dict = {}
    logits, saved = net.forward(params, x, cfg, selections=selections, inputs=inputs)
    return logits, saved, inputs


# (logits, saved, every stage's input) of the train-mode forward with the real kit: the census's and
# the finite differences' program
forward = jax.jit(_forward, static_argnames=("net", "cfg"))


def run(net, kit: Kit, params, x, targets, cfg, *, alpha: float = 0.0, how: str = "compiled") -> Rendered:
    """`step` run one of three ways: "compiled" (one optimised program), "quick" (one program,
    LLVM's optimisation off: a chain evaluated once), or "eager" (op by op: a catalogue of planted
    chains at one point shares its ops, not its programs)."""
    targets = as_targets(net.name, targets, x.shape[0], cfg.num_classes, x.dtype)   # checked, not traced
    if how == "eager":
        return step(net, kit, params, x, targets, cfg, alpha=alpha)
    fn = {"compiled": compiled, "quick": quick}.get(how)
    if fn is None:
        raise ValueError(f"rendered.run: how must be 'compiled', 'quick' or 'eager', got {how!r}")
    return fn(net, kit, params, x, targets, cfg, alpha=float(alpha))


__all__ = ["EXACT_ROUNDING", "KIT", "QUICK", "QUICK_MAX_CELLS", "Chain", "Rendered", "Tape", "compiled", "forward", "new_tape", "quick", "quick_pays", "run", "step",
           "taped", "taped_compiled"]
