"""A layer's elementwise ops on the C kernels (``cpu_elementwise.c``): the KV shift (optionally with K's rotary
embedding in the same pass), the rotary embedding and RMSNorm, each one autograd node and one pass over its tensor
each way where PyTorch takes a pass per product and sum (docs/kernels.md §2). Readable twins, and the ops that
choose between them and these: `layer_ops`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from attnres_lens.kernels import cpu_autograd, cpu_build
from attnres_lens.kernels._common import new_output, new_output_like
from attnres_lens.kernels.cpu_autograd import once_differentiable
from attnres_lens.kernels.cpu_build import REAL_TYPES, kernel_threads


def _elementwise_threads(n_elements: int, library: ctypes.CDLL) -> int:
    """Threads for the KV shift, rotary and RMSNorm kernels: as the depth mix's in the OpenMP build; the pthread
    build runs them on the calling thread."""
    return kernel_threads(n_elements, library) if library.thread_pool else 1


class _EagerKVShift(torch.autograd.Function):
    """`layer_ops.TokenShiftMix` (the KV shift, its formulas there) of a layer's K and V in one autograd node,
    one C pass over each tensor each way; k, v [B, P, H, Dh], coefficients [H, 4] = (K's pair, V's pair). With
    rotary tables (cos, sin: x's dtype, contiguous; else None) the shifted K comes out rotated, in the same pass."""

    @staticmethod
    def forward(
        ctx: Any,
        k: torch.Tensor,
        v: torch.Tensor,
        coefficients: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = k.contiguous(), v.contiguous()
        pairs = coefficients.to(k.dtype).contiguous()
        library = cpu_build.cpu_library(k.dtype)
        threads = _elementwise_threads(k.numel(), library)
        shifted = []
        for x, column, tables in ((k, 0, _rotary_arguments(cos, sin)), (v, 2, _NO_ROTATION)):
            y = new_output_like(x)  # K's pair in columns 0-1, V's in 2-3: addressed, not sliced (a view per call
            library.token_shift_forward(  # costs more than a small layer's shift)
                x.data_ptr(),
                pairs.data_ptr() + column * pairs.element_size(),
                4,
                *x.shape,
                *tables,
                y.data_ptr(),
                threads,
            )
            shifted.append(y)
        ctx.save_for_backward(k, v, pairs, cos, sin)
        ctx.coefficient_dtype = coefficients.dtype
        return shifted[0], shifted[1]

    @staticmethod
    @once_differentiable  # the C backward builds no graph: a second derivative raises instead of coming out zero
    def backward(ctx: Any, grad_k: torch.Tensor, grad_v: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        k, v, pairs, cos, sin = ctx.saved_tensors
        library = cpu_build.cpu_library(k.dtype)
        threads = _elementwise_threads(k.numel(), library)
        grad_pairs = new_output(pairs.shape, pairs.dtype, pairs.device)
        grads = []
        for x, grad_y, column, tables in ((k, grad_k, 0, _rotary_arguments(cos, sin)), (v, grad_v, 2, _NO_ROTATION)):
            grad_y = grad_y.contiguous()
            grad_x = new_output_like(x)
            offset = column * pairs.element_size()
            library.token_shift_backward(
                x.data_ptr(),
                pairs.data_ptr() + offset,
                4,
                grad_y.data_ptr(),
                *x.shape,
                *tables,
                grad_x.data_ptr(),
                grad_pairs.data_ptr() + offset,
                threads,
            )
            grads.append(grad_x)
        return grads[0], grads[1], grad_pairs.to(ctx.coefficient_dtype), None, None


_NO_ROTATION = (None, None, 0)  # the C shift kernels' (cos_table, sin_table, table_stride) for no rotary


def _rotary_arguments(cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple:
    """The C kernels' (cos_table, sin_table, table_stride) for rotary tables, or no rotation for None."""
    return _NO_ROTATION if cos is None else (cos.data_ptr(), sin.data_ptr(), cos.stride(0))


def kv_shift_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    coefficients: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KV shift: `c1 ⊙ x_t + c2 ⊙ x_{t−1}` per head (x_{−1} = 0) for x = k with the pair
    `coefficients[:, :2]` and x = v with `coefficients[:, 2:]`; fp32/fp64 CPU tensors [batch, pos, heads, d_head],
    differentiable in all three. With ``rotary = (cos, sin)`` (`rotary_cpu`'s tables) the shifted K is returned
    rotated, `rotary_cpu(shifted_k, cos, sin)` in the same pass over K."""
    for name, x in (("k", k), ("v", v)):
        if x.device.type != "cpu" or x.dtype not in REAL_TYPES or x.dim() != 4:
            raise ValueError(
                f"kv_shift_cpu needs 4-D fp32/fp64 CPU tensors, got {name} {x.dim()}-D {x.dtype} on {x.device}"
            )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must match, got {list(k.shape)} {k.dtype} and {list(v.shape)} {v.dtype}")
    if coefficients.shape != (k.shape[2], 4) or coefficients.device.type != "cpu":
        raise ValueError(
            f"coefficients must be a CPU tensor [heads, 4] = [{k.shape[2]}, 4], got "
            f"{list(coefficients.shape)} on {coefficients.device}"
        )
    cos, sin = (None, None) if rotary is None else _rotary_tables_for(k, *rotary, caller="kv_shift_cpu")
    return cpu_autograd.apply_function(_EagerKVShift, k, v, coefficients, cos, sin)


class _EagerRotary(torch.autograd.Function):
    """`layer_ops.apply_rotary` in one C pass each way (the backward rotates the gradient back: the same kernel
    with the sine negated); x [B, P, H, Dh], cos and sin [≥ P, Dh] tables whose two halves are equal."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad.contiguous(), cos, sin, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    y = new_output_like(x)
    library = cpu_build.cpu_library(x.dtype)
    library.rotary_forward(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        *x.shape,
        sign,
        y.data_ptr(),
        _elementwise_threads(x.numel(), library),
    )
    return y


def _rotary_tables_for(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caller: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables`' cos and sin checked against x [B, P, H, Dh] (Dh even, at least P rows of Dh, no gradient)
    and cast to x's dtype, contiguous: the tables the C rotation reads."""
    if x.shape[-1] % 2:
        raise ValueError(f"{caller}'s rotary embedding needs an even last dim, got x of shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] < x.shape[1] or cos.shape[1] != x.shape[-1]:
        raise ValueError(
            f"cos and sin must be [n_ctx >= {x.shape[1]}, {x.shape[-1]}] tables, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{caller} differentiates x only; the cos/sin tables must not require grad")
    return tuple(table.to(x.dtype).contiguous() for table in (cos, sin))


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[B, P, H, Dh]`` (fp32/fp64, CPU) with ``rotary_tables``' ``cos`` and ``sin``
    (``[n_ctx, Dh]``, n_ctx >= P; cast to x's dtype), differentiable in ``x``; equals `layer_ops.apply_rotary`."""
    if x.dim() != 4 or x.device.type != "cpu" or x.dtype not in REAL_TYPES:
        raise ValueError(
            f"rotary_cpu needs a 4-D fp32/fp64 CPU tensor, got {x.dim()}-D {x.dtype} on {x.device} of "
            f"shape {tuple(x.shape)}"
        )
    cos, sin = _rotary_tables_for(x, cos, sin, caller="rotary_cpu")
    return cpu_autograd.apply_function(_EagerRotary, x, cos, sin)


class _EagerRMSNorm(torch.autograd.Function):
    """`components.RMSNorm` in one C pass each way (formulas in cpu_elementwise.c); x [..., D], w [D]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x, w = x.contiguous(), w.contiguous()
        rows = x.numel() // x.shape[-1]
        y = new_output_like(x)
        rstd = new_output((rows,), x.dtype, x.device)
        library = cpu_build.cpu_library(x.dtype)
        library.rms_norm_forward(
            x.data_ptr(),
            w.data_ptr(),
            rows,
            x.shape[-1],
            eps,
            y.data_ptr(),
            rstd.data_ptr(),
            _elementwise_threads(x.numel(), library),
        )
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, w, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = new_output_like(x)
        grad_w = new_output(w.shape, x.dtype, x.device)
        library = cpu_build.cpu_library(x.dtype)
        failed = library.rms_norm_backward(
            x.data_ptr(),
            w.data_ptr(),
            rstd.data_ptr(),
            grad.data_ptr(),
            rstd.numel(),
            x.shape[-1],
            grad_x.data_ptr(),
            grad_w.data_ptr(),
            _elementwise_threads(x.numel(), library),
        )
        if failed:
            raise MemoryError(f"the C RMSNorm backward could not allocate its per-thread sums of {x.shape[-1]} values")
        return grad_x, grad_w, None


def rms_norm_cpu(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x²) + eps) * w` over the last dim of an fp32/fp64 CPU tensor, differentiable in x and w;
    equals `F.rms_norm(x, x.shape[-1:], w, eps)`."""
    if x.device.type != "cpu" or x.dtype not in REAL_TYPES or x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(
            f"rms_norm_cpu needs an fp32/fp64 CPU tensor [..., D], got {x.dtype} on {x.device} of "
            f"shape {tuple(x.shape)}"
        )
    if w.shape != x.shape[-1:] or w.device != x.device or w.dtype != x.dtype:
        raise ValueError(
            f"the gain must be [{x.shape[-1]}] {x.dtype} on {x.device}, got {tuple(w.shape)} {w.dtype} on {w.device}"
        )
    return cpu_autograd.apply_function(_EagerRMSNorm, x, w, float(eps))
