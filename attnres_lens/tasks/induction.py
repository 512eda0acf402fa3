"""The KV-shift paper's induction task and the repeated-random-tokens probe."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BOS, Batch, Task, check_int, earlier_occurrences, random_content, uniform_int


def induction_answer_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Answer positions of the induction task, [B, T] bool: the current token occurred earlier.

    Under the task's rule every re-occurrence is followed by what followed the earlier occurrence, so
    those are exactly the positions whose next token the context determines.
    """
    return earlier_occurrences(tokens) > 0


@dataclass(kw_only=True)
class InductionTask(Task):
    """Random sequences where every re-occurrence of a token is followed by its earlier successor.

    Under that rule (Xu et al., arXiv 2411.19574) a sequence is a run of distinct tokens until the first
    re-occurrence, after which it repeats a cycle forever. The paper draws tokens uniformly until one
    collides, so with a vocab small next to the length it collapses into short cycles (period 2 seen),
    which a local head solves. Here the collision is placed explicitly: after `prefix_len` distinct tokens
    (uniform in [min_period, min(vocab_size - 1, seq_len - 3)]) the sequence re-enters its prefix at a
    uniform earlier token, closing a cycle of period uniform in [min_period, prefix_len]. That is the
    paper's process conditioned on the cycle being at least `min_period` long.

    Answer positions: see `induction_answer_mask` (here: from position prefix_len + 1 on).
    Layout: prefix_len, period, each [B].
    """

    name = "induction"
    min_period: int = 8

    def _validate(self) -> None:
        check_int(self.name, "min_period", self.min_period, 2)
        if self.vocab_size - 1 < self.min_period:
            raise ValueError(
                f"induction: vocab_size={self.vocab_size} has fewer content tokens than "
                f"min_period={self.min_period} (a cycle needs that many distinct tokens); "
                f"use vocab_size >= {self.min_period + 1} or a smaller min_period"
            )
        if self.seq_len < self.min_period + 3:
            raise ValueError(
                f"induction: seq_len={self.seq_len} leaves no answer position after a prefix of min_period="
                f"{self.min_period} tokens; use seq_len >= {self.min_period + 3} or a smaller min_period"
            )

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        distinct = torch.rand(batch_size, self.vocab_size - 1, generator=generator).argsort(-1) + 1
        shortest = torch.full((batch_size,), self.min_period)
        longest = torch.full((batch_size,), min(self.vocab_size - 1, self.seq_len - 3))
        prefix_len = uniform_int(shortest, longest, generator)
        period = uniform_int(shortest, prefix_len, generator)
        # Content position q (1-based) takes distinct[q - 1] in the prefix, then cycles through its last
        # `period` entries: beyond the prefix, position q repeats position q - period.
        q = torch.arange(1, self.seq_len)[None, :]
        cycle_start = (prefix_len - period)[:, None]
        index = torch.where(q <= prefix_len[:, None], q - 1, cycle_start + (q - 1 - cycle_start) % period[:, None])
        tokens = torch.cat([torch.full((batch_size, 1), BOS), distinct.gather(1, index)], dim=1)
        return self._batch(tokens, induction_answer_mask(tokens), prefix_len=prefix_len, period=period)


def repeated_tokens(
    batch_size: int, half_len: int, vocab_size: int, generator: torch.Generator, bos: int = BOS
) -> torch.Tensor:
    """[B, 2 * half_len + 1] int64: [bos, r_1..r_L, r_1..r_L] with r uniform over the non-BOS tokens."""
    random_half = random_content((batch_size, half_len), vocab_size, generator)
    return torch.cat([torch.full((batch_size, 1), bos), random_half, random_half], dim=1)


@dataclass(kw_only=True)
class RepeatedTask(Task):
    """Repeated random tokens [BOS, r, r] (half length L = (seq_len - 1) / 2): the standard induction probe.

    A scoring probe, not a training task: its fixed period lets a 1-layer positional head solve it.
    Answer positions: the second half except its last token (t = L+1 .. 2L-1), where the fixed period
    determines the next token (r_{i+1} follows r_i) even when r repeats a token.
    """

    name = "repeated"
    for_training = False

    def _validate(self) -> None:
        check_int(self.name, "seq_len", self.seq_len, 5)  # half length >= 2 leaves an answer position
        if self.seq_len % 2 == 0:
            raise ValueError(
                f"repeated: seq_len={self.seq_len} must be odd (BOS plus two equal halves); "
                f"use {self.seq_len + 1} or {self.seq_len - 1}"
            )

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        half_len = (self.seq_len - 1) // 2
        tokens = repeated_tokens(batch_size, half_len, self.vocab_size, generator)
        answer_mask = torch.zeros_like(tokens, dtype=torch.bool)
        answer_mask[:, half_len + 1 :] = True
        return self._batch(tokens, answer_mask)
