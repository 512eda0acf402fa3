"""Depth-mixing matrix M: the effective weight of each sublayer output in each sublayer input, which puts the
standard residual (all ones), Full AttnRes and Block AttnRes on one footing."""

from __future__ import annotations

import streamlit as st

from attnres_lens.analysis.depth import depth_mixing_matrix
from lens_ui.data import describe_error, task_batch
from lens_ui.figures import mixing_heatmap
from lens_ui.widgets import loadable_runs, pick_model, pick_runs, show_figure

st.title("Depth-mixing matrix")
st.caption("M[input c, output i] = Σ_s α_{c,s} · [f_i is summed into source s], averaged over the run's held-out "
           "data: standard residual 1 below the diagonal; Full AttnRes the α themselves; Block AttnRes one block "
           "weight shared by the block's members (so Full AttnRes rows sum to 1, Block AttnRes rows need not).")

runs = loadable_runs()
if not runs:
    st.info("No readable runs in this folder.")
    st.stop()
chosen = pick_runs(runs, key="mixing-runs", label="Runs (one or two, side by side on one colour scale)",
                  fallback=2)
n_sequences = st.slider("Held-out sequences to average over", 4, 128, 32, step=4, key="mixing-n")

matrices = {}
for run in chosen:
    with st.expander(f"{run.name}: checkpoint", expanded=False):
        handle = pick_model(run, key=f"mixing-checkpoint-{run.name}")
    if handle is None:
        continue
    try:
        tokens = task_batch(run, n_sequences).tokens
        with handle.lock:
            matrices[run.name] = (run, handle.checkpoint, depth_mixing_matrix(handle.model, tokens))
    except Exception as err:  # noqa: BLE001 - e.g. a run whose task config no longer builds
        st.error(f"Cannot compute the mixing matrix of {run.name}: {describe_error(err)}")

if matrices:
    zmax = max(float(frame["weight"].max()) for _, _, frame in matrices.values())
    for column, (name, (run, checkpoint, frame)) in zip(st.columns(len(matrices)), matrices.items()):
        with column:
            st.subheader(name)
            st.caption(f"{run.variant} · {checkpoint}")
            show_figure(mixing_heatmap(frame, f"{name} · M ({checkpoint})", zmax), key=f"mixing-{name}")
