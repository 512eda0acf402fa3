"""The shared-prefix evaluation of many interventions (docs/analysis.md): the staged forward pass, `evaluate_many`,
its state cache, stacked copies and worker threads (attnres_lens/analysis/engine.py, workers.py, session.py).

Ground truth is independent of the code under test: one full forward pass per intervention (the model's own
`run_with_hooks`) and the model's own forward pass, which the stages must compose to exactly.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

import attnres_lens.model as model_module
from attnres_lens import HookedTransformer, attnres, depth_execution
from attnres_lens.analysis import (
    StateCache,
    angular_distance_matrix,
    causal_routing,
    cumulative_pruning,
    evaluate,
    evaluate_many,
    induction_head_scores,
    pruning_sensitivity,
    removal_hooks,
    session,
    source_mask_hooks,
)
from attnres_lens.analysis.engine import EMBEDDING_STAGE, StagedForward, hook_stages, slice_state
from attnres_lens.analysis.interventions import replace_hook
from attnres_lens.analysis.pruning import CHEAP_METRICS
from attnres_lens.analysis.run import prune_tables
from attnres_lens.analysis.session import model_replica
from attnres_lens.analysis.workers import analysis_workers
from attnres_lens.evaluation import score_logits
from attnres_lens.tasks.base import Batch

from .helpers import (
    VARIANTS,
    copy_batch,
    float32_chain_length,
    randomize_depth_parameters,
    reordering_bound,
    small_config,
)


def _accepted(residual: str) -> bool:
    try:
        small_config(residual)
    except ValueError:
        return False
    return True


# every residual kind the model offers, each also attention-only with learned positions
KINDS = VARIANTS + [((kind, 1), "standard") for kind in ("denseformer", "mhc") if _accepted(kind)]
ALL_LAYOUTS = [
    (residual, attention, extra)
    for (residual, attention) in KINDS
    for extra in ({}, {"attn_only": True, "positional_embedding_type": "standard"})
]


def one_pass_each(model: HookedTransformer, batch, interventions) -> list:
    """The reference: one full forward pass of the model per intervention."""
    with torch.no_grad():
        return [
            score_logits(model.run_with_hooks(batch.tokens, fwd_hooks=list(hooks)), batch) for hooks in interventions
        ]


# ---------------------------------------------------------------------------- shared-prefix evaluation
@pytest.mark.parametrize(
    "residual, attention, extra",
    ALL_LAYOUTS,
    ids=[f"{r[0]}{r[1]}-{a}{'-attn_only' if e else ''}" for r, a, e in ALL_LAYOUTS],
)
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
    interventions = [
        [],
        removal_hooks(model, [J - 1]),
        removal_hooks(model, [1]),
        removal_hooks(model, [1, 3]),
        removal_hooks(model, [0, 1, 3]),
        removal_hooks(model, [1, 3]),  # a duplicate
        [(model.sublayer_output_hook(2), replace_hook(noise))],
        [("hook_embed", lambda t, hook: t * 0.5)],
        [("ln_final.hook_scale", lambda t, hook: t * 2)],
    ]
    for consumer, module in model.depth_attention_modules().items():
        if len(model.sources(consumer)) > 1:
            interventions += [source_mask_hooks(model, consumer, [0]), source_mask_hooks(model, consumer, [1])]
    return interventions


@pytest.mark.parametrize(
    "residual, block_size",
    [("standard", 1), ("attnres", 1), ("attnres", 2)]
    + [(kind, 1) for kind in ("denseformer", "mhc") if _accepted(kind)],
)
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
    inner = depth_execution.DepthExecution._phase1_over_copies

    def spied(self, shared, queries, gains, eps):
        stats = inner(self, shared, queries, gains, eps)
        if stats is not None:
            shared_windows.append((len(shared), len(self._copies.originals), self._copies.n_copies))
        return stats

    monkeypatch.setattr(depth_execution.DepthExecution, "_phase1_over_copies", spied)
    got = evaluate_many(model, batch, interventions, max_sequences=3 * len(interventions))
    for single, together in zip(one_pass_each(model, batch, interventions), got):
        assert together.loss == pytest.approx(single.loss, abs=1e-6)
        assert together.accuracy == single.accuracy
    # knockouts at 9: consumer 10's window reads 11 sources, 10 of them shared; knockouts at 10: consumer 11's
    # reads 12, 11 shared; the two output hooks at 11: its window reads only the 12 shared sources
    assert sorted(shared_windows) == [(11, 10, 3), (12, 11, 3), (12, 12, 2)]
    # branches that part at the final readout: the readout reads the blocks without closing the last partial sum,
    # which the copies share too (stacked before it was closed), so phase 1 covers one source fewer than shared
    final_only = [
        [("ln_final.hook_normalized", lambda tensor, hook: tensor * 2)],
        [("ln_final.hook_normalized", lambda tensor, hook: tensor * 0.5)],
    ]
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
    inner = depth_execution.depth_attention_copies_cpu

    def spied(shared, stacked, n_copies, *rest, **options):
        mixed.append((len(shared), len(stacked), n_copies))
        return inner(shared, stacked, n_copies, *rest, **options)

    monkeypatch.setattr(depth_execution, "depth_attention_copies_cpu", spied)
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
    from attnres_lens.analysis.engine import concat_states
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

    for name, (interventions, expected_rows) in cases.items():  # noqa: F402 (a local list, not the module)
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


@pytest.mark.parametrize(
    "residual, block_size",
    [("attnres", 1), ("attnres", 3), ("standard", 1)]
    + [(kind, 1) for kind in ("denseformer", "mhc") if _accepted(kind)],
)
def test_the_analyses_give_the_same_numbers_on_worker_threads(residual, block_size, monkeypatch):
    # AttnRes mixes two-phase here, and a window's phase-1 statistics belong to one batch: stacking or slicing a
    # stream must drop them. Full AttnRes on the C kernel from the first shared source (in this small model no
    # window would open otherwise); Block AttnRes on the readable two-phase, as it runs where Triton does.
    monkeypatch.setattr(depth_execution, "MIN_SHARED_SOURCES", 1)
    if block_size > 1:
        monkeypatch.setattr(depth_execution, "stream_two_phase_backend", lambda *args: "torch")
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
    with session.analysis_session():
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
    # Another thread count splits an op's float32 sums differently: every entry (losses, their differences,
    # distances, α mass) is a chain of float32_chain_length sums of terms up to the largest loss in the tables.
    scale = max(frame.select_dtypes("number").abs().max().max() for frame in serial)
    bound = reordering_bound(float32_chain_length(model.cfg, batch.tokens), scale)
    for one, other, third in zip(serial, parallel, shared_threads):
        # the cheap metrics come from clean passes on this thread, not from the workers: equal up to rounding
        cheap = [column for column in CHEAP_METRICS if column in one]
        pd.testing.assert_frame_equal(one.drop(columns=cheap), other.drop(columns=cheap), check_exact=True)
        pd.testing.assert_frame_equal(one[cheap], other[cheap], check_exact=False, rtol=0, atol=bound)
        # two torch threads per worker may split an op's sums differently: equal up to float rounding
        pd.testing.assert_frame_equal(one, third, check_exact=False, rtol=0, atol=bound)


def test_an_analysis_session_keeps_the_workers_replicas_and_notices_new_hooks(monkeypatch):
    """prune_tables makes one replica per worker for all its evaluate_many calls, with the tables of a run
    without workers; a hook attached to the model between two calls of a session reaches the workers (the
    replicas copied before it are not reused)."""
    model = HookedTransformer(small_config("attnres", 1)).eval()
    randomize_depth_parameters(model)
    batch = copy_batch(3)
    serial = prune_tables(model, batch)
    made = [0]
    inner = session.model_replica
    monkeypatch.setattr(session, "model_replica", lambda m: made.__setitem__(0, made[0] + 1) or inner(m))
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
        with session.analysis_session():
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
    with pytest.raises(ValueError, match="workers must be a positive integer, got None"):
        evaluate_many(model, copy_batch(2), [[]], workers=None)
    for analysis in (causal_routing, evaluate, pruning_sensitivity, induction_head_scores):
        with pytest.raises(TypeError, match=r"batch must be a Batch .* got Tensor.*Batch\.from_tokens\(tokens\)"):
            analysis(model, copy_batch(2).tokens)


def test_a_batch_from_tokens_scores_every_next_token():
    tokens = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    batch = Batch.from_tokens(tokens)
    assert batch.targets.tolist() == [[1, 4, 1, -100], [9, 2, 6, -100]]
    assert batch.answer_mask.tolist() == [[True, True, True, False]] * 2
    with pytest.raises(ValueError, match=r"integer ids of shape \[batch, pos\], got torch.float32 \(4,\)"):
        Batch.from_tokens(torch.ones(4))
    with pytest.raises(ValueError, match="integer ids"):
        Batch.from_tokens(torch.ones(1, 4, dtype=torch.complex64))


class _UnbatchedScale(HookedRootModule):
    """A model outside the toolkit whose one hook point holds a scalar, not a batch's rows."""

    d_vocab = 5

    def __init__(self) -> None:
        super().__init__()
        self.hook_scale = HookPoint()  # [] one scale for every sequence
        self.setup()

    def to_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(tokens, self.d_vocab).float() * self.hook_scale(torch.ones(()))


def test_stacking_refuses_a_hook_point_without_the_batch_axis_by_name():
    """Interventions on a model the staged engine does not know run stacked along the batch; a hook point whose
    tensor does not lead with every copy's rows cannot be split per copy and is named, not mis-split."""
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]])
    batch = Batch(tokens, tokens, torch.ones_like(tokens, dtype=torch.bool))
    double = [("hook_scale", lambda scale, hook: 2 * scale)]
    model = _UnbatchedScale()
    assert len(evaluate_many(model, batch, [double])) == 1  # one intervention: a pass of its own, no stack
    with pytest.raises(ValueError, match=r"hook point 'hook_scale' gave shape \(\).*lead with the batch axis"):
        evaluate_many(model, batch, [double, []])
