"""Depth-attention kernels (docs/kernels.md): one function, four backends, plus two-phase Block AttnRes.

``depth_attention`` mixes a list of sources ``v_s`` (each ``[..., D]``) into ``h = sum_s alpha_s v_s`` with
``alpha = softmax_s(logit_scale * w . RMSNorm_g(v_s))`` (values raw, or RMS-normalised; one query or several).
Backends:

* ``reference`` (``reference.py``): readable PyTorch, the ground truth; exact in float64; fully differentiable.
* ``torch`` (``torch_fast.py``): plain PyTorch with a hand-derived backward (any device, no compiler needed).
* ``cpu`` (``cpu_depth.c`` via ``cpu_depth.py``; built and loaded by ``cpu_build.py``): fused C forward and backward
  for CPU tensors, one pass per source, compiled with the system C compiler on first use.
* ``triton`` (``triton_fused.py``): fused forward and backward kernels for CUDA (or the CPU interpreter).

Which backend ``auto`` picks, and when Block AttnRes runs two-phase, is decided in ``backends.py``. Only torch is
imported here; Triton is imported the first time the triton backend runs.
"""

from __future__ import annotations

import torch

from attnres_lens.kernels._common import (
    Sources,
    builds_no_graph,
    check_logit_bias,
    check_logit_scale,
    check_query,
    check_sources,
    check_vector,
)
from attnres_lens.kernels.backends import (
    BACKEND_ENV_VAR,
    BACKENDS,
    elementwise_runs_cpu_kernel,
    model_runs_two_phase,
    resolve_backend,
    stream_two_phase_backend,
    triton_available,
)
from attnres_lens.kernels.cpu_autograd import share_gradient
from attnres_lens.kernels.cpu_depth import (
    depth_attention_copies_cpu,
    depth_attention_cpu,
    depth_attention_multi_cpu,
    fused_mix_and_norm,
    routed_depth_attention_cpu,
)
from attnres_lens.kernels.layer_ops import TokenShiftMix, apply_rotary, causal_attention, kv_shift, rms_norm, rotary
from attnres_lens.kernels.reference import depth_attention_reference, depth_logits, mix_sources
from attnres_lens.kernels.torch_fast import depth_attention_torch, routed_depth_attention_torch
from attnres_lens.kernels.two_phase import BlockStats, block_phase1, merge_partial

__all__ = [
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "BlockStats",
    "TokenShiftMix",
    "apply_rotary",
    "block_phase1",
    "builds_no_graph",
    "causal_attention",
    "depth_attention",
    "depth_attention_copies_cpu",
    "depth_attention_multi_cpu",
    "depth_logits",
    "elementwise_runs_cpu_kernel",
    "fused_mix_and_norm",
    "kv_shift",
    "merge_partial",
    "mix_sources",
    "model_runs_two_phase",
    "resolve_backend",
    "rms_norm",
    "rotary",
    "share_gradient",
    "stream_two_phase_backend",
    "triton_available",
]


def _token_major(stat: torch.Tensor, lead_shape: torch.Size) -> torch.Tensor:
    """``[S, N]`` source-major statistics -> ``[..., S]``."""
    return stat.t().reshape(*lead_shape, stat.shape[0])


def _routed_fast_path(
    chosen: str,
    source_list: list[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    logit_bias: torch.Tensor | None,
    logit_scale: float,
    normalize_values: bool,
    want_stats: bool,
    depth_buffer: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A call with a knob on a fast backend: its routed kernel takes queries ``[R, D]`` (one ``[D]`` query is one
    route, dropped again from the outputs) and a source-major bias ``[S, N, R]`` or ``[S, N, 1]`` (triton takes
    none, and reads a ``depth_buffer`` in place); returns ``(h, weights, logits)`` in the op's layout
    (docs/kernels.md §1)."""
    first = source_list[0]
    lead_shape, n_sources = first.shape[:-1], len(source_list)
    queries = query.reshape(-1, first.shape[-1])
    n_routes = queries.shape[0]
    bias = None
    if logit_bias is not None:
        bias_routes = n_routes if logit_bias.dim() == first.dim() + 1 else 1  # [..., R, S] or shared [..., S]
        bias = logit_bias.reshape(-1, bias_routes, n_sources).permute(2, 0, 1)
    if chosen == "torch":
        h, weights, logits = routed_depth_attention_torch(
            source_list, queries, key_norm_weight, eps, bias, logit_scale, normalize_values
        )
    elif chosen == "cpu":
        h, weights, logits = routed_depth_attention_cpu(
            source_list, queries, key_norm_weight, eps, bias, logit_scale, normalize_values, want_stats
        )
    else:
        from attnres_lens.kernels.triton_fused import routed_depth_attention_triton

        h, weights, logits = routed_depth_attention_triton(
            source_list, queries, key_norm_weight, eps, want_stats, logit_scale, normalize_values, depth_buffer
        )
    one_query = query.dim() == 1
    if one_query:
        h = h.squeeze(-2)
    if not want_stats:
        return h, None, None
    weights, logits = (stat.permute(1, 2, 0).reshape(*lead_shape, n_routes, n_sources) for stat in (weights, logits))
    if logit_bias is not None:
        shared = logit_bias.dim() == first.dim() and not one_query
        logits = logits + (logit_bias.unsqueeze(-2) if shared else logit_bias.reshape(logits.shape)).to(logits.dtype)
    if one_query:
        weights, logits = weights.squeeze(-2), logits.squeeze(-2)
    return h, weights, logits


def depth_attention(
    sources: Sources,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float = 1e-6,
    backend: str = "auto",
    return_weights: bool = False,
    return_logits: bool = False,
    logit_bias: torch.Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    normalize_values: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Softmax-over-depth mix of ``sources`` (docs/kernels.md §1).

    Args:
        sources: a sequence of same-shape, same-dtype tensors ``[..., D]``, or one depth buffer ``[S, ..., D]``
            whose first dim indexes the sources (read in place by the triton backend).
        query: the pseudo-query ``w``, ``[D]``; or ``[R, D]``, ``R`` queries (routes) over one source set, each
            its own softmax: ``h`` is then ``[..., R, D]`` and weights/logits ``[..., R, S]``.
        key_norm_weight: the key RMSNorm gain ``g``, ``[D]``, or None for an unweighted key norm (Inkling-2).
        eps: RMSNorm epsilon (of the keys, and of the values when they are normalised).
        backend: ``"auto"``, ``"reference"``, ``"torch"``, ``"cpu"`` or ``"triton"``. ``"auto"`` honours
            ``$ATTNRES_LENS_BACKEND`` if set, else picks triton for CUDA tensors, cpu for CPU tensors (falling
            back to torch, with a warning, where no C compiler is found) and torch otherwise; a call using a knob
            that backend lacks runs on the next one that has it (docs/kernels.md §2).
        return_weights: also return ``alpha`` as ``[..., S]`` (fp32; fp64 for fp64 sources except on triton).
        return_logits: also return the pre-softmax logits ``logit_scale * w . k_s`` (plus the bias) as ``[..., S]``.
        logit_bias: optional ``[..., S]`` (shared by every route) or ``[..., R, S]``, added to the logits inside
            the softmax: −inf takes a source out of a token's mix (how interventions knock sources out on the fast
            path). Not differentiable except with the reference backend; the triton kernel has none, so
            ``"auto"`` runs such a call on ``torch``.
        logit_scale: multiplies ``w . k_s`` before the bias is added: 1 for the paper and FLA, ``D**-0.5`` for
            Inkling-2. Finite and > 0.
        normalize_values: mix the sources RMS-normalised without any gain (``v_s * rstd(v_s)``, as Inkling-2),
            even where the keys have a gain; False mixes the raw sources (the paper, FLA).

    Returns:
        ``h`` (``[..., D]`` or ``[..., R, D]``, the sources' dtype), followed by the weights and then the logits
        when asked for. Weights and logits are differentiable only with the reference backend.
    """
    source_list = check_sources(sources)
    first = source_list[0]
    d_model = first.shape[-1]
    n_routes = check_query(query, d_model, first.device)
    if key_norm_weight is not None:
        check_vector("key_norm_weight", key_norm_weight, d_model, first.device)
    logit_scale = check_logit_scale(logit_scale)
    if not isinstance(normalize_values, bool):
        raise ValueError(f"normalize_values must be True or False, got {normalize_values!r}")
    want_stats = return_weights or return_logits
    lead_shape = first.shape[:-1]
    if logit_bias is not None:
        check_logit_bias(logit_bias, lead_shape, len(source_list), first.device, n_routes)
    features = tuple(
        name
        for name, used in (
            ("logit_scale", logit_scale != 1.0),
            ("key_norm_weight=None", key_norm_weight is None),
            ("normalize_values", normalize_values),
            ("query [R, D]", n_routes is not None),
        )
        if used
    )
    chosen = resolve_backend(backend, first.device, logit_bias=logit_bias is not None, features=features)
    if logit_bias is not None and logit_bias.requires_grad and torch.is_grad_enabled() and chosen != "reference":
        raise ValueError(
            f"logit_bias requires grad, but the {chosen} backend does not differentiate it; use "
            "backend='reference' for a gradient with respect to the bias"
        )

    if chosen == "reference":
        h, weights, logits = depth_attention_reference(
            source_list,
            query,
            key_norm_weight,
            eps,
            logit_bias,
            logit_scale=logit_scale,
            normalize_values=normalize_values,
        )
    elif features:
        depth_buffer = sources if isinstance(sources, torch.Tensor) else None
        h, weights, logits = _routed_fast_path(
            chosen,
            source_list,
            query,
            key_norm_weight,
            eps,
            logit_bias,
            logit_scale,
            normalize_values,
            want_stats,
            depth_buffer,
        )
    elif chosen in ("torch", "cpu"):
        fast_path = depth_attention_torch if chosen == "torch" else depth_attention_cpu
        source_major_bias = None if logit_bias is None else logit_bias.reshape(-1, len(source_list)).t()
        h, weights, logits = fast_path(source_list, query, key_norm_weight, eps, source_major_bias)
        if want_stats:
            weights, logits = _token_major(weights, lead_shape), _token_major(logits, lead_shape)
            if logit_bias is not None:
                logits = logits + logit_bias.to(logits.dtype)
    else:
        from attnres_lens.kernels.triton_fused import depth_attention_triton

        depth_buffer = sources if isinstance(sources, torch.Tensor) else None
        h, weights, logits = depth_attention_triton(
            source_list, query, key_norm_weight, eps, want_stats, depth_buffer=depth_buffer
        )
        if want_stats:
            weights, logits = _token_major(weights, lead_shape), _token_major(logits, lead_shape)

    outputs = [h]
    if return_weights:
        outputs.append(weights)
    if return_logits:
        outputs.append(logits)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
