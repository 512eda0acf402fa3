"""The spread of the training-step ratios over runs on different days and machines (issue 15): each cell of
`bench_cpu_step`'s reports (shape × threads × variant) side by side over the runs given, with its range and how
many runs meet its target.

A run is a `bench_cpu_step` report, named by its path or, for one since overwritten, by `REVISION:PATH` (read with
`git show`), so the table can always be made again from committed reports:

    python -m analyses.ratio_spread dbee329:analyses/reports/bench_cpu_step.md \
        analyses/reports/bench_cpu_step_repeat.md analyses/reports/bench_cpu_step.md \
        --out analyses/reports/ratio_spread.md
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

from analyses.bench_cpu_step import TARGETS
from analyses.common import REPO, command_line, emit_report

HEADER = re.compile(r"^Measured (\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC on ([^,]+),")


class Run(NamedTuple):
    """One report: where it came from, when and on which processor, its ratio per (shape, threads, variant) and
    whether the report judged it to meet its target (its own verdict, from the unrounded ratio: a ratio printed as
    1.050 may have missed 1.05)."""
    source: str
    measured: str
    machine: str
    ratios: dict[tuple[str, int, str], float]
    verdicts: dict[tuple[str, int, str], bool]


def report_text(source: str) -> str:
    """The text of a report: a file, or `REVISION:PATH` from git (the path relative to the repository root)."""
    path = Path(source)
    if path.exists():
        return path.read_text()
    if ":" not in source:
        raise FileNotFoundError(f"no report {source!r}: give a file, or REVISION:PATH for a committed version")
    result = subprocess.run(["git", "-C", str(REPO), "show", source], capture_output=True, text=True)
    if result.returncode != 0:
        raise FileNotFoundError(f"cannot read {source!r} from git: {result.stderr.strip()}")
    return result.stdout


def parse_report(source: str, text: str) -> Run:
    """A `bench_cpu_step` report's header and ratio column (raises ValueError naming what is missing)."""
    lines = text.splitlines()
    header = next((match for line in lines if (match := HEADER.match(line))), None)
    if header is None:
        raise ValueError(f"{source}: no 'Measured YYYY-MM-DD HH:MM UTC on MACHINE,' line: not a bench_cpu_step report")
    ratios, verdicts = {}, {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 6 and cells[1].isdigit():
            key = (cells[0], int(cells[1]), cells[2])
            ratios[key] = float(cells[4])
            if cells[5].endswith(("met", "MISSED")):
                verdicts[key] = cells[5].endswith("met")
    if not ratios:
        raise ValueError(f"{source}: no rows of '| shape | threads | variant | step (ms) | × standard | target |'")
    return Run(source, header.group(1), header.group(2).strip(), ratios, verdicts)


def spread_table(runs: Sequence[Run]) -> list[str]:
    """One row per cell that any run measured: each run's ratio (blank where it has none), min–max, the target and
    how many of the runs that measured the cell meet it (by each report's own verdict)."""
    cells = list(dict.fromkeys(cell for run in runs for cell in run.ratios))
    lines = ["| shape | threads | variant | " + " | ".join(f"run {i + 1}" for i in range(len(runs)))
             + " | min–max | target | met in |",
             "|---|---|---|" + "---|" * len(runs) + "---|---|---|"]
    for cell in cells:
        values = [run.ratios.get(cell) for run in runs]
        measured = [value for value in values if value is not None]
        target = TARGETS.get(cell[2].split(" [")[0])
        met = ""
        if target is not None:  # each report's own verdict where it gave one
            verdicts = [run.verdicts.get(cell, run.ratios[cell] <= target) for run in runs if cell in run.ratios]
            met = f"{sum(verdicts)} of {len(measured)}"
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | "
                     + " | ".join("" if value is None else f"{value:.3f}" for value in values)
                     + f" | {min(measured):.3f}–{max(measured):.3f} | {'' if target is None else f'≤ {target:.2f}'}"
                     + f" | {met} |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="bench_cpu_step reports: PATH or REVISION:PATH")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runs = [parse_report(source, report_text(source)) for source in args.reports]
    lines = ["# Training-step ratios over runs on different days and machines", "",
             f"Made by `{command_line()}` from the `bench_cpu_step` reports below (each ratio the median over that "
             "run's interleaved rounds; `standard (second instance)` shows how far two identical models differ in "
             "that run).", "",
             *[f"* run {i + 1}: {run.measured} UTC on {run.machine} (`{run.source}`)" for i, run in enumerate(runs)],
             "", *spread_table(runs)]
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
