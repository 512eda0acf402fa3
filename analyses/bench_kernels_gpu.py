"""GPU benchmark of depth attention (issue 3): forward+backward time and achieved bandwidth, bf16.

Variants: the fused Triton kernels, the fast torch path, the eager reference, ``torch.compile`` of the reference and
fla-core's ``fused_attnres`` (skipped when fla is not installed). Bytes follow docs/kernels.md §8: forward (S+1)·N·D·b,
backward (2S+2)·N·D·b; bandwidth is compared with a measured device-to-device copy. Prints a markdown table headed by
the machine, the command and the date. Installs nothing; imports torch, triton, attnres_lens.kernels (and fla).

    python -m analyses.bench_kernels_gpu                      # full grid (tokens 8k/64k, d_model 1024/4096, S 3/9/17)
    python -m analyses.bench_kernels_gpu --tokens 8192 --variants triton,fla
    python -m analyses.bench_kernels_gpu --dry-run            # tiny shapes, CPU interpreter: correctness only

A second table times two-phase Block AttnRes (one phase-1 pass for a block's S pseudo-queries, then one merge per
sublayer) against S single-pass calls, forward+backward, for blocks with 4, 8 and 16 completed sources.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():
    # only the dry run works without a GPU, and it needs the interpreter, which triton reads at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

from analyses.common import machine_info
from attnres_lens.kernels import block_phase1, depth_attention, merge_partial
from attnres_lens.kernels.reference import depth_attention_reference

VARIANTS = ("triton", "torch", "eager", "compile", "fla")


def _load_fla_fused():
    try:
        from fla.ops.attnres import fused_attnres
    except ImportError:
        return None
    return fused_attnres


def _reference_h(sources, query, gain):
    return depth_attention_reference(sources, query, gain)[0]


def make_variant(name: str):
    """A callable ``(sources, query, gain) -> h``, or None when the variant cannot run here."""
    if name == "triton":
        return lambda sources, query, gain: depth_attention(sources, query, gain, backend="triton")
    if name == "torch":
        return lambda sources, query, gain: depth_attention(sources, query, gain, backend="torch")
    if name == "eager":
        return _reference_h
    if name == "compile":
        return torch.compile(_reference_h, dynamic=False) if torch.cuda.is_available() else None
    if name == "fla":
        fused = _load_fla_fused()
        if fused is None or not torch.cuda.is_available():
            return None
        return lambda sources, query, gain: fused(query, sources, gain, rms_eps=1e-6, scale=1.0)
    raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")


def make_inputs(tokens: int, d_model: int, n_sources: int, dtype: torch.dtype, device: str):
    generator = torch.Generator(device=device).manual_seed(0)
    sources = [
        torch.randn(tokens, d_model, device=device, dtype=dtype, generator=generator).requires_grad_()
        for _ in range(n_sources)
    ]
    query = (torch.randn(d_model, device=device, generator=generator) / d_model**0.5).requires_grad_()
    gain = (1 + 0.1 * torch.randn(d_model, device=device, generator=generator)).requires_grad_()
    grad_output = torch.randn(tokens, d_model, device=device, dtype=dtype, generator=generator)
    return sources, query, gain, grad_output


def forward_backward(variant, sources, query, gain, grad_output):
    h = variant(sources, query, gain)
    grads = torch.autograd.grad(h, [*sources, query, gain], grad_output)
    return h, grads


def cuda_time_ms(fn, reps: int, warmup: int) -> float:
    """Median wall time of ``fn`` on the GPU, in ms, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(reps: int) -> float:
    """Device-to-device copy bandwidth (read + write) of a 2 GiB buffer."""
    source = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    ms = cuda_time_ms(lambda: target.copy_(source), reps, warmup=3)
    return 2 * source.numel() * source.element_size() / ms / 1e6


def block_inputs(tokens: int, d_model: int, n_completed: int, n_queries: int, dtype: torch.dtype, device: str):
    """A block's completed sources, one partial sum per sublayer, and its queries and gains."""
    generator = torch.Generator(device=device).manual_seed(1)

    def tensor(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, device=device, generator=generator)).requires_grad_()

    completed = [tensor(tokens, d_model).to(dtype).detach().requires_grad_() for _ in range(n_completed)]
    partials = [tensor(tokens, d_model).to(dtype).detach().requires_grad_() for _ in range(n_queries)]
    return (
        completed,
        partials,
        tensor(n_queries, d_model, scale=d_model**-0.5),
        tensor(n_queries, d_model, scale=0.1, offset=1.0),
    )


def block_forward(two_phase: bool, completed, partials, queries, gains) -> list[torch.Tensor]:
    """Every sublayer input of one block: sublayer 0 starts it (no partial), sublayer i > 0 adds ``partials[i]``."""
    if two_phase:
        stats = block_phase1(completed, queries, gains, backend="triton")
        return [merge_partial(stats, i, partials[i] if i else None) for i in range(len(partials))]
    return [
        depth_attention([*completed, partials[i]] if i else completed, queries[i], gains[i], backend="triton")
        for i in range(len(partials))
    ]


def block_forward_backward(two_phase: bool, completed, partials, queries, gains):
    outputs = block_forward(two_phase, completed, partials, queries, gains)
    loss = sum((output.float() * (i + 1)).sum() for i, output in enumerate(outputs))
    return outputs, torch.autograd.grad(loss, [*completed, *partials[1:], queries, gains])


def two_phase_dry_run() -> list[str]:
    """Two-phase against single-pass on tiny blocks (interpreter): outputs and gradients must agree."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        "",
        "| tokens | d_model | completed | S | max abs err h | max abs err grads | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for tokens, d_model, n_completed, n_queries in [(37, 24, 2, 2), (50, 40, 4, 4)]:
        inputs = block_inputs(tokens, d_model, n_completed, n_queries, torch.float32, device)
        single_h, single_grads = block_forward_backward(False, *inputs)
        two_h, two_grads = block_forward_backward(True, *inputs)
        h_err = max((a - b).abs().max().item() for a, b in zip(two_h, single_h))
        grad_err = max((a - b).abs().max().item() for a, b in zip(two_grads, single_grads))
        status = "ok" if h_err < 1e-4 and grad_err < 1e-3 else "MISMATCH"
        lines.append(
            f"| {tokens} | {d_model} | {n_completed} | {n_queries} | {h_err:.2e} | {grad_err:.2e} | {status} |"
        )
        if status != "ok":
            raise AssertionError("\n".join(lines))
    return lines


def two_phase_timed(args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        "Two-phase Block AttnRes vs S single-pass calls (triton, bf16, forward+backward of one block):",
        "",
        "| tokens | d_model | completed | S | single-pass ms | two-phase ms | two-phase speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for tokens in args.tokens:
        for d_model in args.d_model:
            for n_completed in (4, 8, 16):
                for n_queries in args.block_sizes:
                    try:
                        inputs = block_inputs(tokens, d_model, n_completed, n_queries, torch.bfloat16, "cuda")
                        single = cuda_time_ms(lambda: block_forward_backward(False, *inputs), args.reps, args.warmup)
                        two = cuda_time_ms(lambda: block_forward_backward(True, *inputs), args.reps, args.warmup)
                    except torch.cuda.OutOfMemoryError:
                        lines.append(f"| {tokens} | {d_model} | {n_completed} | {n_queries} | out of memory | | |")
                        continue
                    finally:
                        inputs = None
                        torch.cuda.empty_cache()
                    lines.append(
                        f"| {tokens} | {d_model} | {n_completed} | {n_queries} | {single:.3f} | {two:.3f} | {single / two:.2f}x |"
                    )
    return lines


def header(args: argparse.Namespace) -> list[str]:
    return [
        f"# Depth-attention kernels: {'dry run (CPU, TRITON_INTERPRET=1), no timings' if args.dry_run else 'GPU'}",
        "",
        f"* machine: {machine_info()}, triton {triton.__version__}",
        f"* command: `{' '.join(['python', 'analyses/bench_kernels_gpu.py', *args.argv])}`",
        f"* date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
    ]


def dry_run(args: argparse.Namespace) -> list[str]:
    """Tiny shapes on whatever device is present: every runnable variant against the fp64 reference."""
    lines = [
        "",
        "| tokens | d_model | sources | dtype | variant | max abs err h | max abs err grads | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for tokens, d_model, n_sources in [(37, 24, 1), (70, 40, 3)]:
        for dtype in (torch.float32, torch.bfloat16):
            sources, query, gain, grad_output = make_inputs(tokens, d_model, n_sources, dtype, device)
            exact = [t.detach().double().requires_grad_() for t in (*sources, query, gain)]
            exact_h, exact_grads = forward_backward(
                _reference_h, exact[:-2], exact[-2], exact[-1], grad_output.double()
            )
            for name in args.variants:
                variant = make_variant(name)
                row = f"| {tokens} | {d_model} | {n_sources} | {str(dtype)[6:]} | {name} |"
                if variant is None:
                    lines.append(f"{row} | | skipped (needs CUDA or fla) |")
                    continue
                h, grads = forward_backward(variant, sources, query, gain, grad_output)
                h_err = (h.double() - exact_h).abs().max().item()
                grad_err = max((g.double() - e).abs().max().item() for g, e in zip(grads, exact_grads))
                limit = 1e-4 if dtype == torch.float32 else 0.25
                status = "ok" if h_err < limit and grad_err < limit * 10 else "MISMATCH"
                lines.append(f"{row} {h_err:.2e} | {grad_err:.2e} | {status} |")
                if status != "ok":
                    raise AssertionError("\n".join(lines))
    return lines


def measure(variant, sources, query, gain, grad_output, baseline_h, args) -> dict | str:
    """Times of one variant at one shape, or the reason it could not run."""
    if variant is None:
        return "skipped (fla not installed)"
    try:
        err = (variant(sources, query, gain).float() - baseline_h.float()).abs().max().item()
        forward_ms = cuda_time_ms(lambda: variant(sources, query, gain), args.reps, args.warmup)
        total_ms = cuda_time_ms(
            lambda: forward_backward(variant, sources, query, gain, grad_output), args.reps, args.warmup
        )
    except torch.cuda.OutOfMemoryError:
        return "out of memory"
    finally:
        torch.cuda.empty_cache()
    return {"forward_ms": forward_ms, "total_ms": total_ms, "err": err}


def timed_run(args: argparse.Namespace) -> list[str]:
    copy_gbs = copy_bandwidth_gbs(args.reps)
    lines = [
        f"* device-to-device copy: {copy_gbs:.0f} GB/s; bytes per docs/kernels.md §8: fwd (S+1)·N·D·2, bwd (2S+2)·N·D·2",
        f"* median of {args.reps} reps after {args.warmup} warm-up calls; err = max |h - h(torch backend)|",
        "",
        "| tokens | d_model | sources | variant | fwd ms | fwd+bwd ms | fwd GB/s | bwd GB/s "
        "| fwd+bwd % of copy | speed-up vs fla | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    variants = {name: make_variant(name) for name in args.variants}
    for tokens in args.tokens:
        for d_model in args.d_model:
            for n_sources in args.sources:
                tensor_bytes = tokens * d_model * 2  # bf16
                forward_bytes = (n_sources + 1) * tensor_bytes
                backward_bytes = (2 * n_sources + 2) * tensor_bytes
                sources, query, gain, grad_output = make_inputs(tokens, d_model, n_sources, torch.bfloat16, "cuda")
                with torch.no_grad():
                    baseline_h = depth_attention(sources, query, gain, backend="torch")
                results = {
                    name: measure(variant, sources, query, gain, grad_output, baseline_h, args)
                    for name, variant in variants.items()
                }
                fla = results.get("fla")
                for name, result in results.items():
                    row = f"| {tokens} | {d_model} | {n_sources} | {name} |"
                    if isinstance(result, str):
                        lines.append(f"{row} {result} | | | | | | |")
                        continue
                    forward_ms, total_ms = result["forward_ms"], result["total_ms"]
                    backward_ms = max(total_ms - forward_ms, 1e-9)
                    total_gbs = (forward_bytes + backward_bytes) / total_ms / 1e6
                    speedup = f"{fla['total_ms'] / total_ms:.2f}x" if isinstance(fla, dict) else ""
                    lines.append(
                        f"{row} {forward_ms:.3f} | {total_ms:.3f} | {forward_bytes / forward_ms / 1e6:.0f} | "
                        f"{backward_bytes / backward_ms / 1e6:.0f} | {100 * total_gbs / copy_gbs:.0f}% | "
                        f"{speedup} | {result['err']:.1e} |"
                    )
                del sources, query, gain, grad_output, baseline_h
                torch.cuda.empty_cache()
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        return [int(item) for item in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU interpreter; correctness only")
    parser.add_argument("--tokens", type=int_list, default=[8192, 65536])
    parser.add_argument("--d-model", type=int_list, default=[1024, 4096])
    parser.add_argument("--sources", type=int_list, default=[3, 9, 17])
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS))
    parser.add_argument("--block-sizes", type=int_list, default=[2, 4, 8], help="S of the two-phase table")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.variants:
        if name not in VARIANTS:
            parser.error(f"--variants: {name!r} is not one of {VARIANTS}")
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("timings need a CUDA GPU; use --dry-run for the CPU correctness check")
    if args.dry_run:
        lines = header(args) + dry_run(args) + two_phase_dry_run()
    else:
        lines = header(args) + timed_run(args) + two_phase_timed(args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
