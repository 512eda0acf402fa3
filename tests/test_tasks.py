"""Task generators: conventions, determinism, and answer positions checked against brute-force oracles.

The oracles below work on plain Python lists, one sequence at a time, from each task's written rule;
they share no code with the vectorised generators.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest
import torch

from attnres_lens.config import ModelConfig, RunConfig, TaskConfig
from attnres_lens.tasks import (
    BOS,
    IGNORE_INDEX,
    TASKS,
    Batch,
    InductionTask,
    NGram3Task,
    make_task,
    repeated_tokens,
)
from attnres_lens.tasks.copying import copy_answer_mask, window_answer_mask
from attnres_lens.tasks.induction import induction_answer_mask

SMALL = {  # non-default sizes, to check that nothing depends on the defaults
    "copy": dict(vocab_size=40, seq_len=41, min_len=4, max_len=10),
    "induction": dict(vocab_size=30, seq_len=50, min_period=5),
    "repeated": dict(vocab_size=20, seq_len=21),
    "ngram3": dict(vocab_size=16, seq_len=40, branching=2, deterministic_frac=0.3),
    "mixed": dict(vocab_size=32, seq_len=61, n_copies=3, min_len=4, max_len=8),
}


# The synthetic tasks; the real-text tasks read files (tests/test_tokens_task.py, tests/test_shakespeare_task.py).
SYNTHETIC = [name for name in TASKS if name not in ("tokens", "shakespeare")]


def tasks_under_test() -> list[tuple[str, dict]]:
    return [(name, {}) for name in SYNTHETIC] + list(SMALL.items())


# ---------------------------------------------------------------- brute-force oracles (per sequence)


def copied_positions(dst: int, length: int, first_offset: int) -> list[int]:
    """Positions t = dst + i with first_offset <= i <= length - 2 (the next token is copied too)."""
    return [dst + i for i in range(first_offset, length - 1)]


def oracle_copy_mask(tokens: list[int], dst: int, length: int) -> set[int]:
    return {t for t in copied_positions(dst, length, 0) if tokens[:t].count(tokens[t]) == 1}


def oracle_window_mask(tokens: list[int], copies: list[tuple[int, int, int]]) -> set[int]:
    answers = set()
    for _, dst, length in copies:
        for t in copied_positions(dst, length, 1):
            window = tokens[dst : t + 1]
            w = len(window)
            followers = {tokens[q + w] for q in range(0, t - w + 1) if tokens[q : q + w] == window}
            if len(followers) == 1:
                answers.add(t)
    return answers


def oracle_induction_mask(tokens: list[int]) -> set[int]:
    return {t for t in range(1, len(tokens) - 1) if tokens[t] in tokens[1:t]}


def predict_by_last_occurrence(tokens: list[int], t: int) -> int | None:
    """A perfect 1-token induction head: what followed the most recent earlier occurrence of tokens[t]."""
    earlier = [j for j in range(t) if tokens[j] == tokens[t]]
    return tokens[earlier[-1] + 1] if earlier else None


def predict_by_longest_match(tokens: list[int], t: int) -> int | None:
    """Continue the longest suffix of tokens[:t+1] that occurred earlier, if its occurrences agree."""
    best = None
    for length in range(1, t + 1):
        suffix = tokens[t - length + 1 : t + 1]
        followers = {tokens[q + length] for q in range(0, t - length + 1) if tokens[q : q + length] == suffix}
        if not followers:
            break
        best = followers
    return next(iter(best)) if best is not None and len(best) == 1 else None


def accuracy_of(predict, batch: Batch) -> float:
    correct = total = 0
    for row in range(batch.tokens.shape[0]):
        tokens, targets = batch.tokens[row].tolist(), batch.targets[row].tolist()
        for t in batch.answer_mask[row].nonzero().flatten().tolist():
            correct += predict(tokens, t) == targets[t]
            total += 1
    assert total > 0
    return correct / total


def layout_rows(batch: Batch, row: int) -> list[tuple[int, int, int]]:
    return list(
        zip(
            batch.layout["src_start"][row].tolist(),
            batch.layout["dst_start"][row].tolist(),
            batch.layout["seg_len"][row].tolist(),
        )
    )


def mask_set(batch: Batch, row: int) -> set[int]:
    return set(batch.answer_mask[row].nonzero().flatten().tolist())


# ---------------------------------------------------------------- conventions shared by every task


@pytest.mark.parametrize("name, params", tasks_under_test())
def test_batch_conventions(name: str, params: dict) -> None:
    task = make_task(name, **params)
    batch = task.sample(16, task.train_generator())
    shape = (16, task.seq_len)
    assert batch.tokens.shape == batch.targets.shape == batch.answer_mask.shape == shape
    assert batch.tokens.dtype == batch.targets.dtype == torch.int64
    assert batch.answer_mask.dtype == torch.bool
    assert (batch.tokens[:, 0] == BOS).all()
    assert ((batch.tokens[:, 1:] >= 1) & (batch.tokens[:, 1:] < task.vocab_size)).all()
    assert torch.equal(batch.targets[:, :-1], batch.tokens[:, 1:])
    assert (batch.targets[:, -1] == IGNORE_INDEX).all()
    assert not batch.answer_mask[:, -1].any()
    assert batch.answer_mask.any(1).float().mean() > 0.5  # most sequences have something to score


@pytest.mark.parametrize("name, params", tasks_under_test())
def test_deterministic_given_seed(name: str, params: dict) -> None:
    first, second = make_task(name, seed=3, **params), make_task(name, seed=3, **params)
    a, b = first.sample(8, first.train_generator()), second.sample(8, second.train_generator())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.answer_mask, b.answer_mask)
    other = make_task(name, seed=4, **params)
    assert not torch.equal(a.tokens, other.sample(8, other.train_generator()).tokens)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_eval_set_fixed_and_disjoint_from_training(name: str) -> None:
    task = make_task(name, seed=1)
    before = task.eval_batch(32)
    generator = task.train_generator()
    training = [task.sample(32, generator).tokens for _ in range(3)]
    after = make_task(name, seed=1).eval_batch(32)
    assert torch.equal(before.tokens, after.tokens) and torch.equal(before.answer_mask, after.answer_mask)
    train_rows = {tuple(row) for tokens in training for row in tokens.tolist()}
    assert not train_rows & {tuple(row) for row in before.tokens.tolist()}


@pytest.mark.parametrize("name, params", tasks_under_test())
def test_config_round_trip(name: str, params: dict) -> None:
    task = make_task(name, seed=5, **params)
    config = task.config()
    assert config["name"] == name and config["seed"] == 5
    rebuilt = make_task(**config)
    assert rebuilt == task
    assert torch.equal(rebuilt.eval_batch(4).tokens, task.eval_batch(4).tokens)


def test_batch_to_device_keeps_layout() -> None:
    batch = make_task("copy").eval_batch(2).to("cpu")
    assert set(batch.layout) == {"src_start", "dst_start", "seg_len"}


# ---------------------------------------------------------------- hand-built sequences


def test_copy_mask_hand_built() -> None:
    # Segment [5, 6, 7] at 1 copied to 5; positions 5 and 6 predict 6 and 7; 7 ends the copy.
    tokens = torch.tensor([[0, 5, 6, 7, 9, 5, 6, 7, 2]])
    mask = copy_answer_mask(tokens, torch.tensor([[5]]), torch.tensor([[3]]))
    assert mask[0].nonzero().flatten().tolist() == [5, 6]
    # 6 also occurs before the segment, so after the copied 6 the answer is ambiguous.
    tokens = torch.tensor([[0, 6, 5, 6, 7, 9, 5, 6, 7, 3]])
    mask = copy_answer_mask(tokens, torch.tensor([[6]]), torch.tensor([[3]]))
    assert mask[0].nonzero().flatten().tolist() == [6]


def test_window_mask_hand_built() -> None:
    # Copy of [5, 6, 7, 9] from 1 to 11; [5, 6] also occurs at 6, followed by 7 as at the source
    # (determined), but [5, 6, 7] at 6 is followed by 3, not 9 (ambiguous).
    tokens = torch.tensor([[0, 5, 6, 7, 9, 2, 5, 6, 7, 3, 1, 5, 6, 7, 9, 4]])
    mask = window_answer_mask(tokens, torch.tensor([[11]]), torch.tensor([[4]]))
    assert mask[0].nonzero().flatten().tolist() == [12]
    # Two copies; [5, 6] occurs at 1 (then 7) and at 5 (then 3): ambiguous. [8, 9, 4] is unique.
    tokens = torch.tensor([[0, 5, 6, 7, 1, 5, 6, 3, 8, 9, 4, 2, 5, 6, 7, 8, 9, 4, 1]])
    mask = window_answer_mask(tokens, torch.tensor([[12, 15]]), torch.tensor([[3, 3]]))
    assert mask[0].nonzero().flatten().tolist() == [16]


def test_induction_mask_hand_built() -> None:
    tokens = torch.tensor([[0, 3, 4, 5, 3, 4, 5, 3]])
    assert induction_answer_mask(tokens)[0].tolist() == [False] * 4 + [True] * 4


def test_ngram_mask_hand_built() -> None:
    task = NGram3Task(vocab_size=8, seq_len=8)
    contexts = [(a, b) for a in range(1, 8) for b in range(1, 8)]
    fixed = next(c for c in contexts if task.deterministic[c[0] * 8 + c[1]])
    free = next(c for c in contexts if not task.deterministic[c[0] * 8 + c[1]])
    mask = task.deterministic_mask(torch.tensor([[0, *fixed, *free]]))[0].tolist()
    # Position 2 ends the deterministic context, position 4 the stochastic one; 0 and 1 have no context.
    assert (mask[0], mask[1], mask[2], mask[4]) == (False, False, True, False)


def test_repeated_tokens_helper() -> None:
    tokens = repeated_tokens(4, 6, 10, torch.Generator().manual_seed(0), bos=9)
    assert tokens.shape == (4, 13) and (tokens[:, 0] == 9).all()
    assert torch.equal(tokens[:, 1:7], tokens[:, 7:]) and (tokens[:, 1:] < 10).all()


# ---------------------------------------------------------------- random batches against the oracles


@pytest.mark.parametrize("params", [{}, SMALL["copy"]])
def test_copy_answers_match_oracle(params: dict) -> None:
    task = make_task("copy", **params)
    batch = task.eval_batch(128)
    for row in range(128):
        tokens = batch.tokens[row].tolist()
        [(src, dst, length)] = layout_rows(batch, row)
        assert task.min_len <= length <= task.max_len and src >= 1 and src + length <= dst
        assert dst + length <= task.seq_len and tokens[dst : dst + length] == tokens[src : src + length]
        assert mask_set(batch, row) == oracle_copy_mask(tokens, dst, length)
    assert accuracy_of(predict_by_last_occurrence, batch) == 1.0


@pytest.mark.parametrize("params", [{}, SMALL["mixed"]])
def test_mixed_answers_match_oracle(params: dict) -> None:
    task = make_task("mixed", **params)
    batch = task.eval_batch(48)
    for row in range(48):
        tokens = batch.tokens[row].tolist()
        copies = layout_rows(batch, row)
        assert len(copies) == task.n_copies
        ends = 0
        for src, dst, length in copies:  # copies in order, never overlapping, sources before them
            assert dst >= ends and src + length <= dst and src >= 1
            assert tokens[dst : dst + length] == tokens[src : src + length]
            ends = dst + length
        assert mask_set(batch, row) == oracle_window_mask(tokens, copies)
    assert accuracy_of(predict_by_longest_match, batch) == 1.0


@pytest.mark.parametrize("params", [{}, SMALL["induction"]])
def test_induction_answers_match_oracle(params: dict) -> None:
    task = make_task("induction", **params)
    batch = task.eval_batch(128)
    for row in range(128):
        tokens = batch.tokens[row].tolist()
        for i in range(1, len(tokens) - 1):  # the rule: re-occurrences repeat the earlier successor
            for j in range(i + 1, len(tokens) - 1):
                if tokens[i] == tokens[j]:
                    assert tokens[i + 1] == tokens[j + 1]
        assert mask_set(batch, row) == oracle_induction_mask(tokens)
    assert accuracy_of(predict_by_last_occurrence, batch) == 1.0


def test_repeated_answers_are_the_second_half() -> None:
    task = make_task("repeated", seq_len=21)
    batch = task.eval_batch(64)
    assert torch.equal(batch.tokens[:, 1:11], batch.tokens[:, 11:])
    for row in range(64):
        assert mask_set(batch, row) == set(range(11, 20))
    assert accuracy_of(lambda tokens, t: tokens[t - 9], batch) == 1.0  # the period-10 positional rule


@pytest.mark.parametrize("params", [{}, SMALL["ngram3"]])
def test_ngram_answers_are_the_deterministic_contexts(params: dict) -> None:
    task = make_task("ngram3", **params)
    batch = task.eval_batch(512)
    followers: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for tokens in batch.tokens.tolist():
        for t in range(2, len(tokens) - 1):
            followers[tokens[t - 1], tokens[t]][tokens[t + 1]] += 1

    def is_deterministic(a: int, b: int) -> bool:
        return bool(task.deterministic[a * task.vocab_size + b])

    # Contexts marked deterministic were only ever followed by one token; many others by several.
    for (a, b), seen in followers.items():
        if is_deterministic(a, b):
            assert len(seen) == 1
    several = [len(seen) > 1 for (a, b), seen in followers.items() if not is_deterministic(a, b)]
    assert sum(several) > len(several) / 3
    for row, tokens in enumerate(batch.tokens.tolist()):
        expected = {t for t in range(2, len(tokens) - 1) if is_deterministic(tokens[t - 1], tokens[t])}
        assert mask_set(batch, row) == expected

    def most_likely(tokens: list[int], t: int) -> int:
        context = tokens[t - 1] * task.vocab_size + tokens[t]
        return task.successors[context, task.probs[context].argmax()].item()

    assert accuracy_of(most_likely, batch) == 1.0


def test_ngram_samples_follow_the_table_probabilities() -> None:
    task = make_task("ngram3")
    batch = task.eval_batch(512)
    context = batch.tokens[:, 1:-2] * task.vocab_size + batch.tokens[:, 2:-1]
    following = batch.tokens[:, 3:]
    stochastic = ~task.deterministic[context]
    for k in range(task.branching):
        observed = (following == task.successors[context, k])[stochastic].double().mean()
        expected = task.probs[context, k][stochastic].mean()
        assert abs(observed - expected) < 0.02


# ---------------------------------------------------------------- no shortcut without induction


def best_fixed_lag_accuracy(batch: Batch) -> float:
    """Accuracy at answer positions of the best "copy the token `lag` positions back" positional head."""
    seq_len = batch.tokens.shape[1]
    best = 0.0
    for lag in range(1, seq_len + 1):
        predicted = torch.full_like(batch.tokens, -1)
        predicted[:, lag - 1 :] = batch.tokens[:, : seq_len - lag + 1]  # predicted[t] = tokens[t + 1 - lag]
        hits = (predicted == batch.targets)[batch.answer_mask].double().mean().item()
        best = max(best, hits)
    return best


@pytest.mark.parametrize("name", ["copy", "induction", "mixed"])
def test_offsets_vary_so_no_positional_head_solves_it(name: str) -> None:
    batch = make_task(name).eval_batch(128)
    if name == "induction":
        lags = batch.layout["period"]
    else:
        lags = batch.layout["dst_start"] - batch.layout["src_start"]
    assert len(set(lags.flatten().tolist())) >= 20
    assert best_fixed_lag_accuracy(batch) < 0.25


def test_repeated_probe_is_solved_by_a_fixed_lag() -> None:
    # The reason it is a probe only: one positional head solves it.
    assert best_fixed_lag_accuracy(make_task("repeated").eval_batch(32)) == 1.0


def test_induction_has_no_short_cycles_at_default_size() -> None:
    task = InductionTask()
    batch = task.eval_batch(256)
    periods = []
    for row, tokens in enumerate(batch.tokens.tolist()):
        # Period measured from the tokens: the distance from the first re-occurrence back to its original.
        first = next(t for t in range(1, len(tokens)) if tokens[t] in tokens[1:t])
        period = first - tokens.index(tokens[first])
        assert all(tokens[q] == tokens[q - period] for q in range(first, len(tokens)))
        assert period == batch.layout["period"][row].item()
        periods.append(period)
    assert min(periods) >= task.min_period
    assert len(set(periods)) >= 20


# ---------------------------------------------------------------- parameter errors


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("copy", dict(vocab_size=20), r"vocab_size >= 33"),
        ("copy", dict(seq_len=30), r"seq_len >= 33"),
        ("copy", dict(min_len=10, max_len=8), r"max_len must be >= 10"),
        ("copy", dict(min_len=1), r"min_len must be >= 2"),
        ("copy", dict(seq_len=65.0), r"seq_len must be an int"),
        ("copy", dict(seed=-1), r"seed must be >= 0"),
        ("induction", dict(vocab_size=8), r"vocab_size >= 9"),
        ("induction", dict(seq_len=10), r"seq_len >= 11"),
        ("repeated", dict(seq_len=64), r"must be odd"),
        ("ngram3", dict(deterministic_frac=1.0), r"strictly between 0 and 1"),
        ("ngram3", dict(branching=70), r"branching <= 63"),
        ("ngram3", dict(seq_len=3), r"seq_len must be >= 4"),  # no position would have an answer
        ("copy", dict(vocab_size=17, seq_len=34, min_len=4, max_len=8), r"vocab_size >= 18"),  # ⌈33/2⌉ = 17
        ("mixed", dict(seq_len=64), r"seq_len >= 65"),
        ("mixed", dict(min_len=2), r"min_len must be >= 3"),
    ],
)
def test_bad_parameters_are_explained(name: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_task(name, **params)


def test_unknown_task_or_parameter_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'kopy'.*'copy'.*'induction'"):
        make_task("kopy")
    with pytest.raises(ValueError, match=r"no parameter segment_len.*'min_len', 'max_len'"):
        make_task("copy", segment_len=8)
    with pytest.raises(ValueError, match=r"batch_size must be >= 1"):
        make_task("copy").sample(0, torch.Generator())


@pytest.mark.parametrize("name, params", tasks_under_test())
def test_a_task_config_keeps_what_was_given_and_builds_that_task(name: str, params: dict) -> None:
    stored = {"name": name, **params}
    config = TaskConfig.from_dict(stored)
    assert (config.name, config.params) == (name, params)
    assert config.to_dict() == stored  # config.json's form, without the defaults the task fills in
    built = config.build()
    assert type(built) is TASKS[name] and built.config() == make_task(name, **params).config()
    assert config.build() is not built  # a new task each time


def test_a_task_config_is_checked_by_the_task_it_names() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'kopy'; choose one of \['copy', 'induction', 'mixed'"):
        TaskConfig("kopy")
    with pytest.raises(
        ValueError,
        match=r"task 'copy' has no parameter segment_len; its parameters are "
        r"\['vocab_size', 'seq_len', 'seed', 'min_len', 'max_len'\]",
    ):
        TaskConfig("copy", {"segment_len": 8})
    with pytest.raises(ValueError, match=r"copy: min_len must be >= 2, got 1"):  # the task's own check
        TaskConfig("copy", {"min_len": 1})
    with pytest.raises(ValueError, match=r"the task has no 'name'; give one of \['copy'"):
        TaskConfig.from_dict({"vocab_size": 32})
    with pytest.raises(ValueError, match=r"'name' is the task's name, not a parameter"):
        TaskConfig("copy", {"name": "induction"})
    with pytest.raises(ValueError, match=r"the task name must be a string.*got \['copy'\]"):
        TaskConfig(["copy"])
    with pytest.raises(ValueError, match=r"task parameters must be a mapping.*got \[\('seq_len', 33\)\]"):
        TaskConfig("copy", [("seq_len", 33)])
    with pytest.raises(ValueError, match=r"a task section must be an object.*got 'copy'"):
        TaskConfig.from_dict("copy")


def test_a_task_config_cannot_change_after_it_was_checked() -> None:
    params = {"vocab_size": 40, "seq_len": 41}
    config = TaskConfig("copy", params)
    params["min_len"] = 0  # the caller's dict is not the config's
    assert config.params == {"vocab_size": 40, "seq_len": 41}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.name = "induction"


def test_a_run_config_holds_a_task_config_given_one_or_its_mapping() -> None:
    model = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_ctx=41, d_vocab=40)
    given = TaskConfig("copy", {"vocab_size": 40, "seq_len": 41})
    from_mapping = RunConfig(model, {"name": "copy", "vocab_size": 40, "seq_len": 41})
    assert from_mapping.task == given and RunConfig(model, given).task is given
    assert from_mapping.build_task().config() == given.build().config()
    with pytest.raises(ValueError, match=r"copy: seq_len must be an int, got '41'"):
        RunConfig(model, {"name": "copy", "seq_len": "41"})
    with pytest.raises(ValueError, match=r"task must be a TaskConfig or a mapping.*got 'copy'"):
        RunConfig(model, "copy")


def test_repeated_is_marked_as_a_probe() -> None:
    assert [name for name, task in TASKS.items() if not task.for_training] == ["repeated"]
