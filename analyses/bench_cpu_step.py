"""CPU training-step time of AttnRes and KV-shift variants relative to the standard model (issue 3).

One process, every variant built up front, steps interleaved variant by variant (so machine noise hits
all of them alike), median over repeats. A step is forward + backward + AdamW update (`attnres_lens.adamw`, fused, as
`train` runs it) on random tokens.
Depth-attention paths compared:

* `eager`: the readable path of `attnres_lens/attnres.py` (what runs when a hook watches the weights);
* `reference`: `kernels.depth_attention(backend="reference")`, plain autograd;
* `torch`: plain-PyTorch fast path (gain folded into the query, rstd once per source, hand-written backward);
* `cpu`: the fused C kernels (`kernels/cpu_depth.c` and the other `cpu_*.c`), what `auto` picks on a CPU with a C compiler.
The standing benchmark measures the `cpu` path (what ships); the others stay for a by-hand comparison through `bench`.

    python -m analyses.benchmarks bench_cpu_step
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from analyses.common import BENCH_VOCAB, model_dims_and_tokens, within_rounds
from attnres_lens import HookedTransformer, ModelConfig, adamw

SHAPES = {
    "small": dict(n_layers=4, d_model=128, n_heads=4, n_ctx=64, batch=12),
    "medium": dict(n_layers=6, d_model=256, n_heads=8, n_ctx=128, batch=8),
}
# issue 15: Block (S = 2, 4) ≤ 1.05×, Full ≤ 1.10×, KV shift ≤ 1.03× the standard step
TARGETS = {"full": 1.10, "block2": 1.05, "block4": 1.05, "standard+kv_shift": 1.03}
# A second standard model, built last the same way: two identical models differ by where their tensors lie in
# memory, so its ratio (docs/results.md) is the noise floor of every ratio here.
SECOND_STANDARD = "standard (second instance)"


def variants(backend: str) -> dict[str, dict]:
    return {
        "standard": dict(residual="standard"),
        "standard+kv_shift": dict(residual="standard", attention="kv_shift"),
        "full": dict(residual="attnres", attnres_block_size=1, depth_attention_backend=backend),
        "block2": dict(residual="attnres", attnres_block_size=2, depth_attention_backend=backend),
        "block4": dict(residual="attnres", attnres_block_size=4, depth_attention_backend=backend),
    }


class Stepper:
    """One model + optimiser + fixed batch; `step()` times a full training step."""

    def __init__(self, shape: dict, overrides: dict, eager: bool):
        shape, self.tokens = model_dims_and_tokens(shape)
        self.model = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **overrides))
        self.optimizer = adamw(self.model, 1e-4, 0.1)
        if eager:  # a no-op hook on each depth-weight point makes the model take its readable path
            for name, hook in self.model.hook_dict.items():
                if name.endswith("hook_weights"):
                    hook.add_hook(lambda weights, hook: None)

    def step(self) -> float:
        """Seconds of one step; `phases` keeps its (forward, backward, optimizer) split."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.tokens, return_type="loss")
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        self.phases = (forward - start, backward - forward, end - backward)
        return end - start


def bench_times(shape: dict, threads: int, repeats: int, paths: list[str]) -> dict[str, list[float]]:
    """Seconds of each variant's steps (and the second standard model's) at `shape` (as in SHAPES), one per round,
    in `repeats` rounds of shuffled order after 3 warm-up steps each."""
    torch.set_num_threads(threads)
    steppers = {}
    for path in paths:
        backend = "reference" if path == "eager" else path
        for name, overrides in variants(backend).items():
            if name.startswith("standard") and path != paths[0]:
                continue  # standard models have no depth attention: built once
            label = name if name.startswith("standard") else f"{name} [{path}]"
            steppers[label] = Stepper(shape, overrides, eager=path == "eager")
    steppers[SECOND_STANDARD] = Stepper(shape, variants(paths[0])["standard"], eager=False)
    for stepper in steppers.values():  # warm-up: allocator, first-call dispatch
        for _ in range(3):
            stepper.step()
    times = {label: [] for label in steppers}
    order, shuffle = list(steppers), random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(order)  # no variant always steps after the same one
        for label in order:
            times[label].append(steppers[label].step())
    return times


def bench(shape_name: str, threads: int, repeats: int, paths: list[str], shape: dict | None = None) -> list[dict]:
    """One row per variant: median step (ms), ratio to the standard step within rounds, target; `shape` (default
    `SHAPES[shape_name]`) as in SHAPES."""
    times = bench_times(shape or SHAPES[shape_name], threads, repeats, paths)
    rows = []
    for label, samples in times.items():
        ratio = within_rounds(samples, times["standard"])
        name = label.split(" [")[0]
        rows.append(
            dict(
                shape=shape_name,
                threads=threads,
                variant=label,
                ms=1000 * statistics.median(samples),
                ratio=ratio,
                target=TARGETS.get(name),
            )
        )
    return rows


TINY = dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """CPU training-step ratios to the standard model, small and medium shapes, 1 and 2 threads (target per variant)."""
    shapes = {"tiny": TINY} if tiny else SHAPES
    rows = []
    for shape_name, shape in shapes.items():
        for threads in [1] if tiny else [1, 2]:
            for row in bench(shape_name, threads, repeats or (2 if tiny else 30), ["cpu"], shape):
                common = dict(shape=shape_name, variant=row["variant"], threads=threads)
                rows += [
                    dict(common, metric="step ratio", value=row["ratio"], unit="× standard", target=row["target"]),
                    dict(common, metric="step time", value=row["ms"], unit="ms"),
                ]
            print(f"done: {shape_name}, {threads} thread(s)", file=sys.stderr)
    return rows
