"""Layer-pruning sensitivity (docs/analysis.md §7-§8): which sublayers can go, measured and predicted.

Measured, one row per sublayer j (Δ = intervened − clean, on a task batch; accuracy on its answer positions):

* remove: the residual kind's own removal (see `attnres_lens.analysis.interventions`): standard, drop f_j
  from the residual sum; Full AttnRes, mask f_j's source in every later softmax; Block AttnRes, subtract f_j
  from its block sum (mask the source if f_j was alone in it);
* mean: f_j replaced by its mean over batch and positions;
* resample: f_j taken from another sequence of the batch (each sequence from the next one).

Cheap predictors from one clean forward pass (higher = more important):

* block_influence — ShortGPT's `1 − E_t cos(h_in, h_out)` with `h_in = h_j` (the sublayer's input) and
  `h_out = h_j + f_j` (its input plus its output), averaged over every token;
* angular_distance_next — Gromov et al.'s `arccos(cos(x_j, x_{j+1}))/π`, token-averaged, where `x_ℓ` is
  the representation entering sublayer ℓ (`x_J` = the final readout's input, before the final norm);
* relative_output_norm — `E_t ‖f_j‖ / ‖h_j‖`;
* routing_mass (every kind but the standard residual; a protocol model where M is defined) — mean over later consumers (final readout included) of the depth-mixing weight
  M[c, j] that f_j receives.

`angular_distance_matrix` gives `d(ℓ, ℓ+n)` for every start ℓ and span n: removing sublayers ℓ … ℓ+n−1
replaces `x_{ℓ+n}` by something close to `x_ℓ` when it is small.

Cumulative curves remove k = 0, 1, … sublayers (until the loss has doubled, by default) in these orders: `measured` (ascending one-at-a-time
Δloss, or accuracy drop with metric="accuracy"; a static greedy order), each cheap metric (ascending),
`similar_block` (for each n, the contiguous block ℓ … ℓ+n−1 with the smallest `d(ℓ, ℓ+n)`) and `drop_deepest`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from attnres_lens.analysis.depth import depth_mixing_matrix
from attnres_lens.analysis.engine import StateCache, capture, evaluate, evaluate_many
from attnres_lens.analysis.interventions import removal_hooks, replace_hook, resample_permutation
from attnres_lens.analysis.session import clean_result
from attnres_lens.analysis.workers import analysis_workers
from attnres_lens.analysis_options import check_metric
from attnres_lens.evaluation import Evaluation
from attnres_lens.mixing import check_mixing_defined
from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.tasks.base import Batch, check_batch

CHEAP_METRICS = ("block_influence", "angular_distance_next", "relative_output_norm", "routing_mass")


def spearman(a: Iterable[float], b: Iterable[float]) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks); NaN if either side is constant."""
    a, b = pd.Series(list(a), dtype=float), pd.Series(list(b), dtype=float)
    return float(a.rank().corr(b.rank()))


# ---------------------------------------------------------------------------- clean-run geometry
@torch.no_grad()
def residual_states(model: DepthMixingModel, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(x_0 … x_J, f_0 … f_{J−1}) from one clean pass: the input of every sublayer plus the final readout's
    input (`readout_input_hook`), and every output."""

    def compute() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n_sublayers = model.n_sublayers
        inputs = [model.sublayer_input_hook(j) for j in range(n_sublayers)] + [model.readout_input_hook]
        outputs = [model.sublayer_output_hook(j) for j in range(n_sublayers)]
        saved = capture(model, tokens, inputs + outputs)
        return [saved[name] for name in inputs], [saved[name] for name in outputs]

    return clean_result("residual_states", model, tokens, compute)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1).clamp(-1, 1)


def _angular(a: torch.Tensor, b: torch.Tensor) -> float:
    return _mean_angle(_cosine(a, b).flatten()).item()


def _mean_angle(cosines: torch.Tensor) -> torch.Tensor:
    """The angular distance arccos(cos)/π, averaged over the last (token) dim."""
    return (cosines.clamp(-1, 1).arccos() / math.pi).mean(-1)


def angular_distance_matrix(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """Token-averaged `arccos(cos(x_ℓ, x_{ℓ+n}))/π` for 0 ≤ ℓ < ℓ+n ≤ J: start, n, end, start_label,
    end_label (x_ℓ is labelled by the sublayer it enters, x_J by 'final'), distance."""
    states, _ = residual_states(model, tokens)
    # every pair at once: unit vectors in float64 (F.cosine_similarity's normalisation), one product per start
    units = torch.stack([F.normalize(state.double().flatten(0, -2), dim=-1, eps=1e-8) for state in states])
    rows = []
    for start in range(len(states) - 1):  # [J + 1, tokens, d]: one contraction per start, no product temporary
        distances = _mean_angle(torch.einsum("ltd,td->lt", units[start + 1 :], units[start])).tolist()
        for end, distance in zip(range(start + 1, len(states)), distances):
            rows.append(
                dict(
                    start=start,
                    n=end - start,
                    end=end,
                    start_label=model.sublayer_name(start),
                    end_label=model.sublayer_name(end),
                    distance=distance,
                )
            )
    return pd.DataFrame(rows)


def cheap_metrics(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """One row per sublayer: the cheap predictors of the module docstring."""
    states, outputs = residual_states(model, tokens)
    rows = []
    for j, output in enumerate(outputs):
        h_in = states[j]
        rows.append(
            dict(
                sublayer=j,
                block_influence=1 - _cosine(h_in, h_in + output).mean().item(),
                angular_distance_next=_angular(states[j], states[j + 1]),
                relative_output_norm=(output.double().norm(dim=-1) / h_in.double().norm(dim=-1).clamp_min(1e-30))
                .mean()
                .item(),
            )
        )
    frame = pd.DataFrame(rows)
    if _has_routing_mass(model):
        mixing = depth_mixing_matrix(model, tokens)
        read_later = mixing[(mixing["sublayer"] >= 0) & (mixing["consumer"] > mixing["sublayer"])]
        frame["routing_mass"] = read_later.groupby("sublayer")["weight"].mean().reindex(frame["sublayer"]).to_numpy()
    return frame


def _has_routing_mass(model: DepthMixingModel) -> bool:
    """Whether routing_mass means something: M is not all ones (the standard residual weighs every output 1), and
    it is defined (a protocol model's consumers each read one mix, `mixing.check_mixing_defined`)."""
    if isinstance(model, HookedTransformer):
        return model.cfg.residual != "standard"
    try:
        check_mixing_defined(model)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------- measured sensitivity
def ablation_sensitivity(model: DepthMixingModel, batch: Batch, progress: bool = False) -> pd.DataFrame:
    """One row per sublayer: sublayer, label, kind, base_loss, base_accuracy, and for mode in (remove, mean,
    resample) dloss_{mode} and dacc_{mode}."""
    check_batch(batch)
    batch = batch.to(model_device(model))
    base = evaluate(model, batch)
    _, outputs = residual_states(model, batch.tokens)
    permutation = resample_permutation(batch.tokens.shape[0]).to(batch.tokens.device)
    modes = ("remove", "mean", "resample")
    interventions = []
    for j in range(model.n_sublayers):
        name = model.sublayer_output_hook(j)
        interventions += [
            removal_hooks(model, [j]),
            [(name, replace_hook(outputs[j].mean(dim=(0, 1))))],
            [(name, replace_hook(outputs[j][permutation]))],
        ]
    results = iter(
        evaluate_many(
            model, batch, interventions, progress=progress, desc="ablating sublayers", workers=analysis_workers(model)
        )
    )
    rows = []
    for j in range(model.n_sublayers):
        label = model.sublayer_name(j)
        row = dict(
            sublayer=j, label=label, kind=model.sublayer_kind(j), base_loss=base.loss, base_accuracy=base.accuracy
        )
        for mode in modes:
            result = next(results)
            row[f"dloss_{mode}"] = result.loss - base.loss
            row[f"dacc_{mode}"] = result.accuracy - base.accuracy
        rows.append(row)
    return pd.DataFrame(rows)


def pruning_sensitivity(model: DepthMixingModel, batch: Batch, progress: bool = False) -> pd.DataFrame:
    """`ablation_sensitivity` joined with `cheap_metrics` on the same batch: one row per sublayer."""
    check_batch(batch)
    measured = ablation_sensitivity(model, batch, progress)
    return measured.merge(cheap_metrics(model, batch.tokens.to(model_device(model))), on="sublayer")


def importance(sensitivity: pd.DataFrame, metric: str = "loss") -> pd.Series:
    """Measured importance of each sublayer under removal: Δloss, or the accuracy drop (−Δacc)."""
    check_metric(metric)
    return sensitivity["dloss_remove"] if metric == "loss" else -sensitivity["dacc_remove"]


def metric_correlations(sensitivity: pd.DataFrame) -> pd.DataFrame:
    """Spearman correlation of each cheap metric with the measured removal Δloss and accuracy drop."""
    rows = []
    for metric in CHEAP_METRICS:
        if metric in sensitivity:
            rows.append(
                dict(
                    metric=metric,
                    spearman_dloss=spearman(sensitivity[metric], importance(sensitivity, "loss")),
                    spearman_accuracy_drop=spearman(sensitivity[metric], importance(sensitivity, "accuracy")),
                    n_sublayers=len(sensitivity),
                )
            )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------- cumulative removal
def removal_orders(
    sensitivity: pd.DataFrame, distances: pd.DataFrame, metric: str = "loss"
) -> dict[str, list[frozenset[int]]]:
    """For each strategy, the sets of removed sublayers for k = 1 … J (see the module docstring)."""
    n_sublayers = len(sensitivity)
    ranked = sensitivity.assign(importance=importance(sensitivity, metric))
    orders = {"measured": _ascending(ranked, "importance")}
    for cheap in CHEAP_METRICS:
        if cheap in sensitivity:
            orders[cheap] = _ascending(ranked, cheap)
    sets = {name: [frozenset(order[:k]) for k in range(1, n_sublayers + 1)] for name, order in orders.items()}
    most_similar = distances.loc[distances.groupby("n")["distance"].idxmin()].sort_values("n")
    sets["similar_block"] = [
        frozenset(range(start, start + n)) for start, n in zip(most_similar["start"], most_similar["n"])
    ]
    sets["drop_deepest"] = [frozenset(range(n_sublayers - k, n_sublayers)) for k in range(1, n_sublayers + 1)]
    return sets


def _ascending(frame: pd.DataFrame, column: str) -> list[int]:
    # Stable sort: ties keep forward order, so the result does not depend on float noise in equal values.
    return frame.sort_values([column, "sublayer"], kind="stable")["sublayer"].tolist()


def cumulative_pruning(
    model: DepthMixingModel,
    batch: Batch,
    sensitivity: pd.DataFrame,
    distances: pd.DataFrame,
    metric: str = "loss",
    stop_at: float | None = 1.0,
    progress: bool = False,
) -> pd.DataFrame:
    """Loss and accuracy after removing the first k sublayers of each strategy's order, k = 0, 1, …: strategy,
    n_removed, removed (indices, comma-separated), removed_labels, loss, accuracy, delta_loss, delta_accuracy,
    relative_loss_increase.

    A strategy's curve ends at the first k whose loss is `stop_at` (relative) or more above the clean loss —
    by default where the loss has doubled, past which further points say little and cost a forward pass
    each; `stop_at=None` runs every curve to k = J. A set shared by several strategies is evaluated once.
    """
    batch = batch.to(model_device(model))
    orders = removal_orders(sensitivity, distances, metric)
    base = evaluate(model, batch)
    results: dict[frozenset[int], Evaluation] = {frozenset(): base}
    curves = {strategy: [frozenset()] for strategy in orders}
    running = set(orders)
    # Rounds of 4, 4, 8, 16, … steps (each as long as all before it): a round evaluates every running strategy's
    # next sets in one call, so sets that agree on their first sublayers share them and branches of different
    # strategies and steps stack and run in parallel; each set resumes from the previous round's states where
    # they agree (the cache). A strategy that stops mid-round costs at most as many sets again as it needed.
    cache = StateCache()
    n_sublayers = len(sensitivity)
    with tqdm(total=n_sublayers, desc="cumulative removal", disable=not progress, leave=False) as bar:
        first = 1
        while first <= n_sublayers and running:
            steps = range(first, min(first + max(4, first - 1), n_sublayers + 1))
            wanted = {orders[strategy][k - 1] for strategy in running for k in steps}
            new = sorted(wanted - set(results), key=sorted)
            # the next round resumes from each order's last set of this one: only their states are kept
            last = {orders[strategy][steps[-1] - 1] for strategy in running}
            results.update(
                zip(
                    new,
                    evaluate_many(
                        model,
                        batch,
                        [removal_hooks(model, removed) for removed in new],
                        cache=cache,
                        workers=analysis_workers(model),
                        remember=[i for i, removed in enumerate(new) if removed in last],
                    ),
                )
            )
            for strategy in sorted(running):
                for k in steps:
                    removed = orders[strategy][k - 1]
                    curves[strategy].append(removed)
                    if stop_at is not None and results[removed].loss / base.loss - 1 >= stop_at:
                        running.discard(strategy)
                        break
            bar.update(len(steps))
            first = steps.stop
    rows = []
    for strategy, sets in curves.items():
        for removed in sets:
            result = results[removed]
            rows.append(
                dict(
                    strategy=strategy,
                    n_removed=len(removed),
                    removed=",".join(map(str, sorted(removed))),
                    removed_labels=",".join(model.sublayer_name(j) for j in sorted(removed)),
                    loss=result.loss,
                    accuracy=result.accuracy,
                    delta_loss=result.loss - base.loss,
                    delta_accuracy=result.accuracy - base.accuracy,
                    relative_loss_increase=result.loss / base.loss - 1,
                )
            )
    return pd.DataFrame(rows)


def removable_within(curves: pd.DataFrame, tolerance: float = 0.05) -> pd.DataFrame:
    """Per strategy, how many sublayers can be removed, in its order, before the loss rises by `tolerance`
    (relative) or more: the largest k such that every prefix up to k stays below it."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ValueError(f"tolerance must be a relative loss increase > 0 (e.g. 0.05), got {tolerance!r}")
    rows = []
    for strategy, curve in curves.groupby("strategy", sort=False):
        curve = curve.sort_values("n_removed")
        over = curve[curve["relative_loss_increase"] >= tolerance]
        within = curve[curve["n_removed"] < over["n_removed"].min()] if len(over) else curve
        last = within.iloc[-1]
        rows.append(
            dict(
                strategy=strategy,
                tolerance=tolerance,
                n_removable=int(last["n_removed"]),
                removed_labels=last["removed_labels"],
                loss=last["loss"],
                accuracy=last["accuracy"],
            )
        )
    return pd.DataFrame(rows)
