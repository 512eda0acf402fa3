"""Attribution through depth (docs/analysis.md §11) and the shared-prefix evaluation of many interventions.

Ground truth is independent of the code under test: one full forward pass per intervention (the model's own
`run_with_hooks`), float64 re-derivations, TransformerLens's own residual decomposition, exact knockouts and
hand-built circuits whose answer is known.
"""

from __future__ import annotations

import pytest
import torch

from attnres_lens import HookedTransformer
from attnres_lens.analysis import causal_routing, evaluate_many, removal_hooks, source_mask_hooks
from attnres_lens.analysis.interventions import (
    EMBEDDING_STAGE,
    StagedForward,
    StateCache,
    hook_stages,
    replace_hook,
)
from attnres_lens.evaluation import score_logits
from attnres_lens.tasks import make_task

from .helpers import VARIANTS, randomize_depth_parameters, small_config

def _accepted(residual: str) -> bool:
    try:
        small_config(residual)
    except ValueError:
        return False
    return True


# every residual kind the model offers, each also attention-only with learned positions
KINDS = VARIANTS + [((kind, 1), "standard") for kind in ("denseformer", "hyper") if _accepted(kind)]
ALL_LAYOUTS = [(residual, attention, extra) for (residual, attention) in KINDS
               for extra in ({}, {"attn_only": True, "positional_embedding_type": "standard"})]


def copy_batch(n: int = 4, vocab: int = 20, seq_len: int = 24):
    return make_task("copy", vocab_size=vocab, seq_len=seq_len, min_len=4, max_len=8).eval_batch(n)


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
                         + [(kind, 1) for kind in ("denseformer", "hyper") if _accepted(kind)])
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
