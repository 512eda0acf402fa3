"""Typed prompts and token labels of a run (docs/analysis.md §11): text through the run's own encoding where the
run reads text (a task over real text, or an `import-hf` folder's tokenizer), else space-separated token ids. The
attribution command, the Attribution page and the Depth attention page's per-token input all read prompts here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from attnres_lens.hf_runs import TransformersModel, open_tokenizer, tokenize
from attnres_lens.tasks import TASKS

if TYPE_CHECKING:
    from attnres_lens.config import RunConfig
    from attnres_lens.model import HookedTransformer
    from attnres_lens.protocol import DepthMixingModel
    from attnres_lens.rundir import PathLike
    from attnres_lens.tasks.base import Batch


def prompt_reads_text(config: RunConfig) -> bool:
    """Whether a typed prompt is text for this run (see `prompt_encoder`), decided without loading anything."""
    if isinstance(config.model, TransformersModel):
        return config.model.has_tokenizer
    return TASKS[config.task.name].reads_text


def prompt_encoder(config: RunConfig, run_path: PathLike) -> Callable[[str], list[int]] | None:
    """How a typed prompt becomes the run's ids: the transformers folder's own tokenizer (a run made by import-hf
    from a folder that has one), the task's encoding for a task over real text (Shakespeare's bytes), else None: the
    prompt is space-separated token ids."""
    if not prompt_reads_text(config):
        return None
    model = config.model
    if isinstance(model, TransformersModel):
        tokenizer = open_tokenizer(model, run_path)
        return lambda text: tokenize(tokenizer, text, model.d_vocab, "the prompt")
    return config.build_task().encode_text


def encode_prompt(
    model: HookedTransformer | DepthMixingModel,
    prompt: str | torch.Tensor,
    encode: Callable[[str], list[int]] | None = None,
    what: str = "--prompt",
) -> torch.Tensor:
    """[1, pos] tokens of a typed prompt: text through `encode` (`prompt_encoder`) when given, else space-separated
    ids; validated by the model. `what` names the input in errors."""
    if isinstance(prompt, str) and not prompt.strip():
        example = '"Good morrow, cousin."' if encode is not None else '"3 17 5 3 17" (space-separated token ids)'
        raise ValueError(f"{what} is empty; give one, e.g. {example}")
    try:
        tokens = model.to_tokens(encode(prompt) if encode is not None and isinstance(prompt, str) else prompt)
    except ValueError as err:  # the model or the tokenizer names the problem; this names the input
        raise ValueError(f"{what}: {err}") from None
    if tokens.shape[0] != 1:
        raise ValueError(f"{what} must be one sequence of token ids, got {tokens.shape[0]}")
    return tokens


def token_labeller(config: RunConfig, run_path: PathLike) -> Callable[[int], str] | None:
    """How a token id reads in the figures' labels where the run reads text: the tokenizer's token, or the task's
    `token_text` (Shakespeare: the byte as a character); None elsewhere (labels are ids). An id the tokenizer has no
    token for reads '#id'."""
    if not prompt_reads_text(config):
        return None
    if isinstance(config.model, TransformersModel):
        tokenizer = open_tokenizer(config.model, run_path)

        def tokenizer_token(token: int) -> str:  # a model may have more ids than its tokenizer has tokens
            text = tokenizer.convert_ids_to_tokens(token)
            return f"#{token}" if text is None else text

        return tokenizer_token
    return config.build_task().token_text


def token_name(token: int, token_label: Callable[[int], str] | None = None) -> str:
    """A token as the figures label it: its text through `token_label` (`token_labeller`), else its id."""
    return str(int(token)) if token_label is None else token_label(int(token))


def parse_prompt(
    model: HookedTransformer | DepthMixingModel,
    prompt: str | torch.Tensor | None,
    batch: Batch,
    encode: Callable[[str], list[int]] | None = None,
    what: str = "--prompt",
) -> torch.Tensor:
    """The per-position views' [1, pos] prompt: the first held-out sequence by default, else `encode_prompt` of
    `prompt` with at least 2 tokens (each position is attributed against the next token)."""
    if prompt is None:
        return batch.tokens[:1]
    tokens = encode_prompt(model, prompt, encode, what)
    if tokens.shape[1] < 2:
        raise ValueError(f"{what} needs at least 2 tokens (each position is attributed against the next token)")
    return tokens
