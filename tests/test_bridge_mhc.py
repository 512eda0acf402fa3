"""The DeepSeek V4 (mHC) bridge (docs/interop.md §7) against transformers' own DeepSeek V4 code: a tiny random model
saved to a folder, its logits, its hyper-connection weights and streams recomputed in float64 from the parameters,
M checked by rebuilding every sublayer input from the outputs, removals against the same removal written on the
transformers modules, and the direct logit attribution against transformers' logits and a float64 recomputation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnres_lens import from_transformers  # noqa: E402
from attnres_lens.analysis.attribution import edge_sensitivity  # noqa: E402
from attnres_lens.analysis.depth import depth_mixing_matrix  # noqa: E402
from attnres_lens.analysis.engine import evaluate  # noqa: E402
from attnres_lens.analysis.interventions import removal_hooks, source_mask_hooks  # noqa: E402
from attnres_lens.analysis.pruning import pruning_sensitivity  # noqa: E402
from attnres_lens.evaluation import score_logits  # noqa: E402
from attnres_lens.mixing import mixing_rows  # noqa: E402
from attnres_lens.protocol import DepthMixingModel  # noqa: E402
from attnres_lens.tasks.base import Batch, next_token_targets  # noqa: E402
from tests.helpers import DEEPSEEK_V4_CONFIG as CONFIG  # noqa: E402
from tests.helpers import DEEPSEEK_V4_LAYERS as N_LAYERS  # noqa: E402
from tests.helpers import DEEPSEEK_V4_STREAMS as N_STREAMS  # noqa: E402
from tests.helpers import save_tiny_deepseek_v4  # noqa: E402

TOKENS = torch.tensor([[3, 17, 42, 5, 59, 0, 21, 8], [11, 11, 30, 2, 7, 48, 19, 33]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4") / "tiny")


@pytest.fixture(scope="module")
def bridge(folder):
    return from_transformers(folder)


def _reference(folder: str, **kwargs):
    """A second, untouched instance of the saved model: transformers' own forward."""
    return transformers.DeepseekV4ForCausalLM.from_pretrained(folder, **kwargs).eval()


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= rel * expected.double().abs().max().item(), error


def test_logits_equal_transformers_hooked_and_not(folder, bridge):
    expected = _reference(folder)(input_ids=TOKENS, use_cache=False).logits
    _close(bridge(TOKENS), expected, 1e-5)
    logits, cache = bridge.run_with_cache(TOKENS)
    _close(logits, expected, 1e-5)
    _close(bridge.readout(cache[bridge.readout_input_hook]), expected, 1e-5)
    assert cache["blocks.2.hook_streams"].shape == (2, 8, N_STREAMS, 32)
    assert cache["blocks.2.mlp_hc.hook_stream_mix"].shape == (2, 8, N_STREAMS, N_STREAMS)
    assert not any("resid_post" in name for name in bridge.hook_dict)  # the streams are no running sum
    assert bridge.hf_model.model.layers[0].mlp.gate.tid2eid.any()  # the hash table survived the folder


def test_bf16_logits_equal_transformers(folder):
    bridge = from_transformers(folder, dtype=torch.bfloat16)
    assert bridge.hf_model.model.embed_tokens.weight.dtype == torch.bfloat16
    expected = _reference(folder, dtype=torch.bfloat16)(input_ids=TOKENS, use_cache=False).logits
    _close(bridge(TOKENS), expected, 1e-5)  # the same operations in the same dtypes: equal, not just within rounding
    _close(bridge.run_with_cache(TOKENS)[0], expected, 1e-5)
    assert bridge.mixing_coefficients(TOKENS).dtype == torch.float32


def test_parameter_gradients_equal_transformers(folder):
    """Attribution differentiates through the bridge: its forwards' backward must be transformers'."""
    bridge, reference = from_transformers(folder), _reference(folder)
    bridge(TOKENS, return_type="loss").backward()
    logits = reference(input_ids=TOKENS, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten()).backward()
    expected = dict(reference.named_parameters())
    for name, parameter in bridge.hf_model.named_parameters():
        if expected[name].grad is not None:
            _close(parameter.grad, expected[name].grad, 1e-5)
    assert bridge.hf_model.model.layers[1].attn_hc.fn.grad.abs().max() > 0


def _connection_float64(streams: torch.Tensor, fn, base, scale, module) -> tuple[torch.Tensor, ...]:
    """DeepSeek V4's hyper-connection written out in float64 from its parameters (docs/model.md §13)."""
    n = N_STREAMS
    flat = streams.double().flatten(2)
    normed = flat / (flat.square().mean(-1, keepdim=True) + module.input_norm.variance_epsilon).sqrt()
    raw = normed @ fn.double().T
    base, scale = base.double(), scale.double()
    pre = torch.sigmoid(raw[..., :n] * scale[0] + base[:n]) + module.hc_eps
    post = 2 * torch.sigmoid(raw[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax((raw[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n)), -1) + module.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + module.hc_eps)
    for _ in range(module.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + module.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + module.hc_eps)
    return pre, post, comb


def _head_float64(streams: torch.Tensor, head) -> torch.Tensor:
    """`hc_head`'s read weights written out in float64 from its parameters."""
    flat = streams.double().flatten(2)
    normed = flat / (flat.square().mean(-1, keepdim=True) + head.input_norm.variance_epsilon).sqrt()
    return torch.sigmoid(normed @ head.hc_fn.double().T * head.hc_scale.double() + head.hc_base.double()) + head.eps


def test_hooks_equal_a_float64_recomputation_from_the_parameters(bridge):
    """Every read/write/mix weight, sublayer input and stream state the hooks show, recomputed from the streams the
    layer received and the hyper-connections' parameters."""
    _, cache = bridge.run_with_cache(TOKENS)
    streams = cache["hook_embed"].double().unsqueeze(-2).expand(-1, -1, N_STREAMS, -1)  # every stream starts as e
    for layer, module in enumerate(bridge.hf_model.model.layers):
        for connection, hc, input_hook, output_hook, streams_hook in (
            ("attn_hc", module.attn_hc, "hook_resid_pre", "hook_attn_out", "hook_streams_mid"),
            ("mlp_hc", module.ffn_hc, "hook_resid_mid", "hook_mlp_out", "hook_streams"),
        ):
            pre, post, comb = _connection_float64(streams, hc.fn, hc.base, hc.scale, hc)
            prefix = f"blocks.{layer}."
            _close(cache[prefix + f"{connection}.hook_read_weights"], pre, 1e-5)
            _close(cache[prefix + f"{connection}.hook_write_weights"], post, 1e-5)
            _close(cache[prefix + f"{connection}.hook_stream_mix"], comb, 1e-5)
            _close(cache[prefix + input_hook], (pre.unsqueeze(-1) * streams).sum(-2), 1e-5)
            written = post.unsqueeze(-1) * cache[prefix + output_hook].double().unsqueeze(-2)
            _close(cache[prefix + streams_hook], written + comb.transpose(-1, -2) @ streams, 1e-5)
            streams = cache[prefix + streams_hook].double()
    read = _head_float64(streams, bridge.hf_model.model.hc_head)
    _close(cache["final_hc.hook_read_weights"], read, 1e-5)
    _close(cache["ln_final.hook_in"], (read.unsqueeze(-1) * streams).sum(-2), 1e-5)
    # the weights differ between tokens and streams: the test reads something
    assert cache["blocks.1.attn_hc.hook_read_weights"].std(dim=(0, 1)).min() > 1e-3


def test_mixing_coefficients_rebuild_every_sublayer_input(folder):
    """M's decomposition, checked in float64: every sublayer input (and the final norm's input) equals
    `M[c, e] e + Σ_i M[c, i] f_i` with the hooked embedding and outputs, token by token."""
    bridge = from_transformers(folder, dtype=torch.float64, experts_implementation="eager")
    coefficients = bridge.mixing_coefficients(TOKENS)
    n = bridge.n_sublayers + 1
    assert coefficients.shape == (*TOKENS.shape, n, n) and coefficients.dtype == torch.float64
    assert torch.equal(coefficients.triu(1), torch.zeros_like(coefficients))  # c reads e and f_i, i < c only
    _, cache = bridge.run_with_cache(TOKENS)
    basis = [cache["hook_embed"]] + [cache[bridge.sublayer_output_hook(j)] for j in range(n - 1)]
    basis = torch.stack(basis, dim=-2)  # [batch, pos, J+1, d]
    assert basis.dtype == torch.float64
    for consumer in range(n):
        rebuilt = (coefficients[..., consumer, :, None] * basis).sum(-2)
        _close(rebuilt, cache[bridge.sublayer_input_hook(consumer)], 1e-10)
    # M is not a plain sum: the weights vary between tokens and differ from one
    assert coefficients[..., -1, 1:-1].std(dim=(0, 1)).min() > 1e-3
    rows = mixing_rows(bridge, coefficients.mean(dim=(0, 1)))  # the layout attnres_lens.mixing's tables read
    assert len(rows) == sum(c + 1 for c in range(n)) and rows[-1]["consumer_label"] == "final"
    # the M analyses read the model's own method (docs/architecture.md §7, optional members)
    table = depth_mixing_matrix(bridge, TOKENS)
    assert table["weight"].to_numpy() == pytest.approx([row["weight"] for row in rows], rel=1e-12)


def _direct_removal(reference, removed: set[int]) -> list:
    """Forward hooks on transformers' own modules that zero the outputs of the `removed` sublayers."""
    handles = []
    for j in removed:
        layer = reference.model.layers[j // 2]
        if j % 2 == 0:  # self_attn returns (output, weights)
            handles.append(
                layer.self_attn.register_forward_hook(lambda _m, _a, out: (torch.zeros_like(out[0]), out[1]))
            )
        else:
            handles.append(layer.mlp.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out)))
    return handles


@pytest.mark.parametrize("removed", [{0}, {3}, {2, 5, 7}])
def test_removal_through_the_toolkit_equals_removal_in_transformers(folder, bridge, removed):
    reference = _reference(folder)
    handles = _direct_removal(reference, removed)
    expected = reference(input_ids=TOKENS, use_cache=False).logits
    for handle in handles:
        handle.remove()
    clean = reference(input_ids=TOKENS, use_cache=False).logits
    removed_logits = bridge.run_with_hooks(TOKENS, fwd_hooks=removal_hooks(bridge, removed))
    _close(removed_logits, expected, 1e-5)
    assert (removed_logits - clean).abs().max() > 1e-3  # the removal changed something


def test_stream_edit_reaches_the_next_layer_as_in_transformers(folder, bridge):
    """`hook_streams` is the next layer's input itself: zeroing it equals zeroing the transformers layer's output."""
    reference = _reference(folder)
    handle = reference.model.layers[1].register_forward_hook(lambda _m, _a, out: torch.zeros_like(out))
    expected = reference(input_ids=TOKENS, use_cache=False).logits
    handle.remove()
    zero = [("blocks.1.hook_streams", lambda streams, hook: torch.zeros_like(streams))]
    _close(bridge.run_with_hooks(TOKENS, fwd_hooks=zero), expected, 1e-5)


def test_pruning_sensitivity_measures_transformers_removals(folder, bridge):
    """The pruning table's removal Δloss per sublayer, against the loss of transformers with that output zeroed."""
    batch = Batch(TOKENS, next_token_targets(TOKENS), torch.ones_like(TOKENS, dtype=torch.bool))
    table = pruning_sensitivity(bridge, batch)
    assert list(table["label"]) == [f"L{j // 2}.{('attn', 'mlp')[j % 2]}" for j in range(2 * N_LAYERS)]
    reference = _reference(folder)
    base = score_logits(reference(input_ids=TOKENS, use_cache=False).logits, batch).loss
    assert table["base_loss"].iloc[0] == pytest.approx(base, rel=1e-5)
    for j in range(bridge.n_sublayers):
        handles = _direct_removal(reference, {j})
        loss = score_logits(reference(input_ids=TOKENS, use_cache=False).logits, batch).loss
        for handle in handles:
            handle.remove()
        assert table["dloss_remove"].iloc[j] == pytest.approx(loss - base, rel=1e-4, abs=1e-6)
    assert evaluate(bridge, batch, removal_hooks(bridge, [1])).loss == pytest.approx(
        base + table["dloss_remove"].iloc[1], rel=1e-6
    )


def test_protocol_names(bridge):
    assert isinstance(bridge, DepthMixingModel)
    assert bridge.n_sublayers == 2 * N_LAYERS and bridge.d_vocab == 64 and bridge.consumers() == []
    assert bridge.sublayer_name(3) == "L1.mlp" and bridge.sublayer_name(bridge.n_sublayers) == "final"
    assert bridge.sublayer_input_hook(2) == "blocks.1.hook_resid_pre"
    assert bridge.sublayer_input_hook(bridge.n_sublayers) == bridge.readout_input_hook == "ln_final.hook_in"
    assert bridge.sublayer_output_hook(3) == "blocks.1.hook_mlp_out"
    assert bridge.sources(2) == [[-1], [0], [1]] and bridge.source_labels(2) == ["emb", "L0.attn", "L0.mlp"]
    for name in ("blocks.0.attn_hc.hook_read_weights", "blocks.3.mlp_hc.hook_stream_mix", "final_hc.hook_read_weights"):
        assert name in bridge.hook_dict
    assert {id(p) for p in bridge.parameters()} == {id(p) for p in bridge.hf_model.parameters()}  # none of its own


def test_refusals_name_the_bad_input(folder, bridge, tmp_path):
    from transformers import DeepseekV4Config, DeepseekV4Model

    with pytest.raises(ValueError, match="no depth softmax"):
        bridge.routes(2)
    with pytest.raises(ValueError, match="no depth softmax"):
        bridge.depth_hook(bridge.n_sublayers, "weights")
    with pytest.raises(ValueError, match="no depth softmax"):
        bridge.route_input_hook(3, "mix")
    with pytest.raises(ValueError, match="not a consumer"):
        source_mask_hooks(bridge, 2, [0])
    batch = Batch(TOKENS, next_token_targets(TOKENS), torch.ones_like(TOKENS, dtype=torch.bool))
    with pytest.raises(ValueError, match="edge attribution needs depth attention; DeepseekV4Bridge has no depth "):
        edge_sensitivity(bridge, batch)
    with pytest.raises(ValueError, match=r"sublayer must be in 0\.\.7, got 8"):
        bridge.sublayer_output_hook(8)
    with pytest.raises(ValueError, match="out of range for d_vocab=64"):
        bridge(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match="already wrapped"):
        from_transformers(bridge.hf_model)
    loaded = _reference(folder)
    with pytest.raises(ValueError, match=r"load_kwargs \['dtype'\] apply only when opening a folder"):
        from_transformers(loaded, dtype=torch.float64)
    small = dict(CONFIG, num_hidden_layers=1, layer_types=CONFIG["layer_types"][:1], mlp_layer_types=["moe"])
    base_model = DeepseekV4Model(DeepseekV4Config(**small))
    with pytest.raises(TypeError, match="got DeepseekV4Model"):
        from_transformers(base_model)
    base_model.save_pretrained(tmp_path / "base")
    with pytest.raises(TypeError, match="holds a DeepSeek V4 DeepseekV4Model"):
        from_transformers(tmp_path / "base")


def test_docs_worked_example_runs_as_printed(tmp_path, capsys):
    """docs/interop.md's DeepSeek V4 example, run as written (in a temporary folder), prints what the docs show."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "interop.md").read_text()
    section = text[text.index("### DeepSeek V4 (mHC)") :]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    exec(compile(code.replace("/tmp/tiny-deepseek-v4", str(tmp_path / "tiny")), "interop.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    expected = printed.strip().splitlines()
    assert len(lines) == len(expected) == 5
    assert lines[0] == expected[0] and lines[2] == expected[2]
    numbers = [[float(x) for x in re.findall(r"-?\d+\.\d+", line)] for line in (*lines, *expected)]
    for row in (1, 3):  # weights and coefficients, rounded to 2 decimals
        assert numbers[row] == pytest.approx(numbers[5 + row], abs=0.011) and len(numbers[row]) > 3
    difference, change = map(float, lines[4].split())
    assert difference <= 1e-5 and change == pytest.approx(float(expected[4].split()[1]), rel=1e-3)


def test_depth_logit_attribution_splits_transformers_logits_against_a_float64_recomputation(folder, bridge):
    """DeepSeek V4's logit is `lm_head(norm(h_J))` (no cap): the terms `M[J, s] (g ⊙ v_s / σ) · W_U[:, t]`, with
    `hc_head`'s read weights frozen in M's row J as σ is, add up to transformers' own logit; each term equals its
    float64 recomputation from what transformers' modules received and their parameters."""
    from attnres_lens.analysis import depth_logit_attribution

    text_model, J, d_model = bridge.hf_model.model, bridge.n_sublayers, CONFIG["hidden_size"]
    seen: dict[str, torch.Tensor] = {}
    streams_in: list[torch.Tensor] = []  # what every hyper-connection (and finally hc_head) read, in forward order
    outputs: list[torch.Tensor] = []  # f_j as transformers' attention and MoE returned them

    def keep_output(_module, _args, out) -> None:
        outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    def keep_streams(_module, args) -> None:
        streams_in.append(args[0].detach())

    handles = [text_model.embed_tokens.register_forward_hook(lambda _m, _a, out: seen.update(e=out.detach()))]
    for layer in text_model.layers:
        handles += [
            layer.attn_hc.register_forward_pre_hook(keep_streams),
            layer.ffn_hc.register_forward_pre_hook(keep_streams),
        ]
        handles += [layer.self_attn.register_forward_hook(keep_output), layer.mlp.register_forward_hook(keep_output)]
    handles.append(text_model.hc_head.register_forward_pre_hook(keep_streams))
    handles.append(text_model.norm.register_forward_pre_hook(lambda _m, args: seen.update(h=args[0].detach())))
    table = depth_logit_attribution(bridge, TOKENS)
    for handle in handles:
        handle.remove()
    # the attribution reads one clean pass and M another: both show the same streams; keep the first
    assert len(streams_in) == 2 * (J + 1) and torch.equal(streams_in[J], streams_in[-1])
    streams_in, outputs = streams_in[: J + 1], outputs[:J]

    # M's row J in float64: every stream starts as e; sublayer j moves the coefficients as C ← combᵀ C + post ⊗ [f_j]
    coefficients = torch.zeros(*TOKENS.shape, N_STREAMS, J + 1, dtype=torch.float64)
    coefficients[..., 0] = 1.0
    for j in range(J):
        hc = (text_model.layers[j // 2].attn_hc, text_model.layers[j // 2].ffn_hc)[j % 2]
        _, post, comb = _connection_float64(streams_in[j], hc.fn, hc.base, hc.scale, hc)
        coefficients = comb.transpose(-1, -2) @ coefficients
        coefficients[..., 1 + j] += post
    alpha = (_head_float64(streams_in[J], text_model.hc_head).unsqueeze(-1) * coefficients).sum(-2)  # [b, p, J+1]
    values = torch.stack([seen["e"], *outputs], dim=-2).double()  # [b, p, J+1, d]: v_s, the sources themselves
    x = seen["h"].double()
    sigma = (x.pow(2).mean(-1, keepdim=True) + text_model.norm.variance_epsilon).sqrt()
    targets = TOKENS[:, 1:]
    direction = bridge.hf_model.lm_head.weight.double()[targets] * text_model.norm.weight.double()  # g ⊙ W_U[:, t]
    terms = values[:, :-1] / sigma[:, :-1, None] * direction[..., None, :]  # [b, p-1, J+1, d]
    expected = alpha[:, :-1] * terms.sum(-1)
    table = table.sort_values(["sequence", "position", "source"])
    got = torch.tensor(table["contribution"].to_numpy()).reshape(expected.shape)
    _close(got, expected, 1e-5)
    _close(torch.tensor(table["alpha"].to_numpy()).reshape(expected.shape), alpha[:, :-1], 1e-5)
    assert (table["bias"] == 0).all()  # lm_head has no bias
    carrying = (expected.abs() > 1e-3).sum(-1).double()
    assert carrying.mean() > 3  # several sources carry a logit: the split says something

    # the sum against transformers' logit from an untouched instance (which the `logit` column equals bit for bit).
    # Both are computed in float32 from the same e, f_j and hyper-connection weights (M from the hooked ones) and σ
    # from the same h_J, so in exact arithmetic they are equal. Every mixing weight is non-negative (pre, post, comb,
    # hence M), so each side's rounding is at most γ_k · A (γ_k = k u / (1 − k u), u = 2⁻²⁴), with
    # A = Σ_s Σ_d |M[J, s] v_s g W_U[:, t] / σ| and k the float32 operations on a term's path: J stream updates of
    # n + 2 (the n-term stream mix, the write, the add), the n-term head collapse, the norm's scale and two products,
    # and lm_head's d-term dot product (M's own recursion has fewer; the float64 sum of the terms adds nothing).
    reference = _reference(folder)(input_ids=TOKENS, use_cache=False).logits.double()
    logit = reference[:, :-1].gather(-1, targets[..., None]).squeeze(-1)
    per_position = table.groupby(["sequence", "position"], sort=True)
    total = torch.tensor((per_position["contribution"].sum() + per_position["bias"].first()).to_numpy())
    k = J * (N_STREAMS + 2) + N_STREAMS + 3 + d_model
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    bound = 2 * gamma * (alpha[:, :-1, :, None] * terms).abs().sum(dim=(-1, -2))
    assert ((total - logit.reshape(-1)).abs() <= bound.reshape(-1)).all(), (total - logit.reshape(-1)).abs().max()
    assert torch.equal(torch.tensor(per_position["logit"].first().to_numpy()), logit.reshape(-1))
