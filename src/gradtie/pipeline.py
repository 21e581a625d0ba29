"""The input pipeline of an image folder: grain datasets decoded and augmented in worker processes.

Training batches: torchvision's `RandomResizedCrop` (scale 0.08–1 of the area, aspect 3:4–4:3, ten
tries, then the centre crop) and a random left–right flip. Evaluation: the short side resized to
size·256/224, the centre size×size crop. Both then normalised per channel with ImageNet's mean
and standard deviation (torchvision's constants), into the run's dtype, NCHW.

Why grain: it is JAX's own data library; a dataset is a random-access map from an index to an
element, run by worker processes (`mp_prefetch`) in a fixed order whatever their number, and its
iterator's state is a small JSON record that orbax checkpoints beside the arrays (grain's own
`grain.checkpoint` handler writes one per process). tf.data would bring TensorFlow, and PyTorch's
DataLoader neither checkpoints its position nor belongs to the JAX ecosystem.

Order: element j of a run's training dataset is local batch b = j of this process. Global batch
b holds positions b·G … b·G + G − 1 of its epoch's permutation (seeded by the run's seed and the
epoch), process p reads rows p·L … p·L + L − 1 of it (L = G / P, its replicas' rows in mesh
order), and example g's crop and flip are drawn from (seed, epoch, g). Nothing depends on the
worker count, the worker an element lands on, or the process count: a global batch is the same
examples with the same augmentations on one process or on many. One dataset spans the whole run
(every epoch), so one iterator and its state carry a resume to the exact next batch, mid-epoch too.

A file that does not decode (truncated, empty, not an image) is skipped: its place goes to the
next example of the epoch's order that decodes (in evaluation it is masked out), and the element
says which record was skipped, for the trainer to count and name. Nothing here imports JAX.

Beyond the suite: the suite states train steps, not how their batches are read.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from .folder import Listing

MEAN = (0.485, 0.456, 0.406)     # ImageNet's per-channel mean and std of pixels in [0, 1] (torchvision)
STD = (0.229, 0.224, 0.225)
RESIZE_RATIO = 256 / 224         # evaluation: short side → size · 256/224, then the centre crop
CROP_SCALE = (0.08, 1.0)         # RandomResizedCrop's area fraction and aspect ratio ranges
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
TRAIN_STREAM, PRECISE_STREAM = 1, 2   # the seed streams of the training order and the precise-BN batches


def _grain():
    """grain, with absl's flags marked parsed (grain reads a flag in its worker pool; a program that
    never calls absl's `app.run` would otherwise fail there)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import grain
    return grain


# ---- one image: decode, crop, flip --------------------------------------------------------------------

def _open(path: str):
    """The image as RGB, fully decoded (PIL is lazy: a truncated file fails here, not later)."""
    from PIL import Image

    img = Image.open(path)
    img.draft("RGB", img.size)      # JPEG: decode at full size, in RGB
    img = img.convert("RGB")
    img.load()
    return img


def crop_box(rng: np.random.Generator, width: int, height: int) -> tuple[float, float, float, float]:
    """RandomResizedCrop's box (left, top, right, bottom): an area fraction in `CROP_SCALE` and an
    aspect ratio log-uniform in `CROP_RATIO`, placed uniformly; after `CROP_TRIES` misses, the
    centre crop at the nearest allowed aspect (torchvision's `get_params`)."""
    area = width * height
    log_ratio = (np.log(CROP_RATIO[0]), np.log(CROP_RATIO[1]))
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(*CROP_SCALE)
        aspect = np.exp(rng.uniform(*log_ratio))
        w = int(round(np.sqrt(target * aspect)))
        h = int(round(np.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < CROP_RATIO[0]:
        w, h = width, int(round(width / CROP_RATIO[0]))
    elif in_ratio > CROP_RATIO[1]:
        w, h = int(round(height * CROP_RATIO[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def center_box(width: int, height: int, size: int) -> tuple[float, float, float, float]:
    """The evaluation crop in the original's pixels: the centre square that the short side resized
    to size·256/224 and cropped to size×size keeps."""
    side = min(width, height) * size / (size * RESIZE_RATIO)
    left, top = (width - side) / 2, (height - side) / 2
    return left, top, left + side, top + side


def train_image(path: str, size: int, rng: np.random.Generator, flip: bool = True) -> np.ndarray:
    """uint8 [3,size,size]: a random resized crop of the image, flipped left–right half the time
    (flip=False: never; the coin is drawn either way, so the crops stay the same)."""
    from PIL import Image

    img = _open(path)
    box = crop_box(rng, *img.size)
    mirror = rng.random() < 0.5 and flip
    out = np.asarray(img.resize((size, size), Image.BILINEAR, box=box))
    if mirror:
        out = out[:, ::-1]
    return out.transpose(2, 0, 1)


def why_unreadable(path: str) -> str:
    """Why a file does not decode, in one line ("" if it does)."""
    try:
        _open(path)
    except Exception as err:
        return " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return ""


def eval_image(path: str, size: int) -> np.ndarray:
    """uint8 [3,size,size]: the short side resized to size·256/224 and the centre crop (one resample)."""
    from PIL import Image

    img = _open(path)
    return np.asarray(img.resize((size, size), Image.BILINEAR, box=center_box(*img.size, size))).transpose(2, 0, 1)


def normalise(images: np.ndarray, dtype=np.float32) -> np.ndarray:
    """uint8 [N,3,H,W] -> (pixel/255 − mean)/std per channel, in `dtype`."""
    dtype = np.dtype(dtype)
    mean = np.asarray(MEAN, dtype)[None, :, None, None]
    std = np.asarray(STD, dtype)[None, :, None, None]
    return (images.astype(dtype) / dtype.type(255) - mean) / std


# ---- the files, compactly (a worker receives them pickled) ------------------------------------------

class Files:
    """A listing's paths as one byte string and offsets (1.28 M ImageNet paths: tens of MB, not a
    tuple of a million objects), and its labels."""

    def __init__(self, listing: Listing):
        encoded = [f.encode() for f in listing.files]
        self.blob = b"".join(encoded)
        self.offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64)
        self.labels = np.asarray(listing.labels, np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return self.blob[self.offsets[i]:self.offsets[i + 1]].decode()


def epoch_order(seed: int, epoch: int, n: int, stream: int = TRAIN_STREAM) -> np.ndarray:
    """The permutation of n examples an epoch reads (a pure function of seed, epoch, stream)."""
    return np.random.default_rng([stream, seed, epoch]).permutation(n)


class Layout(NamedTuple):
    """How one process reads a global batch: G rows, of which process p holds L = G / P starting at p·L."""
    global_batch: int
    process_index: int = 0
    process_count: int = 1

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.process_count

    def position(self, batch: int, row: int) -> int:
        """The global position (in the epoch's order) of row `row` of this process's local batch `batch`."""
        return batch * self.global_batch + self.process_index * self.local_batch + row


def check_layout(op: str, layout: Layout) -> Layout:
    if layout.global_batch < 1 or layout.process_count < 1 or not 0 <= layout.process_index < layout.process_count:
        raise ValueError(f"{op}: bad layout {layout}")
    if layout.global_batch % layout.process_count:
        raise ValueError(f"{op}: the global batch {layout.global_batch} must split evenly over "
                         f"{layout.process_count} processes")
    return layout


class _Decoder:
    """Decodes with substitution: the example at a position, or the next in the order that decodes."""

    def __init__(self, files: Files):
        self.files = files

    def first_good(self, order: np.ndarray, g: int, make) -> tuple[np.ndarray, int, int, int]:
        """(image, label, skipped, first skipped record): the example at position g of `order`, or the
        first after it (cyclically) that decodes; `make(path)` decodes and augments one."""
        n = len(order)
        skipped, first = 0, -1
        for k in range(n):
            record = int(order[(g + k) % n])
            try:
                return make(self.files.path(record)), int(self.files.labels[record]), skipped, first
            except Exception:     # PIL's UnidentifiedImageError, OSError (truncated), ValueError, …
                skipped += 1
                first = record if first < 0 else first
        raise ValueError(f"none of the {n} images decodes (first: {self.files.path(int(order[0]))})")


class TrainBatches(_Decoder):
    """Element j of the run's training dataset: this process's local batch j (epoch j // steps)."""

    def __init__(self, files: Files, size: int, seed: int, steps_per_epoch: int, layout: Layout, flip: bool = True):
        super().__init__(files)
        self.size, self.seed, self.steps, self.layout, self.flip = size, seed, steps_per_epoch, layout, flip

    @functools.lru_cache(maxsize=2)
    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.seed, epoch, len(self.files))

    def __call__(self, j: int) -> dict:
        epoch, b = divmod(int(j), self.steps)
        order = self.order(epoch)
        L = self.layout.local_batch
        images = np.empty((L, 3, self.size, self.size), np.uint8)
        labels = np.empty(L, np.int64)
        skipped = np.zeros(L, np.int32)
        first = np.full(L, -1, np.int64)
        for r in range(L):
            g = self.layout.position(b, r)
            rng = np.random.default_rng([TRAIN_STREAM, self.seed, epoch, g])
            images[r], labels[r], skipped[r], first[r] = self.first_good(
                order, g, lambda path: train_image(path, self.size, rng, self.flip))
        return {"image": images, "label": labels, "skipped": skipped, "skipped_record": first}


class PreciseBatches(_Decoder):
    """Element i: this process's rows of the i-th fixed training batch of the precise BN statistics
    (evaluation transform, no augmentation), from a permutation fixed by the seed."""

    def __init__(self, files: Files, size: int, seed: int, layout: Layout):
        super().__init__(files)
        self.size, self.layout = size, layout
        self.order = epoch_order(seed, 0, len(files), PRECISE_STREAM)

    def __call__(self, i: int) -> dict:
        L = self.layout.local_batch
        images = np.empty((L, 3, self.size, self.size), np.uint8)
        labels = np.empty(L, np.int64)
        skipped = np.zeros(L, np.int32)
        first = np.full(L, -1, np.int64)
        for r in range(L):
            images[r], labels[r], skipped[r], first[r] = self.first_good(
                self.order, self.layout.position(int(i), r), lambda path: eval_image(path, self.size))
        return {"image": images, "label": labels, "skipped": skipped, "skipped_record": first}


class EvalChunks:
    """Element c: this process's rows of evaluation chunk c (G rows: examples c·G … c·G + G − 1 in
    the listing's order); rows past the end, or whose file does not decode, have valid = 0."""

    def __init__(self, files: Files, size: int, layout: Layout):
        self.files, self.size, self.layout = files, size, layout

    def __call__(self, c: int) -> dict:
        L = self.layout.local_batch
        images = np.zeros((L, 3, self.size, self.size), np.uint8)
        labels = np.zeros(L, np.int64)
        valid = np.zeros(L, np.int32)
        first = np.full(L, -1, np.int64)
        for r in range(L):
            g = self.layout.position(int(c), r)
            if g >= len(self.files):
                continue
            try:
                images[r] = eval_image(self.files.path(g), self.size)
                labels[r], valid[r] = self.files.labels[g], 1
            except Exception:
                first[r] = g
        return {"image": images, "label": labels, "valid": valid, "skipped": (first >= 0).astype(np.int32),
                "skipped_record": first}


# ---- grain datasets and iterators --------------------------------------------------------------------

class Normalised:
    """The last map, in the reading process: uint8 images -> normalised floats in the run's dtype."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    def __call__(self, element: dict) -> dict:
        # plain copies: what a worker hands over lives in shared memory, released once dropped
        return {k: normalise(v, self.dtype) if k == "image" else np.array(v) for k, v in element.items()}


def dataset(source, length: int, *, workers: int = 0, dtype: str = "float32", start: int = 0):
    """A grain dataset of `source`'s elements start … length − 1, decoded in `workers` worker
    processes (0: one background thread of this process), normalised here."""
    grain = _grain()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"pipeline: workers must be a non-negative integer, got {workers!r}")
    ds = grain.MapDataset.range(start, length).map(source)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    if workers:
        # batches travel pickled through the workers' queues, not in shared memory: a batch of 64
        # uint8 images at 224 px is 10 MB, a few ms of copying against the half second of decoding
        # it took; shared blocks still queued when a run stops were left for the resource tracker
        ds = grain.experimental.WithOptionsIterDataset(ds, grain.experimental.DatasetOptions(min_shm_size=1 << 40))
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2))
    return ds.map(Normalised(dtype))


class Reader:
    """A run's training batches: one grain iterator over every epoch, and its state.

    `state()` is the iterator's position as grain records it (with the worker count it was taken
    under); `restore(state)` puts a new iterator there. Under another worker count (a resumed run
    on another machine), grain's record does not apply and the iterator starts at the batch the
    step count names instead: the same batches either way, since nothing depends on the workers.
    """

    def __init__(self, files: Files, *, size: int, seed: int, steps_per_epoch: int, epochs: int, layout: Layout,
                 workers: int = 0, dtype: str = "float32", flip: bool = True):
        self.source = TrainBatches(files, size, seed, steps_per_epoch, check_layout("pipeline.Reader", layout), flip)
        self.length = steps_per_epoch * epochs
        self.workers, self.dtype = workers, dtype
        self._it = None
        self._start = 0
        self._step = 0

    @property
    def position(self) -> int:
        """The global step whose batch comes next."""
        return self._step

    def seek(self, step: int, state: Optional[dict] = None) -> None:
        """Read from global step `step` on: with grain's `state` when it was taken under this worker
        count (and at this step), else by position."""
        self.close()
        if state is not None and state.get("workers") == self.workers and state.get("step") == step:
            self._start = int(state["start"])
            self._it = iter(dataset(self.source, self.length, workers=self.workers, dtype=self.dtype,
                                    start=self._start))
            self._it.set_state(state["grain"])
        else:
            self._start = step
            self._it = iter(dataset(self.source, self.length, workers=self.workers, dtype=self.dtype, start=step))
        self._step = step

    def __next__(self) -> dict:
        if self._it is None:
            self.seek(self._step)
        element = next(self._it)
        self._step += 1
        return element

    def state(self) -> dict:
        """grain's state of the iterator, the step it stands at and the worker count (JSON)."""
        if self._it is None:
            self.seek(self._step)
        return {"grain": self._it.get_state(), "step": self._step, "workers": self.workers, "start": self._start}

    def close(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "close"):
            it.close()


def chunks(source, count: int, *, workers: int = 0, dtype: str = "float32") -> Iterator[dict]:
    """`count` elements of `source` in order (evaluation chunks, precise-BN batches)."""
    it = iter(dataset(source, count, workers=workers, dtype=dtype))
    try:
        yield from it
    finally:
        if hasattr(it, "close"):
            it.close()


# ---- the pipeline alone: images per second -----------------------------------------------------------

class InputRate(NamedTuple):
    workers: int
    images: int
    seconds: float
    size: int

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds

    def row(self) -> str:
        who = "in-process thread" if self.workers == 0 else f"{self.workers} worker{'s' * (self.workers != 1)}"
        return f"{who:>17}: {self.images_per_second:6.0f} images/s ({self.images} images in {self.seconds:.1f} s)"


PREFETCHED = 4     # batches a worker (or the reading thread) holds ready: its queue and its thread's buffer


def measure(listing: Listing, *, workers: int, size: int = 224, batch: int = 64, batches: int = 16,
            warmup: Optional[int] = None, seed: int = 0) -> InputRate:
    """Training batches read as a run reads them (decode, random resized crop, flip, normalise to
    float32) with `workers` worker processes: images per second over `batches` batches, taken
    after `warmup` batches read as fast as they come (default: every batch the workers can hold
    ready, and two more), so that the workers' start is behind and no batch decoded in advance
    is counted: the rate is the pipeline's own."""
    warmup = PREFETCHED * max(workers, 1) + 2 if warmup is None else warmup
    files = Files(listing)
    steps = max(1, len(files) // batch)
    epochs = -(-(warmup + batches) // steps)
    reader = Reader(files, size=size, seed=seed, steps_per_epoch=steps, epochs=epochs, layout=Layout(batch),
                    workers=workers)
    try:
        for _ in range(warmup):
            next(reader)
        tic = time.perf_counter()
        for _ in range(batches):
            next(reader)
        seconds = time.perf_counter() - tic
    finally:
        reader.close()
    return InputRate(workers, batches * batch, seconds, size)


def skipped_records(elements: Sequence[dict]) -> list[int]:
    """The records the elements skipped (their first skipped record each), in order."""
    out: list[Any] = []
    for e in elements:
        out += [int(r) for r in np.asarray(e["skipped_record"]) if r >= 0]
    return out
