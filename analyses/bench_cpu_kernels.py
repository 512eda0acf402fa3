"""The CPU speed-ups of the rotary/RMSNorm C kernels, Full AttnRes's two-phase forward, the kernel's thread pool, and
the commands' process costs, each measured side by side (issues 13 and 15; docs/kernels.md §2, §6, §7, §11).

* ops: `components.apply_rotary` vs `cpu_elementwise.rotary_cpu`, `F.rms_norm` vs `cpu_elementwise.rms_norm_cpu`,
  and a depth mix with its consumer's pre-norm as two C calls vs one fused call, forward and forward + backward, interleaved
  repeats in one process at one torch thread;
* two-phase: forward passes (no_grad) of Full AttnRes models with the C two-phase windows as shipped and with
  every consumer mixed in one pass (`attnres.stream_two_phase_backend` replaced for the comparison), interleaved;
* vector sums: the float C library as built (its AVX2 vector sums, where the processor has them) against the same
  source and flags built with `-DNO_VECTOR_SUMS` (its portable `omp simd` loops), and against the fallback build
  without `-march=native`: depth mixes forward, forward + backward and with four queries, and a forward pass of
  the prune model, interleaved;
* threads: two-thread training steps of Full and Block S=4 with the library as built (its row split on torch's
  OpenMP pool) and with the pthread build (without -fopenmp), each × the standard step, interleaved; of every
  variant with the KV shift, rotary and RMSNorm kernels split over the pool and on one thread; and ops and steps
  with each thread's parameter-gradient sums in pages of its own (as built) against the build that adds them into
  one shared block (-DSHARED_THREAD_SUMS); and steps with the sublayer's fused mix keeping h against leaving it
  out;
* process costs: a model replica for the worker threads (`session.model_replica`), and the exit of a process
  that imported the analysis commands, with and without `gc.freeze()` (fresh processes, alternating).

    python -m analyses.bench_cpu_kernels --out analyses/reports/bench_cpu_kernels.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from analyses.common import command_line, emit_report, machine_info, within_rounds
from analyses.kernel_traffic import kernels_from
from attnres_lens import HookedTransformer, ModelConfig, attnres
from attnres_lens.analysis.session import model_replica
from attnres_lens.components import apply_rotary, rotary_tables
from attnres_lens.cpu_settings import keep_freed_memory
from attnres_lens.kernels import cpu_build, cpu_elementwise
from attnres_lens.kernels.cpu_depth import depth_attention_cpu, depth_attention_multi_cpu, depth_attention_normed_cpu
from attnres_lens.kernels.cpu_elementwise import rms_norm_cpu, rotary_cpu

# (label, model shape, batch): the training shapes of bench_cpu_step, the prune model at a stacked pass, a deep one
MODEL_SHAPES = [
    ("4 layers, d128, 12 x 64 tokens", dict(n_layers=4, d_model=128, n_heads=4, n_ctx=64), 12),
    ("6 layers, d256, 8 x 128 tokens", dict(n_layers=6, d_model=256, n_heads=8, n_ctx=128), 8),
    ("12 layers, d64, 64 x 65 tokens", dict(n_layers=12, d_model=64, n_heads=4, n_ctx=65), 64),
    ("24 layers, d128, 8 x 128 tokens", dict(n_layers=24, d_model=128, n_heads=4, n_ctx=128), 8),
]
TINY_SHAPES = [("2 layers, d16, 2 x 8 tokens", dict(n_layers=2, d_model=16, n_heads=2, n_ctx=8), 2)]

_EXIT_PROBE = """
import sys, time
import attnres_lens.analysis.run
from attnres_lens import cpu_settings
cpu_settings.set_threads(1)
if sys.argv[1] == "freeze":
    cpu_settings.configure(1)
print(time.time(), flush=True)
"""


class Timings(dict):
    """Seconds of each function, one per round."""

    def ms(self, name: str) -> float:
        return 1e3 * statistics.median(self[name])

    def ratio(self, name: str, base: str) -> float:
        """`name`'s time over `base`'s, within rounds (`analyses.common.within_rounds`)."""
        return within_rounds(self[name], self[base])


def interleaved(functions: dict[str, Callable[[], object]], repeats: int,
                before: Optional[Callable[[], None]] = None) -> Timings:
    """Each function called once a round, `repeats` rounds after one warm-up round, each round in its own shuffled
    order (seeded), each call after `before` (untimed) when given. In one fixed order a function always followed the
    same one: timing the same C source built twice, the build called after another workload's call measured
    1.05-1.1x slower than the one called after a call that read the same inputs (bench_cold_mix, 2026-12-05)."""
    times = Timings({name: [] for name in functions})
    order, shuffle = list(functions), random.Random(0).shuffle
    for round_ in range(repeats + 1):
        shuffle(order)
        for name in order:
            function = functions[name]
            if before is not None:
                before()
            start = time.perf_counter()
            function()
            if round_:
                times[name].append(time.perf_counter() - start)
    return times


def forward_backward(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        leaf = x.detach().requires_grad_()
        function(leaf).sum().backward()

    return run


def op_rows(repeats: int, tiny: bool) -> list[str]:
    rows = []
    batch, pos, heads, d_head = (2, 8, 2, 4) if tiny else (64, 65, 4, 16)
    cos, sin = rotary_tables(pos, d_head, 10000.0)
    x = torch.randn(batch, pos, heads, d_head)
    table_cos, table_sin = cos[:pos, None], sin[:pos, None]
    torch_rotary, c_rotary = (lambda t: apply_rotary(t, table_cos, table_sin)), (lambda t: rotary_cpu(t, cos, sin))
    for width in ((16,) if tiny else (64, 256)):
        y = torch.randn(batch, pos, width)
        w = torch.rand(width) + 0.5
        torch_norm, c_norm = (lambda t, w=w: F.rms_norm(t, t.shape[-1:], w, 1e-5)), (lambda t, w=w: rms_norm_cpu(t, w, 1e-5))
        rows += _op_row(f"RMSNorm [{batch}, {pos}, {width}]", torch_norm, c_norm, y, repeats)
    rows += _op_row(f"rotary [{batch}, {pos}, {heads}, {d_head}]", torch_rotary, c_rotary, x, repeats)
    return rows


def _op_row(label: str, torch_form, c_form, x: torch.Tensor, repeats: int) -> list[str]:
    with torch.no_grad():
        forward = interleaved({"torch": lambda: torch_form(x), "c": lambda: c_form(x)}, repeats)
    both = interleaved({"torch": forward_backward(torch_form, x), "c": forward_backward(c_form, x)}, repeats)
    return [f"| {label} | {forward.ms('torch'):.3f} | {forward.ms('c'):.3f} | {forward.ratio('torch', 'c'):.2f} | "
            f"{both.ms('torch'):.3f} | {both.ms('c'):.3f} | {both.ratio('torch', 'c'):.2f} |"]


def fused_norm_rows(repeats: int, tiny: bool) -> list[str]:
    """A consumer's depth mix then its pre-norm as two C calls (what the model ran before) vs one fused call,
    forward and forward + backward (the loss on the normed output only, as in a model)."""
    rows = []
    for n_sources, batch, pos, width in ((3, 2, 8, 16),) if tiny else ((5, 12, 64, 128), (9, 12, 64, 128),
                                                                        (13, 8, 128, 256)):
        generator = torch.Generator().manual_seed(n_sources)
        sources = [torch.randn(batch, pos, width, generator=generator, requires_grad=True) for _ in range(n_sources)]
        query, gain, norm_weight = (torch.randn(width, generator=generator, requires_grad=True) for _ in range(3))

        def two_calls():
            return rms_norm_cpu(depth_attention_cpu(sources, query, gain, 1e-6)[0], norm_weight, 1e-5)

        def one_call():
            return depth_attention_normed_cpu(sources, query, gain, 1e-6, norm_weight, 1e-5)[1]

        with torch.no_grad():
            forward = interleaved({"two": two_calls, "one": one_call}, repeats)
        both = interleaved({"two": lambda: two_calls().sum().backward(), "one": lambda: one_call().sum().backward()},
                           repeats)
        rows.append(f"| {n_sources} x [{batch}, {pos}, {width}] | {forward.ms('two'):.3f} | {forward.ms('one'):.3f} | "
                    f"{forward.ratio('two', 'one'):.2f} | {both.ms('two'):.3f} | {both.ms('one'):.3f} | "
                    f"{both.ratio('two', 'one'):.2f} |")
    return rows


def two_phase_rows(shapes, repeats: int) -> list[str]:
    shipped = attnres.stream_two_phase_backend
    rows = []
    for label, shape, batch in shapes:
        model = HookedTransformer(ModelConfig(d_vocab=64, residual="attnres", attnres_block_size=1,
                                              depth_attention_backend="cpu", **shape)).eval()
        with torch.no_grad():
            for module in model.depth_attention_modules().values():
                module.query.normal_()  # away from the uniform start, as in a trained model
        tokens = torch.randint(0, 64, (batch, shape["n_ctx"]))

        def run(policy):
            def forward() -> None:
                attnres.stream_two_phase_backend = policy
                model(tokens)
            return forward

        try:
            with torch.no_grad():
                result = interleaved({"one pass": run(lambda *args: None), "two-phase": run(shipped)}, repeats)
        finally:
            attnres.stream_two_phase_backend = shipped
        rows.append(f"| {label} | {result.ms('one pass'):.1f} | {result.ms('two-phase'):.1f} | "
                    f"{result.ratio('two-phase', 'one pass'):.3f} |")
    return rows


def float_library(arch_flags: list[str], thread_flags: Optional[list[str]] = None,
                  sources: Optional[Sequence[Path]] = None) -> object:
    """The float kernel library built with `arch_flags` (and `thread_flags`, default the shipped ones) in place of
    the shipped ones, from the C files `sources` and the headers beside them (default the shipped C files), in a
    cache of its own."""
    flags, threads, cache = cpu_build.ARCH_FLAGS, cpu_build.THREAD_FLAGS, os.environ.get(cpu_build.CACHE_ENV_VAR)
    shipped_sources, shipped_headers = cpu_build.SOURCES, cpu_build.HEADERS
    with tempfile.TemporaryDirectory() as folder:
        os.environ[cpu_build.CACHE_ENV_VAR], cpu_build.ARCH_FLAGS = folder, (arch_flags,)
        if thread_flags is not None:
            cpu_build.THREAD_FLAGS = (thread_flags,)
        if sources is not None:
            cpu_build.SOURCES = tuple(sources)
            cpu_build.HEADERS = tuple(sorted({header for source in sources for header in source.parent.glob("*.h")}))
        try:
            return cpu_build._build_library("float")  # loaded: the file may go
        finally:
            cpu_build.ARCH_FLAGS, cpu_build.THREAD_FLAGS = flags, threads
            cpu_build.SOURCES, cpu_build.HEADERS = shipped_sources, shipped_headers
            if cache is None:
                del os.environ[cpu_build.CACHE_ENV_VAR]
            else:
                os.environ[cpu_build.CACHE_ENV_VAR] = cache


def with_library(library: object, function: Callable[[], object]) -> Callable[[], None]:
    """`function` with every C call of the kernels going to `library`."""
    def run() -> None:
        with kernels_from(library):
            function()
    return run


def compare_libraries(libraries: dict[str, object], function: Callable[[], object], repeats: int) -> Timings:
    """`function` with each of `libraries` in turn, interleaved."""
    return interleaved({name: with_library(library, function) for name, library in libraries.items()}, repeats)


def vector_sum_rows(repeats: int, tiny: bool) -> list[str]:
    libraries = {"fallback": float_library([]), "loops": float_library([*cpu_build.ARCH_FLAGS[0], "-DNO_VECTOR_SUMS"]),
                 "vector": cpu_build.cpu_library(torch.float32)}

    def compare(function: Callable[[], object]) -> Timings:
        return compare_libraries(libraries, function, repeats)

    rows = []
    cases = ((5, 2, 8, 16),) if tiny else ((9, 12, 64, 128), (25, 64, 65, 64), (49, 8, 128, 128))
    for n_sources, batch, pos, width in cases:
        generator = torch.Generator().manual_seed(n_sources)
        sources = [torch.randn(batch, pos, width, generator=generator, requires_grad=True) for _ in range(n_sources)]
        query, gain = (torch.randn(width, generator=generator, requires_grad=True) for _ in range(2))
        queries = torch.randn(4, width, generator=generator)
        with torch.no_grad():
            forward = compare(lambda: depth_attention_cpu(sources, query, gain, 1e-6))
            multi = compare(lambda: depth_attention_multi_cpu(sources, queries, 1e-6))
        both = compare(lambda: depth_attention_cpu(sources, query, gain, 1e-6)[0].sum().backward())
        rows.append(f"| {n_sources} x [{batch}, {pos}, {width}] | " + " | ".join(
            f"{timing.ms('loops'):.2f} | {timing.ms('vector'):.2f} | {timing.ratio('vector', 'loops'):.3f} | "
            f"{timing.ratio('fallback', 'loops'):.2f}" for timing in (forward, both, multi)) + " |")
    label, shape, batch = (TINY_SHAPES if tiny else MODEL_SHAPES[2:3])[0]
    model = HookedTransformer(ModelConfig(d_vocab=64, residual="attnres", depth_attention_backend="cpu", **shape))
    tokens = torch.randint(0, 64, (batch, shape["n_ctx"]))
    with torch.no_grad():
        timing = compare(lambda: model(tokens))
    rows.append(f"| forward, Full {label} | | | | | | | | | {timing.ms('loops'):.1f} | {timing.ms('vector'):.1f} | "
                f"{timing.ratio('vector', 'loops'):.3f} | {timing.ratio('fallback', 'loops'):.2f} |")
    return rows


def paired_step_rows(timing: Timings, shape_name: str, names: list[str], before: str, after: str) -> list[str]:
    """Table rows of training steps under two settings (`timing` keys "{variant} {setting}"): `| shape | variant |
    before (ms) | after (ms) | after / before | before: × standard | after: × standard |`."""
    rows = []
    for name in names:
        versus = (" | " if name == "standard" else
                  f"{timing.ratio(f'{name} {before}', f'standard {before}'):.3f} | "
                  f"{timing.ratio(f'{name} {after}', f'standard {after}'):.3f}")
        rows.append(f"| {shape_name} | {name} | {timing.ms(f'{name} {before}'):.1f} | "
                    f"{timing.ms(f'{name} {after}'):.1f} | {timing.ratio(f'{name} {after}', f'{name} {before}'):.3f} | "
                    f"{versus} |")
    return rows


def thread_pool_rows(repeats: int, tiny: bool) -> list[str]:
    """Two-thread training steps of Full and Block S=4 AttnRes, × the standard step, with the shipped library (its
    row split on torch's OpenMP pool, from 2^15 elements per thread) and with the pthread build (a thread started
    per call, from 2^20 elements per thread), interleaved."""
    from analyses.bench_cpu_step import SHAPES, Stepper, variants

    libraries = {"OpenMP pool": cpu_build.cpu_library(torch.float32),
                 "pthreads": float_library(list(cpu_build.ARCH_FLAGS[0]), [])}
    shapes = {"tiny": dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)} if tiny else SHAPES
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    rows = []
    try:
        for shape_name, shape in shapes.items():
            steppers = {name: Stepper(shape, variants("cpu")[name], eager=False) for name in ("standard", "full",
                                                                                            "block4")}
            functions = {"standard": steppers["standard"].step}
            for build, library in libraries.items():
                for name in ("full", "block4"):
                    functions[f"{name} {build}"] = with_library(library, steppers[name].step)
            timing = interleaved(functions, repeats)
            for name in ("full", "block4"):
                rows.append(f"| {shape_name} | {name} | {timing.ratio(f'{name} pthreads', 'standard'):.3f} | "
                            f"{timing.ratio(f'{name} OpenMP pool', 'standard'):.3f} |")
    finally:
        torch.set_num_threads(previous)
    return rows


def elementwise_thread_rows(repeats: int, tiny: bool) -> list[str]:
    """Two-thread training steps with the KV shift, rotary and RMSNorm kernels' rows split over torch's OpenMP pool
    (as shipped) and on one thread (`cpu_elementwise._elementwise_threads` answering 1), interleaved: each variant's
    step both ways, and × the standard step of the same setting."""
    from analyses.bench_cpu_step import SHAPES, Stepper, variants

    shapes = {"tiny": dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)} if tiny else SHAPES
    names = ("standard", "standard+kv_shift", "full", "block4")
    shipped = cpu_elementwise._elementwise_threads
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    rows = []
    try:
        for shape_name, shape in shapes.items():
            steppers = {name: Stepper(shape, variants("cpu")[name], eager=False) for name in names}
            functions = {}
            for split in ("split", "one"):
                for name in names:
                    def step(stepper=steppers[name], split=split) -> None:
                        cpu_elementwise._elementwise_threads = shipped if split == "split" else (lambda n, library: 1)
                        try:
                            stepper.step()
                        finally:
                            cpu_elementwise._elementwise_threads = shipped
                    functions[f"{name} {split}"] = step
            rows += paired_step_rows(interleaved(functions, repeats), shape_name, names, "one", "split")
    finally:
        torch.set_num_threads(previous)
    return rows


def thread_sum_rows(repeats: int, tiny: bool) -> tuple[list[str], list[str]]:
    """At two torch threads, the library as built (each thread adds its parameter-gradient sums in pages of its
    own) against the same source and flags with -DSHARED_THREAD_SUMS (every thread adds into its row of one shared
    [threads, D] block, as before): (op rows, step rows). Ops, forward + backward: a depth mix with its fused
    pre-norm at the small training shape, RMSNorm and the KV shift; steps: every variant at bench_cpu_step's shapes,
    each build × its own standard step, interleaved."""
    from analyses.bench_cpu_step import SHAPES, Stepper, variants

    libraries = {"in place": float_library([*cpu_build.ARCH_FLAGS[0], "-DSHARED_THREAD_SUMS"]),
                 "own pages": cpu_build.cpu_library(torch.float32)}
    previous = torch.get_num_threads()
    torch.set_num_threads(2)

    def compare(function: Callable[[], object]) -> Timings:
        return compare_libraries(libraries, function, repeats)

    op_lines, step_lines = [], []
    try:
        batch, pos, width = (2, 8, 16) if tiny else (12, 64, 128)
        generator = torch.Generator().manual_seed(3)
        for n_sources in (3, 9):
            sources = [torch.randn(batch, pos, width, generator=generator, requires_grad=True)
                       for _ in range(n_sources)]
            query, gain, norm_weight = (torch.randn(width, generator=generator, requires_grad=True) for _ in range(3))
            timing = compare(lambda: depth_attention_normed_cpu(sources, query, gain, 1e-6, norm_weight,
                                                                1e-5)[1].sum().backward())
            op_lines.append(f"| depth mix + pre-norm, {n_sources} x [{batch}, {pos}, {width}] | "
                            f"{timing.ms('in place'):.3f} | {timing.ms('own pages'):.3f} | "
                            f"{timing.ratio('own pages', 'in place'):.3f} |")
        rows = torch.randn(batch, pos, width, generator=generator)
        norm_gain = torch.rand(width, generator=generator) + 0.5
        timing = compare(forward_backward(lambda t: rms_norm_cpu(t, norm_gain, 1e-5), rows))
        op_lines.append(f"| RMSNorm [{batch}, {pos}, {width}] | {timing.ms('in place'):.3f} | "
                        f"{timing.ms('own pages'):.3f} | {timing.ratio('own pages', 'in place'):.3f} |")
        heads = 4
        k, v = (torch.randn(batch, pos, heads, width // heads, generator=generator) for _ in range(2))
        coefficients = torch.randn(heads, 4, generator=generator, requires_grad=True)

        def kv_shift() -> None:
            shifted_k, shifted_v = cpu_elementwise.kv_shift_cpu(k.requires_grad_(), v.requires_grad_(), coefficients)
            (shifted_k.sum() + shifted_v.sum()).backward()
        timing = compare(kv_shift)
        op_lines.append(f"| KV shift [{batch}, {pos}, {heads}, {width // heads}] | {timing.ms('in place'):.3f} | "
                        f"{timing.ms('own pages'):.3f} | {timing.ratio('own pages', 'in place'):.3f} |")

        shapes = {"tiny": dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)} if tiny else SHAPES
        names = list(variants("cpu"))
        for shape_name, shape in shapes.items():
            steppers = {name: Stepper(shape, variants("cpu")[name], eager=False) for name in names}
            timing = interleaved({f"{name} {build}": with_library(library, steppers[name].step)
                                  for build, library in libraries.items() for name in names}, repeats)
            step_lines += paired_step_rows(timing, shape_name, names, "in place", "own pages")
    finally:
        torch.set_num_threads(previous)
    return op_lines, step_lines


@contextlib.contextmanager
def mix_keeps_h() -> Iterator[None]:
    """A model's fused mix writes and keeps h, as before 2026-12-02 (it leaves h out as shipped: docs/kernels.md §4)."""
    shipped = attnres.fused_mix_and_norm
    # the depth stream and mix_and_norm pass the six arguments and keep_h positionally
    attnres.fused_mix_and_norm = lambda *args: shipped(*args[:6], True)
    try:
        yield
    finally:
        attnres.fused_mix_and_norm = shipped


def kept_h_rows(repeats: int, tiny: bool) -> list[str]:
    """Training steps of every variant with the sublayer's fused mix keeping h (written, saved, read back) and
    leaving it out (as shipped), interleaved: bench_cpu_step's small shape at one and two threads, and a 24-layer
    model (d_model 128, n_ctx 128, batch 8) at one thread with a quarter of the rounds."""
    from analyses.bench_cpu_step import SHAPES, Stepper, variants

    deep = dict(n_layers=24, d_model=128, n_heads=4, n_ctx=128, batch=8)
    settings = ([("tiny", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2), 1, repeats)] if tiny else
                [("small", SHAPES["small"], 1, repeats), ("small", SHAPES["small"], 2, repeats),
                 ("24 layers", deep, 1, max(3, repeats // 4))])
    names = ["standard", "full", "block2", "block4"]
    previous = torch.get_num_threads()
    rows = []
    try:
        for shape_name, shape, threads, rounds in settings:
            torch.set_num_threads(threads)
            steppers = {name: Stepper(shape, variants("cpu")[name], eager=False) for name in names}
            functions = {}
            for name in names:
                def kept(stepper=steppers[name]) -> None:
                    with mix_keeps_h():
                        stepper.step()
                functions[f"{name} kept"], functions[f"{name} left out"] = kept, steppers[name].step
            rows += paired_step_rows(interleaved(functions, rounds), f"{shape_name}, {threads} thread(s)", names,
                                     "kept", "left out")
    finally:
        torch.set_num_threads(previous)
    return rows


def exit_seconds(mode: str) -> float:
    """Seconds from the probe's last line to its process's end."""
    out = subprocess.run([sys.executable, "-c", _EXIT_PROBE, mode], capture_output=True, text=True, check=True)
    return time.time() - float(out.stdout.split()[-1])


def main(argv: Optional[Sequence[str]] = None, keep_memory: bool = False) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--processes", type=int, default=3, help="exits timed per setting (fresh processes)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a test of the script)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # freed blocks reused (as in a training loop's steady state and in the analysis commands): a call that allocates
    # megabytes of gradients otherwise page-faults them in afresh each time, which swamps the kernels' difference.
    # Process-wide, so only the command applies it, not a test calling main().
    kept = keep_memory and keep_freed_memory()
    allocator = "freed memory kept (`cpu_settings.keep_freed_memory`)" if kept else "the C library's default allocator"
    started = time.perf_counter()
    lines = [
        "# CPU kernels and process costs, side by side",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, one torch "
        f"thread, by `{command_line()}`; {args.repeats} interleaved rounds: times are medians, ratios the median "
        f"over rounds of the ratio within the round; {allocator}.",
        "",
        "| op | PyTorch fwd (ms) | C fwd (ms) | × | PyTorch fwd+bwd (ms) | C fwd+bwd (ms) | × |",
        "|---|---|---|---|---|---|---|",
        *op_rows(args.repeats, args.tiny),
        "",
        "A sublayer's depth mix and its pre-norm (docs/kernels.md §4): `depth_attention_cpu` then `rms_norm_cpu` vs "
        "one `depth_attention_normed_cpu` call.",
        "",
        "| sources x shape | two calls fwd (ms) | fused fwd (ms) | × | two calls fwd+bwd (ms) | fused fwd+bwd (ms) | × |",
        "|---|---|---|---|---|---|---|",
        *fused_norm_rows(args.repeats, args.tiny),
        "",
        "Full AttnRes forward (no_grad, `cpu` backend): every consumer in one fused pass vs the shipped two-phase "
        "windows (4 consumers from 8 shared sources, docs/kernels.md §7).",
        "",
        "| model | one pass (ms) | two-phase (ms) | two-phase / one pass |",
        "|---|---|---|---|",
        *two_phase_rows(TINY_SHAPES if args.tiny else MODEL_SHAPES, args.repeats),
        "",
        "The float library's AVX2 vector sums (docs/kernels.md §6) against its `omp simd` loops (the same source and "
        "flags with -DNO_VECTOR_SUMS; `fallback ×`: the build without -march=native, over the loops): one depth mix "
        "forward (no_grad), forward + backward, and with four queries (`depth_attention_multi_cpu`, phase 1 of "
        "two-phase); the last row a whole forward pass (no_grad, its two-phase windows included) in the last "
        "column group.",
        "",
        "| sources x shape | loops fwd (ms) | vector fwd (ms) | × | fallback × | loops fwd+bwd (ms) | "
        "vector fwd+bwd (ms) | × | fallback × | loops 4 queries (ms) | vector 4 queries (ms) | × | fallback × |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *vector_sum_rows(args.repeats, args.tiny),
    ]
    lines += [
        "",
        "Threads (docs/kernels.md §6): training steps at two torch threads (bench_cpu_step's shapes, fused AdamW), "
        "× the standard step of the same round, with the kernel's row split on torch's OpenMP pool (as shipped) and "
        "with the pthread build (no -fopenmp: a thread started per call, so split only from 2^20 elements per thread).",
        "",
        "| shape | variant | pthreads × standard | OpenMP pool × standard |",
        "|---|---|---|---|",
        *thread_pool_rows(args.repeats, args.tiny),
        "",
        "The KV shift, rotary and RMSNorm kernels (docs/kernels.md §6) at two torch threads: their rows split over "
        "the OpenMP pool from 2^15 elements per thread (as shipped) against one thread, in training steps of each "
        "variant (bench_cpu_step's shapes), interleaved.",
        "",
        "| shape | variant | one thread (ms) | split (ms) | split / one | one: × standard | split: × standard |",
        "|---|---|---|---|---|---|---|",
        *elementwise_thread_rows(args.repeats, args.tiny),
    ]
    sum_ops, sum_steps = thread_sum_rows(args.repeats, args.tiny)
    lines += [
        "",
        "Per-thread sums (docs/kernels.md §11) at two torch threads: the library as built, each thread adding its "
        "parameter-gradient sums (the depth mix's query and fused gain, RMSNorm's gain, the KV shift's pairs) in "
        "pages of its own, against the same source and flags with -DSHARED_THREAD_SUMS, every thread adding into its "
        "row of one shared [threads, D] block; forward + backward, interleaved.",
        "",
        "| op | in place (ms) | own pages (ms) | own / in place |",
        "|---|---|---|---|",
        *sum_ops,
        "",
        "The same two builds in training steps of every variant (bench_cpu_step's shapes, two threads).",
        "",
        "| shape | variant | in place (ms) | own pages (ms) | own / in place | in place: × standard | "
        "own pages: × standard |",
        "|---|---|---|---|---|---|---|",
        *sum_steps,
    ]
    lines += [
        "",
        "A sublayer's fused mix keeping its input h (written, saved for the backward, read back) against leaving "
        "it out as shipped (docs/kernels.md §4: the backward mixes each row again from the sources it reads "
        "anyway), in training steps of every variant, interleaved.",
        "",
        "| shape | variant | h kept (ms) | h left out (ms) | left out / kept | kept: × standard | left out: × standard |",
        "|---|---|---|---|---|---|---|",
        *kept_h_rows(args.repeats, args.tiny),
    ]
    shapes = TINY_SHAPES if args.tiny else MODEL_SHAPES[2:3]
    model = HookedTransformer(ModelConfig(d_vocab=64, residual="attnres", **shapes[0][1]))
    replica = interleaved({"replica": lambda: model_replica(model)}, max(3, args.repeats // 4)).ms("replica")
    exits = {"plain": [], "freeze": []}
    for _ in range(args.processes):
        for mode in exits:
            exits[mode].append(exit_seconds(mode))
    lines += [
        "",
        f"Process costs: one worker replica of the {shapes[0][0].split(',')[0]} Full model "
        f"(`model_replica`) {replica:.0f} ms; the exit of a process that imported the analysis commands "
        f"{statistics.median(exits['plain']):.2f} s, {statistics.median(exits['freeze']):.2f} s after "
        f"`cpu_settings.configure` (gc.freeze), medians of {args.processes} fresh processes each, alternating.",
        "",
        f"Took {time.perf_counter() - started:.0f} s.",
    ]
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    main(keep_memory=True)
