"""Two-phase AttnRes vs one fused depth attention per sublayer, on the CPU, with a gradient (issues 3 and 15).

One block of S sublayers reading `n_blocks` completed blocks plus its partial sum, forward + backward.
`per-sublayer`: `depth_attention` per sublayer, with the `torch` backend (hand-written backward) and with the fused
C `cpu` backend (what CPU models run);
`two-phase`: `block_phase1` once for the block's S queries, then `merge_partial` per sublayer (the C two-phase
kernel's forward and backward).
Then whole training steps of Full AttnRes models: every consumer in one fused pass against two-phase windows of
`attnres.LOOKAHEAD` consumers opened from 8 shared sources and from 16 (the shipped threshold), each against a
standard model. Interleaved repeats in one process, medians.

    python -m analyses.bench_two_phase_cpu --out analyses/reports/bench_two_phase_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from analyses.bench_cpu_kernels import interleaved
from analyses.bench_cpu_step import Stepper
from analyses.common import command_line, emit_report, machine_info
from attnres_lens import attnres
from attnres_lens.kernels import block_phase1, depth_attention, merge_partial

# (layers, d_model, n_ctx, batch): bench_cpu_step's small shape, and bench_depth_scaling's 24 and 48 sublayers
MODEL_SHAPES = [(4, 128, 64, 12), (12, 128, 128, 8), (24, 128, 128, 8)]


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
    """Rows of the model table: each shape's standard step and Full AttnRes's, with windows opened with a gradient
    from no count of shared sources (one pass per consumer), from `attnres.MIN_SHARED_SOURCES` (as without a
    gradient) and from `attnres.MIN_SHARED_SOURCES_WITH_GRAD` (the shipped policy): one Full model, its threshold
    set before each of its steps, in shuffled rounds (`bench_cpu_kernels.interleaved`: in one fixed order the
    step right after the standard model's measured up to 1.05x slower than the same step after another)."""
    shipped = attnres.MIN_SHARED_SOURCES_WITH_GRAD
    thresholds = {"one pass": 1 << 30, "windows from 8": attnres.MIN_SHARED_SOURCES, "shipped": shipped}
    rows = []
    for layers, d_model, n_ctx, batch in MODEL_SHAPES:
        shape = dict(n_layers=layers, d_model=d_model, n_heads=4, n_ctx=n_ctx, batch=batch)
        standard = Stepper(shape, dict(residual="standard"), eager=False)
        full = Stepper(shape, dict(residual="attnres", attnres_block_size=1), eager=False)

        def full_step(threshold: int) -> Callable[[], None]:
            def step() -> None:
                attnres.MIN_SHARED_SOURCES_WITH_GRAD = threshold
                full.step()
            return step

        try:
            times = interleaved({"standard": standard.step,
                                 **{name: full_step(threshold) for name, threshold in thresholds.items()}}, repeats)
        finally:
            attnres.MIN_SHARED_SOURCES_WITH_GRAD = shipped
        cells = []
        for name in thresholds:
            ratio = statistics.median(t / s for t, s in zip(times[name], times["standard"]))
            cells.append(f"{1000 * statistics.median(times[name]):.1f} ({ratio:.3f}×)")
        rows.append(f"| {2 * layers} | {d_model} | {n_ctx} | {batch} | {1000 * statistics.median(times['standard']):.1f} "
                    f"| {' | '.join(cells)} |")
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
        "# Two-phase AttnRes on the CPU, with a gradient",
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
        f"Forward + backward + AdamW of whole models, {args.repeats} rounds in shuffled order: step medians, and in "
        "brackets the median of each round's ratio to the standard step. One Full AttnRes model, its stream's "
        "threshold for windows with a gradient set round by round: `one pass`, none (every consumer's fused mix "
        f"and pre-norm); `windows from {attnres.MIN_SHARED_SOURCES}`, as without a gradient; `shipped`, from "
        f"{attnres.MIN_SHARED_SOURCES_WITH_GRAD} shared sources (`attnres.MIN_SHARED_SOURCES_WITH_GRAD`). A window: "
        f"{attnres.LOOKAHEAD} consumers, phase 1 and the merges on the C two-phase kernel with its backward, each "
        "merge's pre-norm a separate kernel.",
        "",
        f"| sublayers | d_model | n_ctx | batch | standard (ms) | one pass (ms) | windows from "
        f"{attnres.MIN_SHARED_SOURCES} (ms) | shipped (ms) |",
        "|---|---|---|---|---|---|---|---|",
        *model_rows,
        "",
    ])
    emit_report(text, args.out)


if __name__ == "__main__":
    main()
