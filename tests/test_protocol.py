"""The depth-mixing model protocol (docs/architecture.md §7): the toolkit's model implements it, and every analysis
moved onto it gives the same numbers through a protocol-only view of the model (`ProtocolOnly`, which fails with
AttributeError wherever an analysis reaches past the protocol) as on the model itself, whose analyses keep their
staged-engine paths."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from attnres_lens import HookedTransformer
from attnres_lens.analysis import (
    angular_distance_matrix,
    causal_routing,
    cumulative_pruning,
    depth_input_decomposition,
    depth_logit_attribution,
    depth_mixing_matrix,
    depth_summary,
    depth_weights,
    depth_weights_per_token,
    edge_sensitivity,
    evaluate_many,
    per_position_loss,
    prune_tables,
    pruning_sensitivity,
    removal_hooks,
    routing_audit,
    source_logit_lens,
    source_mask_hooks,
)
from attnres_lens.analysis.depth import depth_mixing_per_token, mixing_diagnostics, mixing_matrix_from_weights
from attnres_lens.attnres import EMBEDDING
from attnres_lens.evaluation import score_logits
from attnres_lens.mixing import mixing_coefficients
from attnres_lens.protocol import DEPTH_POINTS, DepthMixingModel

from .helpers import ProtocolOnly, copy_batch, randomize_depth_parameters, small_config

LAYOUTS = {"full": dict(block_size=1), "block": dict(block_size=2), "two-heads": dict(block_size=1, attnres_heads=2)}


def float64_attnres(block_size: int, **overrides) -> HookedTransformer:
    """A float64 AttnRes model with non-uniform routing (two pseudo-query heads where asked)."""
    model = HookedTransformer(small_config("attnres", block_size, dtype=torch.float64, **overrides)).eval()
    if model.cfg.attnres_heads == 1:
        randomize_depth_parameters(model)
    else:  # the key norm's gain is shared by the heads; each head's query slice differs
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for module in model.depth_attention_modules().values():
                module.query.copy_(torch.randn(module.query.shape, generator=generator, dtype=torch.float64))
    return model


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request) -> tuple[HookedTransformer, ProtocolOnly]:
    model = float64_attnres(**LAYOUTS[request.param])
    return model, ProtocolOnly(model)


def assert_same_frame(ours: pd.DataFrame, theirs: pd.DataFrame) -> None:
    """Equal tables; float columns to float64 rounding (the staged engine's stacked passes against plain ones)."""
    pd.testing.assert_frame_equal(ours, theirs, check_exact=False, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------- the toolkit model's members
def test_the_toolkit_model_implements_the_protocol_and_the_proxy_only_that():
    model = float64_attnres(2)
    proxy = ProtocolOnly(model)
    assert isinstance(model, DepthMixingModel) and isinstance(proxy, DepthMixingModel)
    for reach in ("cfg", "blocks", "depth_attention_modules", "parameters", "ln_final", "unembed"):
        with pytest.raises(AttributeError):
            getattr(proxy, reach)
    J = model.cfg.n_sublayers
    assert (model.n_sublayers, model.d_vocab) == (J, model.cfg.d_vocab)
    assert model.consumers() == list(range(J + 1))  # every sublayer and the final readout mixes under AttnRes
    for consumer, module in model.depth_attention_modules().items():
        assert model.routes(consumer) == ["mix"]
        for point in DEPTH_POINTS:
            assert model.hook_dict[model.depth_hook(consumer, point)] is getattr(module, f"hook_{point}")
    with pytest.raises(ValueError, match="depth hook point must be one of .*got 'alpha'"):
        model.depth_hook(0, "alpha")
    with pytest.raises(ValueError, match=rf"consumer must be one of .*got {J + 1}"):
        model.routes(J + 1)


def test_routes_of_multi_head_attnres_and_no_consumers_without_depth_attention():
    heads = HookedTransformer(small_config("attnres", 1, attnres_heads=2))
    assert {tuple(heads.routes(c)) for c in heads.consumers()} == {("h0", "h1")}
    tokens = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    _, cache = heads.run_with_cache(tokens)
    assert cache[heads.depth_hook(3, "weights")].shape == (2, 8, 2, len(heads.sources(3)))
    for residual in ("standard", "denseformer", "mhc"):
        model = HookedTransformer(small_config(residual))
        assert model.consumers() == []
        with pytest.raises(ValueError, match=f"a residual='{residual}' model has no depth attention"):
            model.depth_hook(0, "weights")


@pytest.mark.parametrize("residual, block_size", [("standard", 1), ("attnres", 2), ("mhc", 1)])
def test_the_readout_hook_shows_the_final_norms_input_and_the_readout_maps_it_to_the_logits(residual, block_size):
    model = HookedTransformer(small_config(residual, block_size, dtype=torch.float64)).eval()
    if residual == "attnres":
        randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0))
    seen: list[torch.Tensor] = []  # the ground truth: what the final norm is called with
    handle = model.ln_final.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            clean = model(tokens)
    finally:
        handle.remove()
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=model.readout_input_hook)
        torch.testing.assert_close(cache[model.readout_input_hook], seen[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(logits, clean, rtol=0, atol=1e-12)
        torch.testing.assert_close(model.readout(seen[0]), clean, rtol=0, atol=1e-12)
        # an edit at the hook is what the final norm reads, in a plain pass and in the engine's stacked ones
        edit = (model.readout_input_hook, lambda x, hook: 2 * x + 1)
        edited = model.run_with_hooks(tokens, fwd_hooks=[edit])
        torch.testing.assert_close(edited, model.readout(2 * seen[0] + 1), rtol=0, atol=1e-12)
    batch = copy_batch(3)
    expected = [score_logits(model.run_with_hooks(batch.tokens, fwd_hooks=hooks), batch) for hooks in ([], [edit])]
    for result, reference in zip(evaluate_many(model, batch, [[], [edit]]), expected):
        assert result.loss == pytest.approx(reference.loss, rel=1e-12)


def test_the_embedding_hooks_sum_to_the_embedding_source():
    for positions in ("rotary", "standard"):
        model = HookedTransformer(small_config("attnres", 1, positional_embedding_type=positions)).eval()
        tokens = torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0))
        _, cache = model.run_with_cache(tokens)
        embedding = sum(cache[name] for name in model.embedding_hooks)
        expected = model.embed.W_E[tokens] + (model.pos_embed.W_pos[:10] if positions == "standard" else 0)
        torch.testing.assert_close(embedding, expected)
        assert model.sources(0) == [[EMBEDDING]]  # sublayer 0 reads e alone: its input is e
        torch.testing.assert_close(cache[model.sublayer_input_hook(0)], embedding)


# ---------------------------------------------------------------------------- the same numbers through the proxy
def test_depth_maps_and_summary_are_the_same_through_the_protocol(pair):
    model, proxy = pair
    tokens = copy_batch(3).tokens
    for table in (depth_weights, depth_summary):
        assert_same_frame(table(proxy, tokens), table(model, tokens))
    assert_same_frame(depth_weights_per_token(proxy, tokens[:1]), depth_weights_per_token(model, tokens[:1]))
    weights = depth_weights(model, tokens)
    # one row per route and source; the routes' α is what the depth hook shows, token-averaged
    _, cache = model.run_with_cache(tokens)
    for consumer in model.consumers():
        routes = model.routes(consumer)
        rows = weights[weights["consumer"] == consumer]
        assert list(rows["route"].unique()) == routes
        shown = cache[model.depth_hook(consumer, "weights")].float()
        shown = shown.mean((0, 1)) if len(routes) > 1 else shown.mean((0, 1))[None]
        torch.testing.assert_close(torch.tensor(rows["weight"].to_numpy()).view(len(routes), -1).float(), shown)
    # the summary's entropy per route, from the hook's α directly
    summary = depth_summary(model, tokens).set_index(["consumer", "route"])
    for consumer in model.consumers():
        shown = cache[model.depth_hook(consumer, "weights")].double()
        per_route = shown.unbind(-2) if shown.ndim == 4 else [shown]
        for route, alpha in zip(model.routes(consumer), per_route):
            entropy = -(alpha * alpha.clamp_min(1e-30).log()).sum(-1).mean().item()
            assert summary.loc[(consumer, route), "entropy"] == pytest.approx(entropy, rel=1e-5)


def test_the_mixing_matrix_is_the_same_through_the_protocol_where_it_is_defined(pair):
    model, proxy = pair
    tokens = copy_batch(3).tokens
    if len(model.routes(0)) > 1:  # channel groups are the toolkit's; a protocol model's routes feed separate inputs
        for analysis in (lambda: depth_mixing_matrix(proxy, tokens), lambda: mixing_diagnostics(proxy, tokens)):
            with pytest.raises(ValueError, match=r"run several routes \(\['h0', 'h1'\]\)"):
                analysis()
        return
    assert_same_frame(depth_mixing_matrix(proxy, tokens), depth_mixing_matrix(model, tokens))
    assert_same_frame(depth_mixing_per_token(proxy, tokens[:1]), depth_mixing_per_token(model, tokens[:1]))
    assert_same_frame(mixing_diagnostics(proxy, tokens), mixing_diagnostics(model, tokens))
    from_weights = mixing_matrix_from_weights(proxy, depth_weights(proxy, tokens))
    assert_same_frame(from_weights, mixing_matrix_from_weights(model, depth_weights(model, tokens)))


def test_removal_and_masking_hooks_are_the_same_through_the_protocol(pair):
    model, proxy = pair
    J = model.cfg.n_sublayers
    for removed in ([0], [1, 2], list(range(J))):
        assert removal_hooks(proxy, removed) == removal_hooks(model, removed)
    assert source_mask_hooks(proxy, J, [1]) == source_mask_hooks(model, J, [1])
    # the plain forwards of the protocol path against the staged engine
    batch = copy_batch(4)
    interventions = [[], removal_hooks(model, [1]), removal_hooks(model, [0, 3]), source_mask_hooks(model, J, [0])]
    ours, theirs = evaluate_many(proxy, batch, interventions), evaluate_many(model, batch, interventions)
    for a, b in zip(ours, theirs):
        assert a.loss == pytest.approx(b.loss, rel=1e-10) and a.accuracy == b.accuracy
    with pytest.raises(ValueError, match="no hook point named 'blocks.9.hook_attn_out'"):
        evaluate_many(proxy, batch, [[("blocks.9.hook_attn_out", lambda x, hook: x)]])


def test_pruning_tables_are_the_same_through_the_protocol(pair):
    model, proxy = pair
    batch = copy_batch(4)
    sensitivity = pruning_sensitivity(model, batch)
    through_protocol = pruning_sensitivity(proxy, batch)
    if len(model.routes(0)) > 1:  # routing mass reads M, which a protocol model's several routes leave undefined
        assert "routing_mass" not in through_protocol
        sensitivity = sensitivity.drop(columns="routing_mass")
    assert_same_frame(through_protocol, sensitivity)
    distances = angular_distance_matrix(model, batch.tokens)
    assert_same_frame(angular_distance_matrix(proxy, batch.tokens), distances)
    curves = cumulative_pruning(model, batch, sensitivity, distances, stop_at=None)
    assert_same_frame(cumulative_pruning(proxy, batch, sensitivity, distances, stop_at=None), curves)


def test_causal_routing_is_the_same_through_the_protocol(pair):
    model, proxy = pair
    batch = copy_batch(4)
    assert_same_frame(causal_routing(proxy, batch), causal_routing(model, batch))


def test_the_prune_tables_and_the_loss_per_position_are_the_same_through_the_protocol():
    model = float64_attnres(2)
    proxy, batch = ProtocolOnly(model), copy_batch(4)
    ours, theirs = prune_tables(proxy, batch), prune_tables(model, batch)
    assert ours.keys() == theirs.keys() and "routing" in ours
    for name in ours:
        assert_same_frame(ours[name], theirs[name])
    assert_same_frame(per_position_loss(proxy, batch.tokens), per_position_loss(model, batch.tokens))


def test_attribution_tables_are_the_same_through_the_protocol(pair):
    model, proxy = pair
    batch = copy_batch(4)
    assert_same_frame(source_logit_lens(proxy, batch.tokens, k=3), source_logit_lens(model, batch.tokens, k=3))
    assert_same_frame(edge_sensitivity(proxy, batch), edge_sensitivity(model, batch))
    if len(model.routes(0)) > 1:
        for analysis in (depth_input_decomposition, lambda m, t: routing_audit(m, batch, n_boot=10)):
            with pytest.raises(ValueError, match=r"needs one weight per source; .*routes \['h0', 'h1'\]"):
                analysis(proxy, batch.tokens)
        return
    assert_same_frame(depth_input_decomposition(proxy, batch.tokens), depth_input_decomposition(model, batch.tokens))
    ours, theirs = routing_audit(proxy, batch, n_boot=20), routing_audit(model, batch, n_boot=20)
    for name in ("pairs", "consumers"):
        assert_same_frame(ours[name], theirs[name])


def test_what_the_protocol_does_not_name_is_refused_with_the_reason():
    model = float64_attnres(1)
    proxy, batch = ProtocolOnly(model), copy_batch(2)
    # a model whose inputs are not depth mixes has no M the protocol could read (the toolkit's own sums have one)
    plain = ProtocolOnly(HookedTransformer(small_config("standard")))
    with pytest.raises(ValueError, match=r"every sublayer and the final readout to read a depth mix; .*'L0.attn'"):
        depth_mixing_matrix(plain, batch.tokens)
    with pytest.raises(ValueError, match="has no depth attention; its mixing weights are in depth_mixing_matrix"):
        depth_weights(plain, batch.tokens)
    with pytest.raises(ValueError, match="freezes the final norm's scale.*use source_logit_lens"):
        depth_logit_attribution(proxy, batch.tokens)
    corrupted = batch.tokens.flip(0)
    with pytest.raises(ValueError, match="use the knockout mode"):
        edge_sensitivity(proxy, batch, corrupted=corrupted)


def test_route_input_hooks_of_the_toolkit_model_are_its_inputs_and_channel_groups_have_none():
    model = float64_attnres(2)
    J = model.cfg.n_sublayers
    assert [model.route_input_hook(c, "mix") for c in range(J)] == [model.sublayer_input_hook(c) for c in range(J)]
    assert model.route_input_hook(J, "mix") == model.readout_input_hook
    with pytest.raises(ValueError, match=r"route must be one of \['mix'\], got 'q'"):
        model.route_input_hook(0, "q")
    heads = HookedTransformer(small_config("attnres", 1, attnres_heads=2))
    with pytest.raises(ValueError, match="route 'h0' mixes only its channel group"):
        heads.route_input_hook(0, "h0")


class OwnMixing(ProtocolOnly):
    """A protocol model that computes M itself (as the DeepSeek V4 bridge does): a fixed random lower triangle."""

    __slots__ = ()

    def mixing_coefficients(self, tokens: torch.Tensor) -> torch.Tensor:
        n = self.n_sublayers + 1
        generator = torch.Generator().manual_seed(3)
        return torch.rand(*tokens.shape, n, n, generator=generator, dtype=torch.float64).tril()


def test_a_models_own_mixing_coefficients_are_what_the_m_analyses_read():
    plain = OwnMixing(HookedTransformer(small_config("standard")))  # no consumers: M from weights would be refused
    tokens = copy_batch(2).tokens
    own = plain.mixing_coefficients(tokens)
    frame = depth_mixing_matrix(plain, tokens)
    J = plain.n_sublayers
    expected = own.mean(dim=(0, 1))
    assert frame.set_index(["consumer", "sublayer"])["weight"].to_dict() == pytest.approx(
        {(c, i): expected[c, i + 1].item() for c in range(J + 1) for i in [EMBEDDING, *range(c)]}
    )
    assert len(mixing_diagnostics(plain, tokens)) == J + 1
    with pytest.raises(ValueError, match="computes M itself .* drop route='k'"):
        mixing_coefficients(plain, tokens, route="k")
