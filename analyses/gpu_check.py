"""One GPU check, ready for the day a GPU is at hand: one process, one markdown report, about 8 minutes on an H200.

Sections, in order (each says where it came from; a section that would overrun `--budget-s` is skipped and says so):

1. kernel correctness against the float64 reference, fp32 and bf16, every backend that runs (incl. fla-core's);
2. fused forward+backward time and achieved bandwidth against a measured device-to-device copy, beside eager,
   torch.compile and fla-core's `fused_attnres` at the same shapes (docs/kernels.md §8 byte counts);
3. two-phase Block AttnRes against single-pass calls;
4. the training-step ratios of Block and Full AttnRes to the standard model at 24 layers, d_model 1024 (needs
   transformer-lens and what it imports on the GPU machine; carry them as wheels, see docs/tour.md §9).

The training step's ratios also go to analyses/results.jsonl as rows (`analyses.benchmarks`, where `gpu_check` is
registered too). It installs nothing. `--dry-run` runs every section at tiny shapes on the CPU (Triton under
TRITON_INTERPRET=1), which the test suite does, so the script is known to work before a device is spent on it.

    python -m analyses.gpu_check --out analyses/reports/gpu_check.md
    python -m analyses.gpu_check --dry-run --out /tmp/gpu_check.md
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from analyses import bench_kernels_gpu as kernels
from analyses.results import RESULTS

REPORTS = Path(__file__).resolve().parent / "reports"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU interpreter: the plumbing only")
    parser.add_argument("--out", type=Path, default=REPORTS / "gpu_check.md", help="the markdown report")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip sections that would start after this")
    parser.add_argument(
        "--results",
        type=Path,
        help="append the training step's rows here (default: analyses/results.jsonl, except on a "
        "dry run, whose rows go nowhere unless this is given)",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def section(title: str, run, started: float, budget_s: float) -> list[str]:
    """A report section: its lines, or why it did not run (over budget, or the error it raised)."""
    elapsed = time.perf_counter() - started
    lines = ["", f"## {title}", ""]
    if elapsed > budget_s:
        return lines + [f"skipped: {elapsed:.0f} s of the {budget_s:.0f} s budget already spent"]
    section_start = time.perf_counter()
    try:
        lines += [line for line in run() if not line.startswith("# ")]
    except Exception:  # noqa: BLE001 - one failing section must not lose the others' numbers
        lines += ["FAILED:", "```", traceback.format_exc(limit=6), "```"]
    return lines + ["", f"({time.perf_counter() - section_start:.0f} s)"]


def main(argv: list[str] | None = None) -> list[str]:
    """Run the check, write its report, append its rows (see --results); returns the report's lines."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = f"python -m analyses.gpu_check {' '.join(argv)}".strip()
    lines, rows = check(args.dry_run, args.budget_s, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.results or not args.dry_run:
        from analyses.benchmarks import record  # the runner imports this module

        record("gpu_check", rows, command, args.results or RESULTS)
    return lines


def check(
    dry_run: bool,
    budget_s: float = 480.0,
    command: str = "python -m analyses.benchmarks gpu_check",
) -> tuple[list[str], list[dict]]:
    """(the report's lines, the training step's rows: `bench_block_step_gpu`'s, with Block's target)."""
    import torch

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("the GPU check needs a CUDA GPU; use --dry-run to check the script on the CPU")
    started = time.perf_counter()
    tiny = ["--dry-run"] if dry_run else []
    kernel_args = kernels.parse_args(
        [*tiny, "--tokens", "8192,65536", "--d-model", "1024,4096", "--sources", "3,9,17", "--reps", "10"]
    )
    lines = [f"# GPU check{' (dry run: tiny shapes, CPU interpreter, no timings)' if dry_run else ''}", ""]
    lines += [line for line in kernels.header(kernel_args) if not line.startswith("# ")]
    lines[-2] = f"* command: `{command}`"
    lines += section(
        "1. Correctness against the float64 reference (fp32, bf16)",
        lambda: kernels.dry_run(kernel_args),
        started,
        budget_s,
    )
    if dry_run:
        lines += section("3. Two-phase Block AttnRes vs single pass", kernels.two_phase_dry_run, started, budget_s)
    else:
        lines += section(
            "2. Fused forward+backward: time and bandwidth vs copy, eager, compile, fla",
            lambda: kernels.timed_run(kernel_args),
            started,
            budget_s,
        )
        lines += section(
            "3. Two-phase Block AttnRes vs single pass", lambda: kernels.two_phase_timed(kernel_args), started, budget_s
        )
    rows: list[dict] = []

    def training_step() -> list[str]:
        from analyses import bench_block_step_gpu  # imports transformer-lens through the model

        step_lines, step_rows = bench_block_step_gpu.measure(tiny)
        rows.extend(step_rows)
        return step_lines

    lines += section("4. Training step at 24 layers, d_model 1024 (× standard)", training_step, started, budget_s)
    lines += ["", f"Total: {time.perf_counter() - started:.0f} s."]
    return lines, rows


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """The one GPU check (kernels, bandwidth, two-phase, 24-layer step); rows: the step ratios. Tiny: a CPU dry run."""
    lines, rows = check(dry_run=tiny, command=f"python -m analyses.benchmarks gpu_check{' --tiny' if tiny else ''}")
    if not tiny:  # the report stays markdown beside the rows; a dry run's is not worth keeping
        REPORTS.mkdir(parents=True, exist_ok=True)
        (REPORTS / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
