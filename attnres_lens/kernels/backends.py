"""Backend policy of the depth-attention op: which implementation runs, and whether Block AttnRes runs two-phase.

Every decision of that kind is made here (docs/kernels.md §2):

* ``resolve_backend``: an explicit backend wins; ``"auto"`` defers to ``$ATTNRES_LENS_BACKEND`` when set, else
  picks ``triton`` for CUDA tensors (if Triton is importable), ``cpu`` (the fused C kernel) for CPU tensors where
  it builds, and ``torch`` otherwise; a call with a knob a backend lacks (a logit bias, a knockout, on Triton;
  ``DEPTH_FEATURES``) runs on the next backend that has it under ``"auto"``, and raises where that backend was
  asked for by name;
* ``two_phase_backend``: two-phase AttnRes runs its fused Triton kernels where the single-pass op would run
  Triton, its C kernel (forward and backward) where the single-pass op would run the C kernel and no per-source
  logits are asked for, and its readable PyTorch version everywhere else;
* ``model_runs_two_phase`` / ``stream_two_phase_backend``: Block AttnRes mixes two-phase under Triton; on the CPU
  Full AttnRes does (one read of the shared sources per window of consumers; the stream opens a window from 8
  shared sources without a gradient and from 16 with one, `depth_execution.MIN_SHARED_SOURCES*`); Block AttnRes
  on the CPU one fused pass per sublayer (its few block sources sit in cache);
* ``elementwise_runs_cpu_kernel``: the KV shift, the rotary embedding and RMSNorm run their C kernels wherever the model's
  depth-attention backend resolves to ``cpu``, for fp32/fp64 tensors outside torch.compile (which fuses the
  PyTorch versions itself);
* ``attention_runs_cpu_kernel``: the causal token attention runs its C kernel (no backward) under the same
  conditions where no gradient is needed: inference and exact interventions.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings

import torch

from attnres_lens.kernels._common import needs_autograd

BACKENDS = ("auto", "reference", "torch", "cpu", "triton")
BACKEND_ENV_VAR = "ATTNRES_LENS_BACKEND"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# The op's knobs beyond the paper's mix (docs/kernels.md §1), spelt as its arguments, and the backends that do not
# implement each: ``"auto"`` routes a call that uses one around such a backend (triton and cpu to torch, torch to
# reference); a backend asked for by name, as an argument or in the environment, raises.
DEPTH_FEATURES = ("logit_bias", "logit_scale", "key_norm_weight=None", "normalize_values", "query [R, D]")
_MISSING_FEATURES = {
    "reference": frozenset(),
    "torch": frozenset(),
    "cpu": frozenset(),
    "triton": frozenset({"logit_bias"}),
}
_FALLBACK = {"triton": "torch", "cpu": "torch", "torch": "reference"}


def resolve_backend(
    backend: str, device: torch.device, logit_bias: bool = False, features: tuple[str, ...] = ()
) -> str:
    """Turn ``backend`` (possibly ``"auto"``) into a concrete backend name for tensors on ``device``, for a call
    with a logit bias when ``logit_bias`` and using the knobs named in ``features`` (of ``DEPTH_FEATURES``)."""
    needed = set(features) | ({"logit_bias"} if logit_bias else set())
    if needed:
        chosen = resolve_backend(backend, device)
        missing = needed & _MISSING_FEATURES[chosen]
        if not missing:
            return chosen
        if backend == "auto" and os.environ.get(BACKEND_ENV_VAR, "").strip() in ("", "auto"):
            while missing:  # only a backend asked for by name (argument or environment) refuses a knob
                chosen = _FALLBACK[chosen]
                missing = needed & _MISSING_FEATURES[chosen]
            return chosen
        fallback = _FALLBACK[chosen]
        while needed & _MISSING_FEATURES[fallback]:
            fallback = _FALLBACK[fallback]
        raise ValueError(
            f"the {chosen} depth-attention kernel takes no {', '.join(sorted(missing))}; use "
            f"backend={fallback!r} or 'auto' (and leave ${BACKEND_ENV_VAR} unset) for calls with "
            f"{'one' if len(missing) == 1 else 'them'}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        forced = os.environ.get(BACKEND_ENV_VAR, "").strip()
        if forced:
            if forced not in BACKENDS:
                raise ValueError(f"${BACKEND_ENV_VAR} must be one of {BACKENDS}, got {forced!r}")
            backend = forced
    if backend != "auto":
        return backend
    if device.type == "cuda" and triton_available():
        return "triton"
    if device.type == "cpu" and _cpu_kernel_builds():
        return "cpu"
    return "torch"


def two_phase_backend(backend: str, device: torch.device, needs_logits: bool = False) -> str:
    """``"triton"`` where the single-pass op would run Triton; ``"cpu"`` where it would run the C kernel and
    ``needs_logits`` is false (its two-phase kernel reports no per-source logits); else ``"torch"`` (the
    readable version)."""
    chosen = resolve_backend(backend, device)
    if chosen == "triton":
        return "triton"
    if chosen == "cpu" and not needs_logits and not torch.compiler.is_compiling():
        return "cpu"
    return "torch"


def model_runs_two_phase(block_size: int, backend: str, device: torch.device) -> bool:
    """Whether a model with AttnRes block size ``block_size`` may mix two-phase on ``device`` (its stream then
    decides per window with ``stream_two_phase_backend``): Block AttnRes under Triton, Full AttnRes on the C
    kernel."""
    return stream_two_phase_backend(block_size, backend, device) is not None


def stream_two_phase_backend(block_size: int, backend: str, device: torch.device) -> str | None:
    """The backend of an AttnRes stream's two-phase windows, or None to mix each consumer in one pass: Triton for
    Block AttnRes (forward and backward); the C kernel (forward and backward) for Full AttnRes, whose window's
    shared sources are read once for all its consumers (about half the bytes at depth; the stream decides from
    how many shared sources, docs/kernels.md §7). Block AttnRes on the CPU mixes one fused pass per consumer: its
    few block sources sit in cache, and in inference windows of its blocks measured 0.99-1.12x one pass
    (docs/kernels.md §7)."""
    chosen = two_phase_backend(backend, device)
    if chosen == "torch" or (chosen == "triton" and block_size == 1) or (chosen == "cpu" and block_size > 1):
        return None
    return chosen


_KERNEL_DTYPES = (torch.float32, torch.float64)


def elementwise_runs_cpu_kernel(backend: str, *tensors: torch.Tensor) -> bool:
    """Whether a layer's KV shift (of K and V together), rotary embedding or RMSNorm runs its C kernel on
    ``tensors``, for a model whose depth-attention backend is ``backend``: they must agree in shape, dtype and
    device (a hook may have changed one)."""
    first = tensors[0]
    dtype, shape, device = first.dtype, first.shape, first.device
    if dtype not in _KERNEL_DTYPES or device.type != "cpu":
        return False
    for x in tensors[1:]:  # a loop, not all(...): each sublayer asks this several times per forward
        if x.dtype != dtype or x.shape != shape or not x.is_cpu:  # is_cpu: no device object built per tensor
            return False
    return not torch.compiler.is_compiling() and resolve_backend(backend, device) == "cpu"


# The C attention keeps a head's keys, [d_head, pos], in L1 while every query reads them: faster than PyTorch's SDPA
# for short heads (the op 0.73-0.85x at 65 x 16 and 0.81-0.83x at 64 x 32, a forward pass of prune's model 0.84-0.93x),
# as fast or slower from 4K values (0.97-1.08x at 128 x 32 to 512 x 64) and 2.1-2.3x slower at 64K (two runs of
# analyses/bench_inference.py, 2026-12-02, AMD EPYC; docs/kernels.md §2)
MAX_CPU_ATTENTION_KEYS = 1 << 11


def attention_runs_cpu_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a layer's causal attention runs the C kernel (`cpu_attention.causal_attention_cpu`): where its
    elementwise ops do, no gradient or forward-mode tangent flows through q, k or v (the kernel has neither), a
    head's keys fit in `MAX_CPU_ATTENTION_KEYS` values, and its (batch, head) pairs can keep torch's threads busy
    (they are what it splits over torch's OpenMP pool; a build without OpenMP runs them on one thread, so only at
    one torch thread)."""
    if needs_autograd(q, k, v) or not elementwise_runs_cpu_kernel(backend, q, k, v) or q.dim() != 4:
        return False
    batch, pos, heads, d_head = q.shape
    if pos * d_head > MAX_CPU_ATTENTION_KEYS:
        return False
    threads = torch.get_num_threads()
    if threads == 1:
        return True
    from attnres_lens.kernels.cpu_build import cpu_library

    return cpu_library(q.dtype).thread_pool and batch * heads >= threads


_CPU_KERNEL_STATE: list[bool] = []  # [] until the first "auto" on a CPU tensor tries the build


_CPU_KERNEL_LOCK = threading.Lock()  # worker threads may all ask first: one tries, one warning


def _cpu_kernel_builds() -> bool:
    if not _CPU_KERNEL_STATE:
        if torch.compiler.is_compiling():
            # The build cannot run inside a traced graph (a subprocess and ctypes). torch.compile on the CPU needs a
            # C compiler itself, so the kernel is assumed to build; the op builds it when the graph first runs and
            # raises CpuKernelUnavailable (which names the fix) if it cannot.
            return True
        from attnres_lens.kernels.cpu_build import CpuKernelUnavailable, cpu_library

        with _CPU_KERNEL_LOCK:
            if not _CPU_KERNEL_STATE:
                try:
                    cpu_library(torch.float32)
                    _CPU_KERNEL_STATE.append(True)
                except CpuKernelUnavailable as err:
                    warnings.warn(f"depth attention falls back to the slower torch path: {err}", stacklevel=3)
                    _CPU_KERNEL_STATE.append(False)
    return _CPU_KERNEL_STATE[0]
