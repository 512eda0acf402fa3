"""Where a CPU training step's time goes: the fixed cost of every variant, then standard vs Block (S = 4) vs Full
AttnRes under the torch profiler.

The small shape of `bench_cpu_step.py` (4 layers, d_model 128, n_ctx 64, batch 12), the fused C
`cpu` depth-attention backend (what `auto` picks on a CPU), fused AdamW (what `train` runs).

* **Fixed cost.** Each variant is also stepped at 8 tokens (batch 1, n_ctx 8, same layers and widths), where the
  arithmetic is negligible: that step is the per-step cost of Python, dispatch, allocation and autograd
  bookkeeping, which no faster kernel removes. Both shapes are stepped interleaved in one process (medians; five
  8-token steps a round, their median), and each step is split into forward, backward and optimizer. A last row
  steps the standard model with PyTorch's per-tensor AdamW loop (its CPU default) instead of the fused optimizer
  `train` uses.
* **The C kernels inside the step, and the floor.** Every call of the C library (`kernels/cpu_*.c`) in a
  few training steps of each variant is timed and the bytes it must move counted from its arguments (sources,
  inputs and outputs once each), beside torch's copy bandwidth measured in the same process: a kernel at or above
  copy bandwidth moves its bytes as fast as this machine moves any. Each variant's excess over the standard step
  then splits into the fixed cost (the 8-token excess), the time its C kernels take beyond the standard model's
  (which runs C kernels too: RMSNorm and rotary) and the rest (other ops slowed by the extra bytes, and noise);
  fixed + kernels is what the step costs before anything else slows, the floor of this design (one eager
  autograd node per sublayer, each mix reading its sources once).
* **One mix, layer by layer** (the first thread count). Where a consumer's fixed cost goes: one Block (S = 4)
  consumer of three sources at 8 tokens through each layer of its fused path (`depth_execution.mix_and_norm`'s
  checks, the autograd.Function, the Python around the C call, the C call), forward and backward, beside the
  standard sublayer's pre-norm it replaces; times the consumers of a step, that is the 8-token excess above (the
  timing loop runs warm, where a step's Python objects are cold: a step pays more per layer than this table).
* **Profile** (one thread). The profiler adds per-op overhead, so its absolute times are inflated; read the shares
  and the depth-attention rows.

Each part runs at every torch thread count asked (default 1 and 2).

    python -m analyses.profile_cpu_step --out analyses/reports/profile_cpu_step.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from analyses.bench_cpu_step import SHAPES, TARGETS, Stepper, variants
from analyses.common import command_line, emit_report, provenance, within_rounds
from analyses.kernel_traffic import copy_bandwidth, counted_calls
from attnres_lens import HookedTransformer, ModelConfig, cpu_settings, depth_execution, param_groups
from attnres_lens.kernels import cpu_depth

PROFILED = ("standard", "block4", "full")
TINY_STEPS = 5  # 8-token steps per variant and round
LAYER_CALLS = 200  # calls per timed batch in `mix_layers` (a call is ~10-100 us: a batch is a few ms)
LOOPED_ADAMW = "standard, per-tensor AdamW"  # what `train` ran on the CPU before it used the fused optimizer


class Excess(NamedTuple):
    """A variant's small-shape step against the standard one's (ratio, ms beyond it) and its 8-token excess (ms)."""

    ratio: float
    small_ms: float
    fixed_ms: float


def fixed_costs(repeats: int) -> tuple[list[str], dict[str, Excess], float]:
    """The table of step times at the small shape and at 8 tokens, every variant, interleaved; each variant's
    `Excess`; the standard small step (ms)."""
    shapes = {"small": SHAPES["small"], "8 tokens": dict(SHAPES["small"], batch=1, n_ctx=8)}
    steppers = {
        (variant, shape): Stepper(dims, overrides, eager=False)
        for variant, overrides in variants("cpu").items()
        for shape, dims in shapes.items()
    }
    for shape, dims in shapes.items():  # the standard model under PyTorch's CPU default: a loop over tensors
        looped = steppers[(LOOPED_ADAMW, shape)] = Stepper(dims, variants("cpu")["standard"], eager=False)
        looped.optimizer = torch.optim.AdamW(param_groups(looped.model, 0.1), lr=1e-4, foreach=False)
    for stepper in steppers.values():
        for _ in range(3):
            stepper.step()
    samples = {key: [] for key in steppers}
    for _ in range(repeats):
        for key, stepper in steppers.items():
            # an 8-token step is short enough that one per round leaves its excess noisy (+-0.3 ms between runs):
            # the median of several (each with its phases) per round
            steps = [(stepper.step(), *stepper.phases) for _ in range(TINY_STEPS if key[1] == "8 tokens" else 1)]
            samples[key].append(tuple(statistics.median(column) for column in zip(*steps)))

    def median_ms(values) -> float:
        return 1000 * statistics.median(values)

    def versus_standard(key: tuple[str, str]) -> tuple[float, float]:
        """(ratio, excess in ms) to the standard step, within rounds (as bench_cpu_step)."""
        steps, base = [row[0] for row in samples[key]], [row[0] for row in samples[("standard", key[1])]]
        return within_rounds(steps, base), 1000 * within_rounds(steps, base, "difference")

    lines = [
        "| variant | small step (ms) | × standard | + standard (ms) | 8-token step (ms) | + standard (ms) | "
        "8 tokens: forward / backward / optimizer (ms) | fixed share of the overhead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    excess = {}
    for variant in [*variants("cpu"), LOOPED_ADAMW]:
        small, tiny = samples[(variant, "small")], samples[(variant, "8 tokens")]
        ratio, extra_small = versus_standard((variant, "small"))
        _, extra_tiny = versus_standard((variant, "8 tokens"))
        excess[variant] = Excess(ratio, extra_small, extra_tiny)
        share = f"{extra_tiny / extra_small:.0%}" if extra_small > 0.5 else "(no overhead)"
        phases = " / ".join(f"{median_ms(column):.1f}" for column in list(zip(*tiny))[1:])
        lines.append(
            f"| {variant} | {median_ms(row[0] for row in small):.1f} | {ratio:.3f} | {extra_small:+.1f} | "
            f"{median_ms(row[0] for row in tiny):.1f} | {extra_tiny:+.1f} | {phases} | {share} |"
        )
    return lines, excess, median_ms(row[0] for row in samples[("standard", "small")])


def kernel_traffic(steps: int) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per variant, each C kernel's (calls, seconds, bytes) per step at the small shape, call by call over `steps`
    training steps after 3 warm-up steps (fp32 models: the float library)."""
    traffic = {}
    for variant, overrides in variants("cpu").items():
        stepper = Stepper(SHAPES["small"], overrides, eager=False)
        for _ in range(3):
            stepper.step()
        counting = counted_calls(lambda: [stepper.step() for _ in range(steps)])
        traffic[variant] = {
            name: tuple(value / steps for value in total) for name, total in sorted(counting.totals.items())
        }
    return traffic


def floor_sections(excess: dict[str, Excess], standard_ms: float, steps: int) -> list[str]:
    """The C kernels' time, bytes and bandwidth inside the step, and each variant's excess split into fixed cost,
    kernels and the rest, at the current torch thread count."""
    bandwidth = copy_bandwidth()
    traffic = kernel_traffic(steps)
    kernel_lines = [
        "| variant | C kernel | calls per step | ms per step | MB per step | GB/s | × copy bandwidth |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, kernels in traffic.items():
        for name, (calls, seconds, nbytes) in kernels.items():
            rate = nbytes / seconds / 1e9
            kernel_lines.append(
                f"| {variant} | {name} | {calls:.0f} | {1e3 * seconds:.3f} | {nbytes / 1e6:.2f} | "
                f"{rate:.1f} | {rate / bandwidth:.2f} |"
            )
    kernel_ms = {
        variant: 1e3 * sum(seconds for _, seconds, _ in kernels.values()) for variant, kernels in traffic.items()
    }
    floor_lines = [
        "| variant | × standard | + standard (ms) | fixed: 8-token excess (ms) | C kernels beyond the "
        "standard's (ms) | the rest (ms) | fixed + kernels, × standard | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in traffic:
        if variant == "standard":
            continue
        measured, kernels = excess[variant], kernel_ms[variant] - kernel_ms["standard"]
        floor = 1 + (measured.fixed_ms + kernels) / standard_ms
        target = TARGETS.get(variant)
        verdict = "" if target is None else f"≤ {target:.2f}: floor {'below' if floor <= target else 'ABOVE'}"
        floor_lines.append(
            f"| {variant} | {measured.ratio:.3f} | {measured.small_ms:+.2f} | "
            f"{measured.fixed_ms:+.2f} | {kernels:+.2f} | "
            f"{measured.small_ms - measured.fixed_ms - kernels:+.2f} | {floor:.3f} | "
            f"{verdict} |"
        )
    return [
        f"Copy bandwidth (torch `copy_` of 256 MB, read + write, at this thread count): **{bandwidth:.1f} GB/s**.",
        "",
        *kernel_lines,
        "",
        *floor_lines,
    ]


class _TimedCalls:
    """Callables timed interleaved: each round times a batch of `LAYER_CALLS` calls of each; `us(name)` is the
    median over rounds of the time per call."""

    def __init__(self, calls: dict[str, Callable[[], object]]):
        self.calls, self.samples = calls, {name: [] for name in calls}

    def run(self, rounds: int) -> _TimedCalls:
        for call in self.calls.values():  # warm-up: first-call dispatch, allocator
            for _ in range(LAYER_CALLS // 4):
                call()
        for _ in range(rounds):
            for name, call in self.calls.items():
                start = time.perf_counter()
                for _ in range(LAYER_CALLS):
                    call()
                self.samples[name].append((time.perf_counter() - start) / LAYER_CALLS)
        return self

    def us(self, name: str) -> float:
        return 1e6 * statistics.median(self.samples[name])


def c_call_us(call: Callable[[], object]) -> dict[str, float]:
    """Microseconds per call of each C kernel that `call` runs (ctypes' argument conversion included), over
    `LAYER_CALLS` calls of it."""
    counting = counted_calls(lambda: [call() for _ in range(LAYER_CALLS)])
    return {name: 1e6 * seconds / calls for name, (calls, seconds, _) in counting.totals.items()}


def mix_layers(rounds: int) -> list[str]:
    """One Block (S = 4) consumer's mix of three sources at 8 tokens and the small shape's width (three: the most
    any consumer of the small Block S = 4 model reads, 2.3 on average) through each layer of its fused path, forward and
    backward, beside the standard model's pre-norm that the fused mix replaces (the standard sublayer's residual
    add has its AttnRes counterpart, the partial sum's, and is left out of both). Inputs are leaves that need a
    gradient; each backward is seeded with a fixed gradient of the output, after the leaves' and parameters'
    gradients are reset to None (as `zero_grad(set_to_none=True)` leaves them in a step)."""
    dims = dict(SHAPES["small"], n_ctx=8)
    dims.pop("batch")
    generator = torch.Generator().manual_seed(0)

    def leaf() -> torch.Tensor:
        return torch.randn(1, dims["n_ctx"], dims["d_model"], generator=generator).requires_grad_()

    standard = HookedTransformer(ModelConfig(d_vocab=256, seed=0, **dims, **variants("cpu")["standard"]))
    block = HookedTransformer(ModelConfig(d_vocab=256, seed=0, **dims, **variants("cpu")["block4"]))
    pre_norm, mixer, mix_norm = standard.blocks[0].ln1, block.blocks[0].attn_res, block.blocks[0].ln1
    x, sources, grad_out = leaf(), [leaf() for _ in range(3)], leaf().detach()
    query, gain, norm_weight = mixer.query, mixer.key_norm.w, mix_norm.w
    eps, norm_eps = mixer.key_norm.eps, mix_norm.eps

    def mix() -> torch.Tensor:
        return depth_execution.mix_and_norm(mixer, sources, mix_norm, keep_h=False)[1]

    def backward(output: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        for tensor in leaves:
            tensor.grad = None
        output.backward(grad_out)

    norm_leaves, mix_leaves = [x, pre_norm.w], [*sources, query, gain, norm_weight]

    with torch.no_grad():  # the kernel's own inputs and saved statistics, as the autograd.Function passes them
        plain = [source.detach() for source in sources]
        factors = (query.detach(), gain.detach())
        h, stats, y, norm_rstd = cpu_depth._run_forward(
            plain, factors[0], None, eps, norm_weight, norm_eps, False, factors[1]
        )
        saved_norm = (h, norm_weight.detach(), norm_rstd, grad_out)

    def run_forward():
        with torch.no_grad():
            return cpu_depth._run_forward(plain, factors[0], None, eps, norm_weight, norm_eps, False, factors[1])

    def run_backward():
        with torch.no_grad():
            return cpu_depth._run_backward(plain, None, stats, None, None, saved_norm, factors)

    timed = _TimedCalls(
        {
            "norm": lambda: pre_norm(x),
            "norm+backward": lambda: backward(pre_norm(x), norm_leaves),
            "mix": mix,
            "mix+backward": lambda: backward(mix(), mix_leaves),
            "function": lambda: cpu_depth.fused_mix_and_norm(sources, query, gain, eps, norm_weight, norm_eps, False),
            "run_forward": run_forward,
            "run_backward": run_backward,
        }
    ).run(rounds)
    kernel = {**c_call_us(lambda: backward(pre_norm(x), norm_leaves)), **c_call_us(lambda: backward(mix(), mix_leaves))}
    if set(kernel) != {"rms_norm_forward", "rms_norm_backward", "depth_attention_forward", "depth_attention_backward"}:
        raise RuntimeError(
            f"the pre-norm and the mix ran the C kernels {sorted(kernel)}, not one norm and one fused "
            "mix each way: the paths measured here have changed"
        )
    norm_fw, mix_fw = timed.us("norm"), timed.us("mix")
    norm_bw, mix_bw = timed.us("norm+backward") - norm_fw, timed.us("mix+backward") - mix_fw
    rows = [
        (
            "forward: checks (`depth_execution.fused_with_norm`: hooks, dtypes, widths, backend)",
            None,
            mix_fw - timed.us("function"),
        ),
        (
            "forward: the autograd.Function (apply, saved tensors, shared-gradient lookup)",
            None,
            timed.us("function") - timed.us("run_forward"),
        ),
        (
            "forward: Python around the C call (output allocation, pointer arrays)",
            None,
            timed.us("run_forward") - kernel["depth_attention_forward"],
        ),
        (
            "forward: the C call (ctypes' argument conversion included)",
            kernel["rms_norm_forward"],
            kernel["depth_attention_forward"],
        ),
        ("forward, all", norm_fw, mix_fw),
        (
            "backward: autograd (the engine's node, saved tensors, parameter and input gradients)",
            None,
            mix_bw - timed.us("run_backward"),
        ),
        (
            "backward: Python around the C call (gradient buffers, pointer arrays)",
            None,
            timed.us("run_backward") - kernel["depth_attention_backward"],
        ),
        ("backward: the C call", kernel["rms_norm_backward"], kernel["depth_attention_backward"]),
        ("backward, all", norm_bw, mix_bw),
        ("forward + backward", norm_fw + norm_bw, mix_fw + mix_bw),
    ]
    lines = ["| layer | standard pre-norm (us) | Block consumer, 3 sources (us) |", "|---|---|---|"]
    for label, norm_us, mix_us in rows:
        norm_cell = "" if norm_us is None else f"{norm_us:.1f}"
        lines.append(f"| {label} | {norm_cell} | {mix_us:.1f} |")
    excess = mix_fw + mix_bw - norm_fw - norm_bw
    consumers = 2 * SHAPES["small"]["n_layers"] + 1
    return [
        *lines,
        "",
        f"Excess of one consumer over the pre-norm it replaces, forward + backward: **{excess:.1f} us**;"
        f" × {consumers} consumers (every sublayer's and the final readout's) ≈ {consumers * excess / 1000:.2f} "
        "ms per step, to hold against block4's 8-token excess in the fixed-cost table at this thread count "
        "(which also holds the optimizer's update of the depth parameters).",
    ]


def is_depth_op(key: str) -> bool:
    """Profiler events of the fused C depth kernel: its eager autograd.Functions (forward and backward, with the
    sublayer's pre-norm fused or not) or, when compiled, its custom ops (kernels/cpu_depth.py)."""
    return key.startswith(("_EagerDepthAttention", "_EagerNormedDepthAttention", "attnres_lens::depth_attention_cpu"))


def profile_section(name: str, steps: int) -> list[str]:
    stepper = Stepper(SHAPES["small"], variants("cpu")[name], eager=False)
    for _ in range(3):
        stepper.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            stepper.step()
    events = prof.key_averages()
    per_step = sum(event.self_cpu_time_total for event in events) / steps / 1000
    depth = {event.key: event.cpu_time_total / steps / 1000 for event in events if is_depth_op(event.key)}
    rows = [
        f"| {event.key} | {event.self_cpu_time_total / steps / 1000:.2f} | {event.count // steps} |"
        for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    ]
    depth_lines = [f"* {key}: {ms:.2f} ms per step (with children)" for key, ms in depth.items()]
    return [
        f"### {name}: {per_step:.1f} ms of profiled CPU time per step",
        "",
        *depth_lines,
        "",
        "| op | self ms per step | calls per step |",
        "|---|---|---|",
        *rows,
        "",
    ]


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="interleaved steps per variant and shape")
    parser.add_argument("--steps", type=int, default=20, help="profiled and kernel-timed steps per variant")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    previous = torch.get_num_threads()
    lines = [
        "# Where a CPU training step's time goes",
        "",
        f"Measured {provenance()}, by `{command_line()}`.",
        "",
    ]
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            fixed_lines, excess, standard_ms = fixed_costs(args.repeats)
            lines += [
                f"## {threads} torch thread{'s' if threads > 1 else ''}",
                "",
                "### Fixed cost per step",
                "",
                f"{args.repeats} interleaved rounds: each variant stepped at the small shape and at 8 tokens (batch 1, "
                "n_ctx 8, same layers and widths), where the arithmetic is negligible: the 8-token step is the cost "
                "of Python, dispatch, allocation and autograd bookkeeping per step (the median of "
                f"{TINY_STEPS} per round). Step times are medians; "
                "× standard and + standard the medians over rounds of the ratio and difference to the standard step "
                "of the same round. The last column is the 8-token excess as a share of the small-shape excess: the "
                "part of each variant's overhead that does not shrink with faster kernels or fewer bytes.",
                "",
                *fixed_lines,
                "",
                "### The C kernels inside the step, and the floor",
                "",
                f"Every C kernel call of {args.steps} small-shape training steps per variant, timed one by one, with "
                "the bytes it must move (sources, inputs and outputs once each). Then each variant's excess over the "
                "standard step (from the table above): the fixed cost, its C kernels' time beyond the standard "
                "model's (RMSNorm, rotary), and the rest; `fixed + kernels` is the step before anything else slows, "
                "with kernels at about copy bandwidth or above: the floor of this design, one eager autograd node per "
                "sublayer and each mix reading its sources once.",
                "",
                *floor_sections(excess, standard_ms, args.steps),
                "",
            ]
        torch.set_num_threads(args.threads[0])
        lines += [
            f"## One mix at 8 tokens, layer by layer, {args.threads[0]} torch thread"
            f"{'s' if args.threads[0] > 1 else ''}",
            "",
            f"Medians over {args.repeats} interleaved rounds of {LAYER_CALLS} calls each (us per call); a layer's "
            "time is the difference between two entry points of the path, the C call's is timed call by call. "
            "The C calls at 8 tokens are the kernels' fixed cost, not their arithmetic.",
            "",
            *mix_layers(args.repeats),
            "",
        ]
        lines += [
            f"## Profile at the small shape, {args.threads[0]} torch thread{'s' if args.threads[0] > 1 else ''}",
            "",
        ]
        for name in PROFILED:
            lines += profile_section(name, args.steps)
    finally:
        torch.set_num_threads(previous)
    emit_report("\n".join(lines), args.out)
    return lines


if __name__ == "__main__":
    cpu_settings.keep_freed_memory()  # as the `train` command runs (process-wide, so not in main: tests call it)
    main()
