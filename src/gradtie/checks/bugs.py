"""A catalogue of real backward bugs, each planted as data and each caught.

A check that passes is only worth as much as the bugs it is seen to catch. Every entry is modelled
on a bug that shipped in a major framework or that hand-written backwards commonly have, and is
planted as a value: another kit (`KIT._replace(bn_backward=wrong)`, `gradtie.kit`) or another net
definition (`protocol.with_backwards`) — never a patched module, never the forward, never the
oracle. `plant(name, net)` returns the `tie.Chain` that runs it; `gradtie check --plant-bug NAME`
runs the same verdict path as a real check and must exit 1 naming the first failing node in
backward order. An entry applies to a net when the net's rendered chain calls what it replaces
(`applies`: read off the chain's kit calls at abstract shapes), so the catalogue plants into any
net built from the protocol, and a net's own entries (`Net.bugs`) join it.

A bug that is equivalent to the correct chain at every smooth point is not an entry: a ReLU mask
`>=` instead of `>` differs only where a pre-activation is exactly 0, where the census already
refuses the point (the op tests pin the render's convention at exact zeros).

The Whole-net tie chapter's controls are the entries in `CONTROLS`; the non-twin tie
control is a point, not a bug (`non_twin_tie`). Shown in: Would the check catch it?, Whole-net tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .. import kit as kit_, nets
from ..kit import KIT, Call
from ..nets import protocol
from ..nets.protocol import SMOOTHED_CE, Net
from ..ops import batchnorm, conv, head, maxpool
from ..parallel import uneven_split
from . import census
from .tie import Chain, NodeRow, Point, TieReport, tie


@dataclass(frozen=True)
class Bug:
    """One entry of the catalogue of backward bugs: a mistake hand-written backwards make, planted
    in the rendered chain (never in the forward or the oracle) so that a check must go red.

    `plant_into(net)` returns the net's chain with the bug in it (another kit op, or another stage
    backward); `uses` says whether the net's chain makes the call the bug replaces, so an entry
    applies only where it plants something (`applies`). `breaks` says in one line what is wrong and
    `modelled_on` where such a bug shows up. Entries with `replicas` live in the data-parallel step,
    with `needs_uneven` only where replicas hold different counts, with `needs_smoothing` only at
    α > 0 (`refusal` says why an entry would plant nothing). A net of your own adds entries of its
    own through `Net.bugs`."""

    name: str
    family: str          # "BatchNorm", "synchronised BatchNorm", "max pool", "conv and dense", "head", "blocks", …
    breaks: str          # one line: what is wrong
    modelled_on: str     # where such a bug shows up
    plant_into: Callable[[Net], Chain]
    # whether the net's chain calls what the bug replaces: a predicate over its kit calls
    uses: Callable[[Net, list], bool]
    replicas: bool = False       # planted in the data-parallel step (needs --replicas R ≥ 2)
    needs_smoothing: bool = False
    needs_uneven: bool = False   # plants nothing unless replicas hold different counts (--replica-counts)

    def applies(self, net, cfg=None) -> bool:
        net = nets.load(net)
        return self.uses(net, calls(net, net.cfg(cfg)))

    def refusal(self, label_smoothing: float, batch: int, replicas: int = 1, *, uneven: bool = False) -> str:
        """Why this entry would plant nothing in a check of `batch` examples on `replicas` replicas
        (`uneven`: holding different counts) at that label smoothing ("" when it plants something)."""
        if self.replicas and replicas < 2:
            return f"{self.name} lives in the data-parallel step: use --replicas R ≥ 2"
        if self.needs_uneven and not uneven:
            return (f"{self.name} plants nothing where every replica holds the same count: use --replica-counts "
                    f"(e.g. 3,1)")
        if self.needs_smoothing and not label_smoothing:
            return f"{self.name} plants nothing at label_smoothing = 0: give α > 0 (e.g. 0.1)"
        if self.name == "head_no_batch_divisor" and batch == 1:
            return f"{self.name} plants nothing at batch 1 (÷1 is the identity)"
        return ""


@lru_cache(maxsize=None)
def calls(net: Net, cfg) -> tuple[Call, ...]:
    """Every kit call the rendered chain of `net` makes, in order, at abstract shapes: which ops a
    net's backward uses, and with what statics (strides, pool windows, square dense layers)."""
    log: list = []
    rec = kit_.recording(KIT, log)
    params, x = protocol.abstract_inputs(net, cfg)

    def chain(p, x_):
        logits, saved = net.forward(p, x_, cfg, kit=rec)
        return net.backward(p, saved, logits, cfg, kit=rec)

    jax.eval_shape(chain, params, x)
    return tuple(log)


def _kit_bug(**ops) -> Callable[[Net], Chain]:
    return lambda net: Chain(net, KIT._replace(**ops))


def _calls_op(*ops: str, where: Callable[[Call], bool] = lambda c: True):
    return lambda net, cs: any(c.op in ops and where(c) for c in cs)


# ---- BatchNorm ---------------------------------------------------------------------------------

def _bn_backward(*, mean_term: bool = True, xhat_term: bool = True, gamma: bool = True,
                 unbiased: bool = False, rsqrt_twice: bool = False, global_means: bool = True,
                 count_weighted: bool = True):
    """A BN input backward dx = s·(t − mean(t) − x̂·mean(x̂·t)), t = γ·dy, with one thing wrong."""
    def backward(name, saved: batchnorm.BNSaved, weight, dy):
        axes = (2, 3) if saved.per_example else (0, 2, 3)
        cells = math.prod(dy.shape[a] for a in axes)
        s = lax.rsqrt((saved.var * cells / (cells - 1) if unbiased and cells > 1 else saved.var) + saved.eps)
        s = lax.rsqrt(s) if rsqrt_twice else s
        bc = (lambda v: v[:, :, None, None]) if saved.per_example else (lambda v: v[None, :, None, None])
        xhat = (saved.x - bc(saved.mean)) * bc(s)
        t = weight[None, :, None, None] * dy if gamma else dy
        w = 1.0 if saved.valid is None else jnp.asarray(saved.valid).astype(dy.dtype)[:, None, None, None]
        if saved.valid is not None and not saved.per_example:
            # a padded batch: sums over this replica's valid cells, combined across replicas
            local = jnp.stack([jnp.sum(w * t, axis=axes), jnp.sum(w * xhat * t, axis=axes)])
            count = jnp.sum(jnp.asarray(saved.valid).astype(dy.dtype)) * dy.shape[2] * dy.shape[3]
            if count_weighted:
                means = batchnorm.combine_means(local, count, saved.axis_name if global_means else None)
            else:   # a plain mean of replica means: right only where every replica holds the same count
                means = local / jnp.maximum(count, 1)
                means = means if saved.axis_name is None else lax.pmean(means, saved.axis_name)
        else:
            means = jnp.stack([jnp.mean(t, axis=axes), jnp.mean(xhat * t, axis=axes)])
            if saved.axis_name is not None and not saved.per_example and global_means:
                means = lax.pmean(means, saved.axis_name)
        mean_t, mean_xt = bc(means[0]), bc(means[1])
        dx = w * (bc(s) * (t - (mean_t if mean_term else 0.0) - (xhat * mean_xt if xhat_term else 0.0)))
        return dx.astype(saved.x.dtype)   # in the activations' dtype, as the real op (bf16 policy)
    return backward


def _bn_swapped(name, saved, weight, bias, dy):
    return KIT.bn_nodes(name, saved, weight, bias, dy)[::-1]   # planted: (dβ, dγ)


def _bn_nodes_from_y(name, saved, weight, bias, dy):
    xhat, _ = batchnorm.normalized(saved)
    y = weight[None, :, None, None] * xhat + bias[None, :, None, None]
    return jnp.sum(dy * y, axis=(0, 2, 3)), batchnorm.grad_bias(dy)


def _bn_nodes_reduced_twice(name, saved, weight, bias, dy):
    nodes = KIT.bn_nodes(name, saved, weight, bias, dy)
    # planted: summed over replicas here, then averaged again by the step
    return nodes if saved.axis_name is None else lax.psum(nodes, saved.axis_name)


# ---- max pool ----------------------------------------------------------------------------------

def _pool_overwrite(name, saved: maxpool.PoolSaved, dy, sigma=None):
    # planted: each window's cotangent is WRITTEN onto its cell (scatter .set): where overlapping
    # windows pick the same cell, the last write wins instead of the two adding
    x, spec = saved
    sigma, out = maxpool.select(x, spec) if sigma is None else sigma, jnp.zeros(x.shape, dy.dtype)
    for cell in range(spec.size ** 2):   # one cell index at a time: no two windows collide within it
        part = maxpool.scatter(sigma, jnp.where(sigma == cell, dy, 0), x.shape, spec)
        out = jnp.where(part != 0, part, out)
    return out


def _pool_offset(name, saved: maxpool.PoolSaved, dy, sigma=None):
    # planted: the routing reads windows one column to the right (the selection of the shifted input)
    x, spec = saved
    shifted = jnp.concatenate([x[:, :, :, 1:], x[:, :, :, :1]], axis=3)
    return maxpool.scatter(maxpool.select(shifted, spec), dy, x.shape, spec)


def _pool_as_2x2(name, saved: maxpool.PoolSaved, dy, sigma=None):
    # planted: whatever the forward pooled, route as the 2×2/s2 pool (windows rows 2i, 2i+1)
    return KIT.pool_backward(name, maxpool.PoolSaved(saved.x, maxpool.POOL2), dy, sigma)


# ---- conv and dense ----------------------------------------------------------------------------

def same_pads(size: int, kernel_size: int, stride: int) -> tuple[int, int]:
    """XLA's 'SAME': ⌈size/s⌉ outputs, total padding max((out−1)·s + k − size, 0), the odd cell on
    the high side. On even sizes at s = 2: (0, 1) for k = 3 and (2, 3) for k = 7 where PyTorch pads
    (1, 1) and (3, 3); (0, 0) for 1×1 either way."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel_size - size, 0)
    return total // 2, total - total // 2


def _conv(a, b, pads, dims, rnd, precision=None, **dilation):
    """rnd(a) ⋆ rnd(b), stride 1, in a's dtype (b cast to it), accumulated in float32 for bf16
    operands, rounded by rnd (a conv backward's contraction written out, to plant a wrong padding or
    kernel in)."""
    rnd = rnd or conv.identity
    out = lax.conv_general_dilated(rnd(a), rnd(b.astype(a.dtype)), (1, 1), pads, dimension_numbers=dims,
                                   **dilation, precision=lax.Precision.HIGHEST if precision is None else precision,
                                   preferred_element_type=jnp.float32 if rnd(a).dtype == jnp.bfloat16 else a.dtype)
    return rnd(out).astype(a.dtype)


def _conv_input(*, flip: bool = True, shift: int = 0, same: bool = False):
    """A conv input backward with one thing wrong: the kernel unflipped, the padding `shift` cells
    off, or (strided sites only) XLA's 'SAME' padding."""
    def backward(name, weight, dy, *, input_shape, stride=1, rnd=None, formulation=None, precision=None):
        if same and stride == 1:
            return KIT.conv_backward(name, weight, dy, input_shape=input_shape, stride=stride, rnd=rnd,
                                     formulation=formulation, precision=precision)
        n, c, h, w = input_shape
        k = weight.shape[2]
        p = conv.padding(k)
        up_h, up_w = stride * (dy.shape[2] - 1) + 1, stride * (dy.shape[3] - 1) + 1
        if same:
            (top, _), (left, _) = same_pads(h, k, stride), same_pads(w, k, stride)
            pads = ((k - 1 - top, h + top - up_h), (k - 1 - left, w + left - up_w))
        else:
            pads = ((k - 1 - p + shift, h + p - up_h - shift), (k - 1 - p + shift, w + p - up_w - shift))
        return _conv(dy, weight[:, :, ::-1, ::-1] if flip else weight, pads, ("NCHW", "IOHW", "NCHW"), rnd,
                     precision, lhs_dilation=(stride, stride))
    return backward


def _same_grad_weight(name, x, dy, *, kernel_size, stride=1, rnd=None, formulation=None, precision=None):
    if stride == 1:
        return KIT.conv_grad_weight(name, x, dy, kernel_size=kernel_size, stride=stride, rnd=rnd,
                                    formulation=formulation, precision=precision)
    pads = (same_pads(x.shape[2], kernel_size, stride), same_pads(x.shape[3], kernel_size, stride))
    dw = _conv(x, dy, pads, ("CNHW", "IOHW", "CNHW"), rnd, precision, rhs_dilation=(stride, stride))
    return dw[:, :, :kernel_size, :kernel_size]


def _dense_grad_weight_transposed(name, x, dy, *, precision=None):
    dw = jnp.matmul(dy.T, x.astype(dy.dtype), precision=lax.Precision.HIGHEST if precision is None else precision)
    return dw.T if dw.shape[0] == dw.shape[1] else dw   # planted where the shape lets it pass


def _dense_bias_keepdims(name, dy):
    return jnp.sum(dy, axis=0, keepdims=True)     # planted: [1, out] for an [out] parameter


def _mask_from_conv_output(stage) -> Callable:
    """The stage's backward with every conv→BN→ReLU mask read from the conv output c instead of the
    BN output n (the saved records of the book's two nets)."""
    def backward(params, s, dy, cfg, kit):
        fields = s._fields
        if "layer1" in fields and "n1" in fields:            # cifar8 stages, ResNet-34 blocks
            s = s._replace(n1=s.layer1.c)
            if "n2" in fields:
                s = s._replace(n2=s.layer2.c)
        elif "layer" in fields and "n1" in fields:           # ResNet-34 stem
            s = s._replace(n1=s.layer.c)
        return stage.backward(params, s, dy, cfg, kit)
    return backward


# ---- the head's six ops, one wrong -------------------------------------------------------------

def _head_cotangent(*, over_others: bool = False, divided: bool = True):
    """The head's six kit ops (chapter Head fold) with one wrong: α spread over the K−1 other classes
    (`over_others`), or divConstB (÷N) left out (not `divided`)."""
    def cotangent(logits, targets, alpha: float = 0.0, divisor=None):
        n, k = logits.shape
        d2 = head.shift(head.fold(logits, targets, alpha)[3], alpha / (k - 1 if over_others else k))
        return head.div_const(d2, n if divisor is None else divisor) if divided else d2
    return cotangent


def _smoothed_ce(net: Net, cs) -> bool:
    return net.loss is SMOOTHED_CE


# ---- blocks ------------------------------------------------------------------------------------

def _skip_dropped(d_branch_input, d_skip):
    return d_branch_input      # planted: the skip's cotangent never reaches the block input


def _projection_reads_inner(projections: Mapping[str, str], real: Callable = KIT.bn_backward) -> Callable:
    """A BN backward whose projection BN (a key of `Net.projections`) reads the cotangent its
    main-branch partner (the value: bn2 of a basic block) returned, dn2, instead of the one that
    partner read, da. The net declares both layers; nothing is read off their names."""
    partners = set(projections.values())
    returned: dict = {}   # each partner's output, as its block's backward computes it

    def backward(name, saved, weight, dy):
        if name in projections and projections[name] in returned:
            return real(name, saved, weight, returned[projections[name]])
        out = real(name, saved, weight, dy)
        if name in partners:
            returned[name] = out
        return out
    return backward


def _plants_projection(net: Net, cs) -> bool:
    """Whether the chain runs a projection BN backward whose partner's backward runs before it."""
    seen = set()
    for c in cs:
        if c.op == "bn_backward":
            if net.projections.get(c.args[0]) in seen:
                return True
            seen.add(c.args[0])
    return False


# ---- one node off by a relative δ: the check's sensitivity, planted ----------------------------------

def scaled_node(net, name: str, delta: float) -> Chain:
    """The chain of `net` with parameter node `name` returned as node·(1 + δ): a bug of known size,
    to see the verdict catch it above its sensitivity (`NodeRow.sensitivity`) and miss it below."""
    net = nets.load(net)
    f = 1.0 + float(delta)

    def node(op: str) -> Callable:   # a conv or dense weight or bias node, named `<layer>.weight` / `.bias`
        def planted(layer_name, *args, **kwargs):
            out = getattr(KIT, op)(layer_name, *args, **kwargs)
            return out * f if f"{layer_name}.{op.rsplit('_', 1)[1]}" == name else out
        return planted

    def bn_nodes(layer_name, saved, weight, bias, dy):   # a BN layer's (dγ, dβ): "<layer>.weight", ".bias"
        dgamma, dbeta = KIT.bn_nodes(layer_name, saved, weight, bias, dy)
        return (dgamma * (f if name == f"{layer_name}.weight" else 1.0),
                dbeta * (f if name == f"{layer_name}.bias" else 1.0))

    ops = ("conv_grad_weight", "conv_grad_bias", "dense_grad_weight", "dense_grad_bias")
    kit = KIT._replace(bn_nodes=bn_nodes, **{op: node(op) for op in ops})
    return Chain(net, kit, f"{name} × (1 + {delta:.1e})")


# ---- the catalogue -----------------------------------------------------------------------------

def _bn(**wrong):
    return _kit_bug(bn_backward=_bn_backward(**wrong))


BN_BACKWARD = _calls_op("bn_backward")
BN_NODES = _calls_op("bn_nodes")
_ENTRIES = [
    Bug("bn_no_mean_term", "BatchNorm", "BN input backward without the −mean(t) term",
        "the 'simplified' BN backward of hand-written kernels that drop the mean gradient",
        _bn(mean_term=False), BN_BACKWARD),
    Bug("bn_no_xhat_term", "BatchNorm", "BN input backward without the −x̂·mean(x̂·t) term",
        "treating the batch statistics as constants (the eval-mode backward used in training)",
        _bn(xhat_term=False), BN_BACKWARD),
    Bug("bn_unbiased_variance_backward", "BatchNorm", "unbiased variance in the backward only",
        "the Bessel-corrected variance (the running-stat one) reused in the backward", _bn(unbiased=True), BN_BACKWARD),
    Bug("bn_rsqrt_twice", "BatchNorm", "saved inverse std passed through rsqrt a second time",
        "a kernel that saves 1/σ and a backward that expects σ² (cuDNN-style saved statistics)",
        _bn(rsqrt_twice=True), BN_BACKWARD),
    Bug("bn_swap_dgamma_dbeta", "BatchNorm", "dγ and dβ swapped", "two [C] outputs returned in the wrong order",
        _kit_bug(bn_nodes=_bn_swapped), BN_NODES),
    Bug("bn_forget_gamma", "BatchNorm", "γ forgotten in the input backward",
        "a backward derived for the unit-scale normaliser; invisible at init (γ = 1)", _bn(gamma=False), BN_BACKWARD),
    Bug("bn_dgamma_from_y", "BatchNorm", "dγ computed as Σ dy·y instead of Σ dy·x̂",
        "the output y saved in place of x̂; invisible at init (γ = 1, β = 0)", _kit_bug(bn_nodes=_bn_nodes_from_y),
        BN_NODES),
    Bug("sync_dgamma_dbeta_reduced_twice", "synchronised BatchNorm", "dγ/dβ all-reduced twice (scaled by R)",
        "SyncBatchNorm's parameter gradients summed in the op and again by the data-parallel wrapper",
        _kit_bug(bn_nodes=_bn_nodes_reduced_twice), BN_NODES, replicas=True),
    Bug("sync_local_means_backward", "synchronised BatchNorm", "local instead of global means in the backward",
        "a synchronised forward paired with the per-replica backward", _bn(global_means=False), BN_BACKWARD,
        replicas=True),
    Bug("sync_plain_mean_of_means", "synchronised BatchNorm",
        "global means as a plain mean of replica means where replica counts differ",
        "an uneven last batch averaged as if every replica held the same count", _bn(count_weighted=False),
        BN_BACKWARD, replicas=True, needs_uneven=True),
    Bug("pool3x3_scatter_overwrite", "max pool", "the overlapping 3×3/s2 scatter overwriting instead of adding",
        "scatter with .set where overlapping windows need .add", _kit_bug(pool_backward=_pool_overwrite),
        _calls_op("pool_backward", where=lambda c: c.args[1].spec.size > c.args[1].spec.stride)),
    Bug("pool_window_offset", "max pool", "a window offset by one", "an off-by-one in the window origin",
        _kit_bug(pool_backward=_pool_offset), _calls_op("pool_backward")),
    Bug("pool2x2_backward_on_3x3", "max pool", "the 3×3/s2 stem pool routed by the 2×2 backward",
        "a pool backward written for one pool reused for another", _kit_bug(pool_backward=_pool_as_2x2),
        _calls_op("pool_backward", where=lambda c: c.args[1].spec != maxpool.POOL2 and maxpool.out_size(
            c.args[1].x.shape[2], maxpool.POOL2) == c.args[2].shape[2])),
    Bug("relu_mask_from_conv_output", "conv and dense", "ReLU mask read from the conv output instead of the BN output",
        "the mask taken from the wrong saved tensor after fusing conv and BN",
        lambda net: Chain(protocol.with_backwards(net, _mask_from_conv_output, net.name)),
        lambda net, cs: net.suite is not None),   # the saved records of the suite's nets
    Bug("conv_kernel_not_flipped", "conv and dense", "conv input gradient with the kernel not flipped",
        "correlation and convolution confused in the transpose", _kit_bug(conv_backward=_conv_input(flip=False)),
        _calls_op("conv_backward")),
    Bug("conv_padding_off_by_one", "conv and dense", "conv input gradient with padding off by one",
        "the transposed conv's padding k−1−p written as p", _kit_bug(conv_backward=_conv_input(shift=1)),
        _calls_op("conv_backward", where=lambda c: c.args[1].shape[2] > 1)),
    Bug("same_padding_strided", "conv and dense", "'SAME' padding in the backward of strided convs",
        "XLA 'SAME' (asymmetric) against PyTorch's symmetric padding on stride 2",
        _kit_bug(conv_backward=_conv_input(same=True), conv_grad_weight=_same_grad_weight),
        _calls_op("conv_backward", where=lambda c: c.kwargs.get("stride", 1) == 2 and c.args[1].shape[2] > 1)),
    Bug("dense_weight_grad_transposed", "conv and dense", "dense weight gradient transposed where the shape allows",
        "x ᵀ·dy for dyᵀ·x: only a square layer lets it through without a shape error",
        _kit_bug(dense_grad_weight=_dense_grad_weight_transposed),
        _calls_op("dense_grad_weight", where=lambda c: c.args[1].shape[1] == c.args[2].shape[1])),
    Bug("dense_bias_grad_keepdims", "conv and dense", "dense bias gradient returned as [1, out] for an [out] bias",
        "a reduction with keepdims=True: an optimizer then broadcasts the bias to [1, out]",
        _kit_bug(dense_grad_bias=_dense_bias_keepdims), _calls_op("dense_grad_bias")),
    Bug("head_no_batch_divisor", "head", "head cotangent without 1/N", "sum-reduced loss paired with a mean",
        _kit_bug(loss_cotangent=_head_cotangent(divided=False)), _smoothed_ce),
    Bug("head_smoothing_wrong_k", "head", "head cotangent smoothing with α/(K−1)",
        "label smoothing spread over the K−1 other classes",
        _kit_bug(loss_cotangent=_head_cotangent(over_others=True)), _smoothed_ce, needs_smoothing=True),
    Bug("residual_skip_dropped", "blocks", "the residual skip dropped", "a fan-in whose second cotangent is lost",
        _kit_bug(residual_backward=_skip_dropped), _calls_op("residual_backward")),
    Bug("projection_bn_reads_dn2", "blocks", "the projection BN reading dn2 instead of da",
        "the skip branch wired to the main branch's cotangent one node too deep",
        lambda net: Chain(net, KIT._replace(bn_backward=_projection_reads_inner(net.projections))),
        _plants_projection),
]
CATALOGUE: dict[str, Bug] = {b.name: b for b in _ENTRIES}
# The must-fail controls of the Whole-net tie, by their catalogue names
CONTROLS = ("bn_swap_dgamma_dbeta", "head_no_batch_divisor", "head_smoothing_wrong_k", "pool2x2_backward_on_3x3",
            "same_padding_strided")


def catalogue(net=None) -> dict[str, Bug]:
    """The catalogue, with `net`'s own entries (`Net.bugs`) after it."""
    return {**CATALOGUE, **{b.name: b for b in (() if net is None else nets.load(net).bugs)}}


def entries(net=None, *, replicas: Optional[bool] = None, cfg=None) -> list[Bug]:
    """The entries that apply to `net` (all, without one), optionally only those of (or not of) the
    data-parallel step."""
    return [b for b in catalogue(net).values()
            if (net is None or b.applies(net, cfg)) and (replicas is None or b.replicas == replicas)]


def chosen(net, names: Optional[Sequence[str]] = None, *, label_smoothing: float, batch: int, replicas: int = 1,
           cfg=None) -> list[Bug]:
    """The entries of `names` (default: every one that applies to `net`) of the check's kind (replicas
    > 1: the data-parallel step, each entry at the split it needs), each planting something at this
    label smoothing and batch: an entry that would plant nothing is an error, never a silent green."""
    out = [b for b in entries(net, replicas=replicas > 1, cfg=cfg) if names is None or b.name in names]
    missing = [n for n in names or () if n not in {b.name for b in out}]
    if missing:
        raise ValueError(f"{missing} plant nothing in {net.name} here (see `entries`)")
    for b in out:
        if why := b.refusal(label_smoothing, batch, replicas, uneven=True):
            raise ValueError(why)
    return out


def plant(name: str, net, cfg=None) -> Chain:
    """The chain of `net` with entry `name` planted; ValueError for an unknown name or an entry
    that plants nothing in this net."""
    net = nets.load(net)
    known = catalogue(net)
    if name not in known:
        raise ValueError(f"plant-bug {name!r}: expected one of {', '.join(known)} (or 'list')")
    bug = known[name]
    if not bug.applies(net, cfg):
        raise ValueError(f"plant-bug {name}: plants nothing in {net.name} (its rendered chain makes no call "
                         f"this entry replaces); `--plant-bug list` shows the entries that apply")
    return bug.plant_into(net)._replace(planted=name)


def listing(net=None) -> str:
    """`gradtie check --plant-bug list`: one line per entry (those that apply to `net`, with one)."""
    return "\n".join([f"{'name':<34} {'family':<24} {'needs':<18} what is wrong"] + [
        f"{b.name:<34} {b.family:<24} "
        f"{'--replica-counts' if b.needs_uneven else '--replicas' if b.replicas else '':<18} {b.breaks}"
        for b in entries(net)])


# ---- the catalogue at one point --------------------------------------------------------------------

@dataclass(frozen=True)
class Caught:
    bug: str
    family: str
    net: str
    report: TieReport            # the planted chain's tie
    smooth: Optional[object] = None   # the census, for the non-twin tie point

    @property
    def first(self) -> Optional[NodeRow]:
        return self.report.first_failure()

    @property
    def first_beta(self) -> Optional[NodeRow]:
        return self.report.first_beta_failure()

    @property
    def red(self) -> bool:
        """Caught: a row fails a limit that can tell a bug apart (not one lost in round-off). At the
        non-twin tie point: the census refuses it, and the tie does not pass."""
        if self.smooth is not None:
            return not self.smooth.ok and (not self.report.ok or bool(self.report.ill_conditioned))
        return self.first is not None and not self.first.ill_conditioned

    @property
    def ratio(self) -> float:
        """The first failing row's error over its limit (0 when nothing failed)."""
        return self.first.ratio if self.first is not None else 0.0

    def summary(self) -> str:
        if not self.red:
            return f"{self.bug} on {self.net}: NOT caught"
        line = f"{self.bug} on {self.net}: caught, {len(self.report.failed)}/{len(self.report.rows)} rows fail"
        if self.first is not None:
            line += f"; first in backward order: {self.first.name}"
        if self.first_beta is not None:
            line += f"; first β row: {self.first_beta.name} ({self.first_beta.bad}/{self.first_beta.shape[0]} channels)"
        if self.smooth is not None:
            line += f"; census: {self.smooth.summary().split(';')[0]}"
        return line


@dataclass
class CatalogueReport:
    net: str
    real: TieReport            # the real chain's tie at the same point: it must tie
    caught: list

    @property
    def ok(self) -> bool:
        return self.real.ok and all(c.red for c in self.caught)

    def __getitem__(self, name: str) -> Caught:
        return next(c for c in self.caught if c.bug == name)

    def summary(self) -> str:
        red = sum(c.red for c in self.caught)
        return (f"{self.net}: real chain {'tied' if self.real.ok else 'FAILED'}; "
                f"{red} of {len(self.caught)} planted bugs caught")

    def table(self, ratios: bool = False) -> str:
        """One line per bug: caught or not, the first failing node in backward order and the first β
        row (with its error over its limit when `ratios`: those move with the machine's round-off)."""
        head_ = (f"{'bug':<34} {'family':<23} {'caught':<7} {'first failing node (backward order)':<36} "
                 f"{'first β row':<28}" + ("  err/limit" if ratios else ""))
        return "\n".join([head_, "-" * len(head_)] + [
            f"{c.bug:<34} {c.family:<23} {'yes' if c.red else 'NO':<7} {c.first.name if c.first else '-':<36} "
            f"{c.first_beta.name if c.first_beta else '-':<28}" + (f"  {c.ratio:9.1e}" if ratios else "")
            for c in self.caught])


def run(point: Point, *, names: Optional[Sequence[str]] = None, replicas: int = 1, how: str = "eager") -> CatalogueReport:
    """Every entry that applies to the point's net (or those of `names`) planted in turn, each tied at
    the point (`tie.Point`) against its one reference and envelope. replicas > 1: the data-parallel
    entries, through the mesh step (`tie.tie` on R replicas); else each planted chain runs `how`:
    "eager", op by op (the default: the entries share their ops, not their programs), or "quick" (one
    program each). Give the point a label smoothing > 0 (0.1, say) so that every head entry plants
    something (`chosen`)."""
    net, cfg = point.net, point.cfg
    planted = chosen(net, names, label_smoothing=point.alpha, batch=point.batch, replicas=replicas, cfg=cfg)

    def verdict(chain: Chain, uneven: bool = False):   # uneven: at the split the last batch of an epoch has
        return tie(point, chain, how="compiled" if not chain.planted else how, replicas=replicas,
                   counts=uneven_split(point.batch, replicas) if uneven else None)

    real = verdict(Chain(net))
    caught = [Caught(b.name, b.family, net.name, verdict(plant(b.name, net, cfg), b.needs_uneven)) for b in planted]
    return CatalogueReport(net.name if replicas == 1 else f"{net.name} on {replicas} replicas", real, caught)


def non_twin_tie(net, params, x_flat, targets, cfg, *, label_smoothing: float = 0.0) -> Caught:
    """The non-twin tie control: the convs before the first pool reduced to their centre tap
    (`census.planted_tie`) on flat images. Cells that share a pixel but not a receptive field now
    tie; the census must refuse the point, and the two derivatives disagree there (the rendered
    pool routes a tie to its first cell, autodiff of the max splits it evenly). The gather model's
    input gradient is the derivative at twin ties only, so here the input row is tied to the real
    net's autodiff: on flat images the parameter rows agree either way (tied cells see equal
    patches), and the input row is where the routing shows."""
    point = census.planted_tie(net, params)
    smooth = census.smoothness(net, point, x_flat, cfg)
    rep = tie(Point.of(net, point, x_flat, targets, cfg, label_smoothing=label_smoothing).real_input_gradient())
    return Caught("non_twin_tie", "a point", net.name, rep, smooth)
