"""Analyses of a run directory: what `attnres-lens analyze` and `attnres-lens prune` compute and write.

Tables go to `RUN/analysis/` (or `--out`) as CSV and Parquet with the same stem. Evaluation data is the run's
own task: its fixed held-out set (`task.eval_batch(samples)`), so numbers are comparable across checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pandas as pd
import torch

from attnres_lens.analysis.depth import (
    depth_mixing_matrix,
    depth_summary,
    depth_weights,
    depth_weights_per_token,
    mixing_diagnostics,
)
from attnres_lens.analysis.induction import (
    in_context_learning_score,
    induction_head_scores,
    per_position_loss,
    task_probe,
)
from attnres_lens.analysis.interventions import ForkedJob, analysis_session, fork_available
from attnres_lens.analysis.pruning import (
    angular_distance_matrix,
    check_metric,
    cumulative_pruning,
    metric_correlations,
    pruning_sensitivity,
    removable_within,
)
from attnres_lens.analysis.routing import causal_routing, routing_correlations, routing_disagreements
from attnres_lens.analysis.report import prune_report_html
from attnres_lens.model import HookedTransformer
from attnres_lens.resources import available_memory
from attnres_lens.rundir import PathLike, Run, RunDir, atomic_write_bytes, atomic_write_json, atomic_write_parquet, load_run
from attnres_lens.tasks.base import Batch, Task

REMOVAL_TOLERANCE = 0.05  # "how many sublayers can go for < 5% loss increase"


def open_run(path: PathLike, checkpoint: Union[str, int] = "latest") -> tuple[Run, Task]:
    """The run with its model loaded from `checkpoint`, and its task (checked to build when config.json is read)."""
    run = load_run(path, checkpoint=str(checkpoint))
    return run, run.config.build_task()


def _check_samples(samples: int, minimum: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < minimum:
        raise ValueError(f"samples must be an integer >= {minimum}, got {samples!r}")


def _check_fits(model: HookedTransformer, batch: Batch) -> None:
    """Before any work: a `samples` whose one forward pass cannot fit gets an error, not a process killed without
    a word. The bound is a floor, so it never refuses what would fit: the residual stream's tensors at the final
    readout (every source it reads for AttnRes, else one) and the logits."""
    available = available_memory(model.embed.W_E.device)
    if available is None:
        return
    cfg, (n_sequences, n_positions) = model.cfg, batch.tokens.shape
    n_tensors = len(model.sources(cfg.n_sublayers)) if cfg.residual == "attnres" else 1
    per_sequence = n_positions * (n_tensors * cfg.d_model + cfg.d_vocab) * model.embed.W_E.element_size()
    if n_sequences * per_sequence > available:
        raise ValueError(
            f"samples={n_sequences} needs at least {n_sequences * per_sequence / 2**30:.1f} GiB for one forward pass "
            f"of this model (its residual stream and logits), but {available / 2**30:.1f} GiB are available; use "
            f"far fewer: samples={max(1, available // per_sequence)} is the most that could fit even that one pass, "
            "and the analyses hold several")


def _check_out(out: Optional[PathLike], run: PathLike) -> None:
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
                raise ValueError(f"--out {out} is inside another run directory, {folder}; give a folder outside "
                                 f"it, or leave --out out to write to {Path(run) / 'analysis'}")
            if resolved != analysis and analysis not in resolved.parents:
                raise ValueError(f"--out {out} is inside the run directory {folder}, where outputs go to its "
                                 f"analysis folder only; give {analysis} or a folder outside the run")
            return


def output_dir(run: Run, out: Optional[PathLike]) -> Path:
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
    return dict(run=str(run.path), checkpoint=run.checkpoint, variant=run.model_config.variant,
                residual=run.model_config.residual, samples=samples)


def analyze_run(path: PathLike, checkpoint: Union[str, int] = "latest", samples: int = 16,
                progress: bool = True, out: Optional[PathLike] = None) -> dict[str, pd.DataFrame]:
    """Induction heads, in-context learning and depth maps of a run, written under `out` (default RUN/analysis/).

    Tables: induction_heads, icl_per_position, depth_mixing, mixing_diagnostics; for AttnRes models also depth_weights,
    depth_summary and depth_weights_tokens (per-token α of the first evaluation sequence); plus
    analysis_summary.json.
    """
    _check_samples(samples, 1)
    _check_out(out, path)
    run, task = open_run(path, checkpoint)
    model = run.model
    batch = task.eval_batch(samples)
    _check_fits(model, batch)
    probe = task_probe(model, task, samples)
    icl = per_position_loss(model, batch.tokens)
    tables = {
        "induction_heads": induction_head_scores(model, probe, progress=progress),
        "icl_per_position": icl,
        "depth_mixing": depth_mixing_matrix(model, batch.tokens),
        "mixing_diagnostics": mixing_diagnostics(model, batch.tokens),
    }
    if run.model_config.residual == "attnres":
        tables["depth_weights"] = depth_weights(model, batch.tokens)
        tables["depth_summary"] = depth_summary(model, batch.tokens)
        tables["depth_weights_tokens"] = depth_weights_per_token(model, batch.tokens[:1])
    out_dir = output_dir(run, out)
    write_tables(tables, out_dir)
    heads = tables["induction_heads"]
    best = heads.loc[heads["prefix_score"].idxmax()]
    summary = {**_run_header(run, samples), "icl_score": in_context_learning_score(icl),
               "top_induction_head": dict(layer=int(best["layer"]), head=int(best["head"]),
                                          prefix_score=float(best["prefix_score"]),
                                          tl_induction_score=float(best["tl_induction_score"]))}
    atomic_write_json(out_dir / "analysis_summary.json", _json_safe(summary))
    return tables


@dataclass
class AnalysisResult:
    """What a run-level analysis command computed and wrote: its tables, summary and HTML report."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    report_path: Path


def prune_tables(model: HookedTransformer, batch: Batch, metric: str = "loss", progress: bool = False,
                 on_stage: Optional[Callable[[float, str], Any]] = None,
                 fork_routing: bool = False) -> dict[str, pd.DataFrame]:
    """Every pruning table for a model on a task batch (routing tables only for AttnRes models).

    `on_stage(fraction_done, description)` is called before each stage (a UI's progress bar). `fork_routing`: on
    Linux at two torch threads, compute the causal-routing table in a forked child process on one of them while
    this process computes the others on the other (`interventions.ForkedJob`: for command-line processes; the same
    numbers as in one process). The child runs one thread, so at more threads the split would leave this process
    idle while the child works on: there the tables run on worker threads as without it.
    """
    check_metric(metric)
    with analysis_session():  # the tables share one clean evaluation, one residual-state capture, the replicas
        return _prune_tables(model, batch, metric, on_stage or (lambda fraction, description: None), progress,
                             fork_routing)


def _prune_tables(model: HookedTransformer, batch: Batch, metric: str, report: Callable[[float, str], Any],
                  progress: bool, fork_routing: bool) -> dict[str, pd.DataFrame]:
    stages = 4 if model.cfg.residual == "attnres" else 3
    batch = batch.to(model.embed.W_E.device)
    threads = torch.get_num_threads()
    routing: Optional[ForkedJob] = None
    if fork_routing and model.cfg.residual == "attnres" and threads == 2 and fork_available(model):
        routing = ForkedJob(lambda: causal_routing(model, batch))
        torch.set_num_threads(1)
    try:
        tables = _pruning_tables(model, batch, metric, report, progress, stages)
        if model.cfg.residual == "attnres":
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


def _pruning_tables(model: HookedTransformer, batch: Batch, metric: str, report: Callable[[float, str], Any],
                    progress: bool, stages: int) -> dict[str, pd.DataFrame]:
    report(0 / stages, "ablating each sublayer (remove, mean, resample)…")
    sensitivity = pruning_sensitivity(model, batch, progress)
    report(1 / stages, "angular distances between representations…")
    distances = angular_distance_matrix(model, batch.tokens)
    report(2 / stages, "cumulative removal curves…")
    curves = cumulative_pruning(model, batch, sensitivity, distances, metric, progress=progress)
    return {
        "pruning_sensitivity": sensitivity,
        "angular_distance": distances,
        "pruning_curves": curves,
        "metric_correlations": metric_correlations(sensitivity),
        "removable": removable_within(curves, REMOVAL_TOLERANCE),
    }


def prune_summary(tables: dict[str, pd.DataFrame], header: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of `prune_tables`' output (base loss and accuracy, what is removable, and the routing
    correlations for AttnRes), after `header` (which run, checkpoint, variant …)."""
    sensitivity = tables["pruning_sensitivity"]
    summary = {**header, "base_loss": float(sensitivity["base_loss"].iloc[0]),
               "base_accuracy": float(sensitivity["base_accuracy"].iloc[0]),
               "removable": tables["removable"].to_dict("records")}
    if "routing" in tables:
        summary["routing_correlations"] = routing_correlations(tables["routing"])
    return summary


def prune_run(path: PathLike, out: Optional[PathLike] = None, metric: str = "loss", samples: int = 8,
              checkpoint: Union[str, int] = "latest", progress: bool = True,
              fork_routing: bool = False) -> AnalysisResult:
    """Layer-pruning sensitivity of a run: tables and `prune_report.html` under `out` (default RUN/analysis).
    `fork_routing`: as `prune_tables` (the `attnres-lens prune` command sets it)."""
    check_metric(metric)
    _check_samples(samples, 2)  # resample ablation swaps activations between sequences
    _check_out(out, path)
    run, task = open_run(path, checkpoint)
    batch = task.eval_batch(samples)
    _check_fits(run.model, batch)
    tables = prune_tables(run.model, batch, metric, progress, fork_routing=fork_routing)
    summary = prune_summary(tables, {**_run_header(run, samples), "metric": metric})
    out_dir = output_dir(run, out)
    write_tables(tables, out_dir)
    atomic_write_json(out_dir / "prune_summary.json", _json_safe(summary))
    report_path = out_dir / "prune_report.html"
    html = prune_report_html(tables, summary, metric, REMOVAL_TOLERANCE)
    atomic_write_bytes(report_path, html.encode())
    return AnalysisResult(tables, summary, report_path)
