"""The benchmark kit at tiny sizes: both steps compute the same gradient (the comparison is like for
like), the FLOP count against the hand count, results on disk, the peak table, the abstract compile
and its 120 GiB verdict (a control goes red), and every chapter described at every profile.
Speed itself is measured in benchmarks/, never here."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import bench, book, cli
from gradtie import tolerances
from gradtie.book import workloads
from gradtie.rendered import QUICK

TINY = bench.BenchConfig("cifar8", batch=2, image_size=32, repeats=1)


@pytest.fixture(scope="module")
def measured():
    return bench.measure(TINY)


def test_measure_reports_both_steps_memory_and_flops(measured):
    r = measured
    assert r.rendered_ms > 0 and r.autodiff_ms > 0
    assert r.ratio == pytest.approx(r.rendered_ms / r.autodiff_ms)
    assert r.rendered_temp_mib is not None and r.autodiff_temp_mib is not None
    assert r.rendered_total_mib >= r.rendered_temp_mib
    assert r.images_per_s[0] == pytest.approx(2 / (r.rendered_ms / 1e3))
    assert r.model_gflop == pytest.approx(3 * cifar8_forward_flops(2) / 1e9)
    assert r.mfu == (None, None)   # a CPU has no entry in the peak table


def cifar8_forward_flops(n: int) -> float:
    """By hand: 2·N·O·C·9·H·W per 3×3 conv (padding taps counted), 2·N·in·out per dense layer."""
    convs, c, h = 0, 3, 32
    for width in (16, 16, 32, 32):
        convs += width * c * 9 * h * h + width * width * 9 * h * h
        c, h = width, h // 2
    dense = 128 * 512 + 512 * 512 + 512 * 10
    return 2.0 * n * (convs + dense)


def test_flop_count_of_one_conv_and_one_product():
    """2 per multiply-add, every tap counted: a 3×3 conv costs 9 times its 1×1 peer (a count that
    forgot the taps could not tell them apart), in either conv formulation."""
    from gradtie.ops import conv, dense
    x = jax.ShapeDtypeStruct((2, 3, 8, 8), jnp.float32)
    for form in conv.FORMULATIONS:
        three = bench.forward_flops(lambda a, w: conv.forward(a, w, formulation=form)[0], x,
                                    jax.ShapeDtypeStruct((4, 3, 3, 3), jnp.float32))
        one = bench.forward_flops(lambda a, w: conv.forward(a, w, formulation=form)[0], x,
                                  jax.ShapeDtypeStruct((4, 3, 1, 1), jnp.float32))
        assert three == 2.0 * 2 * 4 * 8 * 8 * 27
        assert three == 9 * one
    product = bench.forward_flops(lambda a, w: dense.forward(a, w)[0], jax.ShapeDtypeStruct((5, 7), jnp.float32),
                                  jax.ShapeDtypeStruct((3, 7), jnp.float32))
    assert product == 2.0 * 5 * 3 * 7


def test_rendered_and_autodiff_steps_compute_the_same_gradient():
    """Like for like: at drawn weights (γ ≠ 1, β ≠ 0) the two timed functions agree in float32 to
    round-off; a peer with the loss halved (a different function) does not."""
    args = bench.inputs(TINY)
    rendered, autodiff = (f.lower(*args).compile(QUICK) for f in bench.step_fns(TINY))
    (lr, gr), (la, ga) = rendered(*args), autodiff(*args)
    assert abs(float(lr) - float(la)) <= 1e-5 * abs(float(la))
    worst = max(float(jnp.max(jnp.abs(gr[k] - ga[k]))) for k in gr)
    scale = max(float(jnp.max(jnp.abs(g))) for g in ga.values())
    assert worst <= 1e-3 * scale
    halved = {k: 0.5 * g for k, g in ga.items()}
    assert max(float(jnp.max(jnp.abs(gr[k] - halved[k]))) for k in gr) > 0.1 * scale


def test_results_round_trip_through_json(tmp_path, measured):
    path = bench.write(tmp_path / "r.json", [measured], suite="test")
    doc = bench.read(path)
    assert doc["suite"] == "test" and doc["machine"]["cores"] >= 1 and doc["machine"]["jax"] == jax.__version__
    (back,) = doc["results"]
    assert back.config == TINY and back.ratio == pytest.approx(measured.ratio)
    raw = json.loads(path.read_text())
    assert raw["results"][0]["ratio"] == pytest.approx(measured.ratio)
    assert bench.read(tmp_path / "missing.json") is None


def test_peak_table_and_mfu():
    assert bench.peak_tflops("NVIDIA H200", "BF16") == 989.0 and bench.peak_tflops("NVIDIA H200", "TF32") == 495.0
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", "FP32") == 67.0
    assert bench.peak_tflops("NVIDIA H100 PCIe", "BF16") == 756.0
    assert bench.peak_tflops("cpu", "BF16") is None
    r = bench.BenchResult(bench.BenchConfig("resnet34", 64, 224, True, num_classes=1000), "gpu", 100.0, 110.0,
                          None, None, model_gflop=989.0, peak_tflops=989.0)
    assert r.mfu[0] == pytest.approx(0.01) and r.mfu[1] == pytest.approx(0.01 / 1.1)
    assert r.images_per_s[0] == pytest.approx(640.0)


def test_abstract_compile_reports_memory_and_the_fit_verdict_can_fail():
    rows = bench.abstract([bench.Workload("test", "cifar8", "cifar8", side, 2, 32, 10, "float32")
                           for side in ("rendered", "autodiff")], progress=False)
    assert all(r.total_gib > 0 and r.temp_gib > 0 for r in rows)
    assert all(r.total_gib >= r.temp_gib for r in rows)
    table, ok = bench.fit_table(rows)
    assert ok and "fits" in table
    _, ok_tiny = bench.fit_table(rows, limit_gib=min(r.total_gib for r in rows) / 2)  # control
    assert not ok_tiny


def test_the_committed_gpu_profiles_fit_the_gpu_and_a_half_limit_does_not():
    # the check the Performance appendix printed before it left the book's reader path: every
    # chapter's gpu profile, compiled from shapes (`gradtie bench --abstract --profile gpu`), fits
    abstract = bench.read_abstract(bench.RESULTS / "abstract_gpu.json")
    assert abstract is not None, "benchmarks/results/abstract_gpu.json is missing: gradtie bench --abstract"
    largest = bench.largest_by_owner(abstract["rows"])
    assert bench.fit_table(abstract["rows"], tolerances.GPU_FIT_GIB)[1]
    assert not bench.fit_table(abstract["rows"], min(largest.values()) / 2)[1]


def test_abstract_memory_grows_with_the_batch():
    small, large = (bench.abstract_one(bench.Workload("test", "c", "cifar8", "rendered", n, 32, 10, "float32"))
                    for n in (2, 16))
    assert large.temp_gib > 4 * small.temp_gib


@pytest.mark.parametrize("profile", book.PROFILES)
def test_every_chapter_and_the_benchmark_have_workloads(profile):
    # the chapters' computations come from the one chapter list (`book.CHAPTERS`, each entry's
    # `workloads`), the benchmark's from the kit
    planned = workloads.profile_workloads(profile)
    owners = {w.owner for w in planned}
    heavy = {c.name for c in book.CHAPTERS}
    assert heavy <= owners and "benchmark" in owners
    assert all(c.workloads is not None for c in book.CHAPTERS)
    for w in planned:
        assert isinstance(w, bench.Workload)
        assert w.side in ("rendered", "autodiff", "head") and w.batch >= 1
    if profile == "gpu":
        sizes = {w.image_size for w in planned if w.owner == "benchmark"}
        assert sizes == {224} and {w.batch for w in planned if w.owner == "benchmark"} == {64, 256}
    only = workloads.profile_workloads(profile, ["head_fold"])
    assert only and {w.owner for w in only} == {"head_fold"}


def test_unknown_chapter_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="chapter 'nope': not in gradtie.book.CHAPTERS"):
        workloads.chapter_workloads("nope", {})
    with pytest.raises(ValueError, match="--chapters: nope is not a chapter"):
        workloads.profile_workloads("ci", ["head_fold", "nope"])
    # a chapter in the list that names no workloads is named, never skipped
    monkeypatch.setattr(book, "CHAPTERS", [book.Chapter("bare", "Bare")])
    with pytest.raises(ValueError, match="chapter 'bare': no workload description"):
        workloads.chapter_workloads("bare", {})


def test_cli_abstract_head_fold_at_ci(capsys):
    assert cli.main(["bench", "--abstract", "--profile", "ci", "--chapters", "head_fold"]) == 0
    out = capsys.readouterr().out
    assert "head_fold" in out and "fits" in out


def test_limits_live_in_tolerances():
    assert tolerances.SPEED_RATIO_LIMIT == 0.95 and tolerances.GPU_FIT_GIB == 120.0
    assert set(tolerances.UPSTREAM_RATIOS.values()) == {1.04, 1.42}
    assert math.isfinite(bench.GIB)


def test_warm_cache_needs_the_persistent_cache():
    if jax.config.jax_compilation_cache_dir:
        pytest.skip("a persistent compilation cache is configured in this session")
    with pytest.raises(ValueError, match="persistent compilation cache is off"):
        bench.warm_cache([TINY], progress=False)


def test_timed_ms_warms_up_then_times_each_call(tmp_path):
    calls = []
    times = bench.timed_ms(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)
    # the reader rebuilds rows with the given type, and reads a missing file as None
    path = bench.write_json(tmp_path / "r.json", {"rows": [{"a": 1}, {"a": 2}]})
    assert bench.read_json(path, lambda d: d["a"] * 10)["rows"] == [10, 20]
    assert bench.read_json(path)["rows"] == [{"a": 1}, {"a": 2}]
    assert bench.read_json(tmp_path / "missing.json", lambda d: d) is None
