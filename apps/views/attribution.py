"""Attribution: which earlier sublayers a prediction uses, and through which path (docs/analysis.md §11).

The training timeline comes from the run's records; the rest is computed on demand from a checkpoint (the same
tables as `attnres-lens attribute`, cached per checkpoint, samples and prompt): direct logit attribution per
source and position, the logit lens over depth, the depth edges ranked by exact knockouts (with the first-order
sensitivity's value / routing split beside them), the routing audit with bootstrap intervals, and the KV-shift
decomposition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import streamlit as st
import torch
from lens_ui.data import ModelHandle, RunTables, no_records_message, task_batch
from lens_ui.text import plain
from lens_ui.widgets import (
    COMPUTED_KEEP,
    computed_on_demand,
    loadable_runs,
    pick_model,
    pick_run,
    show_figure,
    token_input,
)

from attnres_lens.analysis.applicability import bridged_inkling, is_toolkit_model
from attnres_lens.analysis.attribution_report import (
    EDGE_COLUMNS,
    agreement_scatter,
    attribution_tables,
    audit_figure,
    dla_heatmap,
    dla_summary_bars,
    edge_heatmap,
    kv_shift_bars,
    lens_heatmap,
    lens_summary_figure,
    timeline_figure,
)
from attnres_lens.analysis.induction import task_probe
from attnres_lens.analysis.prompts import check_attributable, text_codec
from attnres_lens.analysis.run import ATTRIBUTE_SAMPLES
from attnres_lens.analysis.timeline import fastest_changes, training_timeline

st.title("Attribution")
st.caption(
    "Which sources a prediction reads, and whether through the value a source carries or the routing "
    "weight it gets. Direct logit attribution is exact (final norm's scale frozen); depth edges are ranked by exact "
    "knockouts, with the first-order sensitivity (one backward pass, a small-perturbation slope) beside them."
)

runs = loadable_runs()
run = pick_run(runs, key="attribution-run", prefer=lambda r: r.model_config.residual == "attnres")
st.caption(plain(run.variant))


def compute(
    run: RunTables, handle: ModelHandle, samples: int, prompt: torch.Tensor, progress: Callable[[float, str], Any]
) -> tuple[dict[str, pd.DataFrame], dict[str, str]]:
    """The tables `attnres-lens attribute` computes, and those the model does not support with the reason."""
    # the probe `attnres-lens attribute` scores (the KV-shift decomposition's, or a bridged Inkling model's K/V taps)
    scored = is_toolkit_model(handle.model) or bridged_inkling(handle.model) is not None
    probe = task_probe(handle.model, run.build_task(), samples) if scored else None
    skipped: dict[str, str] = {}
    with handle.lock:
        tables = attribution_tables(
            handle.model, task_batch(run, samples), prompt, probe=probe, on_stage=progress, skipped=skipped
        )
    return tables, skipped


def not_computed(name: str) -> None:
    """The page message for a table the model does not support (analysis/applicability.py), with the reason."""
    st.info(f"Not computed for run {plain(run.name)} ({name}): {plain(skipped[name])}")


def prompt_input(run: RunTables, handle: ModelHandle, samples: int) -> torch.Tensor | None:
    """[1, pos] tokens for the per-position views: a held-out sequence, or text or ids the user types."""

    def held_out_sequence() -> torch.Tensor:
        index = int(st.number_input("Held-out sequence", 0, samples - 1, 0, key="attribution-sequence"))
        return task_batch(run, samples).tokens[index : index + 1]

    label = "Prompt for the per-position views"
    tokens = token_input(run, handle, "attribution-prompt", label, "a held-out sequence", held_out_sequence)
    try:
        if tokens is not None:
            check_attributable(tokens, "the prompt")
    except ValueError as err:
        st.error(plain(err))
        return None
    return tokens


# ---------------------------------------------------------------------------- from the records
st.header("Training timeline")
timeline = training_timeline(run.records, run.metrics)
if timeline.empty:
    st.info(no_records_message(run, "training records", "records/ and metrics.jsonl"))
else:
    changes = fastest_changes(timeline)
    show_figure(timeline_figure(timeline, changes), key="attribution-timeline")
    with st.expander("Step of the fastest change, per series and consumer"):
        # the label names the consumer (a sublayer, the final readout, or the whole model for loss and induction);
        # the model-wide rows, the ones the dotted lines mark, come first
        rows = changes.sort_values("consumer", key=lambda consumer: consumer >= 0, kind="stable")
        st.dataframe(rows.drop(columns="consumer").rename(columns={"consumer_label": "consumer"}), hide_index=True)

# ---------------------------------------------------------------------------- from a checkpoint
st.header("At a checkpoint")
handle = pick_model(run, key="attribution-checkpoint")
if handle is None:
    st.stop()
samples = int(
    st.number_input(
        "Held-out sequences",
        2,
        128,
        ATTRIBUTE_SAMPLES,
        key="attribution-samples",
        help="the routing audit's bootstrap and the corrupted patch need at least 2",
    )
)
prompt = prompt_input(run, handle, samples)
if prompt is None:
    st.stop()
tables, skipped = computed_on_demand(
    "attribution",
    (handle.key, samples, tuple(prompt[0].tolist())),
    "Compute attribution",
    lambda progress: compute(run, handle, samples, prompt, progress),
    failure=f"Attribution of {plain(run.name)} failed",
    waiting="A few seconds for a small model (the exact knockouts and the audit take longest); kept for this "
    f"checkpoint, sample count and prompt while it is among the {COMPUTED_KEEP} results shown last.",
)

codec = text_codec(run.config, run.path)  # tokens by their text where the run encodes text
dla_tab, lens_tab, edge_tab, audit_tab, kv_tab = st.tabs(
    ["Depth DLA", "Logit lens", "Depth edges", "Routing audit", "KV shift"]
)
with dla_tab:
    if "depth_dla" not in tables:
        not_computed("depth_dla")
    else:
        show_figure(dla_heatmap(tables["depth_dla"], codec=codec), key="attribution-dla")
        show_figure(dla_summary_bars(tables["depth_dla_summary"]), key="attribution-dla-summary")
        st.dataframe(tables["depth_dla_summary"], hide_index=True)
    if "depth_inputs" in skipped:
        not_computed("depth_inputs")
with lens_tab:
    show_figure(lens_heatmap(tables["logit_lens"], codec=codec), key="attribution-lens")
    show_figure(lens_summary_figure(tables["logit_lens_summary"]), key="attribution-lens-summary")
with edge_tab:
    if "edge_sensitivity" not in tables:
        dla = " (its depth DLA treats e and every f_j as sources)" if "depth_dla" in tables else ""
        st.info(
            f"Run {plain(run.name)} has a {plain(run.model_config.residual)} residual: no depth attention, so "
            f"no edges to attribute{dla}."
        )
    else:
        knockouts = tables["edge_knockouts"]
        show_figure(edge_heatmap(knockouts, "delta_loss"), key="attribution-knockouts")
        st.caption(
            f"Exact knockouts, ranked by Δloss: every edge on a screen of the sequences, the "
            f"{int((knockouts['measured'] == 'all').sum())} largest re-measured on every sequence "
            f"({knockouts.attrs['cost']:.2f}× the passes of knocking every edge out on every sequence); 95% bootstrap "
            "intervals over the sequences each was measured on."
        )
        st.dataframe(knockouts, hide_index=True)
        st.subheader("First-order sensitivity")
        column = st.radio(
            "Path",
            list(EDGE_COLUMNS),
            horizontal=True,
            key="attribution-edge-path",
            format_func=lambda c: EDGE_COLUMNS[c],
        )
        show_figure(edge_heatmap(tables["edge_sensitivity"], column), key="attribution-edges")
        show_figure(agreement_scatter(tables["edge_sensitivity"], knockouts), key="attribution-agreement")
        st.caption(
            "Largest disagreements between the sensitivity and the exact knockout (max α near 1: a saturated "
            "softmax, far from the small-perturbation regime)."
        )
        st.dataframe(tables["edge_agreement"], hide_index=True)
        if "edge_knockouts_visits" in tables:
            st.subheader("Looped layers: every visit knocked out together")
            st.dataframe(tables["edge_knockouts_visits"], hide_index=True)
with audit_tab:
    if "routing_audit" in skipped:
        not_computed("routing_audit")
    elif "routing_audit_consumers" not in tables:
        st.info(f"Run {plain(run.name)} has no depth attention to audit.")
    else:
        show_figure(audit_figure(tables["routing_audit_consumers"]), key="attribution-audit")
        st.dataframe(tables["routing_audit_consumers"], hide_index=True)
with kv_tab:
    if "kv_shift" in skipped:  # with the reason: no K/V taps, or standard attention (nothing to decompose)
        not_computed("kv_shift")
    else:  # KV shift, or a bridged Inkling model's short K/V convolutions (columns per tap, docs/analysis.md §11)
        show_figure(kv_shift_bars(tables["kv_shift"]), key="attribution-kv")
        st.dataframe(tables["kv_shift"], hide_index=True)
