"""Fake host devices: the request keeps the user's other XLA flags, yields to a count already set,
and refuses to pretend once JAX has started."""

import os
import subprocess
import sys

import jax
import pytest

from gradtie.bench import BenchConfig, _env_for
from gradtie.fake_devices import request_host_devices, without_device_count

PROBE = ("import os; from gradtie.fake_devices import request_host_devices; request_host_devices({n}); "
         "import jax; print(len(jax.devices('cpu')), os.environ['XLA_FLAGS'])")


def _probe(n: int, flags: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if flags is not None:
        env["XLA_FLAGS"] = flags
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", PROBE.format(n=n)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_request_adds_the_count_and_keeps_other_flags():
    assert _probe(3, None) == "3 --xla_force_host_platform_device_count=3"
    # a user's own flag survives (this one changes nothing on a CPU)
    assert _probe(4, "--xla_cpu_enable_fast_math=false") == \
        "4 --xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4"


def test_a_count_the_environment_sets_wins():
    flags = "--xla_force_host_platform_device_count=2"
    assert _probe(8, flags) == f"2 {flags}"


def test_after_jax_started_the_request_raises_unless_already_met(monkeypatch):
    jax.devices()                                     # the backends are up in this process
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(RuntimeError, match="before the first `import jax`"):
        request_host_devices(2)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    request_host_devices(2)                           # nothing to do: no error


@pytest.mark.parametrize("count", [0, -1, 2.0, True, "2"])
def test_a_count_must_be_a_positive_int(count):
    with pytest.raises(ValueError, match="expected a positive int"):
        request_host_devices(count)


def test_a_benchmark_child_gets_the_same_flags():
    user = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert _env_for(BenchConfig(replicas=2), user)["XLA_FLAGS"] == \
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    assert _env_for(BenchConfig(replicas=1), user) == user          # one device: nothing asked
    set_already = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert _env_for(BenchConfig(replicas=2), set_already) == set_already


def test_a_child_asking_its_own_count_keeps_the_other_flags():
    flags = "--xla_cpu_use_fusion_emitters=false --xla_force_host_platform_device_count=8 --xla_dump_to=/x"
    assert without_device_count(flags) == "--xla_cpu_use_fusion_emitters=false --xla_dump_to=/x"
    assert without_device_count("--xla_force_host_platform_device_count=2") == ""
    assert without_device_count("") == ""
