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
import torch.nn.functional as F

from analyses.bench_cpu_step import SHAPES
from analyses.common import command_line, emit_report, machine_info, within_rounds
from attnres_lens import HookedTransformer, ModelConfig, components
from attnres_lens.kernels.backends import attention_runs_cpu_kernel
from attnres_lens.kernels.cpu_fused import causal_attention_cpu

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
    """The token attention as shipped (its C kernel where the policy picks it) or, with `enabled` false, on PyTorch's
    SDPA everywhere."""
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


# (batch, pos, heads, d_head) of the op alone: prune's stacked pass, the small and medium training shapes, and
# longer heads, on both sides of backends.MAX_CPU_ATTENTION_KEYS (pos x d_head)
ATTENTION_OP_SHAPES = [(64, 65, 4, 16), (12, 64, 4, 32), (8, 128, 8, 32), (2, 256, 4, 64), (1, 512, 4, 64),
                       (1, 1024, 4, 64), (1, 512, 8, 128)]


def attention_op_rows(shapes: list[tuple[int, int, int, int]], repeats: int) -> list[str]:
    """The causal attention op alone (no gradient): `cpu_fused.causal_attention_cpu` against PyTorch's SDPA on the
    same tensors, interleaved, whatever `attention_runs_cpu_kernel` would choose."""
    rows = []
    for shape in shapes:
        generator = torch.Generator().manual_seed(sum(shape))
        q, k, v = (torch.randn(*shape, generator=generator) for _ in range(3))
        scale = shape[-1] ** -0.5
        functions = {
            "kernel": lambda: causal_attention_cpu(q, k, v, scale),
            "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, scale=scale),
        }
        times: dict[str, list[float]] = {name: [] for name in functions}
        for _ in range(repeats + 2):  # two warm-up rounds
            for name, function in functions.items():
                start = time.perf_counter()
                function()
                times[name].append(time.perf_counter() - start)
        kernel, sdpa = times["kernel"][2:], times["sdpa"][2:]
        runs = "C kernel" if attention_runs_cpu_kernel("cpu", q, k, v) else "SDPA"
        rows.append(f"| {' x '.join(map(str, shape))} | {shape[1] * shape[3]} | {1e3 * statistics.median(sdpa):.2f} | "
                    f"{1e3 * statistics.median(kernel):.2f} | {within_rounds(kernel, sdpa):.3f} | {runs} |")
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
        "The same forward passes (no gradient, no hooks), interleaved, as shipped (the C kernel where "
        "`attention_runs_cpu_kernel` picks it: short heads, see below) and with PyTorch's "
        "`scaled_dot_product_attention` everywhere; `prune` is the 12-layer depth-full model over `prune "
        "--samples 32`'s batch. × SDPA is the median over rounds of the ratio within the round.",
        "",
        "| shape | variant | SDPA (ms) | as shipped (ms) | × SDPA |",
        "|---|---|---|---|---|",
        *attention_rows({**{name: SHAPES[name] for name in args.shapes}, "prune": PRUNE_SHAPE}, args.repeats),
        "",
        "The op alone, one torch thread, on random tensors [batch, pos, heads, d_head]; `runs` is what "
        "`backends.attention_runs_cpu_kernel` picks for that shape (the C kernel only while a head's keys, pos × "
        "d_head, fit in `MAX_CPU_ATTENTION_KEYS` values).",
        "",
        "| shape | pos × d_head | SDPA (ms) | C kernel (ms) | × SDPA | runs |",
        "|---|---|---|---|---|---|",
        *attention_op_rows(ATTENTION_OP_SHAPES, args.repeats),
    ]
    lines.insert(2, f"Took {time.perf_counter() - started:.0f} s.")
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
