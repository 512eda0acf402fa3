"""How a CPU training step grows with depth and sequence length (issue 15): step time, activation memory, and
the depth mix's achieved bandwidth against a measured copy bandwidth.

One process, one torch thread, the fused C kernel (what `auto` picks). For each depth (sublayers) the standard,
Full and Block (S = 4) models step interleaved, medians over repeats. Per step it also reports:

* activation memory: the bytes of every distinct tensor storage autograd saves for the backward (parameters
  excluded), a machine-independent measure. It must grow linearly in depth for every variant: Full AttnRes
  reads J²/2 sources per forward, but each source is one tensor saved once, never a stacked copy of them;
* the depth mix's bandwidth: the bytes its C forward and backward calls must move, as `kernel_traffic.kernel_bytes`
  counts them (forward: every source it reads, plus y or h; backward: every source and its gradient, plus dy or
  dh), over those calls' time, next to `copy_` of a 256 MB buffer (read + write) on the same core.

    python -m analyses.bench_depth_scaling --out analyses/reports/bench_depth_scaling.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from analyses import bench_cpu_step
from analyses.common import command_line, emit_report, machine_info, within_rounds
from analyses.kernel_traffic import DEPTH_MIX_KERNELS, copy_bandwidth, counted_calls
from attnres_lens import HookedTransformer, attnres

VARIANTS = {"standard": dict(residual="standard"), "full": dict(residual="attnres", attnres_block_size=1),
            "block4": dict(residual="attnres", attnres_block_size=4)}


class Stepper(bench_cpu_step.Stepper):
    """`bench_cpu_step`'s training step at a given depth and shape, plus the memory and bandwidth probes."""

    def __init__(self, overrides: dict, n_layers: int, d_model: int, n_ctx: int, batch: int):
        shape = dict(n_layers=n_layers, d_model=d_model, n_heads=4, n_ctx=n_ctx, batch=batch)
        super().__init__(shape, overrides, eager=False)

    def saved_activation_bytes(self) -> int:
        return saved_activation_bytes(self.model, self.tokens)

    def depth_mix_traffic(self, steps: int = 3) -> tuple[float, int]:
        """Seconds and bytes per step of the C depth mix's calls (`kernel_traffic.kernel_bytes`: forward reads each
        consumer's sources and writes y, or h where it is kept; backward reads the sources and dy or dh and writes
        each source's gradient, reading it first where another consumer of the source wrote it already, §5)."""
        counting = counted_calls(lambda: [self.step() for _ in range(steps)])
        calls, seconds, nbytes = counting.summed(DEPTH_MIX_KERNELS)
        if not calls:
            raise RuntimeError("no C depth-mix call in the step: the model did not run the cpu backend's kernel")
        return seconds / steps, nbytes // steps


def saved_activation_bytes(model: HookedTransformer, tokens: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves for the backward of one loss."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, return_type="loss")  # the graph is freed unused when the loss goes out of scope
    return sum(storages.values())


def measure(depths: list[int], n_ctx: int, d_model: int, batch: int, repeats: int, bandwidth: float) -> list[dict]:
    rows = []
    for sublayers in depths:
        steppers = {name: Stepper(overrides, sublayers // 2, d_model, n_ctx, batch) for name, overrides in VARIANTS.items()}
        for stepper in steppers.values():
            stepper.step(), stepper.step()
        times = {name: [] for name in steppers}
        for _ in range(repeats):
            for name, stepper in steppers.items():
                times[name].append(stepper.step())
        base = statistics.median(times["standard"])
        for name, stepper in steppers.items():
            row = dict(sublayers=sublayers, n_ctx=n_ctx, variant=name, ms=1e3 * statistics.median(times[name]),
                       spread=(1e3 * min(times[name]), 1e3 * max(times[name])),
                       ratio=within_rounds(times[name], times["standard"]),
                       saved_mb=stepper.saved_activation_bytes() / 2**20)
            if name != "standard":
                seconds, nbytes = stepper.depth_mix_traffic()
                # the floor: the standard step plus the mix's bytes at copy bandwidth, which no kernel beats
                row.update(mix_ms=1e3 * seconds, mix_gbs=nbytes / seconds / 1e9,
                           floor=1 + nbytes / (bandwidth * 1e9) / base)
            rows.append(row)
        print(f"done: {sublayers} sublayers, n_ctx {n_ctx}", file=sys.stderr)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24, 48], help="sublayers (even)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256],
                        help="extra sequence lengths, measured at the second depth")
    parser.add_argument("--n-ctx", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if any(depth % 2 or depth < 2 for depth in args.depths):
        parser.error(f"--depths are sublayer counts (attention + MLP per layer): even numbers >= 2, got {args.depths}")
    torch.set_num_threads(1)
    started = time.perf_counter()
    bandwidth = copy_bandwidth()
    rows = measure(args.depths, args.n_ctx, args.d_model, args.batch, args.repeats, bandwidth)
    at = args.depths[min(1, len(args.depths) - 1)]
    context_rows = [row for n_ctx in args.contexts
                    for row in measure([at], n_ctx, args.d_model, args.batch, args.repeats, bandwidth)]
    context_rows += [row for row in rows if row["sublayers"] == at]
    context_rows.sort(key=lambda row: row["n_ctx"])

    def table(selected: list[dict]) -> list[str]:
        out = ["| sublayers | n_ctx | variant | step (ms) | min–max (ms) | × standard | saved activations (MiB) | "
               "depth mix (ms) | depth mix GB/s | bandwidth floor × standard |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in selected:
            mix = (f"{row['mix_ms']:.1f} | {row['mix_gbs']:.1f} | {row['floor']:.3f}" if "mix_ms" in row else " | | ")
            out.append(f"| {row['sublayers']} | {row['n_ctx']} | {row['variant']} | {row['ms']:.1f} | "
                       f"{row['spread'][0]:.0f}–{row['spread'][1]:.0f} | {row['ratio']:.3f} | {row['saved_mb']:.1f} | {mix} |")
        return out

    growth = []
    for name in VARIANTS:
        saved = {row["sublayers"]: row["saved_mb"] for row in rows if row["variant"] == name}
        first, last = min(saved), max(saved)
        growth.append(f"{name} {saved[last] / saved[first]:.2f}× for {last / first:.0f}× the depth")
    lines = [
        "# Training-step cost against depth and sequence length (CPU)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, in {time.perf_counter() - started:.0f} s, by `{command_line()}`. d_model {args.d_model}, batch "
        f"{args.batch}, 4 heads; forward + backward + AdamW; {args.repeats} interleaved rounds: step times are "
        f"medians, × standard the median over rounds of the ratio within the round. Copy "
        f"bandwidth (`copy_` of 256 MB, read + write): **{bandwidth:.1f} GB/s**.",
        "",
        "## Depth", "", *table(rows), "",
        "`bandwidth floor`: the standard step plus the bytes the depth mix as it ran must move, at the measured "
        "copy bandwidth (the sums of each shared source's gradient included): what its reads and writes alone "
        "would cost. Full AttnRes mixes one pass per consumer below "
        f"{attnres.MIN_SHARED_SOURCES_WITH_GRAD} shared sources and in two-phase windows from there (each source "
        "read once for several consumers: fewer bytes, the same arithmetic; docs/kernels.md §7).",
        "",
        f"Saved activations from the shallowest to the deepest model: {'; '.join(growth)} (linear growth: no "
        "stacked copies of the sources are kept).",
        "", f"## Sequence length (at {at} sublayers)", "", *table(context_rows),
    ]
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
