"""Typed prompts and token names of a run (docs/analysis.md §11): text through the run's own encoding where the run
encodes text (a task that does, such as Shakespeare's bytes, or an `import-hf` folder's tokenizer), else
space-separated token ids. The attribution command, the Attribution page and the Depth attention page's per-token
input all read prompts here, and the per-position figures name tokens here.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TextCodec:
    """How a run that encodes text turns typed text into its ids and names its ids."""

    encode: Callable[[str, str], list[int]]  # (text, what names it in errors) -> ids
    name: Callable[[int], str]  # id -> its text, as the figures show it


def encodes_text(config: RunConfig) -> bool:
    """Whether a typed prompt is text for this run (see `text_codec`), decided without loading anything."""
    if isinstance(config.model, TransformersModel):
        return config.model.has_tokenizer
    return TASKS[config.task.name].encodes_text


def text_codec(config: RunConfig, run_path: PathLike) -> TextCodec | None:
    """The run's text encoding: an `import-hf` folder's own tokenizer (an id it has no token for reads '#id'), the
    task's for a task that encodes text (`Task.encode_text` / `token_text`), else None: prompts are token ids."""
    if not encodes_text(config):
        return None
    model = config.model
    if isinstance(model, TransformersModel):
        tokenizer = open_tokenizer(model, run_path)

        def tokenizer_token(token: int) -> str:  # a model may have more ids than its tokenizer has tokens
            text = tokenizer.convert_ids_to_tokens(token)
            return f"#{token}" if text is None else text

        return TextCodec(lambda text, what: tokenize(tokenizer, text, model.d_vocab, what), tokenizer_token)
    task = config.build_task()
    return TextCodec(lambda text, what: task.encode_text(text), task.token_text)


def token_name(token: int, codec: TextCodec | None = None) -> str:
    """A token as the figures label it: its text where the run encodes text, else its id. Escaped, as plotly reads
    its labels as HTML (a tokenizer's '<s>' would strike the label through)."""
    return str(int(token)) if codec is None else html.escape(codec.name(int(token)))


def position_label(position: int, token: int, next_token: int | None = None, codec: TextCodec | None = None) -> str:
    """A position as the per-position figures label it: 'p: token', or 'p: token→next token'."""
    label = f"{int(position)}: {token_name(token, codec)}"
    return label if next_token is None else f"{label}→{token_name(next_token, codec)}"


def encode_prompt(
    model: HookedTransformer | DepthMixingModel,
    prompt: str | torch.Tensor,
    codec: TextCodec | None = None,
    what: str = "--prompt",
    n_ctx: int | None = None,
) -> torch.Tensor:
    """[1, pos] tokens of a typed prompt: text through `codec` (`text_codec`) when given, else space-separated ids;
    at most `n_ctx` of them when given; validated by the model. `what` names the input in errors."""
    text = codec is not None and isinstance(prompt, str)
    if isinstance(prompt, str) and not (prompt if text else prompt.strip()):
        example = '"Good morrow, cousin."' if text else '"3 17 5 3 17" (space-separated token ids)'
        raise ValueError(f"{what} is empty; give one, e.g. {example}")
    ids = codec.encode(prompt, what) if text else prompt
    if text and n_ctx is not None and len(ids) > n_ctx:
        raise ValueError(
            f"{what} is {len(ids)} tokens (through the run's text encoding), the model takes at most {n_ctx}: "
            f"shorten it by {len(ids) - n_ctx} tokens"
        )
    try:
        tokens = model.to_tokens(ids)
    except ValueError as err:  # the model names the problem; this names the input
        raise ValueError(f"{what}: {err}") from None
    if tokens.shape[0] != 1:
        raise ValueError(f"{what} must be one sequence of token ids, got {tokens.shape[0]}")
    return tokens


def check_attributable(tokens: torch.Tensor, what: str = "--prompt") -> None:
    """The per-position attribution views need 2 tokens or more: each position is attributed against the next."""
    if tokens.shape[1] < 2:
        raise ValueError(f"{what} needs at least 2 tokens (each position is attributed against the next token)")


def parse_prompt(
    model: HookedTransformer | DepthMixingModel,
    prompt: str | torch.Tensor | None,
    batch: Batch,
    codec: TextCodec | None = None,
    what: str = "--prompt",
    n_ctx: int | None = None,
) -> torch.Tensor:
    """The per-position views' [1, pos] prompt: the first held-out sequence by default, else `encode_prompt` of
    `prompt`, checked by `check_attributable`."""
    if prompt is None:
        return batch.tokens[:1]
    tokens = encode_prompt(model, prompt, codec, what, n_ctx)
    check_attributable(tokens, what)
    return tokens
