"""Causal depth routing (docs/analysis.md §9, AttnRes models): is the α mass a source receives its causal importance?

For every consumer (sublayer or final readout) with at least two sources and every source s it reads, the
source is knocked out of that consumer's softmax alone (logit → −inf, the rest renormalise; later consumers
are untouched) and the loss change is measured. It sits beside the token-averaged α mass the source had.
Routing mass is not causal importance (arXiv 2606.13168): a source can take mass while carrying little the
consumer needs, or take little mass that matters.
"""

from __future__ import annotations

import pandas as pd

from attnres_lens.analysis.depth import depth_weights_by_consumer, edge_info
from attnres_lens.analysis.engine import evaluate, evaluate_many
from attnres_lens.analysis.interventions import source_mask_hooks
from attnres_lens.analysis.pruning import spearman
from attnres_lens.analysis.workers import analysis_workers
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.tasks.base import Batch, check_scored_batch


def causal_routing(model: DepthMixingModel, batch: Batch, progress: bool = False) -> pd.DataFrame:
    """One row per (consumer, source) of consumers with ≥ 2 sources: consumer, consumer_label, kind, source,
    source_label, members (sublayer indices summed in the source, −1 = embedding), alpha_mass, delta_loss,
    delta_accuracy. A knockout takes the source out of every route of the consumer; alpha_mass is then the mass
    averaged over its routes. Message consumers (Inkling-2-Mini's 'L2.msg@2', kind 'msg') come after the
    sublayer consumers, as consumer J + 1 + k (`protocol.consumer_index`)."""
    batch = check_scored_batch(batch.to(model_device(model)), model.d_vocab)
    weights = depth_weights_by_consumer(model, batch.tokens)
    base = evaluate(model, batch)
    pairs = [(c, s) for c, w in weights.items() if w.shape[-1] > 1 for s in range(w.shape[-1])]
    results = evaluate_many(
        model,
        batch,
        [source_mask_hooks(model, consumer, [source]) for consumer, source in pairs],
        progress=progress,
        desc="masking depth sources",
        workers=analysis_workers(model),
    )
    rows = []
    for (consumer, source), result in zip(pairs, results):
        rows.append(
            dict(
                **edge_info(model, consumer, source),
                alpha_mass=weights[consumer][..., source].mean().item(),
                delta_loss=result.loss - base.loss,
                delta_accuracy=result.accuracy - base.accuracy,
            )
        )
    return pd.DataFrame(rows)


def routing_correlations(routing: pd.DataFrame) -> dict[str, float]:
    """Spearman(α mass, Δloss) over all pairs (`overall`), and its mean over consumers with ≥ 3 sources
    (`within_consumer`), which removes the trivial effect of consumers with few sources having large α."""
    per_consumer = [
        spearman(group["alpha_mass"], group["delta_loss"])
        for _, group in routing.groupby("consumer")
        if len(group) >= 3
    ]
    per_consumer = [value for value in per_consumer if value == value]  # drop NaN (constant columns)
    return dict(
        overall=spearman(routing["alpha_mass"], routing["delta_loss"]),
        within_consumer=float(sum(per_consumer) / len(per_consumer)) if per_consumer else float("nan"),
    )


def routing_disagreements(routing: pd.DataFrame, top: int = 10) -> pd.DataFrame:
    """The `top` pairs whose percentile rank by Δloss and by α mass differ most: `rank_gap` = rank(Δloss) −
    rank(mass), positive when the source matters more than its mass suggests."""
    ranked = routing.assign(
        effect_rank=routing["delta_loss"].rank(pct=True), mass_rank=routing["alpha_mass"].rank(pct=True)
    )
    ranked["rank_gap"] = ranked["effect_rank"] - ranked["mass_rank"]
    ranked["direction"] = ranked["rank_gap"].map(
        lambda gap: "matters more than its mass" if gap > 0 else "mass exceeds its effect"
    )
    order = ranked["rank_gap"].abs().sort_values(ascending=False, kind="stable").index
    return ranked.loc[order].head(top).reset_index(drop=True)
