"""Forward-only (inference) latency on the CPU relative to the standard model, without hooks and with a no-op hook
on every depth-weight point (what reading α costs without a gradient: the hooks fire on the C kernel's weights,
then a second C pass mixes the sources as the hooks left them) (issue 15).

One process, one torch thread, freed memory kept for reuse as the commands run (`cpu_settings`), models built up
front and run interleaved under `torch.no_grad()`, medians over repeats; the shapes of `bench_cpu_step` and a wide
one (d_model 1024), where the depth mix, O(sources · d_model) a token, weighs less against the O(d_model²) matmuls.
Each shape's forward excess over the standard model is then split, from every C kernel call of a few forward
passes timed and its bytes counted (`kernel_traffic`), into the C kernels' time beyond the standard model's and
the rest (Python, dispatch and caches around the calls). A second table times the same forward passes with the
token attention's C kernel (what runs without a gradient) against PyTorch's `scaled_dot_product_attention` (what
runs with one), interleaved, also at the shape of `prune`'s 12-layer model (docs/kernels.md §2).

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
from analyses.common import BENCH_VOCAB, command_line, emit_report, machine_info, model_dims_and_tokens, within_rounds
from analyses.kernel_traffic import DEPTH_MIX_KERNELS, copy_bandwidth, counted_calls
from attnres_lens import HookedTransformer, ModelConfig, components, cpu_settings
from attnres_lens.kernels.backends import attention_runs_cpu_kernel
from attnres_lens.kernels.cpu_attention import causal_attention_cpu

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


# bench_cpu_step's training shapes, and a wide one nearer the widths the AttnRes paper's < 2% is measured at
INFERENCE_SHAPES = {**SHAPES, "wide": dict(n_layers=4, d_model=1024, n_heads=16, n_ctx=128, batch=2)}
TRAFFIC_ROUNDS = 10  # interleaved rounds of one forward pass per variant with every C kernel call timed


def excess_rows(shape_name: str, models: dict[str, HookedTransformer], tokens: torch.Tensor,
                ratios: dict[str, float], standard_ms: float) -> list[str]:
    """Each variant's forward excess over the standard model's (`ratios`, of `standard_ms`) split into its C kernels'
    time beyond the standard's (the median over interleaved rounds of the difference within the round) and the
    rest, with the depth mix's time (median), bytes and bandwidth per forward pass."""
    kernel_ms = {name: [] for name in models}
    mix_ms = {name: [] for name in models}
    mix_bytes = {}
    with torch.no_grad():
        for _ in range(TRAFFIC_ROUNDS):
            for name, model in models.items():
                counting = counted_calls(lambda: model(tokens))
                kernel_ms[name].append(1e3 * sum(seconds for _, seconds, _ in counting.totals.values()))
                _, seconds, mix_bytes[name] = counting.summed(DEPTH_MIX_KERNELS)
                mix_ms[name].append(1e3 * seconds)
    rows = []
    for name in models:
        if name == "standard":
            continue
        excess = (ratios[name] - 1) * standard_ms
        kernels = within_rounds(kernel_ms[name], kernel_ms["standard"], "difference")
        mix = statistics.median(mix_ms[name])
        mix_cells = (f"{mix:.2f} | {mix_bytes[name] / 1e6:.3g} | {mix_bytes[name] / mix / 1e6:.1f}" if mix_bytes[name]
                     else "– | – | –")
        rows.append(f"| {shape_name} | {name} | {ratios[name]:.3f} | {excess:+.2f} | {mix_cells} | {kernels:+.2f} | "
                    f"{excess - kernels:+.2f} | {1 + kernels / standard_ms:.3f} |")
    return rows


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
        shape, tokens = model_dims_and_tokens(shape)
        for name in ("standard", "full"):
            model = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **VARIANTS[name]))
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
    """The causal attention op alone (no gradient): `cpu_attention.causal_attention_cpu` against PyTorch's SDPA on the
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
    parser.add_argument("--shapes", nargs="+", default=list(INFERENCE_SHAPES), choices=list(INFERENCE_SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # as the commands run; process-wide, so a test calling main() leaves it alone
    kept = args.out is not None and cpu_settings.keep_freed_memory()
    allocator = "freed memory kept for reuse" if kept else "the C library's default allocator"
    started = time.perf_counter()
    lines = [
        "# Inference latency (forward only) relative to the standard model (CPU)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, {allocator}, by "
        f"`{command_line()}`; {args.repeats} interleaved rounds of forward passes under no_grad: times are "
        "medians, × standard the median over rounds of the ratio within the round. "
        "`hooked`: a no-op hook on every `hook_weights` point (as when reading α without a gradient: the hooks fire on "
        "the C kernel's weights, then a second C pass mixes the sources as the hooks left them, "
        "`DepthAttention._watched_kernel_mix`).",
        "",
        "| shape | variant | forward (ms) | × standard | hooked (ms) | hooked × standard |",
        "|---|---|---|---|---|---|",
    ]
    excess_lines = []
    for shape_name in args.shapes:
        shape, tokens = model_dims_and_tokens(INFERENCE_SHAPES[shape_name])
        models = {}
        for name, overrides in VARIANTS.items():
            plain = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **overrides))
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
        ratios = {name: within_rounds(times[(name, 0)], base) for name in models}
        excess_lines += excess_rows(shape_name, {name: pair[0] for name, pair in models.items()}, tokens, ratios,
                                    1e3 * medians[("standard", 0)])
        for name in models:
            plain, hooked = medians[(name, 0)], medians[(name, 1)]
            hooked_cells = ("–", "–") if name.startswith("standard") else (
                f"{1e3 * hooked:.1f}", f"{within_rounds(times[(name, 1)], base):.3f}")
            lines.append(f"| {shape_name} | {name} | {1e3 * plain:.1f} | {ratios[name]:.3f} | "
                         f"{hooked_cells[0]} | {hooked_cells[1]} |")
    lines += [
        "",
        "## Where the excess goes",
        "",
        f"Every C kernel call of one forward pass per variant (no hooks) in each of {TRAFFIC_ROUNDS} interleaved "
        "rounds, timed one by one with the bytes it must move (`kernel_traffic`); copy bandwidth (torch `copy_` of "
        f"256 MB, read + write, one thread): **{copy_bandwidth():.1f} GB/s**. Excess: the variant's forward time "
        "beyond the standard's (from × standard above); C kernels: its C calls' time beyond the standard model's "
        "(RMSNorm, rotary, token attention), the median over rounds of the difference within the round; the rest "
        "is what runs around them (Python, dispatch, allocation, and sublayers slowed by caches the mix flushed). "
        "`kernels alone` is the ratio the C kernels' extra time would leave on its own.",
        "",
        "| shape | variant | × standard | excess (ms) | depth mix (ms) | depth mix (MB) | depth mix (GB/s) | "
        "C kernels (ms) | the rest (ms) | kernels alone, × standard |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *excess_lines,
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
        # the wide shape's heads (128 x 64) run SDPA either way
        *attention_rows({**{name: SHAPES[name] for name in args.shapes if name in SHAPES}, "prune": PRUNE_SHAPE},
                        args.repeats),
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
