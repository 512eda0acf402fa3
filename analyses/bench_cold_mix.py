"""The depth mix with cold caches: why a training step's mixes can run below copy bandwidth, and builds that read
the sources differently (issue 15; docs/kernels.md §6, §11).

In a training step the sources of a mix were written a sublayer or more ago, and the matmuls since have evicted
them: the mix reads them from memory, where a timing loop of the op alone finds them in cache. This script times
the fused mix with its consumer's pre-norm (`cpu_depth._run_forward` / `_run_backward`, as a model's sublayer
calls them) at the small training shape's rows (3, 5, 9 sources) and at the depth benchmark's (24 and 48 sources
of [8, 128, 128], where Full's deep consumers read), both ways:

* **warm**: called again at once, its sources in cache;
* **cold**: after a read of 64 MB (more than the last-level cache of the machines measured), as in a step.

Each with the shipped library (it reads by source groups in the forward from 8 sources on and in the backward's
tiles from 9, token row by token row below), a build of the same source that reads by groups at every source count
(`-DGROUPED_FORWARD_MIN_SOURCES=1 -DTILED_BACKWARD_MIN_SOURCES=1`), and the C source of another commit
(`--baseline`, default a953bcf: its forward read the sources token row by token row at every count, with software
prefetch), built with the same flags (its depth kernels' C interface must be the same as this checkout's). Bytes are
`profile_cpu_step`'s count for the call (each source, input and output once); the same-bytes reference is torch
summing the sources stacked along a new first dimension into one output, as cold. Then training steps of every
AttnRes variant at bench_cpu_step's small shape with the shipped library and the grouped-reads build, each × the
standard step under the same build, interleaved. At 1 and 2 torch threads; freed memory kept for reuse, as `train`
runs.

    python -m analyses.bench_cold_mix --out analyses/reports/bench_cold_mix.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from analyses.baseline_tree import REPOSITORY, short_revision
from analyses.bench_cpu_kernels import float_library, interleaved, paired_step_rows, with_library
from analyses.bench_cpu_step import SHAPES, Stepper, variants
from analyses.common import command_line, emit_report, machine_info
from analyses.kernel_traffic import CountingLibrary, copy_bandwidth, kernels_from
from attnres_lens import cpu_settings
from attnres_lens.kernels import cpu_build, cpu_depth

SWEEP_MEGABYTES = 64
STEP_VARIANTS = ("standard", "full", "block2", "block4")
GROUPED = "grouped reads"  # the build that reads by source groups at every source count


def builds(baseline: str) -> dict[str, object]:
    """The shipped float library, the grouped-reads build and the build of `baseline`'s C sources (every ``.c`` and
    ``.h`` file of its kernels folder: one file before the sources were split by job, several after), by name."""
    arch = list(cpu_build.ARCH_FLAGS[0])
    relative = cpu_build.SOURCES[0].parent.relative_to(REPOSITORY).as_posix()
    listing = subprocess.run(["git", "-C", str(REPOSITORY), "ls-tree", "--name-only", baseline, f"{relative}/"],
                             capture_output=True, text=True)
    names = [Path(line).name for line in listing.stdout.splitlines() if line.endswith((".c", ".h"))]
    if listing.returncode != 0 or not any(name.endswith(".c") for name in names):
        raise SystemExit(f"--baseline {baseline!r}: git finds no C source in its {relative} "
                         f"({listing.stderr.strip() or 'no .c file'}); give a commit of this repository that has them")
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            text = subprocess.run(["git", "-C", str(REPOSITORY), "show", f"{baseline}:{relative}/{name}"],
                                  capture_output=True, text=True, check=True)
            (Path(folder) / name).write_text(text.stdout)
        sources = [Path(folder) / name for name in names if name.endswith(".c")]
        return {"shipped": cpu_build.cpu_library(torch.float32),
                GROUPED: float_library([*arch, "-DGROUPED_FORWARD_MIN_SOURCES=1", "-DTILED_BACKWARD_MIN_SOURCES=1"]),
                baseline_name(baseline): float_library(arch, sources=sources)}


def baseline_name(baseline: str) -> str:
    return f"C source of {short_revision(baseline)}"


def sweep(megabytes: int) -> Callable[[], None]:
    """A read of `megabytes` (a sum): afterwards the caches hold that buffer, not what was read before."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    return lambda: buffer.sum()


def call_bytes(library: object, call: Callable[[], object]) -> int:
    """The bytes `kernel_traffic.kernel_bytes` counts for the C calls of `call` (on `library`)."""
    counting = CountingLibrary(library)
    with kernels_from(counting):
        call()
    return sum(total[2] for total in counting.totals.values())


def mix_rows(cases: Sequence[tuple[int, int, int, int]], repeats: int, threads: int, libraries: dict[str, object],
             before_cold: Callable[[], None]) -> list[str]:
    """`| threads | sources | tokens | caches | build | fwd (us) | GB/s | bwd (us) | GB/s |` rows for each
    (batch, pos, width, sources) case, the torch reference last in each cache state."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch, pos, width, n_sources in cases:
        sources = [torch.randn(batch, pos, width, generator=generator) for _ in range(n_sources)]
        query, gain, norm_weight = (torch.rand(width, generator=generator) + 0.5 for _ in range(3))
        grad_y = torch.randn(batch, pos, width, generator=generator)
        _h, stats, _y, norm_rstd = cpu_depth._run_forward(sources, query, None, 1e-6, norm_weight, 1e-5, False, gain)

        def forward() -> object:
            return cpu_depth._run_forward(sources, query, None, 1e-6, norm_weight, 1e-5, False, gain)

        def backward() -> object:
            return cpu_depth._run_backward(sources, None, stats, None, None, (None, norm_weight, norm_rstd, grad_y),
                                           (query, gain))

        stacked, summed = torch.stack(sources), torch.empty_like(sources[0])
        shipped = libraries["shipped"]
        forward_bytes, backward_bytes = call_bytes(shipped, forward), call_bytes(shipped, backward)
        reference_bytes = (stacked.numel() + summed.numel()) * stacked.element_size()
        functions = {}
        for name, library in libraries.items():
            functions[f"{name} fwd"] = with_library(library, forward)
            functions[f"{name} bwd"] = with_library(library, backward)
        functions["reference"] = lambda: torch.sum(stacked, 0, out=summed)
        for caches, before in (("warm", None), ("cold", before_cold)):
            timing = interleaved(functions, repeats, before)
            for name in libraries:
                forward_s, backward_s = timing.ms(f"{name} fwd") / 1e3, timing.ms(f"{name} bwd") / 1e3
                rows.append(f"| {threads} | {n_sources} | {batch * pos} | {caches} | {name} | {1e6 * forward_s:.0f} | "
                            f"{forward_bytes / forward_s / 1e9:.1f} | {1e6 * backward_s:.0f} | "
                            f"{backward_bytes / backward_s / 1e9:.1f} |")
            reference_s = timing.ms("reference") / 1e3
            rows.append(f"| {threads} | {n_sources} | {batch * pos} | {caches} | torch sum of the stacked sources (same bytes as "
                        f"the forward) | {1e6 * reference_s:.0f} | {reference_bytes / reference_s / 1e9:.1f} | | |")
    return rows


def step_rows(shape: dict, shape_name: str, repeats: int, threads: int, libraries: dict[str, object]) -> list[str]:
    """`paired_step_rows` of training steps with the shipped library and the grouped-reads build."""
    steppers = {name: Stepper(shape, variants("cpu")[name], eager=False) for name in STEP_VARIANTS}
    functions = {f"{name} {build}": with_library(libraries[build], stepper.step)
                 for name, stepper in steppers.items() for build in ("shipped", GROUPED)}
    for function in functions.values():
        function(), function()
    timing = interleaved(functions, repeats)
    return [row.replace(f"| {shape_name} |", f"| {shape_name} | {threads} |", 1)
            for row in paired_step_rows(timing, shape_name, list(STEP_VARIANTS), "shipped", GROUPED)]


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a test of the script)")
    parser.add_argument("--baseline", default="a953bcf", help="the commit whose C source to build beside the shipped "
                        "one (default: a953bcf, whose forward read token row by token row)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if any(threads < 1 for threads in args.threads):
        parser.error(f"--threads must be positive, got {args.threads}")
    started = time.perf_counter()
    if args.out is not None:  # process-wide, so a test calling main() leaves it alone
        cpu_settings.keep_freed_memory()
    cases = ([(2, 8, 16, n) for n in (2, 5)] if args.tiny else
             [(12, 64, 128, n) for n in (3, 5, 9)] + [(8, 128, 128, n) for n in (24, 48)])
    shape_name = "tiny" if args.tiny else "small"
    shape = dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2) if args.tiny else SHAPES["small"]
    libraries = builds(args.baseline)
    before_cold = sweep(1 if args.tiny else SWEEP_MEGABYTES)
    previous = torch.get_num_threads()
    mixes, steps, bandwidths = [], [], []
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bandwidths.append(f"{threads} thread{'s' if threads > 1 else ''}: "
                              f"{copy_bandwidth(8 if args.tiny else 256):.1f} GB/s")
            mixes += mix_rows(cases, args.repeats, threads, libraries, before_cold)
            steps += step_rows(shape, shape_name, args.repeats, threads, libraries)
    finally:
        torch.set_num_threads(previous)
    lines = [
        "# The depth mix with cold caches",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, in "
        f"{time.perf_counter() - started:.0f} s, by `{command_line()}`; {args.repeats} interleaved rounds, medians.",
        "",
        f"The fused mix with its pre-norm, d_model {cases[0][2]}, forward and backward (the h-less form a model's "
        f"sublayer runs), warm (called again at once) and cold (after a {SWEEP_MEGABYTES} MB read), with the "
        f"shipped library, the {GROUPED} build (by source groups at every source count), and the "
        f"{baseline_name(args.baseline)} built "
        "with the same flags; GB/s from `profile_cpu_step`'s byte count of each call. Torch copy bandwidth (256 MB, "
        f"read + write): {', '.join(bandwidths)}.",
        "",
        "| threads | sources | tokens | caches | build | fwd (µs) | fwd GB/s | bwd (µs) | bwd GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
        *mixes,
        "",
        f"Training steps at bench_cpu_step's {shape_name} shape with the shipped library and the {GROUPED} "
        "build; × standard: the standard step under the same build, the median over rounds of the ratio within the "
        "round.",
        "",
        f"| shape | threads | variant | shipped (ms) | {GROUPED} (ms) | {GROUPED} / shipped | shipped: × standard | "
        f"{GROUPED}: × standard |",
        "|---|---|---|---|---|---|---|---|",
        *steps,
    ]
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    main()
