"""KV-shift-aware induction analysis (docs/analysis.md §11): which half of a KV-shifting head does the work.

A KV-shift head scores `q_t · K̂_k = α1 q_t·K_k + α2 q_t·K_{k−1}` (RoPE, which is linear, applied to both parts at
the key's position k, and the 1/√d scale) and outputs `Σ_k A_tk V̂_k = β1 Σ_k A_tk V_k + β2 Σ_k A_tk V_{k−1}`.
`kv_shift_decomposition` splits both, per head, from the hooked q, k, v and pattern; a standard-attention head is
the case α = β = (1, 0), so every model gets the same table.

On repeated tokens `[BOS, r, r]` the induction target of query q (second copy, token r_i) is the key q − (L−1)
(first copy, r_{i+1}). A one-layer KV-shift induction head finds it through its *shifted* key, which carries
r_i; the two-layer circuit finds it through its *current* key, into which a previous-token head in the layer
below wrote r_i. Softmax only sees a score relative to the query's other keys, so each part's *advantage* at
the target is its score there minus its mean over the query's visible keys; the shifted-key induction score is
`S / (|C| + |S|)` with C, S the mean current- and shifted-key advantages: ≈ 1 for the one-layer mechanism, ≈ 0
(exactly 0 without KV shift) for the two-layer one, NaN when neither part prefers the target at all.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from transformer_lens.utilities import get_act_name

from attnres_lens.analysis.engine import capture
from attnres_lens.analysis.induction import _check_repeated, default_half_len, repeated_batch
from attnres_lens.components import shift_one_position
from attnres_lens.kernels import apply_rotary
from attnres_lens.model import HookedTransformer
from attnres_lens.tasks.base import Batch


def _shift_scalars(model: HookedTransformer, layer: int) -> torch.Tensor:
    """(α1, α2, β1, β2) per key/value head; standard attention is (1, 0, 1, 0)."""
    attn = model.blocks[layer].attn
    if hasattr(attn, "kv_shift"):
        return attn.kv_shift.detach()
    n_kv = attn.W_K.shape[0]
    return torch.tensor([1.0, 0.0, 1.0, 0.0], device=attn.W_K.device, dtype=attn.W_K.dtype).expand(n_kv, 4)


@torch.no_grad()
def kv_shift_parts(model: HookedTransformer, tokens: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """Per-head parts of one layer's attention: `current_scores`, `shifted_scores` [batch, head, q, k] (their sum
    is `hook_attn_scores` before the causal mask), `current_z`, `shifted_z` [batch, pos, head, d_head] (their sum
    is `hook_z`), and `pattern` [batch, head, q, k]."""
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
    n_pos = tokens.shape[1]
    if cfg.positional_embedding_type == "rotary":
        cos, sin = attn.rotary_cos[:n_pos, None, :], attn.rotary_sin[:n_pos, None, :]
        q = apply_rotary(q, cos, sin)
        current_k, shifted_k = apply_rotary(current_k, cos, sin), apply_rotary(shifted_k, cos, sin)
    group = cfg.n_heads // attn.W_K.shape[0]
    if group > 1:
        current_k, shifted_k, current_v, shifted_v = (
            x.repeat_interleave(group, dim=2) for x in (current_k, shifted_k, current_v, shifted_v)
        )
    scale = math.sqrt(cfg.d_head)
    return dict(
        current_scores=torch.einsum("bqhd,bkhd->bhqk", q, current_k) / scale,
        shifted_scores=torch.einsum("bqhd,bkhd->bhqk", q, shifted_k) / scale,
        current_z=torch.einsum("bhqk,bkhd->bqhd", pattern, current_v),
        shifted_z=torch.einsum("bhqk,bkhd->bqhd", pattern, shifted_v),
        pattern=pattern,
    )


def kv_shift_decomposition(
    model: HookedTransformer, batch: Batch | None = None, n_samples: int = 32, seed: int = 0
) -> pd.DataFrame:
    """One row per (layer, head) on a repeated-tokens batch (default: `repeated_batch` of `n_samples` sequences,
    as `induction_head_scores`): alpha1, alpha2, beta1, beta2 (of the head's key/value head); prefix_score (mean
    attention on the induction target); current_key_advantage and shifted_key_advantage (each part's score at the
    target minus its mean over the query's visible keys, averaged over second-half queries);
    shifted_key_induction_score (module docstring); shifted_value_share (the shifted-value part's projection
    share of the head's output `⟨z_shift, z⟩/‖z‖²`, averaged over second-half positions; 0 without KV shift).
    """
    cfg = model.cfg
    if batch is None:
        batch = repeated_batch(n_samples, default_half_len(model), cfg.d_vocab, seed)
    tokens = batch.tokens.to(model.embed.W_E.device)
    half_len = _check_repeated(tokens)
    queries = torch.arange(half_len + 1, 2 * half_len + 1, device=tokens.device)
    targets = queries - (half_len - 1)
    visible = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()[queries]
    rows = []
    for layer in range(cfg.n_layers):
        parts = kv_shift_parts(model, tokens, layer)
        scalars = _shift_scalars(model, layer)
        group = cfg.n_heads // scalars.shape[0]
        advantages = {}
        for part in ("current", "shifted"):
            scores = parts[f"{part}_scores"][:, :, queries].double()  # [batch, head, n_queries, k]
            at_target = scores.gather(-1, targets[None, None, :, None].expand(*scores.shape[:3], 1)).squeeze(-1)
            mean = (scores * visible).sum(-1) / visible.sum(-1)
            advantages[part] = (at_target - mean).mean(dim=(0, 2))  # [head]
        z = (parts["current_z"] + parts["shifted_z"])[:, queries].double()
        share = ((parts["shifted_z"][:, queries].double() * z).sum(-1) / (z * z).sum(-1).clamp_min(1e-30)).mean(
            dim=(0, 1)
        )
        prefix = parts["pattern"][:, :, queries, targets].double().mean(dim=(0, 2))
        for head in range(cfg.n_heads):
            current, shifted = advantages["current"][head].item(), advantages["shifted"][head].item()
            denominator = abs(current) + abs(shifted)
            alpha1, alpha2, beta1, beta2 = scalars[head // group].tolist()
            rows.append(
                dict(
                    layer=layer,
                    head=head,
                    alpha1=alpha1,
                    alpha2=alpha2,
                    beta1=beta1,
                    beta2=beta2,
                    prefix_score=prefix[head].item(),
                    current_key_advantage=current,
                    shifted_key_advantage=shifted,
                    shifted_key_induction_score=shifted / denominator if denominator > 1e-9 else float("nan"),
                    shifted_value_share=share[head].item(),
                )
            )
    return pd.DataFrame(rows)
