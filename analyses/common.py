"""Shared plumbing of the analyses: train many runs (resumably, in parallel) and describe the machine."""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from attnres_lens.rundir import RunDir, load_run, run_is_complete

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    """One run of a study: `preset` trained with `seed` into `out`, then `overrides` applied.

    `task_seed` None seeds the task with `seed` too (each seed its own task: the reproductions' design). An int
    keeps every run on that one task (one language, one held-out set) and lets `seed` vary the initialisation and
    the order of the training batches only (`train.data_seed`), so runs of one seed pair across variants."""

    preset: str
    seed: int
    out: Path
    overrides: tuple[str, ...] = ()
    task_seed: int | None = None

    def seed_overrides(self) -> list[str]:
        """The settings that seed the run (before `overrides`)."""
        if self.task_seed is None:
            return [f"train.seed={self.seed}", f"task.seed={self.seed}"]
        return [f"train.seed={self.seed}", f"task.seed={self.task_seed}", f"train.data_seed={self.seed}"]


BENCH_VOCAB = 256  # the benchmarks' models: d_vocab, and the range of their token batch


def model_dims_and_tokens(shape: dict) -> tuple[dict, torch.Tensor]:
    """A benchmark shape (`ModelConfig` fields plus `batch`) split into the model's fields and its fixed token
    batch `[batch, n_ctx]` (seed 0), as every benchmark that steps or runs a model at that shape uses them."""
    dims = dict(shape)
    batch = dims.pop("batch")
    return dims, torch.randint(0, BENCH_VOCAB, (batch, dims["n_ctx"]), generator=torch.Generator().manual_seed(0))


def _run_job(job: Job) -> str:
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import resume, train

    run_dir = RunDir(job.out)
    if run_dir.is_complete():
        return f"{job.out.name}: already complete"
    start = time.perf_counter()
    if run_dir.read_index().latest is not None:
        resume(job.out, progress=False)
    else:
        if run_dir.holds_run():  # crashed before its first checkpoint: start over
            shutil.rmtree(job.out)
        # one torch thread per process: the runs train side by side, one per core
        overrides = [*job.seed_overrides(), "train.threads=1", *job.overrides]
        train(apply_overrides(get_preset(job.preset), overrides), job.out, progress=False)
    return f"{job.out.name}: trained in {time.perf_counter() - start:.0f} s"


def run_jobs(jobs: list[Job], workers: int) -> float:
    """Train every job (skipping complete runs, resuming partial ones) on `workers` processes; returns seconds."""
    start = time.perf_counter()
    pending = [job for job in jobs if not run_is_complete(job.out)]
    with tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc="runs", unit="run") as bar:
        if workers <= 1:
            for job in pending:
                bar.write(_run_job(job))
                bar.update(1)
        else:
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for message in pool.imap_unordered(_run_job, pending):
                    bar.write(message)
                    bar.update(1)
    return time.perf_counter() - start


def training_minutes(out: Path) -> float:
    """Wall time a run spent training (`RunDir.training_seconds`), in minutes."""
    return RunDir(out).training_seconds() / 60


def machine() -> dict:
    """The facts that make timings comparable: CPU model, logical cores, GPU (None without CUDA). Every benchmark row
    and report header takes the machine from here (docs/architecture.md, owners table)."""
    cpuinfo = Path("/proc/cpuinfo")
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            "",
        )
        if cpuinfo.exists()
        else ""
    )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(cpu=cpu or platform.processor() or platform.machine(), cores=os.cpu_count(), gpu=gpu)


NOT_DIRTYING = ("analyses/results.jsonl", "docs/results.md")  # written by the benchmarks themselves


def git_state() -> tuple[str, bool]:
    """(commit hash of HEAD, whether tracked files differ from it). The results file and its rendered page are left
    out of the dirty check: appending one benchmark's rows must not mark the next benchmark's rows dirty."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changes = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{path}" for path in NOT_DIRTYING)
        )
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(
            f"benchmark rows record the git commit, but git failed in {REPO}: {error}; run from a git "
            "checkout of the repository"
        ) from error
    return commit, bool(changes.strip())


def machine_info() -> str:
    """`machine()` as one line for a study's report header, with the software versions."""
    facts = machine()
    gpu = f", {facts['gpu']}" if facts["gpu"] else ""
    return (
        f"{facts['cpu']}, {facts['cores']} cores{gpu}, {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def provenance(state: tuple[str, bool] | None = None) -> str:
    """When, at which commit and on what a report was made, for the reports that stay Markdown (benchmark rows
    carry the same facts as fields, `analyses.benchmarks`). `state`: the (commit, dirty) `git_state` gave when the
    work started (default: now; a study that writes its own outputs before its report would count them as changes)."""
    commit, dirty = state or git_state()
    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC} at commit {commit[:7]}"
        f"{' with uncommitted changes' if dirty else ''} on {machine_info()}"
    )


def command_line() -> str:
    """How this script was started, as a command to run from the repository root."""
    module = ".".join(Path(os.path.relpath(sys.argv[0], REPO)).with_suffix("").parts)
    return "python -m " + " ".join(shlex.quote(arg) for arg in [module, *sys.argv[1:]])


def steps_to_threshold(steps, values, threshold: float) -> int | None:
    """First step at which `values` reaches `threshold`, or None."""
    for step, value in zip(steps, values):
        if value >= threshold:
            return int(step)
    return None


def reproduction_jobs(
    description: str, presets: list[str], default_seeds: list[int], name: str
) -> tuple[list[Job], argparse.Namespace]:
    """Parse a reproduction's command line and list its runs: one per preset and seed, under --runs-dir."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", type=int, nargs="+", default=default_seeds)
    parser.add_argument("--steps", type=int, help="override the presets' step budget (same for every variant)")
    parser.add_argument("--workers", type=int, default=2, help="training processes (one torch thread each)")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / name)
    parser.add_argument("--report-dir", type=Path, default=REPO / "analyses" / "reports")
    args = parser.parse_args()
    overrides = (f"train.steps={args.steps}",) if args.steps else ()
    jobs = [
        Job(preset, seed, args.runs_dir / f"{preset}-s{seed}", overrides) for preset in presets for seed in args.seeds
    ]
    return jobs, args


def within_rounds(samples: Sequence[float], base: Sequence[float], compare: str = "ratio") -> float:
    """The median over interleaved rounds of each round's `ratio` (or `difference`) to the baseline's time in the
    same round: a slow spell of the shared machine that spans a round slows the baseline too, where medians of
    each variant's own times would mix rounds (single runs moved by ±7% that way)."""
    if len(samples) != len(base):
        raise ValueError(f"one baseline time per round: got {len(samples)} samples and {len(base)} baseline times")
    pairs = zip(samples, base)
    if compare == "ratio":
        return statistics.median(t / b for t, b in pairs)
    if compare == "difference":
        return statistics.median(t - b for t, b in pairs)
    raise ValueError(f"compare must be 'ratio' or 'difference', got {compare!r}")


def emit_report(text: str, out: Path | None) -> None:
    """Print a markdown report and, when `out` is given, write it there."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def markdown_table(frame: pd.DataFrame, digits: int = 3) -> str:
    """A DataFrame as a Markdown table (numbers rounded to `digits`; a `|` inside a cell escaped)."""
    from analyses.results import table_cell

    def cell(value: object) -> str:
        return table_cell(f"{value:.{digits}f}" if isinstance(value, float) else value)

    lines = ["| " + " | ".join(map(table_cell, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


DESIGN_MARK = "Design, stated before any result:"


def add_study_options(parser: argparse.ArgumentParser, runs: str, report: str | None = None) -> None:
    """The options every study takes: `--set` overrides for every run, `--workers`, `--runs-dir` (default
    runs/`runs`), `--results`, and `--report` (default analyses/reports/`report`) unless `report` is None (a study
    that writes a folder of outputs names its own option)."""
    from analyses.results import RESULTS

    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run"
    )
    parser.add_argument("--workers", type=int, default=2, help="training processes (one torch thread each)")
    parser.add_argument(
        "--runs-dir", type=Path, default=REPO / "runs" / runs, help="where the runs are trained (default: %(default)s)"
    )
    if report is not None:
        parser.add_argument(
            "--report",
            type=Path,
            default=REPO / "analyses" / "reports" / report,
            help="the report written (default: %(default)s, committed)",
        )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="the results file the rows are appended to (default: %(default)s)"
    )


def warm_up_warning(runs: Iterable[Path]) -> str:
    """A report's warning when any of its runs ended within its learning-rate warm-up (a smoke run's few steps): their
    losses are still near the start, so whatever the report compares is noise. Empty otherwise."""
    short = [(run, load_run(run, load_model=False).config.train) for run in runs]
    short = [(run, train) for run, train in short if train.steps <= train.warmup_steps]
    if not short:
        return ""
    run, train = short[0]
    return (
        f"**A smoke run, not a result**: {len(short)} run(s) ended within the learning-rate warm-up (e.g. {run.name}: "
        f"{train.steps} steps, warm-up {train.warmup_steps}), so their losses are still near their start and every "
        "comparison below is noise."
    )


def study_head(title: str, docstring: str, command: str) -> list[str]:
    """A study report's first lines: the title, where and when it ran, the command, and its design, which the
    study's module docstring states after `DESIGN_MARK` and before its usage line (`    python -m …`)."""
    design = docstring.split(DESIGN_MARK)[1].split("    python -m")[0].strip()
    return [f"# {title}", "", provenance(), "", f"Command: `{command}`", "", "## Design", "", design]
