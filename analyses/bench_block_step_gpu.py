"""GPU training step of Block AttnRes (and Full) relative to the standard model, issue 3's model-level target.

One process, variants built up front and stepped in interleaved rounds, median step time (forward, backward, AdamW)
with bf16 autocast. Default shape: 24 layers, d_model 1024, 16 heads, n_ctx 1024, batch 8; Block AttnRes at S = 6
(48 sublayers in 8 blocks, the paper's recommended block count), where the model runs two-phase Triton kernels.
Needs transformer-lens on the GPU machine (carry it as wheels; see the device tool's README).

    python -m analyses.bench_block_step_gpu                 # on the GPU
    python -m analyses.bench_block_step_gpu --dry-run       # tiny model on the CPU: the script's plumbing only
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from analyses.common import machine_info
from attnres_lens import HookedTransformer, ModelConfig, adamw

TARGET = 1.03  # Block AttnRes step time / standard


def variants(block_size: int) -> dict[str, dict]:
    return {
        "standard": dict(residual="standard"),
        f"block S={block_size}": dict(residual="attnres", attnres_block_size=block_size),
        "full": dict(residual="attnres", attnres_block_size=1),
    }


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(shape: dict, overrides: dict, device: str):
    cfg = ModelConfig(
        d_vocab=shape["d_vocab"],
        n_layers=shape["n_layers"],
        d_model=shape["d_model"],
        n_heads=shape["n_heads"],
        n_ctx=shape["n_ctx"],
        device=device,
        seed=0,
        **overrides,
    )
    model = HookedTransformer(cfg)
    optimizer = adamw(model, 1e-4, 0.1)
    tokens = torch.randint(0, cfg.d_vocab, (shape["batch"], cfg.n_ctx), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step() -> float:
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model(tokens, return_type="loss")
        loss.backward()
        optimizer.step()
        synchronize(device)
        return time.perf_counter() - start

    return step


def main(argv: list[str] | None = None) -> list[str]:
    """The markdown report's lines (`measure` has them with the rows)."""
    return measure(argv)[0]


def measure(argv: list[str] | None = None) -> tuple[list[str], list[dict]]:
    """(report lines, benchmark rows: each variant's step ratio, Block's with its target, and step time)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU; checks the script only")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.dry_run:
        device = "cpu"
        shape = dict(n_layers=2, d_model=32, n_heads=4, n_ctx=16, batch=2, d_vocab=64)
        args.block_size, args.repeats = 2, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("timings need a CUDA GPU; use --dry-run to check the script on the CPU")
        device = "cuda"
        shape = dict(
            n_layers=args.layers,
            d_model=args.d_model,
            n_heads=args.d_model // 64,
            n_ctx=args.n_ctx,
            batch=args.batch,
            d_vocab=32768,
        )
    steps = {name: build(shape, overrides, device) for name, overrides in variants(args.block_size).items()}
    for step in steps.values():  # warm-up: kernel compilation, allocator
        for _ in range(2):
            step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(step())
    base = statistics.median(times["standard"])
    lines = [
        f"# Training step relative to the standard model{' (dry run: tiny model on the CPU)' if args.dry_run else ''}",
        "",
        f"* machine: {machine_info()}",
        f"* command: `python -m analyses.bench_block_step_gpu {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"* date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"* shape: {shape}; median of {args.repeats} interleaved steps; target: Block ≤ {TARGET}× standard",
        "",
        "| variant | step ms | × standard |",
        "|---|---|---|",
    ]
    rows = []
    described = (
        f"{shape['n_layers']} layers, d_model {shape['d_model']}, n_ctx {shape['n_ctx']}, batch "
        f"{shape['batch']}, bf16 autocast"
    )
    for name, samples in times.items():
        median = statistics.median(samples)
        lines.append(f"| {name} | {1000 * median:.1f} | {median / base:.3f} |")
        common = dict(metric="step ratio", shape=described, variant=name, threads=None)
        target = TARGET if name.startswith("block") else None
        rows += [
            dict(common, value=median / base, unit="× standard", target=target),
            dict(common, metric="step time", value=1000 * median, unit="ms"),
        ]
    print("\n".join(lines))
    return lines, rows


if __name__ == "__main__":
    main()
