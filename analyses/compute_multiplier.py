"""The compute multiplier: how much more training compute a standard model needs to match Full and Block AttnRes
(the AttnRes paper's headline: Block AttnRes matches a baseline trained with 1.25× the compute), on real text.

Design, stated before any result:

* **Runs**: the `shakespeare-*` model (6 layers with MLPs, d_model 128, byte-level Shakespeare with held-out plays,
  docs/tasks.md §6) as a standard residual at every budget of `--budgets` (training steps, each its own run with
  its own warm-up and cosine schedule), and as Full and Block AttnRes (S = 4) at `--attnres-budget`. One fixed task
  (`task.seed=0`: the same training batches in the same order for every run); a seed sets the initialisation only
  (`train.seed`), and seed s of every variant is paired with seed s of the others.
* **Compute**: training FLOPs = 3 × forward FLOPs × tokens, the forward counted from the config: 2 per weight of
  every matrix product per token (projections, MLP, unembedding), the token attention's scores and mix over the
  causal window (mean length (n_ctx + 1)/2), and each AttnRes consumer's depth mix (key norm, scores, softmax and
  mix over its sources). Embedding lookups, norms and elementwise work are not counted.
* **Loss**: the final held-out loss (nats per byte) over `--eval-sequences` fixed windows of the held-out plays.
* **Read-off**: per seed, the standard model's loss is interpolated linearly in log compute between the two
  budgets whose losses bracket the variant's loss; a variant's multiplier is C* / C, with C* the compute at which
  the interpolation reaches the variant's loss and C the variant's own compute. Local, so a standard model at one
  of the budgets reads off exactly 1 however the loss curve bends (one straight line through curved points would
  not: the first version of this study fitted one, and its Block multiplier excluding 1 was that line's bias).
  Over seeds: the geometric mean of the multipliers and a 95% Student-t interval on their logarithms (paired by
  seed). A variant whose loss lies outside the standard losses' range is extrapolated from the end segment,
  marked as such; a seed whose standard losses do not fall with compute gives no read-off (NaN, left out of the
  seeds counted).
* **Control**: when `--attnres-budget` is one of `--budgets`, each variant's loss minus the standard model's at
  the same budget, paired by seed, with a 95% t-interval: a check free of any read-off, at equal steps (an AttnRes
  run spends a little more compute per step than the standard one; the Runs table gives each run's).
* **What it can resolve**: with a few seeds at this scale, a multiplier whose interval excludes 1, and for Block
  AttnRes whether it excludes the paper's 1.25× (the Result table says both). The interpolation is local to the budgets given, not a
  scaling law. The study is the tool for bigger machines: `--set train.device=cuda` runs it on a GPU,
  `--torchrun N` launches every training under torchrun with N processes, `--budgets` and `--set model.d_model=…`
  change the scale.

    python -m analyses.compute_multiplier [--seeds 0 1 2] [--budgets 250 500 1000 2000] [--attnres-budget 1000]

Writes analyses/reports/compute_multiplier.md and appends its rows to the results file (docs/results.md).
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

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
from analyses.depth_mixing_ablation import mean_ci, t95

VARIANTS = {"standard": "shakespeare-standard", "full": "shakespeare-full", "block": "shakespeare-block"}
FIXED_TASK = ("task.seed=0",)


def forward_flops_per_token(cfg) -> float:
    """Forward FLOPs per token of a `ModelConfig` (the counting rule of the module docstring)."""
    d, n_heads, d_head, d_mlp = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_mlp
    n_kv = cfg.n_key_value_heads or n_heads
    projections = 2 * d * d_head * (2 * n_heads + 2 * n_kv)  # Q and O, K and V
    mlp = 0 if cfg.attn_only else 2 * d * d_mlp * (3 if cfg.gated_mlp else 2)
    window = (cfg.n_ctx + 1) / 2
    attention = 2 * 2 * n_heads * d_head * window  # scores and mix
    flops = cfg.n_layers * (projections + mlp + attention) + 2 * d * cfg.d_vocab
    if cfg.residual == "attnres":
        from attnres_lens.attnres import source_layout

        for consumer in range(cfg.n_sublayers + 1):
            n_sources = len(source_layout(consumer, cfg.n_sublayers, cfg.attnres_block_size, cfg.attnres_window))
            flops += n_sources * 7 * d  # key norm (3d), score (2d), mix (2d)
    return float(flops)


def training_flops(config) -> float:
    """3 × forward FLOPs × tokens seen (steps × batch × sequence length)."""
    tokens = config.train.steps * config.train.batch_size * config.model.n_ctx
    return 3 * forward_flops_per_token(config.model) * tokens


def read_off(standard: pd.DataFrame, loss: float, compute: float) -> tuple[float, bool]:
    """(multiplier C*/C, whether `loss` lies outside the standard losses' range) from one seed's standard runs
    (columns compute, loss; compute in any one unit): the standard loss interpolated linearly in log compute between
    the two budgets whose losses bracket `loss` (outside them, extrapolated from the end segment). (NaN, False) when
    the standard losses do not fall as compute grows: no read-off, so nothing extrapolated."""
    ordered = standard.sort_values("compute")
    log_compute, losses = np.log(ordered["compute"].to_numpy()), ordered["loss"].to_numpy()
    if not (np.diff(losses) < 0).all():
        return float("nan"), False
    # the segment [i, i + 1] with losses[i + 1] <= loss < losses[i] (the end one when outside)
    i = int(np.clip(np.searchsorted(-losses, -loss) - 1, 0, len(losses) - 2))
    slope = (log_compute[i + 1] - log_compute[i]) / (losses[i + 1] - losses[i])
    needed = math.exp(log_compute[i] + (loss - losses[i]) * slope)
    return needed / compute, not losses[-1] <= loss <= losses[0]


def summarise(multipliers: list[float]) -> dict[str, float]:
    """Geometric mean and 95% t-interval over seeds (on the logarithms)."""
    logs = np.log([m for m in multipliers if m > 0 and math.isfinite(m)])
    if len(logs) == 0:
        return dict(mean=float("nan"), low=float("nan"), high=float("nan"), seeds=0)
    centre = float(logs.mean())
    if len(logs) < 2:
        return dict(mean=math.exp(centre), low=float("nan"), high=float("nan"), seeds=1)
    half = t95(len(logs) - 1) * float(logs.std(ddof=1)) / math.sqrt(len(logs))
    return dict(mean=math.exp(centre), low=math.exp(centre - half), high=math.exp(centre + half), seeds=len(logs))


def jobs_for(args: argparse.Namespace) -> list[Job]:
    common = (*FIXED_TASK, f"train.eval_size={args.eval_sequences}", *args.set)
    jobs = []
    for seed in args.seeds:
        for steps in args.budgets:
            jobs.append(
                Job(
                    VARIANTS["standard"],
                    seed,
                    args.runs_dir / f"standard-{steps}-s{seed}",
                    (*common, f"train.steps={steps}"),
                )
            )
        for variant in ("full", "block"):
            steps = args.attnres_budget
            jobs.append(
                Job(
                    VARIANTS[variant],
                    seed,
                    args.runs_dir / f"{variant}-{steps}-s{seed}",
                    (*common, f"train.steps={steps}"),
                )
            )
    return jobs


def torchrun_command(job: Job, processes: int) -> list[str]:
    """The command that trains `job` under `torchrun --nproc-per-node processes` with the settings a worker process
    gives it (`common._run_job`: the job's seed settings, then its overrides; torch's threads left to each rank), or
    resumes it from its latest checkpoint."""
    from attnres_lens.rundir import RunDir

    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(processes)]
    cli = [*torchrun, "-m", "attnres_lens.cli", "train", "--no-progress"]
    run_dir = RunDir(job.out)
    if run_dir.holds_run() and run_dir.read_index().latest is not None:
        return [*cli, "--resume", str(job.out)]
    settings = [*job.seed_overrides(), *job.overrides]
    return [*cli, "--preset", job.preset, "--out", str(job.out), *(a for s in settings for a in ("--set", s))]


def run_under_torchrun(jobs: list[Job], processes: int) -> None:
    """Each training in turn under torchrun with `processes` ranks (skipping complete runs, resuming partial ones; a
    run that crashed before its first checkpoint is removed to start over, as a worker does)."""
    from attnres_lens.rundir import RunDir, run_is_complete

    for job in jobs:
        if run_is_complete(job.out):
            continue
        run_dir = RunDir(job.out)
        if run_dir.holds_run() and run_dir.read_index().latest is None:
            shutil.rmtree(job.out)
        subprocess.run(torchrun_command(job, processes), check=True)


def measure(jobs: list[Job]) -> pd.DataFrame:
    from attnres_lens.rundir import load_run

    rows = []
    for job in jobs:
        run = load_run(job.out, load_model=False)
        evaluated = run.metrics.dropna(subset=["eval_loss"])
        rows.append(
            dict(
                variant=next(name for name, preset in VARIANTS.items() if preset == job.preset),
                seed=job.seed,
                steps=run.config.train.steps,
                compute=training_flops(run.config) / 1e12,  # TFLOP
                loss=float(evaluated["eval_loss"].iloc[-1]),
                minutes=training_minutes(job.out),
            )
        )
    return pd.DataFrame(rows)


def multipliers(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for seed, group in runs.groupby("seed"):
        standard = group[group["variant"] == "standard"]
        for row in group[group["variant"] != "standard"].itertuples():
            value, outside = read_off(standard, row.loss, row.compute)
            rows.append(dict(variant=row.variant, seed=seed, multiplier=value, extrapolated=outside))
    return pd.DataFrame(rows)


PAPER_MULTIPLIER = {"block": 1.25}  # the AttnRes paper's headline, for Block AttnRes


def same_budget_differences(runs: pd.DataFrame, budget: int) -> dict[str, dict[str, float]]:
    """The control: each AttnRes variant's loss minus the standard model's at the same budget, paired by seed (mean
    and 95% t-interval over seeds); empty when the standard model was not trained at `budget`."""
    standard = runs[(runs["variant"] == "standard") & (runs["steps"] == budget)].set_index("seed")["loss"]
    out = {}
    for variant, group in runs[runs["variant"] != "standard"].groupby("variant", sort=False):
        paired = (group.set_index("seed")["loss"] - standard).dropna()
        if len(paired) == 0:
            continue
        mean, half = mean_ci(paired.tolist())
        out[variant] = dict(mean=mean, low=mean - half, high=mean + half, seeds=len(paired))
    return out


def separates(low: float, high: float, value: float) -> str:
    """Where an interval lies relative to `value`: 'above', 'below' or 'includes' (NaN bounds: 'includes')."""
    return "above" if low > value else "below" if high < value else "includes"


def report(
    runs: pd.DataFrame,
    per_seed: pd.DataFrame,
    summary: dict,
    control: dict,
    command: str,
    model: str,
    warning: str = "",
) -> str:
    lines = study_head("Compute multiplier on real text", __doc__ or "", command)
    lines += ["", f"Model trained: {model} (the design's model, with the command's `--set` overrides applied)."]
    lines += ["", warning] if warning else []
    lines += [
        "",
        "## Result",
        "",
        "| variant | multiplier (geometric mean) | 95% interval | seeds | extrapolated seeds | against 1 | "
        "against the paper's multiplier |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, values in summary.items():
        extrapolated = int(per_seed[per_seed["variant"] == variant]["extrapolated"].sum())
        paper = PAPER_MULTIPLIER.get(variant)
        against_paper = f"{separates(values['low'], values['high'], paper)} {paper}×" if paper else "— (none given)"
        if values["seeds"] < 2:
            against_paper = "no interval (fewer than 2 seeds)"
        lines.append(
            f"| {variant} | {values['mean']:.3f} | {values['low']:.3f} – {values['high']:.3f} | {values['seeds']} | "
            f"{extrapolated} | {separates(values['low'], values['high'], 1.0) if values['seeds'] >= 2 else 'no interval'}"
            f" | {against_paper} |"
        )
    lines += [
        "",
        "A multiplier above 1: the standard model needs more compute than the variant to reach the variant's loss "
        "(the variant is the more compute-efficient); below 1, less. 'above' / 'below': the whole interval lies above "
        "or below the value; 'includes': it holds the value, so the study does not separate the multiplier from it; "
        "with fewer than 2 seeds there is no interval.",
    ]
    if control:
        lines += [
            "",
            "## Control: loss against the standard model at the same budget",
            "",
            "| variant | Δ loss (nats/byte, mean over seeds) | 95% interval | seeds | against 0 |",
            "|---|---|---|---|---|",
        ]
        for variant, values in control.items():
            lines.append(
                f"| {variant} | {values['mean']:+.4f} | {values['low']:+.4f} – {values['high']:+.4f} | "
                f"{values['seeds']} | {separates(values['low'], values['high'], 0.0) if values['seeds'] >= 2 else 'no interval'} |"
            )
    lines += [
        "",
        "## Per seed",
        "",
        markdown_table(per_seed),
        "",
        "## Runs",
        "",
        markdown_table(runs.sort_values(["variant", "seed", "steps"]).rename(columns={"compute": "compute (TFLOP)"})),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--budgets", type=int, nargs="+", default=[250, 500, 1000, 2000], help="standard runs' steps")
    parser.add_argument("--attnres-budget", type=int, default=1000, help="Full and Block AttnRes runs' steps")
    parser.add_argument("--eval-sequences", type=int, default=512, help="fixed held-out windows scored")
    parser.add_argument("--torchrun", type=int, metavar="N", help="train each run under torchrun with N processes")
    add_study_options(parser, "compute_multiplier", "compute_multiplier.md")
    args = parser.parse_args(argv)
    if len(set(args.budgets)) < 2 or min(args.budgets) < 1:
        parser.error(
            f"--budgets needs at least two different positive step counts to interpolate between, got {args.budgets}"
        )
    jobs = jobs_for(args)
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset

    for job in jobs:  # a bad setting is refused here, before any training starts
        try:
            apply_overrides(get_preset(job.preset), [f"train.seed={job.seed}", *job.overrides])
        except ValueError as error:
            parser.error(f"run {job.out.name}: {error}")
    commit, dirty = git_state()
    if args.torchrun:
        run_under_torchrun(jobs, args.torchrun)
    else:
        run_jobs(jobs, args.workers)
    runs = measure(jobs)
    per_seed = multipliers(runs)
    summary = {
        variant: summarise(list(group["multiplier"])) for variant, group in per_seed.groupby("variant", sort=False)
    }
    command = "python -m analyses.compute_multiplier " + shlex.join(argv if argv is not None else sys.argv[1:])
    cfg = apply_overrides(get_preset(jobs[0].preset), list(jobs[0].overrides)).model
    model = f"{cfg.n_layers} layers, d_model {cfg.d_model}, d_mlp {cfg.d_mlp}, n_ctx {cfg.n_ctx}"
    control = same_budget_differences(runs, args.attnres_budget)
    warning = warm_up_warning(job.out for job in jobs)
    emit_report(report(runs, per_seed, summary, control, command, model, warning), args.report)
    from analyses.benchmarks import record

    shape = (
        f"shakespeare, {cfg.n_layers} layers, d_model {cfg.d_model}; standard at {args.budgets} steps, AttnRes at "
        f"{args.attnres_budget}; {len(args.seeds)} seeds"
    )
    rows = [
        dict(
            metric="final eval loss",
            shape=shape,
            variant=f"{r.variant} {r.steps} steps seed {r.seed}",
            threads=1,
            value=r.loss,
            unit="nats/byte",
        )
        for r in runs.itertuples()
    ]
    # a multiplier's "mean" is the geometric mean over seeds (the report says so), named as in the first version so
    # the results page keeps one row per quantity across versions
    for table, metric, unit in (
        (summary, "compute multiplier", "× own compute"),
        (control, "loss − standard at the same budget", "nats/byte"),
    ):
        rows += [
            dict(metric=f"{metric} ({key})", shape=shape, variant=variant, threads=1, value=v[key], unit=unit)
            for variant, v in table.items()
            for key in ("mean", "low", "high")
        ]
    record("compute_multiplier", rows, command, args.results, commit, dirty)


if __name__ == "__main__":
    main()
