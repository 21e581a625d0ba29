"""The residual fan-in of a basic block: a = n2 + skip. Shown in: Whole-net tie."""

from __future__ import annotations

import jax

from . import _validate


def forward(branch: jax.Array, skip: jax.Array) -> jax.Array:
    """a = branch + skip."""
    _validate.same_shape("residual.forward", ("branch", "skip"), branch, skip)
    return branch + skip


def backward(d_branch_input: jax.Array, d_skip: jax.Array) -> jax.Array:
    """The block input's cotangent is the sum of both branches' cotangents. Lean: `addVB`."""
    _validate.same_shape("residual.backward", ("branch cotangent", "skip cotangent"), d_branch_input, d_skip)
    return d_branch_input + d_skip
