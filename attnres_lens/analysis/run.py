"""Analyses of a run directory: what `attnres-lens analyze`, `prune` and `attribute` compute and write.

`analyze_run`, `prune_run` and `attribute_run` share their leading signature (`path, *, checkpoint, samples, out,
progress`) and return an `AnalysisResult`: tables, summary (also written as JSON) and an offline HTML report.
Tables go to `RUN/analysis/` (or `--out`) as CSV and Parquet with the same stem. Evaluation data is the run's
own task: its fixed held-out set (`task.eval_batch(samples)`), so numbers are comparable across checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from attnres_lens.analysis.applicability import (
    INDUCTION_TOOLKIT_ONLY,
    bridged_inkling,
    is_toolkit_model,
    where_applicable,
)
from attnres_lens.analysis.attribution_report import (
    attribution_report_html,
    attribution_summary,
    attribution_tables,
)
from attnres_lens.analysis.depth import (
    depth_mixing_matrix,
    depth_summary,
    depth_weights,
    depth_weights_per_token,
    mixing_diagnostics,
)
from attnres_lens.analysis.induction import (
    BRIDGE_NAN_REASONS,
    in_context_learning_score,
    induction_head_scores,
    per_position_loss,
    task_probe,
)
from attnres_lens.analysis.prompts import parse_prompt, text_codec
from attnres_lens.analysis.pruning import (
    angular_distance_matrix,
    cumulative_pruning,
    metric_correlations,
    pruning_sensitivity,
    removable_within,
)
from attnres_lens.analysis.report import analysis_report_html, prune_report_html
from attnres_lens.analysis.routing import causal_routing, routing_correlations, routing_disagreements
from attnres_lens.analysis.session import analysis_session
from attnres_lens.analysis.visits import visit_groups, visit_removals
from attnres_lens.analysis.workers import ForkedJob, fork_available
from attnres_lens.analysis_options import (
    ANALYZE_SAMPLES,
    ATTRIBUTE_SAMPLES,
    MIN_SAMPLES,
    PRUNE_SAMPLES,
    check_metric,
    check_samples,
)
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.resources import check_samples_fit
from attnres_lens.rundir import (
    PathLike,
    Run,
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_parquet,
    load_run,
)
from attnres_lens.tasks.base import Batch, Task

REMOVAL_TOLERANCE = 0.05  # "how many sublayers can go for < 5% loss increase"
# What `icl_score` in analysis_summary.json means (docs/analysis.md §3), written beside it.
ICL_SCORE_DEFINITION = (
    "mean next-token loss over the last tenth of the context minus the mean over 10-20% of it "
    "(nats); negative = later context lowers the loss"
)
TOP_HEADS = 5  # induction heads listed in analysis_summary.json and printed by `analyze`
TOP_SOURCES = 2  # depth sources listed per consumer


def open_run(path: PathLike, checkpoint: str | int = "latest") -> tuple[Run, Task]:
    """The run with its model loaded from `checkpoint`, and its task (checked to build when config.json is read)."""
    run = load_run(path, checkpoint=str(checkpoint))
    return run, run.config.build_task()


def _check_out(out: PathLike | None, run: PathLike) -> None:
    """Before any work: an output folder given as `--out` may be missing (it is created) but not a file, not the
    root of a run directory (the outputs would sit beside its config.json), and inside a run only the analysed
    `run`'s own analysis/ folder (a table named like a record, `depth_weights`, would replace
    records/depth_weights.parquet; another run's analysis/ would get this run's tables under its name)."""
    if out is None:
        return
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder (it is created if missing)")
    blocking = next((folder for folder in path.absolute().parents if folder.exists() and not folder.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"--out {out} cannot be created: {blocking} is a file; give a folder")
    if RunDir(path).holds_run():
        raise ValueError(f"--out {out} is a run directory; give a folder for the outputs, e.g. {path / 'analysis'}")
    resolved = path.resolve()
    for folder in resolved.parents:
        if RunDir(folder).holds_run():
            analysis = RunDir(folder).analysis_dir.resolve()
            if folder != Path(run).resolve():
                raise ValueError(
                    f"--out {out} is inside another run directory, {folder}; give a folder outside "
                    f"it, or leave --out out to write to {Path(run) / 'analysis'}"
                )
            if resolved != analysis and analysis not in resolved.parents:
                raise ValueError(
                    f"--out {out} is inside the run directory {folder}, where outputs go to its "
                    f"analysis folder only; give {analysis} or a folder outside the run"
                )
            return


def output_dir(run: Run, out: PathLike | None) -> Path:
    """Where a run-level analysis writes: `out`, else RUN/analysis/."""
    return Path(out) if out is not None else RunDir(run.path).analysis_dir


def write_tables(tables: dict[str, pd.DataFrame], out_dir: Path) -> list[Path]:
    """Each table as `name.csv` and `name.parquet` (atomic writes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, frame in tables.items():
        atomic_write_bytes(out_dir / f"{name}.csv", frame.to_csv(index=False).encode())
        atomic_write_parquet(out_dir / f"{name}.parquet", frame)
        written += [out_dir / f"{name}.csv", out_dir / f"{name}.parquet"]
    return written


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _run_header(run: Run, samples: int) -> dict[str, Any]:
    return dict(
        run=str(run.path),
        checkpoint=run.checkpoint,
        variant=run.model_config.variant,
        residual=run.model_config.residual,
        samples=samples,
    )


@dataclass
class AnalysisResult:
    """What a run-level analysis computed and wrote: its tables, summary (also as JSON) and HTML report."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    report_path: Path


def _prepare(
    path: PathLike, command: str, checkpoint: str | int, samples: int, out: PathLike | None
) -> tuple[Run, Task, Batch]:
    """The checks every run-level analysis makes before any work, then its run, task and held-out batch."""
    check_samples(samples, MIN_SAMPLES[command])
    _check_out(out, path)
    run, task = open_run(path, checkpoint)
    check_samples_fit(run.model, samples, task.seq_len)  # before the batch: it alone may not fit
    return run, task, task.eval_batch(samples)


def _write(
    tables: dict[str, pd.DataFrame], summary: dict[str, Any], html: str, out_dir: Path, name: str
) -> AnalysisResult:
    """The tables, `{name}_summary.json` and `{name}_report.html` under `out_dir`."""
    summary = _json_safe(summary)
    write_tables(tables, out_dir)
    atomic_write_json(out_dir / f"{name}_summary.json", summary)
    report_path = out_dir / f"{name}_report.html"
    atomic_write_bytes(report_path, html.encode())
    return AnalysisResult(tables, summary, report_path)


def analyze_run(
    path: PathLike,
    *,
    checkpoint: str | int = "latest",
    samples: int = ANALYZE_SAMPLES,
    out: PathLike | None = None,
    progress: bool = True,
) -> AnalysisResult:
    """Induction heads, in-context learning and depth maps of a run, written under `out` (default RUN/analysis/).

    Tables: induction_heads, icl_per_position, depth_mixing, mixing_diagnostics; for AttnRes models also depth_weights,
    depth_summary and depth_weights_tokens (per-token α of the first evaluation sequence); plus
    analysis_summary.json and analysis_report.html (docs/analysis.md §10).
    """
    run, task, batch = _prepare(path, "analyze", checkpoint, samples, out)
    model = run.model
    skipped: dict[str, str] = {}
    tables: dict[str, pd.DataFrame] = {}
    if is_toolkit_model(model) or bridged_inkling(model) is not None:
        probe = task_probe(model, task, samples)
        tables["induction_heads"] = induction_head_scores(model, probe, progress=progress)
    else:
        skipped["induction_heads"] = INDUCTION_TOOLKIT_ONLY
    tables["icl_per_position"] = per_position_loss(model, batch.tokens)
    for name, analysis in (("depth_mixing", depth_mixing_matrix), ("mixing_diagnostics", mixing_diagnostics)):
        table = where_applicable(model, skipped, name, lambda: analysis(model, batch.tokens))
        if table is not None:
            tables[name] = table
    if run.model_config.residual == "attnres":
        tables["depth_weights"] = depth_weights(model, batch.tokens)
        tables["depth_summary"] = depth_summary(model, batch.tokens)
        tables["depth_weights_tokens"] = depth_weights_per_token(model, batch.tokens[:1])
    summary = analysis_summary(tables, _run_header(run, samples), skipped)
    if "induction_heads" in tables and not is_toolkit_model(model):  # the columns a bridged model leaves NaN, and why
        summary["induction_columns_not_computed"] = dict(BRIDGE_NAN_REASONS)
    return _write(tables, summary, analysis_report_html(tables, summary), output_dir(run, out), "analysis")


def analysis_summary(
    tables: dict[str, pd.DataFrame], header: dict[str, Any], skipped: dict[str, str] | None = None
) -> dict[str, Any]:
    """The headline numbers of `analyze_run`'s tables after `header`: the ICL score with its definition, the top
    induction heads by prefix score (the first also as `top_induction_head`), for AttnRes models each consumer's
    largest depth sources, and `skipped` (table → why it does not apply to this model) where any was."""
    summary = {
        **header,
        "icl_score": in_context_learning_score(tables["icl_per_position"]),
        "icl_score_definition": ICL_SCORE_DEFINITION,
    }
    if "induction_heads" in tables:
        heads = tables["induction_heads"].sort_values("prefix_score", ascending=False, kind="stable")
        top_heads = [
            {
                "layer": int(row.layer),
                **({"visit": int(row.visit)} if "visit" in heads else {}),  # a bridged Inkling model's pass
                "head": int(row.head),
                "prefix_score": float(row.prefix_score),
                "tl_induction_score": float(row.tl_induction_score),
            }
            for row in heads.head(TOP_HEADS).itertuples()
        ]
        summary.update(top_induction_head=top_heads[0], top_induction_heads=top_heads)
    if skipped:
        summary["skipped"] = [{"table": name, "reason": reason} for name, reason in skipped.items()]
    if "depth_weights" in tables:
        # a consumer's several routes (multi-head AttnRes) summarised by their mean weight per source
        weights = (
            tables["depth_weights"]
            .groupby(["consumer", "consumer_label", "source", "source_label"], as_index=False, sort=False)["weight"]
            .mean()
        )
        weights = weights.sort_values(["consumer", "weight"], ascending=[True, False], kind="stable")
        summary["top_depth_sources"] = [
            {
                "consumer": int(consumer),
                "consumer_label": group["consumer_label"].iloc[0],
                "sources": [
                    {"source_label": label, "weight": float(weight)}
                    for label, weight in zip(group["source_label"].head(TOP_SOURCES), group["weight"].head(TOP_SOURCES))
                ],
            }
            for consumer, group in weights.groupby("consumer", sort=True)
        ]
    return summary


def prune_tables(
    model: DepthMixingModel,
    batch: Batch,
    metric: str = "loss",
    progress: bool = False,
    on_stage: Callable[[float, str], Any] | None = None,
    fork_routing: bool = False,
) -> dict[str, pd.DataFrame]:
    """Every pruning table for a model on a task batch (routing tables only for models with depth-mixing consumers:
    AttnRes, or another depth-mixing model, docs/architecture.md §7).

    `on_stage(fraction_done, description)` is called before each stage (a UI's progress bar). `fork_routing`: on
    Linux at two torch threads, compute the causal-routing table in a forked child process on one of them while
    this process computes the others on the other (`workers.ForkedJob`: for command-line processes; the same
    numbers as in one process). The child runs one thread, so at more threads the split would leave this process
    idle while the child works on: there the tables run on worker threads as without it.
    """
    check_metric(metric)
    with analysis_session():  # the tables share one clean evaluation, one residual-state capture, the replicas
        return _prune_tables(
            model, batch, metric, on_stage or (lambda fraction, description: None), progress, fork_routing
        )


def _prune_tables(
    model: DepthMixingModel,
    batch: Batch,
    metric: str,
    report: Callable[[float, str], Any],
    progress: bool,
    fork_routing: bool,
) -> dict[str, pd.DataFrame]:
    has_routing = bool(model.consumers())
    stages = 4 if has_routing else 3
    batch = batch.to(model_device(model))
    threads = torch.get_num_threads()
    routing: ForkedJob | None = None
    forking = fork_routing and has_routing and threads == 2
    if forking and isinstance(model, nn.Module) and fork_available(model):  # a torch module's devices say if it may
        routing = ForkedJob(lambda: causal_routing(model, batch))
        torch.set_num_threads(1)
    try:
        tables = _pruning_tables(model, batch, metric, report, progress, stages)
        if has_routing:
            report(3 / stages, "causal depth routing (masking each source of each consumer)…")
            tables["routing"] = routing.result() if routing is not None else causal_routing(model, batch, progress)
            tables["routing_disagreements"] = routing_disagreements(tables["routing"])
    except BaseException:
        if routing is not None:
            routing.cancel()
        raise
    finally:
        torch.set_num_threads(threads)
    report(1.0, "done")
    return tables


def _pruning_tables(
    model: DepthMixingModel,
    batch: Batch,
    metric: str,
    report: Callable[[float, str], Any],
    progress: bool,
    stages: int,
) -> dict[str, pd.DataFrame]:
    report(0 / stages, "ablating each sublayer (remove, mean, resample)…")
    sensitivity = pruning_sensitivity(model, batch, progress)
    report(1 / stages, "angular distances between representations…")
    distances = angular_distance_matrix(model, batch.tokens)
    report(2 / stages, "cumulative removal curves…")
    curves = cumulative_pruning(model, batch, sensitivity, distances, metric, progress=progress)
    tables = {
        "pruning_sensitivity": sensitivity,
        "angular_distance": distances,
        "pruning_curves": curves,
        "metric_correlations": metric_correlations(sensitivity),
        "removable": removable_within(curves, REMOVAL_TOLERANCE),
    }
    if visit_groups(model):  # a looped layer's visits: each alone is in pruning_sensitivity, all together here
        tables["pruning_visits"] = visit_removals(model, batch, progress)
    return tables


def prune_summary(tables: dict[str, pd.DataFrame], header: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of `prune_tables`' output (base loss and accuracy, what is removable, and the routing
    correlations for AttnRes), after `header` (which run, checkpoint, variant …)."""
    sensitivity = tables["pruning_sensitivity"]
    summary = {
        **header,
        "base_loss": float(sensitivity["base_loss"].iloc[0]),
        "base_accuracy": float(sensitivity["base_accuracy"].iloc[0]),
        "removable": tables["removable"].to_dict("records"),
    }
    if "routing" in tables:
        summary["routing_correlations"] = routing_correlations(tables["routing"])
    if "pruning_visits" in tables:
        summary["visits_removed_together"] = tables["pruning_visits"].to_dict("records")
    return summary


def prune_run(
    path: PathLike,
    *,
    checkpoint: str | int = "latest",
    samples: int = PRUNE_SAMPLES,
    out: PathLike | None = None,
    progress: bool = True,
    metric: str = "loss",
    fork_routing: bool = False,
) -> AnalysisResult:
    """Layer-pruning sensitivity of a run: tables, `prune_summary.json` and `prune_report.html` under `out` (default
    RUN/analysis). `metric` orders and plots the removal curves; `fork_routing`: as `prune_tables` (the
    `attnres-lens prune` command sets it)."""
    check_metric(metric)
    run, _, batch = _prepare(path, "prune", checkpoint, samples, out)
    tables = prune_tables(run.model, batch, metric, progress, fork_routing=fork_routing)
    summary = prune_summary(tables, {**_run_header(run, samples), "metric": metric})
    html = prune_report_html(tables, summary, metric, REMOVAL_TOLERANCE)
    return _write(tables, summary, html, output_dir(run, out), "prune")


def attribute_run(
    path: PathLike,
    *,
    checkpoint: str | int = "latest",
    samples: int = ATTRIBUTE_SAMPLES,
    out: PathLike | None = None,
    progress: bool = True,
    prompt: str | None = None,
    n_boot: int = 1000,
) -> AnalysisResult:
    """Attribution through depth of a run (docs/analysis.md §11): tables, `attribution_summary.json` and
    `attribution_report.html` under `out` (default RUN/analysis/). `prompt`: the per-position views' prompt, text
    where the run encodes text (`prompts.text_codec`; its figures then name tokens by their text), else
    space-separated token ids (default the first held-out sequence); `n_boot`: the routing audit's bootstrap
    resamples. Tables the model does not support are listed in the summary's `skipped` with the reason."""
    run, task, batch = _prepare(path, "attribute", checkpoint, samples, out)
    model = run.model
    codec = text_codec(run.config, run.path)
    prompt_tokens = parse_prompt(model, prompt, batch, codec, n_ctx=run.model_config.n_ctx)
    probe = task_probe(model, task, samples) if is_toolkit_model(model) or bridged_inkling(model) is not None else None
    skipped: dict[str, str] = {}
    tables = attribution_tables(
        model, batch, prompt_tokens, run.records, run.metrics, probe, n_boot, progress, skipped=skipped
    )
    header = {**_run_header(run, samples), "prompt": " ".join(map(str, prompt_tokens[0].tolist()))}
    if codec is not None and isinstance(prompt, str):  # typed text: kept beside the ids it encoded to
        header["prompt_text"] = prompt
    summary = attribution_summary(tables, header)
    if skipped:
        summary["skipped"] = [{"table": name, "reason": reason} for name, reason in skipped.items()]
    html = attribution_report_html(tables, summary, codec=codec)
    return _write(tables, summary, html, output_dir(run, out), "attribution")
