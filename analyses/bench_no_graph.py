"""The eager C kernels without grad mode: their forward alone against `autograd.Function.apply` (docs/kernels.md §11).

Where no autograd can see a call (`kernels._common.builds_no_graph`) the eager wrappers run a Function's forward
without building a node (`cpu_autograd.apply_function`). This times the same calls both ways in one process,
interleaved in shuffled rounds (`bench_cpu_kernels.interleaved`), one torch thread, under `torch.no_grad()`: one
consumer's fused depth mix with its pre-norm (`fused_mix_and_norm`, a batch of calls per round), and whole forward
passes of `bench_cpu_step`'s small models. `with the node` patches `cpu_autograd.apply_function` to always apply the
Function, as the code before did.

    python -m analyses.bench_no_graph --out analyses/reports/bench_no_graph.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from analyses.bench_cpu_kernels import interleaved
from analyses.bench_cpu_step import SHAPES
from analyses.common import BENCH_VOCAB, command_line, emit_report, machine_info, model_dims_and_tokens
from attnres_lens import HookedTransformer, ModelConfig, cpu_settings
from attnres_lens.kernels import cpu_autograd, cpu_depth

VARIANTS = {"standard": dict(residual="standard"), "standard+kv_shift": dict(residual="standard", attention="kv_shift"),
            "full": dict(residual="attnres", attnres_block_size=1),
            "block2": dict(residual="attnres", attnres_block_size=2)}
CALLS = 100  # consumer calls per round (one call is ~10-200 us)


@contextlib.contextmanager
def with_node(enabled: bool) -> Iterator[None]:
    """Every eager C wrapper applies its Function (the node built) while `enabled`, else runs as shipped."""
    shipped = cpu_autograd.apply_function
    if enabled:
        cpu_autograd.apply_function = lambda function, *args: function.apply(*args)
    try:
        yield
    finally:
        cpu_autograd.apply_function = shipped


def both_ways(call: Callable[[], object]) -> dict[str, Callable[[], None]]:
    def run(enabled: bool) -> Callable[[], None]:
        def timed() -> None:
            with with_node(enabled):
                call()
        return timed
    return {"as shipped": run(False), "with the node": run(True)}


def consumer_rows(shapes: list[tuple[int, int, int]], repeats: int) -> list[str]:
    rows = []
    for n_tokens, d_model, n_sources in shapes:
        generator = torch.Generator().manual_seed(n_sources)
        sources = [torch.randn(n_tokens, d_model, generator=generator) for _ in range(n_sources)]
        query, gain, norm_weight = (torch.randn(d_model, generator=generator).requires_grad_() for _ in range(3))

        def calls() -> None:
            for _ in range(CALLS):
                cpu_depth.fused_mix_and_norm(sources, query, gain, 1e-6, norm_weight, 1e-5, False)

        times = interleaved(both_ways(calls), repeats)
        shipped, node = (times.ms(name) * 1e3 / CALLS for name in ("as shipped", "with the node"))
        rows.append(f"| {n_tokens} x {d_model}, {n_sources} sources | {shipped:.1f} | {node:.1f} | "
                    f"{times.ratio('as shipped', 'with the node'):.3f} |")
    return rows


def forward_rows(shapes: dict[str, dict], repeats: int) -> list[str]:
    rows = []
    for shape_name, shape in shapes.items():
        shape, tokens = model_dims_and_tokens(shape)
        for name, overrides in VARIANTS.items():
            model = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **overrides))
            times = interleaved(both_ways(lambda: model(tokens)), repeats)
            rows.append(f"| {shape_name} | {name} | {times.ms('as shipped'):.2f} | {times.ms('with the node'):.2f} | "
                        f"{times.ratio('as shipped', 'with the node'):.3f} |")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the plumbing only (the tests run this)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    if args.out is not None:  # process-wide, so a test calling main() leaves it alone
        cpu_settings.keep_freed_memory()
    consumers = [(8, 16, 3)] if args.tiny else [(768, 128, 5), (1024, 256, 9)]
    shapes = {"tiny": dict(n_layers=1, d_model=16, n_heads=2, n_ctx=8, batch=2)} if args.tiny else {
        name: SHAPES[name] for name in ("small", "medium")}
    started = time.perf_counter()
    try:
        with torch.no_grad():
            consumer_lines, forward_lines = consumer_rows(consumers, args.repeats), forward_rows(shapes, args.repeats)
    finally:
        torch.set_num_threads(previous)
    lines = [
        "# The eager C kernels without grad mode: forward alone against Function.apply",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, in {time.perf_counter() - started:.0f} s, by `{command_line()}`; {args.repeats} shuffled rounds "
        "under no_grad, medians; × with the node is the median over rounds of the ratio within the round.",
        "",
        f"## One consumer's fused mix and pre-norm (`fused_mix_and_norm`, {CALLS} calls a round)",
        "",
        "| sources | as shipped (µs a call) | with the node (µs a call) | × with the node |",
        "|---|---|---|---|",
        *consumer_lines,
        "",
        "## Forward passes",
        "",
        "| shape | variant | as shipped (ms) | with the node (ms) | × with the node |",
        "|---|---|---|---|---|",
        *forward_lines,
    ]
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
