"""Exact interventions, old engine vs new, on a 12-layer Full AttnRes model (issue 13).

`attnres-lens prune` evaluates a few hundred exact interventions (sublayer ablations, cumulative removal sets, a
knockout of every source of every consumer). This times the same `prune_tables` call three ways, in one process,
on one briefly trained depth-full model and the run's held-out batch:

* `one pass per intervention`: a full forward pass of the model for each intervention (inline below);
* `stacked full passes`: the engine before this change: copies of the batch stacked into full forward passes
  of up to 64 sequences (inline below);
* `shared prefixes` (the library's `evaluate_many` now): the forward pass in stages; interventions share the
  stages before they part, and branches run stacked from there; with several workers, branches run on that
  many threads.

The tables must agree (max |difference| reported); the engines run at one torch thread, so the comparison is of
work, and the library's engine once more with one worker per core, the parallelism it ships with. Then the
`prune` command end to end, as shipped (one thread per core, freed memory kept for reuse) and with `--threads 1`,
alternating, twice each (the best of each counts); and one forward and backward pass of first-order edge attribution
against the exact knockouts it estimates.

    python -m analyses.benchmarks bench_attribution
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch

from attnres_lens import cpu_settings
from attnres_lens.analysis import (
    causal_routing,
    edge_agreement,
    edge_sensitivity,
    prune_tables,
    pruning,
    routing,
)
from attnres_lens.analysis import engine as library_engine
from attnres_lens.analysis.engine import StagedForward
from attnres_lens.config import apply_overrides
from attnres_lens.evaluation import score_logits
from attnres_lens.presets import get_preset
from attnres_lens.rundir import load_run
from attnres_lens.training import train


# ---------------------------------------------------------------------------- the old engines, inline
def one_pass_per_intervention(
    model,
    batch,
    interventions_,
    max_sequences=None,
    progress=False,
    desc="",
    cache=None,
    score=score_logits,
    workers=1,
    remember=None,
):
    with torch.no_grad():
        return [score(model.run_with_hooks(batch.tokens, fwd_hooks=list(hooks)), batch) for hooks in interventions_]


def stacked_full_passes(
    model,
    batch,
    interventions_,
    max_sequences=64,
    progress=False,
    desc="",
    cache=None,
    score=score_logits,
    workers=1,
    remember=None,
):
    """The previous `evaluate_many`: copies of the batch in full passes of up to 64 sequences (what the engine still
    runs for a model whose stages it does not know)."""
    with torch.no_grad():
        return library_engine._plain_evaluations(model, batch, interventions_, score, False, desc, max_sequences)


@contextmanager
def engine(evaluate_many: Callable | None) -> Iterator[list[int]]:
    """Run the pruning code with another `evaluate_many` (None: the library's), counting interventions."""
    count = [0]
    inner = evaluate_many or library_engine.evaluate_many

    def counted(model, batch, interventions_, *args, **kwargs):
        count[0] += len(interventions_)
        return inner(model, batch, interventions_, *args, **kwargs)

    def single(model, batch, fwd_hooks=()):
        return counted(model, batch, [fwd_hooks])[0]

    saved = {module: (module.evaluate_many, module.evaluate) for module in (pruning, routing)}
    try:
        for module in saved:
            module.evaluate_many, module.evaluate = counted, single
        yield count
    finally:
        for module, (many, one) in saved.items():
            module.evaluate_many, module.evaluate = many, one


@contextmanager
def counting_sublayers(model) -> Iterator[list[int]]:
    """Count sequence × sublayer evaluations (a machine-independent measure of the work), in the staged forward
    pass and in full forward passes alike: the sublayer classes' (attention, MLP) forward counts the sequences it
    gets, so a sublayer that an intervention replaces and the engine skips is not counted. Not a hook: a hook on a
    sublayer makes the engine compute it for every copy."""
    count = [0]
    forward = StagedForward(model)
    classes = {type(forward.sublayer_parts(j)[3]) for j in range(model.cfg.n_sublayers)}
    shipped = {cls: cls.forward for cls in classes}

    def counting(original):
        def run(module, x, *args, **kwargs):
            count[0] += x.shape[0]
            return original(module, x, *args, **kwargs)

        return run

    for cls in classes:
        cls.forward = counting(shipped[cls])
    try:
        yield count
    finally:
        for cls, original in shipped.items():
            cls.forward = original


def timed(function: Callable) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def max_difference(a: dict[str, pd.DataFrame], b: dict[str, pd.DataFrame]) -> tuple[float, int]:
    """(largest |difference| of any measured number, count of rank entries that differ): ranks (columns named
    *rank*) are derived from the measured numbers, and two effects within float rounding of each other may swap."""
    worst, swapped = 0.0, 0
    for name, frame in a.items():
        other = b[name]
        assert list(frame.columns) == list(other.columns) and len(frame) == len(other), name
        for column in frame.select_dtypes("number").columns:
            difference = (frame[column].astype(float) - other[column].astype(float)).abs()
            if "rank" in column:
                swapped += int((difference > 0).sum())
                continue
            worst = max(worst, float(difference.max(skipna=True) if difference.notna().any() else 0.0))
    return worst, swapped


def clean_pass_time(model, tokens: torch.Tensor, repeats: int = 10) -> float:
    """Median wall time of one unhooked forward pass (the unit the work column counts in)."""
    times = []
    with torch.no_grad():
        model(tokens)
        for _ in range(repeats):
            start = time.perf_counter()
            model(tokens)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------- the rows
def measure(
    preset: str = "depth-full",
    steps: int = 300,
    samples: int = 32,
    overrides: Sequence[str] = (),
    skip_one_pass: bool = False,
    cli_repeats: int = 2,
) -> list[dict]:
    """Rows of the comparison: the model of `preset` with `overrides` trained `steps` steps (300: past the untrained
    start, where every removal is harmless and each cumulative curve runs to the end), `samples` held-out sequences
    (as `prune --samples`); the prune command `cli_repeats` times per setting; `skip_one_pass` leaves out the slowest
    engine."""
    torch.set_num_threads(1)  # the engines are compared on work; the CLI below runs as shipped
    cpu_settings.keep_freed_memory()  # as the CLI does

    load_before = os.getloadavg()[0]  # the machine is shared: wall times carry other processes' load
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / preset
        config = apply_overrides(
            get_preset(preset),
            [
                f"train.steps={steps}",
                f"train.eval_every={steps}",
                f"train.record_every={steps}",
                f"train.checkpoint_every={steps}",
                "train.threads=1",
                *overrides,
            ],
        )
        _, train_wall, _ = timed(lambda: train(config, run_dir, progress=False))
        run = load_run(run_dir)
        model, batch = run.model, run.config.build_task().eval_batch(samples)

        cores = os.cpu_count() or 1
        parallel = f"shared prefixes, {cores} workers"
        forked = f"shared prefixes, {cores} threads, routing in a forked process (as `prune` runs)"
        paths = [
            ("shared prefixes", None, 1, False),
            (parallel, None, cores, False),
            ("stacked full passes", stacked_full_passes, 1, False),
        ]
        if not skip_one_pass:
            paths.append(("one pass per intervention", one_pass_per_intervention, 1, False))
        paths += [(f"{parallel} (again)", None, cores, False), (forked, None, cores, True)]
        measured = {}
        for label, evaluate_many, threads, fork in paths:
            torch.set_num_threads(threads)  # the analyses run one worker per torch thread
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            with engine(evaluate_many) as count, counting_sublayers(model) as work:
                tables, wall, cpu = timed(lambda: prune_tables(model, batch, fork_routing=fork))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu += (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)  # a forked table's
            passes = work[0] / (model.cfg.n_sublayers * batch.tokens.shape[0])  # in full passes over the batch
            # a forked child's interventions and work are not counted here
            measured[label] = dict(
                tables=tables,
                wall=wall,
                cpu=cpu,
                interventions=None if fork else count[0],
                passes=None if fork else passes,
                threads=threads,
            )
            print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)
        torch.set_num_threads(1)
        reference = measured["shared prefixes"]["tables"]
        differences = {label: max_difference(reference, entry["tables"]) for label, entry in measured.items()}

        command = [
            str(Path(sys.executable).parent / "attnres-lens"),
            "prune",
            str(run_dir),
            "--samples",
            str(samples),
            "--no-progress",
            "--out",
            str(Path(tmp) / "prune"),
        ]
        cli_walls: dict[str, list[float]] = {"as shipped": [], "--threads 1": []}
        for _ in range(cli_repeats):
            for label, extra in (("as shipped", []), ("--threads 1", ["--threads", "1"])):
                wall = time.perf_counter()
                subprocess.run(command + extra, check=True, stdout=subprocess.DEVNULL)
                cli_walls[label].append(time.perf_counter() - wall)

        import_wall = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import attnres_lens.analysis.run"], check=True)
        import_wall = time.perf_counter() - import_wall
        pass_wall = clean_pass_time(model, batch.tokens)

        edges, edge_wall, _ = timed(lambda: edge_sensitivity(model, batch))
        exact, exact_wall, _ = timed(lambda: causal_routing(model, batch))
        agreement, _ = edge_agreement(edges, exact, top=5)
    load_after = os.getloadavg()[0]

    cfg = model.cfg
    shape = (
        f"preset {preset}{''.join(' ' + override for override in overrides)} ({cfg.n_layers} layers, d_model "
        f"{cfg.d_model}), {steps} steps, {samples} samples"
    )
    rows = []
    for label, entry in measured.items():
        common = dict(shape=shape, variant=label, threads=entry["threads"])
        rows += [
            dict(common, metric="prune_tables wall", value=entry["wall"], unit="s"),
            dict(common, metric="prune_tables CPU", value=entry["cpu"], unit="s"),
            dict(common, metric="max |Δ| vs shared prefixes", value=differences[label][0], unit="abs"),
            dict(common, metric="rank entries that differ", value=differences[label][1], unit="count"),
        ]
        if entry["interventions"] is not None:  # a forked child's work is not seen here
            rows += [
                dict(common, metric="interventions", value=entry["interventions"], unit="count"),
                dict(common, metric="work", value=entry["passes"], unit="full passes"),
            ]
    for label, walls in cli_walls.items():  # the best of the alternating runs: the least disturbed
        rows.append(
            dict(metric="prune end to end", shape=shape, variant=label, threads=None, value=min(walls), unit="s")
        )
    common = dict(shape=shape, threads=1)
    rows += [
        dict(common, metric="load average (1 min)", variant="before", value=load_before, unit="processes"),
        dict(common, metric="load average (1 min)", variant="after", value=load_after, unit="processes"),
        dict(common, metric="package import", variant="attnres_lens.analysis.run", value=import_wall, unit="s"),
        dict(common, metric="clean forward pass", variant="no hooks", value=1e3 * pass_wall, unit="ms"),
        dict(common, metric="edge attribution", variant="first order", value=edge_wall, unit="s"),
        dict(common, metric="edge attribution", variant="exact knockouts", value=exact_wall, unit="s"),
        *(
            dict(
                common,
                metric=f"edge attribution {name}",
                variant="first order vs exact",
                value=agreement[name],
                unit="",
            )
            for name in ("spearman", "spearman_within_consumer", "sign_agreement")
        ),
    ]
    return rows


TINY = dict(steps=2, samples=2, overrides=["model.n_layers=1"], skip_one_pass=True)


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """Exact interventions' engines on a 12-layer Full AttnRes model; `prune` end to end; edge attribution."""
    settings = TINY if tiny else dict(steps=300, samples=32, overrides=[], skip_one_pass=False)
    return measure(**settings, cli_repeats=repeats or (1 if tiny else 2))
