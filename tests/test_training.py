"""Training, recording and run directories end to end (docs/run_directory.md), on the tiny `smoke` preset."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnres_lens import RunDirError, load_run
from attnres_lens.analysis import evaluate
from attnres_lens.cli import main as cli_main
from attnres_lens.config import RunConfig, apply_overrides
from attnres_lens.evaluation import evaluate_model
from attnres_lens.presets import PRESETS, get_preset
from attnres_lens.recorder import prefix_matching_score
from attnres_lens.rundir import RunDir
from attnres_lens.training import Trainer, TrainingDiverged, resume, train
from tests.helpers import float32_chain_length, reordering_bound

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "attnres_lens.cli"]


def smoke(**overrides):
    return apply_overrides(get_preset("smoke"), [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def losses(run_dir: Path) -> dict[int, float]:
    metrics = load_run(run_dir, load_model=False).metrics
    rows = metrics.dropna(subset=["loss"])
    return dict(zip(rows["step"].astype(int), rows["loss"]))


def test_smoke_run_writes_every_file_of_the_format(smoke_run):
    assert json.loads((smoke_run / "config.json").read_text())["preset"] == "smoke"
    index = json.loads((smoke_run / "checkpoints" / "index.json").read_text())
    assert index["latest"] == "step_0000040" and index["best"] in index["kept"]
    for name in index["kept"]:
        assert (smoke_run / "checkpoints" / f"{name}.safetensors").is_file()
        assert (smoke_run / "checkpoints" / f"{name}.state.safetensors").is_file()
    run = load_run(smoke_run)
    assert {"step", "loss", "eval_loss", "eval_accuracy", "lr", "tokens_per_s", "grad_norm"} <= set(run.metrics.columns)
    assert run.metrics["step"].max() == 40
    expected_columns = {
        "depth_weights": {"step", "consumer", "consumer_label", "kind", "source", "source_label", "weight"},
        "magnitudes": {"step", "sublayer", "label", "kind", "output_rms", "input_rms", "grad_norm"},
        "param_grad_norms": {"step", "block", "grad_norm"},
        "induction_scores": {"step", "layer", "head", "prefix_score"},
        "kv_shift": {"step", "layer", "head", "alpha1", "alpha2", "beta1", "beta2"},
    }
    for table, columns in expected_columns.items():
        assert columns <= set(run.records[table].columns), table
        assert sorted(run.records[table]["step"].unique()) == [0, 10, 20, 30, 40]


def test_recorded_depth_weights_are_uniform_at_step_0_and_sum_to_one(smoke_run):
    weights = load_run(smoke_run, load_model=False).records["depth_weights"]
    sums = weights.groupby(["step", "consumer"])["weight"].sum()
    assert (sums - 1).abs().max() < 1e-5
    start = weights[weights["step"] == 0]
    n_sources = start.groupby("consumer")["weight"].transform("size")
    assert ((start["weight"] - 1 / n_sources).abs() < 1e-6).all()
    # Labels come from the model: the smoke model is Block AttnRes with S = 2 (one layer per block).
    final = weights[(weights["step"] == 40) & (weights["consumer_label"] == "final")]
    assert final["source_label"].tolist() == ["emb", "B1 (L0)", "B2 (L1)"]


def test_recorded_magnitudes_match_a_direct_computation(smoke_run):
    run = load_run(smoke_run, checkpoint="latest")
    trainer_batch = run.config.train.record_size
    task = apply_overrides(get_preset("smoke"), []).build_task()
    tokens = task.eval_batch(run.config.train.eval_size).tokens[:trainer_batch]
    _, cache = run.model.run_with_cache(tokens)
    recorded = run.records["magnitudes"]
    row = recorded[(recorded["step"] == 40) & (recorded["label"] == "L1.mlp")].iloc[0]
    mlp_out = cache["mlp_out", 1].double()
    assert row["output_rms"] == pytest.approx(mlp_out.pow(2).mean(-1).sqrt().mean().item(), rel=1e-4)
    input_rms = cache["resid_mid", 1].double().pow(2).mean(-1).sqrt().mean().item()
    assert row["input_rms"] == pytest.approx(input_rms, rel=1e-4)


def test_prefix_matching_score_on_a_hand_made_pattern():
    half = 5
    pattern = torch.zeros(1, 2, 11, 11)
    for q in range(11):
        pattern[0, 1, q, 0] = 1.0  # head 1: attends to BOS only
        pattern[0, 0, q, max(q - half + 1, 0) if q > half else 0] = 1.0  # head 0: a perfect induction head
    scores = prefix_matching_score(pattern, half)
    assert scores.tolist() == [1.0, 0.0]


def test_load_run_restores_the_trained_model(smoke_run):
    run = load_run(smoke_run)
    assert run.checkpoint == "step_0000040" and not run.model.training
    tokens = torch.randint(1, 24, (2, 20))
    best = load_run(smoke_run, checkpoint="best").model
    assert best(tokens).shape == (2, 20, 24)
    assert load_run(smoke_run, checkpoint=20).checkpoint == "step_0000020"  # kept: keep_checkpoints = 2


@pytest.mark.slow
def test_resume_after_a_crash_continues_the_same_loss_curve(tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    train(smoke(), reference, progress=False)

    crashed = tmp_path / "crashed"
    original = Trainer._train_step

    def crash_at_step_27(self):
        if self.step == 27:
            raise KeyboardInterrupt("simulated crash")
        return original(self)

    monkeypatch.setattr(Trainer, "_train_step", crash_at_step_27)
    with pytest.raises(KeyboardInterrupt):
        train(smoke(), crashed, progress=False)
    monkeypatch.setattr(Trainer, "_train_step", original)
    assert json.loads((crashed / "checkpoints" / "index.json").read_text())["latest"] == "step_0000020"
    resume(crashed, progress=False)
    expected, got = losses(reference), losses(crashed)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    records = load_run(crashed, load_model=False).records["depth_weights"]
    assert not records.duplicated(["step", "consumer", "source"]).any()


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path):
    out = tmp_path / "killed"
    # Same config for both runs (the lr schedule depends on the step budget); big batches slow each step
    # so that the kill lands mid-run.
    settings = {"train.steps": 60, "train.checkpoint_every": 20, "train.batch_size": 64, "train.threads": 1}
    command = CLI + ["train", "--preset", "smoke", "--out", str(out), "--no-progress"]
    command += [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    index = out / "checkpoints" / "index.json"
    deadline = time.time() + 120
    while not index.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert index.exists(), "no checkpoint was written before the kill"
    killed_at = json.loads(index.read_text())["latest"]
    assert killed_at != "step_0000060", "the run finished before it could be killed"
    assert cli_main(["train", "--resume", str(out), "--no-progress"]) == 0
    reference = tmp_path / "reference"
    train(smoke(**settings), reference, progress=False)
    expected, got = losses(reference), losses(out)
    assert sorted(got) == sorted(expected)
    assert all(got[s] == pytest.approx(expected[s], rel=1e-6, abs=1e-7) for s in expected)


@pytest.mark.slow
def test_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "nan"
    trainer = Trainer(smoke(), out, progress=False)
    trainer.model.add_perma_hook("hook_embed", lambda x, hook: x * float("nan") if trainer.step >= 25 else x)
    with pytest.raises(TrainingDiverged, match=r"loss became nan at step 26; training stopped"):
        trainer.fit()
    trainer.model.reset_hooks(including_permanent=True)
    run = load_run(out)
    assert run.checkpoint == "step_0000020"
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert run.metrics["step"].max() == 25


def test_corrupt_and_missing_run_directories_give_clear_errors(smoke_run, tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="config.json is missing$"):
        load_run(tmp_path / "empty")
    shutil.copytree(smoke_run, tmp_path / "runs" / "smoke")  # a folder of runs, given for a run: name them
    with pytest.raises(RunDirError, match=r"config.json is missing; it holds run directories \(smoke\): give one"):
        load_run(tmp_path / "runs")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(RunDirError, match="config.json is not valid JSON"):
        load_run(bad)
    (bad / "config.json").write_text(json.dumps({"model": {"residual": "sideways"}, "task": {}, "train": {}}))
    with pytest.raises(RunDirError, match="invalid model section: residual must be one of"):
        load_run(bad)

    copy = tmp_path / "copy"
    shutil.copytree(smoke_run, copy)
    weights = copy / "checkpoints" / "step_0000040.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(RunDirError, match="step_0000040.safetensors is corrupt or truncated"):
        load_run(copy)
    weights.write_bytes(b"\x00" * 100)
    with pytest.raises(RunDirError, match="corrupt or truncated"):
        load_run(copy)
    with pytest.raises(RunDirError, match=r"has no checkpoint 123; it has: latest, best, step_0000020, step_0000040"):
        load_run(copy, checkpoint=123)
    (copy / "records" / "magnitudes.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(RunDirError, match="magnitudes.parquet is corrupt"):
        load_run(copy, load_model=False)
    with pytest.raises(RunDirError, match="has no checkpoint to resume from"):
        no_ckpt = tmp_path / "no_ckpt"
        shutil.copytree(smoke_run, no_ckpt)
        shutil.rmtree(no_ckpt / "checkpoints")
        resume(no_ckpt, progress=False)


def test_cli_presets_and_bad_input(capsys, tmp_path):
    assert cli_main(["presets"]) == 0
    listed = capsys.readouterr().out
    for name in [
        "induction-1l-vanilla",
        "induction-2l-vanilla",
        "induction-1l-kvshift",
        "induction-2l-kvshift",
        "depth-standard",
        "depth-full",
        "depth-block",
        "smoke",
    ]:
        assert name in listed and name in PRESETS
    cases = [
        (["--preset", "nope", "--out", str(tmp_path / "a")], "unknown preset 'nope'"),
        (
            ["--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "model.n_layerz=2"],
            "unknown model field 'n_layerz' (did you mean 'n_layers'?)",
        ),
        (
            ["--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "model.residual=sideways"],
            "residual must be one of",
        ),
        (["--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "train.lr=-1"], "train.lr must be a number > 0"),
        (["--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "task.min_len=1"], "min_len must be >= 2"),
        (["--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "seed=3"], "write section.seed"),
        (["--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "oops"], "--set expects key=value"),
        (["--preset", "smoke"], "--out DIR is required"),
        (["--resume", str(tmp_path / "missing")], "does not exist"),
    ]
    for args, message in cases:
        assert cli_main(["train", *args, "--no-progress"]) == 2
        assert message in capsys.readouterr().err, args
    assert not (tmp_path / "a").exists()


def test_cli_refuses_to_overwrite_a_run(smoke_run, capsys):
    assert cli_main(["train", "--preset", "smoke", "--out", str(smoke_run), "--no-progress"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_overrides_reach_the_config():
    config = apply_overrides(
        get_preset("smoke"),
        ["model.n_layers=3", "train.lr=0.001", "vocab_size=20", "model.d_vocab=20", "residual=standard"],
    )
    assert config.model.n_layers == 3 and config.train.lr == 0.001 and config.task.params["vocab_size"] == 20
    assert config.model.residual == "standard"
    # the preset's Block AttnRes size goes with its residual kind; given with another kind, it is refused
    assert config.model.attnres_block_size == 1 and get_preset("smoke").model.attnres_block_size == 2
    with pytest.raises(ValueError, match="attnres_block_size only applies to residual='attnres'"):
        apply_overrides(get_preset("smoke"), ["residual=standard", "model.attnres_block_size=2"])
    with pytest.raises(ValueError, match="section.field, got '.n_layers=3'"):
        apply_overrides(get_preset("smoke"), [".n_layers=3"])


def test_derived_fields_follow_an_override_unless_given():
    """A preset pins nothing it derived: changing d_model re-derives d_head, d_mlp = 4 d_model, and the KV heads."""
    config = apply_overrides(get_preset("induction-2l-vanilla"), ["model.d_model=48"])
    assert (config.model.d_head, config.model.n_key_value_heads) == (12, 4)
    assert apply_overrides(get_preset("smoke"), ["model.d_model=48"]).model.d_mlp == 4 * 48
    depth = apply_overrides(get_preset("depth-block"), ["model.d_model=96"])
    assert depth.model.d_mlp == 128 and depth.model.d_head == 24  # the preset gave d_mlp: it stays
    with pytest.raises(ValueError, match="n_heads \\* d_head must equal d_model"):
        apply_overrides(get_preset("smoke"), ["model.d_model=48", "model.d_head=16"])  # given, so it is checked
    # a config read back from JSON is explicit everywhere and round-trips unchanged
    assert RunConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()


def test_the_trainer_and_the_analyses_share_one_evaluation(smoke_run):
    trainer = Trainer(RunDir(smoke_run).read_config(), smoke_run, progress=False)
    trainer.model.load_state_dict(load_run(smoke_run).model.state_dict())
    reported = trainer.evaluate()
    analysed = evaluate(trainer.model, trainer.eval_batch)
    assert reported == {
        "eval_loss": analysed.loss,
        "eval_answer_loss": analysed.answer_loss,
        "eval_accuracy": analysed.accuracy,
    }
    logged = RunDir(smoke_run).read_metrics().dropna(subset=["eval_loss"]).iloc[-1]
    assert logged["eval_loss"] == pytest.approx(analysed.loss, rel=1e-6)
    # the answer loss covers exactly the positions the accuracy counts (cross-entropy at the answer mask); the
    # trainer's is float32: its log-softmax over the vocabulary and mean over the answers round, by the reordering bound
    batch = trainer.eval_batch
    with torch.no_grad():
        logits = trainer.model(batch.tokens)
    answers = batch.answer_mask & (batch.targets >= 0)
    by_hand = torch.nn.functional.cross_entropy(logits[answers].double(), batch.targets[answers]).item()
    assert 0 < answers.sum() < (batch.targets >= 0).sum()  # the copy task: answers are a strict subset
    bound = reordering_bound(int(answers.sum()) + trainer.model.cfg.d_vocab, by_hand)
    assert logged["eval_answer_loss"] == pytest.approx(by_hand, rel=0, abs=bound)
    # chunked evaluation sums what one pass would, in another order (and other matrix shapes): float32 rounding
    whole = evaluate_model(trainer.model, trainer.eval_batch, chunk=10_000)
    bound = reordering_bound(float32_chain_length(trainer.model.cfg, trainer.eval_batch.tokens), whole.loss)
    chunked = evaluate_model(trainer.model, trainer.eval_batch, chunk=7)
    assert chunked.loss == pytest.approx(whole.loss, rel=0, abs=bound)


@pytest.mark.slow
def test_two_process_gloo_run_matches_one_process(tmp_path):
    settings = ["--set", "train.steps=10", "--set", "train.log_every=1", "--set", "train.batch_size=8"]
    single = tmp_path / "single"
    assert cli_main(["train", "--preset", "smoke", "--out", str(single), "--no-progress", *settings]) == 0
    double = tmp_path / "double"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "attnres_lens.cli",
            "train",
            "--preset",
            "smoke",
            "--out",
            str(double),
            "--no-progress",
            *settings,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected, got = losses(single), losses(double)
    assert sorted(got) == sorted(expected) == list(range(1, 11))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
    one, two = load_run(single).model, load_run(double).model
    for (name, p1), (_, p2) in zip(one.named_parameters(), two.named_parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-3, atol=1e-4, msg=name)


def test_resume_refuses_a_complete_run_or_a_smaller_budget_without_touching_it(smoke_run, capsys):
    before = (smoke_run / "config.json").read_bytes()
    assert cli_main(["train", "--resume", str(smoke_run), "--no-progress"]) == 2
    assert "is complete (step 40 of 40)" in capsys.readouterr().err
    assert cli_main(["train", "--resume", str(smoke_run), "--steps", "30", "--no-progress"]) == 2
    assert "--steps 30 is not above" in capsys.readouterr().err
    assert (smoke_run / "config.json").read_bytes() == before


@pytest.mark.slow
def test_ctrl_c_says_where_to_resume(tmp_path, monkeypatch, capsys):
    original = Trainer._train_step

    def interrupt_at_step_25(self):
        if self.step == 25:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Trainer, "_train_step", interrupt_at_step_25)
    out = tmp_path / "interrupted"
    assert cli_main(["train", "--preset", "smoke", "--out", str(out), "--no-progress"]) == 130
    message = capsys.readouterr().err
    assert "interrupted: the latest checkpoint is step_0000020" in message and f"--resume {out}" in message
    monkeypatch.setattr(Trainer, "_train_step", original)
    assert cli_main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert load_run(out).checkpoint == "step_0000040"


def test_the_progress_bar_names_the_positions_each_figure_covers(smoke_run):
    trainer = Trainer(RunDir(smoke_run).read_config(), smoke_run, progress=False)
    trainer.last_eval = {"eval_loss": 3.8, "eval_answer_loss": 0.01, "eval_accuracy": 0.999}
    postfix = trainer._postfix({"loss": 3.818, "tokens_per_s": 1000.0})
    assert postfix == {
        "loss (train, all positions)": "3.818",
        "answer loss (eval)": "0.010",
        "answer acc (eval)": "99.9%",
        "tok/s": "1000",
    }


def test_a_run_written_before_the_answer_loss_existed_still_loads_and_resumes(smoke_run, tmp_path):
    import shutil

    from attnres_lens.analysis.timeline import training_timeline

    old = tmp_path / "old"
    shutil.copytree(smoke_run, old)
    lines = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_answer_loss" in line for line in lines)
    (old / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in line.items() if k != "eval_answer_loss"}) + "\n" for line in lines)
    )
    run = load_run(old)
    assert "eval_answer_loss" not in run.metrics and not training_timeline(run.records, run.metrics).empty
    assert cli_main(["train", "--resume", str(old), "--steps", "50", "--no-progress"]) == 0
    metrics = load_run(old, load_model=False).metrics
    assert metrics.loc[metrics["step"] == 50, "eval_answer_loss"].notna().all()
    assert metrics.loc[metrics["step"] <= 40, "eval_answer_loss"].isna().all()


def test_run_is_complete(smoke_run, tmp_path):
    from attnres_lens.rundir import run_is_complete

    assert run_is_complete(smoke_run)
    assert not run_is_complete(tmp_path / "missing")
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(smoke_run, partial)
    (partial / "checkpoints" / "step_0000040.safetensors").unlink()
    assert not run_is_complete(partial)
