"""The transformers bridge (docs/interop.md §7) against transformers' own Inkling-2 / Inkling-2-Mini code: tiny random
models saved to a folder (tests/helpers.py `save_tiny_inkling`), their logits, depth weights (recomputed in float64
from the transformers modules' inputs), sources and knockouts checked against transformers directly."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnres_lens import from_transformers  # noqa: E402
from attnres_lens.analysis.interventions import source_mask_hooks  # noqa: E402
from attnres_lens.attnres import EMBEDDING  # noqa: E402
from attnres_lens.protocol import DepthMixingModel  # noqa: E402


def _reference(folder: str, **kwargs):
    """A second, untouched instance of the saved model: transformers' own forward."""
    architecture = json.loads(open(f"{folder}/config.json").read())["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(folder, **kwargs).eval()


TOKENS = torch.tensor([[3, 17, 42, 5, 59, 0, 21, 8], [11, 11, 30, 2, 7, 48, 19, 33]])


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= rel * expected.double().abs().max().item(), error


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_logits_equal_transformers_hooked_and_not(inkling_folders, kind):
    bridge = from_transformers(inkling_folders[kind])
    expected = _reference(inkling_folders[kind])(input_ids=TOKENS, use_cache=False).logits
    _close(bridge(TOKENS), expected, 1e-5)
    logits, cache = bridge.run_with_cache(TOKENS)  # every hook point hooked, logit_bias included
    _close(logits, expected, 1e-5)
    _close(bridge.readout(cache[bridge.readout_input_hook]), expected, 1e-5)
    assert torch.equal(bridge.to_tokens(TOKENS[0].tolist()), TOKENS[:1])


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_parameter_gradients_equal_transformers(inkling_folders, kind):
    """Attribution differentiates through the bridge: the unhooked depth op's backward must be transformers'."""
    bridge, reference = from_transformers(inkling_folders[kind]), _reference(inkling_folders[kind])
    bridge(TOKENS, return_type="loss").backward()
    logits = reference(input_ids=TOKENS, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    expected = dict(reference.named_parameters())
    for name, parameter in bridge.hf_model.named_parameters():
        if expected[name].grad is not None:
            _close(parameter.grad, expected[name].grad, 1e-4)
    assert bridge.hf_model.model.final_input.query.grad.abs().max() > 0


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_bf16_logits_within_bf16_rounding(inkling_folders, kind):
    bridge = from_transformers(inkling_folders[kind], dtype=torch.bfloat16)
    assert bridge.hf_model.model.embed_tokens.weight.dtype == torch.bfloat16
    expected = _reference(inkling_folders[kind], dtype=torch.bfloat16)(input_ids=TOKENS, use_cache=False).logits
    _close(bridge(TOKENS), expected, 2**-7)


def _captured_consumer_inputs(bridge) -> dict[int | str, tuple[torch.Tensor, torch.Tensor]]:
    """Each depth consumer's (block_states, partial) as transformers' modules receive them (PyTorch pre-hooks),
    keyed by the bridge's consumer via its name: the k-th call of a looped layer's module is visit k."""
    text_model = bridge.hf_model.model
    by_name = {bridge.sublayer_name(c): c for c in bridge.consumers()} | {m: m for m in bridge.message_consumers()}
    looped = {step.layer for step in bridge.visits if step.visit is not None}
    calls: defaultdict[str, int] = defaultdict(int)
    captured: dict[int | str, tuple[torch.Tensor, torch.Tensor]] = {}

    def recorder(layer: int | None, kind: str):
        def hook(_module, args):
            if kind == "msg":
                key_layer = bridge.config.loop_layer_index_start + args[2]
                calls[f"msg{key_layer}"] += 1
                name = f"L{key_layer}.msg@{calls[f'msg{key_layer}'] + 1}"
            elif kind == "final":
                name = "final"
            else:
                calls[f"{kind}{layer}"] += 1
                name = f"L{layer}.{kind}" + (f"@{calls[f'{kind}{layer}']}" if layer in looped else "")
            captured[by_name[name]] = (args[0].detach().clone(), args[1].detach().clone())

        return hook

    handles = [text_model.final_input.register_forward_pre_hook(recorder(None, "final"))]
    for layer, decoder_layer in enumerate(text_model.layers):
        if decoder_layer.attention_input is not None:
            handles.append(decoder_layer.attention_input.register_forward_pre_hook(recorder(layer, "attn")))
        handles.append(decoder_layer.mlp_input.register_forward_pre_hook(recorder(layer, "mlp")))
    if hasattr(text_model, "message_input"):
        handles.append(text_model.message_input.register_forward_pre_hook(recorder(None, "msg")))
    return captured, handles


def _query(bridge, consumer) -> torch.Tensor:
    text_model = bridge.hf_model.model
    if isinstance(consumer, str):
        layer = int(consumer[1:].split(".")[0])
        return text_model.message_input.query[layer - bridge.config.loop_layer_index_start]
    if consumer == bridge.n_sublayers:
        return text_model.final_input.query
    step = bridge.visits[consumer // 2]
    module = text_model.layers[step.layer]
    return (module.attention_input if consumer % 2 == 0 else module.mlp_input).query


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_depth_weights_and_sources_against_transformers_inputs(inkling_folders, kind):
    bridge = from_transformers(inkling_folders[kind])
    captured, handles = _captured_consumer_inputs(bridge)
    _, cache = bridge.run_with_cache(TOKENS)
    for handle in handles:
        handle.remove()
    every = bridge.consumers() + bridge.message_consumers()
    assert sorted(map(str, captured)) == sorted(map(str, every))
    assert bridge.consumers()[-1] == bridge.n_sublayers and 0 not in bridge.consumers()
    for consumer in every:
        block_states, partial = captured[consumer]
        received = [*block_states.unbind(-2), partial]
        members = bridge.sources(consumer)
        assert len(members) == len(received) == len(bridge.source_labels(consumer)), consumer
        for source, group in zip(received, members, strict=True):  # each source is the sum its members say
            parts = [cache["hook_embed"] if j == EMBEDDING else cache[bridge.sublayer_output_hook(j)] for j in group]
            _close(source, sum(p.double() for p in parts), 1e-5)
        # float64 recomputation: unweighted RMSNorm keys, q . k / sqrt(D), softmax
        values = torch.stack(received, dim=-2).double()
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + 1e-6)
        query = _query(bridge, consumer).double().reshape(-1, values.shape[-1])
        expected = torch.softmax((keys @ query.t()).transpose(-1, -2) / values.shape[-1] ** 0.5, dim=-1)
        routes = bridge.routes(consumer)
        weights = cache[bridge.depth_hook(consumer, "weights")]
        assert weights.shape == (*TOKENS.shape, *([len(routes)] if len(routes) > 1 else []), len(members))
        expected = expected.squeeze(-2) if len(routes) == 1 else expected
        torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)  # fp32 weights
    assert max(cache[bridge.depth_hook(c, "weights")].std().item() for c in bridge.consumers()) > 0.05
    last = bridge.visits[-1]  # the readout's last source is the last layer's partial sum
    torch.testing.assert_close(captured[bridge.n_sublayers][1], cache[f"blocks.{last.layer}.hook_block_partial"])


def _drop_source(index: int, forward, call: int | None = None, layer_idx: int | None = None):
    """transformers' own consumer forward with block state `index` left out, on its `call`-th call (every call when
    None; for the message module, only calls for loop layer `layer_idx`)."""
    seen = [0]

    def patched(block_states, partial, *rest):
        if layer_idx is not None and rest[0] != layer_idx:
            return forward(block_states, partial, *rest)
        seen[0] += 1
        if call is None or seen[0] == call:
            keep = [s for s in range(block_states.shape[-2]) if s != index]
            block_states = block_states[..., keep, :]
        return forward(block_states, partial, *rest)

    return patched


def _minus_inf_at(index: int):
    def hook(bias, hook):
        bias[..., index] = float("-inf")
        return bias

    return hook


@pytest.mark.parametrize(
    "kind, consumer_name, module_path, source, call, layer_idx",
    [
        ("plain", "L4.mlp", "layers.4.mlp_input", 1, None, None),
        ("plain", "L4.attn", "layers.4.attention_input", 0, None, None),
        ("loop", "L3.attn@2", "layers.3.attention_input", 0, 2, None),
        ("loop", "L2.msg@3", "message_input", 0, 2, 0),
    ],
)
def test_knockout_through_logit_bias_equals_direct_knockout(
    inkling_folders, kind, consumer_name, module_path, source, call, layer_idx
):
    bridge = from_transformers(inkling_folders[kind])
    names = {bridge.sublayer_name(c): c for c in bridge.consumers()} | {m: m for m in bridge.message_consumers()}
    consumer = names[consumer_name]
    hooked = bridge.run_with_hooks(
        TOKENS, fwd_hooks=[(bridge.depth_hook(consumer, "logit_bias"), _minus_inf_at(source))]
    )
    reference = _reference(inkling_folders[kind])
    module = reference.model.get_submodule(module_path)
    module.forward = _drop_source(source, module.forward, call, layer_idx)
    expected = reference(input_ids=TOKENS, use_cache=False).logits
    _close(hooked, expected, 1e-5)
    assert (hooked - bridge(TOKENS)).abs().max() > 1e-4  # the knockout changed something
    if isinstance(consumer, int):  # the analyses' own knockout, through the protocol, is the same
        _close(bridge.run_with_hooks(TOKENS, fwd_hooks=source_mask_hooks(bridge, consumer, [source])), expected, 1e-5)


def test_loop_patterns_per_visit_are_transformers_attentions(inkling_folders):
    bridge = from_transformers(inkling_folders["loop"])
    _, cache = bridge.run_with_cache(TOKENS)
    attentions = _reference(inkling_folders["loop"])(
        input_ids=TOKENS, use_cache=False, output_attentions=True
    ).attentions
    assert len(attentions) == len(bridge.visits)  # transformers records every visit, in forward order
    for step, expected in zip(bridge.visits, attentions, strict=True):
        name = f"blocks.{step.layer}." + ("" if step.visit is None else f"visit{step.visit}.") + "attn.hook_pattern"
        _close(cache[name], expected, 1e-5)


def test_pattern_hook_sees_and_edits_transformers_attention(inkling_folders):
    bridge = from_transformers(inkling_folders["plain"])
    _, cache = bridge.run_with_cache(TOKENS)
    attentions = _reference(inkling_folders["plain"])(
        input_ids=TOKENS, use_cache=False, output_attentions=True
    ).attentions
    for layer, expected in enumerate(attentions):
        _close(cache[f"blocks.{layer}.attn.hook_pattern"], expected, 1e-5)
    # an edited pattern takes effect: a uniform causal pattern at layer 2 gives the attention output recomputed
    # from it with transformers' own output projection and post-attention convolution
    uniform = torch.tril(torch.ones(TOKENS.shape[1], TOKENS.shape[1]))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    seen = {}
    bridge.run_with_hooks(
        TOKENS,
        fwd_hooks=[
            ("blocks.2.attn.hook_pattern", lambda pattern, hook: uniform.expand_as(pattern).clone()),
            *[
                (f"blocks.2.{name}", lambda x, hook: seen.setdefault(hook.name, x))
                for name in ("hook_resid_pre", "attn.hook_v", "hook_attn_out")
            ],
        ],
    )
    layer = bridge.hf_model.model.layers[2]
    value = seen["blocks.2.attn.hook_v"].repeat_interleave(2, dim=2)  # [b, pos, head, d_head]: kv heads shared
    z = torch.einsum("qk,bkhd->bqhd", uniform, value).flatten(-2)
    expected = layer.post_attention_convolution(
        layer.self_attn.o_proj(z, layer.input_layernorm(seen["blocks.2.hook_resid_pre"]))
    )
    _close(seen["blocks.2.hook_attn_out"], expected, 1e-5)


def test_protocol_names_and_hook_points(inkling_folders):
    bridge = from_transformers(inkling_folders["loop"])
    assert isinstance(bridge, DepthMixingModel)
    assert bridge.n_sublayers == 2 * (7 + 2 * 4)
    assert bridge.sublayer_name(4) == "L2.attn@1" and bridge.sublayer_name(12) == "L2.attn@2"
    assert bridge.sublayer_kind(bridge.n_sublayers) == "final"
    assert bridge.routes(6) == ["q", "k", "v"] and bridge.routes(4) == ["mix"]  # L3 full-attention, L2 sliding
    assert bridge.message_consumers()[0] == "L2.msg@2" and bridge.routes("L2.msg@2") == ["q", "k", "v", "mlp"]
    assert bridge.source_labels("L2.msg@2") == ["B2 (L2@1–L3@1)", "B3 (L4@1–L5@1)"]
    assert bridge.route_input_hook(6, "k") == "blocks.3.visit1.hook_resid_pre_k"
    assert "blocks.0.hook_resid_pre_v" in bridge.hook_dict  # layer 0 has no consumer, but its inputs are hooked
    assert not any(name.endswith("hook_resid_post") for name in bridge.hook_dict)  # no running sum to show
    parameters = dict(bridge.named_parameters())
    assert all(name.startswith("hf_model.") for name in parameters)
    assert parameters["hf_model.lm_head.weight"] is bridge.hf_model.lm_head.weight  # held, not copied
    with pytest.raises(ValueError, match="not a depth consumer"):
        bridge.sources(0)
    bridge.hf_model.activation_checkpointing_enable()
    bridge.train()
    with pytest.raises(ValueError, match="activation_checkpointing_disable"):
        bridge(TOKENS)
    with pytest.raises(ValueError, match="out of range for d_vocab=60"):
        bridge.to_tokens([[1, 60]])
    assert torch.equal(bridge.to_tokens("3 17 42"), torch.tensor([[3, 17, 42]]))
    with pytest.raises(ValueError, match="tokenize text with the model's tokenizer first"):
        bridge.to_tokens("hello")


def test_refusals(inkling_folders, tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="supports Inkling2ForCausalLM, Inkling2LoopForCausalLM; got Linear"):
        from_transformers(torch.nn.Linear(2, 2))
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(TypeError, match="holds a LlamaForCausalLM; from_transformers supports Inkling2ForCausalLM"):
        from_transformers(other)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_transformers(tmp_path / "missing")
    with pytest.raises(ValueError, match="apply only when opening a folder"):
        from_transformers(_reference(inkling_folders["plain"]), dtype=torch.bfloat16)
    model = _reference(inkling_folders["plain"])
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="uses 'sdpa': load it with attn_implementation='eager'"):
        from_transformers(model)
    model.config._attn_implementation = "eager"
    from_transformers(model)
    with pytest.raises(ValueError, match="already wrapped by a bridge"):
        from_transformers(model)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.24.0")  # the module the bridge imports
    with pytest.raises(RuntimeError, match="transformers 5.24.0 is installed: pip install transformers==5.25.0"):
        from_transformers(inkling_folders["plain"])
