"""What the C kernels move: the one count of the bytes each call must move, the calls of a piece of code timed and
counted, and the copy bandwidth to hold them against (docs/kernels.md §8).

`profile_cpu_step` (every kernel inside a training step), `bench_depth_scaling` (the depth mix at 6-48 sublayers)
and `bench_inference` (the forward's kernels) all count bytes here, so their bandwidths and floors mean the same.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from attnres_lens.kernels import cpu_build

DEPTH_MIX_KERNELS = (
    "depth_attention_forward",
    "depth_attention_backward",
    "depth_attention_multi",
    "depth_attention_multi_backward",
)


def kernel_bytes(name: str, args: tuple, element: int) -> int:
    """Bytes the C kernel `name` must move for one call with ctypes arguments `args` (in `cpu_build._bind`'s order)
    of `element`-byte reals: sources, inputs and outputs once each, per-token statistics included; [D] parameters
    and tables left out."""
    if name == "depth_attention_forward":
        n_sources, n_tokens, d_model = args[1], args[2], args[3]
        norm, h = args[8] is not None, args[10] is not None
        rows = n_sources + h + norm  # every source read; h (where kept) and y written
        return element * (rows * n_tokens * d_model + (3 * n_sources + norm) * n_tokens)
    if name == "depth_attention_backward":
        n_sources, n_tokens, d_model = args[1], args[2], args[3]
        h, norm, grad_h, accumulate = args[8] is not None, args[9] is not None, args[12] is not None, args[14]
        added = sum(accumulate[s] for s in range(n_sources)) if accumulate is not None else 0
        # every source read and its gradient written (read first where added into a shared buffer, docs/kernels.md
        # §5); dy with a fused pre-norm, and h where the forward kept it (else mixed again from the sources); dh
        # where h had other uses
        rows = 2 * n_sources + added + h + norm + grad_h
        return element * (rows * n_tokens * d_model + (3 * n_sources + norm) * n_tokens)
    if name == "depth_attention_multi":
        n_sources, n_tokens, d_model, n_queries, prior, prior_tokens = (
            args[1],
            args[2],
            args[3],
            args[5],
            args[6],
            args[8],
        )
        # every source read, each query's mix and log-sum-exp written, its prior's read
        return element * (
            (n_sources + n_queries) * n_tokens * d_model
            + n_queries * n_tokens
            + (n_queries * prior_tokens * (d_model + 1) if prior is not None else 0)
        )
    if name == "depth_attention_multi_backward":
        n_sources, n_tokens, d_model, n_queries, prior = args[1], args[2], args[3], args[5], args[6] is not None
        grad_mix, grad_lse, accumulate = args[10], args[11], args[13]
        with_dh = sum(grad_mix[q] is not None for q in range(n_queries))
        with_dlse = sum(grad_lse[q] is not None for q in range(n_queries))
        added = sum(accumulate[s] for s in range(n_sources)) if accumulate is not None else 0
        # every source read and its gradient written (read first where added); each dh; the prior read and its
        # gradient written; the log-sum-exps read, dlse read, dl written
        rows = 2 * n_sources + added + with_dh + 2 * n_queries * prior
        return element * (rows * n_tokens * d_model + (n_queries * (1 + 2 * prior) + with_dlse) * n_tokens)
    if name == "rms_norm_forward":
        return element * (2 * args[2] * args[3] + args[2])
    if name == "rms_norm_backward":
        return element * (3 * args[4] * args[5] + args[4])
    if name == "token_shift_forward":
        return element * 2 * math.prod(args[3:7])
    if name == "rotary_forward":
        return element * 2 * math.prod(args[4:8])
    if name == "token_shift_backward":
        return element * 3 * math.prod(args[4:8])
    if name == "causal_attention_forward":  # q, k and v read, the output written
        return element * 4 * math.prod(args[3:7])
    raise ValueError(f"no byte count for the C kernel {name!r}: add one to kernel_bytes")


class CountingLibrary:
    """A C library (`cpu_build.cpu_library`'s) with each kernel call timed and its bytes counted: `totals` maps a
    kernel's name to `[calls, seconds, bytes]`."""

    def __init__(self, library: object, element: int = torch.float32.itemsize):
        self._library, self._element, self.totals = library, element, {}

    def __getattr__(self, name: str):
        function = getattr(self._library, name)
        if not name.endswith(("_forward", "_backward", "_multi")):
            return function  # flags and queries (thread_pool, openmp_threads, vector_sums)

        def timed(*args):
            start = time.perf_counter()
            result = function(*args)
            total = self.totals.setdefault(name, [0, 0.0, 0])
            total[0] += 1
            total[1] += time.perf_counter() - start
            total[2] += kernel_bytes(name, args, self._element)
            return result

        return timed

    def summed(self, names: tuple[str, ...]) -> tuple[int, float, int]:
        """`(calls, seconds, bytes)` of the kernels `names` together."""
        totals = [self.totals.get(name, [0, 0.0, 0]) for name in names]
        return sum(t[0] for t in totals), sum(t[1] for t in totals), sum(t[2] for t in totals)


@contextlib.contextmanager
def kernels_from(library: object) -> Iterator[None]:
    """Every C call of the kernels goes to `library`."""
    shipped = cpu_build.cpu_library
    cpu_build.cpu_library = lambda dtype: library
    try:
        yield
    finally:
        cpu_build.cpu_library = shipped


def counted_calls(call: Callable[[], object], dtype: torch.dtype = torch.float32) -> CountingLibrary:
    """Run `call` with every C call of the kernels (the `dtype` library) timed and counted."""
    counting = CountingLibrary(cpu_build.cpu_library(dtype), dtype.itemsize)
    with kernels_from(counting):
        call()
    return counting


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """GB/s of torch's `copy_` of a `megabytes` buffer (read + write) at the current torch thread count: the rate at
    which this machine moves any bytes, to hold a kernel's against."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times[1:]) / 1e9
