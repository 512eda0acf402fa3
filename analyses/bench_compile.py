"""Eager vs torch.compile (inductor, fullgraph) training step on the CPU, per model variant (issue 15).

One process; per variant the eager and the compiled model (same weights, same batch) step interleaved, and the
report gives medians, the compiled/eager ratio, each compiled step's ratio to the eager standard step, and how
long compiling took (the first compiled step). A step: zero grads, forward, loss, backward, AdamW update; the
loss function is what is compiled (`fullgraph=True`, so a graph break fails the run), the optimiser runs eagerly.

    python -m analyses.bench_compile --out analyses/reports/bench_compile.md
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from analyses.common import BENCH_VOCAB, command_line, emit_report, machine_info, model_dims_and_tokens
from attnres_lens import HookedTransformer, ModelConfig, adamw

SHAPE = dict(n_layers=4, d_model=128, n_heads=4, n_ctx=64, batch=12)
VARIANTS = {
    "standard": dict(residual="standard"),
    "standard+kv_shift": dict(residual="standard", attention="kv_shift"),
    "full [cpu kernel]": dict(residual="attnres", attnres_block_size=1),
    "full [reference]": dict(residual="attnres", attnres_block_size=1, depth_attention_backend="reference"),
    "block4 [cpu kernel]": dict(residual="attnres", attnres_block_size=4),
}


class Stepper:
    def __init__(self, model: HookedTransformer, tokens: torch.Tensor, loss_fn: Callable):
        self.model, self.tokens, self.loss_fn = model, tokens, loss_fn
        self.optimizer = adamw(model, 1e-4, 0.1)

    def step(self) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_fn(self.tokens).backward()
        self.optimizer.step()
        return time.perf_counter() - start


def build(overrides: dict, shape: dict, backend: str) -> tuple[Stepper, Stepper, float]:
    """(eager stepper, compiled stepper, seconds the first compiled step took)."""
    shape, tokens = model_dims_and_tokens(shape)
    eager = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **overrides))
    compiled_model = copy.deepcopy(eager)
    compiled_loss = torch.compile(lambda t: compiled_model(t, return_type="loss"), fullgraph=True, backend=backend)
    compiled = Stepper(compiled_model, tokens, compiled_loss)
    compile_seconds = compiled.step()
    return Stepper(eager, tokens, lambda t: eager(t, return_type="loss")), compiled, compile_seconds


def main(argv: Optional[Sequence[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager for a quick check)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help="a 1-layer d_model 32 model (a smoke test)")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = dict(n_layers=1, d_model=32, n_heads=4, n_ctx=16, batch=2) if args.tiny else SHAPE
    if "standard" not in args.variants:
        args.variants = ["standard", *args.variants]

    started = time.perf_counter()
    steppers, compile_seconds = {}, {}
    for name in args.variants:
        torch._dynamo.reset()
        eager, compiled, seconds = build(VARIANTS[name], shape, args.backend)
        steppers[name], compile_seconds[name] = (eager, compiled), seconds
        print(f"{name}: compiled in {seconds:.0f} s", file=sys.stderr)
    for eager, compiled in steppers.values():  # warm-up
        for _ in range(3):
            eager.step(), compiled.step()
    times = {name: ([], []) for name in steppers}
    for _ in range(args.repeats):
        for name, (eager, compiled) in steppers.items():
            times[name][0].append(eager.step())
            times[name][1].append(compiled.step())
    medians = {name: (statistics.median(e), statistics.median(c)) for name, (e, c) in times.items()}
    base = medians["standard"][0]

    lines = [
        "# Eager vs torch.compile training step (CPU)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} on {machine_info()}, "
        f"{args.threads} torch thread(s), backend `{args.backend}`, in {time.perf_counter() - started:.0f} s, by "
        f"`{command_line()}`. Shape: {shape['n_layers']} layers, d_model {shape['d_model']}, n_ctx "
        f"{shape['n_ctx']}, batch {shape['batch']}; medians of {args.repeats} interleaved steps (forward, backward, "
        "AdamW). Every variant compiled with `fullgraph=True`: no graph breaks.",
        "",
        "| variant | eager (ms) | compiled (ms) | compiled / eager | eager × standard | compiled × eager standard | "
        "first compiled step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (eager, compiled) in medians.items():
        lines.append(f"| {name} | {1e3 * eager:.1f} | {1e3 * compiled:.1f} | {compiled / eager:.3f} | "
                     f"{eager / base:.3f} | {compiled / base:.3f} | {compile_seconds[name]:.0f} |")
    emit_report("\n".join(lines) + "\n", args.out)
    return lines


if __name__ == "__main__":
    main()
