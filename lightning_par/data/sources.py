"""Where CIFAR-10 comes from: torchvision's download, a local batches folder, or synthesis.

Every source yields the same thing, uint8 images ``[N, 3, 32, 32]`` and int64 labels, so
transforms, samplers and models never care which one was used.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import torch

BATCHES_FOLDER = "cifar-10-batches-py"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]
# Per-channel statistics of the CIFAR-10 training set.
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
MINI_ENV = "LIGHTNING_PAR_CIFAR10_MINI"


class DataNotFoundError(FileNotFoundError):
    """No CIFAR-10 data could be found or downloaded; the message says how to get some."""


def how_to_get_data(data_dir: Path) -> str:
    return (
        f"No CIFAR-10 data found under {data_dir}. Three ways to get data:\n"
        f"  1. full CIFAR-10: on a machine with internet, use source='torchvision' (it "
        f"downloads 163 MB into {data_dir}), or copy an existing '{BATCHES_FOLDER}' folder "
        "there;\n"
        "  2. a local folder in the official layout, e.g. the real 5 085-image subset: "
        "source='cifar10-mini', data_dir=<path to cifar10-mini> (or set "
        f"{MINI_ENV}=<path>);\n"
        "  3. synthetic CIFAR-shaped data (learnable, no files): source='synthetic'."
    )


def batches_dir(root: str | os.PathLike) -> Path | None:
    """``root`` itself or ``root/cifar-10-batches-py``, whichever holds the batch files."""
    root = Path(root)
    for candidate in (root / BATCHES_FOLDER, root):
        if all((candidate / f).is_file() for f in TRAIN_FILES[:1] + TEST_FILES):
            return candidate
    return None


def find_cifar10_mini() -> Path | None:
    """The real CIFAR-10 subset shipped beside the project (``shared/datasets/cifar10-mini``).

    Looked up in ``$LIGHTNING_PAR_CIFAR10_MINI``, then beside the repository root and the
    current directory's parents. Returns ``None`` when it is nowhere; a
    ``$LIGHTNING_PAR_CIFAR10_MINI`` that names no batches folder is an error, not a
    reason to look elsewhere, so a typo never silently picks up other data.
    """
    env = os.environ.get(MINI_ENV)
    if env:
        if batches_dir(env) is None:
            raise DataNotFoundError(
                f"{MINI_ENV}={env} holds no CIFAR-10 batch files (expected "
                f"data_batch_1 and test_batch there or in {env}/{BATCHES_FOLDER}); fix "
                f"the path or unset {MINI_ENV}"
            )
        return Path(env)
    candidates = []
    here = Path(__file__).resolve()
    for base in [*here.parents, *Path.cwd().resolve().parents, Path.cwd().resolve()]:
        candidates.append(base / "shared" / "datasets" / "cifar10-mini")
    for cand in candidates:
        if batches_dir(cand) is not None:
            return cand
    return None


def has_full_cifar10(root: str | os.PathLike) -> bool:
    """Whether ``root/cifar-10-batches-py`` holds every batch file of the full set."""
    folder = Path(root) / BATCHES_FOLDER
    return all((folder / name).is_file() for name in TRAIN_FILES + TEST_FILES)


def verify_md5sums(folder: Path) -> None:
    """Check the batch files against a ``MD5SUMS`` file, where the folder (or its parent)
    has one: the mini subset carries its own, since torchvision's checksums don't apply."""
    for sums in (folder / "MD5SUMS", folder.parent / "MD5SUMS"):
        if sums.is_file():
            for line in sums.read_text().splitlines():
                if not line.strip():
                    continue
                digest, name = line.split()
                path = folder / name
                if path.is_file() and hashlib.md5(path.read_bytes()).hexdigest() != digest:
                    raise ValueError(f"{path} is corrupted: its MD5 does not match {sums}")
            return


def load_batches(folder: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Read official-layout pickles (protocol 2 or 4, bytes or str keys)."""
    images, labels = [], []
    for name in TRAIN_FILES if train else TEST_FILES:
        path = folder / name
        if not path.is_file():
            if train and images:  # a subset may ship fewer training batches
                continue
            raise DataNotFoundError(f"{path} is missing")
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        entry = {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
        images.append(torch.as_tensor(entry["data"]).reshape(-1, 3, 32, 32))
        labels.append(torch.as_tensor(entry.get("labels", entry.get("fine_labels"))))
    return torch.cat(images), torch.cat(labels).long()


def load_torchvision(root: Path, train: bool, download: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Full CIFAR-10 through ``torchvision.datasets.CIFAR10`` (downloads with its progress
    bar when allowed; checks torchvision's checksums)."""
    from torchvision.datasets import CIFAR10

    ds = CIFAR10(str(root), train=train, download=download)
    images = torch.as_tensor(ds.data).permute(0, 3, 1, 2).contiguous()
    return images, torch.as_tensor(ds.targets).long()


def synthesize(size: int, seed: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable CIFAR-shaped data: each class has a colour and a smooth pattern (a random
    4x4 image upsampled to 32x32); a sample is its class's colour and pattern, the pattern
    randomly shifted, plus noise. Colour makes classes easy, pattern makes them image-like.

    Deterministic in ``(seed, split)``; the class patterns depend on ``seed`` only, so a
    train and a test split of the same seed share classes.
    """
    if size < 0:
        raise ValueError(f"synthetic size must be >= 0, got {size}")
    class_gen = torch.Generator().manual_seed(seed)
    colours = torch.rand(10, 3, 1, 1, generator=class_gen)
    patterns = torch.rand(10, 3, 4, 4, generator=class_gen)
    patterns = torch.nn.functional.interpolate(patterns, size=32, mode="bilinear")
    protos = 0.5 * colours + 0.5 * patterns
    gen = torch.Generator().manual_seed(seed * 1000 + split + 1)
    labels = torch.randint(0, 10, (size,), generator=gen)
    shifts = torch.randint(-3, 4, (size, 2), generator=gen)
    images = protos[labels]
    for i, (dy, dx) in enumerate(shifts.tolist()):
        images[i] = images[i].roll((dy, dx), dims=(1, 2))
    images = images * 0.7 + 0.3 * torch.rand(size, 3, 32, 32, generator=gen)
    return (images * 255).round().clamp(0, 255).to(torch.uint8), labels
