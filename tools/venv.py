"""Build the project's venv from a venv of its requirements that every clone on this machine shares.

    python3 tools/venv.py .venv

Installing requirements.txt takes most of a minute (jaxlib, scipy, scikit-learn, Sphinx…, about
34,000 files) and gives every clone the same files. So they are installed once per interpreter and
requirements.txt, into ~/.cache/gradtie/venvs/KEY (GRADTIE_VENVS moves it), with the byte code of
what the tests and the book import (pip byte-compiling all of it took 50 s more).
Each clone's venv is a copy of that one made of hard links (about a second), with its own copies of
the few files that name the venv's path (the scripts' #! lines, `activate`, pyvenv.cfg), and the
project installed editable. A changed requirements.txt (or this recipe) is a new KEY: a new shared
venv; the newest three are kept.

pip never writes into an installed file, it removes and writes anew, so `.venv/bin/pip install …`
in one clone leaves the shared files and the other clones as they were.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("GRADTIE_VENVS", Path.home() / ".cache" / "gradtie" / "venvs"))
COMPLETE = ".gradtie-requirements"   # written last: a shared venv without it is rebuilt
# imported once into the shared venv, which writes their byte code there
WARM = ("jax", "jax.numpy", "numpy", "scipy.optimize", "sklearn.datasets", "skimage.data", "skimage.transform",
        "matplotlib.pyplot", "optax", "grain", "orbax.checkpoint", "tqdm", "hypothesis", "pytest", "xdist",
        "nbval.plugin", "ipykernel.kernelapp", "papermill", "jupytext", "jupyter_book.cli.main")


KEEP = 3   # shared venvs kept (the newest); the clones' hard links keep their files alive anyway


def key() -> str:
    """The interpreter, the pinned requirements and this recipe: what the shared venv's files depend on."""
    h = hashlib.sha256()
    for part in (sys.version, sys.executable, (ROOT / "requirements.txt").read_text(), Path(__file__).read_text()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def pip(python: Path, *args: str, quiet: bool = True) -> None:
    subprocess.run([str(python), "-m", "pip", "install", *(["-q"] if quiet else []), *args], check=True)


def requirement_names() -> list[str]:
    """The names requirements.txt pins, in its order (what the first build says it installs)."""
    lines = (line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    return [re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0] for line in lines if line]


def shared_venv() -> Path:
    """The requirements' venv for this interpreter, built under a lock when missing or unfinished."""
    deps = CACHE / key()
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{deps.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (deps / COMPLETE).is_file():
            names = requirement_names()
            print(f"installing the {len(names)} requirements of requirements.txt ({', '.join(names)}) and what they "
                  f"need into {deps}: a minute or two, once for this interpreter and requirements.txt", flush=True)
            shutil.rmtree(deps, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(deps)], check=True)
            python = deps / "bin" / "python"
            pip(python, "--upgrade", "pip", "setuptools")
            # byte code only for what the tests and the book import (pip's compiling of all of it
            # took 50 s more), here so that every clone shares it; the rest compiles on first import
            pip(python, "--no-compile", "-r", str(ROOT / "requirements.txt"), quiet=False)   # pip's progress
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            subprocess.run([str(python), "-c", f"import {', '.join(WARM)}"], check=True, env=env,
                           stdout=subprocess.DEVNULL)
            (deps / COMPLETE).write_text((ROOT / "requirements.txt").read_text())
            _prune(keep=deps)
    return deps


def _prune(keep: Path) -> None:
    """Remove all but the newest KEEP shared venvs (a clone's files are hard links: they stay)."""
    built = sorted((d for d in CACHE.iterdir() if (d / COMPLETE).is_file()),
                   key=lambda d: (d / COMPLETE).stat().st_mtime, reverse=True)
    for d in built[KEEP:]:
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)
            (CACHE / f"{d.name}.lock").unlink(missing_ok=True)


def _retarget(path: Path, old: bytes, new: bytes) -> None:
    """Replace a file naming the shared venv by a copy naming this one (never written in place:
    it is a hard link into the shared venv)."""
    data = path.read_bytes()
    if old in data:
        fresh = path.with_name(path.name + ".retarget")
        fresh.write_bytes(data.replace(old, new))
        os.chmod(fresh, path.stat().st_mode)
        os.replace(fresh, path)


def build(venv: Path) -> None:
    deps = shared_venv()
    venv = venv.absolute()
    staging = venv.with_name(venv.name + ".staging")
    for d in (staging, venv):
        if d.is_symlink() or d.is_file():
            d.unlink()
        elif d.exists():
            shutil.rmtree(d)
    if subprocess.run(["cp", "-al", str(deps), str(staging)], stderr=subprocess.DEVNULL).returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)      # another file system: a plain copy
        shutil.copytree(deps, staging, symlinks=True)
    for path in [*(staging / "bin").iterdir(), staging / "pyvenv.cfg"]:
        if path.is_file() and not path.is_symlink():
            _retarget(path, os.fsencode(deps), os.fsencode(venv))
    staging.rename(venv)
    python = venv / "bin" / "python"
    # the project itself, editable; the shared venv's setuptools builds it (no isolated build env)
    pip(python, "--no-compile", "--no-deps", "--no-build-isolation", "-e", str(ROOT))
    subprocess.run([str(python), "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                   check=True, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
