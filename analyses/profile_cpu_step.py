"""Where a CPU training step's time goes: standard vs Block (S = 4) vs Full AttnRes, torch profiler.

The small shape of `bench_cpu_step.py` (4 layers, d_model 128, n_ctx 64, batch 12), one torch thread, the fused C
`cpu` depth-attention backend (what `auto` picks on a CPU). The profiler adds per-op overhead, so absolute times are inflated; read the
shares and the depth-attention rows.

    python -m analyses.profile_cpu_step --out analyses/reports/profile_cpu_step.md
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from analyses.bench_cpu_step import SHAPES, Stepper
from analyses.bench_depth_scaling import is_depth_op
from analyses.common import command_line, emit_report, machine_info

VARIANTS = {
    "standard": dict(residual="standard"),
    "block4": dict(residual="attnres", attnres_block_size=4, depth_attention_backend="cpu"),
    "full": dict(residual="attnres", attnres_block_size=1, depth_attention_backend="cpu"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sections = []
    for name, overrides in VARIANTS.items():
        stepper = Stepper(SHAPES["small"], overrides, eager=False)
        for _ in range(3):
            stepper.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                stepper.step()
        events = prof.key_averages()
        per_step = sum(event.self_cpu_time_total for event in events) / args.steps / 1000
        depth = {event.key: event.cpu_time_total / args.steps / 1000 for event in events if is_depth_op(event.key)}
        rows = [f"| {event.key} | {event.self_cpu_time_total / args.steps / 1000:.2f} | {event.count // args.steps} |"
                for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]]
        depth_lines = [f"* {key}: {ms:.2f} ms per step (with children)" for key, ms in depth.items()]
        sections.append("\n".join([
            f"## {name}: {per_step:.1f} ms of profiled CPU time per step", "", *depth_lines, "",
            "| op | self ms per step | calls per step |", "|---|---|---|", *rows, "",
        ]))
    text = "\n".join([
        "# Profile of a CPU training step", "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch thread, "
        f"{args.steps} profiled steps per variant, by `{command_line()}`.", "", *sections,
    ])
    emit_report(text, args.out)


if __name__ == "__main__":
    main()
