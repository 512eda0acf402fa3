"""One runner for the standing benchmarks: each appends its rows to analyses/results.jsonl (`analyses.results`).

    python -m analyses.benchmarks --list
    python -m analyses.benchmarks bench_cpu_step bench_inference [--repeats N]
    python -m analyses.benchmarks render                # docs/results.md from the results file

A benchmark is a function `(repeats, tiny) -> rows` registered in BENCHMARKS: `repeats` None takes its own default
(interleaved rounds; for bench_attribution the prune command's runs per setting; gpu_check has fixed repetitions and
ignores it), `tiny` runs it on tiny shapes (a smoke test: the rows' structure, not their timings). The runner stamps
every row with the commit, whether the tree was dirty, the UTC time, the machine (`common.machine()`) and the
command that reproduces it. The runner keeps freed memory for reuse, as the commands do
(`cpu_settings.keep_freed_memory`), except with --tiny. Timings want a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from analyses import (
    bench_attribution,
    bench_bridge,
    bench_compile,
    bench_cpu_step,
    bench_depth_scaling,
    bench_edge_knockouts,
    bench_inference,
    gpu_check,
)
from analyses.common import git_state, machine
from analyses.results import RESULTS, RESULTS_PAGE, append_rows, stamped, write_page
from attnres_lens import cpu_settings

Benchmark = Callable[[int | None, bool], list[dict]]

BENCHMARKS: dict[str, Benchmark] = {
    "bench_cpu_step": bench_cpu_step.run,
    "bench_depth_scaling": bench_depth_scaling.run,
    "bench_inference": bench_inference.run,
    "bench_attribution": bench_attribution.run,
    "bench_edge_knockouts": bench_edge_knockouts.run,
    "bench_bridge": bench_bridge.run,
    "bench_compile": bench_compile.run,
    "gpu_check": gpu_check.run,
}
RENDER = "render"


def reproduce(name: str, repeats: int | None, tiny: bool) -> str:
    """The command line that runs benchmark `name` alone with these settings."""
    args = [name, *(["--repeats", str(repeats)] if repeats is not None else []), *(["--tiny"] if tiny else [])]
    return "python -m analyses.benchmarks " + " ".join(shlex.quote(arg) for arg in args)


def run_benchmark(name: str, repeats: int | None = None, tiny: bool = False, results: Path = RESULTS) -> list[dict]:
    """Run one registered benchmark and append its stamped rows to `results`; returns the rows."""
    if name not in BENCHMARKS:
        raise ValueError(
            f"unknown benchmark {name!r}; the registered ones are {', '.join(BENCHMARKS)} "
            "(python -m analyses.benchmarks --list)"
        )
    commit, dirty = git_state()  # before the run: the code that ran is the code at its start
    started = datetime.datetime.now(datetime.UTC)
    return record(
        name, BENCHMARKS[name](repeats, tiny), reproduce(name, repeats, tiny), results, commit, dirty, started
    )


def record(
    name: str,
    rows: list[dict],
    command: str,
    results: Path = RESULTS,
    commit: str | None = None,
    dirty: bool | None = None,
    started: datetime.datetime | None = None,
) -> list[dict]:
    """Stamp benchmark `name`'s rows with the commit and dirty flag (now, unless given), the UTC start, the machine
    and `command`, and append them to `results`; returns the stamped rows."""
    if commit is None or dirty is None:
        commit, dirty = git_state()
    started = started or datetime.datetime.now(datetime.UTC)
    rows = stamped(
        rows,
        dict(
            bench=name,
            commit=commit,
            dirty=dirty,
            utc=f"{started:%Y-%m-%dT%H:%M:%SZ}",
            machine=machine(),
            command=command,
        ),
    )
    append_rows(rows, results)
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run, or {RENDER!r}")
    parser.add_argument("--list", action="store_true", help="list the registered benchmarks")
    parser.add_argument("--repeats", type=int, help="rounds of each benchmark (default: its own)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test of the plumbing, no timings")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results file to append to / render from")
    parser.add_argument("--out", type=Path, default=RESULTS_PAGE, help=f"the page {RENDER!r} writes")
    args = parser.parse_args(argv)
    if args.list:
        for name, benchmark in BENCHMARKS.items():
            print(f"{name:20} {(benchmark.__doc__ or '').strip().splitlines()[0]}")
        return []
    if not args.names:
        parser.error(f"name one or more benchmarks ({', '.join(BENCHMARKS)}), {RENDER!r}, or --list")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.names == [RENDER]:
        print(f"wrote {write_page(args.results, args.out)}")
        return []
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; registered: {', '.join(BENCHMARKS)} ({RENDER!r} goes alone)")
    if not args.tiny:
        cpu_settings.keep_freed_memory()  # as the `train` and `prune` commands run (process-wide)
    rows = []
    for name in args.names:
        start = time.perf_counter()
        rows += (new := run_benchmark(name, args.repeats, args.tiny, args.results))
        print(
            f"{name}: {len(new)} rows appended to {args.results} in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
    return rows


if __name__ == "__main__":
    main()
