"""Layer pruning and causal routing (docs/analysis.md §6-§9): removal semantics checked against a float64 re-derivation,
the report's self-containment, and the commands' errors."""

from __future__ import annotations

import copy
import json
import math
import re
import sys

import pandas as pd
import pytest
import torch

import attnres_lens.analysis.run as run_module
from attnres_lens import HookedTransformer
from attnres_lens.analysis import (
    angular_distance_matrix,
    causal_routing,
    cumulative_pruning,
    evaluate,
    evaluate_many,
    pruning_sensitivity,
    removal_hooks,
    routing_correlations,
    routing_disagreements,
    source_mask_hooks,
)
from attnres_lens.analysis.pruning import removable_within, removal_orders, residual_states
from attnres_lens.analysis.run import prune_tables
from attnres_lens.cli import main as cli_main

from .helpers import block_sources, copy_batch, depth_mix_float64, randomize_depth_parameters, run_cli, small_config


def reference_logits_after_removal(model: HookedTransformer, tokens: torch.Tensor, removed: set[int]) -> torch.Tensor:
    """The removal rule (docs/analysis.md §6), re-derived in float64 from the block definitions (not the model's
    bookkeeping).

    Removed outputs are zero, so every sum drops them; an AttnRes source all of whose members are removed is
    left out of the softmax. Membership comes from `block_sources` run on bit masks instead of tensors.
    """
    m = copy.deepcopy(model).double()
    cfg = m.cfg
    embedding = m.embed(tokens) + (m.pos_embed(tokens) if cfg.positional_embedding_type == "standard" else 0)
    sublayers = []
    for block in m.blocks:
        sublayers.append((block.ln1, block.attn, getattr(block, "attn_res", None)))
        if not cfg.attn_only:
            sublayers.append((block.ln2, block.mlp, getattr(block, "mlp_res", None)))
    n_sublayers = len(sublayers)
    removed_bits = sum(1 << j for j in removed)
    member_bits = [1 << j for j in range(n_sublayers)]

    def read(consumer: int, depth, outputs: list[torch.Tensor]) -> torch.Tensor:
        if cfg.residual == "standard":
            return embedding + sum(outputs)
        values = block_sources(consumer, embedding, outputs, cfg.attnres_block_size, n_sublayers)
        members = block_sources(consumer, 0, member_bits[:consumer], cfg.attnres_block_size, n_sublayers)
        kept = [value for value, bits in zip(values, members) if bits == 0 or bits & ~removed_bits]
        return depth_mix_float64(kept, depth.query, depth.key_norm.w, cfg.attnres_eps)

    outputs: list[torch.Tensor] = []
    for j, (norm, sublayer, depth) in enumerate(sublayers):
        output = sublayer(norm(read(j, depth, outputs)))
        outputs.append(torch.zeros_like(output) if j in removed else output)
    final = read(n_sublayers, getattr(m, "final_res", None), outputs)
    return m.unembed(m.ln_final(final))


CASES = [
    ("standard", 1, {1}),
    ("standard", 1, {0, 3}),
    ("attnres", 1, {2}),
    ("attnres", 1, {0, 4}),
    ("attnres", 1, {5}),  # Full: masking
    ("attnres", 2, {2}),  # Block: alone in consumer 3's partial (masked there), part of b_2 later (subtracted)
    ("attnres", 2, {2, 3}),  # a whole block: masked everywhere
    ("attnres", 2, {1, 5}),  # subtracted from b_1, and from the final readout's last partial
    ("attnres", 4, {1}),
    ("attnres", 4, {4}),
    ("attnres", 4, {4, 5}),
]


@pytest.mark.parametrize("residual, block_size, removed", CASES)
def test_remove_matches_the_float64_re_derivation(residual, block_size, removed):
    model = HookedTransformer(small_config(residual, block_size, attention="kv_shift"))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = reference_logits_after_removal(model, tokens, removed)
    double = copy.deepcopy(model).double()
    removed_logits = double.run_with_hooks(tokens, fwd_hooks=removal_hooks(double, removed))
    torch.testing.assert_close(removed_logits, expected, rtol=0, atol=1e-9)
    clean = reference_logits_after_removal(model, tokens, set())
    assert (removed_logits - clean).abs().max() > 1e-3  # the removal did something


def test_full_attnres_remove_is_masking_its_source_downstream_not_zeroing_it():
    model = HookedTransformer(small_config("attnres", 1))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    j = 2
    removed = model.run_with_hooks(tokens, fwd_hooks=removal_hooks(model, [j]))
    masked_downstream = [
        hook
        for consumer in range(j + 1, model.cfg.n_sublayers + 1)
        for hook in source_mask_hooks(model, consumer, [j + 1])
    ]  # source j+1 holds f_j
    torch.testing.assert_close(removed, model.run_with_hooks(tokens, fwd_hooks=masked_downstream))
    zeroed = model.run_with_hooks(tokens, fwd_hooks=[(model.sublayer_output_hook(j), lambda t, hook: t * 0)])
    assert (removed - zeroed).abs().max() > 1e-3  # a zero source still takes softmax mass


def silence_sublayer_2(model: HookedTransformer) -> None:
    """Sublayer 2 is layer 1's attention; zero W_O makes its output identically zero."""
    with torch.no_grad():
        model.blocks[1].attn.W_O.zero_()


def test_removing_a_sublayer_whose_output_is_zero_changes_nothing_in_a_standard_model():
    model = HookedTransformer(small_config("standard"))
    silence_sublayer_2(model)
    batch = copy_batch(6)
    sensitivity = pruning_sensitivity(model, batch).set_index("sublayer")
    silent = sensitivity.loc[2]
    for mode in ("remove", "mean", "resample"):
        assert silent[f"dloss_{mode}"] == 0 and silent[f"dacc_{mode}"] == 0
    assert silent["block_influence"] == pytest.approx(0, abs=1e-12)
    assert silent["relative_output_norm"] == 0
    assert silent["angular_distance_next"] == pytest.approx(0, abs=1e-6)
    assert sensitivity.drop(2)["dloss_remove"].abs().min() > 0  # the others do something
    distances = angular_distance_matrix(model, batch.tokens)
    curves = cumulative_pruning(model, batch, sensitivity.reset_index(), distances)
    similar = curves[curves["strategy"] == "similar_block"].set_index("n_removed")
    assert similar.loc[1, "removed"] == "2" and similar.loc[1, "delta_loss"] == 0


def test_in_attnres_a_zero_output_still_matters_when_removed():
    """Removing masks the (zero) source, which frees the softmax mass it took: not a no-op, unlike the
    standard residual. Mean and resample ablation of a zero output change nothing."""
    model = HookedTransformer(small_config("attnres", 1))
    randomize_depth_parameters(model)
    silence_sublayer_2(model)
    silent = pruning_sensitivity(model, copy_batch(6)).set_index("sublayer").loc[2]
    assert silent["dloss_mean"] == 0 and silent["dloss_resample"] == 0
    assert abs(silent["dloss_remove"]) > 1e-4


def test_cumulative_curves_start_clean_and_end_with_everything_removed():
    model = HookedTransformer(small_config("attnres", 2))
    randomize_depth_parameters(model)
    batch = copy_batch(6)
    sensitivity = pruning_sensitivity(model, batch)
    curves = cumulative_pruning(
        model, batch, sensitivity, angular_distance_matrix(model, batch.tokens), "accuracy", stop_at=None
    )
    n_sublayers = model.cfg.n_sublayers
    assert set(curves["strategy"]) == {
        "measured",
        "block_influence",
        "angular_distance_next",
        "relative_output_norm",
        "routing_mass",
        "similar_block",
        "drop_deepest",
    }
    for _, curve in curves.groupby("strategy"):
        assert list(curve["n_removed"]) == list(range(n_sublayers + 1))
        assert curve["delta_loss"].iloc[0] == 0
        assert sorted(map(int, curve["removed"].iloc[-1].split(","))) == list(range(n_sublayers))
    assert curves[curves["n_removed"] == n_sublayers]["loss"].nunique() == 1
    deepest = curves[curves["strategy"] == "drop_deepest"].set_index("n_removed")
    assert deepest.loc[2, "removed"] == f"{n_sublayers - 2},{n_sublayers - 1}"
    measured = curves[curves["strategy"] == "measured"].set_index("n_removed")
    least_important = sensitivity.sort_values(["dacc_remove", "sublayer"], ascending=[False, True])["sublayer"].iloc[0]
    assert measured.loc[1, "removed"] == str(least_important)
    for tolerance in (0, -0.1, True):
        with pytest.raises(ValueError, match="tolerance must be a relative loss increase > 0"):
            removable_within(curves, tolerance)


def test_curves_that_stop_mid_round_match_evaluating_each_set_alone():
    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(6)
    sensitivity = pruning_sensitivity(model, batch)
    distances = angular_distance_matrix(model, batch.tokens)
    orders = removal_orders(sensitivity, distances)
    base = evaluate(model, batch).loss
    alone = {
        removed: evaluate(model, batch, removal_hooks(model, removed)) for sets in orders.values() for removed in sets
    }
    increases = sorted(result.loss / base - 1 for result in alone.values())
    stop_at = increases[int(len(increases) * 0.95)]
    curves = cumulative_pruning(model, batch, sensitivity, distances, stop_at=stop_at)
    lengths = []
    for strategy, sets in orders.items():
        expected = [frozenset()]
        for removed in sets:  # the rule, one set at a time: a curve ends at its first set that far above clean
            expected.append(removed)
            if alone[removed].loss / base - 1 >= stop_at:
                break
        curve = curves[curves["strategy"] == strategy]
        assert list(curve["n_removed"]) == list(range(len(expected)))
        assert curve["loss"].iloc[1:].to_numpy() == pytest.approx([alone[r].loss for r in expected[1:]], abs=1e-6)
        lengths.append(len(expected) - 1)
    # not vacuous: some curves stop inside the first round (steps 1-4), some run into the second
    assert min(lengths) < 4 < max(lengths), lengths


# ---------------------------------------------------------------------------- runs and commands
def test_causal_routing_lists_every_source_of_every_mixing_consumer(smoke_run):
    from attnres_lens.rundir import load_run

    model = load_run(smoke_run).model
    routing = causal_routing(model, copy_batch(4, model.cfg.d_vocab, model.cfg.n_ctx))
    expected = {
        (c, s)
        for c in range(model.cfg.n_sublayers + 1)
        for s in range(len(model.sources(c)))
        if len(model.sources(c)) > 1
    }
    assert set(zip(routing["consumer"], routing["source"])) == expected
    assert routing.groupby("consumer")["alpha_mass"].sum().to_numpy() == pytest.approx(1, abs=1e-5)
    assert routing["delta_loss"].abs().max() > 0
    correlations = routing_correlations(routing)
    assert -1 <= correlations["overall"] <= 1
    gaps = routing_disagreements(routing, top=3)["rank_gap"].abs()
    assert len(gaps) == 3 and list(gaps) == sorted(gaps, reverse=True)


def test_prune_command_writes_tables_and_a_self_contained_report(smoke_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert (
        cli_main(
            ["prune", str(smoke_run), "--out", str(out), "--samples", "4", "--metric", "accuracy", "--no-progress"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    for row in json.loads((out / "prune_summary.json").read_text())["removable"]:  # "1 sublayer", "2 sublayers"
        count = row["n_removable"]
        assert f"{row['strategy']}: {count} sublayer{'' if count == 1 else 's'} removable within +5% loss" in printed
    assert f"report: {out / 'prune_report.html'}" in printed
    for name in (
        "pruning_sensitivity",
        "pruning_curves",
        "angular_distance",
        "metric_correlations",
        "removable",
        "routing",
        "routing_disagreements",
    ):
        assert (out / f"{name}.csv").is_file() and (out / f"{name}.parquet").is_file()
    sensitivity = pd.read_parquet(out / "pruning_sensitivity.parquet")
    assert list(sensitivity["label"]) == ["L0.attn", "L0.mlp", "L1.attn", "L1.mlp"]
    assert json.loads((out / "prune_summary.json").read_text())["metric"] == "accuracy"
    html = (out / "prune_report.html").read_text()
    assert re.findall(r"<script[^>]*\ssrc\s*=", html, flags=re.I) == []  # plotly.js is inline
    assert re.findall(r"<link\b", html, flags=re.I) == [] and "@import" not in html
    assert html.count("plotly.js v") == 1 and html.count('class="plotly-graph-div"') == 4  # routing figure too


def test_bad_run_directories_and_options_give_clear_errors(smoke_run, tmp_path, capsys):
    code, _, err = run_cli(["analyze", str(tmp_path / "missing")], capsys)
    assert code == 2 and "attnres-lens: error: run directory" in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["prune", str(tmp_path / "empty")], capsys)
    assert code == 2 and "not a run directory: config.json is missing" in err
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    (untrained / "config.json").write_text((smoke_run / "config.json").read_text())
    code, _, err = run_cli(["analyze", str(untrained)], capsys)
    assert code == 2 and "no latest checkpoint" in err
    code, _, err = run_cli(["analyze", str(smoke_run), "--checkpoint", "999"], capsys)
    assert code == 2 and "has no checkpoint '999'; it has: latest" in err
    code, _, err = run_cli(["prune", str(smoke_run), "--metric", "perplexity"], capsys)
    assert code == 2 and "metric must be one of ['loss', 'accuracy']" in err
    code, _, err = run_cli(["prune", str(smoke_run), "--samples", "1"], capsys)
    assert code == 2 and "samples must be an integer >= 2" in err


def test_samples_that_cannot_fit_are_refused_before_any_work(smoke_run, tmp_path, capsys, monkeypatch):
    import attnres_lens.resources as resources

    assert resources.available_memory(torch.device("cpu")) > 0  # this machine's figure is read
    monkeypatch.setattr(resources, "available_memory", lambda device: 2**20)  # 1 MiB left
    for command in ("analyze", "prune", "attribute"):
        out = tmp_path / command
        code, _, err = run_cli([command, str(smoke_run), "--samples", "4096", "--out", str(out)], capsys)
        assert code == 2 and "samples=4096 needs at least" in err and "GiB are available" in err, err
        assert "samples=" in err.split("use far fewer: ")[1]
        assert not out.exists()  # nothing was written
    monkeypatch.undo()  # this machine's memory: a billion sequences' tokens alone would need 264 GB
    code, _, err = run_cli(["prune", str(smoke_run), "--samples", "1000000000"], capsys)
    assert code == 2 and "samples=1000000000 needs at least" in err, err


def test_stacked_evaluation_gives_each_intervention_its_own_result():
    model = HookedTransformer(small_config("attnres", 2))
    randomize_depth_parameters(model)
    batch = copy_batch(4)
    mean_output = torch.full((model.cfg.d_model,), 0.5)
    interventions = [
        [],
        removal_hooks(model, [2]),
        removal_hooks(model, [0, 5]),
        [(model.sublayer_output_hook(1), lambda t, hook: mean_output.expand_as(t))],
        source_mask_hooks(model, model.cfg.n_sublayers, [0]),
    ]
    one_by_one = [evaluate(model, batch, hooks) for hooks in interventions]
    stacked = evaluate_many(model, batch, interventions, max_sequences=12)  # passes of 3, 2 interventions
    assert len({round(result.loss, 6) for result in one_by_one}) == len(interventions)
    for single, together in zip(one_by_one, stacked):
        assert together.loss == pytest.approx(single.loss, abs=1e-5)
        assert together.accuracy == pytest.approx(single.accuracy, abs=1e-6)


def test_angular_distances_equal_the_pairwise_definition():
    """All pairs at once (one product per start) against arccos(cos)/π per pair in float64, token-averaged."""
    model = HookedTransformer(small_config("attnres", 2))
    randomize_depth_parameters(model)
    batch = copy_batch(6)
    states, _ = residual_states(model, batch.tokens)
    distances = angular_distance_matrix(model, batch.tokens).set_index(["start", "end"])["distance"]
    assert len(distances) == len(states) * (len(states) - 1) // 2
    for (start, end), distance in distances.items():
        cosine = torch.nn.functional.cosine_similarity(states[start].double(), states[end].double(), dim=-1)
        # arccos is steep near cos = 1: a summation order apart in float64 (1e-16) is ~1e-11 there
        assert distance == pytest.approx((cosine.clamp(-1, 1).arccos() / math.pi).mean().item(), rel=1e-9, abs=1e-10)


def test_prune_tables_shares_its_clean_passes(monkeypatch):
    """Inside prune_tables the clean evaluation and the residual-state capture run once each (three times each
    before), and the tables equal those of the functions called one by one."""
    from attnres_lens.analysis import depth, engine, pruning

    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(6)
    counts = {"evaluate": 0, "states": 0, "weights": 0}

    def counting(module, name, key, only_clean=False):
        inner = getattr(module, name)

        def counted(*args, **kwargs):
            if not only_clean or not any(args[2]):
                counts[key] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    counting(engine, "evaluate_many", "evaluate", only_clean=True)
    counting(pruning, "capture", "states")
    counting(depth, "capture", "weights")
    tables = prune_tables(model, batch)
    assert counts == {"evaluate": 1, "states": 1, "weights": 1}
    pd.testing.assert_frame_equal(tables["pruning_sensitivity"], pruning_sensitivity(model, batch))
    pd.testing.assert_frame_equal(tables["angular_distance"], angular_distance_matrix(model, batch.tokens))
    pd.testing.assert_frame_equal(tables["routing"], causal_routing(model, batch))


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


# `fork_routing` is for a command-line process that runs no threads of its own when it forks (`ForkedJob`):
# the child copies only the forking thread, and a lock another thread held at that moment stays held in the
# child for good (seen: MKL's buffer allocator, after earlier tests' worker threads ran matrix products). So the
# comparison runs in a fresh interpreter, as `attnres-lens prune` does, forking before any worker thread starts.
FORKED_ROUTING_CHECK = """
import pandas as pd, torch
import attnres_lens.analysis.run as run_module
from attnres_lens.analysis import routing
from attnres_lens.analysis.run import prune_tables
from attnres_lens.model import HookedTransformer
from tests.helpers import copy_batch, randomize_depth_parameters, small_config

torch.set_num_threads(2)
model = HookedTransformer(small_config("attnres", 2)).eval()
randomize_depth_parameters(model)
batch = copy_batch(6)
calls, inner = [], routing.causal_routing
run_module.causal_routing = lambda *args, **kwargs: calls.append(1) or inner(*args, **kwargs)
forked = prune_tables(model, batch, fork_routing=True)
assert calls == [] and torch.get_num_threads() == 2, (calls, torch.get_num_threads())
run_module.causal_routing = inner
plain = prune_tables(model, batch)
assert forked.keys() == plain.keys()
for name in plain:
    pd.testing.assert_frame_equal(forked[name], plain[name])
print("same tables")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork_routing forks (Linux)")
@pytest.mark.slow
def test_the_routing_table_computed_in_a_forked_process_is_the_same():
    """`fork_routing` computes causal routing in a forked child with half the threads while the process computes
    the other tables with the rest: every table equals the one-process run's, the thread count is restored, and
    the child did the routing (the process ran no knockout of a single source)."""
    import subprocess
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", FORKED_ROUTING_CHECK],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "same tables", done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork_routing forks (Linux)")
def test_a_forked_table_that_fails_or_dies_raises_here(two_threads, monkeypatch):
    """The child's exception comes back as a RuntimeError carrying its traceback; a child that dies before sending
    anything as a RuntimeError with its exit code; either way the thread count is restored."""
    import os

    model = HookedTransformer(small_config("attnres", 1)).eval()
    batch = copy_batch(6)

    def failing(*args, **kwargs):
        raise ZeroDivisionError("routing broke in the child")

    monkeypatch.setattr(run_module, "causal_routing", failing)
    with pytest.raises(RuntimeError, match="(?s)forked analysis process failed.*ZeroDivisionError: routing broke"):
        prune_tables(model, batch, fork_routing=True)
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(run_module, "causal_routing", lambda *args, **kwargs: os._exit(7))
    with pytest.raises(RuntimeError, match="exited with code 7 before sending its result"):
        prune_tables(model, batch, fork_routing=True)
    assert torch.get_num_threads() == 2
    # one thread: nothing to split, so no child (the failing routing runs here and raises as itself)
    monkeypatch.setattr(run_module, "causal_routing", failing)
    torch.set_num_threads(1)
    with pytest.raises(ZeroDivisionError):
        prune_tables(model, batch, fork_routing=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork_routing forks (Linux)")
def test_a_forked_job_is_cancelled_when_this_process_fails(two_threads, monkeypatch):
    """A table of this process that fails while the child computes routing ends the child (no orphan)."""
    from attnres_lens.analysis import workers

    started = []
    original = workers.ForkedJob

    class Recorded(original):
        def __init__(self, compute):
            super().__init__(lambda: __import__("time").sleep(60))
            started.append(self)

    monkeypatch.setattr(run_module, "ForkedJob", Recorded)
    monkeypatch.setattr(run_module, "pruning_sensitivity", lambda *args: (_ for _ in ()).throw(KeyError("boom")))
    model = HookedTransformer(small_config("attnres", 1)).eval()
    with pytest.raises(KeyError, match="boom"):
        prune_tables(model, copy_batch(6), fork_routing=True)
    assert len(started) == 1 and not started[0]._process.is_alive()
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ForkedJob forks (Linux)")
def test_a_forked_job_runs_after_this_process_used_several_threads_and_reports_what_it_cannot_send():
    """The child runs one thread: GNU OpenMP's pool does not survive a fork, and a child opening a parallel region
    of two or more threads after this process used its pool waited forever. A result that cannot be pickled comes
    back as the child's traceback; the child closes its copy of the pipe's reading end."""
    from attnres_lens.analysis.workers import ForkedJob

    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        # whole numbers whose partial sums stay below 2^24: float32 sums them exactly, in any order
        x = torch.randint(-1, 2, (1500, 1500)).float()
        (x + 1).sum()  # this process's pool runs with 4 threads
        threads, total = ForkedJob(lambda: (torch.get_num_threads(), float((x * 2).sum()))).result()
        assert threads == 1 and total == float((x * 2).sum())  # summed in another order, exactly
        with pytest.raises(RuntimeError, match="(?s)forked analysis process failed.*pickle"):
            ForkedJob(lambda: __import__("threading").Lock()).result()
    finally:
        torch.set_num_threads(previous)


def test_fork_routing_forks_only_at_two_threads(monkeypatch):
    """At one thread there is nothing to split, and at three or more the one-thread child would leave this process
    waiting: the tables run here, on worker threads."""
    started = []
    monkeypatch.setattr(run_module, "ForkedJob", lambda compute: started.append(compute))
    model = HookedTransformer(small_config("attnres", 1)).eval()
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            tables = prune_tables(model, copy_batch(6), fork_routing=True)
            assert "routing" in tables and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(previous)
    assert started == []


def test_a_session_keeps_clean_results_apart_from_hooked_runs_and_other_targets():
    """Inside analysis_session a clean result is reused only for the same model state (no hook added) and the
    same batch tensors: an evaluation under a hook, or of a batch with other targets or answer mask, is its own."""
    from attnres_lens.analysis.session import analysis_session
    from attnres_lens.tasks.base import Batch

    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(6)
    answers = batch.answer_mask.nonzero()[::2]  # every other answer position dropped
    mask = batch.answer_mask.clone()
    mask[answers[:, 0], answers[:, 1]] = False
    halved = Batch(batch.tokens, batch.targets, mask)
    with analysis_session():
        clean = evaluate(model, batch)
        with model.hooks(fwd_hooks=[("blocks.0.hook_attn_out", lambda tensor, hook: tensor * 0.5)]):
            hooked = evaluate(model, batch)
        other = evaluate(model, halved)
        again = evaluate(model, batch)
    outside = evaluate(model, batch), evaluate(model, halved)
    with model.hooks(fwd_hooks=[("blocks.0.hook_attn_out", lambda tensor, hook: tensor * 0.5)]):
        hooked_outside = evaluate(model, batch)
    assert again == clean == outside[0] and other == outside[1] and hooked == hooked_outside
    assert hooked.loss != clean.loss and other.answer_loss != clean.answer_loss
