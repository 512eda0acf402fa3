"""The fused backward's in-place sums of shared source gradients (docs/kernels.md §5), on against off (issue 15).

One process, one torch thread, the C kernel. Each case is one model and batch (`bench_cpu_step`'s training step)
stepped with the sums on (forced at any source size: the cases are what `attnres.MIN_SHARED_GRADIENT_ELEMENTS` is
chosen from) and off in turn, the order alternating round by round; each round's ratio is taken within it (`within_rounds`), so a slow
spell of the shared machine slows both. Off is the stream handing its consumers its own tensors, as before the
sums existed: every consumer's backward writes a fresh gradient per source and autograd adds them.

    python -m analyses.bench_shared_gradients --out analyses/reports/bench_shared_gradients.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from analyses.bench_cpu_step import SHAPES, Stepper
from analyses.common import command_line, emit_report, machine_info, within_rounds
from attnres_lens import attnres
from attnres_lens.attnres import DepthStream

CASES = {  # shape, rounds (a small step is cheap and its ratio closer to 1: more rounds)
    # from the sums' own fixed cost (their nodes and buffers) to where the adds they save outweigh it: elements per
    # source 1K, 8K, 32K, 98K (the small shape), 131K at 48 sublayers
    "8 tokens (8 sublayers)": (dict(SHAPES["small"], n_ctx=8, batch=1), 200),
    "64 tokens (8 sublayers)": (dict(SHAPES["small"], batch=1), 150),
    "4 x 64 tokens (8 sublayers)": (dict(SHAPES["small"], batch=4), 80),
    "small (8 sublayers)": (SHAPES["small"], 40),
    "48 sublayers": (dict(n_layers=24, d_model=128, n_heads=4, n_ctx=128, batch=8), 10),  # bench_depth_scaling's
}
VARIANTS = {"full": dict(residual="attnres", attnres_block_size=1),
            "block4": dict(residual="attnres", attnres_block_size=4)}
TINY = dict(n_layers=2, d_model=16, n_heads=2, n_ctx=8, batch=2)


@contextlib.contextmanager
def sums_off() -> Iterator[None]:
    """Every consumer reads the stream's own tensors (autograd then adds their gradients)."""
    shares = DepthStream._shares_gradients
    DepthStream._shares_gradients = lambda self, module, fused=False: False
    try:
        yield
    finally:
        DepthStream._shares_gradients = shares


@contextlib.contextmanager
def sums_on() -> Iterator[None]:
    """The sums at any source size (`attnres.MIN_SHARED_GRADIENT_ELEMENTS` is what this script measures)."""
    threshold = attnres.MIN_SHARED_GRADIENT_ELEMENTS
    attnres.MIN_SHARED_GRADIENT_ELEMENTS = 0
    try:
        yield
    finally:
        attnres.MIN_SHARED_GRADIENT_ELEMENTS = threshold


def measure(shape: dict, overrides: dict, repeats: int) -> dict:
    stepper = Stepper(shape, overrides, eager=False)
    for _ in range(2):
        with sums_on():
            stepper.step()
        with sums_off():
            stepper.step()
    on, off = [], []
    for round_ in range(repeats):
        for sums in ((True, False) if round_ % 2 else (False, True)):
            with (sums_on() if sums else sums_off()):
                (on if sums else off).append(stepper.step())
    ratios = [a / b for a, b in zip(on, off)]
    return dict(on=1000 * statistics.median(on), off=1000 * statistics.median(off), ratio=within_rounds(on, off),
                difference=1000 * within_rounds(on, off, "difference"), low=min(ratios), high=max(ratios),
                elements=shape["batch"] * shape["n_ctx"] * shape["d_model"])


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help="rounds per case (each steps both ways once; defaults in CASES)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model only (tests)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = {"tiny": (TINY, 2)} if args.tiny else CASES
    started = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        "# Shared source gradients summed in the fused backward, on against off",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {machine_info()}, one torch thread, by `{command_line()}`. "
        "Forward + backward + AdamW of `bench_cpu_step`'s step; rounds (per row) each step the same model with the "
        "sums on and off (order alternating); the ratio and difference are each round's on / off and on − off, "
        "medians (and the ratios' range). Shipped: the sums from "
        f"{attnres.MIN_SHARED_GRADIENT_ELEMENTS} elements per source.",
        "",
        "| shape | elements per source | variant | rounds | on (ms) | off (ms) | on − off (ms) | on / off | range |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, (shape, rounds) in cases.items():
        rounds = args.repeats or rounds
        for variant, overrides in VARIANTS.items():
            row = measure(shape, overrides, rounds)
            lines.append(f"| {case} | {row['elements']} | {variant} | {rounds} | {row['on']:.1f} | {row['off']:.1f} | "
                         f"{row['difference']:+.2f} | {row['ratio']:.3f} | {row['low']:.3f}–{row['high']:.3f} |")
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
