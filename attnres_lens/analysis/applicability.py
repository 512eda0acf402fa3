"""Which run-level tables apply to a model that is not the toolkit's own (docs/interop.md §7, "What runs").

`analyze`, `prune` and `attribute` compute every table on the toolkit's `HookedTransformer`. On another
depth-mixing model (the transformers bridge) a table the model cannot support is left out and listed in the
summary's `skipped` with the reason, never a traceback: the toolkit-only analyses by a fixed reason, the others by
their own refusal. The induction-head scores and the K/V (shift or convolution) tap table run on the toolkit's
model and on a bridged Inkling-2 / Inkling-2-Mini (`bridged_inkling`), and are skipped on any other. The direct
logit attribution runs on any model with the protocol's optional `frozen_readout` (the toolkit's, the Inkling and
DeepSeek V4 bridges) and is skipped with its own refusal on others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import DepthMixingModel

# Reasons for the analyses written for the toolkit's own model (and, where said, a bridged Inkling model) only.
INDUCTION_TOOLKIT_ONLY = (
    "the induction-head probe runs on the toolkit's own model and on a bridged Inkling-2 / Inkling-2-Mini (it "
    "reads per-head attention patterns); this model is neither"
)
KV_SHIFT_TOOLKIT_ONLY = (
    "the KV-shift decomposition reads the toolkit's KV-shift attention or the short K/V convolutions of a bridged "
    "Inkling-2 / Inkling-2-Mini (analysis/inkling_taps.py); this model has neither"
)
CORRUPTED_TOOLKIT_ONLY = (
    "patching from a corrupted input is derived for the paper's default depth attention of the toolkit's own model"
)


EDGE_TABLES = ("edge_knockouts", "edge_sensitivity", "routing_audit")  # what depth attention's softmax allows
NO_KV_SHIFT = (
    "the model uses standard attention: it has no KV shift to decompose (the table would only say α1 = β1 = 1, "
    "α2 = β2 = 0 for every head)"
)


def no_depth_attention(model: Any) -> str:
    """Why the edge tables (`EDGE_TABLES`) are not computed on a model without a depth softmax."""
    which = f"this model's residual ({model.cfg.residual!r})" if is_toolkit_model(model) else type(model).__name__
    return (
        f"edges are sources taken out of a depth softmax, and {which} has none (its depth mixing is M: analyze's "
        "depth_mixing table; the depth DLA splits the readout by source)"
    )


def is_toolkit_model(model: Any) -> bool:
    return isinstance(model, HookedTransformer)


def bridged_inkling(model: Any) -> Any | None:
    """The transformers Inkling-2 / Inkling-2-Mini that a bridge (`attnres_lens.from_transformers`) wraps, or None
    for any other model: the induction-head scores and the K/V tap decomposition run on these (docs/interop.md
    §7)."""
    from attnres_lens.analysis.inkling_taps import SUPPORTED_MODELS

    wrapped = getattr(model, "hf_model", None)
    return wrapped if type(wrapped).__name__ in SUPPORTED_MODELS else None


def where_applicable(
    model: DepthMixingModel, skipped: dict[str, str], name: str, compute: Callable[[], Any]
) -> Any | None:
    """`compute()`; for a model other than the toolkit's own, an analysis that refuses it (a ValueError naming what
    the model lacks, e.g. M on a model whose first sublayer reads the embedding directly) returns None and records
    its message under `skipped[name]`. The toolkit's own model is never refused this way: its errors propagate."""
    if is_toolkit_model(model):
        return compute()
    try:
        return compute()
    except ValueError as err:
        skipped[name] = str(err)
        return None
