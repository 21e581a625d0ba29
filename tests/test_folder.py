"""gradtie.folder (an ImageFolder listed) and gradtie.pipeline (its batches: crops, flips,
normalisation, the order, a file that does not decode), on a generated folder of JPEGs."""

import os
import shutil

import numpy as np
import pytest
from hypothesis import given, strategies as st

from gradtie import cli, data, folder, pipeline


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """7 classes × 3 training JPEGs of 48×40 px (and a truncated one, an empty one, a README.txt in
    the first class), 1 val JPEG a class."""
    return folder.write_photo_folder(tmp_path_factory.mktemp("photos") / "photos", per_class=3, val_per_class=1,
                                     size=(48, 40), corrupt=True)


# ---- the listing ------------------------------------------------------------------------------------

def test_classes_are_the_sorted_folder_names_and_labels_follow_them(photos):
    assert photos.classes == tuple(sorted(data.PHOTO_NAMES)) and photos.split == "folders"
    assert len(photos.train) == 7 * 3 + 2 and len(photos.val) == 7       # the two broken .jpg files are listed
    for listing in (photos.train, photos.val):
        for path, label in zip(listing.files, listing.labels):
            assert os.path.basename(os.path.dirname(path)) == photos.classes[label]
    assert photos.not_images == (str(photos.path / "train" / "astronaut" / "README.txt"),)
    line = photos.skipped_line()
    assert "README.txt" in line and "\n" not in line
    assert photos.fingerprint() == folder.read(photos.path).fingerprint()


def test_one_folder_is_split_by_a_fixed_fraction(tmp_path):
    f = folder.write_photo_folder(tmp_path / "one", per_class=5, val_per_class=5, size=(32, 32), split=False)
    again = folder.read(tmp_path / "one")
    assert f.split == "fraction" and again.train.files == f.train.files and again.val.files == f.val.files
    assert len(f.train) + len(f.val) == 70 and 0 < len(f.val) < 70
    assert not set(f.train.files) & set(f.val.files)
    # the split is by name: adding files moves none of the old ones
    extra = tmp_path / "one" / "coffee" / "zz_new.jpg"
    shutil.copy(f.train.files[0], extra)
    grown = folder.read(tmp_path / "one")
    assert set(f.val.files) <= set(grown.val.files) and set(f.train.files) <= set(grown.train.files)


def test_bad_folders_are_errors_naming_the_folder(tmp_path, photos):
    (tmp_path / "empty").mkdir()
    with pytest.raises(folder.FolderError, match=r"'.*empty' holds no images"):
        folder.read(tmp_path / "empty")
    with pytest.raises(folder.FolderError, match="no such folder"):
        folder.read(tmp_path / "missing")
    bare = tmp_path / "bare"
    (bare / "train" / "cat").mkdir(parents=True)
    (bare / "val" / "cat").mkdir(parents=True)
    (bare / "train" / "cat" / "notes.txt").write_text("no image")
    with pytest.raises(folder.FolderError, match=r"class 'cat' holds no JPEG or PNG"):
        folder.read(bare)
    odd = tmp_path / "odd"
    shutil.copytree(photos.path, odd)
    shutil.move(odd / "val" / "rocket", odd / "val" / "rockets")
    with pytest.raises(folder.FolderError, match=r"different classes \(only in train/: \['rocket'\]; "
                                                 r"only in val/: \['rockets'\]\)") as err:
        folder.read(odd)
    assert str(odd) in str(err.value) and "\n" not in str(err.value)


def test_gradtie_train_refuses_an_empty_folder_with_exit_3(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = cli.main(["train", "--data", f"folder:{tmp_path / 'empty'}", "--out", str(tmp_path / "run"),
                     "--replicas", "1"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_BAD_INPUT == 3
    assert "holds no images" in err and str(tmp_path / "empty") in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# ---- one image ------------------------------------------------------------------------------------------

@given(st.integers(0, 2**32 - 1), st.integers(1, 900), st.integers(1, 900))
def test_crop_box_lies_in_the_image_with_torchvisions_area_and_aspect(seed, width, height):
    rng = np.random.default_rng(seed)
    left, top, right, bottom = pipeline.crop_box(rng, width, height)
    assert 0 <= left < right <= width and 0 <= top < bottom <= height
    w, h = right - left, bottom - top
    inside = (pipeline.CROP_SCALE[0] * width * height * 0.9 <= w * h
              and pipeline.CROP_RATIO[0] * 0.9 <= w / h <= pipeline.CROP_RATIO[1] * 1.1)
    fallback = (left, top) == ((width - w) // 2, (height - h) // 2)     # the centre crop after ten misses
    assert inside or fallback


def test_a_flip_mirrors_the_crop_and_evaluation_is_the_centre(photos):
    path = photos.train.files[2]
    kept = pipeline.train_image(path, 24, np.random.default_rng(0), flip=False)
    for seed in range(20):      # a seed whose coin says flip: the same crop, mirrored
        mirrored = pipeline.train_image(path, 24, np.random.default_rng(seed), flip=True)
        plain = pipeline.train_image(path, 24, np.random.default_rng(seed), flip=False)
        if not np.array_equal(mirrored, plain):
            assert np.array_equal(mirrored, plain[:, :, ::-1]) and not np.array_equal(plain, plain[:, :, ::-1])
            break
    else:
        pytest.fail("no flip in 20 draws")
    assert kept.shape == (3, 24, 24) and kept.dtype == np.uint8
    # short side 300 → 256, then the centre 224: the centre 262.5-pixel square of the original
    assert pipeline.center_box(400, 300, 224) == pytest.approx((68.75, 18.75, 331.25, 281.25))
    e = pipeline.eval_image(path, 24)
    assert e.shape == (3, 24, 24) and np.array_equal(e, pipeline.eval_image(path, 24))


def test_normalisation_is_per_channel():
    x = np.zeros((1, 3, 2, 2), np.uint8)
    x[0, 1] = 255
    y = pipeline.normalise(x, "float64")
    expect = [(0 - pipeline.MEAN[0]) / pipeline.STD[0], (1 - pipeline.MEAN[1]) / pipeline.STD[1],
              (0 - pipeline.MEAN[2]) / pipeline.STD[2]]
    assert y.dtype == np.float64 and np.allclose(y[0, :, 0, 0], expect, rtol=1e-15)


# ---- batches ----------------------------------------------------------------------------------------------

def test_a_broken_file_is_skipped_for_the_next_in_the_order(photos):
    files = pipeline.Files(photos.train)
    broken = [i for i in range(len(files)) if "broken_" in files.path(i)]
    assert len(broken) == 2 and all(pipeline.why_unreadable(files.path(i)) for i in broken)
    assert pipeline.why_unreadable(files.path(0)) == ""
    decoder = pipeline._Decoder(files)
    good = next(i for i in range(len(files)) if i not in broken)
    order = np.asarray(broken + [good] + [i for i in range(len(files)) if i not in broken and i != good])
    image, label, skipped, first = decoder.first_good(order, 0, lambda p: pipeline.eval_image(p, 16))
    assert (label, skipped, first) == (files.labels[good], 2, broken[0])
    assert np.array_equal(image, pipeline.eval_image(files.path(good), 16))


def test_the_order_does_not_depend_on_processes_or_workers(photos):
    """Two processes' rows of a global batch, one after the other, are the one-process batch; the
    same seed gives the same batches, another seed others."""
    files = pipeline.Files(photos.train)
    whole = pipeline.TrainBatches(files, 16, 5, 2, pipeline.Layout(8))(1)
    halves = [pipeline.TrainBatches(files, 16, 5, 2, pipeline.Layout(8, p, 2))(1) for p in (0, 1)]
    for key in ("image", "label", "skipped", "skipped_record"):
        assert np.array_equal(np.concatenate([h[key] for h in halves]), whole[key]), key
    assert np.array_equal(pipeline.TrainBatches(files, 16, 5, 2, pipeline.Layout(8))(1)["image"], whole["image"])
    assert not np.array_equal(pipeline.TrainBatches(files, 16, 6, 2, pipeline.Layout(8))(1)["image"], whole["image"])
    epoch2 = pipeline.TrainBatches(files, 16, 5, 2, pipeline.Layout(8))(3)       # epoch 2's second batch
    assert not np.array_equal(epoch2["image"], whole["image"])


def test_evaluation_chunks_mask_the_padding_and_the_broken(photos, tmp_path):
    broken_val = tmp_path / "val"
    shutil.copytree(photos.path, broken_val)
    (broken_val / "val" / "chelsea" / "zz_broken.png").write_bytes(b"\x89PNG not really")
    f = folder.read(broken_val)
    files = pipeline.Files(f.val)
    chunks = list(pipeline.chunks(pipeline.EvalChunks(files, 16, pipeline.Layout(5)), 2, dtype="float32"))
    valid = np.concatenate([c["valid"] for c in chunks])
    assert len(files) == 8 and valid.tolist() == [1, 1, 0, 1, 1, 1, 1, 1, 0, 0]     # chelsea's broken png, padding
    assert pipeline.skipped_records(chunks) == [2]
    assert chunks[0]["image"].dtype == np.float32 and chunks[0]["image"].shape == (5, 3, 16, 16)


def test_the_input_rate_is_measured(photos, capsys):
    rate = pipeline.measure(photos.train, workers=0, size=32, batch=4, batches=2, warmup=1)
    assert rate.images == 8 and rate.images_per_second > 0 and "images/s" in rate.row()
    code = cli.main(["bench", "--input", "--data", f"folder:{photos.path}", "--workers", "0", "--image-size", "32",
                     "--batch", "4", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "in-process thread" in out and "images/s" in out
