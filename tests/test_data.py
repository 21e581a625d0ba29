"""gradtie.data: shipped images, digits, CIFAR-10 files (and their clear errors), mixup/cutmix/flip."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradtie import data

PER_BATCH = 20   # fake CIFAR-10 files: 20 examples per batch keep the tests instant


# ---- shipped images -----------------------------------------------------------------------------

def test_photos_shape_range_and_determinism():
    x = data.photos(9, 32, seed=3)
    assert x.shape == (9, 3, 32, 32) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.std() > 0.05
    np.testing.assert_array_equal(x, data.photos(9, 32, seed=3))
    assert not np.array_equal(x, data.photos(9, 32, seed=4))
    assert data.photos(2, 16, dtype=np.float64).dtype == np.float64


def test_photo_labels_name_the_source_photo():
    x, labels = data.photo_labels(16, 16, seed=1)
    np.testing.assert_array_equal(labels, np.arange(16) % len(data.PHOTO_NAMES))
    np.testing.assert_array_equal(x, data.photos(16, 16, seed=1))
    # crops of the same photo look more alike than crops of different photos, on average
    assert not np.array_equal(x[0], x[7])


def test_flat_images_have_exactly_flat_2x2_windows():
    x = data.flat_images(6, 32, seed=0)
    assert x.shape == (6, 3, 32, 32) and 0.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(x[:, 0], x[:, 1])               # grey: equal channels
    win = x[:, 0].reshape(6, 16, 2, 16, 2)
    flat = (win.max(axis=(2, 4)) == win.min(axis=(2, 4))).mean()
    assert flat > 0.3, flat                                        # many bit-equal twins
    # the control: photos have (almost) no bit-equal 2×2 windows
    p = data.photos(6, 32, seed=0)[:, 0].reshape(6, 16, 2, 16, 2)
    assert (p.max(axis=(2, 4)) == p.min(axis=(2, 4))).mean() < 0.05
    np.testing.assert_array_equal(x, data.flat_images(6, 32, seed=0))


def test_digits_split_labels_and_kron_blocks():
    s = data.digits(seed=0)
    assert s.x_train.shape[1:] == (3, 32, 32) and len(s.x_train) + len(s.x_test) == 1797
    assert len(s.x_test) == round(0.2 * 1797)
    assert set(np.unique(s.y_train)) == set(range(10)) and s.y_train.dtype == np.int64
    assert s.x_train.min() == 0.0 and s.x_train.max() == 1.0
    blocks = s.x_train[:5, 0].reshape(5, 8, 4, 8, 4)
    np.testing.assert_array_equal(blocks, np.broadcast_to(blocks[:, :, :1, :, :1], blocks.shape))
    np.testing.assert_array_equal(s.x_test, data.digits(seed=0).x_test)


def test_synthetic():
    x, y = data.synthetic(10, 8, 4, seed=2)
    assert x.shape == (10, 3, 8, 8) and y.shape == (10,) and 0 <= y.min() and y.max() < 4
    np.testing.assert_array_equal(x, data.synthetic(10, 8, 4, seed=2)[0])


@pytest.mark.parametrize("call, match", [
    (lambda: data.photos(0, 32), "n must be a positive integer"),
    (lambda: data.photos(4, -1), "size must be a positive integer"),
    (lambda: data.photos(True, 32), "n must be a positive integer"),
    (lambda: data.flat_images(2, 0), "size"),
    (lambda: data.photo_labels(2.5, 32), "n must"),
    (lambda: data.synthetic(4, 8, 0), "num_classes"),
    (lambda: data.photos(2, 8, dtype=np.int32), "float32 or float64"),
    (lambda: data.digits(test_fraction=1.0), "test_fraction"),
    (lambda: data.load("imagenet"), "unknown dataset"),
])
def test_bad_arguments_are_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- CIFAR-10 files -----------------------------------------------------------------------------

def write_batch(path, x_rows, labels, *, protocol=2):
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"fake", b"data": x_rows, b"labels": labels}, f, protocol=protocol)


@pytest.fixture
def cifar(tmp_path):
    """A fake cifar-10-batches-py folder: five train batches and a test batch of 20 examples."""
    folder = tmp_path / data.CIFAR10_FOLDER
    folder.mkdir()
    rng = np.random.default_rng(0)
    rows, labels = {}, {}
    for name in data.CIFAR10_TRAIN + (data.CIFAR10_TEST,):
        rows[name] = rng.integers(0, 256, size=(PER_BATCH, 3072), dtype=np.uint8)
        labels[name] = [int(v) for v in rng.integers(0, 10, size=PER_BATCH)]
        write_batch(folder / name, rows[name], labels[name])
    return folder, rows, labels


def test_load_cifar10_reads_every_batch_in_order(cifar):
    folder, rows, labels = cifar
    s = data.load_cifar10(folder.parent)
    assert s.x_train.shape == (5 * PER_BATCH, 3, 32, 32) and s.x_train.dtype == np.uint8
    assert s.x_test.shape == (PER_BATCH, 3, 32, 32)
    np.testing.assert_array_equal(s.y_train, np.concatenate([labels[n] for n in data.CIFAR10_TRAIN]))
    # row layout: red plane, green plane, blue plane, each 32×32 row-major
    r = rows["data_batch_2"][3]
    assert s.x_train[PER_BATCH + 3, 1, 5, 7] == r[1 * 1024 + 5 * 32 + 7]
    f = data.load_cifar10(folder, dtype=np.float32)
    np.testing.assert_allclose(f.x_test, s.x_test / 255.0, rtol=1e-6)
    assert f.x_train.dtype == np.float32
    d = data.load(f"cifar10:{folder}")
    assert d.num_classes == 10 and d.split.x_train.dtype == np.float32


def test_load_cifar10_reads_numpy2_pickles_too(cifar):
    folder, rows, labels = cifar
    write_batch(folder / "test_batch", rows["test_batch"], np.array(labels["test_batch"]), protocol=5)
    np.testing.assert_array_equal(data.load_cifar10(folder).y_test, labels["test_batch"])


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        data.load_cifar10(tmp_path / "nowhere")


def test_missing_batch_file_is_named(cifar):
    folder, _, _ = cifar
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        data.load_cifar10(folder)


class Exploit:
    def __reduce__(self):
        import os
        return (os.getcwd, ())


@pytest.mark.parametrize("corrupt, match", [
    (lambda f: f.write_bytes(b"this is not a pickle"), "not a readable CIFAR-10 python pickle"),
    (lambda f: f.write_bytes(f.read_bytes()[:500]), "not a readable CIFAR-10 python pickle"),
    (lambda f: f.write_bytes(pickle.dumps([1, 2, 3])), "expected a dict"),
    (lambda f: f.write_bytes(pickle.dumps({b"data": np.zeros((20, 3072), np.uint8)})), "lacks"),
    (lambda f: write_batch(f, np.zeros((20, 3071), np.uint8), [0] * 20), r"uint8 array \[N,3072\]"),
    (lambda f: write_batch(f, np.zeros((20, 3072), np.float32), [0] * 20), r"uint8 array \[N,3072\]"),
    (lambda f: write_batch(f, np.zeros((20, 3072), np.uint8), [0] * 19), "must be 20 integers"),
    (lambda f: write_batch(f, np.zeros((20, 3072), np.uint8), [0] * 19 + [10]), r"0…9, got 0…10"),
    (lambda f: write_batch(f, np.zeros((20, 3072), np.uint8), [-1] + [0] * 19), r"0…9"),
    (lambda f: f.write_bytes(pickle.dumps({b"data": Exploit(), b"labels": []})), "refusing to load"),
])
def test_corrupt_batch_is_a_clear_error_naming_the_file(cifar, corrupt, match):
    folder, _, _ = cifar
    corrupt(folder / "data_batch_4")
    with pytest.raises(ValueError, match=match) as err:
        data.load_cifar10(folder)
    assert "data_batch_4" in str(err.value)


def write_bin(path, x_rows, labels):
    """A CIFAR-10 binary batch: one record per example, the label byte then the 3,072 pixels."""
    records = np.concatenate([np.asarray(labels, np.uint8)[:, None], x_rows], axis=1)
    path.write_bytes(records.astype(np.uint8).tobytes())


@pytest.fixture
def cifar_bin(cifar, tmp_path):
    """The same examples as `cifar`, written as the binary version (cifar-10-batches-bin/*.bin)."""
    folder, rows, labels = cifar
    bin_folder = tmp_path / "bin" / data.CIFAR10_BIN_FOLDER
    bin_folder.mkdir(parents=True)
    for name in data.CIFAR10_TRAIN + (data.CIFAR10_TEST,):
        write_bin(bin_folder / f"{name}.bin", rows[name], labels[name])
    return bin_folder, folder


def test_binary_version_reads_the_same_arrays_as_the_python_version(cifar_bin):
    bin_folder, py_folder = cifar_bin
    b, p = data.load_cifar10(bin_folder.parent), data.load_cifar10(py_folder)
    for got, want in zip(b, p):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    d = data.load(f"cifar10:{bin_folder}")
    assert d.num_classes == 10 and d.split.x_test.shape == (PER_BATCH, 3, 32, 32)
    np.testing.assert_array_equal(d.split.x_train, data.load(f"cifar10:{py_folder}").split.x_train)
    # the control: one pixel changed in one record is seen
    raw = bytearray((bin_folder / "test_batch.bin").read_bytes())
    raw[5 * data.CIFAR10_RECORD + 1 + 2 * 1024 + 3] ^= 0xFF
    (bin_folder / "test_batch.bin").write_bytes(bytes(raw))
    assert not np.array_equal(data.load_cifar10(bin_folder).x_test, p.x_test)


@pytest.mark.parametrize("corrupt, match", [
    (lambda f: f.write_bytes(f.read_bytes()[:-1]), "whole records of 3073 bytes"),
    (lambda f: f.write_bytes(b""), "holds 0 bytes"),
    (lambda f: f.write_bytes(bytes([10]) + f.read_bytes()[1:]), "record 0 .* has label 10"),
])
def test_corrupt_binary_batch_is_a_clear_error_naming_the_file(cifar_bin, corrupt, match):
    bin_folder, _ = cifar_bin
    corrupt(bin_folder / "data_batch_2.bin")
    with pytest.raises(ValueError, match=match) as err:
        data.load_cifar10(bin_folder)
    assert "data_batch_2.bin" in str(err.value)


def test_missing_binary_batch_is_named(cifar_bin):
    bin_folder, _ = cifar_bin
    (bin_folder / "data_batch_5.bin").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_5.bin"):
        data.load_cifar10(bin_folder)
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-bin"):
        data.load_cifar10(bin_folder / "nowhere")


# ---- targets and batch transforms ---------------------------------------------------------------

def batch_and_targets(n=8, k=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, 6, 6))
    return jnp.asarray(x), data.one_hot(jnp.asarray(rng.integers(0, k, n)), k, dtype=jnp.float64)


def test_one_hot_reuses_the_head_check():
    np.testing.assert_array_equal(data.one_hot(jnp.array([2, 0]), 3), [[0, 0, 1], [1, 0, 0]])
    with pytest.raises(ValueError, match="0…2"):
        data.one_hot(jnp.array([3]), 3)


def test_mixup_is_a_convex_combination_with_unit_rows():
    x, t = batch_and_targets()
    m = data.mixup(x, t, 7, alpha=0.4)
    assert 0 < float(m.lam) < 1
    assert sorted(np.asarray(m.perm).tolist()) == list(range(8))
    np.testing.assert_allclose(m.x, m.lam * x + (1 - m.lam) * x[m.perm], rtol=0, atol=1e-15)
    np.testing.assert_allclose(m.targets, m.lam * t + (1 - m.lam) * t[m.perm], rtol=1e-14)
    np.testing.assert_allclose(m.targets.sum(axis=1), 1.0, rtol=1e-14)
    fixed = data.mixup(x, t, 7, lam=0.25)
    assert float(fixed.lam) == 0.25 and np.array_equal(fixed.perm, m.perm)


def test_mixup_is_deterministic_for_int_jax_and_numpy_seeds():
    x, t = batch_and_targets()
    for seed in (lambda: 3, lambda: jax.random.key(3), lambda: jax.random.PRNGKey(3),
                 lambda: np.random.default_rng(3)):
        a, b = data.mixup(x, t, seed()), data.mixup(x, t, seed())
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(data.mixup(x, t, 3).x, data.mixup(x, t, 4).x)
    jitted = jax.jit(lambda x_, t_, k: data.mixup(x_, t_, k))(x, t, jax.random.key(3))
    np.testing.assert_allclose(jitted.x, data.mixup(x, t, jax.random.key(3)).x, atol=1e-14)


def test_cutmix_lambda_is_the_exact_kept_area():
    n, k = 8, 5
    # example i is the constant i+1, so every pixel says which example it came from
    x = jnp.broadcast_to(jnp.arange(1.0, n + 1)[:, None, None, None], (n, 3, 10, 10))
    _, t = batch_and_targets(n, k)
    for seed in range(6):
        m = data.cutmix(x, t, seed)
        perm = np.asarray(m.perm)
        src = np.asarray(m.x)[:, 0] - 1                                     # [N,H,W] source index
        for i in range(n):
            assert set(np.unique(src[i])) <= {i, perm[i]}
        moved = [i for i in range(n) if perm[i] != i]
        kept = (src[moved[0]] == moved[0]).mean()
        assert float(m.lam) == kept                                         # exact, not nominal
        np.testing.assert_allclose(m.targets, m.lam * t + (1 - m.lam) * t[perm], rtol=1e-15)
        np.testing.assert_allclose(m.targets.sum(axis=1), 1.0, rtol=1e-14)
    # clipping to the image only shrinks the box: the exact λ is at least the nominal one
    for seed in range(6):
        assert 0.5 <= float(data.cutmix(x, t, seed, lam=0.5).lam) < 1.0
    np.testing.assert_array_equal(data.cutmix(x, t, 11).x, data.cutmix(x, t, 11).x)


def test_mix_rejects_bad_inputs():
    x, t = batch_and_targets()
    with pytest.raises(ValueError, match="targets must be rows"):
        data.mixup(x, t[:4], 0)
    with pytest.raises(ValueError, match="lam must lie in"):
        data.cutmix(x, t, 0, lam=1.5)
    with pytest.raises(ValueError, match="images"):
        data.augment_flip(x[0], 0)
    with pytest.raises(ValueError, match="JAX key"):
        data.mixup(x, t, "seed")


def test_augment_flip_flips_some_examples_left_right():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 3, 4, 5)))
    y = data.augment_flip(x, jax.random.key(1))
    flipped = np.array([np.array_equal(y[i], x[i, :, :, ::-1]) for i in range(64)])
    kept = np.array([np.array_equal(y[i], x[i]) for i in range(64)])
    assert np.all(flipped ^ kept) and 10 < flipped.sum() < 54
    np.testing.assert_array_equal(y, data.augment_flip(x, jax.random.key(1)))


def test_batches_shuffle_and_cover_each_example_once():
    x, y = np.arange(10)[:, None] * np.ones((10, 2)), np.arange(10)
    got = list(data.batches(x, y, 4, key=0, drop_last=False))
    assert [len(b[1]) for b in got] == [4, 4, 2]
    seen = np.concatenate([b[1] for b in got])
    assert sorted(seen.tolist()) == list(range(10)) and seen.tolist() != list(range(10))
    for xb, yb in got:
        np.testing.assert_array_equal(xb[:, 0], yb)
    assert [len(b[1]) for b in data.batches(x, y, 4, key=0)] == [4, 4]
    np.testing.assert_array_equal(next(data.batches(x, y, 4, key=0))[1], got[0][1])
    with pytest.raises(ValueError, match="no full batch"):
        list(data.batches(x, y, 11, key=0))
    with pytest.raises(ValueError, match="same number"):
        list(data.batches(x, y[:3], 2, key=0))


def test_flips_keep_the_class_except_for_digits():
    assert not data.flips_keep_class("digits")
    assert all(data.flips_keep_class(d) for d in ("photos", "synthetic", "cifar10:/data/cifar-10-batches-py"))


def test_load_named_datasets():
    d = data.load("synthetic", size=8, n_train=12, n_test=4, num_classes=3)
    assert d.split.x_train.shape == (12, 3, 8, 8) and len(d.split.y_test) == 4 and d.num_classes == 3
    p = data.load("photos", size=8, n_train=14, n_test=7)
    assert p.num_classes == 7 and p.split.x_test.shape == (7, 3, 8, 8)
    g = data.load("digits", n_train=50, n_test=10)
    assert g.split.x_train.shape == (50, 3, 32, 32) and g.num_classes == 10
