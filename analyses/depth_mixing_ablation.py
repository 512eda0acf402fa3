"""Depth-mixing rules side by side (the AttnRes paper's Table 4 at CPU scale), as a paired study (issue 40 item 1).

Design, stated before any result:

* **Variants**: the twelve rules of `presets.DEPTH_MIXING_VARIANTS` (standard, DenseFormer, mHC, Full and Block
  AttnRes and each AttnRes ablation; the multi-head row is Block AttnRes S = 4, as in the paper), 6 layers with
  MLPs (12 sublayers), d_model 64, on the mixed task (3-gram text with copied segments).
* **Pairing**: one fixed task for every run (`task.seed=0`: one language, one held-out set); seed s sets the
  initialisation (`train.seed`) and the order of the training batches (`train.data_seed`) and nothing else.
  The variants of one seed start from the same shared weights (every parameter they have in common is drawn
  identically: a variant's own parameters never shift the random stream, docs/model.md §6) and see the same batches.
* **Fair parametrisation**: the input-dependent query reads the sum of the sources, its logits are divided by d,
  its d×d matrix starts at zero and is decayed like every weight matrix (`presets.INPUT_QUERY`, docs/model.md §11).
* **Budget and score**: every run trains `--steps` steps (cosine schedule over them); the score of a run is the mean
  held-out loss over the evaluations in the last fifth of training (steps ≥ 0.8·steps, one every steps/20) on 512
  fixed held-out sequences, which averages out the evaluation-to-evaluation wobble of a single last value.
* **Comparisons**: every variant against the standard model and against Full AttnRes, paired by seed (the mean of
  the per-seed differences, a paired t test); Holm–Bonferroni over the whole family, with intervals at each
  comparison's Holm level (`holm_intervals`: an interval excludes 0 exactly when Holm rejects).
* **Resolution**: the minimal detectable difference (80% power at the first Holm level, from the paired SD, by the
  noncentral t) says which gaps the study can resolve; each of the paper's gaps is compared with its own
  comparison's, and each resolved gap's sign with the paper's.
* **Position classes** (a secondary analysis, added when seeds 0 and 1 of 8 were in): the held-out targets split
  by what predicts them (`position_classes`): the copy answers (the task's answer positions: in-context
  retrieval, an induction circuit's job), the 3-gram background (targets whose token and 3-gram context no copy
  touched: language modelling, the part nearest the paper's loss) and the copy edges (the rest). Each run's final
  checkpoint is scored on each class from its own per-token losses; the copy answers and the background are
  compared as the score is, Holm over both classes' comparisons as a second family; the primary comparisons above
  stand as designed.

    python -m analyses.depth_mixing_ablation [--seeds 0 … 7] [--steps N] [--workers 2]

Resumable: complete runs are reused (after checking that each was trained with this design), partial ones resumed.
Writes analyses/reports/depth_mixing_ablation.md (with per-run scores in depth_mixing_ablation.csv and the figures)
and appends one row per run, variant and comparison to the results file (docs/results.md), stamped with the
commit at the study's start.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import shlex
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch

from analyses.common import (
    REPO,
    Job,
    add_study_options,
    emit_report,
    git_state,
    markdown_table,
    provenance,
    run_jobs,
    training_minutes,
    warm_up_warning,
)
from attnres_lens.rundir import run_is_complete

if TYPE_CHECKING:
    from attnres_lens.config import RunConfig
    from attnres_lens.tasks.base import Batch

# The paper's Table 4 (16-layer model, validation loss; lower is better) for the variants that have a row there.
PAPER_LOSS = {
    "depth-standard": 1.766,
    "depth-denseformer": 1.767,
    "depth-mhc": 1.747,
    "depth-full": 1.737,
    "depth-full-input-query": 1.731,
    "depth-full-scalar": 1.749,
    "depth-block": 1.746,
    "depth-full-sigmoid": 1.741,
    "depth-full-no-keynorm": 1.743,
    "depth-block-no-keynorm": 1.750,
    "depth-block-heads16": 1.752,
    "depth-full-window8": 1.764,
}
STANDARD, FULL = "depth-standard", "depth-full"
TASK_SEED = 0  # the one task every run trains on
DEFAULT_SEEDS = list(range(8))
# The default budget, chosen from measured loss curves; BUDGET_NOTE says how (the report quotes it).
DEFAULT_STEPS = 3000
BUDGET_NOTE = (
    "The budget was read off pilot loss curves (`depth_mixing_ablation_pilot.csv`: the standard model and Full "
    "AttnRes, seed 0 of this design, 3000 steps, held-out loss every 100 steps on the 512 sequences; "
    "`attnres-lens train --preset depth-standard --out DIR --set model.n_layers=6 --set task.seed=0 "
    "--set train.data_seed=0 --set train.steps=3000 --set train.eval_size=512`). Their held-out loss fell 0.18 and "
    "0.15 nats over steps 1800-2400, 0.068 and 0.056 over the last fifth and 0.022 and 0.019 over the last 300 "
    "steps; the Full − standard gap went from −0.220 at step 1500 to −0.168 at 2400 and −0.156 at 3000, moving "
    "0.012 over the last fifth (one seed). The runs are still descending at the end of the schedule: the scores "
    "measure this budget, not converged losses, and the study's own drift of every gap over the last fifth is in "
    "the per-comparison table. A longer budget would lower every loss further (not measured); the earlier "
    "600-step budget stopped mid-descent."
)
EVAL_SEQUENCES = 512
LAST_FRACTION = 0.2  # the score averages the evaluations in the last fifth of training
EVALS_PER_RUN = 20
MIN_STEPS = 5
STUDY_SIZE = ("model.n_layers=6", "train.log_every=50", "train.keep_checkpoints=1", f"train.eval_size={EVAL_SEQUENCES}")
ALPHA, POWER = 0.05, 0.8


# ---------------------------------------------------------------------------- Student t, exact for integer df
def t_central_mass(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with `df` (an integer ≥ 1) degrees of freedom, in closed form (Abramowitz and
    Stegun 26.7.3-4: a finite series in cos θ, tan θ = t/√df)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # (2/π)(θ + sin θ (cos θ + 2/3 cos³θ + … + 2·4…(df−3) / 3·5…(df−2) cos^{df−2}θ))
        term = total = math.cos(theta) if df > 1 else 0.0
        for power in range(3, df - 1, 2):
            term *= cos2 * (power - 1) / power
            total += term
        return 2 / math.pi * (theta + sin * total)
    term = total = 1.0  # sin θ (1 + 1/2 cos²θ + … + 1·3…(df−3) / 2·4…(df−2) cos^{df−2}θ)
    for power in range(2, df - 1, 2):
        term *= cos2 * (power - 1) / power
        total += term
    return sin * total


def t_quantile(mass: float, df: int) -> float:
    """The q with P(|T| ≤ q) = `mass` (two-sided: `t_quantile(0.95, df)` is the 95% interval's multiplier)."""
    if not 0 < mass < 1:
        raise ValueError(f"the central mass must be in (0, 1), got {mass!r}")
    low, high = 0.0, 1.0
    while t_central_mass(high, df) < mass:
        low, high = high, 2 * high
    for _ in range(200):  # bisection to float precision
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if t_central_mass(middle, df) < mass else (low, middle)
    return (low + high) / 2


def t95(df: int) -> float:
    """The two-sided 95% Student-t quantile with `df` degrees of freedom."""
    return t_quantile(0.95, df)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student-t confidence interval (NaN with one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


# ---------------------------------------------------------------------------- paired comparisons, Holm
def holm_intervals(differences: Mapping[str, Sequence[float]], alpha: float = ALPHA) -> pd.DataFrame:
    """Paired comparisons under Holm–Bonferroni, each with an interval at its Holm level.

    `differences` maps each comparison to its per-seed differences. Each gets a paired t test on n − 1 degrees of
    freedom. Holm ranks the m p-values (i = 1 … m, smallest first) and rejects while p_(i) ≤ α / (m − i + 1),
    stopping at the first rank s it cannot reject. The interval of rank i is mean ± t · SE with t the two-sided
    quantile at level 1 − α / (m − min(i, s) + 1): the level Holm tested it at, or for the ranks from s on the level
    of the step where Holm stopped, so each interval excludes 0 exactly when Holm rejects that comparison. The
    Holm-adjusted p-value is max_{j ≤ i} min(1, (m − j + 1) p_(j)).

    Returns one row per comparison in the given order: n, mean, sd, se, t, p, rank, p_holm, divisor (m − min(i, s)
    + 1), low, high, rejected.
    """
    if not differences:
        raise ValueError("holm_intervals needs at least one comparison")
    rows = []
    for name, values in differences.items():
        values = [float(v) for v in values]
        if len(values) < 2:
            raise ValueError(f"comparison {name!r} has {len(values)} paired difference(s); a paired interval needs 2+")
        n, mean, sd = len(values), statistics.fmean(values), statistics.stdev(values)
        se = sd / math.sqrt(n)
        if se > 0:
            t = mean / se
            p = 1 - t_central_mass(t, n - 1)
        else:  # every seed gave the same difference
            t, p = (math.copysign(math.inf, mean), 0.0) if mean else (0.0, 1.0)
        rows.append(dict(comparison=name, n=n, mean=mean, sd=sd, se=se, t=t, p=p))
    table = pd.DataFrame(rows)
    m = len(table)
    order = sorted(range(m), key=lambda index: table.at[index, "p"])
    stop = next((i for i, index in enumerate(order, 1) if table.at[index, "p"] > alpha / (m - i + 1)), m + 1)
    running = 0.0
    for i, index in enumerate(order, 1):
        running = max(running, min(1.0, (m - i + 1) * table.at[index, "p"]))
        divisor = m - min(i, stop) + 1
        half = t_quantile(1 - alpha / divisor, int(table.at[index, "n"]) - 1) * table.at[index, "se"]
        mean = table.at[index, "mean"]
        table.loc[index, ["rank", "p_holm", "divisor", "low", "high"]] = [i, running, divisor, mean - half, mean + half]
        table.loc[index, "rejected"] = i < stop
    return table.astype({"rank": int, "divisor": int, "rejected": bool})


def paired_t_power(effect: float, n: int, alpha: float) -> float:
    """Probability that a two-sided paired t test at level `alpha` on `n` seeds rejects when the true mean difference
    is `effect` SDs of the differences: P(|Z + λ| > c·√(V/df)) with λ = effect·√n, V ~ χ² on df = n − 1 and c the
    test's critical value (the noncentral t), integrated over u = √V by Simpson's rule (the integrand is smooth:
    u^(df−1)·e^(−u²/2) times normal tail probabilities)."""
    df = n - 1
    critical = t_quantile(1 - alpha, df)
    u = torch.linspace(0.0, math.sqrt(df) + 12.0, 4001, dtype=torch.float64)  # χ_df has SD < 1: the tail is < 1e-30
    log_density = (
        math.log(2)
        + torch.xlogy(torch.tensor(df - 1.0, dtype=torch.float64), u)
        - u**2 / 2
        - df / 2 * math.log(2)
        - math.lgamma(df / 2)
    )
    shift = effect * math.sqrt(n)
    reach = critical * u / math.sqrt(df)
    integrand = torch.exp(log_density) * (torch.special.ndtr(shift - reach) + torch.special.ndtr(-shift - reach))
    weights = torch.ones_like(u)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return float((weights * integrand).sum() * (u[1] - u[0]) / 3)


def minimal_detectable_difference(sd: float, n: int, alpha: float, power: float = POWER) -> float:
    """The smallest true paired gap that a two-sided paired t test at level `alpha` detects with probability `power`
    (n seeds, `sd` the SD of the differences, taken as known). The textbook shortcut (t_{1−α/2} + t_{power}) · sd / √n
    understates it with few seeds (by about 10% at 5 seeds and α/21)."""
    return detectable_effect(n, alpha, power) * sd


@functools.cache
def detectable_effect(n: int, alpha: float, power: float) -> float:
    """The effect (in SDs of the differences) `paired_t_power` detects with probability `power`, by bisection."""
    low, high = 0.0, 1.0
    while paired_t_power(high, n, alpha) < power:
        low, high = high, 2 * high
    for _ in range(60):  # far below the integral's own accuracy
        middle = (low + high) / 2
        low, high = (middle, high) if paired_t_power(middle, n, alpha) < power else (low, middle)
    return (low + high) / 2


# ---------------------------------------------------------------------------- the runs
def study_overrides(steps: int, settings: Sequence[str] = ()) -> tuple[str, ...]:
    """The settings every run of the study takes: its size, budget, evaluation cadence, then `settings`."""
    eval_every = max(1, steps // EVALS_PER_RUN)
    return (
        *STUDY_SIZE,
        f"train.steps={steps}",
        f"train.eval_every={eval_every}",
        f"train.record_every={steps}",  # the recorder's snapshots are not used: start and end only
        f"train.checkpoint_every={max(1, steps // 4)}",
        *settings,
    )


def study_jobs(
    variants: Sequence[str], seeds: Sequence[int], steps: int, runs_dir: Path, settings: Sequence[str] = ()
) -> list[Job]:
    """One job per variant and seed, every one on the fixed task, seed by seed: a study stopped part way (it is
    resumable) has whole paired seeds rather than a few variants with every seed."""
    overrides = study_overrides(steps, settings)
    return [
        Job(name, seed, runs_dir / f"{name}-s{seed}", overrides, task_seed=TASK_SEED)
        for seed in seeds
        for name in variants
    ]


def expected_config(job: Job) -> RunConfig:
    """The config `common._run_job` trains `job` with."""
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset

    return apply_overrides(get_preset(job.preset), [*job.seed_overrides(), "train.threads=1", *job.overrides])


def check_design(jobs: Sequence[Job]) -> None:
    """Every run on disk was trained with the config this study asks for: a run reused from another design (the
    old unpaired study, another budget) would be compared silently otherwise."""
    from attnres_lens import load_run

    for job in jobs:
        stored, wanted = load_run(job.out, load_model=False).config, expected_config(job)
        for section in ("model", "task", "train"):
            have, want = (getattr(config, section) for config in (stored, wanted))
            have = have.to_dict() if hasattr(have, "to_dict") else dataclasses.asdict(have)
            want = want.to_dict() if hasattr(want, "to_dict") else dataclasses.asdict(want)
            changed = sorted(key for key in set(have) | set(want) if have.get(key) != want.get(key))
            if changed:
                raise ValueError(
                    f"{job.out} was trained with other {section} settings than this study's ({changed}); "
                    "give another --runs-dir or remove it"
                )


# the held-out targets by what predicts them (`position_classes`): column name → label; the first two are compared
POSITION_CLASSES = {"copy_answers": "copy answers", "background": "3-gram background", "copy_edges": "copy edges"}
COMPARED_CLASSES = ("copy_answers", "background")


def position_classes(batch: Batch) -> dict[str, torch.Tensor]:
    """[B, T] masks of the mixed task's targets (docs/tasks.md §2) by what predicts them, keyed as
    `POSITION_CLASSES`: the copy answers (the task's answer positions), the 3-gram background (targets at t with no
    copy in t − 1 … t + 1 … : the token t + 1 and its 3-gram context t − 1, t are the sampled text, so t lies
    outside [dst − 1, dst + len] of every copy) and the copy edges (every other target: the first copied token, copy
    positions whose continuation is ambiguous, and the two tokens after a copy, sampled from a context the copy
    overwrote)."""
    from attnres_lens.tasks.base import IGNORE_INDEX

    if not {"dst_start", "seg_len"} <= set(batch.layout):
        raise ValueError(f"position classes need the mixed task's copy layout; the batch has {sorted(batch.layout)}")
    has_target = batch.targets != IGNORE_INDEX
    positions = torch.arange(batch.tokens.shape[1])
    touched = torch.zeros_like(has_target)
    for k in range(batch.layout["dst_start"].shape[1]):
        dst, length = batch.layout["dst_start"][:, k : k + 1], batch.layout["seg_len"][:, k : k + 1]
        touched |= (positions >= dst - 1) & (positions <= dst + length)
    answers = batch.answer_mask & has_target
    return {
        "copy_answers": answers,
        "background": has_target & ~touched,
        "copy_edges": has_target & touched & ~answers,
    }


@torch.no_grad()
def final_class_losses(out: Path, steps: int) -> dict[str, float]:
    """The run's final checkpoint's mean loss on each position class of the held-out set the trainer evaluates on
    (`task.eval_batch(eval_size)`), from its own per-token losses (float32, summed in float64 as the metric)."""
    from attnres_lens import load_run
    from attnres_lens.evaluation import token_losses

    run = load_run(out, checkpoint=steps)
    batch = run.config.build_task().eval_batch(run.config.train.eval_size)
    losses = token_losses(run.model.eval()(batch.tokens), batch.targets).double()
    return {column: losses[mask].mean().item() for column, mask in position_classes(batch).items()}


def run_score(out: Path, steps: int) -> dict[str, float]:
    """The run's score (the mean held-out loss over the evaluations at steps ≥ (1 − LAST_FRACTION) · steps), how far
    the loss fell from the first of them to the last (a run near convergence barely falls), and its final
    checkpoint's loss on each position class."""
    from attnres_lens import load_run

    evals = load_run(out, load_model=False).metrics.dropna(subset=["eval_loss"])
    evals = evals.drop_duplicates("step", keep="last").sort_values("step")  # a resumed run repeats some steps
    last = evals[evals["step"] >= (1 - LAST_FRACTION) * steps]
    if len(last) < 2:
        raise ValueError(f"{out} has {len(last)} evaluation(s) in the last fifth of its {steps} steps; it needs 2+")
    return dict(
        score=float(last["eval_loss"].mean()),
        last_fifth_drop=float(last["eval_loss"].iloc[0] - last["eval_loss"].iloc[-1]),
        **final_class_losses(out, steps),
    )


def comparisons(per_run: pd.DataFrame, variants: Sequence[str], column: str = "score") -> dict[str, list[float]]:
    """Per-seed differences of `column` of every variant against the standard model and against Full AttnRes (the
    standard against Full counted once, as Full − standard)."""
    wide = per_run.pivot(index="seed", columns="variant", values=column)
    out = {}
    for base in (STANDARD, FULL):
        for name in variants:
            if name == base or (base == FULL and name == STANDARD):
                continue
            out[f"{name} − {base}"] = (wide[name] - wide[base]).tolist()
    return out


def step_time_ratios(variants: list[str], overrides: Sequence[str], rounds: int) -> dict[str, float]:
    """Each variant's forward + backward + AdamW step relative to the standard model's in the same round (the
    median over interleaved rounds, `common.within_rounds`), one torch thread, in one process."""
    from analyses.common import within_rounds
    from attnres_lens.config import apply_overrides
    from attnres_lens.model import HookedTransformer, adamw, next_token_loss
    from attnres_lens.presets import get_preset

    torch.set_num_threads(1)
    steppers = {}
    for name in variants:
        config = apply_overrides(get_preset(name), list(overrides))
        model = HookedTransformer(config.model)
        optimizer = adamw(model, 1e-3, 0.1)
        task = config.build_task()
        steppers[name] = (model, optimizer, task.sample(config.train.batch_size, task.train_generator()).tokens)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(rounds + 2):  # two warm-up rounds
        for name, (model, optimizer, tokens) in steppers.items():
            start = time.perf_counter()
            loss = next_token_loss(model(tokens), tokens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if round_index >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: within_rounds(values, times[STANDARD]) for name, values in times.items()}


def mixing_figures(runs: dict, variants: list[str], report_dir: Path) -> tuple[Path, Path]:
    """A heatmap of each variant's token-averaged depth-mixing matrix M, and its per-consumer diagnostics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnres_lens.analysis.depth import depth_mixing_matrix, mixing_diagnostics

    columns = 4
    rows = math.ceil(len(variants) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.8 * rows), squeeze=False)
    diagnostics = {}
    for ax, name in zip(axes.flat, variants):
        run = runs[name]
        tokens = run.config.build_task().eval_batch(32).tokens
        matrix = depth_mixing_matrix(run.model, tokens)
        grid = matrix.pivot_table(index="consumer", columns="sublayer", values="weight").to_numpy()
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set(title=name.removeprefix("depth-"), xlabel="output (0 = e)", ylabel="input of sublayer")
        fig.colorbar(image, ax=ax, fraction=0.046)
        diagnostics[name] = mixing_diagnostics(run.model, tokens)
    for ax in list(axes.flat)[len(variants) :]:
        ax.axis("off")
    fig.suptitle("Depth-mixing matrix M (coefficient of each output in each sublayer input), seed of the first run")
    fig.tight_layout()
    matrix_png = report_dir / "depth_mixing_ablation_matrices.png"
    fig.savefig(matrix_png, dpi=80)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colours = plt.get_cmap("tab20").colors  # twelve variants: the default cycle of ten would repeat two colours
    for index, (name, frame) in enumerate(diagnostics.items()):
        style = dict(color=colours[(2 * index) % 20 + index // 10], marker=".", label=name.removeprefix("depth-"))
        for ax, column in zip(axes, ["effective_sources", "max_weight", "embedding_mass"]):
            ax.plot(frame["consumer"], frame[column], **style)
    for ax, title in zip(
        axes, ["effective number of outputs read (exp entropy)", "largest share (collapse)", "embedding's share"]
    ):
        ax.set(title=title, xlabel="consumer (sublayer; last = final readout)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    diagnostics_png = report_dir / "depth_mixing_ablation_diagnostics.png"
    fig.savefig(diagnostics_png, dpi=80)
    plt.close(fig)
    return matrix_png, diagnostics_png


# ---------------------------------------------------------------------------- the report
def class_report(per_run: pd.DataFrame, by_class: pd.DataFrame, classes: Mapping[str, torch.Tensor]) -> str:
    """The secondary analysis: each variant's final loss on each position class, and its paired differences on the
    copy answers and on the 3-gram background, Holm over both classes' comparisons."""
    tests = by_class.set_index("comparison")
    m, n_seeds = len(by_class), per_run["seed"].nunique()
    compared = [POSITION_CLASSES[column] for column in COMPARED_CLASSES]
    header = ["variant"] + [f"{label}" for label in POSITION_CLASSES.values()]
    header += [f"Δ {label} vs {base}" for base in ("standard", "Full") for label in compared]
    lines = []
    for variant in dict.fromkeys(per_run["variant"]):
        rows = per_run[per_run["variant"] == variant]
        cells = [variant] + [f"{rows[column].mean():.4f} ± {rows[column].std():.4f}" for column in POSITION_CLASSES]
        for base in (STANDARD, FULL):
            for label in compared:
                key = f"{label}: {variant} − {base}"
                cells.append(interval(tests.loc[key]) if key in tests.index else "—")
        lines.append("| " + " | ".join(cells) + " |")
    resolution = []
    for label in compared:
        own = by_class[by_class["comparison"].str.startswith(f"{label}: ")]
        sd = float(own["sd"].median())
        resolved = own[own["rejected"]]["comparison"].str.removeprefix(f"{label}: ")
        resolution.append(
            f"* **{label}**: median paired SD {sd:.4f}; minimal detectable difference (80% power) "
            f"{minimal_detectable_difference(sd, n_seeds, ALPHA / m):.4f} nats at the first Holm level (α/{m}) and "
            f"{minimal_detectable_difference(sd, n_seeds, ALPHA):.4f} at the last. Resolved after Holm: "
            f"{len(resolved)} of {len(own)}: {', '.join(resolved) or 'none'}."
        )
    counts = {column: int(mask.sum()) for column, mask in classes.items()}
    total = sum(counts.values())
    shares = ", ".join(
        f"{POSITION_CLASSES[column]} {counts[column]} ({counts[column] / total:.1%})" for column in counts
    )
    return f"""
## Copy answers and 3-gram background (secondary analysis)

The score mixes targets that different parts of a model predict. The held-out set's {total} targets split into the
copy answers (the task's answer positions: continuing an earlier segment, an induction circuit's job), the 3-gram
background (targets whose token and 3-gram context no copy touched: language modelling, the part nearest the
paper's loss) and the copy edges (the first copied token, copy positions whose continuation is ambiguous, and the
two tokens after a copy, sampled from a context the copy overwrote): {shares}. This split was added when seeds 0
and 1 of 8 were in, before the rest. Each run's final checkpoint is scored on each class from its
own per-token losses (the final checkpoint, not the last-fifth mean the score averages: the classes' losses weighted
by their counts give the last evaluation's loss, not the score); the copy answers and the background are compared
as the score is, paired by seed, with Holm
over the {m} comparisons of both (a second family: the primary comparisons above stand as designed). Losses: mean ±
SD over seeds; Δ as above.

| {" | ".join(header)} |
|{"---|" * len(header)}
{chr(10).join(lines)}

{chr(10).join(resolution)}
"""


def budget_note(steps: int) -> str:
    """How the default budget was chosen, and whether this invocation kept it."""
    if steps == DEFAULT_STEPS:
        return BUDGET_NOTE
    return (
        f"**Not the study's budget** (`--steps {steps}`). How the default of {DEFAULT_STEPS} was chosen: {BUDGET_NOTE}"
    )


def interval(row: pd.Series) -> str:
    """A comparison as 'mean [low, high]', starred when Holm rejects it."""
    mark = " *" if row["rejected"] else ""
    return f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]{mark}"


# The paper's losses have three decimals, so a difference of two of them is known to about ±0.001: no sign there.
PAPER_ROUNDING = 0.001


def paper_gap(comparison: str) -> float:
    """The paper's Table 4 difference for a comparison named 'variant − base'."""
    variant, base = comparison.split(" − ")
    return PAPER_LOSS[variant] - PAPER_LOSS[base]


def gap_drift(per_run: pd.DataFrame, variants: Sequence[str]) -> dict[str, list[float]]:
    """Per comparison and seed, how far the gap moved over the last fifth: the gap at its end minus the gap at its
    start, which is the base's last-fifth drop minus the variant's."""
    drops = comparisons(per_run, variants, "last_fifth_drop")  # the variant's drop − the base's
    return {key: [-difference for difference in values] for key, values in drops.items()}


def comparison_table(tests: pd.DataFrame, drift: Mapping[str, Sequence[float]], n: int) -> pd.DataFrame:
    """Per comparison: its test, its own minimal detectable difference at the first and last Holm levels, how far
    the gap moved over the last fifth (mean over seeds), the paper's gap, whether that gap reaches the first-level
    MDD, and what the study resolved."""
    m = len(tests)
    rows = []
    for r in tests.itertuples():
        first = minimal_detectable_difference(r.sd, n, ALPHA / m)
        gap = paper_gap(r.comparison)
        if not r.rejected:
            verdict = "not resolved"
        elif abs(gap) <= PAPER_ROUNDING:
            verdict = "resolved; the paper's gap is ≈ 0"
        else:
            verdict = "resolved, " + ("same sign as the paper" if r.mean * gap > 0 else "opposite sign to the paper")
        rows.append(
            {
                "comparison": r.comparison,
                "Δ": f"{r.mean:+.4f}",
                "paired SD": f"{r.sd:.4f}",
                "p (paired t)": f"{r.p:.2g}",
                "p (Holm)": f"{r.p_holm:.2g}",
                "Holm divisor": str(r.divisor),
                f"MDD at α/{m}": f"{first:.4f}",
                "MDD at α": f"{minimal_detectable_difference(r.sd, n, ALPHA):.4f}",
                "gap drift, last fifth": f"{statistics.fmean(drift[r.comparison]):+.4f}",
                "paper Δ": f"{gap:+.3f}",
                "paper Δ vs MDD": "within reach" if abs(gap) >= first else "below",
                "verdict": verdict,
            }
        )
    return pd.DataFrame(rows)


def paper_verdict(table: pd.DataFrame, m: int) -> str:
    """Which of the paper's gaps this study could resolve, and how the resolved comparisons compare with the paper."""
    below = table[table["paper Δ vs MDD"] == "below"]
    missed = table[(table["paper Δ vs MDD"] == "within reach") & (table["verdict"] == "not resolved")]
    resolved = table[table["verdict"].str.startswith("resolved")]
    parts = []
    if len(below):
        gaps = below["paper Δ"].astype(float).abs()
        every = len(below) == len(table)
        parts.append(
            f"For {len(below)} of {len(table)} comparisons the paper's gap ({gaps.min():.3f}–{gaps.max():.3f} nats) is "
            f"below the comparison's own minimal detectable difference at α/{m} (MDD, from its paired SD): "
            + ("**the paper's gaps are beyond this study's resolution**" if every else "beyond this study's resolution")
            + "; where this study does not resolve one of those comparisons, agreement or disagreement with the paper "
            "cannot be read off here."
        )
    else:
        parts.append(f"Every paper gap reaches its comparison's minimal detectable difference at α/{m}.")
    if len(missed):
        parts.append(f"Not resolved although the paper's gap is within reach: {', '.join(missed['comparison'])}.")
    for verdict, label in (
        ("resolved, same sign as the paper", "with the paper's sign"),
        ("resolved, opposite sign to the paper", "against the paper's sign"),
        ("resolved; the paper's gap is ≈ 0", f"where the paper's gap is within its rounding (±{PAPER_ROUNDING})"),
    ):
        names = resolved[resolved["verdict"] == verdict]["comparison"].tolist()
        if names:
            parts.append(f"Resolved {label}: {', '.join(names)}.")
    if len(resolved):
        larger = (resolved["Δ"].astype(float).abs() > resolved["paper Δ"].astype(float).abs()).sum()
        parts.append(
            "Every resolved gap is larger than the paper's for the same comparison."
            if larger == len(resolved)
            else f"{larger} of the {len(resolved)} resolved gaps are larger than the paper's for the same comparison."
        )
    parts.append(
        "Each MDD takes the comparison's SD as known, though it is estimated on n − 1 degrees of freedom, so the "
        "line between reach and not is itself uncertain."
    )
    return " ".join(parts)


def narrowing(tests: pd.DataFrame, drift: Mapping[str, Sequence[float]]) -> str:
    """Which way the resolved gaps drifted over the last fifth: towards 0 (narrowing) or away from it."""
    resolved = tests[tests["rejected"]]
    if resolved.empty:
        return ""
    narrowed = [r.comparison for r in resolved.itertuples() if r.mean * statistics.fmean(drift[r.comparison]) < 0]
    widened = [name for name in resolved["comparison"] if name not in narrowed]
    text = f"{len(narrowed)} of the {len(resolved)} resolved gaps narrowed over it (drifted towards 0)"
    if narrowed:
        text += ": a longer budget may leave those smaller (not measured)"
    if widened:
        text += f". Widened or held: {', '.join(widened)}"
    return text + "."


def normality_note(n: int, m: int) -> str:
    """Why the check of the t test's normality is by eye, when no sign-flip test could replace it at n seeds."""
    smallest = 2 / 2**n  # a sign-flip test's smallest two-sided p: every difference of one sign
    if smallest <= ALPHA / m:
        return ""
    return (
        f"; with {n} seeds no sign-flip or rank test could stand in for it at the first Holm level (its smallest "
        f"two-sided p is 2/2^{n} = {smallest:.3g}, against α/{m} = {ALPHA / m:.3g}), so a split between seeds is for "
        "the eye"
    )


def report(
    per_run: pd.DataFrame,
    tests: pd.DataFrame,
    ratios: dict[str, float],
    seeds: Sequence[int],
    steps: int,
    config,
    command: str,
    timing: tuple[float, float, int],
    figures: tuple[Path, Path],
    rounds: int,
    state: tuple[str, bool],
    warning: str = "",
) -> str:
    """The Markdown report: the design first, then the scores, the paired comparisons and the figures.
    `timing`: minutes of run time summed over the runs, minutes of wall time in this invocation, runs it trained."""
    from attnres_lens.presets import DEPTH_MIXING_VARIANTS

    variants = list(dict.fromkeys(per_run["variant"]))
    by_name = tests.set_index("comparison")
    n, m = len(seeds), len(tests)
    median_sd = float(tests["sd"].median())
    mdd_first = minimal_detectable_difference(median_sd, n, ALPHA / m)
    mdd_last = minimal_detectable_difference(median_sd, n, ALPHA)
    lines = []
    for name in variants:
        scores = per_run[per_run["variant"] == name]["score"]
        keys = [f"{name} − {base}" for base in (STANDARD, FULL)]
        cells = [interval(by_name.loc[key]) if key in by_name.index else "—" for key in keys]
        drop = per_run[per_run["variant"] == name]["last_fifth_drop"].mean()
        lines.append(
            f"| {name} | {DEPTH_MIXING_VARIANTS[name][0]} | {scores.mean():.4f} ± {scores.std():.4f} | {drop:.4f} | "
            f"{cells[0]} | {cells[1]} | {PAPER_LOSS[name]:.3f} | {ratios[name]:.2f}× |"
        )
    resolved = tests[tests["rejected"]]
    drift = gap_drift(per_run, variants)
    table = comparison_table(tests, drift, n)
    drifts = [statistics.fmean(values) for values in drift.values()]
    multi_head = (
        " The paper's multi-head row is Block AttnRes (S = 4, H = 16), and so is ours."
        if "depth-block-heads16" in variants
        else ""
    )
    minutes, wall, trained = timing
    return f"""# Depth-mixing rules side by side (AttnRes paper Table 4, at CPU scale), paired by seed
{chr(10) + warning + chr(10) if warning else ""}
Generated {provenance(state)} (the code as this invocation started, which stamps its results rows), by `{command}`.
Training took {minutes:.1f} min of run time summed over the {len(per_run)} runs (from each run's files: a resumed run
counts from its last resume), {wall:.1f} min of wall time in this invocation, which trained {trained} of them. Runs
reused from earlier invocations are checked against this design's configs (`check_design`), not against the code
that trained them.

## Design

* **Variants**: {len(variants)} depth-mixing rules (`presets.DEPTH_MIXING_VARIANTS`{"" if len(variants) == len(DEPTH_MIXING_VARIANTS) else ", a subset"}), {config.model.n_layers} layers
  with MLPs ({config.model.n_sublayers} sublayers), d_model {config.model.d_model}, d_mlp {config.model.d_mlp},
  {config.model.n_heads} heads, RoPE; the mixed task (3-gram text with copied segments, vocab
  {config.task.params["vocab_size"]}, length {config.task.params["seq_len"]}).{multi_head}
* **Pairing**: one task for every run (`task.seed={TASK_SEED}`: one language, one held-out set). Seeds {list(seeds)}
  set the initialisation (`train.seed`) and the order of the training batches (`train.data_seed`) only; the
  variants of one seed start from identical shared weights (embedding, attention, MLP and unembedding; a variant's
  own parameters never shift the random stream) and see identical batches.
* **Input-dependent query**: q = RMSNorm(Σ_s v_s) W_j, logits divided by d = {config.model.d_model} (Adam moves each
  of W's d² entries by about lr per step, so unscaled logits would move d times faster than the static
  pseudo-query's); W_j zero-initialised (uniform weights at step 0, like the static query); W_j is weight-decayed
  ({config.train.weight_decay}) like every weight matrix, where the static pseudo-query is not (docs/model.md §8, §11).
* **Budget**: {steps} steps of batch {config.train.batch_size}, AdamW {config.train.lr}, warm-up
  {config.train.warmup_steps}, cosine decay to {config.train.min_lr_ratio}× over the run. {budget_note(steps)}
* **Score**: the mean held-out loss over the evaluations at steps ≥ {(1 - LAST_FRACTION) * steps:.0f} (one every
  {config.train.eval_every} steps) on {config.train.eval_size} fixed held-out sequences.
* **Comparisons**: {m} paired differences (each variant − standard, each variant − Full; Full − standard once),
  paired t on {n - 1} degrees of freedom, Holm–Bonferroni over all {m} at α = {ALPHA}. Each interval is at its
  comparison's Holm level (α/{m} for the most significant, then α/{m - 1}, …; the comparisons Holm does not reject at
  the level where it stopped), so it excludes 0 exactly when Holm rejects (* marks those); they are not simultaneous
  95% intervals.
* **Resolution**: with the median paired SD {median_sd:.4f} over {n} seeds, the minimal detectable difference
  (80% power, noncentral t, the SD taken as known) is {mdd_first:.4f} nats at the first Holm level (α/{m}) and
  {mdd_last:.4f} at the last (α); each comparison's own is in the per-comparison table.
* **Step time**: the median over {rounds} interleaved round{"" if rounds == 1 else "s"} of each variant's forward +
  backward + AdamW step relative to the standard model's in the same round, one thread, one process (a shared
  machine makes these rough).
* **What it cannot say**: anything at the paper's scale (16 layers, billions of tokens); gaps below the minimal
  detectable difference; converged losses (the runs still descend at the end of the budget, and the gaps drift
  with them). The paired t assumes roughly normal per-seed differences{normality_note(n, m)}: the per-seed scores
  are in the CSV.

## Results

Score: mean ± SD over seeds. Last-fifth drop: how far the held-out loss fell from the first to the last evaluation
of the last fifth (mean over seeds; how far from flat the runs still were). Δ: mean paired difference (negative =
lower loss than the base) [interval at the comparison's Holm level]; * = separated from 0 after Holm.

| variant | rule | score | last-fifth drop | Δ vs standard | Δ vs Full | paper loss | step time × standard |
|---|---|---|---|---|---|---|---|
{chr(10).join(lines)}

{len(resolved)} of {m} comparisons are resolved after Holm: {", ".join(resolved["comparison"]) or "none"}.

Over the last fifth of training the gaps moved by {min(drifts):+.4f} to {max(drifts):+.4f} nats (mean over seeds;
"gap drift" below). {narrowing(tests, drift)} The scores are those of a {steps}-step budget, not of converged models.

{paper_verdict(table, m)}

Per comparison (MDD: minimal detectable difference from the comparison's own paired SD; paper Δ: the same
difference in the paper's Table 4):

{markdown_table(table)}

![depth-mixing matrices]({figures[0].name})

![mixing diagnostics]({figures[1].name})

Per-run scores: `depth_mixing_ablation.csv`.
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=DEFAULT_SEEDS)
    parser.add_argument(
        "--variants",
        nargs="+",
        help="a subset of presets.DEPTH_MIXING_VARIANTS (default: all; standard and Full always)",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"steps of every run (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--timing-rounds", type=int, default=12, help="interleaved rounds of the step-time ratio")
    add_study_options(parser, "depth_mixing_ablation_paired")
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=REPO / "analyses" / "reports",
        help="where the report, CSV and figures are written (default: %(default)s, committed)",
    )
    args = parser.parse_args(argv)
    from attnres_lens.presets import DEPTH_MIXING_VARIANTS

    unknown = sorted(set(args.variants or ()) - set(DEPTH_MIXING_VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(DEPTH_MIXING_VARIANTS)}")
    # the bases every comparison is made against come first, then the rest in the table's order
    chosen = {STANDARD, FULL, *(args.variants or DEPTH_MIXING_VARIANTS)}
    args.variants = [name for name in DEPTH_MIXING_VARIANTS if name in chosen]
    if len(set(args.seeds)) < 2:
        parser.error(f"paired intervals need two or more distinct seeds, got {args.seeds}")
    if args.steps < MIN_STEPS:
        parser.error(f"--steps must be at least {MIN_STEPS}, so that the last fifth holds two evaluations")
    return args


def difference_rows(tests: pd.DataFrame, shape: str) -> list[dict]:
    """Results rows of a table of paired comparisons: mean and Holm-level interval of each; a position class's
    comparison ('<class>: <variant> − <base>') names its class in the metric."""
    rows = []
    for r in tests.itertuples():
        label, _, comparison = r.comparison.rpartition(": ")
        family = f" ({label})" if label else ""
        for name, value in (("mean", r.mean), ("Holm-level low", r.low), ("Holm-level high", r.high)):
            rows.append(
                dict(metric=f"paired difference{family}: {name}", shape=shape, variant=comparison, value=float(value))
            )
    return rows


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """Train (or reuse) every run, score and compare them, write the report and the results rows; returns the
    comparisons table."""
    from attnres_lens import load_run

    args = parse_args(argv)
    variants = args.variants
    jobs = study_jobs(variants, args.seeds, args.steps, args.runs_dir, args.set)
    commit, dirty = git_state()  # the code that ran is the code at the start
    trained = sum(not run_is_complete(job.out) for job in jobs)
    seconds = run_jobs(jobs, args.workers)
    check_design(jobs)

    per_run = pd.DataFrame([dict(variant=job.preset, seed=job.seed, **run_score(job.out, args.steps)) for job in jobs])
    args.report_dir.mkdir(parents=True, exist_ok=True)
    per_run.to_csv(args.report_dir / "depth_mixing_ablation.csv", index=False)
    tests = holm_intervals(comparisons(per_run, variants))
    by_class = holm_intervals(
        {
            f"{POSITION_CLASSES[column]}: {key}": differences
            for column in COMPARED_CLASSES
            for key, differences in comparisons(per_run, variants, column).items()
        }
    )
    ratios = step_time_ratios(variants, study_overrides(args.steps, args.set), args.timing_rounds)
    first = min(args.seeds)
    runs = {name: load_run(args.runs_dir / f"{name}-s{first}") for name in variants}
    figures = mixing_figures(runs, variants, args.report_dir)
    command = "python -m analyses.depth_mixing_ablation " + shlex.join(argv if argv is not None else sys.argv[1:])
    timing = (sum(training_minutes(job.out) for job in jobs), seconds / 60, trained)
    config = runs[STANDARD].config
    text = report(
        per_run,
        tests,
        ratios,
        args.seeds,
        args.steps,
        config,
        command,
        timing,
        figures,
        args.timing_rounds,
        (commit, dirty),
        warm_up_warning(job.out for job in jobs),
    )
    text += class_report(per_run, by_class, position_classes(config.build_task().eval_batch(config.train.eval_size)))
    emit_report(text, args.report_dir / "depth_mixing_ablation.md")

    from analyses.benchmarks import record

    shape = f"{config.model.n_layers} layers, {args.steps} steps, {config.train.eval_size} held-out sequences"
    scores = {"score (eval loss, last fifth)": "score"} | {
        f"final loss ({label})": column for column, label in POSITION_CLASSES.items()
    }
    rows = [
        dict(metric=metric, shape=shape, variant=f"{r.variant} seed {r.seed}", value=float(getattr(r, column)))
        for r in per_run.itertuples()
        for metric, column in scores.items()
    ]
    rows += difference_rows(tests, shape) + difference_rows(by_class, shape)
    rows += [
        dict(metric="step time × standard", shape=shape, variant=name, value=ratio, unit="ratio")
        for name, ratio in ratios.items()
    ]
    record(
        "depth_mixing_ablation",
        [{"threads": 1, "unit": "nats", **row} for row in rows],
        command,
        args.results,
        commit,
        dirty,
    )
    return tests


if __name__ == "__main__":
    main()
