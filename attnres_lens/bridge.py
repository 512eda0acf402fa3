"""`from_transformers`: the Block-AttnRes models of transformers as a TransformerLens `HookedRootModule`
(docs/interop.md §7).

The bridge holds the transformers model and adds no weights: its parameters are the model's. It replaces, on this
instance only, the forward of every depth consumer (`attention_input`, `mlp_input`, `final_input`, and the loop's
`message_input`) by `DepthMix`, which computes the same mix with hook points, and attaches PyTorch hooks for the
sublayer outputs, the embedding and the token attention. The transformers model's own forward still runs the layers,
so masks, convolutions, gates and the loop schedule stay transformers' own.

Visits: a looped layer (Inkling-2-Mini's core) runs `loop_num_passes` times; each pass is a visit v = 1, 2, … with
its own hook points under `blocks.{l}.visit{v}.` and its own sublayer indices ('L3.attn@2').
"""

from __future__ import annotations

import copy
import json
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformer_lens import ActivationCache
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from attnres_lens.attnres import EMBEDDING
from attnres_lens.hook_checks import any_hooked, is_hooked
from attnres_lens.kernels import depth_attention
from attnres_lens.kernels.reference import depth_logits, mix_sources
from attnres_lens.protocol import SINGLE_ROUTE, FrozenReadout, check_depth_point, token_id_batch

TRANSFORMERS_VERSION = "5.25.0"  # the version whose Inkling model code the bridge mirrors (pyproject.toml pins it)
SUPPORTED_MODELS = ("Inkling2ForCausalLM", "Inkling2LoopForCausalLM")
EVERY_SUPPORTED_MODEL = ", ".join((*SUPPORTED_MODELS, "DeepseekV4ForCausalLM"))  # the last one opens in bridge_mhc
FULL_ATTENTION_ROUTES = ("q", "k", "v")  # the three inputs of a full-attention layer, one query each
MESSAGE_ROUTES = ("q", "k", "v", "mlp")  # the loop's four messages per looped layer
_HOOKED_ATTENTION = "attnres_lens_hooked_eager"  # our name in transformers' AttentionInterface


def from_transformers(model_or_dir: nn.Module | str | Path, **load_kwargs: Any) -> HookedRootModule:
    """Wrap an `Inkling2ForCausalLM` / `Inkling2LoopForCausalLM` (or the folder one was saved to) in hook points;
    a `DeepseekV4ForCausalLM` goes to `bridge_mhc` (docs/interop.md §7).

    A folder is opened with the model class's `from_pretrained(folder, **load_kwargs)`. The model is held, not
    copied, and its consumers' forwards are replaced on this instance (its own forward then still gives the same
    logits). Refuses another transformers version than the pinned one, other model types and bad paths by name.
    """
    from attnres_lens.bridge_mhc import from_transformers_mhc, is_deepseek_v4  # it imports this module

    if is_deepseek_v4(model_or_dir):
        return from_transformers_mhc(model_or_dir, **load_kwargs)
    transformers = _checked_transformers()
    if isinstance(model_or_dir, (str, Path)):
        model = _load(Path(model_or_dir), load_kwargs, transformers)
    else:
        if load_kwargs:
            raise ValueError(
                f"load_kwargs {sorted(load_kwargs)} apply only when opening a folder; got a loaded model "
                f"({type(model_or_dir).__name__}): pass its folder instead, or drop them"
            )
        model = model_or_dir
    if type(model).__name__ not in SUPPORTED_MODELS:
        raise TypeError(
            f"from_transformers supports {EVERY_SUPPORTED_MODEL}; got {type(model).__name__} (text models "
            "only: the vision-language Inkling2ForConditionalGeneration and its Loop variant are out of scope)"
        )
    return InklingBridge(model)


def _checked_transformers() -> Any:
    import transformers

    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise RuntimeError(
            f"the transformers bridge mirrors transformers {TRANSFORMERS_VERSION}'s Inkling model code, but "
            f"transformers {transformers.__version__} is installed: pip install transformers=={TRANSFORMERS_VERSION}"
        )
    return transformers


def _load(folder: Path, load_kwargs: dict[str, Any], transformers: Any) -> nn.Module:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is not a transformers model folder (no config.json there); pass the folder "
            "save_pretrained wrote, or a loaded model"
        )
    config = json.loads(config_file.read_text())
    if isinstance(config, dict) and {"model", "task", "train"} <= set(config):
        raise TypeError(
            f"{str(folder)!r} is an attnres_lens run directory, not a transformers model folder; open it with "
            "attnres_lens.load_run (its .model is the bridged model of a run import-hf made)"
        )
    architectures = config.get("architectures") or []
    supported = [name for name in architectures if name in SUPPORTED_MODELS]
    if not supported:
        raise TypeError(
            f"{str(folder)!r} holds a {', '.join(architectures) or 'model of unnamed architecture'}; "
            f"from_transformers supports {EVERY_SUPPORTED_MODEL}"
        )
    return getattr(transformers, supported[0]).from_pretrained(folder, **load_kwargs)


# ---------------------------------------------------------------------------------------------------- depth mix
class DepthMix(nn.Module):
    """One depth consumer's hook points (docs/interop.md §7). `R` routes: one for a single query, else a route axis."""

    hook_points = ("hook_logit_bias", "hook_logits", "hook_weights")

    def __init__(self, routes: tuple[str, ...]):
        super().__init__()
        self.routes = routes
        self.hook_logit_bias = HookPoint()  # [batch, pos, n_src] ([batch, pos, route, n_src]); fires only when hooked
        self.hook_logits = HookPoint()  # [batch, pos, n_src] ([batch, pos, route, n_src] with several routes)
        self.hook_weights = HookPoint()  # same shape as hook_logits

    def _squeezed(self, x: torch.Tensor) -> torch.Tensor:
        return x.squeeze(-2) if len(self.routes) == 1 else x

    def _unsqueezed(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-2) if len(self.routes) == 1 else x

    def mix(self, sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
        """Inkling's depth attention, `[..., R, D]` in fp32 from sources `[..., D]` and queries `[R, D]`: keys and
        values are the sources after an RMSNorm without gain, logits `q · k / √D`, softmax and mix in fp32
        (docs/interop.md §7). Unhooked it is one call of the depth op; hooked, the op's readable steps with the
        logit bias, logits and weights passing through this consumer's hook points."""
        sources = [source.float() for source in sources]  # transformers mixes in fp32 whatever the model's dtype
        query = query.float()
        scale = sources[0].shape[-1] ** -0.5
        if not any_hooked(self, self.hook_points):
            return depth_attention(sources, query, None, eps, logit_scale=scale, normalize_values=True)
        logits = depth_logits(sources, query, None, eps, scale)  # [..., R, n_src]
        if is_hooked(self.hook_logit_bias):
            bias = self.hook_logit_bias(torch.zeros_like(self._squeezed(logits)))
            logits = logits + self._unsqueezed(bias).to(logits.dtype)
        logits = self._unsqueezed(self.hook_logits(self._squeezed(logits)))
        weights = self._unsqueezed(self.hook_weights(self._squeezed(torch.softmax(logits, dim=-1))))
        # mix_sources takes the route as a leading dim: [R, ..., S] -> [R, ..., D] -> [..., R, D]
        return mix_sources(weights.movedim(-2, 0), sources, normalize_values=True, eps=eps).movedim(0, -2)


class MessageMix(DepthMix):
    """The loop's message consumer of one looped layer's visit: four routes, and the messages it returns."""

    def __init__(self) -> None:
        super().__init__(MESSAGE_ROUTES)
        self.hook_out = HookPoint()  # [batch, pos, route, d_model] the messages, before the layer's tanh gates


class AttentionHooks(nn.Module):
    """Token attention of one layer visit, read from transformers' projections and eager attention."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_q = HookPoint()  # [batch, pos, head_index, d_head] after the query's L2 clip and scale
        self.hook_k = HookPoint()  # [batch, pos, head_index_kv, d_head] after the key's short conv and L2 clip
        self.hook_v = HookPoint()  # [batch, pos, head_index_kv, d_head] after the value's short conv and RMSNorm
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos] softmax weights (sink dropped)


class LayerHooks(nn.Module):
    """Hook points of one decoder layer (of one visit of a looped layer)."""

    def __init__(self, layer: int, full_attention: bool, visit: int | None):
        super().__init__()
        routes = FULL_ATTENTION_ROUTES if full_attention else (SINGLE_ROUTE,)
        self.full_attention = full_attention
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model] attention input h_j ('q' route's mix if full)
        if full_attention:
            self.hook_resid_pre_k = HookPoint()  # [batch, pos, d_model] the key projection's input mix
            self.hook_resid_pre_v = HookPoint()  # [batch, pos, d_model] the value projection's input mix
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model] f_j: attention output after its short conv
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model] MLP input h_j (the mlp_res mix)
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model] f_j: MoE output after its short conv
        self.hook_block_partial = HookPoint()  # [batch, pos, d_model] the open block's sum after this layer
        if layer > 0:  # layer 0 reads the embedding directly
            self.attn_res = DepthMix(routes)
        self.mlp_res = DepthMix((SINGLE_ROUTE,))
        if visit is not None and visit > 1:
            self.msg_res = MessageMix()
            # the layer's true pre-norm inputs on a later visit: each route's message gate applied to the mix
            # (a sliding layer's one mix feeds three gates, so its k and v inputs differ from its q input too)
            self.hook_gated_q = HookPoint()  # [batch, pos, d_model] the query's input: the attention's h_j
            self.hook_gated_k = HookPoint()  # [batch, pos, d_model]
            self.hook_gated_v = HookPoint()  # [batch, pos, d_model]
            self.hook_gated_mlp = HookPoint()  # [batch, pos, d_model] the MLP's input h_j
        self.attn = AttentionHooks()

    def input_hooks(self) -> tuple[HookPoint, ...]:
        if self.full_attention:
            return (self.hook_resid_pre, self.hook_resid_pre_k, self.hook_resid_pre_v)
        return (self.hook_resid_pre,)


class LoopedLayerHooks(nn.Module):
    """`blocks.{l}` of a looped layer: one `LayerHooks` per visit, `visit1`, `visit2`, …"""

    def __init__(self, layer: int, full_attention: bool, n_visits: int):
        super().__init__()
        for visit in range(1, n_visits + 1):
            self.add_module(f"visit{visit}", LayerHooks(layer, full_attention, visit))


class FinalNormHooks(nn.Module):
    """`ln_final`: the final norm's input, as on the toolkit's model (the norm itself is transformers')."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_in = HookPoint()  # [batch, pos, d_model] the readout's input: the final depth mix's output


# ---------------------------------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class LayerVisit:
    """One run of a decoder layer: sublayers `2 * index` (attention) and `2 * index + 1` (MLP)."""

    index: int
    layer: int
    visit: int | None  # 1-based pass of a looped layer, None for a layer that runs once

    @property
    def suffix(self) -> str:
        return "" if self.visit is None else f"@{self.visit}"


def _schedule(config: Any) -> list[LayerVisit]:
    """The text model's layer order: pre-loop layers, each pass of the loop core, post-loop layers."""
    n_layers = config.num_hidden_layers
    start, end, passes = (
        (config.loop_layer_index_start, config.loop_layer_index_end, config.loop_num_passes)
        if hasattr(config, "loop_num_passes")
        else (n_layers, n_layers, 1)
    )
    order: list[tuple[int, int | None]] = [(layer, None) for layer in range(start)]
    order += [(layer, visit) for visit in range(1, passes + 1) for layer in range(start, end)]
    order += [(layer, None) for layer in range(end, n_layers)]
    return [LayerVisit(index, layer, visit) for index, (layer, visit) in enumerate(order)]


def _trace_sources(config: Any, visits: list[LayerVisit]) -> dict[int | str, list[list[int]]]:
    """Each consumer's sources as sublayer-index lists, following the text model's bookkeeping step by step:
    a layer at a block boundary closes the partial sum it received into `block_states` (after its attention
    reads it); the loop's later passes restart from the pre-loop state and message the previous pass's loop blocks."""
    per_block = config.n_layers_per_attn_res_block
    sources: dict[int | str, list[list[int]]] = {}
    blocks: list[list[int]] = []
    partial = [EMBEDDING]
    start = getattr(config, "loop_layer_index_start", None)
    saved: tuple[list[list[int]], list[int]] | None = None
    previous: list[list[int]] = []
    for step in visits:
        boundary = step.layer % per_block == 0
        if step.visit is not None and step.layer == start:
            if step.visit == 1:
                saved = (blocks, partial)
            else:  # the previous pass's loop blocks (its first appended state is the pre-loop block: skipped)
                previous = blocks[len(saved[0]) + 1 :] + [partial]
                blocks, partial = saved
        if step.visit is not None and step.visit > 1:
            sources[message_key(step)] = previous
        attn, mlp = 2 * step.index, 2 * step.index + 1
        if step.layer > 0:
            sources[attn] = [*blocks, partial]
        local_blocks, running = ([*blocks, partial], [attn]) if boundary else (blocks, [*partial, attn])
        sources[mlp] = [*local_blocks, running]
        if boundary:
            blocks = [*blocks, partial]
        partial = [*running, mlp]
    sources[2 * len(visits)] = [*blocks, partial]
    return sources


def message_key(step: LayerVisit) -> str:
    return f"L{step.layer}.msg{step.suffix}"


# ---------------------------------------------------------------------------------------------------- the bridge
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose forwards a bridge replaced
_PATTERN_HOOKS = "_attnres_lens_attention_hooks"  # the attribute of an attention module naming its hook points


class TransformersBridge(HookedRootModule):
    """What every bridge to a transformers causal LM shares (docs/interop.md §7): it holds the model (registered,
    so one model is never wrapped twice: a bridge replaces forwards on that instance), checks token ids against the
    unembedding, and names the readout's and the embedding's hooks (neither Inkling nor DeepSeek V4 has learned
    positions, so e is `hook_embed` alone)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        if hf_model in _WRAPPED:
            raise ValueError(
                f"this {type(hf_model).__name__} is already wrapped by a bridge (its forwards are that bridge's): "
                "use that bridge, or open the folder again for a second one"
            )
        _WRAPPED.add(hf_model)
        self.hf_model = hf_model
        self.config = hf_model.config

    @property
    def d_vocab(self) -> int:
        return self.hf_model.lm_head.out_features

    @property
    def readout_input_hook(self) -> str:
        return "ln_final.hook_in"

    @property
    def embedding_hooks(self) -> list[str]:
        return ["hook_embed"]

    def to_tokens(self, tokens: Any) -> torch.Tensor:
        """`[batch, pos]` int64 ids on the model's device from a tensor, a (nested) list of ids or a string of
        space-separated ids, checked against d_vocab (the unembedding's rows; the embedding's padding rows are never
        a valid input)."""
        tokens = token_id_batch(tokens, ": tokenize text with the model's tokenizer first")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.d_vocab:
            raise ValueError(
                f"token id {low if low < 0 else high} is out of range for d_vocab={self.d_vocab} "
                f"(valid ids 0..{self.d_vocab - 1})"
            )
        return tokens.to(device=self.hf_model.lm_head.weight.device, dtype=torch.long)


class InklingBridge(TransformersBridge):
    """An Inkling-2 / Inkling-2-Mini text model with the toolkit's hook names and the depth-mixing model protocol
    (docs/architecture.md §7, docs/interop.md §7). Build it with `attnres_lens.from_transformers`."""

    def __init__(self, hf_model: nn.Module):
        config = hf_model.config
        if config._attn_implementation not in (None, "eager"):
            raise ValueError(
                f"the bridge reads Inkling's eager attention; this model uses {config._attn_implementation!r}: "
                "load it with attn_implementation='eager'"
            )
        super().__init__(hf_model)
        self.block_size_layers: int = config.n_layers_per_attn_res_block
        self.visits = _schedule(config)
        n_layers = config.num_hidden_layers
        text_model = hf_model.model
        self._layer_visits = {layer: [s for s in self.visits if s.layer == layer] for layer in range(n_layers)}
        self._visit_count = [0] * n_layers
        self._looped = {layer for layer, steps in self._layer_visits.items() if steps[0].visit is not None}
        blocks = []
        for layer, decoder_layer in enumerate(text_model.layers):
            full = decoder_layer.attention_type == "full_attention"
            steps = self._layer_visits[layer]
            blocks.append(
                LoopedLayerHooks(layer, full, len(steps)) if layer in self._looped else LayerHooks(layer, full, None)
            )
        self.blocks = nn.ModuleList(blocks)
        self.final_res = DepthMix((SINGLE_ROUTE,))
        self.ln_final = FinalNormHooks()
        self.hook_embed = HookPoint()  # [batch, pos, d_model] the normed embedding e = b_0
        self._sources = _trace_sources(config, self.visits)
        self._install(text_model)
        self.setup()

    # ------------------------------------------------------------------ installation
    def _install(self, text_model: nn.Module) -> None:
        text_model.embed_tokens.register_forward_hook(lambda _m, _a, out: self.hook_embed(out))
        for layer, decoder_layer in enumerate(text_model.layers):
            decoder_layer.register_forward_pre_hook(self._visit_counter(layer))
            decoder_layer.register_forward_hook(self._output_hook(layer, "hook_block_partial"))
            if decoder_layer.attention_input is not None:
                decoder_layer.attention_input.forward = self._consumer_forward(layer, "attn_res")
            else:  # layer 0: the attention reads the embedding through its pre-norms
                norms = ("q_input_layernorm", "k_input_layernorm", "v_input_layernorm")
                names = norms if decoder_layer.attention_type == "full_attention" else ("input_layernorm",)
                for route, name in enumerate(names):
                    getattr(decoder_layer, name).register_forward_pre_hook(self._layer0_input(route))
            decoder_layer.mlp_input.forward = self._consumer_forward(layer, "mlp_res")
            for conv, hook in (
                ("post_attention_convolution", "hook_attn_out"),
                ("post_mlp_convolution", "hook_mlp_out"),
            ):
                getattr(decoder_layer, conv).register_forward_hook(self._output_hook(layer, hook))
            self._install_attention(layer, decoder_layer.self_attn)
            for route in MESSAGE_ROUTES if hasattr(decoder_layer, "q_message_gate") else ():
                gate = getattr(decoder_layer, f"{route}_message_gate")
                gate.register_forward_hook(self._output_hook(layer, f"hook_gated_{route}"))
        text_model.final_input.forward = self._final_forward(text_model.final_input)
        if hasattr(text_model, "message_input"):
            text_model.message_input.forward = self._message_forward(text_model.message_input)

    def _install_attention(self, layer: int, attention: nn.Module) -> None:
        for name, hook in (("q_proj", "hook_q"), ("k_proj", "hook_k"), ("v_proj", "hook_v")):
            getattr(attention, name).register_forward_hook(self._head_hook(layer, hook))
        # the pattern hook needs the eager attention to pass through our function: this module alone gets a config
        # naming it (the model's config, and every other module, keep theirs)
        _register_hooked_attention()
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation = _HOOKED_ATTENTION
        # on the module, not in a global table: the bridge then lives exactly as long as the model it changed
        setattr(attention, _PATTERN_HOOKS, lambda: self.layer_hooks(layer, self._current_visit(layer)).attn)

    def _visit_counter(self, layer: int) -> Callable:
        def count(_module: nn.Module, _args: Any) -> None:
            if layer == 0:  # layer 0 runs first and once: a new forward
                self._visit_count = [0] * len(self._visit_count)
            self._visit_count[layer] += 1

        return count

    def _current_visit(self, layer: int) -> int | None:
        return self._visit_count[layer] if layer in self._looped else None

    def layer_hooks(self, layer: int, visit: int | None = None) -> LayerHooks:
        """The hook container of `layer` (of its `visit` when looped: 1, 2, …)."""
        block = self.blocks[layer]
        if isinstance(block, LoopedLayerHooks):
            if visit is None or not 1 <= visit <= len(self._layer_visits[layer]):
                raise ValueError(
                    f"layer {layer} is looped {len(self._layer_visits[layer])} times: give visit 1.."
                    f"{len(self._layer_visits[layer])}, got {visit!r}"
                )
            return getattr(block, f"visit{visit}")
        if visit is not None:
            raise ValueError(f"layer {layer} runs once: it has no visit {visit} (pass visit=None)")
        return block

    def _consumer_forward(self, layer: int, which: str) -> Callable:
        module = self.hf_model.model.layers[layer]
        transformers_module = getattr(module, "attention_input" if which == "attn_res" else "mlp_input")

        def forward(block_states: torch.Tensor, partial_block_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
            hooks = self.layer_hooks(layer, self._current_visit(layer))
            sources = [*block_states.unbind(-2), partial_block_states]
            query = transformers_module.query.view(-1, block_states.shape[-1])
            mixed = getattr(hooks, which).mix(sources, query, transformers_module.norm.variance_epsilon)
            points = hooks.input_hooks() if which == "attn_res" else (hooks.hook_resid_mid,)
            return tuple(point(route) for point, route in zip(points, mixed.unbind(-2), strict=True))

        return forward

    def _layer0_input(self, route: int) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> tuple:
            return (self.layer_hooks(0).input_hooks()[route](args[0]), *args[1:])

        return hook

    def _output_hook(self, layer: int, name: str) -> Callable:
        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            return getattr(self.layer_hooks(layer, self._current_visit(layer)), name)(output)

        return hook

    def _head_hook(self, layer: int, name: str) -> Callable:
        def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            point = getattr(self.layer_hooks(layer, self._current_visit(layer)).attn, name)
            return point(output.transpose(1, 2)).transpose(1, 2)  # transformers' [b, head, pos, d] <-> TL's

        return hook

    def _final_forward(self, transformers_module: nn.Module) -> Callable:
        def forward(block_states: torch.Tensor, partial_block_states: torch.Tensor) -> tuple[torch.Tensor]:
            sources = [*block_states.unbind(-2), partial_block_states]
            query = transformers_module.query.view(1, -1)
            mixed = self.final_res.mix(sources, query, transformers_module.norm.variance_epsilon)
            return (self.ln_final.hook_in(mixed.squeeze(-2)),)

        return forward

    def _message_forward(self, transformers_module: nn.Module) -> Callable:
        start = self.config.loop_layer_index_start

        def forward(
            block_states: torch.Tensor, partial_block_states: torch.Tensor, loop_layer_idx: int
        ) -> torch.Tensor:
            layer = start + loop_layer_idx
            hooks = self.layer_hooks(layer, self._visit_count[layer] + 1).msg_res  # called before its layer runs
            sources = [*block_states.unbind(-2), partial_block_states]
            query = transformers_module.query[loop_layer_idx]
            return hooks.hook_out(hooks.mix(sources, query, transformers_module.norm.variance_epsilon))

        return forward

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
        if self._looped and self.hf_model.is_activation_checkpointing and self.hf_model.training:
            raise ValueError(
                "activation (gradient) checkpointing re-runs layers in the backward pass, which the bridge would "
                "count as more visits of the looped layers: call model.activation_checkpointing_disable() (or "
                "eval()) first"
            )
        tokens = self.to_tokens(tokens)
        logits = self.hf_model(input_ids=tokens, use_cache=False).logits
        if return_type is None:
            return None
        if return_type == "logits":
            return logits
        from attnres_lens.model import next_token_loss

        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def run_with_cache(
        self, *model_args: Any, remove_batch_dim: bool = False, **kwargs: Any
    ) -> tuple[Any, ActivationCache]:
        """`HookedRootModule.run_with_cache` with the cache as TransformerLens's `ActivationCache` (the toolkit's
        subclass, whose running-sum helpers refuse these depth-mixed inputs instead of misreading them)."""
        from attnres_lens.model import DepthActivationCache

        out, cache_dict = super().run_with_cache(*model_args, remove_batch_dim=remove_batch_dim, **kwargs)
        return out, DepthActivationCache(cache_dict, self, has_batch_dim=not remove_batch_dim)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, unembedding and logit soft-cap, as transformers applies them, to `[..., d_model]`."""
        text_model = self.hf_model.model
        normed = text_model.norm(x).to(text_model.embed_tokens.weight.dtype)
        return self.hf_model.logit_softcap(self.hf_model.lm_head(normed).float())

    def frozen_readout(self, readout_input: torch.Tensor) -> FrozenReadout:
        """The readout up to the unembedding as a linear map, the final norm's (`Inkling2RMSNorm`) scale frozen at
        `readout_input`: `lm_head(g ⊙ x / σ)`, σ = sqrt(mean(x²) + ε) in float32 as transformers computes it.
        The logit soft-cap comes after `lm_head` and is not linear: `logits` are the pre-cap logits (what
        `lm_head` returns), and a direct logit attribution splits those exactly (docs/analysis.md §11)."""
        text_model = self.hf_model.model
        norm, lm_head = text_model.norm, self.hf_model.lm_head
        x = readout_input.float()
        scale = (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
        normed = norm(readout_input).to(text_model.embed_tokens.weight.dtype)
        return FrozenReadout(
            gain=norm.weight,
            scale=scale,
            unembedding=lm_head.weight.T,
            bias=lm_head.bias,
            logits=lm_head(normed).float(),
        )

    # ------------------------------------------------------------------ depth structure (the protocol)
    @property
    def n_sublayers(self) -> int:
        return 2 * len(self.visits)

    @property
    def depth_logit_scale(self) -> float:
        """Inkling scales its depth logits by 1/√d_model (the paper and FLA: 1)."""
        return self.config.hidden_size**-0.5

    depth_values_normalized = True  # the mix sums RMS-normalised sources, not the raw ones

    def _visit_of(self, sublayer: int) -> tuple[LayerVisit, str]:
        if not 0 <= sublayer < self.n_sublayers:
            raise ValueError(f"sublayer must be in 0..{self.n_sublayers - 1}, got {sublayer}")
        return self.visits[sublayer // 2], "attn" if sublayer % 2 == 0 else "mlp"

    def sublayer_name(self, sublayer: int) -> str:
        """'L{l}.attn' / 'L{l}.mlp', with '@{visit}' on a looped layer; 'final' for J."""
        if sublayer == self.n_sublayers:
            return "final"
        step, kind = self._visit_of(sublayer)
        return f"L{step.layer}.{kind}{step.suffix}"

    def sublayer_kind(self, sublayer: int) -> str:
        return "final" if sublayer == self.n_sublayers else self._visit_of(sublayer)[1]

    def _prefix(self, step: LayerVisit) -> str:
        return f"blocks.{step.layer}." + ("" if step.visit is None else f"visit{step.visit}.")

    def sublayer_input_hook(self, sublayer: int) -> str:
        """h_j, the sublayer's input before its pre-norm: the consumer's mix output ('q' route on full-attention
        layers; layer 0's attention: the embedding), or on a looped layer's visits ≥ 2 the message gate's output
        (`hook_gated_q` / `hook_gated_mlp`; the mix itself is at `route_input_hook`)."""
        if sublayer == self.n_sublayers:
            return self.readout_input_hook
        step, kind = self._visit_of(sublayer)
        if step.visit is not None and step.visit > 1:
            return self._prefix(step) + ("hook_gated_q" if kind == "attn" else "hook_gated_mlp")
        return self._prefix(step) + ("hook_resid_pre" if kind == "attn" else "hook_resid_mid")

    def route_input_hook(self, consumer: int, route: str) -> str:
        """What `consumer`'s depth mix hands its layer on `route` (before any message gate): `Σ_s α_s v_s`."""
        routes = self.routes(consumer)
        if isinstance(consumer, str):
            raise ValueError(
                f"{consumer} returns its four messages stacked at {self._mix_hooks(consumer).name}.hook_out "
                "([batch, pos, route, d_model]); it has no hook per route"
            )
        if route not in routes:
            raise ValueError(f"{self.sublayer_name(consumer)} has routes {routes}, not {route!r}")
        if consumer == self.n_sublayers:
            return self.readout_input_hook
        step, kind = self._visit_of(consumer)
        if route in ("k", "v"):
            return self._prefix(step) + f"hook_resid_pre_{route}"
        return self._prefix(step) + ("hook_resid_pre" if kind == "attn" else "hook_resid_mid")

    def depth_values(self, consumer: int | str, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The vectors `consumer` mixes: each source RMS-normalised without gain, `v_s = r_s b_s` with
        `r_s = (mean(b_s²) + ε)^(-1/2)` (ε its key norm's), in the sources' dtype (docs/architecture.md §7)."""
        eps = self._transformers_consumer(consumer).norm.variance_epsilon
        return [source * torch.rsqrt(source.pow(2).mean(-1, keepdim=True) + eps) for source in sources]

    def direct_inputs(self) -> dict[int, list[int]]:
        """Layer 0's attention reads the embedding itself (no depth mix; its q, k, v inputs are all e)."""
        return {0: [EMBEDDING]}

    def _transformers_consumer(self, consumer: int | str) -> nn.Module:
        self._check_consumer(consumer)
        text_model = self.hf_model.model
        if isinstance(consumer, str):
            return text_model.message_input
        if consumer == self.n_sublayers:
            return text_model.final_input
        step, kind = self._visit_of(consumer)
        layer = text_model.layers[step.layer]
        return layer.attention_input if kind == "attn" else layer.mlp_input

    def sublayer_output_hook(self, sublayer: int) -> str:
        """f_j: the sublayer's output after its post-sublayer short convolution."""
        step, kind = self._visit_of(sublayer)
        return self._prefix(step) + f"hook_{kind}_out"

    def consumers(self) -> list[int]:
        """Every sublayer whose input is a depth mix, in forward order, J last (layer 0's attention has none)."""
        return [consumer for consumer in self._sources if isinstance(consumer, int)]

    def message_consumers(self) -> list[str]:
        """The loop's message consumers, 'L{l}.msg@{v}' for visits v ≥ 2 of each looped layer, in forward order.
        `sources`, `source_labels`, `routes` and `depth_hook` take these names as consumers too."""
        return [consumer for consumer in self._sources if isinstance(consumer, str)]

    def _check_consumer(self, consumer: int | str) -> None:
        if consumer not in self._sources:
            raise ValueError(
                f"{consumer!r} is not a depth consumer of this model: consumers are {self.consumers()}"
                + (f" and the messages {self.message_consumers()}" if self.message_consumers() else "")
            )

    def sources(self, consumer: int | str) -> list[list[int]]:
        """Sublayer indices summed into each source `consumer` reads ([EMBEDDING] for b_0 = e)."""
        self._check_consumer(consumer)
        return [list(members) for members in self._sources[consumer]]

    def source_labels(self, consumer: int | str) -> list[str]:
        """'emb', 'B{k} (L{a}–L{b})' for a closed block of layers (visits suffixed), 'partial' for an open one."""
        labels = []
        for members in self.sources(consumer):
            if members == [EMBEDDING]:
                labels.append("emb")
            elif len(members) < 2 * self.block_size_layers:
                labels.append("partial")
            else:
                first, last = self.visits[members[0] // 2], self.visits[members[-1] // 2]
                span = f"L{first.layer}{first.suffix}–L{last.layer}{last.suffix}"
                labels.append(f"B{first.layer // self.block_size_layers + 1} ({span})")
        return labels

    def routes(self, consumer: int | str) -> list[str]:
        self._check_consumer(consumer)
        return list(self._mix_hooks(consumer).routes)

    def _mix_hooks(self, consumer: int | str) -> DepthMix:
        if isinstance(consumer, str):
            step = next(s for s in self.visits if message_key(s) == consumer)
            return self.layer_hooks(step.layer, step.visit).msg_res
        if consumer == self.n_sublayers:
            return self.final_res
        step, kind = self._visit_of(consumer)
        return getattr(self.layer_hooks(step.layer, step.visit), f"{kind}_res")

    def depth_hook(self, consumer: int | str, point: str) -> str:
        """Hook name of `point` ('logits', 'weights', 'logit_bias') of `consumer`'s depth mix."""
        self._check_consumer(consumer)
        check_depth_point(point)
        return f"{self._mix_hooks(consumer).name}.hook_{point}"


def _register_hooked_attention() -> None:
    from transformers import AttentionInterface

    if _HOOKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(_HOOKED_ATTENTION, _hooked_eager_attention)


def _hooked_eager_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention; when the bridge's `hook_pattern` is hooked, the output is re-read from the
    hooked pattern (`pattern @ V`, the eager function's last step) so an edited pattern takes effect."""
    modeling = sys.modules[type(module).__module__]  # the model's own copy (inkling2 or inkling2_loop)
    output, pattern = modeling.eager_attention_forward(module, query, key, value, *args, **kwargs)
    point = getattr(module, _PATTERN_HOOKS)().hook_pattern
    if not is_hooked(point):
        return output, pattern
    pattern = point(pattern)
    values = modeling.repeat_kv(value, module.num_key_value_groups)
    return torch.matmul(pattern, values).transpose(1, 2).contiguous(), pattern
