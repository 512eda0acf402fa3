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
work, and the library's engine once more with one worker per core, the parallelism it ships with. Then the `prune` command end to end, as shipped (one thread per core, freed memory kept
for reuse) and with `--threads 1`, alternating, twice each; and one forward and backward pass of first-order edge
attribution against the exact knockouts it estimates.

    python -m analyses.bench_attribution --out analyses/reports/bench_attribution.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pandas as pd
import torch

from analyses.common import command_line, emit_report, machine_info
from attnres_lens import cpu_settings
from attnres_lens.analysis import causal_routing, edge_agreement, edge_attribution, prune_tables
from attnres_lens.analysis import engine as library_engine
from attnres_lens.analysis import pruning, routing
from attnres_lens.analysis.engine import StagedForward
from attnres_lens.config import apply_overrides
from attnres_lens.evaluation import score_logits
from attnres_lens.presets import get_preset
from attnres_lens.rundir import load_run
from attnres_lens.training import train


# ---------------------------------------------------------------------------- the old engines, inline
def one_pass_per_intervention(model, batch, interventions_, max_sequences=None, progress=False, desc="", cache=None,
                              score=score_logits, workers=1, remember=None):
    with torch.no_grad():
        return [score(model.run_with_hooks(batch.tokens, fwd_hooks=list(hooks)), batch) for hooks in interventions_]


def stacked_full_passes(model, batch, interventions_, max_sequences=64, progress=False, desc="", cache=None,
                        score=score_logits, workers=1, remember=None):
    """The previous `evaluate_many`: copies of the batch in full passes of up to 64 sequences."""
    n_batch = batch.tokens.shape[0]
    per_pass = max(1, max_sequences // n_batch)
    results = []
    with torch.no_grad():
        for start in range(0, len(interventions_), per_pass):
            group = interventions_[start : start + per_pass]
            by_name: dict[str, list] = defaultdict(list)
            for slot, hooks in enumerate(group):
                for name, hook in hooks:
                    by_name[name].append((slot, hook))
            fwd_hooks = [(name, library_engine._on_copies(n_batch, hooks)) for name, hooks in by_name.items()]
            logits = model.run_with_hooks(batch.tokens.repeat(len(group), 1), fwd_hooks=fwd_hooks)
            results += [score(part, batch) for part in logits.split(n_batch)]
    return results


@contextmanager
def engine(evaluate_many: Optional[Callable]) -> Iterator[list[int]]:
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


def load_average() -> str:
    return " / ".join(f"{value:.2f}" for value in os.getloadavg())


# ---------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="depth-full")
    parser.add_argument("--steps", type=int, default=300,
                        help="training steps before measuring (default 300: past the untrained start, where every "
                             "removal is harmless and each cumulative curve runs to the end)")
    parser.add_argument("--samples", type=int, default=32, help="held-out sequences, as `prune --samples`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the model (e.g. model.n_layers=2 for a quick run)")
    parser.add_argument("--skip-one-pass", action="store_true", help="do not time one pass per intervention")
    parser.add_argument("--cli-repeats", type=int, default=2, help="runs of the prune command per setting (default 2)")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the engines are compared on work; the CLI below runs as shipped
    cpu_settings.keep_freed_memory()  # as the CLI does

    started = time.perf_counter()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / args.preset
        config = apply_overrides(get_preset(args.preset), [
            f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.record_every={args.steps}",
            f"train.checkpoint_every={args.steps}", "train.threads=1", *args.overrides])
        _, train_wall, _ = timed(lambda: train(config, run_dir, progress=False))
        run = load_run(run_dir)
        model, batch = run.model, run.config.build_task().eval_batch(args.samples)

        cores = os.cpu_count() or 1
        parallel = f"shared prefixes, {cores} workers"
        forked = f"shared prefixes, {cores} threads, routing in a forked process (as `prune` runs)"
        paths = [("shared prefixes", None, 1, False), (parallel, None, cores, False),
                 ("stacked full passes", stacked_full_passes, 1, False)]
        if not args.skip_one_pass:
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
            measured[label] = dict(tables=tables, wall=wall, cpu=cpu, interventions=None if fork else count[0],
                                   passes=None if fork else passes)
            print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)
        torch.set_num_threads(1)
        reference = measured["shared prefixes"]["tables"]
        differences = {label: max_difference(reference, entry["tables"]) for label, entry in measured.items()}

        command = [str(Path(sys.executable).parent / "attnres-lens"), "prune", str(run_dir), "--samples",
                   str(args.samples), "--no-progress", "--out", str(Path(tmp) / "prune")]
        cli_walls: dict[str, list[float]] = {"as shipped": [], "--threads 1": []}
        for _ in range(args.cli_repeats):
            for label, extra in (("as shipped", []), ("--threads 1", ["--threads", "1"])):
                wall = time.perf_counter()
                subprocess.run(command + extra, check=True, stdout=subprocess.DEVNULL)
                cli_walls[label].append(time.perf_counter() - wall)
        cli_wall = min(cli_walls["as shipped"])

        import_wall = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import attnres_lens.analysis.run"], check=True)
        import_wall = time.perf_counter() - import_wall
        pass_wall = clean_pass_time(model, batch.tokens)

        edges, edge_wall, _ = timed(lambda: edge_attribution(model, batch))
        exact, exact_wall, _ = timed(lambda: causal_routing(model, batch))
        agreement, worst = edge_agreement(edges, exact, top=5)
    load_after = load_average()

    cfg = model.cfg
    shared = measured["shared prefixes"]
    lines = [
        "# Exact interventions: one pass each, stacked full passes, shared prefixes",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, "
        f"in {time.perf_counter() - started:.0f} s, by `{command_line()}`. Load average (1/5/15 min) "
        f"{load_before} before and {load_after} after: the machine is shared, so wall times carry other "
        "processes' load; CPU times are this process's own (summed over its threads).",
        "",
        f"Model: preset `{args.preset}` ({cfg.n_layers} layers, d_model {cfg.d_model}, d_mlp {cfg.d_mlp}, "
        f"{cfg.n_sublayers} sublayers, {run.model_config.description}), trained {args.steps} steps "
        f"({train_wall:.0f} s); {args.samples} held-out sequences of length {batch.tokens.shape[1]} of its task. "
        "Each row is one `prune_tables` call (sensitivity, angular distances, cumulative curves, causal routing) "
        f"at one torch thread, except the rows with {cores} workers (one per core: the stacked branches run on "
        "that many threads, each on its own copy of the modules) and the forked row (`fork_routing=True`: the "
        "causal-routing table in a forked child on one thread, the other tables here on the other; its "
        "CPU includes the child's, whose interventions and work this process does not see); work counts "
        "sequence × sublayer evaluations, "
        "in units of one full forward pass over the batch. `max |Δ|`: the largest difference of any number the tables "
        "measure from the shared engine's; ranks derived from them (routing disagreements) are counted apart, since "
        "two effects within float rounding of each other may swap places.",
        "",
        "| engine | interventions | work (full-pass equivalents) | wall (s) | CPU (s) | × shared (wall) | "
        "max \\|Δ\\| vs shared | rank entries that differ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in measured.items():
        counted = entry["interventions"] is not None
        lines.append(f"| {label} | {entry['interventions'] if counted else '–'} | "
                     f"{format(entry['passes'], '.0f') if counted else '–'} | {entry['wall']:.1f} | "
                     f"{entry['cpu']:.1f} | {entry['wall'] / shared['wall']:.2f} | {differences[label][0]:.1e} | "
                     f"{differences[label][1]} |")
    lines += [
        "",
        f"`attnres-lens prune RUN --samples {args.samples}` end to end (process start, imports, model load, every "
        f"table, the HTML report), alternating: as shipped (one thread per core) "
        f"{' / '.join(f'{t:.1f}' for t in cli_walls['as shipped'])} s, with `--threads 1` "
        f"{' / '.join(f'{t:.1f}' for t in cli_walls['--threads 1'])} s: **{cli_wall:.1f} s** at best. "
        "What it is made of: importing the package takes "
        f"{import_wall:.1f} s (torch and TransformerLens), and one clean forward pass over the batch "
        f"{pass_wall * 1e3:.0f} ms (median of 10, no hooks), so the {shared['passes']:.0f} full-pass equivalents "
        f"of exact work at a clean pass's rate come to {shared['passes'] * pass_wall:.1f} s "
        f"({import_wall + shared['passes'] * pass_wall:.1f} s with the imports; spread perfectly over {cores} "
        f"cores, {import_wall + shared['passes'] * pass_wall / cores:.1f} s); the engine's stacked passes run "
        f"larger batches than a clean pass (stacks of up to {library_engine.STACK_ELEMENTS:,} elements an "
        "activation) but also hooks, stacking and their own depth mixes.",
        "",
        "First-order edge attribution (one forward and one backward pass, every edge at once) against the exact "
        f"knockouts it estimates: {edge_wall:.2f} s vs {exact_wall:.1f} s ({len(exact)} edges); Spearman "
        f"{agreement['spearman']:.3f} overall, {agreement['spearman_within_consumer']:.3f} within consumers, sign "
        f"agreement {agreement['sign_agreement']:.2f}. Largest disagreements:",
        "",
        "| consumer | source | α mass | max α | exact Δloss | estimate |",
        "|---|---|---|---|---|---|",
    ]
    for _, row in worst.iterrows():
        lines.append(f"| {row['consumer_label']} | {row['source_label']} | {row['alpha_mass']:.3f} | "
                     f"{row['max_alpha']:.3f} | {row['delta_loss']:.5f} | {row['total']:.5f} |")
    text = "\n".join(lines) + "\n"
    emit_report(text, args.out)
    return lines


if __name__ == "__main__":
    main()
