"""Analyses over a model and data, or over a run directory (docs/analysis.md). Every function returns pandas DataFrames.

* `induction`: induction-head scores per layer × head and the in-context-learning score;
* `depth`: depth-attention maps, entropy and sink scores, the depth-mixing matrix M;
* `pruning`: layer-pruning sensitivity, Block Influence, angular distances, cumulative removal curves;
* `routing`: causal depth routing (α mass vs the effect of masking a source);
* `interventions`: the hook-based removal / ablation / masking machinery they share;
* `run`: `analyze_run` and `prune_run`, behind `attnres-lens analyze` and `attnres-lens prune`.
"""

from attnres_lens.analysis.depth import depth_mixing_matrix, depth_summary, depth_weights, depth_weights_per_token
from attnres_lens.analysis.induction import (
    in_context_learning_score,
    induction_head_scores,
    per_position_loss,
    repeated_batch,
)
from attnres_lens.analysis.interventions import evaluate, evaluate_many, removal_hooks, source_mask_hooks
from attnres_lens.analysis.pruning import (
    angular_distance_matrix,
    cheap_metrics,
    cumulative_pruning,
    metric_correlations,
    pruning_sensitivity,
    removable_within,
    spearman,
)
from attnres_lens.analysis.routing import causal_routing, routing_correlations, routing_disagreements
from attnres_lens.analysis.run import analyze_run, prune_run, prune_tables

__all__ = [
    "analyze_run",
    "angular_distance_matrix",
    "causal_routing",
    "cheap_metrics",
    "cumulative_pruning",
    "depth_mixing_matrix",
    "depth_summary",
    "depth_weights",
    "depth_weights_per_token",
    "evaluate",
    "evaluate_many",
    "in_context_learning_score",
    "induction_head_scores",
    "metric_correlations",
    "per_position_loss",
    "prune_run",
    "prune_tables",
    "pruning_sensitivity",
    "removable_within",
    "removal_hooks",
    "repeated_batch",
    "routing_correlations",
    "routing_disagreements",
    "source_mask_hooks",
    "spearman",
]
