"""An image folder as torchvision's `ImageFolder` reads it: one subfolder per class, JPEG or PNG files.

    PATH/train/<class>/*.jpg   and   PATH/val/<class>/*.jpg      (ImageNet's layout), or
    PATH/<class>/*.jpg                                           (split by a fixed fraction)

Class order is the sorted folder names, so label k means the same class on every host and in every
run. `read` only lists files (no decoding: ImageNet's 1.28 M files list in seconds); decoding and
augmentation are `gradtie.pipeline`'s, in worker processes. What is not an image by its name (a
`.txt` beside the photos) is counted and skipped here, and named in one line; a file that is named
like an image but does not decode is counted and skipped by the pipeline. A folder with no images,
a class folder with none, or classes that differ between train/ and val/ is a `FolderError` naming
the folder.

`write_photo_folder` writes such a folder from the shipped photos (one class per photo, random
crops saved as JPEG at a size of ImageNet's order): the tests, `gradtie bench --input` and the GPU
run read it. Nothing here imports JAX: the pipeline's worker processes import this module.

Beyond the suite: the suite states train steps, not how their batches are read.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")     # compared lower-cased, as ImageFolder's IMG_EXTENSIONS
SPLITS = ("train", "val")
VAL_FRACTION = 0.1     # a single folder's share held out for evaluation, by a hash of the file's name


class FolderError(ValueError):
    """A folder that cannot be trained on: empty, a class with no images, train/val classes differ."""


class Listing(NamedTuple):
    """One split: files (absolute paths) with their labels (indices into `classes`)."""
    root: Path
    files: tuple[str, ...]
    labels: np.ndarray          # int64 [n]

    def __len__(self) -> int:
        return len(self.files)


class Folder(NamedTuple):
    """An image folder read: its classes (sorted names), its train and val listings, how it was
    split ("folders": train/ and val/; "fraction": one folder, `VAL_FRACTION` held out), and the
    files skipped for their names (not images)."""
    path: Path
    classes: tuple[str, ...]
    train: Listing
    val: Listing
    split: str
    not_images: tuple[str, ...]

    def fingerprint(self) -> str:
        """A short SHA-256 of the classes and every file's path (relative to the folder) and size:
        a resumed run reads the same files. Sizes come from one `stat` a file."""
        h = hashlib.sha256()
        for name in self.classes:
            h.update(name.encode() + b"\0")
        for listing in (self.train, self.val):
            for f in listing.files:
                h.update(os.path.relpath(f, self.path).encode() + b"\0" + str(os.path.getsize(f)).encode())
        return h.hexdigest()[:16]

    def skipped_line(self) -> Optional[str]:
        """One line naming the first file skipped for its name, or None."""
        if not self.not_images:
            return None
        n = len(self.not_images)
        return (f"skipped {n} file{'s' * (n != 1)} that {'are' if n != 1 else 'is'} not JPEG or PNG by name "
                f"(first: {self.not_images[0]})")


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def _class_folders(root: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def _list_classes(root: Path, classes: Sequence[str]) -> tuple[list[str], list[int], list[str]]:
    """Every image under root/<class>/ (recursively, sorted), its label, and the non-images seen."""
    files, labels, others = [], [], []
    for k, name in enumerate(classes):
        found = []
        for dirpath, dirnames, names in os.walk(root / name):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for n in sorted(names):
                if n.startswith("."):
                    continue
                (found if _is_image(n) else others).append(os.path.join(dirpath, n))
        if not found:
            raise FolderError(f"image folder {str(root / name)!r}: class {name!r} holds no JPEG or PNG "
                              f"files (every class folder needs at least one)")
        files += found
        labels += [k] * len(found)
    return files, labels, others


def _held_out(relative: str, fraction: float) -> bool:
    """Whether a file goes to val in a single folder: a hash of its path inside the folder, so the
    split stays put when files are added and does not depend on the run's seed."""
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read(path, *, val_fraction: float = VAL_FRACTION) -> Folder:
    """The image folder at `path`: train/ and val/ when both are there, else one folder of class
    folders split by `val_fraction` (the files whose name hashes under it go to val).

    FolderError (a ValueError, one line naming the folder) for: no such folder, no class folders,
    a class folder without images, classes that differ between train/ and val/, an empty val split.
    """
    root = Path(path)
    if not root.is_dir():
        raise FolderError(f"image folder {str(root)!r}: no such folder")
    if not 0.0 < val_fraction < 1.0:
        raise FolderError(f"image folder {str(root)!r}: val_fraction must lie in (0, 1), got {val_fraction!r}")
    if all((root / s).is_dir() for s in SPLITS):
        train_classes, val_classes = _class_folders(root / "train"), _class_folders(root / "val")
        if train_classes != val_classes:
            only_train = sorted(set(train_classes) - set(val_classes))
            only_val = sorted(set(val_classes) - set(train_classes))
            raise FolderError(f"image folder {str(root)!r}: train/ and val/ hold different classes "
                              f"(only in train/: {only_train[:5] or 'none'}; only in val/: {only_val[:5] or 'none'})")
        if not train_classes:
            raise FolderError(f"image folder {str(root)!r} holds no images: train/ has no class folders "
                              f"(expected train/<class>/*.jpg and val/<class>/*.jpg)")
        listings, skipped = [], []
        for s in SPLITS:
            files, labels, others = _list_classes(root / s, train_classes)
            listings.append(Listing(root / s, tuple(files), np.asarray(labels, np.int64)))
            skipped += others
        return Folder(root, tuple(train_classes), *listings, "folders", tuple(skipped))
    classes = _class_folders(root)
    if not classes:
        raise FolderError(f"image folder {str(root)!r} holds no images: no class folders (expected "
                          f"<class>/*.jpg, or train/<class>/ and val/<class>/)")
    files, labels, others = _list_classes(root, classes)
    held = np.asarray([_held_out(os.path.relpath(f, root), val_fraction) for f in files], bool)
    if held.all() or not held.any():
        raise FolderError(f"image folder {str(root)!r}: {len(files)} images leave no "
                          f"{'train' if held.all() else 'val'} split at val_fraction {val_fraction:g}; "
                          f"add images, or give train/ and val/ folders")
    labels = np.asarray(labels, np.int64)
    pick = lambda mask: (tuple(f for f, m in zip(files, mask) if m), labels[mask])  # noqa: E731
    return Folder(root, tuple(classes), Listing(root, *pick(~held)), Listing(root, *pick(held)), "fraction",
                  tuple(others))


def parse_spec(spec: str) -> Optional[Path]:
    """'folder:PATH' -> PATH; anything else -> None (another dataset's name)."""
    if spec.startswith("folder:"):
        if len(spec) == len("folder:"):
            raise FolderError("--data folder:PATH needs a path after 'folder:'")
        return Path(spec[len("folder:"):]).expanduser()
    return None


# ---- a folder of JPEGs from the shipped photos ------------------------------------------------------

def _jpeg(rgb: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_photo_folder(path, *, per_class: int = 8, val_per_class: int = 2, size: tuple[int, int] = (160, 120),
                       seed: int = 0, corrupt: bool = False, split: bool = True) -> Folder:
    """Write an ImageFolder of JPEGs cut from the seven shipped photos (`data.PHOTO_NAMES`, one class
    each): `per_class` training and `val_per_class` validation images a class, each a random crop
    (a quarter to all of the photo's short side, aspect 3:4 to 4:3) resized to `size` = (width,
    height). split=False writes one folder of class folders (no train/ and val/; `read` splits it).

    corrupt=True adds what a real folder holds: a truncated JPEG and an empty .jpg in the first
    class's training images and a README.txt beside them. Returns the folder as `read` lists it.
    """
    from PIL import Image

    from . import data

    root = Path(path)
    w, h = size
    rng = np.random.default_rng(seed)
    photos = data.source_photos()
    splits = (("train", per_class), ("val", val_per_class)) if split else (("", per_class + val_per_class),)
    for s, count in splits:
        for name, photo in zip(data.PHOTO_NAMES, photos):
            folder = root / s / name
            folder.mkdir(parents=True, exist_ok=True)
            ph, pw = photo.shape[:2]
            for i in range(count):
                side = rng.uniform(0.25, 1.0) * min(ph, pw)
                aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
                cw, ch = min(pw, side * np.sqrt(aspect)), min(ph, side / np.sqrt(aspect))
                x0, y0 = rng.uniform(0, pw - cw), rng.uniform(0, ph - ch)
                img = Image.fromarray(np.round(photo * 255).astype(np.uint8))
                crop = img.resize((w, h), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
                (folder / f"{name}_{s or 'all'}_{i:05d}.jpg").write_bytes(_jpeg(np.asarray(crop)))
    if corrupt:
        first = root / ("train" if split else "") / data.PHOTO_NAMES[0]
        whole = next(iter(sorted(first.glob("*.jpg")))).read_bytes()
        (first / "broken_truncated.jpg").write_bytes(whole[: len(whole) // 3])
        (first / "broken_empty.jpg").write_bytes(b"")
        (first / "README.txt").write_text("not an image\n")
    return read(root)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """python -m gradtie.folder PATH [--per-class N] [--val-per-class N] [--size W H] [--corrupt]"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m gradtie.folder",
                                description="Write an ImageFolder of JPEGs cut from the shipped photos "
                                            "(7 classes; train/ and val/).")
    p.add_argument("path")
    p.add_argument("--per-class", type=int, default=64, help="training images a class (default 64)")
    p.add_argument("--val-per-class", type=int, default=16, help="validation images a class (default 16)")
    p.add_argument("--size", type=int, nargs=2, default=(500, 375), metavar=("W", "H"),
                   help="image size in pixels (default 500 375, ImageNet's most common)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corrupt", action="store_true", help="add a truncated JPEG, an empty one and a text file")
    a = p.parse_args(argv)
    if any(Path(a.path).glob("*")):
        p.error(f"{a.path!r} is not empty")
    f = write_photo_folder(a.path, per_class=a.per_class, val_per_class=a.val_per_class, size=tuple(a.size),
                           seed=a.seed, corrupt=a.corrupt)
    print(f"wrote {len(f.train)} training and {len(f.val)} validation images, {len(f.classes)} classes, to {f.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
