"""The readable depth mix (docs/model.md §2): plain PyTorch, exact in float64, the ground truth of every backend.

Its two steps are also what the model's hooked path and two-phase's PyTorch version are built from, so the mix is
written once: ``depth_logits`` (keys normalised, scored against the query) and ``mix_sources`` (the weighted sum).
The op's knobs (docs/kernels.md §1) are spelt out here first: a logit scale, a key norm with or without a gain,
values raw or normalised, and several queries (routes) over one source set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnres_lens.kernels._common import compute_dtype


def rstd(values: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(v^2) + eps)`` over the last dim: the key RMSNorm's scale, ``[...]``."""
    return torch.rsqrt(values.pow(2).mean(dim=-1) + eps)


def depth_logits(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """``logit_s = logit_scale * w . (g * v_s * rstd(v_s))`` in the compute dtype: ``[..., n_sources]`` for a
    query ``[D]``, ``[..., R, n_sources]`` for ``R`` queries ``[R, D]``.

    Keys are RMS-normalised, with gain ``g`` unless ``key_norm_weight`` is None (an unweighted norm, as Inkling-2);
    ``logit_scale`` is 1 for the paper and FLA, ``D**-0.5`` for Inkling-2.
    """
    dtype = compute_dtype(sources[0].dtype)
    scored = query.to(dtype)
    if key_norm_weight is not None:
        scored = scored * key_norm_weight.to(dtype)  # w . (g * k) = (w * g) . k
    routes = query.dim() == 2
    logits = []
    for v in sources:
        v = v.to(dtype)
        scale = rstd(v, eps)
        logits.append((v @ scored.t()) * scale[..., None] if routes else (v @ scored) * scale)
    stacked = torch.stack(logits, dim=-1)
    return stacked if logit_scale == 1.0 else stacked * logit_scale


def mix_sources(
    weights: torch.Tensor, sources: Sequence[torch.Tensor], *, normalize_values: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """``h = sum_s weights[..., s] * v_s``, accumulated in ``weights``' dtype and returned in the sources' dtype.

    Values are the raw sources, or with ``normalize_values`` the sources RMS-normalised without any gain
    (``v_s * rstd(v_s)``, epsilon ``eps``), as Inkling-2 mixes them. ``weights`` may carry extra leading dims
    (``[n_q, ..., S]``: one mix per leading index).
    """
    dtype = weights.dtype
    values = [v.to(dtype) for v in sources]
    if normalize_values:
        values = [v * rstd(v, eps)[..., None] for v in values]
    h = sum(weights[..., s, None] * v for s, v in enumerate(values))
    return h.to(sources[0].dtype)


def depth_attention_reference(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float = 1e-6,
    logit_bias: torch.Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    normalize_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(h, weights, logits)``; weights and logits are ``[..., n_sources]`` (``[..., R, n_sources]`` for
    ``R`` queries, with ``h`` ``[..., R, D]``) in the compute dtype.

    ``alpha = softmax_s(depth_logits + logit_bias)``, ``h = mix_sources(alpha, sources)``; the logits returned are
    the softmax's input (a bias of −inf takes a source out of a token's softmax). A bias ``[..., n_sources]`` is
    shared by all routes; ``[..., R, n_sources]`` gives each its own.
    """
    routes = query.dim() == 2
    logits = depth_logits(sources, query, key_norm_weight, eps, logit_scale)
    if logit_bias is not None:
        shared = routes and logit_bias.dim() == logits.dim() - 1
        logits = logits + (logit_bias.unsqueeze(-2) if shared else logit_bias).to(logits.dtype)
    weights = torch.softmax(logits, dim=-1)
    if routes:  # mix_sources takes the route as a leading dim: [R, ..., S] -> [R, ..., D] -> [..., R, D]
        h = mix_sources(weights.movedim(-2, 0), sources, normalize_values=normalize_values, eps=eps).movedim(0, -2)
    else:
        h = mix_sources(weights, sources, normalize_values=normalize_values, eps=eps)
    return h, weights, logits
