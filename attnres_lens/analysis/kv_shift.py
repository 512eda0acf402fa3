"""Short-convolution K/V analysis (docs/analysis.md §11): which taps of a head's key/value convolution do the work.

A head whose keys and values are causal convolutions over tokens (KV shift: width 2 with per-head scalars; the
short convolutions of transformers' Inkling-2: width 4, per channel or per token) has keys `K̂_k = Σ_ℓ K^ℓ_k`, where
the tap part `K^ℓ_k` is what the token ℓ steps back contributes to the key at position k (after everything linear,
and after any per-vector scale the model then applies, which multiplies every tap alike). So its score
`q_t · K̂_k / √d (+ bias_tk) = Σ_ℓ q_t · K^ℓ_k / √d (+ bias_tk)` and its output `Σ_k A_tk V̂_k = Σ_ℓ Σ_k A_tk V^ℓ_k`
split exactly by tap. `AttentionTaps` holds one layer's tap parts; `tap_parts` splits the scores and outputs; the
extractors build it from a model (`hooked_attention_taps` here, `inkling_taps.inkling2_attention_taps` for
transformers' Inkling-2).

On repeated tokens `[BOS, r, r]` the induction target of query q (second copy, token r_i) is the key q − (L−1)
(first copy, r_{i+1}). A one-layer KV-shift induction head finds it through its *shifted* key (lag 1), which
carries r_i; the two-layer circuit finds it through its *current* key (lag 0), into which a previous-token head in
the layer below wrote r_i. Softmax only sees a score relative to the query's other keys, so each tap's *advantage*
`A_ℓ` at the target is its score there minus its mean over the query's visible keys; a tap's induction share is
`A_ℓ / Σ_j |A_j|`, and the shifted-key induction score `Σ_{ℓ≥1} A_ℓ / Σ_j |A_j|` (at width 2 `S / (|C| + |S|)`): ≈ 1
for the one-layer mechanism, ≈ 0 (exactly 0 without KV shift) for the two-layer one, NaN when no tap prefers the
target at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from transformer_lens.utilities import get_act_name

from attnres_lens.analysis.engine import capture
from attnres_lens.analysis.induction import _check_repeated, default_half_len, repeated_batch
from attnres_lens.components import shift_one_position
from attnres_lens.kernels import apply_rotary
from attnres_lens.model import HookedTransformer
from attnres_lens.tasks.base import Batch

# below this total |advantage| no tap prefers the target, and the shares are NaN
_NO_PREFERENCE = 1e-9


@dataclass(frozen=True)
class AttentionTaps:
    """One attention layer's inputs to the tap decomposition (docs/analysis.md §11).

    `queries` [batch, pos, head, d_head] as they meet the keys (after RoPE or the query norm); `key_taps` and
    `value_taps` [lag, batch, pos, kv_head, d_head], lag 0 the current token, whose sum over lags is the keys and
    values the scores and the output read (after RoPE and any per-vector norm's scale); `pattern` [batch, head,
    q, k] the head's attention weights; `score_divisor` the score's divisor (√d_head), `score_bias` [batch, head,
    q, k] an additive score term that does not depend on the keys (a relative-position bias; None where there is
    none); `visible` [batch, q, k] the keys each query may attend to (None: causal)."""

    queries: torch.Tensor
    key_taps: torch.Tensor
    value_taps: torch.Tensor
    pattern: torch.Tensor
    score_divisor: float
    score_bias: torch.Tensor | None = None
    visible: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.key_taps.shape[0]

    def __post_init__(self) -> None:
        if self.key_taps.ndim != 5 or self.key_taps.shape[0] == 0:
            raise ValueError(
                f"key_taps must be [lag, batch, pos, kv_head, d_head] with at least one lag, got shape "
                f"{tuple(self.key_taps.shape)}"
            )
        if self.key_taps.shape != self.value_taps.shape:
            raise ValueError(
                f"key_taps {tuple(self.key_taps.shape)} and value_taps {tuple(self.value_taps.shape)} must have one "
                "shape [lag, batch, pos, kv_head, d_head]: give both convolutions' taps, padding the narrower with "
                "zero taps"
            )
        n_heads, n_kv = self.queries.shape[2], self.key_taps.shape[3]
        if n_heads % n_kv:
            raise ValueError(f"{n_heads} query heads cannot share {n_kv} key/value heads evenly")


# The KV-shift table's columns, in order: the width-2 view of the tap decomposition (its reports show the same)
KV_SHIFT_COLUMNS = [
    "layer",
    "head",
    "alpha1",
    "alpha2",
    "beta1",
    "beta2",
    "prefix_score",
    "current_key_advantage",
    "shifted_key_advantage",
    "shifted_key_induction_score",
    "shifted_value_share",
]


def tap_parts(taps: AttentionTaps) -> dict[str, torch.Tensor]:
    """Per-tap parts of a layer's attention: `score_taps` [lag, batch, head, q, k], whose sum over lags plus
    `score_bias` [batch, head, q, k] (zeros where there is none) is the pre-softmax score before the mask;
    `output_taps` [lag, batch, pos, head, d_head], whose sum is the head's output z; and `pattern`."""
    group = taps.queries.shape[2] // taps.key_taps.shape[3]
    score_taps, output_taps = [], []
    for key, value in zip(taps.key_taps, taps.value_taps, strict=True):
        if group > 1:  # query head h reads key/value head h // group
            key, value = key.repeat_interleave(group, dim=2), value.repeat_interleave(group, dim=2)
        score_taps.append(torch.einsum("bqhd,bkhd->bhqk", taps.queries, key) / taps.score_divisor)
        output_taps.append(torch.einsum("bhqk,bkhd->bqhd", taps.pattern, value))
    score_bias = taps.score_bias if taps.score_bias is not None else torch.zeros_like(score_taps[0])
    return dict(
        score_taps=torch.stack(score_taps),
        score_bias=score_bias,
        output_taps=torch.stack(output_taps),
        pattern=taps.pattern,
    )


def _shift_scalars(model: HookedTransformer, layer: int) -> torch.Tensor:
    """(α1, α2, β1, β2) per key/value head; standard attention is (1, 0, 1, 0)."""
    attn = model.blocks[layer].attn
    if hasattr(attn, "kv_shift"):
        return attn.kv_shift.detach()
    n_kv = attn.W_K.shape[0]
    return torch.tensor([1.0, 0.0, 1.0, 0.0], device=attn.W_K.device, dtype=attn.W_K.dtype).expand(n_kv, 4)


@torch.no_grad()
def hooked_attention_taps(model: HookedTransformer, tokens: torch.Tensor, layer: int) -> AttentionTaps:
    """The toolkit's attention as a width-2 convolution: key taps `(α1 K_k, α2 K_{k−1})` with RoPE at the key's
    position k (linear, so it applies to each tap), value taps `(β1 V_k, β2 V_{k−1})`; standard attention is
    α = β = (1, 0). Read from `hook_q`, `hook_k`, `hook_v` and `hook_pattern` of one clean pass."""
    cfg = model.cfg
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer must be in 0..{cfg.n_layers - 1}, got {layer}")
    tokens = model.to_tokens(tokens)
    names = [get_act_name(kind, layer) for kind in ("q", "k", "v", "pattern")]
    saved = capture(model, tokens, names)
    q, k, v, pattern = (saved[name] for name in names)
    attn = model.blocks[layer].attn
    alpha1, alpha2, beta1, beta2 = _shift_scalars(model, layer).to(q.dtype).unbind(-1)  # each [n_kv_heads]
    current_k, shifted_k = alpha1[:, None] * k, alpha2[:, None] * shift_one_position(k)
    current_v, shifted_v = beta1[:, None] * v, beta2[:, None] * shift_one_position(v)
    if cfg.positional_embedding_type == "rotary":
        n_pos = tokens.shape[1]
        cos, sin = attn.rotary_cos[:n_pos, None, :], attn.rotary_sin[:n_pos, None, :]
        q = apply_rotary(q, cos, sin)
        current_k, shifted_k = apply_rotary(current_k, cos, sin), apply_rotary(shifted_k, cos, sin)
    return AttentionTaps(
        queries=q,
        key_taps=torch.stack([current_k, shifted_k]),
        value_taps=torch.stack([current_v, shifted_v]),
        pattern=pattern,
        score_divisor=math.sqrt(cfg.d_head),
    )


@torch.no_grad()
def kv_shift_parts(model: HookedTransformer, tokens: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """Per-head parts of one layer's attention (the width-2 view of `tap_parts`): `current_scores`,
    `shifted_scores` [batch, head, q, k] (their sum is `hook_attn_scores` before the causal mask), `current_z`,
    `shifted_z` [batch, pos, head, d_head] (their sum is `hook_z`), and `pattern` [batch, head, q, k]."""
    parts = tap_parts(hooked_attention_taps(model, tokens, layer))
    current_scores, shifted_scores = parts["score_taps"]
    current_z, shifted_z = parts["output_taps"]
    return dict(
        current_scores=current_scores,
        shifted_scores=shifted_scores,
        current_z=current_z,
        shifted_z=shifted_z,
        pattern=parts["pattern"],
    )


def tap_statistics(taps: AttentionTaps, tokens: torch.Tensor) -> list[dict[str, Any]]:
    """One dict per query head of the layer on repeated tokens `[BOS, r, r]` (module docstring): `width`;
    `prefix_score` (mean attention on the induction target); per lag ℓ `key_advantage_lag{ℓ}` (the tap's score
    at the target minus its mean over the query's visible keys, averaged over second-half queries),
    `induction_share_lag{ℓ}` (`A_ℓ / Σ_j |A_j|`) and `value_share_lag{ℓ}` (the tap's projection share of the
    head's output `⟨z_ℓ, z⟩/‖z‖²`, averaged over second-half positions; the shares sum to 1);
    `bias_advantage` (the same advantage for the score's bias term, 0 without one); `shifted_key_induction_score`
    (`Σ_{ℓ≥1} A_ℓ / Σ_j |A_j|`) and `shifted_value_share` (the lag ≥ 1 taps' output share)."""
    half_len = _check_repeated(tokens)
    device = taps.pattern.device
    queries = torch.arange(half_len + 1, 2 * half_len + 1, device=device)
    targets = queries - (half_len - 1)
    n_pos = tokens.shape[1]
    if taps.visible is None:
        visible = torch.ones(n_pos, n_pos, dtype=torch.bool, device=device).tril()[queries]
    else:
        visible = taps.visible[:, None, queries]  # [batch, 1, n_queries, k]
        if not visible[..., torch.arange(len(queries), device=device), targets].all():
            raise ValueError(
                f"some second-half query cannot see its induction target {half_len - 1} tokens back (a sliding "
                f"window?): use a probe with a shorter half length than {half_len}"
            )
    parts = tap_parts(taps)

    def advantage(scores: torch.Tensor) -> torch.Tensor:
        """The score at the target minus its mean over the visible keys, averaged over queries: [head]."""
        scores = scores[:, :, queries].double()  # [batch, head, n_queries, k]
        at_target = scores.gather(-1, targets[None, None, :, None].expand(*scores.shape[:3], 1)).squeeze(-1)
        mean = (scores * visible).sum(-1) / visible.sum(-1)
        return (at_target - mean).mean(dim=(0, 2))

    key_advantages = [advantage(scores) for scores in parts["score_taps"]]
    bias_advantage = advantage(parts["score_bias"])
    # sums in the model's dtype, as the head adds its taps; the shares in float64
    output_taps = parts["output_taps"]
    z = output_taps[0]
    for tap in output_taps[1:]:
        z = z + tap
    z = z[:, queries].double()
    squared_norm = (z * z).sum(-1).clamp_min(1e-30)

    def share(part: torch.Tensor) -> torch.Tensor:
        return ((part[:, queries].double() * z).sum(-1) / squared_norm).mean(dim=(0, 1))  # [head]

    value_shares = [share(tap) for tap in output_taps]
    shifted = torch.zeros_like(output_taps[0]) if taps.width == 1 else output_taps[1]
    for tap in output_taps[2:]:
        shifted = shifted + tap
    shifted_value_share = share(shifted)
    prefix = parts["pattern"][:, :, queries, targets].double().mean(dim=(0, 2))
    rows = []
    for head in range(taps.queries.shape[2]):
        advantages = [a[head].item() for a in key_advantages]
        denominator = sum(abs(a) for a in advantages)
        preferred = denominator > _NO_PREFERENCE
        row: dict[str, Any] = dict(head=head, width=taps.width, prefix_score=prefix[head].item())
        for lag, a in enumerate(advantages):
            row[f"key_advantage_lag{lag}"] = a
        for lag, a in enumerate(advantages):
            row[f"induction_share_lag{lag}"] = a / denominator if preferred else float("nan")
        row["bias_advantage"] = bias_advantage[head].item()
        row["shifted_key_induction_score"] = sum(advantages[1:]) / denominator if preferred else float("nan")
        for lag, s in enumerate(value_shares):
            row[f"value_share_lag{lag}"] = s[head].item()
        row["shifted_value_share"] = shifted_value_share[head].item()
        rows.append(row)
    return rows


def conv_tap_decomposition(model: Any, batch: Batch | None = None, n_samples: int = 32, seed: int = 0) -> pd.DataFrame:
    """One row per (layer, head) of `tap_statistics` on a repeated-tokens batch (default: `repeated_batch` of
    `n_samples` sequences). `model` is the toolkit's `HookedTransformer` (KV shift or standard attention: width 2)
    or transformers' `Inkling2ForCausalLM` / `Inkling2LoopForCausalLM` (their K/V short convolutions,
    `inkling_taps`; one row per (layer, visit, head), the Mini's loop layers visited once per pass)."""
    rows: list[dict[str, Any]] = []

    def add(taps: AttentionTaps, **labels: int) -> None:
        rows.extend({**labels, **row} for row in tap_statistics(taps, tokens))

    if isinstance(model, HookedTransformer):
        if batch is None:
            batch = repeated_batch(n_samples, default_half_len(model), model.cfg.d_vocab, seed)
        tokens = batch.tokens.to(model.embed.W_E.device)
        for layer in range(model.cfg.n_layers):
            add(hooked_attention_taps(model, tokens, layer), layer=layer)
    else:
        from attnres_lens.analysis.inkling_taps import check_model, default_probe, each_layer_taps  # imports this

        check_model(model)
        if batch is None:
            batch = default_probe(model, n_samples, seed)
        tokens = batch.tokens.to(model.device)
        # a layer at a time, as the forward reaches it
        each_layer_taps(model, tokens, lambda layer, visit, taps: add(taps, layer=layer, visit=visit))
    return pd.DataFrame(rows)


def kv_shift_decomposition(
    model: HookedTransformer, batch: Batch | None = None, n_samples: int = 32, seed: int = 0
) -> pd.DataFrame:
    """The width-2 view of `conv_tap_decomposition`: one row per (layer, head) on a repeated-tokens batch (default:
    `repeated_batch` of `n_samples` sequences, as `induction_head_scores`): alpha1, alpha2, beta1, beta2 (of the
    head's key/value head); prefix_score (mean attention on the induction target); current_key_advantage and
    shifted_key_advantage (lags 0 and 1); shifted_key_induction_score (module docstring); shifted_value_share
    (the shifted-value part's projection share of the head's output `⟨z_shift, z⟩/‖z‖²`, averaged over
    second-half positions; 0 without KV shift)."""
    taps = conv_tap_decomposition(model, batch, n_samples, seed)
    rows = []
    for layer in range(model.cfg.n_layers):
        scalars = _shift_scalars(model, layer)
        group = model.cfg.n_heads // scalars.shape[0]
        for head in range(model.cfg.n_heads):
            alpha1, alpha2, beta1, beta2 = scalars[head // group].tolist()
            rows.append(dict(layer=layer, head=head, alpha1=alpha1, alpha2=alpha2, beta1=beta1, beta2=beta2))
    scalars = pd.DataFrame(rows)
    table = scalars.merge(taps, on=["layer", "head"], validate="one_to_one")
    table = table.rename(
        columns={"key_advantage_lag0": "current_key_advantage", "key_advantage_lag1": "shifted_key_advantage"}
    )
    return table[KV_SHIFT_COLUMNS]
