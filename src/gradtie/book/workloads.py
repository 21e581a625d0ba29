"""What each chapter compiles, for the memory plan (`gradtie bench --abstract`).

Each chapter of `gradtie.book.CHAPTERS` names its function here (`Chapter.workloads`): given the
chapter's parameters (its parameters cell with a profile's overrides), the computations it compiles,
each net's rendered step and the autodiff oracle at the chapter's dtype, batch, image size and
classes (`gradtie.bench.Workload`). `profile_workloads` walks the one chapter list and adds the
benchmark's own suite; the kit's `gradtie.bench` compiles them from shapes and never reads the book.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

Params = dict[str, Any]


def _both(owner: str, label: str, net: str, batch: int, image_size: int, num_classes: int, dtype: str,
          **kw) -> list:
    from gradtie import bench   # jax and the nets: only when a plan is made, never on `import gradtie.book`
    return bench.workloads_for(owner, label, net, batch, image_size, num_classes, dtype, **kw)


def pools(name: str, p: Params) -> list:
    g = p.get
    return (_both(name, "cifar8 census", "cifar8", g("batch", 4), 32, 10, "float64")
            + _both(name, "resnet34 census", "resnet34", g("batch", 4), g("image_size", 64), 10, "float64"))


def head_fold(name: str, p: Params) -> list:
    from gradtie import bench
    return [bench.Workload(name, "head fold", "resnet34", "head", 6, 32, p.get("num_classes", 10), "float64")]


def stage_germs(name: str, p: Params) -> list:
    g = p.get
    return (_both(name, "cifar8 germs", "cifar8", g("batch", 2), 32, 10, "float64")
            + ([] if "resnet_batch" not in p else
               _both(name, "resnet34 stem germ", "resnet34", g("resnet_batch"), g("image_size", 64), 10, "float64")))


def whole_net_tie(name: str, p: Params) -> list:
    g = p.get
    return (_both(name, "cifar8 tie", "cifar8", g("batch", 4), 32, 10, "float64")
            + _both(name, "resnet34 tie", "resnet34", g("statement_batch", 2), 224, g("num_classes", 10), "float64"))


def stage_by_stage(name: str, p: Params) -> list:
    g = p.get
    return (_both(name, "cifar8 stages", "cifar8", g("batch", 4), 32, 10, "float64")
            + _both(name, "resnet34 stages", "resnet34", g("resnet_batch", 2), g("image_size", 64),
                    g("num_classes", 10), "float64")
            + _both(name, "resnet34 stages at 224 px", "resnet34", g("statement_batch", 2), 224,
                    g("num_classes", 10), "float64"))


def would_it_catch(name: str, p: Params) -> list:
    g = p.get
    r = g("replicas", 2)
    return (_both(name, "cifar8 catalogue", "cifar8", g("batch", 4), 32, 10, "float64")
            + _both(name, "resnet34 catalogue", "resnet34", g("resnet_batch", 2), g("image_size", 32), 10, "float64")
            + _both(name, f"cifar8 R={r}", "cifar8", max(g("batch", 4) // r, 1), 32, 10, "float64", replicas=r))


def check_your_own(name: str, p: Params) -> list:
    from gradtie.book import ROOT
    g = p.get
    return _both(name, "bottleneck check", str(ROOT / "examples" / "bottleneck.py") + ":NET",
                 g("batch", 4), g("image_size", 32), 10, "float64")


def bf16_erasure(name: str, p: Params) -> list:
    g = p.get
    out = []
    for bf16 in (False, True):
        kind = "bf16" if bf16 else "f32"
        out += _both(name, f"cifar8 {kind}", "cifar8", g("batch", 4), 32, 10, "float32", bf16=bf16)
        out += _both(name, f"resnet34 {kind}", "resnet34", g("batch", 4), g("image_size", 32), 10, "float32",
                     bf16=bf16)
    return out


def data_parallel(name: str, p: Params) -> list:
    g = p.get
    net, r = g("net", "cifar8"), g("replicas", 8)
    return (_both(name, f"{net} R={r}", net, g("batch", 4), g("image_size", 32), 10, "float64",
                  replicas=r, head_width=g("head_width", 64))
            + _both(name, f"{net} one device, batch R·N", net, g("batch", 4) * r, g("image_size", 32), 10,
                    "float64", head_width=g("head_width", 64)))


def training(name: str, p: Params) -> list:
    g = p.get
    net = g("net", "cifar8")
    return _both(name, f"{net} train step", net, g("batch", 32), 32, 10, "float32")


def performance(name: str, p: Params) -> list:
    # reads committed results; compiles one step live from shapes
    g = p.get
    return _both(name, f"{g('net', 'resnet34')} live compile", g("net", "resnet34"), g("batch", 2),
                 g("image_size", 32), 10, "float32")


def chapter_workloads(name: str, p: Params) -> list:
    """The computations chapter `name` of `CHAPTERS` compiles at parameters `p`; ValueError naming the
    chapter when it is not in the list or names no workloads."""
    from gradtie import book
    chapter = next((c for c in book.CHAPTERS if c.name == name), None)
    if chapter is None:
        raise ValueError(f"chapter {name!r}: not in gradtie.book.CHAPTERS "
                         f"({', '.join(c.name for c in book.CHAPTERS)})")
    if chapter.workloads is None:
        raise ValueError(f"chapter {name!r}: no workload description (its Chapter.workloads in gradtie.book)")
    return chapter.workloads(name, p)


def profile_workloads(profile: str, chapters: Optional[Sequence[str]] = None) -> list:
    """Every chapter's computations at `profile` (the chapter's parameters cell with the profile's
    overrides), then the benchmark's (gpu: its GPU suite). `chapters`: only these ("benchmark": the
    benchmark's); a name that is neither a chapter nor "benchmark" is an error."""
    from gradtie import bench, book
    if chapters is not None:
        unknown = sorted(set(chapters) - {c.name for c in book.CHAPTERS} - {"benchmark"})
        if unknown:
            raise ValueError(f"--chapters: {', '.join(unknown)} is not a chapter (expected 'benchmark' or one "
                             f"of {', '.join(c.name for c in book.CHAPTERS)})")
    out = []
    for chapter in book.CHAPTERS:
        if chapters is not None and chapter.name not in chapters:
            continue
        p = {**{k: v[1] for k, v in book.parameters_cell(chapter.name).items()},
             **book.chapter_parameters(chapter, profile)}
        out += chapter_workloads(chapter.name, p)
    if chapters is None or "benchmark" in chapters:
        out += bench.suite_workloads(profile)
    return out
