"""The paired depth-mixing ablation (analyses/depth_mixing_ablation.py, issue 40 item 1): the pairing it relies on
(one task, identical shared initialisation and batches across variants of a seed), the fair input-dependent query
against a float64 recomputation, its Holm intervals against hand-worked numbers, stored configs that predate the
new fields, and the study end to end on tiny models."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from analyses import depth_mixing_ablation as study
from analyses.common import Job
from attnres_lens import HookedTransformer, load_run
from attnres_lens.config import RunConfig, TrainConfig
from attnres_lens.presets import DEPTH_MIXING_VARIANTS, INPUT_QUERY, get_preset
from attnres_lens.tasks.base import IGNORE_INDEX, Batch
from attnres_lens.training import Trainer
from tests.helpers import block_sources, small_config

TINY = ["model.d_model=16", "model.n_heads=2", "model.d_mlp=32", "model.n_layers=2", "train.batch_size=2"]
TINY += ["train.warmup_steps=1", "train.eval_size=8", "train.record_size=4", "train.log_every=5"]
STORED = sorted((Path(__file__).parent / "stored_configs").glob("*.json"))


# ---------------------------------------------------------------------------- pairing
def trainers(seed: int, tmp_path: Path, names=tuple(DEPTH_MIXING_VARIANTS)) -> dict[str, Trainer]:
    """Each variant's trainer for `seed` as the study builds it (the job's settings, tiny), before any step."""
    out = {}
    for name in names:
        job = Job(name, seed, tmp_path / f"{name}-s{seed}", (*study.study_overrides(20), *TINY), study.TASK_SEED)
        out[name] = Trainer(study.expected_config(job), job.out, progress=False)
    return out


def test_variants_of_one_seed_share_their_initialisation_and_batches(tmp_path):
    """Every parameter the standard model has is bit-identical in every variant of the seed (mHC's random maps once
    shifted every later layer's weights), and every variant draws the same batches; another seed changes both,
    on the same task (same held-out set)."""
    seed_a, seed_b = trainers(1, tmp_path), trainers(2, tmp_path, (study.STANDARD, "depth-mhc"))
    standard = dict(seed_a[study.STANDARD].model.named_parameters())
    batches = {name: trainer.task.sample(4, trainer.data_generator).tokens for name, trainer in seed_a.items()}
    for name, trainer in seed_a.items():
        params = dict(trainer.model.named_parameters())
        assert set(standard) <= set(params), name
        for key, value in standard.items():
            assert torch.equal(params[key], value), f"{name}: {key} differs from the standard model's"
        assert torch.equal(batches[name], batches[study.STANDARD]), name
        assert torch.equal(trainer.eval_batch.tokens, seed_b[study.STANDARD].eval_batch.tokens), name  # one task
    other = seed_b[study.STANDARD]
    assert not torch.equal(other.model.embed.W_E, standard["embed.W_E"])
    assert torch.equal(seed_b["depth-mhc"].model.blocks[1].attn.W_Q, other.model.blocks[1].attn.W_Q)
    assert not torch.equal(other.task.sample(4, other.data_generator).tokens, batches[study.STANDARD])


def test_the_mhc_side_generator_leaves_the_global_stream_where_it_was():
    torch.manual_seed(7)
    HookedTransformer(small_config("mhc"))
    after_mhc = torch.randn(3)
    torch.manual_seed(7)
    HookedTransformer(small_config("standard"))
    assert torch.equal(torch.randn(3), after_mhc)


def test_the_default_jobs_keep_seeding_the_task_with_the_run_seed():
    """Other reproductions' jobs (no task_seed) are unchanged: each seed its own task, batches in its order."""
    assert Job("smoke", 3, Path("x")).seed_overrides() == ["train.seed=3", "task.seed=3"]
    assert Job("smoke", 3, Path("x"), task_seed=0).seed_overrides() == [
        "train.seed=3",
        "task.seed=0",
        "train.data_seed=3",
    ]


def test_the_jobs_run_seed_by_seed_on_the_one_task(tmp_path):
    """A study stopped part way has whole paired seeds: every variant of seed 0 before any of seed 1."""
    jobs = study.study_jobs(["depth-standard", "depth-full"], [0, 1], 10, tmp_path)
    assert [(job.preset, job.seed) for job in jobs] == [
        ("depth-standard", 0),
        ("depth-full", 0),
        ("depth-standard", 1),
        ("depth-full", 1),
    ]
    assert {job.task_seed for job in jobs} == {study.TASK_SEED}


def test_the_study_parametrises_the_input_query_fairly_and_the_multi_head_row_as_block():
    variants = {name: get_preset(name).model for name in DEPTH_MIXING_VARIANTS}
    query = variants["depth-full-input-query"]
    assert (query.attnres_query, query.attnres_query_scale, query.attnres_query_read) == ("input", "d", "sum")
    assert INPUT_QUERY["attnres_query_scale"] == "d"
    heads = variants["depth-block-heads16"]
    assert (heads.attnres_heads, heads.attnres_block_size) == (16, 4)
    assert set(study.PAPER_LOSS) == set(DEPTH_MIXING_VARIANTS)


# ---------------------------------------------------------------------------- the input-dependent query
def input_query_float64(module, cfg, sources: list[torch.Tensor]) -> torch.Tensor:
    """The mix from docs/model.md §11 written out per head in float64: x the most recent source or the sum of all,
    q = RMSNorm(x) W, z_s = q_h · RMSNorm_g(v_s)_h / scale, α = softmax_s z, h = Σ α_s v_s per head's channels."""
    values = [v.double() for v in sources]
    read = values[-1] if cfg.attnres_query_read == "recent" else sum(values)
    read = read / torch.sqrt(read.pow(2).mean(-1, keepdim=True) + cfg.attnres_eps)
    query = read @ module.query_proj.double()
    group = cfg.d_model // cfg.attnres_heads
    scale = {"none": 1.0, "sqrt_d": math.sqrt(group), "d": float(group)}[cfg.attnres_query_scale]
    out = torch.zeros_like(values[0])
    for h in range(cfg.attnres_heads):
        channels = slice(h * group, (h + 1) * group)
        logits = []
        for v in values:
            key = v[..., channels] / torch.sqrt(v[..., channels].pow(2).mean(-1, keepdim=True) + cfg.attnres_eps)
            logits.append((key * module.key_norm.w.double()[channels] * query[..., channels]).sum(-1) / scale)
        weights = torch.softmax(torch.stack(logits, -1), -1)
        out[..., channels] = sum(weights[..., s, None] * v[..., channels] for s, v in enumerate(values))
    return out


def model_float64(model: HookedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    m = copy.deepcopy(model).double()
    cfg, embedding, outputs = m.cfg, m.embed(tokens), []
    layers = [item for b in m.blocks for item in ((b.ln1, b.attn, b.attn_res), (b.ln2, b.mlp, b.mlp_res))]
    for j, (norm, sublayer, mixer) in enumerate(layers):
        sources = block_sources(j, embedding, outputs, cfg.attnres_block_size, len(layers))
        outputs.append(sublayer(norm(input_query_float64(mixer, cfg, sources))))
    sources = block_sources(len(layers), embedding, outputs, cfg.attnres_block_size, len(layers))
    return m.unembed(m.ln_final(input_query_float64(m.final_res, cfg, sources)))


@pytest.mark.parametrize("scale", ["none", "sqrt_d", "d"])
@pytest.mark.parametrize("read", ["recent", "sum"])
@pytest.mark.parametrize("block_size, heads", [(1, 1), (2, 4)])
def test_the_input_query_options_match_a_float64_recomputation(scale, read, block_size, heads):
    cfg = small_config(
        "attnres",
        block_size,
        attnres_query="input",
        attnres_query_scale=scale,
        attnres_query_read=read,
        attnres_heads=heads,
    )
    model = HookedTransformer(cfg)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for module in model.depth_attention_modules().values():
            module.query_proj.copy_(torch.randn(module.query_proj.shape, generator=generator))
            module.key_norm.w.copy_(1 + 0.3 * torch.randn(module.key_norm.w.shape, generator=generator))
    tokens = torch.randint(0, cfg.d_vocab, (2, 9), generator=generator)
    expected = model_float64(model, tokens)
    torch.testing.assert_close(model.double()(tokens), expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(model.float()(tokens).double(), expected, rtol=1e-4, atol=1e-4)


def test_the_scale_and_read_change_the_mix_and_need_the_input_query():
    base = dict(attnres_query="input")
    models = {
        key: HookedTransformer(small_config("attnres", **base, **options))
        for key, options in {
            "plain": {},
            "scaled": {"attnres_query_scale": "d"},
            "summed": {"attnres_query_read": "sum"},
        }.items()
    }
    generator = torch.Generator().manual_seed(4)
    for model in models.values():
        with torch.no_grad():
            for module in model.depth_attention_modules().values():
                module.query_proj.copy_(
                    torch.randn(module.query_proj.shape, generator=torch.Generator().manual_seed(1))
                )
    tokens = torch.randint(0, 20, (2, 9), generator=generator)
    plain = models["plain"](tokens)
    assert not torch.allclose(models["scaled"](tokens), plain)
    assert not torch.allclose(models["summed"](tokens), plain)
    with pytest.raises(ValueError, match="attnres_query_scale.*need attnres_query='input'"):
        small_config("attnres", attnres_query_scale="d")
    with pytest.raises(ValueError, match="attnres_query_read must be one of"):
        small_config("attnres", attnres_query="input", attnres_query_read="mean")
    assert models["scaled"].cfg.variant == "full+input-query+query-scale-d"


# ---------------------------------------------------------------------------- stored configs
@pytest.mark.parametrize("path", STORED, ids=lambda p: p.stem)
def test_stored_configs_load_with_todays_behaviour(path):
    config = RunConfig.from_dict(json.loads(path.read_text()))
    assert (config.model.attnres_query_scale, config.model.attnres_query_read) == ("none", "recent")
    assert config.train.data_seed is None  # batches in the task seed's order, as before
    HookedTransformer(config.model)


def test_an_input_query_config_written_before_the_options_loads_as_it_trained():
    data = get_preset("depth-full-input-query").to_dict()
    for name in ("attnres_query_scale", "attnres_query_read"):
        del data["model"][name]
    del data["train"]["data_seed"]
    config = RunConfig.from_dict(data)
    module = HookedTransformer(config.model).final_res
    assert (module.query_divisor, module.query_read) == (1.0, "recent")
    task = config.build_task()
    old_order = task.sample(2, task.train_generator()).tokens
    assert torch.equal(old_order, task.sample(2, task.train_generator(TrainConfig().data_seed)).tokens)


# ---------------------------------------------------------------------------- Holm intervals
def test_t_quantiles_match_the_printed_tables():
    for mass, df, table in [(0.95, 1, 12.706), (0.95, 3, 3.182), (0.9, 3, 2.353), (0.99, 7, 3.499), (0.975, 3, 4.177)]:
        assert study.t_quantile(mass, df) == pytest.approx(table, abs=5e-4)
    assert study.t_quantile(0.6, 7) == pytest.approx(0.896, abs=5e-4)  # one-sided 80%
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        study.t_central_mass(1.0, 0)


def test_holm_intervals_match_hand_worked_numbers():
    """A = (0.1, 0.2, 0.3, 0.4), B = (0.0, 0.1, 0.2, 0.3): SD 0.129099, SE 0.0645497, t 3.8730 and 2.3238 on 3
    degrees of freedom, two-sided p 0.0305 and 0.1027 (A&S 26.7.3 by hand: (2/π)(θ + sinθ cosθ)).
    α = 0.10: A is tested at 0.05 and rejected, B at 0.10 and not: A = 0.25 ± 3.182·SE = [0.0446, 0.4554],
    B = 0.15 ± 2.353·SE = [−0.0019, 0.3019]. α = 0.05: A fails at 0.025, so Holm stops at step 1 and both intervals
    take t(0.9875, 3) = 4.177: [−0.0196, 0.5196] and [−0.1196, 0.4196]."""
    differences = {"A": [0.1, 0.2, 0.3, 0.4], "B": [0.0, 0.1, 0.2, 0.3]}
    table = study.holm_intervals(differences, alpha=0.10).set_index("comparison")
    assert table.loc["A", "p"] == pytest.approx(0.0305, abs=1e-4)
    assert table.loc["B", "p"] == pytest.approx(0.1027, abs=1e-4)
    assert table.loc["A", "p_holm"] == pytest.approx(2 * 0.030466, abs=1e-4)
    assert (table.loc["A", "low"], table.loc["A", "high"]) == pytest.approx((0.0446, 0.4554), abs=1e-3)
    assert (table.loc["B", "low"], table.loc["B", "high"]) == pytest.approx((-0.0019, 0.3019), abs=1e-3)
    assert table["rejected"].tolist() == [True, False]
    strict = study.holm_intervals(differences, alpha=0.05).set_index("comparison")
    assert (strict.loc["A", "low"], strict.loc["A", "high"]) == pytest.approx((-0.0196, 0.5196), abs=1e-3)
    assert (strict.loc["B", "low"], strict.loc["B", "high"]) == pytest.approx((-0.1196, 0.4196), abs=1e-3)
    assert not strict["rejected"].any()
    with pytest.raises(ValueError, match="'A' has 1 paired difference"):
        study.holm_intervals({"A": [0.1]})


def test_the_paired_t_power_against_a_published_value_the_level_and_a_simulation():
    """One-sample/paired t, effect 1 SD, 10 observations, α = 0.05 two-sided: power 0.8031 (the noncentral t, as
    tabulated by power software). At effect 0 the power is the level. At 5 seeds and α/21, the effect the study calls
    detectable is rejected in 80% of simulated paired t tests (100 000 draws: SE 0.0013)."""
    assert study.paired_t_power(1.0, 10, 0.05) == pytest.approx(0.8031, abs=2e-4)
    for n, alpha in [(2, 0.05), (5, 0.01), (8, 0.05 / 21)]:
        assert study.paired_t_power(0.0, n, alpha) == pytest.approx(alpha, rel=1e-6)
    effect = study.detectable_effect(5, 0.05 / 21, 0.8)
    draws = torch.randn(100_000, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + effect
    t = draws.mean(1) / (draws.std(1) / math.sqrt(5))
    assert (t.abs() > study.t_quantile(1 - 0.05 / 21, 4)).double().mean().item() == pytest.approx(0.8, abs=0.006)


def test_the_minimal_detectable_difference_exceeds_the_shortcut_and_meets_the_normal_one():
    """With few seeds the textbook (t_{1−α/2} + t_power) · sd / √n understates the gap (SD 0.1, 8 seeds, α = 0.05:
    (2.365 + 0.896) · 0.1 / √8 = 0.1153); with many it tends to the normal (z_{0.975} + z_{0.8}) · sd / √n, from
    above by O(1/df) (t_{0.975} on 399 df is 1.9659 against z's 1.9600: 0.3%)."""
    assert 0.1153 < study.minimal_detectable_difference(0.1, 8, 0.05) < 0.1153 * 1.03
    assert study.minimal_detectable_difference(2.0, 8, 0.05) == pytest.approx(
        20 * study.minimal_detectable_difference(0.1, 8, 0.05)
    )
    normal = (1.959964 + 0.841621) / math.sqrt(400)
    assert study.minimal_detectable_difference(1.0, 400, 0.05) == pytest.approx(normal, rel=5e-3)
    assert study.minimal_detectable_difference(1.0, 400, 0.05) > normal


def test_each_comparison_is_judged_against_the_papers_gap():
    """Every comparison says whether the paper's gap reaches its own minimal detectable difference, resolved or not;
    resolved ones are checked for the paper's sign, except where the paper's gap is within its rounding."""
    differences = {
        "depth-full − depth-standard": [-0.30, -0.31, -0.29, -0.30, -0.32],  # paper −0.029: same sign
        "depth-full-window8 − depth-full": [-0.05, -0.051, -0.049, -0.05, -0.052],  # paper +0.027: opposite
        "depth-denseformer − depth-standard": [0.20, 0.21, 0.19, 0.20, 0.22],  # paper +0.001: no sign there
        "depth-mhc − depth-standard": [0.1, -0.1, 0.05, -0.05, 0.0],  # paper −0.019, far below an SD of 0.08
        "depth-full-input-query − depth-standard": [0.001, -0.001, 0.0005, -0.0005, 0.0],  # paper −0.035: in reach
    }
    tests = study.holm_intervals(differences)
    drift = {key: [0.01] * 5 for key in differences}
    table = study.comparison_table(tests, drift, 5).set_index("comparison")
    assert table["verdict"].to_dict() == {
        "depth-full − depth-standard": "resolved, same sign as the paper",
        "depth-full-window8 − depth-full": "resolved, opposite sign to the paper",
        "depth-denseformer − depth-standard": "resolved; the paper's gap is ≈ 0",
        "depth-mhc − depth-standard": "not resolved",
        "depth-full-input-query − depth-standard": "not resolved",
    }
    # SDs 0.011 and 0.0011 for the first two: MDDs at α/5 far above their paper gaps (0.029, 0.027) and below
    reach = table["paper Δ vs MDD"].to_dict()
    assert reach == {
        "depth-full − depth-standard": "below",
        "depth-full-window8 − depth-full": "within reach",
        "depth-denseformer − depth-standard": "below",
        "depth-mhc − depth-standard": "below",
        "depth-full-input-query − depth-standard": "within reach",
    }
    assert table.loc["depth-full − depth-standard", "paper Δ"] == "-0.029"
    assert table.loc["depth-mhc − depth-standard", "gap drift, last fifth"] == "+0.0100"
    text = study.paper_verdict(table.reset_index(), 5)
    assert "For 3 of 5 comparisons the paper's gap (0.001–0.029 nats)" in text  # resolved ones counted too
    assert "within reach: depth-full-input-query − depth-standard." in text
    assert "Resolved with the paper's sign: depth-full − depth-standard." in text
    assert "Resolved against the paper's sign: depth-full-window8 − depth-full." in text
    assert "within its rounding (±0.001): depth-denseformer − depth-standard." in text
    assert "Every resolved gap is larger than the paper's for the same comparison." in text


def test_the_drift_of_the_resolved_gaps_is_told_by_its_direction():
    """A gap of −0.3 drifting +0.02 narrows; one of +0.2 drifting +0.01 widens; unresolved gaps are not counted."""
    tests = study.holm_intervals(
        {
            "depth-full − depth-standard": [-0.30, -0.31, -0.29, -0.30, -0.32],
            "depth-denseformer − depth-standard": [0.20, 0.21, 0.19, 0.20, 0.22],
            "depth-mhc − depth-standard": [0.1, -0.1, 0.05, -0.05, 0.0],
        }
    )
    drift = {
        "depth-full − depth-standard": [0.02] * 5,
        "depth-denseformer − depth-standard": [0.01] * 5,
        "depth-mhc − depth-standard": [-0.05] * 5,
    }
    text = study.narrowing(tests, drift)
    assert text == (
        "1 of the 2 resolved gaps narrowed over it (drifted towards 0): a longer budget may leave those smaller (not "
        "measured). Widened or held: depth-denseformer − depth-standard."
    )
    away = {**drift, "depth-full − depth-standard": [-0.02] * 5}  # both resolved gaps now widen
    assert study.narrowing(tests, away) == (
        "0 of the 2 resolved gaps narrowed over it (drifted towards 0). Widened or held: depth-full − depth-standard, "
        "depth-denseformer − depth-standard."
    )


def test_the_gap_drift_is_the_bases_drop_minus_the_variants():
    """Over the last fifth Full fell 0.05 and the standard model 0.02 (seed 0), 0.04 and 0.04 (seed 1): the Full −
    standard gap moved by −0.03 and 0 (it widened in Full's favour on seed 0)."""
    per_run = pd.DataFrame(
        dict(
            variant=["depth-standard", "depth-full", "depth-standard", "depth-full"],
            seed=[0, 0, 1, 1],
            last_fifth_drop=[0.02, 0.05, 0.04, 0.04],
        )
    )
    drift = study.gap_drift(per_run, ["depth-standard", "depth-full"])
    assert drift == {"depth-full − depth-standard": [pytest.approx(-0.03), pytest.approx(0.0)]}


def test_the_normality_note_only_where_no_sign_flip_test_could_reach_the_first_holm_level():
    assert "2/2^8 = 0.00781" in study.normality_note(8, 21)  # against α/21 = 0.00238
    assert study.normality_note(10, 21) == ""  # 2/1024 = 0.00195 < 0.00238
    assert study.normality_note(8, 5) == ""  # α/5 = 0.01


def test_position_classes_by_hand():
    """One copy at dst = 4 of length 4 in 12 positions, answers at 5 and 6: targets 3 … 8 (tokens 4 … 9 and their
    contexts) are touched by the copy; of them 5 and 6 are answers, the rest edges; 0 … 2, 9 and 10 are background;
    11 has no target."""
    tokens = torch.arange(12)[None]
    targets = torch.cat([tokens[:, 1:], torch.full((1, 1), IGNORE_INDEX)], 1)
    answers = torch.zeros(1, 12, dtype=torch.bool)
    answers[0, [5, 6]] = True
    layout = dict(dst_start=torch.tensor([[4]]), seg_len=torch.tensor([[4]]))
    classes = study.position_classes(Batch(tokens, targets, answers, layout))
    where = {name: mask[0].nonzero().flatten().tolist() for name, mask in classes.items()}
    assert where == {"copy_answers": [5, 6], "background": [0, 1, 2, 9, 10], "copy_edges": [3, 4, 7, 8]}
    with pytest.raises(ValueError, match="need the mixed task's copy layout; the batch has \\[\\]"):
        study.position_classes(Batch(tokens, targets, answers))


def test_the_background_is_the_sampled_text_on_the_study_task():
    """On the study's task the classes partition the targets, and every background target and its 3-gram context
    are the text the 3-gram model sampled before the copies were written in (drawn again from the same generator)."""
    task = get_preset(study.STANDARD).build_task()
    batch = task.sample(64, torch.Generator().manual_seed(5))
    sampled = task._sample_tokens(64, torch.Generator().manual_seed(5))  # the same draws, before the copies
    classes = study.position_classes(batch)
    stacked = torch.stack(list(classes.values()))
    assert torch.equal(stacked.sum(0), (batch.targets != IGNORE_INDEX).long())  # a partition of the targets
    rows, positions = classes["background"].nonzero(as_tuple=True)
    for offset in (-1, 0, 1):  # the context t − 1, t and the target token t + 1
        at = (positions + offset).clamp(min=0)
        assert torch.equal(batch.tokens[rows, at], sampled[rows, at])
    assert not torch.equal(batch.tokens, sampled) and classes["copy_edges"].any()


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_the_study_runs_end_to_end_on_tiny_models(tmp_path):
    """Standard and Full are always in; mHC, the input query and the multi-head Block row stand for the rest (the
    pairing test above builds all twelve)."""
    args = ["--seeds", "0", "1", "--steps", "10", "--workers", "1", "--timing-rounds", "1", "--variants"]
    args += ["depth-mhc", "depth-full-input-query", "depth-block-heads16"]
    args += ["--runs-dir", str(tmp_path / "runs"), "--report-dir", str(tmp_path), "--results", str(tmp_path / "r")]
    args += [item for setting in TINY for item in ("--set", setting)]
    tests = study.main(args)
    n_variants = 5
    assert len(tests) == 2 * n_variants - 3  # each against standard, each against Full, Full − standard once
    rows = [json.loads(line) for line in (tmp_path / "r").read_text().splitlines()]
    assert {row["bench"] for row in rows} == {"depth_mixing_ablation"}
    # four numbers per run (the score, three classes' final losses); three per comparison (two classes compared)
    assert len(rows) == 4 * 2 * n_variants + 3 * 3 * len(tests) + n_variants
    metrics = {row["metric"] for row in rows}
    assert {
        "paired difference (copy answers): mean",
        "paired difference (3-gram background): Holm-level low",
    } <= metrics
    report = (tmp_path / "depth_mixing_ablation.md").read_text()
    assert report.index("## Design") < report.index("## Results") < report.index("## Copy answers")
    assert "| depth-mhc | " in report.split("## Copy answers")[1]

    # the classes' final losses, weighted by their counts, are the loss the trainer logged at its last evaluation
    run = load_run(tmp_path / "runs" / "depth-full-s1", load_model=False)
    counts = study.position_classes(run.config.build_task().eval_batch(run.config.train.eval_size))
    per_run = pd.read_csv(tmp_path / "depth_mixing_ablation.csv").set_index(["variant", "seed"])
    final = per_run.loc[("depth-full", 1)]
    weighted = sum(final[column] * int(mask.sum()) for column, mask in counts.items()) / sum(
        int(mask.sum()) for mask in counts.values()
    )
    logged = run.metrics.dropna(subset=["eval_loss"]).sort_values("step")["eval_loss"].iloc[-1]
    # float32 token losses summed in float64 both ways (docs/analysis.md §1): they differ by float32 rounding only
    assert weighted == pytest.approx(logged, rel=1e-5)
    assert "Not the study's budget" in report and "| depth-full-input-query |" in report
    with pytest.raises(ValueError, match="other train settings"):  # a reused run from another design is refused
        study.main([*args, "--set", "train.lr=0.001"])
