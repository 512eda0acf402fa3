"""Fused Triton forward and backward for depth attention (docs/kernels.md §4-§5). Reference: ``reference.py``.

Sources arrive either as a list of same-shape tensors, addressed through a small device table of their base
pointers (no copy), or as one contiguous depth buffer ``[S, N, D]`` addressed by stride. One program owns
``BLOCK_ROWS`` tokens and the whole model dimension (``BLOCK_D >= D``), so the per-token reductions (rstd, logit,
dh . v) never leave registers.

Forward: each source tile is read once; an online softmax in fp32 keeps a running max ``m``, sum ``l`` and
un-normalised output; only ``lse = m + log l`` (4 bytes per token) is saved. Backward recomputes rstd and logits
from the source tile it has to read anyway, so it reads each source, ``dh`` and the saved ``h`` once and writes each
source's gradient once. The gain-folded query gradient is summed per program into a ``[programs, D]`` buffer and
reduced on the host in a fixed order: deterministic, no atomics.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from attnres_lens.kernels._common import new_output


@triton.jit
def load_source(src_table, s, buffer_source, offsets, tile_mask, d_model, eps, FROM_TABLE: tl.constexpr):
    """Source s's tile in fp32 and its per-token rstd.

    The source's address comes from the pointer table, or is ``buffer_source`` in a depth buffer.
    """
    if FROM_TABLE:
        source = tl.load(src_table + s).to(buffer_source.dtype)
    else:
        source = buffer_source
    # upcast straight after the load: bf16/fp16 arithmetic is neither accurate nor supported by the interpreter
    v = tl.load(source + offsets, mask=tile_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) / d_model + eps)
    return v, rstd


@triton.jit
def row_tile(tile, n_tokens, cols, col_mask, d_model, BLOCK_ROWS: tl.constexpr):
    """Token rows of tile ``tile`` (int64, so offsets past 2^31 elements stay exact), their masks and offsets."""
    rows = (tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_mask = rows < n_tokens
    tile_mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * d_model + cols[None, :]
    return rows, row_mask, tile_mask, offsets


@triton.jit
def _source_tile(src_table, s, buffer_source, offsets, tile_mask, u, d_model, eps, FROM_TABLE: tl.constexpr):
    """Source s's tile in fp32 with its per-token rstd and logit ``u . (rstd * v)``, ``u = w * g``."""
    v, rstd = load_source(src_table, s, buffer_source, offsets, tile_mask, d_model, eps, FROM_TABLE)
    logit = tl.sum(v * u[None, :], axis=1) * rstd
    return v, rstd, logit


@triton.jit
def _depth_attention_fwd_kernel(
    src_base,  # a source tensor (table mode) or the depth buffer: its element type is the sources' dtype
    src_table,  # int64 [S] base addresses, read only when FROM_TABLE
    source_stride,  # elements between sources in a depth buffer
    folded_query,  # fp32 [D], w * g
    h_out,  # [N, D], sources' dtype
    lse_out,  # fp32 [N]
    logits_out,  # fp32 [S, N], written only when STORE_LOGITS
    n_tokens,
    n_sources,
    d_model,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_tokens
    tile_mask = row_mask[:, None] & (cols[None, :] < d_model)
    offsets = rows[:, None] * d_model + cols[None, :]
    u = tl.load(folded_query + cols, mask=cols < d_model, other=0.0)

    running_max = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    # advancing a pointer (64-bit) rather than computing s * stride keeps S*N*D > 2^31 from overflowing int32
    buffer_source = src_base
    for s in range(n_sources):
        v, rstd, logit = _source_tile(src_table, s, buffer_source, offsets, tile_mask, u, d_model, eps, FROM_TABLE)
        buffer_source += source_stride
        if STORE_LOGITS:
            tl.store(logits_out + s * n_tokens + rows, logit, mask=row_mask)
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(logit - new_max)
        running_sum = running_sum * rescale + p
        acc = acc * rescale[:, None] + p[:, None] * v
        running_max = new_max

    h = acc / running_sum[:, None]
    tl.store(h_out + offsets, h.to(h_out.dtype.element_ty), mask=tile_mask)
    tl.store(lse_out + rows, running_max + tl.log(running_sum), mask=row_mask)


@triton.jit
def _depth_attention_bwd_kernel(
    src_base,
    src_table,
    source_stride,
    grad_sources,  # [S, N, D], sources' dtype
    grad_stride,  # elements between sources' gradients (N * D)
    folded_query,  # fp32 [D]
    h_saved,  # [N, D] forward output
    grad_h,  # [N, D]
    lse_saved,  # fp32 [N]
    grad_folded_partial,  # fp32 [programs, D], one row per program
    n_tokens,
    n_sources,
    d_model,
    eps,
    n_tiles,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FROM_TABLE: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d_model
    u = tl.load(folded_query + cols, mask=col_mask, other=0.0)
    grad_folded = tl.zeros([BLOCK_D], dtype=tl.float32)
    # persistent loop over tiles: the partial-sum buffer stays [programs, D] however many tokens there are
    for tile in range(program, n_tiles, tl.num_programs(0)):
        rows, row_mask, tile_mask, offsets = row_tile(tile, n_tokens, cols, col_mask, d_model, BLOCK_ROWS)
        dh = tl.load(grad_h + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        h = tl.load(h_saved + offsets, mask=tile_mask, other=0.0).to(tl.float32)
        delta = tl.sum(dh * h, axis=1)
        lse = tl.load(lse_saved + rows, mask=row_mask, other=0.0)
        buffer_source = src_base
        grad_source = grad_sources
        for s in range(n_sources):
            v, rstd, logit = _source_tile(src_table, s, buffer_source, offsets, tile_mask, u, d_model, eps, FROM_TABLE)
            buffer_source += source_stride
            weight = tl.exp(logit - lse)
            grad_logit = weight * (tl.sum(v * dh, axis=1) - delta)
            key_coef = grad_logit * rstd
            value_coef = key_coef * logit * rstd / d_model
            grad_v = weight[:, None] * dh + key_coef[:, None] * u[None, :] - value_coef[:, None] * v
            tl.store(grad_source + offsets, grad_v.to(grad_sources.dtype.element_ty), mask=tile_mask)
            grad_source += grad_stride
            grad_folded += tl.sum(key_coef[:, None] * v, axis=0)
    tl.store(grad_folded_partial + program * d_model + cols, grad_folded, mask=col_mask)


@triton.jit
def _routed_fwd_kernel(
    src_base,
    src_table,
    source_stride,
    folded_queries,  # fp32 [R, D], u_r = c * w_r * g
    h_out,  # [N, R, D], sources' dtype
    lse_out,  # fp32 [R, N]
    logits_out,  # fp32 [S, N, R], written only when STORE_LOGITS
    n_tokens,
    n_sources,
    n_routes,
    d_model,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    NORMALIZE_VALUES: tl.constexpr,
):
    """The forward with the op's knobs (docs/kernels.md §1): program (tile, r) mixes route r of one tile, the online
    softmax of `_depth_attention_fwd_kernel`; with NORMALIZE_VALUES it mixes ``rstd * v``."""
    route = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d_model
    rows, row_mask, tile_mask, offsets = row_tile(tl.program_id(0), n_tokens, cols, col_mask, d_model, BLOCK_ROWS)
    u = tl.load(folded_queries + route * d_model + cols, mask=col_mask, other=0.0)
    running_max = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
    buffer_source = src_base
    for s in range(n_sources):
        v, rstd, logit = _source_tile(src_table, s, buffer_source, offsets, tile_mask, u, d_model, eps, FROM_TABLE)
        buffer_source += source_stride
        if STORE_LOGITS:
            tl.store(logits_out + (s * n_tokens + rows) * n_routes + route, logit, mask=row_mask)
        if NORMALIZE_VALUES:
            v = v * rstd[:, None]
        new_max = tl.maximum(running_max, logit)
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(logit - new_max)
        running_sum = running_sum * rescale + p
        acc = acc * rescale[:, None] + p[:, None] * v
        running_max = new_max
    out_offsets = (rows[:, None] * n_routes + route) * d_model + cols[None, :]
    tl.store(h_out + out_offsets, (acc / running_sum[:, None]).to(h_out.dtype.element_ty), mask=tile_mask)
    tl.store(lse_out + route * n_tokens + rows, running_max + tl.log(running_sum), mask=row_mask)


@triton.jit
def _routed_bwd_kernel(
    src_base,
    src_table,
    source_stride,
    grad_sources,  # [S, N, D], sources' dtype
    grad_stride,
    folded_queries,  # fp32 [R, D]
    grad_h,  # [N, R, D]
    lse_saved,  # fp32 [R, N]
    delta_saved,  # fp32 [N, R], dh_r . h_r
    grad_folded_partial,  # fp32 [programs, R, D], one block per program
    n_tokens,
    n_sources,
    n_routes,
    d_model,
    eps,
    n_tiles,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    NORMALIZE_VALUES: tl.constexpr,
):
    """The backward of `_routed_fwd_kernel` (the equations of `torch_fast.RoutedDepthAttentionFunction`): each
    source tile is read once and its gradient summed over the routes in registers before one store; the routes'
    query gradients stay in a ``[BLOCK_R, D]`` register block per program (no atomics)."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d_model
    route_ids = tl.arange(0, BLOCK_R)
    query_mask = (route_ids[:, None] < n_routes) & col_mask[None, :]
    queries = tl.load(folded_queries + route_ids[:, None] * d_model + cols[None, :], mask=query_mask, other=0.0)
    grad_folded = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for tile in range(program, n_tiles, tl.num_programs(0)):
        rows, row_mask, tile_mask, offsets = row_tile(tile, n_tokens, cols, col_mask, d_model, BLOCK_ROWS)
        buffer_source = src_base
        grad_source = grad_sources
        for s in range(n_sources):
            v, rstd = load_source(src_table, s, buffer_source, offsets, tile_mask, d_model, eps, FROM_TABLE)
            buffer_source += source_stride
            value = v
            if NORMALIZE_VALUES:
                value = v * rstd[:, None]
            grad_v = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
            value_coef = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for route in range(n_routes):
                selected = route_ids[:, None] == route
                u = tl.sum(tl.where(selected, queries, 0.0), axis=0)
                logit = tl.sum(v * u[None, :], axis=1) * rstd
                lse = tl.load(lse_saved + route * n_tokens + rows, mask=row_mask, other=0.0)
                delta = tl.load(delta_saved + rows * n_routes + route, mask=row_mask, other=0.0)
                dh_offsets = (rows[:, None] * n_routes + route) * d_model + cols[None, :]
                dh = tl.load(grad_h + dh_offsets, mask=tile_mask, other=0.0).to(tl.float32)
                weight = tl.exp(logit - lse)
                dot = tl.sum(value * dh, axis=1)
                grad_logit = weight * (dot - delta)
                key_coef = grad_logit * rstd
                mix_weight = weight
                value_coef += grad_logit * logit
                if NORMALIZE_VALUES:
                    value_coef += weight * dot
                    mix_weight = weight * rstd
                grad_v += mix_weight[:, None] * dh + key_coef[:, None] * u[None, :]
                grad_folded += tl.where(selected, tl.sum(key_coef[:, None] * v, axis=0)[None, :], 0.0)
            grad_v -= (value_coef * rstd * rstd / d_model)[:, None] * v
            tl.store(grad_source + offsets, grad_v.to(grad_sources.dtype.element_ty), mask=tile_mask)
            grad_source += grad_stride
    partial = grad_folded_partial + program * n_routes * d_model
    tl.store(partial + route_ids[:, None] * d_model + cols[None, :], grad_folded, mask=query_mask)


def interpreting() -> bool:
    """Whether Triton runs on its CPU interpreter (TRITON_INTERPRET=1, the tests' mode), where tiles are numpy ops."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_block_rows(d_model: int) -> int:
    """Rows per program. The interpreter runs a tile as one vectorised numpy op, so big tiles make tests fast;
    on a GPU ~4k elements per tile keeps registers in check while giving each program enough bytes in flight."""
    if interpreting():
        return 64
    return max(1, min(16, 4096 // triton.next_power_of_2(d_model)))


def num_warps(block_rows: int, block_d: int) -> int:
    """Warps per program: more for larger tiles, so each thread keeps a few elements in registers."""
    return 4 if block_rows * block_d <= 2048 else 8


def max_programs(device: torch.device) -> int:
    """Programs of a backward launch: a few per multiprocessor, each looping over tiles and summing its own
    query-gradient row, so the host reduction stays small (a handful on the interpreter)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


_POINTER_TABLES: dict[tuple, torch.Tensor] = {}


def pointer_table(sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Device-resident int64 table of the sources' addresses, cached by address tuple.

    The caching allocator hands the same addresses back step after step, so the host-to-device copy is usually
    skipped; a stale entry is harmless because the table holds nothing but the addresses that key it.
    """
    device = sources[0].device
    key = (device, tuple(source.data_ptr() for source in sources))
    table = _POINTER_TABLES.get(key)
    if table is None:
        if len(_POINTER_TABLES) >= 1024:
            _POINTER_TABLES.clear()
        table = torch.tensor(key[1], dtype=torch.int64, device=device)
        _POINTER_TABLES[key] = table
    return table


def check_device(tensor: torch.Tensor) -> None:
    """Refuse tensors the kernels cannot reach: off CUDA, unless Triton interprets on the CPU."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(
            "the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first imported "
            f"(got tensors on {tensor.device})"
        )


class TritonDepthAttentionFunction(torch.autograd.Function):
    """Fused depth attention. Sources: ``S`` tensors ``[N, D]``, or one depth buffer ``[S, N, D]`` when ``stacked``.

    Returns ``(h [N, D], lse [N], logits [S, N] or empty)``; lse and logits are not differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key_norm_weight: torch.Tensor,
        eps: float,
        store_logits: bool,
        block_rows: int,
        stacked: bool,
        *sources: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first = sources[0][0] if stacked else sources[0]
        n_sources = sources[0].shape[0] if stacked else len(sources)
        n_tokens, d_model = first.shape
        device = first.device
        folded_query = (query.float() * key_norm_weight.float()).contiguous()
        if stacked:
            src_base, src_table, source_stride = sources[0], sources[0], sources[0].stride(0)
        else:
            src_base, src_table, source_stride = sources[0], pointer_table(sources), 0

        h = new_output((n_tokens, d_model), first.dtype, device)
        lse = new_output((n_tokens,), torch.float32, device)
        logits = new_output((n_sources, n_tokens) if store_logits else (0,), torch.float32, device)
        block_d = triton.next_power_of_2(d_model)
        _depth_attention_fwd_kernel[(triton.cdiv(n_tokens, block_rows),)](
            src_base,
            src_table,
            source_stride,
            folded_query,
            h,
            lse,
            logits,
            n_tokens,
            n_sources,
            d_model,
            eps,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            FROM_TABLE=not stacked,
            STORE_LOGITS=store_logits,
            num_warps=num_warps(block_rows, block_d),
        )
        ctx.save_for_backward(query, key_norm_weight, folded_query, h, lse, *sources)
        ctx.src_table = src_table
        ctx.eps, ctx.block_rows, ctx.stacked, ctx.n_sources = eps, block_rows, stacked, n_sources
        ctx.mark_non_differentiable(lse, logits)
        return h, lse, logits

    @staticmethod
    def backward(
        ctx: Any, grad_h: torch.Tensor, _grad_lse: torch.Tensor, _grad_logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        query, key_norm_weight, folded_query, h, lse, *sources = ctx.saved_tensors
        n_tokens, d_model = h.shape
        block_rows = ctx.block_rows
        block_d = triton.next_power_of_2(d_model)
        n_tiles = triton.cdiv(n_tokens, block_rows)
        n_programs = min(n_tiles, max_programs(h.device))
        grad_sources = new_output((ctx.n_sources, n_tokens, d_model), h.dtype, h.device)
        grad_folded_partial = new_output((n_programs, d_model), torch.float32, h.device)
        _depth_attention_bwd_kernel[(n_programs,)](
            sources[0],
            ctx.src_table,
            sources[0].stride(0) if ctx.stacked else 0,
            grad_sources,
            grad_sources.stride(0),
            folded_query,
            h,
            grad_h.contiguous(),
            lse,
            grad_folded_partial,
            n_tokens,
            ctx.n_sources,
            d_model,
            ctx.eps,
            n_tiles,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            FROM_TABLE=not ctx.stacked,
            num_warps=num_warps(block_rows, block_d),
        )
        grad_folded = grad_folded_partial.sum(dim=0)
        grad_query = (grad_folded * key_norm_weight.float()).to(query.dtype)
        grad_gain = (grad_folded * query.float()).to(key_norm_weight.dtype)
        grad_inputs = (grad_sources,) if ctx.stacked else tuple(grad_sources.unbind(0))
        return grad_query, grad_gain, None, None, None, None, *grad_inputs


def depth_attention_triton(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    want_stats: bool,
    depth_buffer: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Return ``(h, weights, logits)``; weights/logits are source-major ``[S, N]`` when ``want_stats``, else None.

    ``depth_buffer`` (``[S, ..., D]``), when given, is read in place instead of building a pointer table.
    """
    check_device(sources[0])
    shape = sources[0].shape
    d_model = shape[-1]
    block_rows = block_rows or default_block_rows(d_model)
    if depth_buffer is not None:
        flat = (depth_buffer.reshape(len(sources), -1, d_model).contiguous(),)
    else:
        flat = tuple(source.reshape(-1, d_model).contiguous() for source in sources)
    h, lse, logits = TritonDepthAttentionFunction.apply(
        query, key_norm_weight, eps, want_stats, block_rows, depth_buffer is not None, *flat
    )
    if not want_stats:
        return h.view(shape), None, None
    return h.view(shape), torch.exp(logits - lse), logits


class TritonRoutedDepthAttentionFunction(torch.autograd.Function):
    """Fused depth attention with the op's knobs (docs/kernels.md §1): queries ``[R, D]``, a logit scale, a gain
    or none, raw or normalised values. Sources as for `TritonDepthAttentionFunction`. Returns ``(h [N, R, D],
    lse [R, N], logits [S, N, R] or empty)``; lse and logits are not differentiable. The forward reads the
    sources once per route (one program per tile and route), the backward once."""

    @staticmethod
    def forward(
        ctx: Any,
        queries: torch.Tensor,
        key_norm_weight: torch.Tensor | None,
        logit_scale: float,
        normalize_values: bool,
        eps: float,
        store_logits: bool,
        block_rows: int,
        stacked: bool,
        *sources: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first = sources[0][0] if stacked else sources[0]
        n_sources = sources[0].shape[0] if stacked else len(sources)
        n_tokens, d_model = first.shape
        n_routes = queries.shape[0]
        device = first.device
        folded = queries.float() * logit_scale
        if key_norm_weight is not None:
            folded = folded * key_norm_weight.float()
        folded = folded.contiguous()
        if stacked:
            src_base, src_table, source_stride = sources[0], sources[0], sources[0].stride(0)
        else:
            src_base, src_table, source_stride = sources[0], pointer_table(sources), 0
        h = new_output((n_tokens, n_routes, d_model), first.dtype, device)
        lse = new_output((n_routes, n_tokens), torch.float32, device)
        logits = new_output((n_sources, n_tokens, n_routes) if store_logits else (0,), torch.float32, device)
        block_d = triton.next_power_of_2(d_model)
        _routed_fwd_kernel[(triton.cdiv(n_tokens, block_rows), n_routes)](
            src_base,
            src_table,
            source_stride,
            folded,
            h,
            lse,
            logits,
            n_tokens,
            n_sources,
            n_routes,
            d_model,
            eps,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            FROM_TABLE=not stacked,
            STORE_LOGITS=store_logits,
            NORMALIZE_VALUES=normalize_values,
            num_warps=num_warps(block_rows, block_d),
        )
        gain = key_norm_weight if key_norm_weight is not None else queries.new_empty(0)
        ctx.save_for_backward(queries, gain, folded, h, lse, *sources)
        ctx.src_table = src_table
        ctx.has_gain, ctx.logit_scale, ctx.normalize_values = key_norm_weight is not None, logit_scale, normalize_values
        ctx.eps, ctx.block_rows, ctx.stacked, ctx.n_sources = eps, block_rows, stacked, n_sources
        ctx.mark_non_differentiable(lse, logits)
        return h, lse, logits

    @staticmethod
    def backward(
        ctx: Any, grad_h: torch.Tensor, _grad_lse: torch.Tensor, _grad_logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        queries, gain, folded, h, lse, *sources = ctx.saved_tensors
        n_tokens, n_routes, d_model = h.shape
        block_rows = ctx.block_rows
        block_d = triton.next_power_of_2(d_model)
        n_tiles = triton.cdiv(n_tokens, block_rows)
        n_programs = max(1, min(n_tiles, max_programs(h.device)))
        grad_h = grad_h.contiguous()
        delta = torch.linalg.vecdot(grad_h.float(), h.float()).contiguous()  # [N, R]: dh_r . h_r
        grad_sources = new_output((ctx.n_sources, n_tokens, d_model), h.dtype, h.device)
        grad_folded_partial = torch.zeros((n_programs, n_routes, d_model), dtype=torch.float32, device=h.device)
        _routed_bwd_kernel[(n_programs,)](
            sources[0],
            ctx.src_table,
            sources[0].stride(0) if ctx.stacked else 0,
            grad_sources,
            grad_sources.stride(0),
            folded,
            grad_h,
            lse,
            delta,
            grad_folded_partial,
            n_tokens,
            ctx.n_sources,
            n_routes,
            d_model,
            ctx.eps,
            n_tiles,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            BLOCK_R=triton.next_power_of_2(n_routes),
            FROM_TABLE=not ctx.stacked,
            NORMALIZE_VALUES=ctx.normalize_values,
            num_warps=num_warps(block_rows, block_d),
        )
        grad_folded = grad_folded_partial.sum(dim=0) * ctx.logit_scale
        if ctx.has_gain:
            grad_query = (grad_folded * gain.float()).to(queries.dtype)
            grad_gain = (grad_folded * queries.float()).sum(dim=0).to(gain.dtype)
        else:
            grad_query, grad_gain = grad_folded.to(queries.dtype), None
        grad_inputs = (grad_sources,) if ctx.stacked else tuple(grad_sources.unbind(0))
        return grad_query, grad_gain, None, None, None, None, None, None, *grad_inputs


def routed_depth_attention_triton(
    sources: list[torch.Tensor],
    queries: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    want_stats: bool,
    logit_scale: float = 1.0,
    normalize_values: bool = False,
    depth_buffer: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Return ``(h [..., R, D], weights, logits)`` for ``queries`` ``[R, D]``; weights/logits source-major ``[S, N,
    R]`` (fp32) when ``want_stats``, else None. ``depth_buffer`` as for `depth_attention_triton`."""
    check_device(sources[0])
    shape = sources[0].shape
    d_model = shape[-1]
    block_rows = block_rows or default_block_rows(d_model)
    if depth_buffer is not None:
        flat = (depth_buffer.reshape(len(sources), -1, d_model).contiguous(),)
    else:
        flat = tuple(source.reshape(-1, d_model).contiguous() for source in sources)
    h, lse, logits = TritonRoutedDepthAttentionFunction.apply(
        queries,
        key_norm_weight,
        logit_scale,
        normalize_values,
        eps,
        want_stats,
        block_rows,
        depth_buffer is not None,
        *flat,
    )
    h = h.view(*shape[:-1], *h.shape[-2:])
    if not want_stats:
        return h, None, None
    return h, torch.exp(logits - lse.t()), logits
