"""Every data source, the mini folder, and the errors when data is missing."""

import pickle
import shutil

import pytest
import torch

from lightning_par.data import (
    CIFAR_MEAN,
    CIFAR_STD,
    CIFAR10DataModule,
    DataNotFoundError,
    SyntheticCIFAR10,
    eval_transform,
    find_cifar10_mini,
    train_transform,
)
from lightning_par.data.sources import synthesize


def test_cifar10_mini_has_the_real_images(mini_dir):
    dm = CIFAR10DataModule(source="cifar10-mini", batch_size=64, val_size=500)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4585, 500, 1017)
    assert "cifar-10-batches-py" in dm.source_used
    # Test image 0 is the official test image 0 (a cat), pixel for pixel after normalising.
    with open(mini_dir / "cifar-10-batches-py" / "test_batch", "rb") as f:
        raw = pickle.load(f, encoding="latin1")
    image, label = dm.test_set[0]
    expected = torch.as_tensor(raw["data"][0]).reshape(3, 32, 32).float() / 255
    expected = (expected - torch.tensor(CIFAR_MEAN)[:, None, None]) / torch.tensor(CIFAR_STD)[
        :, None, None
    ]
    assert label == raw["labels"][0] == 3
    torch.testing.assert_close(image, expected)
    counts = torch.bincount(dm.test_set.labels, minlength=10)
    assert counts.min() >= 87 and counts.max() <= 114


def test_folder_source_with_explicit_data_dir(mini_dir):
    dm = CIFAR10DataModule(source="folder", data_dir=str(mini_dir), val_size=0)
    dm.setup()
    assert len(dm.train_set) == 5085
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 3, 32, 32) and x.dtype == torch.float32  # the default batch size
    assert y.dtype == torch.int64


def test_folder_layout_may_be_the_batches_folder_itself(mini_dir):
    dm = CIFAR10DataModule(source="folder", data_dir=str(mini_dir / "cifar-10-batches-py"))
    dm.setup()
    assert len(dm.test_set) == 1017


def test_corrupted_batch_is_caught_by_md5sums(mini_dir, tmp_path):
    copy = tmp_path / "mini"
    shutil.copytree(mini_dir, copy)
    with open(copy / "cifar-10-batches-py" / "test_batch", "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="corrupted"):
        CIFAR10DataModule(source="folder", data_dir=str(copy)).setup()


def test_synthetic_is_deterministic_any_size_and_learnable():
    a, la = synthesize(300, seed=3, split=0)
    b, lb = synthesize(300, seed=3, split=0)
    assert torch.equal(a, b) and torch.equal(la, lb) and a.dtype == torch.uint8
    assert not torch.equal(a, synthesize(300, seed=4, split=0)[0])
    assert len(SyntheticCIFAR10(size=7)) == 7
    # Learnable: nearest class mean, fitted on train, classifies held-out test data.
    train, test = SyntheticCIFAR10(2000, seed=1), SyntheticCIFAR10(500, seed=1, train=False)
    xs = torch.stack([train[i][0] for i in range(len(train))]).flatten(1)
    means = torch.stack([xs[train.labels == c].mean(0) for c in range(10)])
    xt = torch.stack([test[i][0] for i in range(len(test))]).flatten(1)
    accuracy = (torch.cdist(xt, means).argmin(1) == test.labels).float().mean()
    assert accuracy > 0.6


def test_augmentation_changes_train_images_only():
    dm = CIFAR10DataModule(source="synthetic", synthetic_size=64, val_size=16)
    dm.setup()
    torch.manual_seed(0)
    first = torch.stack([dm.train_set[0][0] for _ in range(8)])
    assert not all(torch.equal(first[0], f) for f in first[1:])
    assert torch.equal(dm.val_set[0][0], dm.val_set[0][0])


def test_auto_with_nothing_names_the_three_ways(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_PAR_CIFAR10_MINI", raising=False)
    dm = CIFAR10DataModule(source="auto", data_dir=str(tmp_path), download=False)
    with pytest.raises(DataNotFoundError) as err:
        dm.setup()
    text = str(err.value)
    assert "source='torchvision'" in text and "cifar10-mini" in text and "synthetic" in text
    assert "Traceback" not in text


def test_auto_takes_a_configured_folder(tmp_path, monkeypatch, mini_dir):
    monkeypatch.setenv("LIGHTNING_PAR_CIFAR10_MINI", str(mini_dir))
    dm = CIFAR10DataModule(source="auto", data_dir=str(tmp_path), download=False)
    with pytest.raises(DataNotFoundError):  # data_dir was given explicitly and is empty
        dm.setup()
    monkeypatch.setenv("LIGHTNING_PAR_DATA", str(tmp_path))
    dm = CIFAR10DataModule(source="auto", download=False)
    dm.setup()
    assert "cifar10-mini" in dm.source_used


def test_torchvision_offline_says_what_is_missing(tmp_path):
    dm = CIFAR10DataModule(source="torchvision", data_dir=str(tmp_path), download=False)
    with pytest.raises(DataNotFoundError, match="torchvision could not provide CIFAR-10"):
        dm.setup()


def test_prepare_data_downloads_only_when_files_are_missing(tmp_path, monkeypatch, mini_dir):
    import lightning_par.data.datamodule as datamodule

    calls = []
    monkeypatch.setattr(datamodule, "load_torchvision", lambda *a: calls.append(a))
    dm = CIFAR10DataModule(source="torchvision", data_dir=str(tmp_path))
    dm.prepare_data()
    assert [(train, download) for _, train, download in calls] == [(True, True), (False, True)]
    calls.clear()
    # every batch file present (the mini set has the official layout): nothing to read
    (tmp_path / "cifar-10-batches-py").symlink_to(mini_dir / "cifar-10-batches-py")
    dm.prepare_data()
    assert calls == []


def test_data_env_var_sets_the_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PAR_DATA", str(tmp_path))
    assert CIFAR10DataModule().data_dir == tmp_path


def test_find_cifar10_mini_honours_the_env_var(tmp_path, monkeypatch, mini_dir):
    monkeypatch.setenv("LIGHTNING_PAR_CIFAR10_MINI", str(mini_dir))
    assert find_cifar10_mini() == mini_dir


@pytest.mark.parametrize("source", ["cifar10-mini", "auto"])
def test_a_wrong_cifar10_mini_env_var_is_an_error_not_a_fallback(tmp_path, monkeypatch, source):
    monkeypatch.setenv("LIGHTNING_PAR_CIFAR10_MINI", str(tmp_path / "typo"))
    monkeypatch.setenv("LIGHTNING_PAR_DATA", str(tmp_path / "empty"))
    with pytest.raises(DataNotFoundError, match="LIGHTNING_PAR_CIFAR10_MINI=.*typo"):
        find_cifar10_mini()
    dm = CIFAR10DataModule(source=source, download=False)
    with pytest.raises(DataNotFoundError, match="LIGHTNING_PAR_CIFAR10_MINI"):
        dm.setup("fit")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "imagenet"}, "not one of"),
        ({"batch_size": 0}, "batch_size"),
        ({"val_size": -1}, "val_size"),
    ],
)
def test_bad_options_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CIFAR10DataModule(**kwargs)


def test_validation_split_cannot_swallow_the_training_set():
    with pytest.raises(ValueError, match="leaves no training images"):
        CIFAR10DataModule(source="synthetic", synthetic_size=10, val_size=10).setup()


def test_training_batches_are_full_by_default(mini_dir):
    # the default split leaves 4 577 = 143 x 32 + 1 images: no one-image batch at the end
    dm = CIFAR10DataModule(source="cifar10-mini", data_dir=str(mini_dir))
    dm.setup("fit")
    train = dm.train_dataloader()
    assert len(dm.train_set) == 4577 and len(train) == 143 and train.drop_last
    assert len(dm.val_dataloader()) == 16 and not dm.val_dataloader().drop_last  # 508 kept
    keep = CIFAR10DataModule(source="cifar10-mini", data_dir=str(mini_dir), drop_last=False)
    keep.setup("fit")
    assert len(keep.train_dataloader()) == 144


def test_the_transforms_are_torchvisions_exactly():
    # ours compute what torchvision's v2 transforms compute, drawing the same random numbers
    # in the same order: the same images for the same seed, and the same generator after
    v2 = pytest.importorskip("torchvision.transforms.v2")
    theirs_train = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(),
                               v2.ToDtype(torch.float32, scale=True),
                               v2.Normalize(CIFAR_MEAN, CIFAR_STD)])  # fmt: skip
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    for ours, theirs in [(train_transform(), theirs_train),
                         (eval_transform(), v2.Compose(theirs_train.transforms[2:]))]:  # fmt: skip
        torch.manual_seed(5)
        mine = torch.stack([ours(image) for image in images])
        after = torch.rand(1)
        torch.manual_seed(5)
        assert torch.equal(mine, torch.stack([theirs(image) for image in images]))
        assert torch.equal(after, torch.rand(1))
    # the crops and flips moved the pixels (the comparison is not of untouched images)
    torch.manual_seed(5)
    assert not torch.equal(train_transform()(images[0]), eval_transform()(images[0]))
