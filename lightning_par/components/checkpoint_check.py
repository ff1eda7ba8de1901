"""A checkpoint path checked in the main process, before any rank starts.

``Trainer.fit(model, ckpt_path=...)`` reads the file only once every rank is up, so a
missing or broken file would cost a launch and end in torch's raw error (a bare
``EOFError``, advice to pass ``weights_only=False``). :func:`check_checkpoint` looks at the
file first: it exists, is a readable file, starts like a ``torch.save`` file, and holds a
``state_dict``. Nothing is unpickled beyond what ``weights_only=True`` allows; a file that
needs more (a checkpoint with custom objects in its hyper-parameters) is left to Lightning.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

#: ``ckpt_path`` values Lightning resolves itself (not file names).
SPECIAL_PATHS = ("last", "best", "hpc", "registry")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format
PICKLE_MAGIC = b"\x80"  # the legacy format: a pickle (protocol 2+)
HOW_TO_FIX = (
    "give the path of a .ckpt file written by Lightning (ModelCheckpoint saves them under "
    "<default_root_dir>/lightning_logs/version_N/checkpoints/), or ckpt_path='last'"
)


class CheckpointError(ValueError):
    """``ckpt_path`` names no usable checkpoint; the message names the file and the fix."""

    def __init__(self, path: Any, problem: str) -> None:
        super().__init__(f"ckpt_path={str(path)!r} {problem}: {HOW_TO_FIX}.")
        self.path = path


def is_checked(path: Any) -> bool:
    """A local file path (not ``None``, ``"last"``/``"best"``/``"hpc"``, a URL or a registry)."""
    if path is None:
        return False
    text = str(path)
    return text not in SPECIAL_PATHS and not text.startswith("registry:") and "://" not in text


def check_checkpoint(path: Any) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is skipped or a readable checkpoint."""
    if not is_checked(path):
        return
    file = Path(path)
    if not file.exists():
        raise CheckpointError(path, "does not exist")
    if file.is_dir():
        found = sorted(p.name for p in file.glob("*.ckpt"))[:3]
        hint = f" (it holds {', '.join(found)})" if found else ""
        raise CheckpointError(path, f"is a directory, not a checkpoint file{hint}")
    try:
        with open(file, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise CheckpointError(path, f"cannot be read ({err.strerror or err})") from None
    if not head:
        raise CheckpointError(path, "is an empty file (0 bytes), not a checkpoint")
    if not (head.startswith(ZIP_MAGIC) or head.startswith(PICKLE_MAGIC)):
        raise CheckpointError(path, "is not a checkpoint (not a file torch.save wrote)")
    _check_contents(path, file, mmap=head.startswith(ZIP_MAGIC))


def _check_contents(path: Any, file: Path, mmap: bool) -> None:
    """Load with ``weights_only=True`` (tensors mapped, not read, for the zip format)."""
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            return  # objects weights_only refuses to build: Lightning decides (not checked)
        raise CheckpointError(path, "is corrupt (its pickled data cannot be read)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        first = str(err).split(".")[0].strip() or type(err).__name__
        raise CheckpointError(path, f"is truncated or corrupt ({first})") from None
    if not isinstance(data, dict) or "state_dict" not in data:
        kind = (
            f"a dict without 'state_dict' (keys: {sorted(map(str, data))[:5]})"
            if isinstance(data, dict)
            else f"a {type(data).__name__}"
        )
        raise CheckpointError(path, f"is not a Lightning checkpoint: it holds {kind}")
