"""Building and loading the C kernels' shared library: the ``cpu`` backend's compiler cache (docs/kernels.md §6).

The C sources (``cpu_build.c``, ``cpu_depth.c``, ``cpu_elementwise.c``, ``cpu_attention.c`` and their private header
``cpu_kernels.h``) are compiled together on first use with the system C compiler (``$CC``, else ``cc``), once per
element type, into ``$ATTNRES_LENS_KERNEL_CACHE`` (default ``~/.cache/attnres_lens/kernels``), and loaded with
ctypes: no torch headers, so a build is quick. The cache key covers every source file, the flags and the CPU, so an
edited source is recompiled and a shared home directory never serves a library built for another processor.
ctypes releases the GIL during a call, and the kernels split their rows over torch's own OpenMP threads where the
work pays for them (`kernel_threads`). The wrappers reach the library through `cpu_library` alone, so a benchmark or
a test redirects every C call by replacing that one function.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

_FOLDER = Path(__file__).parent
# compiled together into one library; the header is read for the cache key only (the compiler finds it beside them)
SOURCES = tuple(_FOLDER / name for name in ("cpu_build.c", "cpu_depth.c", "cpu_elementwise.c", "cpu_attention.c"))
HEADERS = (_FOLDER / "cpu_kernels.h",)
CACHE_ENV_VAR = "ATTNRES_LENS_KERNEL_CACHE"
MAX_THREADS = 64  # the C header's MAX_THREADS
# The kernels split their rows over torch's OpenMP pool, whose threads are awake between torch's ops, so a second
# thread pays from tens of thousands of elements; the build without OpenMP starts a pthread per call, which pays
# only from about a million (docs/kernels.md §6 and §11 have the measurements).
MIN_ELEMENTS_PER_THREAD = 1 << 15
PTHREAD_MIN_ELEMENTS_PER_THREAD = 1 << 20
REAL_TYPES = {torch.float32: "float", torch.float64: "double"}  # the element types a library is built for
_BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-fno-math-errno"]
# Tried in turn: -march=native gives the compiler AVX2/FMA where the machine has them (and the C files' vector sums
# with them); some compilers reject it, and the portable build follows. 256-bit vectors: at d_model 64 a 512-bit
# row is 4 iterations and its reductions dominate (docs/kernels.md §11).
ARCH_FLAGS = (["-march=native", "-mprefer-vector-width=256"], [])
# OpenMP puts the kernel's threads in torch's pool; a compiler without it (Apple's clang) builds the pthread form.
THREAD_FLAGS = (["-fopenmp"], [])


class CpuKernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded (no compiler, a failed build, an unwritable cache)."""


def _cache_dir() -> Path:
    """Where built libraries are kept: $ATTNRES_LENS_KERNEL_CACHE, else the user's cache folder."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres_lens" / "kernels"


def _cpu_fingerprint() -> str:
    """The processor model and its feature flags, since the library is built with -march=native."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _source_texts() -> list[str]:
    """Every C source and header, named: the cache key covers them all, so an edit to any one recompiles."""
    return [f"{path.name}\n{path.read_text()}" for path in (*SOURCES, *HEADERS)]


def _compile(compiler: str, flags: list[str], target: Path) -> subprocess.CompletedProcess:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so.tmp", delete=False) as handle:
        partial = Path(handle.name)
    try:
        result = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(partial), "-lm"], capture_output=True, text=True
        )
        if result.returncode == 0:
            partial.chmod(0o755)  # temporary files are private; a shared cache must be loadable by its other users
            os.replace(partial, target)  # atomic: a concurrent process never loads a half-written library
        return result
    finally:
        partial.unlink(missing_ok=True)


_BUILD_LOCK = threading.Lock()


@functools.cache
def _library(real_type: str) -> ctypes.CDLL:
    # Worker threads (exact interventions) can meet the kernel first at once: one builds, the others then load its
    # file (lru_cache alone would let each of them build).
    with _BUILD_LOCK:
        return _build_library(real_type)


def _build_library(real_type: str) -> ctypes.CDLL:
    """The library for `real_type` ("float" or "double"), from the cache or compiled into it: each flag set of
    `ARCH_FLAGS` x `THREAD_FLAGS` in turn until one builds and loads (raises CpuKernelUnavailable with every
    attempt's error otherwise)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise CpuKernelUnavailable(
            f"the cpu backend compiles a C kernel but no C compiler {compiler!r} was found; install one "
            "(e.g. `apt-get install gcc`), set $CC, or use backend='torch'"
        )
    errors = []
    for arch_flags, thread_flags in itertools.product(ARCH_FLAGS, THREAD_FLAGS):
        flags = [*_BASE_FLAGS, *arch_flags, *thread_flags, f"-DREAL={real_type}"]
        key = hashlib.sha256(
            "\0".join([*_source_texts(), compiler, *flags, platform.machine(), _cpu_fingerprint()]).encode()
        ).hexdigest()[:16]
        target = _cache_dir() / f"depth_attention_{real_type}_{key}.so"
        # a cached file that will not load (truncated, from a noexec mount) is rebuilt once before giving up
        for rebuild in (not target.exists(), True):
            if rebuild:
                try:
                    result = _compile(compiler, flags, target)
                except OSError as err:
                    raise CpuKernelUnavailable(
                        f"cannot build the cpu kernel in {target.parent} ({err}); set ${CACHE_ENV_VAR} to a "
                        "writable folder or use backend='torch'"
                    ) from err
                if result.returncode != 0:
                    errors.append(f"$ {compiler} {' '.join(flags)}\n{result.stderr.strip()}")
                    break
            try:
                return _bind(ctypes.CDLL(str(target)))
            except OSError as err:
                errors.append(f"cannot load {target}: {err}")
    raise CpuKernelUnavailable(
        "building or loading the cpu depth-attention kernel failed; use backend='torch' meanwhile.\n"
        + "\n\n".join(errors)
    )


def _signatures() -> dict[str, tuple]:
    """Each C function's (return type, argument types), in the C files' order of arguments."""
    pointer, int64, c_int, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    return {
        "depth_attention_forward": (
            None,
            [
                pointer,
                int64,
                int64,
                int64,
                pointer,
                pointer,
                pointer,
                real,
                pointer,
                real,
                pointer,
                pointer,
                pointer,
                pointer,
                c_int,
            ],
        ),
        "depth_attention_backward": (
            c_int,
            [
                pointer,
                int64,
                int64,
                int64,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                c_int,
            ],
        ),
        "vector_sums": (c_int, []),
        "openmp_threads": (c_int, []),
        # sources, S, N, D, queries, R, bias, its route stride, its token stride, normalize_values, eps, h, lse,
        # weights, logits, threads
        "depth_attention_routed": (
            None,
            [pointer, int64, int64, int64, pointer, int64, pointer, int64, int64, c_int, real]
            + [pointer, pointer, pointer, pointer, c_int],
        ),
        # sources, S, N, D, queries, R, bias, its route stride, its token stride, normalize_values, eps, lse,
        # grad_h, grad_sources, accumulate, grad_queries, threads
        "depth_attention_routed_backward": (
            c_int,
            [pointer, int64, int64, int64, pointer, int64, pointer, int64, int64, c_int, real]
            + [pointer, pointer, pointer, pointer, pointer, c_int],
        ),
        "depth_attention_multi": (
            None,
            [pointer, int64, int64, int64, pointer, int64, pointer, pointer, int64, real, pointer, pointer, c_int],
        ),
        "depth_attention_multi_backward": (
            c_int,
            [
                pointer,
                int64,
                int64,
                int64,
                pointer,
                int64,
                pointer,
                pointer,
                real,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                pointer,
                c_int,
            ],
        ),
        "depth_attention_copies_forward": (
            c_int,
            [
                pointer,
                int64,
                int64,
                int64,
                int64,
                int64,
                pointer,
                pointer,
                real,
                pointer,
                real,
                pointer,
                pointer,
                pointer,
                pointer,
                c_int,
            ],
        ),
        "rotary_forward": (None, [pointer, pointer, pointer, int64, int64, int64, int64, int64, real, pointer, c_int]),
        "causal_attention_forward": (
            c_int,
            [pointer, pointer, pointer, int64, int64, int64, int64, real, pointer, c_int],
        ),
        "rms_norm_forward": (None, [pointer, pointer, int64, int64, real, pointer, pointer, c_int]),
        "rms_norm_backward": (c_int, [pointer, pointer, pointer, pointer, int64, int64, pointer, pointer, c_int]),
        "token_shift_forward": (
            None,
            [pointer, pointer, int64, int64, int64, int64, int64, pointer, pointer, int64, pointer, c_int],
        ),
        "token_shift_backward": (
            None,
            [
                pointer,
                pointer,
                int64,
                pointer,
                int64,
                int64,
                int64,
                int64,
                pointer,
                pointer,
                int64,
                pointer,
                pointer,
                c_int,
            ],
        ),
    }


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Sets each function's types. A library built from an older C source (an analysis's baseline build) may lack
    the newer functions: those stay unbound, and a call to one raises AttributeError."""
    for name, (result, arguments) in _signatures().items():
        if hasattr(library, name):
            function = getattr(library, name)
            function.restype, function.argtypes = result, arguments
    library.thread_pool = library.openmp_threads() > 0  # built with OpenMP: its threads are torch's (run_rows)
    return library


def cpu_library(dtype: torch.dtype) -> ctypes.CDLL:
    """The kernel library for fp32 or fp64 tensors, built on the first call (raises CpuKernelUnavailable)."""
    return _library(REAL_TYPES[dtype])


def kernel_threads(n_elements: int, library: ctypes.CDLL) -> int:
    """Threads for a call over `n_elements`: one per `MIN_ELEMENTS_PER_THREAD` (per `PTHREAD_MIN_ELEMENTS_PER_THREAD`
    in the build without OpenMP, whose threads cost more to start), at most torch's thread count."""
    minimum = MIN_ELEMENTS_PER_THREAD if library.thread_pool else PTHREAD_MIN_ELEMENTS_PER_THREAD
    return max(1, min(torch.get_num_threads(), MAX_THREADS, n_elements // minimum))


def address(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for the C kernel, NULL for None."""
    return None if tensor is None else tensor.data_ptr()


def pointer_array(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    """The C kernel's array of data pointers of `tensors`."""
    return (ctypes.c_void_p * len(tensors))(*(tensor.data_ptr() for tensor in tensors))


def optional_pointer_array(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array:
    """`pointer_array` with NULL for each None."""
    return (ctypes.c_void_p * len(tensors))(*(address(tensor) for tensor in tensors))
