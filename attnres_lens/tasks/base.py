"""Shared pieces of the task generators: the batch type, the task base class, seeding and helpers.

See the package docstring (`attnres_lens.tasks`) for the conventions every task follows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

BOS = 0
"""Reserved token id placed at position 0 of every sequence; never used as content."""

IGNORE_INDEX = -100
"""Target at positions without a next token (the last one); `F.cross_entropy`'s default ignore_index."""

# Independent random streams derived from a task's seed. The model stream draws the fixed parts of a task
# (e.g. the 3-gram table), so it never depends on how many batches were sampled.
_TRAIN_STREAM, _EVAL_STREAM, _MODEL_STREAM = 0, 1, 2


def derive_generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one named stream of `seed`; distinct streams never share state."""
    words = np.random.SeedSequence([seed, stream]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator()
    generator.manual_seed((int(words[0]) << 32) | int(words[1]))
    return generator


@dataclass
class Batch:
    """One batch of sequences, on the CPU until moved with `to`.

    tokens:      [B, T] int64, the model input.
    targets:     [B, T] int64, next-token labels: targets[:, t] = tokens[:, t + 1]; the last position holds
                 IGNORE_INDEX.
    answer_mask: [B, T] bool, positions whose target the context determines (accuracy is counted there only).
    layout:      per-task description of how each sequence was built (e.g. copy sources and destinations),
                 for analysis and tests; tensors with a leading batch dimension.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    answer_mask: torch.Tensor
    layout: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor) -> Batch:
        """Tokens of your own [B, T] scored as next-token prediction: every position but the last has a target, and
        every target counts as an answer (as on real text)."""
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(
                f"tokens must be integer ids of shape [batch, pos], got {tokens.dtype} {tuple(tokens.shape)}"
            )
        targets = next_token_targets(tokens.long())
        return cls(tokens.long(), targets, targets != IGNORE_INDEX)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.tokens.to(device),
            self.targets.to(device),
            self.answer_mask.to(device),
            {name: value.to(device) for name, value in self.layout.items()},
        )


def check_target_ids(targets: Any, shape: torch.Size, d_vocab: int, what: str = "targets") -> torch.Tensor:
    """`targets` as int64 token ids of `shape`, each in [0, d_vocab) or IGNORE_INDEX; anything else (floats or
    booleans, which would be truncated or read as ids 0/1, another shape, an id out of range) is a ValueError
    naming `what`."""
    targets = torch.as_tensor(targets)
    if targets.dtype == torch.bool or targets.is_floating_point() or targets.is_complex():
        raise ValueError(
            f"{what} must hold integer token ids, got dtype {targets.dtype}; pass a long tensor "
            f"(use {IGNORE_INDEX} to skip a position)"
        )
    if targets.shape != shape:
        raise ValueError(f"{what} must have the tokens' shape {tuple(shape)}, got {tuple(targets.shape)}")
    bad = targets[(targets != IGNORE_INDEX) & ((targets < 0) | (targets >= d_vocab))]
    if len(bad):
        raise ValueError(
            f"{what} holds token id {int(bad[0])}, out of range for d_vocab={d_vocab} "
            f"(use {IGNORE_INDEX} to skip a position)"
        )
    return targets.long()


def check_batch(batch: Any) -> None:
    """A `Batch`, or a TypeError naming what was given and how to make one from tokens."""
    if not isinstance(batch, Batch):
        raise TypeError(
            f"batch must be a Batch (tokens, next-token targets, answer positions), got {type(batch).__name__}; "
            "for tokens of your own, Batch.from_tokens(tokens) (attnres_lens.tasks.base) scores every next token"
        )


def check_scored_batch(batch: Batch, d_vocab: int) -> Batch:
    """`batch` checked for an analysis that scores it: targets as `check_target_ids`, an answer mask of booleans
    of the tokens' shape, and at least one position with a target (an all-IGNORE batch, e.g. of one-token
    sequences, would give a table of NaN effects). Returns it with int64 targets."""
    check_batch(batch)
    targets = check_target_ids(batch.targets, batch.tokens.shape, d_vocab, "batch.targets")
    mask = torch.as_tensor(batch.answer_mask)
    if mask.dtype != torch.bool or mask.shape != batch.tokens.shape:
        raise ValueError(
            f"batch.answer_mask must be booleans of the tokens' shape {tuple(batch.tokens.shape)}, got "
            f"{mask.dtype} of shape {tuple(mask.shape)}"
        )
    if not (targets != IGNORE_INDEX).any():
        raise ValueError(
            "the batch has no position with a target (every target is "
            f"{IGNORE_INDEX}, e.g. one-token sequences): there is nothing to score"
        )
    return dataclasses.replace(batch, targets=targets.to(batch.tokens.device), answer_mask=mask)


def next_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Targets for `tokens` [B, T]: shifted left by one, IGNORE_INDEX at the last position."""
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def earlier_occurrences(tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: how many times tokens[b, t] occurs in tokens[b, :t]."""
    same = tokens[:, :, None] == tokens[:, None, :]
    earlier = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril(-1)
    return (same & earlier).sum(-1)


def random_content(shape: tuple[int, ...], vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform random content tokens (never BOS)."""
    return torch.randint(1, vocab_size, shape, generator=generator)


def uniform_int(low: torch.Tensor, high: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Elementwise uniform integers in [low, high] (inclusive), for per-row bounds."""
    # float64 so that u * span never rounds up to span.
    u = torch.rand(low.shape, generator=generator, dtype=torch.float64)
    return (low + (u * (high - low + 1)).long()).minimum(high)


def check_int(task: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{task}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{task}: {name} must be >= {minimum}, got {value}")


@dataclass(kw_only=True)
class Task:
    """Base class: a seeded generator of token sequences with a known set of answer positions.

    Subclasses set `name`, add their own parameters as fields, check them in `_validate` and build
    sequences in `_generate`.
    """

    name: ClassVar[str]
    for_training: ClassVar[bool] = True  # False for scoring probes that a positional head can solve
    encodes_text: ClassVar[bool] = False  # True where typed text has ids by the task's own rule (`encode_text`)
    vocab_size: int = 64
    seq_len: int = 65
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self.name, "vocab_size", self.vocab_size, 3)
        check_int(self.name, "seq_len", self.seq_len, 3)
        check_int(self.name, "seed", self.seed, 0)
        self._validate()

    def _validate(self) -> None:
        """Check the task's own parameters; raise ValueError saying what to change."""

    def encode_text(self, text: str) -> list[int]:
        """`text` as this task's ids, BOS first, for a task that encodes text (`encodes_text`)."""
        raise ValueError(f"{self.name}: the task's sequences are not text; give a prompt as token ids")

    def token_text(self, token: int) -> str:
        """How id `token` reads in a figure's labels, for a task that encodes text (`encodes_text`)."""
        raise ValueError(f"{self.name}: the task's sequences are not text; its tokens are labelled by id")

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """A training batch drawn from `generator` (advances it; see `train_generator`)."""
        check_int(self.name, "batch_size", batch_size, 1)
        return self._generate(batch_size, generator)

    def eval_batch(self, n: int) -> Batch:
        """The fixed held-out set of `n` sequences: same for a given seed and n, whatever was sampled before."""
        return self.sample(n, derive_generator(self.seed, _EVAL_STREAM))

    def train_generator(self, data_seed: int | None = None) -> torch.Generator:
        """The generator for training batches, seeded from `seed` (or from `data_seed` when given: another order of
        batches of the same task) on a stream disjoint from `eval_batch`'s.

        Data parallel: draw the global batch on every rank from this same generator and keep the rank's
        rows, so the data do not depend on the world size. Save `get_state()` to resume exactly.
        """
        return derive_generator(self.seed if data_seed is None else data_seed, _TRAIN_STREAM)

    def model_generator(self) -> torch.Generator:
        """The generator for the fixed parts of a task (e.g. a 3-gram table), independent of sampling."""
        return derive_generator(self.seed, _MODEL_STREAM)

    def config(self) -> dict[str, Any]:
        """{"name": ..., **parameters}; `make_task(**task.config())` rebuilds an equal task."""
        params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return {"name": self.name, **params}

    def _batch(self, tokens: torch.Tensor, answer_mask: torch.Tensor, **layout: torch.Tensor) -> Batch:
        # The last position has no target, so it can never count as an answer.
        answer_mask = answer_mask.clone()
        answer_mask[:, -1] = False
        return Batch(tokens, next_token_targets(tokens), answer_mask, layout)
