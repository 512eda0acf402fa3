"""The transformers bridge's forward against transformers' own eager forward (issue 42 item 3: it should not be
slower), side by side in one process.

Two copies of one random Inkling-2 text model (same weights): transformers' own, and one opened through
`attnres_lens.from_transformers`, whose depth consumers run through the toolkit's depth op
(`kernels.depth_attention` with the logit scale, unweighted key norm, normalised values and q/k/v routes). Each
round times one forward of each (no gradient, then with a backward pass), interleaved, and the ratio is the median
over rounds of bridged / transformers in the same round (`common.within_rounds`). A third variant hooks every
consumer's depth weights (the readable path a hook sees), to show what watching the routing costs.

A second measure times what every exact analysis on a bridged model runs: `evaluate_many` over the removal of each
sublayer alone, its interventions stacked along the batch (the default) over one forward pass each
(`max_sequences` = the batch), interleaved in rounds that alternate which goes first; the largest difference between the two losses rides along.

    python -m analyses.benchmarks bench_bridge
"""

from __future__ import annotations

import copy
import time

import torch

from analyses.common import within_rounds

LAYER_TYPES = ("hybrid_sliding", "hybrid")
SMALL = dict(hidden_size=256, layers=8, heads=4, head_dim=64, experts=8, expert_width=256, seq=256, batch=2)
TINY = dict(hidden_size=32, layers=4, heads=2, head_dim=16, experts=4, expert_width=16, seq=16, batch=2)


def inkling_model(shape: dict) -> torch.nn.Module:
    from transformers import Inkling2ForCausalLM, Inkling2TextConfig

    torch.manual_seed(0)
    config = Inkling2TextConfig(
        vocab_size=512,
        unpadded_vocab_size=500,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["layers"],
        layer_types=[LAYER_TYPES[layer % 2] for layer in range(shape["layers"])],
        num_attention_heads=shape["heads"],
        num_key_value_heads=1,
        head_dim=shape["head_dim"],
        swa_num_attention_heads=shape["heads"],
        swa_num_key_value_heads=1,
        swa_head_dim=shape["head_dim"],
        sliding_window_size=64,
        d_rel=4,
        rel_extent=8,
        moe_intermediate_size=shape["expert_width"],
        n_routed_experts=shape["experts"],
        num_experts_per_tok=2,
        n_layers_per_attn_res_block=2,
        eos_token_id=None,
        use_cache=False,
    )
    model = Inkling2ForCausalLM(config).eval()
    with torch.no_grad():  # non-uniform routing, as a trained model has
        for name, parameter in model.named_parameters():
            if name.endswith(".query"):
                parameter.normal_(0.0, 1.0)
    return model


def measure(shape: dict, rounds: int) -> list[dict]:
    from attnres_lens import from_transformers

    reference = inkling_model(shape)
    bridge = from_transformers(copy.deepcopy(reference))
    tokens = torch.randint(0, 500, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    weights_hooks = [(bridge.depth_hook(c, "weights"), lambda value, hook: None) for c in bridge.consumers()]

    def transformers_forward():
        return reference(input_ids=tokens, use_cache=False).logits

    def bridged():
        return bridge(tokens)

    def hooked():
        return bridge.run_with_hooks(tokens, fwd_hooks=weights_hooks)

    runs = {"transformers eager": transformers_forward, "bridge": bridged, "bridge, depth weights hooked": hooked}
    rows = []
    for mode in ("no grad", "forward + backward"):
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(rounds + 1):  # one warm-up round
            for name, forward in runs.items():
                start = time.perf_counter()
                if mode == "no grad":
                    with torch.no_grad():
                        forward()
                else:
                    forward().float().square().mean().backward()
                if round_index:
                    times[name].append(time.perf_counter() - start)
        base = times["transformers eager"]
        shape_label = (
            f"Inkling-2, {shape['layers']} layers, hidden {shape['hidden_size']}, {shape['experts']} experts, "
            f"batch {shape['batch']} × {shape['seq']}, {mode}"
        )
        for name in runs:
            rows.append(
                dict(
                    metric="forward time" if name == "transformers eager" else "forward / transformers",
                    shape=shape_label,
                    variant=name,
                    threads=torch.get_num_threads(),
                    value=min(base) if name == "transformers eager" else within_rounds(times[name], base),
                    unit="s" if name == "transformers eager" else "× transformers",
                    target=1.0 if name == "bridge" else None,
                )
            )
    return rows


def measure_stacking(shape: dict, rounds: int) -> list[dict]:
    from attnres_lens import from_transformers
    from attnres_lens.analysis import evaluate_many, removal_hooks
    from attnres_lens.tasks.base import Batch, next_token_targets

    bridge = from_transformers(inkling_model(shape))
    tokens = torch.randint(0, 500, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0))
    targets = next_token_targets(tokens)
    batch = Batch(tokens, targets, targets != -100)
    removals = [removal_hooks(bridge, [j]) for j in range(bridge.n_sublayers)]
    runs = {"one pass each": dict(max_sequences=len(tokens)), "stacked": {}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {}
    for round_index in range(rounds + 1):  # one warm-up round
        order = list(runs.items()) if round_index % 2 else list(runs.items())[::-1]  # neither always goes first
        for name, options in order:
            start = time.perf_counter()
            losses[name] = [result.loss for result in evaluate_many(bridge, batch, removals, **options)]
            if round_index:
                times[name].append(time.perf_counter() - start)
    shape_label = (
        f"Inkling-2, {shape['layers']} layers, hidden {shape['hidden_size']}, {shape['experts']} experts, "
        f"batch {shape['batch']} × {shape['seq']}, {len(removals)} removals"
    )
    common = dict(shape=shape_label, threads=torch.get_num_threads())
    largest = max(abs(a - b) for a, b in zip(losses["stacked"], losses["one pass each"], strict=True))
    return [
        dict(
            metric="evaluate_many time", variant="one pass each", value=min(times["one pass each"]), unit="s", **common
        ),
        dict(
            metric="evaluate_many / one pass each",
            variant="stacked",
            value=within_rounds(times["stacked"], times["one pass each"]),
            unit="× one pass each",
            target=1.0,
            **common,
        ),
        dict(metric="max |Δloss| stacked vs one pass each", variant="stacked", value=largest, unit="nats", **common),
    ]


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """The bridged forward over transformers' own, unhooked and with every depth weight hooked; interventions
    stacked along the batch over one forward pass each."""
    shape, rounds = (TINY, repeats or 2) if tiny else (SMALL, repeats or 15)
    return measure(shape, rounds) + measure_stacking(shape, max(2, rounds // 3))
