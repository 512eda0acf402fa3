"""What a run directory promises (docs/run_directory.md §12): one writer, nothing lost or overwritten, honest
divergence handling, every input validated. Each test reproduces a way the project once lost data, trained the
wrong model silently or showed a traceback; the concurrency tests start real processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import attnres_lens
from attnres_lens import HookedTransformer, ModelConfig, RunDirError, load_run
from attnres_lens.cli import main as cli_main
from attnres_lens.config import TaskConfig, TrainConfig, apply_overrides
from attnres_lens.model import next_token_loss
from attnres_lens.presets import get_preset
from attnres_lens.rundir import RunDir, atomic_save_safetensors, read_safetensors
from attnres_lens.tasks import make_task
from attnres_lens.training import TrainingDiverged, resume, train

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "attnres_lens.cli"]
SLOW_SMOKE = ["--set", "train.steps=300", "--set", "train.log_every=1", "--set", "train.checkpoint_every=5"]


def copy_run(smoke_run: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(smoke_run, target)
    return target


def cli_error(capsys, *argv: str, code: int = 2) -> str:
    """The one-line error of a CLI call that must fail with exit code `code` (3: training diverged)."""
    assert cli_main([*argv]) == code, argv
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnres-lens: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def start_training(out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*CLI, "train", "--preset", "smoke", "--out", str(out), "--no-progress", *SLOW_SMOKE],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.1)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- one writer
@pytest.mark.slow
def test_two_trainings_started_together_on_one_folder_leave_one_writer(tmp_path):
    out = tmp_path / "run"
    first, second = start_training(out), start_training(out)
    try:
        results = sorted([(first.wait(300), first.stderr.read()), (second.wait(300), second.stderr.read())])
    finally:
        for process in (first, second):
            process.kill()
    (ok, _), (refused, message) = results
    assert (ok, refused) == (0, 2), results
    # names the holder, unless it refused in the instant between the holder's lock and its name (then "another")
    assert "is being written by" in message and "one writer at a time" in message
    steps = metric_steps(out)
    assert steps == sorted(set(steps))  # no duplicated or out-of-order lines


@pytest.mark.slow
def test_resume_while_training_is_refused_and_a_killed_run_stays_resumable(tmp_path, capsys):
    out = tmp_path / "run"
    process = start_training(out)
    try:
        wait_for(lambda: RunDir(out).read_index().latest is not None)
        err = cli_error(capsys, "train", "--resume", str(out), "--no-progress")
        assert "is being written by process" in err and str(process.pid) in err
        os.kill(process.pid, signal.SIGKILL)  # the OS releases the lock with the process
        process.wait(60)
    finally:
        process.kill()
    target = int(RunDir(out).read_index().latest.split("_")[1]) + 10
    assert resume(out, progress=False, steps=target).step == target
    steps = metric_steps(out)
    assert steps == sorted(set(steps)) and steps[-1] == target


def test_a_folder_that_is_not_a_run_is_never_trained_into(tmp_path, capsys):
    folder = tmp_path / "mine"
    (folder / "records").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("my own line\n")
    (folder / "records" / "magnitudes.parquet").write_bytes(b"user data")
    err = cli_error(capsys, "train", "--preset", "smoke", "--out", str(folder), "--no-progress")
    assert "is not empty and holds no run" in err and "metrics.jsonl" in err
    assert (folder / "metrics.jsonl").read_text() == "my own line\n"
    assert (folder / "records" / "magnitudes.parquet").read_bytes() == b"user data"
    assert not (folder / "config.json").exists()


def test_a_refused_new_run_leaves_no_folder_behind(tmp_path, capsys):
    cli_error(capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "new"), "--set", "model.d_vocab=4")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------- divergence
def test_divergence_without_any_checkpoint_says_so(tmp_path, capsys):
    err = cli_error(
        capsys,
        "train",
        "--preset",
        "smoke",
        "--out",
        str(tmp_path / "nan"),
        "--no-progress",
        "--set",
        "train.lr=1e6",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.grad_clip=0",
        code=3,
    )
    assert "no checkpoint was written before it" in err and "last good checkpoint" not in err
    assert RunDir(tmp_path / "nan").read_index().latest is None


def test_a_non_finite_checkpoint_is_never_saved(tmp_path):
    config = apply_overrides(
        get_preset("smoke"), ["train.lr=1e6", "train.warmup_steps=0", "train.grad_clip=0", "train.checkpoint_every=1"]
    )
    with pytest.raises(TrainingDiverged) as caught:
        train(config, tmp_path / "nan", progress=False)
    run_dir = RunDir(tmp_path / "nan")
    index = run_dir.read_index()
    for name in index.kept:
        tensors, meta = read_safetensors(run_dir.weights_path(name))
        assert math.isfinite(float(meta["eval_loss"])) and all(torch.isfinite(t).all() for t in tensors.values())
    if index.latest:  # the message names exactly what is left, and analyses open it
        assert index.latest in str(caught.value)
        assert cli_main(["analyze", str(tmp_path / "nan"), "--samples", "2", "--no-progress"]) == 0
    else:
        assert "no checkpoint was written" in str(caught.value)


def test_float16_training_on_the_cpu_is_refused_up_front(tmp_path, capsys):
    err = cli_error(
        capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "fp16"), "--set", "model.dtype=float16"
    )
    assert "float16 is not supported for training on the CPU" in err


# ---------------------------------------------------------------------------- validated settings
@pytest.mark.parametrize(
    "setting, message",
    [
        ("model.attn_only=no", "attn_only must be true or false, got 'no'"),
        ("train.lr=true", "train.lr must be a finite number, got True"),
        ("train.betas=[0.9]", "train.betas must be a list of 2 numbers, got [0.9]"),
        ('train.steps="ten"', "train.steps must be an integer, got 'ten'"),
        ("model.d_mlp=1.5", "d_mlp must be an integer or null, got 1.5"),
        ("model.init_range=Infinity", "init_range must be a finite number, got inf"),
        ("model.normalization_type=LN", "normalization_type='LN' is not implemented"),
        ("model.final_rms=true", "final_rms=True is not implemented"),  # gated_mlp is implemented (docs/model.md §6)
        ("model.num_experts=4", "num_experts=4 is not implemented"),
    ],
)
def test_settings_are_type_checked_not_coerced(setting, message, tmp_path, capsys):
    err = cli_error(capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "x"), "--set", setting)
    assert message in err


@pytest.mark.parametrize(
    "fields", [dict(d_mlp=1.5), dict(init_range=math.inf), dict(d_model="64"), dict(attn_only=1), dict(eps=math.nan)]
)
def test_model_config_raises_value_error_never_type_error(fields):
    with pytest.raises(ValueError):
        ModelConfig(**fields)


def test_train_config_rejects_wrong_types():
    with pytest.raises(ValueError, match="train.betas"):
        TrainConfig(betas=(0.9, 0.95, 0.99))
    with pytest.raises(ValueError, match="train.batch_size must be an integer"):
        TrainConfig(batch_size=8.0)
    for betas in ((2, 0.5), (0.9, 1.0), (-0.1, 0.9)):  # named here, not by torch's AdamW at the first step
        with pytest.raises(ValueError, match=r"train.betas must be two numbers in \[0, 1\)"):
            TrainConfig(betas=betas)


# ---------------------------------------------------------------------------- damaged files
def test_damaged_files_give_one_error_naming_the_file(smoke_run, tmp_path):
    run = copy_run(smoke_run, tmp_path)
    (run / "checkpoints" / "index.json").write_text("[]")
    with pytest.raises(RunDirError, match=r"index.json is not a checkpoint index"):
        load_run(run)

    run = copy_run(smoke_run, tmp_path, "metrics")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "[1, 2]", *lines[1:]]) + "\n")
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 2 is not a metrics record"):
        load_run(run, load_model=False)
    with pytest.raises(RunDirError, match=r"metrics.jsonl line 2"):  # resume refuses what load_run refuses
        resume(run, progress=False, steps=80)

    run = copy_run(smoke_run, tmp_path, "records")
    pd.DataFrame({"step": [0], "wrong": [1.0]}).to_parquet(run / "records" / "magnitudes.parquet")
    with pytest.raises(RunDirError, match=r"magnitudes.parquet lacks the columns \['sublayer'"):
        load_run(run, load_model=False)

    for name, edit, message in [
        ("noname", lambda c: c["task"].pop("name"), "invalid task section: the task has no 'name'"),
        ("taskvalue", lambda c: c["task"].update(min_len=0), "invalid task section: copy: min_len must be >= 2"),
        ("betas", lambda c: c["train"].update(betas=[0.9]), "invalid train section: train.betas must be"),
        ("trainfield", lambda c: c["train"].update(lrr=0.1), r"invalid train section: unknown train field.*'lrr'"),
        (
            "provenance",
            lambda c: c.update(provenance=["fla"]),
            "invalid provenance section: a run config's 'provenance' must be an object or absent",
        ),
    ]:
        run = copy_run(smoke_run, tmp_path, name)
        config = json.loads((run / "config.json").read_text())
        edit(config)
        (run / "config.json").write_text(json.dumps(config))
        with pytest.raises(RunDirError, match=message):
            load_run(run, load_model=False)


def test_damaged_files_give_cli_errors_not_tracebacks(smoke_run, tmp_path, capsys):
    run = copy_run(smoke_run, tmp_path)
    (run / "checkpoints" / "index.json").write_text("[]")
    for command in (["analyze", str(run)], ["prune", str(run)], ["train", "--resume", str(run), "--steps", "80"]):
        assert "index.json is not a checkpoint index" in cli_error(capsys, *command, "--no-progress")


def test_checkpoint_metadata_is_checked_before_anything_is_built(smoke_run, tmp_path):
    run = copy_run(smoke_run, tmp_path)
    weights_path = RunDir(run).weights_path("step_0000040")
    tensors, meta = read_safetensors(weights_path)
    huge = json.loads(meta["model_config"]) | {"d_vocab": 2**45}
    atomic_save_safetensors(weights_path, tensors, {**meta, "model_config": json.dumps(huge)})
    with pytest.raises(RunDirError, match="another model than config.json describes.*d_vocab"):
        load_run(run)
    config = json.loads((run / "config.json").read_text())
    config["model"]["d_vocab"] = 2**45  # both agree on an absurd size: the tensors' shapes still refuse it
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunDirError, match=r"does not match its config: .*embed.W_E"):
        load_run(run)

    run = copy_run(smoke_run, tmp_path, "relu")
    relu = json.loads(meta["model_config"]) | {"act_fn": "relu"}
    atomic_save_safetensors(
        RunDir(run).weights_path("step_0000040"), tensors, {**meta, "model_config": json.dumps(relu)}
    )
    with pytest.raises(RunDirError, match="act_fn: checkpoint 'relu', config.json 'gelu'"):
        load_run(run)


_DYNAMO_PROBE = """
import sys
from attnres_lens import load_run
from attnres_lens.presets import PRESETS, get_preset
from attnres_lens.rundir import _expected_shapes
for name in sorted(PRESETS):
    _expected_shapes(get_preset(name).model)
load_run(sys.argv[1])
print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
"""


def test_the_shape_check_allocates_nothing_for_an_absurd_context_length():
    import dataclasses

    from attnres_lens.rundir import _expected_shapes

    cfg = get_preset("depth-full").model
    assert cfg.positional_embedding_type == "rotary"  # no parameter is n_ctx long; the rotary tables would be
    shapes = _expected_shapes(dataclasses.replace(cfg, n_ctx=2**40))  # 2^40 x d_head doubles if they were real
    assert shapes["embed.W_E"] == (cfg.d_vocab, cfg.d_model)


@pytest.mark.slow
def test_loading_a_run_stays_clear_of_torch_dynamo_and_sympy(smoke_run):
    """The shape check builds each preset's model on the meta device; a Python decomposition or a meta `randn`
    there would import torch._dynamo or sympy, 1.4 s and 0.5 s of every command (a fresh process: other tests
    import them)."""
    out = subprocess.run(
        [sys.executable, "-c", _DYNAMO_PROBE, str(smoke_run)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-2:] == ["False", "False"]


# ---------------------------------------------------------------------------- smaller cases
def test_empty_batches_and_one_token_sequences_are_refused():
    model = HookedTransformer(ModelConfig(d_model=16, n_heads=2, n_layers=1, n_ctx=8, d_vocab=10))
    with pytest.raises(ValueError, match="batch >= 1"):
        model(torch.zeros(0, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(torch.tensor([[3]]), return_type="loss")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        next_token_loss(torch.zeros(1, 1, 10), torch.tensor([[3]]))


def test_prune_out_pointing_at_a_file_is_an_error(smoke_run, tmp_path, capsys):
    existing = tmp_path / "report.txt"
    existing.write_text("keep me")
    err = cli_error(capsys, "prune", str(smoke_run), "--out", str(existing), "--no-progress")
    assert "is a file; give a folder" in err and existing.read_text() == "keep me"
    for command in ("prune", "analyze", "attribute"):  # refused before any work, not a traceback after it
        err = cli_error(capsys, command, str(smoke_run), "--out", str(existing / "sub"), "--no-progress")
        assert f"cannot be created: {existing} is a file" in err, command


def test_every_run_file_is_world_readable(smoke_run):
    for path in smoke_run.rglob("*"):
        if path.is_file() and path.name != ".lock":
            assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044, path


@pytest.mark.slow
def test_resume_can_start_from_an_earlier_checkpoint(tmp_path, capsys):
    reference = tmp_path / "reference"
    config = apply_overrides(get_preset("smoke"), ["train.steps=60", "train.keep_checkpoints=3"])
    train(config, reference, progress=False)
    # a crash right after step 40's checkpoint, whose state file is then found damaged
    run = copy_run(reference, tmp_path, "crashed")
    run_dir = RunDir(run)
    run_dir.weights_path("step_0000060").unlink()
    run_dir.state_path("step_0000060").unlink()
    index = json.loads(run_dir.index_path.read_text())
    index.update(latest="step_0000040", kept=["step_0000020", "step_0000040"], best="step_0000040")
    run_dir.index_path.write_text(json.dumps(index))
    run_dir.state_path("step_0000040").write_bytes(b"garbage")
    assert "corrupt or truncated" in cli_error(capsys, "train", "--resume", str(run), "--no-progress")
    assert cli_main(["train", "--resume", str(run), "--checkpoint", "20", "--no-progress"]) == 0
    steps = metric_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 60

    def train_losses(path: Path) -> dict[int, float]:
        return {
            r["step"]: r["loss"]
            for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        }

    expected, got = train_losses(reference), train_losses(run)
    assert set(got) == set(expected)
    for step in expected:  # redone from step 20, exactly as the uninterrupted run
        assert got[step] == pytest.approx(expected[step], rel=1e-6), step


def test_nothing_in_the_package_unpickles():
    """No call of torch.load or pickle.load(s), and no import of pickle, in the package's code (an error message
    may still show the user the conversion command)."""
    import ast

    for path in (REPO / "attnres_lens").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
            ):
                assert (node.func.value.id, node.func.attr) not in {
                    ("torch", "load"),
                    ("pickle", "load"),
                    ("pickle", "loads"),
                }, f"{path}:{node.lineno}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                assert not any(name.split(".")[0] in ("pickle", "dill", "cloudpickle") for name in names), path


def test_a_write_interrupted_midway_leaves_the_previous_file(smoke_run, tmp_path, monkeypatch):
    import attnres_lens.rundir as rundir

    run = copy_run(smoke_run, tmp_path)
    path = RunDir(run).weights_path("step_0000040")
    before = path.read_bytes()

    def torn_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(before[:100])  # half a file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir, "save_file", torn_save)
    tensors, meta = read_safetensors(path)
    with pytest.raises(KeyboardInterrupt):
        atomic_save_safetensors(path, tensors, meta)
    assert path.read_bytes() == before
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_torn_last_metrics_line_is_skipped_and_any_other_is_an_error(smoke_run, tmp_path):
    run = copy_run(smoke_run, tmp_path)
    rows = len(load_run(run, load_model=False).metrics)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 41, "lo')  # a crash mid-line
    assert len(load_run(run, load_model=False).metrics) == rows
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('\n{"step": 42}\n')
    with pytest.raises(RunDirError, match="is not valid JSON"):
        load_run(run, load_model=False)


# ---------------------------------------------------------------------------- found by a new user's audit
def crash_at(monkeypatch, step: int) -> None:
    """The next training crashes (KeyboardInterrupt) when it is about to take step `step + 1`."""
    from attnres_lens.training import Trainer

    original = Trainer._train_step

    def step_or_crash(self):
        if self.step == step:
            raise KeyboardInterrupt("simulated crash")
        return original(self)

    monkeypatch.setattr(Trainer, "_train_step", step_or_crash)


def metric_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_resume_between_log_lines_logs_the_same_mean_loss_and_evaluations_keep_their_cadence(tmp_path, monkeypatch):
    """Checkpoints every 7 steps, log lines every 5: a checkpoint carries the losses since the last line, so the
    line after a resume averages the same steps. Evaluations every 7 steps write their own lines."""
    config = apply_overrides(
        get_preset("smoke"),
        [
            "train.steps=21",
            "train.log_every=5",
            "train.eval_every=7",
            "train.checkpoint_every=7",
            "train.keep_checkpoints=5",
        ],
    )
    train(config, tmp_path / "reference", progress=False)
    crash_at(monkeypatch, 17)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "crashed", progress=False)
    monkeypatch.undo()
    assert RunDir(tmp_path / "crashed").read_index().latest == "step_0000014"
    resume(tmp_path / "crashed", progress=False)
    expected, got = metric_lines(tmp_path / "reference"), metric_lines(tmp_path / "crashed")
    assert [line["step"] for line in got] == [line["step"] for line in expected] == [0, 5, 7, 10, 14, 15, 20, 21]
    assert [line["step"] for line in got if "eval_loss" in line] == [0, 7, 14, 21]
    for before, after in zip(expected, got):
        assert set(after) == set(before)
        for key in set(before) & {"loss", "eval_loss", "grad_norm"}:
            assert after[key] == pytest.approx(before[key], rel=1e-9), (before["step"], key)


@pytest.mark.slow
def test_a_resume_from_an_earlier_checkpoint_forgets_the_later_branch(tmp_path, monkeypatch):
    config = apply_overrides(
        get_preset("smoke"), ["train.steps=40", "train.checkpoint_every=10", "train.keep_checkpoints=5"]
    )
    run = tmp_path / "run"
    train(config, run, progress=False)
    crash_at(monkeypatch, 15)  # the new branch from step 10 stops before its step-20 checkpoint
    with pytest.raises(KeyboardInterrupt):
        resume(run, progress=False, steps=60, checkpoint="10")
    monkeypatch.undo()
    index = RunDir(run).read_index()
    assert index.latest == "step_0000010" and index.kept == ["step_0000010"] and index.best == "step_0000010"
    assert sorted(p.name for p in (run / "checkpoints").glob("*.safetensors")) == [
        "step_0000010.safetensors",
        "step_0000010.state.safetensors",
    ]
    resume(run, progress=False)  # continues the step-10 branch, not the old run's step 40
    steps = [line["step"] for line in metric_lines(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 60 and {15, 20, 40, 45} <= set(steps)
    assert load_run(run, checkpoint="best").checkpoint in RunDir(run).read_index().kept


def test_a_writer_refused_by_the_lock_leaves_the_holders_folder(tmp_path, monkeypatch):
    """The second writer saw no folder, then the first made it and took the lock: the refused one must not
    remove what it did not make."""
    from attnres_lens.rundir import RunDirBusy, RunLock

    out = tmp_path / "run"
    holder, original = RunLock(out / ".lock"), RunLock.acquire

    def acquire_after_the_holder(self):
        if self is not holder and holder._fd is None:
            original(holder)
        return original(self)

    monkeypatch.setattr(RunLock, "acquire", acquire_after_the_holder)
    with pytest.raises(RunDirBusy):
        train(get_preset("smoke"), out, progress=False)
    assert (out / ".lock").is_file()
    holder.release()


def test_a_state_file_that_is_not_one_is_an_error_naming_it(smoke_run, tmp_path, capsys):
    run = copy_run(smoke_run, tmp_path)
    run_dir = RunDir(run)
    shutil.copy(run_dir.weights_path("step_0000040"), run_dir.state_path("step_0000040"))
    err = cli_error(capsys, "train", "--resume", str(run), "--steps", "50", "--no-progress")
    assert "step_0000040.state.safetensors is not a training state file" in err and "--checkpoint" in err
    run = copy_run(smoke_run, tmp_path, "half_window")
    run_dir = RunDir(run)
    state, meta = read_safetensors(run_dir.state_path("step_0000040"))
    del state["log.loss_sum"]  # the open log window comes as a pair
    atomic_save_safetensors(run_dir.state_path("step_0000040"), state, meta)
    assert "missing ['log.loss_sum']" in cli_error(
        capsys, "train", "--resume", str(run), "--steps", "50", "--no-progress"
    )


def test_resume_may_move_the_run_to_another_device(smoke_run, tmp_path, capsys):
    run = copy_run(smoke_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["train"]["device"] = "cuda"  # trained on a GPU elsewhere
    (run / "config.json").write_text(json.dumps(config))
    if not torch.cuda.is_available():
        assert "use --device cpu or auto" in cli_error(
            capsys, "train", "--resume", str(run), "--steps", "44", "--no-progress"
        )
    assert cli_main(["train", "--resume", str(run), "--steps", "44", "--device", "cpu", "--no-progress"]) == 0
    assert json.loads((run / "config.json").read_text())["train"]["device"] == "cpu"
    assert metric_lines(run)[-1]["step"] == 44


def test_settings_training_would_not_use_are_refused(tmp_path, capsys):
    smoke = get_preset("smoke")
    with pytest.raises(ValueError, match="model.seed=5 is not used by training.*set train.seed"):
        train(apply_overrides(smoke, ["model.seed=5"]), tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="model.device='meta' is not used by training.*set train.device"):
        train(apply_overrides(smoke, ["model.device=meta"]), tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    train(
        apply_overrides(smoke, ["model.seed=0", "train.steps=5", "train.checkpoint_every=5"]),
        tmp_path / "c",
        progress=False,
    )  # agreeing with train.seed is fine
    for seed in ("-1", str(2**63), "18446744073709551615"):
        assert "train.seed must be an integer in [0, 2**63)" in cli_error(
            capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "d"), "--set", f"train.seed={seed}"
        )
    (tmp_path / "file").write_text("x")
    err = cli_error(capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "file" / "run"))
    assert "Not a directory" in err
    assert "is a file, not a folder" in cli_error(capsys, "train", "--resume", str(tmp_path / "file"))


def test_the_dashboard_command_refuses_what_it_cannot_serve(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert "is a file, not a folder of runs" in cli_error(capsys, "dashboard", "--runs", str(tmp_path / "file"))
    assert "no such folder" in cli_error(capsys, "dashboard", "--runs", str(tmp_path / "nowhere"))
    assert "--port must be in 1..65535, got 0" in cli_error(capsys, "dashboard", "--runs", str(tmp_path), "--port", "0")


# ---------------------------------------------------------------------------- data parallel (torchrun, gloo on CPU)
def torchrun(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`attnres-lens train --preset smoke` on two torchrun ranks (tests/data_parallel_worker.py), 120 s at most:
    a rank left waiting in a collective would hang the run, which this turns into a failure."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "data_parallel_worker.py"),
        "train",
        "--preset",
        "smoke",
        "--out",
        str(out),
        "--no-progress",
        *args,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_data_parallel_training_matches_one_process_and_a_failure_on_one_rank_stops_the_run(tmp_path):
    steps = ["--steps", "10", "--set", "train.checkpoint_every=10"]
    result = torchrun(tmp_path / "two", *steps)
    assert result.returncode == 0, result.stderr[-2000:]
    assert cli_main(["train", "--preset", "smoke", "--out", str(tmp_path / "one"), "--no-progress", *steps]) == 0
    two, one = metric_lines(tmp_path / "two"), metric_lines(tmp_path / "one")
    assert [line["step"] for line in two] == [line["step"] for line in one]
    for a, b in zip(two, one):  # each rank takes half the batch, gradients are averaged: the same step
        for key in set(b) & {"loss", "eval_loss", "grad_norm"}:
            assert a[key] == pytest.approx(b[key], rel=1e-5), (b["step"], key)

    diverged = torchrun(tmp_path / "inf", "--steps", "30", env={"INF_ON_RANK1_AT_STEP": "3"})
    assert diverged.stderr.count("the training loss became inf at step 3") == 2  # both ranks, from the mean
    assert "rank 0 says which checkpoint is kept" in diverged.stderr and diverged.returncode != 0
    stopped = torchrun(
        tmp_path / "nan", "--steps", "30", "--set", "train.checkpoint_every=10", env={"NAN_EVAL_ON_RANK0_AT_STEP": "10"}
    )
    assert "at step 10 the held-out loss is nan" in stopped.stderr and stopped.returncode != 0
    assert RunDir(tmp_path / "nan").read_index().latest is None


def test_runs_written_by_earlier_versions_still_load_and_resume(tmp_path):
    """Earlier versions recorded fields a standard model never reads (a preset's block size kept through
    `--set model.residual=standard`, FLA's norm_eps as attnres_eps) and a model.seed training did not use: such a
    run loads, with those fields at their defaults, and resumes."""
    config = apply_overrides(
        get_preset("smoke"), ["model.residual=standard", "train.steps=10", "train.checkpoint_every=10"]
    )
    run = tmp_path / "old"
    train(config, run, progress=False)
    recorded = {"attnres_block_size": 2, "attnres_eps": 1e-5}
    raw = json.loads((run / "config.json").read_text())
    raw["model"].update(recorded, seed=5)
    (run / "config.json").write_text(json.dumps(raw))
    path = RunDir(run).weights_path("step_0000010")
    tensors, meta = read_safetensors(path)
    meta["model_config"] = json.dumps({**json.loads(meta["model_config"]), **recorded})
    atomic_save_safetensors(path, tensors, meta)
    loaded = load_run(run)
    assert loaded.model.cfg.residual == "standard" and loaded.model.cfg.attnres_block_size == 1
    assert loaded.model.cfg.attnres_eps == 1e-6
    assert cli_main(["train", "--resume", str(run), "--steps", "15", "--no-progress"]) == 0
    assert metric_lines(run)[-1]["step"] == 15


STORED_CONFIGS = sorted((REPO / "tests" / "stored_configs").glob("*.json"))
# fields added since 0.2.0, each written back at its default (which gives the behaviour the run was trained with)
FIELDS_ADDED_SINCE_0_2_0 = {
    "model": {"attnres_query_scale": "none", "attnres_query_read": "recent"},
    "train": {"data_seed": None},
}


@pytest.mark.parametrize("stored", STORED_CONFIGS, ids=[path.stem for path in STORED_CONFIGS])
def test_a_config_json_written_before_the_task_section_was_typed_reads_and_writes_back_byte_for_byte(stored, tmp_path):
    """tests/stored_configs holds config.json files that version 0.2.0 wrote while `RunConfig.task` was a plain dict (a
    preset, a `--set task.name=…` switch, an imported model's provenance, a task given by name only): read as a typed
    `RunConfig` and written again, each is the same bytes but for the package version it is stamped with and the
    fields added since, at their defaults."""
    text = stored.read_text()
    raw = json.loads(text)
    assert json.dumps(raw, indent=2, sort_keys=True) + "\n" == text  # the file is in the writer's format
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(text)
    config = RunDir(run).read_config()
    assert isinstance(config.task, TaskConfig)
    assert config.build_task().config() == make_task(**raw["task"]).config()
    RunDir(run).write_config(config)
    stamp = f'"version": "{raw["version"]}"'
    assert text.count(stamp) == 1
    expected = json.loads(text.replace(stamp, f'"version": "{attnres_lens.__version__}"'))
    for section, fields in FIELDS_ADDED_SINCE_0_2_0.items():
        assert not set(fields) & set(expected[section])
        expected[section].update(fields)
    assert (run / "config.json").read_text() == json.dumps(expected, indent=2, sort_keys=True) + "\n"


def test_the_demo_runs_task_sections_read_and_write_back_unchanged():
    demo_configs = sorted((REPO / "data" / "demo_runs").glob("*/config.json"))
    if not demo_configs:
        pytest.skip("no demo runs in data/demo_runs (`make demo` writes them)")
    for path in demo_configs:
        stored_task = json.loads(path.read_text())["task"]
        assert RunDir(path.parent).read_config().to_dict()["task"] == stored_task, path


def test_a_resume_from_a_checkpoint_a_crash_left_unindexed_keeps_it(tmp_path):
    config = apply_overrides(
        get_preset("smoke"), ["train.steps=20", "train.checkpoint_every=10", "train.keep_checkpoints=5"]
    )
    run = tmp_path / "run"
    train(config, run, progress=False)
    index = json.loads(RunDir(run).index_path.read_text())  # step 10 on disk, no longer in the index
    index.update(kept=["step_0000020"], latest="step_0000020", best="step_0000020")
    RunDir(run).index_path.write_text(json.dumps(index))
    resume(run, progress=False, steps=30, checkpoint="10")
    index = RunDir(run).read_index()
    assert index.kept == ["step_0000010", "step_0000020", "step_0000030"] and index.latest == "step_0000030"


def test_a_damaged_earlier_checkpoint_does_not_stop_a_resume_from_a_later_one(tmp_path):
    config = apply_overrides(
        get_preset("smoke"), ["train.steps=30", "train.checkpoint_every=10", "train.keep_checkpoints=5"]
    )
    run = tmp_path / "run"
    train(config, run, progress=False)
    RunDir(run).weights_path("step_0000010").write_bytes(b"garbage")
    resume(run, progress=False, steps=40, checkpoint="20")  # forgets step 30; reads the others' eval losses
    index = RunDir(run).read_index()
    assert index.latest == "step_0000040" and index.best != "step_0000010"
    with pytest.raises(RunDirError, match="corrupt or truncated"):
        load_run(run, checkpoint="10")


# ---------------------------------------------------------------------------- hostile files and leftovers (issue 41)
def test_a_refused_new_run_leaves_no_lock_behind(tmp_path, capsys):
    folder = tmp_path / "mine"  # refused before the lock
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    cli_error(capsys, "train", "--preset", "smoke", "--out", str(folder), "--no-progress")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"  # refused under the lock: a setting training would not use
    empty.mkdir()
    cli_error(capsys, "train", "--preset", "smoke", "--out", str(empty), "--no-progress", "--set", "model.seed=5")
    assert list(empty.iterdir()) == []


def test_a_lock_taken_on_a_discarded_lock_file_is_taken_again(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder discarded it would lock a file no one else sees:
    acquire checks the locked file is still the one at the path, else takes the new one."""
    import attnres_lens.rundir as rundir
    from attnres_lens.rundir import RunLock

    path = tmp_path / "run" / ".lock"
    holder = RunLock(path).acquire()
    real_open = os.open

    def open_then_holder_discards(name, flags, *mode):
        fd = real_open(name, flags, *mode)
        if holder._fd is not None:
            holder.discard()  # between the second writer's open and its flock
        return fd

    monkeypatch.setattr(rundir.os, "open", open_then_holder_discards)
    second = RunLock(path).acquire()
    assert os.fstat(second._fd).st_ino == os.stat(path).st_ino and second.created
    second.release()


def test_a_killed_writers_temporary_files_are_removed_on_resume(smoke_run, tmp_path):
    run = copy_run(smoke_run, tmp_path)
    left = [
        run / "checkpoints" / ".step_0000040.state.safetensors.k2j1.tmp",
        run / ".metrics.jsonl.x9.tmp",
        run / "records" / ".magnitudes.parquet.a1.tmp",
    ]
    for path in left:
        path.write_bytes(b"half a file")
    resume(run, progress=False, steps=45)
    assert not [path for path in left if path.exists()]
    assert load_run(run).config.train.steps == 45


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "checkpoints/index.json"])
def test_non_utf8_bytes_in_a_run_file_are_an_error_naming_it(smoke_run, tmp_path, name):
    run = copy_run(smoke_run, tmp_path)
    path = run / name
    path.write_bytes(path.read_bytes()[:-3] + b"\xff\xfe\n")
    with pytest.raises(RunDirError, match=f"{path} is not UTF-8 text"):
        load_run(run).metrics


@pytest.mark.parametrize(
    "setting, message",
    [
        ("model.mhc_streams=1000000", "mostly mhc_streams² × d_model stream mixers"),
        ("model.mhc_sinkhorn_iters=100000000", "mhc_sinkhorn_iters=100000000 is more than 1000"),
        ("train.threads=100000", "threads=100000 is more than this machine can run"),
        ("train.eval_size=1", "no answer position to score accuracy on"),
    ],
)
def test_settings_that_would_crash_hang_or_mislead_are_refused_before_training(setting, message, tmp_path, capsys):
    """Each was accepted: a storage overflow, a run that trains forever, a segmentation fault, NaN accuracies."""
    extra = ["--set", "model.residual=mhc"] if setting.startswith("model.mhc") else []
    extra += ["--set", "train.record_size=1"] if setting == "train.eval_size=1" else []
    err = cli_error(
        capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "run"), "--no-progress", *extra, "--set", setting
    )
    assert message in err
    assert not (tmp_path / "run").exists()


def test_analysis_threads_are_bounded_as_trainings_are(smoke_run, tmp_path, capsys):
    err = cli_error(capsys, "prune", str(smoke_run), "--threads", "100000", "--out", str(tmp_path / "p"))
    assert "threads=100000 is more than this machine can run" in err


# ---------------------------------------------------------------------------- a review's findings (lock and cleanup)
def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    """A run folder handed over with `.lock` linking to another file: taking the lock would empty that file and
    write the holder's name into it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(RunDirError, match=r"\.lock is not a plain file"):
        RunDir(run).lock().acquire()
    assert victim.read_text() == "mine"


def test_a_refused_new_run_removes_only_what_it_made(tmp_path, capsys, monkeypatch):
    import attnres_lens.rundir as rundir
    from attnres_lens.rundir import RunLock

    deep = tmp_path / "x" / "a" / "b" / "run"  # the parents it made go too
    cli_error(capsys, "train", "--preset", "smoke", "--out", str(deep), "--no-progress", "--set", "model.seed=5")
    assert not (tmp_path / "x").exists()

    theirs = tmp_path / "theirs"  # another process made the folder just before this one: never removed

    def another_made_it(path):
        path.mkdir()
        (path / "user_notes.txt").write_text("x")
        return []

    monkeypatch.setattr(rundir, "_make_folders", another_made_it)
    with pytest.raises(FileExistsError, match="is not empty"):  # refused under the lock, their file kept
        train(apply_overrides(get_preset("smoke"), ["model.seed=5"]), theirs, progress=False)
    assert sorted(p.name for p in theirs.iterdir()) == ["user_notes.txt"]
    monkeypatch.undo()

    def interrupted(self, fd):  # Ctrl-C while the lock names its holder
        raise KeyboardInterrupt

    monkeypatch.setattr(RunLock, "_name_holder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(get_preset("smoke"), tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()


def test_a_run_recorded_with_more_threads_than_this_machine_runs_resumes_with_threads(smoke_run, tmp_path, capsys):
    run = copy_run(smoke_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["train"]["threads"] = 100000  # as if recorded on a far bigger machine
    (run / "config.json").write_text(json.dumps(config))
    err = cli_error(capsys, "train", "--resume", str(run), "--steps", "45", "--no-progress")
    assert "threads=100000 is more than this machine can run" in err and "--threads" in err
    assert cli_main(["train", "--resume", str(run), "--steps", "45", "--threads", "1", "--no-progress"]) == 0
    assert json.loads((run / "config.json").read_text())["train"]["threads"] == 1
    assert "--threads is for --resume" in cli_error(
        capsys, "train", "--preset", "smoke", "--out", str(tmp_path / "n"), "--threads", "1"
    )
