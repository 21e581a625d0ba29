"""Head fold: the six kit ops step by step, their tie to autodiff, planted head bugs, the smoothed
loss's minimum, and the linear head (GAP + dense) tied to its oracle.

The fold (ResNet34RenderB's six kit ops): p = softmaxRow(z); d0 = p − t; a = α·t; d1 = d0 + a; d2 = d1 − α/K;
dy = d2 / N, i.e. dy = (p − t̃)/N with t̃ = (1−α)t + α/K. It is ∂/∂z of the mean smoothed
cross-entropy when every row of t sums to 1. The oracle is `gradtie.reference` (autodiff of the
loss written as users write it); nothing here borrows the fold to build the oracle.

Functions return reports and print nothing. Shown in: Head fold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import data, prng, reference
from .. import tolerances as tol
from ..ops import dense, gap, head
from .tie import Limit, NodeRow, TieReport, compare

# ---- the fold, step by step ---------------------------------------------------------------------

@dataclass
class FoldSteps:
    """Every intermediate of the fold for one batch: arrays [N,K]."""
    alpha: float
    targets: np.ndarray
    p: np.ndarray     # softmaxRow(z)
    d0: np.ndarray    # subB: p − t
    a: np.ndarray     # scaleB: α·t
    d1: np.ndarray    # addVB: d0 + a
    d2: np.ndarray    # shiftB: d1 − α/K
    dy: np.ndarray    # divConstB: d2 / N
    n: int            # the batch N
    k: int            # the classes K

    def table(self, example: int = 0, decimals: int = 4) -> str:
        """One line per op: its Lean name, formula and the row of `example`, rounded."""
        lines = [f"example {example}, N = {self.n}, K = {self.k}, α = {self.alpha:g}",
                 f"{'t':<11} {'':<15} " + " ".join(f"{v:{decimals + 4}.{decimals}f}" for v in self.targets[example])]
        for name, formula, value in [("softmaxRow", "p = softmax(z)", self.p), ("subB", "d0 = p − t", self.d0),
                                     ("scaleB", "a = α·t", self.a), ("addVB", "d1 = d0 + a", self.d1),
                                     ("shiftB", "d2 = d1 − α/K", self.d2), ("divConstB", "dy = d2 / N", self.dy)]:
            row = " ".join(f"{v + 0.0:{decimals + 4}.{decimals}f}" for v in value[example])
            lines.append(f"{name:<11} {formula:<15} {row}")
        return "\n".join(lines)

    @property
    def inexact_divisions(self) -> int:
        """Entries where the true division d2/N differs from d2·(1/N), 1/N rounded first (0 when N
        is a power of two): why the render divides (`divConstB`) rather than multiplying."""
        return int(np.sum(self.d2 / self.n != self.d2 * (1.0 / self.n)))


def fold_steps(logits, targets, alpha: float = 0.0) -> FoldSteps:
    """The render's own six kit ops (`gradtie.ops.head.fold`) with every intermediate. Unlike
    `head.cotangent` it does not check the row sums, so the hypothesis can be tested too."""
    logits, targets = jnp.asarray(logits), jnp.asarray(targets)
    steps = (np.asarray(v) for v in (targets, *head.fold(logits, targets, alpha)))
    return FoldSteps(float(alpha), *steps, *map(int, logits.shape))


# ---- planted bugs: each breaks one step of the fold ---------------------------------------------

def smoothing_wrong_k(logits, targets, alpha: float = 0.0):
    """α/K with K read off the batch axis (N) instead of the class axis: the shift is α/N. Invisible
    when N = K or α = 0."""
    n = len(logits)
    return head.div_const(head.shift(jnp.asarray(fold_steps(logits, targets, alpha).d1), alpha / n), n)


def drop_batch_divisor(logits, targets, alpha: float = 0.0):
    """The 1/N dropped: dy = d2, the gradient of the SUM over the batch, N times too large."""
    return jnp.asarray(fold_steps(logits, targets, alpha).d2)


def smoothing_twice(logits, targets, alpha: float = 0.0):
    """t̃ built first and then smoothed again by the fold: (p − t̃̃)/N. Invisible at α = 0."""
    return jnp.asarray(fold_steps(logits, head.smoothed(jnp.asarray(targets), alpha), alpha).dy)


CONTROLS: dict[str, Callable] = {f.__name__: f for f in (smoothing_wrong_k, drop_batch_divisor, smoothing_twice)}


# ---- the tie ------------------------------------------------------------------------------------

class HeadTies(TieReport):
    """Head ties, one `tie.compare` row per case at a fixed limit (no envelope: the fold's six
    roundings sit far below it)."""

    def summary(self) -> str:
        """Counts and the limit only: stable to print."""
        failed = [r.name for r in self.rows if not r.ok]
        line = f"tied {len(self.rows) - len(failed)}/{len(self.rows)} at rel err ≤ {self.rows[0].limit:.0e}"
        return line + (f"; red: {', '.join(failed)}" if failed else "")


def _row(label: str, got, oracle, limit: float = tol.REL_F64) -> NodeRow:
    """max |got − oracle| relative to max |oracle| (to 1 where the oracle is 0), held to `limit`."""
    return compare({label: got}, {label: oracle}, limit=Limit(floor=limit))[0]


def _ties(rows: list[NodeRow], **meta) -> HeadTies:
    return HeadTies("head", "float64", rows, 0.0, 0.0, meta)


def tie_fold(logits, targets, alpha: float = 0.0, *, fold: Optional[Callable] = None, label: str = "",
             limit: float = tol.REL_F64) -> NodeRow:
    """The fold (or a planted bug) against ∂/∂z of the mean smoothed cross-entropy by autodiff."""
    dy = fold(logits, targets, alpha) if fold else fold_steps(logits, targets, alpha).dy
    return _row(label, dy, reference.head_cotangent(jnp.asarray(logits), jnp.asarray(targets), alpha), limit)


def tie_plain(logits, labels, *, limit: float = tol.REL_F64) -> NodeRow:
    """The fold at α = 0 with one-hot rows against autodiff of plain cross-entropy on int labels."""
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    dy = fold_steps(logits, head.one_hot(labels, logits.shape[1], logits.dtype), 0.0).dy
    _, oracle = reference.value_and_grad(reference.plain_cross_entropy)(logits, labels)
    return _row("α=0 vs plain cross-entropy", dy, oracle, limit)


def refusal(logits, targets, alpha: float = 0.0) -> str:
    """The error `head.cotangent` raises for these targets ("" when it accepts them)."""
    try:
        head.cotangent(jnp.asarray(logits), jnp.asarray(targets), alpha)
    except ValueError as err:
        return str(err)
    return ""


def fold_cases(key, *, alphas: Sequence[float] = (0.0, 0.1), batches: Sequence[int] = (3, 6),
               kinds: Sequence[str] = data.TARGET_KINDS, num_classes: int = 10,
               logit_scale: float = 3.0) -> HeadTies:
    """The fold tied to autodiff for every (α, N, target kind): random logits N(0, scale²)."""
    ties = []
    for i, (alpha, n, kind) in enumerate((a, n, k) for a in alphas for n in batches for k in kinds):
        kz, kt = jax.random.split(jax.random.fold_in(key, i))
        z = logit_scale * prng.normal(kz, (n, num_classes), jnp.float64)
        t = data.batch_targets(kind, n, num_classes, kt)
        ties.append(tie_fold(z, t, alpha, label=f"α={alpha:g} N={n} {kind}"))
    return _ties(ties)


def control_cases(logits, targets, alpha: float) -> HeadTies:
    """The fold and each planted bug, tied to autodiff at the same batch."""
    return _ties([tie_fold(logits, targets, alpha, label="fold (six kit ops)")] +
                 [tie_fold(logits, targets, alpha, fold=f, label=name) for name, f in CONTROLS.items()])


# ---- the minimum of the smoothed loss -----------------------------------------------------------

def smoothed_entropy(num_classes: int, alpha: float) -> float:
    """H(t̃) for a one-hot t: t̃ = 1 − α + α/K on the label, α/K elsewhere (0·log 0 = 0)."""
    t = np.full(num_classes, alpha / num_classes)
    t[0] += 1 - alpha
    t = t[t > 0]
    return float(-np.sum(t * np.log(t)))


class EntropyTerms(NamedTuple):
    """H(t̃) for a one-hot t, split into the label's term and the other K − 1 classes' terms."""
    num_classes: int
    alpha: float
    label_share: float      # t̃ on the label: 1 − α + α/K
    other_share: float      # t̃ on each other class: α/K
    label_term: float       # −t̃_label·ln t̃_label
    others_term: float      # −(K − 1)·(α/K)·ln(α/K)
    total: float            # their sum, H(t̃)
    best_margin: float      # the logit margin where p = t̃: ln(t̃_label / t̃_other)


def entropy_terms(num_classes: int = 10, alpha: float = 0.1) -> EntropyTerms:
    """The two terms of H(t̃) = −t̃_label ln t̃_label − (K − 1)·(α/K)·ln(α/K), for 0 < α ≤ 1."""
    if not 0.0 < alpha <= 1.0 or num_classes < 2:
        raise ValueError(f"entropy_terms: expected 0 < alpha <= 1 and num_classes >= 2, got {alpha!r}, {num_classes!r}")
    top, rest = 1 - alpha + alpha / num_classes, alpha / num_classes
    label_term, others_term = float(-top * np.log(top)), float(-(num_classes - 1) * rest * np.log(rest))
    return EntropyTerms(num_classes, float(alpha), top, rest, label_term, others_term, label_term + others_term,
                        float(np.log(top / rest)))


@dataclass
class MarginCurve:
    """The smoothed loss of one example along logits z = m·e_label (the logit margin m)."""
    num_classes: int
    alpha: float
    margins: np.ndarray
    losses: np.ndarray
    entropy: float          # H(t̃), the minimum in ℝ (loss = H(t̃) + KL(t̃ ‖ p))
    at_log_target: float    # the loss at z = log t̃, where p = t̃
    best_margin: float      # the margin minimising the loss: log((1 − α + α/K)/(α/K))
    descent: float          # the loss after gradient descent on all K logits with the kit fold
    minimum: float          # the smallest loss on the margin grid

    @property
    def ok(self) -> bool:
        """H(t̃) is the minimum: reached at z = log t̃ and by descent (to float64 round-off), and no
        margin on the grid goes below it."""
        rel = tol.REL_F64 * self.entropy
        return bool(abs(self.at_log_target - self.entropy) <= rel and abs(self.descent - self.entropy) <= rel
                    and self.minimum >= self.entropy - rel)


def margin_curve(num_classes: int = 10, alpha: float = 0.1, *, margins: Optional[np.ndarray] = None,
                 descent_steps: int = 2000, lr: float = 5.0) -> MarginCurve:
    """Loss vs margin, H(t̃), the loss at z = log t̃, and a numerical minimum by gradient descent
    from z = 0 along the fold's own cotangent (one example, so dy = p − t̃). Needs 0 < α: at α = 0
    the infimum 0 is approached as the margin grows but never attained."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"margin_curve: alpha must lie in (0, 1], got {alpha!r}")
    margins = np.linspace(0.0, 12.0, 481) if margins is None else np.asarray(margins)
    t = head.one_hot(jnp.array([0]), num_classes, jnp.float64)
    loss = jax.jit(lambda z: head.forward(z, t, alpha))
    e0 = np.eye(num_classes)[0]
    losses = np.array([float(loss(jnp.asarray(m * e0)[None])) for m in margins])
    at_log_target = float(loss(jnp.log(head.smoothed(t, alpha))))

    def step(z, _):
        return z - lr * head.cotangent(z, t, alpha), None
    z, _ = jax.lax.scan(step, jnp.zeros((1, num_classes), jnp.float64), None, length=descent_steps)
    return MarginCurve(num_classes, float(alpha), margins, losses, smoothed_entropy(num_classes, alpha),
                       at_log_target, entropy_terms(num_classes, alpha).best_margin, float(loss(z)),
                       float(np.min(losses)))


# ---- the linear head: GAP and dense, no hypothesis needed ---------------------------------------

def tied_head_input(key, n: int = 3, channels: int = 8, size: int = 4) -> jax.Array:
    """A GAP input [N,C,H,W] whose features hold exact ties: the first half of the channels are
    constant small integers (equal features across channels and examples), and the last example
    repeats the first."""
    kx, ki = jax.random.split(key)
    x = prng.normal(kx, (n, channels, size, size), jnp.float64)
    ints = jnp.round(prng.normal(ki, (n, channels // 2, 1, 1), jnp.float64))
    x = x.at[:, : channels // 2].set(jnp.broadcast_to(ints, (n, channels // 2, size, size)))
    return x.at[-1].set(x[0]) if n > 1 else x


def feature_ties(g) -> int:
    """Pairs of exactly equal entries of the features g [N,C] (within an example or across)."""
    v = np.asarray(g).ravel()
    _, counts = np.unique(v, return_counts=True)
    return int(np.sum(counts * (counts - 1) // 2))


def gap_without_area(input_shape, dg):
    """A planted GAP backward that forgets the 1/(H·W): dg broadcast as it is."""
    return jnp.broadcast_to(dg[:, :, None, None], input_shape)


def linear_head_cases(key, *, n: int = 3, channels: int = 8, size: int = 4, num_classes: int = 5,
                      gap_backward: Callable = gap.backward) -> HeadTies:
    """GAP backward (`gapBack`), the dense input backward (`rowDenseBackFlat`) and the dense weight
    and bias nodes, tied to `jax.vjp` of the forwards at a random point whose features hold exact
    ties (`tied_head_input`): both maps are linear, so ties change nothing. `gap_backward` swaps in
    a planted bug (`gap_without_area`). meta["feature_ties"]: the equal pairs among the GAP features
    the dense layer reads."""
    kx, kw, kb, kg = jax.random.split(key, 4)
    x = tied_head_input(kx, n, channels, size)
    w = prng.normal(kw, (num_classes, channels), jnp.float64) / np.sqrt(channels)
    b = prng.normal(kb, (num_classes,), jnp.float64)
    dlogits = prng.normal(kg, (n, num_classes), jnp.float64)
    g, shape = gap.forward(x)
    dg = dense.backward(w, dlogits)
    dg_o, dw_o, db_o = reference.dense_vjp(g, w, b, dlogits)
    dx_o = reference.gap_vjp(x, dg_o)
    return _ties([_row("gapBack: dx", gap_backward(shape, dg), dx_o), _row("rowDenseBackFlat: dg", dg, dg_o),
                  _row("dense weight: dW", dense.grad_weight(g, dlogits), dw_o),
                  _row("dense bias: db", dense.grad_bias(dlogits), db_o)], feature_ties=feature_ties(g))
