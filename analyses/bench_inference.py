"""Forward-only (inference) latency on the CPU relative to the standard model, without hooks and with a no-op hook
on every depth-weight point (what reading α costs without a gradient: the hooks fire on the C kernel's weights,
then a second C pass mixes the sources as the hooks left them) (issue 15).

One process, one torch thread, freed memory kept for reuse as the commands run (`cpu_settings`), models built up
front and run interleaved under `torch.no_grad()`, medians over repeats; the shapes of `bench_cpu_step` and a wide
one (d_model 1024), where the depth mix, O(sources · d_model) a token, weighs less against the O(d_model²) matmuls.
Each shape's forward excess over the standard model is then split, from every C kernel call of a few forward
passes timed and its bytes counted (`kernel_traffic`), into the C kernels' time beyond the standard model's and
the rest (Python, dispatch and caches around the calls). A second table times the same forward passes with the
token attention's C kernel (what runs without a gradient) against PyTorch's `scaled_dot_product_attention` (what
runs with one), interleaved, also at the shape of `prune`'s 12-layer model (docs/kernels.md §2).

    python -m analyses.benchmarks bench_inference
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from analyses.bench_cpu_step import SHAPES
from analyses.common import BENCH_VOCAB, model_dims_and_tokens, within_rounds
from analyses.kernel_traffic import DEPTH_MIX_KERNELS, copy_bandwidth, counted_calls
from attnres_lens import HookedTransformer, ModelConfig
from attnres_lens.kernels import layer_ops
from attnres_lens.kernels.backends import attention_runs_cpu_kernel
from attnres_lens.kernels.cpu_attention import causal_attention_cpu

VARIANTS = {
    "standard": dict(residual="standard"),
    "standard+kv_shift": dict(residual="standard", attention="kv_shift"),
    "full": dict(residual="attnres", attnres_block_size=1),
    "block2": dict(residual="attnres", attnres_block_size=2),
    "block4": dict(residual="attnres", attnres_block_size=4),
}


def record_weights(model: HookedTransformer) -> None:
    """A no-op forward hook on every depth-weight point, left on (as a recorder's would be)."""
    for name, point in model.hook_dict.items():
        if name.endswith("hook_weights"):
            point.add_hook(lambda weights, hook: None)


# bench_cpu_step's training shapes, and a wide one nearer the widths the AttnRes paper's < 2% is measured at
INFERENCE_SHAPES = {**SHAPES, "wide": dict(n_layers=4, d_model=1024, n_heads=16, n_ctx=128, batch=2)}
TRAFFIC_ROUNDS = 10  # interleaved rounds of one forward pass per variant with every C kernel call timed


def excess_rows(
    shape_name: str,
    models: dict[str, HookedTransformer],
    tokens: torch.Tensor,
    ratios: dict[str, float],
    standard_ms: float,
) -> list[dict]:
    """Each variant's forward excess over the standard model's (`ratios`, of `standard_ms`) split into its C kernels'
    time beyond the standard's (the median over interleaved rounds of the difference within the round) and the
    rest, with the depth mix's time (median), bytes and bandwidth per forward pass."""
    kernel_ms = {name: [] for name in models}
    mix_ms = {name: [] for name in models}
    mix_bytes = {}
    with torch.no_grad():
        for _ in range(TRAFFIC_ROUNDS):
            for name, model in models.items():
                counting = counted_calls(lambda: model(tokens))
                kernel_ms[name].append(1e3 * sum(seconds for _, seconds, _ in counting.totals.values()))
                _, seconds, mix_bytes[name] = counting.summed(DEPTH_MIX_KERNELS)
                mix_ms[name].append(1e3 * seconds)
    rows = []
    for name in models:
        if name == "standard":
            continue
        excess = (ratios[name] - 1) * standard_ms
        kernels = within_rounds(kernel_ms[name], kernel_ms["standard"], "difference")
        common = dict(shape=shape_name, variant=name, threads=1)
        rows += [
            dict(common, metric="forward excess", value=excess, unit="ms"),
            dict(common, metric="C kernels' excess", value=kernels, unit="ms"),
            dict(common, metric="the rest of the excess", value=excess - kernels, unit="ms"),
            dict(common, metric="kernels alone", value=1 + kernels / standard_ms, unit="× standard"),
        ]
        if mix_bytes[name]:
            mix = statistics.median(mix_ms[name])
            rows += [
                dict(common, metric="depth mix time", value=mix, unit="ms"),
                dict(common, metric="depth mix bytes", value=mix_bytes[name] / 1e6, unit="MB"),
                dict(common, metric="depth mix bandwidth", value=mix_bytes[name] / mix / 1e6, unit="GB/s"),
            ]
    return rows


# the 12-layer depth-full preset's model and `prune --samples 32`'s batch (sequences of 65 tokens)
PRUNE_SHAPE = dict(n_layers=12, d_model=64, n_heads=4, d_mlp=128, n_ctx=65, batch=32)


@contextlib.contextmanager
def attention_kernel(enabled: bool) -> Iterator[None]:
    """The token attention as shipped (its C kernel where the policy picks it) or, with `enabled` false, on PyTorch's
    SDPA everywhere."""
    shipped = layer_ops.attention_runs_cpu_kernel
    if not enabled:
        layer_ops.attention_runs_cpu_kernel = lambda *args: False
    try:
        yield
    finally:
        layer_ops.attention_runs_cpu_kernel = shipped


def attention_rows(shapes: dict[str, dict], repeats: int) -> list[dict]:
    rows = []
    for shape_name, shape in shapes.items():
        shape, tokens = model_dims_and_tokens(shape)
        for name in ("standard", "full"):
            model = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **VARIANTS[name]))
            times: dict[bool, list[float]] = {True: [], False: []}
            with torch.no_grad():
                for _ in range(repeats + 2):  # two warm-up rounds
                    for enabled in times:
                        with attention_kernel(enabled):
                            start = time.perf_counter()
                            model(tokens)
                            times[enabled].append(time.perf_counter() - start)
            kernel, sdpa = times[True][2:], times[False][2:]
            rows.append(
                dict(
                    metric="forward with the attention kernel",
                    shape=shape_name,
                    variant=name,
                    threads=1,
                    value=within_rounds(kernel, sdpa),
                    unit="× SDPA",
                )
            )
    return rows


# (batch, pos, heads, d_head) of the op alone: prune's stacked pass, the small and medium training shapes, and
# longer heads, on both sides of backends.MAX_CPU_ATTENTION_KEYS (pos x d_head)
ATTENTION_OP_SHAPES = [
    (64, 65, 4, 16),
    (12, 64, 4, 32),
    (8, 128, 8, 32),
    (2, 256, 4, 64),
    (1, 512, 4, 64),
    (1, 1024, 4, 64),
    (1, 512, 8, 128),
]


def attention_op_rows(shapes: list[tuple[int, int, int, int]], repeats: int) -> list[dict]:
    """The causal attention op alone (no gradient): `cpu_attention.causal_attention_cpu` against PyTorch's SDPA on the
    same tensors, interleaved, whatever `attention_runs_cpu_kernel` would choose."""
    rows = []
    for shape in shapes:
        generator = torch.Generator().manual_seed(sum(shape))
        q, k, v = (torch.randn(*shape, generator=generator) for _ in range(3))
        scale = shape[-1] ** -0.5
        functions = {
            "kernel": lambda: causal_attention_cpu(q, k, v, scale),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in functions}
        for _ in range(repeats + 2):  # two warm-up rounds
            for name, function in functions.items():
                start = time.perf_counter()
                function()
                times[name].append(time.perf_counter() - start)
        kernel, sdpa = times["kernel"][2:], times["sdpa"][2:]
        runs = "C kernel" if attention_runs_cpu_kernel("cpu", q, k, v) else "SDPA"
        rows.append(
            dict(
                metric="attention op, C kernel",
                shape=f"{' x '.join(map(str, shape))} (pos × d_head {shape[1] * shape[3]})",
                variant=f"policy runs {runs}",
                threads=1,
                value=within_rounds(kernel, sdpa),
                unit="× SDPA",
            )
        )
    return rows


TINY = dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)
TINY_OPS = [(2, 8, 2, 4), (1, 600, 1, 32)]  # one shape on each side of MAX_CPU_ATTENTION_KEYS


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """Forward-only latency to the standard model (small, medium, wide), hooked and not; excess split; C attention."""
    shapes = {"tiny": TINY} if tiny else INFERENCE_SHAPES
    repeats = repeats or (2 if tiny else 30)
    torch.set_num_threads(1)
    rows = [
        dict(
            metric="copy bandwidth", shape="copy_ of 256 MB", variant="", threads=1, value=copy_bandwidth(), unit="GB/s"
        )
    ]
    for shape_name, shape in shapes.items():
        shape, tokens = model_dims_and_tokens(shape)
        models = {}
        for name, overrides in VARIANTS.items():
            plain = HookedTransformer(ModelConfig(d_vocab=BENCH_VOCAB, seed=0, **shape, **overrides))
            hooked = HookedTransformer(plain.cfg)
            hooked.load_state_dict(plain.state_dict())
            record_weights(hooked)
            models[name] = (plain, hooked)
        times = {(name, kind): [] for name in models for kind in (0, 1)}
        with torch.no_grad():
            for pair in models.values():
                for model in pair:
                    model(tokens), model(tokens)
            for _ in range(repeats):
                for name, pair in models.items():
                    for kind, model in enumerate(pair):
                        start = time.perf_counter()
                        model(tokens)
                        times[(name, kind)].append(time.perf_counter() - start)
        base = times[("standard", 0)]
        ratios = {name: within_rounds(times[(name, 0)], base) for name in models}
        for name in models:
            common = dict(shape=shape_name, variant=name, threads=1)
            rows += [
                dict(common, metric="forward ratio", value=ratios[name], unit="× standard"),
                dict(common, metric="forward time", value=1e3 * statistics.median(times[(name, 0)]), unit="ms"),
            ]
            if not name.startswith("standard"):  # the hooks watch depth weights: none in a standard model
                rows.append(
                    dict(
                        common,
                        metric="hooked forward ratio",
                        value=within_rounds(times[(name, 1)], base),
                        unit="× standard",
                    )
                )
        rows += excess_rows(
            shape_name, {name: pair[0] for name, pair in models.items()}, tokens, ratios, 1e3 * statistics.median(base)
        )
    # the wide shape's heads (128 x 64) run SDPA either way
    attention_shapes = ({"tiny": TINY} if tiny else {name: SHAPES[name] for name in SHAPES}) | {
        "prune": TINY if tiny else PRUNE_SHAPE
    }
    rows += attention_rows(attention_shapes, repeats)
    rows += attention_op_rows(TINY_OPS if tiny else ATTENTION_OP_SHAPES, repeats)
    return rows
