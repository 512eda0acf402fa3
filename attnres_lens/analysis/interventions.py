"""What an intervention is: a list of hooks `(hook point name, function)`; the hooks that replace an activation,
knock sources out of a depth softmax, or remove sublayers. Running them is `engine`'s job (`evaluate_many`).

Everything acts from outside the model through its hook points (docs/hooks.md), named by the depth-mixing model
protocol (docs/architecture.md §7), so the same code serves the standard residual, Full and Block AttnRes and any
other depth-mixing model.

Removing a set R of sublayers (docs/analysis.md §6) is one rule for every residual kind:

* every output `f_j`, j ∈ R, is zeroed, which drops it from every sum that contains it: the standard
  residual `e + Σ f_i`, and an AttnRes block sum or partial sum (the block sum minus `f_j`, key and value);
* an AttnRes source whose members are *all* removed is masked out of every softmax that reads it
  (a logit bias of −inf, on `hook_logit_bias`, which keeps the mix in the fused kernel) instead of being left
  as a zero vector: a zero source would still take softmax mass
  (its key is zero, so its logit is 0), which is not "absent".

For Full AttnRes (S = 1) every source is a single output, so removal is exactly "mask f_j's source in every
later softmax, the final readout included"; for Block AttnRes it is "subtract f_j from its block sum", and a
sublayer alone in its block (or alone in a partial) is masked, the consistent limit of subtraction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch

from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import DepthMixingModel, depth_consumers

Hook = tuple[str, Callable]


def replaces_activation(hook: Callable) -> Callable:
    """Mark `hook` as one whose result does not depend on the activation it is given (only on its shape and
    dtype): on a sublayer's output, `evaluate_many` then skips computing that sublayer for the copies it serves."""
    hook.replaces_activation = True
    return hook


def replace_hook(replacement: torch.Tensor) -> Callable:
    """Hook that replaces an activation by `replacement` (broadcast to the activation's shape)."""

    @replaces_activation
    def hook(tensor: torch.Tensor, hook) -> torch.Tensor:
        return replacement.to(tensor.dtype).expand_as(tensor)

    return hook


def mask_sources_hook(sources: Sequence[int]) -> Callable:
    """Hook on a depth attention's `hook_logit_bias` (or `hook_logits`) that knocks `sources` out of its softmax
    (the last axis, so every route where the bias or logits have a route axis).
    The same sources give the same function object, so `evaluate_many` sees removal sets that agree on a consumer
    as sharing it."""
    return _mask_sources_hook(tuple(int(source) for source in sources))


@functools.cache
def _mask_sources_hook(sources: tuple[int, ...]) -> Callable:
    index = torch.tensor(list(sources))

    def hook(bias: torch.Tensor, hook) -> torch.Tensor:
        return bias.index_fill(-1, index.to(bias.device), float("-inf"))

    return hook


@replaces_activation
def _zero(tensor: torch.Tensor, hook) -> torch.Tensor:
    return torch.zeros_like(tensor)


def removal_hooks(model: DepthMixingModel, removed: Iterable[int]) -> list[Hook]:
    """Hooks that remove the sublayers in `removed` (see the module docstring for the rule): every output zeroed
    at `sublayer_output_hook`, and every consumer's emptied sources masked at its `depth_hook(c, "logit_bias")`."""
    removed = set(removed)
    n_sublayers = model.n_sublayers
    bad = sorted(j for j in removed if not 0 <= j < n_sublayers)
    if bad:
        raise ValueError(f"sublayers {bad} are out of range 0..{n_sublayers - 1}")
    hooks: list[Hook] = [(model.sublayer_output_hook(j), _zero) for j in sorted(removed)]
    for consumer in depth_consumers(model):
        emptied = [s for s, members in enumerate(model.sources(consumer)) if set(members) <= removed]
        # a message consumer may lose every source (the whole previous pass removed): its sources are then all
        # zero, and so its messages, with nothing left to renormalise over
        if emptied and len(emptied) < len(model.sources(consumer)):
            hooks.append((model.depth_hook(consumer, "logit_bias"), mask_sources_hook(emptied)))
    return hooks


def source_mask_hooks(model: DepthMixingModel, consumer: int | str, sources: Sequence[int]) -> list[Hook]:
    """Hooks that knock `sources` out of one consumer's depth softmax, every route of it (depth-mixing consumers,
    message consumers included)."""
    if consumer not in depth_consumers(model):
        what = f"residual={model.cfg.residual!r}" if isinstance(model, HookedTransformer) else "not a consumer"
        raise ValueError(f"consumer {consumer} has no depth attention ({what})")
    n_sources = len(model.sources(consumer))
    if not sources or any(not 0 <= s < n_sources for s in sources) or len(set(sources)) >= n_sources:
        raise ValueError(f"consumer {consumer} reads {n_sources} sources; cannot mask {list(sources)}")
    return [(model.depth_hook(consumer, "logit_bias"), mask_sources_hook(sources))]


def resample_permutation(batch_size: int) -> torch.Tensor:
    """Each sequence takes its activations from the next one (a derangement, so never from itself)."""
    if batch_size < 2:
        raise ValueError("resample ablation needs at least 2 sequences (samples >= 2)")
    return torch.roll(torch.arange(batch_size), -1)
