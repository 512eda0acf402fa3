"""A sparse random 3-gram language (the control task) and the mixed task built on it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .base import BOS, Batch, Task, check_int, random_content
from .copying import copy_layout, insert_copies, window_answer_mask


@dataclass(kw_only=True)
class NGram3Task(Task):
    """Sequences from a fixed random sparse 3-gram model drawn from the seed (control: no induction needed).

    Every context (a, b) of content tokens has `branching` possible successors with Dirichlet(1)
    probabilities, except a `deterministic_frac` share of contexts that have a single successor.
    Sequences are [BOS, x_1, x_2, x_3, ...] with x_1, x_2 uniform and x_{t+1} ~ P(. | x_{t-1}, x_t).

    Nothing is determined where the 3-gram is stochastic, so answer positions are the t >= 2 whose context
    (x_{t-1}, x_t) is deterministic; there the unique successor is the answer. The loss on all positions
    measures how well the whole distribution is learnt.

    Model tables (indexed by a * vocab_size + b): `successors` [V*V, branching] int64 and `probs`
    [V*V, branching] float64 (a deterministic context puts probability 1 on its first successor),
    `deterministic` [V*V] bool.
    """

    name = "ngram3"
    branching: int = 3
    deterministic_frac: float = 0.5
    successors: torch.Tensor = field(init=False, repr=False, compare=False)
    probs: torch.Tensor = field(init=False, repr=False, compare=False)
    deterministic: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._draw_model()

    def _validate(self) -> None:
        # the first answer can be the target of position 2 (context x_1, x_2), which needs a position 3
        check_int(self.name, "seq_len", self.seq_len, 4)
        check_int(self.name, "branching", self.branching, 2)
        if self.branching > self.vocab_size - 1:
            raise ValueError(
                f"{self.name}: branching={self.branching} exceeds the {self.vocab_size - 1} content tokens; "
                f"use branching <= {self.vocab_size - 1} or a larger vocab_size"
            )
        frac = self.deterministic_frac
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
            raise ValueError(
                f"{self.name}: deterministic_frac must be a number strictly between 0 and 1, got {frac!r} "
                "(0 leaves no answer positions; 1 makes every sequence fall into a deterministic cycle)"
            )

    def _draw_model(self) -> None:
        generator = self.model_generator()
        n_contexts = self.vocab_size * self.vocab_size
        content_order = torch.rand(n_contexts, self.vocab_size - 1, generator=generator).argsort(-1)
        self.successors = content_order[:, : self.branching] + 1
        self.deterministic = torch.rand(n_contexts, generator=generator) < self.deterministic_frac
        weights = -torch.rand(n_contexts, self.branching, generator=generator, dtype=torch.float64).log()
        weights[self.deterministic, 1:] = 0.0
        self.probs = weights / weights.sum(-1, keepdim=True)

    def _sample_tokens(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """[B, T] sequences of the 3-gram model; the Markov chain runs in numpy, time-major, for speed."""
        tokens = np.empty((self.seq_len, batch_size), dtype=np.int64)
        tokens[0] = BOS
        tokens[1:3] = random_content((2, batch_size), self.vocab_size, generator).numpy()
        uniforms = torch.rand(self.seq_len, batch_size, generator=generator, dtype=torch.float64).numpy()
        # Inverse-CDF draw: the successor index is the number of cumulative thresholds below the uniform.
        thresholds = self.probs.cumsum(-1)[:, :-1].T.contiguous().numpy()  # [branching - 1, contexts]
        successors = self.successors.reshape(-1).numpy()
        for t in range(3, self.seq_len):
            context = tokens[t - 2] * self.vocab_size + tokens[t - 1]
            choice = np.zeros(batch_size, dtype=np.int64)
            for threshold in thresholds:
                choice += uniforms[t] >= threshold[context]
            tokens[t] = successors[context * self.branching + choice]
        return torch.from_numpy(tokens.T.copy())

    def deterministic_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: t >= 2 whose 3-gram context (tokens[t-1], tokens[t]) has a single successor."""
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        context = tokens[:, 1:-1] * self.vocab_size + tokens[:, 2:]
        mask[:, 2:] = self.deterministic[context]
        return mask

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        tokens = self._sample_tokens(batch_size, generator)
        return self._batch(tokens, self.deterministic_mask(tokens))


@dataclass(kw_only=True)
class MixedTask(NGram3Task):
    """Language-like text for depth studies: 3-gram sequences with `n_copies` earlier segments copied in.

    The background is the 3-gram model of `NGram3Task` (same parameters); each copy of min_len..max_len
    tokens overwrites a later stretch with an earlier one (placement: `copy_layout`). Answer positions are
    inside copies only (see `window_answer_mask`): the first copied token is never one, because a single
    matching token is too often a 3-gram coincidence; a copy may copy text that an earlier copy repeated.
    Layout: src_start, dst_start, seg_len, each [B, K].
    """

    name = "mixed"
    n_copies: int = 2
    min_len: int = 8
    max_len: int = 16

    def _validate(self) -> None:
        super()._validate()
        check_int(self.name, "n_copies", self.n_copies, 1)
        check_int(self.name, "min_len", self.min_len, 3)
        check_int(self.name, "max_len", self.max_len, self.min_len)
        chunk = (self.seq_len - 1) // self.n_copies
        if chunk < 2 * self.max_len:
            raise ValueError(
                f"mixed: seq_len={self.seq_len} is too short for n_copies={self.n_copies} copies of up to "
                f"max_len={self.max_len} tokens (each needs its own stretch of 2*max_len positions); use "
                f"seq_len >= {2 * self.max_len * self.n_copies + 1}, fewer copies or a smaller max_len"
            )

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        tokens = self._sample_tokens(batch_size, generator)
        layout = copy_layout(batch_size, self.seq_len, self.n_copies, self.min_len, self.max_len, generator)
        src, dst, length = layout
        tokens = insert_copies(tokens, src, dst, length)
        answer_mask = window_answer_mask(tokens, dst, length)
        return self._batch(tokens, answer_mask, src_start=src, dst_start=dst, seg_len=length)
