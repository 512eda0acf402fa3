"""Forward-only (inference) latency on the CPU relative to the standard model, without hooks and with a no-op hook
on every depth-weight point (what recording α costs: those consumers take the readable path) (issue 15).

One process, one torch thread, models built up front and run interleaved under `torch.no_grad()`, medians over
repeats; the same shapes as `bench_cpu_step`. A second table times the same forward passes with the token
attention's C kernel (what runs without a gradient) against PyTorch's `scaled_dot_product_attention` (what runs
with one), interleaved, also at the shape of `prune`'s 12-layer model (docs/kernels.md §2).

    python -m analyses.bench_inference --out analyses/reports/bench_inference.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from analyses.bench_cpu_step import SHAPES
from analyses.common import command_line, emit_report, machine_info, within_rounds
from attnres_lens import HookedTransformer, ModelConfig, components

VARIANTS = {
    "standard": dict(residual="standard"),
    "standard+kv_shift": dict(residual="standard", attention="kv_shift"),
    "full": dict(residual="attnres", attnres_block_size=1),
    "block2": dict(residual="attnres", attnres_block_size=2),
    "block4": dict(residual="attnres", attnres_block_size=4),
}


def record_weights(model: HookedTransformer) -> None:
    """A no-op forward hook on every depth-weight point, left on (as a recorder's would be)."""
    for name, point in model.hook_dict.items():
        if name.endswith("hook_weights"):
            point.add_hook(lambda weights, hook: None)


# the 12-layer depth-full preset's model and `prune --samples 32`'s batch (sequences of 65 tokens)
PRUNE_SHAPE = dict(n_layers=12, d_model=64, n_heads=4, d_mlp=128, n_ctx=65, batch=32)


@contextlib.contextmanager
def attention_kernel(enabled: bool) -> Iterator[None]:
    """The token attention on its C kernel (as shipped) or, with `enabled` false, on PyTorch's SDPA."""
    shipped = components.attention_runs_cpu_kernel
    if not enabled:
        components.attention_runs_cpu_kernel = lambda *args: False
    try:
        yield
    finally:
        components.attention_runs_cpu_kernel = shipped


def attention_rows(shapes: dict[str, dict], repeats: int) -> list[str]:
    rows = []
    for shape_name, shape in shapes.items():
        shape = dict(shape)
        batch = shape.pop("batch")
        tokens = torch.randint(0, 256, (batch, shape["n_ctx"]), generator=torch.Generator().manual_seed(0))
        for name in ("standard", "full"):
            model = HookedTransformer(ModelConfig(d_vocab=256, seed=0, **shape, **VARIANTS[name]))
            times: dict[bool, list[float]] = {True: [], False: []}
            with torch.no_grad():
                for _ in range(repeats + 2):  # two warm-up rounds
                    for enabled in times:
                        with attention_kernel(enabled):
                            start = time.perf_counter()
                            model(tokens)
                            times[enabled].append(time.perf_counter() - start)
            kernel, sdpa = times[True][2:], times[False][2:]
            rows.append(f"| {shape_name} | {name} | {1e3 * statistics.median(sdpa):.1f} | "
                        f"{1e3 * statistics.median(kernel):.1f} | {within_rounds(kernel, sdpa):.3f} |")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines = [
        "# Inference latency (forward only) relative to the standard model (CPU)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, by `{command_line()}`; {args.repeats} interleaved rounds of forward passes under no_grad: times are "
        "medians, × standard the median over rounds of the ratio within the round. "
        "`hooked`: a no-op hook on every `hook_weights` point (the readable depth path, as when recording α).",
        "",
        "| shape | variant | forward (ms) | × standard | hooked (ms) | hooked × standard |",
        "|---|---|---|---|---|---|",
    ]
    for shape_name in args.shapes:
        shape = dict(SHAPES[shape_name])
        batch = shape.pop("batch")
        tokens = torch.randint(0, 256, (batch, shape["n_ctx"]), generator=torch.Generator().manual_seed(0))
        models = {}
        for name, overrides in VARIANTS.items():
            plain = HookedTransformer(ModelConfig(d_vocab=256, seed=0, **shape, **overrides))
            hooked = HookedTransformer(plain.cfg)
            hooked.load_state_dict(plain.state_dict())
            record_weights(hooked)
            models[name] = (plain, hooked)
        times = {(name, kind): [] for name in models for kind in (0, 1)}
        with torch.no_grad():
            for pair in models.values():
                for model in pair:
                    model(tokens), model(tokens)
            for _ in range(args.repeats):
                for name, pair in models.items():
                    for kind, model in enumerate(pair):
                        start = time.perf_counter()
                        model(tokens)
                        times[(name, kind)].append(time.perf_counter() - start)
        medians = {key: statistics.median(values) for key, values in times.items()}
        base = times[("standard", 0)]
        for name in models:
            plain, hooked = medians[(name, 0)], medians[(name, 1)]
            hooked_cells = ("–", "–") if name.startswith("standard") else (
                f"{1e3 * hooked:.1f}", f"{within_rounds(times[(name, 1)], base):.3f}")
            lines.append(f"| {shape_name} | {name} | {1e3 * plain:.1f} | {within_rounds(times[(name, 0)], base):.3f} | "
                         f"{hooked_cells[0]} | {hooked_cells[1]} |")
    lines += [
        "",
        "## The token attention's C kernel against PyTorch's SDPA",
        "",
        "The same forward passes (no gradient, no hooks), interleaved, with the C kernel and with PyTorch's "
        "`scaled_dot_product_attention`; `prune` is the 12-layer depth-full model over `prune --samples 32`'s batch. "
        "× SDPA is the median over rounds of the ratio within the round.",
        "",
        "| shape | variant | SDPA (ms) | C kernel (ms) | × SDPA |",
        "|---|---|---|---|---|",
        *attention_rows({**{name: SHAPES[name] for name in args.shapes}, "prune": PRUNE_SHAPE}, args.repeats),
    ]
    lines.insert(2, f"Took {time.perf_counter() - started:.0f} s.")
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
