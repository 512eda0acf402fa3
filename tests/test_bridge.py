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
    with pytest.raises(
        TypeError, match="supports Inkling2ForCausalLM, Inkling2LoopForCausalLM, DeepseekV4ForCausalLM; got Linear"
    ):
        from_transformers(torch.nn.Linear(2, 2))
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(TypeError, match="holds a LlamaForCausalLM; from_transformers supports Inkling2ForCausalLM"):
        from_transformers(other)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_transformers(tmp_path / "missing")
    run = tmp_path / "a_run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {}, "task": {}, "train": {}}))
    with pytest.raises(TypeError, match="is an attnres_lens run directory.*attnres_lens.load_run"):
        from_transformers(run)
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


# ---------------------------------------------------------------------------- the analyses on the bridge
def _captured(bridge, names: list[str] = ()) -> tuple[dict, dict]:
    """One forward: the transformers modules' inputs per consumer (float64 recomputations start there) and the
    activations at `names`."""
    captured, handles = _captured_consumer_inputs(bridge)
    _, cache = bridge.run_with_cache(TOKENS)
    for handle in handles:
        handle.remove()
    return captured, cache


def _recomputed_mix(bridge, consumer, received: list[torch.Tensor], dropped: int | None = None):
    """float64 from the inputs transformers' module received: α `[b, p, R, S]` (source `dropped` knocked out),
    the normalised values `[b, p, S, D]` the mix sums, each source's RMS scale r `[b, p, S]`, and the mixes
    `[b, p, R, D]`."""
    sources = torch.stack(received, dim=-2).double()
    scale = torch.rsqrt(sources.pow(2).mean(-1) + 1e-6)
    values = sources * scale[..., None]
    query = _query(bridge, consumer).double().reshape(-1, sources.shape[-1])
    logits = (values @ query.t()).transpose(-1, -2) / sources.shape[-1] ** 0.5
    if dropped is not None:
        logits[..., dropped] = float("-inf")
    alpha = torch.softmax(logits, dim=-1)
    return alpha, values, scale, alpha @ values


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_mixing_matrix_weighs_raw_outputs_by_alpha_times_rms_scale_and_rebuilds_every_input(inkling_folders, kind):
    from attnres_lens.mixing import basis_index, mixing_coefficients

    bridge = from_transformers(inkling_folders[kind])
    captured, cache = _captured(bridge)
    J = bridge.n_sublayers
    basis = torch.stack([cache["hook_embed"]] + [cache[bridge.sublayer_output_hook(j)] for j in range(J)], -2)
    for route in (None, "k", "v"):
        M = mixing_coefficients(bridge, TOKENS, route=route).double()
        assert M.shape == (*TOKENS.shape, J + 1, J + 1)
        # layer 0's attention reads the embedding itself: weight 1 on e, nothing else
        assert torch.equal(M[..., 0, :], torch.eye(J + 1, dtype=M.dtype)[0].expand_as(M[..., 0, :]))
        for consumer in bridge.consumers():
            routes = bridge.routes(consumer)
            r = routes.index(route) if route in routes else 0
            alpha, _, scale, mixes = _recomputed_mix(
                bridge, consumer, [*captured[consumer][0].unbind(-2), captured[consumer][1]]
            )
            expected = torch.zeros_like(M[..., consumer, :])
            for s, members in enumerate(bridge.sources(consumer)):
                for member in members:
                    expected[..., basis_index(member)] += alpha[..., r, s] * scale[..., s]
            torch.testing.assert_close(M[..., consumer, :], expected, rtol=1e-4, atol=1e-6)
            # M rebuilds the mix the layer receives on that route from the raw outputs
            rebuilt = (M[..., consumer, :, None] * basis.double()).sum(-2)
            _close(rebuilt, cache[bridge.route_input_hook(consumer, routes[r])], 1e-5)
            _close(rebuilt, mixes[..., r, :], 1e-5)
    with pytest.raises(ValueError, match=r"route must be one of this model's routes \['k', 'mix', 'q', 'v'\]"):
        mixing_coefficients(bridge, TOKENS, route="h0")


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_input_decomposition_per_route_against_a_float64_recomputation(inkling_folders, kind):
    from attnres_lens.analysis import depth_input_decomposition

    bridge = from_transformers(inkling_folders[kind])
    captured, _ = _captured(bridge)
    table = depth_input_decomposition(bridge, TOKENS, per_token=True)
    assert set(table["consumer"]) == set(bridge.consumers())
    for consumer in bridge.consumers():
        alpha, values, _, mixes = _recomputed_mix(
            bridge, consumer, [*captured[consumer][0].unbind(-2), captured[consumer][1]]
        )
        for r, route in enumerate(bridge.routes(consumer)):
            rows = table[(table["consumer"] == consumer) & (table["route"] == route)]
            assert len(rows) == TOKENS.numel() * values.shape[-2], (consumer, route)
            terms = alpha[..., r, :, None] * values  # [b, p, S, D]
            h = mixes[..., r, :]
            share = (terms * h[..., None, :]).sum(-1) / (h * h).sum(-1, keepdim=True)
            for column, expected in (("alpha", alpha[..., r, :]), ("term_norm", terms.norm(dim=-1)), ("share", share)):
                got = torch.tensor(rows.sort_values(["sequence", "position", "source"])[column].to_numpy())
                torch.testing.assert_close(got, expected.reshape(-1), rtol=1e-4, atol=1e-6)
            sums = rows.groupby(["sequence", "position"])["share"].sum()
            assert ((sums - 1).abs() < 1e-4).all()


def test_edge_sensitivity_is_the_derivative_of_each_knockout_along_its_change(inkling_folders):
    """The first-order estimate of knocking source s out of consumer c is Σ_routes Σ_tokens ∂loss/∂h_r · (h'_r − h_r),
    with the mixes h, h' recomputed in float64 from transformers' module inputs (normalised values) and the
    gradient taken at the mixes' own hooks."""
    from attnres_lens.analysis import edge_sensitivity

    bridge = from_transformers(inkling_folders["plain"])
    captured, _ = _captured(bridge)
    table = edge_sensitivity(bridge, TOKENS).set_index(["consumer", "source"])
    for consumer in (8, 7, bridge.n_sublayers):  # L4.attn (q, k, v), L3.mlp, final
        routes = bridge.routes(consumer)
        names = [bridge.route_input_hook(consumer, route) for route in routes]
        shifts = {name: torch.zeros(*TOKENS.shape, 32, requires_grad=True) for name in names}
        logits = bridge.run_with_hooks(TOKENS, fwd_hooks=[(n, lambda x, hook: x + shifts[hook.name]) for n in names])
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), TOKENS[:, 1:].flatten())
        grads = torch.autograd.grad(loss, [shifts[name] for name in names])
        received = [*captured[consumer][0].unbind(-2), captured[consumer][1]]
        clean = _recomputed_mix(bridge, consumer, received)[3]
        for source in range(len(received)):
            knocked = _recomputed_mix(bridge, consumer, received, dropped=source)[3]
            expected = sum((g.double() * (knocked - clean)[..., r, :]).sum() for r, g in enumerate(grads))
            assert table.loc[(consumer, source), "total"] == pytest.approx(expected.item(), rel=2e-3, abs=1e-7)


def test_gated_inputs_of_later_visits_are_the_message_gates_outputs(inkling_folders):
    bridge = from_transformers(inkling_folders["loop"])
    reference = _reference(inkling_folders["loop"])
    seen: defaultdict[str, list[torch.Tensor]] = defaultdict(list)
    for layer in range(2, 6):
        for route in ("q", "k", "v", "mlp"):
            gate = getattr(reference.model.layers[layer], f"{route}_message_gate")
            gate.register_forward_hook(lambda _m, _a, out, key=f"{layer}.{route}": seen[key].append(out.detach()))
    reference(input_ids=TOKENS, use_cache=False)
    _, cache = bridge.run_with_cache(TOKENS)
    for step in bridge.visits:
        if step.visit is None or step.visit == 1:
            continue
        attn, mlp = 2 * step.index, 2 * step.index + 1
        _close(cache[bridge.sublayer_input_hook(attn)], seen[f"{step.layer}.q"][step.visit - 2], 1e-5)
        _close(cache[bridge.sublayer_input_hook(mlp)], seen[f"{step.layer}.mlp"][step.visit - 2], 1e-5)
        for route in ("k", "v"):
            _close(
                cache[f"blocks.{step.layer}.visit{step.visit}.hook_gated_{route}"],
                seen[f"{step.layer}.{route}"][step.visit - 2],
                1e-5,
            )
        # the mix the depth analyses decompose is still there, before the gate
        assert bridge.route_input_hook(attn, bridge.routes(attn)[0]).endswith("hook_resid_pre")
        assert not torch.allclose(cache[bridge.route_input_hook(mlp, "mix")], cache[bridge.sublayer_input_hook(mlp)])


def test_run_with_cache_returns_an_activation_cache_that_refuses_running_sum_helpers(inkling_folders):
    from transformer_lens import ActivationCache

    bridge = from_transformers(inkling_folders["plain"])
    _, cache = bridge.run_with_cache(TOKENS)
    assert isinstance(cache, ActivationCache) and cache["blocks.1.hook_resid_pre"].shape == (*TOKENS.shape, 32)
    with pytest.raises(
        ValueError, match="assumes a running-sum residual stream, but this model's kind is InklingBridge"
    ):
        cache.accumulated_resid()


def _loss(logits: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), TOKENS[:, 1:].flatten()).item()


def _zero_calls(calls: set[int] | None):
    """A forward hook zeroing a module's output on its `calls` (1-based; every call when None)."""
    seen = [0]

    def hook(_module, _args, output):
        seen[0] += 1
        return torch.zeros_like(output) if calls is None or seen[0] in calls else output

    return hook


def test_every_protocol_analysis_runs_on_the_mini_with_messages_and_visits_against_direct_knockouts(inkling_folders):
    """Depth maps and summary show the message consumers; causal routing, edge knockouts and the routing audit
    measure a knockout equal to the one written on transformers' module; pruning removes one visit of a looped
    layer, or all of them, as zeroing those calls of transformers' post-MLP convolution does."""
    from attnres_lens.analysis import (
        depth_summary,
        depth_weights,
        depth_weights_per_token,
        edge_knockouts,
        routing_audit,
        source_logit_lens,
    )
    from attnres_lens.analysis.depth import mixing_diagnostics, mixing_matrix_from_weights
    from attnres_lens.analysis.interventions import removal_hooks
    from attnres_lens.analysis.pruning import angular_distance_matrix, pruning_sensitivity
    from attnres_lens.analysis.routing import causal_routing
    from attnres_lens.tasks.base import Batch, next_token_targets

    bridge = from_transformers(inkling_folders["loop"])
    targets = next_token_targets(TOKENS)
    batch = Batch(TOKENS, targets, targets != -100)
    clean = _loss(_reference(inkling_folders["loop"])(input_ids=TOKENS, use_cache=False).logits)
    _, cache = bridge.run_with_cache(TOKENS)

    weights, summary = depth_weights(bridge, TOKENS), depth_summary(bridge, TOKENS)
    messages = bridge.message_consumers()
    assert list(summary[summary["kind"] == "msg"]["consumer_label"].unique()) == messages
    J = bridge.n_sublayers  # tables number message k as consumer J + 1 + k: one integer column (parquet)
    assert list(summary[summary["kind"] == "msg"]["consumer"].unique()) == [J + 1 + k for k in range(len(messages))]
    assert weights["consumer"].dtype.kind == summary["consumer"].dtype.kind == "i"
    shown = cache[bridge.depth_hook("L2.msg@3", "weights")].double().mean(dim=(0, 1))  # [route, source]
    rows = weights[weights["consumer_label"] == "L2.msg@3"]
    assert list(rows["route"].unique()) == ["q", "k", "v", "mlp"]
    torch.testing.assert_close(torch.tensor(rows["weight"].to_numpy()).view(4, -1), shown, rtol=1e-5, atol=1e-7)
    assert set(depth_weights_per_token(bridge, TOKENS[:1])["consumer_label"]) >= set(messages)

    # the message knockout, directly: transformers' message module without that block state on that call
    reference = _reference(inkling_folders["loop"])
    module = reference.model.message_input
    module.forward = _drop_source(0, module.forward, call=2, layer_idx=0)
    direct = _loss(reference(input_ids=TOKENS, use_cache=False).logits) - clean
    routing = causal_routing(bridge, batch).set_index(["consumer_label", "source"])
    assert routing.loc[("L2.msg@3", 0), "delta_loss"] == pytest.approx(direct, rel=1e-4, abs=1e-6)
    assert routing.loc[("L2.msg@3", 0), "kind"] == "msg" and abs(direct) > 1e-5
    knockouts = edge_knockouts(bridge, batch, screen_fraction=1, n_boot=10).set_index(["consumer_label", "source"])
    assert knockouts.loc[("L2.msg@3", 0), "delta_loss"] == pytest.approx(direct, rel=1e-4, abs=1e-6)

    # a full-attention looped consumer (L3.attn@2, three routes) in the routing audit
    consumer = next(c for c in bridge.consumers() if bridge.sublayer_name(c) == "L3.attn@2")
    reference = _reference(inkling_folders["loop"])
    module = reference.model.layers[3].attention_input
    module.forward = _drop_source(0, module.forward, call=2)
    direct = _loss(reference(input_ids=TOKENS, use_cache=False).logits) - clean
    audit = routing_audit(bridge, batch, n_boot=10)
    pairs = audit["pairs"][(audit["pairs"]["consumer"] == consumer) & (audit["pairs"]["source"] == 0)]
    assert list(pairs["route"]) == ["q", "k", "v"]
    assert pairs["delta_loss"].to_numpy() == pytest.approx([direct] * 3, rel=1e-4, abs=1e-6)
    alpha = cache[bridge.depth_hook(consumer, "weights")].double().mean(dim=(0, 1))[:, 0]
    assert pairs["alpha_mass"].to_numpy() == pytest.approx(alpha.numpy(), rel=1e-5)

    # removal of one visit, and of every visit, of L3's MLP against zeroing those calls on transformers' module
    visits = [j for j in range(bridge.n_sublayers) if bridge.sublayer_name(j).startswith("L3.mlp@")]
    one_visit = _reference_with_zeroed_calls(inkling_folders["loop"], {2})
    _close(bridge.run_with_hooks(TOKENS, fwd_hooks=removal_hooks(bridge, [visits[1]])), one_visit, 1e-5)
    every_visit = _reference_with_zeroed_calls(inkling_folders["loop"], None)
    _close(bridge.run_with_hooks(TOKENS, fwd_hooks=removal_hooks(bridge, visits)), every_visit, 1e-5)
    sensitivity = pruning_sensitivity(bridge, batch).set_index("label")
    assert sensitivity.loc["L3.mlp@2", "dloss_remove"] == pytest.approx(_loss(one_visit) - clean, rel=1e-4, abs=1e-6)
    assert sensitivity["routing_mass"].notna().all()  # M is defined on Inkling: layer 0 reads e with weight 1

    # the rest runs and is shaped as on the toolkit's model
    assert len(angular_distance_matrix(bridge, TOKENS)) == bridge.n_sublayers * (bridge.n_sublayers + 1) // 2
    assert len(mixing_diagnostics(bridge, TOKENS)) == bridge.n_sublayers + 1
    assert set(source_logit_lens(bridge, TOKENS, k=2)["vector"]) == {"source", "input"}
    with pytest.raises(ValueError, match="use depth_mixing_matrix\\(model, tokens\\)"):
        mixing_matrix_from_weights(bridge, weights)


def _reference_with_zeroed_calls(folder: str, calls: set[int] | None) -> torch.Tensor:
    """transformers' logits with layer 3's post-MLP convolution zeroed on `calls` (every call when None)."""
    reference = _reference(folder)
    reference.model.layers[3].post_mlp_convolution.register_forward_hook(_zero_calls(calls))
    return reference(input_ids=TOKENS, use_cache=False).logits


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_depth_logit_attribution_splits_the_pre_cap_logit_against_a_float64_recomputation(inkling_folders, kind):
    from attnres_lens.analysis import depth_logit_attribution

    bridge = from_transformers(inkling_folders[kind])
    bridge.hf_model.logit_softcap.softcap = (
        0.05  # a cap that bends these small logits (about ±0.1), so pre- and post-cap differ
    )
    text_model, J = bridge.hf_model.model, bridge.n_sublayers
    captured, handles = _captured_consumer_inputs(bridge)
    seen: dict[str, torch.Tensor] = {}
    handles += [
        text_model.norm.register_forward_pre_hook(lambda _m, args: seen.update(norm_input=args[0].detach())),
        bridge.hf_model.lm_head.register_forward_hook(lambda _m, _a, out: seen.update(pre_cap=out.detach())),
    ]
    table = depth_logit_attribution(bridge, TOKENS)
    for handle in handles:
        handle.remove()
    table = table.sort_values(["sequence", "position", "source"])
    n_sources = len(bridge.sources(J))
    targets = TOKENS[:, 1:]
    pre_cap = seen["pre_cap"].double()[:, :-1].gather(-1, targets[..., None]).squeeze(-1)  # [b, p-1]
    per_position = table.groupby(["sequence", "position"], sort=True)
    total = per_position["contribution"].sum() + per_position["bias"].first()
    torch.testing.assert_close(torch.tensor(total.to_numpy()), pre_cap.reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(per_position["logit"].first().to_numpy()), pre_cap.reshape(-1))
    capped = bridge(TOKENS).double()[:, :-1].gather(-1, targets[..., None]).squeeze(-1)
    assert (capped - pre_cap).abs().max() > 0.01  # the column is the pre-cap logit, not the model's output
    # each source: α_s (g ⊙ v_s / σ) · W_U[:, t] in float64 from what transformers' modules received
    alpha, values, _, _ = _recomputed_mix(bridge, J, [*captured[J][0].unbind(-2), captured[J][1]])
    x = seen["norm_input"].double()
    sigma = (x.pow(2).mean(-1, keepdim=True) + text_model.norm.variance_epsilon).sqrt()
    frozen = values * text_model.norm.weight.double() / sigma[..., None, :]  # [b, p, S, D]
    direction = bridge.hf_model.lm_head.weight.double()[targets]  # [b, p-1, D]
    expected = alpha[:, :-1, 0] * (frozen[:, :-1] * direction[..., None, :]).sum(-1)  # [b, p-1, S]
    got = torch.tensor(table["contribution"].to_numpy()).reshape(*targets.shape, n_sources)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (table["bias"] == 0).all()  # lm_head has no bias


@pytest.mark.parametrize("kind", ["loop", "deepseek_v4"])
def test_interventions_stacked_along_the_batch_equal_one_forward_pass_each(kind, request):
    """`evaluate_many` on a model the staged engine does not know stacks the interventions along the batch, each
    one's hooks on its own copy: every intervention's logits equal its own `run_with_hooks` pass up to the float32
    reordering of a larger batch (the bound of tests/helpers.py over the model's longest chain of sums); a hook
    that returns None observes its copy alone; a limit on the sequences a pass splits the stack. On the
    Inkling-2-Mini (message consumers, looped visits, MoE) and on DeepSeek V4 (mHC streams, hash routing by token)."""
    from attnres_lens.analysis import evaluate_many, removal_hooks
    from attnres_lens.tasks.base import Batch, next_token_targets

    from .helpers import reordering_bound

    folders = {"loop": lambda: request.getfixturevalue("inkling_folders")["loop"]}
    folders["deepseek_v4"] = lambda: request.getfixturevalue("deepseek_v4_folder")
    bridge = from_transformers(folders[kind]()).eval()
    targets = next_token_targets(TOKENS)
    batch = Batch(TOKENS, targets, targets != -100)
    seen: list[int] = []

    def observe(tensor: torch.Tensor, hook) -> None:
        seen.append(tensor.shape[0])

    interventions = [
        [],
        removal_hooks(bridge, [1]),
        [(bridge.sublayer_output_hook(2), observe)] + removal_hooks(bridge, [0, 5]),
        removal_hooks(bridge, [4]),
        # reads its own copy, which differs from the others' there
        removal_hooks(bridge, [1]) + [(bridge.sublayer_output_hook(3), lambda output, hook: 3 * output)],
    ]
    if bridge.consumers():  # DeepSeek V4 mixes through mHC streams: no depth softmax to mask
        interventions.append(source_mask_hooks(bridge, bridge.consumers()[3], [0]))
    one_each = [bridge.run_with_hooks(TOKENS, fwd_hooks=list(hooks)) for hooks in interventions]
    config = bridge.hf_model.config
    widest = max(config.hidden_size, config.moe_intermediate_size, getattr(config, "intermediate_size", 0))
    per_sublayer = widest + TOKENS.shape[1] + 4 * config.hidden_size + getattr(config, "hc_mult", 1)  # mHC streams
    chain = TOKENS.numel() + config.vocab_size + bridge.n_sublayers * per_sublayer
    for max_sequences in (None, 2 * len(TOKENS)):  # all in one pass; two copies a pass
        seen.clear()
        stacked = evaluate_many(
            bridge, batch, interventions, score=lambda logits, _: logits, max_sequences=max_sequences
        )
        assert seen == [len(TOKENS)]
        for got, expected in zip(stacked, one_each, strict=True):
            bound = reordering_bound(chain, expected.abs().max().item())
            torch.testing.assert_close(got, expected, rtol=0, atol=bound)
    assert (one_each[1] - one_each[0]).abs().max() > 1e-3  # the interventions change the logits
