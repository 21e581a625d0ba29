"""A catalogue of real backward bugs, each planted in the rendered backward and each caught.

Every entry is modelled on a bug that shipped in a major framework or that hand-written backwards
commonly have. `plant(name, net)` returns a `controls.Control`: the real net's forward (the oracle
differentiates it), and the rendered backward traced with one function swapped, one saved tensor
misread or the nodes relabelled — never the forward, never the oracle. `gradtie check --plant-bug
NAME` runs the same verdict path as a real check and must exit 1 naming the first failing node in
backward order. Shown in: Would the check catch it?

A bug that is equivalent to the correct chain at every smooth point is not an entry: a ReLU mask
`>=` instead of `>` differs only where a pre-activation is exactly 0, where the census already
refuses the point (the op tests pin the render's convention at exact zeros).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import jax.numpy as jnp
from jax import lax

from ..ops import batchnorm, conv, dense, maxpool, residual
from . import controls
from .controls import Control, _check_net


@dataclass(frozen=True)
class Bug:
    name: str
    family: str                  # "BatchNorm", "synchronised BatchNorm", "max pool", "conv and dense", "head", "ResNet-34 blocks"
    breaks: str                  # one line: what is wrong
    modelled_on: str             # where such a bug shows up
    make: Callable[..., Control]
    nets: tuple[str, ...] = ("cifar8", "resnet34")
    replicas: bool = False       # planted in the data-parallel step (needs --replicas R ≥ 2)
    needs_smoothing: bool = False
    needs_uneven: bool = False   # plants nothing unless replicas hold different counts (--replica-counts)

    def applies(self, net_name: str) -> bool:
        return net_name in self.nets


# ---- BatchNorm ---------------------------------------------------------------------------------

def _bn_backward(*, mean_term: bool = True, xhat_term: bool = True, gamma: bool = True,
                 unbiased: bool = False, rsqrt_twice: bool = False, global_means: bool = True):
    """A BN input backward dx = s·(t − mean(t) − x̂·mean(x̂·t)), t = γ·dy, with one thing wrong."""
    def backward(saved: batchnorm.BNSaved, weight, dy):
        axes = (2, 3) if saved.per_example else (0, 2, 3)
        cells = math.prod(dy.shape[a] for a in axes)
        var = saved.var * cells / (cells - 1) if unbiased and cells > 1 else saved.var
        s = lax.rsqrt(var + saved.eps)
        if rsqrt_twice:
            s = lax.rsqrt(s)
        bc = (lambda v: v[:, :, None, None]) if saved.per_example else (lambda v: v[None, :, None, None])
        xhat = (saved.x - bc(saved.mean)) * bc(s)
        t = weight[None, :, None, None] * dy if gamma else dy
        means = jnp.stack([jnp.mean(t, axis=axes), jnp.mean(xhat * t, axis=axes)])
        if saved.axis_name is not None and not saved.per_example and global_means:
            means = lax.pmean(means, saved.axis_name)
        mean_t, mean_xt = bc(means[0]), bc(means[1])
        return bc(s) * (t - (mean_t if mean_term else 0.0) - (xhat * mean_xt if xhat_term else 0.0))
    return backward


def _bn_patch(net, name: str, breaks: str, **wrong) -> Control:
    return Control(name, net, breaks, patches=((batchnorm, "backward", _bn_backward(**wrong)),))


def bn_no_mean_term(net):
    return _bn_patch(net, "bn_no_mean_term", "BN input backward without the −mean(t) term", mean_term=False)


def bn_no_xhat_term(net):
    return _bn_patch(net, "bn_no_xhat_term", "BN input backward without the −x̂·mean(x̂·t) term", xhat_term=False)


def bn_unbiased_variance_backward(net):
    return _bn_patch(net, "bn_unbiased_variance_backward",
                     "BN backward recomputes s from the unbiased variance (the forward used the biased one)",
                     unbiased=True)


def bn_rsqrt_twice(net):
    return _bn_patch(net, "bn_rsqrt_twice", "BN backward passes the saved inverse std through rsqrt again",
                     rsqrt_twice=True)


def bn_forget_gamma(net):
    return _bn_patch(net, "bn_forget_gamma", "BN input backward with t = dy (γ forgotten)", gamma=False)


def bn_swap_dgamma_dbeta(net):
    c = controls.swap_gamma_beta(net)
    return Control("bn_swap_dgamma_dbeta", net, c.breaks, relabel=c.relabel)


def _bn_nodes_from_y(params):
    def bn_nodes(name: str, saved: batchnorm.BNSaved, dn):
        gamma, beta = params[f"{name}.weight"], params[f"{name}.bias"]
        xhat, _ = batchnorm.normalized(saved)
        y = gamma[None, :, None, None] * xhat + beta[None, :, None, None]
        return {f"{name}.weight": jnp.sum(dn * y, axis=(0, 2, 3)), f"{name}.bias": batchnorm.grad_bias(dn)}
    return bn_nodes


def bn_dgamma_from_y(net):
    """dγ = Σ dy·y (the BN output) instead of Σ dy·x̂: right only where γ = 1 and β = 0 (at init)."""
    return Control("bn_dgamma_from_y", net, "dγ computed as Σ dy·y instead of Σ dy·x̂",
                   patch_factory=lambda params: ((net, "bn_nodes", _bn_nodes_from_y(params)),))


# ---- synchronised BatchNorm (through the data-parallel step) -------------------------------------

def _bn_nodes_reduced_twice(name: str, saved: batchnorm.BNSaved, dn):
    dgamma, dbeta = batchnorm.grad_weight(saved, dn), batchnorm.grad_bias(dn)
    if saved.axis_name is not None:   # planted: summed over replicas here, then averaged again by the step
        dgamma, dbeta = lax.psum(dgamma, saved.axis_name), lax.psum(dbeta, saved.axis_name)
    return {f"{name}.weight": dgamma, f"{name}.bias": dbeta}


def sync_dgamma_dbeta_reduced_twice(net):
    return Control("sync_dgamma_dbeta_reduced_twice", net,
                   "dγ and dβ all-reduced inside the BN backward and again by the step (R× too large)",
                   patches=((net, "bn_nodes", _bn_nodes_reduced_twice),))


def sync_local_means_backward(net):
    return _bn_patch(net, "sync_local_means_backward",
                     "the BN backward's mean(t), mean(x̂·t) over the replica's own cells, not the global batch",
                     global_means=False)


def _plain_mean_of_means(sums, cells, axis_name):
    # planted: each replica's means over its own valid cells, then a plain mean over the replicas
    # (right only when every replica holds the same number of examples)
    local = sums / jnp.maximum(cells, 1)
    return local if axis_name is None else lax.pmean(local, axis_name)


def sync_plain_mean_of_means(net):
    """The backward's two means combined as a plain mean of replica means, not weighted by counts.
    Planted in the backward only (the forward's statistics keep the count-weighted combine): it
    shows only where replicas hold different numbers of examples."""
    return Control("sync_plain_mean_of_means", net,
                   "the BN backward's global means as a plain mean of replica means (uneven counts)",
                   patches=((batchnorm, "combine_means", _plain_mean_of_means),))


# ---- max pool ----------------------------------------------------------------------------------

def _first_max(x, spec):
    return jnp.argmax(maxpool.windows(x, spec), axis=-1)


def _cell_index(sigma, spec, shape):
    """The flat input index (row-major over H, W) of the cell σ picks in each window; −1 in padding."""
    k, s, p = spec.size, spec.stride, spec.pad
    _, _, h, w = shape
    i = jnp.arange(sigma.shape[2])[:, None]
    j = jnp.arange(sigma.shape[3])[None, :]
    row = s * i - p + sigma // k
    col = s * j - p + sigma % k
    inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
    return jnp.where(inside, row * w + col, -1)


def _pool_overwrite(saved: maxpool.PoolSaved, dy):
    # planted: each window's cotangent is WRITTEN onto its cell (scatter .set); where overlapping
    # windows pick the same cell, one write wins instead of the two adding
    x, spec = saved
    n, c, h, w = x.shape
    idx = _cell_index(_first_max(x, spec), spec, x.shape)
    idx = jnp.where(idx < 0, h * w, idx).reshape(n, c, -1)
    ni = jnp.arange(n)[:, None, None]
    ci = jnp.arange(c)[None, :, None]
    flat = jnp.zeros((n, c, h * w + 1), dy.dtype).at[ni, ci, idx].set(dy.reshape(n, c, -1))
    return flat[:, :, :h * w].reshape(n, c, h, w)


def pool3x3_scatter_overwrite(net):
    _check_net("pool3x3_scatter_overwrite", net, ("resnet34",), "only the 3×3/s2 stem pool overlaps")
    return Control("pool3x3_scatter_overwrite", net,
                   "the overlapping 3×3/s2 pool backward overwrites where windows share a cell instead of adding",
                   patches=((maxpool, "backward", _pool_overwrite),))


def _pool_offset(saved: maxpool.PoolSaved, dy):
    # planted: the routing reads windows one column to the right (the selection of the shifted input)
    x, spec = saved
    shifted = jnp.concatenate([x[:, :, :, 1:], x[:, :, :, :1]], axis=3)
    sigma = _first_max(shifted, spec)
    return maxpool.scatter(sigma, dy, x.shape, spec)


def pool_window_offset(net):
    return Control("pool_window_offset", net, "the pool backward's windows offset by one column",
                   patches=((maxpool, "backward", _pool_offset),))


# ---- conv and dense ----------------------------------------------------------------------------

def _mask_from_conv_output(saved: dict) -> dict:
    """Every conv→BN→ReLU mask read from the conv output c instead of the BN output n."""
    out = {}
    for stage, rec in saved.items():
        fields = rec._fields
        if "layer1" in fields and "n1" in fields:            # cifar8 stages, ResNet-34 blocks
            rec = rec._replace(n1=rec.layer1.c)
            if "n2" in fields:
                rec = rec._replace(n2=rec.layer2.c)
        elif "layer" in fields and "n1" in fields:           # ResNet-34 stem
            rec = rec._replace(n1=rec.layer.c)
        out[stage] = rec
    return out


def relu_mask_from_conv_output(net):
    return Control("relu_mask_from_conv_output", net,
                   "the ReLU mask read from the conv output (before BatchNorm) instead of the BN output",
                   saved_transform=_mask_from_conv_output)


def _conv_backward(*, flip: bool = True, shift: int = 0):
    def backward(weight, dy, *, input_shape, stride=1, rnd=None):
        rnd_ = rnd or conv.identity
        n, c, h, w = input_shape
        k = weight.shape[2]
        p = conv.padding(k)
        wr = rnd_(weight)
        kernel = wr[:, :, ::-1, ::-1] if flip else wr
        up_h, up_w = stride * (dy.shape[2] - 1) + 1, stride * (dy.shape[3] - 1) + 1
        pads = ((k - 1 - p + shift, h + p - up_h - shift), (k - 1 - p + shift, w + p - up_w - shift))
        acc = jnp.float32 if jnp.dtype(dy.dtype) == jnp.bfloat16 else dy.dtype
        dx = lax.conv_general_dilated(rnd_(dy), kernel, (1, 1), pads, lhs_dilation=(stride, stride),
                                      dimension_numbers=("NCHW", "IOHW", "NCHW"),
                                      precision=lax.Precision.HIGHEST, preferred_element_type=acc)
        return rnd_(dx).astype(dy.dtype)
    return backward


def conv_kernel_not_flipped(net):
    return Control("conv_kernel_not_flipped", net, "the conv input backward correlates with W unflipped",
                   patches=((conv, "backward", _conv_backward(flip=False)),))


def conv_padding_off_by_one(net):
    return Control("conv_padding_off_by_one", net, "the conv input backward padded one cell off (dx shifted)",
                   patches=((conv, "backward", _conv_backward(shift=1)),))


def _dense_grad_weight_transposed(x, dy):
    dw = jnp.matmul(dy.T, x, precision=lax.Precision.HIGHEST)
    return dw.T if dw.shape[0] == dw.shape[1] else dw   # planted where the shape lets it pass


def dense_weight_grad_transposed(net):
    _check_net("dense_weight_grad_transposed", net, ("cifar8",), "ResNet-34's fc is not square")
    return Control("dense_weight_grad_transposed", net,
                   "a square dense layer's weight gradient transposed (fc2 512×512: no shape error)",
                   patches=((dense, "grad_weight", _dense_grad_weight_transposed),))


# ---- ResNet-34 blocks --------------------------------------------------------------------------

def _skip_dropped(d_branch_input, d_skip):
    return d_branch_input      # planted: the skip's cotangent never reaches the block input


def residual_skip_dropped(net):
    _check_net("residual_skip_dropped", net, ("resnet34",), "cifar8 has no residual blocks")
    return Control("residual_skip_dropped", net, "the residual fan-in drops the skip branch's cotangent",
                   patches=((residual, "backward", _skip_dropped),))


def _projection_reads_dn2(real_block_backward):
    """The downsample block's backward with the projection BN fed dn2 (the cotangent below bn2)
    instead of da (the one bn2 itself reads)."""
    def block_backward(block, params, s, dy, cfg):
        if s.proj is None:
            return real_block_backward(block, params, s, dy, cfg)
        saved_bn = {}
        real_bn_backward = batchnorm.backward

        def recording(saved, weight, d):   # remember bn2's output (dn2) for the projection
            out = real_bn_backward(saved, weight, d)
            if saved.x is s.layer2.c:
                saved_bn["dn2"] = out
            if saved.x is s.proj.c and "dn2" in saved_bn:
                return real_bn_backward(saved, weight, saved_bn["dn2"])
            return out

        with controls.planted(((batchnorm, "backward", recording),)):
            return real_block_backward(block, params, s, dy, cfg)
    return block_backward


def projection_bn_reads_dn2(net):
    _check_net("projection_bn_reads_dn2", net, ("resnet34",), "cifar8 has no projection")
    return Control("projection_bn_reads_dn2", net,
                   "the downsample projection's BN backward reads dn2 instead of da",
                   patches=((net, "_block_backward", _projection_reads_dn2(net._block_backward)),))


# ---- the catalogue -----------------------------------------------------------------------------

BOTH = ("cifar8", "resnet34")
CATALOGUE: dict[str, Bug] = {b.name: b for b in [
    Bug("bn_no_mean_term", "BatchNorm", "BN input backward without the −mean(t) term",
        "the 'simplified' BN backward of hand-written kernels that drop the mean gradient", bn_no_mean_term),
    Bug("bn_no_xhat_term", "BatchNorm", "BN input backward without the −x̂·mean(x̂·t) term",
        "treating the batch statistics as constants (the eval-mode backward used in training)", bn_no_xhat_term),
    Bug("bn_unbiased_variance_backward", "BatchNorm", "unbiased variance in the backward only",
        "the Bessel-corrected variance (the running-stat one) reused in the backward", bn_unbiased_variance_backward),
    Bug("bn_rsqrt_twice", "BatchNorm", "saved inverse std passed through rsqrt a second time",
        "a kernel that saves 1/σ and a backward that expects σ² (cuDNN-style saved statistics)", bn_rsqrt_twice),
    Bug("bn_swap_dgamma_dbeta", "BatchNorm", "dγ and dβ swapped", "two [C] outputs returned in the wrong order",
        bn_swap_dgamma_dbeta),
    Bug("bn_forget_gamma", "BatchNorm", "γ forgotten in the input backward",
        "a backward derived for the unit-scale normaliser; invisible at init (γ = 1)", bn_forget_gamma),
    Bug("bn_dgamma_from_y", "BatchNorm", "dγ computed as Σ dy·y instead of Σ dy·x̂",
        "the output y saved in place of x̂; invisible at init (γ = 1, β = 0)", bn_dgamma_from_y),
    Bug("sync_dgamma_dbeta_reduced_twice", "synchronised BatchNorm", "dγ/dβ all-reduced twice (scaled by R)",
        "SyncBatchNorm's parameter gradients summed in the op and again by the data-parallel wrapper",
        sync_dgamma_dbeta_reduced_twice, replicas=True),
    Bug("sync_local_means_backward", "synchronised BatchNorm", "local instead of global means in the backward",
        "a synchronised forward paired with the per-replica backward", sync_local_means_backward, replicas=True),
    Bug("sync_plain_mean_of_means", "synchronised BatchNorm",
        "global means as a plain mean of replica means where replica counts differ",
        "an uneven last batch averaged as if every replica held the same count",
        sync_plain_mean_of_means, replicas=True, needs_uneven=True),
    Bug("pool3x3_scatter_overwrite", "max pool", "the overlapping 3×3/s2 scatter overwriting instead of adding",
        "scatter with .set where overlapping windows need .add", pool3x3_scatter_overwrite, nets=("resnet34",)),
    Bug("pool_window_offset", "max pool", "a window offset by one", "an off-by-one in the window origin",
        pool_window_offset),
    Bug("pool2x2_backward_on_3x3", "max pool", "the 3×3/s2 stem pool routed by the 2×2 backward",
        "a pool backward written for one pool reused for another", controls.pool2x2_backward_on_3x3,
        nets=("resnet34",)),
    Bug("relu_mask_from_conv_output", "conv and dense", "ReLU mask read from the conv output instead of the BN output",
        "the mask taken from the wrong saved tensor after fusing conv and BN", relu_mask_from_conv_output),
    Bug("conv_kernel_not_flipped", "conv and dense", "conv input gradient with the kernel not flipped",
        "correlation and convolution confused in the transpose", conv_kernel_not_flipped),
    Bug("conv_padding_off_by_one", "conv and dense", "conv input gradient with padding off by one",
        "the transposed conv's padding k−1−p written as p", conv_padding_off_by_one),
    Bug("same_padding_strided", "conv and dense", "'SAME' padding in the backward of strided convs",
        "XLA 'SAME' (asymmetric) against PyTorch's symmetric padding on stride 2", controls.same_padding_strided,
        nets=("resnet34",)),
    Bug("dense_weight_grad_transposed", "conv and dense", "dense weight gradient transposed where the shape allows",
        "x ᵀ·dy for dyᵀ·x: only a square layer lets it through without a shape error",
        dense_weight_grad_transposed, nets=("cifar8",)),
    Bug("head_no_batch_divisor", "head", "head cotangent without 1/N", "sum-reduced loss paired with a mean",
        lambda net: _renamed(controls.drop_batch_divisor(net), "head_no_batch_divisor")),
    Bug("head_smoothing_wrong_k", "head", "head cotangent smoothing with α/(K−1)",
        "label smoothing spread over the K−1 other classes", 
        lambda net: _renamed(controls.smoothing_wrong_k(net), "head_smoothing_wrong_k"), needs_smoothing=True),
    Bug("residual_skip_dropped", "ResNet-34 blocks", "the residual skip dropped", "a fan-in whose second cotangent is lost",
        residual_skip_dropped, nets=("resnet34",)),
    Bug("projection_bn_reads_dn2", "ResNet-34 blocks", "the projection BN reading dn2 instead of da",
        "the skip branch wired to the main branch's cotangent one node too deep", projection_bn_reads_dn2,
        nets=("resnet34",)),
]}


def _renamed(c: Control, name: str) -> Control:
    return Control(name, c.real_net, c.breaks, head_cotangent=c.head_cotangent, patches=c.patches,
                   relabel=c.relabel, needs_smoothing=c.needs_smoothing)


def plant(name: str, net) -> Control:
    """The net with catalogue entry `name` planted in its rendered backward; ValueError for an
    unknown name or a bug that does not apply to this net."""
    if name not in CATALOGUE:
        raise ValueError(f"plant-bug {name!r}: expected one of {', '.join(CATALOGUE)} (or 'list')")
    bug = CATALOGUE[name]
    label = net.__name__.rsplit(".", 1)[-1]
    if not bug.applies(label):
        raise ValueError(f"plant-bug {name}: applies to {', '.join(bug.nets)} only, not {label}")
    return bug.make(net)


def entries(net_name: Optional[str] = None, *, replicas: Optional[bool] = None) -> list[Bug]:
    """The catalogue, optionally only what applies to `net_name` and to (or not to) the data-parallel step."""
    return [b for b in CATALOGUE.values() if (net_name is None or b.applies(net_name))
            and (replicas is None or b.replicas == replicas)]


def listing() -> str:
    """`gradtie check --plant-bug list`: one line per entry."""
    lines = [f"{'name':<34} {'family':<24} {'nets':<17} what is wrong"]
    for b in CATALOGUE.values():
        nets = "/".join(b.nets) + (" (--replica-counts)" if b.needs_uneven else " (--replicas)" if b.replicas else "")
        lines.append(f"{b.name:<34} {b.family:<24} {nets:<17} {b.breaks}")
    return "\n".join(lines)


# ---- the catalogue at one point --------------------------------------------------------------------

@dataclass(frozen=True)
class Caught:
    bug: str
    family: str
    net: str
    report: object            # the TieReport of the planted chain

    @property
    def first(self):
        return self.report.first_failure()

    @property
    def red(self) -> bool:
        """Caught: a row fails a limit that can tell a bug apart (not one lost in round-off)."""
        return self.first is not None and not self.first.ill_conditioned

    @property
    def ratio(self) -> float:
        """The first failing row's error over its limit (0 when nothing failed)."""
        return self.first.rel / self.first.limit if self.first is not None else 0.0


@dataclass
class CatalogueReport:
    net: str
    real: object               # the real chain's TieReport at the same point: it must tie
    caught: list

    @property
    def ok(self) -> bool:
        return self.real.ok and all(c.red for c in self.caught)

    def summary(self) -> str:
        red = sum(c.red for c in self.caught)
        return (f"{self.net}: real chain {'tied' if self.real.ok else 'FAILED'}; "
                f"{red}/{len(self.caught)} planted bugs caught")

    def table(self, ratios: bool = False) -> str:
        """One line per bug: caught or not, and the first failing node in backward order (with its
        error over its limit when `ratios`: those move with the machine's round-off, the rest does not)."""
        head = f"{'bug':<34} {'family':<23} {'caught':<7} {'first failing node (backward order)':<36}"
        lines = [head + ("  err/limit" if ratios else ""), "-" * (len(head) + (11 if ratios else 0))]
        for c in self.caught:
            line = f"{c.bug:<34} {c.family:<23} {'yes' if c.red else 'NO':<7} {c.first.name if c.first else '-':<36}"
            lines.append(line + (f"  {c.ratio:9.1e}" if ratios else ""))
        return "\n".join(lines)


def run(net, params, x, targets, cfg, *, label_smoothing: float = 0.1, names=None, replicas: int = 1,
        point=None) -> CatalogueReport:
    """Every catalogue entry that applies to `net` (or `names`) planted in turn, each tied at the
    same point against one shared reference and envelope. replicas > 1: the data-parallel entries,
    through the mesh step (`check.tie_replicas`); else each planted backward runs op by op (the
    entries share their ops, not their programs: `tie.rendered_nodes`). label_smoothing > 0 so that
    every head entry plants something."""
    from .check import tie_replicas
    from .tie import net_label, reference_at, tie, targets_matrix
    label = net_label(net)
    chosen = [b for b in entries(label, replicas=replicas > 1) if names is None or b.name in names]
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    point = point or reference_at(net, params, x, t, cfg, label_smoothing=label_smoothing)

    def verdict(n, uneven=False):
        if replicas > 1:   # an entry that needs uneven counts runs at the split the last batch of an epoch has
            from ..parallel import uneven_split
            counts = uneven_split(x.shape[0], replicas) if uneven else None
            return tie_replicas(n, params, x, t, cfg, replicas=replicas, label_smoothing=label_smoothing, point=point,
                                counts=counts)
        return tie(n, params, x, t, cfg, label_smoothing=label_smoothing, point=point, op_by_op=True)

    real = verdict(net)
    caught = [Caught(b.name, b.family, label, verdict(b.make(net), b.needs_uneven)) for b in chosen]
    return CatalogueReport(label if replicas == 1 else f"{label} on {replicas} replicas", real, caught)
