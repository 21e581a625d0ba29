"""2-D convolution, NCHW activations and OIHW weights, symmetric `(k-1)//2` zero padding.

Forward, rendered input backward (stride 1 and 2), weight and bias gradients, then the bf16 kinds:
every conv site takes a rounding function `rnd` (identity by default) applied to both operands and
once to the result, with float32 accumulation. Shown in: Whole-net tie, bf16 erasure.

Padding is PyTorch's symmetric `(k-1)//2` at every stride, not XLA's 'SAME' (which pads strided
convs asymmetrically and so reads a window one cell off).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import _validate

Rounding = Callable[[jax.Array], jax.Array]
_DIMS = ("NCHW", "OIHW", "NCHW")


def identity(a: jax.Array) -> jax.Array:
    return a


def padding(kernel_size: int) -> int:
    """Symmetric zero padding on each side: (k-1)//2."""
    return (kernel_size - 1) // 2


def out_size(size: int, kernel_size: int, stride: int) -> int:
    return (size + 2 * padding(kernel_size) - kernel_size) // stride + 1


def _acc_dtype(*operands) -> jnp.dtype:
    # bf16 operands accumulate in float32; f32/f64 operands accumulate in their own dtype
    dt = jnp.result_type(*operands)
    return jnp.dtype(jnp.float32) if dt == jnp.bfloat16 else dt


def _result_dtype(carrier, *operands) -> jnp.dtype:
    """What the contraction itself returns. A bf16 carrier (the bf16 policy's activations) takes a
    bf16 result straight from the contraction: float32 accumulation inside it, one rounding at the
    end, which is the suite's kind rnd(conv(rnd(a), rnd(b))) and what cuDNN runs on bf16 tensor
    cores (a (bf16, bf16) -> f32 convolution is upcast to a float32 one on XLA's GPU backend).
    Otherwise the accumulator's dtype, rounded afterwards by the site's `rnd` (the bf16 kinds in a
    float32 chain)."""
    return jnp.dtype(carrier) if jnp.dtype(carrier) == jnp.bfloat16 else _acc_dtype(*operands)


def _precision(precision) -> lax.Precision:
    # None: the checks' precision (true float32 / float64); the tf32 and bf16 policies pass DEFAULT
    return lax.Precision.HIGHEST if precision is None else precision


def _correlate(lhs, rhs, *, strides, pads, lhs_dilation=(1, 1), rhs_dilation=(1, 1), dims=_DIMS, precision=None,
               out=None):
    return lax.conv_general_dilated(
        lhs, rhs, window_strides=strides, padding=pads, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dims,
        precision=_precision(precision), preferred_element_type=out or _acc_dtype(lhs, rhs))


# ---- two formulations of one contraction -------------------------------------------------------
#
# Every conv site is one contraction. It runs either as XLA's convolution or as patches · weights
# (the k·k shifted views of the padded input stacked, then one matrix product). On the CPU backend
# XLA's convolution is pathologically slow where the output grid is tiny against the contraction
# (ResNet-34's layer4 at 64 px: 2×2 outputs with 512·9 terms each, 3×3 kernels reading mostly
# padding; ~70× slower than the product, benchmarks/), so there the product is used. Both compute
# the same sums; which one runs depends on the shapes only, so a bf16 kind and its f32 peer always
# take the same one.

# On the CPU the product wins once an output's contraction is this many times the grid it covers
# (measured per site of both nets, benchmarks/conv_sites.py); a 1×1 kernel is a product outright.
PATCHES_RATIO = 32


def use_patches(out_cells: int, contraction: int, kernel_size: int, formulation: Optional[str] = None) -> bool:
    """Whether a contraction of `contraction` terms per output, over `out_cells` output cells per
    image, runs as patches · weights. `formulation` pins it ("conv": XLA's convolution, what an
    accelerator runs; "patches": the product); None applies the shape rule (CPU backend only;
    elsewhere always XLA's convolution). Configuration, read at trace time: a net's
    `Config.conv_formulation`."""
    if formulation is not None:
        if formulation not in FORMULATIONS:
            raise ValueError(f"conv formulation: expected one of {', '.join(map(repr, FORMULATIONS))} or None, "
                             f"got {formulation!r}")
        return formulation == "patches"
    return jax.default_backend() == "cpu" and (kernel_size == 1 or contraction >= PATCHES_RATIO * out_cells)


FORMULATIONS = ("conv", "patches")


def _patches(x: jax.Array, k: int, stride: int) -> jax.Array:
    """x [N,C,H,W] -> the patches, channel-major: P[c·k·k + kh·k + kw, (n,i,j)] = xpad[n,c,s·i+kh,s·j+kw],
    column (n,i,j) the window of output (i,j) of image n (zero padding p = (k−1)//2).

    Channel-major because the products read it that way: W[O,C·k·k] · P is a plain matrix product
    with the weights in place (a cell-major P makes the compiler transpose, i.e. copy, the weights on
    every call: 38 MB per ResNet-34 layer4 block in float64), and dW = dy[O,cells] · Pᵀ reads it in
    place too."""
    p = padding(k)
    n, c = x.shape[:2]
    ho, wo = out_size(x.shape[2], k, stride), out_size(x.shape[3], k, stride)
    xpad = jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p))).transpose(1, 0, 2, 3)   # [C,N,H,W]: activation-sized
    taps = [xpad[:, :, kh:kh + stride * (ho - 1) + 1:stride, kw:kw + stride * (wo - 1) + 1:stride]
            for kh in range(k) for kw in range(k)]
    return jnp.stack(taps, axis=1).reshape(c * k * k, n * ho * wo)


def _channels_first(a: jax.Array) -> jax.Array:
    """[N,O,H,W] -> [O, N·H·W]: one column per cell."""
    n, o, h, w = a.shape
    return a.transpose(1, 0, 2, 3).reshape(o, n * h * w)


def _rows(a: jax.Array) -> jax.Array:
    """[N,O,H,W] -> [N·H·W, O]: one row per cell."""
    n, o, h, w = a.shape
    return a.transpose(0, 2, 3, 1).reshape(n * h * w, o)


def _unpatches(cols: jax.Array, shape: tuple[int, ...], k: int, stride: int) -> jax.Array:
    """The adjoint of `_patches`, from the cell-major layout: cols [N·H'·W', C·k·k] (a row per
    output cell) -> [N,C,H,W]. Each tap's plane is spread to the stride and added at its offset
    (kh − p, kw − p), taps in row-major order."""
    n, c, h, w = shape
    p = padding(k)
    ho, wo = out_size(h, k, stride), out_size(w, k, stride)
    taps = cols.reshape(n, ho, wo, c, k, k).transpose(0, 3, 4, 5, 1, 2)  # [N,C,k,k,H',W']
    zero = jnp.zeros((), cols.dtype)
    out = None
    for kh in range(k):
        for kw in range(k):
            lo_h, lo_w = kh - p, kw - p
            config = ((0, 0, 0), (0, 0, 0), (lo_h, h - lo_h - (stride * (ho - 1) + 1), stride - 1),
                      (lo_w, w - lo_w - (stride * (wo - 1) + 1), stride - 1))
            part = lax.pad(taps[:, :, kh, kw], zero, config)
            out = part if out is None else out + part
    return out


def _matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int], precision=None, out=None) -> jax.Array:
    """A 2-D product contracting a's axis contract[0] with b's axis contract[1], float32
    accumulation for bf16 operands (`out`: the result's dtype, default the accumulator's)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=_precision(precision), preferred_element_type=out or _acc_dtype(a, b))


def _round_result(out: jax.Array, rnd: Rounding, dtype) -> jax.Array:
    # the kind's single rounding of the float32 accumulator, back in the carrier dtype. A bf16-typed
    # rounding makes this a convert pair, which a backend allowing excess precision may delete (see
    # the bf16 section); "nearest" rounds with integer ops and cannot be folded away.
    return rnd(out).astype(dtype)


class ConvSaved(NamedTuple):
    x: jax.Array  # the conv input, read by the weight gradient
    stride: int


def _check(op: str, x, w, b, stride: int) -> None:
    _validate.rank(op, "x", x, 4)
    _validate.rank(op, "weight", w, 4)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[1]} channels but weight expects {w.shape[1]} "
                         f"(x {tuple(x.shape)}, weight {tuple(w.shape)})")
    if w.shape[2] != w.shape[3] or w.shape[2] % 2 != 1:
        raise ValueError(f"{op}: kernel must be square and odd, got weight {tuple(w.shape)}")
    if stride not in (1, 2):
        raise ValueError(f"{op}: stride must be 1 or 2, got {stride}")
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"{op}: bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    _validate.finite(op, "x", x)


def forward(x: jax.Array, weight: jax.Array, bias: Optional[jax.Array] = None, *, stride: int = 1,
            rnd: Optional[Rounding] = None, formulation: Optional[str] = None,
            precision: Optional[lax.Precision] = None) -> tuple[jax.Array, ConvSaved]:
    """y[n,o,i,j] = Σ_{c,kh,kw} xpad[n,c,s·i+kh,s·j+kw]·W[o,c,kh,kw] + b[o].

    x [N,C,H,W], weight [O,C,k,k] -> y [N,O,H',W'], H' = (H + 2p − k)//s + 1, p = (k−1)//2.
    The contraction runs in x's dtype (the weight is cast to it: bf16 activations read bf16
    weights) at `precision` (None: HIGHEST). With `rnd`, the bf16 kind: rnd(conv(rnd(x), rnd(W)))
    accumulated in float32, then the bias.
    """
    _check("conv.forward", x, weight, bias, stride)
    p = padding(weight.shape[2])
    rnd_ = rnd or identity
    k = weight.shape[2]
    xr, wr = rnd_(x), rnd_(weight.astype(x.dtype))
    out = _result_dtype(x.dtype, xr, wr)
    if use_patches(out_size(x.shape[2], k, stride) * out_size(x.shape[3], k, stride), x.shape[1] * k * k, k,
                   formulation):
        n, ho, wo = x.shape[0], out_size(x.shape[2], k, stride), out_size(x.shape[3], k, stride)
        y = _matmul(wr.reshape(wr.shape[0], -1), _patches(xr, k, stride), (1, 0), precision, out)   # [O, N·H'·W']
        y = y.reshape(wr.shape[0], n, ho, wo).transpose(1, 0, 2, 3)
    else:
        y = _correlate(xr, wr, strides=(stride, stride), pads=((p, p), (p, p)), precision=precision, out=out)
    y = _round_result(y, rnd_, x.dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)[None, :, None, None]
    return y, ConvSaved(x, stride)


def upsample(dy: jax.Array, stride: int) -> jax.Array:
    """Zeros between cells: dy's values land on the stride-1 grid at multiples of `stride`."""
    if stride == 1:
        return dy
    zero = jnp.zeros((), dy.dtype)
    return lax.pad(dy, zero, ((0, 0, 0), (0, 0, 0), (0, 0, stride - 1), (0, 0, stride - 1)))


# dy[N,O,H',W'] upsampled to the stride-1 grid, correlated with flip(W)ᵀ[C,O,k,k] -> dx[N,C,H,W]
def backward(weight: jax.Array, dy: jax.Array, *, input_shape: tuple[int, ...], stride: int = 1,
             rnd: Optional[Rounding] = None, formulation: Optional[str] = None,
             precision: Optional[lax.Precision] = None) -> jax.Array:
    """Input cotangent: linear in dy, independent of the primal; in dy's dtype (the weight is cast
    to it before the flip, so the convolution reads its kernel straight from the reverse).

    dx[n,c,h,w] = Σ_{o,kh,kw} dyup[n,o,h+p−kh,w+p−kw]·W[o,c,kh,kw], dyup = dy upsampled by the
    stride (values at multiples of s). Lean: `convBackBatched`, `cInB`; strided:
    `convStridedBackBatched`.
    """
    op = "conv.backward"
    _validate.rank(op, "dy", dy, 4)
    _validate.rank(op, "weight", weight, 4)
    n, c, h, w = input_shape
    k = weight.shape[2]
    expected = (n, weight.shape[0], out_size(h, k, stride), out_size(w, k, stride))
    if tuple(dy.shape) != expected:
        raise ValueError(f"{op}: dy must have shape {expected} for input {tuple(input_shape)} and "
                         f"weight {tuple(weight.shape)} at stride {stride}, got {tuple(dy.shape)}")
    p = padding(k)
    rnd_ = rnd or identity
    dyr, wr = rnd_(dy), rnd_(weight.astype(dy.dtype))
    out = _result_dtype(dy.dtype, dyr, wr)
    if use_patches(h * w, weight.shape[0] * k * k, k, formulation):
        # the transpose of the patches: every tap's products in one matrix product with W read in
        # place, then each tap's plane added back onto the input grid at its offset (a bf16 carrier
        # adds the taps in float32 and rounds once)
        cols = _matmul(_rows(dyr), wr.reshape(wr.shape[0], -1), (1, 0), precision)  # [N·H'·W', C·k·k]
        dx = _unpatches(cols, tuple(input_shape), k, stride)
    else:
        flipped = wr[:, :, ::-1, ::-1]  # [O,C,k,k], read with O as the input feature: flip(W)ᵀ
        # the upsampled grid is s·(H'−1)+1 long; low pad k−1−p, high pad fills it back to H (it is
        # larger when (H + 2p − k) is not a multiple of s). The upsampling is the convolution's own
        # input dilation: the zeros are never multiplied.
        up_h, up_w = stride * (dy.shape[2] - 1) + 1, stride * (dy.shape[3] - 1) + 1
        pads = ((k - 1 - p, h + p - up_h), (k - 1 - p, w + p - up_w))
        dx = _correlate(dyr, flipped, strides=(1, 1), pads=pads, lhs_dilation=(stride, stride),
                        dims=("NCHW", "IOHW", "NCHW"), precision=precision, out=out)
    return _round_result(dx, rnd_, dy.dtype)


# x[N,C,H,W] (padded) correlated with dy[N,O,H',W'] dilated by s, summed over N -> dW[O,C,k,k]
def grad_weight(x: jax.Array, dy: jax.Array, *, kernel_size: int, stride: int = 1,
                rnd: Optional[Rounding] = None, formulation: Optional[str] = None,
                precision: Optional[lax.Precision] = None) -> jax.Array:
    """dW[o,c,kh,kw] = Σ_n Σ_{i,j} dy[n,o,i,j]·xpad[n,c,s·i+kh,s·j+kw], in x's dtype.

    The bf16 kind (and a bf16 carrier) rounds the result once, outside the batch sum. Lean:
    `convWeightGradB` and its strided peer.
    """
    op = "conv.grad_weight"
    _validate.rank(op, "x", x, 4)
    _validate.rank(op, "dy", dy, 4)
    n, c, h, w = x.shape
    expected = (n, out_size(h, kernel_size, stride), out_size(w, kernel_size, stride))
    if (dy.shape[0], dy.shape[2], dy.shape[3]) != expected:
        raise ValueError(f"{op}: dy {tuple(dy.shape)} does not match x {tuple(x.shape)} at kernel "
                         f"{kernel_size}, stride {stride}")
    p = padding(kernel_size)
    rnd_ = rnd or identity
    xr, dyr = rnd_(x), rnd_(dy.astype(x.dtype))
    out = _result_dtype(x.dtype, xr, dyr)
    ho, wo = dy.shape[2], dy.shape[3]
    if use_patches(ho * wo, c * kernel_size ** 2, kernel_size, formulation):  # the forward's rule at this site
        # the forward's own patches (the compiler shares them with the forward under one jit)
        dw = _matmul(_channels_first(dyr), _patches(xr, kernel_size, stride), (1, 1), precision, out)
        dw = dw.reshape(dy.shape[1], c, kernel_size, kernel_size)
    else:
        tiles = grad_weight_tiles(n, ho, wo, xr.dtype, formulation)
        if tiles is None:
            # batch axis as the contraction ("feature") axis, channels as the "batch" axis; the high
            # pad stops the window sweep at exactly k positions
            hi_h = kernel_size + stride * (ho - 1) - h - p
            hi_w = kernel_size + stride * (wo - 1) - w - p
            dw = _correlate(xr, dyr, strides=(1, 1), pads=((p, hi_h), (p, hi_w)),
                            rhs_dilation=(stride, stride), dims=("CNHW", "IOHW", "CNHW"),
                            precision=precision, out=out)  # [O,C,k,k]
        else:
            # the tiles add up in the accumulator's dtype: a bf16 result is rounded once, at the end
            dw = _grad_weight_tiled(xr, dyr, kernel_size, stride, *tiles, precision=precision)
    return _round_result(dw, rnd_, x.dtype)


# On the CPU backend the weight gradient's convolution (the batch as its contraction axis) slows
# down sharply once one call sweeps a large grid: cifar8's conv2 at batch 64 takes 11 ms as one call
# and 4.3-5.0 ms as 64 or 16 calls; ResNet-34's layer1 at 224 px, 47 ms against 28 ms per image in
# bands of rows. Below TILE_MIN_CELLS per image one call is as fast. Each call costs about 30 ms of
# compilation, so a site is cut into at most MAX_TILES calls (cifar8 at batch 128: 9.8 ms as 16
# calls, 8.8 ms as 128, compiled in 0.55 s against 3.9 s).
TILE_CELLS = 1024
TILE_MIN_CELLS = 256
MAX_TILES = 16


def grad_weight_tiles(n: int, ho: int, wo: int, dtype, formulation: Optional[str] = None) -> Optional[tuple[int, int]]:
    """(examples, output rows) per call when the weight gradient is cut into tiles (None: one call
    for the whole batch). Tiled only where the shape rule applies (CPU backend, `formulation` None),
    for float32 and bf16 sites of at least `TILE_MIN_CELLS` output cells per image; float64 keeps one
    call (its sites are the checks' small batches, where more calls cost compile time and save
    nothing)."""
    if (formulation is not None or jax.default_backend() != "cpu" or jnp.dtype(dtype) == jnp.float64
            or n == 1 or ho * wo < TILE_MIN_CELLS):
        return None
    rows = ho if ho * wo <= TILE_CELLS else max(1, TILE_CELLS // wo)
    bands = -(-ho // rows)
    return max(1, -(-n * bands // MAX_TILES)), rows


def _grad_weight_tiled(x: jax.Array, dy: jax.Array, k: int, stride: int, examples: int, rows: int,
                       precision=None) -> jax.Array:
    """The weight gradient as a sum over tiles of `examples` images × `rows` output rows, each tile
    one convolution over the zero-padded input's rows it reads (padding inside the call is the slow
    form on the CPU). dy is moved to rows of cells ([N,H',W',O]) once, not per tile."""
    n, c, h, w = x.shape
    ho, wo = dy.shape[2], dy.shape[3]
    p = padding(k)
    xpad = jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))[:, :, :stride * (ho - 1) + k, :stride * (wo - 1) + k]
    dy_cells = dy.transpose(0, 2, 3, 1)
    total = None
    for i in range(0, n, examples):
        for r in range(0, ho, rows):
            r_end = min(r + rows, ho)
            part = _correlate(xpad[i:i + examples, :, stride * r:stride * (r_end - 1) + k],
                              dy_cells[i:i + examples, r:r_end], strides=(1, 1), pads=((0, 0), (0, 0)),
                              rhs_dilation=(stride, stride), dims=("CNHW", "IHWO", "CNHW"), precision=precision)
            total = part if total is None else total + part
    return total


# dy[N,O,H',W'] summed over (n,i,j) -> db[O]
def grad_bias(dy: jax.Array) -> jax.Array:
    """db[o] = Σ_{n,i,j} dy[n,o,i,j]; exactly 0 in ℝ when BatchNorm follows (round-off in floats).
    Summed in at least float32 (a bf16 cotangent's sum is a parameter node)."""
    _validate.rank("conv.grad_bias", "dy", dy, 4)
    return jnp.sum(dy.astype(_acc_dtype(dy)), axis=(0, 2, 3))


# ---- bf16 kinds: the rounding functions ------------------------------------------------------------
#
# Every conv site above is a bf16 kind when given `rnd`: rnd(op(rnd(a), rnd(b))), the contraction
# accumulating in float32, the result rounded once (the weight gradient's rounding sits outside its
# batch sum: the batch is part of the one float32 contraction). At rnd = identity it is the f32 op
# bit for bit: it adds rounding and nothing else. Three rounding functions, by name:
#
#   "identity" — no rounding: the kind is its f32 peer (erasure);
#   "nearest"  — bf16 round-to-nearest-even written with integer ops on the bits, carried in the
#                input's dtype: a compiler cannot fold it away (its autodiff derivative is 0);
#   "bf16"     — real bf16: bf16-typed operands, so the conv itself reads bf16 and accumulates in
#                float32 (what the nets use by default; differentiable by the oracle).
#
# A rounding written as a cast round-trip, convert(f32→bf16)→convert(bf16→f32), is a different
# thing: XLA's GPU backend may delete the pair (it allows excess precision), so it may not round at
# all. The bf16-typed operands above feed the conv directly, with no convert back in between.

BF16_MANTISSA = 7  # stored fraction bits of bfloat16; unit roundoff 2⁻⁸ (round to nearest)
_BITS = {jnp.dtype(jnp.float32): (jnp.uint32, 23), jnp.dtype(jnp.float64): (jnp.uint64, 52)}


def round_bf16(a: jax.Array) -> jax.Array:
    """Round to the nearest bfloat16 value, ties to even, kept in a's dtype (float32 or float64).

    Integer arithmetic on the bits: add half an ulp of bf16 (minus one, plus the last kept bit: ties
    go to even), then clear the dropped bits. For float32 this is exactly the f32→bf16 conversion,
    overflow to ±inf included; float64 keeps its own exponent range. bf16 inputs pass through.
    """
    a = jnp.asarray(a)
    if a.dtype == jnp.bfloat16:
        return a
    if a.dtype not in _BITS:
        raise ValueError(f"conv.round_bf16: expected float32, float64 or bfloat16, got {a.dtype}")
    uint, fraction = _BITS[a.dtype]
    drop = fraction - BF16_MANTISSA
    bits = lax.bitcast_convert_type(a, uint)
    last_kept = (bits >> drop) & uint(1)
    half = uint((1 << (drop - 1)) - 1)
    bits = (bits + half + last_kept) & ~uint((1 << drop) - 1)
    return lax.bitcast_convert_type(bits, a.dtype)


def bf16_operand(a: jax.Array) -> jax.Array:
    """Round-to-nearest-even to bfloat16, kept bf16-typed so the conv accumulates in float32.

    A cast round-trip (f32→bf16→f32) can be erased by a compiler; bf16-typed operands cannot.
    """
    return a.astype(jnp.bfloat16)


ROUNDINGS: dict[str, Rounding] = {"identity": identity, "nearest": round_bf16, "bf16": bf16_operand}


def named_rounding(rounding) -> Rounding:
    """A rounding function by name ("identity", "nearest", "bf16"); a callable passes through."""
    if callable(rounding):
        return rounding
    if rounding not in ROUNDINGS:
        raise ValueError(f"bf16 rounding {rounding!r}: expected one of {', '.join(map(repr, ROUNDINGS))} "
                         f"or a function")
    return ROUNDINGS[rounding]
