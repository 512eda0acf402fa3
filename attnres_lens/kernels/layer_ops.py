"""A layer's token ops behind one boundary: RMSNorm, the rotary embedding, the KV shift and the causal attention.

Each op asks `backends.py` whether its C kernel runs on these tensors (docs/kernels.md §2) and calls it, or else
its PyTorch version, kept here beside it: the model calls the op and never branches on a backend itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from attnres_lens.kernels.backends import attention_runs_cpu_kernel, elementwise_runs_cpu_kernel
from attnres_lens.kernels.cpu_attention import causal_attention_cpu
from attnres_lens.kernels.cpu_elementwise import kv_shift_cpu, rms_norm_cpu, rotary_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    """`x / rms(x) * weight` over the last dim: one C pass each way where the model's `backend` runs the C kernels
    and the gain has x's dtype, else PyTorch's fused norm (one pass instead of several on CUDA)."""
    if elementwise_runs_cpu_kernel(backend, x) and weight.dtype == x.dtype:
        return rms_norm_cpu(x, weight, eps)
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str) -> torch.Tensor:
    """RoPE of q or k [batch, pos, heads, d_head] with `rotary_tables`' [n_ctx, d_head] cos and sin: one C pass
    where `backend` runs the C kernels, else `apply_rotary`."""
    if elementwise_runs_cpu_kernel(backend, x):
        return rotary_cpu(x, cos, sin)
    n_pos = x.shape[1]
    return apply_rotary(x, cos[:n_pos, None, :], sin[:n_pos, None, :])


def kv_shift(
    k: torch.Tensor,
    v: torch.Tensor,
    coefficients: torch.Tensor,
    backend: str,
    rotary_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The KV shift (docs/model.md §5) of K and V [batch, pos, heads, d_head] with `coefficients` [heads, 4]
    `(α1, α2, β1, β2)`, and whether K came back rotated: with `rotary_tables` (cos, sin) the C kernel rotates the
    shifted K in the same pass; `TokenShiftMix` (where the C kernel does not run) never does."""
    if elementwise_runs_cpu_kernel(backend, k, v):  # both in one fused op
        k, v = kv_shift_cpu(k, v, coefficients, rotary_tables)
        return k, v, rotary_tables is not None
    return TokenShiftMix.apply(k, coefficients[:, :2]), TokenShiftMix.apply(v, coefficients[:, 2:]), False


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    """Causal softmax attention z [batch, pos, heads, d_head] of q, k, v in that layout (as many K/V heads as
    query heads): the C kernel where `attention_runs_cpu_kernel` allows it (no gradient), else PyTorch's fused
    scaled-dot-product attention, which computes the same softmax without materialising it."""
    if attention_runs_cpu_kernel(backend, q, k, v):
        return causal_attention_cpu(q, k, v, scale)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    ).transpose(1, 2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` with rotate_half(x) = [−x₂, x₁] for the halves x₁, x₂ of the last dim,
    written as `roll(x) * [−sin₁, sin₂]`: one copy of x instead of a negation and a concatenation."""
    half = x.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # [pos, 1, d_head]: small
    return torch.addcmul(x * cos, x.roll(half, dims=-1), signed_sin)


class TokenShiftMix(torch.autograd.Function):
    """`c1 ⊙ x_t + c2 ⊙ x_{t−1}` per head (x_{−1} = 0), x [batch, pos, heads, d_head], coefficients [heads, 2]:
    the KV shift (docs/model.md §5) in two ops each way, where autograd's graph of mul, pad and add takes about ten
    memory-bound passes per tensor.

    Backward (dy the output gradient, sums over batch, position and d_head):
        dx_t = c1 dy_t + c2 dy_{t+1} (dy_P = 0),   dc1 = Σ dy_t · x_t,   dc2 = Σ dy_t · x_{t−1}
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        current, previous = coefficients.to(x.dtype).unbind(-1)
        y = x * current[:, None]
        y[:, 1:].addcmul_(x[:, :-1], previous[:, None])
        ctx.save_for_backward(x, coefficients)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, coefficients = ctx.saved_tensors
        current, previous = coefficients.to(x.dtype).unbind(-1)
        dx = dy * current[:, None]
        dx[:, :-1].addcmul_(dy[:, 1:], previous[:, None])
        d_current = (dy * x).sum(dim=(0, 1, 3))
        d_previous = (dy[:, 1:] * x[:, :-1]).sum(dim=(0, 1, 3))
        return dx, torch.stack([d_current, d_previous], dim=-1).to(coefficients.dtype)
