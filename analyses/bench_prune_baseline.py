"""`attnres-lens prune` end to end, this checkout against an earlier commit, alternating (issue 13).

Checks the earlier commit out into a git worktree, trains the 12-layer Full model briefly with that tree's `train`
command (so the run is in a format both trees read: this checkout reads older runs, not the reverse), and runs
the `prune` command of each tree in turn on the same run, `--repeats` times each after one warm-up run each (the
C kernels of each tree build then). The earlier tree's package is imported ahead of this checkout's editable
install by a two-line wrapper, so both use the same environment and only the code differs. On a shared machine
only such alternating runs compare two versions: the same command swings ±30% within an hour.

    python -m analyses.bench_prune_baseline --baseline a21094f --out analyses/reports/bench_prune_baseline.md

`--baseline 5fcf51a` is the last commit before exact interventions shared work (one masked forward pass per
knockout), the engine the 103 s of the issue timed.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from analyses.common import command_line, emit_report, machine_info

REPOSITORY = Path(__file__).resolve().parent.parent

# Imports the package from the tree in argv[1] (not the editable install), then runs its command line.
_WRAPPER = """
import sys
tree = sys.argv.pop(1)
sys.meta_path = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
sys.path.insert(0, tree)
import attnres_lens
assert attnres_lens.__file__.startswith(tree), attnres_lens.__file__
from attnres_lens.cli import main
sys.exit(main())
"""


def prune_seconds(tree: Path, run_dir: Path, out: Path, samples: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _WRAPPER, str(tree), "prune", str(run_dir), "--samples", str(samples),
                    "--no-progress", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
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
    revision = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", args.baseline],
                              capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    edited = subprocess.run(["git", "-C", str(REPOSITORY), "status", "--porcelain", "--untracked-files=no", "--",
                             "*.py", "*.c"], capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        baseline_tree = tmp / "baseline"
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", str(baseline_tree), revision],
                       check=True, capture_output=True)
        try:
            settings = [f"train.{key}={args.steps}" for key in ("eval_every", "record_every", "checkpoint_every")]
            subprocess.run([sys.executable, "-c", _WRAPPER, str(baseline_tree), "train", "--preset", args.preset,
                            "--out", str(tmp / "run"), "--steps", str(args.steps), "--no-progress",
                            *[argument for setting in [*settings, *args.overrides] for argument in ("--set", setting)]],
                           check=True, stdout=subprocess.DEVNULL)
            this = f"this checkout ({head}{' + uncommitted changes' if edited else ''})"
            trees = {f"baseline {revision}": baseline_tree, this: REPOSITORY}
            walls: dict[str, list[float]] = {label: [] for label in trees}
            for round_ in range(args.repeats + 1):  # round 0 warms up (kernel builds, file caches)
                for label, tree in trees.items():
                    wall = prune_seconds(tree, tmp / "run", tmp / f"out{round_}{len(walls[label])}", args.samples)
                    if round_:
                        walls[label].append(wall)
        finally:
            subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(baseline_tree)],
                           check=False, capture_output=True)
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
