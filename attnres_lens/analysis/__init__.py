"""Analyses over a model and data, or over a run directory (docs/analysis.md). Every function returns pandas DataFrames.

The depth analyses take any depth-mixing model (`attnres_lens.protocol.DepthMixingModel`, docs/architecture.md §7):
the toolkit's `HookedTransformer` (with the staged engine's faster paths) or another implementation.

* `induction`: induction-head scores per layer × head and the in-context-learning score;
* `depth`: depth-attention maps, entropy and sink scores, the depth-mixing matrix M;
* `pruning`: layer-pruning sensitivity, Block Influence, angular distances, cumulative removal curves;
* `routing`: causal depth routing (α mass vs the effect of masking a source);
* `attribution`: attribution through depth (direct logit attribution per source, the logit lens over depth,
  first-order edge attribution with value and routing paths, the routing audit);
* `kv_shift`: KV-shift-aware induction analysis (current- vs shifted-key scores and values);
* `timeline`: routing statistics over training next to the induction-score jump and the loss curve;
* `interventions`: what an intervention is: the hooks that remove sublayers, replace activations or mask sources;
* `engine`: running a model under interventions (`capture`, `evaluate`, and `evaluate_many`, which shares the
  computation interventions have in common); `workers` its worker threads and forked jobs; `session` the work
  analyses of one unchanged model share;
* `run`: `analyze_run`, `prune_run` and `attribute_run`, behind `attnres-lens analyze`, `prune` and `attribute`.
"""

from attnres_lens.analysis.attribution import (
    audit_summary,
    depth_input_decomposition,
    depth_logit_attribution,
    edge_agreement,
    edge_attribution,
    logit_attribution_summary,
    logit_lens_summary,
    routing_audit,
    source_logit_lens,
)
from attnres_lens.analysis.depth import depth_mixing_matrix, depth_summary, depth_weights, depth_weights_per_token
from attnres_lens.analysis.engine import StateCache, evaluate, evaluate_many
from attnres_lens.analysis.induction import (
    in_context_learning_score,
    induction_head_scores,
    per_position_loss,
    repeated_batch,
)
from attnres_lens.analysis.interventions import removal_hooks, source_mask_hooks
from attnres_lens.analysis.kv_shift import kv_shift_decomposition, kv_shift_parts
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
from attnres_lens.analysis.run import analyze_run, attribute_run, prune_run, prune_tables
from attnres_lens.analysis.timeline import fastest_changes, training_timeline

__all__ = [
    "StateCache",
    "analyze_run",
    "angular_distance_matrix",
    "attribute_run",
    "audit_summary",
    "causal_routing",
    "cheap_metrics",
    "cumulative_pruning",
    "depth_input_decomposition",
    "depth_logit_attribution",
    "depth_mixing_matrix",
    "depth_summary",
    "depth_weights",
    "depth_weights_per_token",
    "edge_agreement",
    "edge_attribution",
    "evaluate",
    "evaluate_many",
    "fastest_changes",
    "in_context_learning_score",
    "induction_head_scores",
    "kv_shift_decomposition",
    "kv_shift_parts",
    "logit_attribution_summary",
    "logit_lens_summary",
    "metric_correlations",
    "per_position_loss",
    "prune_run",
    "prune_tables",
    "pruning_sensitivity",
    "removable_within",
    "removal_hooks",
    "repeated_batch",
    "routing_audit",
    "routing_correlations",
    "routing_disagreements",
    "source_logit_lens",
    "source_mask_hooks",
    "spearman",
    "training_timeline",
]
