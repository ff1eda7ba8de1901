import logging
import os
import warnings
from pathlib import Path

import pytest

# Multi-process tests fail fast: a silent peer times out after 20 s, not 60.
os.environ.setdefault("LIGHTNING_PAR_TIMEOUT", "20")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*does not have many workers.*")


@pytest.fixture(scope="session")
def mini_dir() -> Path:
    """The real CIFAR-10 subset beside the project (CI has ../shared beside the clone)."""
    from lightning_par.data import find_cifar10_mini

    path = find_cifar10_mini()
    assert path is not None, (
        "cifar10-mini not found: set LIGHTNING_PAR_CIFAR10_MINI or put shared/ beside the repo"
    )
    return path


@pytest.fixture(autouse=True)
def _run_in_tmp_dir(tmp_path, monkeypatch):
    """Each test runs in its own temporary folder, so Trainer logs and checkpoints written
    to the working directory never land in the repository."""
    monkeypatch.chdir(tmp_path)
