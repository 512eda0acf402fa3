"""`HookedTransformer`: one model class for every variant (docs/model.md §1).

standard / Full AttnRes / Block AttnRes residuals × standard / KV-shifting attention, PreNorm with
RMSNorm, RoPE (or learned positions), optional `attn_only`. Built on TransformerLens's
`HookedRootModule`, so `run_with_hooks`, `hooks()` and `run_with_cache` work as in TL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens import ActivationCache, HookedRootModule
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import get_act_name

from attnres_lens.attnres import EMBEDDING, DepthAttention, DepthStream, source_layout
from attnres_lens.components import MLP, Attention, Embed, PosEmbed, RMSNorm, Unembed, side_generator
from attnres_lens.config import ModelConfig
from attnres_lens.denseformer import DenseStream, DepthWeightedAverage
from attnres_lens.hook_checks import module_hooked
from attnres_lens.kernels import model_runs_two_phase
from attnres_lens.mhc import MHCConnection, MHCHead, MHCStream
from attnres_lens.protocol import SINGLE_ROUTE, FrozenReadout, check_depth_point, token_id_batch
from attnres_lens.resources import check_model_fits
from attnres_lens.streams import ResidualStream, SumStream

TokensLike = torch.Tensor | Sequence[int] | Sequence[Sequence[int]] | str


# The hook showing each residual kind's post-layer state (docs/model.md §9).
POST_LAYER_HOOK = {
    "standard": "hook_resid_post",
    "attnres": "hook_block_partial",
    "denseformer": "hook_dwa_out",
    "mhc": "hook_streams",
}


def depth_attention(cfg: ModelConfig, consumer: int) -> DepthAttention:
    """The depth attention of `consumer` (sublayer index, J = final readout) with the config's AttnRes options."""
    n_sources = len(source_layout(consumer, cfg.n_sublayers, cfg.attnres_block_size, cfg.attnres_window))
    return DepthAttention(
        cfg.d_model,
        cfg.attnres_eps,
        cfg.depth_attention_backend,
        score=cfg.attnres_score,
        key_norm=cfg.attnres_key_norm,
        query=cfg.attnres_query,
        heads=cfg.attnres_heads,
        mixing=cfg.attnres_mixing,
        n_sources=n_sources,
        query_scale=cfg.attnres_query_scale,
        query_read=cfg.attnres_query_read,
    )


def mhc_connection(cfg: ModelConfig, generator: torch.Generator | None = None) -> MHCConnection:
    return MHCConnection(
        cfg.mhc_streams, cfg.d_model, cfg.eps, cfg.mhc_eps, cfg.mhc_sinkhorn_iters, cfg.init_range, generator
    )


class TransformerBlock(nn.Module):
    """One layer: attention sublayer then (unless `attn_only`) MLP sublayer, each with its pre-norm.

    Each sublayer reads its input from the residual stream (`streams.ResidualStream`) through its mixer: its own
    depth attention under AttnRes (`attn_res`, `mlp_res`), its hyper-connection under mHC (`attn_hc`, `mlp_hc`),
    none otherwise; DenseFormer averages over depth after the layer (`dwa`). The post-layer state has one hook
    named for what it is (`POST_LAYER_HOOK`): only the standard residual's is a residual stream
    (`hook_resid_post`), so TransformerLens helpers that decompose one refuse the other kinds.
    """

    # hook points whose hooks keep a sublayer's pre-norm out of its depth mix's kernel (interventions stack by them)
    path_hooks = ("hook_resid_pre", "hook_resid_mid")

    def __init__(self, cfg: ModelConfig, layer: int, side: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.ln1 = RMSNorm(cfg.d_model, cfg.eps, backend=cfg.depth_attention_backend)
        self.attn = Attention(cfg)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model] input of the attention sublayer
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model] f_j of the attention sublayer
        sublayers = [2 * layer] if not cfg.attn_only else [layer]
        if not cfg.attn_only:
            self.ln2 = RMSNorm(cfg.d_model, cfg.eps, backend=cfg.depth_attention_backend)
            self.mlp = MLP(cfg)
            self.hook_resid_mid = HookPoint()  # [batch, pos, d_model] input of the MLP sublayer
            self.hook_mlp_out = HookPoint()  # [batch, pos, d_model] f_j of the MLP sublayer
            sublayers.append(2 * layer + 1)
        if cfg.residual == "attnres":
            self.attn_res = depth_attention(cfg, sublayers[0])
            if not cfg.attn_only:
                self.mlp_res = depth_attention(cfg, sublayers[1])
        elif cfg.residual == "mhc":
            self.attn_hc = mhc_connection(cfg, side)
            if not cfg.attn_only:
                self.mlp_hc = mhc_connection(cfg, side)
        elif cfg.residual == "denseformer":
            self.dwa = DepthWeightedAverage(layer)
        # [batch, pos, d_model]: the residual stream (standard), the block's partial sum (AttnRes), the DWA output
        # Y_k (DenseFormer); [batch, pos, n_streams, d_model]: the streams (mHC)
        setattr(self, POST_LAYER_HOOK[cfg.residual], HookPoint())

    def mixers(self) -> tuple[nn.Module | None, nn.Module | None]:
        """The modules that mix the inputs of the attention and MLP sublayers (None for a plain residual)."""
        prefix = {"attnres": "res", "mhc": "hc"}.get(self.cfg.residual)
        if prefix is None:
            return None, None
        return getattr(self, f"attn_{prefix}"), getattr(self, f"mlp_{prefix}", None)

    def forward(self, stream: ResidualStream) -> None:
        attn_mixer, mlp_mixer = self.mixers()
        self._sublayer(stream, attn_mixer, self.hook_resid_pre, self.ln1, self.attn, self.hook_attn_out)
        if not self.cfg.attn_only:
            self._sublayer(stream, mlp_mixer, self.hook_resid_mid, self.ln2, self.mlp, self.hook_mlp_out)
        stream.end_layer(getattr(self, "dwa", None))
        # a hook that edits the post-layer state edits what later sublayers read
        stream.state = getattr(self, POST_LAYER_HOOK[self.cfg.residual])(stream.state)

    @staticmethod
    def _sublayer(
        stream: ResidualStream,
        mixer: nn.Module | None,
        hook_in: HookPoint,
        norm: RMSNorm,
        sublayer: nn.Module,
        hook_out: HookPoint,
    ) -> None:
        x, normed = stream.read_normed(mixer, hook_in, norm)
        stream.write(hook_out(sublayer(normed)), x)


class DepthActivationCache(ActivationCache):
    """TransformerLens's `ActivationCache`, whose residual-stream helpers refuse models without a running sum.

    `accumulated_resid`, `decompose_resid`, `get_full_resid_decomposition`, `logit_lens` and the remainder term of
    `stack_head_results` / `stack_neuron_results` assume every sublayer input is `e + Σ f_i`. That holds for the
    standard residual only; for AttnRes the inputs are depth mixes, and TL's sums would be silently wrong.
    """

    def _require_running_sum(self, helper: str) -> None:
        # a model from elsewhere (the transformers bridge) has no cfg.residual: its inputs are depth mixes
        residual = getattr(getattr(self.model, "cfg", None), "residual", None)
        if residual != "standard":
            what = f"residual is {residual!r}" if residual else f"kind is {type(self.model).__name__}"
            raise ValueError(
                f"ActivationCache.{helper} assumes a running-sum residual stream, but this model's {what}"
                ": its sublayer inputs are depth mixes of earlier outputs, not sums. Use "
                "attnres_lens.analysis (depth_weights, depth_mixing_matrix) to decompose them."
            )

    def accumulated_resid(self, *args: Any, **kwargs: Any) -> Any:
        self._require_running_sum("accumulated_resid")
        return super().accumulated_resid(*args, **kwargs)

    def decompose_resid(self, *args: Any, **kwargs: Any) -> Any:
        self._require_running_sum("decompose_resid")
        return super().decompose_resid(*args, **kwargs)

    def get_full_resid_decomposition(self, *args: Any, **kwargs: Any) -> Any:
        self._require_running_sum("get_full_resid_decomposition")
        return super().get_full_resid_decomposition(*args, **kwargs)

    def logit_lens(self, *args: Any, **kwargs: Any) -> Any:
        self._require_running_sum("logit_lens")
        return super().logit_lens(*args, **kwargs)

    def stack_head_results(self, *args: Any, incl_remainder: bool = False, **kwargs: Any) -> Any:
        if incl_remainder:
            self._require_running_sum("stack_head_results(incl_remainder=True)")
        return super().stack_head_results(*args, incl_remainder=incl_remainder, **kwargs)

    def stack_neuron_results(self, *args: Any, incl_remainder: bool = False, **kwargs: Any) -> Any:
        if incl_remainder:
            self._require_running_sum("stack_neuron_results(incl_remainder=True)")
        return super().stack_neuron_results(*args, incl_remainder=incl_remainder, **kwargs)


class HookedTransformer(HookedRootModule):
    """A small hooked transformer whose residual is standard or AttnRes (docs/model.md)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be an attnres_lens.ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        check_model_fits(cfg)  # a config may ask for terabytes: refuse before allocating
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        # mHC's own parameters draw from a side generator: the shared ones match across residual kinds (§6)
        side = side_generator() if cfg.residual == "mhc" else None
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        if cfg.positional_embedding_type == "standard":
            self.pos_embed = PosEmbed(cfg)
            self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList([TransformerBlock(cfg, layer, side) for layer in range(cfg.n_layers)])
        if cfg.residual == "attnres":
            self.final_res = depth_attention(cfg, cfg.n_sublayers)
        elif cfg.residual == "mhc":
            self.final_hc = MHCHead(cfg.mhc_streams, cfg.d_model, cfg.eps, cfg.mhc_eps, cfg.init_range, side)
        self.ln_final = RMSNorm(cfg.d_model, cfg.eps, backend=cfg.depth_attention_backend)
        # [batch, pos, d_model] h_J, the final norm's input (TransformerLens 4's bridge name); fires only when hooked,
        # so an unhooked readout keeps its mix and norm in one kernel (docs/hooks.md §2)
        self.ln_final.hook_in = HookPoint()
        # a hook there takes the readout off the fused path: interventions stack copies by it (docs/architecture.md §2)
        self.ln_final.path_hooks = (*RMSNorm.path_hooks, "hook_in")
        self.unembed = Unembed(cfg, self.embed)  # the embedding is W_U too when tie_word_embeddings
        self.to(device=cfg.device, dtype=cfg.dtype)
        self.setup()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        tokens: TokensLike,
        return_type: Literal["logits", "loss", "both"] | None = "logits",
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

        stream = self._stream(embedding)
        for block in self.blocks:
            block(stream)
        logits = self.read_out(stream)

        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def _stream(self, embedding: torch.Tensor) -> ResidualStream:
        cfg = self.cfg
        if cfg.residual == "attnres":
            return DepthStream(
                embedding, cfg.attnres_block_size, self._two_phase_consumers(embedding.device), cfg.attnres_window
            )
        if cfg.residual == "denseformer":
            return DenseStream(embedding)
        if cfg.residual == "mhc":
            return MHCStream(embedding, cfg.mhc_streams)
        return SumStream(embedding)

    def read_out(self, stream: ResidualStream) -> torch.Tensor:
        """The logits from a stream every sublayer has written: the final mix, `ln_final.hook_in` (only when
        hooked: otherwise the mix and the final norm may run as one kernel), the final norm and the unembedding. A
        module put in `ln_final`'s place has no `hook_in` unless it brings one: its input is then not hooked."""
        hook_in = getattr(self.ln_final, "hook_in", None)
        if hook_in is not None and module_hooked(hook_in):
            return self.unembed(self.ln_final(hook_in(stream.readout(self.final_mixer()))))
        return self.unembed(stream.readout_normed(self.final_mixer(), self.ln_final))

    def final_mixer(self) -> nn.Module | None:
        """The module that mixes the final norm's input: `final_res` (AttnRes), `final_hc` (mHC), else None."""
        return getattr(self, "final_res", None) or getattr(self, "final_hc", None)

    def _two_phase_consumers(self, device: torch.device) -> list[DepthAttention] | None:
        """The consumers a stream may mix two-phase (kernels.backends.model_runs_two_phase): Block AttnRes under
        Triton, and Full AttnRes on the C kernel (the stream decides per window). The ablation options (and a
        sliding window, whose sources differ per consumer) mix one sublayer at a time."""
        if self.cfg.attnres_options or not model_runs_two_phase(
            self.cfg.attnres_block_size, self.cfg.depth_attention_backend, device
        ):
            return None
        modules = self.depth_attention_modules()
        return [modules[consumer] for consumer in sorted(modules)]

    def run_with_cache(
        self, *model_args: Any, remove_batch_dim: bool = False, **kwargs: Any
    ) -> tuple[Any, DepthActivationCache]:
        """Like TL's, but the cache is a `transformer_lens.ActivationCache` (`DepthActivationCache`), so
        `cache["pattern", l]` works, and its residual-stream helpers refuse AttnRes models instead of misreading them."""
        if model_args and not isinstance(model_args[0], torch.Tensor):
            model_args = (self.to_tokens(model_args[0]), *model_args[1:])
        out, cache_dict = super().run_with_cache(*model_args, remove_batch_dim=remove_batch_dim, **kwargs)
        return out, DepthActivationCache(cache_dict, self, has_batch_dim=not remove_batch_dim)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """TransformerLens's protocol: the sum of the bias terms written into the residual stream before `layer`
        (its MLP input too when `mlp_input`). Attention has no output bias here, so only MLP `b_out` counts."""
        if self.cfg.residual != "standard":
            raise ValueError(
                "accumulated_bias describes a running-sum residual stream; this model's residual is "
                f"{self.cfg.residual!r}"
            )
        total = torch.zeros(self.cfg.d_model, device=self.embed.W_E.device, dtype=self.embed.W_E.dtype)
        if include_mlp_biases and not self.cfg.attn_only and self.cfg.use_bias:
            for block in self.blocks[:layer]:
                total = total + block.mlp.b_out
        return total

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
                raise ValueError(
                    f"strings of tokens must all have the same length to form a batch, got {[len(r) for r in rows]}"
                )
            tokens = rows
        tokens = token_id_batch(tokens)
        if tokens.shape[-1] > self.cfg.n_ctx:
            raise ValueError(
                f"sequence length {tokens.shape[-1]} exceeds n_ctx={self.cfg.n_ctx}; truncate the input or "
                "build the model with a larger n_ctx"
            )
        if torch.compiler.is_compiling():
            # host values (`.item()`) would break a compiled graph: inside one the range check runs as an
            # assertion on the device, raising RuntimeError with this message when the step runs
            in_range = ((tokens >= 0) & (tokens < self.cfg.d_vocab)).all()
            torch._assert_async(
                in_range, f"token ids must be in 0..{self.cfg.d_vocab - 1} (d_vocab={self.cfg.d_vocab})"
            )
            return tokens.to(device=self.embed.W_E.device, dtype=torch.long)
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            raise ValueError(
                f"token id {bad} is out of range for d_vocab={self.cfg.d_vocab} (valid ids 0..{self.cfg.d_vocab - 1})"
            )
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

        Residuals without depth attention use Full-style bookkeeping, one source per output: `[e, f_0, …, f_{j−1}]`
        (the standard residual weighs each 1; DenseFormer and mHC weigh them as `depth_mixing` computes).
        """
        if self.cfg.residual == "attnres":
            return source_layout(sublayer, self.cfg.n_sublayers, self.cfg.attnres_block_size, self.cfg.attnres_window)
        return source_layout(sublayer, self.cfg.n_sublayers, 1)

    def source_labels(self, sublayer: int) -> list[str]:
        """Short plot labels for the sources read by `sublayer`: 'emb', 'L3.attn', 'B2 (L2–L3)', 'partial'."""
        block_size = self.cfg.attnres_block_size if self.cfg.residual == "attnres" else 1
        labels = []
        for members in self.sources(sublayer):
            if members == [EMBEDDING]:
                labels.append("emb")
            elif block_size == 1:
                labels.append(self.sublayer_name(members[0]))
            elif len(members) < block_size:
                labels.append("partial")
            else:
                first, last = self._layer_kind(members[0])[0], self._layer_kind(members[-1])[0]
                span = f"L{first}" if first == last else f"L{first}–L{last}"
                labels.append(f"B{members[0] // block_size + 1} ({span})")  # blocks count from 1 (b_0 = e)
        return labels

    def sublayer_kind(self, sublayer: int) -> str:
        """'attn' or 'mlp' for sublayer j, 'final' for J (the final readout)."""
        return "final" if sublayer == self.cfg.n_sublayers else self._layer_kind(sublayer)[1]

    def sublayer_output_hook(self, sublayer: int) -> str:
        """Name of the hook holding f_j, the output of sublayer j."""
        layer, kind = self._layer_kind(sublayer)
        return get_act_name(f"{kind}_out", layer)

    def sublayer_input_hook(self, sublayer: int) -> str:
        """Name of the hook holding h_j, the input of sublayer j (before its own pre-norm)."""
        layer, kind = self._layer_kind(sublayer)
        return get_act_name("resid_pre" if kind == "attn" else "resid_mid", layer)

    def route_input_hook(self, consumer: int, route: str) -> str:
        """What `consumer`'s depth attention hands its sublayer: `sublayer_input_hook` (the readout's input for J)
        on the one route 'mix'. With `attnres_heads` > 1 each route mixes only its channel group, so no hook holds
        one route's whole mix."""
        routes = self.routes(consumer)
        if route != SINGLE_ROUTE:
            raise ValueError(
                f"route must be one of {routes}, got {route!r}"
                if route not in routes
                else f"route {route!r} mixes only its channel group of the input; read sublayer_input_hook instead"
            )
        return self.readout_input_hook if consumer == self.cfg.n_sublayers else self.sublayer_input_hook(consumer)

    def _layer_kind(self, sublayer: int) -> tuple[int, str]:
        if not 0 <= sublayer < self.cfg.n_sublayers:
            raise ValueError(f"sublayer must be in 0..{self.cfg.n_sublayers - 1}, got {sublayer}")
        if self.cfg.attn_only:
            return sublayer, "attn"
        return sublayer // 2, "attn" if sublayer % 2 == 0 else "mlp"

    def mixer_modules(self) -> dict[int, nn.Module]:
        """The module mixing each consumer's input (sublayer index, J = final): depth attention (AttnRes) or the
        hyper-connection and final head (mHC); empty for the standard residual and DenseFormer."""
        modules: dict[int, nn.Module] = {}
        for layer, block in enumerate(self.blocks):
            attn_mixer, mlp_mixer = block.mixers()
            if attn_mixer is None:
                return {}
            if self.cfg.attn_only:
                modules[layer] = attn_mixer
            else:
                modules[2 * layer], modules[2 * layer + 1] = attn_mixer, mlp_mixer
        modules[self.cfg.n_sublayers] = self.final_mixer()
        return modules

    def depth_attention_modules(self) -> dict[int, DepthAttention]:
        """Depth-attention module of each consumer (sublayer index, J = final); empty unless AttnRes."""
        return self.mixer_modules() if self.cfg.residual == "attnres" else {}

    # ------------------------------------------------------------------ the depth-mixing model protocol
    # (attnres_lens/protocol.py, docs/architecture.md §7): consumers are the AttnRes depth attentions
    @property
    def n_sublayers(self) -> int:
        """J, the number of sublayers (J itself is the final readout)."""
        return self.cfg.n_sublayers

    @property
    def d_vocab(self) -> int:
        """The vocabulary size of the logits."""
        return self.cfg.d_vocab

    @property
    def embedding_hooks(self) -> list[str]:
        """Hook names whose sum is e: the token embedding, plus the learned positions where the model has them."""
        return ["hook_embed", "hook_pos_embed"] if self.cfg.positional_embedding_type == "standard" else ["hook_embed"]

    @property
    def readout_input_hook(self) -> str:
        """Hook name of h_J, the final norm's input."""
        return "ln_final.hook_in"

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the unembedding applied to `[..., d_model]` (the final readout's input onwards)."""
        return self.unembed(self.ln_final(x))

    def frozen_readout(self, readout_input: torch.Tensor) -> FrozenReadout:
        """The readout as a linear map with `ln_final`'s scale frozen at `readout_input` (docs/analysis.md §11):
        the scale and the logits as the norm's explicit (hooked) path computes them."""
        norm = self.ln_final
        scale = (readout_input.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
        return FrozenReadout(
            gain=norm.w,
            scale=scale,
            unembedding=self.unembed.W_U,
            bias=self.unembed.b_U,
            logits=self.unembed(readout_input / scale * norm.w),
        )

    def consumers(self) -> list[int]:
        """The sublayers (and J) whose input is a depth-attention mix, in forward order: every one under AttnRes,
        none for the other residual kinds (their mixing is `attnres_lens.mixing`'s M)."""
        return sorted(self.depth_attention_modules())

    def routes(self, consumer: int) -> list[str]:
        """['mix'], or with `attnres_heads` H > 1 one softmax per channel group, ['h0', …, 'h{H−1}']."""
        self._depth_attention(consumer)
        heads = self.cfg.attnres_heads
        return [SINGLE_ROUTE] if heads == 1 else [f"h{head}" for head in range(heads)]

    def depth_hook(self, consumer: int, point: str) -> str:
        """Hook name of `point` ('logits', 'weights', 'logit_bias') of `consumer`'s depth attention. With
        `attnres_heads` > 1 the logits and weights have a route axis, [batch, pos, heads, n_src]; the logit bias
        stays [batch, pos, n_src], added to every head (docs/hooks.md §2)."""
        check_depth_point(point)
        return getattr(self._depth_attention(consumer), f"hook_{point}").name

    def _depth_attention(self, consumer: int) -> DepthAttention:
        modules = self.depth_attention_modules()
        if consumer not in modules:
            if not modules:
                raise ValueError(
                    f"a residual={self.cfg.residual!r} model has no depth attention, so no consumer {consumer!r}"
                )
            raise ValueError(
                f"consumer must be one of {sorted(modules)} (J = {self.cfg.n_sublayers}), got {consumer!r}"
            )
        return modules[consumer]

    def post_layer_hook(self, layer: int) -> str:
        """Name of the hook showing the residual state after `layer` (what it is depends on the residual kind)."""
        return f"blocks.{layer}.{POST_LAYER_HOOK[self.cfg.residual]}"


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Cross-entropy of logits at t against token t+1; [batch, pos-1] if `per_token`, else the mean."""
    if tokens.shape[-1] < 2:
        raise ValueError(f"a next-token loss needs sequences of at least 2 tokens, got length {tokens.shape[-1]}")
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


def adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.AdamW:
    """AdamW over `param_groups`, fused (one kernel call for all tensors) on the CPU and CUDA. PyTorch's default
    on the CPU is a Python loop of several ops per parameter tensor, and AttnRes adds two tensors per sublayer
    (docs/kernels.md §11 has the timings)."""
    first = next((p for p in model.parameters() if p.requires_grad), None)
    if first is None:
        raise ValueError(
            f"adamw needs a model with trainable parameters; {type(model).__name__} has none "
            "(all frozen or none at all)"
        )
    return torch.optim.AdamW(
        param_groups(model, weight_decay), lr=lr, betas=betas, fused=first.device.type in ("cpu", "cuda")
    )
