"""The evaluation metric, defined once (docs/analysis.md §1): the trainer's held-out evaluation and every analysis
that measures damage (ablations, pruning, routing) score logits with `score_logits`.

* `loss`: mean next-token cross-entropy over every position that has a target (the training loss);
* `answer_loss`: the same over the task's answer positions (those whose target the context determines);
* `accuracy`: argmax accuracy over the answer positions (NaN when a batch has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnres_lens.tasks.base import IGNORE_INDEX, Batch


@dataclass
class Evaluation:
    """One scored batch (the fields as defined above): one type for the trainer's log and every analysis."""

    loss: float
    answer_loss: float
    accuracy: float


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[batch, pos] next-token cross-entropy, 0 where the target is IGNORE_INDEX; in fp32, or fp64 for fp64 logits
    (a float64 model's loss differences keep their bits)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view(
        targets.shape
    )


def per_sequence_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[batch] float64 on the CPU: each sequence's summed `token_losses`. Summed over sequences and divided by the
    target count, it is the evaluation `loss`; per sequence, it is what a bootstrap over sequences resamples."""
    return token_losses(logits, targets).double().sum(-1).cpu()


@dataclass
class _Totals:
    """Sums that combine across chunks of a batch: float64, so a chunked evaluation equals one pass to float64
    rounding (float32 sums per chunk differed by ~1e-7)."""

    loss: float = 0.0
    targets: int = 0
    answer_loss: float = 0.0
    answers: int = 0
    correct: int = 0

    def add(self, logits: torch.Tensor, batch: Batch) -> None:
        per_token = token_losses(logits, batch.targets)
        has_target = batch.targets != IGNORE_INDEX
        answers = batch.answer_mask & has_target
        self.loss += per_token[has_target].double().sum().item()
        self.targets += int(has_target.sum())
        self.answer_loss += per_token[answers].double().sum().item()
        self.answers += int(answers.sum())
        self.correct += int((logits.argmax(-1) == batch.targets)[answers].sum())

    def result(self) -> Evaluation:
        nan = float("nan")
        return Evaluation(
            loss=self.loss / self.targets if self.targets else nan,
            answer_loss=self.answer_loss / self.answers if self.answers else nan,
            accuracy=self.correct / self.answers if self.answers else nan,
        )


def score_logits(logits: torch.Tensor, batch: Batch) -> Evaluation:
    """The metric of `logits` [batch, pos, vocab] against `batch`'s targets and answer positions."""
    totals = _Totals()
    totals.add(logits, batch)
    return totals.result()


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, batch: Batch, chunk: int = 64) -> Evaluation:
    """The metric of `model` on `batch`, run `chunk` sequences at a time (the same as one pass, to float64
    rounding)."""
    totals = _Totals()
    for start in range(0, batch.tokens.shape[0], chunk):
        rows = slice(start, start + chunk)
        part = Batch(batch.tokens[rows], batch.targets[rows], batch.answer_mask[rows])
        totals.add(model(part.tokens), part)
    return totals.result()
