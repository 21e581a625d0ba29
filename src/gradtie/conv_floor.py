"""The convolutions' floor under a step: every conv site of a configuration timed alone, gradtie's
conv nodes against PyTorch's convolution forward and backward on the same shapes.

A training step runs its convolutions and more. One program that runs every conv node of a
configuration's rendered step (each conv site as many times as the net has convs of that shape, on
inputs of their own) and nothing else is a floor under the step with this backend's convolution
kernels: no change to the BatchNorm, ReLU, pool or layout work around them takes the step below it. Where the floor alone
is above `peer_bench.GOAL` × PyTorch eager's whole step, the rendered step cannot reach the goal
without faster convolution kernels; where it is below, the gap lies outside the convolutions.

Each side runs in a process of its own, in alternating rounds, with the same thread count: gradtie's
conv nodes (forward, input backward, weight gradient, float32, the formulation the step's shape rule
picks: all in one program for the floor, and each site's nodes jitted alone), PyTorch's sites (`conv2d` forward and `backward()` for the input and weight
gradients), and PyTorch's whole step (`gradtie.peers`, the peer benchmark's own). The net's first
conv has no input gradient on either side (nothing upstream reads it; the rendered step's compiled
program drops it). Medians over each process's repeats, then over the rounds. Shown in: Performance.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .peer_bench import GOAL, PeerConfig, _run_child, measure_side
from .progress import bar

SIDES = ("gradtie", "torch")


@dataclass(frozen=True)
class ConvSite:
    """One conv shape of a net: `count` convs of it per forward."""
    batch: int
    in_ch: int
    out_ch: int
    size: int          # input side (square images)
    kernel: int
    stride: int
    count: int = 1
    input_grad: bool = True   # False for the net's first conv: nothing reads its input cotangent

    def out_size(self) -> int:
        from .ops import conv
        return conv.out_size(self.size, self.kernel, self.stride)

    def gflop(self) -> float:
        """Forward GFLOP of one call: 2 per multiply-add, every tap counted (as `bench.forward_flops`)."""
        return 2 * self.batch * self.out_ch * self.in_ch * self.kernel ** 2 * self.out_size() ** 2 / 1e9

    def step_gflop(self) -> float:
        """GFLOP of the site's nodes in one step: forward, weight gradient, and the input backward
        where it runs."""
        return (3 if self.input_grad else 2) * self.gflop()

    def label(self) -> str:
        return (f"{self.in_ch}→{self.out_ch} {self.kernel}×{self.kernel}/{self.stride} at {self.size}²"
                f"{'' if self.input_grad else ' (no dx)'}")


def _cifar8_sites(batch: int, image_size: int) -> list[ConvSite]:
    out, cin, h = [], 3, image_size
    for width in (16, 16, 32, 32):   # cifar8.WIDTHS: two 3×3 convs per stage, then a 2×2 pool
        out.append(ConvSite(batch, cin, width, h, 3, 1, input_grad=cin != 3))
        out.append(ConvSite(batch, width, width, h, 3, 1))
        cin, h = width, h // 2
    return out


def _resnet34_sites(batch: int, image_size: int) -> list[ConvSite]:
    from .ops import conv, maxpool
    stem = ConvSite(batch, 3, 64, image_size, 7, 2, input_grad=False)
    h = maxpool.out_size(stem.out_size(), maxpool.POOL3S2)
    out, cin = [stem], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        same = 2 * blocks
        if stride == 2:   # the first block's strided 3×3 and its 1×1 downsample
            out += [ConvSite(batch, cin, width, h, 3, 2), ConvSite(batch, cin, width, h, 1, 2)]
            h, same = conv.out_size(h, 3, 2), same - 1
        out.append(ConvSite(batch, width, width, h, 3, 1, count=same))
        cin = width
    return out


SITES = {"cifar8": _cifar8_sites, "resnet34": _resnet34_sites}


def sites(net: str, batch: int, image_size: int) -> list[ConvSite]:
    """Every conv shape of cifar8-BN or ResNet-34 at (batch, image_size), in forward order, with the
    number of convs of that shape."""
    if net not in SITES:
        raise ValueError(f"conv floor: net must be cifar8 or resnet34, got {net!r}")
    return SITES[net](batch, image_size)


# ---- one side in this process ------------------------------------------------------------------

def _median_ms(step, repeats: int) -> float:
    from . import bench
    from .peers import child   # the peers' own warm-up, so every side is timed alike
    return statistics.median(bench.timed_ms(step, repeats, child.WARMUP))


def _site_arrays(site: ConvSite, key):
    import jax
    import jax.numpy as jnp

    from . import prng   # jax.random's values without a threefry program per shape
    kx, kw, kd = jax.random.split(key, 3)
    o = site.out_size()
    return (prng.normal(kx, (site.batch, site.in_ch, site.size, site.size), jnp.float32),
            prng.normal(kw, (site.out_ch, site.in_ch, site.kernel, site.kernel), jnp.float32),
            prng.normal(kd, (site.batch, site.out_ch, o, o), jnp.float32))


def _nodes(site: ConvSite, x, w, dy) -> dict[str, "jax.Array"]:
    """gradtie's conv nodes at one site, the formulation the step's shape rule picks."""
    from .ops import conv
    s, k = site.stride, site.kernel
    out = {"forward": conv.forward(x, w, stride=s)[0],
           "grad_weight": conv.grad_weight(x, dy, kernel_size=k, stride=s)}
    if site.input_grad:
        out["backward"] = conv.backward(w, dy, input_shape=x.shape, stride=s)
    return out


def _nodes_nhwc(site: ConvSite, x, w, dy) -> dict[str, "jax.Array"]:
    """The same three contractions as XLA's convolutions in the layout its CPU kernels read (NHWC
    activations, HWIO weights: no layout copies): x [N,H,W,C], w [k,k,C,O], dy [N,H',W',O]."""
    from jax import lax

    from .ops import conv
    s, k, p = site.stride, site.kernel, conv.padding(site.kernel)
    h, ho = site.size, site.out_size()
    hi = k + s * (ho - 1) - h - p
    out = {"forward": conv._correlate(x, w, strides=(s, s), pads=((p, p), (p, p)), dims=("NHWC", "HWIO", "NHWC")),
           # the batch as the contraction ("feature") axis, channels as the "batch" axis -> [k,k,C,O]
           "grad_weight": conv._correlate(x, dy, strides=(1, 1), pads=((p, hi), (p, hi)), rhs_dilation=(s, s),
                                          dims=("CHWN", "IHWO", "HWNC"))}
    if site.input_grad:
        up = s * (ho - 1) + 1
        out["backward"] = conv._correlate(dy, w[::-1, ::-1], strides=(1, 1), pads=((k - 1 - p, h + p - up),) * 2,
                                          lhs_dilation=(s, s), dims=("NHWC", "HWOI", "NHWC"))
    return out


LAYOUTS = {"nchw": _nodes, "nhwc": _nodes_nhwc}


def to_nhwc(x, w, dy):
    """gradtie's NCHW / OIHW arrays in the layout `_nodes_nhwc` reads."""
    return x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), dy.transpose(0, 2, 3, 1)


def measure_gradtie(site: ConvSite, repeats: int) -> dict[str, float]:
    """ms of gradtie's conv nodes at one site, float32, each jitted alone."""
    import jax
    x, w, dy = _site_arrays(site, jax.random.key(0))
    out = {}
    for name in ("forward", "backward", "grad_weight") if site.input_grad else ("forward", "grad_weight"):
        f = jax.jit(lambda x, w, dy, name=name: _nodes(site, x, w, dy)[name])
        out[name] = _median_ms(lambda: jax.block_until_ready(f(x, w, dy)), repeats)
    return out


def measure_all_convs(sites_: Sequence[ConvSite], repeats: int, layout: str = "nchw") -> float:
    """ms of one program that runs every conv node of the step and nothing else: each site `count`
    times, on inputs of its own (identical inputs would be computed once), every result an output.
    The compiler is free to schedule them as it likes; the step does all of this work and more.
    layout "nchw": gradtie's conv ops as the rendered step calls them; "nhwc": XLA's convolutions
    in their kernels' own layout, what a channels-last step would call."""
    import jax
    instances = [(s, _site_arrays(s, jax.random.key(i * 1000 + j)))
                 for i, s in enumerate(sites_) for j in range(s.count)]
    if layout == "nhwc":
        instances = [(s, to_nhwc(*a)) for s, a in instances]
    nodes = LAYOUTS[layout]
    f = jax.jit(lambda arrays: [nodes(s, *a) for (s, _), a in zip(instances, arrays)])
    arrays = [a for _, a in instances]
    return _median_ms(lambda: jax.block_until_ready(f(arrays)), repeats)


def measure_torch(site: ConvSite, repeats: int) -> dict[str, float]:
    """ms of PyTorch's conv2d forward and backward at one site, float32 (what its eager step runs)."""
    from .peers import torch_eager
    torch = torch_eager.modules().torch
    g = torch.Generator().manual_seed(0)
    o = site.out_size()
    x = torch.randn(site.batch, site.in_ch, site.size, site.size, generator=g).requires_grad_(site.input_grad)
    w = torch.randn(site.out_ch, site.in_ch, site.kernel, site.kernel, generator=g).requires_grad_()
    dy = torch.randn(site.batch, site.out_ch, o, o, generator=g)
    from .ops import conv
    pad = conv.padding(site.kernel)

    def step():
        x.grad = w.grad = None
        torch.nn.functional.conv2d(x, w, stride=site.stride, padding=pad).backward(dy)
    return {"forward_backward": _median_ms(step, repeats)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One side's sites in this process: {"side", "ms": [per site {node: ms}], "version", "threads"}
    or {"side", "skipped"} where PyTorch is not installed."""
    side, repeats = spec["side"], int(spec["repeats"])
    todo = [ConvSite(**s) for s in spec["sites"]]
    if side == "gradtie":
        import jax
        return {"side": side, "ms": [measure_gradtie(s, repeats) for s in todo],
                "all_convs_ms": measure_all_convs(todo, repeats),
                "all_convs_nhwc_ms": measure_all_convs(todo, repeats, "nhwc"), "version": f"jax {jax.__version__}",
                "threads": os.cpu_count()}
    if side != "torch":
        raise ValueError(f"conv floor: side must be one of {', '.join(SIDES)}, got {side!r}")
    from .peers import torch_eager
    ok, why = torch_eager.available()
    if not ok:
        return {"side": side, "skipped": why}
    threads = torch_eager.threads(os.cpu_count())
    return {"side": side, "ms": [measure_torch(s, repeats) for s in todo], "version": torch_eager.version(),
            "threads": threads}


# ---- the run -----------------------------------------------------------------------------------

@dataclass
class FloorRow:
    """One configuration: its sites, each side's per-site ms (median over the rounds), and PyTorch's
    whole step."""
    config: PeerConfig
    sites: list[ConvSite]
    gradtie_ms: list[dict[str, float]]
    torch_ms: Optional[list[dict[str, float]]]
    torch_step_ms: Optional[float]
    round_floor_ms: list[float]
    round_torch_step_ms: list[float]
    round_floor_nhwc_ms: list[float] = field(default_factory=list)

    def _rounds(self, layout: str) -> list[float]:
        return self.round_floor_ms if layout == "nchw" else self.round_floor_nhwc_ms

    def floor_ms(self, layout: str = "nchw") -> Optional[float]:
        """One program running every conv node of the step and nothing else (median over the rounds):
        gradtie's conv ops ("nchw") or XLA's convolutions channels-last ("nhwc")."""
        rounds = self._rounds(layout)
        return statistics.median(rounds) if rounds else None

    def best_layout(self) -> str:
        """The layout whose floor is lower: the one a faster step would be built on."""
        nhwc = self.floor_ms("nhwc")
        return "nhwc" if nhwc is not None and nhwc < self.floor_ms("nchw") else "nchw"

    def sites_sum_ms(self) -> float:
        """The sites timed one by one: Σ_sites count × (forward + backward + weight gradient)."""
        return _sites_sum(self.sites, self.gradtie_ms)

    def torch_convs_ms(self) -> Optional[float]:
        """PyTorch's sites timed one by one, summed the same way."""
        return None if self.torch_ms is None else _sites_sum(self.sites, self.torch_ms)

    def fraction(self, layout: Optional[str] = None) -> Optional[float]:
        """The floor (in `layout`, default the lower one) over PyTorch's whole step, median of the
        per-round ratios."""
        rounds = self._rounds(layout or self.best_layout())
        if not self.round_torch_step_ms or not rounds:
            return None
        return statistics.median(f / t for f, t in zip(rounds, self.round_torch_step_ms))

    def site_gflops(self) -> list[tuple[ConvSite, float, Optional[float]]]:
        """(site, gradtie GFLOP/s, PyTorch GFLOP/s) over each site's nodes in one step."""
        out = []
        for i, s in enumerate(self.sites):
            g = s.step_gflop() / (sum(self.gradtie_ms[i].values()) / 1e3)
            t = None if self.torch_ms is None else s.step_gflop() / (sum(self.torch_ms[i].values()) / 1e3)
            out.append((s, g, t))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "sites": [asdict(s) for s in self.sites],
                "gradtie_ms": self.gradtie_ms, "torch_ms": self.torch_ms, "torch_step_ms": self.torch_step_ms,
                "round_floor_ms": self.round_floor_ms, "round_torch_step_ms": self.round_torch_step_ms,
                "round_floor_nhwc_ms": self.round_floor_nhwc_ms,
                "floor_ms": self.floor_ms(), "floor_nhwc_ms": self.floor_ms("nhwc"),
                "sites_sum_ms": self.sites_sum_ms(), "torch_convs_ms": self.torch_convs_ms(),
                "fraction": self.fraction()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FloorRow":
        return cls(PeerConfig(**d["config"]), [ConvSite(**s) for s in d["sites"]], d["gradtie_ms"], d["torch_ms"],
                   d["torch_step_ms"], d["round_floor_ms"], d["round_torch_step_ms"], d.get("round_floor_nhwc_ms", []))


def _site_medians(results: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per site and node, the median over the rounds."""
    return [{node: statistics.median(r[i][node] for r in results) for node in results[0][i]}
            for i in range(len(results[0]))]


def _sites_sum(sites_: Sequence[ConvSite], ms: Sequence[dict[str, float]]) -> float:
    """Σ_sites count × the site's nodes' ms."""
    return sum(s.count * sum(m.values()) for s, m in zip(sites_, ms))


def run(configs: Iterable[PeerConfig], *, rounds: int = 2, repeats: int = 5, progress: bool = True,
        out: Optional[Path] = None) -> dict[str, Any]:
    """Every configuration: gradtie's sites, PyTorch's sites and PyTorch's whole step, each in its own
    process, `rounds` alternating rounds. With `out`, the JSON is rewritten after every configuration."""
    from . import bench
    configs = list(configs)
    if rounds < 1 or repeats < 1:
        raise ValueError(f"conv floor: rounds and repeats must be at least 1, got {rounds}, {repeats}")
    doc: dict[str, Any] = {"machine": bench.machine(), "rounds": rounds, "repeats": repeats, "goal": GOAL,
                           "method": __doc__.split("\n\n")[2], "rows": []}
    for c in bar(configs, desc="conv floor", enabled=progress):
        todo = sites(c.net, c.batch, c.image_size)
        spec = {"sites": [asdict(s) for s in todo], "repeats": repeats}
        runs: dict[str, list] = {"gradtie": [], "torch": [], "step": []}
        for r in range(rounds):
            order = ["gradtie", "torch", "step"]
            for side in order[r % 3:] + order[:r % 3]:
                if side == "step":
                    runs[side].append(measure_side("torch", c))
                else:
                    runs[side].append(_run_child("gradtie.conv_floor", {"side": side, **spec}))
        skipped = runs["torch"][0].get("skipped")
        g = [r["ms"] for r in runs["gradtie"]]
        t = None if skipped else [r["ms"] for r in runs["torch"]]
        steps = [] if skipped else [statistics.median(r["times_ms"]) for r in runs["step"]]
        row = FloorRow(c, todo, _site_medians(g), None if t is None else _site_medians(t),
                       statistics.median(steps) if steps else None, [r["all_convs_ms"] for r in runs["gradtie"]],
                       steps, [r["all_convs_nhwc_ms"] for r in runs["gradtie"]])
        doc["rows"].append({**row.as_dict(), "versions": {k: v[0].get("version", v[0].get("skipped", ""))
                                                          for k, v in runs.items()}})
        if out is not None:
            bench.write_json(out, doc)
    return doc


def read(path: Path) -> Optional[dict[str, Any]]:
    """A results file as `run` writes it, its rows as FloorRows; None when it does not exist."""
    from . import bench
    return bench.read_json(path, FloorRow.from_dict)


def kernel_bound(rows: Sequence[FloorRow], goal: float = GOAL) -> list[str]:
    """The configurations whose conv floor alone, in the lower of the two layouts, is above `goal` ×
    PyTorch's whole step: there no step built on this backend's convolution kernels reaches the goal."""
    return [f"{r.config.label()}: conv floor ({r.best_layout().upper()}) / PyTorch step = {r.fraction():.2f} > {goal}"
            for r in rows if r.fraction() is not None and r.fraction() > goal]


def scaled(rows: Sequence[FloorRow], factor: float) -> list[FloorRow]:
    """The rows with gradtie's conv times (both floors, every site) multiplied by `factor`: the
    verdict's controls."""
    return [FloorRow(r.config, r.sites, [{k: v * factor for k, v in ms.items()} for ms in r.gradtie_ms],
                     r.torch_ms, r.torch_step_ms, [f * factor for f in r.round_floor_ms], r.round_torch_step_ms,
                     [f * factor for f in r.round_floor_nhwc_ms])
            for r in rows]


def table(rows: Sequence[FloorRow]) -> str:
    """Markdown: each configuration's conv floor, PyTorch's convolutions alone and its whole step."""
    lines = ["| configuration | gradtie's conv ops ms | XLA convs NHWC ms | PyTorch convs ms | PyTorch step ms "
             "| lower floor / PyTorch step |", "|---|---|---|---|---|---|"]

    def ms(v):
        return "not run" if v is None else f"{v:.1f}"
    for r in rows:
        f = r.fraction()
        lines.append(f"| {r.config.label()} | {ms(r.floor_ms())} | {ms(r.floor_ms('nhwc'))} | {ms(r.torch_convs_ms())} | "
                     f"{ms(r.torch_step_ms)} | {'—' if f is None else f'{f:.2f} ({r.best_layout().upper()})'} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: python -m gradtie.conv_floor '{\"side\": \"gradtie\", \"sites\": [...], \"repeats\": 5}'",
              file=sys.stderr)
        return 2
    print(json.dumps(measure(json.loads(args[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
