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
Saved activations must grow linearly in depth (no stacked copies of the sources are kept). Full AttnRes mixes one
pass per consumer below `depth_execution.MIN_SHARED_SOURCES_WITH_GRAD` shared sources and in two-phase windows from there
(docs/kernels.md §7).

    python -m analyses.benchmarks bench_depth_scaling
"""

from __future__ import annotations

import statistics
import sys

import torch

from analyses import bench_cpu_step
from analyses.common import within_rounds
from analyses.kernel_traffic import DEPTH_MIX_KERNELS, copy_bandwidth, counted_calls
from attnres_lens import HookedTransformer

VARIANTS = {
    "standard": dict(residual="standard"),
    "full": dict(residual="attnres", attnres_block_size=1),
    "block4": dict(residual="attnres", attnres_block_size=4),
}


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
        steppers = {
            name: Stepper(overrides, sublayers // 2, d_model, n_ctx, batch) for name, overrides in VARIANTS.items()
        }
        for stepper in steppers.values():
            stepper.step(), stepper.step()
        times = {name: [] for name in steppers}
        for _ in range(repeats):
            for name, stepper in steppers.items():
                times[name].append(stepper.step())
        base = statistics.median(times["standard"])
        for name, stepper in steppers.items():
            row = dict(
                sublayers=sublayers,
                n_ctx=n_ctx,
                variant=name,
                ms=1e3 * statistics.median(times[name]),
                spread=(1e3 * min(times[name]), 1e3 * max(times[name])),
                ratio=within_rounds(times[name], times["standard"]),
                saved_mb=stepper.saved_activation_bytes() / 2**20,
            )
            if name != "standard":
                seconds, nbytes = stepper.depth_mix_traffic()
                # the floor: the standard step plus the mix's bytes at copy bandwidth, which no kernel beats
                row.update(
                    mix_ms=1e3 * seconds, mix_gbs=nbytes / seconds / 1e9, floor=1 + nbytes / (bandwidth * 1e9) / base
                )
            rows.append(row)
        print(f"done: {sublayers} sublayers, n_ctx {n_ctx}", file=sys.stderr)
    return rows


DEPTHS, CONTEXTS, N_CTX, D_MODEL, BATCH = [6, 12, 24, 48], [64, 256], 128, 128, 8
TINY = dict(depths=[2, 4], contexts=[8], n_ctx=16, d_model=16, batch=2)


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """CPU training step against depth (6-48 sublayers) and sequence length: ratios, saved activations, mix GB/s."""
    depths, contexts, n_ctx, d_model, batch = (
        (TINY["depths"], TINY["contexts"], TINY["n_ctx"], TINY["d_model"], TINY["batch"])
        if tiny
        else (DEPTHS, CONTEXTS, N_CTX, D_MODEL, BATCH)
    )
    repeats = repeats or (1 if tiny else 9)
    torch.set_num_threads(1)
    bandwidth = copy_bandwidth()
    measured = measure(depths, n_ctx, d_model, batch, repeats, bandwidth)
    at = depths[min(1, len(depths) - 1)]  # the sequence lengths are measured at the second depth
    measured += [row for context in contexts for row in measure([at], context, d_model, batch, repeats, bandwidth)]
    rows = [dict(metric="copy bandwidth", shape="copy_ of 256 MB", variant="", threads=1, value=bandwidth, unit="GB/s")]
    for row in measured:
        common = dict(
            shape=f"{row['sublayers']} sublayers, n_ctx {row['n_ctx']}, d_model {d_model}, batch {batch}",
            variant=row["variant"],
            threads=1,
        )
        rows += [
            dict(common, metric="step ratio", value=row["ratio"], unit="× standard"),
            dict(common, metric="step time", value=row["ms"], unit="ms"),
            dict(common, metric="saved activations", value=row["saved_mb"], unit="MiB"),
        ]
        if "mix_ms" in row:
            # the floor: the standard step plus the mix's bytes at copy bandwidth, which no kernel beats
            rows += [
                dict(common, metric="depth mix bandwidth", value=row["mix_gbs"], unit="GB/s"),
                dict(common, metric="bandwidth floor", value=row["floor"], unit="× standard"),
            ]
    return rows
