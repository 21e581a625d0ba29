"""Float64 on, fixed seeds, quick hypothesis profile, one persistent compilation cache, and the
`slow` mark (on the tests themselves: cases a chapter also shows, run by `make test-all`)."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One on-disk compilation cache for the test workers and the interpreters they start (the mesh
# workers, `python -m gradtie check`): the same programs at the same shapes compile once a run.
_CACHE = os.environ.setdefault("GRADTIE_CACHE", str(Path.home() / ".cache" / "gradtie" / "jax-tests"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")   # the Makefile says why
# Compile-light XLA settings for every program the tests compile, and the chapters nbval runs (its
# kernels, like the commands the tests start, inherit this environment): XLA's older emitters for
# fused elementwise code, and LLVM at -O1. An eager op compiles in about 19 ms instead of 46, a
# ResNet-34 step at 32 px in about 2.5 s instead of 3.5-4.4; at 224 px it runs about 15 % slower.
# `make test` on an empty compilation cache, 2-core CPU: 1106 s as XLA ships, 926 s with the older
# emitters, 840 s with -O1 too. `rendered.QUICK` (-O0) names the newer emitters: with the older ones
# it returned NaN. A flag the environment already sets wins; the book's own runs (`make book`) use
# XLA's defaults.
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": "false", "xla_backend_optimization_level": "1"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{k}={v}" for k, v in FAST_COMPILE.items()
                                                if k not in _flags]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402


jax.config.update("jax_enable_x64", True)
settings.register_profile("gradtie", max_examples=15, deadline=None, derandomize=True)
settings.load_profile("gradtie")


@pytest.fixture
def compilations():
    """`compilations(f)` -> (f(), how many programs JAX compiled or read from the cache meanwhile)."""
    def run(f):
        events = []

        def listener(event, duration, **kw):
            if "backend_compile" in event:
                events.append(event)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            return f(), len(events)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    return run


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a repeat of a case a chapter also shows (make test-all)")


# The files holding the longest tests are collected first, so that the two workers share them early
# and finish together on short ones; left in collection order, the mesh tests ran last and one worker
# waited on them. Worker seconds of `make test`'s unit tests on a warm cache, 2-core CPU: 71, 36, 35,
# 32, 27, 25, 25, 20, 19 in this order, and every other file under 14.
FIRST = ("tests/test_parallel.py", "tests/nets/test_resnet34.py", "tests/checks/test_step.py",
         "tests/checks/test_stages.py", "tests/checks/test_bf16.py", "tests/checks/test_policies.py",
         "tests/test_api.py", "tests/test_train_mesh.py", "tests/checks/test_bugs.py",
         "tests/checks/test_census.py", "tests/test_intro.py", "tests/test_cli_check.py", "tests/test_cli.py")


# `make test` runs nbval's chapters and the unit tests in one session (`--dist loadscope`: each
# chapter's cells in order on one worker, each test file on one worker). The chapters go first, in
# the order the command line gives them (longest first), then the test files, longest first, so
# that the short ones end the session (one checkout, one after the other: 485 s against 493 s for
# `make unit nbval`, within the machine's noise).
def pytest_collection_modifyitems(config, items):
    # a stable sort: within a file, and among the files not listed, collection order stays
    rank = {name: i for i, name in enumerate(FIRST)}
    path = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    items.sort(key=lambda item: -1 if path(item).endswith(".ipynb") else rank.get(path(item), len(FIRST)))
