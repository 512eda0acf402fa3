"""Eager vs torch.compile (inductor, fullgraph) training step on the CPU, per model variant (issue 15).

One process; per variant the eager and the compiled model (same weights, same batch) step interleaved, and the
report gives medians, the compiled/eager ratio, each compiled step's ratio to the eager standard step, and how
long compiling took (the first compiled step). A step: zero grads, forward, loss, backward, AdamW update; the
loss function is what is compiled (`fullgraph=True`, so a graph break fails the run), the optimiser runs eagerly.

    python -m analyses.benchmarks bench_compile
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from analyses.common import BENCH_VOCAB, model_dims_and_tokens
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


TINY = dict(n_layers=1, d_model=32, n_heads=4, n_ctx=16, batch=2)


def measure(
    repeats: int = 20,
    threads: int = 1,
    backend: str = "inductor",
    names: Sequence[str] = tuple(VARIANTS),
    shape: dict | None = None,
) -> list[dict]:
    """Rows per variant (the standard one always, first): eager and compiled step medians over `repeats`
    interleaved steps, compiled / eager, compiled × the eager standard step, and the first compiled step's seconds."""
    torch.set_num_threads(threads)
    shape = shape or SHAPE
    names = ["standard", *(name for name in names if name != "standard")]
    steppers, compile_seconds = {}, {}
    for name in names:
        torch._dynamo.reset()
        eager, compiled, seconds = build(VARIANTS[name], shape, backend)
        steppers[name], compile_seconds[name] = (eager, compiled), seconds
        print(f"{name}: compiled in {seconds:.0f} s", file=sys.stderr)
    for eager, compiled in steppers.values():  # warm-up
        for _ in range(3):
            eager.step(), compiled.step()
    times = {name: ([], []) for name in steppers}
    for _ in range(repeats):
        for name, (eager, compiled) in steppers.items():
            times[name][0].append(eager.step())
            times[name][1].append(compiled.step())
    medians = {name: (statistics.median(e), statistics.median(c)) for name, (e, c) in times.items()}
    base = medians["standard"][0]
    described = (
        f"{shape['n_layers']} layers, d_model {shape['d_model']}, n_ctx {shape['n_ctx']}, batch "
        f"{shape['batch']}, backend {backend}"
    )
    rows = []
    for name, (eager, compiled) in medians.items():
        common = dict(shape=described, variant=name, threads=threads)
        rows += [
            dict(common, metric="eager step", value=1e3 * eager, unit="ms"),
            dict(common, metric="compiled step", value=1e3 * compiled, unit="ms"),
            dict(common, metric="compiled / eager", value=compiled / eager, unit="× eager"),
            dict(common, metric="eager step ratio", value=eager / base, unit="× standard"),
            dict(common, metric="compiled step ratio", value=compiled / base, unit="× eager standard"),
            dict(common, metric="first compiled step", value=compile_seconds[name], unit="s"),
        ]
    return rows


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """Eager vs torch.compile (inductor, fullgraph) CPU training step per variant, 4 layers, d_model 128."""
    if tiny:  # aot_eager: the graph capture without inductor's minutes of C++ code generation
        return measure(repeats or 2, backend="aot_eager", names=["standard", "full [cpu kernel]"], shape=TINY)
    return measure(repeats or 20)
