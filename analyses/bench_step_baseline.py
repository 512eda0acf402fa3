"""Training-step ratios to the standard model, this checkout against an earlier commit, in alternating processes
(issue 15).

The earlier commit is checked out into a git worktree (`analyses.baseline_tree`). Each process imports one tree's
`attnres_lens` and steps every variant of `bench_cpu_step` (this checkout's measurement code: `Stepper`, the
shapes, the shuffled interleaved rounds and a second standard model) at one thread count, and reports its step
times; each variant's ratio to the standard step is taken within that process (`within_rounds`). The two trees
alternate, `--processes` times each, so a slow spell of the shared machine falls on both; a ratio, being taken
inside one process, already cancels most of it.

    python -m analyses.bench_step_baseline --baseline f7bb594 --out analyses/reports/bench_step_baseline.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from analyses.baseline_tree import REPOSITORY, checked_out, short_revision, this_checkout, tree_command
from analyses.bench_cpu_step import SECOND_STANDARD, SHAPES, TARGETS
from analyses.common import command_line, emit_report, machine_info, within_rounds

TINY_SHAPE = dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)  # --tiny: a test of the script

# Runs in the tree's environment (its attnres_lens already imported); this checkout's analyses go first on the
# path for the measurement code. argv: checkout, shape (JSON), threads, rounds. Prints {label: [seconds, ...]}.
_PROBE = """
import json
sys.path.insert(0, sys.argv[1])
from analyses.bench_cpu_step import bench_times
from attnres_lens import cpu_settings
cpu_settings.keep_freed_memory()
print(json.dumps(bench_times(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), ["cpu"])))
"""


def step_times(tree: Path, shape: dict, threads: int, rounds: int) -> dict[str, list[float]]:
    result = subprocess.run(tree_command(tree, _PROBE, str(REPOSITORY), json.dumps(shape), str(threads),
                                         str(rounds)), check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--processes", type=int, default=3, help="processes per tree and thread count")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds per process")
    parser.add_argument("--tiny", action="store_true", help="a one-layer model of width 16 (a test of the script)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    shape = TINY_SHAPE if args.tiny else SHAPES[args.shape]
    started = time.perf_counter()
    revision = short_revision(args.baseline)
    labels = {"baseline": f"baseline {revision}", "this": this_checkout()}
    # (tree, threads) -> variant -> one ratio per process
    ratios: dict[tuple[str, int], dict[str, list[float]]] = {}
    with checked_out(revision) as baseline_tree:
        trees = {"baseline": baseline_tree, "this": REPOSITORY}
        for tree in trees.values():  # each tree builds its C kernels once, outside the timed processes
            step_times(tree, shape, args.threads[0], 1)
        for _ in range(args.processes):
            for threads in args.threads:
                for name, tree in trees.items():
                    times = step_times(tree, shape, threads, args.rounds)
                    for label, samples in times.items():
                        ratios.setdefault((name, threads), {}).setdefault(label, []).append(
                            within_rounds(samples, times["standard"]))
    variants = [label for label in ratios[("this", args.threads[0])] if label != "standard"]
    rows = []
    for threads in args.threads:
        for label in variants:
            name = label.split(" [")[0]
            old, new = ratios[("baseline", threads)][label], ratios[("this", threads)][label]
            old_median, new_median = statistics.median(old), statistics.median(new)
            measurable = label != SECOND_STANDARD and abs(old_median - 1) > 0.005  # an excess to keep a share of
            excess = (new_median - 1) / (old_median - 1) if measurable else float("nan")
            target = TARGETS.get(name)
            kept = "" if excess != excess else f"{excess:.2f}"
            rows.append(f"| {threads} | {label} | {' / '.join(f'{r:.3f}' for r in old)} | {old_median:.3f} | "
                        f"{' / '.join(f'{r:.3f}' for r in new)} | {new_median:.3f} | {kept} | "
                        f"{'' if target is None else f'≤ {target:.2f}'} |")
    lines = [
        "# Training-step ratios: this checkout against an earlier commit",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, in "
        f"{time.perf_counter() - started:.0f} s, by `{command_line()}`. Shape `{'tiny' if args.tiny else args.shape}` "
        f"({shape['n_layers']} layers, d_model {shape['d_model']}, n_ctx {shape['n_ctx']}, batch {shape['batch']}); "
        "each process steps "
        f"every variant in {args.rounds} shuffled interleaved rounds (`bench_cpu_step`'s measurement, this "
        "checkout's code for it, the tree's `attnres_lens`) and gives each variant's ratio to the standard step "
        f"within its rounds; the trees alternate, {args.processes} processes each per thread count. "
        f"`{SECOND_STANDARD}` is the noise floor. `excess kept`: (this − 1) / (baseline − 1) of the medians.",
        "",
        f"| threads | variant | {labels['baseline']}: per process | median | {labels['this']}: per process | "
        "median | excess kept | target |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    main()
