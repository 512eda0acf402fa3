"""Causal token attention on the C kernel (``cpu_attention.c``), without a gradient: inference and exact
interventions, where it replaces PyTorch's scaled-dot-product attention on the model's own [batch, pos, heads,
d_head] layout, without transposes (docs/kernels.md §2).
"""

from __future__ import annotations

import torch

from attnres_lens.kernels import cpu_build
from attnres_lens.kernels._common import needs_autograd, new_output
from attnres_lens.kernels.cpu_build import REAL_TYPES, kernel_threads


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention without a gradient: `softmax(q kᵀ · scale, causal) v` per batch row and head, for
    fp32/fp64 CPU tensors [batch, pos, heads, d_head] (the model's layout), output in the same layout; equals
    `F.scaled_dot_product_attention(..., is_causal=True)` on the transposed tensors (docs/kernels.md §2). For
    inference and exact interventions: it refuses tensors that require a gradient or carry a tangent."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cpu" or x.dtype not in REAL_TYPES or x.dim() != 4:
            raise ValueError(
                f"causal_attention_cpu needs 4-D fp32/fp64 CPU tensors, got {name} {x.dim()}-D {x.dtype} on {x.device}"
            )
        if x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(
                f"q, k and v must agree in shape and dtype, got {list(q.shape)} {q.dtype} and {name} "
                f"{list(x.shape)} {x.dtype}"
            )
        if needs_autograd(x):
            raise ValueError(
                f"causal_attention_cpu has no derivative, but {name} requires a gradient or carries a "
                "forward-mode tangent; use F.scaled_dot_product_attention, or run under "
                "torch.no_grad() without tangents"
            )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, pos, heads, d_head = q.shape
    out = new_output(q.shape, q.dtype, q.device)
    if out.numel() == 0:
        return out
    library = cpu_build.cpu_library(q.dtype)
    status = library.causal_attention_forward(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        batch,
        pos,
        heads,
        d_head,
        float(scale),
        out.data_ptr(),
        kernel_threads(3 * q.numel(), library),
    )
    if status != 0:
        raise MemoryError(
            f"causal_attention_cpu could not allocate its key blocks ({d_head + 1} x {pos} values per thread)"
        )
    return out
