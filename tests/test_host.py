"""Host arrays reach the device as the same bits, in the dtype asked for, without a compilation."""

import jax
import jax.numpy as jnp
import numpy as np

from gradtie.host import to_device, tree_to_device


def test_a_new_shape_moves_without_compiling_and_keeps_its_bits(compilations):
    a = np.random.default_rng(0).standard_normal((3, 5, 7))          # a shape no test compiles
    got, n = compilations(lambda: to_device(a))
    assert n == 0 and isinstance(got, jax.Array) and got.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(got), a)
    # the control: the staged copy this replaces compiles a program for a fresh shape
    _, staged = compilations(lambda: jnp.asarray(np.ones((3, 5, 11))))
    assert staged >= 1


def test_dtype_and_trees():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert to_device(a, np.float64).dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(to_device(a, np.float64)), a.astype(np.float64))
    b = to_device(a)
    assert to_device(b) is b                                          # already there: no copy
    tree = tree_to_device({"w": a, "b": np.zeros(3)}, np.float32)
    assert {k: v.dtype for k, v in tree.items()} == {"w": jnp.float32, "b": jnp.float32}
