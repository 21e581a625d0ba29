"""Rendered step vs autodiff step across the CPU configurations: a fresh process per configuration.

    .venv/bin/python benchmarks/rendered_vs_autodiff.py [--suite cpu|quick] [--out benchmarks/results/cpu.json]
                                                        [--check]

Writes the results as JSON (with the machine: CPU model, cores, JAX version, date, load average)
and a Markdown twin beside it, and prints the table. Each configuration compiles both steps once,
reads XLA's compiled memory, then times them interleaved (medians over the repeats). `--check`
exits 1 unless every ratio rendered/autodiff is at most the issue's limit and every rendered
temporary memory at most autodiff's. Look at the load average first (`uptime`): the numbers are
the machine's, and a busy machine widens them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradtie import bench
from gradtie import tolerances


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"{m['cpu']}, {m['cores']} cores, jax {m['jax']} ({m['backend']}), {m['date']}, "
             f"load average {', '.join(f'{v:.2f}' for v in m.get('load_average') or [])}", "",
             "| configuration | rendered ms | autodiff ms | ratio | pairwise ratio | temp MiB (r / a) | load |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        mem = (f"{r.rendered_temp_mib:.1f} / {r.autodiff_temp_mib:.1f}"
               if r.rendered_temp_mib is not None else "n/a")
        lines.append(f"| {r.config.label()} | {r.rendered_ms:.1f} | {r.autodiff_ms:.1f} | {r.ratio:.3f} | "
                     f"{r.pair_ratio:.3f} | {mem} | {r.load[0]:.1f} → {r.load[1]:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("cpu", "quick"), default="cpu")
    p.add_argument("--out", type=Path, default=bench.RESULTS / "cpu.json", help="JSON results (a .md twin beside it)")
    p.add_argument("--check", action="store_true", help="exit 1 unless every ratio and memory holds")
    args = p.parse_args()
    bench.run(bench.SUITES[args.suite], out=args.out, suite=args.suite)
    doc = bench.read(args.out)
    text = markdown(doc)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    bad = bench.verdict(doc["results"], tolerances.SPEED_RATIO_LIMIT)
    for line in bad:
        print("over the limit:", line)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
