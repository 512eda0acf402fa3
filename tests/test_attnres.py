"""AttnRes math (docs/model.md §2): depth attention, source bookkeeping, agreement with hand math and fla-core."""

from __future__ import annotations

import pytest
import torch

from attnres_lens import HookedTransformer
from attnres_lens.attnres import EMBEDDING, DepthAttention, source_layout
from tests.helpers import block_sources, depth_mix_float64, randomize_depth_parameters, reference_logits, small_config

E = EMBEDDING


def test_zero_init_gives_uniform_weights_and_the_mean_of_sources():
    depth = DepthAttention(d_model=8, eps=1e-6)
    sources = [torch.randn(2, 5, 8) * scale for scale in (1.0, 3.0, 0.1, 10.0)]
    captured = {}
    depth.hook_weights.add_hook(lambda w, hook: captured.setdefault("w", w))
    h = depth(sources)
    torch.testing.assert_close(captured["w"], torch.full((2, 5, 4), 0.25))
    torch.testing.assert_close(h, torch.stack(sources).mean(0))


def test_hand_computed_example():
    # k = RMSNorm([1,0,0,0]) = [2,0,0,0] → logit 4; the other source scores 0; h_0 = e^4 / (e^4 + 1).
    depth = DepthAttention(d_model=4, eps=1e-6)
    with torch.no_grad():
        depth.query.copy_(torch.tensor([2.0, 0, 0, 0]))
    h = depth([torch.tensor([1.0, 0, 0, 0]), torch.tensor([0.0, 1, 0, 0])])
    assert h[0].item() == pytest.approx(0.9820138, abs=1e-6)
    assert h[1].item() == pytest.approx(1 - 0.9820138, abs=1e-6)


def test_matches_float64_equation_and_no_sqrt_d_scale():
    torch.manual_seed(0)
    depth = DepthAttention(d_model=16, eps=1e-6).double()
    with torch.no_grad():
        depth.query.normal_()
        depth.key_norm.w.uniform_(0.5, 1.5)
    sources = [torch.randn(3, 7, 16, dtype=torch.float64) for _ in range(5)]
    expected = depth_mix_float64(sources, depth.query, depth.key_norm.w, 1e-6)
    torch.testing.assert_close(depth(sources), expected, rtol=1e-12, atol=1e-12)
    # A 1/sqrt(d) scale (a known reimplementation bug) would give a visibly different mix.
    scaled = depth_mix_float64(sources, depth.query / 4.0, depth.key_norm.w, 1e-6)
    assert (depth(sources) - scaled).abs().max() > 1e-2


def test_matches_fla_naive_attnres_oracle():
    naive = pytest.importorskip("fla.ops.attnres").naive_attnres
    torch.manual_seed(1)
    for n_sources, d_model in [(1, 8), (3, 24), (9, 40)]:
        depth = DepthAttention(d_model, eps=1e-6)
        with torch.no_grad():
            depth.query.normal_()
            depth.key_norm.w.uniform_(0.5, 1.5)
        sources = [torch.randn(2, 6, d_model) for _ in range(n_sources)]
        captured = {}
        depth.hook_weights.add_hook(lambda w, hook: captured.setdefault("w", w))
        h = depth(sources)
        expected_h, expected_w = naive(
            depth.query, sources, depth.key_norm.w, rms_eps=1e-6, scale=1.0, return_weights=True
        )
        torch.testing.assert_close(h, expected_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(captured["w"], expected_w.movedim(0, -1), rtol=1e-5, atol=1e-6)


def test_worked_example_block_size_4():
    # docs/model.md §3 table: S = 4, 3 layers with MLPs (J = 6).
    expected = {
        0: [[E]],
        1: [[E], [0]],
        2: [[E], [0, 1]],
        3: [[E], [0, 1, 2]],
        4: [[E], [0, 1, 2, 3]],
        5: [[E], [0, 1, 2, 3], [4]],
        6: [[E], [0, 1, 2, 3], [4, 5]],  # final readout: every block and the last partial
    }
    for consumer, sources in expected.items():
        assert source_layout(consumer, 6, 4) == sources


@pytest.mark.parametrize("block_size", [1, 2, 4, 6])
@pytest.mark.parametrize("n_sublayers", [1, 5, 8, 12])
def test_source_sets_follow_the_block_definitions(block_size, n_sublayers):
    # Compare index layouts with the block definitions (docs/model.md §2) applied to symbolic outputs: output i is the
    # one-hot vector e_i, so a sum of outputs is the set of its members.
    eye = torch.eye(n_sublayers + 1)
    embedding, outputs = eye[n_sublayers], list(eye[:n_sublayers])
    for consumer in range(n_sublayers + 1):
        layout = source_layout(consumer, n_sublayers, block_size)
        spec = block_sources(consumer, embedding, outputs, block_size, n_sublayers)
        members = [sorted(EMBEDDING if i == n_sublayers else i for i in v.nonzero().flatten().tolist()) for v in spec]
        assert layout == members
        assert layout[0] == [E] and all(E not in source for source in layout[1:]), "embedding folded into a block"
        if consumer == 0:
            assert layout == [[E]]
        # Sources partition exactly the earlier sublayers.
        flat = sorted(i for source in layout[1:] for i in source)
        assert flat == list(range(consumer))


def test_block_size_1_is_full_attnres():
    for consumer in range(7):
        assert source_layout(consumer, 6, 1) == [[E]] + [[i] for i in range(consumer)]


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("attn_only", [False, True])
def test_model_matches_independent_float64_reimplementation(block_size, attn_only):
    model = HookedTransformer(small_config("attnres", block_size, attn_only=attn_only))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens).double(), reference_logits(model, tokens), rtol=1e-4, atol=1e-4)


def test_full_attnres_is_block_size_1_and_differs_from_block_mode():
    full = HookedTransformer(small_config("attnres", 1))
    block = HookedTransformer(small_config("attnres", 4))
    block.load_state_dict(full.state_dict())
    randomize_depth_parameters(full)
    randomize_depth_parameters(block)
    tokens = torch.randint(0, 20, (2, 9))
    assert (full(tokens) - block(tokens)).abs().max() > 1e-4  # block sums change what is attended


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_aggregated_input_recomputed_from_hooks_in_float64(block_size):
    model = HookedTransformer(small_config("attnres", block_size))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (3, 10))
    _, cache = model.run_with_cache(tokens)
    outputs = []
    for layer in range(model.cfg.n_layers):
        outputs += [cache["attn_out", layer], cache["mlp_out", layer]]
    J = model.cfg.n_sublayers
    for consumer in range(J):
        layer, kind = divmod(consumer, 2)
        sources = [
            cache["hook_embed"] if members == [E] else sum(outputs[i] for i in members)
            for members in source_layout(consumer, J, block_size)
        ]
        weights = cache[f"blocks.{layer}.{'mlp' if kind else 'attn'}_res.hook_weights"].double()
        assert weights.shape == (3, 10, len(sources))
        torch.testing.assert_close(weights.sum(-1), torch.ones(3, 10, dtype=torch.float64))
        recomputed = sum(weights[..., s, None] * v.double() for s, v in enumerate(sources))
        hooked_input = cache["resid_mid" if kind else "resid_pre", layer].double()
        torch.testing.assert_close(recomputed, hooked_input, rtol=1e-5, atol=1e-6)
    final_weights = cache["final_res.hook_weights"]
    assert final_weights.shape[-1] == len(source_layout(J, J, block_size))


def test_first_sublayer_has_one_source_with_weight_one():
    model = HookedTransformer(small_config("attnres", 2))
    randomize_depth_parameters(model)
    _, cache = model.run_with_cache(torch.randint(0, 20, (2, 5)))
    assert torch.equal(cache["blocks.0.attn_res.hook_weights"], torch.ones(2, 5, 1))
    torch.testing.assert_close(cache["resid_pre", 0], cache["hook_embed"])


def test_fresh_model_has_uniform_depth_weights_everywhere():
    model = HookedTransformer(small_config("attnres", 2))
    _, cache = model.run_with_cache(torch.randint(0, 20, (2, 6)))
    names = [name for name in cache.cache_dict if name.endswith("hook_weights")]
    assert len(names) == 2 * model.cfg.n_layers + 1
    for name in names:
        weights = cache[name]
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / weights.shape[-1]))


def test_source_labels():
    full = HookedTransformer(small_config("attnres", 1))
    assert full.source_labels(0) == ["emb"]
    assert full.source_labels(3) == ["emb", "L0.attn", "L0.mlp", "L1.attn"]
    block = HookedTransformer(small_config("attnres", 4))  # 3 layers, J = 6
    assert block.source_labels(4) == ["emb", "B1 (L0–L1)"]
    assert block.source_labels(5) == ["emb", "B1 (L0–L1)", "partial"]
    assert block.source_labels(6) == ["emb", "B1 (L0–L1)", "partial"]
    by_layer = HookedTransformer(small_config("attnres", 2))
    assert by_layer.source_labels(6) == ["emb", "B1 (L0)", "B2 (L1)", "B3 (L2)"]
    with pytest.raises(ValueError, match="consumer must be in 0..6"):
        block.source_labels(7)
