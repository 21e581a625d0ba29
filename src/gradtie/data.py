"""Data: real shipped photos, flat-region images, digits, CIFAR-10 files, mixup/cutmix targets.

Everything here runs offline. The photos are the ones scikit-image and scikit-learn ship
(astronaut, coffee, chelsea, rocket, hubble_deep_field; china, flower); `flat_images` draws from
images with large flat regions (horse, page, upsampled digits), which give many twin ties after
conv→BN→ReLU. Loaders return host NumPy arrays, NCHW, pixels in [0,1]; the batch transforms
(`mixup`, `cutmix`, `augment_flip`) are JAX functions that also run under `jit`.

Targets are rows summing to 1 (the head fold's hypothesis): one-hot rows, or the convex combinations mixup and
cutmix make. Shown in: Pools, Whole-net tie, Training with the rendered step.
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import prng
from .host import to_device
from .ops import head

PHOTO_NAMES = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "china", "flower")
FLAT_NAMES = ("horse", "page", "digits")
MIN_CROP_SCALE = 0.3            # a crop's side is at least this fraction of the photo's short side
# CIFAR-10 as https://www.cs.toronto.edu/~kriz/cifar.html ships it, in either of two versions:
# "CIFAR-10 python version" (cifar-10-python.tar.gz -> cifar-10-batches-py/, pickled dicts) and
# "CIFAR-10 binary version" (cifar-10-binary.tar.gz -> cifar-10-batches-bin/, fixed-size records).
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = "test_batch"
CIFAR10_BIN_FOLDER = "cifar-10-batches-bin"
CIFAR10_BIN_TRAIN = tuple(f"{name}.bin" for name in CIFAR10_TRAIN)
CIFAR10_BIN_TEST = f"{CIFAR10_TEST}.bin"
CIFAR10_RECORD = 1 + 3 * 32 * 32      # binary record: one label byte, then the red, green, blue planes
CIFAR10_CLASSES = 10

Seed = Union[int, np.integer, np.random.Generator, jax.Array]


class Split(NamedTuple):
    """A train/test split: images [N,3,S,S] and int labels [N]."""
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


class Dataset(NamedTuple):
    """What `gradtie train` reads: a split and its class count."""
    name: str
    split: Split
    num_classes: int


class Mixed(NamedTuple):
    """A mixed batch: x̃ = λ·x + (1−λ)·x[perm] (mixup) or x with a box pasted from x[perm] (cutmix),
    and t̃ = λ·t + (1−λ)·t[perm]; λ is the weight of the batch's own examples."""
    x: jax.Array
    targets: jax.Array
    lam: jax.Array
    perm: jax.Array


# ---- validation ---------------------------------------------------------------------------------

def _positive_int(op: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{op}: {name} must be a positive integer, got {v!r}")
    return int(v)


def _float_dtype(op: str, dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"{op}: dtype must be float32 or float64, got {dt}")
    return dt


def _images(op: str, x) -> None:
    if np.ndim(x) != 4:
        raise ValueError(f"{op}: x must be images [N,C,H,W], got shape {tuple(np.shape(x))}")


def _as_key(op: str, seed: Seed) -> jax.Array:
    """A JAX key from a JAX key, an int seed or a NumPy Generator (which is advanced by one draw)."""
    if isinstance(seed, np.random.Generator):
        return jax.random.key(int(seed.integers(0, 2**31 - 1)))
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return jax.random.key(int(seed))
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    if isinstance(seed, jax.Array) and seed.dtype == jnp.uint32 and seed.shape == (2,):
        return jax.random.wrap_key_data(seed)       # a raw `PRNGKey`: same stream, typed
    raise ValueError(f"{op}: expected a JAX key, an int seed or a numpy Generator, got {type(seed).__name__}")


# ---- shipped images -----------------------------------------------------------------------------

SKLEARN_PHOTOS = ("china", "flower")


def _sklearn_photo(name: str) -> np.ndarray:
    """scikit-learn's sample photo `name` as uint8 [H,W,3], decoded as `load_sample_images` does
    (PIL), read from the installed package without importing scikit-learn (1.7 s of imports)."""
    import importlib.util

    from PIL import Image

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("data.photos: scikit-learn is not installed (its sample photos china, flower)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "images" / f"{name}.jpg"
    if not path.is_file():
        raise FileNotFoundError(f"data.photos: scikit-learn's sample photo {path} is missing")
    with Image.open(path) as img:
        return np.asarray(img)


@functools.lru_cache(maxsize=None)
def source_photos() -> tuple[np.ndarray, ...]:
    """The seven shipped RGB photos as float64 [H,W,3] in [0,1], in `PHOTO_NAMES` order (read-only)."""
    import skimage.data

    out = []
    for name in PHOTO_NAMES:
        img = _sklearn_photo(name) if name in SKLEARN_PHOTOS else getattr(skimage.data, name)()
        arr = np.asarray(img, dtype=np.float64) / 255.0
        arr.setflags(write=False)
        out.append(arr)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _digit_images() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images / 16.0, d.target.astype(np.int64)


@functools.lru_cache(maxsize=None)
def _flat_sources() -> tuple[np.ndarray, np.ndarray]:
    """horse (binary) and page (grey) as float64 [H,W] in [0,1]."""
    import skimage.data

    return (np.asarray(skimage.data.horse(), dtype=np.float64),
            np.asarray(skimage.data.page(), dtype=np.float64) / 255.0)


def _random_square(rng: np.random.Generator, h: int, w: int) -> tuple[int, int, int]:
    short = min(h, w)
    side = max(1, int(round(rng.uniform(MIN_CROP_SCALE, 1.0) * short)))
    return int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1)), side


def _block_mean(img: np.ndarray, f: int) -> np.ndarray:
    """Area downsample by an integer factor f (the mean of each f×f block); the anti-aliased resize
    that follows then works on at most about 4× the target size, which keeps big crops cheap."""
    if f <= 1:
        return img
    s = img.shape[0] - img.shape[0] % f
    return img[:s, :s].reshape(s // f, f, s // f, f, -1).mean(axis=(1, 3))


def _crops(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from skimage.transform import resize

    rng = np.random.default_rng(seed)
    sources = source_photos()
    x = np.empty((n, 3, size, size), dtype=np.float64)
    which = np.arange(n) % len(sources)
    for i, k in enumerate(which):
        img = sources[k]
        top, left, side = _random_square(rng, *img.shape[:2])
        crop = _block_mean(img[top:top + side, left:left + side], side // (2 * size))
        small = resize(crop, (size, size), order=1, anti_aliasing=True, mode="reflect")
        x[i] = np.clip(small, 0.0, 1.0).transpose(2, 0, 1)
    return x, which.astype(np.int64)


def photos(n: int, size: int, *, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """n random square crops of the shipped photos, resized to size×size: x [n,3,size,size] in [0,1].

    Crop i comes from photo `i % 7` (`PHOTO_NAMES`); its side is a uniform fraction in [0.3, 1] of
    the photo's short side, placed uniformly, then resized with anti-aliasing (an area-like
    downsample). Deterministic for a seed.
    """
    op = "data.photos"
    n, size = _positive_int(op, "n", n), _positive_int(op, "size", size)
    dt = _float_dtype(op, dtype)
    return _crops(n, size, seed)[0].astype(dt)


def photo_labels(n: int, size: int, *, seed: int = 0, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """`photos` with a class per crop: the index of the photo it was cut from (K = 7 classes)."""
    op = "data.photo_labels"
    n, size = _positive_int(op, "n", n), _positive_int(op, "size", size)
    dt = _float_dtype(op, dtype)
    x, labels = _crops(n, size, seed)
    return x.astype(dt), labels


def _nearest(img: np.ndarray, size: int) -> np.ndarray:
    """Nearest-neighbour resample of a square [S,S] image: every output pixel IS a source pixel, so a
    flat region stays exactly flat (interpolation would leave ulp-level differences between twins)."""
    s = img.shape[0]
    if s % size == 0:
        return img[s // size // 2::s // size, s // size // 2::s // size]
    idx = np.minimum((np.arange(size) + 0.5) * s / size, s - 1).astype(np.int64)
    return img[np.ix_(idx, idx)]


def _upsample_digit(img: np.ndarray, size: int) -> np.ndarray:
    if size % img.shape[0] == 0:
        f = size // img.shape[0]
        return np.kron(img, np.ones((f, f)))
    return _nearest(img, size)


def flat_images(n: int, size: int, *, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """Images full of flat regions: x [n,3,size,size] in [0,1], grey (three equal channels).

    Image i comes from `FLAT_NAMES[i % 3]`: a random square crop (scale ≥ 0.3) of the binary horse
    silhouette or of the scanned page, nearest-neighbour resampled; or a random sklearn digit
    upsampled by `np.kron` (nearest neighbour). Resampling never interpolates, so equal pixels stay
    bit-equal: their zero-padded receptive fields are twins (chapter Pools). Deterministic for a seed.
    """
    op = "data.flat_images"
    n, size = _positive_int(op, "n", n), _positive_int(op, "size", size)
    dt = _float_dtype(op, dtype)
    rng = np.random.default_rng(seed)
    horse, page = _flat_sources()
    digit_imgs, _ = _digit_images()
    x = np.empty((n, 3, size, size), dtype=np.float64)
    for i in range(n):
        kind = FLAT_NAMES[i % len(FLAT_NAMES)]
        if kind == "digits":
            grey = _upsample_digit(digit_imgs[rng.integers(0, len(digit_imgs))], size)
        else:
            img = horse if kind == "horse" else page
            top, left, side = _random_square(rng, *img.shape)
            grey = _nearest(img[top:top + side, left:left + side], size)
        x[i] = grey[None]
    return x.astype(dt)


# ---- the batches a check runs on ---------------------------------------------------------------

def images(kind: str, n: int, size: int, *, seed: int = 0, channels: int = 3) -> jax.Array:
    """A batch x [n,channels,size,size] in float64: `photos` or `flat_images` (their float32 pixels
    widened exactly) for kind "photos" or "flat", or standard-normal pixels for "randn"."""
    if kind == "randn":
        return prng.normal(jax.random.key(seed), (n, channels, size, size), jnp.float64)
    if kind not in ("photos", "flat"):
        raise ValueError(f"data {kind!r}: expected one of randn, photos, flat")
    if channels != 3:
        raise ValueError(f"data {kind!r} holds RGB images; this net takes {channels} channels (use randn)")
    return to_device((photos if kind == "photos" else flat_images)(n, size, seed=seed), np.float64)


def photo_batch(n: int, size: int, num_classes: int, *, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """n photo crops in float64 and one-hot rows [n,K] of the photo each was cut from (7 photos ≤ K)."""
    x, labels = photo_labels(n, size, seed=seed)
    return jnp.asarray(x, jnp.float64), one_hot(jnp.asarray(labels), num_classes, jnp.float64)


def photo_batches(steps: int, n: int, size: int, *, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`steps` batches of n photo crops (float64) with their labels, the photo each was cut from
    (`photo_labels`, K = 7), the photos mixed across the batches."""
    x, labels = photo_labels(steps * n, size, seed=seed, dtype=np.float64)
    order = np.random.default_rng(seed).permutation(steps * n)
    return [(x[part], labels[part]) for part in np.split(order, steps)]


def digits(*, size: int = 32, test_fraction: float = 0.2, seed: int = 0, dtype=np.float32) -> Split:
    """sklearn's 1,797 8×8 digits as [N,3,size,size] in [0,1] (nearest upsample by `np.kron`, three
    equal channels), int labels 0…9, shuffled with the seed and split into train and test."""
    op = "data.digits"
    size = _positive_int(op, "size", size)
    dt = _float_dtype(op, dtype)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"{op}: test_fraction must lie strictly between 0 and 1, got {test_fraction!r}")
    imgs, labels = _digit_images()
    order = np.random.default_rng(seed).permutation(len(imgs))
    x = np.stack([_upsample_digit(imgs[i], size) for i in order])
    x = np.repeat(x[:, None], 3, axis=1).astype(dt)
    y = labels[order]
    n_test = max(1, int(round(test_fraction * len(x))))
    return Split(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def synthetic(n: int, size: int, num_classes: int, seed: int = 0, *,
              dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Standard-normal images x [n,3,size,size] with uniform random labels in 0…K−1."""
    op = "data.synthetic"
    n, size = _positive_int(op, "n", n), _positive_int(op, "size", size)
    num_classes = _positive_int(op, "num_classes", num_classes)
    dt = _float_dtype(op, dtype)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, size, size)).astype(dt)
    return x, rng.integers(0, num_classes, size=n).astype(np.int64)


# ---- CIFAR-10: python pickle batches or binary records ----------------------------------------


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists and NumPy arrays only: a batch file cannot run code when it is read."""

    ALLOWED = {("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
               ("numpy._core.numeric", "_frombuffer"), ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}

    def find_class(self, module, name):
        canonical = "numpy._core" + module[len("numpy.core"):] if module.startswith("numpy.core") else module
        if (canonical, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name} (only NumPy arrays)")
        return super().find_class(canonical, name)


def _cifar_folder(path) -> tuple[Path, str]:
    """(folder, "python" or "binary"): `path` is either version's batch folder or the folder holding it."""
    p = Path(path)
    for sub in (CIFAR10_FOLDER, CIFAR10_BIN_FOLDER):
        if (p / sub).is_dir():
            p = p / sub
            break
    if not p.is_dir():
        raise FileNotFoundError(f"load_cifar10: no folder at {str(path)!r}; expected {CIFAR10_FOLDER!r} "
                                f"(data_batch_1…5 and test_batch, the python version) or "
                                f"{CIFAR10_BIN_FOLDER!r} (data_batch_1…5.bin and test_batch.bin, the "
                                f"binary version), or the folder holding one of them")
    if any((p / name).exists() for name in CIFAR10_BIN_TRAIN + (CIFAR10_BIN_TEST,)):
        return p, "binary"
    return p, "python"


def _field(d: dict, name: str):
    for key in (name.encode(), name):
        if key in d:
            return d[key]
    return None


def read_cifar10_batch(file) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch -> (x uint8 [N,3,32,32], labels int64 [N]), with clear errors."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"load_cifar10: missing batch file {str(file)!r}; expected "
                                f"{', '.join(CIFAR10_TRAIN)} and {CIFAR10_TEST} in {str(file.parent)!r}")
    try:
        d = _ArrayUnpickler(io.BytesIO(file.read_bytes()), encoding="bytes").load()
    except Exception as err:  # any unpickling failure means the same thing to the reader
        raise ValueError(f"load_cifar10: {str(file)!r} is not a readable CIFAR-10 python pickle "
                         f"({type(err).__name__}: {err})") from err
    if not isinstance(d, dict):
        raise ValueError(f"load_cifar10: {str(file)!r} holds a {type(d).__name__}; expected a dict "
                         f"with b'data' and b'labels'")
    data, labels = _field(d, "data"), _field(d, "labels")
    if data is None or labels is None:
        raise ValueError(f"load_cifar10: {str(file)!r} lacks b'data' or b'labels' "
                         f"(keys: {sorted(map(repr, d))})")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = (f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__)
        raise ValueError(f"load_cifar10: b'data' in {str(file)!r} must be a uint8 array [N,3072] "
                         f"(3×32×32 pixels per row), got {got}")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or not (
            np.issubdtype(labels.dtype, np.integer) or labels.size == 0):
        raise ValueError(f"load_cifar10: b'labels' in {str(file)!r} must be {data.shape[0]} integers "
                         f"(one per row of b'data'), got {labels.dtype} {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= CIFAR10_CLASSES):
        raise ValueError(f"load_cifar10: labels in {str(file)!r} must lie in 0…{CIFAR10_CLASSES - 1}, "
                         f"got {int(labels.min())}…{int(labels.max())}")
    # each row is the red plane, then green, then blue, each 32×32 row-major: exactly NCHW
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def read_cifar10_bin(file) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch -> (x uint8 [N,3,32,32], labels int64 [N]), with clear errors.

    The file is N records of 3,073 bytes: the label (0…9), then 1,024 red, 1,024 green and 1,024
    blue pixels, each plane 32×32 row-major.
    """
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"load_cifar10: missing batch file {str(file)!r}; expected "
                                f"{', '.join(CIFAR10_BIN_TRAIN)} and {CIFAR10_BIN_TEST} in {str(file.parent)!r}")
    raw = np.frombuffer(file.read_bytes(), dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR10_RECORD:
        raise ValueError(f"load_cifar10: {str(file)!r} holds {raw.size} bytes; a CIFAR-10 binary batch "
                         f"is whole records of {CIFAR10_RECORD} bytes (1 label byte + 3×32×32 pixels)")
    records = raw.reshape(-1, CIFAR10_RECORD)
    labels = records[:, 0].astype(np.int64)
    if labels.max() >= CIFAR10_CLASSES:
        bad = int(np.argmax(labels >= CIFAR10_CLASSES))
        raise ValueError(f"load_cifar10: record {bad} of {str(file)!r} has label {int(labels[bad])}; "
                         f"labels must lie in 0…{CIFAR10_CLASSES - 1}")
    return records[:, 1:].reshape(-1, 3, 32, 32).copy(), labels


def load_cifar10(path, *, dtype=None) -> Split:
    """CIFAR-10 from either version's files: (x_train [50000,3,32,32], y_train, x_test, y_test).

    `path` is the `cifar-10-batches-py` folder (the python version: pickled batches) or the
    `cifar-10-batches-bin` folder (the binary version: `.bin` records), or the folder holding one;
    both come from https://www.cs.toronto.edu/~kriz/cifar.html and give the same arrays. Images
    stay uint8 with `dtype=None`, or become float32/float64 in [0,1]. Pickles are read with an
    unpickler that accepts NumPy arrays only. A missing folder or file is a FileNotFoundError,
    anything malformed a ValueError, each naming the file and what was expected.
    """
    folder, version = _cifar_folder(path)
    if version == "binary":
        train = [read_cifar10_bin(folder / name) for name in CIFAR10_BIN_TRAIN]
        x_test, y_test = read_cifar10_bin(folder / CIFAR10_BIN_TEST)
    else:
        train = [read_cifar10_batch(folder / name) for name in CIFAR10_TRAIN]
        x_test, y_test = read_cifar10_batch(folder / CIFAR10_TEST)
    x_train = np.concatenate([b[0] for b in train])
    y_train = np.concatenate([b[1] for b in train])
    if dtype is not None:
        dt = _float_dtype("data.load_cifar10", dtype)
        x_train, x_test = (x_train / 255.0).astype(dt), (x_test / 255.0).astype(dt)
    return Split(x_train, y_train, x_test, y_test)


# ---- targets and batch transforms (JAX; these run under jit) ------------------------------------

def one_hot(labels, num_classes: int, dtype=jnp.float32) -> jax.Array:
    """Int labels [N] -> one-hot rows [N,K] (`gradtie.ops.head.one_hot`)."""
    return head.one_hot(labels, num_classes, dtype=dtype)


def _mix_inputs(op: str, x, targets) -> tuple[jax.Array, jax.Array]:
    _images(op, x)
    if np.ndim(targets) != 2 or np.shape(targets)[0] != np.shape(x)[0]:
        raise ValueError(f"{op}: targets must be rows [N,K] for x {tuple(np.shape(x))}, "
                         f"got {tuple(np.shape(targets))}")
    return jnp.asarray(x), jnp.asarray(targets)


def _lambda(op: str, key: jax.Array, alpha: float, lam, dtype) -> jax.Array:
    """λ as given, or drawn from Beta(α, α)."""
    if lam is not None:
        if not isinstance(lam, jax.core.Tracer) and not 0.0 <= float(lam) <= 1.0:
            raise ValueError(f"{op}: lam must lie in [0, 1], got {lam!r}")
        return jnp.asarray(lam, dtype=dtype)
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"{op}: alpha must be a positive number (λ ~ Beta(α, α)), got {alpha!r}")
    return jax.random.beta(key, alpha, alpha, dtype=dtype)


TARGET_KINDS = ("one-hot", "mixup", "cutmix")


def batch_targets(kind: str, n: int, k: int, key) -> jax.Array:
    """[N,K] float64 targets: one-hot rows of random labels, or their mixup / cutmix over a photo
    batch; every row sums to 1."""
    k_lab, k_mix = jax.random.split(key)
    t = one_hot(prng.randint(k_lab, (n,), 0, k), k, jnp.float64)
    if kind == "one-hot":
        return t
    x = jnp.asarray(photos(n, 32, seed=int(prng.randint(k_mix, (), 0, 2**30))), jnp.float64)
    if kind == "mixup":
        return mixup(x, t, k_mix).targets
    if kind == "cutmix":
        return cutmix(x, t, k_mix).targets
    raise ValueError(f"batch_targets: kind must be one of {TARGET_KINDS}, got {kind!r}")


def mixup(x, targets, key: Seed, *, alpha: float = 0.2, lam=None) -> Mixed:
    """Mixup: x̃ = λ·x + (1−λ)·x[π], t̃ = λ·t + (1−λ)·t[π], π a random permutation of the batch.

    λ ~ Beta(α, α) from the key unless `lam` is given. t̃'s rows sum to 1 whenever t's do, which is
    all the head cotangent assumes (chapter Head fold). Deterministic for a key, int seed or Generator.
    """
    op = "data.mixup"
    x, targets = _mix_inputs(op, x, targets)
    k_perm, k_lam = jax.random.split(_as_key(op, key))
    lam = _lambda(op, k_lam, alpha, lam, targets.dtype)
    return _mixup(x, targets, k_perm, lam)


@jax.jit
def _mixup(x, targets, key, lam) -> Mixed:
    perm = jax.random.permutation(key, x.shape[0])
    lx = lam.astype(x.dtype)
    return Mixed(lx * x + (1 - lx) * x[perm], lam * targets + (1 - lam) * targets[perm], lam, perm)


def cutmix_box(key: jax.Array, height: int, width: int, lam) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A box (top, bottom, left, right), half-open, of side √(1−λ)·(H, W) about a uniform centre,
    clipped to the image (as in the CutMix paper; clipping makes the pasted area smaller)."""
    k_y, k_x = jax.random.split(key)
    r = jnp.sqrt(1.0 - lam)
    cut_h = jnp.floor(height * r).astype(jnp.int32)
    cut_w = jnp.floor(width * r).astype(jnp.int32)
    cy = jax.random.randint(k_y, (), 0, height)
    cx = jax.random.randint(k_x, (), 0, width)
    return (jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + cut_h // 2, 0, height),
            jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + cut_w // 2, 0, width))


def cutmix(x, targets, key: Seed, *, alpha: float = 1.0, lam=None) -> Mixed:
    """CutMix: paste one box of x[π] into every image; t̃ = λ·t + (1−λ)·t[π].

    The box is drawn for a nominal λ₀ (~ Beta(α, α), or `lam`), then clipped to the image; the
    returned λ is the EXACT kept area fraction, 1 − (box area)/(H·W) ≥ λ₀, so the targets weigh
    each source by the pixels it really contributes. Deterministic for a key, int seed or Generator.
    """
    op = "data.cutmix"
    x, targets = _mix_inputs(op, x, targets)
    k_perm, k_lam, k_box = jax.random.split(_as_key(op, key), 3)
    lam0 = _lambda(op, k_lam, alpha, lam, targets.dtype)
    return _cutmix(x, targets, k_perm, k_box, lam0)


@jax.jit
def _cutmix(x, targets, k_perm, k_box, lam0) -> Mixed:
    perm = jax.random.permutation(k_perm, x.shape[0])
    h, w = x.shape[2], x.shape[3]
    top, bottom, left, right = cutmix_box(k_box, h, w, lam0)
    rows, cols = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    xm = jnp.where(inside[None, None], x[perm], x)
    kept = (h * w - (bottom - top) * (right - left)).astype(targets.dtype)
    lam = kept / (h * w)                            # one rounding: the kept pixel count over H·W
    return Mixed(xm, lam * targets + (1 - lam) * targets[perm], lam, perm)


def augment_flip(x, key: Seed) -> jax.Array:
    """Flip each image left–right with probability ½ (the cifar8 recipe's only augmentation)."""
    op = "data.augment_flip"
    _images(op, x)
    return _flip(jnp.asarray(x), _as_key(op, key))


@jax.jit
def _flip(x, key):
    flip = jax.random.bernoulli(key, 0.5, (x.shape[0],))
    return jnp.where(flip[:, None, None, None], x[..., ::-1], x)


def batches(x, y, batch: int, *, key: Seed, drop_last: bool = True) -> Iterator[tuple]:
    """Shuffled minibatches (x[idx], y[idx]) covering the examples once, in an order set by the key.

    With drop_last the final partial batch is skipped, so every batch has the same shape (one
    compile of the train step).
    """
    op = "data.batches"
    batch = _positive_int(op, "batch", batch)
    n = np.shape(x)[0] if np.ndim(x) else 0
    if np.shape(y)[:1] != (n,):
        raise ValueError(f"{op}: x and y must hold the same number of examples, got "
                         f"{tuple(np.shape(x))} and {tuple(np.shape(y))}")
    if n == 0 or (drop_last and n < batch):
        raise ValueError(f"{op}: {n} examples make no full batch of {batch}")
    order = np.asarray(jax.random.permutation(_as_key(op, key), n))
    stop = n - n % batch if drop_last else n
    for start in range(0, stop, batch):
        idx = order[start:start + batch]
        yield x[idx], y[idx]


# ---- named datasets (what `gradtie train --data` reads) -----------------------------------------

DATASETS = ("digits", "photos", "synthetic", "cifar10:PATH")


def flips_keep_class(spec: str) -> bool:
    """Whether a left–right mirror keeps an image's class: yes for crops of photos, CIFAR-10 and
    noise; no for digits (a mirrored 2, 3, 4, 5, 7 or 9 is no digit). The train default follows it."""
    return spec != "digits"


def load(spec: str, *, size: int = 32, n_train: Optional[int] = None, n_test: Optional[int] = None,
         num_classes: int = 10, seed: int = 0, dtype=np.float32) -> Dataset:
    """A named dataset with a train/test split: "digits", "photos" (K = 7, the source photo),
    "synthetic" (random normal images, random labels) or "cifar10:PATH".

    n_train / n_test cap the split sizes (photos and synthetic need them or use 1024 / 256).
    """
    op = "data.load"
    if spec == "digits":
        split, k = digits(size=size, seed=seed, dtype=dtype), 10
    elif spec == "photos":
        tr, te = n_train or 1024, n_test or 256
        split = Split(*photo_labels(tr, size, seed=seed, dtype=dtype),
                      *photo_labels(te, size, seed=seed + 1, dtype=dtype))
        k = len(PHOTO_NAMES)
    elif spec == "synthetic":
        tr, te = n_train or 1024, n_test or 256
        split = Split(*synthetic(tr, size, num_classes, seed, dtype=dtype),
                      *synthetic(te, size, num_classes, seed + 1, dtype=dtype))
        k = num_classes
    elif spec.startswith("cifar10:") and len(spec) > len("cifar10:"):
        if size != 32:
            raise ValueError(f"{op}: CIFAR-10 images are 32×32, got size={size}")
        split, k = load_cifar10(spec[len("cifar10:"):], dtype=dtype), CIFAR10_CLASSES
    else:
        raise ValueError(f"{op}: unknown dataset {spec!r}; expected one of {', '.join(DATASETS)}")
    for name, cap in (("n_train", n_train), ("n_test", n_test)):
        if cap is not None:
            _positive_int(op, name, cap)
    if n_train is not None or n_test is not None:
        split = Split(split.x_train[:n_train], split.y_train[:n_train],
                      split.x_test[:n_test], split.y_test[:n_test])
    return Dataset(spec, split, k)
