"""The depth-mixing model protocol: the few members every depth analysis needs from a model
(docs/architecture.md §7, "Depth-mixing model protocol").

A model whose sublayer inputs are depth mixes (AttnRes-style: a softmax over earlier sources per consumer and
route) implements `DepthMixingModel`, plus TransformerLens's `HookedRootModule` hook API (`run_with_hooks`,
`run_with_cache`, `hooks`, `hook_dict`). The toolkit's `HookedTransformer` is the first implementation; a model
built elsewhere (the transformers bridge) is another. Analyses that take a `DepthMixingModel` use only these
members and that hook API; where one has a faster path for the toolkit's own model it picks it by
`isinstance(model, HookedTransformer)`.

Indexing (docs/architecture.md §7): sublayers 0 … J−1 in forward order (J = `n_sublayers`), J standing for the
final readout; a consumer is a sublayer (or J) whose input is a depth mix; `sources(consumer)` lists per source
the sublayer indices summed into it, `[EMBEDDING]` (−1) for the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

# what `depth_hook(consumer, point)` names: the depth logits, the weights (softmax of the logits), and a logit bias
# that fires only when hooked, on zeros, its return added to the logits (−inf takes a source out)
DEPTH_POINTS = ("logits", "weights", "logit_bias")

SINGLE_ROUTE = "mix"  # the route name of a consumer that runs one softmax over its sources


@runtime_checkable
class DepthMixingModel(Protocol):
    """What an analysis may ask a depth-mixing model (docs/architecture.md §7 has the table with shapes)."""

    @property
    def n_sublayers(self) -> int:
        """J: the number of sublayers (a looped layer's visits each count); J itself is the final readout."""
        ...

    @property
    def d_vocab(self) -> int:
        """The vocabulary size of the logits."""
        ...

    @property
    def embedding_hooks(self) -> list[str]:
        """Hook names whose sum is e, the embedding source (`EMBEDDING` in `sources`): ['hook_embed'], or with
        learned positions ['hook_embed', 'hook_pos_embed']. An addition to docs/architecture.md §7's first table:
        analyses that rebuild sources from their members, or need a gradient root, read e here."""
        ...

    @property
    def readout_input_hook(self) -> str:
        """Hook name of the final readout's input (the final depth mix's output, before the final norm)."""
        ...

    def sublayer_name(self, sublayer: int) -> str:
        """'L{l}.attn', 'L{l}.mlp', 'final' for J (with a visit suffix '@{v}' where a layer runs several times)."""
        ...

    def sublayer_kind(self, sublayer: int) -> str:
        """'attn', 'mlp' or 'final'."""
        ...

    def sublayer_input_hook(self, sublayer: int) -> str:
        """Hook name of h_j, the sublayer's input before its own pre-norm."""
        ...

    def sublayer_output_hook(self, sublayer: int) -> str:
        """Hook name of f_j, what sublayer j adds to the sources."""
        ...

    def route_input_hook(self, consumer: int, route: str) -> str:
        """Hook name of what `consumer`'s depth mix hands its layer on `route` (one of `routes(consumer)`),
        `[batch, pos, d_model]`: `Σ_s α_s v_s` with `v_s` as `depth_values` gives them. For a one-route consumer
        without message gates it is `sublayer_input_hook(consumer)`."""
        ...

    def consumers(self) -> list[int]:
        """Every consumer (a sublayer index, or J) in forward order, J last."""
        ...

    def sources(self, consumer: int) -> list[list[int]]:
        """Per source of `consumer`, the sublayer indices summed into it ([EMBEDDING] for the embedding)."""
        ...

    def source_labels(self, consumer: int) -> list[str]:
        """A short label per source: 'emb', 'L3.attn', 'B2 (L2–L3)', 'partial'."""
        ...

    def routes(self, consumer: int) -> list[str]:
        """The softmaxes `consumer` runs over its one source set: ['mix'] for one query, ['q', 'k', 'v'], ['h0', …]."""
        ...

    def depth_hook(self, consumer: int, point: str) -> str:
        """Hook name of `point` (one of `DEPTH_POINTS`) of `consumer`'s depth mix: [batch, pos, n_src] for one
        route, [batch, pos, route, n_src] for several."""
        ...

    def to_tokens(self, tokens: Any) -> torch.Tensor:
        """Validated `[batch, pos]` int64 token ids on the model's device."""
        ...

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, the unembedding and anything after it, applied to `[..., d_model]`: logits."""
        ...

    def __call__(self, tokens: Any) -> torch.Tensor:
        """The forward pass: logits [batch, pos, d_vocab]."""
        ...


# ------------------------------------------------------------------------------------- optional members
# A model may add these (docs/architecture.md §7, "Optional members"); analyses read them through the functions
# below, which give the paper's defaults where a model has none.


def depth_values(model: DepthMixingModel, consumer: int | str, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """The value vectors `consumer`'s mix sums, from its sources (as `sources(consumer)` builds them, any dtype):
    the model's `depth_values(consumer, sources)` where it has one (Inkling: each source RMS-normalised, v_s = r_s
    b_s), else the sources themselves (the paper and FLA mix raw sources)."""
    own = getattr(model, "depth_values", None)
    return list(sources) if own is None else own(consumer, sources)


@dataclass
class FrozenReadout:
    """The final readout with the final norm's scale frozen at one pass, a linear map of its input x:
    `logits = (gain ⊙ x / scale) @ unembedding + bias` (docs/analysis.md §11). `logits` are the model's own
    logits of that pass before anything non-linear after the unembedding (Inkling's soft-cap), which the map
    reproduces to float rounding."""

    gain: torch.Tensor  # the final norm's gain g, [d_model]
    scale: torch.Tensor  # its per-token scale σ = sqrt(mean(x²) + ε) at the pass, [..., 1]
    unembedding: torch.Tensor  # W_U, [d_model, d_vocab]
    bias: torch.Tensor | None  # b_U, [d_vocab], or None
    logits: torch.Tensor  # the pre-cap logits of the pass, [..., d_vocab]


def check_frozen_readout(model: DepthMixingModel) -> None:
    """Refuse, naming the model, one without `frozen_readout`: its readout is not known to be a norm then an
    unembedding, so the direct logit attribution has no linear map to split."""
    if getattr(model, "frozen_readout", None) is None:
        raise ValueError(
            "depth_logit_attribution freezes the final norm's scale, which needs the model's final norm gain and "
            f"scale and its unembedding (the optional member frozen_readout); {type(model).__name__} does not "
            "expose them: use source_logit_lens"
        )


def frozen_readout(model: DepthMixingModel, readout_input: torch.Tensor) -> FrozenReadout:
    """The model's `frozen_readout(readout_input)`: its final readout as a linear map with the final norm's scale
    frozen at `readout_input` (what `readout_input_hook` shows); refused as `check_frozen_readout` says."""
    check_frozen_readout(model)
    return model.frozen_readout(readout_input)


def direct_inputs(model: DepthMixingModel) -> dict[int, list[int]]:
    """Sublayers that are no consumer because they read a plain sum of members (Inkling's layer 0 reads the
    embedding: `{0: [EMBEDDING]}`): the model's `direct_inputs()` where it has one, else none. Their row of M holds
    weight 1 on each member."""
    own = getattr(model, "direct_inputs", None)
    return {} if own is None else own()


def message_consumers(model: DepthMixingModel) -> list[str]:
    """Depth consumers that feed gates rather than a sublayer input (Inkling-2-Mini's 'L{l}.msg@{v}'), named by
    strings that `sources`, `source_labels`, `routes` and `depth_hook` accept: the model's `message_consumers()`
    where it has one, else none."""
    own = getattr(model, "message_consumers", None)
    return [] if own is None else own()


def depth_consumers(model: DepthMixingModel) -> list[int | str]:
    """Every consumer whose depth weights an analysis can read and knock out: `consumers()`, then the messages."""
    return [*model.consumers(), *message_consumers(model)]


def consumer_index(model: DepthMixingModel, consumer: int | str) -> int:
    """The integer a table's `consumer` column holds: the sublayer index (J for the readout), or J + 1 + k for the
    k-th message consumer, so the column stays one integer type (parquet) and its keys unique."""
    if isinstance(consumer, str):
        return model.n_sublayers + 1 + message_consumers(model).index(consumer)
    return consumer


def consumer_label(model: DepthMixingModel, consumer: int | str) -> str:
    """'L3.attn', 'final', or a message consumer's own name."""
    return consumer if isinstance(consumer, str) else model.sublayer_name(consumer)


def consumer_kind(model: DepthMixingModel, consumer: int | str) -> str:
    """'attn', 'mlp', 'final', or 'msg' for a message consumer."""
    return "msg" if isinstance(consumer, str) else model.sublayer_kind(consumer)


def check_depth_point(point: str) -> None:
    """Refuse a depth hook point not in `DEPTH_POINTS`, naming it and the choices."""
    if point not in DEPTH_POINTS:
        raise ValueError(f"depth hook point must be one of {list(DEPTH_POINTS)}, got {point!r}")


def token_id_batch(tokens: Any, string_hint: str = "") -> torch.Tensor:
    """`[batch, pos]` integer ids, not yet range-checked, from a tensor, a (nested) list of ids or a string of
    space-separated ids: the parsing and shape checks every protocol model's `to_tokens` shares (`string_hint` ends
    the error for a string that is not ids)."""
    if isinstance(tokens, str):
        try:
            tokens = [int(piece) for piece in tokens.split()]
        except ValueError as err:
            raise ValueError(
                f"a string of tokens must hold space-separated integer ids, got {tokens[:60]!r}{string_hint}"
            ) from err
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.tensor(tokens)
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise ValueError(f"tokens must be integer ids, got a tensor of dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise ValueError(f"tokens must have shape [batch, pos] with batch >= 1 and pos >= 1, got {tuple(tokens.shape)}")
    return tokens


def model_device(model: DepthMixingModel) -> torch.device:
    """The device the model computes on: where `to_tokens` puts tokens (the protocol names no other member)."""
    return model.to_tokens(torch.zeros(1, 1, dtype=torch.long)).device
