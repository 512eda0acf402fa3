"""The ``cpu`` backend: fused C forward and backward for CPU tensors (``cpu_fused.c``). Reference: ``reference.py``.

The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``), once per element type,
into ``$ATTNRES_LENS_KERNEL_CACHE`` (default ``~/.cache/attnres_lens/kernels``), and loaded with ctypes: no torch
headers, so a build takes about a second. The cache key covers the source, the flags and the CPU, so a shared home
directory never serves a library built for another processor. ctypes releases the GIL during the call; the kernel
splits token rows over torch's own OpenMP threads, as many as torch's intra-op pool when the work is large enough to
pay.
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
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch.autograd.function import once_differentiable as _guard_second_derivative

from attnres_lens.kernels._common import (builds_no_graph, check_logit_bias, check_vector, compute_dtype,
                                         needs_autograd, new_output, new_output_like)

SOURCE = Path(__file__).with_name("cpu_fused.c")
CACHE_ENV_VAR = "ATTNRES_LENS_KERNEL_CACHE"
MAX_THREADS = 64  # the C file's MAX_THREADS
MAX_QUERIES = 8  # the C file's MAX_QUERIES: larger query sets are split
# The kernel splits its rows over torch's OpenMP pool (docs/kernels.md §6), whose threads are awake between torch's
# ops: in a one-off trial a second thread paid from ~50K source elements (forward + backward of one mix). The
# build without OpenMP starts a pthread per call (50-100 us), which paid only from ~1M (docs/kernels.md §11).
MIN_ELEMENTS_PER_THREAD = 1 << 15
PTHREAD_MIN_ELEMENTS_PER_THREAD = 1 << 20
_REAL_TYPES = {torch.float32: "float", torch.float64: "double"}
_BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-fno-math-errno"]
# Tried in turn: -march=native gives the compiler AVX2/FMA where the machine has them (and the C file's vector sums
# with them); some compilers reject it, and the portable build follows. 256-bit vectors: at d_model 64 a 512-bit
# row is 4 iterations and its reductions dominate (1.3x slower here).
ARCH_FLAGS = (["-march=native", "-mprefer-vector-width=256"], [])
# OpenMP puts the kernel's threads in torch's pool; a compiler without it (Apple's clang) builds the pthread form.
THREAD_FLAGS = (["-fopenmp"], [])


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


_BUILD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _library(real_type: str) -> ctypes.CDLL:
    # Worker threads (exact interventions) can meet the kernel first at once: one builds, the others then load its
    # file (lru_cache alone would let each of them build).
    with _BUILD_LOCK:
        return _build_library(real_type)


def _build_library(real_type: str) -> ctypes.CDLL:
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


def _signatures() -> dict[str, tuple]:
    """Each C function's (return type, argument types), in the C file's order of arguments."""
    pointer, int64, c_int, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    return {
        "depth_attention_forward": (None, [pointer, int64, int64, int64, pointer, pointer, pointer, real, pointer, real,
                                           pointer, pointer, pointer, pointer, c_int]),
        "depth_attention_backward": (c_int, [pointer, int64, int64, int64, pointer, pointer, pointer, pointer, pointer,
                                             pointer, pointer, pointer, pointer, pointer, pointer, pointer, pointer,
                                             pointer, c_int]),
        "vector_sums": (c_int, []),
        "openmp_threads": (c_int, []),
        "depth_attention_multi": (None, [pointer, int64, int64, int64, pointer, int64, pointer, pointer, int64, real,
                                         pointer, pointer, c_int]),
        "depth_attention_multi_backward": (c_int, [pointer, int64, int64, int64, pointer, int64, pointer, pointer,
                                                   real, pointer, pointer, pointer, pointer, pointer, pointer,
                                                   pointer, pointer, c_int]),
        "depth_attention_copies_forward": (c_int, [pointer, int64, int64, int64, int64, int64, pointer, pointer, real,
                                                   pointer, real, pointer, pointer, pointer, pointer, c_int]),
        "rotary_forward": (None, [pointer, pointer, pointer, int64, int64, int64, int64, int64, real, pointer,
                                  c_int]),
        "causal_attention_forward": (c_int, [pointer, pointer, pointer, int64, int64, int64, int64, real, pointer,
                                             c_int]),
        "rms_norm_forward": (None, [pointer, pointer, int64, int64, real, pointer, pointer, c_int]),
        "rms_norm_backward": (c_int, [pointer, pointer, pointer, pointer, int64, int64, pointer, pointer, c_int]),
        "token_shift_forward": (None, [pointer, pointer, int64, int64, int64, int64, int64, pointer, pointer, int64,
                                       pointer, c_int]),
        "token_shift_backward": (None, [pointer, pointer, int64, pointer, int64, int64, int64, int64, pointer,
                                        pointer, int64, pointer, pointer, c_int]),
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
    return _library(_REAL_TYPES[dtype])


def _n_threads(n_elements: int, library: ctypes.CDLL) -> int:
    minimum = MIN_ELEMENTS_PER_THREAD if library.thread_pool else PTHREAD_MIN_ELEMENTS_PER_THREAD
    return max(1, min(torch.get_num_threads(), MAX_THREADS, n_elements // minimum))


def _elementwise_threads(n_elements: int, library: ctypes.CDLL) -> int:
    """Threads for the KV shift, rotary and RMSNorm kernels: as the depth mix's in the OpenMP build; the pthread
    build runs them on the calling thread."""
    return _n_threads(n_elements, library) if library.thread_pool else 1


class _NoGraph:
    """The `ctx` an eager Function's forward gets when `_apply` runs it without autograd: what it saves or marks
    for a backward is dropped (its attributes are set and forgotten)."""

    def save_for_backward(self, *tensors: Optional[torch.Tensor]) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _apply(function: type[torch.autograd.Function], *args):
    """`function.apply(*args)`, or where it `builds_no_graph` (inference, exact interventions) its forward alone:
    no autograd node and no saved tensors (faster, docs/kernels.md §11),
    the same output values. Under forward-mode AD `apply` runs: these Functions have no jvp, so a dual
    input raises where the forward alone would drop its tangent without a word."""
    if builds_no_graph():
        return function.forward(_NoGraph(), *args)
    return function.apply(*args)


def once_differentiable(backward: Callable) -> Callable:
    """torch's `once_differentiable` for the C kernels' backwards, without its cost where it does nothing: in a
    plain backward (no create_graph) grad mode is already off, where its no-grad context and output checks only
    return the outputs (~5 us a node in a trial, 2026-12-02; ~35 nodes in a small model's step); with create_graph
    it runs as torch's, so a second derivative through the C backward raises instead of coming out wrong."""
    guarded = _guard_second_derivative(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        return guarded(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)
    return run


def _address(tensor: Optional[torch.Tensor]) -> Optional[int]:
    """A tensor's data pointer for the C kernel, NULL for None."""
    return None if tensor is None else tensor.data_ptr()


def _pointer_array(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(tensor.data_ptr() for tensor in tensors))


def _optional_pointer_array(tensors) -> ctypes.Array:
    """`_pointer_array` with NULL for each None."""
    return (ctypes.c_void_p * len(tensors))(*(_address(tensor) for tensor in tensors))


# Two kernel calls, each used two ways. Under torch.compile they are PyTorch custom ops (torch.library), so a
# model that calls them traces into one graph (fullgraph) instead of breaking at the ctypes call: each op has a
# fake (shape-only) version for tracing, and the forward op's autograd rule calls the backward op. In eager mode
# an autograd.Function calls the same two functions: its dispatch costs ~80 us less per call than a custom op's
# at small shapes, which is 2-3% of a small model's step with one call per sublayer; it also leaves the query's
# product with the gain to the C kernel, forward and backward (an autograd product and its backward cost ~15% of a
# small mix; a product in the node, ~3 us and a saved tensor). Sources arrive as contiguous [..., D] tensors of one
# dtype (fp32 or fp64), read as [N, D] rows; the statistics (rstd, logits, weights) come as one [3, S, N] block.
def _run_forward(sources: list[torch.Tensor], query: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                 norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0, keep_h: bool = True,
                 gain: Optional[torch.Tensor] = None
                 ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(h [..., D], stats [3, S, N], y, norm_rstd [N])``; ``y = RMSNorm(h) * norm_weight`` and its rstd with the
    consumer's pre-norm fused (``norm_weight`` given, contiguous), else None. With the pre-norm fused and not
    ``keep_h``, h is not written (None): the backward mixes its rows again. ``query`` is the folded ``u = w * g``,
    or with ``gain`` the pseudo-query ``w``, whose product with the gain the kernel takes (contiguous, the sources'
    dtype)."""
    first = sources[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    n_tokens, n_sources = first.numel() // shape[-1], len(sources)
    if not keep_h and norm_weight is None:
        raise ValueError("only a mix with its pre-norm fused can leave h out: its output would be y alone")
    h = new_output_like(first) if keep_h else None
    stats = new_output((3, n_sources, n_tokens), dtype, device)
    y = norm_rstd = None
    if norm_weight is not None:
        y, norm_rstd = new_output_like(first), new_output((n_tokens,), dtype, device)
    library = cpu_library(dtype)
    library.depth_attention_forward(
        _pointer_array(sources), n_sources, n_tokens, shape[-1], query.data_ptr(), _address(gain), _address(bias),
        eps, _address(norm_weight), norm_eps, _address(h), stats.data_ptr(), _address(y), _address(norm_rstd),
        _n_threads(n_sources * n_tokens * shape[-1], library),
    )
    return h, stats, y, norm_rstd


def _forward_kernel(sources: list[torch.Tensor], folded_query: torch.Tensor, bias: Optional[torch.Tensor],
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [..., D], stats [3, S, N])``; ``folded_query`` is ``u = w * g`` (contiguous, the sources' dtype);
    ``bias`` an optional ``[S, N]`` logit bias (added inside the softmax; the logits in ``stats`` are unbiased)."""
    h, stats, _, _ = _run_forward(sources, folded_query, bias, eps)
    return h, stats


_forward_op = torch.library.custom_op("attnres_lens::depth_attention_cpu_forward", _forward_kernel, mutates_args=())


@_forward_op.register_fake
def _forward_shapes(sources, folded_query, bias, eps):
    first = sources[0]
    return first.new_empty(first.shape), first.new_empty((3, len(sources), first.numel() // first.shape[-1]))


class SharedGradient:
    """The gradient of one source that several fused consumers read, summed in place (docs/kernels.md §5).

    `share_gradient` puts a node after the source whose output the consumers read; each consumer's C backward adds
    its part into this object's buffer for the running backward pass (the first part writes it) and returns no
    gradient for that input, where autograd would add every consumer's fresh copy in a pass of its own; the node,
    which autograd runs only after every consumer of its output, hands the sum on. One buffer per backward pass
    (autograd's graph task: concurrent and reentrant backwards keep theirs apart), dropped when that pass ends, so
    one that stopped short of the node (a gradient with respect to a query only) leaves nothing behind."""

    __slots__ = ("buffers",)

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def target(self, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The buffer this backward pass adds into, and whether it already holds a part (else write it)."""
        task = torch._C._current_graph_task_id()
        buffer = self.buffers.get(task)
        if buffer is not None:
            return buffer, True
        self.buffers[task] = buffer = new_output_like(like)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.buffers.pop(task, None))
        return buffer, False

    def take(self) -> Optional[torch.Tensor]:
        """The sum of this backward pass's parts (None if no consumer added one), released."""
        return self.buffers.pop(torch._C._current_graph_task_id(), None)


class _ShareGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, source: torch.Tensor, shared: SharedGradient) -> torch.Tensor:
        ctx.shared = shared
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], None]:
        summed = ctx.shared.take()
        if summed is None or grad is None:  # the node's other uses (an unfused consumer) send grad
            return (grad if summed is None else summed), None
        return summed.add_(grad), None


def share_gradient(source: torch.Tensor) -> torch.Tensor:
    """`source`, seen through a node that collects the fused consumers' gradients in one buffer (`SharedGradient`);
    `source` itself when it needs no gradient. Give the result only to depth mixes: a gradient taken with respect
    to it directly would miss their parts (the gradient of `source` itself is complete)."""
    if not source.requires_grad:
        return source
    shared = SharedGradient()
    view = _ShareGradient.apply(source, shared)
    view.shared_gradient = shared
    return view


def _shared_gradients(sources: tuple[torch.Tensor, ...]) -> Optional[list[Optional[SharedGradient]]]:
    shared = [getattr(source, "shared_gradient", None) for source in sources]
    return shared if any(item is not None for item in shared) else None


def _buffers_to_sum_into(ctx, *grads: Optional[torch.Tensor]) -> Optional[list[Optional[SharedGradient]]]:
    """The consumer's shared buffers for this backward, or None when a gradient builds a graph (create_graph): a
    shared buffer carries no graph, so those gradients come back fresh, where `once_differentiable` makes a second
    derivative through them raise instead of come out wrong."""
    return None if any(grad is not None and grad.requires_grad for grad in grads) else ctx.shared


def _gradient_buffers(sources: list[torch.Tensor], shared: Optional[list[Optional[SharedGradient]]] = None
                      ) -> tuple[list[torch.Tensor], Optional[ctypes.Array]]:
    """A backward's outputs for the sources (a source with a `SharedGradient` gets its buffer) and the C kernel's
    per-source add-or-write flags (None: write all). One tensor per source, not one [S, N, D] block:
    activation-sized allocations are recycled by the C allocator step after step, while a block of a new size is
    often mapped afresh and page-faulted in."""
    first = sources[0]
    if shared is None:
        return [new_output_like(first) for _ in sources], None
    grad_sources, accumulate = [], [0] * len(sources)
    for s, source in enumerate(sources):
        if shared[s] is not None:
            buffer, accumulate[s] = shared[s].target(source)
            grad_sources.append(buffer)
        else:
            grad_sources.append(new_output_like(first))
    return grad_sources, (ctypes.c_uint8 * len(sources))(*accumulate)


def _returned(grad_sources: list[torch.Tensor], shared: Optional[list[Optional[SharedGradient]]]) -> list:
    """The gradients a backward returns for its sources: none for those summed in a shared buffer."""
    if shared is None:
        return grad_sources
    return [None if item is not None else grad for grad, item in zip(grad_sources, shared)]


def _backward_kernel(sources: list[torch.Tensor], folded_query: torch.Tensor, stats: torch.Tensor,
                     grad_h: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(grad of each source, grad of u)`` for the forward op's saved statistics and ``grad_h`` (contiguous): the
    custom op's signature, which has no shared buffers (a compiled model's stream does not share)."""
    grad_sources, grad_folded, _, _ = _run_backward(sources, folded_query, stats, grad_h, None)
    return grad_sources, grad_folded


def _run_backward(sources: list[torch.Tensor], folded_query: Optional[torch.Tensor], stats: torch.Tensor,
                  grad_h: Optional[torch.Tensor], shared: Optional[list[Optional[SharedGradient]]],
                  norm: Optional[tuple[torch.Tensor, ...]] = None,
                  query_and_gain: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                  ) -> tuple[list, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(grads returned for the sources, grad of the query, grad of the gain, grad of the norm's weight)``:
    with ``query_and_gain`` (the factors of ``u = w * g``, contiguous) the C kernel returns ``dw = du * g`` and ``dg = du * w``,
    without them ``du`` in the query's place and None for the gain; ``folded_query`` may be None where they are
    given (the kernel takes their product, as the forward did). ``norm`` the fused pre-norm's
    ``(h, norm_weight, norm_rstd, grad_y)`` (``grad_h`` may then be None), else None (no weight gradient)."""
    first = sources[0]
    d_model, dtype = first.shape[-1], first.dtype
    n_sources, n_tokens = len(sources), first.numel() // d_model
    grad_sources, accumulate = _gradient_buffers(sources, shared)
    query = gain = grad_gain = h = norm_weight = norm_rstd = grad_y = grad_norm_weight = None
    if query_and_gain is not None:
        query, gain = query_and_gain  # contiguous: the eager nodes saved them so
        grad_gain = new_output_like(gain)
    # the [D] gradients like the [D] inputs (the sources' dtype)
    grad_query = new_output_like(query if folded_query is None else folded_query)
    if norm is not None:
        h, norm_weight, norm_rstd, grad_y = norm
        grad_norm_weight = new_output_like(norm_weight)
    library = cpu_library(dtype)
    failed = library.depth_attention_backward(
        _pointer_array(sources), n_sources, n_tokens, d_model, _address(folded_query), _address(query),
        _address(gain), stats.data_ptr(), _address(h), _address(norm_weight), _address(norm_rstd), _address(grad_y),
        _address(grad_h), _pointer_array(grad_sources), accumulate, grad_query.data_ptr(), _address(grad_gain),
        _address(grad_norm_weight), _n_threads(n_sources * n_tokens * d_model, library),
    )
    if failed:
        raise MemoryError(f"the C depth-attention backward could not allocate its per-thread sums of {d_model} "
                          "values")
    return _returned(grad_sources, shared), grad_query, grad_gain, grad_norm_weight


_backward_op = torch.library.custom_op("attnres_lens::depth_attention_cpu_backward", _backward_kernel,
                                       mutates_args=())


@_backward_op.register_fake
def _backward_shapes(sources, folded_query, stats, grad_h):
    return [source.new_empty(source.shape) for source in sources], folded_query.new_empty(folded_query.shape)


def _save_for_backward(ctx, inputs, output) -> None:
    sources, folded_query, _bias, _eps = inputs
    _h, stats = output
    ctx.n_sources = len(sources)
    ctx.save_for_backward(*sources, folded_query, stats)


def _backward(ctx, grad_h, _grad_stats):
    saved = ctx.saved_tensors
    sources, (folded_query, stats) = list(saved[: ctx.n_sources]), saved[ctx.n_sources :]
    grad_sources, grad_folded = _backward_op(sources, folded_query, stats, grad_h.contiguous())
    return grad_sources, grad_folded, None, None  # the bias is not differentiable here (docs/kernels.md §1)


_forward_op.register_autograd(_backward, setup_context=_save_for_backward)


class _EagerDepthAttention(torch.autograd.Function):
    """The eager twin of `_forward_op` with its autograd rule, the query folded in by the C kernel (``u = w * g``,
    so ``dw = du * g`` and ``dg = du * w``): ``(h, logits, weights)``, the last two reported only
    (non-differentiable). ``query`` and ``gain`` come in the compute dtype (fp32, or fp64 for fp64 sources)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, gain: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                *sources: torch.Tensor):
        query, gain = query.contiguous(), gain.contiguous()
        h, stats, _, _ = _run_forward(list(sources), query, bias, eps, gain=gain)
        ctx.save_for_backward(query, gain, stats, *sources)
        ctx.shared = _shared_gradients(sources)
        _rstd, logits, weights = stats.unbind(0)
        ctx.mark_non_differentiable(logits, weights)
        return h, logits, weights

    @staticmethod
    @once_differentiable  # the C backward builds no graph: a second derivative raises instead of coming out wrong
    def backward(ctx, grad_h: torch.Tensor, _grad_logits: torch.Tensor, _grad_weights: torch.Tensor):
        query, gain, stats, *sources = ctx.saved_tensors
        grad_sources, grad_query, grad_gain, _ = _run_backward(sources, None, stats, grad_h.contiguous(),
                                                               _buffers_to_sum_into(ctx, grad_h), None, (query, gain))
        return grad_query, grad_gain, None, None, *grad_sources


def _contiguous(sources: list[torch.Tensor], compute: torch.dtype) -> list[torch.Tensor]:
    """Each source contiguous in the compute dtype. The model's (fp32, contiguous) are passed as they are: a
    no-op `.to().contiguous()` or a view per source cost more than the kernel at small shapes."""
    return [source if source.dtype == compute and source.is_contiguous() else source.to(compute).contiguous()
            for source in sources]


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
    compute = compute_dtype(first.dtype)
    flat = _contiguous(sources, compute)
    if bias is not None:
        bias = bias.to(compute).contiguous()
    # the query and gain are folded in the compute dtype (bf16 parameters would round the product)
    query, gain = query.to(compute), key_norm_weight.to(compute)
    if torch.compiler.is_compiling():
        # dw and dg follow from du by autograd through this product
        h, stats = _forward_op(flat, (query * gain).contiguous(), bias, float(eps))
        # reported, not consumed: detached, so nothing can backpropagate through them and silently get zero
        logits, weights = stats[1].detach(), stats[2].detach()
    else:
        h, logits, weights = _apply(_EagerDepthAttention, query, gain, bias, float(eps), *flat)
    return (h if h.dtype == first.dtype else h.to(first.dtype)), weights, logits


class _EagerNormedDepthAttention(torch.autograd.Function):
    """`_EagerDepthAttention` with the consumer's pre-norm fused: ``(h, y)`` with ``y = RMSNorm(h) * norm_weight``
    (docs/kernels.md §4). ``h`` may have other uses (its gradient is then added to the norm's); without
    ``keep_h`` it is neither written nor saved (None: the backward mixes its rows again from the sources it reads
    anyway). Weights and logits are not reported. All inputs in the sources' dtype."""

    @staticmethod
    def forward(ctx, keep_h: bool, query: torch.Tensor, gain: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                norm_eps: float, *sources: torch.Tensor):
        query, gain = query.contiguous(), gain.contiguous()
        h, stats, y, norm_rstd = _run_forward(list(sources), query, None, eps, norm_weight, norm_eps, keep_h, gain)
        ctx.save_for_backward(query, gain, norm_weight, stats, norm_rstd, h, *sources)
        ctx.shared = _shared_gradients(sources)
        ctx.set_materialize_grads(False)  # h usually has no other use: no zero gradient to add
        return h, y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h: Optional[torch.Tensor], grad_y: Optional[torch.Tensor]):
        query, gain, norm_weight, stats, norm_rstd, h, *sources = ctx.saved_tensors
        if grad_y is None and grad_h is None:
            return (None,) * (6 + len(sources))
        norm = None if grad_y is None else (h, norm_weight, norm_rstd, grad_y.contiguous())  # None: only h was used
        grad_sources, grad_query, grad_gain, grad_norm_weight = _run_backward(
            sources, None, stats, None if grad_h is None else grad_h.contiguous(),
            _buffers_to_sum_into(ctx, grad_h, grad_y), norm, (query, gain))
        return None, grad_query, grad_gain, grad_norm_weight, None, None, *grad_sources


def depth_attention_normed_cpu(sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor,
                               eps: float, norm_weight: torch.Tensor, norm_eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, RMSNorm(h) * norm_weight)`` for contiguous fp32/fp64 CPU sources of one dtype, with parameters of that
    dtype, in one kernel call each way (eager only: under torch.compile inductor fuses the norm itself); equals
    `depth_attention_cpu` followed by `rms_norm_cpu`."""
    first = sources[0]
    if first.device.type != "cpu" or first.dtype not in _REAL_TYPES or torch.compiler.is_compiling():
        raise ValueError(f"the fused pre-norm runs eagerly on fp32/fp64 CPU tensors, got {first.dtype} on "
                         f"{first.device}")
    for name, tensor in (("query", query), ("key_norm_weight", key_norm_weight), ("norm_weight", norm_weight)):
        if tensor.dtype != first.dtype or tensor.shape != first.shape[-1:]:
            raise ValueError(f"{name} must be [{first.shape[-1]}] {first.dtype} like the sources, got "
                             f"{list(tensor.shape)} {tensor.dtype}")
    return fused_mix_and_norm(sources, query, key_norm_weight, eps, norm_weight, norm_eps)


def fused_mix_and_norm(sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float,
                       norm_weight: torch.Tensor, norm_eps: float, keep_h: bool = True
                       ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """`depth_attention_normed_cpu` without its checks, for a caller that made them: `DepthAttention.fused_with_norm`
    (sources of one shape and dtype on the CPU, outside torch.compile, parameters of the sources' dtype and width),
    which the depth stream and `DepthAttention.mix_and_norm` ask before calling this; checking twice cost ~10 of
    the ~30 us a small sublayer's mix takes (a trial, 2026-12-02). Without ``keep_h``, ``(None, y)``: h is neither
    written nor read back (a model's sublayer reads y alone)."""
    return _apply(_EagerNormedDepthAttention, keep_h, query, key_norm_weight, norm_weight.contiguous(), float(eps),
                  float(norm_eps), *_contiguous(sources, sources[0].dtype))


def _run_multi(sources: list[torch.Tensor], queries: torch.Tensor, eps: float,
               prior: Optional[tuple[torch.Tensor, torch.Tensor]], prior_tokens: int, mix: list[torch.Tensor],
               lse: list[torch.Tensor]) -> None:
    """The C call of `depth_attention_multi_cpu` on flat operands: sources ``[N, D]`` (contiguous, the compute
    dtype), queries ``[Q, D]``, prior ``([Q, P, D], [Q, P])`` or None; writes each query's ``mix`` ``[N, D]`` and
    ``lse`` ``[N]`` (contiguous tensors of the compute dtype: rows of one block, or tensors of their own)."""
    first = sources[0]
    n_tokens, d_model, n_queries = first.numel() // first.shape[-1], first.shape[-1], queries.shape[0]
    library, pointers = cpu_library(first.dtype), _pointer_array(sources)
    threads = _n_threads(len(sources) * n_tokens * d_model, library)
    for start in range(0, n_queries, MAX_QUERIES):
        part = slice(start, start + MAX_QUERIES)
        library.depth_attention_multi(
            pointers, len(sources), n_tokens, d_model, queries[part].data_ptr(), queries[part].shape[0],
            None if prior is None else prior[0][part].data_ptr(), None if prior is None else prior[1][part].data_ptr(),
            prior_tokens, eps, _pointer_array(mix[part]), _pointer_array(lse[part]), threads,
        )


class _EagerMultiDepthAttention(torch.autograd.Function):
    """`depth_attention_multi_cpu` with its backward (C, `depth_attention_multi_backward`), for Q <= MAX_QUERIES
    queries and a prior over the sources' own tokens: ``(mix_0, ..., mix_{Q-1}, lse_0, ..., lse_{Q-1})``, each
    query's part a tensor of its own, so a consumer's gradient reaches its part alone (indexing one [Q, N, D] output
    would send back a [Q, N, D] block of zeros per consumer), and a consumer may edit its input in place: the mixes
    are not views, and the backward does not read them. All operands flat and contiguous in the compute
    dtype: queries ``[Q, D]``, prior ``[Q, N, D]`` and ``[Q, N]`` or None, sources ``[N, D]``."""

    @staticmethod
    def forward(ctx, eps: float, queries: torch.Tensor, prior_mix: Optional[torch.Tensor],
                prior_lse: Optional[torch.Tensor], *sources: torch.Tensor):
        prior = None if prior_mix is None else (prior_mix, prior_lse)
        first, n_queries = sources[0], queries.shape[0]
        n_tokens = first.numel() // first.shape[-1]
        mix = [new_output((n_tokens, first.shape[-1]), first.dtype, first.device) for _ in range(n_queries)]
        lse = [new_output((n_tokens,), first.dtype, first.device) for _ in range(n_queries)]
        _run_multi(list(sources), queries, eps, prior, n_tokens, mix, lse)
        ctx.eps = eps
        ctx.save_for_backward(queries, prior_mix, prior_lse, *lse, *sources)
        ctx.shared = _shared_gradients(sources)
        ctx.set_materialize_grads(False)  # a consumer reads its own part: no zeros for the others'
        return (*mix, *lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Optional[torch.Tensor]):
        queries, prior_mix, prior_lse, *saved = ctx.saved_tensors
        n_queries = queries.shape[0]
        lse, sources = saved[:n_queries], saved[n_queries:]
        first = sources[0]
        if all(grad is None for grad in grads):
            return (None,) * (4 + len(sources))
        grads = [None if grad is None else grad.contiguous() for grad in grads]
        shared = _buffers_to_sum_into(ctx, *grads)
        grad_sources, accumulate = _gradient_buffers(sources, shared)
        grad_queries = new_output_like(queries)
        grad_prior_mix = None if prior_mix is None else new_output_like(prior_mix)
        grad_prior_lse = None if prior_lse is None else new_output_like(prior_lse)
        d_model = first.shape[-1]
        n_tokens = first.numel() // d_model
        library = cpu_library(first.dtype)
        status = library.depth_attention_multi_backward(
            _pointer_array(sources), len(sources), n_tokens, d_model, queries.data_ptr(), n_queries,
            _address(prior_mix), _address(prior_lse), ctx.eps, _pointer_array(lse),
            _optional_pointer_array(grads[:n_queries]), _optional_pointer_array(grads[n_queries:]),
            _pointer_array(grad_sources), accumulate, grad_queries.data_ptr(), _address(grad_prior_mix),
            _address(grad_prior_lse), _n_threads(len(sources) * n_tokens * d_model, library))
        if status != 0:
            raise MemoryError(f"the C two-phase backward could not allocate its per-thread sums of {n_queries} x "
                              f"{d_model} values")
        return None, grad_queries, grad_prior_mix, grad_prior_lse, *_returned(grad_sources, shared)


def depth_attention_multi_cpu(
    sources: list[torch.Tensor], folded_queries: torch.Tensor, eps: float,
    prior: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[Union[torch.Tensor, tuple[torch.Tensor, ...]], Union[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """Q depth attentions over the same ``sources`` (each ``[..., D]``) in one read of them (docs/kernels.md §7):
    ``folded_queries`` ``[Q, D]`` (``u_q = w_q * g_q``); ``prior`` an optional part per query over other sources,
    ``(mix [Q, ..., D], lse [Q, ...])``, folded into each softmax. Returns ``(mix [Q, ..., D], lse [Q, ...])`` in
    fp32 (fp64 for fp64 sources): phase 1 of two-phase AttnRes, or with a prior its phase 2.

    With a gradient (grad mode on and a source, a query or the prior needing one) the mix has a C backward, and
    ``mix`` and ``lse`` come as tuples of Q tensors ``[..., D]`` and ``[...]``, one per query: each consumer's
    gradient then reaches its own part alone. A source seen through `share_gradient` gets its gradient summed
    in its shared buffer, as the one-pass mix does. A forward-mode tangent on an operand raises (the C mix has no
    jvp) rather than being dropped.

    Without a gradient the prior may also cover one copy of a batch the sources stack k times along their first
    dim (``mix [Q, B, ..., D]`` for sources ``[k * B, ..., D]``): each copy then takes that one prior, which was
    mixed once from sources all copies share (exact interventions)."""
    first = sources[0]
    if first.device.type != "cpu":
        raise ValueError(f"the cpu backend needs CPU tensors, got tensors on {first.device}; use backend='auto'")
    needs_grad = needs_autograd(*sources, folded_queries, *(prior or ()))  # a tangent reaches the Function: raises
    lead, d_model = first.shape[:-1], first.shape[-1]
    if folded_queries.dim() != 2 or folded_queries.shape[1] != d_model:
        raise ValueError(f"folded_queries must be [n_queries, {d_model}] (the sources' last dim), got "
                         f"{tuple(folded_queries.shape)}")
    compute = compute_dtype(first.dtype)
    flat = _contiguous(sources, compute)
    n_tokens, n_queries = first.numel() // d_model, folded_queries.shape[0]
    queries = folded_queries.to(compute).contiguous()
    prior_tokens = n_tokens
    if prior is not None:
        prior_mix, prior_lse = prior
        copies = first.shape[0] // prior_mix.shape[1] if prior_mix.dim() == first.dim() + 1 and prior_mix.shape[1] else 0
        if (prior_mix.shape[0] != n_queries or copies * prior_mix.shape[1] != first.shape[0]
                or prior_mix.shape[2:] != first.shape[1:] or prior_lse.shape != prior_mix.shape[:-1]):
            raise ValueError(f"prior must be (mix [{n_queries}, B, {', '.join(map(str, first.shape[1:]))}], lse "
                             f"[{n_queries}, B, {', '.join(map(str, lead[1:]))}]) with B the sources' first dim "
                             f"{first.shape[0]} or a divisor of it, got {tuple(prior_mix.shape)} and "
                             f"{tuple(prior_lse.shape)}")
        prior_tokens = n_tokens // copies if copies else n_tokens  # no tokens: nothing is read
        if needs_grad and prior_tokens != n_tokens:
            raise ValueError(f"a prior over one copy of stacked sources ({prior_mix.shape[1]} of {first.shape[0]} "
                             "rows) has no backward or forward-mode derivative; run it under torch.no_grad() on "
                             "tensors without tangents, or give the prior for every row")
        prior = prior_mix.to(compute).reshape(n_queries, prior_tokens, d_model).contiguous(), \
            prior_lse.to(compute).reshape(n_queries, prior_tokens).contiguous()
    if not needs_grad:
        mix = new_output((n_queries, n_tokens, d_model), compute, first.device)
        lse = new_output((n_queries, n_tokens), compute, first.device)
        _run_multi(flat, queries, eps, prior, prior_tokens, list(mix.unbind(0)), list(lse.unbind(0)))
        return mix.view(n_queries, *lead, d_model), lse.view(n_queries, *lead)
    mixes, lses = [], []
    for start in range(0, n_queries, MAX_QUERIES):
        part = slice(start, start + MAX_QUERIES)
        part_prior = (None, None) if prior is None else (prior[0][part], prior[1][part])
        outputs = _EagerMultiDepthAttention.apply(float(eps), queries[part], *part_prior, *flat)
        half = len(outputs) // 2
        mixes += [mix.view(*lead, d_model) for mix in outputs[:half]]
        lses += [lse.view(lead) for lse in outputs[half:]]
    return tuple(mixes), tuple(lses)


def depth_attention_copies_cpu(shared: list[torch.Tensor], stacked: list[torch.Tensor], n_copies: int,
                               query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float,
                               bias: Optional[torch.Tensor] = None,
                               norm: Optional[tuple[torch.Tensor, float]] = None
                               ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The depth attention of `n_copies` copies of one batch stacked along the first dim, each copy with its own
    logit bias, without a backward (exact interventions; docs/kernels.md §7): the sources are ``shared`` (one
    copy's batch ``[B, ..., D]`` each, read by every copy) followed by ``stacked`` (``[n_copies * B, ..., D]``, copy
    i's rows at ``i * B``; may be empty), fp32 or fp64; ``bias`` ``[n_copies * B, ..., S]`` as `hook_logit_bias`
    gives it, or None. Returns ``h`` ``[n_copies * B, ..., D]``: what `depth_attention` returns for the shared
    sources repeated n_copies times, without reading them n_copies times; with ``norm = (weight [D], eps)`` the
    consumer's pre-norm fused too, ``(h, RMSNorm(h) * weight)``."""
    if not shared:
        raise ValueError("depth_attention_copies_cpu needs at least one shared source")
    if isinstance(n_copies, bool) or not isinstance(n_copies, int) or n_copies < 1:
        raise ValueError(f"n_copies must be a positive integer, got {n_copies!r}")
    copy = shared[0]
    sources = [*shared, *stacked]
    for tensor in sources:
        if tensor.device.type != "cpu" or tensor.dtype not in _REAL_TYPES:
            raise ValueError(f"depth_attention_copies_cpu needs fp32/fp64 CPU sources, got {tensor.dtype} on "
                             f"{tensor.device}")
    if copy.dim() < 2:
        raise ValueError(f"sources must be [B, ..., D], got a shared source of shape {tuple(copy.shape)}")
    d_model, n_sources = copy.shape[-1], len(sources)
    vectors = [("query", query), ("key_norm_weight", key_norm_weight), *([("norm weight", norm[0])] if norm else [])]
    for name, vector in vectors:
        check_vector(name, vector, d_model, copy.device)
    parameters = [query, key_norm_weight, *(() if bias is None else (bias,)), *(norm[:1] if norm else ())]
    if needs_autograd(*sources, *parameters):
        raise ValueError("depth_attention_copies_cpu has no backward or forward-mode derivative; run it under "
                         "torch.no_grad() on tensors without tangents, or mix with depth_attention for a gradient")
    stacked_shape = (n_copies * copy.shape[0], *copy.shape[1:])
    if any(x.shape != copy.shape for x in shared) or any(x.shape != stacked_shape for x in stacked):
        raise ValueError(f"shared sources must each be one copy {list(copy.shape)} and stacked ones "
                         f"{list(stacked_shape)} ({n_copies} copies), got {[list(x.shape) for x in shared]} and "
                         f"{[list(x.shape) for x in stacked]}")
    if bias is not None:
        check_logit_bias(bias, torch.Size(stacked_shape[:-1]), n_sources, copy.device)
    compute = compute_dtype(copy.dtype)
    flat = _contiguous(sources, compute)
    n_tokens = copy.numel() // d_model
    folded = (query.to(compute) * key_norm_weight.to(compute)).contiguous()
    source_major = None if bias is None else bias.reshape(-1, n_sources).t().to(compute).contiguous()
    h = new_output(stacked_shape, compute, copy.device)
    y = norm_rstd = norm_weight = None
    if norm is not None:
        norm_weight = norm[0].to(compute).contiguous()
        y = new_output(stacked_shape, compute, copy.device)
        norm_rstd = new_output((n_copies * n_tokens,), compute, copy.device)
    stats = new_output((3, n_sources, n_tokens), compute, copy.device)
    if h.numel():
        library = cpu_library(compute)
        status = library.depth_attention_copies_forward(
            _pointer_array(flat), n_sources, len(shared), n_copies, n_tokens, d_model, folded.data_ptr(),
            _address(source_major), eps, _address(norm_weight), float(norm[1]) if norm else 0.0, h.data_ptr(),
            _address(y), _address(norm_rstd), stats.data_ptr(),
            _n_threads(n_sources * n_copies * n_tokens * d_model, library))
        if status != 0:
            raise MemoryError(f"depth_attention_copies_cpu could not allocate its source tables ({n_copies} x "
                              f"{n_sources} pointers)")
    return h if norm is None else (h, y)


class _EagerKVShift(torch.autograd.Function):
    """`components.TokenShiftMix` (the KV shift, its formulas there) of a layer's K and V in one autograd node,
    one C pass over each tensor each way; k, v [B, P, H, Dh], coefficients [H, 4] = (K's pair, V's pair). With
    rotary tables (cos, sin: x's dtype, contiguous; else None) the shifted K comes out rotated, in the same pass."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, coefficients: torch.Tensor, cos: Optional[torch.Tensor],
                sin: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = k.contiguous(), v.contiguous()
        pairs = coefficients.to(k.dtype).contiguous()
        library = cpu_library(k.dtype)
        threads = _elementwise_threads(k.numel(), library)
        shifted = []
        for x, column, tables in ((k, 0, _rotary_arguments(cos, sin)), (v, 2, _NO_ROTATION)):
            y = new_output_like(x)  # K's pair in columns 0-1, V's in 2-3: addressed, not sliced (a view per call
            library.token_shift_forward(  # costs more than a small layer's shift)
                x.data_ptr(), pairs.data_ptr() + column * pairs.element_size(), 4, *x.shape, *tables, y.data_ptr(),
                threads)
            shifted.append(y)
        ctx.save_for_backward(k, v, pairs, cos, sin)
        ctx.coefficient_dtype = coefficients.dtype
        return shifted[0], shifted[1]

    @staticmethod
    @once_differentiable  # the C backward builds no graph: a second derivative raises instead of coming out zero
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        k, v, pairs, cos, sin = ctx.saved_tensors
        library = cpu_library(k.dtype)
        threads = _elementwise_threads(k.numel(), library)
        grad_pairs = new_output(pairs.shape, pairs.dtype, pairs.device)
        grads = []
        for x, grad_y, column, tables in ((k, grad_k, 0, _rotary_arguments(cos, sin)),
                                          (v, grad_v, 2, _NO_ROTATION)):
            grad_y = grad_y.contiguous()
            grad_x = new_output_like(x)
            offset = column * pairs.element_size()
            library.token_shift_backward(x.data_ptr(), pairs.data_ptr() + offset, 4, grad_y.data_ptr(), *x.shape,
                                         *tables, grad_x.data_ptr(), grad_pairs.data_ptr() + offset, threads)
            grads.append(grad_x)
        return grads[0], grads[1], grad_pairs.to(ctx.coefficient_dtype), None, None


_NO_ROTATION = (None, None, 0)  # the C shift kernels' (cos_table, sin_table, table_stride) for no rotary


def _rotary_arguments(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> tuple:
    """The C kernels' (cos_table, sin_table, table_stride) for rotary tables, or no rotation for None."""
    return _NO_ROTATION if cos is None else (cos.data_ptr(), sin.data_ptr(), cos.stride(0))


def kv_shift_cpu(k: torch.Tensor, v: torch.Tensor, coefficients: torch.Tensor,
                 rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KV shift: `c1 ⊙ x_t + c2 ⊙ x_{t−1}` per head (x_{−1} = 0) for x = k with the pair
    `coefficients[:, :2]` and x = v with `coefficients[:, 2:]`; fp32/fp64 CPU tensors [batch, pos, heads, d_head],
    differentiable in all three. With ``rotary = (cos, sin)`` (`rotary_cpu`'s tables) the shifted K is returned
    rotated, `rotary_cpu(shifted_k, cos, sin)` in the same pass over K."""
    for name, x in (("k", k), ("v", v)):
        if x.device.type != "cpu" or x.dtype not in _REAL_TYPES or x.dim() != 4:
            raise ValueError(f"kv_shift_cpu needs 4-D fp32/fp64 CPU tensors, got {name} {x.dim()}-D {x.dtype} on "
                             f"{x.device}")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must match, got {list(k.shape)} {k.dtype} and {list(v.shape)} {v.dtype}")
    if coefficients.shape != (k.shape[2], 4) or coefficients.device.type != "cpu":
        raise ValueError(f"coefficients must be a CPU tensor [heads, 4] = [{k.shape[2]}, 4], got "
                         f"{list(coefficients.shape)} on {coefficients.device}")
    cos, sin = (None, None) if rotary is None else _rotary_tables_for(k, *rotary, caller="kv_shift_cpu")
    return _apply(_EagerKVShift, k, v, coefficients, cos, sin)


class _EagerRotary(torch.autograd.Function):
    """`components.apply_rotary` in one C pass each way (the backward rotates the gradient back: the same kernel
    with the sine negated); x [B, P, H, Dh], cos and sin [≥ P, Dh] tables whose two halves are equal."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad.contiguous(), cos, sin, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    y = new_output_like(x)
    library = cpu_library(x.dtype)
    library.rotary_forward(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.stride(0), *x.shape, sign, y.data_ptr(),
                           _elementwise_threads(x.numel(), library))
    return y


def _rotary_tables_for(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caller: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables`' cos and sin checked against x [B, P, H, Dh] (Dh even, at least P rows of Dh, no gradient)
    and cast to x's dtype, contiguous: the tables the C rotation reads."""
    if x.shape[-1] % 2:
        raise ValueError(f"{caller}'s rotary embedding needs an even last dim, got x of shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] < x.shape[1] or cos.shape[1] != x.shape[-1]:
        raise ValueError(f"cos and sin must be [n_ctx >= {x.shape[1]}, {x.shape[-1]}] tables, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{caller} differentiates x only; the cos/sin tables must not require grad")
    return tuple(table.to(x.dtype).contiguous() for table in (cos, sin))


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[B, P, H, Dh]`` (fp32/fp64, CPU) with ``rotary_tables``' ``cos`` and ``sin``
    (``[n_ctx, Dh]``, n_ctx >= P; cast to x's dtype), differentiable in ``x``; equals `components.apply_rotary`."""
    if x.dim() != 4 or x.device.type != "cpu" or x.dtype not in _REAL_TYPES:
        raise ValueError(f"rotary_cpu needs a 4-D fp32/fp64 CPU tensor, got {x.dim()}-D {x.dtype} on {x.device} of "
                         f"shape {tuple(x.shape)}")
    cos, sin = _rotary_tables_for(x, cos, sin, caller="rotary_cpu")
    return _apply(_EagerRotary, x, cos, sin)


class _EagerRMSNorm(torch.autograd.Function):
    """`components.RMSNorm` in one C pass each way (formulas in cpu_fused.c); x [..., D], w [D]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x, w = x.contiguous(), w.contiguous()
        rows = x.numel() // x.shape[-1]
        y = new_output_like(x)
        rstd = new_output((rows,), x.dtype, x.device)
        library = cpu_library(x.dtype)
        library.rms_norm_forward(x.data_ptr(), w.data_ptr(), rows, x.shape[-1], eps, y.data_ptr(), rstd.data_ptr(),
                                 _elementwise_threads(x.numel(), library))
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = new_output_like(x)
        grad_w = new_output(w.shape, x.dtype, x.device)
        library = cpu_library(x.dtype)
        failed = library.rms_norm_backward(x.data_ptr(), w.data_ptr(), rstd.data_ptr(), grad.data_ptr(), rstd.numel(),
                                           x.shape[-1], grad_x.data_ptr(), grad_w.data_ptr(),
                                           _elementwise_threads(x.numel(), library))
        if failed:
            raise MemoryError(f"the C RMSNorm backward could not allocate its per-thread sums of {x.shape[-1]} values")
        return grad_x, grad_w, None


def rms_norm_cpu(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) * w` over the last dim of an fp32/fp64 CPU tensor, differentiable in x and w;
    equals `F.rms_norm(x, x.shape[-1:], w, eps)`."""
    if x.device.type != "cpu" or x.dtype not in _REAL_TYPES or x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"rms_norm_cpu needs an fp32/fp64 CPU tensor [..., D], got {x.dtype} on {x.device} of "
                         f"shape {tuple(x.shape)}")
    if w.shape != x.shape[-1:] or w.device != x.device or w.dtype != x.dtype:
        raise ValueError(f"the gain must be [{x.shape[-1]}] {x.dtype} on {x.device}, got {tuple(w.shape)} {w.dtype} "
                         f"on {w.device}")
    return _apply(_EagerRMSNorm, x, w, float(eps))


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention without a gradient: `softmax(q kᵀ · scale, causal) v` per batch row and head, for
    fp32/fp64 CPU tensors [batch, pos, heads, d_head] (the model's layout), output in the same layout; equals
    `F.scaled_dot_product_attention(..., is_causal=True)` on the transposed tensors (docs/kernels.md §2). For
    inference and exact interventions: it refuses tensors that require a gradient or carry a tangent."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cpu" or x.dtype not in _REAL_TYPES or x.dim() != 4:
            raise ValueError(f"causal_attention_cpu needs 4-D fp32/fp64 CPU tensors, got {name} {x.dim()}-D "
                             f"{x.dtype} on {x.device}")
        if x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(f"q, k and v must agree in shape and dtype, got {list(q.shape)} {q.dtype} and {name} "
                             f"{list(x.shape)} {x.dtype}")
        if needs_autograd(x):
            raise ValueError(f"causal_attention_cpu has no derivative, but {name} requires a gradient or carries a "
                             "forward-mode tangent; use F.scaled_dot_product_attention, or run under "
                             "torch.no_grad() without tangents")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, pos, heads, d_head = q.shape
    out = new_output(q.shape, q.dtype, q.device)
    if out.numel() == 0:
        return out
    library = cpu_library(q.dtype)
    status = library.causal_attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), batch, pos, heads, d_head,
                                              float(scale), out.data_ptr(), _n_threads(3 * q.numel(), library))
    if status != 0:
        raise MemoryError(f"causal_attention_cpu could not allocate its key blocks ({d_head + 1} x {pos} values "
                          "per thread)")
    return out
