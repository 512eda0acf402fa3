"""Plotly figures built from run tables. Pure functions of DataFrames, so they are easy to test and export.

Colour scales are colour-blind safe: Viridis / Cividis for magnitudes, RdBu (ColorBrewer, CB-safe) centred on
zero for signed scores; every colour bar is titled with the quantity and its scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from attnres_lens.analysis.induction import head_row_labels
from attnres_lens.analysis.prompts import TextCodec, position_label

SEQUENTIAL = "Viridis"
SIGNED = "RdBu_r"
KIND_TITLES = {"attn": "pre-attention", "mlp": "pre-MLP", "final": "final readout"}


def _layout(fig: go.Figure, title: str, height: int = 420, **layout) -> go.Figure:
    fig.update_layout(
        title=title, height=height, margin=dict(l=10, r=10, t=50, b=10), template="plotly_white", **layout
    )
    return fig


# Printed cell values (docs/architecture.md §5): a grid of at most 8 columns and 120 cells (a Block AttnRes panel)
# at the default size; up to 16 columns and 272 cells (a 6-layer Full AttnRes panel, 13 sources) in a smaller font;
# larger grids only on hover, where printed values would no longer fit their cells.
CELL_TEXT_RULES = ((8, 120, 12), (16, 272, 9))  # (max columns, max cells, font size)


def cell_text(shape: tuple[int, int]) -> tuple[str | None, int]:
    """(texttemplate, font size) for a heatmap of `shape` (rows, columns): values to two decimals, or None."""
    rows, columns = shape
    for max_columns, max_cells, size in CELL_TEXT_RULES:
        if columns <= max_columns and rows * columns <= max_cells:
            return "%{z:.2f}", size
    return None, 12


def heatmap(
    matrix: pd.DataFrame,
    title: str,
    colorbar: str,
    zmin: float | None = None,
    zmax: float | None = None,
    colorscale: str = SEQUENTIAL,
    zmid: float | None = None,
    x_title: str = "",
    y_title: str = "",
    hover: str = "value",
    height: int | None = None,
) -> go.Figure:
    """A labelled heatmap of `matrix` (rows top to bottom), values printed in cells by `cell_text`'s rule."""
    template, font_size = cell_text(matrix.shape)
    trace = go.Heatmap(
        z=matrix.to_numpy(dtype=float),
        x=[str(c) for c in matrix.columns],
        y=[str(i) for i in matrix.index],
        colorscale=colorscale,
        zmin=zmin,
        zmax=zmax,
        zmid=zmid,
        colorbar=dict(title=dict(text=colorbar)),
        hovertemplate=f"{y_title or 'row'} %{{y}}<br>{x_title or 'column'} %{{x}}<br>{hover} = %{{z:.4g}}<extra></extra>",
        texttemplate=template,
        textfont=dict(size=font_size),
        hoverongaps=False,
        xgap=1,
        ygap=1,
    )
    fig = go.Figure(trace)
    fig.update_yaxes(autorange="reversed", title=y_title, type="category")
    fig.update_xaxes(title=x_title, type="category")
    return _layout(fig, title, height or max(260, 60 + 28 * len(matrix.index)))


# ---------------------------------------------------------------------------- depth attention
def source_order(frame: pd.DataFrame) -> list[str]:
    """Source labels as heatmap columns: by first position, with Block AttnRes' "partial" last."""
    first = frame.groupby("source_label")["source"].min()
    return sorted(first.index, key=lambda label: (label == "partial", first[label], label))


def depth_matrix(weights: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Consumer × source matrix of token-averaged α for one step and one panel kind (NaN: not a source)."""
    panel = weights[weights["kind"] == kind]
    matrix = panel.pivot_table(index=["consumer", "consumer_label"], columns="source_label", values="weight")
    matrix = matrix.sort_index().droplevel("consumer")
    return matrix.reindex(columns=source_order(panel))


def depth_heatmap(weights: pd.DataFrame, kind: str, title: str, zmax: float, subtitle: str) -> go.Figure:
    return heatmap(
        depth_matrix(weights, kind),
        f"{KIND_TITLES[kind]}, {title}<br><sup>{subtitle}</sup>",
        "α (token mean)",
        0.0,
        zmax,
        x_title="source",
        y_title="consumer",
        hover="α",
    )


def per_token_heatmap(per_token: pd.DataFrame, consumer: int, title: str, codec: TextCodec | None = None) -> go.Figure:
    """α of one consumer at every position of sequence 0; tokens named by their text where the run encodes text."""
    rows = per_token[(per_token["consumer"] == consumer) & (per_token["sequence"] == 0)]
    rows = rows.assign(row=[position_label(p, t, codec=codec) for p, t in zip(rows["position"], rows["token"])])
    matrix = rows.pivot_table(index=["position", "row"], columns="source_label", values="weight")
    matrix = matrix.sort_index().droplevel("position").reindex(columns=source_order(rows))
    return heatmap(
        matrix,
        title,
        "α",
        0.0,
        1.0,
        x_title="source",
        y_title="position: token",
        hover="α",
        height=max(320, 40 + 16 * len(matrix.index)),
    )


def mixing_heatmap(mixing: pd.DataFrame, title: str, zmax: float, zmin: float = 0.0) -> go.Figure:
    """M as consumer × output; with a negative `zmin` (DenseFormer's weights are unconstrained) on the signed scale
    centred on zero, so a negative coefficient never shares the colour of zero."""
    matrix = mixing.pivot_table(
        index=["consumer", "consumer_label"], columns=["sublayer", "sublayer_label"], values="weight"
    )
    matrix = matrix.sort_index().droplevel("consumer")
    matrix = matrix.sort_index(axis=1).droplevel("sublayer", axis=1)
    if zmin < 0:
        bound = max(zmax, -zmin)
        return heatmap(
            matrix,
            title,
            "effective weight M",
            -bound,
            bound,
            SIGNED,
            zmid=0.0,
            x_title="sublayer output (emb = e)",
            y_title="sublayer input",
            hover="M",
        )
    return heatmap(
        matrix,
        title,
        "effective weight M",
        0.0,
        zmax,
        x_title="sublayer output (emb = e)",
        y_title="sublayer input",
        hover="M",
    )


# ---------------------------------------------------------------------------- training dynamics
def curves(
    series: Sequence[tuple[str, pd.DataFrame]],
    columns: Sequence[tuple[str, str]],
    title: str,
    y_title: str,
    log_y: bool = False,
) -> go.Figure:
    """Lines of `columns` [(column, name)] against step, one colour per run, one dash per column."""
    fig = go.Figure()
    colours = sample_colorscale(SEQUENTIAL, np.linspace(0, 0.9, max(len(series), 2)))
    dashes = ["solid", "dash", "dot"]
    for (run_name, metrics), colour in zip(series, colours):
        for (column, name), dash in zip(columns, dashes):
            if column not in metrics:
                continue
            rows = metrics[["step", column]].dropna()
            fig.add_scatter(
                x=rows["step"],
                y=rows[column],
                mode="lines",
                name=f"{run_name} · {name}",
                line=dict(color=colour, dash=dash),
                hovertemplate=f"{run_name}<br>{name}<br>step %{{x}}: %{{y:.4g}}<extra></extra>",
            )
    fig.update_xaxes(title="step")
    fig.update_yaxes(title=y_title, type="log" if log_y else "linear")
    return _layout(fig, title, showlegend=True, legend=dict(orientation="h", y=-0.25))


def by_depth_lines(
    frame: pd.DataFrame, x: str, x_labels: str, value: str, title: str, y_title: str, log_y: bool = False
) -> go.Figure:
    """`value` against depth, one line per recorded step, coloured from early (dark) to late (yellow)."""
    fig = go.Figure()
    steps = sorted(frame["step"].unique())
    colours = sample_colorscale(SEQUENTIAL, np.linspace(0, 1, max(len(steps), 2)))
    for step, colour in zip(steps, colours):
        rows = frame[frame["step"] == step].sort_values(x)
        fig.add_scatter(
            x=rows[x_labels],
            y=rows[value],
            mode="lines+markers",
            name=f"step {step}",
            line=dict(color=colour),
            marker=dict(size=5),
            hovertemplate=f"step {step}<br>%{{x}}: %{{y:.4g}}<extra></extra>",
        )
    fig.update_xaxes(
        title="depth",
        type="category",
        categoryorder="array",
        categoryarray=list(frame.sort_values(x)[x_labels].drop_duplicates()),
    )
    fig.update_yaxes(title=y_title, type="log" if log_y else "linear")
    return _layout(fig, title)


def last_step_by_depth(
    series: Sequence[tuple[str, pd.DataFrame]],
    x: str,
    x_labels: str,
    value: str,
    title: str,
    y_title: str,
    log_y: bool = False,
) -> go.Figure:
    """`value` against depth at each run's last recorded step, one line per run."""
    fig = go.Figure()
    colours = sample_colorscale(SEQUENTIAL, np.linspace(0, 0.9, max(len(series), 2)))
    for (run_name, frame), colour in zip(series, colours):
        step = frame["step"].max()
        rows = frame[frame["step"] == step].sort_values(x)
        fig.add_scatter(
            x=rows[x],
            y=rows[value],
            mode="lines+markers",
            name=f"{run_name} (step {step})",
            line=dict(color=colour),
            customdata=rows[x_labels],
            hovertemplate=f"{run_name}<br>%{{customdata}}: %{{y:.4g}}<extra></extra>",
        )
    fig.update_xaxes(title="depth (sublayer or block index)")
    fig.update_yaxes(title=y_title, type="log" if log_y else "linear")
    return _layout(fig, title)


def depth_step_heatmap(
    frame: pd.DataFrame, x: str, x_labels: str, value: str, title: str, colorbar: str, log_z: bool = False
) -> go.Figure:
    matrix = frame.pivot_table(index=[x, x_labels], columns="step", values=value).sort_index().droplevel(x)
    if log_z:
        matrix = np.log10(matrix.clip(lower=1e-12))
        colorbar = f"log10 {colorbar}"
    fig = heatmap(matrix, title, colorbar, colorscale="Cividis", x_title="step", y_title="depth", hover=colorbar)
    fig.update_traces(texttemplate=None)
    return fig


# ---------------------------------------------------------------------------- induction heads
def layer_head_heatmap(
    scores: pd.DataFrame, value: str, title: str, colorbar: str, zmin: float | None, zmax: float | None, signed: bool
) -> go.Figure:
    if "visit" in scores:  # a bridged Inkling model: one row per layer, or per visit of a looped layer ('L3@2')
        labels = head_row_labels(scores)
        matrix = scores.assign(row=labels).pivot(index="row", columns="head", values=value).loc[labels.unique()]
    else:
        matrix = scores.pivot_table(index="layer", columns="head", values=value).sort_index()
        matrix.index = [f"L{layer}" for layer in matrix.index]
    matrix.columns = [f"H{head}" for head in matrix.columns]
    if signed:
        values = np.abs(matrix.to_numpy(dtype=float))
        # an all-NaN score (a column a bridged model leaves out) draws empty cells on the default scale
        bound = (float(np.nanmax(values)) if np.isfinite(values).any() else 0.0) or 1.0
        return heatmap(
            matrix, title, colorbar, -bound, bound, SIGNED, zmid=0.0, x_title="head", y_title="layer", hover=value
        )
    return heatmap(matrix, title, colorbar, zmin, zmax, x_title="head", y_title="layer", hover=value)


def score_over_training(scores: pd.DataFrame, value: str, title: str, y_title: str) -> go.Figure:
    fig = go.Figure()
    heads = scores[["layer", "head"]].drop_duplicates().sort_values(["layer", "head"]).itertuples(index=False)
    heads = list(heads)
    colours = sample_colorscale(SEQUENTIAL, np.linspace(0, 0.9, max(len(heads), 2)))
    for (layer, head), colour in zip(heads, colours):
        rows = scores[(scores["layer"] == layer) & (scores["head"] == head)].sort_values("step")
        fig.add_scatter(
            x=rows["step"],
            y=rows[value],
            mode="lines+markers",
            name=f"L{layer}H{head}",
            line=dict(color=colour),
            marker=dict(size=4),
            hovertemplate=f"L{layer}H{head}<br>step %{{x}}: %{{y:.3f}}<extra></extra>",
        )
    fig.update_xaxes(title="step")
    fig.update_yaxes(title=y_title)
    return _layout(fig, title)


def pattern_heatmap(pattern: np.ndarray, tokens: Sequence[int], title: str) -> go.Figure:
    labels = [position_label(position, token) for position, token in enumerate(tokens)]
    matrix = pd.DataFrame(pattern, index=labels, columns=labels)
    fig = heatmap(
        matrix,
        title,
        "attention",
        0.0,
        1.0,
        x_title="key position: token",
        y_title="query position: token",
        hover="attention",
        height=max(420, 60 + 9 * len(labels)),
    )
    fig.update_traces(texttemplate=None)
    return fig


def kv_shift_figure(kv: pd.DataFrame, title: str) -> go.Figure:
    coefficients = [
        ("alpha1", "α1 (key, current)"),
        ("alpha2", "α2 (key, previous)"),
        ("beta1", "β1 (value, current)"),
        ("beta2", "β2 (value, previous)"),
    ]
    fig = make_subplots(rows=1, cols=4, subplot_titles=[name for _, name in coefficients], shared_yaxes=True)
    heads = list(kv[["layer", "head"]].drop_duplicates().sort_values(["layer", "head"]).itertuples(index=False))
    colours = sample_colorscale(SEQUENTIAL, np.linspace(0, 0.9, max(len(heads), 2)))
    for column, (coefficient, name) in enumerate(coefficients, start=1):
        for (layer, head), colour in zip(heads, colours):
            rows = kv[(kv["layer"] == layer) & (kv["head"] == head)].sort_values("step")
            fig.add_scatter(
                x=rows["step"],
                y=rows[coefficient],
                mode="lines",
                name=f"L{layer}H{head}",
                legendgroup=f"L{layer}H{head}",
                showlegend=column == 1,
                line=dict(color=colour),
                hovertemplate=f"L{layer}H{head} {name}<br>step %{{x}}: %{{y:.3f}}<extra></extra>",
                row=1,
                col=column,
            )
    fig.update_xaxes(title="step")
    fig = _layout(fig, title, height=400)
    fig.update_layout(margin=dict(t=90))  # room for the title above the subplot titles
    return fig
