"""Bytes of tensor storage alive on the CPU, counted from the tensors themselves.

CUDA keeps its own count (``torch.cuda.max_memory_allocated``); the CPU allocator keeps
none that Python can read, and a process's resident size (``psutil``) mixes tensors with
the interpreter, libraries and pages the allocator has not handed back. So
:class:`LiveStorages` counts storages:

* it starts from every tensor alive when it is entered (``gc`` finds the Python ones; the
  caller adds those only C++ holds, such as gradients, with :meth:`LiveStorages.add`), and
  then, as a ``TorchDispatchMode``, adds the storage of every tensor each operator returns
  (activations, gradients, buffers, the optimizer's state);
* it holds each storage by a weak reference, so a storage counts exactly as long as it
  lives, and at its current size (a storage resized to nothing, as ZeRO stage 3 and FSDP
  free gathered weights, counts 0 bytes until it is given its bytes back); storages shared
  by several tensors (views) count once; wrapper tensors (``DTensor``) count their inner
  tensors;
* after every operator it sums the live storages and keeps the largest sum: the peak.

A dispatch mode is entered per thread: operators that run on another thread (the
communication threads of ``ring_allreduce`` and ``zero``, which allocate the ring's
receive buffers: one chunk or segment per collective) are not seen; what they write into
a storage the step's thread made (a gathered unit) is. Tensors the caller passes as
``exclude`` (the data set) are left out.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """``tensor``, or the tensors a wrapper subclass (``DTensor``) holds."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        for name in attrs:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from plain_tensors(inner)
    else:
        yield tensor


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(key, bytes)`` of ``tensor``'s storage (``None`` for one without: meta, sparse)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if storage.device.type == "meta":
        return None
    return storage._cdata, storage.nbytes()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages of ``tensors`` (views of one storage count once)."""
    sizes: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        for plain in plain_tensors(tensor):
            key = storage_key(plain)
            if key is not None:
                sizes[key[0]] = key[1]
    return sum(sizes.values())


class LiveStorages(TorchDispatchMode):
    """Count the bytes of live tensor storage while entered; :attr:`peak` is the largest
    count seen after any operator (see the module)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._refs: dict[int, StorageWeakRef] = {}
        self._exclude = {k[0] for t in exclude for p in plain_tensors(t) if (k := storage_key(p))}
        self.peak = 0
        self.at_start = 0

    def add(self, *tensors: torch.Tensor | None) -> None:
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            for plain in plain_tensors(tensor):
                key = storage_key(plain)
                if key is not None and key[0] not in self._exclude and key[0] not in self._refs:
                    self._refs[key[0]] = StorageWeakRef(plain.untyped_storage())

    def live_bytes(self) -> int:
        """The bytes of every storage still alive, at its current size."""
        total, dead = 0, []
        for key, ref in self._refs.items():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                dead.append(key)
            else:
                total += storage.nbytes()
        for key in dead:
            del self._refs[key]
        return total

    def __enter__(self) -> LiveStorages:
        with warnings.catch_warnings():  # isinstance on a deprecated torch name warns
            warnings.simplefilter("ignore")
            self.add(*(o for o in gc.get_objects() if isinstance(o, torch.Tensor)))
        self.at_start = self.peak = self.live_bytes()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        self.peak = max(self.peak, self.live_bytes())
        return out
