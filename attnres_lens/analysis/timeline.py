"""Training timeline from a run's recorded snapshots (docs/analysis.md §11): how depth routing settles next to the
induction-score jump and the loss curve, and the step where each changes fastest.

Series, one value per recorded step: per consumer (from `records/depth_weights`, the token-averaged α of each
snapshot) `routing_entropy` (nats, of the token-averaged α: the recorder keeps no per-token weights),
`max_weight` and `embedding_weight`; per model `induction_score` (the largest prefix-matching score over heads,
`records/induction_scores`), `loss` and `eval_loss` (`metrics.jsonl`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

CONSUMER_SERIES = ("routing_entropy", "max_weight", "embedding_weight")
MODEL_SERIES = ("induction_score", "loss", "eval_loss")
# The consumer column of a model-wide series: no sublayer reads it. −2, not −1, which reads as "the last consumer"
# (the final readout is a consumer with its own index, labelled "final").
MODEL_WIDE, MODEL_WIDE_LABEL = -2, "whole model"


def training_timeline(records: dict[str, pd.DataFrame], metrics: pd.DataFrame) -> pd.DataFrame:
    """Long table: series, consumer (`MODEL_WIDE`, −2, for model-wide series), consumer_label (`MODEL_WIDE_LABEL`,
    "whole model", for those), step, value."""
    frames = []
    weights = records.get("depth_weights", pd.DataFrame())
    if len(weights):

        def per_snapshot(group: pd.DataFrame) -> pd.Series:
            alpha = group.sort_values("source")["weight"].to_numpy(dtype=float)
            shares = alpha[alpha > 0] / alpha.sum()  # α itself for softmax scores; sigmoid ones do not sum to 1
            return pd.Series(
                {
                    "routing_entropy": float(-(shares * np.log(shares)).sum()),
                    "max_weight": float(alpha.max()),
                    "embedding_weight": float(group.loc[group["source"] == 0, "weight"].sum()),
                }
            )

        keys = ["step", "consumer", "consumer_label"]
        stats = weights.groupby(keys, sort=True)[["source", "weight"]].apply(per_snapshot).reset_index()
        frames.append(stats.melt(id_vars=keys, value_vars=list(CONSUMER_SERIES), var_name="series"))
    scores = records.get("induction_scores", pd.DataFrame())
    if len(scores):
        best = scores.groupby("step", sort=True)["prefix_score"].max().reset_index(name="value")
        frames.append(best.assign(series="induction_score"))
    for column in ("loss", "eval_loss"):
        if column in metrics and "step" in metrics:
            curve = metrics[["step", column]].dropna().rename(columns={column: "value"})
            frames.append(curve.assign(series=column))
    if not frames:
        return pd.DataFrame(columns=["series", "consumer", "consumer_label", "step", "value"])
    timeline = pd.concat(frames, ignore_index=True)
    timeline["consumer"] = timeline["consumer"].fillna(MODEL_WIDE).astype(int) if "consumer" in timeline else MODEL_WIDE
    timeline["consumer_label"] = (
        timeline["consumer_label"].fillna(MODEL_WIDE_LABEL) if "consumer_label" in timeline else MODEL_WIDE_LABEL
    )
    timeline["step"] = timeline["step"].astype(int)
    return timeline[["series", "consumer", "consumer_label", "step", "value"]].sort_values(
        ["series", "consumer", "step"], ignore_index=True
    )


def fastest_changes(timeline: pd.DataFrame) -> pd.DataFrame:
    """Per series (and consumer): the interval between consecutive recorded steps where the value changes fastest
    (largest |Δvalue / Δstep|): series, consumer, consumer_label, step_from, step (the end of the interval),
    value_from, value_to, rate (Δvalue / Δstep, signed). Series with fewer than two points are left out."""
    rows = []
    for (series, consumer, label), curve in timeline.groupby(["series", "consumer", "consumer_label"], sort=False):
        curve = curve.drop_duplicates("step", keep="last").sort_values("step")
        if len(curve) < 2:
            continue
        steps, values = curve["step"].to_numpy(), curve["value"].to_numpy(dtype=float)
        rate = np.diff(values) / np.diff(steps)
        fastest = int(np.nanargmax(np.abs(rate))) if np.isfinite(rate).any() else 0
        rows.append(
            dict(
                series=series,
                consumer=consumer,
                consumer_label=label,
                step_from=int(steps[fastest]),
                step=int(steps[fastest + 1]),
                value_from=float(values[fastest]),
                value_to=float(values[fastest + 1]),
                rate=float(rate[fastest]),
            )
        )
    return pd.DataFrame(
        rows, columns=["series", "consumer", "consumer_label", "step_from", "step", "value_from", "value_to", "rate"]
    )
