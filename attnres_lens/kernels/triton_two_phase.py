"""Two-phase Block AttnRes in Triton (paper Alg. 1, docs/kernels.md §7), forward and backward. Reference:
``two_phase.py``.

Phase 1 (``_phase1_fwd_kernel``): one program owns ``BLOCK_ROWS`` tokens and scores *all* ``n_q`` pseudo-queries of
a block against each completed-block source as it streams past, so every source is read once for the whole block.
Per query it keeps an online softmax (running max, sum and un-normalised mix, fp32) and writes the normalised mix
``h1_q`` (fp32) and ``lse1_q = m + log l``. Queries sit on a padded leading axis ``BLOCK_Q`` (a power of two); the
rows of padding queries are computed and never stored.

Phase 2 (``_merge_fwd_kernel``): each sublayer merges its own partial sum ``p`` (one source) into its phase-1 part.
With ``(lse1, h1)`` for the completed sources and ``lp = u . RMSNorm(p)``, the online-softmax merge
(docs/kernels.md §7) reads

    a = e^{lse1 - L},  b = e^{lp - L},  L = log(e^{lse1} + e^{lp}),  h = a h1 + b p.

Backward recomputes rstd and logits from the tiles it reads anyway. Per token, with ``dh1_q`` and ``dlse1_q``
flowing back into phase 1 and ``delta_q = dh1_q . h1_q``:

    dlogit_qs = alpha_qs (dh1_q . v_s - delta_q + dlse1_q)
    dv_s      = sum_q alpha_qs dh1_q + r_s sum_q dlogit_qs u_q - r_s^2 / D (sum_q dlogit_qs l_qs) v_s
    du_q     += sum_s dlogit_qs r_s v_s

Query gradients are summed per program into ``[programs, ...]`` buffers and reduced on the host in a fixed order.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from attnres_lens.kernels._common import new_output
from attnres_lens.kernels.triton_fused import (
    check_device,
    default_block_rows,
    load_source,
    max_programs,
    num_warps,
    pointer_table,
    row_tile,
)


@triton.jit
def _phase1_fwd_kernel(
    src_base,
    src_table,
    source_stride,
    folded_queries,  # fp32 [n_q, D]
    h1_out,  # fp32 [n_q, N, D]: kept wide, since the backward's dh1 . v - dh1 . h1 cancels
    lse1_out,  # fp32 [n_q, N]
    logits_out,  # fp32 [n_q, S, N], written only when STORE_LOGITS
    n_tokens,
    n_sources,
    n_queries,
    d_model,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    queries = tl.arange(0, BLOCK_Q).to(tl.int64)
    row_mask = rows < n_tokens
    col_mask = cols < d_model
    query_mask = queries < n_queries
    tile_mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * d_model + cols[None, :]
    u = tl.load(
        folded_queries + queries[:, None] * d_model + cols[None, :],
        mask=query_mask[:, None] & col_mask[None, :],
        other=0.0,
    )  # [Q, D]

    running_max = tl.full([BLOCK_Q, BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_Q, BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    buffer_source = src_base
    for s in range(n_sources):
        v, rstd = load_source(src_table, s, buffer_source, offsets, tile_mask, d_model, eps, FROM_TABLE)
        buffer_source += source_stride
        logit = tl.sum(v[None, :, :] * u[:, None, :], axis=2) * rstd[None, :]  # [Q, R]
        if STORE_LOGITS:
            tl.store(
                logits_out + (queries[:, None] * n_sources + s) * n_tokens + rows[None, :],
                logit,
                mask=query_mask[:, None] & row_mask[None, :],
            )
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(logit - new_max)
        running_sum = running_sum * rescale + p
        acc = acc * rescale[:, :, None] + p[:, :, None] * v[None, :, :]
        running_max = new_max

    h1 = acc / running_sum[:, :, None]
    query_tiles = queries[:, None, None] * n_tokens * d_model + offsets[None, :, :]
    tl.store(h1_out + query_tiles, h1, mask=query_mask[:, None, None] & tile_mask[None])
    tl.store(
        lse1_out + queries[:, None] * n_tokens + rows[None, :],
        running_max + tl.log(running_sum),
        mask=query_mask[:, None] & row_mask[None, :],
    )


@triton.jit
def _phase1_bwd_kernel(
    src_base,
    src_table,
    source_stride,
    grad_sources,  # [S, N, D], sources' dtype
    grad_stride,
    folded_queries,  # fp32 [n_q, D]
    h1_saved,  # [n_q, N, D]
    grad_h1,  # [n_q, N, D]
    lse1_saved,  # fp32 [n_q, N]
    grad_lse1,  # fp32 [n_q, N]
    grad_folded_partial,  # fp32 [programs, n_q, D]
    n_tokens,
    n_sources,
    n_queries,
    d_model,
    eps,
    n_tiles,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    FROM_TABLE: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    queries = tl.arange(0, BLOCK_Q).to(tl.int64)
    col_mask = cols < d_model
    query_mask = queries < n_queries
    u = tl.load(
        folded_queries + queries[:, None] * d_model + cols[None, :],
        mask=query_mask[:, None] & col_mask[None, :],
        other=0.0,
    )
    grad_folded = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for tile in range(program, n_tiles, tl.num_programs(0)):
        rows, row_mask, tile_mask, offsets = row_tile(tile, n_tokens, cols, col_mask, d_model, BLOCK_ROWS)
        stat_offsets = queries[:, None] * n_tokens + rows[None, :]
        stat_mask = query_mask[:, None] & row_mask[None, :]
        query_tiles = queries[:, None, None] * n_tokens * d_model + offsets[None, :, :]
        query_tile_mask = query_mask[:, None, None] & tile_mask[None]
        dh1 = tl.load(grad_h1 + query_tiles, mask=query_tile_mask, other=0.0).to(tl.float32)
        h1 = tl.load(h1_saved + query_tiles, mask=query_tile_mask, other=0.0)
        delta = tl.sum(dh1 * h1, axis=2)  # [Q, R]
        lse = tl.load(lse1_saved + stat_offsets, mask=stat_mask, other=0.0)
        dlse = tl.load(grad_lse1 + stat_offsets, mask=stat_mask, other=0.0)
        buffer_source = src_base
        grad_source = grad_sources
        for s in range(n_sources):
            v, rstd = load_source(src_table, s, buffer_source, offsets, tile_mask, d_model, eps, FROM_TABLE)
            buffer_source += source_stride
            logit = tl.sum(v[None, :, :] * u[:, None, :], axis=2) * rstd[None, :]
            weight = tl.where(stat_mask, tl.exp(logit - lse), 0.0)  # padding queries and rows contribute nothing
            grad_logit = weight * (tl.sum(dh1 * v[None, :, :], axis=2) - delta + dlse)
            key_coef = grad_logit * rstd[None, :]
            value_coef = tl.sum(key_coef * logit, axis=0) * rstd / d_model  # [R]
            grad_v = (
                tl.sum(weight[:, :, None] * dh1, axis=0)
                + tl.sum(key_coef[:, :, None] * u[:, None, :], axis=0)
                - value_coef[:, None] * v
            )
            tl.store(grad_source + offsets, grad_v.to(grad_sources.dtype.element_ty), mask=tile_mask)
            grad_source += grad_stride
            grad_folded += tl.sum(key_coef[:, :, None] * v[None, :, :], axis=1)
    tl.store(
        grad_folded_partial + (program * n_queries + queries[:, None]) * d_model + cols[None, :],
        grad_folded,
        mask=query_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _partial_logit(partial, offsets, tile_mask, u, d_model, eps):
    p = tl.load(partial + offsets, mask=tile_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(p * p, axis=1) / d_model + eps)
    return p, rstd, tl.sum(p * u[None, :], axis=1) * rstd


@triton.jit
def _merge_fwd_kernel(
    h1,  # [N, D] this sublayer's phase-1 mix
    lse1,  # fp32 [N]
    partial,  # [N, D]
    folded_query,  # fp32 [D]
    h_out,  # [N, D]
    lse_out,  # fp32 [N], log-sum-exp over every source
    partial_logit_out,  # fp32 [N], written only when STORE_LOGITS
    n_tokens,
    d_model,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_tokens
    tile_mask = row_mask[:, None] & (cols[None, :] < d_model)
    offsets = rows[:, None] * d_model + cols[None, :]
    u = tl.load(folded_query + cols, mask=cols < d_model, other=0.0)
    p, rstd, partial_logit = _partial_logit(partial, offsets, tile_mask, u, d_model, eps)
    completed_lse = tl.load(lse1 + rows, mask=row_mask, other=0.0)
    mix = tl.load(h1 + offsets, mask=tile_mask, other=0.0)
    top = tl.maximum(completed_lse, partial_logit)
    scale1 = tl.exp(completed_lse - top)
    scale2 = tl.exp(partial_logit - top)
    total = scale1 + scale2
    h = (scale1[:, None] * mix + scale2[:, None] * p) / total[:, None]
    tl.store(h_out + offsets, h.to(h_out.dtype.element_ty), mask=tile_mask)
    tl.store(lse_out + rows, top + tl.log(total), mask=row_mask)
    if STORE_LOGITS:
        tl.store(partial_logit_out + rows, partial_logit, mask=row_mask)


@triton.jit
def _merge_bwd_kernel(
    h1,
    lse1,
    partial,
    folded_query,
    lse_saved,
    grad_h,
    grad_h1,  # out [N, D]
    grad_lse1,  # out fp32 [N]
    grad_partial,  # out [N, D]
    grad_folded_partial,  # out fp32 [programs, D]
    n_tokens,
    d_model,
    eps,
    n_tiles,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d_model
    u = tl.load(folded_query + cols, mask=col_mask, other=0.0)
    grad_folded = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(program, n_tiles, tl.num_programs(0)):
        rows, row_mask, tile_mask, offsets = row_tile(tile, n_tokens, cols, col_mask, d_model, BLOCK_ROWS)
        p, rstd, partial_logit = _partial_logit(partial, offsets, tile_mask, u, d_model, eps)
        lse = tl.load(lse_saved + rows, mask=row_mask, other=0.0)
        weight1 = tl.exp(tl.load(lse1 + rows, mask=row_mask, other=0.0) - lse)
        weight2 = tl.exp(partial_logit - lse)
        mix = tl.load(h1 + offsets, mask=tile_mask, other=0.0)
        dh = tl.load(grad_h + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        dot1 = tl.sum(dh * mix, axis=1)
        dot2 = tl.sum(dh * p, axis=1)
        delta = weight1 * dot1 + weight2 * dot2  # dh . h
        key_coef = weight2 * (dot2 - delta) * rstd
        value_coef = key_coef * partial_logit * rstd / d_model
        tl.store(grad_h1 + offsets, weight1[:, None] * dh, mask=tile_mask)
        tl.store(grad_lse1 + rows, weight1 * (dot1 - delta), mask=row_mask)
        grad_p = weight2[:, None] * dh + key_coef[:, None] * u[None, :] - value_coef[:, None] * p
        tl.store(grad_partial + offsets, grad_p.to(grad_partial.dtype.element_ty), mask=tile_mask)
        grad_folded += tl.sum(tl.where(row_mask, key_coef, 0.0)[:, None] * p, axis=0)
    tl.store(grad_folded_partial + program * d_model + cols, grad_folded, mask=col_mask)


def _block_q(n_queries: int) -> int:
    """The padded query axis of phase 1's programs: a power of two, as `tl.arange` needs."""
    return max(2, triton.next_power_of_2(n_queries))  # tl.arange needs at least 2 elements on older Triton


def _phase1_block_rows(n_queries: int, d_model: int) -> int:
    """Rows per program, shrunk so the ``[Q, rows, D]`` accumulator stays near the single-query kernel's size."""
    rows = default_block_rows(d_model)
    return max(1, rows // _block_q(n_queries)) if rows > 1 else rows


def _query_grads(
    grad_folded: torch.Tensor, queries: torch.Tensor, gains: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``d/dw`` and ``d/dg`` from the gradient of ``u = w * g``."""
    return (grad_folded * gains.float()).to(queries.dtype), (grad_folded * queries.float()).to(gains.dtype)


class TritonPhase1Function(torch.autograd.Function):
    """``(h1 [n_q, N, D], lse1 [n_q, N], logits [n_q, S, N] or empty)`` from ``S`` sources ``[N, D]``."""

    @staticmethod
    def forward(
        ctx: Any,
        queries: torch.Tensor,
        key_norm_weights: torch.Tensor,
        eps: float,
        store_logits: bool,
        block_rows: int,
        *sources: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n_tokens, d_model = sources[0].shape
        n_queries, n_sources = queries.shape[0], len(sources)
        device = sources[0].device
        folded = (queries.float() * key_norm_weights.float()).contiguous()
        table = pointer_table(sources)
        h1 = new_output((n_queries, n_tokens, d_model), torch.float32, device)
        lse1 = new_output((n_queries, n_tokens), torch.float32, device)
        logits = new_output((n_queries, n_sources, n_tokens) if store_logits else (0,), torch.float32, device)
        block_d = triton.next_power_of_2(d_model)
        _phase1_fwd_kernel[(triton.cdiv(n_tokens, block_rows),)](
            sources[0],
            table,
            0,
            folded,
            h1,
            lse1,
            logits,
            n_tokens,
            n_sources,
            n_queries,
            d_model,
            eps,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            BLOCK_Q=_block_q(n_queries),
            FROM_TABLE=True,
            STORE_LOGITS=store_logits,
            num_warps=num_warps(block_rows * _block_q(n_queries), block_d),
        )
        ctx.save_for_backward(queries, key_norm_weights, folded, h1, lse1, *sources)
        ctx.table, ctx.eps, ctx.block_rows = table, eps, block_rows
        ctx.mark_non_differentiable(logits)
        return h1, lse1, logits

    @staticmethod
    def backward(
        ctx: Any, grad_h1: torch.Tensor | None, grad_lse1: torch.Tensor | None, _grad_logits: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        queries, key_norm_weights, folded, h1, lse1, *sources = ctx.saved_tensors
        n_queries, n_tokens, d_model = h1.shape
        grad_h1 = torch.zeros_like(h1) if grad_h1 is None else grad_h1.contiguous()
        grad_lse1 = torch.zeros_like(lse1) if grad_lse1 is None else grad_lse1.float().contiguous()
        block_rows, block_d = ctx.block_rows, triton.next_power_of_2(d_model)
        n_tiles = triton.cdiv(n_tokens, block_rows)
        n_programs = min(n_tiles, max_programs(h1.device))
        grad_sources = new_output((len(sources), n_tokens, d_model), sources[0].dtype, h1.device)
        grad_folded_partial = new_output((n_programs, n_queries, d_model), torch.float32, h1.device)
        _phase1_bwd_kernel[(n_programs,)](
            sources[0],
            ctx.table,
            0,
            grad_sources,
            grad_sources.stride(0),
            folded,
            h1,
            grad_h1,
            lse1,
            grad_lse1,
            grad_folded_partial,
            n_tokens,
            len(sources),
            n_queries,
            d_model,
            ctx.eps,
            n_tiles,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            BLOCK_Q=_block_q(n_queries),
            FROM_TABLE=True,
            num_warps=num_warps(block_rows * _block_q(n_queries), block_d),
        )
        grad_queries, grad_gains = _query_grads(grad_folded_partial.sum(dim=0), queries, key_norm_weights)
        return grad_queries, grad_gains, None, None, None, *grad_sources.unbind(0)


class TritonMergeFunction(torch.autograd.Function):
    """``(h [N, D], partial logit [N] or empty)``: phase 2 for one sublayer."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key_norm_weight: torch.Tensor,
        eps: float,
        store_logits: bool,
        block_rows: int,
        h1: torch.Tensor,
        lse1: torch.Tensor,
        partial: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_tokens, d_model = partial.shape
        folded = (query.float() * key_norm_weight.float()).contiguous()
        h = new_output((n_tokens, d_model), partial.dtype, partial.device)
        lse = new_output((n_tokens,), torch.float32, partial.device)
        partial_logit = new_output((n_tokens,) if store_logits else (0,), torch.float32, partial.device)
        block_d = triton.next_power_of_2(d_model)
        _merge_fwd_kernel[(triton.cdiv(n_tokens, block_rows),)](
            h1,
            lse1,
            partial,
            folded,
            h,
            lse,
            partial_logit,
            n_tokens,
            d_model,
            eps,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            STORE_LOGITS=store_logits,
            num_warps=num_warps(block_rows, block_d),
        )
        ctx.save_for_backward(query, key_norm_weight, folded, h1, lse1, partial, lse)
        ctx.eps, ctx.block_rows = eps, block_rows
        ctx.mark_non_differentiable(partial_logit)
        return h, partial_logit

    @staticmethod
    def backward(
        ctx: Any, grad_h: torch.Tensor, _grad_partial_logit: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        query, key_norm_weight, folded, h1, lse1, partial, lse = ctx.saved_tensors
        n_tokens, d_model = partial.shape
        block_rows, block_d = ctx.block_rows, triton.next_power_of_2(d_model)
        n_tiles = triton.cdiv(n_tokens, block_rows)
        n_programs = min(n_tiles, max_programs(partial.device))
        grad_h1 = new_output(h1.shape, h1.dtype, h1.device)
        grad_lse1 = new_output(lse1.shape, torch.float32, h1.device)
        grad_partial = new_output(partial.shape, partial.dtype, partial.device)
        grad_folded_partial = new_output((n_programs, d_model), torch.float32, partial.device)
        _merge_bwd_kernel[(n_programs,)](
            h1,
            lse1,
            partial,
            folded,
            lse,
            grad_h.contiguous(),
            grad_h1,
            grad_lse1,
            grad_partial,
            grad_folded_partial,
            n_tokens,
            d_model,
            ctx.eps,
            n_tiles,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            num_warps=num_warps(block_rows, block_d),
        )
        grad_query, grad_gain = _query_grads(grad_folded_partial.sum(dim=0), query, key_norm_weight)
        return grad_query, grad_gain, None, None, None, grad_h1, grad_lse1, grad_partial


def phase1_triton(
    sources: list[torch.Tensor],
    queries: torch.Tensor,
    key_norm_weights: torch.Tensor,
    eps: float,
    store_logits: bool,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(h1 [n_q, ..., D], lse1 [n_q, ...], logits [n_q, ..., S] or None)`` for sources ``[..., D]``."""
    check_device(sources[0])
    shape = sources[0].shape
    d_model, n_queries = shape[-1], queries.shape[0]
    block_rows = block_rows or _phase1_block_rows(n_queries, d_model)
    flat = tuple(source.reshape(-1, d_model).contiguous() for source in sources)
    h1, lse1, logits = TritonPhase1Function.apply(queries, key_norm_weights, eps, store_logits, block_rows, *flat)
    lead = (n_queries, *shape[:-1])
    if store_logits:
        logits = logits.movedim(1, -1).reshape(*lead, len(sources))
    return h1.view(*lead, d_model), lse1.view(lead), logits if store_logits else None


def merge_triton(
    h1: torch.Tensor,
    lse1: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    store_logits: bool,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h [..., D], partial logit [...] or None)`` for one sublayer's phase-1 part and partial sum."""
    check_device(partial)
    shape = partial.shape
    d_model = shape[-1]
    block_rows = block_rows or default_block_rows(d_model)
    h, partial_logit = TritonMergeFunction.apply(
        query,
        key_norm_weight,
        eps,
        store_logits,
        block_rows,
        h1.reshape(-1, d_model).contiguous(),
        lse1.reshape(-1).contiguous(),
        partial.reshape(-1, d_model).contiguous(),
    )
    return h.view(shape), partial_logit.view(shape[:-1]) if store_logits else None
