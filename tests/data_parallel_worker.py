"""`attnres-lens ARGS` on one torchrun rank, for tests/test_run_guarantees.py, with a failure on one rank alone:
$INF_ON_RANK1_AT_STEP = k makes rank 1's training loss infinite at its k-th step (a batch that diverges on one
rank); $NAN_EVAL_ON_RANK0_AT_STEP = k makes rank 0's held-out loss NaN when evaluated at step k (a checkpoint only
rank 0 checks)."""

import os
import sys

import attnres_lens.training as training
from attnres_lens.cli import main

if os.environ.get("INF_ON_RANK1_AT_STEP") and os.environ.get("RANK") == "1":
    at_step, original_loss, calls = int(os.environ["INF_ON_RANK1_AT_STEP"]), training.next_token_loss, []

    def diverging_loss(logits, tokens):
        calls.append(None)
        loss = original_loss(logits, tokens)
        return loss * float("inf") if len(calls) == at_step else loss

    training.next_token_loss = diverging_loss

if os.environ.get("NAN_EVAL_ON_RANK0_AT_STEP") and os.environ.get("RANK") == "0":
    eval_step, original_evaluate = int(os.environ["NAN_EVAL_ON_RANK0_AT_STEP"]), training.Trainer.evaluate

    def diverging_evaluate(self):
        metrics = original_evaluate(self)
        return {**metrics, "eval_loss": float("nan")} if self.step == eval_step else metrics

    training.Trainer.evaluate = diverging_evaluate

sys.exit(main(sys.argv[1:]))
