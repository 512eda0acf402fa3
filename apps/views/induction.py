"""Induction heads: layer × head scores (recorded over training, or measured now on a checkpoint), a head's
attention pattern on repeated tokens, and the KV-shift coefficients over training."""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch
from lens_ui.data import ModelHandle, no_records_message
from lens_ui.figures import kv_shift_figure, layer_head_heatmap, pattern_heatmap, score_over_training
from lens_ui.text import figure_text, plain
from lens_ui.widgets import loadable_runs, pick_model, pick_run, repeated_tokens_input, show_figure
from transformer_lens.utilities import get_act_name

from attnres_lens.analysis.applicability import (
    INDUCTION_TOOLKIT_ONLY,
    bridged_inkling,
    is_toolkit_model,
)
from attnres_lens.analysis.induction import BRIDGE_NAN_REASONS, induction_head_scores, pattern_hooks, task_probe
from attnres_lens.bridge import SUPPORTED_MODELS as INKLING_MODELS
from attnres_lens.tasks.base import Task

# column: (menu name, colour-bar title with its scale, zmin, zmax, signed)
METRICS = {
    "prefix_score": ("prefix-matching score (ARENA/Olsson)", "prefix score<br>(ceiling ≈ 1)", 0.0, 1.0, False),
    "tl_induction_score": (
        "TransformerLens detect_head induction score",
        "TL score<br>(ceiling ≈ 0.5)",
        0.0,
        0.5,
        False,
    ),
    "previous_token_score": ("previous-token score", "mean A[q, q−1]<br>(ceiling 1)", 0.0, 1.0, False),
    "copying_score": (
        "copying score (direct logit effect of the OV path)",
        "logit of the<br>right token",
        None,
        None,
        True,
    ),
    "ablation_zero_score": ("ablation score, head zeroed", "Δ loss (nats)", None, None, True),
    "ablation_mean_score": ("ablation score, head mean-ablated", "Δ loss (nats)", None, None, True),
}
RECORDED = "recorded: prefix-matching score over training"

st.title("Induction heads")
st.caption(
    "Scores on repeated random tokens [BOS, r, r]. The prefix score and TransformerLens' detect_head use "
    "different scales (ceilings ≈ 1 and ≈ 0.5): never compare one against the other's thresholds. A KV-shift "
    "head's values mix two tokens, so check the copying and ablation scores, not only the pattern."
)

runs = loadable_runs()
run = pick_run(runs, key="induction-run", prefer=lambda r: r.model_config.attention == "kv_shift")
st.caption(plain(run.variant))
run_title = figure_text(run.name)  # in figure titles: Plotly reads them as HTML


@st.cache_data(show_spinner=False, max_entries=32)
def live_scores(_handle: ModelHandle, key: tuple, n_samples: int, _task: Task) -> pd.DataFrame:
    """`attnres-lens analyze`'s scores: the run's probe (its task's vocabulary and seed; `key` names the run)."""
    with _handle.lock:
        return induction_head_scores(_handle.model, task_probe(_handle.model, _task, n_samples))


metric = st.selectbox(
    "Metric",
    [RECORDED, *METRICS],
    key="induction-metric",
    format_func=lambda m: m if m == RECORDED else f"at a checkpoint: {METRICS[m][0]}",
)
if metric == RECORDED:
    scores = run.record("induction_scores")
    if scores.empty:
        st.warning(
            no_records_message(run, "recorded induction scores", "records/induction_scores.parquet")
            + " Pick a metric measured at a checkpoint."
        )
    else:
        steps = sorted(int(s) for s in scores["step"].unique())
        step = (
            st.select_slider("Training step", steps, value=steps[-1], key="induction-step")
            if len(steps) > 1
            else steps[0]
        )
        name, colorbar, zmin, zmax, signed = METRICS["prefix_score"]
        left, right = st.columns(2)
        with left:
            show_figure(
                layer_head_heatmap(
                    scores[scores["step"] == step],
                    "prefix_score",
                    f"prefix score @ step {step}<br><sup>{run_title}</sup>",
                    colorbar,
                    zmin,
                    zmax,
                    signed,
                ),
                key=f"induction-recorded-{run.name}",
            )
        with right:
            show_figure(
                score_over_training(
                    scores,
                    "prefix_score",
                    f"prefix score over training<br><sup>{run_title}</sup>",
                    "prefix score (ceiling ≈ 1)",
                ),
                key=f"induction-training-{run.name}",
            )
else:
    handle = pick_model(run, key="induction-checkpoint")
    n_samples = st.slider("Repeated sequences", 4, 64, 16, step=4, key="induction-samples")
    if handle is not None and not is_toolkit_model(handle.model) and bridged_inkling(handle.model) is None:
        st.info(f"Not computed for run {plain(run.name)}: {plain(INDUCTION_TOOLKIT_ONLY)}.")
    elif handle is not None:
        with st.spinner("Scoring every head (patterns, TL detector, copying, ablations)…"):
            task = run.build_task()
            scores = live_scores(handle, handle.key, n_samples, task)
        if metric in BRIDGE_NAN_REASONS and not is_toolkit_model(handle.model):
            st.info(f"Not computed for run {plain(run.name)} ({metric}): {plain(BRIDGE_NAN_REASONS[metric])}.")
        name, colorbar, zmin, zmax, signed = METRICS[metric]
        show_figure(
            layer_head_heatmap(
                scores,
                metric,
                f"{name}<br><sup>{run_title} · {figure_text(handle.checkpoint)}</sup>",
                colorbar,
                zmin,
                zmax,
                signed,
            ),
            key=f"induction-live-{run.name}-{metric}",
        )
        with st.expander("All scores as a table"):
            st.dataframe(scores, hide_index=True)

st.divider()
st.header("Attention pattern of one head")
handle = pick_model(run, key="induction-pattern-checkpoint")
if handle is not None and not is_toolkit_model(handle.model) and bridged_inkling(handle.model) is None:
    st.info(f"Not shown for run {plain(run.name)}: {plain(INDUCTION_TOOLKIT_ONLY)}.")
elif handle is not None and not is_toolkit_model(handle.model):  # a bridged Inkling model: a layer's visits apart
    hooks = pattern_hooks(handle.model)
    left, right = st.columns(2)
    layer, visit = left.selectbox(
        "Layer",
        list(hooks),
        format_func=lambda key: f"L{key[0]}" + (f"@{key[1]}" if key[1] else ""),
        key="induction-layer-visit",
    )
    head = right.selectbox("Head", range(handle.model.hf_model.config.num_attention_heads), key="induction-head")
    tokens = repeated_tokens_input(run, "induction-pattern", run.model_config.n_ctx)
    hook = hooks[layer, visit]
    with handle.lock, torch.no_grad():
        _, cache = handle.model.run_with_cache(tokens, names_filter=lambda name: name == hook)
    show_figure(
        pattern_heatmap(
            cache[hook][0, head].float().cpu().numpy(),
            tokens[0].tolist(),
            f"L{layer}{f'@{visit}' if visit else ''}H{head} attention on [BOS, r, r]"
            f"<br><sup>{run_title} · {figure_text(handle.checkpoint)}</sup>",
        ),
        key=f"induction-pattern-{run.name}",
    )
elif handle is not None:
    model = handle.model
    recorded = run.record("induction_scores")
    best_layer, best_head = 0, 0  # default: the head with the highest recorded prefix score at the last step
    if not recorded.empty:
        last = recorded[recorded["step"] == recorded["step"].max()]
        best = last.loc[last["prefix_score"].idxmax()]
        best_layer, best_head = int(best["layer"]), int(best["head"])
    left, right = st.columns(2)
    layer = left.selectbox("Layer", range(model.cfg.n_layers), index=best_layer, key="induction-layer")
    head = right.selectbox("Head", range(model.cfg.n_heads), index=best_head, key="induction-head")
    tokens = repeated_tokens_input(run, "induction-pattern", model.cfg.n_ctx)
    hook = get_act_name("pattern", layer)
    with handle.lock, torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name == hook)
    pattern = cache[hook][0, head].float().cpu().numpy()
    show_figure(
        pattern_heatmap(
            pattern,
            tokens[0].tolist(),
            f"L{layer}H{head} attention on [BOS, r, r]<br><sup>{run_title} · {figure_text(handle.checkpoint)}</sup>",
        ),
        key=f"induction-pattern-{run.name}",
    )
    st.caption(
        "An induction head attends from each second-half token to the token after its first occurrence: "
        "the stripe L−1 below the diagonal."
    )

st.divider()
st.header("KV-shift coefficients over training")
if run.refers_to_folder and run.model_config.architecture in INKLING_MODELS:
    st.info(
        f"Run {plain(run.name)} refers to a transformers model folder: it has no training records. Its short K/V "
        "convolutions are split by tap on the Attribution page's KV shift tab."
    )
elif run.refers_to_folder:
    st.info(
        f"Run {plain(run.name)} refers to a transformers model folder ({plain(run.model_config.architecture)}): it "
        "has no training records, and neither a KV shift nor short K/V convolutions to decompose."
    )
elif run.model_config.attention != "kv_shift":
    st.info(f"Run {plain(run.name)} uses standard attention: it has no KV-shift coefficients.")
else:
    kv = run.record("kv_shift")
    if kv.empty:
        st.warning(no_records_message(run, "recorded KV-shift coefficients", "records/kv_shift.parquet"))
    else:
        st.caption("K̂_t = α1·K_t + α2·K_{t−1}, V̂_t = β1·V_t + β2·V_{t−1}, per head.")
        show_figure(kv_shift_figure(kv, f"{run_title} · KV-shift coefficients"), key=f"induction-kv-{run.name}")
