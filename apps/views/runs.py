"""Runs: every run directory of the runs folder, filters, and the one or two runs the other pages show."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st
from lens_ui.data import (
    ACCURACY,
    ANSWER_LOSS,
    EVAL_LOSS,
    RUNS_DIR_KEY,
    SELECTION_KEY,
    TRAIN_LOSS,
    all_runs,
    folder_under_served,
    runs_dir,
    selected_paths,
    served_dir,
    summary_row,
)
from lens_ui.text import plain

st.title("Runs")

folder = st.text_input(
    "Runs folder",
    str(runs_dir()),
    help=f"A run directory, or a folder of run directories: {plain(served_dir())} (the folder "
    "this dashboard serves) or a folder under it; a relative path starts there",
)
try:
    chosen = folder_under_served(folder)
except ValueError as err:  # nothing outside the served folder is read, listed or opened
    st.error(plain(err))
else:
    if chosen != runs_dir():
        st.session_state[RUNS_DIR_KEY] = str(chosen)
        st.session_state[SELECTION_KEY] = []

runs, broken = all_runs()
for name, error in broken.items():
    st.error(f"**{plain(name)}**: {plain(error)}")
if not runs:
    if not runs_dir().exists():
        st.warning(f"The folder {plain(runs_dir())} does not exist.")
    st.info(
        "No readable runs here. Train one with `attnres-lens train --preset smoke --out runs/smoke`, "
        "or run `make demo` for the demo runs."
    )
    st.stop()

table = pd.DataFrame([summary_row(run) | {"path": run.path} for run in runs])
if table[ANSWER_LOSS].isna().all():  # no run logged it (it is newer than these runs): no empty column
    table = table.drop(columns=ANSWER_LOSS)
filters = st.columns(4)
tasks = filters[0].multiselect("Task", sorted(table["task"].unique()))
residuals = filters[1].multiselect("Residual", sorted(table["residual"].unique()))
attentions = filters[2].multiselect("Attention", sorted(table["attention"].unique()))
text = filters[3].text_input("Name contains")
shown = table[
    (table["task"].isin(tasks) if tasks else True)
    & (table["residual"].isin(residuals) if residuals else True)
    & (table["attention"].isin(attentions) if attentions else True)
    & table["run"].str.contains(text, case=False, regex=False)
]
st.dataframe(  # no variant column: residual, attention and layers say the same, and the metrics need the room
    shown.drop(columns=["path", "variant"]),
    hide_index=True,
    width="stretch",
    column_config={
        TRAIN_LOSS: st.column_config.NumberColumn(
            format="%.3f", help="last logged training loss, averaged over every target position of the training batch"
        ),
        EVAL_LOSS: st.column_config.NumberColumn(
            format="%.3f",
            help="last held-out loss, averaged over every target position, including those no rule predicts",
        ),
        ANSWER_LOSS: st.column_config.NumberColumn(
            format="%.3f",
            help="last held-out loss over the task's answer "
            "positions only, the positions the accuracy counts; None: the run "
            "did not log it (runs older than this metric)",
        ),
        ACCURACY: st.column_config.NumberColumn(
            format="percent", help="last held-out accuracy over the task's answer positions only"
        ),
    },
)
st.caption(
    "“all pos.”: averaged over every target position; “answer pos.”: over the task's answer positions only. "
    "The loss over all positions includes tokens no rule predicts (such as the random tokens a copy "
    "task's sequence starts with), so it can stay high while the accuracy over the answer positions, where "
    "the task's rule fixes the next token, is near 100%."
)

labels = {run.path: run.label for run in runs}
selected = [path for path in selected_paths() if path in labels]
options = list(dict.fromkeys(list(shown["path"]) + selected))
st.session_state["runs-pick"] = selected  # the widget shows the selection, whichever page set it


def remember_selection() -> None:
    st.session_state[SELECTION_KEY] = st.session_state["runs-pick"]


picked = st.multiselect(
    "Pick one or two runs for the other pages",
    options,
    max_selections=2,
    format_func=labels.get,
    key="runs-pick",
    on_change=remember_selection,
)
if picked:
    st.success("Selected: " + ", ".join(plain(Path(p).name) for p in picked) + ". Open a page in the sidebar.")
