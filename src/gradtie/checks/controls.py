"""Must-fail controls: the real nets with one planted bug each, which the tie must catch.

A check that passes is only worth as much as the bugs it is seen to catch (SPEC §6). Each control
below is a net-like `Control`: the real net's forward, and a rendered side with one thing wrong,
named for what it breaks. The kernels carry no switch for it: a control either composes the head
cotangent itself (with one kit op wrong), relabels the nodes the real chain returns, or swaps the
one function the real net calls (`patches`) while its backward is traced.

| control                   | what is planted                                                  |
|---------------------------|------------------------------------------------------------------|
| `swap_gamma_beta`         | every BN layer hands back dγ as dβ and dβ as dγ                  |
| `drop_batch_divisor`      | the cotangent at the logits skips `divConstB` (÷N)               |
| `smoothing_wrong_k`       | `shiftB` subtracts α/(K−1) instead of α/K                         |
| `pool2x2_backward_on_3x3` | ResNet-34's 3×3/s2 stem pool routed by the 2×2 pool backward     |
| `same_padding_strided`    | strided conv backward and weight grad padded as XLA's 'SAME'     |
| `non_twin_tie`            | a point, not a bug: centre-tap convs on flat images (census)     |

`run` ties each control at one point against one shared oracle and reports, per control, whether
the tie went red and the first node that breaks in backward order, with the first β row: dβ = Σ dy
has no weight in the way, so it traces where the cotangent itself first goes wrong. Shown in:
Whole-net tie.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp
from jax import lax

from ..nets import stages
from ..ops import conv, head, maxpool
from . import census
from .tie import NodeRow, TieReport, net_label, reference_at, targets_matrix, tie

Patch = tuple[Any, str, Callable]   # (module, attribute, replacement) while the backward is traced


@dataclass(frozen=True, eq=False)
class Control:
    """A net-like object: `real_net`'s forward, and a rendered side with one planted bug.

    The tie kit reads `forward`, `backward`, `head_cotangent` and `real_net` (the oracle always
    differentiates the real forward); everything else (Config, init, POOLS, preactivations …) is the
    real net's. Hashed by identity, so a compiled backward is never shared with the real net's
    unless nothing is planted in it.
    """
    name: str
    real_net: Any
    breaks: str                                         # one line: what is wrong
    head_cotangent: Callable = head.cotangent           # (logits, targets, α) -> dlogits
    patches: tuple[Patch, ...] = ()
    relabel: Optional[Callable[[dict], dict]] = None    # applied to the nodes the real chain returns
    needs_smoothing: bool = False                       # plants nothing at α = 0
    # patches that need the parameters (a planted node reading γ and β): params -> patches
    patch_factory: Optional[Callable[[dict], tuple[Patch, ...]]] = None
    # the saved record as the planted backward reads it (a mask read from the wrong tensor)
    saved_transform: Optional[Callable[[dict], dict]] = None

    @property
    def label(self) -> str:
        return f"{net_label(self.real_net)} + {self.name}"

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(object.__getattribute__(self, "real_net"), attr)

    def forward(self, params, x, cfg, **kwargs):
        return self.real_net.forward(params, x, cfg, **kwargs)

    @property
    def backward(self) -> Callable:
        """The real net's backward itself when nothing is planted in it (so its compiled code is
        shared), else the real backward traced under `patches`, its nodes relabelled."""
        if not self.patches and self.relabel is None and self.patch_factory is None and self.saved_transform is None:
            return self.real_net.backward
        return self._planted_backward

    def _planted_backward(self, params, saved, dlogits, cfg):
        patches = self.patches + (self.patch_factory(params) if self.patch_factory else ())
        if self.saved_transform is not None:
            saved = self.saved_transform(saved)
        with planted(patches):
            grads, dx = self.real_net.backward(params, saved, dlogits, cfg)
        return (grads if self.relabel is None else self.relabel(grads)), dx


@contextlib.contextmanager
def planted(patches: Sequence[Patch]):
    """Swap each module attribute for its replacement, and back, whatever happens inside."""
    originals = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    try:
        for module, attr, replacement in patches:
            setattr(module, attr, replacement)
        yield
    finally:
        for module, attr, original in reversed(originals):
            setattr(module, attr, original)


def _check_net(control: str, net, nets: Sequence[str], why: str) -> None:
    if net_label(net) not in nets:
        raise ValueError(f"{control}: applies to {', '.join(nets)} only ({why}), got {net_label(net)}")


# ---- γ ↔ β -------------------------------------------------------------------------------------

def _swapped_gamma_beta(grads: dict) -> dict:
    shapes = {name: tuple(g.shape) for name, g in grads.items()}
    out = dict(grads)
    for name in grads:
        if name.endswith(".bias") and len(shapes.get(name[:-len("bias")] + "weight", ())) == 1:
            gamma = name[:-len("bias")] + "weight"
            out[gamma], out[name] = grads[name], grads[gamma]
    return out


def swap_gamma_beta(net) -> Control:
    """Every BN layer's dγ handed back as its dβ and dβ as dγ (the same shape [C]: nothing complains)."""
    return Control("swap_gamma_beta", net, "every BN layer's dγ and dβ swapped",
                   relabel=_swapped_gamma_beta)


# ---- the head cotangent: the six kit ops with one wrong ------------------------------------------

def _cotangent_without_divisor(logits, targets, alpha: float = 0.0):
    head.check_targets("drop_batch_divisor", logits, targets)
    n, k = logits.shape
    p = head.softmax_row(logits)
    d1 = head.add(head.sub(p, targets), head.scale(alpha, targets))
    return head.shift(d1, alpha / k)            # planted: divConstB (÷N) left out


def drop_batch_divisor(net) -> Control:
    """dy = p − t̃ instead of (p − t̃)/N: every node N times too large (invisible at N = 1)."""
    return Control("drop_batch_divisor", net, "the cotangent at the logits not divided by N",
                   head_cotangent=_cotangent_without_divisor)


def _cotangent_wrong_k(logits, targets, alpha: float = 0.0):
    head.check_targets("smoothing_wrong_k", logits, targets)
    n, k = logits.shape
    p = head.softmax_row(logits)
    d1 = head.add(head.sub(p, targets), head.scale(alpha, targets))
    d2 = head.shift(d1, alpha / (k - 1))        # planted: α spread over the K−1 other classes
    return head.div_const(d2, n)


def smoothing_wrong_k(net) -> Control:
    """α/(K−1) in place of α/K: the smoothed target no longer sums to 1, every row of dy is shifted."""
    return Control("smoothing_wrong_k", net, "α/K computed with K−1 classes",
                   head_cotangent=_cotangent_wrong_k, needs_smoothing=True)


# ---- ResNet-34's stem pool routed by the 2×2 backward ------------------------------------------

def _pool2x2_backward(spec, r, sigma, dy):
    # planted: whatever the forward pooled, route as the 2×2/s2 pool (windows rows 2i, 2i+1)
    return stages.pool_backward(maxpool.POOL2, r, sigma, dy)


def pool2x2_backward_on_3x3(net) -> Control:
    """The 3×3/s2 pad-1 stem pool's cotangent routed by the 2×2/s2 pool backward: same shapes
    (H/2 windows either way on even H), different windows, no accumulation over overlaps."""
    _check_net("pool2x2_backward_on_3x3", net, ("resnet34",), "cifar8's pools are 2×2 already")
    return Control("pool2x2_backward_on_3x3", net, "the 3×3/s2 stem pool routed by the 2×2 backward",
                   patches=((net, "pool_backward", _pool2x2_backward),))


# ---- 'SAME' padding on strided convs ----------------------------------------------------------

def same_pads(size: int, kernel_size: int, stride: int) -> tuple[int, int]:
    """XLA's 'SAME': ⌈size/s⌉ outputs, total padding max((out−1)·s + k − size, 0), the odd cell on
    the high side. On even sizes at s = 2: (0, 1) for k = 3 and (2, 3) for k = 7 where PyTorch pads
    (1, 1) and (3, 3); (0, 0) for 1×1 either way."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel_size - size, 0)
    return total // 2, total - total // 2


def _acc(dtype):
    return jnp.float32 if jnp.dtype(dtype) == jnp.bfloat16 else dtype


def _same_input_backward(real: Callable) -> Callable:
    def backward(weight, dy, *, input_shape, stride=1, rnd=None):
        if stride == 1:
            return real(weight, dy, input_shape=input_shape, stride=stride, rnd=rnd)
        rnd_ = rnd or conv.identity
        n, c, h, w = input_shape
        k = weight.shape[2]
        (top, _), (left, _) = same_pads(h, k, stride), same_pads(w, k, stride)
        dyup = conv.upsample(rnd_(dy), stride)
        flipped = jnp.swapaxes(rnd_(weight)[:, :, ::-1, ::-1], 0, 1)
        pads = ((k - 1 - top, h + top - dyup.shape[2]), (k - 1 - left, w + left - dyup.shape[3]))
        dx = lax.conv_general_dilated(dyup, flipped, (1, 1), pads, dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                      precision=lax.Precision.HIGHEST, preferred_element_type=_acc(dy.dtype))
        return rnd_(dx).astype(dy.dtype)
    return backward


def _same_grad_weight(real: Callable) -> Callable:
    def grad_weight(x, dy, *, kernel_size, stride=1, rnd=None):
        if stride == 1:
            return real(x, dy, kernel_size=kernel_size, stride=stride, rnd=rnd)
        rnd_ = rnd or conv.identity
        pads = (same_pads(x.shape[2], kernel_size, stride), same_pads(x.shape[3], kernel_size, stride))
        dw = lax.conv_general_dilated(rnd_(x), rnd_(dy), (1, 1), pads, rhs_dilation=(stride, stride),
                                      dimension_numbers=("CNHW", "IOHW", "CNHW"),
                                      precision=lax.Precision.HIGHEST, preferred_element_type=_acc(x.dtype))
        return rnd_(dw[:, :, :kernel_size, :kernel_size]).astype(x.dtype)
    return grad_weight


def same_padding_strided(net) -> Control:
    """Every strided conv's input backward and weight gradient computed for XLA 'SAME' padding
    (the forward keeps PyTorch's symmetric padding): the 7×7/s2 stem and the 3×3/s2 conv1 of each
    downsample block read windows one cell off; the 1×1/s2 projections are unaffected."""
    _check_net("same_padding_strided", net, ("resnet34",), "cifar8 has no strided conv")
    return Control("same_padding_strided", net, "'SAME' padding in the backward of strided convs",
                   patches=((conv, "backward", _same_input_backward(conv.backward)),
                            (conv, "grad_weight", _same_grad_weight(conv.grad_weight))))


CONTROLS: dict[str, Callable] = {
    "swap_gamma_beta": swap_gamma_beta,
    "drop_batch_divisor": drop_batch_divisor,
    "smoothing_wrong_k": smoothing_wrong_k,
    "pool2x2_backward_on_3x3": pool2x2_backward_on_3x3,
    "same_padding_strided": same_padding_strided,
}


def applicable(net) -> list[Control]:
    """Every planted-bug control that plants something in `net`."""
    out = []
    for make in CONTROLS.values():
        try:
            out.append(make(net))
        except ValueError:
            pass
    return out


# ---- reports -----------------------------------------------------------------------------------

@dataclass
class ControlResult:
    name: str
    net: str
    breaks: str
    report: TieReport
    smooth: Optional[Any] = None      # the census, for the non-twin tie point

    @property
    def red(self) -> bool:
        """The tie does not pass: a node fails, or round-off at the point moves the oracle so far that
        nothing can be told apart (at a constructed non-smooth point ulp nudges flip the routing); and
        there the census refuses the point too."""
        undecided = not self.report.ok or bool(self.report.ill_conditioned)
        if self.smooth is not None:
            return not self.smooth.ok and undecided
        return undecided

    @property
    def first(self) -> Optional[NodeRow]:
        return self.report.first_failure()

    @property
    def first_beta(self) -> Optional[NodeRow]:
        return self.report.first_beta_failure()

    @property
    def failed(self) -> int:
        return len(self.report.failed)

    def summary(self) -> str:
        if not self.red:
            return f"{self.name} on {self.net}: NOT red"
        first = self.first
        beta = self.first_beta
        line = (f"{self.name} on {self.net}: red, {self.failed}/{len(self.report.rows)} rows fail; "
                f"first in backward order: {first.name}")
        if beta is not None:
            line += f"; first β row: {beta.name} ({beta.bad}/{beta.shape[0]} channels)"
        if self.smooth is not None:
            line += f"; census: {self.smooth.summary().split(';')[0]}"
        return line


def format_table(results: Sequence[ControlResult]) -> str:
    """One line per control: red or not, rows failing, the first node and the first β row to break."""
    head_ = (f"{'control':<24} {'net':<9} {'red':<4} {'failing':>8}  {'first node (backward order)':<30} "
             f"{'first β row':<28} {'channels':>8}")
    lines = [head_, "-" * len(head_)]
    for r in results:
        first, beta = r.first, r.first_beta
        lines.append(f"{r.name:<24} {r.net:<9} {'yes' if r.red else 'NO':<4} "
                     f"{f'{r.failed}/{len(r.report.rows)}':>8}  {first.name if first else '-':<30} "
                     f"{beta.name if beta else '-':<28} "
                     f"{f'{beta.bad}/{beta.shape[0]}' if beta else '-':>8}")
    return "\n".join(lines)


@dataclass
class ControlReport:
    net: str
    real: TieReport                   # the real chain at the same point: it must tie
    results: list[ControlResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The real chain ties and every control goes red."""
        return self.real.ok and all(r.red for r in self.results)

    def __getitem__(self, name: str) -> ControlResult:
        return next(r for r in self.results if r.name == name)

    def summary(self) -> str:
        red = sum(r.red for r in self.results)
        return (f"{self.net}: real chain {'tied' if self.real.ok else 'FAILED'}; "
                f"{red}/{len(self.results)} controls red")

    def table(self) -> str:
        return format_table(self.results)

    def as_dict(self) -> dict[str, Any]:
        return {"net": self.net, "ok": self.ok, "real": self.real.as_dict(),
                "controls": [{"name": r.name, "breaks": r.breaks, "red": r.red,
                              "first": r.first.name if r.first else None,
                              "first_beta": r.first_beta.name if r.first_beta else None,
                              "tie": r.report.as_dict()} for r in self.results]}


def run(net, params, x, targets, cfg, *, label_smoothing: float = 0.1,
        controls: Optional[Sequence[Control]] = None) -> ControlReport:
    """Tie the real chain and every control at (params, x) against one oracle evaluation.

    label_smoothing must be > 0 for `smoothing_wrong_k` to plant anything, and the batch > 1 for
    `drop_batch_divisor`; a control that would plant nothing is an error, never a silent green.
    """
    controls = applicable(net) if controls is None else list(controls)
    for c in controls:
        if c.needs_smoothing and label_smoothing == 0:
            raise ValueError(f"{c.name} plants nothing at label_smoothing = 0; use α > 0 (e.g. 0.1)")
        if c.name == "drop_batch_divisor" and x.shape[0] == 1:
            raise ValueError("drop_batch_divisor plants nothing at batch 1 (÷1 is the identity)")
    t = targets_matrix(targets, cfg.num_classes, x.dtype)
    point = reference_at(net, params, x, t, cfg, label_smoothing=label_smoothing)
    real = tie(net, params, x, t, cfg, label_smoothing=label_smoothing, point=point)
    results = [ControlResult(c.name, net_label(net), c.breaks,
                             tie(c, params, x, t, cfg, label_smoothing=label_smoothing, point=point))
               for c in controls]
    return ControlReport(net_label(net), real, results)


def non_twin_tie(net, params, x_flat, targets, cfg, *, label_smoothing: float = 0.0) -> ControlResult:
    """The non-twin tie control: the convs before the first pool reduced to their centre tap
    (`census.planted_tie`) on flat images. Cells that share a pixel but not a receptive field now
    tie; the census must refuse the point, and the two derivatives disagree there (the rendered
    pool routes a tie to its first cell, autodiff of the max splits it evenly). The gather model's
    input gradient is the derivative at twin ties only, so here the input row is tied to the real
    net's autodiff: on flat images the parameter rows agree either way (tied cells see equal
    patches), and the input row is where the routing shows."""
    point = census.planted_tie(net, params)
    smooth = census.smoothness(net, point, x_flat, cfg)
    report = tie(net, point, x_flat, targets, cfg, label_smoothing=label_smoothing, freeze_ties=False)
    return ControlResult("non_twin_tie", net_label(net), "a non-twin tie point (centre-tap convs, flat images)",
                         report, smooth)
