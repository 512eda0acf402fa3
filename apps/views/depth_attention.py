"""Depth attention: token-averaged α as consumer × source heatmaps, scrubbed through training, two runs side by
side on one colour scale, and a per-token view computed with a checkpoint's model."""

from __future__ import annotations

import pandas as pd
import streamlit as st
from lens_ui.data import ModelHandle, RunTables, describe_error, load_model, no_records_message, task_batch
from lens_ui.figures import KIND_TITLES, depth_heatmap, per_token_heatmap
from lens_ui.text import figure_text, plain
from lens_ui.widgets import loadable_runs, pick_model, pick_runs, repeated_tokens_input, show_figure, token_input

from attnres_lens.analysis.depth import depth_weights, depth_weights_per_token
from attnres_lens.analysis.prompts import text_codec

st.title("Depth attention")
st.caption(
    "Each AttnRes sublayer reads a softmax mix α over earlier sources (embedding, sublayer outputs or block "
    "sums). Rows: the consumer (the sublayer whose input is mixed); columns: its sources. Standard-residual "
    "runs have no depth attention (every weight is 1; see the Depth-mixing matrix page)."
)

runs = loadable_runs(
    lambda run: run.model_config.residual == "attnres",
    "No AttnRes run in this folder: depth attention exists only with `residual=attnres`.",
)
chosen = pick_runs(
    runs,
    key="depth-runs",
    label="Runs (one or two, shown side by side)",
    fallback=2,
    unshowable="depth attention exists only in AttnRes runs (`residual=attnres`)",
)
if not chosen:
    st.info("Pick a run.")
    st.stop()


@st.cache_data(show_spinner="Computing depth weights from the checkpoint…", max_entries=16)
def checkpoint_weights(_handle: ModelHandle, key: tuple, _run: RunTables, n_sequences: int) -> pd.DataFrame:
    """Token-averaged α of a checkpoint's model on the run's held-out data, as one snapshot at step 0."""
    with _handle.lock:
        return depth_weights(_handle.model, task_batch(_run, n_sequences).tokens).assign(step=0)


recorded = {run.path: run.record("depth_weights") for run in chosen}
for run in chosen:
    if recorded[run.path].empty and run.imported:  # no snapshots will ever exist: measure its one checkpoint
        st.info(
            no_records_message(run, "depth-weight snapshots", "records/depth_weights.parquet")
            + " Its heatmap is computed now, on 16 held-out sequences of the run's task."
        )
        handle, error = load_model(run, "latest")
        try:
            recorded[run.path] = checkpoint_weights(handle, handle.key, run, 16) if handle else pd.DataFrame()
        except Exception as err:  # noqa: BLE001 - e.g. a task whose token file moved
            error = describe_error(err)
        if error:
            st.error(f"Cannot compute the depth weights of {plain(run.name)}: {plain(error)}")
    elif recorded[run.path].empty:
        st.warning(no_records_message(run, "recorded depth weights", "records/depth_weights.parquet"))
chosen = [run for run in chosen if not recorded[run.path].empty]
if not chosen:
    st.stop()

steps = sorted(set().union(*(recorded[run.path]["step"].unique() for run in chosen)))
step = (
    st.select_slider(
        "Training step (recorded snapshots)", options=[int(s) for s in steps], value=int(steps[-1]), key="depth-step"
    )
    if len(steps) > 1
    else int(steps[0])
)


def snapshot(run: RunTables) -> tuple[int, pd.DataFrame]:
    """The run's snapshot at the latest recorded step ≤ the slider (runs may record at different steps)."""
    weights = recorded[run.path]
    available = weights["step"][weights["step"] <= step]
    at = int(available.max()) if len(available) else int(weights["step"].min())
    return at, weights[weights["step"] == at]


snapshots = {run.path: snapshot(run) for run in chosen}
# One colour scale for every panel on the page, so the two runs compare directly.
zmax = max(float(frame["weight"].max()) for _, frame in snapshots.values())
columns = st.columns(len(chosen))
for column, run in zip(columns, chosen):
    at, frame = snapshots[run.path]
    with column:
        st.subheader(plain(run.name))
        st.caption(f"{plain(run.variant)} · " + ("imported checkpoint" if run.imported else f"step {at}"))
        for kind in KIND_TITLES:
            if (frame["kind"] == kind).any():
                where = "imported checkpoint" if run.imported else f"step {at}"
                show_figure(
                    depth_heatmap(frame, kind, where, zmax, figure_text(run.name)), key=f"depth-{run.name}-{kind}"
                )

st.divider()
st.header("Per-token view")
st.caption("α at every position of one input, from the model at the chosen checkpoint.")
names = [run.name for run in chosen]
run = (
    chosen[names.index(st.radio("Run", names, horizontal=True, key="depth-token-run", format_func=plain))]
    if len(chosen) > 1
    else chosen[0]
)
handle = pick_model(run, key="depth-token-checkpoint")
if handle is None:
    st.stop()
tokens = token_input(
    run,
    handle,
    "depth-token-input",
    "Input",
    "repeated random tokens",
    lambda: repeated_tokens_input(run, "depth-token-input", run.model_config.n_ctx),
)
if tokens is None:
    st.stop()
model = handle.model
consumers = model.consumers()  # protocol members only: the bridge is no HookedTransformer
consumer = st.selectbox(
    "Consumer", consumers, index=len(consumers) - 1, format_func=model.sublayer_name, key="depth-token-consumer"
)

with handle.lock:
    per_token = depth_weights_per_token(model, tokens)
show_figure(
    per_token_heatmap(
        per_token,
        consumer,
        f"α of {model.sublayer_name(consumer)} per token<br><sup>"
        f"{figure_text(run.name)} · {figure_text(handle.checkpoint)}</sup>",
        text_codec(run.config, run.path),
    ),
    key=f"depth-per-token-{run.name}",
)
