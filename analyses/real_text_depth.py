"""Depth patterns on real text: on which side of the AttnRes paper's Figure 8 claims the seeds fall (issue 40).

Design, stated before any result:

* **Models**: `shakespeare-full` (Full AttnRes) and `shakespeare-block` (Block AttnRes, S = 4): 6 layers with
  MLPs = 12 sublayers and the final readout, byte-level Shakespeare (docs/tasks.md §6), the presets' budget.
  Seeds vary the initialisation only (`train.seed`): the task, its training batches in their order, its held-out
  plays and the evaluation windows are one fixed task (`task.seed=0`) for every run.
* **Measured on**: the final checkpoint, α of every consumer averaged over `--samples` held-out windows (from the
  held-out plays) and their positions (`depth_summary`, `depth_weights_by_consumer`).
* **Claims and their statistics** (consumers with at least two sources; "uniform" is 1/n_sources for each):
  1. *locality*: the most recent source (the preceding sublayer's output for Full; the open block's partial sum,
     or the last completed block at a block's start, for Block) takes the most weight: the share of consumers whose
     top source it is, and its mean weight minus the uniform share;
  2. *persistent embedding weight*: the embedding keeps weight in the deeper half of the consumers: their mean α on
     it minus the uniform share, and the share of them where it exceeds uniform;
  3. *pre-attention vs pre-MLP*: MLP inputs are more local and sharper than attention inputs: the mean weight on
     the most recent source (MLP − attention) and the mean normalised entropy (attention − MLP), over the layers
     1 … 5 where both consumers exist.
  Each statistic has a threshold (0 for a difference, 0.5 for a share; the verdict table prints it) and the claim
  predicts a value above it. The verdict says on which side each seed of a model falls: **predicted side on every
  seed**, **other side on every seed**, or **seeds disagree** (not resolved). It describes these seeds, not a test:
  with the default two seeds, a statistic whose sign were a coin toss per seed would land on the predicted side on
  both one time in four.
* **What it cannot say**: anything at scale (12 sublayers, 2000 steps of a d_model-128 model on ~5 MB of text);
  how large the effects are beyond these seeds (no interval across two seeds).

    python -m analyses.real_text_depth [--seeds 0 1] [--workers 2] [--samples 64]

Writes analyses/reports/real_text_depth.md and appends one row per statistic, model and seed to the results file
(docs/results.md).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

import pandas as pd
import torch

from analyses.common import (
    Job,
    add_study_options,
    emit_report,
    git_state,
    markdown_table,
    run_jobs,
    study_head,
    training_minutes,
    warm_up_warning,
)
from attnres_lens.rundir import load_run

PRESETS = ("shakespeare-full", "shakespeare-block")
FIXED_TASK = ("task.seed=0",)  # one task and one batch order for every seed: a seed varies the initialisation only
CLAIMS = {
    "locality: top source is the most recent (share of consumers)": 0.5,
    "locality: α on the most recent − uniform": 0.0,
    "embedding: α on e − uniform (deeper half)": 0.0,
    "embedding: α on e > uniform (share of deeper half)": 0.5,
    "pre-MLP − pre-attention: α on the most recent": 0.0,
    "pre-attention − pre-MLP: normalised entropy": 0.0,
}  # each statistic's threshold: the claim predicts a value above it


def consumer_table(model, tokens: torch.Tensor) -> pd.DataFrame:
    """Per consumer with ≥ 2 sources: layer, kind, n_sources, α on the most recent source and on the embedding
    (token means), whether the most recent source is the top one, and the normalised entropy."""
    from attnres_lens.analysis import depth_summary
    from attnres_lens.analysis.depth import depth_weights_by_consumer

    summary = depth_summary(model, tokens).set_index("consumer")
    rows = []
    for consumer, weights in depth_weights_by_consumer(model, tokens).items():
        mean = weights.double().mean(dim=(0, 1))
        n_sources = len(mean)
        if n_sources < 2:
            continue
        rows.append(
            dict(
                consumer=consumer,
                label=model.sublayer_name(consumer),
                kind=model.sublayer_kind(consumer),
                layer=consumer // 2,
                n_sources=n_sources,
                recent=mean[-1].item(),
                embedding=mean[0].item(),
                recent_is_top=bool(int(mean.argmax()) == n_sources - 1),
                normalized_entropy=summary.loc[consumer, "normalized_entropy"],
            )
        )
    return pd.DataFrame(rows)


def statistics(table: pd.DataFrame, n_consumers: int) -> dict[str, float]:
    """The claims' statistics (module docstring) from one run's `consumer_table`; `n_consumers` = J + 1."""
    uniform = 1 / table["n_sources"]
    deeper = table[table["consumer"] >= n_consumers / 2]
    both = table[table["kind"].isin(["attn", "mlp"])]
    paired = both.pivot_table(index="layer", columns="kind", values=["recent", "normalized_entropy"]).dropna()
    return {
        "locality: top source is the most recent (share of consumers)": float(table["recent_is_top"].mean()),
        "locality: α on the most recent − uniform": float((table["recent"] - uniform).mean()),
        "embedding: α on e − uniform (deeper half)": float((deeper["embedding"] - 1 / deeper["n_sources"]).mean()),
        "embedding: α on e > uniform (share of deeper half)": float(
            (deeper["embedding"] > 1 / deeper["n_sources"]).mean()
        ),
        "pre-MLP − pre-attention: α on the most recent": float(
            (paired["recent", "mlp"] - paired["recent", "attn"]).mean()
        ),
        "pre-attention − pre-MLP: normalised entropy": float(
            (paired["normalized_entropy", "attn"] - paired["normalized_entropy", "mlp"]).mean()
        ),
    }


def verdict(values: list[float], threshold: float) -> str:
    """On which side of `threshold` the seeds' values fall (the claim predicts above); NaNs are left out."""
    above = [value > threshold for value in values if not math.isnan(value)]
    if not above:
        return "undefined"
    if all(above):
        return "predicted side on every seed"
    if not any(above):
        return "other side on every seed"
    return "seeds disagree (not resolved)"


def measure(jobs: list[Job], samples: int) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    rows, tables = [], {}
    for job in jobs:
        run = load_run(job.out)
        tokens = run.config.build_task().eval_batch(samples).tokens
        table = consumer_table(run.model, tokens)
        tables[f"{job.preset} seed {job.seed}"] = table
        stats = statistics(table, run.model.cfg.n_sublayers + 1)
        final = run.metrics.dropna(subset=["eval_loss"]).iloc[-1]
        rows += [dict(preset=job.preset, seed=job.seed, statistic=name, value=value) for name, value in stats.items()]
        rows.append(
            dict(preset=job.preset, seed=job.seed, statistic="final eval loss (nats/byte)", value=final["eval_loss"])
        )
    return pd.DataFrame(rows), tables


def report(values: pd.DataFrame, tables: dict[str, pd.DataFrame], jobs: list[Job], samples: int, command: str) -> str:
    lines = study_head("Depth patterns on real text (AttnRes paper, Figure 8)", __doc__ or "", command)
    config = load_run(jobs[0].out, load_model=False).config
    cfg = config.model
    warning = warm_up_warning(job.out for job in jobs)
    lines += [
        "",
        f"Model trained: {cfg.n_layers} layers ({cfg.n_sublayers} sublayers), d_model {cfg.d_model}, d_mlp "
        f"{cfg.d_mlp}, n_ctx {cfg.n_ctx}, {config.train.steps} steps (the design's model, with the command's "
        "`--set` overrides applied).",
        *(["", warning] if warning else []),
        "",
        f"Runs: {', '.join(f'{job.preset} seed {job.seed} ({training_minutes(job.out):.1f} min)' for job in jobs)}; "
        f"α averaged over {samples} held-out windows.",
        "",
        "## Verdicts",
        "",
        "| claim | predicted | model | "
        + " | ".join(f"seed {seed}" for seed in sorted(values["seed"].unique()))
        + " | verdict |",
        "|---|---|---|" + "---|" * values["seed"].nunique() + "---|",
    ]
    for statistic in [*CLAIMS, "final eval loss (nats/byte)"]:
        for preset in PRESETS:
            chosen = values[(values["preset"] == preset) & (values["statistic"] == statistic)].sort_values("seed")
            if chosen.empty:
                continue
            cells = " | ".join(f"{value:.3g}" for value in chosen["value"])
            ruling = verdict(list(chosen["value"]), CLAIMS[statistic]) if statistic in CLAIMS else "—"
            predicted = f"> {CLAIMS[statistic]:g}" if statistic in CLAIMS else "—"
            lines.append(f"| {statistic} | {predicted} | {preset} | {cells} | {ruling} |")
    lines += ["", "## Per consumer", ""]
    for name, table in tables.items():
        lines += [f"### {name}", "", markdown_table(table), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="override the presets' step budget (a smoke run)")
    parser.add_argument("--samples", type=int, default=64, help="held-out windows α is averaged over")
    add_study_options(parser, "real_text_depth", "real_text_depth.md")
    args = parser.parse_args(argv)
    overrides = (*FIXED_TASK, *((f"train.steps={args.steps}",) if args.steps else ()), *args.set)
    jobs = [Job(p, seed, args.runs_dir / f"{p}-s{seed}", overrides) for p in PRESETS for seed in args.seeds]
    commit, dirty = git_state()  # the code that ran is the code at the start
    run_jobs(jobs, args.workers)
    values, tables = measure(jobs, args.samples)
    command = "python -m analyses.real_text_depth " + shlex.join(argv if argv is not None else sys.argv[1:])
    emit_report(report(values, tables, jobs, args.samples, command), args.report)
    from analyses.benchmarks import record

    steps = args.steps or 2000
    record(
        "real_text_depth",
        [
            dict(
                metric=row.statistic,
                shape=f"{row.preset}, {steps} steps, α over {args.samples} held-out windows",
                variant=f"seed {row.seed}",
                threads=1,
                value=row.value,
                unit="nats/byte" if row.statistic.startswith("final eval loss") else "α / share",
            )
            for row in values.itertuples()
        ],
        command,
        args.results,
        commit,
        dirty,
    )


if __name__ == "__main__":
    main()
