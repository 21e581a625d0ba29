"""Rendered step vs autodiff step across sizes: a fresh process per configuration.

    .venv/bin/python benchmarks/rendered_vs_autodiff.py [--quick] [--out benchmarks/results/cpu.md]

Writes a Markdown table (median ms/step, the ratio rendered/autodiff, compiled temporary memory)
and prints it. The numbers are the machine's: record the backend and core count beside them.
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

from gradtie import bench

FULL = [bench.BenchConfig("cifar8", b, 32, bf16) for b in (32, 128) for bf16 in (False, True)] + \
       [bench.BenchConfig("resnet34", b, s, False, repeats=5) for b, s in ((8, 64), (32, 64))]
QUICK = [bench.BenchConfig("cifar8", 32, 32), bench.BenchConfig("resnet34", 8, 64, repeats=3)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two small configurations")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    args = p.parse_args()
    results = bench.run(QUICK if args.quick else FULL)
    lines = [f"backend {results[0].backend}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
             "", "| net | batch | px | convs | rendered ms | autodiff ms | ratio | temp MiB (r / a) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.config
        mem = (f"{r.rendered_temp_mib:.1f} / {r.autodiff_temp_mib:.1f}"
               if r.rendered_temp_mib is not None and r.autodiff_temp_mib is not None else "n/a")
        lines.append(f"| {c.net} | {c.batch} | {c.image_size} | {'bf16' if c.bf16 else 'f32'} | "
                     f"{r.rendered_ms:.1f} | {r.autodiff_ms:.1f} | {r.ratio:.2f} | {mem} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
