"""Two-phase AttnRes (paper Alg. 1, docs/kernels.md §7): readable PyTorch here, fused Triton in
``triton_two_phase.py``, fused C in ``cpu_depth.c`` (``depth_attention_multi`` and its backward).

Pseudo-queries do not depend on the input, so every sublayer of a block can score the completed-block sources
``[b_0, ..., b_{n-1}]`` together as soon as the block starts (phase 1): each source is read once for all queries,
its rstd is computed once, and the ``n_q`` logits come from one matmul. Phase 2 folds in the sources phase 1
could not see — the sublayer's own partial sum ``p`` (taken *before* the sublayer's update), or for Full AttnRes
the outputs written since phase 1 — with the online-softmax merge of two parts ``(m1, l1, o1)`` and
``(m2, l2, o2)``::

    m = max(m1, m2),   h = (e^{m1-m} o1 + e^{m2-m} o2) / (e^{m1-m} l1 + e^{m2-m} l2)

Phase 1 keeps each query's part normalised, as ``(lse1, h1) = (m1 + log l1, o1 / l1)`` (the same state with
``l = 1``); the partial is a one-source part ``(logit_p, 1, p)`` (several sources: their own softmax part). The
result equals one softmax over ``[b_0, ..., b_{n-1}, p]`` in value and gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from attnres_lens.kernels._common import Sources, check_sources, compute_dtype
from attnres_lens.kernels.backends import two_phase_backend
from attnres_lens.kernels.reference import mix_sources, rstd


class BlockStats(NamedTuple):
    """Phase-1 state of a block: one softmax part per pseudo-query over the completed sources.

    Leading dims: ``n_q`` (one per pseudo-query of the block), then the sources' token dims ``...``.
    """

    # [n_q, ..., D] softmax mix of the completed sources (fp32; fp64 for fp64); from the C kernel with a
    # gradient, a tuple of n_q [..., D] tensors (each consumer's gradient reaches its own part)
    mix: torch.Tensor | tuple[torch.Tensor, ...]
    lse: torch.Tensor | tuple[torch.Tensor, ...]  # [n_q, ...] log-sum-exp of those logits, likewise
    queries: torch.Tensor  # [n_q, D]
    key_norm_weights: torch.Tensor  # [n_q, D]
    logits: torch.Tensor | None  # [n_q, ..., n_completed] when phase 1 was asked for them
    eps: float
    backend: str  # "torch", "triton" or "cpu": phase 2 runs where phase 1 ran
    out_dtype: torch.dtype  # the sources' dtype, which every merged output is cast back to


def block_phase1(
    sources: Sources,
    queries: torch.Tensor,
    key_norm_weights: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
    backend: str = "auto",
) -> BlockStats:
    """Phase 1: score all ``n_q`` pseudo-queries of a block against its completed-block sources in one pass.

    Args:
        sources: the completed-block sources ``[b_0, ..., b_{n-1}]``, each ``[..., D]`` (list or ``[S, ..., D]``).
        queries: ``[n_q, D]``, the pseudo-queries of the block's sublayers, in order.
        key_norm_weights: ``[n_q, D]``, each sublayer's key-norm gain.
        eps: RMSNorm epsilon of the keys.
        return_logits: keep the per-source logits (for hooks that report depth weights).
        backend: as for ``depth_attention``; ``"triton"`` (or ``"auto"`` on CUDA) runs the fused kernels, and
            ``"cpu"`` (or ``"auto"`` on the CPU) the fused C kernel when no logits are asked for; any
            other choice this module's PyTorch.
    """
    source_list = check_sources(sources)
    d_model = source_list[0].shape[-1]
    if queries.dim() != 2 or queries.shape[1] != d_model:
        raise ValueError(f"queries must have shape [n_q, {d_model}], got {tuple(queries.shape)}")
    if key_norm_weights.shape != queries.shape:
        raise ValueError(
            f"key_norm_weights must match queries' shape {tuple(queries.shape)}, got {tuple(key_norm_weights.shape)}"
        )
    for name, vectors in (("queries", queries), ("key_norm_weights", key_norm_weights)):  # as the single-pass op
        if not vectors.is_floating_point() or vectors.device != source_list[0].device:
            raise ValueError(
                f"{name} must be floating point on the sources' device {source_list[0].device}, got "
                f"{vectors.dtype} on {vectors.device}"
            )
    chosen = two_phase_backend(backend, source_list[0].device, return_logits)
    if chosen == "cpu":
        from attnres_lens.kernels.cpu_depth import depth_attention_multi_cpu

        dtype = compute_dtype(source_list[0].dtype)  # fold u = w * g as the single-pass kernel does
        mix, lse = depth_attention_multi_cpu(source_list, queries.to(dtype) * key_norm_weights.to(dtype), eps)
        logits = None
    elif chosen == "triton":
        from attnres_lens.kernels.triton_two_phase import phase1_triton

        mix, lse, logits = phase1_triton(source_list, queries, key_norm_weights, eps, return_logits)
    else:
        dtype = compute_dtype(source_list[0].dtype)
        folded = queries.to(dtype) * key_norm_weights.to(dtype)
        values = [source.to(dtype) for source in source_list]
        # [n_q, ..., S]: rstd depends only on the source, so it is shared by every query
        logits = torch.stack([(v @ folded.t()).movedim(-1, 0) * rstd(v, eps) for v in values], dim=-1)
        mix = mix_sources(torch.softmax(logits, dim=-1), values)
        lse = torch.logsumexp(logits, dim=-1)
    return BlockStats(
        mix=mix,
        lse=lse,
        queries=queries,
        key_norm_weights=key_norm_weights,
        logits=logits if return_logits else None,
        eps=eps,
        backend=chosen,
        out_dtype=source_list[0].dtype,
    )


def merge_partial(
    stats: BlockStats,
    index: int,
    partial: torch.Tensor | Sequence[torch.Tensor] | None,
    return_weights: bool = False,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Phase 2: the input of the block's ``index``-th sublayer, merging what phase 1 did not see into ``stats``.

    ``partial`` is the sum of the block's earlier sublayer outputs (``[..., D]``), or None for the sublayer that
    starts the block (then ``h`` is the phase-1 mix); for Full AttnRes, the list of sources written since phase 1
    (empty for the consumer phase 1 started at). Returns ``h`` in the sources' dtype, followed by the depth
    weights and/or logits over ``[completed..., partial...]`` (``[..., n_sources]``) when asked; those need
    phase-1 logits. Phase 2 runs where phase 1 ran. After the C kernel's phase 1 with a gradient, ``stats.mix``
    and ``stats.lse`` hold one tensor per query (`cpu_depth.depth_attention_multi_cpu`)."""
    n_queries = stats.queries.shape[0]
    if not 0 <= index < n_queries:
        raise ValueError(f"index must be in 0..{n_queries - 1}, got {index}")
    if (return_weights or return_logits) and stats.logits is None:
        raise ValueError("depth weights/logits need block_phase1(..., return_logits=True)")
    new_sources = [] if partial is None else [partial] if isinstance(partial, torch.Tensor) else list(partial)
    completed_logits = stats.logits[index] if stats.logits is not None else None
    mix, completed_lse = stats.mix[index], stats.lse[index]
    if not new_sources:
        h, logits = mix.to(stats.out_dtype), completed_logits
    else:
        for value in new_sources:
            if value.shape != mix.shape:
                raise ValueError(f"partial must have shape {tuple(mix.shape)}, got {tuple(value.shape)}")
            if not value.is_floating_point() or value.device != mix.device:
                raise ValueError(
                    f"partial must be a floating tensor on {mix.device}, got {value.dtype} on {value.device}"
                )
        query, gain = stats.queries[index], stats.key_norm_weights[index]
        new_logits = None
        if stats.backend == "triton":
            if len(new_sources) != 1:
                raise ValueError(f"the triton merge takes one partial sum, got {len(new_sources)} sources")
            from attnres_lens.kernels.triton_two_phase import merge_triton

            h, new_logits = merge_triton(
                mix, completed_lse, new_sources[0], query, gain, stats.eps, completed_logits is not None
            )
            new_logits = None if new_logits is None else new_logits[..., None]
        elif stats.backend == "cpu":
            from attnres_lens.kernels.cpu_depth import depth_attention_multi_cpu

            folded = query.to(mix.dtype) * gain.to(mix.dtype)
            merged, _ = depth_attention_multi_cpu(
                new_sources, folded[None], stats.eps, prior=(mix[None], completed_lse[None])
            )
            h = merged[0].to(stats.out_dtype)
        else:
            values = [value.to(mix.dtype) for value in new_sources]
            folded = query.to(mix.dtype) * gain.to(mix.dtype)
            new_logits = torch.stack([(value @ folded) * rstd(value, stats.eps) for value in values], dim=-1)
            total_lse = torch.logaddexp(completed_lse, torch.logsumexp(new_logits, dim=-1))
            h = torch.exp(completed_lse - total_lse)[..., None] * mix
            for value, logit in zip(values, new_logits.unbind(-1)):
                h = h + torch.exp(logit - total_lse)[..., None] * value
            h = h.to(stats.out_dtype)
        logits = None
        if completed_logits is not None:
            logits = torch.cat([completed_logits, new_logits], dim=-1)
    extras = []
    if return_weights:
        extras.append(torch.softmax(logits, dim=-1))
    if return_logits:
        extras.append(logits)
    return (h, *extras) if extras else h
