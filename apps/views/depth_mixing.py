"""Depth-mixing matrix M: the effective weight of each sublayer output in each sublayer input, which puts the
standard residual (all ones), Full AttnRes and Block AttnRes on one footing. Scrub through training (from the
recorded depth-weight snapshots, of which M is a linear function) or compute it at a checkpoint."""

from __future__ import annotations

import streamlit as st
from lens_ui.data import describe_error, no_records_message, task_batch
from lens_ui.figures import mixing_heatmap
from lens_ui.text import figure_text, plain
from lens_ui.widgets import loadable_runs, pick_model, pick_runs, show_figure

from attnres_lens.analysis.applicability import where_applicable
from attnres_lens.analysis.depth import depth_mixing_matrix, mixing_matrix_from_weights

st.title("Depth-mixing matrix")
st.caption(
    "M[input c, output i] = Σ_s α_{c,s} · [f_i is summed into source s], averaged over the run's held-out "
    "data: standard residual 1 below the diagonal; Full AttnRes the α themselves; Block AttnRes one block "
    "weight shared by the block's members (so Full AttnRes rows sum to 1, Block AttnRes rows need not)."
)

runs = loadable_runs()
chosen = pick_runs(runs, key="mixing-runs", label="Runs (one or two, side by side on one colour scale)", fallback=2)
if not chosen:
    st.info("Pick a run.")
    st.stop()
source = st.radio(
    "Weights from",
    ["recorded snapshots (scrub through training)", "a checkpoint's model"],
    horizontal=True,
    key="mixing-source",
)
from_records = source.startswith("recorded")

step = None
if from_records:
    # M itself is recorded for every residual kind (records/depth_mixing); older AttnRes runs have only α, of which
    # M is a linear function (records/depth_weights)
    recorded = {
        run.path: run.record("depth_mixing") if not run.record("depth_mixing").empty else run.record("depth_weights")
        for run in chosen
    }
    steps = sorted(set().union(*(frame["step"].unique() for frame in recorded.values() if not frame.empty)))
    if steps:
        step = (
            st.select_slider(
                "Training step (recorded snapshots)",
                options=[int(s) for s in steps],
                value=int(steps[-1]),
                key="mixing-step",
            )
            if len(steps) > 1
            else int(steps[0])
        )
else:
    n_sequences = st.slider("Held-out sequences to average over", 4, 128, 32, step=4, key="mixing-n")

matrices = {}
for run in chosen:
    weights = recorded[run.path] if from_records else None
    if weights is not None and weights.empty and run.model_config.residual == "standard":
        weights = None  # no M recorded (an older run): the standard residual's, all ones, comes from the model
    handle = None
    if weights is None or ("sublayer" not in weights and not weights.empty):  # a recorded M needs no model
        with st.expander(f"{plain(run.name)}: checkpoint", expanded=False):
            handle = pick_model(run, key=f"mixing-checkpoint-{run.name}")
        if handle is None:
            continue
    try:
        if weights is not None:
            if weights.empty:
                st.warning(
                    no_records_message(run, "recorded mixing weights", "records/depth_mixing.parquet")
                    + " Choose “a checkpoint's model” above."
                )
                continue
            at = (
                int(weights["step"][weights["step"] <= step].max())
                if (weights["step"] <= step).any()
                else int(weights["step"].min())
            )
            snapshot = weights[weights["step"] == at]
            if "sublayer" in snapshot:  # a recorded M
                matrix = snapshot.drop(columns="step").reset_index(drop=True)
            else:
                matrix = mixing_matrix_from_weights(handle.model, snapshot)
            where = f"step {at}"
        elif from_records:  # the standard residual's weights are 1 at every step
            matrix, where = depth_mixing_matrix(handle.model), "every step"
        else:
            tokens = task_batch(run, n_sequences).tokens
            skipped: dict[str, str] = {}
            with handle.lock:  # a model M does not apply to (e.g. one whose first sublayer reads e directly) says why
                matrix = where_applicable(
                    handle.model, skipped, "depth_mixing", lambda: depth_mixing_matrix(handle.model, tokens)
                )
            if matrix is None:
                st.info(f"Not computed for run {plain(run.name)}: {plain(skipped['depth_mixing'])}")
                continue
            where = handle.checkpoint
        matrices[run.name] = (run, where, matrix)
    except Exception as err:  # noqa: BLE001 - e.g. a run whose task config no longer builds
        st.error(f"Cannot compute the mixing matrix of {plain(run.name)}: {plain(describe_error(err))}")

if matrices:
    zmax = max(float(frame["weight"].max()) for _, _, frame in matrices.values())
    zmin = min(0.0, *(float(frame["weight"].min()) for _, _, frame in matrices.values()))
    for column, (name, (run, where, frame)) in zip(st.columns(len(matrices)), matrices.items()):
        with column:
            st.subheader(plain(name))
            st.caption(f"{plain(run.variant)} · {plain(where)}")
            show_figure(
                mixing_heatmap(frame, f"{figure_text(name)} · M ({figure_text(where)})", zmax, zmin),
                key=f"mixing-{name}",
            )
