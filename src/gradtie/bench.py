"""Speed and memory of the rendered step against the autodiff step, side by side in one process.

The autodiff step is the honest peer: `jax.value_and_grad` of the same forward and the same loss,
jitted the same way (data parallel: the same mesh, the same synchronised BatchNorm, the same
gradient all-reduce). `measure` compiles both once, reads XLA's compiled memory of each, then times
them interleaved in one process (drift in the machine's load hits both) and reports medians, the
ratio rendered / autodiff, images/s and, on a device with a known peak, the model FLOP utilisation.
`run` starts a fresh process per configuration, so no compilation cache or allocator state carries
from one configuration to the next.

`abstract` validates a profile without running it: every computation of the benchmark's and each
chapter's gpu profile (the chapters' from `gradtie.book.workloads`) is lowered and compiled at its
own shapes from `jax.ShapeDtypeStruct`s (no data), and XLA's memory analysis says how much device
memory it needs. Shown in: Performance.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from concurrent.futures import ThreadPoolExecutor

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from . import nets, parallel, prng, reference, rendered
from . import policy as policy_
from .fake_devices import with_host_devices
from .kit import KIT
from .ops import dense, gap, head
from .progress import bar
from .tolerances import GPU_FIT_GIB

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


# ---- what is measured -------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    net: str = "cifar8"
    batch: int = 32             # per replica
    image_size: int = 32
    bf16: bool = False
    replicas: int = 1           # 0: every local device
    repeats: int = 10
    num_classes: int = 10
    policy: str = "tie"         # the execution policy (`gradtie.policy`): tie, tf32, bf16

    def label(self) -> str:
        r = {0: " R=all", 1: ""}.get(self.replicas, f" R={self.replicas}")
        kind = "bf16 sites" if self.bf16 else {"tie": "f32", "tf32": "tf32", "bf16": "bf16"}[self.policy]
        return f"{self.net} batch {self.batch} {self.image_size}px {kind}{r}"

    @property
    def units(self) -> str:
        """The arithmetic units the step's contractions run on (`Policy.units`); the bf16 conv
        sites of the `tie` policy run as float32 convolutions on XLA's GPU backend."""
        return policy_.get(self.policy).units


# The configurations of the issue, on the CPU, f32: cifar8 at batch 32 and 128, ResNet-34 at batch
# 8 and 32 at 32 and 64 px, on one device; cifar8 and ResNet-34 (32 px) on two host devices (R = 2,
# the batch per replica).
CPU_SUITE = ([BenchConfig("cifar8", b, 32, replicas=r) for r in (1, 2) for b in (32, 128)]
             + [BenchConfig("resnet34", b, s, repeats=7) for s in (32, 64) for b in (8, 32)]
             + [BenchConfig("resnet34", b, 32, replicas=2, repeats=7) for b in (8, 32)])
QUICK_SUITE = [BenchConfig("cifar8", 32, 32, repeats=5), BenchConfig("resnet34", 8, 32, repeats=3)]
# The GPU run (benchmarks/gpu.sh): ImageNet shapes under each execution policy; R = every local device.
GPU_POLICIES = ("bf16", "tf32", "tie")
GPU_SUITE = [BenchConfig("resnet34", b, 224, replicas=0, repeats=10, num_classes=1000, policy=pol)
             for pol in GPU_POLICIES for b in (256, 64)]
SUITES = {"cpu": CPU_SUITE, "quick": QUICK_SUITE, "gpu": GPU_SUITE}


@dataclass
class BenchResult:
    config: BenchConfig
    backend: str
    rendered_ms: float                    # median ms per gradient step (forward + backward + loss)
    autodiff_ms: float
    rendered_temp_mib: Optional[float]    # XLA's compiled temporary buffers
    autodiff_temp_mib: Optional[float]
    pair_ratio: Optional[float] = None    # median over the interleaved pairs of rendered / autodiff
    rendered_total_mib: Optional[float] = None   # arguments + outputs + temporaries, compiled
    autodiff_total_mib: Optional[float] = None
    peak_mib: Optional[float] = None      # the device's peak bytes in use in this process (both steps)
    model_gflop: Optional[float] = None   # per step: 3 × the forward's multiply-adds × 2
    peak_tflops: Optional[float] = None   # the device's dense peak for the conv dtype, when known
    device_kind: str = ""
    load: tuple[float, float] = (math.nan, math.nan)  # 1-minute load average before and after
    kernels: dict = field(default_factory=dict)   # the rendered program's convolution kernels by signature

    @property
    def ratio(self) -> float:
        """rendered / autodiff: above 1 the rendered step is slower."""
        return self.rendered_ms / self.autodiff_ms

    @property
    def images_per_s(self) -> tuple[float, float]:
        """(rendered, autodiff) images per second over the global batch R·N."""
        n = self.config.batch * self.config.replicas
        return n / (self.rendered_ms / 1e3), n / (self.autodiff_ms / 1e3)

    @property
    def mfu(self) -> tuple[Optional[float], Optional[float]]:
        """Model FLOP utilisation of each step against the devices' dense peak (None when unknown)."""
        if not self.model_gflop or not self.peak_tflops:
            return None, None
        peak = self.peak_tflops * 1e12 * self.config.replicas
        return tuple(self.model_gflop * 1e9 / (ms / 1e3) / peak for ms in (self.rendered_ms, self.autodiff_ms))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ratio=self.ratio, images_per_s=list(self.images_per_s), mfu=list(self.mfu))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchResult":
        d = {k: v for k, v in d.items() if k not in ("ratio", "images_per_s", "mfu")}
        d["config"] = BenchConfig(**d["config"])
        d["load"] = tuple(d.get("load", (math.nan, math.nan)))
        d["config"] = BenchConfig(**d["config"]) if isinstance(d["config"], dict) else d["config"]
        return cls(**d)

    def row(self) -> str:
        mem = ""
        if self.rendered_temp_mib is not None and self.autodiff_temp_mib is not None:
            mem = f"  temp {self.rendered_temp_mib:8.1f} / {self.autodiff_temp_mib:8.1f} MiB"
        ips = self.images_per_s
        mfu = self.mfu
        extra = f"  MFU {mfu[0]:5.1%} / {mfu[1]:5.1%}" if mfu[0] is not None else ""
        return (f"{self.config.label():<34} rendered {self.rendered_ms:9.2f} ms  autodiff {self.autodiff_ms:9.2f} ms  "
                f"ratio {self.ratio:5.3f}  {ips[0]:8.1f} / {ips[1]:8.1f} img/s{mem}{extra}")


# ---- the two steps ----------------------------------------------------------------------------------

def net_config(config: BenchConfig, **overrides):
    net = nets.load(config.net)
    return net, net.config(bf16=config.bf16, num_classes=config.num_classes, policy=config.policy, **overrides)


def grad_fns(net, cfg) -> tuple[Callable, Callable]:
    """The rendered and the autodiff (loss, grads) functions of one device, both plain (unjitted):
    the one rendered step (`rendered.step`) and the oracle's gradient of the forward-based loss."""
    def rendered_(params, x, targets):
        out = rendered.step(net, KIT, params, x, targets, cfg)
        return out.loss, out.grads

    def autodiff(params, x, targets):
        return reference.value_and_grad(lambda p: reference.loss_at(net, p, x, targets, cfg))(params)

    return rendered_, autodiff


def mesh_grad_fns(net, cfg, mesh) -> tuple[Callable, Callable]:
    """The data-parallel steps on one mesh: each replica runs its N examples with synchronised
    BatchNorm (`gradtie.parallel.replica_config`) and divides its loss by N; the loss and the
    gradients are mean-all-reduced.

    Rendered: the data-parallel rendered step itself (`parallel.replica_step`: each stage's nodes
    all-reduced as soon as the chain has produced them). Autodiff: `jax.value_and_grad` of the global
    loss (the replica mean of each replica's loss) with respect to the replicated parameters."""
    rcfg = parallel.replica_config(cfg, True)
    axis = parallel.AXIS
    step = parallel.replica_step(net, KIT, cfg, 0.0, True, parallel.replica_count(mesh), with_dx=False)

    def rendered_(params, x, targets):
        loss, grads, _, _, _ = step(params, x, targets)
        return loss, grads

    def autodiff(params, x, targets):
        # the global loss, the replica mean; differentiating it with respect to the replicated
        # parameters all-reduces their cotangents where autodiff meets them
        return reference.value_and_grad(lambda p: lax.pmean(reference.loss_at(net, p, x, targets, rcfg), axis))(params)

    def shard(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=(P(), P()))

    return shard(rendered_), shard(autodiff)


def _mesh(config: BenchConfig):
    if len(jax.devices()) < config.replicas:
        raise ValueError(f"bench: {config.replicas} replicas need as many devices, this process has "
                         f"{len(jax.devices())} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{config.replicas})")
    return parallel.data_mesh(config.replicas)


def step_fns(config: BenchConfig) -> tuple[Callable, Callable]:
    """(rendered, autodiff) for a configuration, jitted the same way."""
    net, cfg = net_config(config)
    if config.replicas > 1:
        rendered, autodiff = mesh_grad_fns(net, cfg, _mesh(config))
    else:
        rendered, autodiff = grad_fns(net, cfg)
    return jax.jit(rendered), jax.jit(autodiff)


def placed(config: BenchConfig, args):
    """The inputs where the steps read them: on a mesh, the parameters replicated and the batch
    sharded over "data" (so no call pays for moving them)."""
    if config.replicas <= 1:
        return args
    mesh = _mesh(config)
    params, x, targets = args
    return parallel.replicate(mesh, params), *parallel.global_batch(mesh, (x, targets))


def inputs(config: BenchConfig, *, abstract: bool = False, dtype=jnp.float32):
    """(params, x, one-hot targets) of the global batch R·N; `abstract`: ShapeDtypeStructs only."""
    net, cfg = net_config(config)
    n = config.batch * config.replicas
    x_shape = (n, 3, config.image_size, config.image_size)
    if abstract:
        params = jax.eval_shape(lambda: net.init(jax.random.key(0), cfg))
        params = {k: jax.ShapeDtypeStruct(v.shape, dtype) for k, v in params.items()}
        return (params, jax.ShapeDtypeStruct(x_shape, dtype),
                jax.ShapeDtypeStruct((n, cfg.num_classes), dtype))
    key = jax.random.key(0)
    params = net.init(key, cfg, weights="drawn")
    x = prng.uniform(jax.random.fold_in(key, 1), x_shape, dtype)
    labels = prng.randint(jax.random.fold_in(key, 2), (n,), 0, cfg.num_classes)
    return params, x, jax.nn.one_hot(labels, cfg.num_classes, dtype=dtype)


# ---- model FLOPs and the device's peak --------------------------------------------------------------

def forward_flops(fn: Callable, *args) -> float:
    """FLOPs of the convolutions and matrix products in fn's jaxpr (2 per multiply-add, every tap
    of every window counted, the standard model count)."""
    def count(jaxpr) -> float:
        total = 0.0
        for eqn in jaxpr.eqns:
            out = eqn.outvars[0].aval
            if eqn.primitive.name == "conv_general_dilated":
                rhs = eqn.invars[1].aval.shape
                spec = eqn.params["dimension_numbers"].rhs_spec   # (out feature, in feature, spatial…)
                per_out = rhs[spec[1]] * math.prod(rhs[d] for d in spec[2:])
                total += 2.0 * math.prod(out.shape) * per_out
            elif eqn.primitive.name == "dot_general":
                (lhs_contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                total += 2.0 * math.prod(out.shape) * math.prod(lhs[d] for d in lhs_contract)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        total += count(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        total += count(sub)
        return total
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def model_gflop(config: BenchConfig) -> float:
    """Model GFLOP of one training step of the global batch: 3 × the forward's (the backward's
    input and weight products each match the forward's)."""
    net, cfg = net_config(config)
    params, x, _ = inputs(config, abstract=True)
    return 3 * forward_flops(lambda p, a: net.forward(p, a, cfg)[0], params, x) / 1e9


# Dense (no sparsity) peak TFLOP/s by device kind and the units a policy's contractions run on.
# Sources: NVIDIA's H100 Tensor Core GPU datasheet (SXM5: BF16 989.4, TF32 494.7, FP32 66.9; PCIe:
# 756, 378, 51.2), the H200 datasheet (the H100 SXM's compute: 989 / 495 / 67) and the A100 datasheet
# (BF16 312, TF32 156, FP32 19.5). The `tie` policy runs at Precision.HIGHEST (true float32, no TF32),
# so FP32 is its peak; `tf32` reads TF32's, `bf16` BF16's.
PEAK_TFLOPS = {  # checked in order: the first substring of the device kind that matches
    "H100 PCIe": {"BF16": 756.0, "TF32": 378.0, "FP32": 51.2},
    "H200": {"BF16": 989.0, "TF32": 495.0, "FP32": 67.0},
    "H100": {"BF16": 989.0, "TF32": 495.0, "FP32": 67.0},
    "A100": {"BF16": 312.0, "TF32": 156.0, "FP32": 19.5},
}
PEAK_SOURCE = "NVIDIA H100 / H200 / A100 datasheets, dense (no sparsity), by the policy's units"


def peak_tflops(device_kind: str, units: str) -> Optional[float]:
    """The dense peak of `units` ("BF16", "TF32", "FP32") on a device kind; None when unknown."""
    for kind, peaks in PEAK_TFLOPS.items():
        if kind.lower() in device_kind.lower():
            return peaks[units]
    return None


# ---- timing -----------------------------------------------------------------------------------------

def _compile(f: Callable, args) -> tuple[Callable, Optional[float], Optional[float]]:
    """Compile once; (executable, temporary MiB, arguments + outputs + temporaries MiB)."""
    compiled = f.lower(*args).compile()
    try:
        m = compiled.memory_analysis()
        temp = m.temp_size_in_bytes / 2**20
        total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes) / 2**20
        return compiled, temp, total
    except Exception:  # not every backend reports memory
        return compiled, None, None


_CONV_LINE = re.compile(r"custom_call_target=\"(__cudnn\$conv[^\"]*)\"")
_TYPED = re.compile(r"(bf16|f16|f32|f64)\[")


def conv_kernels(hlo_text: str) -> dict[str, int]:
    """How many convolutions of a compiled program run as each kernel, read off its optimized HLO:
    cuDNN's custom calls by target and the dtypes on their line (result first, then operands), or
    XLA's own `convolution` instructions by their dtypes."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = _CONV_LINE.search(line)
        if m:
            key = f"{m.group(1)} {'/'.join(_TYPED.findall(line.split('custom_call_target')[0])[:3])}"
        elif " convolution(" in line:
            key = f"convolution {'/'.join(_TYPED.findall(line.split('window=')[0])[:3])}"
        else:
            continue
        out[key] = out.get(key, 0) + 1
    return out


def _time(f, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return (time.perf_counter() - t0) * 1e3


def timed_ms(step: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    """`warmup` untimed calls of `step` (which waits for its own result), then the ms of `repeats`
    more, one by one."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _peak_mib() -> Optional[float]:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def measure(config: BenchConfig) -> BenchResult:
    """Median ms per step of the rendered and the autodiff gradient, interleaved, in this process."""
    if jax.config.jax_compilation_cache_dir:   # what `warm_cache` compiled, whatever its size
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if config.replicas == 0:
        config = dataclasses.replace(config, replicas=jax.local_device_count())
    before = _load()
    rendered, autodiff = step_fns(config)
    args = placed(config, inputs(config))
    rendered, r_temp, r_total = _compile(rendered, args)
    autodiff, a_temp, a_total = _compile(autodiff, args)
    try:
        kernels = conv_kernels(rendered.as_text())
    except Exception:  # a backend without the text of its executable
        kernels = {}
    for f in (rendered, autodiff):   # warm up
        _time(f, args)
    times_r, times_a = [], []
    for _ in range(config.repeats):
        times_r.append(_time(rendered, args))
        times_a.append(_time(autodiff, args))
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    return BenchResult(config, jax.default_backend(), statistics.median(times_r), statistics.median(times_a),
                       r_temp, a_temp, pair_ratio=statistics.median(r / a for r, a in zip(times_r, times_a)),
                       rendered_total_mib=r_total, autodiff_total_mib=a_total, peak_mib=_peak_mib(),
                       model_gflop=model_gflop(config), peak_tflops=peak_tflops(kind, config.units),
                       device_kind=kind, load=(before, _load()), kernels=kernels)


def _abstract_placed(config: BenchConfig):
    """The inputs' shapes, dtypes and (on a mesh) shardings, as `placed` puts them."""
    args = inputs(config, abstract=True)
    if config.replicas <= 1:
        return args
    mesh = _mesh(config)
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P(parallel.AXIS))
    params, x, targets = args
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in params.items()}
    return (params, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=data),
            jax.ShapeDtypeStruct(targets.shape, targets.dtype, sharding=data))


def warm_cache(configs: Iterable[BenchConfig], *, workers: int = 8, progress: bool = True,
               extra: Callable[[BenchConfig], list] = lambda c: []) -> float:
    """Compile both steps of every configuration, several at once, into JAX's persistent compilation
    cache (which must be on: `jax_compilation_cache_dir`); the fresh process that then measures a
    configuration loads its programs instead of compiling them. `extra(config)`: more lowered
    programs of the configuration (its peers') to compile in the same pool. Returns the seconds.

    On a GPU the compiles, not the steps, are what the benchmark's time goes to; XLA compiles in C++
    without holding Python's lock, so threads overlap them."""
    if not jax.config.jax_compilation_cache_dir:
        raise ValueError("bench.warm_cache: JAX's persistent compilation cache is off; set "
                         "JAX_COMPILATION_CACHE_DIR (benchmarks/gpu.sh does)")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    configs = [dataclasses.replace(c, replicas=jax.local_device_count()) if c.replicas == 0 else c
               for c in configs]
    lowered = []
    for c in configs:   # tracing holds Python's lock: one at a time
        args = _abstract_placed(c)
        lowered += [f.lower(*args) for f in step_fns(c)] + list(extra(c))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(bar(pool.map(lambda low: low.compile(), lowered), total=len(lowered), desc="compiling",
                 enabled=progress))
    return time.perf_counter() - t0


def _env_for(config: BenchConfig, env: Optional[dict] = None) -> dict:
    env = dict(os.environ if env is None else env)
    if config.replicas > 1:   # harmless where real accelerators provide the devices
        env["XLA_FLAGS"] = with_host_devices(env.get("XLA_FLAGS", ""), config.replicas)
    return env


def measure_in_fresh_process(config: BenchConfig, *, env: Optional[dict] = None) -> BenchResult:
    """`measure` in a new Python process (nothing cached from other configurations); with replicas
    on a CPU-only machine the process gets that many host devices."""
    out = subprocess.run([sys.executable, "-m", "gradtie.bench", json.dumps(asdict(config))],
                         capture_output=True, text=True, env=_env_for(config, env), check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark {config} failed:\n{out.stderr[-2000:]}")
    return BenchResult.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run(configs: Iterable[BenchConfig], *, progress: bool = True, fresh: bool = True,
        out: Optional[Path] = None, suite: str = "custom") -> list[BenchResult]:
    """One fresh process per configuration (or all in this one), results in order. With `out`, the
    JSON is rewritten after every configuration, so a run cut short keeps what it measured."""
    configs = list(configs)
    one = measure_in_fresh_process if fresh else measure
    results = []
    info = machine()
    for c in bar(configs, desc="benchmarks", enabled=progress):
        results.append(one(c))
        if not fresh:
            jax.clear_caches()
        if out is not None:
            info["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            write(out, results, suite=suite, machine_info=info)
    return results


# ---- results on disk --------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _jaxlib_version() -> str:
    try:
        import jaxlib
        return jaxlib.__version__
    except (ImportError, AttributeError):
        return ""


def machine() -> dict[str, Any]:
    """The machine the numbers belong to: CPU model, cores, JAX version, backend, devices, the date
    and the load average when it was asked."""
    devices = jax.devices()
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": _jaxlib_version(),
            "backend": jax.default_backend(), "devices": len(devices),
            "device_kind": getattr(devices[0], "device_kind", ""),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def write(path: Path, results: Sequence[BenchResult], *, suite: str, note: str = "",
          machine_info: Optional[dict] = None) -> Path:
    """JSON: the machine, the suite, how it was measured, and one row per configuration."""
    doc = {"suite": suite, "machine": machine_info or machine(),
           "method": ("rendered and autodiff steps compiled once each, then timed interleaved in one "
                      "process per configuration; medians over the repeats (ms per step of the global "
                      "batch); memory from XLA's compiled memory analysis"),
           "peak_flops_source": PEAK_SOURCE, "note": note,
           "results": [r.as_dict() for r in results]}
    return write_json(path, doc)


def read(path: Path) -> Optional[dict[str, Any]]:
    """A results file as written by `write`, its rows as BenchResults; None when it does not exist."""
    doc = read_json(path)
    if doc is not None:
        doc["results"] = [BenchResult.from_dict(d) for d in doc["results"]]
    return doc


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    """A results document as indented JSON (numpy scalars as floats), its folder made if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return path


def read_json(path: Path, row: Optional[Callable[[dict], Any]] = None) -> Optional[dict[str, Any]]:
    """A document `write_json` wrote; None when the file does not exist. With `row`, its "rows"
    rebuilt by it (a row type's `from_dict`)."""
    path = Path(path)
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if row is not None:
        doc["rows"] = [row(d) for d in doc["rows"]]
    return doc


# ---- abstract evaluation: compile at a profile's shapes, no data ------------------------------------

@dataclass(frozen=True)
class Workload:
    """One computation a chapter or the benchmark compiles: a net's rendered or autodiff step (or the
    head fold alone) at a dtype, global batch and image size; `replicas` > 1: on a mesh."""
    owner: str          # "benchmark" or a chapter name
    label: str
    net: str
    side: str           # "rendered", "autodiff" or "head"
    batch: int          # per replica
    image_size: int = 32
    num_classes: int = 10
    dtype: str = "float32"
    bf16: bool = False
    replicas: int = 1
    head_width: int = 512


@dataclass
class AbstractRow:
    workload: Workload
    temp_gib: float
    total_gib: float    # arguments + outputs + temporaries − aliased
    compile_s: float


GIB = 2**30


def workloads_for(owner: str, label: str, net: str, batch: int, image_size: int, num_classes: int,
                  dtype: str, **kw) -> list[Workload]:
    """A net's rendered step and its autodiff oracle, one Workload each, at the same shapes."""
    return [Workload(owner, label, net, side, batch, image_size, num_classes, dtype, **kw)
            for side in ("rendered", "autodiff")]


def benchmark_workloads(configs: Sequence[BenchConfig]) -> list[Workload]:
    # "every local device" (replicas 0) is checked per device: one replica's step at its batch
    return [w for c in configs
            for w in workloads_for("benchmark", c.label(), c.net, c.batch, c.image_size, c.num_classes,
                                   "float32", bf16=c.bf16, replicas=max(c.replicas, 1))]


def suite_workloads(profile: str) -> list[Workload]:
    """The benchmark's own computations at `profile` (gpu: its GPU suite; else the CPU suite). The
    chapters' computations are the book's (`gradtie.book.workloads`)."""
    return benchmark_workloads(GPU_SUITE if profile == "gpu" else CPU_SUITE)


def _abstract_fn(w: Workload):
    """(function, abstract arguments) of a workload; every conv site as XLA's convolution (what an
    accelerator runs), by configuration."""
    dtype = jnp.dtype(w.dtype)
    if w.side == "head":
        def fold(g, weight, bias, targets):
            pooled, _ = gap.forward(g)
            logits, _ = dense.forward(pooled, weight, bias)
            return head.cotangent(logits, targets, 0.1), reference.head_cotangent(logits, targets, 0.1)
        s = jax.ShapeDtypeStruct
        return fold, (s((w.batch, 512, 7, 7), dtype), s((w.num_classes, 512), dtype), s((w.num_classes,), dtype),
                      s((w.batch, w.num_classes), dtype))
    config = BenchConfig(w.net, w.batch, w.image_size, w.bf16, w.replicas, num_classes=w.num_classes)
    fields = {f.name for f in dataclasses.fields(nets.load(w.net).config)}
    kw = {"head_width": w.head_width} if "head_width" in fields else {}
    net, cfg = net_config(config, conv_formulation="conv", **kw)
    pair = mesh_grad_fns(net, cfg, parallel.data_mesh(w.replicas)) if w.replicas > 1 else grad_fns(net, cfg)
    fn = pair[0] if w.side == "rendered" else pair[1]
    params = jax.eval_shape(lambda: net.init(jax.random.key(0), cfg))
    params = {k: jax.ShapeDtypeStruct(v.shape, dtype) for k, v in params.items()}
    n = config.batch * config.replicas
    return fn, (params, jax.ShapeDtypeStruct((n, 3, w.image_size, w.image_size), dtype),
                jax.ShapeDtypeStruct((n, w.num_classes), dtype))


def abstract_one(w: Workload) -> AbstractRow:
    """Lower and compile one workload from shapes alone; XLA's memory analysis of the executable."""
    fn, args = _abstract_fn(w)
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return AbstractRow(w, m.temp_size_in_bytes / GIB, total / GIB, time.perf_counter() - t0)


def abstract(workloads: Sequence[Workload], *, progress: bool = True) -> list[AbstractRow]:
    """Compile every workload at its shapes (float64 workloads turn on x64 for the whole run)."""
    if any(w.dtype == "float64" for w in workloads):
        jax.config.update("jax_enable_x64", True)
    need = max([w.replicas for w in workloads] + [1])
    if len(jax.devices()) < need:
        raise ValueError(f"bench --abstract: the workloads need {need} devices, this process has "
                         f"{len(jax.devices())} (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={need})")
    return [abstract_one(w) for w in bar(list(workloads), desc="abstract compile", enabled=progress)]


def abstract_in_fresh_process(workloads: Sequence[Workload]) -> list[AbstractRow]:
    """`abstract(workloads)` in a new process with enough host devices for the meshes."""
    need = max([w.replicas for w in workloads] + [1])
    env = _env_for(BenchConfig(replicas=need))
    arg = json.dumps({"abstract": [asdict(w) for w in workloads]})
    out = subprocess.run([sys.executable, "-m", "gradtie.bench", arg], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"abstract evaluation failed:\n{out.stderr[-3000:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return [AbstractRow(Workload(**r.pop("workload")), **r) for r in rows]


def fit_table(rows: Sequence[AbstractRow], limit_gib: Optional[float] = None) -> tuple[str, bool]:
    """A table per owner: the largest computation's footprint against the limit; all fit?"""
    if limit_gib is None:
        limit_gib = GPU_FIT_GIB
    lines = [f"{'owner':<14} {'computation':<34} {'side':<8} {'dtype':<8} {'temp GiB':>9} {'total GiB':>10}"]
    ok = True
    for r in rows:
        w = r.workload
        lines.append(f"{w.owner:<14} {w.label:<34} {w.side:<8} {w.dtype if not w.bf16 else 'bf16':<8} "
                     f"{r.temp_gib:9.2f} {r.total_gib:10.2f}")
    owners = dict.fromkeys(r.workload.owner for r in rows)
    for owner in owners:
        worst = max(r.total_gib for r in rows if r.workload.owner == owner)
        fits = worst <= limit_gib
        ok &= fits
        lines.append(f"{owner:<14} largest {worst:8.2f} GiB of {limit_gib:.0f}: {'fits' if fits else 'DOES NOT FIT'}")
    return "\n".join(lines), ok


def largest_by_owner(rows: Sequence[AbstractRow]) -> dict[str, float]:
    """Per owner (chapter or benchmark), the largest footprint in GiB, in the rows' order."""
    out: dict[str, float] = {}
    for r in rows:
        out[r.workload.owner] = max(out.get(r.workload.owner, 0.0), r.total_gib)
    return out


def write_abstract(path: Path, rows: Sequence[AbstractRow], *, profile: str) -> Path:
    """The abstract compile's rows as JSON, with the machine that compiled them."""
    doc = {"profile": profile, "machine": machine(),
           "method": ("lowered and compiled from ShapeDtypeStructs (no data) on this machine's backend, "
                      "XLA's convolution at every conv site; footprint = arguments + outputs + "
                      "temporaries - aliased, from XLA's memory analysis"),
           "rows": [asdict(r) for r in rows]}
    return write_json(path, doc)


def read_abstract(path: Path) -> Optional[dict[str, Any]]:
    """A file written by `write_abstract`, its rows as AbstractRows; None when it does not exist."""
    doc = read_json(path)
    if doc is not None:
        doc["rows"] = [AbstractRow(Workload(**r["workload"]), r["temp_gib"], r["total_gib"], r["compile_s"])
                       for r in doc["rows"]]
    return doc


def verdict(results: Sequence[BenchResult], limit: float) -> list[str]:
    """The configurations that break a limit: a ratio rendered/autodiff above `limit`, or more
    compiled temporary memory than autodiff's. Empty: every configuration holds."""
    bad = []
    for r in results:
        if r.ratio > limit:
            bad.append(f"{r.config.label()}: ratio {r.ratio:.3f} > {limit}")
        if (r.rendered_temp_mib is not None and r.autodiff_temp_mib is not None
                and r.rendered_temp_mib > r.autodiff_temp_mib):
            bad.append(f"{r.config.label()}: temporary memory {r.rendered_temp_mib:.1f} MiB > "
                       f"autodiff's {r.autodiff_temp_mib:.1f} MiB")
    return bad


def _main(arg: str) -> None:
    spec = json.loads(arg)
    if "abstract" in spec:
        rows = abstract([Workload(**w) for w in spec["abstract"]], progress=False)
        print(json.dumps([asdict(r) for r in rows]))
        return
    print(json.dumps(measure(BenchConfig(**spec)).as_dict(), default=float))


if __name__ == "__main__":
    _main(sys.argv[1])
