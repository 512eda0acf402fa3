"""Snapshots of a model's internals during training, read through hook points only (docs/run_directory.md §4-§5).

Each `record(step)` runs one forward and backward pass on a fixed evaluation batch and one forward pass
on a fixed repeated-tokens probe, and appends long-format rows to these tables:

* `depth_weights`: step, consumer, consumer_label, kind, source, source_label, weight (token-averaged α)
* `depth_mixing`: step, consumer, consumer_label, sublayer, sublayer_label, weight (the token-averaged depth-mixing
  matrix M of `attnres_lens.mixing`, for every residual kind)
* `magnitudes`: step, sublayer, label, kind, output_rms (RMS over d_model of f_j, token-averaged),
  input_rms (RMS of the sublayer's input), grad_norm (‖∂loss/∂f_j‖ over d_model, token-averaged; the
  loss is the token-mean cross-entropy)
* `param_grad_norms`: step, block ("embed", "blocks.0", …, "final_res", "ln_final", "unembed"), grad_norm
* `induction_scores`: step, layer, head, prefix_score (ARENA/Olsson: mean_q A[q, q−(L−1)] over the
  second half of [BOS, r, r]; ceiling ≈ 1)
* `kv_shift`: step, layer, head, alpha1, alpha2, beta1, beta2 (KV-shift models only)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd
import torch
from transformer_lens.utilities import get_act_name

from attnres_lens.mixing import mixing_coefficients, mixing_rows
from attnres_lens.model import HookedTransformer, next_token_loss
from attnres_lens.tasks.base import Batch


class Recorder:
    """Appends the tables above at each `record(step)`, on fixed batches so successive snapshots differ only by
    training; `rows` holds them until the trainer writes them (docs/run_directory.md §4)."""

    def __init__(self, model: HookedTransformer, eval_batch: Batch, probe_tokens: torch.Tensor):
        self.model = model
        self.eval_batch = eval_batch
        self.probe_tokens = probe_tokens
        self.rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        cfg = model.cfg
        self.sublayers = [(j, model.sublayer_name(j)) for j in range(cfg.n_sublayers)]
        self.depth_modules = {j: module.hook_weights.name for j, module in model.depth_attention_modules().items()}

    def record(self, step: int) -> None:
        """One snapshot at `step`, in eval mode; the model's mode is restored after, so recording never changes
        training."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            self._record_activations_and_gradients(step)
            self._record_induction(step)
            self._record_kv_shift(step)
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)

    def _record_activations_and_gradients(self, step: int) -> None:
        model = self.model
        wanted = set(self.depth_modules.values())
        for j, _ in self.sublayers:
            wanted |= {model.sublayer_output_hook(j), model.sublayer_input_hook(j)}
        wanted.add("ln_final.hook_scale")
        forward: dict[str, torch.Tensor] = {}
        grads: dict[str, torch.Tensor] = {}

        def save_forward(tensor: torch.Tensor, hook) -> None:
            forward[hook.name] = tensor.detach()

        def save_grad(tensor: torch.Tensor, hook) -> None:
            grads[hook.name] = tensor.detach()

        outputs = [model.sublayer_output_hook(j) for j, _ in self.sublayers]
        model.zero_grad(set_to_none=True)
        with model.hooks(
            fwd_hooks=[(name, save_forward) for name in wanted], bwd_hooks=[(name, save_grad) for name in outputs]
        ):
            logits = model(self.eval_batch.tokens)
            next_token_loss(logits, self.eval_batch.tokens).backward()

        for consumer, hook_name in self.depth_modules.items():
            weights = forward[hook_name].float().flatten(0, -2).mean(0)  # token- (and head-) averaged α
            labels = model.source_labels(consumer)
            consumer_label = model.sublayer_name(consumer)
            kind = model.sublayer_kind(consumer)
            for source, (label, weight) in enumerate(zip(labels, weights.tolist())):
                self.rows["depth_weights"].append(
                    dict(
                        step=step,
                        consumer=consumer,
                        consumer_label=consumer_label,
                        kind=kind,
                        source=source,
                        source_label=label,
                        weight=weight,
                    )
                )
        mixing = mixing_coefficients(model, self.eval_batch.tokens).mean(dim=(0, 1))
        self.rows["depth_mixing"] += [dict(step=step, **row) for row in mixing_rows(model, mixing)]
        for j, label in self.sublayers:
            self.rows["magnitudes"].append(
                dict(
                    step=step,
                    sublayer=j,
                    label=label,
                    kind=model.sublayer_kind(j),
                    output_rms=rms(forward[model.sublayer_output_hook(j)]),
                    input_rms=rms(forward[model.sublayer_input_hook(j)]),
                    grad_norm=grads[model.sublayer_output_hook(j)].float().norm(dim=-1).mean().item(),
                )
            )
        self.rows["magnitudes"].append(
            dict(
                step=step,
                sublayer=model.cfg.n_sublayers,
                label="final",
                kind="final",
                output_rms=float("nan"),
                input_rms=forward["ln_final.hook_scale"].float().mean().item(),
                grad_norm=float("nan"),
            )
        )
        for block, params in parameter_blocks(model).items():
            squares = [p.grad.float().pow(2).sum() for p in params if p.grad is not None]
            norm = torch.stack(squares).sum().sqrt().item() if squares else 0.0
            self.rows["param_grad_norms"].append(dict(step=step, block=block, grad_norm=norm))

    def _record_induction(self, step: int) -> None:
        patterns: dict[str, torch.Tensor] = {}
        with (
            torch.no_grad(),
            self.model.hooks(
                fwd_hooks=[
                    (lambda name: name.endswith("hook_pattern"), lambda t, hook: patterns.__setitem__(hook.name, t))
                ]
            ),
        ):
            self.model(self.probe_tokens, return_type=None)
        half = (self.probe_tokens.shape[1] - 1) // 2
        for layer in range(self.model.cfg.n_layers):
            scores = prefix_matching_score(patterns[get_act_name("pattern", layer)], half)
            for head, score in enumerate(scores.tolist()):
                self.rows["induction_scores"].append(dict(step=step, layer=layer, head=head, prefix_score=score))

    def _record_kv_shift(self, step: int) -> None:
        if self.model.cfg.attention != "kv_shift":
            return
        for layer, block in enumerate(self.model.blocks):
            for head, (a1, a2, b1, b2) in enumerate(block.attn.kv_shift.detach().float().tolist()):
                self.rows["kv_shift"].append(
                    dict(step=step, layer=layer, head=head, alpha1=a1, alpha2=a2, beta1=b1, beta2=b2)
                )

    def tables(self) -> dict[str, pd.DataFrame]:
        return {name: pd.DataFrame(rows) for name, rows in self.rows.items()}

    def load(self, tables: dict[str, pd.DataFrame], up_to_step: int) -> None:
        """Resume: keep the rows recorded at or before `up_to_step` (later ones are recorded again)."""
        for name, frame in tables.items():
            self.rows[name] = frame[frame["step"] <= up_to_step].to_dict("records")


def rms(x: torch.Tensor) -> float:
    """RMS over the last dimension, averaged over every other dimension."""
    return x.float().pow(2).mean(-1).sqrt().mean().item()


def prefix_matching_score(pattern: torch.Tensor, half_len: int) -> torch.Tensor:
    """Per-head mean of A[q, q − (L − 1)] over the second-half queries q = L+1 … 2L of [BOS, r, r].

    `pattern` is [batch, head, q, k]; the key q − L + 1 holds the token that followed q's token
    the previous time it occurred.
    """
    queries = torch.arange(half_len + 1, 2 * half_len + 1, device=pattern.device)
    return pattern[:, :, queries, queries - half_len + 1].float().mean(dim=(0, 2))


def parameter_blocks(model: HookedTransformer) -> dict[str, list[torch.nn.Parameter]]:
    """Parameters grouped by top-level block: 'embed', 'blocks.0', …, 'final_res' / 'final_hc', 'ln_final',
    'unembed'."""
    groups: dict[str, list[torch.nn.Parameter]] = defaultdict(list)
    for name, param in model.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        groups[key].append(param)
    return dict(groups)
