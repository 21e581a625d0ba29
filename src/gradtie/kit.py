"""The kit: every op a rendered chain calls besides the forwards, as one value handed to the chain.

A net's stage backwards never import an op backward: they call the kit they are given. `KIT`
holds the real ops of `gradtie.ops`; a planted bug is another kit, `KIT._replace(bn_backward=wrong)`,
and a consumer that wants to see every call (a conv site, the arguments of a node) wraps the kit
(`recording`). Nothing is patched, nothing is restored, and two kits run side by side. A kit is a
NamedTuple of functions: hashable, so it is a static argument of `jax.jit` like the net and the
config.

Fields that make a parameter node or touch a named layer take the layer's name first (`conv1`,
`layer2.0.downsample.1`, `fc`): the real ops ignore it; a recording names its sites by it. The
contractions take the execution policy's `precision` (None: HIGHEST, what the checks run;
`gradtie.policy`); under the `tie` policy the nets call them without it, so a kit written without a
`precision` keyword still runs every check, and only the `tf32` and `bf16` policies need one.

| field               | the real op (signature)                                                   | Lean                     |
|---------------------|---------------------------------------------------------------------------|--------------------------|
| `conv_forward`      | (name, x, w, b, *, stride, rnd, formulation, precision) -> (y, ConvSaved) | the conv forward          |
| `conv_backward`     | (name, w, dy, *, input_shape, stride, rnd, formulation, precision) -> dx  | `convBackBatched`         |
| `conv_grad_weight`  | (name, x, dy, *, kernel_size, stride, rnd, formulation, precision) -> dW  | `convWeightGradB`         |
| `conv_grad_bias`    | (name, dy) -> db                                                          | the conv bias node        |
| `bn_forward`        | (name, c, γ, β, *, eps, per_example, axis_name, valid) -> (n, BNSaved)    | the BN forward            |
| `bn_backward`       | (name, saved, γ, dy) -> dx                                                | `bnBatchBack`, `bnBackB`  |
| `bn_nodes`          | (name, saved, γ, β, dy) -> (dγ, dβ)                                       | the BN parameter nodes    |
| `relu_backward`     | (saved, dy) -> dx                                                         | `selectPosB`, `reluMaskB` |
| `pool_backward`     | (name, saved, dy, sigma) -> dx (sigma None: σ = argmax)                   | `maxPoolBackB`, selScatter|
| `gap_backward`      | (input_shape, dg) -> dx                                                   | `gapBack`                 |
| `dense_backward`    | (name, w, dy, *, precision) -> dx                                         | `rowDenseBackFlat`        |
| `dense_grad_weight` | (name, x, dy, *, precision) -> dW                                         | the dense weight node     |
| `dense_grad_bias`   | (name, dy) -> db                                                          | the dense bias node       |
| `residual_backward` | (d_branch, d_skip) -> dx                                                  | `addVB`                   |
| `loss_cotangent`    | None: the net's loss's own cotangent; else (logits, targets, α, divisor)  | the six-op head fold      |

Shown in: Would the check catch it?, Check your own backward.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from .ops import batchnorm, conv, dense, gap, maxpool, relu, residual


def conv_forward(name: str, x, weight, bias=None, *, stride: int = 1, rnd=None, formulation=None, precision=None):
    return conv.forward(x, weight, bias, stride=stride, rnd=rnd, formulation=formulation, precision=precision)


def conv_backward(name: str, weight, dy, *, input_shape, stride: int = 1, rnd=None, formulation=None,
                  precision=None):
    return conv.backward(weight, dy, input_shape=input_shape, stride=stride, rnd=rnd, formulation=formulation,
                         precision=precision)


def conv_grad_weight(name: str, x, dy, *, kernel_size: int, stride: int = 1, rnd=None, formulation=None,
                     precision=None):
    return conv.grad_weight(x, dy, kernel_size=kernel_size, stride=stride, rnd=rnd, formulation=formulation,
                            precision=precision)


def conv_grad_bias(name: str, dy):
    return conv.grad_bias(dy)


def bn_forward(name: str, c, weight, bias, *, eps: float, per_example: bool = False, axis_name=None, valid=None):
    """Train-mode BatchNorm (batch statistics): through the kit so that a check can pin its output
    (the bf16 policy rounds it) where it replays the chain."""
    return batchnorm.forward(c, weight, bias, eps=eps, per_example=per_example, axis_name=axis_name, valid=valid)


def bn_backward(name: str, saved: batchnorm.BNSaved, weight, dy):
    return batchnorm.backward(saved, weight, dy)


def bn_nodes(name: str, saved: batchnorm.BNSaved, weight, bias, dy):
    """(dγ, dβ) from the cotangent dy at the BN output; local to a replica (the data-parallel step
    all-reduces them)."""
    return batchnorm.grad_weight(saved, dy), batchnorm.grad_bias(dy)


def relu_backward(saved: relu.ReluSaved, dy):
    return relu.backward(saved, dy)


def pool_backward(name: str, saved: maxpool.PoolSaved, dy, sigma=None):
    """First-max routing on the saved input, or (the gather model frozen at σ) selScatter."""
    if sigma is None:
        return maxpool.backward(saved, dy)
    return maxpool.scatter(sigma, dy, saved.x.shape, saved.spec)


def gap_backward(input_shape, dg):
    return gap.backward(input_shape, dg)


def dense_backward(name: str, weight, dy, *, precision=None):
    return dense.backward(weight, dy, precision=precision)


def dense_grad_weight(name: str, x, dy, *, precision=None):
    return dense.grad_weight(x, dy, precision=precision)


def dense_grad_bias(name: str, dy):
    return dense.grad_bias(dy)


def residual_backward(d_branch, d_skip):
    return residual.backward(d_branch, d_skip)


class Kit(NamedTuple):
    """The ops a rendered chain calls (see the module docstring for each signature)."""
    conv_forward: Callable = conv_forward
    conv_backward: Callable = conv_backward
    conv_grad_weight: Callable = conv_grad_weight
    conv_grad_bias: Callable = conv_grad_bias
    bn_forward: Callable = bn_forward
    bn_backward: Callable = bn_backward
    bn_nodes: Callable = bn_nodes
    relu_backward: Callable = relu_backward
    pool_backward: Callable = pool_backward
    gap_backward: Callable = gap_backward
    dense_backward: Callable = dense_backward
    dense_grad_weight: Callable = dense_grad_weight
    dense_grad_bias: Callable = dense_grad_bias
    residual_backward: Callable = residual_backward
    loss_cotangent: Optional[Callable] = None

    def __repr__(self) -> str:
        """`KIT` for the default kit, else the ops that differ from it: `Kit(bn_backward=...)`."""
        changed = [f"{name}={getattr(v, '__name__', repr(v))}" for name, v, d in zip(self._fields, self, _DEFAULTS)
                   if v is not d]
        return f"Kit({', '.join(changed)})" if changed else "KIT"


_DEFAULTS = tuple(Kit._field_defaults[name] for name in Kit._fields)
KIT = Kit()
OPS = tuple(f for f in Kit._fields if f != "loss_cotangent")


class Call(NamedTuple):
    """One call the chain made through a recording kit."""
    op: str                      # the kit field
    args: tuple
    kwargs: dict
    out: Any


def recording(kit: Kit, log: list, ops=OPS) -> Kit:
    """`kit` with each of `ops` appending a `Call` to `log` as it runs (under a trace: at trace
    time, with the traced arrays). A new kit, hashable by identity: build it inside the traced
    function whose calls it records."""
    def wrap(op: str, f: Callable) -> Callable:
        def recorded(*args, **kwargs):
            out = f(*args, **kwargs)
            log.append(Call(op, args, kwargs, out))
            return out
        return recorded
    return kit._replace(**{op: wrap(op, getattr(kit, op)) for op in ops})
