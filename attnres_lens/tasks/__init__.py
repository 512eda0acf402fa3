"""Synthetic tasks for training and probing induction (docs/tasks.md).

Conventions shared by every task:

* Tokens: id 0 is BOS (`BOS`), reserved and placed at position 0 of every sequence; content tokens are
  1 .. vocab_size-1. `vocab_size` counts BOS, so it is the model's vocabulary size. No other special tokens.
* A batch (`Batch`) holds `tokens` [B, seq_len] int64, the whole sequence fed to the model, and `targets`
  [B, seq_len] int64 with targets[:, t] = tokens[:, t+1] and IGNORE_INDEX (-100) at the last position.
  Loss is next-token cross-entropy on every position that has a target:
  `F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)`.
* `answer_mask` [B, seq_len] bool marks the positions t whose target the context tokens[:, :t+1] determines
  under the task's rule (each task documents its rule). Accuracy is counted there only:
  `(logits.argmax(-1) == targets)[answer_mask]` - a model that knows the rule scores 100%.
* Determinism: a task is fully described by its parameters (`task.config()`, rebuilt by `make_task`).
  Training batches come from `task.train_generator()` via `task.sample(batch_size, generator)`;
  `task.eval_batch(n)` is a fixed held-out set drawn from its own stream, identical whatever was sampled.
  Batches are built on the CPU; move them with `batch.to(device)`.

Tasks (`TASKS`, built with `make_task(name, **params)`):

* `copy`: random tokens with a segment repeated at a random later offset (the default training task).
* `induction`: the KV-shift paper's task, every re-occurring token followed by its earlier successor.
* `repeated`: [BOS, r, r] repeated random tokens, a scoring probe (`for_training` is False).
* `ngram3`: a sparse random 3-gram language (control).
* `mixed`: 3-gram text with copied segments, for depth studies.
* `tokens`: windows of a file of token ids from any tokenizer (real text); no BOS of its own, every position an
  answer (see `tokens.py`).
* `shakespeare`: byte-level windows of Shakespeare's plays, split by play; every position an answer (see
  `shakespeare.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import BOS, IGNORE_INDEX, Batch, Task
from .copying import CopyTask
from .induction import InductionTask, RepeatedTask, repeated_tokens
from .ngram import MixedTask, NGram3Task
from .shakespeare import ShakespeareTask
from .tokens import TokensTask

TASKS: dict[str, type[Task]] = {
    task.name: task
    for task in (CopyTask, InductionTask, RepeatedTask, NGram3Task, MixedTask, TokensTask, ShakespeareTask)
}


def make_task(name: str, **params: Any) -> Task:
    """Build the task `name` from keyword parameters; unknown names or parameters raise ValueError."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    task_class = TASKS[name]
    allowed = [f.name for f in dataclasses.fields(task_class) if f.init]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no parameter {', '.join(unknown)}; its parameters are {allowed}")
    return task_class(**params)


__all__ = [
    "BOS",
    "IGNORE_INDEX",
    "TASKS",
    "Batch",
    "CopyTask",
    "InductionTask",
    "MixedTask",
    "NGram3Task",
    "RepeatedTask",
    "ShakespeareTask",
    "Task",
    "TokensTask",
    "make_task",
    "repeated_tokens",
]
