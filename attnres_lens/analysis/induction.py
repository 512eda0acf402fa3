"""Induction-head scores per layer × head, and the in-context-learning score (docs/analysis.md §2-§3).

All head scores are measured on repeated random tokens `[BOS, r_1…r_L, r_1…r_L]`, where the second half is
predictable only by induction. Two attention-pattern scores on *different scales* are reported side by side;
never compare one against the other's thresholds:

* `prefix_score` — ARENA/Olsson prefix matching, `mean_q A[q, q−(L−1)]` over the second-half queries.
  Ceiling ≈ 1.
* `tl_induction_score` — TransformerLens `head_detector.detect_head(…, "induction_head")` (error measure
  "mul"): attention on every "token after an earlier copy of mine" key, divided by all attention, over all
  queries including the first half. Ceiling ≈ L / (2L + 1) ≈ 0.5 on a 2× repeat.

Because a KV-shift head's values mix two tokens, patterns alone mislead, so two output-side scores follow:

* `copying_score` — direct logit attribution of the head's OV output to the correct next token, in logits.
  For each answer position (second half) the head's output `o = z_h · W_O[h]` is carried straight to the
  logits along the direct path with everything else frozen at the clean run: through the final readout's
  depth weight of the source holding the head's sublayer (1 for the standard residual), the final RMSNorm
  (clean per-token scale, learned gain) and `W_U`. The score is the logit this gives the correct next token
  minus its mean over the vocabulary, averaged over answer positions (0 for a head that writes nothing;
  positive when the head copies the token it should predict).
* `ablation_zero_score`, `ablation_mean_score` — increase of the loss on the repeated half (the answer
  positions) when the head's output `z_h` is zeroed, or replaced by its mean over batch and positions.

On a bridged Inkling-2 / Inkling-2-Mini (`attnres_lens.from_transformers`) the rows are per (layer, visit, head),
`visit` as in the bridge's hook names (1, 2, … on the Mini's looped layers, 0 on a layer that runs once), read from
`blocks.{l}[.visit{v}].attn.hook_pattern` (transformers' eager softmax, the sink's column dropped). The prefix and
previous-token scores and `ablation_zero_score` (the head's pattern row zeroed, which zeroes its `z_h` exactly) are
computed; the other columns are NaN, for the reasons in `BRIDGE_NAN_REASONS` (docs/analysis.md §2).
"""

from __future__ import annotations

import pandas as pd
import torch
from transformer_lens.head_detector import detect_head
from transformer_lens.utilities import get_act_name

from attnres_lens.analysis.applicability import bridged_inkling
from attnres_lens.analysis.engine import capture, evaluate, evaluate_many
from attnres_lens.analysis.interventions import replace_hook
from attnres_lens.analysis.workers import analysis_workers
from attnres_lens.mixing import basis_index, mixing_coefficients
from attnres_lens.model import HookedTransformer, next_token_loss
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.recorder import prefix_matching_score
from attnres_lens.tasks import make_task
from attnres_lens.tasks.base import BOS, IGNORE_INDEX, Batch, Task, check_batch

# Columns of `induction_head_scores` left NaN on a bridged Inkling model, and why (docs/analysis.md §2).
BRIDGE_NAN_REASONS = {
    "tl_induction_score": "TransformerLens' detect_head runs a HookedTransformer on prompt strings; the bridge is not one",
    "copying_score": "the direct path of a head's output to the logits is defined for the toolkit's own readout "
    "(one W_O per head, a final depth mix of raw values); Inkling's readout mixes normalised sources",
    "ablation_mean_score": "the bridge exposes no per-head output z_h to replace by its mean (a pattern hook can only "
    "zero it)",
}


def repeated_batch(n_samples: int, half_len: int, vocab_size: int, seed: int = 0) -> Batch:
    """The fixed repeated-tokens probe: `n_samples` sequences `[BOS, r, r]`, answers on the second half."""
    return make_task("repeated", vocab_size=vocab_size, seq_len=2 * half_len + 1, seed=seed).eval_batch(n_samples)


def task_probe(model: HookedTransformer | DepthMixingModel, task: Task, n_samples: int) -> Batch:
    """The repeated-tokens probe of a run's analyses: `n_samples` sequences at the model's longest probe length, in
    the task's vocabulary and from its seed, so `analyze`, `attribute` and the dashboard score the same tokens."""
    return repeated_batch(n_samples, default_half_len(model), task.vocab_size, seed=task.seed)


def default_half_len(model: HookedTransformer | DepthMixingModel) -> int:
    """Longest L with `2L + 1 < n_ctx`: `detect_head` needs a sequence strictly shorter than the context. On a
    bridged Inkling model: `inkling_taps.probe_half_len` (no longer than a sliding window)."""
    inkling = bridged_inkling(model)
    if inkling is not None:
        from attnres_lens.analysis.inkling_taps import probe_half_len  # it imports this module

        return probe_half_len(inkling)
    half_len = (model.cfg.n_ctx - 2) // 2
    if half_len < 2:
        raise ValueError(f"n_ctx={model.cfg.n_ctx} is too short for a repeated-tokens probe (needs n_ctx >= 6)")
    return half_len


def _check_repeated(tokens: torch.Tensor) -> int:
    half_len = (tokens.shape[1] - 1) // 2
    if tokens.shape[1] != 2 * half_len + 1 or half_len < 2:
        raise ValueError(f"repeated tokens must have odd length 2L+1 with L >= 2, got length {tokens.shape[1]}")
    if not (tokens[:, 1 : half_len + 1] == tokens[:, half_len + 1 :]).all() or not (tokens[:, 0] == BOS).all():
        raise ValueError("tokens must be [BOS, r, r] repeated sequences (see `repeated_batch`)")
    return half_len


@torch.no_grad()
def induction_head_scores(
    model: HookedTransformer | DepthMixingModel,
    batch: Batch | None = None,
    n_samples: int = 32,
    vocab_size: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> pd.DataFrame:
    """One row per (layer, head): prefix_score, tl_induction_score, previous_token_score, copying_score,
    ablation_zero_score, ablation_mean_score (definitions in the module docstring).

    `batch` is a repeated-tokens batch (default: `repeated_batch(n_samples, default_half_len(model),
    vocab_size or d_vocab, seed)`). On a bridged Inkling model, one row per (layer, visit, head) (module docstring).
    """
    if batch is not None:
        check_batch(batch)
    if not isinstance(model, HookedTransformer):
        return _bridged_scores(model, batch, n_samples, vocab_size, seed)
    cfg = model.cfg
    if batch is None:
        batch = repeated_batch(n_samples, default_half_len(model), vocab_size or cfg.d_vocab, seed)
    batch = batch.to(model.embed.W_E.device)
    tokens = batch.tokens
    half_len = _check_repeated(tokens)

    pattern_names = [get_act_name("pattern", layer) for layer in range(cfg.n_layers)]
    z_names = [get_act_name("z", layer) for layer in range(cfg.n_layers)]
    clean = capture(model, tokens, pattern_names + z_names + ["ln_final.hook_scale"])

    # TL's detector reads one prompt as a string; averaging over prompts is what it does for a list itself
    # (its list path first calls `to_tokens` on the whole list, which our model does not take).
    tl_scores = torch.stack(
        [detect_head(model, " ".join(map(str, row)), "induction_head") for row in tokens.tolist()]
    ).mean(0)
    copying = _copying_scores(model, batch, clean)
    base_loss = evaluate(model, batch).answer_loss

    heads = [(layer, head) for layer in range(cfg.n_layers) for head in range(cfg.n_heads)]
    ablations = []
    for layer, head in heads:
        z = clean[z_names[layer]]
        one_head = torch.zeros(cfg.n_heads, 1, dtype=z.dtype, device=z.device)
        one_head[head] = 1
        zeroed = z * (1 - one_head)
        mean_ablated = zeroed + one_head * z[:, :, head].mean(dim=(0, 1))
        ablations += [[(z_names[layer], replace_hook(zeroed))], [(z_names[layer], replace_hook(mean_ablated))]]
    ablated = iter(
        evaluate_many(
            model, batch, ablations, progress=progress, desc="ablating heads", workers=analysis_workers(model)
        )
    )
    rows = []
    for layer, head in heads:
        pattern = clean[pattern_names[layer]]
        rows.append(
            dict(
                layer=layer,
                head=head,
                prefix_score=prefix_matching_score(pattern, half_len)[head].item(),
                tl_induction_score=tl_scores[layer, head].item(),
                previous_token_score=pattern[:, head].diagonal(offset=-1, dim1=-2, dim2=-1).float().mean().item(),
                copying_score=copying[layer, head].item(),
                ablation_zero_score=next(ablated).answer_loss - base_loss,
                ablation_mean_score=next(ablated).answer_loss - base_loss,
            )
        )
    return pd.DataFrame(rows)


def _bridged_scores(
    model: DepthMixingModel, batch: Batch | None, n_samples: int, vocab_size: int | None, seed: int
) -> pd.DataFrame:
    """`induction_head_scores` on a bridged Inkling model: the pattern scores and the zero ablation per visit."""
    if bridged_inkling(model) is None:
        raise ValueError(
            f"induction-head scores run on the toolkit's HookedTransformer or a bridged Inkling-2 / Inkling-2-Mini, "
            f"got {type(model).__name__}"
        )
    if batch is None:
        batch = repeated_batch(n_samples, default_half_len(model), vocab_size or model.d_vocab, seed)
    batch = batch.to(model_device(model))
    half_len = _check_repeated(batch.tokens)
    names = pattern_hooks(model)
    clean = capture(model, batch.tokens, names.values())
    base_loss = evaluate(model, batch).answer_loss
    rows = []
    for (layer, visit), name in names.items():
        pattern = clean[name]
        for head in range(pattern.shape[1]):

            def zero_head(pattern: torch.Tensor, hook, head: int = head) -> torch.Tensor:
                pattern = pattern.clone()
                pattern[:, head] = 0
                return pattern

            rows.append(
                dict(
                    layer=layer,
                    visit=visit,
                    head=head,
                    prefix_score=prefix_matching_score(pattern, half_len)[head].item(),
                    tl_induction_score=float("nan"),
                    previous_token_score=pattern[:, head].diagonal(offset=-1, dim1=-2, dim2=-1).float().mean().item(),
                    copying_score=float("nan"),
                    ablation_zero_score=evaluate(model, batch, [(name, zero_head)]).answer_loss - base_loss,
                    ablation_mean_score=float("nan"),
                )
            )
    return pd.DataFrame(rows)


def pattern_hooks(model: DepthMixingModel) -> dict[tuple[int, int], str]:
    """A bridged Inkling model's attention-pattern hook names by (layer, visit), in forward order (visit 1, 2, … on
    a looped layer, 0 on a layer that runs once; docs/interop.md §7)."""
    return {
        (step.layer, step.visit or 0): model.layer_hooks(step.layer, step.visit).attn.hook_pattern.name
        for step in model.visits
    }


def head_row_labels(scores: pd.DataFrame) -> pd.Series:
    """'L{layer}' per row of an induction or tap table, 'L{layer}@{visit}' for a looped layer's visit (a bridged
    Mini), so a layer × head view keeps every visit apart."""
    visits = scores["visit"] if "visit" in scores else pd.Series(0, index=scores.index)
    return pd.Series(
        [f"L{layer}" if not visit else f"L{layer}@{visit}" for layer, visit in zip(scores["layer"], visits)],
        index=scores.index,
    )


def _copying_scores(model: HookedTransformer, batch: Batch, clean: dict[str, torch.Tensor]) -> torch.Tensor:
    """[n_layers, n_heads] direct-path logit of the correct next token minus the vocabulary mean."""
    cfg = model.cfg
    answers = batch.answer_mask & (batch.targets != IGNORE_INDEX)
    targets = batch.targets[answers]  # [n_answers]
    # in at least float32 whatever the model's dtype: the readout weights come in float32 or wider, and a bf16
    # difference of logits would keep ~3 significant digits
    dtype = torch.promote_types(model.unembed.W_U.dtype, torch.float32)
    scale = clean["ln_final.hook_scale"][answers].to(dtype)  # [n_answers, 1]
    unembed = (model.ln_final.w[:, None] * model.unembed.W_U).to(dtype)  # gain folded into W_U: [d_model, d_vocab]
    scores = torch.zeros(cfg.n_layers, cfg.n_heads)
    readout = mixing_coefficients(model, batch.tokens, per_group=True)[..., cfg.n_sublayers, :]  # [b, p, groups, J+1]
    readout = readout.to(scale.device)
    for layer, block in enumerate(model.blocks):
        z = clean[get_act_name("z", layer)][answers].to(dtype)  # [n_answers, head, d_head]
        head_out = torch.einsum("nhd,hdm->nhm", z, block.attn.W_O.to(dtype)) / scale[:, None]
        head_out = head_out * _direct_path_weight(model, layer, readout, answers).to(dtype)[:, None, :]
        logits = head_out @ unembed  # [n_answers, head, d_vocab]
        correct = logits.gather(-1, targets[:, None, None].expand(-1, cfg.n_heads, 1)).squeeze(-1)
        scores[layer] = (correct - logits.mean(-1)).float().mean(0).cpu()
    return scores


def _direct_path_weight(
    model: HookedTransformer, layer: int, readout: torch.Tensor, answers: torch.Tensor
) -> torch.Tensor:
    """Per answer position and channel, the weight with which the final readout reads layer's attention output:
    its column of the depth-mixing matrix (1 for the standard residual), `[n_answers, d_model]`."""
    sublayer = layer if model.cfg.attn_only else 2 * layer
    groups = readout[..., basis_index(sublayer)][answers]  # [n_answers, channel groups]
    return groups.repeat_interleave(model.cfg.d_model // groups.shape[-1], dim=-1)


@torch.no_grad()
def per_position_loss(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """Mean next-token loss at each position t (predicting token t+1): columns position, loss."""
    tokens = model.to_tokens(tokens)
    losses = next_token_loss(model(tokens), tokens, per_token=True).mean(0)
    return pd.DataFrame({"position": range(len(losses)), "loss": losses.cpu().numpy()})


def in_context_learning_score(
    per_position: pd.DataFrame, early: tuple[float, float] = (0.1, 0.2), late: tuple[float, float] = (0.9, 1.0)
) -> float:
    """Loss late in context minus loss early in context (Olsson et al.; negative = the context helps).

    Windows are fractions of the predicted positions: by default the mean loss over the positions in the
    last tenth minus the mean over those between 10% and 20% of the context.
    """
    n = len(per_position)
    if n < 10:
        raise ValueError(f"need at least 10 predicted positions for an in-context-learning score, got {n}")

    def window(bounds: tuple[float, float]) -> float:
        start, stop = int(bounds[0] * n), max(int(bounds[0] * n) + 1, int(bounds[1] * n))
        return float(per_position["loss"].iloc[start:stop].mean())

    return window(late) - window(early)
