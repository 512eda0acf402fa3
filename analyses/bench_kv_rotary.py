"""The KV shift with K's rotary embedding in the shift's own C pass, against the two passes one after the other
(issue 15; docs/kernels.md §2, §6).

On the `cpu` backend a KV-shift layer with RoPE rotates the shifted K inside `kv_shift_cpu` (one read and one write
of K each way), unless a hook watches `hook_k_shifted`; then the shift writes K̂ and `rotary_cpu` reads and
rewrites it. This script steps three models at `bench_cpu_step`'s shapes, interleaved in shuffled rounds: the
standard model, the KV-shift model as shipped, and a second KV-shift model that takes the separate passes (its
`hook_k_shifted` points answer "hooked" to the layer's check, without a hook whose call would cost time of its
own). Ratios are medians over rounds of the ratio within the round.

    python -m analyses.bench_kv_rotary --out analyses/reports/bench_kv_rotary.md
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from analyses.bench_cpu_step import SHAPES, Stepper, variants
from analyses.common import command_line, emit_report, machine_info, within_rounds
from attnres_lens import components, cpu_settings

VARIANTS = ("standard", "KV shift, K rotated in the shift's pass", "KV shift, rotary as its own pass")


def step_times(shape: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each of VARIANTS' training steps at `shape`, one per round, in shuffled rounds after 3 warm-ups."""
    steppers = dict(zip(VARIANTS, (Stepper(shape, variants("cpu")[name], eager=False)
                                   for name in ("standard", "standard+kv_shift", "standard+kv_shift"))))
    separate = {id(block.attn.hook_k_shifted) for block in steppers[VARIANTS[2]].model.blocks}
    shipped = components.is_hooked
    components.is_hooked = lambda point: id(point) in separate or shipped(point)
    try:
        for stepper in steppers.values():
            for _ in range(3):
                stepper.step()
        times = {name: [] for name in VARIANTS}
        order, shuffle = list(VARIANTS), random.Random(0).shuffle
        for _ in range(repeats):
            shuffle(order)
            for name in order:
                times[name].append(steppers[name].step())
    finally:
        components.is_hooked = shipped
    return times


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=[*SHAPES, "tiny"], default=list(SHAPES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(threads < 1 for threads in args.threads):
        parser.error(f"--repeats and --threads must be positive, got {args.repeats} and {args.threads}")
    started = time.perf_counter()
    if args.out is not None:  # process-wide, so a test calling main() leaves it alone
        cpu_settings.keep_freed_memory()
    shapes = {**SHAPES, "tiny": dict(n_layers=2, d_model=16, n_heads=2, n_ctx=8, batch=2)}
    previous = torch.get_num_threads()
    rows = []
    try:
        for shape_name in args.shapes:
            for threads in args.threads:
                torch.set_num_threads(threads)
                times = step_times(shapes[shape_name], args.repeats)
                standard, shipped, separate = (times[name] for name in VARIANTS)
                rows.append(f"| {shape_name} | {threads} | {1e3 * statistics.median(standard):.1f} | "
                            f"{within_rounds(shipped, standard):.3f} | {within_rounds(separate, standard):.3f} | "
                            f"{within_rounds(shipped, separate):.3f} |")
    finally:
        torch.set_num_threads(previous)
    lines = [
        "# KV shift: K's rotary in the shift's pass or in its own",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, in "
        f"{time.perf_counter() - started:.0f} s, by `{command_line()}`; {args.repeats} shuffled rounds of one "
        "training step each (fused AdamW, freed memory kept, as `train` runs); ratios are medians over rounds of the "
        "ratio within the round.",
        "",
        "| shape | threads | standard step (ms) | rotated in the shift: × standard | own pass: × standard | "
        "in the shift / own pass |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    main()
