"""`gradtie.prng`: jax.random's values bit for bit, one compilation per size class, and the nets'
initial weights unchanged by drawing through it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import prng
from gradtie.nets import cifar8

KEY = jax.random.fold_in(jax.random.key(3), 7)
SHAPES = [(), (1,), (5,), (3, 4, 5, 7), (64, 3, 3, 3), (2, 3, 32, 32)]
# every dtype and function at a 1-D and a 4-D shape; float64 normals at all six (each jax.random
# draw compared compiles its own program: 0.4–3 s)
EVERY_KIND = [(5,), (64, 3, 3, 3)]


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values_are_jax_randoms_bit_for_bit(shape):
    assert same(prng.normal(KEY, shape, jnp.float64), jax.random.normal(KEY, shape, jnp.float64))
    old = jax.random.PRNGKey(1)                       # raw uint32 keys too
    assert same(prng.normal(old, shape, jnp.float64), jax.random.normal(old, shape, jnp.float64))
    if shape not in EVERY_KIND:
        return
    for dtype in (jnp.float32, None):
        assert same(prng.normal(KEY, shape, dtype), jax.random.normal(KEY, shape, dtype))
    for dtype in (jnp.float64, jnp.float32, None):
        assert same(prng.uniform(KEY, shape, dtype, 0.5, 1.5), jax.random.uniform(KEY, shape, dtype, 0.5, 1.5))
    for dtype in (jnp.int32, None):
        assert same(prng.randint(KEY, shape, 3, 2**31 - 1, dtype), jax.random.randint(KEY, shape, 3, 2**31 - 1, dtype))


def test_a_wrong_value_would_show():
    """The comparison above can fail: a neighbouring key, or the tail of a longer draw, differs."""
    assert not same(prng.normal(jax.random.fold_in(KEY, 1), (5,), jnp.float64), jax.random.normal(KEY, (5,), jnp.float64))
    assert not same(jax.random.normal(KEY, (8,), jnp.float64)[3:], jax.random.normal(KEY, (5,), jnp.float64))


def test_size_classes():
    assert [prng.size_class(n) for n in (0, 1, 2, 3, 5, 1024, 1025)] == [1, 1, 2, 4, 8, 1024, 2048]
    big = (1 << 22) + 1
    assert prng.size_class(big) == (1 << 22) + (1 << 20)           # at most a quarter wasted above 2²²
    for n in (7, 100, 12345, big, 3 << 22):
        assert n <= prng.size_class(n) < max(2 * n, n + (1 << 20))


def test_one_compilation_per_size_class():
    seen = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":     # a new program, cached or not
            seen.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for shape in [(5, 2, 3, 3), (3, 5, 2, 3), (2, 45), (90,), (11, 11)]:     # 90, 90, 90, 90, 121 → 128
            prng.normal(jax.random.fold_in(KEY, math.prod(shape)), shape, jnp.float16)
        first = seen.count("jit(_normal)")
        # control: the listener sees a new size class compile (1000 → 1024), once for two shapes of it
        for shape in [(1000,), (30, 31)]:
            prng.normal(KEY, shape, jnp.float16)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert first <= 1, seen     # float16 draws of 128 values: one program at most
    assert seen.count("jit(_normal)") == first + 1, seen


def test_under_a_trace_it_is_part_of_the_callers_program():
    f = jax.jit(lambda k: prng.normal(k, (2, 3), jnp.float32) * 2)
    assert same(f(KEY), jax.jit(lambda k: jax.random.normal(k, (2, 3), jnp.float32) * 2)(KEY))
    closed = jax.jit(lambda: prng.uniform(KEY, (2, 3), jnp.float32))         # a concrete key, traced around
    assert same(closed(), jax.random.uniform(KEY, (2, 3), jnp.float32))
    assert jax.eval_shape(lambda: prng.randint(KEY, (4, 5), 0, 9)).shape == (4, 5)
    # the nets' initial weights, traced or not, are the same values
    eager = cifar8.NET.init(KEY, cifar8.Config(), weights="drawn")
    traced = jax.jit(lambda k: cifar8.NET.init(k, cifar8.Config(), weights="drawn"))(KEY)
    assert all(same(eager[k], traced[k]) for k in eager)
    assert jax.eval_shape(lambda: cifar8.NET.init(KEY, cifar8.Config()))["conv1.weight"].shape == (16, 3, 3, 3)


def test_initial_weights_are_the_flat_draw_cut_into_tensors():
    """The nets draw one standard normal for every weight (float32) and cut it: the first conv
    weight is std · z[:size] of jax.random.normal's flat draw, std = √(2/(O·kh·kw)) (He fan-out)."""
    key = jax.random.key(0)
    cfg = cifar8.Config()
    params = cifar8.NET.init(key, cfg, weights="drawn")
    specs = [s for s in cifar8.NET.param_specs(cfg) if s.init in ("conv", "dense")]
    total = sum(math.prod(s.shape) for s in specs)
    z = jax.random.normal(key, (total,), jnp.float32)
    first = specs[0]
    assert (first.name, first.shape) == ("conv1.weight", (16, 3, 3, 3))
    size = math.prod(first.shape)
    expect = jnp.float32(math.sqrt(2 / (16 * 3 * 3))) * z[:size].reshape(first.shape)
    assert same(params[first.name], expect)
    # control: the draw's next values are the next tensor's, not these
    assert not same(params[first.name], jnp.float32(math.sqrt(2 / (16 * 3 * 3))) * z[1:size + 1].reshape(first.shape))
