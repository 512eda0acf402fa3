"""How faithfully, and at what cost, cheaper measures rank depth edges as exact knockouts do (issue 40 item 4).

On the shipped demo runs `depth-full-6l` and `depth-block-6l` (trained Full and Block AttnRes models on the
synthetic mixed task) and `shakespeare-block-6l` (Block AttnRes on real text), over the first `samples` held-out
sequences of each run's task:

* `exact`: every source knocked out of every consumer on every sequence (`edge_knockouts(screen_fraction=1)`,
  which equals `causal_routing`);
* `two-stage`: `edge_knockouts` as `attribute` runs it (a quarter of the sequences screened, the 20 largest
  re-measured on all), at `attribute`'s default sample count and at 64 sequences;
* `first-order sensitivity`: `edge_sensitivity`, one forward and backward pass.

Each is scored against `exact` with `ranking_agreement` (Spearman, Pearson, top-10 recall), and timed in the same
process, one after the other (wall time, relative to `exact`; the two-stage mode's knockout passes too).

    python -m analyses.benchmarks bench_edge_knockouts
"""

from __future__ import annotations

import time

import torch

from analyses.common import REPO
from attnres_lens.analysis import edge_knockouts, edge_sensitivity
from attnres_lens.analysis.knockouts import REMEASURE, SCREEN_FRACTION, ranking_agreement
from attnres_lens.analysis_options import ATTRIBUTE_SAMPLES
from attnres_lens.rundir import load_run

RUNS = ("depth-full-6l", "depth-block-6l", "shakespeare-block-6l")
KEYS = ["consumer", "source"]


def measure(run_name: str, samples: int) -> list[dict]:
    run = load_run(REPO / "data" / "demo_runs" / run_name)
    model, batch = run.model, run.config.build_task().eval_batch(samples)
    timings, tables = {}, {}
    for label, compute in (
        ("exact", lambda: edge_knockouts(model, batch, screen_fraction=1)),
        ("two-stage", lambda: edge_knockouts(model, batch)),
        ("first-order sensitivity", lambda: edge_sensitivity(model, batch)),
    ):
        start = time.perf_counter()
        tables[label] = compute()
        timings[label] = time.perf_counter() - start
    exact = tables["exact"].set_index(KEYS)["delta_loss"]
    estimates = {
        "two-stage": tables["two-stage"].set_index(KEYS)["delta_loss"],
        "first-order sensitivity": tables["first-order sensitivity"].set_index(KEYS)["total"],
    }
    cfg = model.cfg
    shape = (
        f"demo run {run_name} ({cfg.n_layers} layers, d_model {cfg.d_model}), {samples} sequences, {len(exact)} edges"
    )
    common = dict(shape=shape, threads=torch.get_num_threads())
    rows = [dict(common, variant="exact", metric="wall", value=timings["exact"], unit="s")]
    for label, estimate in estimates.items():
        agreement = ranking_agreement(estimate, exact)
        rows += [
            dict(common, variant=label, metric="Spearman vs exact", value=agreement["spearman"], unit="ρ"),
            dict(common, variant=label, metric="Pearson vs exact", value=agreement["pearson"], unit="r"),
            dict(
                common,
                variant=label,
                metric=f"top-{agreement['top']} recall",
                value=agreement["top_recall"],
                unit="share",
            ),
            dict(common, variant=label, metric="wall", value=timings[label] / timings["exact"], unit="× exact"),
        ]
    rows.append(
        dict(
            common,
            variant=f"two-stage (screen {SCREEN_FRACTION:g}, re-measure {REMEASURE})",
            metric="knockout passes",
            value=tables["two-stage"].attrs["cost"],
            unit="× exact",
        )
    )
    return rows


def run(repeats: int | None = None, tiny: bool = False) -> list[dict]:
    """Agreement and cost on each of `RUNS`, at `attribute`'s default sample count and at 64 sequences (`repeats` is
    not used: each measure runs once)."""
    counts = (8,) if tiny else (ATTRIBUTE_SAMPLES, 64)
    return [row for samples in counts for name in RUNS for row in measure(name, samples)]
