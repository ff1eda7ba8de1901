"""Keep freed memory in the process, for benchmarks of training steps on CPU.

A training step allocates the same activations and gradients every step and frees them at
its end. glibc's ``malloc`` hands large freed blocks back to the operating system
(``munmap``, and trimming the heap's top), so the next step faults the same pages in again
and the kernel zeroes each one. Measured on the CIFAR CNN's zero-bubble pipeline (K = 2,
M = 8, one thread per stage): 4358 minor page faults per step on stage 0 against torch's
schedule's 1, and 10-15 % of every contender's stage CPU time. Raising glibc's mmap and
trim thresholds (``mallopt``, as ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...`` would
at start-up) keeps the pages mapped: faults fall to about 10 per step. Process-wide, so a
benchmark that sets it sets it for every contender in the process (ours and torch's alike);
PyTorch's CUDA caching allocator does the same for GPU memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Make glibc keep freed blocks up to ``threshold`` bytes in the process (no ``munmap``,
    no heap trimming below it). Returns whether it applied (``False`` off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mmap_max = min(threshold, 1 << 25)  # glibc caps the mmap threshold at 32 MiB (64-bit)
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_max)) and bool(
        mallopt(_M_TRIM_THRESHOLD, threshold)
    )
