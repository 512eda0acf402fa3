"""Two-phase Block AttnRes (paper Alg. 1, SPEC §5), in PyTorch with autograd.

Pseudo-queries do not depend on the input, so every sublayer of a block can score the completed-block sources
``[b_0, ..., b_{n-1}]`` together as soon as the block starts (phase 1): each source is read once for all queries,
its rstd is computed once, and the ``n_q`` logits come from one matmul. Phase 2 folds in the one source phase 1
could not see, the sublayer's own partial sum ``p`` (taken *before* the sublayer's update), with the
online-softmax merge of two parts ``(m1, l1, o1)`` and ``(m2, l2, o2)``::

    m = max(m1, m2),   h = (e^{m1-m} o1 + e^{m2-m} o2) / (e^{m1-m} l1 + e^{m2-m} l2)

where the partial is a one-source part: ``m2 = logit_p``, ``l2 = 1``, ``o2 = p``. The result equals one softmax
over ``[b_0, ..., b_{n-1}, p]`` in value and gradient.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from attnres_lens.kernels._common import Sources, check_sources, compute_dtype


class BlockStats(NamedTuple):
    """Per-query online-softmax state over a block's completed sources (fp32, or fp64 for fp64 sources).

    Leading dims: ``n_q`` (one per pseudo-query of the block), then the sources' token dims ``...``.
    """

    max: torch.Tensor  # [n_q, ...] largest logit
    sum: torch.Tensor  # [n_q, ...] sum_s exp(logit_s - max)
    out: torch.Tensor  # [n_q, ..., D] sum_s exp(logit_s - max) * v_s, not yet divided by `sum`
    folded_queries: torch.Tensor  # [n_q, D] query * gain, reused to score the partial sum in phase 2
    logits: Optional[torch.Tensor]  # [n_q, ..., n_completed] when phase 1 was asked for them
    out_dtype: torch.dtype  # the sources' dtype, which the merged output is cast back to


def _rstd(values: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(values.pow(2).mean(dim=-1) + eps)


def block_phase1(
    sources: Sources,
    queries: torch.Tensor,
    key_norm_weights: torch.Tensor,
    eps: float = 1e-6,
    return_logits: bool = False,
) -> BlockStats:
    """Phase 1: score all ``n_q`` pseudo-queries of a block against its completed-block sources in one pass.

    Args:
        sources: the completed-block sources ``[b_0, ..., b_{n-1}]``, each ``[..., D]`` (list or ``[S, ..., D]``).
        queries: ``[n_q, D]``, the pseudo-queries of the block's sublayers, in order.
        key_norm_weights: ``[n_q, D]``, each sublayer's key-norm gain.
        eps: RMSNorm epsilon of the keys.
        return_logits: keep the per-source logits (for hooks that report depth weights).
    """
    source_list = check_sources(sources)
    d_model = source_list[0].shape[-1]
    if queries.dim() != 2 or queries.shape[1] != d_model:
        raise ValueError(f"queries must have shape [n_q, {d_model}], got {tuple(queries.shape)}")
    if key_norm_weights.shape != queries.shape:
        raise ValueError(
            f"key_norm_weights must match queries' shape {tuple(queries.shape)}, got {tuple(key_norm_weights.shape)}"
        )
    dtype = compute_dtype(source_list[0].dtype)
    folded = queries.to(dtype) * key_norm_weights.to(dtype)
    values = [source.to(dtype) for source in source_list]
    # [n_q, ..., S]: rstd depends only on the source, so it is shared by every query
    logits = torch.stack([(v @ folded.t()).movedim(-1, 0) * _rstd(v, eps) for v in values], dim=-1)
    running_max = logits.max(dim=-1).values
    unnormalised = torch.exp(logits - running_max[..., None])
    out = sum(unnormalised[..., s, None] * v for s, v in enumerate(values))
    return BlockStats(
        max=running_max,
        sum=unnormalised.sum(dim=-1),
        out=out,
        folded_queries=folded,
        logits=logits if return_logits else None,
        out_dtype=source_list[0].dtype,
    )


def merge_partial(
    stats: BlockStats,
    index: int,
    partial: Optional[torch.Tensor],
    eps: float = 1e-6,
    return_weights: bool = False,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Phase 2: the input of the block's ``index``-th sublayer, merging its partial sum into phase-1 ``stats``.

    ``partial`` is the sum of the block's earlier sublayer outputs (``[..., D]``), or None for the sublayer that
    starts the block (then ``h = out / sum``). Returns ``h`` in the sources' dtype, followed by the depth weights
    and/or logits over ``[completed..., partial]`` (``[..., n_sources]``) when asked; those need phase-1 logits.
    """
    n_queries = stats.folded_queries.shape[0]
    if not 0 <= index < n_queries:
        raise ValueError(f"index must be in 0..{n_queries - 1}, got {index}")
    if (return_weights or return_logits) and stats.logits is None:
        raise ValueError("depth weights/logits need block_phase1(..., return_logits=True)")
    max1, sum1, out1 = stats.max[index], stats.sum[index], stats.out[index]
    if partial is None:
        h = out1 / sum1[..., None]
        logits = stats.logits[index] if stats.logits is not None else None
    else:
        if partial.shape != out1.shape:
            raise ValueError(f"partial must have shape {tuple(out1.shape)}, got {tuple(partial.shape)}")
        value = partial.to(out1.dtype)
        partial_logit = (value @ stats.folded_queries[index]) * _rstd(value, eps)
        merged_max = torch.maximum(max1, partial_logit)
        scale1 = torch.exp(max1 - merged_max)
        scale2 = torch.exp(partial_logit - merged_max)
        h = (scale1[..., None] * out1 + scale2[..., None] * value) / (scale1 * sum1 + scale2)[..., None]
        logits = None
        if stats.logits is not None:
            logits = torch.cat([stats.logits[index], partial_logit[..., None]], dim=-1)
    h = h.to(stats.out_dtype)
    extras = []
    if return_weights:
        extras.append(torch.softmax(logits, dim=-1))
    if return_logits:
        extras.append(logits)
    return (h, *extras) if extras else h
