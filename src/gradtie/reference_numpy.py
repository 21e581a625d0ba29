"""The forward written a second time: NumPy, float64, apart from `gradtie.ops` and `gradtie.nets`.

The autodiff oracle (`gradtie.reference`) differentiates the project's own forward, so a bug in that
forward would sit on both sides of every tie. This module is the independent forward the project's
is tied to. It imports nothing from gradtie: it reads only a params dict with PyTorch state_dict
names and layouts (PyTorch state_dict) and NCHW images, and computes from the formulas alone.

Two levels:

- direct loops (`conv2d_loop`, `maxpool_loop`, `maxpool_backward_loop`): explicit sums over
  o, c, kh, kw and explicit window scans, for small shapes — the root of trust;
- vectorised primitives for the nets (`conv2d`: im2col from index arithmetic and one `np.einsum`;
  `batchnorm` from its formula; `maxpool` over index-gathered windows), each tied to its loop.

Round-off. A float64 dot product of n terms, in any order, with or without fused multiply-adds, is
within γ_n·Σ|a||b| of the exact value (Higham, Thm 3.5), γ_n = n·ε/(1 − n·ε) — here with
ε = ε₆₄ = 2⁻⁵² per rounding, twice the unit roundoff, so an extra rounding (a reciprocal multiply in
place of a division) stays covered. `conv2d_roundoff`, `batchnorm_roundoff`, `maxpool_backward_loop`
give that bound per output element for one evaluation from exact inputs.

Through a whole net, worst-case bounds compound by about √n per layer (|W| where W has signs), which
says nothing after 36 layers. So the nets carry a first-order *envelope* instead: each op's local
round-off gets the standard deviation σ_n·Σ|a||b| of the probabilistic model (`sigma_n`: √n
roundings instead of γ_n's n), errors of different cells are independent, and variances are
propagated through the signed linearisation (conv by W², BN by its exact Jacobian, ReLU by its mask,
max pool by the window's largest variance). `Forward.envelope` is that standard deviation at each
logit. It overestimates the real round-off (each local Σ|a||b| ignores cancellation), and it widens
where the point is ill-conditioned (a BN channel with small variance over few cells, as in
ResNet-34's layer4 at 32 px).

Planted mistakes (`PLANTED`) swap one primitive for a wrong one — unbiased variance, ε off by ten,
a flipped kernel, a window one cell off, 'SAME' padding, (H,W,C) flattening — so a test can show
that the tie sees each of them. Tied to the project's forward in tests/test_forward_independence.py.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

import numpy as np

EPS64 = float(np.finfo(np.float64).eps)   # 2⁻⁵², counted per rounding (twice the unit roundoff)
BN_EPS = 1e-5                             # the render's ε
CIFAR8_CONVS = 8
CIFAR8_IMAGE = 32
RESNET34_LAYERS = (3, 4, 6, 3)            # basic blocks per layer


def gamma_n(n: int) -> float:
    """γ_n = n·ε/(1 − n·ε): the relative bound of an n-term float64 sum of products (ε = ε₆₄)."""
    if n * EPS64 >= 1:
        raise ValueError(f"gamma_n: n = {n} is too large for a first-order bound")
    return n * EPS64 / (1 - n * EPS64)


def sigma_n(n: int) -> float:
    """√n·ε: the standard deviation, relative to Σ|a||b|, of an n-term float64 sum's round-off when
    the roundings are independent and mean-zero (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019:
    the error is below λ√n·u·Σ|a||b| but with probability falling like exp(−λ²/2)); ε = 2u."""
    return float(np.sqrt(n)) * EPS64


# ---- input checks ----------------------------------------------------------------------------------

def _f64(op: str, name: str, a, ndim: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim}, got shape {a.shape}")
    return a


def _conv_operands(op: str, x, weight, bias):
    x = _f64(op, "x [N,C,H,W]", x, 4)
    w = _f64(op, "weight [O,C,k,k]", weight, 4)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{op}: x has {x.shape[1]} channels, weight expects {w.shape[1]} "
                         f"(x {x.shape}, weight {w.shape})")
    if w.shape[2] != w.shape[3] or w.shape[2] % 2 != 1:
        raise ValueError(f"{op}: expected a square odd kernel, got weight {w.shape}")
    b = None if bias is None else _f64(op, "bias [O]", bias, 1)
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"{op}: bias must have shape ({w.shape[0]},), got {b.shape}")
    return x, w, b


def _out(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


# ---- direct loops: the root of trust ---------------------------------------------------------------

def conv2d_loop(x, weight, bias=None, *, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """y[n,o,i,j] = b[o] + Σ_c Σ_kh Σ_kw x[n,c,s·i+kh−p, s·j+kw−p]·W[o,c,kh,kw], p = (k−1)//2.

    Explicit loops; a tap outside the image reads the zero padding and is skipped. Returns (y, mag),
    mag[n,o,i,j] = |b[o]| + Σ|x||W| over the same taps: the magnitude sum of the output's products.
    For small shapes only.
    """
    x, w, b = _conv_operands("conv2d_loop", x, weight, bias)
    n_, c_, h_, w_ = x.shape
    o_, _, k, _ = w.shape
    p = (k - 1) // 2
    ho, wo = _out(h_, k, stride, p), _out(w_, k, stride, p)
    y, mag = np.zeros((n_, o_, ho, wo)), np.zeros((n_, o_, ho, wo))
    for n in range(n_):
        for o in range(o_):
            for i in range(ho):
                for j in range(wo):
                    acc = 0.0 if b is None else b[o]
                    size = 0.0 if b is None else abs(b[o])
                    for c in range(c_):
                        for kh in range(k):
                            row = stride * i + kh - p
                            if not 0 <= row < h_:
                                continue
                            for kw in range(k):
                                col = stride * j + kw - p
                                if not 0 <= col < w_:
                                    continue
                                prod = x[n, c, row, col] * w[o, c, kh, kw]
                                acc += prod
                                size += abs(prod)
                    y[n, o, i, j], mag[n, o, i, j] = acc, size
    return y, mag


def _pool_args(op: str, x, size: int, stride: int, pad: int) -> np.ndarray:
    x = _f64(op, "x [N,C,H,W]", x, 4)
    if size < 1 or stride < 1 or not 0 <= pad < size:
        raise ValueError(f"{op}: expected size ≥ 1, stride ≥ 1, 0 ≤ pad < size, got {size}, {stride}, {pad}")
    if _out(x.shape[2], size, stride, pad) < 1 or _out(x.shape[3], size, stride, pad) < 1:
        raise ValueError(f"{op}: x {x.shape} is smaller than the {size}×{size} window")
    return x


def _window_cells(i: int, j: int, size: int, stride: int, pad: int, h: int, w: int):
    """The cells of window (i,j) inside the image, in row-major window order (padding is −∞: skipped)."""
    for kh in range(size):
        row = stride * i + kh - pad
        for kw in range(size):
            col = stride * j + kw - pad
            if 0 <= row < h and 0 <= col < w:
                yield row, col


def maxpool_loop(x, *, size: int, stride: int, pad: int = 0) -> np.ndarray:
    """y[n,c,i,j] = max over window (i,j), rows s·i−p … s·i−p+k−1 (−∞ padding). Explicit scan."""
    x = _pool_args("maxpool_loop", x, size, stride, pad)
    n_, c_, h_, w_ = x.shape
    ho, wo = _out(h_, size, stride, pad), _out(w_, size, stride, pad)
    y = np.empty((n_, c_, ho, wo))
    for n in range(n_):
        for c in range(c_):
            for i in range(ho):
                for j in range(wo):
                    y[n, c, i, j] = max(x[n, c, r, q] for r, q in _window_cells(i, j, size, stride, pad, h_, w_))
    return y


def maxpool_backward_loop(x, dy, *, size: int, stride: int, pad: int = 0):
    """Each window's cotangent onto its FIRST maximal cell in row-major window order; overlaps add.

    Returns (dx, bound): bound[n,c,h,w] = γ_m·Σ|contributions| with m the number of windows that
    route to that cell (0 where at most one does: a single contribution is exact).
    """
    x = _pool_args("maxpool_backward_loop", x, size, stride, pad)
    n_, c_, h_, w_ = x.shape
    ho, wo = _out(h_, size, stride, pad), _out(w_, size, stride, pad)
    dy = _f64("maxpool_backward_loop", "dy", dy, 4)
    if dy.shape != (n_, c_, ho, wo):
        raise ValueError(f"maxpool_backward_loop: dy must have shape {(n_, c_, ho, wo)}, got {dy.shape}")
    dx, mag, count = np.zeros_like(x), np.zeros_like(x), np.zeros(x.shape, dtype=np.int64)
    for n in range(n_):
        for c in range(c_):
            for i in range(ho):
                for j in range(wo):
                    best = None
                    for r, q in _window_cells(i, j, size, stride, pad, h_, w_):
                        if best is None or x[n, c, r, q] > x[n, c, best[0], best[1]]:  # strict: first max
                            best = (r, q)
                    dx[n, c, best[0], best[1]] += dy[n, c, i, j]
                    mag[n, c, best[0], best[1]] += abs(dy[n, c, i, j])
                    count[n, c, best[0], best[1]] += 1
    bound = np.where(count > 1, np.vectorize(gamma_n)(np.maximum(count, 1)) * mag, 0.0)
    return dx, bound


# ---- vectorised primitives (the nets') -------------------------------------------------------------

def _windows(xp: np.ndarray, k: int, stride: int, ho: int, wo: int) -> np.ndarray:
    """[N,C,Hp,Wp] -> [N,C,ho,wo,k,k]: window (i,j) is rows s·i … s·i+k−1 of the padded input."""
    rows = stride * np.arange(ho)[:, None] + np.arange(k)[None, :]      # [ho,k]
    cols = stride * np.arange(wo)[:, None] + np.arange(k)[None, :]      # [wo,k]
    return xp[:, :, rows[:, None, :, None], cols[None, :, None, :]]


def _conv(x, w, b, stride: int, pads: tuple[int, int], ho: int, wo: int) -> np.ndarray:
    lo, hi = pads
    xp = np.pad(x, ((0, 0), (0, 0), (lo, hi), (lo, hi)))
    y = np.einsum("ncijab,ocab->noij", _windows(xp, w.shape[2], stride, ho, wo), w, optimize=True)
    return y if b is None else y + b[None, :, None, None]


def conv2d(x, weight, bias=None, *, stride: int = 1) -> np.ndarray:
    """The render's conv (symmetric (k−1)//2 zero padding, correlation, OIHW): im2col by index
    arithmetic, one einsum over (c, kh, kw). x [N,C,H,W], W [O,C,k,k] -> [N,O,H',W']."""
    x, w, b = _conv_operands("conv2d", x, weight, bias)
    p = (w.shape[2] - 1) // 2
    ho, wo = _out(x.shape[2], w.shape[2], stride, p), _out(x.shape[3], w.shape[2], stride, p)
    return _conv(x, w, b, stride, (p, p), ho, wo)


def conv2d_roundoff(x, weight, bias=None, *, stride: int = 1,
                    sum_bound: Callable[[int], float] = gamma_n) -> np.ndarray:
    """γ_n·(|W|⊛|x| + |b|), n = C·k·k (+1 with a bias): one float64 evaluation's bound per output
    (with sum_bound=sigma_n: the standard deviation of its round-off instead)."""
    x, w, b = _conv_operands("conv2d_roundoff", x, weight, bias)
    n = w.shape[1] * w.shape[2] * w.shape[3] + (b is not None)
    return sum_bound(n) * conv2d(np.abs(x), np.abs(w), None if b is None else np.abs(b), stride=stride)


def _bn_operands(op: str, x, weight, bias):
    x = _f64(op, "x [N,C,H,W]", x, 4)
    g, b = _f64(op, "weight γ [C]", weight, 1), _f64(op, "bias β [C]", bias, 1)
    if g.shape != (x.shape[1],) or b.shape != (x.shape[1],):
        raise ValueError(f"{op}: γ and β must have shape ({x.shape[1]},) for x {x.shape}, "
                         f"got {g.shape} and {b.shape}")
    return x, g[None, :, None, None], b[None, :, None, None]


def _bn_axes(x: np.ndarray, per_example: bool) -> tuple[tuple[int, ...], int]:
    """The axes one BN channel normalises over and their cell count M."""
    axes = (2, 3) if per_example else (0, 2, 3)
    return axes, int(np.prod([x.shape[a] for a in axes]))


def batchnorm(x, weight, bias, *, eps: float = BN_EPS, per_example: bool = False,
              correction: int = 0) -> np.ndarray:
    """y = γ(x − μ)/√(σ² + ε) + β, μ and σ² = Σ(x−μ)²/(M − correction) over the channel's M cells
    ((N,H,W), or (H,W) per example). The render's BN is the population variance: correction 0."""
    x, g, b = _bn_operands("batchnorm", x, weight, bias)
    axes, m = _bn_axes(x, per_example)
    mu = x.mean(axis=axes, keepdims=True)
    var = np.square(x - mu).sum(axis=axes, keepdims=True) / (m - correction)
    return g * ((x - mu) / np.sqrt(var + eps)) + b


def batchnorm_roundoff(x, weight, bias, *, eps: float = BN_EPS, per_example: bool = False,
                       sum_bound: Callable[[int], float] = gamma_n) -> np.ndarray:
    """First-order bound on |fl(y) − y| for one float64 evaluation of BN from exact x.

    Counting roundings (ε each): μ = Σx/M within γ_{M+1}·mean|x|; d = x − μ adds ε|d|;
    σ² = Σd²/M within mean(2|d||δd|) + γ_{M+3}·mean(d²); s = 1/√(σ²+ε) gains ½|δσ²|/(σ²+ε) + 3ε
    relative (add, square root, divide); x̂ = d·s adds ε|x̂|; y = γx̂ + β adds 2ε(|γx̂| + |β|).
    With sum_bound=sigma_n the two sums count √M instead of M roundings (the nets' envelope).
    """
    x, g, b = _bn_operands("batchnorm_roundoff", x, weight, bias)
    axes, m = _bn_axes(x, per_example)
    mu = x.mean(axis=axes, keepdims=True)
    d = x - mu
    var = np.square(d).mean(axis=axes, keepdims=True)
    s = 1.0 / np.sqrt(var + eps)
    xhat = d * s
    dmu = sum_bound(m + 1) * np.abs(x).mean(axis=axes, keepdims=True)
    dd = dmu + EPS64 * np.abs(d)
    dvar = (2 * np.abs(d) * dd).mean(axis=axes, keepdims=True) + sum_bound(m + 3) * var
    ds = s * (0.5 * dvar / (var + eps) + 3 * EPS64)
    dxhat = s * dd + np.abs(d) * ds + EPS64 * np.abs(xhat)
    return np.abs(g) * dxhat + 2 * EPS64 * (np.abs(g * xhat) + np.abs(b))


def _maxpool(x, size: int, stride: int, pads: tuple[int, int], ho: int, wo: int, start: int = 0):
    lo, hi = pads
    xp = np.pad(x, ((0, 0), (0, 0), (lo, hi), (lo, hi)), constant_values=-np.inf)[:, :, start:, start:]
    return _windows(xp, size, stride, ho, wo).max(axis=(-2, -1))


def maxpool(x, *, size: int, stride: int, pad: int = 0) -> np.ndarray:
    """Max over k×k windows at stride s, −∞ padding p on each side. Max rounds nothing: exact."""
    x = _pool_args("maxpool", x, size, stride, pad)
    ho, wo = _out(x.shape[2], size, stride, pad), _out(x.shape[3], size, stride, pad)
    return _maxpool(x, size, stride, (pad, pad), ho, wo)


def flatten(x) -> np.ndarray:
    """[N,C,H,W] -> [N, C·H·W] in (C,H,W) order (the render's flatten)."""
    x = np.asarray(x, dtype=np.float64)
    return x.reshape(x.shape[0], -1)


class NumpyOps(NamedTuple):
    """The primitives a net forward calls for its values; `PLANTED` swaps one for a wrong one."""
    conv2d: Callable[..., np.ndarray]      # (x, W, b, *, stride)
    batchnorm: Callable[..., np.ndarray]   # (x, γ, β, *, eps, per_example)
    maxpool: Callable[..., np.ndarray]     # (x, *, size, stride, pad)
    flatten: Callable[..., np.ndarray]     # (x)


OPS = NumpyOps(conv2d, batchnorm, maxpool, flatten)


# ---- the nets, with their round-off envelopes ------------------------------------------------------

class Signal(NamedTuple):
    value: np.ndarray
    var: Optional[np.ndarray]   # variance of its first-order round-off (module doc); None: not tracked


class Forward(NamedTuple):
    """Logits [N,K] and the envelope: the standard deviation of their float64 round-off, per logit
    (None when the forward ran with envelope=False)."""
    logits: np.ndarray
    envelope: Optional[np.ndarray]


def _start(x: np.ndarray, envelope: bool) -> Signal:
    return Signal(x, np.zeros_like(x) if envelope else None)


def _finish(sig: Signal) -> Forward:
    return Forward(sig.value, None if sig.var is None else np.sqrt(sig.var))


def _conv_layer(ops: NumpyOps, sig: Signal, params, name: str, stride: int) -> Signal:
    w, b = params[f"{name}.weight"], params.get(f"{name}.bias")
    value = ops.conv2d(sig.value, w, b, stride=stride)
    if sig.var is None:
        return Signal(value, None)
    local = conv2d_roundoff(sig.value, w, b, stride=stride, sum_bound=sigma_n)
    return Signal(value, conv2d(sig.var, np.square(w), None, stride=stride) + np.square(local))


def _bn_layer(ops: NumpyOps, sig: Signal, params, name: str, eps: float, per_example: bool) -> Signal:
    # The Jacobian is γs(I − (11ᵀ + x̂x̂ᵀ)/M) per channel, so under independent errors of variance v:
    # var(δy_i) = γ²s²[v_i(1 − 2(1 + x̂_i²)/M) + (Σv + 2x̂_i·Σx̂v + x̂_i²·Σx̂²v)/M²]. Exact for the
    # linear map: with few cells (M = 2 in ResNet-34's layer4 at 32 px) BN all but erases its input's
    # errors, which a triangle inequality would multiply by s instead.
    g, beta = params[f"{name}.weight"], params[f"{name}.bias"]
    value = ops.batchnorm(sig.value, g, beta, eps=eps, per_example=per_example)
    if sig.var is None:
        return Signal(value, None)
    axes, m = _bn_axes(sig.value, per_example)
    mu = sig.value.mean(axis=axes, keepdims=True)
    s = 1.0 / np.sqrt(np.square(sig.value - mu).mean(axis=axes, keepdims=True) + eps)
    xhat, v = (sig.value - mu) * s, sig.var
    s0, s1, s2 = (np.sum(a, axis=axes, keepdims=True) for a in (v, xhat * v, np.square(xhat) * v))
    spread = v * (1 - 2 * (1 + np.square(xhat)) / m) + (s0 + 2 * xhat * s1 + np.square(xhat) * s2) / m**2
    propagated = np.square(np.asarray(g)[None, :, None, None] * s) * np.maximum(spread, 0.0)
    local = batchnorm_roundoff(sig.value, g, beta, eps=eps, per_example=per_example, sum_bound=sigma_n)
    return Signal(value, propagated + np.square(local))


def _relu(sig: Signal) -> Signal:
    # first order, as the whole envelope: the error passes where the derivative is 1 (pre > 0, the render's
    # mask) and stops where it is 0; a cell within round-off of the kink moves by at most its own error
    value = np.maximum(sig.value, 0.0)
    return Signal(value, None if sig.var is None else np.where(sig.value > 0, sig.var, 0.0))


def _pool(ops: NumpyOps, sig: Signal, size: int, stride: int, pad: int) -> Signal:
    # |max a − max b| ≤ max|a − b|: the window's largest variance
    value = ops.maxpool(sig.value, size=size, stride=stride, pad=pad)
    return Signal(value, None if sig.var is None else maxpool(sig.var, size=size, stride=stride, pad=pad))


def _dense(sig: Signal, params, name: str) -> Signal:
    w, b = np.asarray(params[f"{name}.weight"], np.float64), np.asarray(params[f"{name}.bias"], np.float64)
    if sig.value.shape[1] != w.shape[1] or b.shape != (w.shape[0],):
        raise ValueError(f"{name}: expected weight [out,{sig.value.shape[1]}] and bias [out], got "
                         f"{w.shape} and {b.shape}")
    value = sig.value @ w.T + b
    if sig.var is None:
        return Signal(value, None)
    local = sigma_n(w.shape[1] + 1) * (np.abs(sig.value) @ np.abs(w).T + np.abs(b))
    return Signal(value, sig.var @ np.square(w).T + np.square(local))


def _params(net: str, params: Mapping, names: list[str]) -> dict[str, np.ndarray]:
    if not isinstance(params, Mapping):
        raise ValueError(f"{net}: params must be a dict of PyTorch state_dict tensors, got {type(params).__name__}")
    missing = [name for name in names if name not in params]
    if missing:
        raise ValueError(f"{net}: params lack {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''}")
    return {name: np.asarray(p, dtype=np.float64) for name, p in params.items()}


def _image(net: str, x, rule: str, ok: Callable[[int], bool]) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 4 or x.shape[0] < 1 or x.shape[1] != 3 or not (ok(x.shape[2]) and ok(x.shape[3])):
        raise ValueError(f"{net}: x must be images [N,3,S,S] (NCHW) with S {rule}, got shape {x.shape}")
    return x


def cifar8_forward(params: Mapping, x, *, eps: float = BN_EPS, bn: str = "batch",
                   ops: NumpyOps = OPS, envelope: bool = True) -> Forward:
    """cifar8-BN logits, train mode: four stages of two conv3×3→BN→ReLU and a 2×2/s2 pool,
    flatten (C,H,W), fc1 → ReLU → fc2 → ReLU → fc3. Conv biases are used when params hold them;
    bn "batch" normalises over (N,H,W), "example" over each image's (H,W). envelope=False skips the
    round-off envelope (about two thirds of the work)."""
    if bn not in ("batch", "example"):
        raise ValueError(f"cifar8_forward: bn must be 'batch' or 'example', got {bn!r}")
    names = [f"{kind}{j}.{p}" for j in range(1, CIFAR8_CONVS + 1) for kind in ("conv", "bn")
             for p in (("weight",) if kind == "conv" else ("weight", "bias"))]
    names += [f"fc{j}.{p}" for j in (1, 2, 3) for p in ("weight", "bias")]
    x = _image("cifar8_forward", x, f"= {CIFAR8_IMAGE}", lambda s: s == CIFAR8_IMAGE)
    p = _params("cifar8_forward", params, names)
    sig = _start(x, envelope)
    for j in range(1, CIFAR8_CONVS + 1):
        sig = _conv_layer(ops, sig, p, f"conv{j}", 1)
        sig = _relu(_bn_layer(ops, sig, p, f"bn{j}", eps, bn == "example"))
        if j % 2 == 0:
            sig = _pool(ops, sig, 2, 2, 0)
    sig = Signal(ops.flatten(sig.value), None if sig.var is None else flatten(sig.var))
    sig = _relu(_dense(sig, p, "fc1"))
    sig = _relu(_dense(sig, p, "fc2"))
    sig = _dense(sig, p, "fc3")
    return _finish(sig)


def _resnet34_names() -> list[str]:
    names = ["conv1.weight", "bn1.weight", "bn1.bias"]
    for layer, size in enumerate(RESNET34_LAYERS, start=1):
        for i in range(size):
            q = f"layer{layer}.{i}"
            names += [f"{q}.conv1.weight", f"{q}.bn1.weight", f"{q}.bn1.bias",
                      f"{q}.conv2.weight", f"{q}.bn2.weight", f"{q}.bn2.bias"]
            if layer > 1 and i == 0:
                names += [f"{q}.downsample.0.weight", f"{q}.downsample.1.weight", f"{q}.downsample.1.bias"]
    return names + ["fc.weight", "fc.bias"]


def resnet34_forward(params: Mapping, x, *, eps: float = BN_EPS, ops: NumpyOps = OPS,
                     envelope: bool = True) -> Forward:
    """ResNet-34 logits, train mode: conv 7×7/s2 → BN → ReLU → max pool 3×3/s2 pad 1;
    [3,4,6,3] basic blocks (the first of layers 2–4 strided, with a 1×1/s2 conv + BN projection);
    global average pool; fc. Conv biases are used when params hold them. envelope=False skips the
    round-off envelope."""
    x = _image("resnet34_forward", x, "a positive multiple of 32", lambda s: s >= 32 and s % 32 == 0)
    p = _params("resnet34_forward", params, _resnet34_names())
    sig = _start(x, envelope)
    sig = _relu(_bn_layer(ops, _conv_layer(ops, sig, p, "conv1", 2), p, "bn1", eps, False))
    sig = _pool(ops, sig, 3, 2, 1)
    for layer, size in enumerate(RESNET34_LAYERS, start=1):
        for i in range(size):
            q, stride = f"layer{layer}.{i}", 2 if layer > 1 and i == 0 else 1
            r1 = _relu(_bn_layer(ops, _conv_layer(ops, sig, p, f"{q}.conv1", stride), p, f"{q}.bn1", eps, False))
            n2 = _bn_layer(ops, _conv_layer(ops, r1, p, f"{q}.conv2", 1), p, f"{q}.bn2", eps, False)
            skip = sig if stride == 1 else _bn_layer(
                ops, _conv_layer(ops, sig, p, f"{q}.downsample.0", 2), p, f"{q}.downsample.1", eps, False)
            a = n2.value + skip.value
            sig = _relu(Signal(a, None if sig.var is None else n2.var + skip.var + np.square(EPS64 * a)))
    h, w = sig.value.shape[2], sig.value.shape[3]
    g = sig.value.mean(axis=(2, 3))
    if sig.var is not None:
        local = sigma_n(h * w + 1) * np.abs(sig.value).mean(axis=(2, 3))
        sig = Signal(g, sig.var.sum(axis=(2, 3)) / (h * w) ** 2 + np.square(local))
    else:
        sig = Signal(g, None)
    sig = _dense(sig, p, "fc")
    return _finish(sig)


# ---- planted mistakes: each must differ from the project's forward beyond the tie's limit -----------

def _conv_pads(ops_pads: Callable[[int, int, int, int], tuple[int, int]]):
    """A conv that reads the output grid of the render's conv through other paddings (lo, hi)."""
    def planted(x, weight, bias=None, *, stride: int = 1):
        x, w, b = _conv_operands("conv2d", x, weight, bias)
        k = w.shape[2]
        p = (k - 1) // 2
        ho, wo = _out(x.shape[2], k, stride, p), _out(x.shape[3], k, stride, p)
        return _conv(x, w, b, stride, ops_pads(x.shape[2], k, stride, ho), ho, wo)
    return planted


def _same_pads(h: int, k: int, stride: int, ho: int) -> tuple[int, int]:
    # XLA's 'SAME': total (ho−1)·s + k − H, the smaller half before (asymmetric on strided convs)
    total = max((ho - 1) * stride + k - h, 0)
    return total // 2, total - total // 2


def _flipped_kernel(x, weight, bias=None, *, stride: int = 1):
    return conv2d(x, np.asarray(weight)[:, :, ::-1, ::-1], bias, stride=stride)   # a true convolution


def _unbiased_variance(x, weight, bias, *, eps: float = BN_EPS, per_example: bool = False):
    return batchnorm(x, weight, bias, eps=eps, per_example=per_example, correction=1)


def _eps_tenth(x, weight, bias, *, eps: float = BN_EPS, per_example: bool = False):
    return batchnorm(x, weight, bias, eps=eps / 10, per_example=per_example)


def _pool_window_offset(x, *, size: int, stride: int, pad: int = 0):
    x = _pool_args("maxpool", x, size, stride, pad)
    ho, wo = _out(x.shape[2], size, stride, pad), _out(x.shape[3], size, stride, pad)
    return _maxpool(x, size, stride, (pad, pad + 1), ho, wo, start=1)   # every window one cell down-right


def _flatten_hwc(x):
    x = np.asarray(x, dtype=np.float64)
    return x.transpose(0, 2, 3, 1).reshape(x.shape[0], -1)


PLANTED: dict[str, NumpyOps] = {
    "unbiased_variance": OPS._replace(batchnorm=_unbiased_variance),
    "eps_tenth": OPS._replace(batchnorm=_eps_tenth),
    "flipped_kernel": OPS._replace(conv2d=_flipped_kernel),
    "conv_window_offset": OPS._replace(conv2d=_conv_pads(lambda h, k, s, ho: ((k - 1) // 2 + 1,) * 2)),
    "same_padding_strided": OPS._replace(conv2d=_conv_pads(
        lambda h, k, s, ho: _same_pads(h, k, s, ho) if s > 1 else ((k - 1) // 2,) * 2)),
    "pool_window_offset": OPS._replace(maxpool=_pool_window_offset),
    "flatten_hwc": OPS._replace(flatten=_flatten_hwc),
}
