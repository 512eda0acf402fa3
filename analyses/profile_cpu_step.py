"""Where a CPU training step's time goes: the fixed cost of every variant, then standard vs Block (S = 4) vs Full
AttnRes under the torch profiler.

The small shape of `bench_cpu_step.py` (4 layers, d_model 128, n_ctx 64, batch 12), one torch thread, the fused C
`cpu` depth-attention backend (what `auto` picks on a CPU), fused AdamW (what `train` runs).

* **Fixed cost.** Each variant is also stepped at 8 tokens (batch 1, n_ctx 8, same layers and widths), where the
  arithmetic is negligible: that step is the per-step cost of Python, dispatch, allocation and autograd
  bookkeeping, which no faster kernel removes. Both shapes are stepped interleaved in one process (medians), and
  each step is split into forward, backward and optimizer. A last row steps the standard model with PyTorch's
  per-tensor AdamW loop (its CPU default) instead of the fused optimizer `train` uses.
* **Profile.** The profiler adds per-op overhead, so its absolute times are inflated; read the shares and the
  depth-attention rows.

    python -m analyses.profile_cpu_step --out analyses/reports/profile_cpu_step.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from analyses.bench_cpu_step import SHAPES, Stepper, variants
from analyses.bench_depth_scaling import is_depth_op
from analyses.common import command_line, emit_report, machine_info, within_rounds
from attnres_lens import cpu_settings, param_groups

PROFILED = ("standard", "block4", "full")
LOOPED_ADAMW = "standard, per-tensor AdamW"  # what `train` ran on the CPU before it used the fused optimizer


def fixed_costs(repeats: int) -> list[str]:
    """The table of step times at the small shape and at 8 tokens, every variant, interleaved."""
    shapes = {"small": SHAPES["small"], "8 tokens": dict(SHAPES["small"], batch=1, n_ctx=8)}
    steppers = {(variant, shape): Stepper(dims, overrides, eager=False)
                for variant, overrides in variants("cpu").items() for shape, dims in shapes.items()}
    for shape, dims in shapes.items():  # the standard model under PyTorch's CPU default: a loop over tensors
        looped = steppers[(LOOPED_ADAMW, shape)] = Stepper(dims, variants("cpu")["standard"], eager=False)
        looped.optimizer = torch.optim.AdamW(param_groups(looped.model, 0.1), lr=1e-4, foreach=False)
    for stepper in steppers.values():
        for _ in range(3):
            stepper.step()
    samples = {key: [] for key in steppers}
    for _ in range(repeats):
        for key, stepper in steppers.items():
            samples[key].append((stepper.step(), *stepper.phases))

    def median_ms(values) -> float:
        return 1000 * statistics.median(values)

    def versus_standard(key: tuple[str, str]) -> tuple[float, float]:
        """(ratio, excess in ms) to the standard step, within rounds (as bench_cpu_step)."""
        steps, base = [row[0] for row in samples[key]], [row[0] for row in samples[("standard", key[1])]]
        return within_rounds(steps, base), 1000 * within_rounds(steps, base, "difference")

    lines = ["| variant | small step (ms) | × standard | + standard (ms) | 8-token step (ms) | + standard (ms) | "
             "8 tokens: forward / backward / optimizer (ms) | fixed share of the overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for variant in [*variants("cpu"), LOOPED_ADAMW]:
        small, tiny = samples[(variant, "small")], samples[(variant, "8 tokens")]
        ratio, extra_small = versus_standard((variant, "small"))
        _, extra_tiny = versus_standard((variant, "8 tokens"))
        share = f"{extra_tiny / extra_small:.0%}" if extra_small > 0.5 else "(no overhead)"
        phases = " / ".join(f"{median_ms(column):.1f}" for column in list(zip(*tiny))[1:])
        lines.append(f"| {variant} | {median_ms(row[0] for row in small):.1f} | {ratio:.3f} | {extra_small:+.1f} | "
                     f"{median_ms(row[0] for row in tiny):.1f} | {extra_tiny:+.1f} | {phases} | {share} |")
    return lines


def profile_section(name: str, steps: int) -> list[str]:
    stepper = Stepper(SHAPES["small"], variants("cpu")[name], eager=False)
    for _ in range(3):
        stepper.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            stepper.step()
    events = prof.key_averages()
    per_step = sum(event.self_cpu_time_total for event in events) / steps / 1000
    depth = {event.key: event.cpu_time_total / steps / 1000 for event in events if is_depth_op(event.key)}
    rows = [f"| {event.key} | {event.self_cpu_time_total / steps / 1000:.2f} | {event.count // steps} |"
            for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]]
    depth_lines = [f"* {key}: {ms:.2f} ms per step (with children)" for key, ms in depth.items()]
    return [f"### {name}: {per_step:.1f} ms of profiled CPU time per step", "", *depth_lines, "",
            "| op | self ms per step | calls per step |", "|---|---|---|", *rows, ""]


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="interleaved steps per variant and shape")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per variant")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "# Where a CPU training step's time goes", "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, by `{command_line()}`.", "",
        "## Fixed cost per step", "",
        f"{args.repeats} interleaved rounds: each variant stepped at the small shape and at 8 tokens (batch 1, "
        "n_ctx 8, same layers and widths), where the arithmetic is negligible: the 8-token step is the cost of "
        "Python, dispatch, allocation and autograd bookkeeping per step. Step times are medians; × standard and "
        "+ standard the medians over rounds of the ratio and difference to the standard step of the same round. "
        "The last column is the 8-token excess as a share of the small-shape excess: the part of each variant's "
        "overhead that does not shrink with faster kernels or fewer bytes.", "",
        *fixed_costs(args.repeats), "",
        "## Profile at the small shape", "",
    ]
    for name in PROFILED:
        lines += profile_section(name, args.steps)
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    cpu_settings.keep_freed_memory()  # as the `train` command runs (process-wide, so not in main: tests call it)
    main()
