"""Attribution through depth (docs/analysis.md §11); the shared-prefix evaluation it runs on is tested in
test_interventions.py.

Ground truth is independent of the code under test: float64 re-derivations, TransformerLens's own residual
decomposition, exact knockouts and hand-built circuits whose answer is known.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from attnres_lens import HookedTransformer, ModelConfig
from attnres_lens.analysis import (
    causal_routing,
    depth_input_decomposition,
    depth_logit_attribution,
    edge_agreement,
    edge_sensitivity,
    fastest_changes,
    kv_shift_decomposition,
    kv_shift_parts,
    logit_attribution_summary,
    logit_lens_summary,
    repeated_batch,
    routing_audit,
    source_logit_lens,
    training_timeline,
)
from attnres_lens.analysis.attribution import depth_terms
from attnres_lens.config import apply_overrides
from attnres_lens.presets import get_preset
from attnres_lens.rundir import load_run
from attnres_lens.tasks.base import IGNORE_INDEX, next_token_targets
from attnres_lens.training import train

from .helpers import copy_batch, randomize_depth_parameters, reference_logits, run_cli, small_config
from .test_analysis import N_CTX, VOCAB, duplicate_free_repeats, hand_built_heads


# ---------------------------------------------------------------------------- depth direct logit attribution
def float64_model(residual: str, block_size: int = 1, **overrides) -> HookedTransformer:
    model = HookedTransformer(small_config(residual, block_size, dtype=torch.float64, **overrides)).eval()
    randomize_depth_parameters(model)
    return model


@pytest.mark.parametrize("residual, block_size", [("standard", 1), ("attnres", 1), ("attnres", 2)])
def test_per_source_terms_sum_exactly_to_the_clean_logit_minus_the_bias(residual, block_size):
    model = float64_model(residual, block_size)
    with torch.no_grad():
        model.unembed.b_U.normal_(generator=torch.Generator().manual_seed(5))  # a bias term to subtract
    tokens = copy_batch(3).tokens
    reference = reference_logits(model, tokens).detach()  # an independent float64 forward pass
    targets = next_token_targets(tokens)
    wrong = (targets + 1) % model.cfg.d_vocab
    for incorrect in (None, wrong):
        table = depth_logit_attribution(model, tokens, incorrect=incorrect)
        assert set(table["source_label"]) == set(model.source_labels(model.cfg.n_sublayers))
        per_position = table.groupby(["sequence", "position"])
        total = per_position["contribution"].sum() + per_position["bias"].first()
        assert (total - per_position["logit"].first()).abs().max() < 1e-10
        first = per_position.first().reset_index()
        rows, cols = torch.tensor(first["sequence"]), torch.tensor(first["position"])
        expected = reference[rows, cols, targets[rows, cols]]
        if incorrect is not None:
            expected = expected - reference[rows, cols, wrong[rows, cols]]
        assert first["logit"].to_numpy() == pytest.approx(expected.numpy(), abs=1e-10)
    summary = logit_attribution_summary(table)
    assert summary["share"].sum() == pytest.approx(1)


def test_standard_model_attribution_equals_transformer_lens_decomposition():
    """TransformerLens's own per-component DLA (decompose_resid → apply_ln_to_stack → logit_attrs, with the final
    norm's gain folded into the unembedding directions as TL expects) gives the same numbers."""
    model = float64_model("standard")
    tokens = copy_batch(2).tokens
    targets = next_token_targets(tokens)
    _, cache = model.run_with_cache(tokens)
    stack, labels = cache.decompose_resid(layer=-1, return_labels=True)  # embed, 0_attn_out, 0_mlp_out, …
    folded = model.ln_final.w[:, None] * model.unembed.W_U
    model.tokens_to_residual_directions = lambda ids: folded[:, torch.as_tensor(ids)].movedim(0, -1)
    try:
        tl = cache.logit_attrs(stack, tokens=targets.clamp_min(0))  # [component, batch, pos]
    finally:
        del model.tokens_to_residual_directions
    ours = depth_logit_attribution(model, tokens)
    names = {"embed": "emb"} | {
        f"{j // 2}_{'attn' if j % 2 == 0 else 'mlp'}_out": model.sublayer_name(j) for j in range(model.cfg.n_sublayers)
    }
    for component, label in enumerate(labels):
        mine = ours[ours["source_label"] == names[label]]
        theirs = tl[component][torch.tensor(mine["sequence"].to_numpy()), torch.tensor(mine["position"].to_numpy())]
        assert mine["contribution"].to_numpy() == pytest.approx(theirs.detach().numpy(), abs=1e-10), label


@pytest.mark.parametrize("residual, block_size", [("standard", 1), ("attnres", 1), ("attnres", 4)])
def test_every_sublayer_input_is_the_sum_of_its_source_terms(residual, block_size):
    model = float64_model(residual, block_size)
    tokens = copy_batch(3).tokens
    terms = depth_terms(model, tokens)
    for consumer in range(model.cfg.n_sublayers + 1):
        alpha = terms.alpha(model, consumer)
        rebuilt = sum(alpha[..., s, None] * v for s, v in enumerate(terms.source_vectors(model, consumer)))
        assert (rebuilt - terms.inputs[consumer]).abs().max() < 1e-12, consumer
    shares = depth_input_decomposition(model, tokens, per_token=True)
    by_token = shares.groupby(["consumer", "sequence", "position"])["share"].sum()
    assert by_token.to_numpy() == pytest.approx(1, abs=1e-10)
    averaged = depth_input_decomposition(model, tokens)
    assert len(averaged) == sum(len(model.sources(c)) for c in range(model.cfg.n_sublayers + 1))


def test_the_attribution_functions_refuse_bad_input_with_the_value():
    model = float64_model("attnres")
    tokens = copy_batch(2).tokens
    with pytest.raises(ValueError, match="targets must have the tokens' shape"):
        depth_logit_attribution(model, tokens, targets=tokens[:, :3])
    with pytest.raises(ValueError, match="token id 99"):
        depth_logit_attribution(model, tokens, targets=torch.full_like(tokens, 99))
    for wrong in (tokens.float() + 0.7, tokens > 2):  # not truncated to ids, not read as ids 0 and 1
        with pytest.raises(ValueError, match=f"targets must hold integer token ids, got dtype {wrong.dtype}"):
            depth_logit_attribution(model, tokens, targets=wrong)
    with pytest.raises(ValueError, match="incorrect must hold integer token ids"):
        depth_logit_attribution(model, tokens, incorrect=tokens.double())
    with pytest.raises(ValueError, match="k must be an integer in 1..20, got 0"):
        source_logit_lens(model, tokens, k=0)
    with pytest.raises(ValueError, match="metric must be one of"):
        edge_sensitivity(model, copy_batch(2), metric="perplexity")
    with pytest.raises(ValueError, match="needs depth attention; this model's residual is 'standard'"):
        edge_sensitivity(float64_model("standard"), copy_batch(2))
    with pytest.raises(ValueError, match="n_boot must be an integer >= 10, got 3"):
        routing_audit(model, copy_batch(2), n_boot=3)


# ---------------------------------------------------------------------------- logit lens
def test_the_lens_decodes_the_final_input_to_the_models_own_prediction():
    model = float64_model("attnres", 2)
    tokens = copy_batch(2).tokens
    lens = source_logit_lens(model, tokens, k=3)
    with torch.no_grad():
        logits = model(tokens)
    final = lens[lens["label"] == "→final"]
    rows, cols = torch.tensor(final["sequence"].to_numpy()), torch.tensor(final["position"].to_numpy())
    assert final["top_tokens"].str.split().str[0].astype(int).tolist() == logits[rows, cols].argmax(-1).tolist()
    target_logits = logits[rows, cols].gather(-1, torch.tensor(final["target"].to_numpy())[:, None]).squeeze(-1)
    assert final["target_logit"].to_numpy() == pytest.approx(target_logits.numpy(), abs=1e-10)
    ranks = (logits[rows, cols] > target_logits[:, None]).sum(-1)
    assert final["target_rank"].tolist() == ranks.tolist()
    # every source and every input, once per position with a target; Block AttnRes also its block sums
    labels = lens.drop_duplicates(["vector", "label"])
    assert (labels["vector"] == "input").sum() == model.cfg.n_sublayers + 1
    assert "B1 (L0) = L0.attn+L0.mlp" in set(labels["label"])
    summary = logit_lens_summary(lens)
    assert list(summary["label"]) == list(labels["label"]) and summary["top1"].between(0, 1).all()


# ---------------------------------------------------------------------------- edge attribution
def float64_loss(model: HookedTransformer, batch, fwd_hooks=(), pre_final=None) -> float:
    """The evaluation loss in float64 with hooks (and optionally a PyTorch pre-hook replacing the final
    readout's input, which has no hook point)."""
    handle = None
    if pre_final is not None:
        handle = model.ln_final.register_forward_pre_hook(lambda module, args: (pre_final(args[0]),))
    try:
        with torch.no_grad():
            logits = model.run_with_hooks(batch.tokens, fwd_hooks=list(fwd_hooks))
    finally:
        if handle is not None:
            handle.remove()
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX).item()


def nudge(model: HookedTransformer, batch, consumer: int, direction: torch.Tensor, epsilon: float) -> float:
    """Central finite difference of the loss along `direction` added to consumer's input."""

    def loss(sign: float) -> float:
        shift = lambda h: h + sign * epsilon * direction  # noqa: E731
        if consumer == model.cfg.n_sublayers:
            return float64_loss(model, batch, pre_final=shift)
        return float64_loss(model, batch, [(model.sublayer_input_hook(consumer), lambda h, hook: shift(h))])

    return (loss(1) - loss(-1)) / (2 * epsilon)


def knockout_direction(terms, model, consumer: int, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Δh of knocking `source` out of `consumer` (h' − h, h' the renormalised rest), and the value path −α_s v_s."""
    alpha, vectors = terms.alpha(model, consumer), terms.source_vectors(model, consumer)
    rest = [s for s in range(len(vectors)) if s != source]
    kept = alpha[..., rest].sum(-1, keepdim=True)
    after = sum(alpha[..., s, None] * vectors[s] for s in rest) / kept
    return after - terms.inputs[consumer], -alpha[..., source, None] * vectors[source]


def test_edge_estimates_are_the_directional_derivatives_of_the_loss_float64():
    model = float64_model("attnres", 1)
    batch = copy_batch(3)
    edges = edge_sensitivity(model, batch).set_index(["consumer", "source"])
    terms = depth_terms(model, batch.tokens)
    J = model.cfg.n_sublayers
    for consumer, source in [(1, 0), (3, 2), (J, 0), (J, J)]:
        total, value = knockout_direction(terms, model, consumer, source)
        row = edges.loc[(consumer, source)]
        assert row["total"] == pytest.approx(nudge(model, batch, consumer, total, 1e-5), rel=1e-6, abs=1e-10)
        assert row["value_path"] == pytest.approx(nudge(model, batch, consumer, value, 1e-5), rel=1e-6, abs=1e-10)


def test_corrupted_patching_estimates_are_directional_derivatives_float64():
    model = float64_model("attnres", 2)
    batch = copy_batch(3)
    corrupted = batch.tokens.roll(1, dims=0)
    edges = edge_sensitivity(model, batch, corrupted=corrupted).set_index(["consumer", "source"])
    assert set(edges["mode"]) == {"corrupted"}
    clean, corrupt = depth_terms(model, batch.tokens), depth_terms(model, corrupted)
    modules = model.depth_attention_modules()
    for consumer, source in [(1, 0), (2, 1), (model.cfg.n_sublayers, 1)]:
        vectors = clean.source_vectors(model, consumer)
        delta = corrupt.source_vectors(model, consumer)[source] - vectors[source]
        alpha = clean.alpha(model, consumer)

        def patched_input(epsilon: float, move_weights: bool) -> torch.Tensor:
            moved = [v + epsilon * delta if s == source else v for s, v in enumerate(vectors)]
            if not move_weights:  # the value path: the weights stay where they were
                return sum(alpha[..., s, None] * v for s, v in enumerate(moved))
            with torch.no_grad():
                return modules[consumer](moved)

        for column, move_weights in (("total", True), ("value_path", False)):
            # exact patches at ±ε through the consumer's input, against the first-order estimate
            def loss(epsilon: float) -> float:
                h = patched_input(epsilon, move_weights)
                if consumer == model.cfg.n_sublayers:
                    return float64_loss(model, batch, pre_final=lambda _: h)
                return float64_loss(model, batch, [(model.sublayer_input_hook(consumer), lambda t, hook: h)])

            derivative = (loss(1e-5) - loss(-1e-5)) / 2e-5
            assert edges.loc[(consumer, source), column] == pytest.approx(derivative, rel=1e-5, abs=1e-10), column


def test_a_zero_source_acts_only_through_routing_and_its_neighbour_only_through_its_value():
    """Layer 0's attention writes nothing (W_O = 0), so L0.mlp reads [e, f_0 = 0]: h = α_e e. Knocking out the
    zero source renormalises e's weight (value path 0); knocking out e leaves h' = 0 = h − α_e e, all value."""
    model = float64_model("attnres", 1)
    with torch.no_grad():
        model.blocks[0].attn.W_O.zero_()
    edges = edge_sensitivity(model, copy_batch(3)).set_index(["consumer", "source"])
    zero_source, embedding = edges.loc[(1, 1)], edges.loc[(1, 0)]
    assert zero_source["value_path"] == 0 and abs(zero_source["routing_path"]) > 1e-4
    assert abs(embedding["routing_path"]) < 1e-14 and abs(embedding["value_path"]) > 1e-4


def saturated_readout_model() -> HookedTransformer:
    """A Full AttnRes model whose final readout attends almost only to the embedding: every token embedding
    shares a large component along dim 0, no sublayer writes along dim 0, and the readout's query points there,
    so α_e ≈ 0.995 and every other source gets ≈ 1e-3."""
    model = float64_model("attnres", 1)
    with torch.no_grad():
        model.embed.W_E[:, 0] = 3.0
        for block in model.blocks:
            block.attn.W_O[..., 0] = 0
            block.mlp.W_out[:, 0] = 0
            block.mlp.b_out[0] = 0
        model.final_res.query.zero_()
        model.final_res.query[0] = 1.3
        model.final_res.key_norm.w.fill_(1)
    return model


def test_first_order_fails_on_a_saturated_softmax_and_the_report_says_where():
    model = saturated_readout_model()
    batch = copy_batch(4)
    J = model.cfg.n_sublayers
    edges = edge_sensitivity(model, batch)
    routing = causal_routing(model, batch)
    final = edges[edges["consumer"] == J].set_index("source")
    exact = routing[routing["consumer"] == J].set_index("source")["delta_loss"]
    assert final.loc[0, "max_alpha"] > 0.99
    # sources the readout barely uses: tiny effects, and the linear estimate of them is good
    for source in range(1, J + 1):
        assert final.loc[source, "alpha_mass"] < 0.01
        assert final.loc[source, "total"] == pytest.approx(exact[source], rel=0.05, abs=1e-6)
    # the embedding carries the readout: knocking it out is far outside the linear regime
    assert abs(exact[0]) > 0.01 and abs(final.loc[0, "total"] - exact[0]) > 0.5 * abs(exact[0])
    summary, worst = edge_agreement(edges, routing, top=3)
    assert worst.loc[0, "consumer_label"] == "final" and worst.loc[0, "source_label"] == "emb"
    assert worst.loc[0, "max_alpha"] > 0.99 and summary["n_edges"] == len(routing)


def test_edge_estimates_rank_exact_knockouts_when_the_softmax_is_soft():
    model = float64_model("attnres", 1, n_layers=4)
    with torch.no_grad():
        for module in model.depth_attention_modules().values():
            module.query.mul_(0.15)  # near-uniform routing: knockouts are small perturbations
    batch = copy_batch(4)
    summary, _ = edge_agreement(edge_sensitivity(model, batch), causal_routing(model, batch))
    assert summary["spearman"] > 0.9 and summary["sign_agreement"] > 0.8


# ---------------------------------------------------------------------------- routing audit
def test_routing_audit_point_estimates_are_the_exact_knockouts():
    model = float64_model("attnres", 1)
    batch = copy_batch(5)
    audit = routing_audit(model, batch, n_boot=200)
    routing = causal_routing(model, batch)
    pairs = audit["pairs"].merge(routing, on=["consumer", "source"], suffixes=("", "_exact"))
    assert len(pairs) == len(routing)
    assert pairs["delta_loss"].to_numpy() == pytest.approx(pairs["delta_loss_exact"].to_numpy(), abs=1e-6)
    assert pairs["alpha_mass"].to_numpy() == pytest.approx(pairs["alpha_mass_exact"].to_numpy(), abs=1e-6)
    for name in ("alpha_mass", "delta_loss"):
        assert (pairs[f"{name}_low"] <= pairs[f"{name}_high"]).all()
    consumers = audit["consumers"]
    assert list(consumers["consumer"]) == sorted(routing["consumer"].unique())
    assert consumers.loc[consumers["n_sources"] == 2, "spearman"].isna().all()
    assert consumers.loc[consumers["n_sources"] > 2, "spearman"].between(-1, 1).all()
    assert (consumers["null_mean_dloss"] != 0).any()  # content-dependent routing: the mean schedule is a change


def test_routing_audit_of_identical_sequences_has_no_spread():
    model = float64_model("attnres", 2)
    one = copy_batch(1)
    batch = type(one)(one.tokens.repeat(4, 1), one.targets.repeat(4, 1), one.answer_mask.repeat(4, 1))
    pairs = routing_audit(model, batch, n_boot=50)["pairs"]
    for name in ("alpha_mass", "delta_loss"):
        assert pairs[f"{name}_low"].to_numpy() == pytest.approx(pairs[name].to_numpy(), abs=1e-9)
        assert pairs[f"{name}_high"].to_numpy() == pytest.approx(pairs[name].to_numpy(), abs=1e-9)


def test_the_mean_schedule_changes_nothing_when_routing_ignores_the_content():
    """Zero pseudo-queries (step 0): α is uniform at every token, so its token mean is α itself."""
    model = HookedTransformer(small_config("attnres", 1, dtype=torch.float64)).eval()
    consumers = routing_audit(model, copy_batch(3), n_boot=20)["consumers"]
    assert consumers["null_mean_dloss"].abs().max() < 1e-6
    assert consumers["null_recency_dloss"].abs().max() > 1e-5  # pooled recency differs from 1/n per consumer


# ---------------------------------------------------------------------------- KV-shift decomposition
@pytest.mark.parametrize(
    "attention, extra",
    [
        ("kv_shift", {}),
        ("standard", {}),
        ("kv_shift", {"positional_embedding_type": "standard"}),
        ("kv_shift", {"n_key_value_heads": 2}),
    ],
)
def test_score_and_output_parts_sum_to_the_hooked_scores_and_z(attention, extra):
    model = HookedTransformer(small_config("standard", 1, attention, dtype=torch.float64, **extra)).eval()
    tokens = copy_batch(2).tokens
    _, cache = model.run_with_cache(tokens)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    for layer in range(model.cfg.n_layers):
        parts = kv_shift_parts(model, tokens, layer)
        scores = parts["current_scores"] + parts["shifted_scores"]
        hooked = cache["attn_scores", layer]
        assert (scores - hooked)[..., causal].abs().max() < 1e-12
        assert (parts["current_z"] + parts["shifted_z"] - cache["z", layer]).abs().max() < 1e-12
        if attention == "standard":
            assert parts["shifted_scores"].abs().max() == 0 and parts["shifted_z"].abs().max() == 0


def two_layer_induction_circuit() -> HookedTransformer:
    """Standard attention, two layers: layer 0 head 0 attends to the previous position and writes that token into
    dims 32–43; layer 1 head 0 matches its query token against those dims (the *current* key) and copies the
    token it finds to the logits: the two-layer previous-token + induction circuit."""
    vocab, n_ctx = VOCAB, N_CTX
    previous = range(vocab + n_ctx, 2 * vocab + n_ctx)
    cfg = ModelConfig(
        d_model=2 * vocab + n_ctx,
        n_heads=2,
        n_layers=2,
        n_ctx=n_ctx,
        d_vocab=vocab,
        attn_only=True,
        positional_embedding_type="standard",
        seed=0,
        dtype=torch.float64,
    )
    model = HookedTransformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for block in model.blocks:
            block.ln1.w.fill_(1)
        model.ln_final.w.fill_(1)
        first, second = model.blocks[0].attn, model.blocks[1].attn
        for p in range(n_ctx):
            model.pos_embed.W_pos[p, vocab + p] = 1
            first.W_K[0, vocab + p, p] = 2.5
            if p >= 1:
                first.W_Q[0, vocab + p, p - 1] = 2.5
        for v in range(vocab):
            model.embed.W_E[v, v] = 1
            model.unembed.W_U[v, v] = 1
            first.W_V[0, v, v] = first.W_O[0, v, previous[v]] = 1
            second.W_Q[0, v, v] = second.W_K[0, previous[v], v] = 3.0
            second.W_V[0, v, v] = second.W_O[0, v, v] = 1
    return model.eval()


def test_the_shifted_key_score_tells_the_one_layer_kv_shift_head_from_the_two_layer_circuit():
    batch = duplicate_free_repeats(8)
    one_layer = kv_shift_decomposition(hand_built_heads(), batch).set_index(["layer", "head"])
    head = one_layer.loc[(0, 0)]
    assert head["prefix_score"] > 0.9 and head["shifted_key_induction_score"] > 0.95
    assert head["shifted_key_advantage"] > 5 and abs(head["current_key_advantage"]) < 0.5
    assert abs(head["shifted_value_share"]) < 1e-9  # β = (1, 0): the values are not shifted
    two_layer = kv_shift_decomposition(two_layer_induction_circuit(), batch).set_index(["layer", "head"])
    induction = two_layer.loc[(1, 0)]
    assert induction["prefix_score"] > 0.9 and induction["current_key_advantage"] > 5
    assert induction["shifted_key_advantage"] == 0 and induction["shifted_key_induction_score"] == 0
    assert two_layer.loc[(0, 0), "prefix_score"] < 0.1  # the previous-token head is not itself an induction head


@pytest.fixture(scope="module")
def induction_runs(tmp_path_factory):
    """Short runs of the two mechanisms' presets at the smoke scale (a few seconds each): one-layer KV shift,
    which forms an induction head within 300 steps, and two-layer vanilla attention (too short to form one)."""
    runs = {}
    for name, overrides in (
        ("induction-1l-kvshift", ["model.n_layers=1", 'model.attention="kv_shift"']),
        ("induction-2l-vanilla", ["model.n_layers=2", 'model.attention="standard"']),
    ):
        out = tmp_path_factory.mktemp("attribution") / name
        config = apply_overrides(
            get_preset("smoke"),
            [
                "model.attn_only=true",
                'model.residual="standard"',
                "train.steps=300",
                "train.batch_size=16",
                "train.lr=0.01",
                "train.eval_every=100",
                "train.record_every=50",
                "train.checkpoint_every=300",
                *overrides,
            ],
        )
        train(config, out, progress=False)
        runs[name] = out
    return runs


@pytest.mark.slow
def test_trained_runs_use_the_mechanism_their_architecture_allows(induction_runs):
    probe = repeated_batch(32, half_len=15, vocab_size=24, seed=3)
    kv = kv_shift_decomposition(load_run(induction_runs["induction-1l-kvshift"]).model, probe)
    top = kv.loc[kv["prefix_score"].idxmax()]
    assert top["prefix_score"] > 0.4 and top["shifted_key_induction_score"] > 0.9
    vanilla = kv_shift_decomposition(load_run(induction_runs["induction-2l-vanilla"]).model, probe)
    assert (vanilla["shifted_key_advantage"] == 0).all() and (vanilla["shifted_key_induction_score"] == 0).all()


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[1] / "data" / "demo_runs" / "induction-2l-vanilla").is_dir(),
    reason="demo runs missing (make demo)",
)
def test_the_shipped_induction_runs_tell_the_two_mechanisms_apart():
    demo = Path(__file__).resolve().parent.parent / "data" / "demo_runs"
    probe = repeated_batch(16, half_len=20, vocab_size=64, seed=3)
    scores = {
        name: kv_shift_decomposition(load_run(demo / name).model, probe)
        for name in ("induction-1l-kvshift", "induction-2l-vanilla")
    }
    for name, expected in (("induction-1l-kvshift", 1.0), ("induction-2l-vanilla", 0.0)):
        top = scores[name].loc[scores[name]["prefix_score"].idxmax()]
        assert top["prefix_score"] > 0.5, name
        assert top["shifted_key_induction_score"] == pytest.approx(expected, abs=0.05), name
    vanilla = scores["induction-2l-vanilla"].set_index(["layer", "head"])
    # layer 1, current key
    assert vanilla["prefix_score"].idxmax()[0] == 1 and vanilla["current_key_advantage"].max() > 5


# ---------------------------------------------------------------------------- training timeline
def test_timeline_statistics_and_fastest_change_on_known_snapshots():
    weights = pd.DataFrame(
        [
            dict(step=step, consumer=1, consumer_label="L0.mlp", kind="mlp", source=s, source_label=label, weight=w)
            for step, alphas in ((0, (0.5, 0.5)), (10, (0.6, 0.4)), (20, (0.9, 0.1)), (30, (0.92, 0.08)))
            for s, (label, w) in enumerate(zip(("emb", "L0.attn"), alphas))
        ]
    )
    scores = pd.DataFrame(
        [
            dict(step=step, layer=0, head=h, prefix_score=value)
            for step, values in ((0, (0.0, 0.1)), (10, (0.1, 0.2)), (20, (0.15, 0.8)), (30, (0.2, 0.85)))
            for h, value in enumerate(values)
        ]
    )
    metrics = pd.DataFrame({"step": [0, 10, 20, 30], "loss": [3.0, 2.9, 1.5, 1.4], "eval_loss": [3.1, 3.0, 1.6, 1.5]})
    timeline = training_timeline({"depth_weights": weights, "induction_scores": scores}, metrics)
    entropy = timeline[timeline["series"] == "routing_entropy"].set_index("step")["value"]
    assert entropy[0] == pytest.approx(math.log(2))
    assert entropy[20] == pytest.approx(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))
    assert timeline[timeline["series"] == "induction_score"].set_index("step")["value"][20] == 0.8
    changes = fastest_changes(timeline).set_index("series")
    for series in ("routing_entropy", "max_weight", "embedding_weight", "induction_score", "loss", "eval_loss"):
        assert changes.loc[series, "step"] == 20 and changes.loc[series, "step_from"] == 10, series
    assert changes.loc["max_weight", "rate"] == pytest.approx(0.03)
    sigmoid = weights.assign(weight=0.5 * weights["step"].ne(0) + 0.5)  # α = 0.5, then 1 for both sources
    entropy = training_timeline({"depth_weights": sigmoid}, metrics[["step"]])
    assert entropy[entropy["series"] == "routing_entropy"]["value"].to_numpy() == pytest.approx(math.log(2))


def test_timeline_of_a_recorded_run_covers_every_consumer(smoke_run):
    run = load_run(smoke_run)
    timeline = training_timeline(run.records, run.metrics)
    consumers = set(timeline.loc[timeline["series"] == "max_weight", "consumer"])
    assert consumers == set(range(run.model_config.n_sublayers + 1))
    steps = set(run.records["depth_weights"]["step"])
    changes = fastest_changes(timeline)
    routing = changes[changes["series"].isin(["routing_entropy", "max_weight", "embedding_weight"])]
    assert set(routing["step"]) <= steps and len(routing) == 3 * len(consumers)


def test_row_wise_spearman_matches_the_pandas_one_with_ties():
    from attnres_lens.analysis import spearman
    from attnres_lens.analysis.attribution import spearman_rows

    generator = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (30, 6), generator=generator).double()  # many ties
    b = torch.randn(30, 6, generator=generator)
    b[0] = 1.0  # a constant row
    rows = spearman_rows(a, b)
    for row, (x, y) in enumerate(zip(a, b)):
        expected = spearman(x.tolist(), y.tolist())
        assert (math.isnan(rows[row]) and math.isnan(expected)) or rows[row].item() == pytest.approx(expected)


# ---------------------------------------------------------------------------- the attribute command
ATTRIBUTION_TABLES = (
    "depth_dla",
    "depth_dla_summary",
    "depth_inputs",
    "logit_lens",
    "logit_lens_summary",
    "edge_sensitivity",
    "edge_sensitivity_corrupted",
    "edge_knockouts",
    "edge_agreement",
    "routing_audit_pairs",
    "routing_audit_consumers",
    "kv_shift",
    "timeline",
    "timeline_changes",
)


@pytest.mark.slow
def test_attribute_command_writes_tables_and_one_offline_report(smoke_run, tmp_path, capsys):
    out = tmp_path / "attribution"
    code, stdout, _ = run_cli(
        ["attribute", str(smoke_run), "--samples", "3", "--prompt", "0 3 5 7 3 5", "--out", str(out), "--no-progress"],
        capsys,
    )
    assert code == 0 and "report:" in stdout and "Spearman" in stdout
    for name in ATTRIBUTION_TABLES:
        assert (out / f"{name}.csv").is_file() and (out / f"{name}.parquet").is_file(), name
    dla = pd.read_parquet(out / "depth_dla.parquet")
    assert sorted(dla["position"].unique()) == [0, 1, 2, 3, 4]  # the prompt's positions with a next token
    summary = json.loads((out / "attribution_summary.json").read_text())
    assert summary["prompt"] == "0 3 5 7 3 5" and summary["edge_agreement"]["n_edges"] > 0
    report = (out / "attribution_report.html").read_text()
    assert re.findall(r"<script[^>]*\ssrc\s*=", report, flags=re.I) == []  # plotly.js is inline, once
    assert re.findall(r"<link\b", report, flags=re.I) == [] and report.count("plotly.js v") == 1
    assert report.count('class="plotly-graph-div"') == 10


@pytest.mark.slow
def test_attribute_command_reports_an_undefined_within_consumer_spearman(tmp_path, capsys):
    """Two layers in one block of four: no consumer reads three sources, so the within-consumer Spearman is
    undefined (None in the JSON summary): the report says n/a instead of failing to format it."""
    run = tmp_path / "one_block"
    train(
        apply_overrides(
            get_preset("smoke"),
            ["model.n_layers=2", "model.attnres_block_size=4", "train.steps=5", "train.checkpoint_every=5"],
        ),
        run,
        progress=False,
    )
    code, stdout, _ = run_cli(
        ["attribute", str(run), "--samples", "3", "--out", str(tmp_path / "out"), "--no-progress"], capsys
    )
    assert code == 0 and "report:" in stdout
    summary = json.loads((tmp_path / "out" / "attribution_summary.json").read_text())
    assert summary["edge_agreement"]["spearman_within_consumer"] is None
    assert "(n/a Spearman within consumers" in (tmp_path / "out" / "attribution_report.html").read_text()


def test_attribute_command_refuses_bad_input_in_one_line(smoke_run, tmp_path, capsys):
    cases = [
        (["attribute", str(tmp_path / "missing")], "does not exist"),
        (["attribute", str(smoke_run), "--samples", "1"], "samples must be an integer >= 2"),
        (["attribute", str(smoke_run), "--prompt", "1 2 x"], "space-separated integer ids"),
        (["attribute", str(smoke_run), "--prompt", "1 2 999"], "token id 999 is out of range"),
        (["attribute", str(smoke_run), "--prompt", "5"], "--prompt needs at least 2 tokens"),
        (["attribute", str(smoke_run), "--checkpoint", "999"], "has no checkpoint '999'; it has: latest"),
        (["attribute", str(smoke_run), "--prompt", " "], "--prompt is empty; give one"),
        (["attribute", str(smoke_run), "--prompt", " ".join(["1"] * 500)], "--prompt: sequence length 500 exceeds"),
    ]
    (tmp_path / "a-file").write_text("")
    cases.append((["attribute", str(smoke_run), "--out", str(tmp_path / "a-file")], "is a file"))
    for argv, message in cases:
        code, _, err = run_cli(argv + ["--no-progress"], capsys)
        assert code == 2 and err.startswith("attnres-lens: error: ") and message in err, (argv, err)
        assert err.count("\n") == 1, err


DEMO_RUNS = Path(__file__).resolve().parent.parent / "data" / "demo_runs"


@pytest.mark.slow
@pytest.mark.skipif(not DEMO_RUNS.is_dir(), reason="no demo runs (make demo)")
def test_attribute_works_on_every_shipped_demo_run(tmp_path, capsys):
    runs = sorted(path for path in DEMO_RUNS.iterdir() if (path / "config.json").is_file())
    assert runs
    for run in runs:
        code, stdout, err = run_cli(
            ["attribute", str(run), "--samples", "2", "--out", str(tmp_path / run.name), "--no-progress"], capsys
        )
        assert code == 0, (run.name, err)
        assert (tmp_path / run.name / "attribution_report.html").is_file()


@pytest.mark.slow
def test_attribute_works_on_a_run_imported_from_fla(tmp_path, capsys):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install attnres_lens[fla])")
    from attnres_lens.interop import import_fla_run
    from tests.test_interop import make_fla  # FLA's own model class, built on the CPU

    fla = make_fla(seed=3, num_hidden_layers=2, vocab_size=40, max_position_embeddings=33, attnres_block_size=1)
    run, _ = import_fla_run(fla, tmp_path / "imported")
    code, stdout, err = run_cli(["attribute", str(run), "--samples", "3", "--no-progress"], capsys)
    assert code == 0, err
    tables = {name: pd.read_parquet(run / "analysis" / f"{name}.parquet") for name in ("edge_sensitivity", "timeline")}
    assert len(tables["edge_sensitivity"]) > 0 and tables["timeline"].empty  # imported: no training records


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end_on_a_tiny_model(tmp_path):
    from analyses.benchmarks import main as benchmarks

    rows = benchmarks(["bench_attribution", "--tiny", "--results", str(tmp_path / "results.jsonl")])
    value = {(row["metric"], row["variant"]): row["value"] for row in rows}
    assert value[("max |Δ| vs shared prefixes", "stacked full passes")] < 1e-5  # the engines agree
    assert value[("rank entries that differ", "stacked full passes")] >= 0  # counted apart
    assert value[("work", "shared prefixes")] < value[("work", "stacked full passes")]  # less work
    forked = next(variant for metric, variant in value if "forked process" in variant)
    assert value[("max |Δ| vs shared prefixes", forked)] == 0  # the same tables
    assert ("work", forked) not in value  # the child's work is not seen here
    assert value[("prune end to end", "as shipped")] > 0 and value[("prune end to end", "--threads 1")] > 0
    assert (
        value[("clean forward pass", "no hooks")] > 0
        and -1 <= value[("edge attribution spearman", "first order vs exact")] <= 1
    )


# ---------------------------------------------------------------------------- hostile batches (issue 41 item 11)
def _analyses_of_a_batch():
    from attnres_lens.analysis import causal_routing, edge_sensitivity, routing_audit

    return {
        "edge_sensitivity": edge_sensitivity,
        "causal_routing": causal_routing,
        "routing_audit": lambda model, batch: routing_audit(model, batch, n_boot=10),
    }


@pytest.mark.parametrize("analysis", ["edge_sensitivity", "causal_routing", "routing_audit"])
def test_every_analysis_of_a_batch_checks_it_as_depth_logit_attribution_does(analysis):
    """Each refuses what would be misread (float or out-of-range targets, a mask of another shape or kind) or give
    a table of NaN effects without a word (no position with a target), naming the problem."""
    import dataclasses

    run = _analyses_of_a_batch()[analysis]
    model = HookedTransformer(small_config("attnres", 1, n_layers=1))
    batch = copy_batch(3)
    cases = {
        "must hold integer token ids, got dtype torch.float32": dict(targets=batch.targets.float()),
        "out of range for d_vocab=20": dict(
            targets=torch.where(batch.targets == IGNORE_INDEX, IGNORE_INDEX, batch.targets + 20)
        ),
        "batch.targets must have the tokens' shape": dict(targets=batch.targets[:, :-1]),
        "answer_mask must be booleans of the tokens' shape": dict(answer_mask=batch.answer_mask.long()),
        "no position with a target": dict(targets=torch.full_like(batch.targets, IGNORE_INDEX)),
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            run(model, dataclasses.replace(batch, **change))
    one_token = dataclasses.replace(
        batch,
        tokens=batch.tokens[:, :1],
        targets=batch.targets[:, :1] * 0 + IGNORE_INDEX,
        answer_mask=batch.answer_mask[:, :1],
    )
    with pytest.raises(ValueError, match="one-token sequences"):
        run(model, one_token)
    if analysis != "causal_routing":  # the two that take raw tokens check them alike
        with pytest.raises(ValueError, match="one-token sequences"):
            run(model, batch.tokens[:, :1])


def test_attribute_says_why_edges_and_the_kv_shift_table_are_not_computed(tmp_path, capsys):
    """A standard-residual, standard-attention model: no depth softmax (no edges) and no KV shift, each listed with
    its reason in the summary, the report and the printed lines, not silently left out."""
    run = tmp_path / "standard"
    overrides = ["model.residual=standard", "model.attention=standard", "train.steps=2", "train.eval_every=2"]
    train(apply_overrides(get_preset("smoke"), overrides), run, progress=False)
    code, out, err = run_cli(["attribute", str(run), "--samples", "2", "--no-progress"], capsys)
    assert code == 0, err
    summary = json.loads((run / "analysis" / "attribution_summary.json").read_text())
    skipped = {row["table"]: row["reason"] for row in summary["skipped"]}
    assert set(skipped) == {"edge_knockouts", "edge_sensitivity", "routing_audit", "kv_shift"}
    assert "residual ('standard') has none" in skipped["edge_knockouts"] and "no KV shift" in skipped["kv_shift"]
    assert all(f"not computed: {name}: " in out for name in skipped)
    report = (run / "analysis" / "attribution_report.html").read_text()
    assert all(name in report for name in skipped)
