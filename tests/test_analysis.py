"""Analysis library (docs/analysis.md): induction scores on hand-built heads, depth maps, TL agreement on a trained
run."""

from __future__ import annotations

import json
import math
import re
import shutil

import pandas as pd
import pytest
import torch

from attnres_lens import HookedTransformer, ModelConfig
from attnres_lens.analysis import (
    depth_mixing_matrix,
    depth_summary,
    depth_weights,
    depth_weights_per_token,
    evaluate,
    in_context_learning_score,
    induction_head_scores,
    per_position_loss,
    repeated_batch,
    spearman,
)
from attnres_lens.analysis.depth import mixing_matrix_from_weights
from attnres_lens.analysis.run import analyze_run
from attnres_lens.config import apply_overrides
from attnres_lens.presets import get_preset
from attnres_lens.rundir import load_run
from attnres_lens.tasks.base import BOS, Batch, next_token_targets
from attnres_lens.training import train

from .helpers import randomize_depth_parameters, small_config

VOCAB, HALF, N_CTX = 12, 8, 20
TOKEN_DIMS, POSITION_DIMS = range(VOCAB), range(VOCAB, VOCAB + N_CTX)


def hand_built_heads() -> HookedTransformer:
    """1-layer attention-only KV-shift model. Head 0 is a perfect induction head, head 1 a previous-token head.

    One-hot token embeddings in dims 0–11 and one-hot learned positions in dims 12–31 (not RoPE, which would
    rotate a content match by the query–key distance). Head 0: KV shift α = (0, 1) makes the key at t the
    previous token's embedding, and W_Q = W_K = identity on token dims, so query q (token r_i) attends where the
    previous token was r_i, i.e. to r_{i+1}; β = (1, 0) keeps values unshifted, so V = that token, which W_O and
    W_U turn into its logit. Head 1: standard attention (α = β = (1, 0)) matching query position q to key
    position q − 1; its W_V and W_O are zero, so it writes nothing.
    """
    cfg = ModelConfig(
        d_model=40,
        n_heads=2,
        n_layers=1,
        n_ctx=N_CTX,
        d_vocab=VOCAB,
        attn_only=True,
        attention="kv_shift",
        positional_embedding_type="standard",
        seed=0,
    )
    model = HookedTransformer(cfg)
    scale = 2.5  # attention scores of 4.47·scale² ≈ 28 for a match: a near-hard argmax
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.blocks[0].ln1.w.fill_(1)
        model.ln_final.w.fill_(1)
        attn = model.blocks[0].attn
        for v in TOKEN_DIMS:
            model.embed.W_E[v, v] = 1
            model.unembed.W_U[v, v] = 1
            attn.W_Q[0, v, v] = attn.W_K[0, v, v] = scale
            attn.W_V[0, v, v] = attn.W_O[0, v, v] = 1
        for p, dim in enumerate(POSITION_DIMS):
            model.pos_embed.W_pos[p, dim] = 1
            attn.W_K[1, dim, p] = scale
            if p >= 1:
                attn.W_Q[1, dim, p - 1] = scale
        attn.kv_shift.copy_(torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]]))
    return model.eval()


def duplicate_free_repeats(n: int, half_len: int = HALF, vocab: int = VOCAB, seed: int = 0) -> Batch:
    """[BOS, r, r] with r drawn without replacement, so every second-half token has one earlier match."""
    generator = torch.Generator().manual_seed(seed)
    halves = torch.stack([torch.randperm(vocab - 1, generator=generator)[:half_len] + 1 for _ in range(n)])
    tokens = torch.cat([torch.full((n, 1), BOS), halves, halves], dim=1)
    answer_mask = torch.zeros_like(tokens, dtype=torch.bool)
    answer_mask[:, half_len + 1 : -1] = True
    return Batch(tokens, next_token_targets(tokens), answer_mask)


@pytest.fixture(scope="module")
def hand_model():
    return hand_built_heads()


@pytest.fixture(scope="module")
def hand_scores(hand_model):
    return induction_head_scores(hand_model, duplicate_free_repeats(16)).set_index("head")


def test_hand_built_induction_head_scores_one_and_the_other_head_zero(hand_scores):
    assert hand_scores.loc[0, "prefix_score"] == pytest.approx(1, abs=1e-3)
    assert hand_scores.loc[1, "prefix_score"] == pytest.approx(0, abs=1e-3)
    assert hand_scores.loc[0, "copying_score"] > 1  # it writes the correct next token's logit
    assert hand_scores.loc[1, "copying_score"] == 0  # W_O = 0: no direct effect at all
    assert hand_scores.loc[0, "ablation_zero_score"] > 1
    assert hand_scores.loc[1, "ablation_zero_score"] == pytest.approx(0, abs=1e-6)


def test_hand_built_previous_token_head_scores_one(hand_scores):
    assert hand_scores.loc[1, "previous_token_score"] == pytest.approx(1, abs=1e-3)
    assert hand_scores.loc[0, "previous_token_score"] < 0.2


def zero_head(head: int):
    def hook(z: torch.Tensor, hook) -> torch.Tensor:
        keep = torch.ones(z.shape[2], 1)
        keep[head] = 0
        return z * keep

    return hook


def test_ablating_the_induction_head_destroys_repeated_half_accuracy(hand_model):
    batch = duplicate_free_repeats(16, seed=1)
    clean = evaluate(hand_model, batch)
    induction_ablated = evaluate(hand_model, batch, [("blocks.0.attn.hook_z", zero_head(0))])
    previous_token_ablated = evaluate(hand_model, batch, [("blocks.0.attn.hook_z", zero_head(1))])
    assert clean.accuracy == 1.0 and induction_ablated.accuracy == 0.0
    assert previous_token_ablated.accuracy == 1.0
    assert induction_ablated.answer_loss > clean.answer_loss + 1


def test_tl_detect_head_is_prefix_score_on_its_own_scale(hand_model):
    """On duplicate-free repeats TL's 'mul' score counts the same diagonal, divided by all 2L+1 query rows."""
    scores = induction_head_scores(hand_model, duplicate_free_repeats(8, seed=2))
    expected = scores["prefix_score"] * HALF / (2 * HALF + 1)
    assert scores["tl_induction_score"].to_numpy() == pytest.approx(expected.to_numpy(), abs=1e-4)
    assert scores["tl_induction_score"].max() < 0.5 < scores["prefix_score"].max()


def test_in_context_learning_score_is_negative_when_the_second_half_is_copied(hand_model):
    per_position = per_position_loss(hand_model, duplicate_free_repeats(8).tokens)
    assert list(per_position["position"]) == list(range(2 * HALF))
    assert in_context_learning_score(per_position) < -1
    ramp = pd.DataFrame({"position": range(100), "loss": [float(p) for p in range(100)]})
    assert in_context_learning_score(ramp) == pytest.approx(94.5 - 14.5)  # mean of 90–99 minus mean of 10–19
    with pytest.raises(ValueError, match="at least 10"):
        in_context_learning_score(ramp.head(5))


def test_scores_reject_a_batch_that_is_not_repeated_tokens(hand_model):
    batch = duplicate_free_repeats(2)
    batch.tokens[:, -1] = batch.tokens[:, 1]  # the second half no longer repeats the first
    with pytest.raises(ValueError, match="repeated"):
        induction_head_scores(hand_model, batch)


# ---------------------------------------------------------------------------- trained runs
@pytest.fixture(scope="module")
def induction_run(tmp_path_factory):
    """A 2-layer attention-only KV-shift model trained for 300 steps (~5 s): long enough that one head becomes
    an induction head (the 40-step smoke run leaves every head near-uniform, so its ranking is noise)."""
    out = tmp_path_factory.mktemp("analysis") / "induction"
    config = apply_overrides(
        get_preset("smoke"),
        [
            "model.attn_only=true",
            'model.residual="standard"',
            "train.steps=300",
            "train.batch_size=16",
            "train.lr=0.01",
            "train.eval_every=100",
            "train.record_every=300",
            "train.checkpoint_every=300",
        ],
    )
    train(config, out, progress=False)
    return out


@pytest.mark.slow
def test_prefix_score_and_tl_detect_head_agree_in_ranking_on_a_trained_run(induction_run):
    model = load_run(induction_run).model
    probe = repeated_batch(32, half_len=15, vocab_size=24, seed=3)  # random repeats, duplicates allowed
    scores = induction_head_scores(model, probe)
    assert len(scores) == model.cfg.n_layers * model.cfg.n_heads
    top = scores["prefix_score"].idxmax()
    assert top == scores["tl_induction_score"].idxmax()
    assert scores["prefix_score"][top] > 0.4 > scores["prefix_score"].drop(top).max()  # a clear induction head
    assert spearman(scores["prefix_score"], scores["tl_induction_score"]) > 0.5
    # Its output matters on the repeated half, and it copies the right token.
    assert scores["ablation_mean_score"].idxmax() == top and scores["copying_score"].idxmax() == top


def test_analyze_run_writes_its_tables(smoke_run, tmp_path):
    run = shutil.copytree(smoke_run, tmp_path / "smoke")  # it writes into the run
    result = analyze_run(run, samples=4, progress=False)
    for name in (
        "induction_heads",
        "icl_per_position",
        "depth_mixing",
        "mixing_diagnostics",
        "depth_weights",
        "depth_summary",
        "depth_weights_tokens",
    ):
        assert (run / "analysis" / f"{name}.csv").is_file()
        written = pd.read_parquet(run / "analysis" / f"{name}.parquet")
        pd.testing.assert_frame_equal(written, result.tables[name].reset_index(drop=True), check_dtype=False)
    assert json.loads((run / "analysis" / "analysis_summary.json").read_text()) == result.summary
    assert result.report_path == run / "analysis" / "analysis_report.html"


def test_analysis_summary_states_and_follows_its_definitions(smoke_run, tmp_path):
    """The ICL score is late-context loss minus early-context loss, recomputed here from the written per-position
    losses; the top heads are the table's by prefix score; the top depth sources are each consumer's largest α."""
    out = tmp_path / "analysis"
    summary = analyze_run(smoke_run, samples=4, progress=False, out=out).summary
    assert json.loads((out / "analysis_summary.json").read_text()) == summary
    losses = pd.read_csv(out / "icl_per_position.csv")["loss"].to_numpy()
    n = len(losses)  # 32 predicted positions: late = the last tenth, early = 10-20% of them
    late, early = losses[int(0.9 * n) :].mean(), losses[int(0.1 * n) : int(0.2 * n)].mean()
    assert summary["icl_score"] == pytest.approx(late - early, abs=1e-6)
    definition = summary["icl_score_definition"]
    assert "last tenth" in definition and "minus" in definition
    assert "negative = later context lowers the loss" in definition
    heads = pd.read_csv(out / "induction_heads.csv").sort_values("prefix_score", ascending=False, kind="stable")
    assert [(h["layer"], h["head"]) for h in summary["top_induction_heads"]] == list(
        zip(heads["layer"].head(5), heads["head"].head(5))
    )
    assert summary["top_induction_head"] == summary["top_induction_heads"][0]
    weights = pd.read_csv(out / "depth_weights.csv")
    assert len(summary["top_depth_sources"]) == weights["consumer"].nunique()
    for row in summary["top_depth_sources"]:
        consumer = weights[weights["consumer"] == row["consumer"]]
        assert row["sources"][0]["weight"] == pytest.approx(consumer["weight"].max())
        assert [s["weight"] for s in row["sources"]] == sorted(consumer["weight"], reverse=True)[:2]


def test_analyze_report_is_offline_and_holds_the_depth_maps(smoke_run, tmp_path):
    result = analyze_run(smoke_run, samples=2, progress=False, out=tmp_path / "a")
    html = result.report_path.read_text()
    assert re.findall(r"<script[^>]*\ssrc\s*=", html, flags=re.I) == [] and html.count("plotly.js v") == 1
    for heading in (
        "Top induction heads",
        "Loss per position",
        "Depth attention α, pre-attention consumers",
        "Depth attention α, pre-MLP consumers",
        "Depth attention α, final readout consumers",
        "Depth-mixing matrix M",
    ):
        assert heading in html, heading
    assert f"{result.summary['icl_score']:.4f}" in html


def test_analyze_command_writes_to_out_and_leaves_the_run_alone(smoke_run, tmp_path, capsys):
    from attnres_lens.cli import main

    analysis = smoke_run / "analysis"
    before = sorted(path.name for path in analysis.iterdir()) if analysis.exists() else []
    out = tmp_path / "elsewhere"
    assert main(["analyze", str(smoke_run), "--samples", "2", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"tables in {out}/" in printed and f"report: {out / 'analysis_report.html'}" in printed
    summary = json.loads((out / "analysis_summary.json").read_text())
    best = summary["top_induction_head"]
    assert f"best head L{best['layer']}H{best['head']}: prefix score {best['prefix_score']:.3f}" in printed
    assert f"in-context learning score {summary['icl_score']:+.4f}" in printed
    for row in summary["top_depth_sources"]:  # one line per consumer, its largest source first
        top_source = re.escape(row["sources"][0]["source_label"])
        assert re.search(rf"{re.escape(row['consumer_label'])}: {top_source} ", printed)
    assert (out / "induction_heads.parquet").is_file() and (out / "analysis_summary.json").is_file()
    after = sorted(path.name for path in analysis.iterdir()) if analysis.exists() else []
    assert after == before
    (tmp_path / "a-file").write_text("")
    assert main(["analyze", str(smoke_run), "--no-progress", "--out", str(tmp_path / "a-file")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------- depth maps
def _tokens(cfg: ModelConfig, n: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (n, cfg.n_ctx), generator=torch.Generator().manual_seed(seed))


def _matrix(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.pivot(index="consumer", columns="sublayer", values="weight")


def test_depth_mixing_matrix_of_a_standard_model_is_all_ones_below_the_diagonal():
    model = HookedTransformer(small_config("standard"))
    matrix = _matrix(depth_mixing_matrix(model))
    n_sublayers = model.cfg.n_sublayers
    assert matrix.shape == (n_sublayers + 1, n_sublayers + 1)  # consumers 0..J × emb + sublayers 0..J-1
    for consumer in range(n_sublayers + 1):
        for sublayer in range(-1, n_sublayers):
            expected = 1.0 if sublayer < consumer else None
            value = matrix.loc[consumer, sublayer]
            assert (value == expected) if expected else math.isnan(value)


def test_depth_mixing_matrix_of_full_attnres_at_init_is_uniform():
    model = HookedTransformer(small_config("attnres", 1))
    matrix = _matrix(depth_mixing_matrix(model, _tokens(model.cfg)))
    for consumer in range(model.cfg.n_sublayers + 1):
        row = matrix.loc[consumer].dropna()
        assert len(row) == consumer + 1
        assert row.to_numpy() == pytest.approx([1 / (consumer + 1)] * (consumer + 1), abs=1e-6)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_depth_weights_sum_to_one_and_block_weight_applies_to_every_member(block_size):
    model = HookedTransformer(small_config("attnres", block_size))
    randomize_depth_parameters(model)
    tokens = _tokens(model.cfg)
    weights = depth_weights(model, tokens)
    assert weights.groupby("consumer")["weight"].sum().to_numpy() == pytest.approx(1, abs=1e-5)
    assert set(weights["kind"]) == {"attn", "mlp", "final"}
    mixing = depth_mixing_matrix(model, tokens).set_index(["consumer", "sublayer"])["weight"]
    source_weight = weights.set_index(["consumer", "source"])["weight"]
    for consumer in range(model.cfg.n_sublayers + 1):
        for source, members in enumerate(model.sources(consumer)):
            for member in members:
                assert mixing[consumer, member] == pytest.approx(source_weight[consumer, source])


def test_depth_summary_entropy_and_sink():
    model = HookedTransformer(small_config("attnres", 1))
    tokens = _tokens(model.cfg)
    uniform = depth_summary(model, tokens).set_index("consumer")
    assert uniform["normalized_entropy"].dropna().to_numpy() == pytest.approx(1, abs=1e-5)
    assert math.isnan(uniform.loc[0, "normalized_entropy"])  # one source: entropy 0 of log 1
    with torch.no_grad():  # every embedding shares one direction and the final query points along it
        model.embed.W_E[:, 0] += 1
        model.final_res.query[0] = 20  # logit of e ≈ 20·√d_model; other sources' keys barely use dim 0
    summary = depth_summary(model, tokens).set_index("consumer").loc[model.cfg.n_sublayers]
    assert summary["sink_label"] == "emb" and summary["sink_score"] > 0.95
    assert summary["normalized_entropy"] < 0.1
    # sigmoid scores: every α is 0.5 at initialisation, uniform shares though they do not sum to 1
    sigmoid = HookedTransformer(small_config("attnres", 1, attnres_score="sigmoid"))
    summary = depth_summary(sigmoid, tokens).set_index("consumer").dropna(subset=["normalized_entropy"])
    assert summary["normalized_entropy"].to_numpy() == pytest.approx(1, abs=1e-6)
    assert summary["sink_score"].to_numpy() == pytest.approx(1 / summary["n_sources"].to_numpy())
    assert summary["embedding_weight"].to_numpy() == pytest.approx(0.5)


def test_per_token_depth_weights_match_the_hooked_weights():
    model = HookedTransformer(small_config("attnres", 2))
    randomize_depth_parameters(model)
    tokens = _tokens(model.cfg, n=2)
    frame = depth_weights_per_token(model, tokens)
    _, cache = model.run_with_cache(tokens)
    consumer = 3
    hooked = cache[model.depth_attention_modules()[consumer].hook_weights.name]
    rows = frame[(frame["consumer"] == consumer) & (frame["sequence"] == 1) & (frame["position"] == 5)]
    # the cached run computes every attention pattern explicitly, the table's no-grad run in the fused kernel:
    # the same weights to float32 rounding
    assert rows["weight"].to_numpy() == pytest.approx(hooked[1, 5].numpy(), rel=1e-5, abs=1e-7)
    assert (rows["token"] == tokens[1, 5].item()).all()
    assert list(rows["source_label"]) == model.source_labels(consumer)
    with pytest.raises(ValueError, match="no depth attention"):
        depth_weights(HookedTransformer(small_config("standard")), tokens)


def test_spearman_is_a_rank_correlation():
    values = [0.3, 1.0, 2.5, 7.0, 8.0]
    assert spearman(values, [math.exp(v) for v in values]) == pytest.approx(1)
    assert spearman(values, [-(v**3) for v in values]) == pytest.approx(-1)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486833)  # ties take average ranks
    assert math.isnan(spearman(values, [1.0] * 5))


def test_mixing_matrix_from_a_recorded_snapshot_equals_the_checkpoint_computation(smoke_run):
    """The recorder's token-averaged α at the last step and a fresh forward pass of that checkpoint on the same
    sequences give the same M (M is linear in the token-averaged weights)."""
    run = load_run(smoke_run, checkpoint="latest")
    tokens = run.config.build_task().eval_batch(run.config.train.eval_size).tokens[: run.config.train.record_size]
    snapshot = run.records["depth_weights"]
    recorded = mixing_matrix_from_weights(run.model, snapshot[snapshot["step"] == run.config.train.steps])
    computed = depth_mixing_matrix(run.model, tokens)
    pd.testing.assert_frame_equal(recorded, computed, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no rows for consumer 0"):
        mixing_matrix_from_weights(run.model, snapshot[(snapshot["step"] == 0) & (snapshot["consumer"] > 0)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_every_analysis_command_works_in_every_dtype_a_run_can_have(tmp_path, dtype):
    """`analyze` failed on a bfloat16 run (a bf16 matmul against float32 readout weights); each command must work
    in every dtype training accepts on the CPU, and its tables hold finite numbers."""
    from attnres_lens.cli import main as cli_main

    run = tmp_path / "run"
    config = apply_overrides(
        get_preset("smoke"),
        [
            f"model.dtype={dtype}",
            "train.steps=4",
            "train.eval_every=4",
            "train.log_every=4",
            "train.checkpoint_every=4",
        ],
    )
    train(config, run, progress=False)
    for command in (["analyze", "--samples", "4"], ["prune", "--samples", "2"], ["attribute", "--samples", "2"]):
        assert cli_main([command[0], str(run), "--no-progress", *command[1:], "--out", str(tmp_path / command[0])]) == 0
    heads = pd.read_parquet(tmp_path / "analyze" / "induction_heads.parquet")
    assert len(heads) and heads.select_dtypes("number").notna().all().all()
