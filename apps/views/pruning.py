"""Pruning: the analysis library's layer-pruning report (sensitivity, cumulative removal curves, angular
distances, and for AttnRes the causal depth routing), computed on demand with progress, cached per checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st
from lens_ui.data import ModelHandle, RunTables, task_batch
from lens_ui.text import plain
from lens_ui.widgets import COMPUTED_KEEP, computed_on_demand, loadable_runs, pick_model, pick_run

from attnres_lens.analysis.report import prune_report_html
from attnres_lens.analysis.run import PRUNE_SAMPLES, REMOVAL_TOLERANCE, prune_summary, prune_tables

st.title("Layer pruning")
st.caption(
    "Δloss and Δaccuracy when each sublayer is removed, mean-ablated or resample-ablated; cumulative "
    "curves for several removal orders; angular distances between representations; for AttnRes models, "
    "α mass against the causal effect of masking each source. Computed on the run's held-out data."
)


def compute_report(
    run: RunTables, handle: ModelHandle, samples: int, metric: str, progress: Callable[[float, str], Any]
) -> str:
    """The library's pruning tables (reporting each stage to `progress`), as its HTML report."""
    with handle.lock:
        tables = prune_tables(handle.model, task_batch(run, samples), metric, on_stage=progress)
    header = {
        "run": run.name,
        "checkpoint": handle.checkpoint,
        "variant": run.variant,
        "samples": samples,
        "metric": metric,
    }
    summary = prune_summary(tables, header)
    return prune_report_html(tables, summary, metric, REMOVAL_TOLERANCE)


runs = loadable_runs()
run = pick_run(runs, key="pruning-run")
st.caption(plain(run.variant))
handle = pick_model(run, key="pruning-checkpoint")
if handle is None:
    st.stop()
left, right = st.columns(2)
samples = int(left.number_input("Held-out sequences", 2, 256, PRUNE_SAMPLES, key="pruning-samples"))
metric = right.radio("Order removals by", ["loss", "accuracy"], horizontal=True, key="pruning-metric")

report = computed_on_demand(
    "pruning",
    (handle.key, samples, metric),
    "Compute pruning report",
    lambda progress: compute_report(run, handle, samples, metric, progress),
    failure=f"The pruning report of {plain(run.name)} failed",
    waiting=f"The report takes a few seconds to a minute; it is kept for this checkpoint while it is among the "
    f"{COMPUTED_KEEP} results shown last.",
)

st.download_button(
    "⬇ Report (HTML)",
    report,
    file_name=f"prune_report_{run.name}.html",
    mime="text/html",
    key="pruning-download",
    on_click="ignore",
    help="The same report as a standalone file (offline)",
)
# The report holds the summary tables and every figure once; the frame takes the report's own height (measured by
# the browser), so nothing is cut whatever the model's depth. Our own report (names escaped by the library).
st.iframe(report, height="content")
