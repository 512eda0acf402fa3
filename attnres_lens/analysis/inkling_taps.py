"""Tap parts of transformers' Inkling-2 attention (docs/analysis.md §11), for `kv_shift.tap_parts` and
`conv_tap_decomposition`.

An Inkling-2 key (value) at position t is `n_t · (Σ_ℓ w^ℓ_t ⊙ x_{t−ℓ} + x_t) / c` with `x = linear(input)`: the
sliding-window layers' `Inkling2ShortConvolution` has static per-channel taps `w^ℓ` and `c = √(width + 1)`; the
full-attention layers' `Inkling2DynamicShortConvolution` has `w^ℓ_t = static^ℓ + dynamic^ℓ_t`, the dynamic part
projected from the token's input and shared by the channels of a key/value head, and `c = √(2·width + 1)`. The
identity residual `x_t` joins lag 0 (it is the current token). `n_t` is the per-(token, head) norm that follows:
an L2 clip for keys, an unweighted RMSNorm for values. Both multiply the whole vector by one scalar, so with that
scalar read off the model's own pass every tap gets the same factor and the split stays exact. Queries (an L2
clip with a learned scale, and on full-attention layers a position-dependent log scale) are taken as the module
computes them: they carry no convolution. There is no RoPE: positions enter the score through an additive
relative-position bias that depends on the query's input and the distance only, reported as the score's bias
term; the per-head attention sink is one more logit with a zero value, so the pattern (the module's own weights)
sums to less than 1 and the output has no sink part.

Inputs are captured with PyTorch forward hooks on each layer's `self_attn` during one forward of the model; the
modules' own weights and functions do the rest (nothing is copied from transformers). The looped Inkling-2-Mini
(`Inkling2LoopForCausalLM`, the same attention modules) runs its loop layers' attention once per pass: each run is
a visit, numbered from 0 in the order of the forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from attnres_lens.analysis.induction import repeated_batch
from attnres_lens.analysis.kv_shift import AttentionTaps
from attnres_lens.tasks.base import Batch

SUPPORTED_MODELS = ("Inkling2ForCausalLM", "Inkling2LoopForCausalLM")
ATTENTION_MODULES = (
    "Inkling2SlidingAttention",
    "Inkling2FullAttention",
    "Inkling2LoopSlidingAttention",
    "Inkling2LoopFullAttention",
)
DEFAULT_HALF_LEN = 32


def check_model(model: Any) -> None:
    """Refuse, by name, a model other than transformers' Inkling-2 (or Inkling-2-Mini) text model with eager
    attention."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise TypeError(
            f"the K/V convolution taps are read from {' or '.join(SUPPORTED_MODELS)} (transformers' Inkling-2), got "
            f"{name}: open the text model with transformers' Inkling2ForCausalLM or Inkling2LoopForCausalLM"
        )
    implementation = model.config._attn_implementation
    if implementation != "eager":
        raise ValueError(
            f"the tap split needs the attention weights, which only eager attention returns; the model uses "
            f"{implementation!r}: load it with attn_implementation='eager'"
        )


def default_probe(model: Any, n_samples: int = 32, seed: int = 0) -> Batch:
    """Repeated tokens in the model's vocabulary, `DEFAULT_HALF_LEN` long or shorter where a sliding window would
    hide an induction target (L − 1 tokens back)."""
    return repeated_batch(n_samples, probe_half_len(model), model.config.vocab_size, seed)


def probe_half_len(model: Any) -> int:
    """The repeated-tokens probe's half length L on an Inkling model: `DEFAULT_HALF_LEN`, or shorter where a
    sliding window would hide an induction target (L − 1 tokens back)."""
    check_model(model)
    config = model.config
    sliding = [
        config.sliding_window_size
        for kind in config.layer_types[: config.num_hidden_layers]
        if kind.endswith("sliding")
    ]
    half_len = min([DEFAULT_HALF_LEN, *sliding])
    if half_len < 2:
        raise ValueError(f"sliding_window_size={min(sliding)} is too short for a repeated-tokens probe (needs >= 2)")
    return half_len


def _lagged(context: torch.Tensor, lag: int) -> torch.Tensor:
    """`context[:, t − lag]` at position t, zeros before 0 (context is [batch, pos, channel])."""
    if lag == 0:
        return context
    return F.pad(context[:, :-lag], (0, 0, lag, 0))


def _convolution_taps(projection: nn.Module, inputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pre-norm state of `Inkling2KeyValueProjection` split by lag: [lag, batch, pos, channel], in `dtype`."""
    convolution = projection.sconv
    width = convolution.conv_kernel_size
    states = projection.linear(inputs).to(dtype)
    if hasattr(convolution, "conv1d"):  # Inkling2ShortConvolution: PyTorch's conv1d weight [channel, 1, width]
        # conv1d with width − 1 left padding weights the token ℓ back by kernel index width − 1 − ℓ
        kernel = convolution.conv1d.weight[:, 0].to(dtype)
        tap_weights = [kernel[:, width - 1 - lag] for lag in range(width)]
        divisor = math.sqrt(width + 1)
    else:  # Inkling2DynamicShortConvolution: static [width, channel] plus per-token [batch, pos, head, width]
        batch, n_pos, channels = states.shape
        n_heads = convolution.num_heads
        dynamic = convolution.weight_proj(inputs).to(dtype).view(batch, n_pos, n_heads, 1, width)
        static = convolution.static_weight.to(dtype).T.reshape(n_heads, channels // n_heads, width)
        per_token = (static + dynamic).reshape(batch, n_pos, channels, width)  # channel h·d_head + i
        tap_weights = [per_token[..., lag] for lag in range(width)]
        divisor = math.sqrt(2 * width + 1)
    taps = [_lagged(states, lag) * weight for lag, weight in enumerate(tap_weights)]
    taps[0] = taps[0] + states
    return torch.stack(taps) / divisor


def _projection_taps(projection: nn.Module, inputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Key or value taps [lag, batch, pos, kv_head, d_head]: the convolution's taps times the scalar the norm applied
    to each (token, head) vector in the module's own pass."""
    taps = _convolution_taps(projection, inputs, dtype)
    taps = taps.unflatten(-1, (-1, projection.head_dim))
    before = projection.sconv(projection.linear(inputs), inputs)
    before = before.unflatten(-1, (-1, projection.head_dim))
    normed = projection.norm(before)
    tolerance = 16 * torch.finfo(normed.dtype).eps  # a few roundings of the norm's output in the model's dtype
    after, before = normed.to(dtype), before.to(dtype)
    # the norm's factor, read as a projection: exact for any norm that scales the whole vector
    scale = (after * before).sum(-1, keepdim=True) / (before * before).sum(-1, keepdim=True).clamp_min(
        torch.finfo(dtype).tiny
    )
    residual = (after - scale * before).norm(dim=-1).max().item()
    if residual > tolerance * max(after.norm(dim=-1).max().item(), 1.0):
        raise ValueError(
            f"{type(projection.norm).__name__} does not scale each (token, head) vector by one factor (off by "
            f"{residual:.3g}), so the convolution's taps cannot share it"
        )
    return taps * scale


@torch.no_grad()
def _layer_taps(attention: nn.Module, inputs: dict[str, Any], weights: torch.Tensor) -> AttentionTaps:
    """One layer's taps from its attention's keyword inputs and the attention weights it returned."""
    for name in ("cache", "seq_idx", "conv_mask"):  # none is set by an uncached forward without padding
        if inputs.get(name) is not None:
            raise ValueError(f"the taps are read from one uncached, unpadded forward; the model was called with {name}")
    hidden = inputs["hidden_states"]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    key_inputs = inputs.get("key_hidden_states")
    value_inputs = inputs.get("value_hidden_states")
    key_inputs = hidden if key_inputs is None else key_inputs
    value_inputs = hidden if value_inputs is None else value_inputs
    position_ids = inputs["position_ids"]
    queries = attention.q_proj(hidden, position_ids).transpose(1, 2).to(dtype)  # [batch, pos, head, d_head]
    bias = attention.relative_position_bias(hidden, inputs["relative_distance"], position_ids).to(dtype)
    mask = inputs.get("attention_mask")
    n_pos = hidden.shape[1]
    if mask is None:
        visible = torch.ones(n_pos, n_pos, dtype=torch.bool, device=hidden.device).tril().expand(len(hidden), -1, -1)
    else:  # [batch, 1, q, k]: True where attended, or an additive mask that is 0 there
        visible = (mask if mask.dtype == torch.bool else mask == 0)[:, 0]
    return AttentionTaps(
        queries=queries,
        key_taps=_projection_taps(attention.k_proj, key_inputs, dtype),
        value_taps=_projection_taps(attention.v_proj, value_inputs, dtype),
        pattern=weights.to(dtype),
        score_divisor=1 / attention.scaling,
        score_bias=bias,
        visible=visible,
    )


def each_layer_taps(
    model: Any,
    tokens: torch.Tensor,
    on_layer: Callable[[int, int, AttentionTaps], None],
    layers: Iterable[int] | None = None,
) -> None:
    """Run one forward of a transformers `Inkling2ForCausalLM` or `Inkling2LoopForCausalLM` (eager attention, no
    cache) on `tokens` [batch, pos] and call `on_layer(layer, visit, taps)` each time a chosen layer's attention
    finishes (default: every layer; visit 0 but on the Mini's loop layers, one per pass), so a caller that reduces
    the taps never holds more than one layer's. The taps are in float32 (float64 for a float64 model); their sum is
    the keys and values the attention computed, up to float32 rounding (the model's in bf16)."""
    check_model(model)
    blocks = model.model.layers
    chosen = range(len(blocks)) if layers is None else sorted(set(layers))
    for layer in chosen:
        if not 0 <= layer < len(blocks):
            raise ValueError(f"layer must be in 0..{len(blocks) - 1}, got {layer}")
        name = type(blocks[layer].self_attn).__name__
        if name not in ATTENTION_MODULES:
            raise TypeError(f"layer {layer}'s attention is {name}, expected one of {ATTENTION_MODULES}")
    visits = dict.fromkeys(chosen, 0)

    def watch(layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: tuple) -> None:
            if args:
                raise ValueError(f"layer {layer}'s attention was called with positional arguments; expected keywords")
            if output[1] is None:
                raise ValueError(f"layer {layer}'s attention returned no weights: load the model with eager attention")
            visits[layer] += 1
            on_layer(layer, visits[layer] - 1, _layer_taps(module, kwargs, output[1]))

        return hook

    handles = [blocks[layer].self_attn.register_forward_hook(watch(layer), with_kwargs=True) for layer in chosen]
    try:
        with torch.no_grad():
            model(input_ids=tokens, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def inkling2_attention_taps(
    model: Any, tokens: torch.Tensor, layers: Iterable[int] | None = None
) -> dict[tuple[int, int], AttentionTaps]:
    """The chosen layers' `AttentionTaps` (default: every layer) from one forward (`each_layer_taps`), keyed by
    (layer, visit)."""
    found: dict[tuple[int, int], AttentionTaps] = {}

    def keep(layer: int, visit: int, taps: AttentionTaps) -> None:
        found[layer, visit] = taps

    each_layer_taps(model, tokens, keep, layers)
    return found
