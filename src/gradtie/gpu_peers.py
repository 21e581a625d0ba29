"""What users run on a GPU instead of gradtie, under each execution policy, in the same run.

For each benchmark configuration (`bench.GPU_SUITE`: ResNet-34 at 224 px, 1000 classes, batch 64
and 256, policies bf16, tf32 and tie) two peers, each timed in a fresh process of its own:

| policy | plain JAX (`peers.plain_jax`, NHWC, autodiff)      | PyTorch eager (`peers.torch_eager`)       |
|--------|-----------------------------------------------------|-------------------------------------------|
| `bf16` | bf16 activations and conv operands, float32 params  | bf16 autocast, channels_last               |
| `tf32` | float32 at default precision (TF32 convolutions)    | float32, TF32 on (PyTorch's default)       |
| `tie`  | float32 at HIGHEST (true float32)                   | float32, TF32 off                          |

The plain-JAX programs compile into JAX's persistent cache beside the rendered and autodiff ones
(`programs`, `bench.warm_cache`'s pool), so each process loads them. PyTorch runs where it is
installed (its column says "not run" otherwise), in a process that keeps JAX on the CPU (JAX would
take most of the GPU's memory before PyTorch asked for any). Results: `benchmarks/results/
peers_gpu.json`; `goals` reads them with `gpu.json` against the rendered step. Shown in: Performance.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from .progress import bar

PLAIN = {"bf16": ("DEFAULT", "bfloat16"), "tf32": ("DEFAULT", "float32"), "tie": ("HIGHEST", "float32")}
TORCH = {"bf16": "bf16-cl", "tf32": "tf32", "tie": "fp32"}
SIDES = ("plain-jax", "torch")
WARMUP = 3
# The goals: the rendered step at most this fraction of a peer's time
GOAL = 0.95
TIE_GOAL = 1.05      # the tie policy against PyTorch with TF32 off


def describe(side: str, policy: str) -> str:
    if side == "plain-jax":
        precision, compute = PLAIN[policy]
        return f"plain JAX, {'bf16' if compute == 'bfloat16' else 'float32'} at {precision}"
    from .peers import torch_eager
    return f"PyTorch eager, {torch_eager.VARIANTS[TORCH[policy]]}"


def plain_step(config) -> tuple[Callable, tuple]:
    """(the jitted plain-JAX step, its arguments on the device) at a benchmark configuration's inputs."""
    import numpy as np

    from . import bench
    from .peers import plain_jax
    params, x, targets = bench.inputs(config)
    precision, compute = PLAIN[config.policy]
    p = plain_jax.make(config.net, {k: np.asarray(v) for k, v in params.items()}, np.asarray(x), np.asarray(targets),
                       num_classes=config.num_classes, layout="NHWC", precision=precision, compute=compute)
    return p.fn, p.args


def programs(config) -> list:
    """The plain-JAX step lowered at the configuration's inputs (for `bench.warm_cache`)."""
    fn, args = plain_step(config)   # a partial of the jitted step, its layout static
    return [fn.func.lower(*args, **fn.keywords)]


def measure(side: str, config) -> dict[str, Any]:
    """One peer at one configuration, in this process: build, warm up, time `config.repeats` steps."""
    from . import bench
    t0 = time.perf_counter()
    if side == "plain-jax":
        import jax
        if jax.config.jax_compilation_cache_dir:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        fn, args = plain_step(config)
        step = lambda: jax.block_until_ready(fn(*args))   # noqa: E731
        version, device = f"jax {jax.__version__}", getattr(jax.devices()[0], "device_kind", "")
    elif side == "torch":
        from .peers import torch_eager
        ok, why = torch_eager.available()
        if not ok:
            return {"side": side, "policy": config.policy, "skipped": why}
        params, x, targets = bench.inputs(config)
        import numpy as np
        prepared = torch_eager.make(config.net, {k: np.asarray(v) for k, v in params.items()}, np.asarray(x),
                                    np.asarray(targets), num_classes=config.num_classes,
                                    variant=TORCH[config.policy])
        step, version, device = prepared.step, torch_eager.version(), torch_eager.device()
    else:
        raise ValueError(f"gpu peers: side must be one of {', '.join(SIDES)}, got {side!r}")
    built = time.perf_counter() - t0
    times = bench.timed_ms(step, config.repeats, WARMUP)
    return {"side": side, "policy": config.policy, "describe": describe(side, config.policy), "times_ms": times,
            "ms": statistics.median(times), "build_s": built, "version": version, "device": device}


def _child(side: str, config) -> dict[str, Any]:
    env = dict(os.environ)
    if side == "torch":
        env["JAX_PLATFORMS"] = "cpu"   # the inputs are drawn on the CPU; the GPU is PyTorch's
    spec = json.dumps({"side": side, "config": asdict(config)})
    out = subprocess.run([sys.executable, "-m", "gradtie.gpu_peers", spec], capture_output=True, text=True,
                         env=env, check=False, timeout=600)
    if out.returncode != 0:
        return {"side": side, "policy": config.policy, "error": out.stderr[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(configs: Iterable, *, sides: Sequence[str] = SIDES, progress: bool = True,
        out: Optional[Path] = None) -> dict[str, Any]:
    """Every configuration's peers, each in a fresh process; the JSON rewritten after each."""
    from . import bench
    doc: dict[str, Any] = {"machine": bench.machine(), "method": __doc__.split("\n\n")[1], "rows": []}
    for config in bar(list(configs), desc="GPU peers", enabled=progress):
        row = {"config": asdict(config), "sides": {side: _child(side, config) for side in sides}}
        doc["rows"].append(row)
        if out is not None:
            bench.write_json(out, doc)
    return doc


def run_all(out: Path, peers_out: Path, *, configs: Optional[Sequence] = None, progress: bool = True,
            sides: Sequence[str] = SIDES) -> dict[str, Any]:
    """The GPU run in one call (`benchmarks/gpu.sh`): every program of every configuration compiled
    at once into the persistent cache, then each configuration's rendered and autodiff steps in a
    fresh process (`bench.run`, written to `out`), each peer in a fresh process (`run`, written to
    `peers_out`), and what the backend keeps of a bf16 rounding with and without excess precision
    (written into `peers_out` too). Returns {"results", "peers", "rows", "goals", "compile_s"}."""
    from . import bench
    configs = list(bench.GPU_SUITE if configs is None else configs)
    t0 = time.perf_counter()
    compile_s = bench.warm_cache(configs, progress=progress,
                                 extra=programs if "plain-jax" in sides else (lambda c: []))
    results = bench.run(configs, progress=progress, out=out, suite="gpu")
    doc = run(configs, sides=sides, progress=progress, out=peers_out)
    doc["rounding"] = [excess_precision(""), excess_precision("--xla_allow_excess_precision=false")]
    doc["compile_s"], doc["total_s"] = compile_s, time.perf_counter() - t0
    bench.write_json(peers_out, doc)
    rows = goal_rows(results, doc)
    return {"results": results, "peers": doc, "rows": rows, "goals": goals(rows), "compile_s": compile_s}


# ---- the goals -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GoalRow:
    """The rendered step at one configuration against each peer (None: that side did not run)."""
    label: str
    policy: str
    batch: int
    rendered_ms: float
    autodiff_ms: float
    peers_ms: dict
    images: int

    def ratio(self, side: str) -> Optional[float]:
        ms = self.peers_ms.get(side)
        return None if ms is None else self.rendered_ms / ms

    def images_per_s(self, ms: Optional[float]) -> Optional[float]:
        return None if ms is None else self.images / (ms / 1e3)


def goal_rows(results: Sequence, peers_doc: dict[str, Any]) -> list[GoalRow]:
    """`bench.BenchResult`s (gpu.json) joined with the peers' rows (peers_gpu.json) by configuration."""
    by = {(r["config"]["policy"], r["config"]["batch"]): r["sides"] for r in peers_doc["rows"]}
    out = []
    for r in results:
        c = r.config
        sides = by.get((c.policy, c.batch), {})
        peers_ms = {s: v.get("ms") for s, v in sides.items() if v.get("ms") is not None}
        out.append(GoalRow(c.label(), c.policy, c.batch, r.rendered_ms, r.autodiff_ms, peers_ms,
                           c.batch * max(c.replicas, 1)))
    return out


def goals(rows: Sequence[GoalRow]) -> list[str]:
    """The issue's goals the rows miss (empty: every goal met): bf16 and tf32 at most GOAL × each
    peer of their own precision; tie at most TIE_GOAL × PyTorch with TF32 off. A peer that did not
    run is named as such."""
    bad = []
    for row in rows:
        wanted = ("plain-jax", "torch") if row.policy in ("bf16", "tf32") else ("torch",)
        limit = GOAL if row.policy in ("bf16", "tf32") else TIE_GOAL
        for side in wanted:
            ratio = row.ratio(side)
            if ratio is None:
                bad.append(f"{row.label}: {side} not run")
            elif ratio > limit:
                bad.append(f"{row.label}: rendered / {side} = {ratio:.2f} > {limit}")
    return bad


def table(rows: Sequence[GoalRow]) -> str:
    """Markdown: ms (img/s) of the rendered step, autodiff of its forward and each peer, and the ratios."""
    def cell(row: GoalRow, ms: Optional[float]) -> str:
        return "not run" if ms is None else f"{ms:.1f} ({row.images_per_s(ms):,.0f})"

    def ratio(value: Optional[float]) -> str:
        return "—" if value is None else f"{value:.2f}"

    lines = ["| configuration | rendered ms (img/s) | autodiff | plain JAX | PyTorch | rendered / plain JAX "
             "| rendered / PyTorch |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.label} | {cell(row, row.rendered_ms)} | {cell(row, row.autodiff_ms)} | "
                     f"{cell(row, row.peers_ms.get('plain-jax'))} | {cell(row, row.peers_ms.get('torch'))} | "
                     f"{ratio(row.ratio('plain-jax'))} | {ratio(row.ratio('torch'))} |")
    return "\n".join(lines)


# ---- what XLA's GPU backend keeps of a rounding ------------------------------------------------------

def excess_precision(flags: str) -> dict[str, Any]:
    """In a fresh process with XLA_FLAGS=`flags`: does a jitted f32→bf16→f32 cast pair still round,
    and does the bf16 policy's conv site (bf16 × bf16 → bf16) equal float32 accumulation rounded
    once (`checks.bf16.kinds`)?"""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    out = subprocess.run([sys.executable, "-m", "gradtie.gpu_peers", json.dumps({"rounding": flags})],
                         capture_output=True, text=True, env=env, check=False, timeout=300)
    if out.returncode != 0:
        return {"flags": flags, "error": out.stderr[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rounding_here(flags: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .checks.bf16 import kinds
    from .ops import conv
    x = jax.random.normal(jax.random.key(0), (4, 64, 28, 28), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 64, 3, 3), jnp.float32) / 24
    pair = kinds.hlo_cast_roundtrip(x)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    site = jax.jit(lambda a, b: conv.forward(a, b, formulation="conv", precision=jax.lax.Precision.DEFAULT)[0])
    y = np.asarray(site(xb, wb).astype(jnp.float32))
    acc = jax.jit(lambda a, b: conv.forward(a.astype(jnp.float32), b.astype(jnp.float32), formulation="conv")[0])
    rounded = np.asarray(acc(xb, wb).astype(jnp.bfloat16).astype(jnp.float32))
    return {"flags": flags, "backend": jax.default_backend(), "cast_pair_rounds": pair.rounds,
            "cast_pair_converts": pair.converts, "bf16_site_is_rounded_f32": bool(np.array_equal(y, rounded)),
            "bf16_site_max_ulps_from_rounded_f32": float(np.max(np.abs(y - rounded) / np.maximum(
                np.abs(rounded) * 2.0 ** -8, 1e-30)))}


def _main(arg: str) -> None:
    from . import bench
    spec = json.loads(arg)
    if "rounding" in spec:
        print(json.dumps(_rounding_here(spec["rounding"]), default=float))
        return
    config = bench.BenchConfig(**spec["config"])
    print(json.dumps(measure(spec["side"], config), default=float))


if __name__ == "__main__":
    _main(sys.argv[1])
