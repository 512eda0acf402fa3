"""Depth mixes on the C kernels (``cpu_depth.c``): the ``cpu`` backend of `depth_attention`, the mix with its
consumer's pre-norm fused, the multi-query mix of two-phase AttnRes, and the mix of stacked copies of a batch
(docs/kernels.md §4-§7). Reference: ``reference.py``.

Each wrapper checks and lays out its operands, calls the library through `cpu_build.cpu_library`, and brings the
kernel into autograd: an autograd.Function in eager mode (run without a node where no autograd can see it,
`cpu_autograd.apply_function`), PyTorch custom ops under torch.compile.
"""

from __future__ import annotations

from typing import Any

import torch

from attnres_lens.kernels import cpu_autograd, cpu_build
from attnres_lens.kernels._common import (
    check_logit_bias,
    check_vector,
    compute_dtype,
    needs_autograd,
    new_output,
    new_output_like,
)
from attnres_lens.kernels.cpu_autograd import (
    SharedGradient,
    buffers_to_sum_into,
    gradient_buffers,
    once_differentiable,
    returned_gradients,
    shared_gradients,
)
from attnres_lens.kernels.cpu_build import (
    REAL_TYPES,
    address,
    kernel_threads,
    optional_pointer_array,
    pointer_array,
)

MAX_QUERIES = 8  # the C file's MAX_QUERIES: larger query sets are split


# Two kernel calls, each used two ways. Under torch.compile they are PyTorch custom ops (torch.library), so a
# model that calls them traces into one graph (fullgraph) instead of breaking at the ctypes call: each op has a
# fake (shape-only) version for tracing, and the forward op's autograd rule calls the backward op. In eager mode
# an autograd.Function calls the same two functions: its dispatch costs less per call than a custom op's, which
# counts at small shapes with one call per sublayer, and it leaves the query's product with the gain to the C
# kernel, forward and backward, where an autograd product would add its own pass and saved tensor
# (docs/kernels.md §11). Sources arrive as contiguous [..., D] tensors of one dtype (fp32 or fp64), read as [N, D]
# rows; the statistics (rstd, logits, weights) come as one [3, S, N] block.
def _run_forward(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
    keep_h: bool = True,
    gain: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
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
    library = cpu_build.cpu_library(dtype)
    library.depth_attention_forward(
        pointer_array(sources),
        n_sources,
        n_tokens,
        shape[-1],
        query.data_ptr(),
        address(gain),
        address(bias),
        eps,
        address(norm_weight),
        norm_eps,
        address(h),
        stats.data_ptr(),
        address(y),
        address(norm_rstd),
        kernel_threads(n_sources * n_tokens * shape[-1], library),
    )
    return h, stats, y, norm_rstd


def _forward_kernel(
    sources: list[torch.Tensor], folded_query: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [..., D], stats [3, S, N])``; ``folded_query`` is ``u = w * g`` (contiguous, the sources' dtype);
    ``bias`` an optional ``[S, N]`` logit bias (added inside the softmax; the logits in ``stats`` are unbiased)."""
    h, stats, _, _ = _run_forward(sources, folded_query, bias, eps)
    return h, stats


_forward_op = torch.library.custom_op("attnres_lens::depth_attention_cpu_forward", _forward_kernel, mutates_args=())


@_forward_op.register_fake
def _forward_shapes(
    sources: list[torch.Tensor], folded_query: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    first = sources[0]
    return first.new_empty(first.shape), first.new_empty((3, len(sources), first.numel() // first.shape[-1]))


def _backward_kernel(
    sources: list[torch.Tensor], folded_query: torch.Tensor, stats: torch.Tensor, grad_h: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(grad of each source, grad of u)`` for the forward op's saved statistics and ``grad_h`` (contiguous): the
    custom op's signature, which has no shared buffers (a compiled model's stream does not share)."""
    grad_sources, grad_folded, _, _ = _run_backward(sources, folded_query, stats, grad_h, None)
    return grad_sources, grad_folded


def _run_backward(
    sources: list[torch.Tensor],
    folded_query: torch.Tensor | None,
    stats: torch.Tensor,
    grad_h: torch.Tensor | None,
    shared: list[SharedGradient | None] | None,
    norm: tuple[torch.Tensor, ...] | None = None,
    query_and_gain: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(grads returned for the sources, grad of the query, grad of the gain, grad of the norm's weight)``:
    with ``query_and_gain`` (the factors of ``u = w * g``, contiguous) the C kernel returns ``dw = du * g`` and
    ``dg = du * w``, without them ``du`` in the query's place and None for the gain; ``folded_query`` may be None
    where they are given (the kernel takes their product, as the forward did). ``norm`` the fused pre-norm's
    ``(h, norm_weight, norm_rstd, grad_y)`` (``grad_h`` may then be None), else None (no weight gradient)."""
    first = sources[0]
    d_model, dtype = first.shape[-1], first.dtype
    n_sources, n_tokens = len(sources), first.numel() // d_model
    grad_sources, accumulate = gradient_buffers(sources, shared)
    query = gain = grad_gain = h = norm_weight = norm_rstd = grad_y = grad_norm_weight = None
    if query_and_gain is not None:
        query, gain = query_and_gain  # contiguous: the eager nodes saved them so
        grad_gain = new_output_like(gain)
    # the [D] gradients like the [D] inputs (the sources' dtype)
    grad_query = new_output_like(query if folded_query is None else folded_query)
    if norm is not None:
        h, norm_weight, norm_rstd, grad_y = norm
        grad_norm_weight = new_output_like(norm_weight)
    library = cpu_build.cpu_library(dtype)
    failed = library.depth_attention_backward(
        pointer_array(sources),
        n_sources,
        n_tokens,
        d_model,
        address(folded_query),
        address(query),
        address(gain),
        stats.data_ptr(),
        address(h),
        address(norm_weight),
        address(norm_rstd),
        address(grad_y),
        address(grad_h),
        pointer_array(grad_sources),
        accumulate,
        grad_query.data_ptr(),
        address(grad_gain),
        address(grad_norm_weight),
        kernel_threads(n_sources * n_tokens * d_model, library),
    )
    if failed:
        raise MemoryError(f"the C depth-attention backward could not allocate its per-thread sums of {d_model} values")
    return returned_gradients(grad_sources, shared), grad_query, grad_gain, grad_norm_weight


_backward_op = torch.library.custom_op("attnres_lens::depth_attention_cpu_backward", _backward_kernel, mutates_args=())


@_backward_op.register_fake
def _backward_shapes(
    sources: list[torch.Tensor], folded_query: torch.Tensor, stats: torch.Tensor, grad_h: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [source.new_empty(source.shape) for source in sources], folded_query.new_empty(folded_query.shape)


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
    sources, folded_query, _bias, _eps = inputs
    _h, stats = output
    ctx.n_sources = len(sources)
    ctx.save_for_backward(*sources, folded_query, stats)


def _backward(
    ctx: Any, grad_h: torch.Tensor, _grad_stats: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor, None, None]:
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
    def forward(
        ctx: Any, query: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None, eps: float, *sources: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, gain = query.contiguous(), gain.contiguous()
        h, stats, _, _ = _run_forward(list(sources), query, bias, eps, gain=gain)
        ctx.save_for_backward(query, gain, stats, *sources)
        ctx.shared = shared_gradients(sources)
        _rstd, logits, weights = stats.unbind(0)
        ctx.mark_non_differentiable(logits, weights)
        return h, logits, weights

    @staticmethod
    @once_differentiable  # the C backward builds no graph: a second derivative raises instead of coming out wrong
    def backward(
        ctx: Any, grad_h: torch.Tensor, _grad_logits: torch.Tensor, _grad_weights: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        query, gain, stats, *sources = ctx.saved_tensors
        grad_sources, grad_query, grad_gain, _ = _run_backward(
            sources, None, stats, grad_h.contiguous(), buffers_to_sum_into(ctx, grad_h), None, (query, gain)
        )
        return grad_query, grad_gain, None, None, *grad_sources


def _contiguous(sources: list[torch.Tensor], compute: torch.dtype) -> list[torch.Tensor]:
    """Each source contiguous in the compute dtype. The model's (fp32, contiguous) are passed as they are: a
    no-op `.to().contiguous()` or a view per source cost more than the kernel at small shapes."""
    return [
        source if source.dtype == compute and source.is_contiguous() else source.to(compute).contiguous()
        for source in sources
    ]


def depth_attention_cpu(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
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
        h, logits, weights = cpu_autograd.apply_function(_EagerDepthAttention, query, gain, bias, float(eps), *flat)
    return (h if h.dtype == first.dtype else h.to(first.dtype)), weights, logits


class _EagerNormedDepthAttention(torch.autograd.Function):
    """`_EagerDepthAttention` with the consumer's pre-norm fused: ``(h, y)`` with ``y = RMSNorm(h) * norm_weight``
    (docs/kernels.md §4). ``h`` may have other uses (its gradient is then added to the norm's); without
    ``keep_h`` it is neither written nor saved (None: the backward mixes its rows again from the sources it reads
    anyway). Weights and logits are not reported. All inputs in the sources' dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        keep_h: bool,
        query: torch.Tensor,
        gain: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        norm_eps: float,
        *sources: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        query, gain = query.contiguous(), gain.contiguous()
        h, stats, y, norm_rstd = _run_forward(list(sources), query, None, eps, norm_weight, norm_eps, keep_h, gain)
        ctx.save_for_backward(query, gain, norm_weight, stats, norm_rstd, h, *sources)
        ctx.shared = shared_gradients(sources)
        ctx.set_materialize_grads(False)  # h usually has no other use: no zero gradient to add
        return h, y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_h: torch.Tensor | None, grad_y: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        query, gain, norm_weight, stats, norm_rstd, h, *sources = ctx.saved_tensors
        if grad_y is None and grad_h is None:
            return (None,) * (6 + len(sources))
        norm = None if grad_y is None else (h, norm_weight, norm_rstd, grad_y.contiguous())  # None: only h was used
        grad_sources, grad_query, grad_gain, grad_norm_weight = _run_backward(
            sources,
            None,
            stats,
            None if grad_h is None else grad_h.contiguous(),
            buffers_to_sum_into(ctx, grad_h, grad_y),
            norm,
            (query, gain),
        )
        return None, grad_query, grad_gain, grad_norm_weight, None, None, *grad_sources


def depth_attention_normed_cpu(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, RMSNorm(h) * norm_weight)`` for contiguous fp32/fp64 CPU sources of one dtype, with parameters of that
    dtype, in one kernel call each way (eager only: under torch.compile inductor fuses the norm itself); equals
    `depth_attention_cpu` followed by `rms_norm_cpu`."""
    first = sources[0]
    if first.device.type != "cpu" or first.dtype not in REAL_TYPES or torch.compiler.is_compiling():
        raise ValueError(
            f"the fused pre-norm runs eagerly on fp32/fp64 CPU tensors, got {first.dtype} on {first.device}"
        )
    for name, tensor in (("query", query), ("key_norm_weight", key_norm_weight), ("norm_weight", norm_weight)):
        if tensor.dtype != first.dtype or tensor.shape != first.shape[-1:]:
            raise ValueError(
                f"{name} must be [{first.shape[-1]}] {first.dtype} like the sources, got "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
    return fused_mix_and_norm(sources, query, key_norm_weight, eps, norm_weight, norm_eps)


def fused_mix_and_norm(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
    keep_h: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`depth_attention_normed_cpu` without its checks, for a caller that made them: `depth_execution.fused_with_norm`
    (sources of one shape and dtype on the CPU, outside torch.compile, parameters of the sources' dtype and width),
    which the depth stream and `depth_execution.mix_and_norm` ask before calling this; checking twice costs a
    sizeable part of a small sublayer's mix (docs/kernels.md §11). Without ``keep_h``, ``(None, y)``: h is neither
    written nor read back (a model's sublayer reads y alone)."""
    return cpu_autograd.apply_function(
        _EagerNormedDepthAttention,
        keep_h,
        query,
        key_norm_weight,
        norm_weight.contiguous(),
        float(eps),
        float(norm_eps),
        *_contiguous(sources, sources[0].dtype),
    )


def _run_multi(
    sources: list[torch.Tensor],
    queries: torch.Tensor,
    eps: float,
    prior: tuple[torch.Tensor, torch.Tensor] | None,
    prior_tokens: int,
    mix: list[torch.Tensor],
    lse: list[torch.Tensor],
) -> None:
    """The C call of `depth_attention_multi_cpu` on flat operands: sources ``[N, D]`` (contiguous, the compute
    dtype), queries ``[Q, D]``, prior ``([Q, P, D], [Q, P])`` or None; writes each query's ``mix`` ``[N, D]`` and
    ``lse`` ``[N]`` (contiguous tensors of the compute dtype: rows of one block, or tensors of their own)."""
    first = sources[0]
    n_tokens, d_model, n_queries = first.numel() // first.shape[-1], first.shape[-1], queries.shape[0]
    library, pointers = cpu_build.cpu_library(first.dtype), pointer_array(sources)
    threads = kernel_threads(len(sources) * n_tokens * d_model, library)
    for start in range(0, n_queries, MAX_QUERIES):
        part = slice(start, start + MAX_QUERIES)
        library.depth_attention_multi(
            pointers,
            len(sources),
            n_tokens,
            d_model,
            queries[part].data_ptr(),
            queries[part].shape[0],
            None if prior is None else prior[0][part].data_ptr(),
            None if prior is None else prior[1][part].data_ptr(),
            prior_tokens,
            eps,
            pointer_array(mix[part]),
            pointer_array(lse[part]),
            threads,
        )


class _EagerMultiDepthAttention(torch.autograd.Function):
    """`depth_attention_multi_cpu` with its backward (C, `depth_attention_multi_backward`), for Q <= MAX_QUERIES
    queries and a prior over the sources' own tokens: ``(mix_0, ..., mix_{Q-1}, lse_0, ..., lse_{Q-1})``, each
    query's part a tensor of its own, so a consumer's gradient reaches its part alone (indexing one [Q, N, D] output
    would send back a [Q, N, D] block of zeros per consumer), and a consumer may edit its input in place: the mixes
    are not views, and the backward does not read them. All operands flat and contiguous in the compute
    dtype: queries ``[Q, D]``, prior ``[Q, N, D]`` and ``[Q, N]`` or None, sources ``[N, D]``."""

    @staticmethod
    def forward(
        ctx: Any,
        eps: float,
        queries: torch.Tensor,
        prior_mix: torch.Tensor | None,
        prior_lse: torch.Tensor | None,
        *sources: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        prior = None if prior_mix is None else (prior_mix, prior_lse)
        first, n_queries = sources[0], queries.shape[0]
        n_tokens = first.numel() // first.shape[-1]
        mix = [new_output((n_tokens, first.shape[-1]), first.dtype, first.device) for _ in range(n_queries)]
        lse = [new_output((n_tokens,), first.dtype, first.device) for _ in range(n_queries)]
        _run_multi(list(sources), queries, eps, prior, n_tokens, mix, lse)
        ctx.eps = eps
        ctx.save_for_backward(queries, prior_mix, prior_lse, *lse, *sources)
        ctx.shared = shared_gradients(sources)
        ctx.set_materialize_grads(False)  # a consumer reads its own part: no zeros for the others'
        return (*mix, *lse)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        queries, prior_mix, prior_lse, *saved = ctx.saved_tensors
        n_queries = queries.shape[0]
        lse, sources = saved[:n_queries], saved[n_queries:]
        first = sources[0]
        if all(grad is None for grad in grads):
            return (None,) * (4 + len(sources))
        grads = [None if grad is None else grad.contiguous() for grad in grads]
        shared = buffers_to_sum_into(ctx, *grads)
        grad_sources, accumulate = gradient_buffers(sources, shared)
        grad_queries = new_output_like(queries)
        grad_prior_mix = None if prior_mix is None else new_output_like(prior_mix)
        grad_prior_lse = None if prior_lse is None else new_output_like(prior_lse)
        d_model = first.shape[-1]
        n_tokens = first.numel() // d_model
        library = cpu_build.cpu_library(first.dtype)
        status = library.depth_attention_multi_backward(
            pointer_array(sources),
            len(sources),
            n_tokens,
            d_model,
            queries.data_ptr(),
            n_queries,
            address(prior_mix),
            address(prior_lse),
            ctx.eps,
            pointer_array(lse),
            optional_pointer_array(grads[:n_queries]),
            optional_pointer_array(grads[n_queries:]),
            pointer_array(grad_sources),
            accumulate,
            grad_queries.data_ptr(),
            address(grad_prior_mix),
            address(grad_prior_lse),
            kernel_threads(len(sources) * n_tokens * d_model, library),
        )
        if status != 0:
            raise MemoryError(
                f"the C two-phase backward could not allocate its per-thread sums of {n_queries} x {d_model} values"
            )
        return None, grad_queries, grad_prior_mix, grad_prior_lse, *returned_gradients(grad_sources, shared)


def depth_attention_multi_cpu(
    sources: list[torch.Tensor],
    folded_queries: torch.Tensor,
    eps: float,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, ...]]:
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
        raise ValueError(
            f"folded_queries must be [n_queries, {d_model}] (the sources' last dim), got {tuple(folded_queries.shape)}"
        )
    compute = compute_dtype(first.dtype)
    flat = _contiguous(sources, compute)
    n_tokens, n_queries = first.numel() // d_model, folded_queries.shape[0]
    queries = folded_queries.to(compute).contiguous()
    prior_tokens = n_tokens
    if prior is not None:
        prior_mix, prior_lse = prior
        stacks_copies = prior_mix.dim() == first.dim() + 1 and prior_mix.shape[1]
        copies = first.shape[0] // prior_mix.shape[1] if stacks_copies else 0
        if (
            prior_mix.shape[0] != n_queries
            or copies * prior_mix.shape[1] != first.shape[0]
            or prior_mix.shape[2:] != first.shape[1:]
            or prior_lse.shape != prior_mix.shape[:-1]
        ):
            raise ValueError(
                f"prior must be (mix [{n_queries}, B, {', '.join(map(str, first.shape[1:]))}], lse "
                f"[{n_queries}, B, {', '.join(map(str, lead[1:]))}]) with B the sources' first dim "
                f"{first.shape[0]} or a divisor of it, got {tuple(prior_mix.shape)} and "
                f"{tuple(prior_lse.shape)}"
            )
        prior_tokens = n_tokens // copies if copies else n_tokens  # no tokens: nothing is read
        if needs_grad and prior_tokens != n_tokens:
            raise ValueError(
                f"a prior over one copy of stacked sources ({prior_mix.shape[1]} of {first.shape[0]} "
                "rows) has no backward or forward-mode derivative; run it under torch.no_grad() on "
                "tensors without tangents, or give the prior for every row"
            )
        prior = (
            prior_mix.to(compute).reshape(n_queries, prior_tokens, d_model).contiguous(),
            prior_lse.to(compute).reshape(n_queries, prior_tokens).contiguous(),
        )
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


def depth_attention_copies_cpu(
    shared: list[torch.Tensor],
    stacked: list[torch.Tensor],
    n_copies: int,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        if tensor.device.type != "cpu" or tensor.dtype not in REAL_TYPES:
            raise ValueError(
                f"depth_attention_copies_cpu needs fp32/fp64 CPU sources, got {tensor.dtype} on {tensor.device}"
            )
    if copy.dim() < 2:
        raise ValueError(f"sources must be [B, ..., D], got a shared source of shape {tuple(copy.shape)}")
    d_model, n_sources = copy.shape[-1], len(sources)
    vectors = [("query", query), ("key_norm_weight", key_norm_weight), *([("norm weight", norm[0])] if norm else [])]
    for name, vector in vectors:
        check_vector(name, vector, d_model, copy.device)
    parameters = [query, key_norm_weight, *(() if bias is None else (bias,)), *(norm[:1] if norm else ())]
    if needs_autograd(*sources, *parameters):
        raise ValueError(
            "depth_attention_copies_cpu has no backward or forward-mode derivative; run it under "
            "torch.no_grad() on tensors without tangents, or mix with depth_attention for a gradient"
        )
    stacked_shape = (n_copies * copy.shape[0], *copy.shape[1:])
    if any(x.shape != copy.shape for x in shared) or any(x.shape != stacked_shape for x in stacked):
        raise ValueError(
            f"shared sources must each be one copy {list(copy.shape)} and stacked ones "
            f"{list(stacked_shape)} ({n_copies} copies), got {[list(x.shape) for x in shared]} and "
            f"{[list(x.shape) for x in stacked]}"
        )
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
        library = cpu_build.cpu_library(compute)
        status = library.depth_attention_copies_forward(
            pointer_array(flat),
            n_sources,
            len(shared),
            n_copies,
            n_tokens,
            d_model,
            folded.data_ptr(),
            address(source_major),
            eps,
            address(norm_weight),
            float(norm[1]) if norm else 0.0,
            h.data_ptr(),
            address(y),
            address(norm_rstd),
            stats.data_ptr(),
            kernel_threads(n_sources * n_copies * n_tokens * d_model, library),
        )
        if status != 0:
            raise MemoryError(
                f"depth_attention_copies_cpu could not allocate its source tables ({n_copies} x {n_sources} pointers)"
            )
    return h if norm is None else (h, y)


class _EagerRoutedDepthAttention(torch.autograd.Function):
    """The op with its knobs on the C kernel (`depth_attention_routed` and its backward; docs/kernels.md §1): R <=
    MAX_QUERIES folded queries ``[R, D]`` (``u_r = c w_r g``, folded by the caller, so autograd gives ``dw`` and
    ``dg`` from ``du``), a token-major bias ``[N, Rb, S]`` (Rb = R, or 1 shared by the routes) or None, values raw
    or normalised. Returns ``(h [..., R, D], weights [N, R, S], logits [N, R, S])`` in the compute dtype, the last
    two reported only (empty unless ``want_stats``), the logits unbiased."""

    @staticmethod
    def forward(
        ctx: Any,
        queries: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        normalize_values: bool,
        want_stats: bool,
        *sources: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first = sources[0]
        d_model, n_routes, n_sources = first.shape[-1], queries.shape[0], len(sources)
        n_tokens = first.numel() // d_model
        h = new_output((*first.shape[:-1], n_routes, d_model), first.dtype, first.device)
        lse = new_output((n_routes, n_tokens), first.dtype, first.device)
        stats_shape = (n_tokens, n_routes, n_sources) if want_stats else (0,)
        weights, logits = (new_output(stats_shape, first.dtype, first.device) for _ in range(2))
        library = cpu_build.cpu_library(first.dtype)
        library.depth_attention_routed(
            pointer_array(sources),
            n_sources,
            n_tokens,
            d_model,
            queries.data_ptr(),
            n_routes,
            *_bias_layout(bias, n_routes, n_sources),
            int(normalize_values),
            eps,
            h.data_ptr(),
            lse.data_ptr(),
            weights.data_ptr() if want_stats else None,
            logits.data_ptr() if want_stats else None,
            kernel_threads(n_sources * n_tokens * d_model * n_routes, library),
        )
        ctx.eps, ctx.normalize_values = eps, normalize_values
        ctx.save_for_backward(queries, bias, lse, *sources)
        ctx.shared = shared_gradients(sources)
        ctx.mark_non_differentiable(weights, logits)
        return h, weights, logits

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_h: torch.Tensor, _grad_weights: torch.Tensor, _grad_logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        queries, bias, lse, *sources = ctx.saved_tensors
        first = sources[0]
        d_model, n_routes, n_sources = first.shape[-1], queries.shape[0], len(sources)
        n_tokens = first.numel() // d_model
        grad_h = grad_h.contiguous()
        shared = buffers_to_sum_into(ctx, grad_h)
        grad_sources, accumulate = gradient_buffers(sources, shared)
        grad_queries = new_output_like(queries)
        library = cpu_build.cpu_library(first.dtype)
        status = library.depth_attention_routed_backward(
            pointer_array(sources),
            n_sources,
            n_tokens,
            d_model,
            queries.data_ptr(),
            n_routes,
            *_bias_layout(bias, n_routes, n_sources),
            int(ctx.normalize_values),
            ctx.eps,
            lse.data_ptr(),
            grad_h.data_ptr(),
            pointer_array(grad_sources),
            accumulate,
            grad_queries.data_ptr(),
            kernel_threads(n_sources * n_tokens * d_model * n_routes, library),
        )
        if status != 0:
            raise MemoryError(
                f"the C routed backward could not allocate its per-thread sums of {n_routes} x {d_model} values"
            )
        return grad_queries, None, None, None, None, *returned_gradients(grad_sources, shared)


def _bias_layout(bias: torch.Tensor | None, n_routes: int, n_sources: int) -> tuple[int | None, int, int]:
    """The C kernel's view of a token-major bias ``[N, Rb, S]``: its address, the step from one route's row to the
    next (0 where one row is shared by the routes) and from one token's rows to the next."""
    if bias is None:
        return None, 0, 0
    routes_in_bias = bias.shape[1]
    return bias.data_ptr(), (n_sources if routes_in_bias == n_routes > 1 else 0), routes_in_bias * n_sources


def routed_depth_attention_cpu(
    sources: list[torch.Tensor],
    queries: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    normalize_values: bool = False,
    want_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`torch_fast.routed_depth_attention_torch` on the C kernel: ``(h [..., R, D], weights, logits)`` for
    ``queries`` ``[R, D]``, weights/logits source-major ``[n_sources, N, R]`` (views of the kernel's token-major
    output; None unless ``want_stats``), the logits unbiased; ``bias`` ``[n_sources, N, R]``, ``[n_sources, N,
    1]`` or None. The queries are
    folded with autograd (``u_r = c w_r g``) and split into sets of MAX_QUERIES. Under torch.compile, which cannot
    trace the ctypes call, the torch backend's Function runs instead (the same function)."""
    first = sources[0]
    if first.device.type != "cpu":
        raise ValueError(f"the cpu backend needs CPU tensors, got tensors on {first.device}; use backend='auto'")
    if torch.compiler.is_compiling():
        from attnres_lens.kernels.torch_fast import routed_depth_attention_torch

        return routed_depth_attention_torch(sources, queries, key_norm_weight, eps, bias, logit_scale, normalize_values)
    compute = compute_dtype(first.dtype)
    flat = _contiguous(sources, compute)
    folded = queries.to(compute) * logit_scale
    if key_norm_weight is not None:
        folded = folded * key_norm_weight.to(compute)
    token_bias = None if bias is None else bias.permute(1, 2, 0).to(compute)  # [N, Rb, S]
    parts = []
    for start in range(0, queries.shape[0], MAX_QUERIES):
        part = slice(start, start + MAX_QUERIES)
        part_bias = None
        if token_bias is not None:
            part_bias = (token_bias if token_bias.shape[1] == 1 else token_bias[:, part]).contiguous()
        parts.append(
            cpu_autograd.apply_function(
                _EagerRoutedDepthAttention,
                folded[part].contiguous(),
                part_bias,
                float(eps),
                normalize_values,
                want_stats,
                *flat,
            )
        )
    h, weights, logits = (
        parts[0] if len(parts) == 1 else (torch.cat(out, dim) for out, dim in zip(zip(*parts), (-2, 1, 1)))
    )
    h = h if h.dtype == first.dtype else h.to(first.dtype)
    if not want_stats:
        return h, None, None
    return h, weights.permute(2, 0, 1), logits.permute(2, 0, 1)
