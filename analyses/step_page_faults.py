"""Page faults per CPU training step with glibc's default allocator and with freed memory kept for reuse
(`cpu_settings.keep_freed_memory`, which the `train` command applies; docs/kernels.md §11).

The allocator policy is process-wide, so each setting runs in processes of its own; as in `train`, each process
steps one model (a variant at the bench_cpu_step small shape, one torch thread), and reports minor page faults per
step (`getrusage`) and its median step time. Processes alternate setting by setting, `--processes` per variant and
setting.

    python -m analyses.step_page_faults --out analyses/reports/step_page_faults.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from analyses.bench_cpu_step import SHAPES, Stepper, variants
from analyses.common import command_line, emit_report, machine_info
from attnres_lens import cpu_settings

VARIANTS = ("standard", "full", "block4")


def measure(variant: str, keep: bool, shape: str, steps: int) -> tuple[float, float]:
    """(minor faults per step, median step ms) of `variant` stepped in this process."""
    if keep:
        cpu_settings.keep_freed_memory()
    torch.set_num_threads(1)
    stepper = Stepper(SHAPES[shape], variants("cpu")[variant], eager=False)
    for _ in range(3):  # warm-up: first-touch faults happen either way
        stepper.step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [stepper.step() for _ in range(steps)]
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps, 1e3 * statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=10, help="measured steps per variant and process")
    parser.add_argument("--processes", type=int, default=2, help="processes per setting, alternating")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] == "kept", args.shape, args.steps)))
        return []
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.processes):
        for name in VARIANTS:
            for setting in ("default", "kept"):
                out = subprocess.run([sys.executable, "-m", "analyses.step_page_faults", "--child", name, setting,
                                      "--shape", args.shape, "--steps", str(args.steps)],
                                     capture_output=True, text=True, check=True)
                runs.setdefault((name, setting), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = [
        "# Page faults per training step: glibc's default allocator against freed memory kept",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, by `{command_line()}`. Shape `{args.shape}` of bench_cpu_step; one model per process, "
        f"{args.steps} steps after 3 warm-up steps, {args.processes} processes per variant and setting "
        "(alternating); faults are minor page faults per step (the process's, during the steps), times the median "
        "step; one cell per process.",
        "",
        "| variant | faults, default | faults, kept | step ms, default | step ms, kept |",
        "|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        faults = [" / ".join(f"{run[0]:.0f}" for run in runs[(name, setting)]) for setting in ("default", "kept")]
        times = [" / ".join(f"{run[1]:.1f}" for run in runs[(name, setting)]) for setting in ("default", "kept")]
        cells = faults + times
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
