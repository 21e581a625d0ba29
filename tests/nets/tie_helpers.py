"""Shared by the net tests: images, targets, the autodiff oracle and the node-by-node comparison.

The oracle is `gradtie.reference.oracle`, the one every check ties to: autodiff of `net.forward`
and the net's loss value (`net.loss.value`, tied to plain-jnp cross-entropy in tests/ops/test_head.py).
It never reads the rendered backward or the head cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import skimage.data
import skimage.transform
from sklearn.datasets import load_digits

from gradtie import prng, reference
from gradtie import tolerances
from gradtie.checks.tie import Limit, compare, zero_in_reals as zero_nodes

# These tests run both sides unjitted, op by op, where rendered and autodiff agree to round-off even
# at a BatchNorm over M = 2 cells: every row is held to the float64 floor (
# `tolerances.REL_F64`) through the tie kit's row builder, `checks.tie.compare` (nodes that are 0 in ℝ
# against the net's scale, `tolerances.ZERO_NODE_SCALE`).


# ---- images -------------------------------------------------------------------------------------

def _square(img: np.ndarray, top: float = 0.5, left: float = 0.5) -> np.ndarray:
    """The largest square crop, placed at relative offsets (0.5, 0.5 = centred)."""
    h, w = img.shape[:2]
    s = min(h, w)
    i, j = int(round((h - s) * top)), int(round((w - s) * left))
    return img[i:i + s, j:j + s]


def _nchw(imgs) -> np.ndarray:
    return np.stack([np.transpose(img, (2, 0, 1)) for img in imgs]).astype(np.float64)


def photos(n: int, size: int) -> np.ndarray:
    """n real photo crops (astronaut, chelsea, coffee, then other crops of them), [n,3,size,size] in [0,1]."""
    sources = [skimage.data.astronaut(), skimage.data.chelsea(), skimage.data.coffee()]
    offsets = [(0.5, 0.5), (0.0, 0.0), (1.0, 1.0)]
    imgs = []
    for k in range(n):
        img = _square(sources[k % 3], *offsets[(k // 3) % 3])
        imgs.append(skimage.transform.resize(img, (size, size), anti_aliasing=True))  # floats in [0,1]
    return _nchw(imgs)


def flat_images(n: int, size: int = 32) -> np.ndarray:
    """Images full of flat regions (ties): the horse silhouette, then digits upsampled 8→32 by np.kron."""
    horse = skimage.transform.resize(_square(skimage.data.horse().astype(np.float64)), (size, size),
                                     order=0, anti_aliasing=False)
    imgs = [horse]
    digits = load_digits().images
    for k in range(n - 1):
        imgs.append(np.kron(digits[k] / 16.0, np.ones((size // 8, size // 8))))
    return _nchw([np.repeat(img[:, :, None], 3, axis=2) for img in imgs])


def randn(key: int, shape) -> jax.Array:
    return prng.normal(jax.random.PRNGKey(key), shape, jnp.float64)


# ---- targets ------------------------------------------------------------------------------------

def labels(n: int, k: int) -> jax.Array:
    return jnp.asarray((np.arange(n) * 3 + 1) % k, dtype=jnp.int32)


def soft_targets(n: int, k: int) -> jax.Array:
    """Mixup-style rows: λ·onehot(a) + (1−λ)·onehot(b), summing to 1."""
    lam = np.linspace(0.3, 0.8, n)[:, None]
    a = np.eye(k)[np.arange(n) % k]
    b = np.eye(k)[(np.arange(n) * 7 + 2) % k]
    return jnp.asarray(lam * a + (1 - lam) * b)


def as_rows(targets, k: int) -> jax.Array:
    t = jnp.asarray(targets)
    return jax.nn.one_hot(t, k, dtype=jnp.float64) if t.ndim == 1 else t.astype(jnp.float64)


# ---- oracle and comparison ----------------------------------------------------------------------

@jax.jit
def _cast64(params):
    return jax.tree.map(lambda a: a.astype(jnp.float64), params)


def f64(params):
    """Cast to float64 in one compiled call, keeping the signature order (a jit sorts dict keys)."""
    cast = _cast64(params)
    return {name: cast[name] for name in params}


def oracle_loss_and_grads(net, params, x, targets, cfg, alpha):
    """(loss, parameter gradients) of `reference.oracle`: autodiff of the forward-based loss."""
    loss, grads, _ = reference.oracle(net, params, x, as_rows(targets, cfg.num_classes), cfg, alpha)
    return loss, grads


def oracle_input_cotangent(net, params, x, cfg, dlogits):
    """`reference.vjp` of the forward's logits with respect to the image."""
    (dx,) = reference.vjp(lambda x_: net.forward(params, x_, cfg)[0], x, cotangent=dlogits)
    return dx


def zero_in_reals(name: str, params) -> bool:
    """A conv bias: BN follows every conv, so its node is Σ of a BN input cotangent, 0 in ℝ."""
    return name in zero_nodes(params)


def rows(rendered, oracle, params, dx=None, loss=None) -> list:
    """The tie kit's rows (`tie.compare`) at the float64 floor: nodes in the oracle's order, then
    the input cotangent (dx = (rendered, oracle)), the loss first (loss = (rendered, oracle))."""
    return compare({k: rendered[k] for k in oracle}, oracle, limit=Limit(floor=tolerances.REL_F64),
                       zero_nodes=zero_nodes(params), dx=dx, loss=loss)


def node_errors(rendered, oracle, params) -> dict[str, tuple[float, float]]:
    """name -> (relative error, its limit)."""
    return {r.name: (r.rel, r.limit) for r in rows(rendered, oracle, params)}


def untied(rendered, oracle, params) -> list[str]:
    """Names of the nodes the rendered chain does not tie (a missing or extra node is untied too)."""
    if set(rendered) != set(oracle):
        return sorted(set(rendered) ^ set(oracle))
    return [r.name for r in rows(rendered, oracle, params) if not r.ok]


def assert_tied(rendered, oracle, params):
    bad = untied(rendered, oracle, params)
    errs = node_errors(rendered, oracle, params) if set(rendered) == set(oracle) else {}
    assert bad == [], {name: errs.get(name) for name in bad[:8]}


def input_tied(dx, dx_ref) -> bool:
    """The input cotangent tied at the float64 floor, relative to max|oracle|."""
    return compare({}, {}, limit=Limit(floor=tolerances.REL_F64), dx=(dx, dx_ref))[0].ok


def loss_tied(loss, loss_ref) -> bool:
    return compare({}, {}, limit=Limit(floor=tolerances.REL_F64), loss=(loss, loss_ref))[0].ok


def rel_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
