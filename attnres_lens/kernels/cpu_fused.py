"""The ``cpu`` backend: fused C forward and backward for CPU tensors (``cpu_fused.c``). Reference: ``reference.py``.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``), once per element type,
into ``$ATTNRES_LENS_KERNEL_CACHE`` (default ``~/.cache/attnres_lens/kernels``), and loaded with ctypes: no torch
headers, so a build takes about a second. The cache key covers the source, the flags and the CPU, so a shared home
directory never serves a library built for another processor. ctypes releases the GIL during the call; the kernel
splits token rows over its own threads, as many as torch's intra-op pool when the work is large enough to pay.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from attnres_lens.kernels._common import new_output

SOURCE = Path(__file__).with_name("cpu_fused.c")
CACHE_ENV_VAR = "ATTNRES_LENS_KERNEL_CACHE"
MAX_THREADS = 64  # the C file's MAX_THREADS
# Starting a thread costs ~50-100 us on a small VM (a persistent pool woke no faster): below ~0.25M source
# elements per thread a second thread costs more than it saves (2 threads: S=4 x 768 x 128 no gain, S=9 1.2x).
MIN_ELEMENTS_PER_THREAD = 1 << 18
_REAL_TYPES = {torch.float32: "float", torch.float64: "double"}
_BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-fno-math-errno"]


class CpuKernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded (no compiler, a failed build, an unwritable cache)."""


def _cache_dir() -> Path:
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


def _compile(compiler: str, flags: list[str], target: Path) -> subprocess.CompletedProcess:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so.tmp", delete=False) as handle:
        partial = Path(handle.name)
    try:
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True, text=True
        )
        if result.returncode == 0:
            partial.chmod(0o755)  # temporary files are private; a shared cache must be loadable by its other users
            os.replace(partial, target)  # atomic: a concurrent process never loads a half-written library
        return result
    finally:
        partial.unlink(missing_ok=True)


@functools.lru_cache(maxsize=None)
def _library(real_type: str) -> ctypes.CDLL:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise CpuKernelUnavailable(
            f"the cpu backend compiles a C kernel but no C compiler {compiler!r} was found; install one "
            "(e.g. `apt-get install gcc`), set $CC, or use backend='torch'"
        )
    errors = []
    # -march=native gives the compiler AVX/FMA where the machine has them; some compilers reject it
    # 256-bit vectors: at d_model 64 a 512-bit row is 4 iterations and its reductions dominate (1.3x slower here)
    for arch_flags in (["-march=native", "-mprefer-vector-width=256"], []):
        flags = [*_BASE_FLAGS, *arch_flags, f"-DREAL={real_type}"]
        key = hashlib.sha256(
            "\0".join([SOURCE.read_text(), compiler, *flags, platform.machine(), _cpu_fingerprint()]).encode()
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


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, int64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.depth_attention_forward.restype = None
    library.depth_attention_forward.argtypes = [
        pointer, int64, int64, int64, pointer, pointer, ctypes.c_double, pointer, pointer, pointer, pointer, c_int
    ]
    library.depth_attention_backward.restype = None
    library.depth_attention_backward.argtypes = [
        pointer, int64, int64, int64, pointer, pointer, pointer, pointer, pointer, pointer, pointer, c_int
    ]
    return library


def cpu_library(dtype: torch.dtype) -> ctypes.CDLL:
    """The kernel library for fp32 or fp64 tensors, built on the first call (raises CpuKernelUnavailable)."""
    return _library(_REAL_TYPES[dtype])


def _n_threads(n_elements: int) -> int:
    return max(1, min(torch.get_num_threads(), MAX_THREADS, n_elements // MIN_ELEMENTS_PER_THREAD))


def _pointer_array(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(tensor.data_ptr() for tensor in tensors))


class CpuDepthAttentionFunction(torch.autograd.Function):
    """``(h [N, D], weights [S, N], logits [S, N])`` from contiguous ``[N, D]`` fp32/fp64 sources and an optional
    ``[S, N]`` logit bias in their dtype (added inside the softmax; ``logits`` are the unbiased scores).

    Weights and logits are not differentiable (they are reported, not consumed, by the caller), nor is the bias.
    """

    @staticmethod
    def forward(ctx, query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float, bias: Optional[torch.Tensor],
                *sources: torch.Tensor):
        n_tokens, d_model = sources[0].shape
        n_sources = len(sources)
        dtype = sources[0].dtype
        library = cpu_library(dtype)
        folded_query = (query.to(dtype) * key_norm_weight.to(dtype)).contiguous()
        h = new_output((n_tokens, d_model), dtype, sources[0].device)
        rstd, logits, weights = (new_output((n_sources, n_tokens), dtype, h.device) for _ in range(3))
        source_pointers = _pointer_array(sources)
        library.depth_attention_forward(
            source_pointers, n_sources, n_tokens, d_model, folded_query.data_ptr(),
            None if bias is None else bias.data_ptr(), eps,
            h.data_ptr(), rstd.data_ptr(), logits.data_ptr(), weights.data_ptr(),
            _n_threads(n_sources * n_tokens * d_model),
        )
        ctx.save_for_backward(query, key_norm_weight, folded_query, rstd, logits, weights, *sources)
        ctx.mark_non_differentiable(weights, logits)
        return h, weights, logits

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor, _grad_weights: torch.Tensor, _grad_logits: torch.Tensor):
        query, key_norm_weight, folded_query, rstd, logits, weights, *sources = ctx.saved_tensors
        n_sources = len(sources)
        n_tokens, d_model = sources[0].shape
        dtype = sources[0].dtype
        grad_h = grad_h.to(dtype).contiguous()
        n_threads = _n_threads(n_sources * n_tokens * d_model)
        # one [N, D] tensor per source, not one [S, N, D] block: activation-sized allocations are recycled by the
        # C allocator step after step, while a block of a new size is often mapped afresh and page-faulted in
        grad_sources = [new_output((n_tokens, d_model), dtype, grad_h.device) for _ in range(n_sources)]
        grad_folded_partial = new_output((n_threads, d_model), dtype, grad_h.device)
        cpu_library(dtype).depth_attention_backward(
            _pointer_array(sources), n_sources, n_tokens, d_model, folded_query.data_ptr(),
            rstd.data_ptr(), logits.data_ptr(), weights.data_ptr(), grad_h.data_ptr(),
            _pointer_array(grad_sources), grad_folded_partial.data_ptr(), n_threads,
        )
        grad_folded = grad_folded_partial.sum(dim=0)
        grad_query = (grad_folded * key_norm_weight.to(dtype)).to(query.dtype)
        grad_gain = (grad_folded * query.to(dtype)).to(key_norm_weight.dtype)
        return grad_query, grad_gain, None, None, *grad_sources


def depth_attention_cpu(
    sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(h, weights, logits)``; weights/logits come source-major, ``[n_sources, N]`` (fp32, fp64 for fp64),
    the logits unbiased. ``bias``: ``[n_sources, N]`` or None.

    Half-precision sources are upcast to fp32 for the kernel and the output cast back.
    """
    first = sources[0]
    if first.device.type != "cpu":
        raise ValueError(f"the cpu backend needs CPU tensors, got tensors on {first.device}; use backend='auto'")
    shape = first.shape
    compute = torch.float64 if first.dtype == torch.float64 else torch.float32
    # fp32 contiguous sources (the model's) are viewed, not copied: a no-op `.to().contiguous()` per source
    # cost more than the kernel at small shapes
    flat = [source.view(-1, shape[-1]) if source.dtype == compute and source.is_contiguous()
            else source.reshape(-1, shape[-1]).to(compute).contiguous() for source in sources]
    if bias is not None:
        bias = bias.to(compute).contiguous()
    h, weights, logits = CpuDepthAttentionFunction.apply(query, key_norm_weight, eps, bias, *flat)
    return h.to(first.dtype).view(shape), weights, logits
