"""The self-contained HTML reports of `prune` and `analyze`: one file each, plotly.js embedded once, no network
needed to open it."""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import pandas as pd

from attnres_lens.analysis.induction import head_row_labels
from attnres_lens.analysis_options import plural

MODE_NAMES = {"remove": "remove", "mean": "mean-ablate", "resample": "resample-ablate"}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; }
.note { color: #555; font-size: 0.9em; }
"""


def padded_range(values: np.ndarray, margin: float = 0.06) -> list[float] | None:
    """[low, high] around the finite `values` with `margin` of their span on each side (of the value itself when
    they are all equal), so no curve or marker touches the frame; None (autorange) without finite values."""
    finite = values[np.isfinite(values)]
    if not len(finite):
        return None
    low, high = float(finite.min()), float(finite.max())
    pad = margin * ((high - low) or abs(high) or 1.0)
    return [low - pad, high + pad]


def _figures(tables: dict[str, pd.DataFrame], metric: str, tolerance: float) -> list[tuple[str, Any, str]]:
    import plotly.graph_objects as go

    sensitivity, curves, distances = tables["pruning_sensitivity"], tables["pruning_curves"], tables["angular_distance"]
    column, axis = ("dloss", "Δ loss") if metric == "loss" else ("dacc", "Δ accuracy")
    bars = go.Figure(
        [
            go.Bar(name=name, x=sensitivity["label"], y=sensitivity[f"{column}_{mode}"])
            for mode, name in MODE_NAMES.items()
        ]
    )
    bars.update_layout(barmode="group", xaxis_title="sublayer", yaxis_title=axis, height=420)

    value = "loss" if metric == "loss" else "accuracy"
    cumulative = go.Figure(
        [
            go.Scatter(name=strategy, x=curve["n_removed"], y=curve[value], mode="lines+markers")
            for strategy, curve in curves.groupby("strategy", sort=False)
        ]
    )
    base = curves.loc[curves["n_removed"] == 0, "loss"].iloc[0]
    shown = [curves[value].to_numpy(dtype=float)]
    if metric == "loss":
        threshold = base * (1 + tolerance)
        cumulative.add_hline(
            y=threshold, line_dash="dot", annotation_text=f"+{tolerance:.0%} loss", annotation_position="top left"
        )
        shown.append(np.array([threshold]))
    cumulative.update_layout(
        xaxis_title="sublayers removed", yaxis_title=value, height=460, yaxis_range=padded_range(np.concatenate(shown))
    )

    grid = distances.pivot(index="start_label", columns="n", values="distance")
    grid = grid.reindex(distances.drop_duplicates("start")["start_label"])
    heatmap = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(), x=grid.columns.tolist(), y=grid.index.tolist(), colorscale="Viridis", colorbar_title="d"
        )
    )
    heatmap.update_layout(
        xaxis_title="n (sublayers spanned)",
        yaxis_title="start ℓ (representation entering)",
        yaxis_autorange="reversed",
        height=560,
    )

    figures = [
        (f"{axis} per sublayer", bars, "One sublayer at a time; remove follows the residual kind's own rule."),
        (
            f"{value.capitalize()} vs sublayers removed",
            cumulative,
            "Each strategy removes its first k sublayers; 'measured' orders by the one-at-a-time effect above.",
        ),
        (
            "Angular distance d(ℓ, ℓ+n)",
            heatmap,
            "arccos(cos(x_ℓ, x_{ℓ+n}))/π averaged over tokens (Gromov et al.); small = the span changes little.",
        ),
    ]
    routing = tables.get("routing")
    if routing is not None and len(routing):
        scatter = go.Figure()
        for kind, group in routing.groupby("kind", sort=False):
            scatter.add_trace(
                go.Scatter(
                    name=f"pre-{kind}" if kind != "final" else "final readout",
                    x=group["alpha_mass"],
                    y=group["delta_loss"],
                    mode="markers",
                    text=group["consumer_label"] + " ← " + group["source_label"],
                    hovertemplate="%{text}<br>α=%{x:.3f}<br>Δloss=%{y:.4f}",
                )
            )
        scatter.update_layout(
            xaxis_title="α mass received (token mean)", yaxis_title="Δ loss when masked from that consumer", height=460
        )
        figures.append(
            (
                "Causal depth routing: α mass vs effect of masking",
                scatter,
                "One point per consumer × source; routing mass is not causal importance.",
            )
        )
    return figures


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, float_format=lambda value: f"{value:.4g}", border=0)


def prune_report_html(
    tables: dict[str, pd.DataFrame],
    summary: dict[str, Any],
    metric: str = "loss",
    tolerance: float = 0.05,
    title: str | None = None,
) -> str:
    """The report as one HTML string: summary, removable-count and correlation tables, and the figures."""
    title = title or f"Layer-pruning report: {summary.get('run', '')}"
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Model {html.escape(str(summary.get('variant')))}, checkpoint {html.escape(str(summary.get('checkpoint')))}, "
        f"{summary.get('samples')} evaluation sequences of the run's task. Clean loss {summary['base_loss']:.4f}, "
        f"accuracy on answer positions {summary['base_accuracy']:.4f}. Ordering metric: {html.escape(metric)}.</p>",
        f"<h2>Sublayers removable within +{tolerance:.0%} loss</h2>",
        _table(tables["removable"]),
        "<h2>Cheap metrics vs measured removal effect (Spearman)</h2>",
        _table(tables["metric_correlations"]),
    ]
    if "pruning_visits" in tables:
        parts += [
            "<h2>Looped layers: every visit removed together</h2>",
            '<p class="note">Each visit alone is a row of the sensitivity table; here all visits of a looped '
            "sublayer go at once, beside the sum of their single removals.</p>",
            _table(tables["pruning_visits"]),
        ]
    if "routing" in tables:
        correlations = summary.get("routing_correlations", {})
        parts += [
            "<h2>Routing: largest disagreements between α mass and causal effect</h2>",
            f"<p>Spearman(α mass, Δloss) over all consumer × source pairs: {correlations.get('overall', float('nan')):.3f}; "
            f"mean within consumers: {correlations.get('within_consumer', float('nan')):.3f}.</p>",
            _table(
                tables["routing_disagreements"][
                    ["consumer_label", "source_label", "alpha_mass", "delta_loss", "rank_gap", "direction"]
                ]
            ),
        ]
    for index, (heading, figure, note) in enumerate(_figures(tables, metric, tolerance)):
        # An explicit template: importing streamlit changes Plotly's default one.
        figure.update_layout(template="plotly_white")
        # plotly.js goes inline with the first figure only; later figures reuse it.
        body = figure.to_html(full_html=False, include_plotlyjs=index == 0, config={"displaylogo": False})
        parts += [f"<h2>{html.escape(heading)}</h2>", f'<p class="note">{html.escape(note)}</p>', body]
    parts.append("</body></html>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------- the analyze report
def _heatmap(matrix: pd.DataFrame, colorbar: str, x_title: str, y_title: str, **trace: Any) -> Any:
    import plotly.graph_objects as go

    figure = go.Figure(
        go.Heatmap(
            z=matrix.to_numpy(dtype=float),
            x=[str(c) for c in matrix.columns],
            y=[str(i) for i in matrix.index],
            colorbar_title=colorbar,
            hoverongaps=False,
            xgap=1,
            ygap=1,
            **trace,
        )
    )
    figure.update_xaxes(title=x_title, type="category")
    figure.update_yaxes(title=y_title, type="category", autorange="reversed")
    figure.update_layout(height=max(300, 80 + 26 * len(matrix.index)))
    return figure


def _analysis_figures(tables: dict[str, pd.DataFrame]) -> list[tuple[str, Any, str]]:
    import plotly.graph_objects as go

    icl = tables["icl_per_position"]
    loss = go.Figure(go.Scatter(x=icl["position"], y=icl["loss"], mode="lines"))
    loss.update_layout(xaxis_title="position t (predicting token t+1)", yaxis_title="mean loss (nats)", height=380)
    figures = []
    if "induction_heads" in tables:  # skipped on models other than the toolkit's own (the summary says why)
        scores = tables["induction_heads"]
        if "visit" in scores:  # a bridged Inkling model: one row per layer or visit of a looped layer ('L3@2')
            labels = head_row_labels(scores)
            heads = scores.assign(row=labels).pivot(index="row", columns="head", values="prefix_score")
            heads = heads.loc[labels.unique()]
        else:
            heads = scores.pivot(index="layer", columns="head", values="prefix_score")
        figures.append(
            (
                "Induction heads: prefix-matching score",
                _heatmap(heads, "prefix score", "head", "layer", colorscale="Viridis", zmin=0.0, zmax=1.0),
                "Attention from the second copy of a repeated sequence to the token after the earlier copy of the "
                "current token (docs/analysis.md §2).",
            )
        )
    figures.append(
        (
            "Loss per position (in-context learning)",
            loss,
            "Mean next-token loss over the held-out sequences; falling with position = the context helps (§3).",
        )
    )
    if "depth_weights" in tables:
        weights = tables["depth_weights"]
        for kind, name in (("attn", "pre-attention"), ("mlp", "pre-MLP"), ("final", "final readout")):
            panel = weights[weights["kind"] == kind]
            if panel.empty:
                continue
            order = panel.groupby("source_label")["source"].min()
            columns = sorted(order.index, key=lambda label: (label == "partial", order[label], label))
            matrix = (
                panel.pivot_table(index=["consumer", "consumer_label"], columns="source_label", values="weight")
                .sort_index()
                .droplevel("consumer")
                .reindex(columns=columns)
            )
            figures.append(
                (
                    f"Depth attention α, {name} consumers",
                    _heatmap(matrix, "α (token mean)", "source", "consumer", colorscale="Viridis", zmin=0.0),
                    "Token-averaged weight each consumer puts on each earlier source (§4).",
                )
            )
    if "depth_mixing" in tables:
        grid = (
            tables["depth_mixing"]
            .pivot_table(index=["consumer", "consumer_label"], columns=["sublayer", "sublayer_label"], values="weight")
            .sort_index()
            .droplevel("consumer")
        )
        grid = grid.sort_index(axis=1).droplevel("sublayer", axis=1)
        figures.append(
            (
                "Depth-mixing matrix M",
                _heatmap(grid, "M", "sublayer output (emb = e)", "sublayer input", colorscale="RdBu_r", zmid=0.0),
                "Effective weight of each sublayer output in each sublayer input, token-averaged; standard "
                "residual: all ones below the diagonal (§5).",
            )
        )
    return figures


def skipped_html(summary: dict[str, Any]) -> list[str]:
    """A report section listing the tables that do not apply to the run's model, each with its reason."""
    if not summary.get("skipped"):
        return []
    items = "".join(
        f"<li><b>{html.escape(row['table'])}</b>: {html.escape(row['reason'])}</li>" for row in summary["skipped"]
    )
    return ["<h2>Not computed for this model</h2>", f"<ul>{items}</ul>"]


def analysis_report_html(tables: dict[str, pd.DataFrame], summary: dict[str, Any], title: str | None = None) -> str:
    """`attnres-lens analyze`'s report as one HTML string: headline numbers, top induction heads, depth summary and
    the figures (induction scores, loss per position, depth maps); plotly.js embedded once, so it opens offline."""
    title = title or f"Analysis: {summary.get('run', '')}"
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>Model {html.escape(str(summary.get('variant')))}, checkpoint {html.escape(str(summary.get('checkpoint')))}, "
        f"{plural(summary['samples'], 'held-out sequence')} of the run's task. In-context-learning score "
        f"{summary['icl_score']:.4f} ({html.escape(summary['icl_score_definition'])}).</p>",
        *skipped_html(summary),
    ]
    if "top_induction_heads" in summary:
        parts += ["<h2>Top induction heads</h2>", _table(pd.DataFrame(summary["top_induction_heads"]))]
    if "depth_summary" in tables:
        summary = tables["depth_summary"]
        routes = ["route"] if summary["route"].nunique() > 1 else []  # multi-head: one row per route
        parts += [
            "<h2>Depth attention per consumer</h2>",
            _table(
                summary[
                    [
                        "consumer_label",
                        *routes,
                        "n_sources",
                        "normalized_entropy",
                        "sink_label",
                        "sink_score",
                        "embedding_weight",
                    ]
                ]
            ),
        ]
    for index, (heading, figure, note) in enumerate(_analysis_figures(tables)):
        figure.update_layout(template="plotly_white")  # explicit: importing streamlit changes Plotly's default
        body = figure.to_html(full_html=False, include_plotlyjs=index == 0, config={"displaylogo": False})
        parts += [f"<h2>{html.escape(heading)}</h2>", f'<p class="note">{html.escape(note)}</p>', body]
    parts.append("</body></html>")
    return "\n".join(parts)
