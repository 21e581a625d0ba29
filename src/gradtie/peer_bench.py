"""The rendered step against what a user would pick instead, on one machine, in one run.

Five sides per configuration, each timed in a process of its own (nothing compiled, cached or
allocated by one side reaches another), with the same thread count, in alternating rounds:

- "rendered": gradtie's rendered step (`gradtie.rendered.step`, jitted);
- "autodiff": `jax.value_and_grad` through gradtie's own forward (the same conv formulation);
- "jax-nchw", "jax-nhwc": the step a JAX user writes without gradtie, `lax.conv_general_dilated`
  and `reduce_window` in either layout (`gradtie.peers.plain_jax`); the faster one is the peer;
- "torch": PyTorch eager, torchvision's ResNet-34 or a cifar8-BN module (`gradtie.peers.torch_eager`),
  run only where PyTorch is installed (requirements-peers.txt); otherwise its column says so.

Every peer is first checked to compute the same loss and gradients as gradtie's oracle at the same
drawn weights, in float64 (`gradtie.peers.agreement`): a fast peer is also a correct one. The
practical peak is one large float32 matrix product (`MATMUL_N`³), timed in its own process in every
round; each side's achieved GFLOP/s (the model's FLOPs per step over its median time) is reported
as a fraction of it. Medians over each process's repeats, then over the rounds; the pairwise ratio
rendered / peer is the median of the per-round ratios. Shown in: Performance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .progress import bar

SIDES = ("rendered", "autodiff", "jax-nchw", "jax-nhwc", "torch")
PEERS = ("jax-nchw", "jax-nhwc", "torch")
MATMUL_N = 2048
GOAL = 0.95          # the rendered step's time over each peer's, at most
LIMIT_GOAL = 0.5     # ResNet-34 at batch 32, 64 px: this fraction of the matrix product's rate


@dataclass(frozen=True)
class PeerConfig:
    net: str = "cifar8"
    batch: int = 32
    image_size: int = 32
    num_classes: int = 10
    repeats: int = 5

    def label(self) -> str:
        return f"{self.net} batch {self.batch} {self.image_size}px"


# The CPU configurations: cifar8 at batch 32, 64, 128; ResNet-34 at batch 8 and 32 at 64 px
# and batch 8 at 224 px (the suite's resolution). 128 px fills in the image-size axis of the plots.
PEER_SUITE = ([PeerConfig("cifar8", b, 32, repeats=7) for b in (32, 64, 128)]
              + [PeerConfig("resnet34", b, 64) for b in (8, 32)]
              + [PeerConfig("resnet34", 8, 128, repeats=4), PeerConfig("resnet34", 8, 224, repeats=3)])
PEER_QUICK = [PeerConfig("cifar8", 32, 32, repeats=3), PeerConfig("resnet34", 8, 64, repeats=2)]
# The GPU run (benchmarks/gpu.sh): ImageNet shapes for ResNet-34, a large cifar8 batch.
PEER_GPU = [PeerConfig("resnet34", 64, 224, num_classes=1000, repeats=10), PeerConfig("cifar8", 256, 32, repeats=20)]
# where each net's peer is checked against the oracle: (batch, image side)
AGREEMENT_POINT = {"cifar8": (4, 32), "resnet34": (2, 64)}
PEER_SUITES = {"peers": PEER_SUITE, "peers-quick": PEER_QUICK, "peers-gpu": PEER_GPU}


# ---- one side in this process ------------------------------------------------------------------

def _bench_config(config: PeerConfig):
    from . import bench
    return bench.BenchConfig(config.net, config.batch, config.image_size, num_classes=config.num_classes,
                             repeats=config.repeats)


def measure_gradtie_side(side: str, config: PeerConfig) -> dict[str, Any]:
    """Time gradtie's rendered step or autodiff through its forward, float32, in this process:
    compile, two warm-up steps, then `repeats` timed steps."""
    import jax
    from . import bench
    from .peers import child   # the peers' own warm-up and memory reading, so every side is timed alike
    bc = _bench_config(config)
    rendered, autodiff = bench.step_fns(bc)
    args = bench.inputs(bc)
    t0 = time.perf_counter()
    compiled, temp, total = bench._compile(rendered if side == "rendered" else autodiff, args)
    compile_s = time.perf_counter() - t0
    times = bench.timed_ms(lambda: jax.block_until_ready(compiled(*args)), config.repeats, child.WARMUP)
    return {"side": side, "times_ms": times, "peak_rss_mib": child.peak_rss_mib(), "temp_mib": temp,
            "compile_s": compile_s, "threads": os.cpu_count(), "version": f"jax {jax.__version__}"}


def measure_matmul(n: int = MATMUL_N, repeats: int = 10) -> dict[str, Any]:
    """GFLOP/s of one jitted n×n·n×n float32 product at full precision: the machine's practical peak."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    from . import bench
    f = jax.jit(lambda x, y: lax.dot(x, y, precision=lax.Precision.HIGHEST))
    times = bench.timed_ms(lambda: jax.block_until_ready(f(a, b)), repeats, 2)
    return {"side": "matmul", "n": n, "gflops": 2 * n ** 3 / (statistics.median(times) / 1e3) / 1e9,
            "times_ms": times}


# ---- one side in a fresh process ---------------------------------------------------------------

def _run_child(module: str, spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", module, json.dumps(spec)], capture_output=True, text=True,
                         timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{module} {spec} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_side(side: str, config: PeerConfig) -> dict[str, Any]:
    """One side of one configuration in a fresh process: its times, peak memory and version, or
    {"skipped": reason} where the peer is not installed."""
    if side not in SIDES:
        raise ValueError(f"peer bench: side must be one of {', '.join(SIDES)}, got {side!r}")
    if side in ("rendered", "autodiff"):
        return _run_child("gradtie.peer_bench", {"side": side, **asdict(config)})
    return _run_child("gradtie.peers", {"peer": side, "net": config.net, "batch": config.batch,
                                        "image_size": config.image_size, "num_classes": config.num_classes,
                                        "repeats": config.repeats, "threads": os.cpu_count()})


def check_peer(peer: str, net: str) -> dict[str, Any]:
    """The peer's float64 loss and gradients against gradtie's oracle at drawn weights, in a fresh
    process: {"ok", "describe"} or {"skipped"}."""
    return _run_child("gradtie.peer_bench", {"check": peer, "net": net})


def _check_here(peer: str, net: str) -> dict[str, Any]:
    import jax
    jax.config.update("jax_enable_x64", True)   # this process only checks: the oracle is float64
    from . import peers
    ok, reason = peers.available(peer)
    if not ok:
        return {"peer": peer, "net": net, "skipped": reason}
    batch, size = AGREEMENT_POINT[net]
    a = peers.agreement(peer, net, batch=batch, image_size=size, num_classes=10, seed=0)
    return {"peer": peer, "net": net, "ok": bool(a.ok), "describe": a.describe()}


# ---- the run -----------------------------------------------------------------------------------

@dataclass
class SideResult:
    side: str
    ms: Optional[float]                 # median over the rounds of each round's median
    round_ms: list[float] = field(default_factory=list)
    peak_rss_mib: Optional[float] = None
    temp_mib: Optional[float] = None
    version: str = ""
    layout: str = ""
    skipped: str = ""


@dataclass
class PeerRow:
    config: PeerConfig
    sides: dict[str, SideResult]
    model_gflop: float
    matmul_gflops: float                # this run's practical peak, median over its rounds

    def ms(self, side: str) -> Optional[float]:
        r = self.sides.get(side)
        return None if r is None or r.skipped else r.ms

    def plain_jax(self) -> Optional[str]:
        """The faster plain-JAX layout: the peer a JAX user would keep."""
        ran = [s for s in ("jax-nchw", "jax-nhwc") if self.ms(s) is not None]
        return min(ran, key=self.ms) if ran else None

    def ratio(self, peer: str) -> Optional[float]:
        """Median over the rounds of rendered / peer (same round, so drift hits both)."""
        r, p = self.sides.get("rendered"), self.sides.get(peer)
        if r is None or p is None or p.skipped or r.skipped or not p.round_ms:
            return None
        return statistics.median(a / b for a, b in zip(r.round_ms, p.round_ms))

    def limit_fraction(self, side: str = "rendered") -> Optional[float]:
        ms = self.ms(side)
        if ms is None or not self.matmul_gflops:
            return None
        return self.model_gflop / (ms / 1e3) / self.matmul_gflops

    def as_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "sides": {k: asdict(v) for k, v in self.sides.items()},
                "model_gflop": self.model_gflop, "matmul_gflops": self.matmul_gflops,
                "plain_jax": self.plain_jax(),
                "ratios": {p: self.ratio(p) for p in ("autodiff", *PEERS)},
                "limit_fraction": {s: self.limit_fraction(s) for s in self.sides}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PeerRow":
        return cls(PeerConfig(**d["config"]), {k: SideResult(**v) for k, v in d["sides"].items()},
                   d["model_gflop"], d["matmul_gflops"])


def model_gflop(config: PeerConfig) -> float:
    from . import bench
    return bench.model_gflop(_bench_config(config))


def run(configs: Iterable[PeerConfig], *, rounds: int = 3, sides: Sequence[str] = SIDES,
        progress: bool = True, out: Optional[Path] = None) -> dict[str, Any]:
    """Every configuration: each side in its own process, `rounds` alternating rounds (the side
    order rotates each round), the matrix product timed once per round. With `out`, the JSON is
    rewritten after every configuration, so a run cut short keeps what it measured."""
    from . import bench
    configs = list(configs)
    if rounds < 1:
        raise ValueError(f"peer bench: rounds must be at least 1, got {rounds}")
    doc: dict[str, Any] = {"machine": bench.machine(), "rounds": rounds, "method": __doc__.split("\n\n")[1],
                           "checks": [], "rows": []}
    for peer in (s for s in sides if s in PEERS):
        for net in dict.fromkeys(c.net for c in configs):
            doc["checks"].append(check_peer(peer, net))
    wrong = [c for c in doc["checks"] if not c.get("skipped") and not c["ok"]]
    if wrong:
        raise RuntimeError("peer bench: a peer does not compute gradtie's loss and gradients, so its time "
                           "means nothing:\n" + "\n".join(c["describe"] for c in wrong))
    skip = {(c["peer"], c["net"]): c["skipped"] for c in doc["checks"] if c.get("skipped")}
    steps = [(c, r) for c in configs for r in range(rounds)]
    matmul = []
    per: dict[PeerConfig, dict[str, list[dict]]] = {c: {s: [] for s in sides} for c in configs}
    for c, r in bar(steps, desc="peer rounds", enabled=progress):
        matmul.append(_run_child("gradtie.peer_bench", {"matmul": MATMUL_N})["gflops"])
        order = list(sides[r % len(sides):]) + list(sides[:r % len(sides)])
        for side in order:
            if (side, c.net) in skip:
                per[c][side].append({"skipped": skip[(side, c.net)]})
                continue
            per[c][side].append(measure_side(side, c))
        if r == rounds - 1:
            doc["rows"].append(_row(c, per[c], statistics.median(matmul[-rounds:])).as_dict())
            doc["matmul_gflops"] = statistics.median(matmul)
            if out is not None:
                write(out, doc)
    doc["matmul_gflops"] = statistics.median(matmul) if matmul else math.nan
    if out is not None:
        write(out, doc)
    return doc


def _row(config: PeerConfig, runs: dict[str, list[dict]], matmul_gflops: float) -> PeerRow:
    sides = {}
    for side, results in runs.items():
        skipped = next((r["skipped"] for r in results if r.get("skipped")), "")
        if skipped:
            sides[side] = SideResult(side, None, skipped=skipped)
            continue
        round_ms = [statistics.median(r["times_ms"]) for r in results]
        sides[side] = SideResult(side, statistics.median(round_ms), round_ms,
                                 max(r.get("peak_rss_mib") or 0.0 for r in results) or None,
                                 results[0].get("temp_mib"), results[0].get("version", ""),
                                 results[0].get("layout", ""))
    return PeerRow(config, sides, model_gflop(config), matmul_gflops)


# ---- results on disk and the verdict -----------------------------------------------------------

def write(path: Path, doc: dict[str, Any]) -> Path:
    from . import bench
    return bench.write_json(path, doc)


def read(path: Path) -> Optional[dict[str, Any]]:
    """A results file as `run` writes it, its rows as PeerRows; None when it does not exist."""
    from . import bench
    return bench.read_json(path, PeerRow.from_dict)


def verdict(rows: Sequence[PeerRow], goal: float = GOAL) -> list[str]:
    """Where the rendered step is not at most `goal` × a peer's time (the faster plain-JAX layout
    stands for plain JAX; a peer that did not run is named as such). Empty: ahead everywhere."""
    bad = []
    for row in rows:
        for peer in ("plain", "torch"):
            side = row.plain_jax() if peer == "plain" else "torch"
            name = "plain JAX" if peer == "plain" else "PyTorch eager"
            if side is None or row.ms(side) is None:
                bad.append(f"{row.config.label()}: {name} not run")
                continue
            ratio = row.ratio(side)
            if ratio > goal:
                bad.append(f"{row.config.label()}: rendered / {name} = {ratio:.2f} > {goal}")
    return bad


def scaled(rows: Sequence[PeerRow], factors: dict[str, float]) -> list[PeerRow]:
    """The rows with each named side's times multiplied by its factor: the verdict's controls (a
    rendered step twice as slow must be behind everywhere)."""
    out = []
    for row in rows:
        sides = {}
        for name, r in row.sides.items():
            f = factors.get(name, 1.0)
            sides[name] = dataclasses.replace(r, ms=None if r.ms is None else r.ms * f,
                                              round_ms=[t * f for t in r.round_ms])
        out.append(PeerRow(row.config, sides, row.model_gflop, row.matmul_gflops))
    return out


def table(rows: Sequence[PeerRow]) -> str:
    """Markdown: median ms per step of every side, the pairwise ratios, GFLOP/s as a fraction of the
    matrix product's."""
    head = ("| configuration | rendered ms | autodiff ms | plain JAX ms (layout) | PyTorch eager ms "
            "| rendered / autodiff | rendered / plain JAX | rendered / PyTorch | rendered of matmul peak |")
    lines = [head, "|" + "---|" * 9]
    for row in rows:
        pj = row.plain_jax()

        def ms(side):
            v = row.ms(side) if side else None
            return "not run" if v is None else f"{v:.1f}"

        def ratio(side):
            v = row.ratio(side) if side else None
            return "—" if v is None else f"{v:.2f}"
        frac = row.limit_fraction()
        lines.append(f"| {row.config.label()} | {ms('rendered')} | {ms('autodiff')} | "
                     f"{ms(pj)}{f' ({pj[4:].upper()})' if pj else ''} | {ms('torch')} | {ratio('autodiff')} | "
                     f"{ratio(pj)} | {ratio('torch')} | {'—' if frac is None else f'{frac:.2f}'} |")
    return "\n".join(lines)


def _main(arg: str) -> None:
    spec = json.loads(arg)
    if "matmul" in spec:
        print(json.dumps(measure_matmul(spec["matmul"])))
    elif "check" in spec:
        print(json.dumps(_check_here(spec["check"], spec["net"])))
    else:
        side = spec.pop("side")
        print(json.dumps(measure_gradtie_side(side, PeerConfig(**spec)), default=float))


if __name__ == "__main__":
    _main(sys.argv[1])
