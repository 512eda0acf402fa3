"""`attnres-lens prune` end to end, this checkout against an earlier commit, alternating (issue 13).

Checks the earlier commit out into a git worktree, trains the 12-layer Full model briefly with that tree's `train`
command (so the run is in a format both trees read: this checkout reads older runs, not the reverse), and runs
the `prune` command of each tree in turn on the same run, `--repeats` times each after one warm-up run each (the
C kernels of each tree build then), each tree's package imported in the same environment (`analyses.baseline_tree`),
so only the code differs.

    python -m analyses.bench_prune_baseline --baseline a21094f --out analyses/reports/bench_prune_baseline.md

`--baseline 5fcf51a` is the last commit before exact interventions shared work (one masked forward pass per
knockout), the engine the 103 s of the issue timed.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from analyses.baseline_tree import REPOSITORY, checked_out, short_revision, this_checkout, tree_command
from analyses.common import command_line, emit_report, machine_info

_CLI = "from attnres_lens.cli import main\nsys.exit(main())\n"


def prune_seconds(tree: Path, run_dir: Path, out: Path, samples: int) -> float:
    start = time.perf_counter()
    subprocess.run(tree_command(tree, _CLI, "prune", str(run_dir), "--samples", str(samples), "--no-progress",
                                "--out", str(out)), check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--preset", default="depth-full")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    revision = short_revision(args.baseline)
    this = this_checkout()
    with checked_out(revision) as baseline_tree:
        scratch = baseline_tree.parent
        settings = [f"train.{key}={args.steps}" for key in ("eval_every", "record_every", "checkpoint_every")]
        subprocess.run(tree_command(baseline_tree, _CLI, "train", "--preset", args.preset, "--out",
                                    str(scratch / "run"), "--steps", str(args.steps), "--no-progress",
                                    *[argument for setting in [*settings, *args.overrides]
                                      for argument in ("--set", setting)]),
                       check=True, stdout=subprocess.DEVNULL)
        trees = {f"baseline {revision}": baseline_tree, this: REPOSITORY}
        walls: dict[str, list[float]] = {label: [] for label in trees}
        for round_ in range(args.repeats + 1):  # round 0 warms up (kernel builds, file caches)
            for label, tree in trees.items():
                wall = prune_seconds(tree, scratch / "run", scratch / f"out{round_}{len(walls[label])}", args.samples)
                if round_:
                    walls[label].append(wall)
    old_walls, new_walls = walls.values()
    ratios = [b / a for a, b in zip(old_walls, new_walls)]
    lines = [
        "# `prune` end to end: this checkout against an earlier commit",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, by "
        f"`{command_line()}`. Preset `{args.preset}` trained {args.steps} steps by the baseline's `train`; "
        f"`attnres-lens prune RUN --samples {args.samples}` as each tree ships it, the two trees alternating, "
        f"{args.repeats} runs each after a warm-up run each.",
        "",
        "| tree | runs (s) | median (s) |",
        "|---|---|---|",
        *(f"| {label} | {' / '.join(f'{t:.1f}' for t in values)} | {statistics.median(values):.1f} |"
          for label, values in walls.items()),
        "",
        f"This checkout / baseline, pair by pair: {' / '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.3f}; the baseline takes {1 / statistics.median(ratios):.2f}x this "
        "checkout's time).",
    ]
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    main()
