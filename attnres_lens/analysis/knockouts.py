"""Exact edge knockouts in two stages (docs/analysis.md §11, "Depth edges"): what `attribute` ranks depth edges by.

An edge is (consumer c, source s): knocking s out of c's depth softmax alone (logit → −inf, the others
renormalise; later consumers untouched) changes the loss by Δ(c, s), the quantity `causal_routing` measures. On
trained models no first-order estimate ranks these faithfully (the loss along a knockout path is flat, then at
least quadratic), so they are measured, not estimated, at a reduced cost:

1. **screen**: every edge is knocked out on a fixed random subset of the sequences (`screen_fraction` of them);
2. **re-measure**: the `remeasure` edges with the largest |Δ| on the screen are knocked out on the remaining
   sequences too, so their Δ is exact on the whole batch (the screen's per-sequence losses are reused).

Each row says which set its Δ was measured on. Δ is the loss change over the measured sequences' target
positions (the evaluation metric's mean, so on every sequence it equals `causal_routing`'s `delta_loss`), with a
95% percentile bootstrap interval over those sequences. The cost in knockout passes, relative to knocking every
edge out on every sequence, is `screen_fraction + (1 − screen_fraction) · min(remeasure, n_edges) / n_edges`.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from attnres_lens.analysis.depth import depth_weights_by_consumer, edge_info
from attnres_lens.analysis.engine import evaluate_many
from attnres_lens.analysis.interventions import Hook, source_mask_hooks
from attnres_lens.analysis.pruning import spearman
from attnres_lens.analysis.workers import analysis_workers
from attnres_lens.evaluation import per_sequence_losses
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.tasks.base import IGNORE_INDEX, Batch, check_scored_batch

SCREEN_FRACTION = 0.25
REMEASURE = 20


def edge_knockouts(
    model: DepthMixingModel,
    batch: Batch,
    *,
    screen_fraction: float = SCREEN_FRACTION,
    remeasure: int = REMEASURE,
    n_boot: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> pd.DataFrame:
    """Δloss of knocking each source out of each consumer (consumers with ≥ 2 sources), measured exactly in two
    stages (module docstring); `screen_fraction=1` measures every edge on every sequence.

    Message consumers (`protocol.message_consumers`: Inkling-2-Mini's 'L2.msg@2', kind 'msg') are knocked out
    like the others, as consumer J + 1 + k (`protocol.consumer_index`). One row per edge, ranked by Δloss (rank 1 = the edge whose removal hurts most): consumer,
    consumer_label, kind, source, source_label, members, alpha_mass, delta_loss with delta_loss_low /
    delta_loss_high, sequences (how many it was measured on), measured ('all' or 'screen'), rank. `attrs["cost"]` is the knockout passes run
    relative to every edge on every sequence; `attrs["screen"]` the screen's sequence indices.
    """
    if isinstance(screen_fraction, bool) or not isinstance(screen_fraction, (int, float)):
        raise ValueError(f"screen_fraction must be a number in (0, 1], got {screen_fraction!r}")
    if not 0 < screen_fraction <= 1:
        raise ValueError(
            f"screen_fraction must be in (0, 1] (1 measures every edge on every sequence), got {screen_fraction}"
        )
    if isinstance(remeasure, bool) or not isinstance(remeasure, int) or remeasure < 0:
        raise ValueError(f"remeasure must be an integer >= 0 (edges re-measured on every sequence), got {remeasure!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
        raise ValueError(f"n_boot must be an integer >= 10, got {n_boot!r}")
    batch = check_scored_batch(batch.to(model_device(model)), model.d_vocab)
    n_seq = batch.tokens.shape[0]
    n_screen = math.ceil(screen_fraction * n_seq)
    if n_screen < 2:
        raise ValueError(
            f"the screen holds {n_screen} of {n_seq} sequences; a bootstrap needs at least 2: raise samples or "
            "screen_fraction"
        )
    order = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed))
    screen, rest = order[:n_screen].sort().values, order[n_screen:].sort().values
    weights = depth_weights_by_consumer(model, batch.tokens)
    edges = [(c, s) for c, w in weights.items() if w.shape[-1] > 1 for s in range(w.shape[-1])]  # consumer order
    if not edges:
        raise ValueError("no consumer of this model reads two or more sources: there is no edge to knock out")
    counts = (batch.targets != IGNORE_INDEX).sum(-1).double().cpu()

    def losses(rows: torch.Tensor, knocked: list[tuple[int, int]], stage: str) -> list[torch.Tensor]:
        """Per-sequence summed losses of `rows`: the clean model first, then each knockout."""
        interventions: list[list[Hook]] = [[]] + [source_mask_hooks(model, c, [s]) for c, s in knocked]
        return evaluate_many(
            model,
            _rows(batch, rows),
            interventions,
            progress=progress,
            desc=f"edge knockouts ({stage})",
            score=lambda logits, part: per_sequence_losses(logits, part.targets),
            workers=analysis_workers(model),
        )

    clean_screen, *screened = losses(screen, edges, "screen")
    diffs = {edge: knocked - clean_screen for edge, knocked in zip(edges, screened)}  # [n_screen] each
    screen_delta = {edge: float(diffs[edge].sum() / counts[screen].sum()) for edge in edges}
    chosen = sorted(edges, key=lambda edge: -abs(screen_delta[edge]))[:remeasure] if len(rest) else []
    full: dict[tuple[int, int], torch.Tensor] = {}
    if chosen:
        clean_rest, *remeasured = losses(rest, chosen, "re-measure")
        for edge, knocked in zip(chosen, remeasured):
            per_sequence = torch.empty(n_seq, dtype=torch.float64)
            per_sequence[screen], per_sequence[rest] = diffs[edge], knocked - clean_rest
            full[edge] = per_sequence
    if not len(rest):  # the screen is the whole batch: every edge is measured on every sequence
        full = {edge: diffs[edge] for edge in edges}
    boot = bootstrap_weights(n_seq, n_boot, seed)
    screen_boot = bootstrap_weights(n_screen, n_boot, seed)
    rows = []
    for edge in edges:
        consumer, source = edge
        if edge in full:
            diff, use, draws, measured = full[edge], counts, boot, "all"
        else:
            diff, use, draws, measured = diffs[edge], counts[screen], screen_boot, "screen"
        samples = (draws @ diff) / (draws @ use)
        low, high = torch.quantile(samples, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        rows.append(
            dict(
                **edge_info(model, consumer, source),
                alpha_mass=weights[consumer][..., source].mean().item(),
                delta_loss=float(diff.sum() / use.sum()),
                delta_loss_low=low,
                delta_loss_high=high,
                sequences=len(diff),
                measured=measured,
            )
        )
    frame = pd.DataFrame(rows).sort_values("delta_loss", ascending=False, kind="stable").reset_index(drop=True)
    frame["rank"] = range(1, len(frame) + 1)
    frame.attrs["cost"] = (len(edges) * n_screen + len(chosen) * len(rest)) / (len(edges) * n_seq)
    frame.attrs["screen"] = screen.tolist()
    return frame


def ranking_agreement(estimate: pd.Series, exact: pd.Series, top: int = 10) -> dict[str, float]:
    """How well `estimate` ranks the edges as `exact` does (two Series on the same index, e.g. (consumer, source)):
    Spearman and Pearson correlations, and top-`top` recall: the share of the `top` edges with the largest exact
    Δloss (the knockouts that hurt most) that are also among the estimate's `top` largest."""
    if not estimate.index.equals(exact.index):
        exact = exact.reindex(estimate.index)
    if exact.isna().any():
        raise ValueError("the estimate and the exact table must cover the same edges")
    k = min(top, len(exact))
    largest = set(exact.sort_values(ascending=False, kind="stable").index[:k])
    found = set(estimate.sort_values(ascending=False, kind="stable").index[:k])
    return dict(
        spearman=spearman(estimate, exact),
        pearson=float(estimate.astype(float).corr(exact.astype(float))),
        top_recall=len(largest & found) / k if k else float("nan"),
        top=k,
    )


def _rows(batch: Batch, rows: torch.Tensor) -> Batch:
    index = rows.to(batch.tokens.device)
    return Batch(
        batch.tokens[index],
        batch.targets[index],
        batch.answer_mask[index],
        {name: value[index] for name, value in batch.layout.items()},
    )


def bootstrap_weights(n: int, n_boot: int, seed: int) -> torch.Tensor:
    """[n_boot, n] float64: how often each of n sequences is drawn in each resample of a bootstrap over sequences
    (a one-hot sum would hold n_boot·n² values); a ratio of sums over sequences resamples as `(w @ a) / (w @ b)`."""
    draws = torch.randint(0, n, (n_boot, n), generator=torch.Generator().manual_seed(seed))
    return torch.zeros(n_boot, n, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_boot, n, dtype=torch.float64)
    )
