"""How the C kernels meet autograd: their eager autograd.Functions run without a node where no autograd can see the
call (`apply_function`), their backwards skip torch's `once_differentiable` checks where those do nothing, and the
fused consumers of one source sum its gradient in one buffer instead of autograd adding a copy per consumer
(`share_gradient`, docs/kernels.md §5). Each saves work a small model's step pays per call (docs/kernels.md §11).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable as _guard_second_derivative

from attnres_lens.kernels._common import builds_no_graph, new_output_like


class _NoGraph:
    """The `ctx` an eager Function's forward gets when `apply_function` runs it without autograd: what it saves or marks
    for a backward is dropped (its attributes are set and forgotten)."""

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    """`function.apply(*args)`, or where it `builds_no_graph` (inference, exact interventions) its forward alone:
    no autograd node and no saved tensors, which a small consumer's call pays for (docs/kernels.md §11), and
    the same output values. Under forward-mode AD `apply` runs: these Functions have no jvp, so a dual
    input raises where the forward alone would drop its tangent without a word."""
    if builds_no_graph():
        return function.forward(_NoGraph(), *args)
    return function.apply(*args)


def once_differentiable(backward: Callable) -> Callable:
    """torch's `once_differentiable` for the C kernels' backwards, without its cost where it does nothing: in a
    plain backward (no create_graph) grad mode is already off, where its no-grad context and output checks only
    return the outputs, at a cost per node that a small model's step pays dozens of times; with create_graph
    it runs as torch's, so a second derivative through the C backward raises instead of coming out wrong."""
    guarded = _guard_second_derivative(backward)

    @functools.wraps(backward)
    def run(ctx: Any, *grads: torch.Tensor | None) -> Any:
        return guarded(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)

    return run


class SharedGradient:
    """The gradient of one source that several fused consumers read, summed in place (docs/kernels.md §5).

    `share_gradient` puts a node after the source whose output the consumers read; each consumer's C backward adds
    its part into this object's buffer for the running backward pass (the first part writes it) and returns no
    gradient for that input, where autograd would add every consumer's fresh copy in a pass of its own; the node,
    which autograd runs only after every consumer of its output, hands the sum on. One buffer per backward pass
    (autograd's graph task: concurrent and reentrant backwards keep theirs apart), dropped when that pass ends, so
    one that stopped short of the node (a gradient with respect to a query only) leaves nothing behind."""

    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def target(self, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The buffer this backward pass adds into, and whether it already holds a part (else write it)."""
        task = torch._C._current_graph_task_id()
        buffer = self.buffers.get(task)
        if buffer is not None:
            return buffer, True
        self.buffers[task] = buffer = new_output_like(like)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.buffers.pop(task, None))
        return buffer, False

    def take(self) -> torch.Tensor | None:
        """The sum of this backward pass's parts (None if no consumer added one), released."""
        return self.buffers.pop(torch._C._current_graph_task_id(), None)


class _ShareGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, shared: SharedGradient) -> torch.Tensor:
        ctx.shared = shared
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        summed = ctx.shared.take()
        if summed is None or grad is None:  # the node's other uses (an unfused consumer) send grad
            return (grad if summed is None else summed), None
        return summed.add_(grad), None


def share_gradient(source: torch.Tensor) -> torch.Tensor:
    """`source`, seen through a node that collects the fused consumers' gradients in one buffer (`SharedGradient`);
    `source` itself when it needs no gradient. Give the result only to depth mixes: a gradient taken with respect
    to it directly would miss their parts (the gradient of `source` itself is complete)."""
    if not source.requires_grad:
        return source
    shared = SharedGradient()
    view = _ShareGradient.apply(source, shared)
    view.shared_gradient = shared
    return view


def shared_gradients(sources: tuple[torch.Tensor, ...]) -> list[SharedGradient | None] | None:
    """Each source's `SharedGradient` (None for a source without one), or None when no source has one."""
    shared = [getattr(source, "shared_gradient", None) for source in sources]
    return shared if any(item is not None for item in shared) else None


def buffers_to_sum_into(ctx: Any, *grads: torch.Tensor | None) -> list[SharedGradient | None] | None:
    """The consumer's shared buffers for this backward, or None when a gradient builds a graph (create_graph): a
    shared buffer carries no graph, so those gradients come back fresh, where `once_differentiable` makes a second
    derivative through them raise instead of come out wrong."""
    return None if any(grad is not None and grad.requires_grad for grad in grads) else ctx.shared


def gradient_buffers(
    sources: list[torch.Tensor], shared: list[SharedGradient | None] | None = None
) -> tuple[list[torch.Tensor], ctypes.Array | None]:
    """A backward's outputs for the sources (a source with a `SharedGradient` gets its buffer) and the C kernel's
    per-source add-or-write flags (None: write all). One tensor per source, not one [S, N, D] block:
    activation-sized allocations are recycled by the C allocator step after step, while a block of a new size is
    often mapped afresh and page-faulted in."""
    first = sources[0]
    if shared is None:
        return [new_output_like(first) for _ in sources], None
    grad_sources, accumulate = [], [0] * len(sources)
    for s, source in enumerate(sources):
        if shared[s] is not None:
            buffer, accumulate[s] = shared[s].target(source)
            grad_sources.append(buffer)
        else:
            grad_sources.append(new_output_like(first))
    return grad_sources, (ctypes.c_uint8 * len(sources))(*accumulate)


def returned_gradients(grad_sources: list[torch.Tensor], shared: list[SharedGradient | None] | None) -> list:
    """The gradients a backward returns for its sources: none for those summed in a shared buffer."""
    if shared is None:
        return grad_sources
    return [None if item is not None else grad for grad, item in zip(grad_sources, shared)]
