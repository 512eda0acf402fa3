"""How large exact interventions' stacks should be, and what mixing the stacked copies' shared sources once saves
(issue 13; docs/analysis.md §11).

On one briefly trained depth-full model (as `bench_attribution` trains it) and the run's held-out batch:

* `prune_tables` at one worker per core (as `attnres-lens prune` runs) with stacks of 64 sequences (the earlier
  default), 128, 256, 512 and the shipped default (copies within `engine.STACK_ELEMENTS` elements an
  activation), interleaved rounds;
* `causal_routing` at one thread in the shipped stacks with the copies' shared sources mixed once (as shipped) and
  with every copy mixing all its sources (`DepthStream.stacked_from` left unused), interleaved; the results must
  agree;
* the tables' fixed cost: `prune_tables` at one thread on the batch and on 2 held-out sequences, stacked as
  many copies at a time, so the same interventions run in the same passes and only the arithmetic shrinks: what
  is left at 2 sequences is Python, dispatch and allocation, which worker threads cannot overlap (the GIL).

    python -m analyses.bench_stack_size --out analyses/reports/bench_stack_size.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from analyses.common import command_line, emit_report, machine_info, within_rounds
from attnres_lens import cpu_settings
from attnres_lens.analysis import engine, routing
from attnres_lens.analysis.run import prune_tables
from attnres_lens.attnres import DepthStream
from attnres_lens.config import apply_overrides
from attnres_lens.presets import get_preset
from attnres_lens.rundir import load_run
from attnres_lens.training import train


def with_stacks(max_sequences: Optional[int], function: Callable[[], object]) -> Callable[[], object]:
    """`function` with `evaluate_many`'s default stack size replaced (None: as shipped)."""
    inner = engine.evaluate_many.__wrapped__  # under its no_grad decorator
    shipped = inner.__defaults__

    def run() -> object:
        inner.__defaults__ = (max_sequences, *shipped[1:])
        try:
            return function()
        finally:
            inner.__defaults__ = shipped

    return run


def without_shared_sources(function: Callable[[], object]) -> Callable[[], object]:
    """`function` with stacked copies mixing every source themselves (the stream never learns what they share)."""
    def run() -> object:
        shipped = DepthStream.stacked_from
        DepthStream.stacked_from = lambda self, states: None
        try:
            return function()
        finally:
            DepthStream.stacked_from = shipped

    return run


def interleaved(functions: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, list[float]], dict]:
    """Seconds of each function per round (one warm-up call each first), and each one's last result."""
    results = {label: function() for label, function in functions.items()}
    times: dict[str, list[float]] = {label: [] for label in functions}
    for _ in range(rounds):
        for label, function in functions.items():
            start = time.perf_counter()
            results[label] = function()
            times[label].append(time.perf_counter() - start)
    return times, results


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="depth-full")
    parser.add_argument("--steps", type=int, default=300, help="training steps before measuring (as bench_attribution)")
    parser.add_argument("--samples", type=int, default=32, help="held-out sequences, as `prune --samples`")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the model (e.g. model.n_layers=2 for a quick run)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512],
                        help="stack sizes in sequences to compare with the shipped default")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    cpu_settings.keep_freed_memory()  # as the commands do
    started = time.perf_counter()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / args.preset
        config = apply_overrides(get_preset(args.preset), [
            f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.record_every={args.steps}",
            f"train.checkpoint_every={args.steps}", "train.threads=1", *args.overrides])
        torch.set_num_threads(1)
        train(config, run_dir, progress=False)
        run = load_run(run_dir)
        model, batch = run.model, run.config.build_task().eval_batch(args.samples)
        per_copy = batch.tokens.numel() * model.cfg.d_model
        default_copies = max(1, engine.STACK_ELEMENTS // per_copy)

        torch.set_num_threads(cores)  # one worker per core, as `prune` runs
        sizes = {f"{size} sequences": size for size in args.sizes}
        sizes[f"default ({default_copies * args.samples} sequences)"] = None
        prune_times, _ = interleaved({label: with_stacks(size, lambda: prune_tables(model, batch))
                                      for label, size in sizes.items()}, args.rounds)

        torch.set_num_threads(1)
        routing_runs = {"shared sources mixed once": lambda: routing.causal_routing(model, batch)}
        routing_runs["every copy mixes all"] = without_shared_sources(routing_runs["shared sources mixed once"])
        routing_times, tables = interleaved(routing_runs, args.rounds + 1)

        small = run.config.build_task().eval_batch(2)
        fixed_runs = {f"the batch ({args.samples} sequences)": with_stacks(default_copies * args.samples,
                                                               lambda: prune_tables(model, batch)),
                      "2 sequences": with_stacks(default_copies * 2, lambda: prune_tables(model, small))}
        fixed_times, _ = interleaved(fixed_runs, args.rounds)
    difference = float((tables["shared sources mixed once"]["delta_loss"]
                        - tables["every copy mixes all"]["delta_loss"]).abs().max())

    cfg = model.cfg
    baseline = f"{args.sizes[0]} sequences"
    lines = [
        "# Exact interventions: stack size and shared sources",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, in "
        f"{time.perf_counter() - started:.0f} s, by `{command_line()}`. Model: preset `{args.preset}` ({cfg.n_layers} "
        f"layers, d_model {cfg.d_model}, {cfg.n_sublayers} sublayers), trained {args.steps} steps; {args.samples} "
        f"held-out sequences of length {batch.tokens.shape[1]}. {args.rounds} interleaved rounds after a warm-up "
        "call each: times are medians, ratios the median over rounds of the ratio within the round.",
        "",
        f"`prune_tables` with {cores} workers (one per core, as `attnres-lens prune` runs), by stack size; the "
        f"shipped default stacks as many copies of the batch as keep an activation within "
        f"{engine.STACK_ELEMENTS:,} elements.",
        "",
        f"| stacks of | seconds (each round) | median (s) | × {baseline} |",
        "|---|---|---|---|",
    ]
    for label, times in prune_times.items():
        lines.append(f"| {label} | {' / '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} | "
                     f"{within_rounds(times, prune_times[baseline]):.3f} |")
    base = routing_times["every copy mixes all"]
    lines += [
        "",
        "`causal_routing` at one thread in the default stacks: the copies' shared sources mixed once at one copy's "
        "batch (a Full AttnRes window's phase 1, as shipped) or by every copy.",
        "",
        "| stacked copies | seconds (each round) | median (s) | × every copy mixes all |",
        "|---|---|---|---|",
    ]
    for label, times in routing_times.items():
        lines.append(f"| {label} | {' / '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} | "
                     f"{within_rounds(times, base):.3f} |")
    lines += ["", f"Largest difference of a knockout's Δloss between the two: {difference:.1e}.", "",
              f"`prune_tables` at one thread in stacks of {default_copies} copies of the batch: the fixed cost, "
              "what remains when the batch shrinks to 2 sequences.", "",
              "| batch | seconds (each round) | median (s) |", "|---|---|---|"]
    for label, times in fixed_times.items():
        lines.append(f"| {label} | {' / '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} |")
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
