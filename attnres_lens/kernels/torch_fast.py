"""Fast depth attention in plain PyTorch (the CPU path) with a hand-derived backward.

Savings over the reference: the key-norm gain is folded into the query (``w . (g * k_hat) = (w * g) . k_hat``), each
source's rstd is computed once with one fused norm, nothing of size [n_sources, N, D] is ever stacked, and the
backward is a handful of per-source BLAS-1/2 calls instead of an autograd graph of ~10 nodes per source.

Backward, per token (r_s = rstd of source s, u = w * g, delta = dh . h):
    dlogit_s = alpha_s * (dh . v_s - delta)
    dv_s     = alpha_s * dh + dlogit_s * r_s * u - dlogit_s * logit_s * r_s^2 / D * v_s
    du       = sum_tokens sum_s dlogit_s * r_s * v_s,   dw = du * g,   dg = du * w
"""

from __future__ import annotations

import torch

from attnres_lens.kernels._common import compute_dtype, new_output


class DepthAttentionFunction(torch.autograd.Function):
    """``(h, weights [S, N], logits [S, N])`` from sources flattened to ``[N, D]`` and an optional ``[S, N]`` logit
    bias (added inside the softmax only; ``logits`` are the unbiased scores, which the backward's key term needs).

    Weights and logits are not differentiable (they are reported, not consumed, by the caller), nor is the bias.
    """

    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key_norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None,
        *sources: torch.Tensor,
    ):
        d_model = sources[0].shape[-1]
        dtype = compute_dtype(sources[0].dtype)
        folded_query = query.to(dtype) * key_norm_weight.to(dtype)
        values = [source.to(dtype) for source in sources]
        # rstd = 1 / sqrt(|v|^2 / D + eps), via one fused norm kernel per source
        rstd = torch.stack([torch.linalg.vector_norm(v, dim=-1) for v in values])
        rstd = rstd.square_().div_(d_model).add_(eps).rsqrt_()
        logits = torch.stack([v @ folded_query for v in values]).mul_(rstd)
        weights = torch.softmax(logits if bias is None else logits + bias.to(dtype), dim=0)
        h = values[0] * weights[0, :, None]
        for s in range(1, len(values)):
            h.addcmul_(values[s], weights[s, :, None])
        ctx.save_for_backward(query, key_norm_weight, folded_query, rstd, logits, weights, h, *sources)
        ctx.mark_non_differentiable(weights, logits)
        return h.to(sources[0].dtype), weights, logits

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor, _grad_weights: torch.Tensor, _grad_logits: torch.Tensor):
        query, key_norm_weight, folded_query, rstd, logits, weights, h, *sources = ctx.saved_tensors
        dtype = h.dtype
        n_tokens, d_model = h.shape
        grad_h = grad_h.to(dtype)
        values = [source.to(dtype) for source in sources]
        # One [S, N, D] buffer holds every source gradient; it doubles as scratch for dh * v_s so the backward
        # allocates nothing else of that size (fresh large allocations cost page faults on this CPU).
        grad_sources = new_output((len(values), n_tokens, d_model), dtype, h.device)
        for s, v in enumerate(values):
            torch.mul(v, grad_h, out=grad_sources[s])
        grad_logits = grad_sources.sum(dim=-1).sub_(torch.linalg.vecdot(grad_h, h)).mul_(weights)
        key_coef = grad_logits.mul_(rstd)  # in place: grad_logits is not needed again
        value_coef = key_coef * logits * rstd / d_model
        torch.mul(key_coef[:, :, None], folded_query, out=grad_sources)
        grad_sources.addcmul_(weights[:, :, None], grad_h)
        grad_folded = torch.zeros_like(folded_query)
        for s, v in enumerate(values):
            grad_sources[s].addcmul_(v, value_coef[s, :, None], value=-1.0)
            grad_folded.addmv_(v.t(), key_coef[s])
        grad_query = (grad_folded * key_norm_weight.to(dtype)).to(query.dtype)
        grad_gain = (grad_folded * query.to(dtype)).to(key_norm_weight.dtype)
        grad_sources = grad_sources.to(sources[0].dtype)
        return grad_query, grad_gain, None, None, *grad_sources.unbind(0)


def depth_attention_torch(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(h, weights, logits)``; weights/logits come source-major, ``[n_sources, N]``, the logits unbiased.
    ``bias``: ``[n_sources, N]`` or None."""
    shape = sources[0].shape
    flat = [source.reshape(-1, shape[-1]) for source in sources]
    h, weights, logits = DepthAttentionFunction.apply(query, key_norm_weight, eps, bias, *flat)
    return h.view(shape), weights, logits
