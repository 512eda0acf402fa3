"""Attribution through depth (docs/analysis.md §11) and the shared-prefix evaluation of many interventions.

Ground truth is independent of the code under test: one full forward pass per intervention (the model's own
`run_with_hooks`), float64 re-derivations, TransformerLens's own residual decomposition, exact knockouts and
hand-built circuits whose answer is known.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import attnres_lens.model as model_module
from attnres_lens import HookedTransformer, ModelConfig, attnres
from attnres_lens.analysis import (
    angular_distance_matrix,
    causal_routing,
    cumulative_pruning,
    depth_input_decomposition,
    depth_logit_attribution,
    edge_agreement,
    edge_attribution,
    evaluate_many,
    fastest_changes,
    kv_shift_decomposition,
    kv_shift_parts,
    logit_attribution_summary,
    logit_lens_summary,
    pruning_sensitivity,
    removal_hooks,
    repeated_batch,
    routing_audit,
    source_logit_lens,
    source_mask_hooks,
    training_timeline,
)
from attnres_lens.analysis import interventions
from attnres_lens.analysis.attribution import depth_terms
from attnres_lens.analysis.interventions import (
    EMBEDDING_STAGE,
    StagedForward,
    StateCache,
    analysis_workers,
    hook_stages,
    model_replica,
    replace_hook,
    slice_state,
)
from attnres_lens.analysis.pruning import CHEAP_METRICS
from attnres_lens.analysis.run import prune_tables
from attnres_lens.cli import main as cli_main
from attnres_lens.config import apply_overrides
from attnres_lens.evaluation import score_logits
from attnres_lens.presets import get_preset
from attnres_lens.rundir import load_run
from attnres_lens.tasks import make_task
from attnres_lens.tasks.base import IGNORE_INDEX, next_token_targets
from attnres_lens.training import train

from .helpers import VARIANTS, randomize_depth_parameters, reference_logits, small_config
from .test_analysis import N_CTX, VOCAB, duplicate_free_repeats, hand_built_heads

def _accepted(residual: str) -> bool:
    try:
        small_config(residual)
    except ValueError:
        return False
    return True


# every residual kind the model offers, each also attention-only with learned positions
KINDS = VARIANTS + [((kind, 1), "standard") for kind in ("denseformer", "mhc") if _accepted(kind)]
ALL_LAYOUTS = [(residual, attention, extra) for (residual, attention) in KINDS
               for extra in ({}, {"attn_only": True, "positional_embedding_type": "standard"})]


def copy_batch(n: int = 4, vocab: int = 20, seq_len: int = 24):
    return make_task("copy", vocab_size=vocab, seq_len=seq_len, min_len=4, max_len=8).eval_batch(n)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The smoke preset (Block AttnRes + KV shift, 40 steps, snapshots every 10): seconds to train."""
    out = tmp_path_factory.mktemp("attribution") / "smoke"
    train(get_preset("smoke"), out, progress=False)
    return out


def one_pass_each(model: HookedTransformer, batch, interventions) -> list:
    """The reference: one full forward pass of the model per intervention."""
    with torch.no_grad():
        return [score_logits(model.run_with_hooks(batch.tokens, fwd_hooks=list(hooks)), batch)
                for hooks in interventions]


# ---------------------------------------------------------------------------- shared-prefix evaluation
@pytest.mark.parametrize("residual, attention, extra", ALL_LAYOUTS,
                         ids=[f"{r[0]}{r[1]}-{a}{'-attn_only' if e else ''}" for r, a, e in ALL_LAYOUTS])
def test_the_stages_compose_to_the_models_forward_pass_exactly(residual, attention, extra):
    model = HookedTransformer(small_config(residual[0], residual[1], attention, **extra)).eval()
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (3, 24), generator=torch.Generator().manual_seed(0))
    forward = StagedForward(model)
    fired: dict[str, int] = {}
    current = [EMBEDDING_STAGE]

    def note(tensor, hook):
        fired[hook.name] = current[0]

    def staged() -> torch.Tensor:
        current[0] = EMBEDDING_STAGE
        state = forward.run(tokens, EMBEDDING_STAGE)
        for stage in range(model.cfg.n_sublayers + 1):
            current[0] = stage
            state = forward.run(state, stage)
        return state

    with torch.no_grad():
        assert torch.equal(staged(), model(tokens))
        with model.hooks(fwd_hooks=[(name, note) for name in model.hook_dict]):
            staged()
    # every hook point fires, in the stage `hook_stages` gives it
    assert fired == hook_stages(model)


def mixed_interventions(model: HookedTransformer, batch) -> list:
    """Removal chains (nested sets), source knockouts, replacements, duplicates, an embedding and a final hook."""
    J = model.cfg.n_sublayers
    noise = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(3))
    interventions = [[], removal_hooks(model, [J - 1]), removal_hooks(model, [1]), removal_hooks(model, [1, 3]),
                     removal_hooks(model, [0, 1, 3]), removal_hooks(model, [1, 3]),  # a duplicate
                     [(model.sublayer_output_hook(2), replace_hook(noise))],
                     [("hook_embed", lambda t, hook: t * 0.5)],
                     [("ln_final.hook_scale", lambda t, hook: t * 2)]]
    for consumer, module in model.depth_attention_modules().items():
        if len(model.sources(consumer)) > 1:
            interventions += [source_mask_hooks(model, consumer, [0]), source_mask_hooks(model, consumer, [1])]
    return interventions


@pytest.mark.parametrize("residual, block_size", [("standard", 1), ("attnres", 1), ("attnres", 2)]
                         + [(kind, 1) for kind in ("denseformer", "mhc") if _accepted(kind)])
@pytest.mark.parametrize("max_sequences", [4, 256])
def test_shared_evaluation_equals_one_pass_per_intervention(residual, block_size, max_sequences):
    model = HookedTransformer(small_config(residual, block_size)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(4)
    interventions = mixed_interventions(model, batch)
    expected = one_pass_each(model, batch, interventions)
    shared = evaluate_many(model, batch, interventions, max_sequences=max_sequences)
    assert len({round(result.loss, 5) for result in expected}) > len(interventions) // 2  # they differ
    for single, together in zip(expected, shared):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)
        assert together.answer_loss == pytest.approx(single.answer_loss, abs=1e-6)
        assert together.accuracy == single.accuracy
    # on three worker threads (each its own copy of the modules): the same numbers, not merely close ones
    parallel = evaluate_many(model, batch, interventions, max_sequences=max_sequences, workers=3)
    assert [result.__dict__ for result in parallel] == [result.__dict__ for result in shared]
    assert not any(point.fwd_hooks for point in model.hook_dict.values())


def test_stacked_copies_mix_the_blocks_they_share_once(monkeypatch):
    """Branches stacked from one state hold the same leading sources: a Full AttnRes window's phase 1 mixes those
    once, at one copy's batch, as the prior of every copy (`DepthStream.stacked_from`). Source knockouts at late
    consumers (the window also reads sources written after the branches part) and hooks on a late sublayer's
    output (the window's first consumer reads only shared sources) equal one full pass each."""
    model = HookedTransformer(small_config("attnres", 1, n_layers=6, d_model=16)).eval()  # 12 sublayers
    randomize_depth_parameters(model)
    batch = copy_batch(3)
    noise = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(5))
    late_output = model.sublayer_output_hook(11)
    interventions = [source_mask_hooks(model, consumer, [source]) for consumer in (9, 10) for source in (0, 4, 8)]
    interventions += [[(late_output, replace_hook(noise))], [(late_output, lambda tensor, hook: tensor * 2)]]
    shared_windows: list[tuple[int, int, int]] = []  # (sources read, of them shared, copies) per window
    inner = attnres.DepthStream._phase1_over_copies

    def spied(self, shared, queries, gains, eps):
        stats = inner(self, shared, queries, gains, eps)
        if stats is not None:
            shared_windows.append((len(shared), len(self._copies.originals), self._copies.n_copies))
        return stats

    monkeypatch.setattr(attnres.DepthStream, "_phase1_over_copies", spied)
    got = evaluate_many(model, batch, interventions, max_sequences=3 * len(interventions))
    for single, together in zip(one_pass_each(model, batch, interventions), got):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)
        assert together.accuracy == single.accuracy
    # knockouts at 9: consumer 10's window reads 11 sources, 10 of them shared; knockouts at 10: consumer 11's
    # reads 12, 11 shared; the two output hooks at 11: its window reads only the 12 shared sources
    assert sorted(shared_windows) == [(11, 10, 3), (12, 11, 3), (12, 12, 2)]
    # branches that part at the final readout: the readout reads the blocks without closing the last partial sum,
    # which the copies share too (stacked before it was closed), so phase 1 covers one source fewer than shared
    final_only = [[("ln_final.hook_normalized", lambda tensor, hook: tensor * 2)],
                  [("ln_final.hook_normalized", lambda tensor, hook: tensor * 0.5)]]
    shared_windows.clear()
    got = evaluate_many(model, batch, final_only, max_sequences=6)
    for single, together in zip(one_pass_each(model, batch, final_only), got):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)
    assert shared_windows == [(12, 13, 2)]  # 13 sources shared, the readout's window reads 12 blocks of them
    shared_windows.clear()
    evaluate_many(model, batch, interventions, max_sequences=3)  # one copy a pass: nothing to share
    assert shared_windows == []


@pytest.mark.parametrize("block_size", [1, 2])
def test_knockouts_of_stacked_copies_read_the_shared_sources_once(monkeypatch, block_size):
    """A consumer with a knockout (a logit-bias hook) in a stack of copies that share their leading sources mixes
    them once for every copy (`DepthStream._mix_over_copies`): source knockouts at one consumer (every source
    shared) and removals of a middle sublayer with its mean ablation (sources shared up to it, then each copy's
    own) equal one full pass each; a shared source replaced after stacking, a hook that watches the weights, or a
    gradient send the mix down the one-pass path."""
    model = HookedTransformer(small_config("attnres", block_size, n_layers=4, d_model=16)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(3)
    mixed: list[tuple[int, int, int]] = []  # (shared, stacked, copies) per mix over copies
    inner = attnres.depth_attention_copies_cpu

    def spied(shared, stacked, n_copies, *rest, **options):
        mixed.append((len(shared), len(stacked), n_copies))
        return inner(shared, stacked, n_copies, *rest, **options)

    monkeypatch.setattr(attnres, "depth_attention_copies_cpu", spied)
    consumer = 5
    n_sources = len(model.sources(consumer))
    interventions = [source_mask_hooks(model, consumer, [source]) for source in range(n_sources)]
    interventions += [removal_hooks(model, [3]), [(model.sublayer_output_hook(3), replace_hook(torch.zeros(16)))]]
    got = evaluate_many(model, batch, interventions, max_sequences=3 * len(interventions))
    for single, together in zip(one_pass_each(model, batch, interventions), got):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)
        assert together.answer_loss == pytest.approx(single.answer_loss, abs=1e-6)
        assert together.accuracy == single.accuracy
    # the knockouts at consumer 5 share all its sources, except with S = 2 the current block's partial sum (sublayer
    # 4's output, in a block unfinished when the copies were stacked: the next write replaces it); the removal stack
    # (2 copies from sublayer 3) shares what was complete before 3 at every later consumer with a knockout
    shared_at_5 = n_sources if block_size == 1 else n_sources - 1
    assert (shared_at_5, n_sources - shared_at_5, n_sources) in mixed
    assert any(copies == 2 and stacked > 0 for _, stacked, copies in mixed)
    # one copy per pass: nothing shared, the one-pass mix
    mixed.clear()
    evaluate_many(model, batch, interventions, max_sequences=3)
    assert mixed == []


def test_stacked_knockouts_take_a_half_precision_bias_as_one_pass_does():
    """A logit-bias hook may return another floating dtype (the one-pass mix converts it): stacked copies mixed
    over their shared sources take it too, and equal one full pass each."""
    model = HookedTransformer(small_config("attnres", 1, n_layers=4, d_model=16)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(3)
    name = model.depth_attention_modules()[5].hook_logit_bias.name

    def knock(source):
        return lambda bias, hook: bias.index_fill(-1, torch.tensor([source]), float("-inf")).to(torch.bfloat16)

    interventions = [[(name, knock(source))] for source in range(6)]
    got = evaluate_many(model, batch, interventions, max_sequences=3 * len(interventions))
    for single, together in zip(one_pass_each(model, batch, interventions), got):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)


def test_a_shared_source_replaced_after_stacking_is_mixed_as_it_now_is():
    """The copies' shared sources are known by identity: a stream whose shared block was replaced after stacking
    mixes what it now holds (the one-pass path), as does a consumer whose weights a hook watches."""
    from attnres_lens.analysis.interventions import concat_states
    from attnres_lens.components import RMSNorm

    generator = torch.Generator().manual_seed(3)
    blocks = [torch.randn(2, 5, 8, generator=generator) for _ in range(3)]
    states = []
    for _ in range(3):
        state = attnres.DepthStream(blocks[0], block_size=2)
        state.blocks = list(blocks)
        state.partial = torch.randn(2, 5, 8, generator=generator)  # each copy's own
        states.append(state)
    stacked = concat_states(states)
    module = attnres.DepthAttention(8, 1e-6)
    with torch.no_grad():
        module.query.copy_(torch.randn(8, generator=generator))
    module.hook_logit_bias.add_hook(lambda bias, hook: bias.index_fill(-1, torch.tensor([1]), float("-inf")))
    assert concat_states(states)._mix_over_copies(module, None) is None  # with a gradient: never (no backward)
    with torch.no_grad():
        shared_mix = stacked._mix_over_copies(module, None)
        assert shared_mix is not None
        torch.testing.assert_close(shared_mix, module(stacked.sources()), rtol=1e-6, atol=1e-6)
        # with the consumer's pre-norm: fused, or, where a hook watches it, run as itself (the hook sees h's norm)
        norm = RMSNorm(8, 1e-5)
        with torch.no_grad():
            norm.w.copy_(torch.linspace(0.5, 1.5, 8))
        h, y = stacked._mix_over_copies(module, norm)
        torch.testing.assert_close(h, shared_mix, rtol=0, atol=0)
        torch.testing.assert_close(y, norm(shared_mix), rtol=1e-6, atol=1e-6)
        seen = []
        norm.hook_normalized.add_hook(lambda normalized, hook: seen.append(normalized.shape))
        h, y = stacked._mix_over_copies(module, norm)
        assert seen == [shared_mix.shape]
        torch.testing.assert_close(y, norm(shared_mix), rtol=0, atol=0)
        stacked.blocks[1] = stacked.blocks[1] * 2  # replaced: no longer the copies' shared block
        assert stacked._mix_over_copies(module, None) is None
        module.hook_weights.add_hook(lambda weights, hook: weights)
        assert concat_states(states)._mix_over_copies(module, None) is None


def test_a_sublayer_whose_output_is_replaced_is_not_computed_for_that_copy(monkeypatch):
    """Removals and ablations replace a sublayer's output whatever it was (`replaces_activation`), so a stacked
    pass computes that sublayer for the other copies only; an unmarked hook of the same effect, any hook inside
    the sublayer, or a hook already on the model there keeps every copy computed. Results equal one full pass each
    either way."""
    from attnres_lens.components import Attention

    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(4)
    j = 2
    watched = model.blocks[j // 2].attn
    rows_seen: list[int] = []
    forward = Attention.forward

    def counting(module, x):  # not a hook: a hook on the module is itself a reason to compute every copy
        if module is watched:
            rows_seen.append(x.shape[0])
        return forward(module, x)

    monkeypatch.setattr(Attention, "forward", counting)
    output_point = model.sublayer_output_hook(j)
    unmarked_zero = (output_point, lambda tensor, hook: torch.zeros_like(tensor))
    doubled = (output_point, lambda tensor, hook: tensor * 2)
    halved = (output_point, lambda tensor, hook: tensor * 0.5)
    mean = torch.full((model.cfg.d_model,), 0.25)
    inside = (f"blocks.{j // 2}.attn.hook_z", lambda tensor, hook: tensor * 0.5)
    cases = {  # interventions stacked in one pass -> rows the attention of sublayer j computes
        "removal beside a doubling": ([removal_hooks(model, [j]), [doubled]], 4),
        "replacement beside a doubling": ([[(output_point, replace_hook(mean))], [doubled]], 4),
        "removal between two kept copies": ([[doubled], removal_hooks(model, [j]), [halved]], 8),
        "removal and replacement": ([removal_hooks(model, [j]), [(output_point, replace_hook(mean))]], 0),
        "unmarked zero": ([[unmarked_zero], [doubled]], 8),
        "removal beside a hook inside": ([removal_hooks(model, [j]), [inside]], 8),
    }

    def check(name: str, interventions: list, expected_rows: int) -> None:
        rows_seen.clear()
        got = evaluate_many(model, batch, interventions, max_sequences=12)
        assert rows_seen == ([expected_rows] if expected_rows else []), name
        for single, together in zip(one_pass_each(model, batch, interventions), got):
            assert together.loss == pytest.approx(single.loss, abs=1e-6), name

    for name, (interventions, expected_rows) in cases.items():
        check(name, interventions, expected_rows)
    # a hook the model already carries inside the sublayer sees every copy, as without interventions
    seen_by_recorder: list[int] = []
    model.hook_dict[inside[0]].add_hook(lambda tensor, hook: seen_by_recorder.append(tensor.shape[0]))
    try:
        check("recorded", [removal_hooks(model, [j]), [doubled]], 8)
    finally:
        model.reset_hooks()
    assert max(seen_by_recorder) == 8  # the stacked pass: both copies (the reference passes see one each)


def test_parallel_evaluation_restores_threads_and_hooks_and_reports_a_failing_hook():
    model = HookedTransformer(small_config("attnres", 1)).eval()
    batch = copy_batch(3)
    interventions = [removal_hooks(model, [j]) for j in range(model.cfg.n_sublayers)]

    def fail(tensor, hook):
        raise RuntimeError(f"hook failed at {hook.name}")

    interventions.append([(model.sublayer_output_hook(2), fail)])
    with pytest.raises(RuntimeError, match="hook failed at blocks.1.hook_attn_out"):
        evaluate_many(model, batch, interventions, max_sequences=3, workers=2)
    assert torch.get_num_threads() == 1  # the suite's setting, restored
    assert not any(point.fwd_hooks for point in model.hook_dict.values())
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        evaluate_many(model, batch, interventions, workers=0)


@pytest.mark.parametrize("residual, block_size", [("attnres", 1), ("attnres", 3), ("standard", 1)]
                         + [(kind, 1) for kind in ("denseformer", "mhc") if _accepted(kind)])
def test_the_analyses_give_the_same_numbers_on_worker_threads(residual, block_size, monkeypatch):
    # AttnRes mixes two-phase here, and a window's phase-1 statistics belong to one batch: stacking or slicing a
    # stream must drop them. Full AttnRes on the C kernel from the first shared source (in this small model no
    # window would open otherwise); Block AttnRes on the readable two-phase, as it runs where Triton does.
    monkeypatch.setattr(attnres, "MIN_SHARED_SOURCES", 1)
    if block_size > 1:
        monkeypatch.setattr(attnres, "stream_two_phase_backend", lambda *args: "torch")
        monkeypatch.setattr(model_module, "model_runs_two_phase", lambda *args: True)
    model = HookedTransformer(small_config(residual, block_size)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(3)

    def tables() -> list[pd.DataFrame]:
        sensitivity = pruning_sensitivity(model, batch)
        distances = angular_distance_matrix(model, batch.tokens)
        out = [sensitivity, cumulative_pruning(model, batch, sensitivity, distances, stop_at=None)]
        return out + ([causal_routing(model, batch)] if residual == "attnres" else [])

    threads = torch.get_num_threads()
    # One session: the clean passes (their outputs' means, the base loss) run once, on this thread at one torch
    # thread; on some processors (AMD EPYC) torch's own small reductions round differently at three threads
    # (the mHC stream mix's sums).
    with interventions.analysis_session():
        serial = tables()
        torch.set_num_threads(3)  # analysis_workers gives one worker per torch thread
        try:
            assert analysis_workers(model) == 3
            parallel = tables()
            torch.set_num_threads(8)  # at most 4 workers, two torch threads each
            assert analysis_workers(model) == 4
            shared_threads = tables()
        finally:
            torch.set_num_threads(threads)
    for one, other, third in zip(serial, parallel, shared_threads):
        # the cheap metrics come from clean passes on this thread, not from the workers: equal up to rounding
        cheap = [column for column in CHEAP_METRICS if column in one]
        pd.testing.assert_frame_equal(one.drop(columns=cheap), other.drop(columns=cheap), check_exact=True)
        pd.testing.assert_frame_equal(one[cheap], other[cheap], check_exact=False, rtol=1e-6, atol=1e-7)
        # two torch threads per worker may split an op's sums differently: equal up to float rounding
        pd.testing.assert_frame_equal(one, third, check_exact=False, rtol=1e-6, atol=1e-7)


def test_an_analysis_session_keeps_the_workers_replicas_and_notices_new_hooks(monkeypatch):
    """prune_tables makes one replica per worker for all its evaluate_many calls, with the tables of a run
    without workers; a hook attached to the model between two calls of a session reaches the workers (the
    replicas copied before it are not reused)."""
    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(3)
    serial = prune_tables(model, batch)
    made = [0]
    inner = interventions.model_replica
    monkeypatch.setattr(interventions, "model_replica", lambda m: made.__setitem__(0, made[0] + 1) or inner(m))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tables = prune_tables(model, batch)
        assert made[0] == 2
        for name, frame in serial.items():
            pd.testing.assert_frame_equal(frame, tables[name], check_exact=True)
        seen = []
        # the knockouts part at consumer 2, so sublayer 4 (where the new hook is) runs on the workers only
        knockouts = [source_mask_hooks(model, 2, [source]) for source in range(3)]
        with interventions.analysis_session():
            first = evaluate_many(model, batch, knockouts, workers=2)
            model.blocks[2].hook_resid_pre.add_hook(lambda tensor, hook: seen.append(1))
            try:
                second = evaluate_many(model, batch, knockouts, workers=2)
            finally:
                model.blocks[2].hook_resid_pre.remove_hooks()
        assert seen and [r.loss for r in first] == [r.loss for r in second]
    finally:
        torch.set_num_threads(threads)


def test_worker_threads_are_refused_where_they_would_compute_something_else():
    model = HookedTransformer(small_config("attnres", 1)).eval()
    batch = copy_batch(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # thread-local: a worker would run in float32
        assert analysis_workers(model) == 1
        with pytest.raises(ValueError, match="workers=2 needs worker threads, but autocast is on"):
            evaluate_many(model, batch, [[], removal_hooks(model, [1])], workers=2)


def test_a_kept_state_copies_its_rows_once_for_every_stage():
    model = HookedTransformer(small_config("attnres", 1)).eval()
    forward = StagedForward(model)
    tokens = torch.cat([copy_batch(2).tokens] * 3)  # three copies of a batch of two, stacked
    copies: dict = {}
    first = forward.run(forward.run(tokens, EMBEDDING_STAGE), 0)
    second = forward.run(first, 1)
    rows = [slice_state(state, 2, 2, copies) for state in (first, second)]
    for full, part in zip((first, second), rows):
        assert len(part.blocks) == len(full.blocks)
        for stacked, sliced in zip(full.blocks, part.blocks):
            assert torch.equal(sliced, stacked[2:4])
            assert sliced.untyped_storage().data_ptr() != stacked.untyped_storage().data_ptr()  # a copy
    assert rows[1].blocks[0] is rows[0].blocks[0]  # the embedding, shared by both stages, is copied once


def test_a_model_replica_shares_the_weights_and_keeps_its_own_hooks():
    model = HookedTransformer(small_config("attnres", 1)).eval()
    replica = model_replica(model)
    assert all(a is b for a, b in zip(model.parameters(), replica.parameters()))
    tokens = copy_batch(2).tokens
    with torch.no_grad():
        model.embed.W_E.mul_(2)  # an edit in place reaches the replica
        assert torch.equal(replica(tokens), model(tokens))
    fired = []
    replica.hook_dict["hook_embed"].add_hook(lambda tensor, hook: fired.append(hook.name))
    with torch.no_grad():
        model(tokens)
    assert fired == []

    class Counter:  # a hook attached before the copy, as a bound method: the copy calls the same object
        calls = 0

        def count(self, module, args, output) -> None:
            self.calls += 1

    counter = Counter()
    model.hook_dict["hook_embed"].register_forward_hook(counter.count)
    with torch.no_grad():
        model_replica(model)(tokens)
    assert counter.calls == 1


def test_a_state_cache_resumes_a_later_call_and_stays_exact():
    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(4)
    cache = StateCache()
    first = [removal_hooks(model, [3]), removal_hooks(model, [4])]
    second = [removal_hooks(model, [3, 5]), removal_hooks(model, [2, 4]), removal_hooks(model, [3])]
    evaluate_many(model, batch, first, cache=cache)
    assert cache.states  # the first call's states are kept
    resumed = evaluate_many(model, batch, second, cache=cache)
    for single, together in zip(one_pass_each(model, batch, second), resumed):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)
    with pytest.raises(ValueError, match="one model and one batch"):
        evaluate_many(model, copy_batch(3), first, cache=cache)


def test_causal_routing_is_unchanged_by_sharing_the_clean_prefix():
    model = HookedTransformer(small_config("attnres", 2)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(3)
    routing = causal_routing(model, batch)
    base = one_pass_each(model, batch, [[]])[0]
    knockouts = [source_mask_hooks(model, c, [s]) for c, s in zip(routing["consumer"], routing["source"])]
    exact = [result.loss - base.loss for result in one_pass_each(model, batch, knockouts)]
    assert routing["delta_loss"].to_numpy() == pytest.approx(exact, abs=1e-6)


def test_bad_hook_names_are_refused_with_the_name():
    model = HookedTransformer(small_config("attnres", 1))
    with pytest.raises(ValueError, match="no hook point named 'blocks.0.hook_nothing'"):
        evaluate_many(model, copy_batch(2), [[("blocks.0.hook_nothing", lambda t, hook: t)]])
    with pytest.raises(ValueError, match="max_sequences must be a positive integer"):
        evaluate_many(model, copy_batch(2), [[]], max_sequences=0)


# ---------------------------------------------------------------------------- depth direct logit attribution
def float64_model(residual: str, block_size: int = 1, **overrides) -> HookedTransformer:
    model = HookedTransformer(small_config(residual, block_size, dtype=torch.float64, **overrides)).eval()
    randomize_depth_parameters(model)
    return model


@pytest.mark.parametrize("residual, block_size", [("standard", 1), ("attnres", 1), ("attnres", 2)])
def test_per_source_terms_sum_exactly_to_the_clean_logit_minus_the_bias(residual, block_size):
    model = float64_model(residual, block_size)
    with torch.no_grad():
        model.unembed.b_U.normal_(generator=torch.Generator().manual_seed(5))  # a bias term to subtract
    tokens = copy_batch(3).tokens
    reference = reference_logits(model, tokens).detach()  # an independent float64 forward pass
    targets = next_token_targets(tokens)
    wrong = (targets + 1) % model.cfg.d_vocab
    for incorrect in (None, wrong):
        table = depth_logit_attribution(model, tokens, incorrect=incorrect)
        assert set(table["source_label"]) == set(model.source_labels(model.cfg.n_sublayers))
        per_position = table.groupby(["sequence", "position"])
        total = per_position["contribution"].sum() + per_position["bias"].first()
        assert (total - per_position["logit"].first()).abs().max() < 1e-10
        first = per_position.first().reset_index()
        rows, cols = torch.tensor(first["sequence"]), torch.tensor(first["position"])
        expected = reference[rows, cols, targets[rows, cols]]
        if incorrect is not None:
            expected = expected - reference[rows, cols, wrong[rows, cols]]
        assert first["logit"].to_numpy() == pytest.approx(expected.numpy(), abs=1e-10)
    summary = logit_attribution_summary(table)
    assert summary["share"].sum() == pytest.approx(1)


def test_standard_model_attribution_equals_transformer_lens_decomposition():
    """TransformerLens's own per-component DLA (decompose_resid → apply_ln_to_stack → logit_attrs, with the final
    norm's gain folded into the unembedding directions as TL expects) gives the same numbers."""
    model = float64_model("standard")
    tokens = copy_batch(2).tokens
    targets = next_token_targets(tokens)
    _, cache = model.run_with_cache(tokens)
    stack, labels = cache.decompose_resid(layer=-1, return_labels=True)  # embed, 0_attn_out, 0_mlp_out, …
    folded = model.ln_final.w[:, None] * model.unembed.W_U
    model.tokens_to_residual_directions = lambda ids: folded[:, torch.as_tensor(ids)].movedim(0, -1)
    try:
        tl = cache.logit_attrs(stack, tokens=targets.clamp_min(0))  # [component, batch, pos]
    finally:
        del model.tokens_to_residual_directions
    ours = depth_logit_attribution(model, tokens)
    names = {"embed": "emb"} | {f"{j // 2}_{'attn' if j % 2 == 0 else 'mlp'}_out": model.sublayer_name(j)
                                 for j in range(model.cfg.n_sublayers)}
    for component, label in enumerate(labels):
        mine = ours[ours["source_label"] == names[label]]
        theirs = tl[component][torch.tensor(mine["sequence"].to_numpy()), torch.tensor(mine["position"].to_numpy())]
        assert mine["contribution"].to_numpy() == pytest.approx(theirs.detach().numpy(), abs=1e-10), label


@pytest.mark.parametrize("residual, block_size", [("standard", 1), ("attnres", 1), ("attnres", 4)])
def test_every_sublayer_input_is_the_sum_of_its_source_terms(residual, block_size):
    model = float64_model(residual, block_size)
    tokens = copy_batch(3).tokens
    terms = depth_terms(model, tokens)
    for consumer in range(model.cfg.n_sublayers + 1):
        alpha = terms.alpha(model, consumer)
        rebuilt = sum(alpha[..., s, None] * v for s, v in enumerate(terms.source_vectors(model, consumer)))
        assert (rebuilt - terms.inputs[consumer]).abs().max() < 1e-12, consumer
    shares = depth_input_decomposition(model, tokens, per_token=True)
    by_token = shares.groupby(["consumer", "sequence", "position"])["share"].sum()
    assert by_token.to_numpy() == pytest.approx(1, abs=1e-10)
    averaged = depth_input_decomposition(model, tokens)
    assert len(averaged) == sum(len(model.sources(c)) for c in range(model.cfg.n_sublayers + 1))


def test_the_attribution_functions_refuse_bad_input_with_the_value():
    model = float64_model("attnres")
    tokens = copy_batch(2).tokens
    with pytest.raises(ValueError, match="targets must have the tokens' shape"):
        depth_logit_attribution(model, tokens, targets=tokens[:, :3])
    with pytest.raises(ValueError, match="token id 99"):
        depth_logit_attribution(model, tokens, targets=torch.full_like(tokens, 99))
    for wrong in (tokens.float() + 0.7, tokens > 2):  # not truncated to ids, not read as ids 0 and 1
        with pytest.raises(ValueError, match=f"targets must hold integer token ids, got dtype {wrong.dtype}"):
            depth_logit_attribution(model, tokens, targets=wrong)
    with pytest.raises(ValueError, match="incorrect must hold integer token ids"):
        depth_logit_attribution(model, tokens, incorrect=tokens.double())
    with pytest.raises(ValueError, match="k must be an integer in 1..20, got 0"):
        source_logit_lens(model, tokens, k=0)
    with pytest.raises(ValueError, match="metric must be one of"):
        edge_attribution(model, copy_batch(2), metric="perplexity")
    with pytest.raises(ValueError, match="needs depth attention; this model's residual is 'standard'"):
        edge_attribution(float64_model("standard"), copy_batch(2))
    with pytest.raises(ValueError, match="n_boot must be an integer >= 10, got 3"):
        routing_audit(model, copy_batch(2), n_boot=3)


# ---------------------------------------------------------------------------- logit lens
def test_the_lens_decodes_the_final_input_to_the_models_own_prediction():
    model = float64_model("attnres", 2)
    tokens = copy_batch(2).tokens
    lens = source_logit_lens(model, tokens, k=3)
    with torch.no_grad():
        logits = model(tokens)
    final = lens[lens["label"] == "→final"]
    rows, cols = torch.tensor(final["sequence"].to_numpy()), torch.tensor(final["position"].to_numpy())
    assert final["top_tokens"].str.split().str[0].astype(int).tolist() == logits[rows, cols].argmax(-1).tolist()
    target_logits = logits[rows, cols].gather(-1, torch.tensor(final["target"].to_numpy())[:, None]).squeeze(-1)
    assert final["target_logit"].to_numpy() == pytest.approx(target_logits.numpy(), abs=1e-10)
    ranks = (logits[rows, cols] > target_logits[:, None]).sum(-1)
    assert final["target_rank"].tolist() == ranks.tolist()
    # every source and every input, once per position with a target; Block AttnRes also its block sums
    labels = lens.drop_duplicates(["vector", "label"])
    assert (labels["vector"] == "input").sum() == model.cfg.n_sublayers + 1
    assert "B1 (L0) = L0.attn+L0.mlp" in set(labels["label"])
    summary = logit_lens_summary(lens)
    assert list(summary["label"]) == list(labels["label"]) and summary["top1"].between(0, 1).all()


# ---------------------------------------------------------------------------- edge attribution
def float64_loss(model: HookedTransformer, batch, fwd_hooks=(), pre_final=None) -> float:
    """The evaluation loss in float64 with hooks (and optionally a PyTorch pre-hook replacing the final
    readout's input, which has no hook point)."""
    handle = None
    if pre_final is not None:
        handle = model.ln_final.register_forward_pre_hook(lambda module, args: (pre_final(args[0]),))
    try:
        with torch.no_grad():
            logits = model.run_with_hooks(batch.tokens, fwd_hooks=list(fwd_hooks))
    finally:
        if handle is not None:
            handle.remove()
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX).item()


def nudge(model: HookedTransformer, batch, consumer: int, direction: torch.Tensor, epsilon: float) -> float:
    """Central finite difference of the loss along `direction` added to consumer's input."""
    def loss(sign: float) -> float:
        shift = lambda h: h + sign * epsilon * direction  # noqa: E731
        if consumer == model.cfg.n_sublayers:
            return float64_loss(model, batch, pre_final=shift)
        return float64_loss(model, batch, [(model.sublayer_input_hook(consumer), lambda h, hook: shift(h))])

    return (loss(1) - loss(-1)) / (2 * epsilon)


def knockout_direction(terms, model, consumer: int, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Δh of knocking `source` out of `consumer` (h' − h, h' the renormalised rest), and the value path −α_s v_s."""
    alpha, vectors = terms.alpha(model, consumer), terms.source_vectors(model, consumer)
    rest = [s for s in range(len(vectors)) if s != source]
    kept = alpha[..., rest].sum(-1, keepdim=True)
    after = sum(alpha[..., s, None] * vectors[s] for s in rest) / kept
    return after - terms.inputs[consumer], -alpha[..., source, None] * vectors[source]


def test_edge_estimates_are_the_directional_derivatives_of_the_loss_float64():
    model = float64_model("attnres", 1)
    batch = copy_batch(3)
    edges = edge_attribution(model, batch).set_index(["consumer", "source"])
    terms = depth_terms(model, batch.tokens)
    J = model.cfg.n_sublayers
    for consumer, source in [(1, 0), (3, 2), (J, 0), (J, J)]:
        total, value = knockout_direction(terms, model, consumer, source)
        row = edges.loc[(consumer, source)]
        assert row["total"] == pytest.approx(nudge(model, batch, consumer, total, 1e-5), rel=1e-6, abs=1e-10)
        assert row["value_path"] == pytest.approx(nudge(model, batch, consumer, value, 1e-5), rel=1e-6, abs=1e-10)


def test_corrupted_patching_estimates_are_directional_derivatives_float64():
    model = float64_model("attnres", 2)
    batch = copy_batch(3)
    corrupted = batch.tokens.roll(1, dims=0)
    edges = edge_attribution(model, batch, corrupted=corrupted).set_index(["consumer", "source"])
    assert set(edges["mode"]) == {"corrupted"}
    clean, corrupt = depth_terms(model, batch.tokens), depth_terms(model, corrupted)
    modules = model.depth_attention_modules()
    for consumer, source in [(1, 0), (2, 1), (model.cfg.n_sublayers, 1)]:
        vectors = clean.source_vectors(model, consumer)
        delta = corrupt.source_vectors(model, consumer)[source] - vectors[source]
        alpha = clean.alpha(model, consumer)

        def patched_input(epsilon: float, move_weights: bool) -> torch.Tensor:
            moved = [v + epsilon * delta if s == source else v for s, v in enumerate(vectors)]
            if not move_weights:  # the value path: the weights stay where they were
                return sum(alpha[..., s, None] * v for s, v in enumerate(moved))
            with torch.no_grad():
                return modules[consumer](moved)

        for column, move_weights in (("total", True), ("value_path", False)):
            # exact patches at ±ε through the consumer's input, against the first-order estimate
            def loss(epsilon: float) -> float:
                h = patched_input(epsilon, move_weights)
                if consumer == model.cfg.n_sublayers:
                    return float64_loss(model, batch, pre_final=lambda _: h)
                return float64_loss(model, batch, [(model.sublayer_input_hook(consumer), lambda t, hook: h)])

            derivative = (loss(1e-5) - loss(-1e-5)) / 2e-5
            assert edges.loc[(consumer, source), column] == pytest.approx(derivative, rel=1e-5, abs=1e-10), column


def test_a_zero_source_acts_only_through_routing_and_its_neighbour_only_through_its_value():
    """Layer 0's attention writes nothing (W_O = 0), so L0.mlp reads [e, f_0 = 0]: h = α_e e. Knocking out the
    zero source renormalises e's weight (value path 0); knocking out e leaves h' = 0 = h − α_e e, all value."""
    model = float64_model("attnres", 1)
    with torch.no_grad():
        model.blocks[0].attn.W_O.zero_()
    edges = edge_attribution(model, copy_batch(3)).set_index(["consumer", "source"])
    zero_source, embedding = edges.loc[(1, 1)], edges.loc[(1, 0)]
    assert zero_source["value_path"] == 0 and abs(zero_source["routing_path"]) > 1e-4
    assert abs(embedding["routing_path"]) < 1e-14 and abs(embedding["value_path"]) > 1e-4


def saturated_readout_model() -> HookedTransformer:
    """A Full AttnRes model whose final readout attends almost only to the embedding: every token embedding
    shares a large component along dim 0, no sublayer writes along dim 0, and the readout's query points there,
    so α_e ≈ 0.995 and every other source gets ≈ 1e-3."""
    model = float64_model("attnres", 1)
    with torch.no_grad():
        model.embed.W_E[:, 0] = 3.0
        for block in model.blocks:
            block.attn.W_O[..., 0] = 0
            block.mlp.W_out[:, 0] = 0
            block.mlp.b_out[0] = 0
        model.final_res.query.zero_()
        model.final_res.query[0] = 1.3
        model.final_res.key_norm.w.fill_(1)
    return model


def test_first_order_fails_on_a_saturated_softmax_and_the_report_says_where():
    model = saturated_readout_model()
    batch = copy_batch(4)
    J = model.cfg.n_sublayers
    edges = edge_attribution(model, batch)
    routing = causal_routing(model, batch)
    final = edges[edges["consumer"] == J].set_index("source")
    exact = routing[routing["consumer"] == J].set_index("source")["delta_loss"]
    assert final.loc[0, "max_alpha"] > 0.99
    # sources the readout barely uses: tiny effects, and the linear estimate of them is good
    for source in range(1, J + 1):
        assert final.loc[source, "alpha_mass"] < 0.01
        assert final.loc[source, "total"] == pytest.approx(exact[source], rel=0.05, abs=1e-6)
    # the embedding carries the readout: knocking it out is far outside the linear regime
    assert abs(exact[0]) > 0.01 and abs(final.loc[0, "total"] - exact[0]) > 0.5 * abs(exact[0])
    summary, worst = edge_agreement(edges, routing, top=3)
    assert worst.loc[0, "consumer_label"] == "final" and worst.loc[0, "source_label"] == "emb"
    assert worst.loc[0, "max_alpha"] > 0.99 and summary["n_edges"] == len(routing)


def test_edge_estimates_rank_exact_knockouts_when_the_softmax_is_soft():
    model = float64_model("attnres", 1, n_layers=4)
    with torch.no_grad():
        for module in model.depth_attention_modules().values():
            module.query.mul_(0.15)  # near-uniform routing: knockouts are small perturbations
    batch = copy_batch(4)
    summary, _ = edge_agreement(edge_attribution(model, batch), causal_routing(model, batch))
    assert summary["spearman"] > 0.9 and summary["sign_agreement"] > 0.8


# ---------------------------------------------------------------------------- routing audit
def test_routing_audit_point_estimates_are_the_exact_knockouts():
    model = float64_model("attnres", 1)
    batch = copy_batch(5)
    audit = routing_audit(model, batch, n_boot=200)
    routing = causal_routing(model, batch)
    pairs = audit["pairs"].merge(routing, on=["consumer", "source"], suffixes=("", "_exact"))
    assert len(pairs) == len(routing)
    assert pairs["delta_loss"].to_numpy() == pytest.approx(pairs["delta_loss_exact"].to_numpy(), abs=1e-6)
    assert pairs["alpha_mass"].to_numpy() == pytest.approx(pairs["alpha_mass_exact"].to_numpy(), abs=1e-6)
    for name in ("alpha_mass", "delta_loss"):
        assert (pairs[f"{name}_low"] <= pairs[f"{name}_high"]).all()
    consumers = audit["consumers"]
    assert list(consumers["consumer"]) == sorted(routing["consumer"].unique())
    assert consumers.loc[consumers["n_sources"] == 2, "spearman"].isna().all()
    assert consumers.loc[consumers["n_sources"] > 2, "spearman"].between(-1, 1).all()
    assert (consumers["null_mean_dloss"] != 0).any()  # content-dependent routing: the mean schedule is a change


def test_routing_audit_of_identical_sequences_has_no_spread():
    model = float64_model("attnres", 2)
    one = copy_batch(1)
    batch = type(one)(one.tokens.repeat(4, 1), one.targets.repeat(4, 1), one.answer_mask.repeat(4, 1))
    pairs = routing_audit(model, batch, n_boot=50)["pairs"]
    for name in ("alpha_mass", "delta_loss"):
        assert pairs[f"{name}_low"].to_numpy() == pytest.approx(pairs[name].to_numpy(), abs=1e-9)
        assert pairs[f"{name}_high"].to_numpy() == pytest.approx(pairs[name].to_numpy(), abs=1e-9)


def test_the_mean_schedule_changes_nothing_when_routing_ignores_the_content():
    """Zero pseudo-queries (step 0): α is uniform at every token, so its token mean is α itself."""
    model = HookedTransformer(small_config("attnres", 1, dtype=torch.float64)).eval()
    consumers = routing_audit(model, copy_batch(3), n_boot=20)["consumers"]
    assert consumers["null_mean_dloss"].abs().max() < 1e-6
    assert consumers["null_recency_dloss"].abs().max() > 1e-5  # pooled recency differs from 1/n per consumer


# ---------------------------------------------------------------------------- KV-shift decomposition
@pytest.mark.parametrize("attention, extra", [("kv_shift", {}), ("standard", {}),
                                              ("kv_shift", {"positional_embedding_type": "standard"}),
                                              ("kv_shift", {"n_key_value_heads": 2})])
def test_score_and_output_parts_sum_to_the_hooked_scores_and_z(attention, extra):
    model = HookedTransformer(small_config("standard", 1, attention, dtype=torch.float64, **extra)).eval()
    tokens = copy_batch(2).tokens
    _, cache = model.run_with_cache(tokens)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    for layer in range(model.cfg.n_layers):
        parts = kv_shift_parts(model, tokens, layer)
        scores = parts["current_scores"] + parts["shifted_scores"]
        hooked = cache["attn_scores", layer]
        assert (scores - hooked)[..., causal].abs().max() < 1e-12
        assert (parts["current_z"] + parts["shifted_z"] - cache["z", layer]).abs().max() < 1e-12
        if attention == "standard":
            assert parts["shifted_scores"].abs().max() == 0 and parts["shifted_z"].abs().max() == 0


def two_layer_induction_circuit() -> HookedTransformer:
    """Standard attention, two layers: layer 0 head 0 attends to the previous position and writes that token into
    dims 32–43; layer 1 head 0 matches its query token against those dims (the *current* key) and copies the
    token it finds to the logits: the two-layer previous-token + induction circuit."""
    vocab, n_ctx = VOCAB, N_CTX
    previous = range(vocab + n_ctx, 2 * vocab + n_ctx)
    cfg = ModelConfig(d_model=2 * vocab + n_ctx, n_heads=2, n_layers=2, n_ctx=n_ctx, d_vocab=vocab, attn_only=True,
                      positional_embedding_type="standard", seed=0, dtype=torch.float64)
    model = HookedTransformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for block in model.blocks:
            block.ln1.w.fill_(1)
        model.ln_final.w.fill_(1)
        first, second = model.blocks[0].attn, model.blocks[1].attn
        for p in range(n_ctx):
            model.pos_embed.W_pos[p, vocab + p] = 1
            first.W_K[0, vocab + p, p] = 2.5
            if p >= 1:
                first.W_Q[0, vocab + p, p - 1] = 2.5
        for v in range(vocab):
            model.embed.W_E[v, v] = 1
            model.unembed.W_U[v, v] = 1
            first.W_V[0, v, v] = first.W_O[0, v, previous[v]] = 1
            second.W_Q[0, v, v] = second.W_K[0, previous[v], v] = 3.0
            second.W_V[0, v, v] = second.W_O[0, v, v] = 1
    return model.eval()


def test_the_shifted_key_score_tells_the_one_layer_kv_shift_head_from_the_two_layer_circuit():
    batch = duplicate_free_repeats(8)
    one_layer = kv_shift_decomposition(hand_built_heads(), batch).set_index(["layer", "head"])
    head = one_layer.loc[(0, 0)]
    assert head["prefix_score"] > 0.9 and head["shifted_key_induction_score"] > 0.95
    assert head["shifted_key_advantage"] > 5 and abs(head["current_key_advantage"]) < 0.5
    assert abs(head["shifted_value_share"]) < 1e-9  # β = (1, 0): the values are not shifted
    two_layer = kv_shift_decomposition(two_layer_induction_circuit(), batch).set_index(["layer", "head"])
    induction = two_layer.loc[(1, 0)]
    assert induction["prefix_score"] > 0.9 and induction["current_key_advantage"] > 5
    assert induction["shifted_key_advantage"] == 0 and induction["shifted_key_induction_score"] == 0
    assert two_layer.loc[(0, 0), "prefix_score"] < 0.1  # the previous-token head is not itself an induction head


@pytest.fixture(scope="module")
def induction_runs(tmp_path_factory):
    """Short runs of the two mechanisms' presets at the smoke scale (a few seconds each): one-layer KV shift,
    which forms an induction head within 300 steps, and two-layer vanilla attention (too short to form one)."""
    runs = {}
    for name, overrides in (("induction-1l-kvshift", ["model.n_layers=1", 'model.attention="kv_shift"']),
                            ("induction-2l-vanilla", ["model.n_layers=2", 'model.attention="standard"'])):
        out = tmp_path_factory.mktemp("attribution") / name
        config = apply_overrides(get_preset("smoke"), [
            "model.attn_only=true", 'model.residual="standard"', "train.steps=300", "train.batch_size=16",
            "train.lr=0.01", "train.eval_every=100", "train.record_every=50", "train.checkpoint_every=300",
            *overrides])
        train(config, out, progress=False)
        runs[name] = out
    return runs


@pytest.mark.slow
def test_trained_runs_use_the_mechanism_their_architecture_allows(induction_runs):
    probe = repeated_batch(32, half_len=15, vocab_size=24, seed=3)
    kv = kv_shift_decomposition(load_run(induction_runs["induction-1l-kvshift"]).model, probe)
    top = kv.loc[kv["prefix_score"].idxmax()]
    assert top["prefix_score"] > 0.4 and top["shifted_key_induction_score"] > 0.9
    vanilla = kv_shift_decomposition(load_run(induction_runs["induction-2l-vanilla"]).model, probe)
    assert (vanilla["shifted_key_advantage"] == 0).all() and (vanilla["shifted_key_induction_score"] == 0).all()


@pytest.mark.skipif(not (Path(__file__).resolve().parent.parent / "data" / "demo_runs" / "induction-2l-vanilla").is_dir(),
                    reason="demo runs missing (make demo)")
def test_the_shipped_induction_runs_tell_the_two_mechanisms_apart():
    demo = Path(__file__).resolve().parent.parent / "data" / "demo_runs"
    probe = repeated_batch(16, half_len=20, vocab_size=64, seed=3)
    scores = {name: kv_shift_decomposition(load_run(demo / name).model, probe)
              for name in ("induction-1l-kvshift", "induction-2l-vanilla")}
    for name, expected in (("induction-1l-kvshift", 1.0), ("induction-2l-vanilla", 0.0)):
        top = scores[name].loc[scores[name]["prefix_score"].idxmax()]
        assert top["prefix_score"] > 0.5, name
        assert top["shifted_key_induction_score"] == pytest.approx(expected, abs=0.05), name
    vanilla = scores["induction-2l-vanilla"].set_index(["layer", "head"])
    assert vanilla["prefix_score"].idxmax()[0] == 1 and vanilla["current_key_advantage"].max() > 5  # layer 1, current key


# ---------------------------------------------------------------------------- training timeline
def test_timeline_statistics_and_fastest_change_on_known_snapshots():
    weights = pd.DataFrame([
        dict(step=step, consumer=1, consumer_label="L0.mlp", kind="mlp", source=s, source_label=label, weight=w)
        for step, alphas in ((0, (0.5, 0.5)), (10, (0.6, 0.4)), (20, (0.9, 0.1)), (30, (0.92, 0.08)))
        for s, (label, w) in enumerate(zip(("emb", "L0.attn"), alphas))])
    scores = pd.DataFrame([dict(step=step, layer=0, head=h, prefix_score=value)
                           for step, values in ((0, (0.0, 0.1)), (10, (0.1, 0.2)), (20, (0.15, 0.8)), (30, (0.2, 0.85)))
                           for h, value in enumerate(values)])
    metrics = pd.DataFrame({"step": [0, 10, 20, 30], "loss": [3.0, 2.9, 1.5, 1.4], "eval_loss": [3.1, 3.0, 1.6, 1.5]})
    timeline = training_timeline({"depth_weights": weights, "induction_scores": scores}, metrics)
    entropy = timeline[timeline["series"] == "routing_entropy"].set_index("step")["value"]
    assert entropy[0] == pytest.approx(math.log(2)) and entropy[20] == pytest.approx(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))
    assert timeline[timeline["series"] == "induction_score"].set_index("step")["value"][20] == 0.8
    changes = fastest_changes(timeline).set_index("series")
    for series in ("routing_entropy", "max_weight", "embedding_weight", "induction_score", "loss", "eval_loss"):
        assert changes.loc[series, "step"] == 20 and changes.loc[series, "step_from"] == 10, series
    assert changes.loc["max_weight", "rate"] == pytest.approx(0.03)
    sigmoid = weights.assign(weight=0.5 * weights["step"].ne(0) + 0.5)  # α = 0.5, then 1 for both sources
    entropy = training_timeline({"depth_weights": sigmoid}, metrics[["step"]])
    assert entropy[entropy["series"] == "routing_entropy"]["value"].to_numpy() == pytest.approx(math.log(2))


def test_timeline_of_a_recorded_run_covers_every_consumer(smoke_run):
    run = load_run(smoke_run)
    timeline = training_timeline(run.records, run.metrics)
    consumers = set(timeline.loc[timeline["series"] == "max_weight", "consumer"])
    assert consumers == set(range(run.model_config.n_sublayers + 1))
    steps = set(run.records["depth_weights"]["step"])
    changes = fastest_changes(timeline)
    routing = changes[changes["series"].isin(["routing_entropy", "max_weight", "embedding_weight"])]
    assert set(routing["step"]) <= steps and len(routing) == 3 * len(consumers)


def test_row_wise_spearman_matches_the_pandas_one_with_ties():
    from attnres_lens.analysis import spearman
    from attnres_lens.analysis.attribution import spearman_rows

    generator = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (30, 6), generator=generator).double()  # many ties
    b = torch.randn(30, 6, generator=generator)
    b[0] = 1.0  # a constant row
    rows = spearman_rows(a, b)
    for row, (x, y) in enumerate(zip(a, b)):
        expected = spearman(x.tolist(), y.tolist())
        assert (math.isnan(rows[row]) and math.isnan(expected)) or rows[row].item() == pytest.approx(expected)


# ---------------------------------------------------------------------------- the attribute command
def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


ATTRIBUTION_TABLES = ("depth_dla", "depth_dla_summary", "depth_inputs", "logit_lens", "logit_lens_summary",
                      "edge_attribution", "edge_attribution_corrupted", "routing", "edge_agreement",
                      "routing_audit_pairs", "routing_audit_consumers", "kv_shift", "timeline", "timeline_changes")


def test_attribute_command_writes_tables_and_one_offline_report(smoke_run, tmp_path, capsys):
    out = tmp_path / "attribution"
    code, stdout, _ = run_cli(["attribute", str(smoke_run), "--samples", "3", "--prompt", "0 3 5 7 3 5",
                               "--out", str(out), "--no-progress"], capsys)
    assert code == 0 and "report:" in stdout and "Spearman" in stdout
    for name in ATTRIBUTION_TABLES:
        assert (out / f"{name}.csv").is_file() and (out / f"{name}.parquet").is_file(), name
    dla = pd.read_parquet(out / "depth_dla.parquet")
    assert sorted(dla["position"].unique()) == [0, 1, 2, 3, 4]  # the prompt's positions with a next token
    summary = json.loads((out / "attribution_summary.json").read_text())
    assert summary["prompt"] == "0 3 5 7 3 5" and summary["edge_agreement"]["n_edges"] > 0
    report = (out / "attribution_report.html").read_text()
    assert re.findall(r"<script[^>]*\ssrc\s*=", report, flags=re.I) == []  # plotly.js is inline, once
    assert re.findall(r"<link\b", report, flags=re.I) == [] and report.count("plotly.js v") == 1
    assert report.count('class="plotly-graph-div"') == 9


def test_attribute_command_reports_an_undefined_within_consumer_spearman(tmp_path, capsys):
    """Two layers in one block of four: no consumer reads three sources, so the within-consumer Spearman is
    undefined (None in the JSON summary): the report says n/a instead of failing to format it."""
    run = tmp_path / "one_block"
    train(apply_overrides(get_preset("smoke"), ["model.n_layers=2", "model.attnres_block_size=4", "train.steps=5",
                                                "train.checkpoint_every=5"]), run, progress=False)
    code, stdout, _ = run_cli(["attribute", str(run), "--samples", "3", "--out", str(tmp_path / "out"),
                               "--no-progress"], capsys)
    assert code == 0 and "report:" in stdout
    summary = json.loads((tmp_path / "out" / "attribution_summary.json").read_text())
    assert summary["edge_agreement"]["spearman_within_consumer"] is None
    assert "(n/a within consumers" in (tmp_path / "out" / "attribution_report.html").read_text()


def test_attribute_command_refuses_bad_input_in_one_line(smoke_run, tmp_path, capsys):
    cases = [
        (["attribute", str(tmp_path / "missing")], "does not exist"),
        (["attribute", str(smoke_run), "--samples", "1"], "samples must be an integer >= 2"),
        (["attribute", str(smoke_run), "--prompt", "1 2 x"], "space-separated integer ids"),
        (["attribute", str(smoke_run), "--prompt", "1 2 999"], "token id 999 is out of range"),
        (["attribute", str(smoke_run), "--prompt", "5"], "--prompt needs at least 2 tokens"),
        (["attribute", str(smoke_run), "--checkpoint", "999"], "has no checkpoint '999'; it has: latest"),
        (["attribute", str(smoke_run), "--prompt", " "], "--prompt is empty; give space-separated token ids"),
        (["attribute", str(smoke_run), "--prompt", " ".join(["1"] * 500)], "--prompt: sequence length 500 exceeds"),
    ]
    (tmp_path / "a-file").write_text("")
    cases.append((["attribute", str(smoke_run), "--out", str(tmp_path / "a-file")], "is a file"))
    for argv, message in cases:
        code, _, err = run_cli(argv + ["--no-progress"], capsys)
        assert code == 2 and err.startswith("attnres-lens: error: ") and message in err, (argv, err)
        assert err.count("\n") == 1, err


DEMO_RUNS = Path(__file__).resolve().parent.parent / "data" / "demo_runs"


@pytest.mark.slow
@pytest.mark.skipif(not DEMO_RUNS.is_dir(), reason="no demo runs (make demo)")
def test_attribute_works_on_every_shipped_demo_run(tmp_path, capsys):
    runs = sorted(path for path in DEMO_RUNS.iterdir() if (path / "config.json").is_file())
    assert runs
    for run in runs:
        code, stdout, err = run_cli(["attribute", str(run), "--samples", "2", "--out", str(tmp_path / run.name),
                                     "--no-progress"], capsys)
        assert code == 0, (run.name, err)
        assert (tmp_path / run.name / "attribution_report.html").is_file()


@pytest.mark.slow
def test_attribute_works_on_a_run_imported_from_fla(tmp_path, capsys):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install attnres_lens[fla])")
    from attnres_lens.interop import import_fla_run
    from tests.test_interop import make_fla  # FLA's own model class, built on the CPU

    fla = make_fla(seed=3, num_hidden_layers=2, vocab_size=40, max_position_embeddings=33, attnres_block_size=1)
    run, _ = import_fla_run(fla, tmp_path / "imported")
    code, stdout, err = run_cli(["attribute", str(run), "--samples", "3", "--no-progress"], capsys)
    assert code == 0, err
    tables = {name: pd.read_parquet(run / "analysis" / f"{name}.parquet") for name in ("edge_attribution", "timeline")}
    assert len(tables["edge_attribution"]) > 0 and tables["timeline"].empty  # imported: no training records


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end_on_a_tiny_model(tmp_path):
    from analyses.benchmarks import main as benchmarks

    rows = benchmarks(["bench_attribution", "--tiny", "--results", str(tmp_path / "results.jsonl")])
    value = {(row["metric"], row["variant"]): row["value"] for row in rows}
    assert value[("max |Δ| vs shared prefixes", "stacked full passes")] < 1e-5  # the engines agree
    assert value[("rank entries that differ", "stacked full passes")] >= 0  # counted apart
    assert value[("work", "shared prefixes")] < value[("work", "stacked full passes")]  # less work
    forked = next(variant for metric, variant in value if "forked process" in variant)
    assert value[("max |Δ| vs shared prefixes", forked)] == 0  # the same tables
    assert ("work", forked) not in value  # the child's work is not seen here
    assert value[("prune end to end", "as shipped")] > 0 and value[("prune end to end", "--threads 1")] > 0
    assert value[("clean forward pass", "no hooks")] > 0 and -1 <= value[("edge attribution spearman",
                                                                          "first order vs exact")] <= 1


# ---------------------------------------------------------------------------- hostile batches (issue 41 item 11)
def _analyses_of_a_batch():
    from attnres_lens.analysis import causal_routing, edge_attribution, routing_audit

    return {"edge_attribution": edge_attribution, "causal_routing": causal_routing,
            "routing_audit": lambda model, batch: routing_audit(model, batch, n_boot=10)}


@pytest.mark.parametrize("analysis", ["edge_attribution", "causal_routing", "routing_audit"])
def test_every_analysis_of_a_batch_checks_it_as_depth_logit_attribution_does(analysis):
    """Each refuses what would be misread (float or out-of-range targets, a mask of another shape or kind) or give
    a table of NaN effects without a word (no position with a target), naming the problem."""
    import dataclasses

    run = _analyses_of_a_batch()[analysis]
    model = HookedTransformer(small_config("attnres", 1, n_layers=1))
    batch = copy_batch(3)
    cases = {
        "must hold integer token ids, got dtype torch.float32": dict(targets=batch.targets.float()),
        "out of range for d_vocab=20": dict(targets=torch.where(batch.targets == IGNORE_INDEX, IGNORE_INDEX,
                                                                batch.targets + 20)),
        "batch.targets must have the tokens' shape": dict(targets=batch.targets[:, :-1]),
        "answer_mask must be booleans of the tokens' shape": dict(answer_mask=batch.answer_mask.long()),
        "no position with a target": dict(targets=torch.full_like(batch.targets, IGNORE_INDEX)),
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            run(model, dataclasses.replace(batch, **change))
    one_token = dataclasses.replace(batch, tokens=batch.tokens[:, :1], targets=batch.targets[:, :1] * 0 + IGNORE_INDEX,
                                    answer_mask=batch.answer_mask[:, :1])
    with pytest.raises(ValueError, match="one-token sequences"):
        run(model, one_token)
