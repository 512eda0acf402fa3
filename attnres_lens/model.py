"""`HookedTransformer`: one model class for every variant (SPEC §3).

standard / Full AttnRes / Block AttnRes residuals × standard / KV-shifting attention, PreNorm with
RMSNorm, RoPE (or learned positions), optional `attn_only`. Built on TransformerLens's
`HookedRootModule`, so `run_with_hooks`, `hooks()` and `run_with_cache` work as in TL.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint

from attnres_lens.attnres import EMBEDDING, DepthAttention, DepthStream, source_layout
from attnres_lens.components import MLP, Attention, Embed, PosEmbed, RMSNorm, Unembed
from attnres_lens.config import ModelConfig
from attnres_lens.kernels import resolve_backend

TokensLike = Union[torch.Tensor, Sequence[int], Sequence[Sequence[int]], str]


class SumStream:
    """The standard PreNorm residual: every sublayer reads `e + Σ_{i<j} f_i`."""

    def __init__(self, embedding: torch.Tensor):
        self.resid = embedding

    def write(self, output: torch.Tensor) -> None:
        self.resid = self.resid + output


class TransformerBlock(nn.Module):
    """One layer: attention sublayer then (unless `attn_only`) MLP sublayer, each with its pre-norm.

    Under AttnRes each sublayer first reads its input through its own depth attention
    (`attn_res`, `mlp_res`).
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.ln1 = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg, layer)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        if not cfg.attn_only:
            self.ln2 = RMSNorm(cfg.d_model, cfg.eps)
            self.mlp = MLP(cfg)
            self.hook_resid_mid = HookPoint()
            self.hook_mlp_out = HookPoint()
        if cfg.residual == "attnres":
            self.attn_res = DepthAttention(cfg.d_model, cfg.attnres_eps, cfg.depth_attention_backend)
            if not cfg.attn_only:
                self.mlp_res = DepthAttention(cfg.d_model, cfg.attnres_eps, cfg.depth_attention_backend)
        self.hook_resid_post = HookPoint()

    def forward(self, stream: Union[SumStream, DepthStream]) -> None:
        self._sublayer(stream, "attn_res", self.hook_resid_pre, self.ln1, self.attn, self.hook_attn_out)
        if not self.cfg.attn_only:
            self._sublayer(stream, "mlp_res", self.hook_resid_mid, self.ln2, self.mlp, self.hook_mlp_out)
        # resid_post is the residual (standard) or the current block's partial sum (AttnRes); a hook
        # that edits it edits what later sublayers read.
        if isinstance(stream, SumStream):
            stream.resid = self.hook_resid_post(stream.resid)
        else:
            stream.partial = self.hook_resid_post(stream.partial)

    def _sublayer(self, stream, depth_attention: str, hook_in: HookPoint, norm, sublayer, hook_out: HookPoint) -> None:
        if isinstance(stream, SumStream):
            stream.resid = x = hook_in(stream.resid)
        else:
            x = hook_in(stream.mix(getattr(self, depth_attention)))
        stream.write(hook_out(sublayer(norm(x))))


class HookedTransformer(HookedRootModule):
    """A small hooked transformer whose residual is standard or AttnRes (SPEC §3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be an attnres_lens.ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        if cfg.positional_embedding_type == "standard":
            self.pos_embed = PosEmbed(cfg)
            self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList([TransformerBlock(cfg, layer) for layer in range(cfg.n_layers)])
        if cfg.residual == "attnres":
            self.final_res = DepthAttention(cfg.d_model, cfg.attnres_eps, cfg.depth_attention_backend)
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps)
        self.unembed = Unembed(cfg)
        self.to(device=cfg.device, dtype=cfg.dtype)
        self.setup()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        tokens: TokensLike,
        return_type: Optional[Literal["logits", "loss", "both"]] = "logits",
        loss_per_token: bool = False,
    ) -> Any:
        """Run the model on `tokens` ([batch, pos] ints, or anything `to_tokens` accepts).

        The loss is next-token cross-entropy: logits at position t predict token t+1.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be one of 'logits', 'loss', 'both', None; got {return_type!r}")
        tokens = self.to_tokens(tokens)
        embedding = self.hook_embed(self.embed(tokens))
        if self.cfg.positional_embedding_type == "standard":
            embedding = embedding + self.hook_pos_embed(self.pos_embed(tokens))

        if self.cfg.residual == "standard":
            stream = SumStream(embedding)
            for block in self.blocks:
                block(stream)
            final = stream.resid
        else:
            stream = DepthStream(embedding, self.cfg.attnres_block_size, self._two_phase_consumers(embedding.device))
            for block in self.blocks:
                block(stream)
            final = stream.mix(self.final_res, final=True)
        logits = self.unembed(self.ln_final(final))

        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def _two_phase_consumers(self, device: torch.device) -> Optional[list[DepthAttention]]:
        """Block AttnRes runs two-phase where the depth-attention backend is Triton (fused phase-1 and merge
        kernels); the CPU paths mix each sublayer in one pass, which measured faster there."""
        if self.cfg.attnres_block_size == 1 or resolve_backend(self.cfg.depth_attention_backend, device) != "triton":
            return None
        modules = self.depth_attention_modules()
        return [modules[consumer] for consumer in sorted(modules)]

    def run_with_cache(self, *model_args: Any, remove_batch_dim: bool = False, **kwargs: Any):
        """Like TL's, but the cache is a `transformer_lens.ActivationCache`, so `cache["pattern", l]` works."""
        if model_args and not isinstance(model_args[0], torch.Tensor):
            model_args = (self.to_tokens(model_args[0]), *model_args[1:])
        out, cache_dict = super().run_with_cache(*model_args, remove_batch_dim=remove_batch_dim, **kwargs)
        return out, ActivationCache(cache_dict, self, has_batch_dim=not remove_batch_dim)

    # ------------------------------------------------------------------ tokens
    def to_tokens(self, tokens: TokensLike) -> torch.Tensor:
        """Validated `[batch, pos]` int64 tokens on the model's device.

        Accepts an int tensor ([pos] or [batch, pos]), a list of ints, a list of lists, a string of
        space-separated ints, or a list of such strings (so TL utilities that pass strings work). No BOS
        is prepended.
        """
        if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens):
            rows = [self.to_tokens(text)[0].tolist() for text in tokens]  # TL utilities pass lists of prompts
            if len({len(row) for row in rows}) > 1:
                raise ValueError(f"strings of tokens must all have the same length to form a batch, got {[len(r) for r in rows]}")
            tokens = rows
        if isinstance(tokens, str):
            try:
                tokens = [int(piece) for piece in tokens.split()]
            except ValueError as err:
                raise ValueError(
                    f"a string of tokens must hold space-separated integer ids, got {tokens[:60]!r}"
                ) from err
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.tensor(tokens)
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
            raise ValueError(f"tokens must be integer ids, got a tensor of dtype {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.shape[-1] == 0:
            raise ValueError(f"tokens must have shape [batch, pos] with pos >= 1, got {tuple(tokens.shape)}")
        if tokens.shape[-1] > self.cfg.n_ctx:
            raise ValueError(
                f"sequence length {tokens.shape[-1]} exceeds n_ctx={self.cfg.n_ctx}; truncate the input or "
                "build the model with a larger n_ctx"
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is out of range for d_vocab={self.cfg.d_vocab} (valid ids 0..{self.cfg.d_vocab - 1})")
        return tokens.to(device=self.embed.W_E.device, dtype=torch.long)

    # ------------------------------------------------------------------ depth structure
    def sublayer_name(self, sublayer: int) -> str:
        """'L{layer}.attn' / 'L{layer}.mlp' for sublayer j (forward order), 'final' for J."""
        if sublayer == self.cfg.n_sublayers:
            return "final"
        layer, kind = self._layer_kind(sublayer)
        return f"L{layer}.{kind}"

    def sources(self, sublayer: int) -> list[list[int]]:
        """Sublayer indices summed into each source read by `sublayer` (J = final readout).

        The standard residual is Full-style bookkeeping with all weights 1: `[e, f_0, …, f_{j−1}]`.
        """
        block_size = self.cfg.attnres_block_size if self.cfg.residual == "attnres" else 1
        return source_layout(sublayer, self.cfg.n_sublayers, block_size)

    def source_labels(self, sublayer: int) -> list[str]:
        """Short plot labels for the sources read by `sublayer`: 'emb', 'L3.attn', 'B2 (L2–L3)', 'partial'."""
        sources = self.sources(sublayer)
        block_size = self.cfg.attnres_block_size if self.cfg.residual == "attnres" else 1
        labels = []
        for index, members in enumerate(sources):
            if members == [EMBEDDING]:
                labels.append("emb")
            elif block_size == 1:
                labels.append(self.sublayer_name(members[0]))
            elif len(members) < block_size:
                labels.append("partial")
            else:
                first, last = self._layer_kind(members[0])[0], self._layer_kind(members[-1])[0]
                span = f"L{first}" if first == last else f"L{first}–L{last}"
                labels.append(f"B{index} ({span})")
        return labels

    def sublayer_output_hook(self, sublayer: int) -> str:
        """Name of the hook holding f_j, the output of sublayer j."""
        layer, kind = self._layer_kind(sublayer)
        return f"blocks.{layer}.hook_{kind}_out"

    def sublayer_input_hook(self, sublayer: int) -> str:
        """Name of the hook holding h_j, the input of sublayer j (before its own pre-norm)."""
        layer, kind = self._layer_kind(sublayer)
        return f"blocks.{layer}.hook_resid_{'pre' if kind == 'attn' else 'mid'}"

    def _layer_kind(self, sublayer: int) -> tuple[int, str]:
        if not 0 <= sublayer < self.cfg.n_sublayers:
            raise ValueError(f"sublayer must be in 0..{self.cfg.n_sublayers - 1}, got {sublayer}")
        if self.cfg.attn_only:
            return sublayer, "attn"
        return sublayer // 2, "attn" if sublayer % 2 == 0 else "mlp"

    def depth_attention_modules(self) -> dict[int, DepthAttention]:
        """Depth-attention module of each consumer (sublayer index, J = final); empty for standard."""
        if self.cfg.residual != "attnres":
            return {}
        modules: dict[int, DepthAttention] = {}
        for layer, block in enumerate(self.blocks):
            if self.cfg.attn_only:
                modules[layer] = block.attn_res
            else:
                modules[2 * layer], modules[2 * layer + 1] = block.attn_res, block.mlp_res
        modules[self.cfg.n_sublayers] = self.final_res
        return modules


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Cross-entropy of logits at t against token t+1; [batch, pos-1] if `per_token`, else the mean."""
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
    losses = losses.view(tokens.shape[0], -1)
    return losses if per_token else losses.mean()


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay weight matrices only.

    KV-shift scalars, depth-attention pseudo-queries, norm gains and biases stay out of weight decay:
    decay would pull the queries back to uniform depth weights and the shift scalars towards zero.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.endswith("kv_shift"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
