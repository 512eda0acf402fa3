"""The studies of issue 40 (analyses/real_text_depth.py, analyses/compute_multiplier.py): their arithmetic against
values worked by hand or counted another way, and each end to end on tiny models (the full runs are not tests)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from analyses import compute_multiplier, real_text_depth
from analyses.common import Job, _run_job, warm_up_warning
from attnres_lens import load_run
from attnres_lens.model import HookedTransformer
from attnres_lens.presets import get_preset
from attnres_lens.rundir import RunDir, run_is_complete
from attnres_lens.training import Trainer

TINY = ["model.d_model=16", "model.n_heads=2", "model.d_mlp=32", "train.eval_every=2", "train.log_every=2"]
TINY += ["train.record_every=2", "train.checkpoint_every=2", "train.batch_size=2", "train.warmup_steps=1"]


def test_the_read_off_inverts_the_standard_line():
    compute = pd.Series([100.0, 200.0, 400.0, 800.0])
    standard = pd.DataFrame(dict(compute=compute, loss=5 - 0.5 * compute.apply(math.log)))
    loss_at_250 = 5 - 0.5 * math.log(250)
    multiplier, outside = compute_multiplier.read_off(standard, loss_at_250, 200.0)
    assert multiplier == pytest.approx(1.25) and not outside
    beyond, outside = compute_multiplier.read_off(standard, 5 - 0.5 * math.log(1600), 200.0)
    assert outside and beyond == pytest.approx(8.0)  # extrapolated along the end segment, itself on the line
    rising = standard.assign(loss=standard["loss"][::-1].to_numpy())
    assert math.isnan(compute_multiplier.read_off(rising, 2.0, 200.0)[0])
    bumpy = standard.assign(loss=[3.0, 2.5, 2.6, 2.0])  # more compute, a higher loss once: no read-off
    value, extrapolated = compute_multiplier.read_off(bumpy, 2.4, 200.0)
    assert math.isnan(value) and not extrapolated


def test_the_compute_study_refuses_budgets_it_cannot_interpolate_between(capsys):
    for budgets in (["300"], ["300", "300"], ["0", "300"]):
        with pytest.raises(SystemExit):
            compute_multiplier.main(["--budgets", *budgets])
        assert f"got {[int(b) for b in budgets]}" in capsys.readouterr().err


def test_the_read_off_is_local_so_a_standard_run_reads_one_on_a_curved_curve():
    """Losses convex in log compute (3, 2, 1.6, 1.4 at 100 … 800): each standard run reads off exactly 1, where a
    least-squares line through all four would call the run at 400 a 1.205× one. Between 200 and 400 the read-off
    interpolates in log compute: a loss of 1.8, half-way, needs √(200 · 400)."""
    standard = pd.DataFrame(dict(compute=[100.0, 200.0, 400.0, 800.0], loss=[3.0, 2.0, 1.6, 1.4]))
    for compute, loss in zip(standard["compute"], standard["loss"], strict=True):
        assert compute_multiplier.read_off(standard, loss, compute) == (pytest.approx(1.0), False)
    multiplier, _ = compute_multiplier.read_off(standard, 1.8, 200.0)
    assert multiplier == pytest.approx(math.sqrt(200 * 400) / 200)


def test_the_control_pairs_each_variant_with_the_standard_model_at_its_budget():
    runs = pd.DataFrame(
        dict(
            variant=["standard", "standard", "standard", "standard", "block", "block"],
            seed=[0, 0, 1, 1, 0, 1],
            steps=[300, 600, 300, 600, 600, 600],
            loss=[2.5, 2.0, 2.6, 2.2, 1.9, 2.0],
        )
    )
    control = compute_multiplier.same_budget_differences(runs, 600)["block"]
    # differences −0.1 and −0.2: SD 0.1/√2, SE 0.05, t on 1 degree of freedom tan(0.475π) = 12.706
    mean, half = -0.15, math.tan(math.pi * 0.475) * 0.05
    assert (control["mean"], control["low"], control["high"]) == pytest.approx((mean, mean - half, mean + half))
    assert control["seeds"] == 2 and compute_multiplier.same_budget_differences(runs, 450) == {}
    assert compute_multiplier.separates(-0.3, -0.1, 0.0) == "below"
    assert compute_multiplier.separates(1.1, 1.3, 1.25) == "includes"


def test_the_interval_is_a_t_interval_on_the_logarithms():
    summary = compute_multiplier.summarise([1.2, 1.3])
    logs = [math.log(1.2), math.log(1.3)]
    t = math.tan(math.pi * 0.475)  # the 97.5% quantile of t with 1 degree of freedom (the Cauchy distribution)
    half = t * abs(logs[0] - logs[1]) / math.sqrt(2) / math.sqrt(2)  # sd of two values = |a − b| / √2
    assert summary["mean"] == pytest.approx(math.sqrt(1.2 * 1.3))
    assert summary["low"] == pytest.approx(math.exp(sum(logs) / 2 - half))
    assert summary["high"] == pytest.approx(math.exp(sum(logs) / 2 + half)) and summary["seeds"] == 2


@pytest.mark.parametrize("preset", ["shakespeare-standard", "shakespeare-full", "shakespeare-block"])
def test_forward_flops_count_every_matrix_weight_twice(preset):
    cfg = get_preset(preset).model
    model = HookedTransformer(cfg)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.ndim >= 2 and not name.startswith("embed"))
    window = (cfg.n_ctx + 1) / 2
    expected = 2 * matrices + cfg.n_layers * 4 * cfg.n_heads * cfg.d_head * window
    if cfg.residual == "attnres":  # every consumer's sources, counted from the model's own layout
        expected += 7 * cfg.d_model * sum(len(model.sources(c)) for c in range(cfg.n_sublayers + 1))
    assert compute_multiplier.forward_flops_per_token(cfg) == pytest.approx(expected)


def test_real_text_statistics_on_a_hand_made_table():
    table = pd.DataFrame(
        dict(
            consumer=[1, 2, 3, 4],
            kind=["mlp", "attn", "mlp", "final"],
            layer=[0, 1, 1, 2],
            n_sources=[2, 3, 4, 5],
            recent=[0.6, 0.2, 0.5, 0.1],
            embedding=[0.4, 0.5, 0.3, 0.6],
            recent_is_top=[True, False, True, False],
            normalized_entropy=[0.9, 0.8, 0.6, 0.5],
        )
    )
    stats = real_text_depth.statistics(table, n_consumers=5)
    assert stats["locality: top source is the most recent (share of consumers)"] == 0.5
    assert stats["locality: α on the most recent − uniform"] == pytest.approx(
        ((0.6 - 1 / 2) + (0.2 - 1 / 3) + (0.5 - 1 / 4) + (0.1 - 1 / 5)) / 4
    )
    deeper = [(0.3, 4), (0.6, 5)]  # consumers 3 and 4 (≥ 5 / 2)
    assert stats["embedding: α on e − uniform (deeper half)"] == pytest.approx(sum(e - 1 / n for e, n in deeper) / 2)
    assert stats["embedding: α on e > uniform (share of deeper half)"] == 1.0
    assert stats["pre-MLP − pre-attention: α on the most recent"] == pytest.approx(0.5 - 0.2)  # layer 1 only
    assert stats["pre-attention − pre-MLP: normalised entropy"] == pytest.approx(0.8 - 0.6)
    assert real_text_depth.verdict([0.1, 0.2], 0.0) == "predicted side on every seed"
    assert real_text_depth.verdict([0.1, -0.2], 0.0) == "seeds disagree (not resolved)"
    assert real_text_depth.verdict([-0.1], 0.0) == "other side on every seed"


@pytest.mark.slow
def test_both_studies_run_end_to_end_on_tiny_models(tmp_path):
    settings = [arg for setting in TINY for arg in ("--set", setting)]
    results = tmp_path / "results.jsonl"
    real_text_depth.main(
        ["--seeds", "0", "--steps", "4", "--samples", "4", "--workers", "1", "--runs-dir", str(tmp_path / "rt")]
        + ["--report", str(tmp_path / "rt.md"), "--results", str(results), "--set", "train.eval_size=32", *settings]
    )
    compute_multiplier.main(
        ["--seeds", "0", "1", "--budgets", "2", "4", "--attnres-budget", "3", "--eval-sequences", "32"]
        + ["--workers", "1", "--runs-dir", str(tmp_path / "cm"), "--report", str(tmp_path / "cm.md")]
        + ["--results", str(results), *settings]
    )
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert {row["bench"] for row in rows} == {"real_text_depth", "compute_multiplier"}
    real_text = [row for row in rows if row["bench"] == "real_text_depth"]
    assert len(real_text) == 2 * (len(real_text_depth.CLAIMS) + 1)  # two presets, each claim and the final loss
    multipliers = {row["variant"]: row["value"] for row in rows if row["metric"] == "compute multiplier (mean)"}
    assert set(multipliers) == {"full", "block"}
    assert "## Design" in (tmp_path / "rt.md").read_text() and "## Design" in (tmp_path / "cm.md").read_text()
    assert all(row["command"].startswith("python -m analyses.") for row in rows)


@pytest.mark.slow
def test_the_compute_study_trains_and_resumes_under_torchrun_as_a_worker_does(tmp_path, monkeypatch):
    """`--torchrun 2` trains a fresh run and finishes a crashed one (from its checkpoint) to the config and the
    held-out losses a worker process gives the same jobs: two ranks each take half the batch and average their
    gradients, the same step up to float32 reordering (the data-parallel test in test_run_guarantees.py)."""
    settings = (*compute_multiplier.FIXED_TASK, "train.steps=4", "train.eval_size=8", "train.record_size=4", *TINY)
    fresh, crashed = (
        Job(compute_multiplier.VARIANTS["block"], 1, tmp_path / name, settings) for name in ("fresh", "crashed")
    )
    original = Trainer._train_step

    def crash_at_step_3(self, *args, **kwargs):
        if self.step == 3:
            raise KeyboardInterrupt("simulated crash")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_train_step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        _run_job(crashed)
    monkeypatch.setattr(Trainer, "_train_step", original)
    assert RunDir(crashed.out).read_index().latest == "step_0000002" and not run_is_complete(crashed.out)

    compute_multiplier.run_under_torchrun([fresh, crashed], 2)
    for job in (fresh, crashed):
        reference = Job(job.preset, job.seed, tmp_path / f"{job.out.name}-one-process", job.overrides)
        _run_job(reference)
        ranks, worker = (load_run(run.out, load_model=False) for run in (job, reference))
        for section in ("model", "task"):
            assert getattr(ranks.config, section) == getattr(worker.config, section)
        assert ranks.config.train.seed == worker.config.train.seed == 1
        ours, theirs = (run.metrics.dropna(subset=["eval_loss"]).drop_duplicates("step") for run in (ranks, worker))
        assert ours["step"].tolist() == theirs["step"].tolist() == [0, 2, 4]
        assert ours["eval_loss"].to_numpy() == pytest.approx(theirs["eval_loss"].to_numpy(), rel=1e-5)


def test_a_report_on_runs_that_ended_within_their_warm_up_says_it_is_a_smoke_run(tmp_path):
    settings = (*compute_multiplier.FIXED_TASK, "train.eval_size=8", "train.record_size=4", *TINY)
    short, long = (
        Job(compute_multiplier.VARIANTS["standard"], 0, tmp_path / name, (*settings, *extra))
        for name, extra in (("short", ("train.steps=2", "train.warmup_steps=5")), ("long", ("train.steps=2",)))
    )
    for job in (short, long):
        _run_job(job)
    assert warm_up_warning([long.out]) == ""  # TINY's warm-up is one step
    warning = warm_up_warning([long.out, short.out])
    assert warning.startswith("**A smoke run, not a result**: 1 run(s) ended within the learning-rate warm-up")
    assert "(e.g. short: 2 steps, warm-up 5)" in warning
