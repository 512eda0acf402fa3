"""DeepSeek V4 from transformers: its mHC residual as a TransformerLens `HookedRootModule` (docs/interop.md §7,
"DeepSeek V4").

DeepSeek V4 keeps `hc_mult` = n residual streams per token (manifold-constrained hyper-connections, docs/model.md
§13): before each sublayer a `DeepseekV4HyperConnection` computes from the streams read weights `pre`, write weights
`post` and a doubly stochastic stream mix `comb`; the sublayer reads `h = Σ_k pre_k X_k` and the streams become
`combᵀ X + post ⊗ f`. There is no depth softmax, so the depth-mixing protocol's `consumers()` is empty and the
mixing is M (docs/analysis.md §5), which `DeepseekV4Bridge.mixing_coefficients` computes from the hooked weights;
`frozen_readout` gives the direct logit attribution the final norm and `lm_head`, `hc_head`'s read weights frozen in
M's row J.

The bridge holds the model and copies no weights. On this instance only it replaces the forward of every decoder
layer, hyper-connection and the final head (`hc_head`) by the same arithmetic with hook points, so an edit of the
streams reaches both what the next sublayer reads and the residual it keeps (a hook on a module's input alone could
not). Everything else — embedding, attention with its compressors and indexer, MoE, masks, rotary — is transformers'
own code. The four-dimensional streams have their own hook names (`hook_streams`, `hook_streams_mid`); as in
TransformerLens's DeepSeek V4 adapter there is no `hook_resid_post`, which would suggest one running residual.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens.attnres import EMBEDDING
from attnres_lens.bridge import TransformersBridge, _checked_transformers
from attnres_lens.mhc import sinkhorn
from attnres_lens.mixing import basis_index
from attnres_lens.protocol import FrozenReadout

MODEL_TYPE = "deepseek_v4"
SUPPORTED_MODEL = "DeepseekV4ForCausalLM"


def is_deepseek_v4(model_or_dir: Any) -> bool:
    """Whether `model_or_dir` is a DeepSeek V4 model, or a folder whose config.json says so (by `model_type`)."""
    if isinstance(model_or_dir, (str, Path)):
        config_file = Path(model_or_dir) / "config.json"
        return config_file.is_file() and json.loads(config_file.read_text()).get("model_type") == MODEL_TYPE
    return getattr(getattr(model_or_dir, "config", None), "model_type", None) == MODEL_TYPE


def from_transformers_mhc(model_or_dir: nn.Module | str | Path, **load_kwargs: Any) -> DeepseekV4Bridge:
    """`attnres_lens.from_transformers` for DeepSeek V4: a `DeepseekV4ForCausalLM` or the folder one was saved to
    (opened with `DeepseekV4ForCausalLM.from_pretrained(folder, **load_kwargs)`)."""
    transformers = _checked_transformers()
    if isinstance(model_or_dir, (str, Path)):
        architectures = json.loads((Path(model_or_dir) / "config.json").read_text()).get("architectures") or []
        if SUPPORTED_MODEL not in architectures:
            raise TypeError(
                f"{str(model_or_dir)!r} holds a DeepSeek V4 {', '.join(architectures) or 'model of unnamed class'}; "
                f"from_transformers opens the causal LM, {SUPPORTED_MODEL} (save that class's model)"
            )
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(model_or_dir, **load_kwargs)
    else:
        if load_kwargs:
            raise ValueError(
                f"load_kwargs {sorted(load_kwargs)} apply only when opening a folder; got a loaded model "
                f"({type(model_or_dir).__name__}): pass its folder instead, or drop them"
            )
        model = model_or_dir
    if type(model).__name__ != SUPPORTED_MODEL:
        raise TypeError(
            f"from_transformers opens DeepSeek V4 as {SUPPORTED_MODEL} (the causal LM with its lm_head); got "
            f"{type(model).__name__}"
        )
    return DeepseekV4Bridge(model)


# ---------------------------------------------------------------------------------------------------- hook modules
class ConnectionHooks(nn.Module):
    """The weights of one hyper-connection (`attn_hc`, `mlp_hc`), named as on the toolkit's mHC model."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_read_weights = HookPoint()  # [batch, pos, n] pre: how much the sublayer reads from each stream
        self.hook_write_weights = HookPoint()  # [batch, pos, n] post: how much of its output each stream gets
        self.hook_stream_mix = HookPoint()  # [batch, pos, n, n] comb: X ← combᵀ X + post ⊗ f


class MHCLayerHooks(nn.Module):
    """`blocks.{l}`: hook points of one DeepSeek V4 decoder layer, in the order they fire."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_hc = ConnectionHooks()
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model] h_j of the attention: Σ_k pre_k X_k
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model] f_j: the attention's output
        self.hook_streams_mid = HookPoint()  # [batch, pos, n, d_model] the streams after the attention's write
        self.mlp_hc = ConnectionHooks()
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model] h_j of the MoE
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model] f_j: the MoE's output (routed + shared experts)
        self.hook_streams = HookPoint()  # [batch, pos, n, d_model] the streams after the layer: the next one's input


class FinalHeadHooks(nn.Module):
    """`final_hc`: the read weights of transformers' `hc_head`, which collapses the streams before the final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_read_weights = HookPoint()  # [batch, pos, n]


class FinalNormHooks(nn.Module):
    """`ln_final`: the final norm's input, as on the toolkit's model (the norm itself is transformers')."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_in = HookPoint()  # [batch, pos, d_model] h_J: the head's collapse of the streams


# ---------------------------------------------------------------------------------------------------- the bridge
class DeepseekV4Bridge(TransformersBridge):
    """A DeepSeek V4 causal LM with the toolkit's mHC hook names and the depth-mixing model protocol
    (docs/architecture.md §7, docs/interop.md §7). Build it with `attnres_lens.from_transformers`."""

    def __init__(self, hf_model: nn.Module):
        super().__init__(hf_model)
        text_model = hf_model.model
        self.n_streams: int = self.config.hc_mult
        self.blocks = nn.ModuleList(MHCLayerHooks() for _ in text_model.layers)
        self.final_hc = FinalHeadHooks()
        self.ln_final = FinalNormHooks()
        self.hook_embed = HookPoint()  # [batch, pos, d_model] e: the token embedding, copied into every stream
        text_model.embed_tokens.register_forward_hook(lambda _m, _a, out: self.hook_embed(out))
        for layer, decoder_layer in enumerate(text_model.layers):
            hooks = self.blocks[layer]
            decoder_layer.attn_hc.forward = _connection_forward(decoder_layer.attn_hc, hooks.attn_hc)
            decoder_layer.ffn_hc.forward = _connection_forward(decoder_layer.ffn_hc, hooks.mlp_hc)
            decoder_layer.forward = _layer_forward(decoder_layer, hooks)
        text_model.hc_head.forward = _head_forward(text_model.hc_head, self.final_hc, self.ln_final)
        self.setup()

    # ------------------------------------------------------------------ forward and readout
    def forward(
        self,
        tokens: Any,
        return_type: Literal["logits", "loss", "both"] | None = "logits",
        loss_per_token: bool = False,
    ) -> Any:
        """Logits `[batch, pos, d_vocab]` of transformers' own forward (no cache), or the next-token loss."""
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be one of 'logits', 'loss', 'both', None; got {return_type!r}")
        tokens = self.to_tokens(tokens)
        logits = self.hf_model(input_ids=tokens, use_cache=False).logits
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        from attnres_lens.model import next_token_loss

        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and `lm_head`, as transformers applies them after `hc_head`, to `[..., d_model]`."""
        return self.hf_model.lm_head(self.hf_model.model.norm(x))

    def frozen_readout(self, readout_input: torch.Tensor) -> FrozenReadout:
        """The readout after `hc_head` as a linear map, the final norm's (`DeepseekV4RMSNorm`) scale frozen at
        `readout_input` (h_J, `ln_final.hook_in`): `lm_head(g ⊙ x / σ)`, σ = sqrt(mean(x²) + ε) in float32 as
        transformers computes it. DeepSeek V4 has no soft-cap or logit scaling after `lm_head`, so `logits` are the
        model's own logits, in its dtype.

        `hc_head` collapses the streams into h_J with read weights computed from the streams themselves; the direct
        logit attribution freezes them at the pass as it freezes σ: they are M's row J (`mixing_coefficients`), so
        `h_J = M[J, e] e + Σ_i M[J, i] f_i` and each source's term is linear in it (docs/analysis.md §11)."""
        norm, lm_head = self.hf_model.model.norm, self.hf_model.lm_head
        scale = (readout_input.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
        return FrozenReadout(
            gain=norm.weight,
            scale=scale,
            unembedding=lm_head.weight.T,
            bias=lm_head.bias,
            logits=self.readout(readout_input),
        )

    # ------------------------------------------------------------------ depth structure (the protocol)
    @property
    def n_sublayers(self) -> int:
        return 2 * len(self.blocks)

    def _check_sublayer(self, sublayer: int, final: bool = False) -> None:
        last = self.n_sublayers if final else self.n_sublayers - 1
        if not 0 <= sublayer <= last:
            raise ValueError(f"sublayer must be in 0..{last}, got {sublayer}")

    def sublayer_name(self, sublayer: int) -> str:
        """'L{l}.attn' / 'L{l}.mlp'; 'final' for J."""
        self._check_sublayer(sublayer, final=True)
        if sublayer == self.n_sublayers:
            return "final"
        return f"L{sublayer // 2}.{self.sublayer_kind(sublayer)}"

    def sublayer_kind(self, sublayer: int) -> str:
        self._check_sublayer(sublayer, final=True)
        return "final" if sublayer == self.n_sublayers else ("attn", "mlp")[sublayer % 2]

    def sublayer_input_hook(self, sublayer: int) -> str:
        """h_j, the read-weighted sum of the streams before the sublayer's pre-norm (`ln_final.hook_in` for J)."""
        self._check_sublayer(sublayer, final=True)
        if sublayer == self.n_sublayers:
            return self.readout_input_hook
        return f"blocks.{sublayer // 2}." + ("hook_resid_pre" if sublayer % 2 == 0 else "hook_resid_mid")

    def sublayer_output_hook(self, sublayer: int) -> str:
        """f_j, what the sublayer writes (times its write weights) into every stream."""
        self._check_sublayer(sublayer)
        return f"blocks.{sublayer // 2}.hook_{self.sublayer_kind(sublayer)}_out"

    def consumers(self) -> list[int]:
        """None: mHC mixes by read, write and stream-mix weights, not a depth softmax (its mixing is M)."""
        return []

    def sources(self, consumer: int) -> list[list[int]]:
        """One source per earlier output, `[[EMBEDDING], [0], …, [c−1]]`, as the toolkit's mHC model: the streams
        carry every earlier output, weighted as `mixing_coefficients` computes."""
        self._check_sublayer(consumer, final=True)
        return [[EMBEDDING], *([j] for j in range(consumer))]

    def source_labels(self, consumer: int) -> list[str]:
        return ["emb", *(self.sublayer_name(j) for j in range(consumer))]

    def routes(self, consumer: int) -> list[str]:
        raise ValueError(self._no_depth_softmax(consumer))

    def depth_hook(self, consumer: int, point: str) -> str:
        raise ValueError(self._no_depth_softmax(consumer))

    def route_input_hook(self, consumer: int, route: str) -> str:
        """Refused as `routes` is: no consumer, so no route (the input of sublayer j is `sublayer_input_hook(j)`)."""
        raise ValueError(self._no_depth_softmax(consumer))

    def _no_depth_softmax(self, consumer: int) -> str:
        return (
            f"a DeepSeek V4 (mHC) model has no depth softmax, so no consumer {consumer!r}: its mixing is "
            "mixing_coefficients(tokens), from the hyper-connections' hook_read_weights, hook_write_weights and "
            "hook_stream_mix"
        )

    # ------------------------------------------------------------------ M
    def connection_hooks(self, sublayer: int) -> ConnectionHooks | FinalHeadHooks:
        """The hyper-connection hooks that read sublayer j's input (`final_hc` for J)."""
        self._check_sublayer(sublayer, final=True)
        if sublayer == self.n_sublayers:
            return self.final_hc
        return getattr(self.blocks[sublayer // 2], ("attn_hc", "mlp_hc")[sublayer % 2])

    @torch.no_grad()
    def mixing_coefficients(self, tokens: Any) -> torch.Tensor:
        """M per token, `[batch, pos, J+1, J+1]` in `attnres_lens.mixing.mixing_coefficients`'s layout (row c = the
        input of sublayer c, J the final norm's input; column 0 = e, 1 + i = f_i), fp32, or fp64 for a float64
        model: every stream starts as e, sublayer j's input is `Σ_k pre_k C_k`, and its update moves the streams'
        coefficients as `C ← combᵀ C + post ⊗ [f_j]` (docs/analysis.md §5)."""
        tokens = self.to_tokens(tokens)
        n = self.n_sublayers + 1
        names = [self.connection_hooks(c).hook_read_weights.name for c in range(n)]
        names += [name for c in range(n - 1) for name in self._update_hooks(c)]
        saved: dict[str, torch.Tensor] = {}

        def save(tensor: torch.Tensor, hook: HookPoint) -> None:
            saved[hook.name] = tensor.detach()

        self.run_with_hooks(tokens, return_type=None, fwd_hooks=[(name, save) for name in names])
        like = dict(
            dtype=torch.promote_types(self.hf_model.model.embed_tokens.weight.dtype, torch.float32),
            device=tokens.device,
        )
        streams = torch.zeros(*tokens.shape, self.n_streams, n, **like)  # each stream's coefficients
        streams[..., basis_index(EMBEDDING)] = 1.0
        coefficients = torch.zeros(*tokens.shape, n, n, **like)
        for consumer in range(n):
            read = saved[names[consumer]].to(**like)
            coefficients[..., consumer, :] = (read.unsqueeze(-1) * streams).sum(-2)
            if consumer < n - 1:
                write, mix = (saved[name].to(**like) for name in self._update_hooks(consumer))
                streams = mix.transpose(-1, -2) @ streams
                streams[..., basis_index(consumer)] += write
        return coefficients

    def _update_hooks(self, sublayer: int) -> tuple[str, str]:
        hooks = self.connection_hooks(sublayer)
        return hooks.hook_write_weights.name, hooks.hook_stream_mix.name


# ---------------------------------------------------------------------------------------------------- forwards
# Each repeats transformers 5.25.0's arithmetic (modeling_deepseek_v4.py) operation for operation, with hook points
# between the steps: unhooked, the values are transformers' own.
def _connection_forward(connection: nn.Module, hooks: ConnectionHooks) -> Callable:
    """`DeepseekV4HyperConnection.forward`: `(post, comb, collapsed)` from the streams, with the weights hooked."""

    def forward(hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = connection.hc_mult
        flattened = connection.input_norm(hidden_streams.flatten(2).float())
        raw = F.linear(flattened, connection.fn.float())
        pre_w, post_w, comb_w = raw.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = connection.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = connection.scale.unbind(0)
        pre = hooks.hook_read_weights(torch.sigmoid(pre_w * pre_scale + pre_b) + connection.hc_eps)
        post = hooks.hook_write_weights(2 * torch.sigmoid(post_w * post_scale + post_b))
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n), dim=-1)
        comb = sinkhorn(comb + connection.hc_eps, connection.hc_sinkhorn_iters, connection.hc_eps)
        comb = hooks.hook_stream_mix(comb)
        collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
        return post, comb, collapsed

    return forward


def _layer_forward(layer: nn.Module, hooks: MHCLayerHooks) -> Callable:
    """`DeepseekV4DecoderLayer.forward`, with the sublayers' inputs and outputs and the streams hooked."""

    def write(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )

    def forward(hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        post, comb, collapsed = layer.attn_hc(hidden_states)
        attn_output, _ = layer.self_attn(layer.input_layernorm(hooks.hook_resid_pre(collapsed)), **kwargs)
        hidden_states = hooks.hook_streams_mid(write(hidden_states, post, comb, hooks.hook_attn_out(attn_output)))
        post, comb, collapsed = layer.ffn_hc(hidden_states)
        mlp_output = layer.mlp(layer.post_attention_layernorm(hooks.hook_resid_mid(collapsed)), input_ids=input_ids)
        return hooks.hook_streams(write(hidden_states, post, comb, hooks.hook_mlp_out(mlp_output)))

    return forward


def _head_forward(head: nn.Module, hooks: FinalHeadHooks, final_norm: FinalNormHooks) -> Callable:
    """`DeepseekV4HyperHead.forward`: the streams collapsed by the head's read weights, the final norm's input."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = head.input_norm(x.flatten(2).float())
        mixes = F.linear(flat, head.hc_fn.float())
        pre = hooks.hook_read_weights(torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps)
        return final_norm.hook_in((pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype))

    return forward
