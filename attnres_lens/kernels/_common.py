"""Leaf helpers shared by the depth-attention backends: input validation, output allocation, compute dtype, and
whether an autograd can see a kernel call (`builds_no_graph`, `needs_autograd`: grad mode, forward-mode AD and
torch.func transforms, asked by the C kernels' wrappers, the backend policy and the watched depth mix).

Which backend runs is decided in ``backends.py``, not here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd import forward_ad

Sources = Sequence[torch.Tensor] | torch.Tensor

# Tests switch this on so every freshly allocated kernel output starts as NaN: an element a kernel forgets to
# write then fails the comparison instead of silently holding stale memory that happens to look right.
POISON_OUTPUTS = False


def new_output(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output buffer (NaN-filled while ``POISON_OUTPUTS`` is set)."""
    if POISON_OUTPUTS:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def new_output_like(tensor: torch.Tensor) -> torch.Tensor:
    """`new_output` of `tensor`'s shape, dtype and device, contiguous: half the cost of `torch.empty` with its
    arguments spelt out (~1 against ~2 us), and the C kernels allocate several such outputs per call."""
    if POISON_OUTPUTS:
        return torch.full_like(tensor, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic runs in fp32, or in fp64 when the inputs are fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_sources(sources: Sources) -> list[torch.Tensor]:
    """Validate the sources and return them as a list of ``[..., D]`` tensors (views of a depth buffer)."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2:
            raise ValueError(f"a depth buffer must have shape [n_sources, ..., D], got {tuple(sources.shape)}")
        source_list = list(sources.unbind(0))
    else:
        source_list = list(sources)
    if not source_list:
        raise ValueError("depth attention needs at least one source")
    for index, source in enumerate(source_list):
        if not isinstance(source, torch.Tensor) or source.dim() < 1:
            raise ValueError(
                f"every source must be a tensor of shape [..., D]; source {index} is "
                f"{tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__}"
            )
    first = source_list[0]
    if not first.is_floating_point():
        raise ValueError(f"sources must be floating point, got {first.dtype}")
    if first.shape[-1] == 0:
        raise ValueError(f"sources must have a width D >= 1, got shape {tuple(first.shape)}")
    for index, source in enumerate(source_list[1:], start=1):
        if source.shape != first.shape:
            raise ValueError(
                f"all sources must have the same shape: source 0 is {tuple(first.shape)}, "
                f"source {index} is {tuple(source.shape)}"
            )
        if source.dtype != first.dtype:
            raise ValueError(
                f"all sources must have the same dtype: source 0 is {first.dtype}, source {index} is {source.dtype}"
            )
        if source.device != first.device:
            raise ValueError(
                f"all sources must be on one device: source 0 is on {first.device}, source {index} on {source.device}"
            )
    return source_list


def check_vector(name: str, vector: torch.Tensor, d_model: int, device: torch.device) -> None:
    """A pseudo-query or key-norm gain must be a floating ``[D]`` vector on the sources' device."""
    if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (d_model,):
        shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise ValueError(f"{name} must have shape [{d_model}] (the sources' last dim), got {shape}")
    if not vector.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {vector.dtype}")
    if vector.device != device:
        raise ValueError(f"{name} is on {vector.device} but the sources are on {device}")


def check_query(query: torch.Tensor, d_model: int, device: torch.device) -> int | None:
    """A pseudo-query is a floating ``[D]`` vector, or ``[R, D]`` for ``R`` routes over one source set, on the
    sources' device. Returns ``R``, or None for one ``[D]`` query."""
    if isinstance(query, torch.Tensor) and query.dim() == 2 and query.shape[0] >= 1 and query.shape[1] == d_model:
        check_vector("query", query[0], d_model, device)
        return query.shape[0]
    if isinstance(query, torch.Tensor) and query.dim() != 1:
        raise ValueError(
            f"query must have shape [{d_model}] or [n_routes, {d_model}] (the sources' last dim), "
            f"got {tuple(query.shape)}"
        )
    check_vector("query", query, d_model, device)
    return None


def check_logit_scale(logit_scale: float) -> float:
    """The logit scale multiplies ``w . k`` (1 for the paper and FLA, ``D**-0.5`` for Inkling-2): a finite number
    above 0."""
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)):
        raise ValueError(
            f"logit_scale must be a Python number (1.0, or D**-0.5 for Inkling-2), got {type(logit_scale).__name__}"
        )
    if not math.isfinite(logit_scale) or logit_scale <= 0:
        raise ValueError(
            f"logit_scale must be finite and > 0 (1.0, or D**-0.5 for Inkling-2), got {logit_scale!r}; "
            "take a source out with logit_bias=-inf instead"
        )
    return float(logit_scale)


def check_logit_bias(
    bias: torch.Tensor, lead_shape: torch.Size, n_sources: int, device: torch.device, n_routes: int | None = None
) -> None:
    """A logit bias is a floating ``[..., n_sources]`` tensor with the sources' leading dims, on their device; with
    ``n_routes`` queries it may also be ``[..., n_routes, n_sources]`` (one bias per route)."""
    expected = (*lead_shape, n_sources)
    per_route = (*lead_shape, n_routes, n_sources)
    shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
    if shape != expected and (n_routes is None or shape != per_route):
        routed = "" if n_routes is None else f" or {list(per_route)} (one bias per route)"
        raise ValueError(
            f"logit_bias must have shape {list(expected)} (the sources' leading dims, then one entry "
            f"per source){routed}, got {shape}"
        )
    if not bias.is_floating_point():
        raise ValueError(f"logit_bias must be floating point, got {bias.dtype}")
    if bias.device != device:
        raise ValueError(f"logit_bias is on {bias.device} but the sources are on {device}")


def forward_ad_open() -> bool:
    """Whether a forward-mode AD level is open: inside one, a Function is asked for its jvp even without grad mode,
    and a tensor may carry a tangent."""
    return forward_ad._current_level >= 0  # -1 outside every dual level


def builds_no_graph() -> bool:
    """Whether no autograd can see this call: grad mode off, no forward-mode AD level open and no torch.func
    transform (vmap, grad, jvp) active, whose wrapped tensors a C kernel cannot read: there the Function is
    applied, and torch.func's own error names what it lacks."""
    return not torch.is_grad_enabled() and not forward_ad_open() and not torch._C._are_functorch_transforms_active()


def needs_autograd(*tensors: torch.Tensor) -> bool:
    """Whether an autograd needs a derivative through a call on ``tensors``: grad mode on and one of them requires
    a gradient, or a forward-mode AD level open and one of them carries a tangent. A kernel without a derivative
    refuses them (or hands them to a Function, whose missing jvp raises) rather than drop the tangent."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        return True
    return forward_ad_open() and any(forward_ad.unpack_dual(tensor).tangent is not None for tensor in tensors)
