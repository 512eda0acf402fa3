"""Hook-based interventions shared by the analyses: capture, evaluate, remove, replace, mask.

Everything acts from outside the model through its hook points (docs/hooks.md), so the same code serves the
standard residual, Full and Block AttnRes.

Removing a set R of sublayers (docs/analysis.md §6) is one rule for every residual kind:

* every output `f_j`, j ∈ R, is zeroed, which drops it from every sum that contains it: the standard
  residual `e + Σ f_i`, and an AttnRes block sum or partial sum (the block sum minus `f_j`, key and value);
* an AttnRes source whose members are *all* removed is masked out of every softmax that reads it
  (logit → −inf) instead of being left as a zero vector: a zero source would still take softmax mass
  (its key is zero, so its logit is 0), which is not "absent".

For Full AttnRes (S = 1) every source is a single output, so removal is exactly "mask f_j's source in every
later softmax, the final readout included"; for Block AttnRes it is "subtract f_j from its block sum", and a
sublayer alone in its block (or alone in a partial) is masked, the consistent limit of subtraction.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from attnres_lens.evaluation import Evaluation, score_logits
from attnres_lens.model import HookedTransformer
from attnres_lens.tasks.base import Batch

Hook = tuple[str, Callable]


# ---------------------------------------------------------------------------- running
@torch.no_grad()
def capture(model: HookedTransformer, tokens: torch.Tensor, names: Iterable[str],
            fwd_hooks: Sequence[Hook] = ()) -> dict[str, torch.Tensor]:
    """Activations at the hook points `names` for one forward pass (with optional interventions)."""
    saved: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, hook) -> None:
        saved[hook.name] = tensor

    hooks = list(fwd_hooks) + [(name, save) for name in set(names)]
    model.run_with_hooks(tokens, return_type=None, fwd_hooks=hooks)
    return saved


def evaluate(model: HookedTransformer, batch: Batch, fwd_hooks: Sequence[Hook] = ()) -> Evaluation:
    """The batch's loss, answer loss and accuracy with the hooks `fwd_hooks` applied."""
    return evaluate_many(model, batch, [fwd_hooks])[0]


@torch.no_grad()
def evaluate_many(model: HookedTransformer, batch: Batch, interventions: Sequence[Sequence[Hook]],
                  max_sequences: int = 64, progress: bool = False, desc: str = "interventions") -> list[Evaluation]:
    """`evaluate` for each intervention (a list of hooks), stacking copies of the batch into shared forward
    passes of up to `max_sequences` sequences: each intervention's hooks see only their own copy. On a CPU
    a pass has a sizeable fixed cost, so this is faster than one pass per intervention."""
    n_batch = batch.tokens.shape[0]
    per_pass = max(1, max_sequences // n_batch)
    results: list[Evaluation] = []
    with tqdm(total=len(interventions), desc=desc, disable=not progress, leave=False) as bar:
        for start in range(0, len(interventions), per_pass):
            group = interventions[start : start + per_pass]
            hooks_by_name: dict[str, list[tuple[int, Callable]]] = defaultdict(list)
            for slot, hooks in enumerate(group):
                for name, hook in hooks:
                    hooks_by_name[name].append((slot, hook))
            fwd_hooks = [(name, _on_copies(n_batch, hooks)) for name, hooks in hooks_by_name.items()]
            logits = model.run_with_hooks(batch.tokens.repeat(len(group), 1), fwd_hooks=fwd_hooks)
            results += [score_logits(part, batch) for part in logits.split(n_batch)]
            bar.update(len(group))
    return results


def _on_copies(n_batch: int, functions: list[tuple[int, Callable]]) -> Callable:
    def apply(tensor: torch.Tensor, hook) -> torch.Tensor:  # TL passes the hook point as `hook=`
        copies = list(tensor.split(n_batch))
        for slot, function in functions:
            copies[slot] = function(copies[slot], hook=hook)
        return torch.cat(copies)

    return apply


# ---------------------------------------------------------------------------- interventions
def replace_hook(replacement: torch.Tensor) -> Callable:
    """Hook that replaces an activation by `replacement` (broadcast to the activation's shape)."""

    def hook(tensor: torch.Tensor, hook) -> torch.Tensor:
        return replacement.to(tensor.dtype).expand_as(tensor)

    return hook


def mask_sources_hook(sources: Sequence[int]) -> Callable:
    """Hook on a depth attention's `hook_logits` that knocks `sources` out of its softmax."""
    index = torch.tensor(list(sources))

    def hook(logits: torch.Tensor, hook) -> torch.Tensor:
        return logits.index_fill(-1, index.to(logits.device), float("-inf"))

    return hook


def _zero(tensor: torch.Tensor, hook) -> torch.Tensor:
    return torch.zeros_like(tensor)


def removal_hooks(model: HookedTransformer, removed: Iterable[int]) -> list[Hook]:
    """Hooks that remove the sublayers in `removed` (see the module docstring for the rule)."""
    removed = set(removed)
    bad = sorted(j for j in removed if not 0 <= j < model.cfg.n_sublayers)
    if bad:
        raise ValueError(f"sublayers {bad} are out of range 0..{model.cfg.n_sublayers - 1}")
    hooks: list[Hook] = [(model.sublayer_output_hook(j), _zero) for j in sorted(removed)]
    for consumer, module in model.depth_attention_modules().items():
        emptied = [s for s, members in enumerate(model.sources(consumer)) if set(members) <= removed]
        if emptied:
            hooks.append((module.hook_logits.name, mask_sources_hook(emptied)))
    return hooks


def source_mask_hooks(model: HookedTransformer, consumer: int, sources: Sequence[int]) -> list[Hook]:
    """Hooks that knock `sources` out of one consumer's depth softmax (AttnRes only)."""
    modules = model.depth_attention_modules()
    if consumer not in modules:
        raise ValueError(f"consumer {consumer} has no depth attention (residual={model.cfg.residual!r})")
    n_sources = len(model.sources(consumer))
    if not sources or any(not 0 <= s < n_sources for s in sources) or len(set(sources)) >= n_sources:
        raise ValueError(f"consumer {consumer} reads {n_sources} sources; cannot mask {list(sources)}")
    return [(modules[consumer].hook_logits.name, mask_sources_hook(sources))]


def resample_permutation(batch_size: int) -> torch.Tensor:
    """Each sequence takes its activations from the next one (a derangement, so never from itself)."""
    if batch_size < 2:
        raise ValueError("resample ablation needs at least 2 sequences (samples >= 2)")
    return torch.roll(torch.arange(batch_size), -1)
