"""Speed and memory of the rendered step against the autodiff step, side by side in one process.

`measure` times both gradient computations of one configuration in the same process, interleaved
(so drift in the machine's load hits both), and reports medians, the ratio and the compiled
temporary memory of each. `run` starts a fresh process per configuration, so no compilation cache
or allocator state carries from one configuration to the next. Shown in: Performance.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class BenchConfig:
    net: str = "cifar8"
    batch: int = 32
    image_size: int = 32
    bf16: bool = False
    replicas: int = 1
    repeats: int = 10


@dataclass
class BenchResult:
    config: BenchConfig
    backend: str
    rendered_ms: float      # median ms per gradient step (forward + backward)
    autodiff_ms: float
    rendered_temp_mib: Optional[float]   # XLA's compiled temporary buffers
    autodiff_temp_mib: Optional[float]

    @property
    def ratio(self) -> float:
        """rendered / autodiff: above 1 the rendered step is slower."""
        return self.rendered_ms / self.autodiff_ms

    def row(self) -> str:
        c = self.config
        mem = ""
        if self.rendered_temp_mib is not None and self.autodiff_temp_mib is not None:
            mem = f"  temp {self.rendered_temp_mib:8.1f} / {self.autodiff_temp_mib:8.1f} MiB"
        return (f"{c.net:<9} batch {c.batch:>4} {c.image_size:>4}px {'bf16' if c.bf16 else 'f32 ':<4} "
                f"R={c.replicas}  rendered {self.rendered_ms:9.2f} ms  autodiff {self.autodiff_ms:9.2f} ms  "
                f"ratio {self.ratio:5.2f}{mem}")


def _net(name: str):
    from .checks.check import net_module
    return net_module(name)


def _grad_fns(net, cfg):
    """The rendered and the autodiff loss-and-gradient functions, both jitted."""
    from . import reference

    def rendered(params, x, targets):
        return net.loss_and_grads(params, x, targets, cfg)

    def autodiff(params, x, targets):
        def loss(p):
            logits, _ = net.forward(p, x, cfg)
            return reference.smoothed_cross_entropy(logits, targets)
        return jax.value_and_grad(loss)(params)

    return jax.jit(rendered), jax.jit(autodiff)


def _mesh_grad_fns(net, cfg, mesh):
    """The data-parallel rendered step (`gradtie.parallel`) and its autodiff peer on the same mesh:
    each replica differentiates its own loss (synchronised BatchNorm inside), then a mean all-reduce."""
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from . import parallel, reference
    rcfg = parallel.replica_config(cfg, True)

    def replica(params, x, targets):
        def loss(p):
            logits, _ = net.forward(p, x, rcfg)
            return reference.smoothed_cross_entropy(logits, targets)
        value, grads = jax.value_and_grad(loss)(params)
        return lax.pmean(value, parallel.AXIS), lax.pmean(grads, parallel.AXIS)

    autodiff = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P(parallel.AXIS), P(parallel.AXIS)),
                                     out_specs=(P(), P())))
    def rendered(p, a, t):  # already compiled inside `parallel` (its input checks need concrete values)
        return parallel.loss_and_grads(net, p, a, t, cfg, mesh=mesh)
    return rendered, autodiff


def _temp_mib(f, *args) -> Optional[float]:
    try:
        stats = f.lower(*args).compile().memory_analysis()
        return stats.temp_size_in_bytes / 2**20
    except Exception:  # not every backend reports memory; a plain function has no `lower`
        return None


def _time(f, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return (time.perf_counter() - t0) * 1e3


def measure(config: BenchConfig) -> BenchResult:
    """Median ms per step of the rendered and the autodiff gradient, interleaved, in this process."""
    net = _net(config.net)
    kwargs = {"num_classes": 10} if config.net == "resnet34" else {}
    cfg = net.Config(bf16=config.bf16, **kwargs)
    key = jax.random.key(0)
    params = net.init(key, cfg)
    n = config.batch * config.replicas
    x = jax.random.uniform(jax.random.fold_in(key, 1), (n, 3, config.image_size, config.image_size))
    labels = jax.random.randint(jax.random.fold_in(key, 2), (n,), 0, cfg.num_classes)
    targets = jax.nn.one_hot(labels, cfg.num_classes, dtype=jnp.float32)
    if config.replicas > 1:
        from . import parallel
        rendered, autodiff = _mesh_grad_fns(net, cfg, parallel.data_mesh(config.replicas))
    else:
        rendered, autodiff = _grad_fns(net, cfg)
    args = (params, x, targets)
    mem = (_temp_mib(rendered, *args), _temp_mib(autodiff, *args))
    for f in (rendered, autodiff):   # compile and warm up
        _time(f, args)
    times_r, times_a = [], []
    for _ in range(config.repeats):
        times_r.append(_time(rendered, args))
        times_a.append(_time(autodiff, args))
    return BenchResult(config, jax.default_backend(), statistics.median(times_r),
                       statistics.median(times_a), *mem)


def measure_in_fresh_process(config: BenchConfig, *, env: Optional[dict] = None) -> BenchResult:
    """`measure` in a new Python process (nothing cached from other configurations).

    With replicas on a CPU-only machine the process gets that many host devices (harmless where
    real accelerators provide them).
    """
    env = dict(os.environ if env is None else env)
    flags = env.get("XLA_FLAGS", "")
    if config.replicas > 1 and "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={config.replicas}".strip()
    out = subprocess.run([sys.executable, "-m", "gradtie.bench", json.dumps(asdict(config))],
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark {config} failed:\n{out.stderr[-2000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return BenchResult(BenchConfig(**d.pop("config")), **d)


def run(configs: Iterable[BenchConfig], *, progress: bool = True) -> list[BenchResult]:
    """One fresh process per configuration; results in order."""
    from tqdm.auto import tqdm
    configs = list(configs)
    return [measure_in_fresh_process(c) for c in tqdm(configs, desc="benchmarks", disable=not progress)]


if __name__ == "__main__":
    result = measure(BenchConfig(**json.loads(sys.argv[1])))
    print(json.dumps(asdict(result)))
