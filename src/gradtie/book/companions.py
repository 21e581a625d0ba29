"""The book's Lean-companion demonstrations that compare one side with something written apart from it.

Each companion here answers a statement of the suite with two computations that share no code on
the path that matters, and each comes with a control that must make it fail:

- `typed_erasure` (`Bf16Erasure`): the conv kinds run as REAL bf16-typed kernels (operands typed
  bfloat16, float32 accumulation) at operands already exact in bf16, against the exact sum of their
  products computed apart (NumPy, float64, index arithmetic: `exact_conv`), within float32's own
  accumulation bound; the control: operands that are not bf16-exact, which the kernel's cast rounds
  and the exact sum does not, so they exceed that bound. Shown in: bf16 erasure.
- `pool_vjp_tie` (selScatter, `batchMapAux_maxPoolBackFlat_eq_selScatter`): the pool backward
  against autodiff (`gradtie.reference.vjp`) of a gather model written here with its own index
  arithmetic, at a σ = argmax computed here; controls: another σ, a planted pool backward. Shown in:
  Pools.
- `node_ties_at_tie` (`cifar8Bbn_train_step_tiedB`, `r34_net_tiedB`: no smoothness clause): at a
  non-twin tie every stage's nodes still equal its VJP at the cotangent the chain hands it. Shown
  in: Pools.
- `forward_tie` (`resnet34ForwardBFull_eq_slots`): the eighteen-stage fold against the NumPy
  ResNet-34 (`gradtie.reference_numpy`), within its float64 envelope; controls: a planted NumPy
  op, two stages swapped. Shown in: Whole-net tie.
- `head_exact` (the head's tie reads 0): the head's rendered backward and its autodiff VJP against
  the exact values (rational arithmetic), to show where the 0 comes from. Shown in: Whole-net tie.
- `other_blocks` (`r34InputGradB_correct`: "for any block maps b1 … b16"): ResNet-34's stem and
  head around sixteen other maps, each with its own hand-written VJP. Shown in: Check your own backward.
- `input_sweep` (`cifar8BbnInputGradB_correct` at every N): cifar8's input gradient at lifted
  points where `MaxPool2Smooth` holds, one N at a time; a point outside it is not judged. Shown in:
  Whole-net tie.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gradtie import reference, rendered
from gradtie import reference_numpy as rn
from gradtie import tolerances as tol
from gradtie.checks import census, stages
from gradtie.checks.bf16 import Site, contraction_length, same_bits
from gradtie.checks.bf16.kinds import U_F32
from gradtie.checks.bf16.kinds import apply as conv_apply  # noqa: E402
from gradtie.checks.tie import Chain, Point, TieReport, need_x64, reference_at, targets_matrix, tie
from gradtie.kit import KIT
from gradtie.nets import resnet34
from gradtie.nets.protocol import Net, ParamSpec, Pass, Stage
from gradtie.ops import conv, maxpool


def _over(diff, limit) -> float:
    """max diff/limit over the entries (0 where diff is 0; an entry whose limit is 0 and diff is not: inf)."""
    diff, limit = np.asarray(diff, np.float64), np.asarray(limit, np.float64)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return float(np.max(np.where(diff == 0, 0.0, diff / limit), initial=0.0))


def gamma(n, u: float) -> float:
    """γ_n = n·u/(1 − n·u): the relative bound of an n-term sum of exact products at unit roundoff u."""
    return n * u / (1 - n * u)


# ---- Bf16Erasure with the real bf16-typed kernels ------------------------------------------------

def typed_operands(a: jax.Array) -> jax.Array:
    """The rounding handed to a conv op so that its OPERANDS run bf16-typed and its float32
    accumulator comes back unrounded: float64 operands are typed bfloat16 (the conv then reads bf16
    and accumulates in float32, as the nets' "bf16" rounding does), and the float32 accumulator
    passes (the op's single result rounding is then the identity, widened exactly to float64).
    Operands must be float64 holding bf16-exact values, or the cast itself rounds them."""
    return a.astype(jnp.bfloat16) if a.dtype == jnp.float64 else a


def exact_conv(op: str, a, b, *, stride: int, kernel_size: int, out_shape=None) -> tuple[np.ndarray, np.ndarray]:
    """The conv op `op` at operands (a, b) as the sum of its products in NumPy float64, with Σ|a||b|
    per output: forward (x, W), input backward (dy, W; out_shape: x's shape), weight grad (x, dy). The
    windows are read by index arithmetic over the symmetric (k−1)//2 zero padding
    (`reference_numpy`'s im2col), apart from the kit's convolutions and from XLA. At operands that are
    bf16 values every product is exact in float64, and the float64 sums err by at most
    γ_n(2⁻⁵³)·Σ|a||b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    k, p = kernel_size, (kernel_size - 1) // 2

    def one(a_, b_):
        if op == "forward":
            return rn.conv2d(a_, b_, stride=stride)
        if op == "grad_weight":
            ho, wo = b_.shape[2], b_.shape[3]
            xp = np.pad(a_, ((0, 0), (0, 0), (p, p + stride), (p, p + stride)))
            return np.einsum("ncijab,noij->ocab", rn._windows(xp, k, stride, ho, wo), b_, optimize=True)
        if op == "backward":
            n_, c_, h_, w_ = out_shape
            ho, wo = a_.shape[2], a_.shape[3]
            dxp = np.zeros((n_, c_, max(h_ + 2 * p, stride * (ho - 1) + k), max(w_ + 2 * p, stride * (wo - 1) + k)))
            for kh in range(k):
                for kw in range(k):
                    dxp[:, :, kh:kh + stride * (ho - 1) + 1:stride, kw:kw + stride * (wo - 1) + 1:stride] += \
                        np.einsum("noij,oc->ncij", a_, b_[:, :, kh, kw], optimize=True)
            return dxp[:, :, p:p + h_, p:p + w_]
        raise ValueError(f"exact_conv: op {op!r}: expected forward, backward or grad_weight")

    return one(a, b), one(np.abs(a), np.abs(b))


@dataclass(frozen=True)
class TypedRow:
    name: str            # the site ("forward s1", "conv3 weight grad" …)
    op: str
    formulation: str     # what the op ran: "conv" (XLA's convolution) or "patches" (patches · weights)
    n: int               # products per output
    exact: bool          # operands bf16-exact (the erasure point) or not (the control)
    equal: bool          # the typed kernel's float32 accumulator == the f32 peer, bit for bit
    kind_equal: bool     # the typed kind (result rounded to bf16) == round_bf16(f32 peer), bit for bit
    differing: int       # outputs whose bits differ from the f32 peer
    ratio: float         # max |typed − peer| / (2·γ_n(2⁻²⁴)·Σ|a||b|): ≤ 1 is summation order alone
    exact_ratio: float = 0.0   # max |typed − exact sum of the products| / ((γ_n(2⁻²⁴) + γ_n(2⁻⁵³))·Σ|a||b|)
    peer_exact_ratio: float = 0.0   # the same for the f32 peer

    @property
    def within(self) -> bool:
        return self.ratio <= 1.0

    @property
    def within_exact(self) -> bool:
        """The typed kernel is a float32 sum of the exact products: within float32's accumulation
        bound of the exact value computed apart."""
        return self.exact_ratio <= 1.0


@dataclass
class TypedReport:
    rows: list[TypedRow]
    backend: str

    def erasure(self) -> list[TypedRow]:
        return [r for r in self.rows if r.exact]

    def controls(self) -> list[TypedRow]:
        return [r for r in self.rows if not r.exact]

    @property
    def ok(self) -> bool:
        """Every site at bf16-exact operands lies within float32's accumulation bound of the exact
        sum of its products (computed apart), and so does its f32 peer; every control (operands not
        bf16-exact) lies outside it."""
        return (all(r.within_exact and r.peer_exact_ratio <= 1.0 for r in self.erasure())
                and all(not r.within_exact for r in self.controls()))

    def summary(self) -> str:
        er, ctl = self.erasure(), self.controls()
        order = [r for r in er if not r.equal]
        line = (f"{sum(r.within_exact for r in er)}/{len(er)} sites within float32's accumulation bound of the "
                f"exact sum at bf16-exact operands; {sum(r.equal for r in er)}/{len(er)} the f32 peer bit for bit "
                f"(the rounded kind too: {sum(r.kind_equal for r in er)}/{len(er)})")
        if order:
            line += (f"; {len(order)} summing in their own order ({', '.join(sorted({r.formulation for r in order}))}),"
                     f" within {max(r.ratio for r in order):.2g} of the order bound")
        return line + (f"; controls (operands not bf16-exact): {sum(not r.within_exact for r in ctl)}/{len(ctl)} "
                       f"outside the bound")


def _formulation_ran(site: Site) -> str:
    grid = (site.b if site.op == "grad_weight" else site.node).shape
    terms = site.b.shape[0] if site.op == "backward" else site.a.shape[1]
    return "patches" if conv.use_patches(grid[2] * grid[3], terms * site.kernel_size ** 2, site.kernel_size,
                                         site.formulation) else "conv"


@partial(jax.jit, compiler_options=rendered.QUICK)
def _typed_numbers(site: Site):
    """(f32 peer, typed kernel's accumulator in float64, the nets' bf16 kind, Σ|a||b| in float64) at
    the site's float32 operands."""
    a32, b32 = site.a, site.b
    kw = dict(stride=site.stride, formulation=site.formulation, out_shape=site.out_shape)
    a64, b64 = a32.astype(jnp.float64), b32.astype(jnp.float64)
    return (conv_apply(site.op, a32, b32, **kw), conv_apply(site.op, a64, b64, rnd=typed_operands, **kw),
            conv_apply(site.op, a32, b32, rnd=conv.bf16_operand, **kw),
            conv_apply(site.op, jnp.abs(a64), jnp.abs(b64), **kw))


def typed_row(site: Site, *, exact: bool = True) -> TypedRow:
    """One conv site run as the bf16-typed kernel and as its f32 peer at the same float32 operand
    values: bf16-exact ones (`exact`: rounded to bf16 first) or the site's own (the control)."""
    a32, b32 = (conv.round_bf16(v) if exact else v for v in (site.a.astype(jnp.float32), site.b.astype(jnp.float32)))
    peer, typed, kind, mag = (np.asarray(v) for v in _typed_numbers(replace(site, name="", a=a32, b=b32, bias=None)))
    n = contraction_length(site.op, site.a.shape, site.b.shape, site.kernel_size)
    ratio = _over(np.abs(typed - peer.astype(np.float64)), 2 * gamma(n, U_F32) * mag)
    exact_sum, exact_mag = exact_conv(site.op, a32, b32, stride=site.stride, kernel_size=site.kernel_size,
                                      out_shape=site.node.shape)
    bound = (gamma(n, U_F32) + gamma(n, 2.0 ** -53)) * exact_mag
    return TypedRow(site.name, site.op, _formulation_ran(site), n, exact, same_bits(typed.astype(np.float32), peer),
                    same_bits(kind, np.asarray(conv.round_bf16(jnp.asarray(peer)))),
                    int(np.sum(typed.astype(np.float32) != peer)), ratio,
                    _over(np.abs(typed - exact_sum), bound), _over(np.abs(peer.astype(np.float64) - exact_sum), bound))


def typed_erasure(sites: Sequence[Site], *, controls: bool = True) -> TypedReport:
    """Every site at bf16-exact operands (and, with `controls`, at its own operands). Needs float64:
    without it the typed operands would stay float32 and the comparison could not fail."""
    need_x64("typed_erasure")
    rows = [typed_row(s) for s in sites]
    if controls:
        rows += [typed_row(s, exact=False) for s in sites]
    return TypedReport(rows, jax.default_backend())


def with_formulation(sites: Sequence[Site], formulation: str) -> list[Site]:
    """The same sites pinned to one formulation ("conv" or "patches"); each name says which."""
    return [replace(s, name=f"{s.name} [{formulation}]", formulation=formulation) for s in sites]


# ---- selScatter against autodiff of a gather model written apart ---------------------------------

def _window_index(spec: maxpool.PoolSpec, ho: int, wo: int, sigma: np.ndarray):
    """Rows and columns (in the input, padding offset p) of the cell σ picks in each window."""
    kh, kw = sigma // spec.size, sigma % spec.size
    i = spec.stride * jnp.arange(ho)[:, None] + kh          # in the padded grid
    j = spec.stride * jnp.arange(wo)[None, :] + kw
    return i, j


def argmax_selection(x, spec: maxpool.PoolSpec) -> np.ndarray:
    """σ = argmax written here with NumPy: per window, the row-major index of its first maximal cell
    (windows read by index arithmetic from the −∞-padded input)."""
    x = np.asarray(x, np.float64)
    n, c, h, w = x.shape
    k, s, p = spec.size, spec.stride, spec.pad
    ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
    cells = np.stack([xp[:, :, kh:kh + s * ho:s, kw:kw + s * wo:s] for kh in range(k) for kw in range(k)], axis=-1)
    return np.argmax(cells, axis=-1)                      # np.argmax returns the first maximal index


def gather_model(x: jax.Array, sigma, spec: maxpool.PoolSpec) -> jax.Array:
    """y[n,c,i,j] = xpad[n,c, s·i + σ//k, s·j + σ%k]: the pool frozen at σ, by plain indexing (no
    code of `gradtie.ops.maxpool`). A σ that picks a padding cell reads 0 there."""
    p = spec.pad
    n, c, h, w = x.shape
    ho, wo = sigma.shape[2:]
    xp = jnp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    i, j = _window_index(spec, ho, wo, jnp.asarray(sigma))
    nn = np.arange(n)[:, None, None, None]
    cc = np.arange(c)[None, :, None, None]
    return xp[nn, cc, i, j]


@partial(jax.jit, static_argnums=3)
def _gather_vjp(x, dy, sigma, spec: maxpool.PoolSpec):
    """`reference.vjp` of the gather model at σ: at dy, and at |dy| (the magnitudes each cell sums)."""
    (want,) = reference.vjp(lambda a: gather_model(a, sigma, spec), x, cotangent=dy)
    (mag,) = reference.vjp(lambda a: gather_model(a, sigma, spec), x, cotangent=jnp.abs(dy))
    return want, mag


@dataclass(frozen=True)
class PoolTieRow:
    label: str               # "cifar8 pool1 (2×2/s2)" …
    rendered: str            # what ran on the rendered side: "pool backward", a control's name
    windows: int
    tied_windows: int        # windows whose maximum is attained more than once
    differing: int           # input cells whose bits differ from the gather model's VJP
    ratio: float             # max |diff| / (2·γ_3(2⁻⁵³)·Σ|terms|): overlapping windows add ≤ 4 terms

    @property
    def equal(self) -> bool:
        return self.differing == 0

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


def pool_vjp_tie(label: str, x, dy, spec: maxpool.PoolSpec, *, sigma=None, backward: Optional[Callable] = None,
                 rendered: str = "pool backward") -> PoolTieRow:
    """The pool backward at (x, dy) against `reference.vjp` of the gather model at σ (default: the
    argmax computed here). backward(saved, dy) -> dx: the rendered side (default: the kit's
    `pool_backward` at σ = argmax, `maxPoolBackB`). Where windows overlap (3×3/s2) a cell's
    cotangent is a sum of up to four, added in another order by autodiff's scatter: the row allows
    2·γ₃ of the sum of their magnitudes, and counts the cells whose bits differ."""
    x, dy = jnp.asarray(x, jnp.float64), jnp.asarray(dy, jnp.float64)
    sigma = argmax_selection(x, spec) if sigma is None else np.asarray(sigma)
    saved = maxpool.PoolSaved(x, spec)
    got = np.asarray(backward(saved, dy) if backward is not None else KIT.pool_backward(label, saved, dy))
    want, mag = (np.asarray(v) for v in _gather_vjp(x, dy, jnp.asarray(sigma), spec))
    ratio = _over(np.abs(got - want), 2 * gamma(3, 2.0 ** -53) * mag)
    win = np.asarray(maxpool.windows(np.asarray(x), spec))
    tied = int(np.sum(np.sum(win == win.max(-1, keepdims=True), axis=-1) > 1))
    return PoolTieRow(label, rendered, int(np.asarray(sigma).size), tied, int(np.sum(got != want)), ratio)


def shifted_selection(sigma, spec: maxpool.PoolSpec) -> np.ndarray:
    """σ moved one cell along each window's row (wrapping inside the window): the 'shifted cell' control."""
    kh, kw = np.divmod(np.asarray(sigma), spec.size)
    return kh * spec.size + (kw + 1) % spec.size


# ---- node ties at a non-twin tie: the step tie carries no smoothness clause ----------------------

@dataclass
class TieNodes:
    """At a point the census refuses: the per-stage ties of the chain (nodes and handed-on
    cotangents, each at the cotangent the chain hands the stage) and the census itself."""
    stages: stages.StageReport
    smooth: census.SmoothReport

    @property
    def nodes(self) -> list:
        return [r for t in self.stages.ties for r in t.nodes]

    def summary(self) -> str:
        return (f"{sum(r.ok for r in self.nodes)}/{len(self.nodes)} nodes tied to their stage's VJP at the "
                f"cotangent the chain hands it, {sum(t.ok for t in self.stages.ties)}/{len(self.stages.ties)} "
                f"stages; census: {'smooth' if self.smooth.ok else 'refused'} "
                f"({self.smooth.non_twin_ties} non-twin ties)")


def node_ties_at_tie(net, params, x, targets, cfg, *, label_smoothing: float = 0.0, chain: Optional[Chain] = None,
                     key=None) -> TieNodes:
    """Every stage of the rendered chain tied alone at the cotangent the chain hands it
    (`stages.stage_ties`: a pool window tied at a positive maximum is read frozen at σ = argmax, the
    selScatter the chain runs), together with the census of the point."""
    st = stages.stage_ties(Point.of(net, params, x, targets, cfg, label_smoothing=label_smoothing, key=key), chain=chain)
    return TieNodes(st, census.smoothness(net, params, x, cfg))


# ---- the eighteen-stage fold against the NumPy ResNet-34 -----------------------------------------

@dataclass(frozen=True)
class ForwardTie:
    label: str
    image: tuple             # x's shape
    ratio: float             # max |logits − NumPy logits| / limit: ≤ 1 is tied
    limit_max: float         # the largest limit (FORWARD_NET_SIGMAS·√2 × the NumPy envelope)
    err_max: float           # the largest |difference|

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


def fold(named: Sequence[tuple[str, Callable]], x, order: Optional[Sequence[str]] = None):
    """The logits of the stages composed in list order (or in `order`, by name)."""
    by_name = dict(named)
    for name in (order or [n for n, _ in named]):
        x = by_name[name](x)
    return x


@partial(jax.jit, static_argnums=(2, 3), compiler_options=rendered.QUICK)
def _fold_logits(params, x, cfg, order):
    return fold(resnet34.NET.stages(params, cfg), x, order)


def forward_tie(params, x, cfg, *, ops: rn.NumpyOps = rn.OPS, order: Optional[Sequence[str]] = None,
                label: str = "eighteen-stage fold", reference_forward=None) -> ForwardTie:
    """ResNet-34's eighteen stages (`resnet34.NET.stages`) folded (in `order`) against the NumPy forward
    (with `ops`) in float64, each logit within FORWARD_NET_SIGMAS·√2 standard deviations of the
    NumPy envelope (the two sides' round-off, independent). reference_forward: a NumPy `Forward`
    already computed with the real ops (its envelope is the limit's; the planted ops run without one)."""
    p64 = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
    logits = np.asarray(_fold_logits(p64, jnp.asarray(x, jnp.float64), cfg, None if order is None else tuple(order)))
    ref = reference_forward or rn.resnet34_forward(params, np.asarray(x, np.float64))
    want = ref.logits if ops is rn.OPS else rn.resnet34_forward(params, np.asarray(x, np.float64), ops=ops,
                                                                 envelope=False).logits
    limit = tol.FORWARD_NET_SIGMAS * np.sqrt(2.0) * ref.envelope
    diff = np.abs(logits - want)
    return ForwardTie(label, tuple(np.shape(x)), _over(diff, limit), float(limit.max()), float(diff.max()))


# ---- the head's exact zero -----------------------------------------------------------------------

def _exact_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in rational arithmetic, rounded once to float64 (float64 × float64 is exact as a Fraction)."""
    fa = [[Fraction(float(v)) for v in row] for row in a]
    fb = [[Fraction(float(v)) for v in row] for row in b.T]
    return np.array([[float(sum(x * y for x, y in zip(r, col))) for col in fb] for r in fa])


@dataclass(frozen=True)
class HeadRow:
    node: str                # "fc.weight", "fc.bias", "input" (the GAP input's cotangent)
    oracle_bits: int         # entries whose bits differ, rendered against the autodiff VJP
    rendered_ulps: float     # max |rendered − exact| / (γ_n(2⁻⁵³)·Σ|a||b|): ≤ 1 within the sum's bound
    oracle_ulps: float       # the same for the autodiff VJP
    reordered_bits: int      # entries whose bits differ, the reversed-order evaluation against the oracle
    reordered_ulps: float    # the reversed-order evaluation against the exact values
    control_ulps: float      # a planted head backward against the exact values (> 1: it fails)


@dataclass
class HeadExact:
    shape: tuple            # the GAP input [N,C,H,W]
    rows: list[HeadRow]
    control: str

    @property
    def ok(self) -> bool:
        return all(r.rendered_ulps <= 1 and r.oracle_ulps <= 1 and r.reordered_ulps <= 1 for r in self.rows)

    @property
    def control_fails(self) -> bool:
        return any(r.control_ulps > 1 for r in self.rows)


def _ratio(got, exact, mag, n: int) -> float:
    return _over(np.abs(np.asarray(got, np.float64) - exact), gamma(n, 2.0 ** -53) * mag)


def head_exact(params, h, dlogits, cfg, *, control: str = "gap_without_divisor") -> HeadExact:
    """ResNet-34's head (GAP → fc) backward at GAP input h [N,C,H,W] and cotangent dlogits [N,K],
    three ways against the exact values (rational arithmetic, rounded once): the rendered backward
    (`_head_backward` through the kit), its autodiff VJP (`gradtie.reference.vjp` of the head
    forward), and the same sums run in reversed order. Each within γ_n·Σ|a||b| of exact. The tie
    reads 0 where the rendered side and autodiff run the same float64 operations in the same order;
    the reversed evaluation shows the round-off that 0 hides. control "gap_without_divisor": the
    GAP backward without its 1/(H·W); "transposed": dx from dlogits @ Wᵀ's wrong side (W[:, ::-1])."""
    head_stage = resnet34.stage_list(cfg)[-1]
    hp = {k: jnp.asarray(params[k], jnp.float64) for k in head_stage.params}
    h, dz = jnp.asarray(h, jnp.float64), jnp.asarray(dlogits, jnp.float64)
    _, saved = head_stage.forward(hp, h, cfg, Pass())
    grads, dx = head_stage.backward(hp, saved, dz, cfg, KIT)
    og, odx = reference.vjp(lambda p, a: head_stage.forward(p, a, cfg, Pass())[0], hp, h, cotangent=dz)
    n, c, hh, ww = h.shape
    w = np.asarray(hp["fc.weight"])                                        # [K,C]
    g = np.asarray(saved.g)                                                # [N,C]: the GAP output
    dzn = np.asarray(dz)
    exact = {"fc.weight": _exact_matmul(dzn.T, g), "fc.bias": _exact_matmul(dzn.T, np.ones((n, 1)))[:, 0]}
    dg_exact = _exact_matmul(dzn, w)                                       # [N,C]
    exact["input"] = np.broadcast_to((dg_exact / (hh * ww))[:, :, None, None], h.shape)  # one more rounding
    mag = {"fc.weight": np.abs(dzn).T @ np.abs(g), "fc.bias": np.abs(dzn).sum(0),
           "input": np.broadcast_to(((np.abs(dzn) @ np.abs(w)) / (hh * ww))[:, :, None, None], h.shape)}
    terms = {"fc.weight": n, "fc.bias": n, "input": dzn.shape[1] + 1}     # + 1: the division by H·W
    # the same sums, their terms in reversed order
    rev = {"fc.weight": dzn[::-1].T @ g[::-1], "fc.bias": dzn[::-1].sum(0),
           "input": np.broadcast_to(((dzn[:, ::-1] @ w[::-1]) / (hh * ww))[:, :, None, None], h.shape)}
    wrong_dx = (np.broadcast_to((dzn @ w)[:, :, None, None], h.shape) if control == "gap_without_divisor"
                else np.broadcast_to(((dzn @ w[:, ::-1]) / (hh * ww))[:, :, None, None], h.shape))
    got = {**{k: np.asarray(grads[k]) for k in grads}, "input": np.asarray(dx)}
    ora = {**{k: np.asarray(og[k]) for k in og}, "input": np.asarray(odx)}
    rows = []
    for k in ("fc.weight", "fc.bias", "input"):
        wrong = wrong_dx if k == "input" else got[k]
        rows.append(HeadRow(k, int(np.sum(got[k] != ora[k])), _ratio(got[k], exact[k], mag[k], terms[k]),
                            _ratio(ora[k], exact[k], mag[k], terms[k]), int(np.sum(rev[k] != ora[k])),
                            _ratio(rev[k], exact[k], mag[k], terms[k]), _ratio(wrong, exact[k], mag[k], terms[k])))
    return HeadExact(tuple(h.shape), rows, control)


# ---- other block maps between ResNet-34's stem and head ------------------------------------------

def _identity_stage(name: str) -> Stage:
    return Stage(name, "identity map", lambda p, x, cfg, how: (x, ()), lambda p, s, dy, cfg, kit: ({}, dy), ())


def _scaled_residual_stage(name: str, width: int, kernel_size: int, alpha: float, *, forget_alpha: bool = False):
    """y = x + α·conv(x; W) (k×k, stride 1, no bias), with its VJP written by hand:
    dx = dy + α·convBack(W; dy), dW = α·convWeightGrad(x; dy). forget_alpha: the planted VJP whose
    input cotangent drops α (dx = dy + convBack(W; dy))."""
    wname = f"{name}.conv.weight"

    def forward(p, x, cfg, how):
        y, saved = conv.forward(x, p[wname])
        return x + alpha * y, saved

    def backward(p, saved, dy, cfg, kit):
        dc = conv.backward(p[wname], dy, input_shape=saved.x.shape)
        dw = conv.grad_weight(saved.x, dy, kernel_size=kernel_size)
        return {wname: alpha * dw}, dy + (dc if forget_alpha else alpha * dc)

    spec = ParamSpec(wname, (width, width, kernel_size, kernel_size), "conv")
    return Stage(name, "scaled residual", forward, backward, (wname,)), spec


@dataclass(frozen=True)
class Slot:
    """One of the sixteen block slots: "identity", ("residual", width, kernel, α), or a stage of
    another net (its Stage, its Config, its ParamSpecs) — wrapped to run at that net's Config."""
    kind: str
    stage: Optional[Stage] = None
    specs: tuple = ()


def identity_slot() -> Slot:
    return Slot("identity")


def residual_slot(width: int, kernel_size: int = 3, alpha: float = 0.5, *, forget_alpha: bool = False) -> Slot:
    return Slot(f"residual:{width}:{kernel_size}:{alpha}:{int(forget_alpha)}")


def foreign_slot(net: Net, cfg, stage_name: str) -> Slot:
    """A stage of another net (e.g. a bottleneck block of examples/bottleneck.py), run at its own cfg."""
    st = next(s for s in net.stage_list(cfg) if s.name == stage_name)
    specs = tuple(s for s in net.param_specs(cfg) if s.name in st.params)
    wrapped = Stage(st.name, f"{net.name}'s {st.name}", lambda p, x, _cfg, how: st.forward(p, x, cfg, how),
                    lambda p, s, dy, _cfg, kit: st.backward(p, s, dy, cfg, kit), st.params, st.relu_inputs,
                    st.pool_inputs, st.bn_layers)
    return Slot("foreign", wrapped, specs)


def stem_head_net(slots: Sequence[Slot], name: str = "ResNet-34 stem and head, other blocks") -> Net:
    """ResNet-34's certified stem (conv 7×7/s2, BN, ReLU, 3×3/s2 pool) and head (GAP, fc) around
    the sixteen slots b1 … b16 in order, each a map with its own hand-written VJP."""
    if len(slots) != 16:
        raise ValueError(f"stem_head_net: r34InputGradB_correct has sixteen block slots, got {len(slots)}")
    built, specs = [], []
    for i, slot in enumerate(slots, start=1):
        if slot.kind == "identity":
            built.append(_identity_stage(f"b{i}"))
        elif slot.kind.startswith("residual:"):
            _, width, k, alpha, forget = slot.kind.split(":")
            st, spec = _scaled_residual_stage(f"b{i}", int(width), int(k), float(alpha), forget_alpha=forget == "1")
            built.append(st)
            specs.append(spec)
        else:
            built.append(slot.stage)
            specs += list(slot.specs)
    r34 = resnet34.stage_list(resnet34.Config())
    stem, head = r34[0], r34[-1]

    def param_specs(cfg):
        full = resnet34.param_specs(cfg)
        return ([s for s in full if s.name in stem.params] + specs + [s for s in full if s.name in head.params])

    def stage_list(cfg):
        r = resnet34.stage_list(cfg)
        return [r[0], *built, r[-1]]

    return Net(name, resnet34.Config, param_specs, stage_list, resnet34.POOLS, resnet34.POOL_PREACTIVATIONS,
               size_rule=resnet34.NET.size_rule, size_ok=resnet34.NET.size_ok, default_size=32)


@dataclass
class BlocksTie:
    net: str
    slots: list[str]         # each slot's stage kind, b1 … b16
    report: TieReport
    point: Any               # the oracle's point (shared with a control)

    @property
    def ok(self) -> bool:
        return self.report.ok


def other_blocks(net: Net, params, x, targets, cfg, *, label_smoothing: float = 0.0, rendered_net: Optional[Net] = None,
                 point=None, key=None) -> BlocksTie:
    """The whole-net tie (`checks.tie.tie`: every node and the input cotangent against `jax.vjp` of
    the composed forward, within the point's measured envelope) of a `stem_head_net`. rendered_net:
    the chain of another `stem_head_net` with the same forward (a block whose VJP is planted wrong)
    tied to this one's oracle; point: a `reference_at` point to share."""
    chain = None if rendered_net is None else Chain(rendered_net)
    if point is None:
        point = reference_at(net, params, x, targets, cfg, label_smoothing=label_smoothing, key=key)
    rep = tie(point, chain, how="quick")
    return BlocksTie((rendered_net or net).name, [s.kind for s in (rendered_net or net).stage_list(cfg)[1:-1]], rep,
                     point)


# ---- cifar8's input gradient at every N, inside MaxPool2Smooth ----------------------------------

@dataclass(frozen=True)
class InputRow:
    n: int
    point: str               # "randn, β lifted", "photos" …
    holds: bool              # MaxPool2Smooth (the census's cifar8 input hypothesis)
    first: str               # the first violation when it fails
    report: Optional[TieReport]   # None: not judged (the hypothesis fails)

    @property
    def verdict(self) -> str:
        if self.report is None:
            return "not judged"
        return "tied" if self.report.row("input").ok and self.report.ok else "FAILED"


def input_row(net, params, x, targets, cfg, *, point: str, label_smoothing: float = 0.0, chain=None,
              key=None) -> InputRow:
    """The census at (params, x); where cifar8's input hypothesis holds, the whole tie (input row
    and nodes); where it fails, no verdict: the statement says nothing there."""
    smooth = census.smoothness(net, params, x, cfg)
    h = smooth.hypothesis(census.C8_INPUT)
    if not h.holds:
        return InputRow(int(x.shape[0]), point, False, h.first.describe() if h.first else "", None)
    rep = tie(Point.of(net, params, x, targets, cfg, label_smoothing=label_smoothing, key=key), chain)
    return InputRow(int(x.shape[0]), point, True, "", rep)


def input_sweep(net, params, cfg, images: Callable[[int], jax.Array], ns: Sequence[int], *,
                label_smoothing: float = 0.0, key=None) -> list[InputRow]:
    """At each N: images(N), the pool-feeding β lifted at that batch (`census.lift_dead_windows`, so
    no window is dead), the census, and the tie where `MaxPool2Smooth` holds."""
    rows = []
    for n in ns:
        x = images(n)
        lifted = census.lift_dead_windows(net, params, x, cfg)
        t = targets_matrix((jnp.arange(n) * 3 + 1) % cfg.num_classes, cfg.num_classes, x.dtype)
        rows.append(input_row(net, lifted, x, t, cfg, point="randn, β lifted", label_smoothing=label_smoothing,
                              key=key))
    return rows
