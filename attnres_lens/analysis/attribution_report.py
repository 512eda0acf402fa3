"""Attribution through depth (docs/analysis.md §11) as tables and one offline HTML report, and the figures the
report and the dashboard's Attribution page share; `attnres-lens attribute` runs it on a run directory
(`attnres_lens.analysis.run.attribute_run`).

Data: the run's held-out set (`task.eval_batch(samples)`, scored on its answer positions where it has them),
one prompt for the per-position views (`--prompt`, default the first held-out sequence), the repeated-tokens
probe for the KV-shift decomposition (a bridged Inkling model's K/V convolution taps), and the run's recorded
snapshots for the timeline.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from attnres_lens.analysis.applicability import (
    CORRUPTED_TOOLKIT_ONLY,
    EDGE_TABLES,
    KV_SHIFT_TOOLKIT_ONLY,
    NO_KV_SHIFT,
    bridged_inkling,
    is_toolkit_model,
    no_depth_attention,
    where_applicable,
)
from attnres_lens.analysis.attribution import (
    audit_summary,
    depth_input_decomposition,
    depth_logit_attribution,
    edge_agreement,
    edge_sensitivity,
    logit_attribution_summary,
    logit_lens_summary,
    routing_audit,
    source_logit_lens,
)
from attnres_lens.analysis.induction import default_half_len, repeated_batch
from attnres_lens.analysis.knockouts import SCREEN_FRACTION, edge_knockouts
from attnres_lens.analysis.kv_shift import KV_SHIFT_COLUMNS, conv_tap_decomposition, kv_shift_decomposition
from attnres_lens.analysis.prompts import TextCodec, position_label, token_name
from attnres_lens.analysis.report import STYLE, skipped_html
from attnres_lens.analysis.timeline import fastest_changes, training_timeline
from attnres_lens.analysis.visits import visit_groups, visit_knockouts
from attnres_lens.analysis_options import plural
from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.tasks.base import IGNORE_INDEX, Batch

if TYPE_CHECKING:
    import plotly.graph_objects as go

SIGNED, SEQUENTIAL = "RdBu_r", "Viridis"
EDGE_COLUMNS = {"total": "total Δloss", "value_path": "value path", "routing_path": "routing path"}


# ---------------------------------------------------------------------------- tables
def answer_targets(batch: Batch) -> torch.Tensor:
    """The batch's targets at its answer positions (−100 elsewhere); all targets if it marks no answers."""
    if not batch.answer_mask.any():
        return batch.targets
    return torch.where(batch.answer_mask, batch.targets, IGNORE_INDEX)


def attribution_tables(
    model: HookedTransformer | DepthMixingModel,
    batch: Batch,
    prompt: torch.Tensor,
    records: dict[str, pd.DataFrame] | None = None,
    metrics: pd.DataFrame | None = None,
    probe: Batch | None = None,
    n_boot: int = 1000,
    progress: bool = False,
    on_stage: Callable[[float, str], Any] | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, pd.DataFrame]:
    """Every attribution table for a model (the edge, routing and audit tables for AttnRes models only).

    `prompt` [1, pos] feeds the per-position tables (depth_dla, logit_lens); `batch` the rest. `on_stage(fraction,
    description)` is called before each stage (a UI's progress bar); `progress` shows a tqdm bar over the stages.
    On a depth-mixing model other than the toolkit's own (the transformers bridge), the tables it cannot support
    are left out and `skipped` (when given) gets table → reason (analysis/applicability.py).
    """
    skipped = {} if skipped is None else skipped
    toolkit = is_toolkit_model(model)
    batch = batch.to(model_device(model))
    attnres = model.cfg.residual == "attnres" if toolkit else bool(model.consumers())

    def applicable(tables: dict[str, pd.DataFrame], name: str, compute: Callable[[], Any]) -> None:
        result = where_applicable(model, skipped, name, compute)
        if isinstance(result, dict):  # several tables under one analysis (the routing audit)
            tables.update({f"{name}_{key}": frame for key, frame in result.items()})
        elif result is not None:
            tables[name] = result

    def logit_attribution(t: dict[str, pd.DataFrame]) -> None:
        # a model without `frozen_readout` refuses by name and is skipped with that reason
        applicable(t, "depth_dla", lambda: depth_logit_attribution(model, prompt))
        applicable(
            t,
            "depth_dla_summary",
            lambda: logit_attribution_summary(depth_logit_attribution(model, batch.tokens, answer_targets(batch))),
        )
        applicable(t, "depth_inputs", lambda: depth_input_decomposition(model, batch.tokens))

    stages: list[tuple[str, Callable[[dict], None]]] = [
        ("direct logit attribution", logit_attribution),
        (
            "logit lens",
            lambda t: t.update(
                logit_lens=source_logit_lens(model, prompt),
                logit_lens_summary=logit_lens_summary(
                    source_logit_lens(model, batch.tokens, targets=answer_targets(batch))
                ),
            ),
        ),
    ]
    # patching from a corrupted input is derived for the paper's default depth attention only (docs/analysis.md §11)
    patchable = toolkit and all(getattr(module, "fusable", True) for module in model.depth_attention_modules().values())
    if attnres and not toolkit:
        skipped["edge_sensitivity_corrupted"] = CORRUPTED_TOOLKIT_ONLY
    if not attnres:
        skipped.update(dict.fromkeys(EDGE_TABLES, no_depth_attention(model)))
    if attnres:
        # the screen needs 2 sequences for its bootstrap: a quarter of the batch, or 2 of a batch under 8
        screen = max(SCREEN_FRACTION, min(1.0, 2 / batch.tokens.shape[0]))
        stages += [
            (
                "edge knockouts (exact: every edge on a screen, the largest on every sequence)",
                lambda t: t.update(edge_knockouts=edge_knockouts(model, batch, screen_fraction=screen, n_boot=n_boot)),
            ),
            (
                "first-order sensitivity (one forward and backward pass)",
                lambda t: t.update(
                    edge_sensitivity=edge_sensitivity(model, batch),
                    **(
                        {
                            "edge_sensitivity_corrupted": edge_sensitivity(
                                model, batch, corrupted=batch.tokens.roll(1, dims=0)
                            )
                        }
                        if patchable
                        else {}
                    ),
                ),
            ),
            *(
                [
                    (
                        "knockouts of every visit of a looped layer together",
                        lambda t: t.update(edge_knockouts_visits=visit_knockouts(model, batch)),
                    )
                ]
                if visit_groups(model)
                else []
            ),
            (
                "routing audit (bootstrap over sequences, null schedules)",
                lambda t: applicable(t, "routing_audit", lambda: routing_audit(model, batch, n_boot)),
            ),
        ]
    inkling = bridged_inkling(model)
    if toolkit and model.cfg.attention == "standard":
        skipped["kv_shift"] = NO_KV_SHIFT
    elif toolkit or inkling is not None:
        if probe is None:
            probe = repeated_batch(
                batch.tokens.shape[0], default_half_len(model), model.cfg.d_vocab if toolkit else model.d_vocab
            )
        stages.append(
            (
                "KV-shift decomposition" if toolkit else "K/V convolution taps",
                lambda t: t.update(
                    # a bridged Inkling model: its short K/V convolutions split by tap, read from the transformers
                    # model the bridge wraps (docs/analysis.md §11)
                    kv_shift=kv_shift_decomposition(model, probe) if toolkit else conv_tap_decomposition(inkling, probe)
                ),
            )
        )
    else:
        skipped["kv_shift"] = KV_SHIFT_TOOLKIT_ONLY
    if records is not None and metrics is not None:
        stages.append(("training timeline", lambda t: t.update(timeline=training_timeline(records, metrics))))
    tables: dict[str, pd.DataFrame] = {}
    report = on_stage or (lambda fraction, description: None)
    with tqdm(total=len(stages), desc="attribution", disable=not progress, leave=False) as bar:
        for index, (description, stage) in enumerate(stages):
            report(index / len(stages), description + "…")
            bar.set_postfix_str(description)
            stage(tables)
            bar.update(1)
    if "edge_knockouts" in tables:
        tables["edge_agreement"] = edge_agreement(tables["edge_sensitivity"], tables["edge_knockouts"])[1]
    if "timeline" in tables:
        tables["timeline_changes"] = fastest_changes(tables["timeline"])
    report(1.0, "done")
    return tables


def attribution_summary(tables: dict[str, pd.DataFrame], header: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers: the sources carrying most of the correct-token logit, the lens depth where the target
    first ranks top on average, the edges whose knockout hurts most and the knockouts' cost, how well the
    first-order sensitivity ranks them, the audit's means, the strongest shifted-key head."""
    summary: dict[str, Any] = dict(header)
    if "depth_dla_summary" in tables:
        dla = tables["depth_dla_summary"].sort_values("mean_abs_contribution", ascending=False)
        summary["top_logit_sources"] = dla.head(3)[["source_label", "mean_contribution", "share"]].to_dict("records")
    lens = tables["logit_lens_summary"]
    inputs = lens[lens["vector"] == "input"]
    summary["lens_final_top1"] = float(inputs["top1"].iloc[-1])
    if "edge_knockouts" in tables:
        knockouts = tables["edge_knockouts"]
        summary["top_edges"] = knockouts.head(5)[
            ["consumer_label", "source_label", "delta_loss", "delta_loss_low", "delta_loss_high", "measured"]
        ].to_dict("records")
        summary["knockout_cost"] = knockouts.attrs["cost"]
        agreement, _ = edge_agreement(tables["edge_sensitivity"], knockouts)
        summary["edge_agreement"] = agreement
    if "routing_audit_consumers" in tables:
        summary["routing_audit"] = audit_summary({"consumers": tables["routing_audit_consumers"]})
    if "kv_shift" in tables:
        kv = tables["kv_shift"]
        best = kv.loc[kv["prefix_score"].idxmax()]
        summary["top_induction_head"] = dict(
            layer=int(best["layer"]),
            # a bridged Inkling model: the visit as in the bridge's hook names and analyze's induction table
            **({"visit": int(bridge_visits(kv)[best.name])} if "visit" in kv else {}),
            head=int(best["head"]),
            prefix_score=float(best["prefix_score"]),
            shifted_key_induction_score=float(best["shifted_key_induction_score"]),
        )
    if "timeline_changes" in tables:
        changes = tables["timeline_changes"]
        model_wide = changes[changes["consumer"] < 0]
        summary["fastest_change_steps"] = dict(zip(model_wide["series"], model_wide["step"].astype(int)))
    return summary


# ---------------------------------------------------------------------------- figures (pure functions of tables)
def _layout(figure: go.Figure, title: str, height: int = 420, **layout: Any) -> go.Figure:
    # an explicit template: importing streamlit changes Plotly's default one
    layout.setdefault("margin", dict(l=10, r=10, t=60, b=10))
    figure.update_layout(title=title, height=height, template="plotly_white", **layout)
    return figure


def dla_heatmap(dla: pd.DataFrame, sequence: int = 0, codec: TextCodec | None = None) -> go.Figure:
    """Per-position direct logit attribution of one sequence: source × position, signed; tokens named by
    their text where the run encodes text (`codec`, `prompts.text_codec`), else by id."""
    import plotly.graph_objects as go

    frame = dla[dla["sequence"] == sequence]
    grid = frame.pivot(index="source_label", columns="position", values="contribution")
    grid = grid.reindex(frame.drop_duplicates("source")["source_label"])
    targets = frame.drop_duplicates("position").set_index("position")["target"].reindex(grid.columns)
    tokens = frame.drop_duplicates("position").set_index("position")["token"].reindex(grid.columns)
    limit = float(grid.abs().max().max()) or 1.0
    figure = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=[position_label(p, t, n, codec) for p, t, n in zip(grid.columns, tokens, targets)],
            y=grid.index.tolist(),
            colorscale=SIGNED,
            zmid=0,
            zmin=-limit,
            zmax=limit,
            colorbar=dict(title=dict(text="logit")),
            hovertemplate="source %{y}<br>position %{x}<br>contribution %{z:.3f}<extra></extra>",
        )
    )
    figure.update_yaxes(autorange="reversed", title="source (final readout)", type="category")
    figure.update_xaxes(title="position: token→next token", type="category")
    return _layout(
        figure, "Direct logit attribution of the next token, per source and position", max(320, 80 + 24 * len(grid))
    )


def dla_summary_bars(summary: pd.DataFrame) -> go.Figure:
    import plotly.graph_objects as go

    figure = go.Figure(
        go.Bar(
            x=summary["source_label"],
            y=summary["mean_contribution"],
            error_y=None,
            marker_color="#4c72b0",
            customdata=summary[["share", "mean_alpha"]].to_numpy(),
            hovertemplate="%{x}<br>mean contribution %{y:.3f}<br>share of |·| %{customdata[0]:.2f}"
            "<br>mean α %{customdata[1]:.3f}<extra></extra>",
        )
    )
    figure.update_xaxes(title="source", type="category")
    figure.update_yaxes(title="mean contribution to the correct logit")
    return _layout(figure, "Which sources the prediction reads (held-out answer positions)")


def lens_heatmap(lens: pd.DataFrame, sequence: int = 0, codec: TextCodec | None = None) -> go.Figure:
    """Correct-token rank of every decoded vector (depth order) at each position of one sequence; the hover's top
    tokens named by their text where the run encodes text (`codec`), else by id."""
    import plotly.graph_objects as go

    frame = lens[lens["sequence"] == sequence]
    if codec is not None:
        named = [" ".join(token_name(int(t), codec) for t in top.split()) for top in frame["top_tokens"]]
        frame = frame.assign(top_tokens=named)
    order = frame.drop_duplicates(["vector", "label"])["label"].tolist()
    grid = frame.pivot_table(index="label", columns="position", values="target_rank", aggfunc="first").reindex(order)
    tops = frame.pivot_table(index="label", columns="position", values="top_tokens", aggfunc="first").reindex(order)
    at = frame.drop_duplicates("position").set_index("position").reindex(grid.columns)
    figure = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(dtype=float),
            x=[position_label(p, t, n, codec) for p, t, n in zip(grid.columns, at["token"], at["target"])],
            y=order,
            customdata=tops.to_numpy(),
            colorscale=SEQUENTIAL,
            reversescale=True,
            colorbar=dict(title=dict(text="rank of the<br>next token")),
            hovertemplate="%{y}<br>position %{x}<br>rank %{z}<br>top tokens %{customdata}<extra></extra>",
        )
    )
    figure.update_yaxes(autorange="reversed", type="category", title="decoded vector (sources, then inputs)")
    figure.update_xaxes(title="position: token→next token", type="category")
    return _layout(figure, "Logit lens over depth: rank of the next token (0 = top)", max(360, 60 + 20 * len(order)))


def lens_summary_figure(summary: pd.DataFrame) -> go.Figure:
    import plotly.graph_objects as go

    figure = go.Figure()
    for vector, group in summary.groupby("vector", sort=False):
        figure.add_trace(go.Scatter(x=group["label"], y=group["top1"], mode="lines+markers", name=f"{vector}s"))
    figure.update_xaxes(title="decoded vector, in depth order", type="category")
    figure.update_yaxes(title="share of answers ranked first", range=[0, 1])
    return _layout(figure, "Logit lens: where the answer becomes readable")


def edge_heatmap(edges: pd.DataFrame, column: str = "total") -> go.Figure:
    """Consumer × source heatmap of an edge column: the knockouts' exact `delta_loss` (`edge_knockouts`), or a
    first-order sensitivity column (total, value_path or routing_path; `edge_sensitivity`)."""
    import plotly.graph_objects as go

    if column not in EDGE_COLUMNS and column != "delta_loss":
        raise ValueError(f"column must be 'delta_loss' or one of {list(EDGE_COLUMNS)}, got {column!r}")
    grid = _edge_grid(edges, column)
    limit = float(grid.abs().max().max()) if grid.notna().any().any() else 1.0
    figure = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(dtype=float),
            x=grid.columns.tolist(),
            y=grid.index.tolist(),
            colorscale=SIGNED,
            zmid=0,
            zmin=-limit,
            zmax=limit,
            hoverongaps=False,
            colorbar=dict(title=dict(text="Δloss" if column == "delta_loss" else "Δloss (est.)")),
            hovertemplate="consumer %{y}<br>source %{x}<br>%{z:.4g}<extra></extra>",
        )
    )
    figure.update_yaxes(autorange="reversed", type="category", title="consumer")
    figure.update_xaxes(type="category", title="source")
    title = (
        "Edge knockouts: exact Δloss of knocking a source out of a consumer"
        if column == "delta_loss"
        else f"First-order sensitivity ({EDGE_COLUMNS[column]}): Δloss of a small step towards the knockout"
    )
    return _layout(figure, title, max(360, 80 + 22 * len(grid)))


def _edge_grid(edges: pd.DataFrame, column: str) -> pd.DataFrame:
    grid = edges.pivot_table(index=["consumer", "consumer_label"], columns="source_label", values=column)
    grid = grid.sort_index().droplevel("consumer")
    first = edges.groupby("source_label")["source"].min()
    return grid.reindex(columns=sorted(grid.columns, key=lambda label: (label == "partial", first[label], label)))


def edge_heatmap_with_toggle(edges: pd.DataFrame) -> go.Figure:
    """`edge_heatmap` with buttons switching between the total, the value path and the routing path (works in an
    offline HTML file)."""
    figure = edge_heatmap(edges, "total")
    grids = {column: _edge_grid(edges, column) for column in EDGE_COLUMNS}
    limit = max(float(grid.abs().max().max()) for grid in grids.values())
    figure.update_traces(zmin=-limit, zmax=limit)
    buttons = [
        dict(
            label=label,
            method="update",
            args=[
                {"z": [grids[column].to_numpy(dtype=float)]},
                {"title.text": f"First-order sensitivity ({label}): Δloss of a small step towards the knockout"},
            ],
        )
        for column, label in EDGE_COLUMNS.items()
    ]
    figure.update_layout(
        updatemenus=[
            dict(type="buttons", direction="right", buttons=buttons, x=1, y=1.02, xanchor="right", yanchor="bottom")
        ],
        margin=dict(t=100),
    )
    return figure


def agreement_scatter(edges: pd.DataFrame, knockouts: pd.DataFrame) -> go.Figure:
    """The first-order sensitivity of each edge against its exact knockout (`edge_knockouts` or `causal_routing`)."""
    import plotly.graph_objects as go

    merged = edges.merge(knockouts[["consumer", "source", "delta_loss"]], on=["consumer", "source"])
    figure = go.Figure(
        go.Scatter(
            x=merged["delta_loss"],
            y=merged["total"],
            mode="markers",
            marker=dict(
                color=merged["max_alpha"],
                colorscale=SEQUENTIAL,
                cmin=0,
                cmax=1,
                showscale=True,
                colorbar=dict(title=dict(text="max α")),
            ),
            text=merged["consumer_label"] + " ← " + merged["source_label"],
            hovertemplate="%{text}<br>exact %{x:.4g}<br>estimate %{y:.4g}<extra></extra>",
        )
    )
    low = float(min(merged["delta_loss"].min(), merged["total"].min()))
    high = float(max(merged["delta_loss"].max(), merged["total"].max()))
    figure.add_trace(
        go.Scatter(
            x=[low, high],
            y=[low, high],
            mode="lines",
            line=dict(dash="dot", color="#888"),
            name="estimate = exact",
            hoverinfo="skip",
        )
    )
    figure.update_xaxes(title="exact Δloss (masked forward pass)")
    figure.update_yaxes(title="first-order sensitivity")
    return _layout(figure, "First-order sensitivity vs exact knockouts", showlegend=False)


def audit_figure(consumers: pd.DataFrame) -> go.Figure:
    """Per consumer: Spearman(α mass, Δloss) with its bootstrap CI, and the Δloss of the two null schedules."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=(
            "Spearman(α mass, Δloss) over a consumer's sources",
            "Δloss when α is replaced by a null schedule",
        ),
    )
    labels = consumers["consumer_label"]
    figure.add_trace(
        go.Scatter(
            x=labels,
            y=consumers["spearman"],
            mode="markers",
            name="Spearman",
            marker=dict(color="#4c72b0"),
            error_y=dict(
                type="data",
                symmetric=False,
                array=consumers["spearman_high"] - consumers["spearman"],
                arrayminus=consumers["spearman"] - consumers["spearman_low"],
            ),
        ),
        row=1,
        col=1,
    )
    for name, color in (("mean", "#dd8452"), ("recency", "#55a868")):
        value = consumers[f"null_{name}_dloss"]
        figure.add_trace(
            go.Bar(
                x=labels,
                y=value,
                name=f"{name} schedule",
                marker_color=color,
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=consumers[f"null_{name}_dloss_high"] - value,
                    arrayminus=value - consumers[f"null_{name}_dloss_low"],
                ),
            ),
            row=1,
            col=2,
        )
    figure.update_yaxes(range=[-1.05, 1.05], row=1, col=1)
    figure.update_xaxes(type="category")
    return _layout(figure, "Routing audit (95% bootstrap intervals over sequences)", 440, barmode="group")


def bridge_visits(taps: pd.DataFrame) -> pd.Series:
    """A tap table's visits (`conv_tap_decomposition` counts every layer's runs from 0) in the bridge's numbering
    (docs/interop.md §7): 1, 2, … on a looped layer (one that ran more than once), 0 on a layer that runs once."""
    looped = taps.groupby("layer")["visit"].transform("nunique") > 1
    return (taps["visit"] + 1).where(looped, 0)


def kv_shift_bars(kv: pd.DataFrame) -> go.Figure:
    """The KV-shift table's current- and shifted-key advantages per head, or a tap table's (a bridged Inkling
    model's `conv_tap_decomposition`) advantage of every lag, with the prefix score."""
    import plotly.graph_objects as go

    labels = "L" + kv["layer"].astype(str)
    if "visit" in kv:  # a looped layer's visits, named as the bridge's sublayers ('L3@1')
        visits = bridge_visits(kv)
        labels = labels.where(visits == 0, labels + "@" + visits.astype(str))
    labels = labels + "H" + kv["head"].astype(str)
    if "current_key_advantage" in kv:
        bars = [
            go.Bar(x=labels, y=kv["current_key_advantage"], name="current key (α1·q·K_k)"),
            go.Bar(x=labels, y=kv["shifted_key_advantage"], name="shifted key (α2·q·K_{k−1})"),
        ]
        title = "KV-shift decomposition on repeated tokens: which key finds the induction target"
    else:
        lags = sorted(
            int(column.removeprefix("key_advantage_lag")) for column in kv if column.startswith("key_advantage_lag")
        )
        bars = [
            go.Bar(
                x=labels, y=kv[f"key_advantage_lag{lag}"], name="current token (lag 0)" if lag == 0 else f"lag {lag}"
            )
            for lag in lags
        ]
        title = "K/V convolution taps on repeated tokens: which tap's key finds the induction target"
    figure = go.Figure(bars)
    figure.add_trace(
        go.Scatter(
            x=labels,
            y=kv["prefix_score"],
            name="prefix score (attention on target)",
            mode="markers",
            yaxis="y2",
            marker=dict(color="black", symbol="diamond"),
        )
    )
    figure.update_layout(
        yaxis=dict(title="score advantage at the induction target"),
        yaxis2=dict(title="prefix score", overlaying="y", side="right", range=[0, 1]),
    )
    figure.update_xaxes(title="head", type="category")
    return _layout(figure, title, barmode="group")


TIMELINE_PANELS = (
    ("loss", "eval_loss"),
    ("induction_score",),
    ("routing_entropy",),
    ("max_weight",),
    ("embedding_weight",),
)


# model-wide series: Okabe–Ito colours (colour-blind safe), apart from the per-consumer Viridis ramp
MODEL_WIDE_COLOURS = {"loss": "#000000", "eval_loss": "#E69F00", "induction_score": "#D55E00"}
KIND_DASHES = {"attn": "solid", "mlp": "dash", "final": "dot"}


def consumer_styles(timeline: pd.DataFrame) -> dict[int, dict[str, str]]:
    """{consumer: line style}: colour by depth (Viridis from the first consumer to the final readout) and dash by
    sublayer kind (attn solid, mlp dashed, final dotted), so every consumer's line is told apart however many there
    are; Plotly's ten default colours repeat from the eleventh."""
    from plotly.colors import sample_colorscale

    labels = timeline.loc[timeline["consumer"] >= 0, ["consumer", "consumer_label"]].drop_duplicates("consumer")
    labels = labels.sort_values("consumer")
    colours = sample_colorscale(SEQUENTIAL, [0.85 * i / max(len(labels) - 1, 1) for i in range(len(labels))])
    return {
        int(consumer): dict(color=colour, dash=KIND_DASHES.get(str(label).rsplit(".", 1)[-1], "dashdot"))
        for (consumer, label), colour in zip(labels.itertuples(index=False), colours)
    }


def timeline_figure(timeline: pd.DataFrame, changes: pd.DataFrame) -> go.Figure:
    """Loss, the induction score and per-consumer routing statistics over training, on one step axis; a dotted
    line marks where the loss and the induction score change fastest, labelled inside that series' own panel (two
    labels never share a row, so they cannot overlap)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = [panel for panel in TIMELINE_PANELS if timeline["series"].isin(panel).any()]
    figure = make_subplots(
        rows=len(panels),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.05,
        subplot_titles=[" / ".join(panel) for panel in panels],
    )
    styles, in_legend = consumer_styles(timeline), set()
    for row, panel in enumerate(panels, start=1):
        for series in panel:
            frame = timeline[timeline["series"] == series]
            for (consumer, label), curve in frame.groupby(["consumer", "consumer_label"], sort=True):
                name = label if consumer >= 0 else series  # one legend entry per consumer, toggling every panel
                line = styles[consumer] if consumer >= 0 else dict(color=MODEL_WIDE_COLOURS.get(series, "#555555"))
                figure.add_trace(
                    go.Scatter(
                        x=curve["step"],
                        y=curve["value"],
                        mode="lines",
                        name=name,
                        legendgroup=name,
                        showlegend=name not in in_legend,
                        line=line,
                        hovertemplate=f"{name}<br>step %{{x}}<br>%{{y:.4g}}<extra></extra>",
                    ),
                    row=row,
                    col=1,
                )
                in_legend.add(name)
    first, last = int(timeline["step"].min()), int(timeline["step"].max())
    for series in ("loss", "induction_score"):
        hit = changes[(changes["series"] == series) & (changes["consumer"] < 0)]
        row = next((row for row, panel in enumerate(panels, start=1) if series in panel), None)
        if len(hit) and row is not None:
            step = int(hit["step"].iloc[0])
            figure.add_vline(x=step, line_dash="dot", line_color="#888")
            right_half = step > (first + last) / 2  # the label reads away from the nearer edge
            figure.add_annotation(
                x=step,
                y=1.0,
                xref="x",
                yref="y domain",
                row=row,
                col=1,
                showarrow=False,
                xanchor="right" if right_half else "left",
                yanchor="top",
                xshift=-4 if right_half else 4,
                text=f"fastest {series.replace('_', ' ')}: step {step}",
                font=dict(size=11),
                bgcolor="rgba(255,255,255,0.85)",
            )
    figure.update_xaxes(title="step", row=len(panels), col=1)
    return _layout(figure, "Training timeline", 180 * len(panels) + 120, margin=dict(l=10, r=10, t=80, b=10))


# ---------------------------------------------------------------------------- the HTML report
def _table(frame: pd.DataFrame, columns: list[str] | None = None) -> str:
    frame = frame if columns is None else frame[[column for column in columns if column in frame]]
    return (
        '<div class="wide">'
        + frame.to_html(index=False, float_format=lambda value: f"{value:.4g}", border=0)
        + "</div>"
    )


KNOCKOUT_COLUMNS = [
    "rank",
    "consumer_label",
    "source_label",
    "alpha_mass",
    "delta_loss",
    "delta_loss_low",
    "delta_loss_high",
    "measured",
    "sequences",
]
AUDIT_COLUMNS = [
    "consumer_label",
    "n_sources",
    "spearman",
    "spearman_low",
    "spearman_high",
    "top_mass_label",
    "top_effect_label",
    "null_mean_dloss",
    "null_mean_dloss_low",
    "null_mean_dloss_high",
    "null_recency_dloss",
    "null_recency_dloss_low",
    "null_recency_dloss_high",
]
REPORT_STYLE = STYLE + ".wide { overflow-x: auto; max-width: 100%; }\n"


def attribution_report_html(
    tables: dict[str, pd.DataFrame],
    summary: dict[str, Any],
    title: str | None = None,
    codec: TextCodec | None = None,
) -> str:
    """The report as one HTML string, a section per analysis; plotly.js embedded once, so it opens offline. Tokens
    are named by their text where the run encodes text (`codec`, `prompts.text_codec`), else by id."""
    title = title or f"Attribution through depth: {summary.get('run', '')}"
    sections: list[tuple[str, str, list[Any], str]] = []  # heading, note, figures, table HTML
    if "depth_dla" in tables:  # tables a model does not support are listed under "Not computed" (the summary)
        sections.append(
            (
                "Direct logit attribution through depth",
                "Exact: with the final norm's scale frozen at its clean value, the per-source terms of a position sum "
                "to its logit minus the unembedding bias (on Inkling models the logit before the soft-cap, which "
                "is not linear; on mHC models, DeepSeek V4's included, the weights M that mix the streams into the "
                "final norm's input are frozen at the clean pass too). The table averages the correct-token logit "
                "over held-out answer positions.",
                [
                    dla_heatmap(tables["depth_dla"], codec=codec),
                    dla_summary_bars(tables["depth_dla_summary"]),
                ],
                _table(tables["depth_dla_summary"]),
            )
        )
    sections += [
        (
            "Logit lens over depth",
            "Every source and every sublayer input decoded through the final norm (recomputed on the vector) and the "
            "unembedding.",
            [
                lens_heatmap(tables["logit_lens"], codec=codec),
                lens_summary_figure(tables["logit_lens_summary"]),
            ],
            "",
        ),
    ]
    if "edge_knockouts" in tables:
        agreement = summary.get("edge_agreement", {})
        knockouts = tables["edge_knockouts"]

        def number(key: str, digits: int) -> str:  # the summary holds None for NaN (JSON has no NaN)
            value = agreement.get(key)
            return "n/a" if value is None or value != value else f"{value:.{digits}f}"

        sections += [
            (
                "Depth edges: exact knockouts",
                "Each source knocked out of each consumer's depth softmax alone (the others renormalise), the loss "
                "change measured, not estimated: every edge on a screen of the sequences, then the "
                f"{int((knockouts['measured'] == 'all').sum())} with the largest effect on every sequence "
                f"({knockouts.attrs['cost']:.2f}× the knockout passes of every edge on every sequence), with 95% "
                "bootstrap intervals over the sequences each was measured on. Edges ranked by Δloss.",
                [edge_heatmap(knockouts, "delta_loss")],
                _table(knockouts.head(15), KNOCKOUT_COLUMNS),
            ),
            (
                "First-order sensitivity: value and routing paths",
                f"The loss's slope along each knockout, from one forward and one backward pass (buttons: total, value "
                f"path, routing path): a small-perturbation sensitivity, not an estimate of the knockout. Against the "
                f"knockouts: Spearman {number('spearman', 3)}, Pearson {number('pearson', 3)}, top-"
                f"{agreement.get('recall_top', 10)} recall {number('top_recall', 2)} over "
                f"{plural(agreement.get('n_edges', 0), 'edge')} ({number('spearman_within_consumer', 3)} Spearman within "
                f"consumers; n/a where no consumer reads three sources), sign agreement {number('sign_agreement', 2)}. "
                "It departs most where a softmax is saturated (max α near 1); the largest disagreements are listed.",
                [
                    edge_heatmap_with_toggle(tables["edge_sensitivity"]),
                    agreement_scatter(tables["edge_sensitivity"], knockouts),
                ],
                _table(tables["edge_agreement"]),
            ),
        ]
    if "edge_knockouts_visits" in tables:
        sections.append(
            (
                "Looped layers: knockouts of every visit together",
                "One source, by label, knocked out of every visit's depth softmax of a looped consumer at once "
                "(exact Δloss on every sequence), beside the sum of the knockouts in one visit at a time.",
                [],
                _table(tables["edge_knockouts_visits"]),
            )
        )
    if "routing_audit_consumers" in tables:
        sections.append(
            (
                "Routing audit",
                "α mass against the exact effect of each knockout, per consumer, with 95% bootstrap intervals over "
                "sequences. Null schedules replace a consumer's α by its token mean (content-independent) or by one "
                "recency profile pooled over consumers.",
                [audit_figure(tables["routing_audit_consumers"])],
                _table(tables["routing_audit_consumers"], AUDIT_COLUMNS),
            )
        )
    if "kv_shift" in tables:
        taps = "current_key_advantage" not in tables["kv_shift"]  # a bridged Inkling model's convolution taps
        sections.append(
            (
                "K/V convolution taps" if taps else "KV-shift decomposition",
                (
                    "Scores and outputs split by tap of the short K/V convolutions (lag 0 the current token) on repeated "
                    "tokens; rows per layer, visit (from 0 per pass) and head. "
                    if taps
                    else "Scores split into current-key and shifted-key parts on repeated tokens. "
                )
                + "Shifted-key induction score "
                "≈ 1: a one-layer KV-shift induction head; ≈ 0: the target is found through the current key (the "
                "two-layer previous-token + induction circuit).",
                [kv_shift_bars(tables["kv_shift"])],
                _table(tables["kv_shift"], None if taps else KV_SHIFT_COLUMNS),
            )
        )
    if "timeline" in tables and len(tables["timeline"]):
        changes = tables["timeline_changes"]
        sections.append(
            (
                "Training timeline",
                "From the run's recorded snapshots; dotted lines mark where the loss "
                "and the induction score change fastest.",
                [timeline_figure(tables["timeline"], changes)],
                _table(changes[changes["consumer"] < 0]),
            )
        )
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{REPORT_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Model {html.escape(str(summary.get('variant')))}, checkpoint "
        f"{html.escape(str(summary.get('checkpoint')))}, {summary.get('samples')} held-out sequences. Prompt "
        f"for the per-position views: <code>{html.escape(str(summary.get('prompt', '')))}</code>"
        + (f" (the text {html.escape(repr(summary['prompt_text']))})" if "prompt_text" in summary else "")
        + ".</p>",
        *skipped_html(summary),
    ]
    first = True
    for heading, note, figures, table in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", f'<p class="note">{html.escape(note)}</p>']
        for figure in figures:
            # plotly.js goes inline with the first figure only; later figures reuse it
            parts.append(figure.to_html(full_html=False, include_plotlyjs=first, config={"displaylogo": False}))
            first = False
        parts.append(table)
    parts.append("</body></html>")
    return "\n".join(parts)
