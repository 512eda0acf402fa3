"""Training dynamics: loss and accuracy curves of several runs, and per-depth output magnitudes and gradient
norms over training (a line per recorded step, and a depth × step heatmap)."""

from __future__ import annotations

import pandas as pd
import streamlit as st
from lens_ui.data import no_records_message
from lens_ui.figures import by_depth_lines, curves, depth_step_heatmap, last_step_by_depth
from lens_ui.text import figure_text, plain
from lens_ui.widgets import loadable_runs, pick_runs, show_figure

st.title("Training dynamics")

runs = loadable_runs()
chosen = pick_runs(runs, key="dynamics-runs", max_runs=None, label="Runs (overlaid)", fallback=3)
if not chosen:
    st.info("Pick at least one run.")
    st.stop()

log_loss = st.toggle("Log-scale loss", value=False, key="dynamics-log-loss")
series = [(figure_text(run.name), run.metrics) for run in chosen if not run.metrics.empty]
for run in chosen:
    if run.metrics.empty:
        st.warning(no_records_message(run, "training curves", "metrics.jsonl is missing or empty"))
if series:
    left, right = st.columns(2)
    with left:
        show_figure(
            curves(
                series,
                [
                    ("loss", "train, all positions"),
                    ("eval_loss", "eval, all positions"),
                    ("eval_answer_loss", "eval, answer positions"),
                ],  # newer runs log the last
                "Loss",
                "cross-entropy (nats)",
                log_y=log_loss,
            ),
            key="dynamics-loss",
        )
    with right:
        show_figure(
            curves(series, [("eval_accuracy", "eval")], "Accuracy (answer positions)", "accuracy"),
            key="dynamics-accuracy",
        )

st.divider()
st.header("By depth")
METRICS = {
    "output magnitude (RMS of f_j)": ("magnitudes", "output_rms", "RMS"),
    "hidden-state magnitude (RMS of the sublayer input)": ("magnitudes", "input_rms", "RMS"),
    "activation gradient norm (‖∂loss/∂f_j‖)": ("magnitudes", "grad_norm", "gradient norm"),
    "parameter gradient norm per block": ("param_grad_norms", "grad_norm", "gradient norm"),
}
metric = st.selectbox("Quantity", list(METRICS), key="dynamics-metric")
log_depth = st.toggle("Log scale", value=True, key="dynamics-log-depth")
table, value, unit = METRICS[metric]
if table == "magnitudes":
    x, x_labels = "sublayer", "label"
else:
    x, x_labels = "position", "block"


def depth_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Parameter blocks keep the model's order (embed, blocks.0, …, unembed), not alphabetical order."""
    if table == "magnitudes":
        return frame
    order = {name: position for position, name in enumerate(dict.fromkeys(frame["block"]))}
    return frame.assign(position=frame["block"].map(order))


frames = {}
for run in chosen:
    if run.record(table).empty:
        st.warning(no_records_message(run, f"`{table}` records", f"records/{table}.parquet"))
    else:
        frames[run.name] = depth_frame(run.record(table))
if len(frames) > 1:
    overlaid = [(figure_text(name), frame) for name, frame in frames.items()]  # trace names: Plotly reads HTML
    show_figure(
        last_step_by_depth(
            overlaid,
            x,
            x_labels,
            value,
            f"{metric}<br><sup>last recorded step, runs overlaid</sup>",
            unit,
            log_y=log_depth,
        ),
        key="dynamics-overlay",
    )
for run in chosen:
    if run.name not in frames:
        continue
    frame = frames[run.name]
    st.subheader(plain(run.name))
    st.caption(plain(run.variant))
    run_title = figure_text(run.name)
    left, right = st.columns(2)
    with left:
        show_figure(
            by_depth_lines(
                frame,
                x,
                x_labels,
                value,
                f"{metric}<br><sup>{run_title}, a line per recorded step</sup>",
                unit,
                log_y=log_depth,
            ),
            key=f"dynamics-lines-{run.name}",
        )
    with right:
        show_figure(
            depth_step_heatmap(
                frame, x, x_labels, value, f"{metric}<br><sup>{run_title}, depth × step</sup>", unit, log_z=log_depth
            ),
            key=f"dynamics-heatmap-{run.name}",
        )
