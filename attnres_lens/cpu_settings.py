"""Process-wide CPU settings for the command-line tools (docs/kernels.md §11): torch's thread count, how the C
allocator treats freed memory, and Python's cyclic garbage collector.

Both act on the whole process, so the library never applies them on import: the `attnres-lens` commands do, for
their own process, and a notebook or script may call `configure` itself.

Freed memory. A forward pass allocates activation-sized temporaries of a few MB each. glibc's malloc serves
blocks that size with fresh `mmap`s, or trims them off its heap when they are freed, so the next pass page-faults
the same memory in again, over a million minor faults in one causal-routing table of a 12-layer Full model.
Raising its mmap and trim thresholds keeps freed blocks for reuse: no faults, and a faster table (docs/kernels.md
§11 has the timings). The cost is that the process holds on to its peak memory until it exits, which is right for
a command that ends and wrong for a long-lived server (the dashboard does not call this).

The garbage collector. A command imports over a million Python objects (torch, TransformerLens, transformers,
pandas) that live until it exits, yet every full collection traverses them all, and the interpreter's exit runs
more. `gc.freeze()` once the imports are done moves them to a permanent generation the collector skips, which
shortens the full collections and the process's exit several-fold (docs/kernels.md §11). Objects made afterwards
are collected as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import platform

import torch

# mallopt parameters (glibc malloc.h) and the largest mmap threshold it accepts on 64-bit machines
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MAX_MMAP_THRESHOLD = 32 << 20
_NEVER_TRIM = (1 << 31) - 1  # mallopt takes a C int


def configure(threads: int = 0) -> None:
    """`threads` torch threads (0: torch's default, one per core), `keep_freed_memory()`, and the objects alive now
    (call it after the imports) frozen out of the garbage collector's traversals (`gc.freeze`)."""
    set_threads(threads)
    keep_freed_memory()
    _freeze_imports()


@functools.cache
def _freeze_imports() -> None:
    """Once per process (cyclic garbage alive at that moment is never freed, so repeated calls would keep more)."""
    gc.freeze()


def max_threads() -> int:
    """The most torch threads a process may ask for: 8 per core, at least 64. More only oversubscribe the cores,
    and far more crash torch's OpenMP pool (100000 threads: a segmentation fault at the first parallel op)."""
    return max(64, 8 * (os.cpu_count() or 1))


def set_threads(threads: int) -> None:
    """torch's intra-op thread count; 0 leaves torch's default (one per core)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be a whole number >= 0 (0 = one per core), got {threads!r}")
    if threads > max_threads():
        raise ValueError(
            f"threads={threads} is more than this machine can run ({os.cpu_count()} cores; at most "
            f"{max_threads()}); use 0 for one per core (train.threads; resuming, --threads)"
        )
    if threads:
        torch.set_num_threads(threads)


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks up to 32 MB for reuse instead of returning them to the system.
    True if applied; False where the C library is not glibc (nothing to tune, nothing changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success; 0 means glibc refused the value, which leaves its default in place
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    )
