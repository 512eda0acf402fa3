"""The K/V convolution tap decomposition (docs/analysis.md §11): the toolkit's KV shift as its width-2 case, and
transformers' Inkling-2 short convolutions (width 4, static and per-token taps).

Ground truth is independent of the code under test: the model's own keys, values, scores and outputs read
through its hook points or PyTorch hooks on transformers' modules, and the KV-shift parts recomputed by running
the model with one tap's scalar set to 0.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from attnres_lens import HookedTransformer
from attnres_lens.analysis import (
    conv_tap_decomposition,
    hooked_attention_taps,
    inkling2_attention_taps,
    kv_shift_decomposition,
    repeated_batch,
    tap_parts,
    tap_statistics,
)

from .helpers import small_config

HALF_LEN = 5


def kv_shift_model(**overrides) -> HookedTransformer:
    model = HookedTransformer(small_config("standard", 1, "kv_shift", dtype=torch.float64, **overrides)).eval()
    with torch.no_grad():  # taps of both signs and sizes, so no part is negligible
        for block in model.blocks:
            block.attn.kv_shift.normal_(generator=torch.Generator().manual_seed(block.attn.W_K.shape[0]))
    return model


@pytest.mark.parametrize(
    "attention, extra",
    [("kv_shift", {}), ("standard", {}), ("kv_shift", {"positional_embedding_type": "standard"})],
)
def test_the_toolkit_taps_sum_to_the_keys_and_values_its_attention_reads(attention, extra):
    model = HookedTransformer(small_config("standard", 1, attention, dtype=torch.float64, n_key_value_heads=2, **extra))
    tokens = repeated_batch(2, HALF_LEN, model.cfg.d_vocab, seed=1).tokens
    _, cache = model.eval().run_with_cache(tokens)
    shifted = "_shifted" if attention == "kv_shift" else ""
    for layer in range(model.cfg.n_layers):
        taps = hooked_attention_taps(model, tokens, layer)
        assert taps.width == 2
        hook = f"blocks.{layer}.attn.hook_{{}}".format
        keys = cache[hook(f"k{shifted}")] if "positional_embedding_type" in extra else cache[hook("rot_k")]
        assert (taps.key_taps.sum(0) - keys).abs().max() < 1e-12
        assert (taps.value_taps.sum(0) - cache[hook(f"v{shifted}")]).abs().max() < 1e-12
        assert taps.key_taps[1, :, 0].abs().max() == 0  # nothing one token before the first


def test_standard_attention_is_a_width_1_convolution_and_mismatched_taps_are_refused():
    """Without KV shift the lag-1 taps are zero, so dropping them changes no number but the width."""
    model = HookedTransformer(small_config("standard", 1, "standard", dtype=torch.float64)).eval()
    tokens = repeated_batch(3, HALF_LEN, model.cfg.d_vocab, seed=3).tokens
    taps = hooked_attention_taps(model, tokens, 1)
    narrow = dataclasses.replace(taps, key_taps=taps.key_taps[:1], value_taps=taps.value_taps[:1])
    for wide_row, narrow_row in zip(tap_statistics(taps, tokens), tap_statistics(narrow, tokens), strict=True):
        assert narrow_row["width"] == 1 and narrow_row["shifted_key_induction_score"] == 0
        assert narrow_row["shifted_value_share"] == 0 and narrow_row["value_share_lag0"] == pytest.approx(1)
        for column, value in narrow_row.items():
            if column != "width":
                assert wide_row[column] == pytest.approx(value, abs=1e-12, nan_ok=True), column
    with pytest.raises(ValueError, match="must have one shape"):
        dataclasses.replace(taps, value_taps=taps.value_taps[:1])
    with pytest.raises(ValueError, match="at least one lag"):
        dataclasses.replace(taps, key_taps=taps.key_taps[:0], value_taps=taps.value_taps[:0])


def advantages_from_definition(scores: torch.Tensor, half_len: int) -> torch.Tensor:
    """docs/analysis.md §11: the score at the target q − (L−1) minus its mean over keys 0..q, averaged over
    second-half queries and the batch: [head]."""
    rows = []
    for q in range(half_len + 1, 2 * half_len + 1):
        row = scores[:, :, q, : q + 1]
        rows.append(row[..., q - (half_len - 1)] - row.mean(-1))
    return torch.stack(rows, -1).mean(dim=(0, 2))


def test_the_kv_shift_table_is_the_width_2_case_of_the_tap_decomposition():
    """Each part of a KV-shift layer is the layer with the other tap's scalar set to 0: α2 = 0 leaves the current-key
    scores, α1 = 0 the shifted-key ones, β2 = 0 (pattern unchanged) the current-value output, β1 = 0 the shifted."""
    model = kv_shift_model()
    batch = repeated_batch(6, HALF_LEN, model.cfg.d_vocab, seed=2)
    kv = kv_shift_decomposition(model, batch).set_index(["layer", "head"])
    general = conv_tap_decomposition(model, batch).set_index(["layer", "head"])

    def run_with_tap_zeroed(layer: int, column: int):
        ablated = copy.deepcopy(model)
        with torch.no_grad():
            ablated.blocks[layer].attn.kv_shift[:, column] = 0
        return ablated.run_with_cache(batch.tokens)[1]

    _, clean = model.run_with_cache(batch.tokens)
    queries = slice(HALF_LEN + 1, 2 * HALF_LEN + 1)
    for layer in range(model.cfg.n_layers):
        current_k, shifted_k, current_v, shifted_v = (run_with_tap_zeroed(layer, column) for column in (1, 0, 3, 2))
        current = advantages_from_definition(current_k["attn_scores", layer], HALF_LEN)
        shifted = advantages_from_definition(shifted_k["attn_scores", layer], HALF_LEN)
        z = clean["z", layer][:, queries]
        share = ((shifted_v["z", layer][:, queries] * z).sum(-1) / (z * z).sum(-1)).mean(dim=(0, 1))
        for table in (kv, general.rename(columns={"key_advantage_lag0": "current_key_advantage"})):
            rows = table.loc[layer]
            assert rows["current_key_advantage"].to_numpy() == pytest.approx(current.numpy(), abs=1e-10)
            assert rows["shifted_value_share"].to_numpy() == pytest.approx(share.numpy(), abs=1e-10)
            score = (shifted / (current.abs() + shifted.abs())).numpy()
            assert rows["shifted_key_induction_score"].to_numpy() == pytest.approx(score, abs=1e-10)
        assert kv.loc[layer, "shifted_key_advantage"].to_numpy() == pytest.approx(shifted.numpy(), abs=1e-10)
        assert general.loc[layer, "key_advantage_lag1"].to_numpy() == pytest.approx(shifted.numpy(), abs=1e-10)
        current_share = ((current_v["z", layer][:, queries] * z).sum(-1) / (z * z).sum(-1)).mean(dim=(0, 1))
        assert general.loc[layer, "value_share_lag0"].to_numpy() == pytest.approx(current_share.numpy(), abs=1e-10)
    assert (general["width"] == 2).all() and (general["bias_advantage"] == 0).all()
    assert general["key_advantage_lag1"].abs().min() > 0


# ---------------------------------------------------------------------------- transformers' Inkling-2
SLIDING_WINDOW = 8
KEY_CLIP = 0.25
FAMILIES = {
    # family: (layer types, extra config); the Mini loops its layers 1 and 2 twice
    "inkling2": (["hybrid_sliding", "hybrid"], {}),
    "inkling2_loop": (
        ["hybrid_sliding", "hybrid", "hybrid_sliding"],
        dict(loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=4),
    ),
}


def tiny_inkling(family: str):
    """A tiny random Inkling-2 or Inkling-2-Mini (sliding-window layers with static taps, full-attention layers
    with per-token taps, GQA) with every convolution tap and the position bias drawn large enough to matter."""
    modeling = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    configuration = pytest.importorskip(f"transformers.models.{family}.configuration_{family}")
    prefix = "Inkling2Loop" if family == "inkling2_loop" else "Inkling2"
    layer_types, extra = FAMILIES[family]
    config = getattr(configuration, f"{prefix}TextConfig")(
        vocab_size=48,
        unpadded_vocab_size=48,
        hidden_size=32,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=8,
        sliding_window_size=SLIDING_WINDOW,
        d_rel=4,
        rel_extent=16,
        layer_types=layer_types,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_layers_per_attn_res_block=1,
        use_cache=False,
        eos_token_id=None,
        qk_l2_clip_threshold=KEY_CLIP,  # low enough that the key norm clips some keys and not others
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(modeling, f"{prefix}ForCausalLM")(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            attention.relative_position_bias.proj.normal_(generator=generator)
            for projection in (attention.k_proj, attention.v_proj):
                convolution = projection.sconv
                if hasattr(convolution, "conv1d"):
                    convolution.conv1d.weight.normal_(generator=generator)
                else:
                    convolution.static_weight.normal_(generator=generator)
                    convolution.weight_proj.weight.normal_(std=0.3, generator=generator)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def inkling(request):
    """A tiny model of each family and what its modules computed on a repeated-tokens batch, read by PyTorch hooks
    and keyed by (module, layer, visit)."""
    model = tiny_inkling(request.param)
    batch = repeated_batch(3, HALF_LEN, model.config.vocab_size, seed=4)
    seen: dict[tuple[str, int, int], object] = {}

    def keep(name: str, layer: int):
        def hook(module, args, kwargs, output):
            visit = sum(key[:2] == (name, layer) for key in seen)
            seen[name, layer, visit] = (args, kwargs, output)

        return hook

    handles = []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for name, module in (
            ("attention", attention),
            ("q", attention.q_proj),
            ("k", attention.k_proj),
            ("v", attention.v_proj),
            ("bias", attention.relative_position_bias),
            ("o", attention.o_proj),
        ):
            handles.append(module.register_forward_hook(keep(name, index), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=batch.tokens, use_cache=False)
    for handle in handles:
        handle.remove()
    return model, batch, seen


def head_outputs(seen, layer: int, visit: int) -> dict[str, torch.Tensor]:
    """The module's own query, key, value, bias, z and pattern of one visit of a layer, in the tap layout."""
    args, kwargs, _ = seen["o", layer, visit]
    _, _, (_, pattern) = seen["attention", layer, visit]
    z = args[0] if args else kwargs["attn_output"]
    return dict(
        queries=seen["q", layer, visit][2].transpose(1, 2),
        keys=seen["k", layer, visit][2].transpose(1, 2),
        values=seen["v", layer, visit][2].transpose(1, 2),
        bias=seen["bias", layer, visit][2],
        z=z.unflatten(-1, (-1, 8)),
        pattern=pattern,
    )


def visits_of(seen) -> list[tuple[int, int]]:
    return sorted(key[1:] for key in seen if key[0] == "attention")


def test_inkling_taps_sum_to_the_modules_keys_values_scores_and_outputs(inkling):
    model, batch, seen = inkling
    taps = inkling2_attention_taps(model, batch.tokens)
    assert sorted(taps) == visits_of(seen)
    for (layer, visit), layer_taps in taps.items():
        truth = head_outputs(seen, layer, visit)
        assert layer_taps.width == model.config.conv_kernel_size == 4
        assert (layer_taps.key_taps.sum(0) - truth["keys"]).abs().max() < 1e-6
        clipped = truth["keys"].norm(dim=-1) > KEY_CLIP * (1 - 1e-5)
        assert clipped.any() and not clipped.all()
        assert (layer_taps.value_taps.sum(0) - truth["values"]).abs().max() < 1e-5  # values are RMS-normalised: ~1
        for lag in range(1, 4):  # a tap ℓ back is empty at the first ℓ positions, and matters after them
            assert layer_taps.key_taps[lag, :, :lag].abs().max() == 0
            assert layer_taps.key_taps[lag].abs().max() > 0.05 * layer_taps.key_taps[0].abs().max()
        parts = tap_parts(layer_taps)
        keys = truth["keys"].repeat_interleave(2, dim=2)
        scaling = model.model.layers[layer].self_attn.scaling
        scores = torch.einsum("bqhd,bkhd->bhqk", truth["queries"], keys) * scaling + truth["bias"]
        assert (parts["score_taps"].sum(0) + parts["score_bias"] - scores).abs().max() < 1e-6
        assert (parts["score_bias"] - truth["bias"]).abs().max() == 0
        assert truth["bias"].abs().max() > 0.1  # the bias column is a real part of these scores
        assert (parts["output_taps"].sum(0) - truth["z"]).abs().max() < 1e-6


def test_the_inkling_table_splits_the_full_scores_advantage_by_tap(inkling):
    model, batch, seen = inkling
    table = conv_tap_decomposition(model, batch).set_index(["layer", "visit", "head"]).sort_index()
    assert sorted(set(table.index.droplevel("head"))) == visits_of(seen)
    lags = range(4)
    for layer, visit in visits_of(seen):
        truth = head_outputs(seen, layer, visit)
        keys = truth["keys"].repeat_interleave(2, dim=2)
        scaling = model.model.layers[layer].self_attn.scaling
        scores = torch.einsum("bqhd,bkhd->bhqk", truth["queries"], keys).double() * scaling + truth["bias"].double()
        # the windows (8 keys) cover every query's keys 0..q here except the first one or two at the end
        visible = torch.ones(2 * HALF_LEN + 1, 2 * HALF_LEN + 1, dtype=torch.bool).tril()
        if model.config.layer_types[layer] == "hybrid_sliding":
            visible &= ~torch.ones_like(visible).tril(-SLIDING_WINDOW)
        rows = []
        for q in range(HALF_LEN + 1, 2 * HALF_LEN + 1):
            keys_seen = scores[:, :, q, visible[q]]
            rows.append(scores[:, :, q, q - (HALF_LEN - 1)] - keys_seen.mean(-1))
        total = torch.stack(rows, -1).mean(dim=(0, 2))
        rows = table.loc[(layer, visit)]
        split = sum(rows[f"key_advantage_lag{lag}"] for lag in lags) + rows["bias_advantage"]
        assert split.to_numpy() == pytest.approx(total.numpy(), abs=1e-5)
        shares = sum(rows[f"value_share_lag{lag}"] for lag in lags)
        assert shares.to_numpy() == pytest.approx(1.0, abs=1e-6)
        shifted = sum(rows[f"induction_share_lag{lag}"] for lag in lags[1:])
        assert rows["shifted_key_induction_score"].to_numpy() == pytest.approx(shifted.to_numpy(), abs=1e-12)
        prefix = truth["pattern"][:, :, range(HALF_LEN + 1, 2 * HALF_LEN + 1), range(2, HALF_LEN + 2)]
        assert rows["prefix_score"].to_numpy() == pytest.approx(prefix.double().mean(dim=(0, 2)).numpy(), abs=1e-7)
        assert rows["shifted_value_share"].abs().min() > 0.01  # the lag >= 1 value taps carry part of the output


class ChannelGain(torch.nn.Module):
    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return states * torch.linspace(0.5, 2, states.shape[-1])


def test_inkling_refusals_name_the_problem_and_the_fix(inkling):
    model, _, seen = inkling
    with pytest.raises(TypeError, match="got Linear"):
        conv_tap_decomposition(torch.nn.Linear(2, 2))
    too_long = repeated_batch(2, SLIDING_WINDOW + 1, model.config.vocab_size, seed=0)
    with pytest.raises(TypeError, match="got Linear"):
        conv_tap_decomposition(torch.nn.Linear(2, 2), too_long)
    with pytest.raises(ValueError, match="shorter half length than 9"):
        conv_tap_decomposition(model, too_long)
    default = conv_tap_decomposition(model, n_samples=2)  # the default probe fits the window
    assert len(default) == 4 * len(visits_of(seen)) and not default["shifted_key_induction_score"].isna().all()
    projection = model.model.layers[1].self_attn.k_proj
    clip = projection.norm
    projection.norm = ChannelGain()  # not one factor per vector: the taps cannot share it
    try:
        with pytest.raises(ValueError, match="ChannelGain does not scale each"):
            inkling2_attention_taps(model, too_long.tokens)
    finally:
        projection.norm = clip
    model.config._attn_implementation = "sdpa"
    try:
        with pytest.raises(ValueError, match="attn_implementation='eager'"):
            inkling2_attention_taps(model, too_long.tokens)
    finally:
        model.config._attn_implementation = "eager"


def test_inkling_taps_of_chosen_layers_and_of_a_bf16_model_from_its_folder(inkling, tmp_path):
    """A bf16 checkpoint opened with from_pretrained (its convolutions stay fp32): the taps, in float32, sum to the
    module's bf16 keys and values within bf16 rounding."""
    model, batch, seen = inkling
    chosen = inkling2_attention_taps(model, batch.tokens, layers=[1])
    assert sorted(chosen) == [visit for visit in visits_of(seen) if visit[0] == 1]
    n_layers = len(model.model.layers)
    with pytest.raises(ValueError, match=f"layer must be in 0..{n_layers - 1}, got {n_layers}"):
        inkling2_attention_taps(model, batch.tokens, layers=[n_layers])
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    outputs: dict[tuple[int, str], list[torch.Tensor]] = {}

    def keep(layer: int, kind: str):
        return lambda module, args, output: outputs.setdefault((layer, kind), []).append(output)

    handles = [
        projection.register_forward_hook(keep(index, kind))
        for index, layer in enumerate(loaded.model.layers)
        for kind, projection in (("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj))
    ]
    taps = inkling2_attention_taps(loaded, batch.tokens)
    for handle in handles:
        handle.remove()
    for (layer, visit), layer_taps in taps.items():
        assert layer_taps.key_taps.dtype == torch.float32
        for kind, parts in (("k", layer_taps.key_taps), ("v", layer_taps.value_taps)):
            module = outputs[layer, kind][visit]
            assert module.dtype == torch.bfloat16
            module = module.transpose(1, 2).float()
            assert (parts.sum(0) - module).abs().max() <= 2**-7 * module.abs().max()
