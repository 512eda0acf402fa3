"""The readable depth mix (docs/model.md §2): plain PyTorch, exact in float64, the ground truth of every backend.

Its two steps are also what the model's hooked path and two-phase's PyTorch version are built from, so the mix is
written once: ``depth_logits`` (keys normalised, scored against the query) and ``mix_sources`` (the weighted sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnres_lens.kernels._common import compute_dtype


def rstd(values: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(v^2) + eps)`` over the last dim: the key RMSNorm's scale, ``[...]``."""
    return torch.rsqrt(values.pow(2).mean(dim=-1) + eps)


def depth_logits(
    sources: Sequence[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``logit_s = w . (g * v_s * rstd(v_s))`` as ``[..., n_sources]`` in the compute dtype.

    Keys are RMS-normalised with gain ``g``; there is no temperature and no 1/sqrt(d).
    """
    dtype = compute_dtype(sources[0].dtype)
    scored = query.to(dtype) * key_norm_weight.to(dtype)  # w . (g * k) = (w * g) . k
    return torch.stack([(v.to(dtype) @ scored) * rstd(v.to(dtype), eps) for v in sources], dim=-1)


def mix_sources(weights: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """``h = sum_s weights[..., s] * v_s`` (values un-normalised), accumulated in ``weights``' dtype and returned in
    the sources' dtype."""
    h = sum(weights[..., s, None] * v.to(weights.dtype) for s, v in enumerate(sources))
    return h.to(sources[0].dtype)


def depth_attention_reference(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float = 1e-6,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(h, weights, logits)``; weights and logits are ``[..., n_sources]`` in the compute dtype.

    ``alpha = softmax_s(depth_logits + logit_bias)``, ``h = mix_sources(alpha, sources)``; the logits returned are
    the softmax's input (a bias of −inf takes a source out of a token's softmax).
    """
    logits = depth_logits(sources, query, key_norm_weight, eps)
    if logit_bias is not None:
        logits = logits + logit_bias.to(logits.dtype)
    weights = torch.softmax(logits, dim=-1)
    return mix_sources(weights, sources), weights, logits
