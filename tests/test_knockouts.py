"""Two-stage exact edge knockouts (`analysis.knockouts`), against the exact knockouts of `causal_routing` (one
full evaluation per edge on every sequence): a float64 model, where the two agree to float64 rounding, and the
trained smoke run, where they agree within float32's reordering bound."""

from __future__ import annotations

import pytest
import torch

from attnres_lens.analysis import causal_routing, edge_knockouts, evaluate
from attnres_lens.model import HookedTransformer
from attnres_lens.rundir import load_run
from tests.helpers import copy_batch, float32_chain_length, randomize_depth_parameters, reordering_bound, small_config


def float64_model(block_size: int = 1) -> HookedTransformer:
    model = HookedTransformer(small_config("attnres", block_size, dtype=torch.float64)).eval()
    randomize_depth_parameters(model)
    return model


def subset(batch, rows: list[int]):
    index = torch.tensor(rows)
    return type(batch)(batch.tokens[index], batch.targets[index], batch.answer_mask[index])


def test_every_edge_on_every_sequence_is_causal_routing():
    model, batch = float64_model(), copy_batch(6)
    table = edge_knockouts(model, batch, screen_fraction=1, n_boot=100)
    exact = causal_routing(model, batch).set_index(["consumer", "source"])
    rows = table.set_index(["consumer", "source"]).loc[exact.index]
    assert len(table) == len(exact) and (rows["measured"] == "all").all() and (rows["sequences"] == 6).all()
    assert rows["delta_loss"].to_numpy() == pytest.approx(exact["delta_loss"].to_numpy(), rel=1e-9, abs=1e-12)
    assert rows["alpha_mass"].to_numpy() == pytest.approx(exact["alpha_mass"].to_numpy(), rel=1e-6)
    assert (rows["delta_loss_low"] <= rows["delta_loss"]).all() and (
        rows["delta_loss"] <= rows["delta_loss_high"]
    ).all()
    assert list(table["rank"]) == list(range(1, len(table) + 1))
    assert table["delta_loss"].is_monotonic_decreasing and table.attrs["cost"] == 1


def test_two_stages_measure_the_top_edges_on_every_sequence_and_the_rest_on_the_screen():
    model, batch = float64_model(), copy_batch(8)
    table = edge_knockouts(model, batch, screen_fraction=0.25, remeasure=5, n_boot=100, seed=3)
    screen = table.attrs["screen"]
    assert len(screen) == 2
    exact_all = causal_routing(model, batch).set_index(["consumer", "source"])["delta_loss"]
    exact_screen = causal_routing(model, subset(batch, screen)).set_index(["consumer", "source"])["delta_loss"]
    rows = table.set_index(["consumer", "source"])
    remeasured = rows[rows["measured"] == "all"]
    screened = rows[rows["measured"] == "screen"]
    assert len(remeasured) == 5 and len(screened) == len(rows) - 5
    # the re-measured edges are the screen's five largest |Δ|
    assert set(remeasured.index) == set(exact_screen.abs().sort_values(ascending=False).index[:5])
    assert remeasured["delta_loss"].to_numpy() == pytest.approx(exact_all[remeasured.index].to_numpy(), rel=1e-9)
    assert screened["delta_loss"].to_numpy() == pytest.approx(exact_screen[screened.index].to_numpy(), rel=1e-9)
    n_edges = len(rows)
    assert table.attrs["cost"] == pytest.approx((n_edges * 2 + 5 * 6) / (n_edges * 8))


def test_on_a_trained_run_the_re_measured_edges_are_the_exact_knockouts(smoke_run):
    run = load_run(smoke_run)
    model, batch = run.model, run.config.build_task().eval_batch(8)
    table = edge_knockouts(model, batch, remeasure=6, n_boot=100)
    exact = causal_routing(model, batch).set_index(["consumer", "source"])["delta_loss"]
    bound = 2 * reordering_bound(float32_chain_length(model.cfg, batch.tokens), evaluate(model, batch).loss)
    remeasured = table[table["measured"] == "all"].set_index(["consumer", "source"])
    assert len(remeasured) == 6
    assert remeasured["delta_loss"].to_numpy() == pytest.approx(exact[remeasured.index].to_numpy(), rel=0, abs=bound)
    # the largest exact effect is found: its screen estimate put it among those re-measured
    assert exact.abs().idxmax() in remeasured.index


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(screen_fraction=0), "screen_fraction must be in"),
        (dict(screen_fraction=1.5), "screen_fraction must be in"),
        (dict(screen_fraction=True), "screen_fraction must be a number"),
        (dict(remeasure=-1), "remeasure must be an integer"),
        (dict(n_boot=5), "n_boot must be an integer >= 10"),
        (dict(screen_fraction=0.1), "a bootstrap needs at least 2"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        edge_knockouts(float64_model(), copy_batch(6), **kwargs)


def test_ranking_agreement_counts_the_exact_top_edges_the_estimate_finds():
    import pandas as pd

    from attnres_lens.analysis.knockouts import ranking_agreement

    exact = pd.Series([5.0, 4.0, 3.0, 2.0, 1.0, 0.0], index=list("abcdef"))
    assert ranking_agreement(exact * 2 + 1, exact, top=3) == dict(spearman=1.0, pearson=1.0, top_recall=1.0, top=3)
    reversed_ = ranking_agreement(-exact, exact, top=2)
    assert reversed_["spearman"] == -1.0 and reversed_["top_recall"] == 0.0
    swapped = exact.copy()
    swapped[["c", "d"]] = [2.0, 3.0]  # the third-largest exact edge falls to fourth
    assert ranking_agreement(swapped, exact, top=3)["top_recall"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="same edges"):
        ranking_agreement(exact, exact.drop("a"))
