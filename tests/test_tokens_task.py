"""The token-file task (`task.name=tokens`): windows of a memory-mapped file of token ids (docs/tasks.md §5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnres_lens.tasks import IGNORE_INDEX, make_task
from attnres_lens.tasks.tokens import TokensTask


@pytest.fixture
def text(tmp_path):
    """A 'text' whose every window is recognisable: id i at position i of the file, modulo 50."""
    ids = (np.arange(5000) % 50).astype(np.uint16)
    ids.tofile(tmp_path / "ids.bin")
    np.save(tmp_path / "ids.npy", ids.astype(np.uint32))
    return tmp_path


def test_windows_are_the_file_and_the_held_out_split_is_its_tail(text):
    task = make_task("tokens", path=str(text / "ids.bin"), dtype="uint16", vocab_size=50, seq_len=33, seed=2)
    split = 4500  # 10% held out
    file = np.fromfile(text / "ids.bin", dtype=np.uint16)
    batch = task.sample(64, task.train_generator())
    for row in batch.tokens.tolist():  # a window of the file, consecutive ids, from the training part
        assert row == [(row[0] + i) % 50 for i in range(33)]
    starts = [int(np.flatnonzero(file[: split - 32] == row[0])[0]) for row in batch.tokens.tolist()]
    assert all(0 <= start <= split - 33 for start in starts)
    held_out = task.eval_batch(8)
    assert torch.equal(held_out.tokens[0], torch.from_numpy(file[split : split + 33].astype(np.int64)))
    assert torch.equal(held_out.tokens[-1], torch.from_numpy(file[-33:].astype(np.int64)))
    assert torch.equal(held_out.tokens, make_task(**task.config()).eval_batch(8).tokens)
    # every position with a target is an answer: on text, accuracy is next-token accuracy
    assert held_out.answer_mask[:, :-1].all() and not held_out.answer_mask[:, -1].any()
    assert torch.equal(held_out.targets[:, :-1], held_out.tokens[:, 1:])
    assert (held_out.targets[:, -1] == IGNORE_INDEX).all()


def test_npy_files_carry_their_dtype_and_match_raw_files(text):
    raw = make_task("tokens", path=str(text / "ids.bin"), dtype="uint16", vocab_size=50, seq_len=17)
    npy = make_task("tokens", path=str(text / "ids.npy"), vocab_size=50, seq_len=17)
    assert torch.equal(raw.eval_batch(5).tokens, npy.eval_batch(5).tokens)
    generator_a, generator_b = raw.train_generator(), npy.train_generator()
    assert torch.equal(raw.sample(4, generator_a).tokens, npy.sample(4, generator_b).tokens)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: dict(path=str(d / "ids.bin")), "does not record its dtype"),
        (lambda d: dict(path=str(d / "ids.bin"), dtype="int32"), "dtype must be one of"),
        (lambda d: dict(path=str(d / "odd.bin"), dtype="uint32"), "not a whole number of uint32 ids"),
        (lambda d: dict(path=str(d / "int64.npy")), "holds int64 values"),
        (lambda d: dict(path=str(d / "ids.npy"), dtype="uint16"), "holds uint32 ids but the task says"),
        (lambda d: dict(path=str(d / "ids.npy"), vocab_size=40), "holds id 49, out of range for vocab_size=40"),
        (lambda d: dict(path=str(d / "ids.npy"), seq_len=600), "too short for seq_len=600"),
        (lambda d: dict(path=str(d / "missing.bin"), dtype="uint16"), "does not exist"),
        (lambda d: dict(path=str(d / "ids.npy"), holdout=1.5), "holdout must be a fraction above 0 and at most 1"),
        (lambda d: dict(path=str(d / "ids.npy"), holdout=1, seq_len=6000), "fewer than one window of seq_len=6000"),
        (lambda d: dict(), "give the token file"),
    ],
)
def test_bad_files_get_clear_errors(text, make, message):
    (text / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.save(text / "int64.npy", np.arange(100, dtype=np.int64))
    params = {"vocab_size": 50, "seq_len": 33, **make(text)}
    with pytest.raises(ValueError, match=message):
        TokensTask(**params)


def test_holding_out_the_whole_file_evaluates_on_all_of_it_and_refuses_training_windows(text):
    task = TokensTask(path=str(text / "ids.npy"), vocab_size=50, seq_len=33, holdout=1)
    ids = np.load(text / "ids.npy")
    windows = task.eval_batch(4).tokens
    assert windows[0].tolist() == ids[:33].tolist() and windows[-1].tolist() == ids[-33:].tolist()
    with pytest.raises(ValueError, match="holdout=1 holds out the whole of .*no training windows.*holdout below 1"):
        task.sample(2, task.train_generator())


def test_a_model_trains_on_a_token_file(tmp_path):
    """The trainer runs on real-text windows: the held-out loss falls on a file of a repeating pattern."""
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.rundir import load_run
    from attnres_lens.training import train

    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 24, 40)
    np.save(tmp_path / "ids.npy", np.tile(pattern, 200).astype(np.uint16))
    config = apply_overrides(
        get_preset("smoke"),
        [
            "task.name=tokens",
            f"task.path={tmp_path / 'ids.npy'}",
            "task.vocab_size=24",
            "task.seq_len=33",
            "train.steps=30",
            "train.eval_size=8",
            "train.record_size=8",
        ],
    )
    train(config, tmp_path / "run", progress=False)
    metrics = load_run(tmp_path / "run", load_model=False).metrics.dropna(subset=["eval_loss"])
    assert metrics["eval_loss"].iloc[-1] < metrics["eval_loss"].iloc[0] - 0.5


def test_switching_the_task_by_override_keeps_only_shared_parameters(text):
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset

    smoke = get_preset("smoke")
    switched = apply_overrides(smoke, ["task.name=tokens", f"task.path={text / 'ids.npy'}", "task.vocab_size=50"])
    assert switched.task.params["seq_len"] == smoke.task.params["seq_len"] and "max_len" not in switched.task.params
    with pytest.raises(ValueError, match="has no parameter max_len"):  # given explicitly: still refused
        apply_overrides(smoke, ["task.name=tokens", f"task.path={text / 'ids.npy'}", "task.max_len=4"])
