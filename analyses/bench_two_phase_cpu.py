"""Two-phase AttnRes vs one fused depth attention per sublayer, on the CPU, with a gradient (issues 3 and 15).

One block of S sublayers reading `n_blocks` completed blocks plus its partial sum, forward + backward.
`per-sublayer`: `depth_attention` per sublayer, with the `torch` backend (hand-written backward) and with the fused
C `cpu` backend (what CPU models run);
`two-phase`: `block_phase1` once for the block's S queries, then `merge_partial` per sublayer (the C two-phase
kernel's forward and backward).
Then whole training steps of Full AttnRes models: every consumer in one fused pass (the shipped policy) against
two-phase windows of `attnres.LOOKAHEAD` consumers (the policy swapped for the comparison), each against a standard
model. Interleaved repeats in one process, medians.

    python -m analyses.bench_two_phase_cpu --out analyses/reports/bench_two_phase_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch

from analyses.bench_cpu_step import Stepper
from analyses.common import command_line, emit_report, machine_info
from attnres_lens import attnres
from attnres_lens.kernels import block_phase1, depth_attention, merge_partial

# (layers, d_model, n_ctx, batch): bench_cpu_step's small shape, and bench_depth_scaling's 48 sublayers
MODEL_SHAPES = [(4, 128, 64, 12), (24, 128, 128, 8)]


def make_block(n_tokens: int, d_model: int, n_blocks: int, block_size: int):
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(n_tokens, d_model, generator=generator).requires_grad_() for _ in range(n_blocks)]
    outputs = [torch.randn(n_tokens, d_model, generator=generator).requires_grad_() for _ in range(block_size)]
    queries = torch.randn(block_size, d_model, generator=generator).requires_grad_()
    gains = torch.ones(block_size, d_model).requires_grad_()
    return blocks, outputs, queries, gains


def per_sublayer(blocks, outputs, queries, gains, backend: str) -> None:
    partial, total = None, 0.0
    for index, output in enumerate(outputs):
        sources = blocks + ([partial] if partial is not None else [])
        total = total + depth_attention(sources, queries[index], gains[index], backend=backend).sum()
        partial = output if partial is None else partial + output
    total.backward()


def two_phase(blocks, outputs, queries, gains) -> None:
    stats = block_phase1(blocks, queries, gains)
    partial, total = None, 0.0
    for index, output in enumerate(outputs):
        total = total + merge_partial(stats, index, partial).sum()
        partial = output if partial is None else partial + output
    total.backward()


def training_steps(repeats: int) -> list[str]:
    """Rows of the model table: each shape's standard step, Full AttnRes in one pass per consumer and in two-phase
    windows, interleaved round by round."""
    shipped = attnres.stream_two_phase_backend

    def windows_with_gradient(block_size, backend, device, needs_grad):
        return shipped(block_size, backend, device, False)

    rows = []
    for layers, d_model, n_ctx, batch in MODEL_SHAPES:
        shape = dict(n_layers=layers, d_model=d_model, n_heads=4, n_ctx=n_ctx, batch=batch)
        steppers = {"standard": (Stepper(shape, dict(residual="standard"), eager=False), shipped),
                    "one pass": (Stepper(shape, dict(residual="attnres", attnres_block_size=1), eager=False), shipped),
                    "two-phase": (Stepper(shape, dict(residual="attnres", attnres_block_size=1), eager=False),
                                  windows_with_gradient)}
        times = {name: [] for name in steppers}
        try:
            for round_ in range(repeats + 1):  # the first round warms up
                for name, (stepper, policy) in steppers.items():
                    attnres.stream_two_phase_backend = policy
                    seconds = stepper.step()
                    if round_:
                        times[name].append(seconds)
        finally:
            attnres.stream_two_phase_backend = shipped
        ratios = {name: statistics.median(t / s for t, s in zip(times[name], times["standard"]))
                  for name in ("one pass", "two-phase")}
        standard, one_pass, two = (1000 * statistics.median(times[name]) for name in steppers)
        rows.append(f"| {2 * layers} | {d_model} | {n_ctx} | {batch} | {standard:.1f} | {one_pass:.1f} | {two:.1f} | "
                    f"{ratios['one pass']:.3f} | {ratios['two-phase']:.3f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n_tokens, d_model, n_blocks, block_size in [(768, 128, 3, 4), (768, 128, 6, 4), (1024, 256, 6, 2)]:
        inputs = make_block(n_tokens, d_model, n_blocks, block_size)
        functions = {
            "torch": lambda: per_sublayer(*inputs, backend="torch"),
            "cpu": lambda: per_sublayer(*inputs, backend="cpu"),
            "two-phase": lambda: two_phase(*inputs),
        }
        times = {name: [] for name in functions}
        for function in functions.values():
            function()  # warm-up (and the C kernel's first-call build)
        for _ in range(args.repeats):
            for name, function in functions.items():
                start = time.perf_counter()
                function()
                times[name].append(time.perf_counter() - start)
        torch_ms, cpu_ms, two_ms = (1000 * statistics.median(times[name]) for name in functions)
        rows.append(f"| {n_tokens} | {d_model} | {n_blocks} | {block_size} | {torch_ms:.2f} | {cpu_ms:.2f} | "
                    f"{two_ms:.2f} | {two_ms / torch_ms:.2f} | {two_ms / cpu_ms:.2f} |")
    model_rows = training_steps(args.repeats)
    text = "\n".join([
        "# Two-phase Block AttnRes on the CPU",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch thread, "
        f"by `{command_line()}`. Forward + backward of one block's depth attentions, median of {args.repeats} interleaved repeats.",
        "",
        "| tokens | d_model | completed blocks | S | per-sublayer torch (ms) | per-sublayer cpu (ms) | two-phase (ms) "
        "| two-phase / torch | two-phase / cpu |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "## Training steps of Full AttnRes",
        "",
        f"Forward + backward + AdamW of whole models, {args.repeats} interleaved rounds; × standard is the median of "
        "each round's ratio. `one pass`: every consumer's fused mix (what the model runs with a gradient); "
        f"`two-phase`: windows of {attnres.LOOKAHEAD} consumers from {attnres.MIN_SHARED_SOURCES} shared sources on, "
        "phase 1 and the merges on the C two-phase kernel with its backward, the pre-norm a separate kernel.",
        "",
        "| sublayers | d_model | n_ctx | batch | standard (ms) | one pass (ms) | two-phase (ms) | one pass × standard "
        "| two-phase × standard |",
        "|---|---|---|---|---|---|---|---|---|",
        *model_rows,
        "",
    ])
    emit_report(text, args.out)


if __name__ == "__main__":
    main()
