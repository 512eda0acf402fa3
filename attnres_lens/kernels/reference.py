"""Readable ground truth for depth attention (SPEC §3.2). Plain PyTorch; exact in float64."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnres_lens.kernels._common import compute_dtype


def depth_attention_reference(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(h, weights, logits)``; weights and logits are ``[..., n_sources]`` in the compute dtype.

    ``k_s = v_s * rsqrt(mean(v_s^2) + eps) * g``, ``logit_s = w . k_s`` (no 1/sqrt(d), no temperature),
    ``alpha = softmax_s(logit)``, ``h = sum_s alpha_s v_s`` with the values left un-normalised.
    """
    dtype = compute_dtype(sources[0].dtype)
    values = [source.to(dtype) for source in sources]
    query = query.to(dtype)
    gain = key_norm_weight.to(dtype)
    keys = [v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps) * gain for v in values]
    logits = torch.stack([key @ query for key in keys], dim=-1)
    weights = torch.softmax(logits, dim=-1)
    h = sum(weights[..., s, None] * v for s, v in enumerate(values))
    return h.to(sources[0].dtype), weights, logits
