"""The hooked model family: shapes, hooks, KV shift, causality, TL compatibility, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from transformer_lens import ActivationCache
from transformer_lens.head_detector import detect_head
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import get_act_name

from attnres_lens import HookedTransformer, ModelConfig, adamw, param_groups
from attnres_lens.components import normal_init, rotary_tables
from attnres_lens.hook_checks import is_hooked
from attnres_lens.kernels import apply_rotary
from tests.helpers import VARIANTS, randomize_depth_parameters, reference_logits, small_config


@pytest.mark.parametrize("residual_and_size,attention", VARIANTS)
def test_every_variant_matches_the_float64_reimplementation(residual_and_size, attention):
    residual, block_size = residual_and_size
    model = HookedTransformer(small_config(residual, block_size, attention))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (2, 12))
    torch.testing.assert_close(model(tokens).double(), reference_logits(model, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("residual_and_size,attention", VARIANTS)
@pytest.mark.parametrize("positional", ["rotary", "standard"])
def test_causality(residual_and_size, attention, positional):
    residual, block_size = residual_and_size
    model = HookedTransformer(small_config(residual, block_size, attention, positional_embedding_type=positional))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (2, 16))
    for t in (0, 5, 14):
        changed = tokens.clone()
        changed[:, t + 1 :] = torch.randint(0, 20, changed[:, t + 1 :].shape)
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % 20  # guarantee every later token differs
        torch.testing.assert_close(model(tokens)[:, : t + 1], model(changed)[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(model(tokens)[:, t + 1 :], model(changed)[:, t + 1 :])


def test_hook_shapes_follow_the_hook_table():
    cfg = small_config("attnres", 2, "kv_shift", n_key_value_heads=2)
    model = HookedTransformer(cfg)
    batch, pos = 2, 7
    _, cache = model.run_with_cache(torch.randint(0, 20, (batch, pos)))
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head
    expected = {
        "hook_embed": (batch, pos, d),
        "blocks.1.hook_resid_pre": (batch, pos, d),
        "blocks.1.hook_resid_mid": (batch, pos, d),
        "blocks.1.hook_block_partial": (batch, pos, d),  # AttnRes: the block's partial sum, not a residual stream
        "blocks.1.attn.hook_q": (batch, pos, h, dh),
        "blocks.1.attn.hook_k": (batch, pos, kv, dh),
        "blocks.1.attn.hook_v": (batch, pos, kv, dh),
        "blocks.1.attn.hook_k_shifted": (batch, pos, kv, dh),
        "blocks.1.attn.hook_v_shifted": (batch, pos, kv, dh),
        "blocks.1.attn.hook_rot_q": (batch, pos, h, dh),
        "blocks.1.attn.hook_rot_k": (batch, pos, kv, dh),
        "blocks.1.attn.hook_attn_scores": (batch, h, pos, pos),
        "blocks.1.attn.hook_pattern": (batch, h, pos, pos),
        "blocks.1.attn.hook_z": (batch, pos, h, dh),
        "blocks.1.hook_attn_out": (batch, pos, d),
        "blocks.1.hook_mlp_out": (batch, pos, d),
        "blocks.1.attn_res.hook_logits": (batch, pos, 2),  # [e, b_1]: layer 1 starts block 2 at S = 2
        "blocks.1.attn_res.hook_weights": (batch, pos, 2),
        "blocks.1.mlp_res.hook_weights": (batch, pos, 3),  # [e, b_1, partial]
        "final_res.hook_weights": (batch, pos, 4),
        "ln_final.hook_normalized": (batch, pos, d),
    }
    for name, shape in expected.items():
        assert tuple(cache[name].shape) == shape, name
    assert not any(name.endswith("pattern") for name in cache.cache_dict if "_res." in name)


def test_hook_points_and_parameter_names():
    model = HookedTransformer(small_config("attnres", 1, "kv_shift", positional_embedding_type="standard"))
    params = dict(model.named_parameters())
    for name in [
        "blocks.0.attn_res.query",
        "blocks.0.attn_res.key_norm.w",
        "blocks.2.mlp_res.query",
        "blocks.2.mlp_res.key_norm.w",
        "final_res.query",
        "final_res.key_norm.w",
        "pos_embed.W_pos",
    ]:
        assert name in params, name
    assert params["blocks.1.attn.kv_shift"].shape == (4, 4)
    assert "hook_pos_embed" in model.hook_dict
    standard = HookedTransformer(small_config())
    assert not any(part in name for name in standard.hook_dict for part in ("attn_res.", "mlp_res.", "final_res."))
    assert not any("kv_shift" in name for name, _ in standard.named_parameters())
    attn_only = HookedTransformer(small_config("attnres", 1, attn_only=True))
    assert "blocks.0.hook_resid_mid" not in attn_only.hook_dict and "blocks.0.mlp_res.query" not in dict(
        attn_only.named_parameters()
    )


def test_hook_point_layer_parsing():
    model = HookedTransformer(small_config("attnres", 2))
    assert model.hook_dict["blocks.2.attn_res.hook_weights"].layer() == 2
    assert model.hook_dict["blocks.1.attn.hook_pattern"].layer() == 1


def test_kv_shift_with_identity_coefficients_equals_standard_attention():
    standard = HookedTransformer(small_config(attention="standard"))
    shifted = HookedTransformer(small_config(attention="kv_shift"))
    state = {k: v for k, v in shifted.state_dict().items() if "kv_shift" not in k}
    standard.load_state_dict(state)
    with torch.no_grad():
        for block in shifted.blocks:
            block.attn.kv_shift.copy_(torch.tensor([1.0, 0.0, 1.0, 0.0]).expand_as(block.attn.kv_shift))
    tokens = torch.randint(0, 20, (2, 15))
    assert torch.equal(shifted(tokens), standard(tokens))


def test_kv_shift_reads_the_previous_token_with_zeros_at_t0():
    model = HookedTransformer(small_config(attention="kv_shift"))
    with torch.no_grad():
        coefficients = torch.tensor(
            [[0.0, 1.0, 0.3, 0.7], [1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 1.0, 0.0], [0.2, -0.4, 2.0, 0.1]]
        )
        model.blocks[0].attn.kv_shift.copy_(coefficients)
    _, cache = model.run_with_cache(torch.randint(0, 20, (2, 9)))
    k, v = cache["k", 0], cache["v", 0]
    k_prev = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], dim=1)
    v_prev = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
    for head, (a1, a2, b1, b2) in enumerate(coefficients.tolist()):
        torch.testing.assert_close(
            cache["blocks.0.attn.hook_k_shifted"][:, :, head], a1 * k[:, :, head] + a2 * k_prev[:, :, head]
        )
        torch.testing.assert_close(
            cache["blocks.0.attn.hook_v_shifted"][:, :, head], b1 * v[:, :, head] + b2 * v_prev[:, :, head]
        )
    # Pure shift (α = (0, 1)): position 0 sees a zero key.
    assert torch.equal(cache["blocks.0.attn.hook_k_shifted"][:, 0, 0], torch.zeros_like(k[:, 0, 0]))


def test_kv_shift_initialisation():
    model = HookedTransformer(small_config(attention="kv_shift", n_layers=8))
    coefficients = torch.stack([block.attn.kv_shift for block in model.blocks])
    alpha1, alpha2, beta1, beta2 = coefficients.unbind(-1)
    assert ((alpha1 >= 0) & (alpha1 <= 1)).all() and ((beta1 >= 0) & (beta1 <= 1)).all()
    torch.testing.assert_close(alpha1 + alpha2, torch.ones_like(alpha1))
    torch.testing.assert_close(beta1 + beta2, torch.ones_like(beta1))
    assert alpha1.std() > 0.05  # drawn, not constant


def test_rope_is_applied_to_the_shifted_keys():
    # Independent RoPE: rotate each (i, i + d/2) pair as a complex number by t·θ_i, in float64.
    model = HookedTransformer(small_config(attention="kv_shift"))
    pos = 10
    _, cache = model.run_with_cache(torch.randint(0, 20, (1, pos)))
    shifted = cache["blocks.2.attn.hook_k_shifted"].double()
    half = shifted.shape[-1] // 2
    theta = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / shifted.shape[-1])
    rotation = torch.polar(
        torch.ones(pos, half, dtype=torch.float64), torch.arange(pos, dtype=torch.float64)[:, None] * theta
    )
    z = torch.complex(shifted[..., :half], shifted[..., half:]) * rotation[None, :, None, :]
    expected = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(cache["blocks.2.attn.hook_rot_k"].double(), expected, rtol=1e-5, atol=1e-6)
    cos, sin = rotary_tables(pos, shifted.shape[-1], 10000.0)
    assert torch.allclose(apply_rotary(shifted.float(), cos[:, None], sin[:, None]).double(), expected, atol=1e-5)


def test_param_groups_keep_scalars_queries_and_gains_out_of_weight_decay():
    model = HookedTransformer(small_config("attnres", 2, "kv_shift"))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decayed.isdisjoint(kept) and decayed | kept == set(names.values())
    for name in [
        "blocks.0.attn.kv_shift",
        "blocks.1.attn_res.query",
        "blocks.1.mlp_res.key_norm.w",
        "final_res.query",
        "blocks.0.ln1.w",
        "ln_final.w",
    ]:
        assert name in kept, name
    for name in ["blocks.0.attn.W_Q", "blocks.0.mlp.W_in", "embed.W_E", "unembed.W_U"]:
        assert name in decayed, name
    torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)  # accepted by the optimiser as is


def test_adamw_is_fused_on_the_cpu_and_steps_like_the_per_tensor_loop():
    def trained(make_optimizer) -> dict[str, torch.Tensor]:
        model = HookedTransformer(small_config("attnres", 2, "kv_shift"))
        optimizer = make_optimizer(model)
        tokens = torch.randint(0, 20, (3, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            model(tokens, return_type="loss").backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    fused = adamw(HookedTransformer(small_config()), 1e-2, 0.1, (0.9, 0.95))
    assert fused.defaults["fused"] and [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]
    got = trained(lambda model: adamw(model, 1e-2, 0.1, (0.9, 0.95)))
    want = trained(lambda model: torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=False))
    assert got.keys() == want.keys()
    for name in want:  # three steps of lr 1e-2 move every parameter; the two implementations agree to rounding
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    frozen = HookedTransformer(small_config()).requires_grad_(False)
    with pytest.raises(ValueError, match="adamw needs a model with trainable parameters; HookedTransformer has none"):
        adamw(frozen, 1e-2, 0.1)


def test_loss_is_next_token_cross_entropy():
    model = HookedTransformer(small_config())
    tokens = torch.randint(0, 20, (3, 8))
    logits, loss = model(tokens, return_type="both")
    log_probs = logits.double().log_softmax(-1)
    expected = -log_probs[:, :-1].gather(-1, tokens[:, 1:, None]).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert model(tokens, return_type="loss", loss_per_token=True).shape == (3, 7)
    assert model(tokens, return_type=None) is None
    assert abs(loss.item() - math.log(20)) < 0.5  # near-uniform predictions at init


def test_run_with_cache_returns_activation_cache_and_tl_names_resolve():
    model = HookedTransformer(small_config("attnres", 1))
    logits, cache = model.run_with_cache(torch.randint(0, 20, (2, 6)))
    assert isinstance(cache, ActivationCache)
    assert cache["pattern", 1].shape == (2, 4, 6, 6)
    assert torch.equal(cache["pattern", 1], cache["blocks.1.attn.hook_pattern"])
    for args in [
        ("q", 0),
        ("k", 1),
        ("v", 2),
        ("z", 0),
        ("pattern", 1),
        ("attn_scores", 2),
        ("resid_pre", 0),
        ("resid_mid", 1),
        ("attn_out", 0),
        ("mlp_out", 1),
        ("pre", 0),
        ("post", 2),
        ("rot_q", 1),
        ("rot_k", 1),
        ("normalized", 0, "ln1"),
        ("scale", 2, "ln2"),
        ("embed",),
    ]:
        assert get_act_name(*args) in cache.cache_dict, args
    assert cache["pattern", -1].shape == (2, 4, 6, 6)
    _, single = model.run_with_cache([1, 2, 3], remove_batch_dim=True)
    assert single["pattern", 0].shape == (4, 3, 3)


def test_detect_head_runs_on_the_model():
    model = HookedTransformer(small_config("attnres", 2, "kv_shift"))
    scores = detect_head(model, "1 5 7 9 3 5 7 9 3 2", "induction_head")
    assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads)
    assert ((scores >= 0) & (scores <= 1)).all()
    previous = detect_head(model, "1 5 7 9 3 5 7 9 3 2", "previous_token_head")
    assert previous.shape == (3, 4)


def test_forward_and_backward_hooks_fire_on_depth_attention():
    model = HookedTransformer(small_config("attnres", 2))
    seen = {"fwd": [], "bwd": []}
    names = ["blocks.1.attn_res.hook_weights", "blocks.1.mlp_res.hook_logits", "final_res.hook_weights"]
    for name in names:
        model.add_hook(name, lambda t, hook: seen["fwd"].append(hook.name), dir="fwd")
        model.add_hook(
            name,
            lambda g, hook: seen["bwd"].append(
                (hook.name, g[0].shape) if isinstance(g, tuple) else (hook.name, g.shape)
            ),
            dir="bwd",
        )
    loss = model(torch.randint(0, 20, (2, 6)), return_type="loss")
    loss.backward()
    model.reset_hooks()
    assert sorted(seen["fwd"]) == sorted(names)
    assert sorted(name for name, _ in seen["bwd"]) == sorted(names)


def test_patching_a_depth_weight_hook_changes_the_output():
    model = HookedTransformer(small_config("attnres", 1))
    tokens = torch.randint(0, 20, (1, 5))

    def attend_only_to_embedding(weights, hook):
        return torch.zeros_like(weights).index_fill(-1, torch.tensor([0]), 1.0)

    clean = model(tokens)
    patched = model.run_with_hooks(tokens, fwd_hooks=[("final_res.hook_weights", attend_only_to_embedding)])
    assert not torch.allclose(clean, patched)
    _, cache = model.run_with_cache(tokens)
    expected = model.unembed(model.ln_final(cache["hook_embed"]))
    torch.testing.assert_close(patched, expected)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(residual="highway"),
            r"residual must be one of \['standard', 'attnres', 'denseformer', 'mhc'\], got 'highway'",
        ),
        (dict(attention="linear"), r"attention must be one of \['standard', 'kv_shift'\]"),
        (dict(attnres_block_size=0), r"attnres_block_size must be an integer >= 1, got 0"),
        (dict(d_model=30, n_heads=4), r"d_model=30 is not divisible into n_heads=4"),
        (dict(d_model=32, n_heads=4, d_head=16), r"n_heads \* d_head must equal d_model"),
        (dict(n_ctx=0), r"n_ctx must be an integer >= 1, got 0"),
        (dict(d_vocab=-5), r"d_vocab must be an integer >= 1"),
        (dict(n_key_value_heads=3), r"n_key_value_heads=3 must be >= 1 and divide n_heads=4"),
        (dict(positional_embedding_type="alibi"), r"positional_embedding_type must be one of"),
        (dict(attnres_eps=0.0), r"attnres_eps must be > 0"),
        (dict(depth_attention_backend="cuda"), r"depth_attention_backend must be one of"),
        (dict(dtype="float8"), r"dtype must be one of"),
    ],
)
def test_bad_config_values_raise_clear_errors(overrides, match):
    params = dict(d_model=32, n_heads=4)
    params.update(overrides)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**params)


def test_config_json_round_trip():
    cfg = small_config("attnres", 4, "kv_shift", dtype="float64", n_key_value_heads=2, attn_only=True)
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg and again.dtype == torch.float64 and again.d_head == 8
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['block_sz'\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "block_sz": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json("{residual: attnres")
    assert cfg.variant == "block4+kv_shift" and small_config("attnres", 1).variant == "full"


def test_bad_tokens_raise_clear_errors():
    model = HookedTransformer(small_config())
    with pytest.raises(ValueError, match=r"token id 20 is out of range for d_vocab=20 \(valid ids 0..19\)"):
        model(torch.tensor([[1, 2, 20]]))
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        model([3, -1])
    with pytest.raises(ValueError, match="sequence length 25 exceeds n_ctx=24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must be integer ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="space-separated integer ids"):
        model.to_tokens("the cat")
    with pytest.raises(ValueError, match="return_type must be one of"):
        model(torch.zeros(1, 4, dtype=torch.long), return_type="probs")


def test_to_tokens_accepts_lists_tensors_and_strings():
    model = HookedTransformer(small_config())
    expected = torch.tensor([[3, 4, 5]])
    for tokens in ([3, 4, 5], [[3, 4, 5]], torch.tensor([3, 4, 5], dtype=torch.int32), "3 4 5"):
        assert torch.equal(model.to_tokens(tokens), expected)


def test_gradients_reach_every_parameter():
    model = HookedTransformer(small_config("attnres", 2, "kv_shift"))
    randomize_depth_parameters(model)
    model(torch.randint(0, 20, (2, 8)), return_type="loss").backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    # Sublayer 0 reads one source with weight exactly 1, so its query and key norm get no gradient.
    assert missing == ["blocks.0.attn_res.query", "blocks.0.attn_res.key_norm.w"]


def test_tl_residual_helpers_work_on_the_standard_residual():
    """TL's decomposition helpers read the standard model's running sum correctly."""
    model = HookedTransformer(small_config("standard", positional_embedding_type="standard"))
    _, cache = model.run_with_cache(torch.randint(0, 20, (2, 6)))
    final = cache["blocks.2.hook_resid_post"]
    accumulated = cache.accumulated_resid()
    torch.testing.assert_close(accumulated[-1], final)
    torch.testing.assert_close(accumulated[1], cache["blocks.1.hook_resid_pre"])
    # the components (embeddings, every attention and MLP output) sum to the residual stream exactly
    torch.testing.assert_close(cache.decompose_resid().sum(0), final, rtol=1e-5, atol=1e-6)
    components = cache.get_full_resid_decomposition(expand_neurons=False)
    torch.testing.assert_close(components.sum(0), final, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_size", [1, 2])
def test_tl_residual_helpers_refuse_attnres(block_size):
    """An AttnRes model has no running sum: TL's helpers would misread it, so they refuse, naming the residual."""
    model = HookedTransformer(small_config("attnres", block_size))
    _, cache = model.run_with_cache(torch.randint(0, 20, (2, 6)))
    assert "blocks.0.hook_resid_post" not in cache.cache_dict  # the post-layer state has a truthful name
    assert cache["blocks.0.hook_block_partial"].shape == (2, 6, 32)
    refused = [
        cache.accumulated_resid,
        cache.decompose_resid,
        cache.get_full_resid_decomposition,
        cache.logit_lens,
        lambda: cache.stack_head_results(incl_remainder=True),
    ]
    for helper in refused:
        with pytest.raises(ValueError, match="running-sum residual stream.*'attnres'"):
            helper()
    assert cache.stack_head_results().shape[0] == model.cfg.n_layers * model.cfg.n_heads  # per-head outputs are fine


# ---------------------------------------------------------------------------- Llama-style options (docs/model.md §6)
def test_gated_mlp_is_swiglu_with_transformer_lens_hook_names():
    model = HookedTransformer(small_config("attnres", 2, gated_mlp=True, act_fn="silu", d_mlp=40))
    mlp = model.blocks[0].mlp
    assert {"W_gate", "b_gate", "W_in", "b_in", "W_out", "b_out"} <= {name for name, _ in mlp.named_parameters()}
    tokens = torch.randint(0, 20, (2, 7))
    _, cache = model.run_with_cache(tokens)
    x = model.blocks[0].ln2(cache["blocks.0.hook_resid_mid"])
    gate, linear = x @ mlp.W_gate + mlp.b_gate, x @ mlp.W_in + mlp.b_in
    torch.testing.assert_close(cache["blocks.0.mlp.hook_pre"], gate)
    torch.testing.assert_close(cache["blocks.0.mlp.hook_pre_linear"], linear)
    torch.testing.assert_close(cache["blocks.0.mlp.hook_post"], gate * torch.sigmoid(gate) * linear)
    torch.testing.assert_close(cache["blocks.0.hook_mlp_out"], cache["blocks.0.mlp.hook_post"] @ mlp.W_out + mlp.b_out)
    assert cache["mlp_post", 0].shape == (2, 7, 40)  # get_act_name resolves the gated names too
    assert "blocks.0.mlp.hook_pre_linear" not in HookedTransformer(small_config()).hook_dict  # ungated: as before


def test_bias_free_and_tied_unembedding():
    model = HookedTransformer(small_config("standard", use_bias=False, tie_word_embeddings=True, gated_mlp=True))
    names = set(model.state_dict())
    assert not {name for name in names if ".b_" in name or name.endswith("b_U")}
    assert "unembed.W_U" not in names and model.unembed.W_U.shape == (32, 20)
    assert model.unembed.W_U.data_ptr() == model.embed.W_E.data_ptr()  # the embedding itself, transposed
    tokens = torch.randint(0, 20, (2, 6))
    _, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(model(tokens), model.ln_final(cache["blocks.2.hook_resid_post"]) @ model.embed.W_E.T)
    model(tokens).sum().backward()  # one parameter, gradients from both ends
    assert model.embed.W_E.grad is not None and model.embed.W_E.grad.abs().sum() > 0
    assert torch.count_nonzero(model.accumulated_bias(2)) == 0


def test_default_models_keep_their_parameters():
    """The new switches default to the toolkit's original architecture: biases, an untied unembedding, GELU MLP."""
    names = set(HookedTransformer(small_config("attnres", 2)).state_dict())
    assert {"unembed.W_U", "unembed.b_U", "blocks.0.mlp.b_in", "blocks.0.mlp.b_out"} <= names
    assert not {name for name in names if "W_gate" in name}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(gated_mlp=True, attn_only=True), "gated_mlp=True needs MLP sublayers"),
        (dict(use_bias="no"), "use_bias must be true or false"),
        (dict(tie_word_embeddings=1), "tie_word_embeddings must be true or false"),
    ],
)
def test_new_switches_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_inference_mode_then_training():
    # nothing created under inference_mode (a cached constant, say) may poison a later backward
    model = HookedTransformer(small_config("attnres", 2, "kv_shift"))
    tokens = torch.randint(0, 20, (2, 8))
    with torch.inference_mode():
        expected = model(tokens, return_type="loss")
    loss = model(tokens, return_type="loss")
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected)


def test_token_shift_mix_matches_autograd_of_its_definition():
    from attnres_lens.components import shift_one_position
    from attnres_lens.kernels import TokenShiftMix

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    coefficients = torch.randn(3, 2, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(TokenShiftMix.apply, (x, coefficients))
    expected = coefficients[:, 0, None] * x + coefficients[:, 1, None] * shift_one_position(x)
    torch.testing.assert_close(TokenShiftMix.apply(x, coefficients), expected)


@pytest.mark.parametrize("divisor", [1.0, math.sqrt(8)])
def test_normal_init_gives_the_values_of_randn_times_std(divisor):
    torch.manual_seed(3)
    expected = torch.randn(5, 7) * 0.02 / divisor if divisor != 1.0 else torch.randn(5, 7) * 0.02
    torch.manual_seed(3)
    assert torch.equal(normal_init((5, 7), 0.02, divisor), expected)


def test_is_hooked_answers_what_has_hooks_answers():
    point = HookPoint()

    def agree() -> bool:
        assert is_hooked(point) == point.has_hooks()
        return is_hooked(point)

    assert not agree()
    point.add_hook(lambda tensor, hook: tensor)
    assert agree()
    point.remove_hooks()
    assert not agree()
    point.add_hook(lambda grad, hook: None, dir="bwd")
    assert agree()
    point.remove_hooks(dir="bwd")
    assert not agree()
    point.add_perma_hook(lambda tensor, hook: tensor)
    assert agree()
    point.remove_hooks()  # permanent hooks stay
    assert agree()
    point.remove_hooks(including_permanent=True)
    assert not agree()
    model = HookedTransformer(small_config("attnres", 1))
    mixer = model.blocks[0].attn_res
    with model.hooks(fwd_hooks=[("blocks.0.attn_res.hook_weights", lambda weights, hook: weights)]):
        assert is_hooked(mixer.hook_weights) and mixer.observed() and mixer.hooked()
    assert not (is_hooked(mixer.hook_weights) or mixer.hooked())
