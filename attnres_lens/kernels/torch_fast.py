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


class RoutedDepthAttentionFunction(torch.autograd.Function):
    """The op with its knobs (docs/kernels.md §1): ``R`` queries ``[R, D]`` over one source set, a logit scale
    ``c``, a key gain or none, raw or normalised values. Returns ``(h [N, R, D], weights [S, N, R], logits
    [S, N, R])`` from sources flattened to ``[N, D]``; the logits unbiased, the bias ``[S, N, R]`` (or ``[S, N,
    1]``, shared by the routes) added inside the softmax only. Calls without a knob keep `DepthAttentionFunction`,
    whose per-source BLAS-1/2 calls give the paper's mix its current numbers.

    Scale and gain fold into the query, ``u_r = c * w_r * g``, so ``z_rs = r_s (u_r . v_s)``. With ``v^_s`` the
    mixed value (``v_s``, or ``r_s v_s`` normalised), ``p_rs = dh_r . v^_s`` and ``delta_r = dh_r . h_r``:

        dz_rs = alpha_rs * (p_rs - delta_r)
        dv_s  = m_s * sum_r alpha_rs dh_r + r_s sum_r dz_rs u_r - r_s^2 / D * (sum_r dz_rs z_rs + n_s) * v_s
        du_r  = sum_tokens sum_s dz_rs * r_s * v_s,   dw_r = c * du_r * g,   dg = c * sum_r du_r * w_r

    where ``m_s = 1`` and ``n_s = 0`` for raw values, and ``m_s = r_s``, ``n_s = sum_r alpha_rs p_rs`` for
    normalised ones (the derivative of ``r_s v_s`` through ``r_s``, with ``dr_s/dv_s = -r_s^3 v_s / D``).
    """

    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key_norm_weight: torch.Tensor | None,
        logit_scale: float,
        normalize_values: bool,
        eps: float,
        bias: torch.Tensor | None,
        *sources: torch.Tensor,
    ):
        d_model = sources[0].shape[-1]
        dtype = compute_dtype(sources[0].dtype)
        folded_query = query.to(dtype) * logit_scale
        if key_norm_weight is not None:
            folded_query = folded_query * key_norm_weight.to(dtype)
        values = [source.to(dtype) for source in sources]
        rstd = torch.stack([torch.linalg.vector_norm(v, dim=-1) for v in values])
        rstd = rstd.square_().div_(d_model).add_(eps).rsqrt_()  # [S, N]
        logits = torch.stack([v @ folded_query.t() for v in values]).mul_(rstd[..., None])  # [S, N, R]
        weights = torch.softmax(logits if bias is None else logits + bias.to(dtype), dim=0)
        mixed = [v * r[:, None] for v, r in zip(values, rstd)] if normalize_values else values
        h = mixed[0][:, None, :] * weights[0, :, :, None]  # [N, R, D]
        for s in range(1, len(mixed)):
            h.addcmul_(mixed[s][:, None, :], weights[s, :, :, None])
        ctx.logit_scale, ctx.normalize_values, ctx.has_gain = logit_scale, normalize_values, key_norm_weight is not None
        gain = key_norm_weight if key_norm_weight is not None else query.new_empty(0)
        ctx.save_for_backward(query, gain, folded_query, rstd, logits, weights, h, *sources)
        ctx.mark_non_differentiable(weights, logits)
        return h.to(sources[0].dtype), weights, logits

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor, _grad_weights: torch.Tensor, _grad_logits: torch.Tensor):
        query, gain, folded_query, rstd, logits, weights, h, *sources = ctx.saved_tensors
        dtype = h.dtype
        d_model = h.shape[-1]
        grad_h = grad_h.to(dtype)  # [N, R, D]
        values = [source.to(dtype) for source in sources]
        mixed = [v * r[:, None] for v, r in zip(values, rstd)] if ctx.normalize_values else values
        dots = torch.stack([torch.linalg.vecdot(grad_h, m[:, None, :]) for m in mixed])  # p: [S, N, R]
        grad_logits = (dots - torch.linalg.vecdot(grad_h, h)).mul_(weights)
        key_coef = grad_logits * rstd[..., None]
        value_terms = grad_logits * logits
        if ctx.normalize_values:
            value_terms += weights * dots
        value_coef = value_terms.sum(dim=-1) * rstd.square() / d_model  # [S, N]
        grad_folded = torch.zeros_like(folded_query)
        grad_sources = []
        for s, v in enumerate(values):
            grad = torch.bmm(weights[s][:, None, :], grad_h).squeeze(1)  # sum_r alpha_rs dh_r: [N, D]
            if ctx.normalize_values:
                grad.mul_(rstd[s][:, None])
            grad.addmm_(key_coef[s], folded_query).addcmul_(v, value_coef[s][:, None], value=-1.0)
            grad_sources.append(grad.to(sources[s].dtype))
            grad_folded.addmm_(key_coef[s].t(), v)
        grad_folded.mul_(ctx.logit_scale)
        if ctx.has_gain:
            grad_query = (grad_folded * gain.to(dtype)).to(query.dtype)
            grad_gain = (grad_folded * query.to(dtype)).sum(dim=0).to(gain.dtype)
        else:
            grad_query, grad_gain = grad_folded.to(query.dtype), None
        return grad_query, grad_gain, None, None, None, None, *grad_sources


def routed_depth_attention_torch(
    sources: list[torch.Tensor],
    queries: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    normalize_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(h [..., R, D], weights, logits)`` for ``queries`` ``[R, D]``; weights/logits come source-major,
    ``[n_sources, N, R]``, the logits unbiased. ``bias``: ``[n_sources, N, R]``, ``[n_sources, N, 1]`` or None."""
    shape = sources[0].shape
    flat = [source.reshape(-1, shape[-1]) for source in sources]
    h, weights, logits = RoutedDepthAttentionFunction.apply(
        queries, key_norm_weight, logit_scale, normalize_values, eps, bias, *flat
    )
    return h.view(*shape[:-1], *h.shape[-2:]), weights, logits
