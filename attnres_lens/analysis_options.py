"""The run-level analyses' options that the command line checks before it imports torch (docs/analysis.md §10).

One default per analysis, shared by `attnres-lens analyze|prune|attribute`, their `*_run` functions and the
dashboard's pages, so the same run gives the same numbers everywhere. This module imports nothing heavy:
`attnres_lens.analysis.run` re-exports these names.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# Held-out sequences each analysis evaluates by default.
ANALYZE_SAMPLES = 16
PRUNE_SAMPLES = 16
ATTRIBUTE_SAMPLES = 16

# The fewest each accepts: resample ablation (prune) swaps activations between sequences; attribution's bootstrap
# and corrupted patch need two sequences.
MIN_SAMPLES = {"analyze": 1, "prune": 2, "attribute": 2}

PRUNE_METRICS = ("loss", "accuracy")  # what the pruning curves order and plot by


def check_samples(samples: int, minimum: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < minimum:
        raise ValueError(f"samples must be an integer >= {minimum}, got {samples!r}")


def check_metric(metric: str) -> None:
    if metric not in PRUNE_METRICS:
        raise ValueError(f"metric must be one of {list(PRUNE_METRICS)}, got {metric!r}")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """ " (did you mean 'n_layers'?)" for the choices closest to a mistyped `name`, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=2, cutoff=0.75)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def plural(count: int, noun: str, plural_form: str = "") -> str:
    """`1 sublayer`, `2 sublayers`: the count with its noun in the number it needs."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"
