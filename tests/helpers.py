"""Shared test utilities: small model builders, a copy-task batch, an in-process CLI call and an independent float64
re-implementation of the AttnRes residual (docs/model.md §2), and a protocol-only view of a model (`ProtocolOnly`)."""

from __future__ import annotations

import copy
import itertools

import torch

from attnres_lens import HookedTransformer, ModelConfig
from attnres_lens.cli import main as cli_main
from attnres_lens.tasks import make_task
from tests.kernel_cases import oracle

VARIANTS = list(
    itertools.product([("standard", 1), ("attnres", 1), ("attnres", 2), ("attnres", 4)], ["standard", "kv_shift"])
)


def small_config(
    residual: str = "standard", block_size: int = 1, attention: str = "standard", **overrides
) -> ModelConfig:
    params = dict(d_model=32, n_heads=4, n_layers=3, n_ctx=24, d_vocab=20, seed=0)
    params.update(overrides)
    return ModelConfig(residual=residual, attnres_block_size=block_size, attention=attention, **params)


# float32's unit roundoff: one rounding moves a value by at most this fraction of it
FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def float32_chain_length(cfg: ModelConfig, tokens: torch.Tensor) -> int:
    """Terms summed along the longest chain of float32 sums between a model's input and its loss (or back to a
    parameter's gradient): the tokens, the vocabulary, and per layer the MLP's hidden units, the attended positions
    and four d_model-long contractions (query, key, value and output projections)."""
    return tokens.numel() + cfg.d_vocab + cfg.n_layers * (cfg.d_mlp + tokens.shape[-1] + 4 * cfg.d_model)


def reordering_bound(n_terms: int, scale: float) -> float:
    """The most a float32 result of `n_terms` summed terms of magnitude up to `scale` moves when its sums run in
    another order (other kernels, thread splits, a compiled graph): n·u·scale, each addition rounding once."""
    return n_terms * FLOAT32_UNIT_ROUNDOFF * scale


def assert_same_step(
    model: HookedTransformer,
    tokens: torch.Tensor,
    loss: torch.Tensor,
    grads: dict[str, torch.Tensor],
    expected_loss: torch.Tensor,
    expected_grads: dict[str, torch.Tensor],
) -> None:
    """Two float32 training steps that sum the same terms in other orders (two backends, or a compiled graph and
    the eager step): the loss and each gradient entry within the reordering bound of the chain of sums behind it
    (`float32_chain_length` terms in all), its terms of the size of the tensor's largest entry (softmax and RMSNorm
    backwards cancel larger ones: counting every term covers them)."""
    n = float32_chain_length(model.cfg, tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=reordering_bound(n, expected_loss.abs().item()))
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        bound = reordering_bound(n, expected_grads[name].abs().max().item())
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=0, atol=bound, msg=name)


def copy_batch(n: int, vocab: int = 20, seq_len: int = 24):
    """`n` held-out sequences of the copy task, sized for `small_config` models."""
    return make_task("copy", vocab_size=vocab, seq_len=seq_len, min_len=4, max_len=8).eval_batch(n)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`attnres-lens argv` run in this process: its exit code, stdout and stderr."""
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def randomize_depth_parameters(model: HookedTransformer, seed: int = 1) -> None:
    """Give pseudo-queries and key-norm gains non-trivial values (they start at 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.depth_attention_modules().values():
            module.query.copy_(torch.randn(module.query.shape, generator=generator))
            module.key_norm.w.copy_(1 + 0.3 * torch.randn(module.key_norm.w.shape, generator=generator))


def depth_mix_float64(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """The suite's one independent oracle of the depth mix (`tests.kernel_cases.oracle`), keeping only h."""
    return oracle(sources, query, gain, eps)[0]


def block_sources(
    j: int, embedding: torch.Tensor, outputs: list[torch.Tensor], block_size: int, n_sublayers: int
) -> list[torch.Tensor]:
    """Sources of sublayer j (or the final readout, j = J) straight from the block definitions (docs/model.md §2)."""
    S = block_size
    if j == n_sublayers:  # final readout: every completed block and the last partial
        n_blocks = -(-n_sublayers // S)
        blocks = [sum(outputs[(m - 1) * S : m * S]) for m in range(1, n_blocks)]
        return [embedding, *blocks, sum(outputs[(n_blocks - 1) * S : n_sublayers])]
    n = j // S + 1  # block of sublayer j, 1-based
    blocks = [sum(outputs[(m - 1) * S : m * S]) for m in range(1, n)]
    partial = [sum(outputs[(n - 1) * S : j])] if j % S else []
    return [embedding, *blocks, *partial]


def reference_logits(model: HookedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """A second, float64 forward pass that re-derives the residual logic from docs/model.md §1-§2.

    It reuses the model's sublayers (attention, MLP, norms) but none of its residual bookkeeping.
    """
    m = copy.deepcopy(model).double()
    cfg = m.cfg
    embedding = m.embed(tokens)
    if cfg.positional_embedding_type == "standard":
        embedding = embedding + m.pos_embed(tokens)
    sublayers = []
    for block in m.blocks:
        sublayers.append((block.ln1, block.attn, getattr(block, "attn_res", None)))
        if not cfg.attn_only:
            sublayers.append((block.ln2, block.mlp, getattr(block, "mlp_res", None)))
    outputs: list[torch.Tensor] = []
    J = len(sublayers)
    for j, (norm, sublayer, depth) in enumerate(sublayers):
        if cfg.residual == "standard":
            h = embedding + sum(outputs)
        else:
            sources = block_sources(j, embedding, outputs, cfg.attnres_block_size, J)
            h = depth_mix_float64(sources, depth.query, depth.key_norm.w, cfg.attnres_eps)
        outputs.append(sublayer(norm(h)))
    if cfg.residual == "standard":
        final = embedding + sum(outputs)
    else:
        sources = block_sources(J, embedding, outputs, cfg.attnres_block_size, J)
        final = depth_mix_float64(sources, m.final_res.query, m.final_res.key_norm.w, cfg.attnres_eps)
    return m.unembed(m.ln_final(final))


class ProtocolOnly:
    """A `HookedTransformer` seen through the depth-mixing model protocol alone (docs/architecture.md §7): the
    protocol's members and `HookedRootModule`'s hook API (`run_with_hooks`, `run_with_cache`, `hooks`, `hook_dict`),
    nothing else, so an analysis that reaches past the protocol (`model.cfg`, `model.blocks`, `parameters()`) fails
    with AttributeError. Not a `HookedTransformer`, so analyses take their protocol-only paths."""

    __slots__ = ("_wrapped",)

    def __init__(self, model: HookedTransformer):
        self._wrapped = model

    @property
    def n_sublayers(self) -> int:
        return self._wrapped.n_sublayers

    @property
    def d_vocab(self) -> int:
        return self._wrapped.d_vocab

    @property
    def embedding_hooks(self) -> list[str]:
        return self._wrapped.embedding_hooks

    @property
    def readout_input_hook(self) -> str:
        return self._wrapped.readout_input_hook

    @property
    def hook_dict(self) -> dict:
        return self._wrapped.hook_dict

    def sublayer_name(self, sublayer: int) -> str:
        return self._wrapped.sublayer_name(sublayer)

    def sublayer_kind(self, sublayer: int) -> str:
        return self._wrapped.sublayer_kind(sublayer)

    def sublayer_input_hook(self, sublayer: int) -> str:
        return self._wrapped.sublayer_input_hook(sublayer)

    def sublayer_output_hook(self, sublayer: int) -> str:
        return self._wrapped.sublayer_output_hook(sublayer)

    def route_input_hook(self, consumer: int, route: str) -> str:
        return self._wrapped.route_input_hook(consumer, route)

    def consumers(self) -> list[int]:
        return self._wrapped.consumers()

    def sources(self, consumer: int) -> list[list[int]]:
        return self._wrapped.sources(consumer)

    def source_labels(self, consumer: int) -> list[str]:
        return self._wrapped.source_labels(consumer)

    def routes(self, consumer: int) -> list[str]:
        return self._wrapped.routes(consumer)

    def depth_hook(self, consumer: int, point: str) -> str:
        return self._wrapped.depth_hook(consumer, point)

    def to_tokens(self, tokens) -> torch.Tensor:
        return self._wrapped.to_tokens(tokens)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        return self._wrapped.readout(x)

    def forward(self, tokens) -> torch.Tensor:
        return self._wrapped(tokens)

    def __call__(self, tokens) -> torch.Tensor:
        return self._wrapped(tokens)

    def run_with_hooks(self, tokens, fwd_hooks=(), bwd_hooks=(), reset_hooks_end=True, clear_contexts=False):
        """`HookedRootModule.run_with_hooks` over the protocol's forward, which takes tokens alone (a keyword the
        toolkit's forward has, such as `return_type`, fails here as it would on another model)."""
        with self.hooks(list(fwd_hooks), list(bwd_hooks), reset_hooks_end, clear_contexts):
            return self(tokens)

    def run_with_cache(self, *args, **kwargs):
        return self._wrapped.run_with_cache(*args, **kwargs)

    def hooks(self, *args, **kwargs):
        return self._wrapped.hooks(*args, **kwargs)


# ---------------------------------------------------------------------------- tiny transformers Inkling models
# Tiny random Inkling-2 / Inkling-2-Mini, saved with save_pretrained and opened from the folder (docs/interop.md §7).
INKLING_COMMON = dict(
    vocab_size=64,
    unpadded_vocab_size=60,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    swa_num_attention_heads=2,
    swa_num_key_value_heads=1,
    swa_head_dim=16,
    sliding_window_size=4,
    d_rel=4,
    rel_extent=8,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_layers_per_attn_res_block=2,
    eos_token_id=None,
    use_cache=False,
)
_SLIDING, _FULL = "hybrid_sliding", "hybrid"
TINY_TOKENIZER_WORDS = ("the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "and", "then", "slept")


def save_tiny_inkling(kind: str, folder) -> str:
    """A tiny random Inkling-2 (`kind` 'plain': 5 layers) or Inkling-2-Mini ('loop': 7 layers, two blocks of two
    layers looped three times, so messages route over two sources) saved to `folder`; its pseudo-queries and static
    conv taps are drawn non-zero (zero-initialised ones would make every routing uniform)."""
    from transformers import Inkling2ForCausalLM, Inkling2LoopForCausalLM, Inkling2TextConfig
    from transformers.models.inkling2_loop import Inkling2LoopTextConfig

    torch.manual_seed(0)
    if kind == "plain":
        config = Inkling2TextConfig(
            num_hidden_layers=5, layer_types=[_SLIDING, _FULL, _SLIDING, _SLIDING, _FULL], **INKLING_COMMON
        )
        model = Inkling2ForCausalLM(config)
    elif kind == "loop":
        config = Inkling2LoopTextConfig(
            num_hidden_layers=7,
            layer_types=[_FULL, _SLIDING, _SLIDING, _FULL, _SLIDING, _FULL, _SLIDING],  # layer 0 reads the embedding
            loop_layer_index_start=2,
            loop_layer_index_end=6,
            loop_num_passes=3,
            loop_gate_rank=4,
            **INKLING_COMMON,
        )
        model = Inkling2LoopForCausalLM(config)
    else:
        raise ValueError(f"kind must be 'plain' or 'loop', got {kind!r}")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".query") or name.endswith("static_weight"):
                parameter.normal_(0.0, 2.0)
    model.save_pretrained(folder)
    return str(folder)


def save_tiny_tokenizer(folder) -> None:
    """A word-level tokenizer over `TINY_TOKENIZER_WORDS` (ids 0..11, '[UNK]' 12) saved beside a model: text in
    the tests goes through it as it would through a real model folder's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(TINY_TOKENIZER_WORDS)} | {"[UNK]": len(TINY_TOKENIZER_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


HF_RUN_TEXT = " ".join(["the cat sat on the mat and then the dog ran far and slept"] * 30)


# ---------------------------------------------------------------------------- a tiny transformers DeepSeek V4
# A tiny random DeepSeek V4 (mHC), saved with save_pretrained and opened from the folder (docs/interop.md §7).
DEEPSEEK_V4_STREAMS, DEEPSEEK_V4_EXPERTS, DEEPSEEK_V4_LAYERS = 3, 4, 4
DEEPSEEK_V4_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=DEEPSEEK_V4_LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=8,
    n_routed_experts=DEEPSEEK_V4_EXPERTS,
    num_experts_per_tok=2,
    hc_mult=DEEPSEEK_V4_STREAMS,
    hc_sinkhorn_iters=5,
    sliding_window=4,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=2,
    # every attention kind, with compression rates small enough to compress 8 tokens
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    eos_token_id=None,
    bos_token_id=None,
    use_cache=False,
)


def save_tiny_deepseek_v4(folder) -> str:
    """A tiny random `DeepseekV4ForCausalLM` (`DEEPSEEK_V4_CONFIG`: every attention kind, a hash-routed MoE layer)
    saved to `folder`; its hyper-connection weights are drawn away from transformers' init, which reads the streams
    almost evenly, and the hash-routed layer's table is filled (zeros until a checkpoint fills it)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**DEEPSEEK_V4_CONFIG))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("_hc.fn", "hc_head.hc_fn")):
                parameter.normal_(0.0, 0.5)
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                parameter.normal_(0.0, 1.0)
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):
                parameter.uniform_(0.5, 2.0)
        gate = model.model.layers[0].mlp.gate
        gate.tid2eid.copy_(torch.randint(0, DEEPSEEK_V4_EXPERTS, gate.tid2eid.shape))
    model.save_pretrained(folder)
    return str(folder)
