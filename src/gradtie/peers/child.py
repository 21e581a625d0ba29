"""One peer timed in its own process: `python -m gradtie.peers '<json>'`.

The benchmark starts one such process per peer and configuration, in alternating rounds, so that
no peer's compilation, allocator or thread pool state carries into another's. The spec names the
peer and the point: {"peer", "net", "batch", "image_size", "num_classes", "repeats", "threads"}.
The inputs are the benchmark's own, float32 (`gradtie.bench.inputs`: the same parameters, images
and targets the rendered step is timed at). The process sets the thread count where the peer's
framework takes one (torch.set_num_threads; XLA sizes its own pool, which is reported), runs
WARMUP steps, times `repeats` more one by one and prints one JSON line:

    {"peer", "net", "batch", "image_size", "num_classes", "times_ms": [...], "peak_rss_mib",
     "rss_before_mib", "threads", "threads_requested", "version", "layout", "device", "dtype"}

peak_rss_mib is the process's peak resident memory (getrusage), rss_before_mib the same read
before the peer was built (the interpreter, JAX and the inputs). A peer that cannot run here
(torch not installed) prints {"peer", "skipped": why} and exits 0.

This module sits above `gradtie.bench` (it reads the benchmark's inputs); the benchmark starts it as
a process and never imports it. Shown in: Performance.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .. import bench
from . import get
from .protocol import host

FIELDS = {"peer": str, "net": str, "batch": int, "image_size": int, "num_classes": int, "repeats": int,
        "threads": (int, type(None))}
DEFAULTS = {"num_classes": 10, "repeats": 10, "threads": None}
WARMUP = 2


def peak_rss_mib() -> float:
    """The process's peak resident set, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec with its defaults, every key known and of its type."""
    unknown = set(spec) - set(FIELDS)
    if unknown:
        raise ValueError(f"peers: unknown keys {sorted(unknown)} (expected {', '.join(FIELDS)})")
    out = {**DEFAULTS, **spec}
    missing = [k for k in FIELDS if k not in out]
    if missing:
        raise ValueError(f"peers: the spec needs {', '.join(missing)}")
    for k, kind in FIELDS.items():
        if isinstance(out[k], bool) or not isinstance(out[k], kind):
            raise ValueError(f"peers: {k} must be {'an integer' if kind is not str else 'a string'}"
                             f"{' or null' if isinstance(kind, tuple) else ''}, got {out[k]!r}")
    if out["repeats"] < 1:
        raise ValueError(f"peers: repeats must be at least 1, got {out['repeats']}")
    return out


def measure(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Build the peer at the benchmark's float32 inputs, warm it up, time `repeats` steps."""
    s = parse(spec)
    peer = get(s["peer"])
    ok, why = peer.available()
    if not ok:
        return {"peer": peer.name, "skipped": why}
    threads = peer.threads(s["threads"])
    config = bench.BenchConfig(s["net"], s["batch"], s["image_size"], repeats=s["repeats"],
                               num_classes=s["num_classes"])
    params, x, targets = bench.inputs(config)
    params, x, targets = host(params, np.float32), np.asarray(x), np.asarray(targets)
    before = peak_rss_mib()
    prepared = peer.make(s["net"], params, x, targets, num_classes=s["num_classes"], dtype="float32")
    times = bench.timed_ms(prepared.step, s["repeats"], WARMUP)
    return {"peer": peer.name, "net": s["net"], "batch": s["batch"], "image_size": s["image_size"],
            "num_classes": s["num_classes"], "times_ms": times, "peak_rss_mib": peak_rss_mib(),
            "rss_before_mib": before, "threads": threads, "threads_requested": s["threads"],
            "version": peer.version(), "layout": peer.layout, "device": peer.device(), "dtype": "float32"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: python -m gradtie.peers '{\"peer\": \"torch\", \"net\": \"cifar8\", \"batch\": 64, "
              "\"image_size\": 32, \"num_classes\": 10, \"repeats\": 10, \"threads\": 2}'", file=sys.stderr)
        return 2
    try:
        out = measure(json.loads(args[0]))
    except ValueError as e:   # a bad spec (json.JSONDecodeError is one too)
        print(f"python -m gradtie.peers: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0
