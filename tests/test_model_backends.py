"""The model's depth attention through each kernel backend: same loss, same gradients, same hook values."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch
from torch.autograd import forward_ad

from analyses.bench_depth_scaling import saved_activation_bytes
from attnres_lens import HookedTransformer, depth_execution
from attnres_lens.analysis.engine import concat_states
from attnres_lens.attnres import DepthAttention, DepthStream
from attnres_lens.kernels import depth_attention, triton_available
from tests.helpers import assert_same_step, randomize_depth_parameters, small_config

BACKENDS = ["reference", "torch", "cpu", pytest.param("triton", marks=pytest.mark.triton)]


def loss_and_grads(model: HookedTransformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens, return_type="loss")
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 2, 4])  # 6 sublayers: S = 4 leaves a short last block
def test_whole_model_loss_and_gradients_agree_across_backends(backend, block_size):
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    base = HookedTransformer(small_config("attnres", block_size, "kv_shift"))
    randomize_depth_parameters(base)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(3))
    # The readable, hooked path is the ground truth: a hook on every depth-weight point forces it.
    with base.hooks(fwd_hooks=[(lambda name: name.endswith("hook_weights"), lambda w, hook: None)]):
        expected_loss, expected_grads = loss_and_grads(base, tokens)
    model = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend=backend))
    model.load_state_dict(base.state_dict())
    loss, grads = loss_and_grads(model, tokens)
    assert_same_step(model, tokens, loss, grads, expected_loss, expected_grads)


def test_hooked_and_unhooked_forward_agree():
    model = HookedTransformer(small_config("attnres", 2))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (3, 10))
    logits_cached, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(model(tokens), logits_cached, rtol=1e-5, atol=1e-6)
    assert "blocks.1.attn_res.hook_weights" in cache.cache_dict


@pytest.mark.parametrize("block_size", [1, 2])
def test_the_final_readout_fuses_its_norm_unless_something_watches_it(block_size):
    """On the C kernel the final readout's mix computes the final norm in the same call, like a sublayer's pre-norm:
    no norm runs on its own in a training step. A PyTorch pre-hook on `ln_final` (how attribution captures the
    readout's input) keeps them apart and sees the input whose norm gives the same logits."""
    from analyses.kernel_traffic import counted_calls

    model = HookedTransformer(small_config("attnres", block_size, depth_attention_backend="cpu"))
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(5))
    counting = counted_calls(lambda: model(tokens, return_type="loss").backward())
    assert counting.totals["depth_attention_forward"][0] == model.cfg.n_sublayers + 1
    assert not {"rms_norm_forward", "rms_norm_backward"} & set(counting.totals)
    fused = model(tokens)
    seen = []
    handle = model.ln_final.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        watched = model(tokens)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (2, 9, model.cfg.d_model)
    torch.testing.assert_close(watched, fused, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.unembed(model.ln_final(seen[0])), fused, rtol=1e-5, atol=1e-6)


def test_parametrized_depth_and_norm_parameters_keep_the_fused_path_right():
    """A parametrized pseudo-query or norm gain (`torch.nn.utils.parametrize`) is not among a module's plain
    parameters, which the fused path reads directly: the model still runs, equals a model with the parametrized
    values written in by hand, and its gradients reach the parametrization's original."""
    from torch.nn.utils import parametrize

    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    model = HookedTransformer(small_config("attnres", 2, depth_attention_backend="cpu"))
    randomize_depth_parameters(model)
    by_hand = HookedTransformer(model.cfg)
    by_hand.load_state_dict(model.state_dict())
    with torch.no_grad():
        for module in (by_hand.final_res, by_hand.blocks[0].attn_res):
            module.query.mul_(2)
        by_hand.blocks[0].ln1.w.mul_(2)
    for module, name in ((model.final_res, "query"), (model.blocks[0].attn_res, "query"), (model.blocks[0].ln1, "w")):
        parametrize.register_parametrization(module, name, Twice())
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(4))
    loss, expected = model(tokens, return_type="loss"), by_hand(tokens, return_type="loss")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    original = model.final_res.parametrizations.query.original
    torch.testing.assert_close(original.grad, 2 * by_hand.final_res.query.grad, rtol=1e-4, atol=1e-6)
    original = model.blocks[0].ln1.parametrizations.w.original
    torch.testing.assert_close(original.grad, 2 * by_hand.blocks[0].ln1.w.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("replacement", ["identity", "layer norm"])
def test_a_final_norm_replaced_by_another_module_runs_on_its_own(replacement):
    """The final readout fuses `ln_final` only where it is the model's RMSNorm: a module put in its place runs on
    the readout's mix as any module would, on every backend alike (the reference one never fuses)."""
    logits = {}
    for backend in ("cpu", "reference"):
        model = HookedTransformer(small_config("attnres", 1, depth_attention_backend=backend))
        randomize_depth_parameters(model)
        model.ln_final = torch.nn.Identity() if replacement == "identity" else torch.nn.LayerNorm(model.cfg.d_model)
        tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(6))
        logits[backend] = model(tokens)
        with torch.no_grad():
            logits[f"{backend} no grad"] = model(tokens)
    for backend in ("cpu", "cpu no grad", "reference no grad"):
        torch.testing.assert_close(logits[backend], logits["reference"], rtol=1e-5, atol=1e-5)


def test_a_depth_attention_changed_after_construction_takes_the_path_its_options_say():
    """Whether a mix is fused follows its options as they are, not as they were built: a model whose depth
    attentions were switched to sigmoid scores after construction equals one built with sigmoid scores (the
    fused kernels compute softmax only, and would silently ignore the switch)."""
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(8))
    switched = HookedTransformer(small_config("attnres", 2, depth_attention_backend="cpu"))
    randomize_depth_parameters(switched)
    built = HookedTransformer(small_config("attnres", 2, depth_attention_backend="cpu", attnres_score="sigmoid"))
    built.load_state_dict(switched.state_dict())
    softmax = switched(tokens)
    for module in switched.depth_attention_modules().values():
        module.score = "sigmoid"
    torch.testing.assert_close(switched(tokens), built(tokens), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(softmax, built(tokens), atol=1e-3)


@pytest.mark.parametrize("hooked", [False, True])
def test_attnres_trains_under_bf16_autocast(hooked):
    # As on CUDA with bf16 autocast: the embedding stays fp32 while sublayer outputs come out bf16.
    model = HookedTransformer(small_config("attnres", 2, "kv_shift"))
    tokens = torch.randint(0, 20, (2, 9))
    hooks = [(lambda name: name.endswith("hook_weights"), lambda w, hook: None)] if hooked else []
    with model.hooks(fwd_hooks=hooks), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, return_type="loss")
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - model(tokens, return_type="loss").item()) < 0.05  # bf16 rounding only
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.triton
def test_two_phase_model_with_one_hooked_consumer():
    """Under Triton, Block AttnRes runs two-phase; a hook on one consumer sends only that consumer down the
    readable path, sees the weights of the single-pass softmax, and leaves loss and gradients unchanged."""
    if not triton_available():
        pytest.skip("triton is not installed")
    base = HookedTransformer(small_config("attnres", 4))
    randomize_depth_parameters(base)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(4))
    expected_loss, expected_grads = loss_and_grads(base, tokens)
    _, reference_cache = base.run_with_cache(tokens)
    model = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend="triton"))
    model.load_state_dict(base.state_dict())
    assert model._two_phase_consumers(tokens.device) is not None
    seen = {}

    def record(weights, hook):  # returns None: the hook watches without replacing the activation
        seen[hook.name] = weights.detach()

    name = "blocks.0.mlp_res.hook_weights"  # the second consumer of block 1
    with model.hooks(fwd_hooks=[(name, record)]):
        loss, grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(seen[name], reference_cache[name], rtol=1e-5, atol=1e-6)
    assert_same_step(model, tokens, loss, grads, expected_loss, expected_grads)


@pytest.mark.triton
def test_two_phase_stream_keeps_bf16_inputs_bf16():
    if not triton_available():
        pytest.skip("triton is not installed")
    consumers = [DepthAttention(16, 1e-6, backend="triton").to(torch.bfloat16) for _ in range(4)]  # 3 sublayers + final
    for module in consumers:
        torch.nn.init.normal_(module.query)
    embedding = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    two_phase, single = DepthStream(embedding, 2, consumers), DepthStream(embedding, 2)
    for sublayer in range(3):
        mixed = two_phase.read(consumers[sublayer])
        expected = single.read(consumers[sublayer])
        assert mixed.dtype == torch.bfloat16
        torch.testing.assert_close(mixed, expected, rtol=2e-2, atol=2e-2)
        output = torch.tanh(mixed.float() * (sublayer + 1)).to(torch.bfloat16)
        two_phase.write(output)
        single.write(output)
    torch.testing.assert_close(two_phase.readout(consumers[3]), single.readout(consumers[3]), rtol=2e-2, atol=2e-2)


def _knockout(index: list[int]):
    def hook(tensor, hook):
        return tensor.index_fill(-1, torch.tensor(index), float("-inf"))

    return hook


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
@pytest.mark.parametrize(
    "block_size,overrides", [(1, {}), (2, {}), (1, dict(attnres_heads=2)), (2, dict(attnres_score="sigmoid"))]
)
def test_a_bias_knockout_equals_a_logit_knockout(backend, block_size, overrides):
    """Knocking sources out through `hook_logit_bias` (the fused path for the default method) gives the loss and
    gradients of the same knockout on `hook_logits` (the readable path, the ground truth)."""
    base = HookedTransformer(small_config("attnres", block_size, depth_attention_backend=backend, **overrides))
    randomize_depth_parameters(base)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(5))
    modules = base.depth_attention_modules()
    knocked = {3: [0, 2], base.cfg.n_sublayers: [1]}  # consumer -> sources taken out
    results = {}
    for point in ("hook_logits", "hook_logit_bias"):
        hooks = [(getattr(modules[c], point).name, _knockout(sources)) for c, sources in knocked.items()]
        with base.hooks(fwd_hooks=hooks):
            results[point] = loss_and_grads(base, tokens)
    (expected_loss, expected_grads), (loss, grads) = results["hook_logits"], results["hook_logit_bias"]
    unmasked, _ = loss_and_grads(base, tokens)
    assert not torch.allclose(unmasked, expected_loss)  # the knockout changes the loss
    assert_same_step(base, tokens, loss, grads, expected_loss, expected_grads)


def test_a_bias_hook_keeps_the_fused_kernel(monkeypatch):
    model = HookedTransformer(small_config("attnres", 1))
    module = model.depth_attention_modules()[2]
    monkeypatch.setattr(DepthAttention, "logits", lambda *args: pytest.fail("took the readable path"))
    with model.hooks(fwd_hooks=[(module.hook_logit_bias.name, _knockout([1]))]):
        model(torch.randint(0, 20, (1, 5)))


@pytest.mark.parametrize(
    "attention,overrides",
    [
        ("standard", {}),
        ("kv_shift", {}),
        ("standard", dict(n_key_value_heads=2)),
        ("kv_shift", dict(positional_embedding_type="standard")),
    ],
)
def test_fused_attention_equals_the_explicit_softmax(attention, overrides):
    """Unhooked attention runs PyTorch's fused SDPA; a hook on the pattern computes scores, mask and softmax
    explicitly. Same outputs and gradients, in float64 to leave rounding out."""
    model = HookedTransformer(small_config("attnres", 2, attention, **overrides)).double()
    randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (3, 11), generator=torch.Generator().manual_seed(6))
    fused_loss, fused_grads = loss_and_grads(model, tokens)
    with model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_pattern"), lambda pattern, hook: None)]):
        explicit_loss, explicit_grads = loss_and_grads(model, tokens)
    torch.testing.assert_close(fused_loss, explicit_loss, rtol=1e-12, atol=1e-12)
    for name in fused_grads:
        torch.testing.assert_close(fused_grads[name], explicit_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [1, 2])
def test_saved_activations_grow_linearly_with_depth(backend, block_size):
    """Full AttnRes reads J²/2 sources per forward, but each source is one saved tensor: a path that kept stacked
    copies of the sources alive would add a source's bytes per consumer per layer to each increment. Only the
    per-source statistics ([n_sources, tokens], 1/d_model of a source) may grow."""
    tokens = torch.randint(0, 20, (2, 16))
    saved = [
        saved_activation_bytes(
            HookedTransformer(small_config("attnres", block_size, n_layers=n_layers, depth_attention_backend=backend)),
            tokens,
        )
        for n_layers in (1, 2, 3, 4)
    ]
    increments = [later - earlier for earlier, later in zip(saved, saved[1:])]
    source_bytes = tokens.numel() * 32 * 4  # one [batch, pos, d_model] fp32 tensor
    assert all(abs(b - a) < source_bytes / 2 for a, b in zip(increments, increments[1:])), increments


def _count_two_phase_calls(monkeypatch) -> list[int]:
    from attnres_lens.kernels import cpu_depth

    calls = [0]
    inner = cpu_depth.depth_attention_multi_cpu

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(cpu_depth, "depth_attention_multi_cpu", counted)
    return calls


def test_without_a_gradient_full_attnres_mixes_two_phase_on_the_cpu_and_agrees_with_the_readable_path(monkeypatch):
    base = HookedTransformer(small_config("attnres", 1, n_layers=6, dtype=torch.float64))
    randomize_depth_parameters(base)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(5))
    with base.hooks(fwd_hooks=[(lambda name: name.endswith("hook_weights"), lambda w, hook: None)]):
        expected = base(tokens).detach()
    model = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend="cpu"))
    model.load_state_dict(base.state_dict())
    calls = _count_two_phase_calls(monkeypatch)
    with torch.no_grad():
        logits = model(tokens)
    # windows from MIN_SHARED_SOURCES = 8 sources: consumers 7-10 (phase 1 and 3 merges) and 11-12
    assert calls[0] == 4 + 2
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)
    # with a gradient windows open from MIN_SHARED_SOURCES_WITH_GRAD shared sources: none in 13 consumers
    calls[0] = 0
    loss = model(tokens, return_type="loss")
    loss.backward()
    assert calls[0] == 0 and model.final_res.query.grad is not None


@pytest.mark.parametrize("shared_gradients, edited", [(False, None), (True, None), (True, 7), (True, 9)])
def test_full_attnres_trained_through_two_phase_windows_on_the_cpu_equals_the_readable_path(
    monkeypatch, shared_gradients, edited
):
    """Windows opened with a gradient from 8 shared sources (as without one), the C two-phase backward trains
    Full AttnRes to the `reference` backend's loss and gradients in float64, with the completed blocks' gradients
    summed in shared buffers or by autograd, and with a hook editing a sublayer's input in place (`edited`: the
    window's first consumer, whose input is phase 1's part that later merges keep, or a merging one)."""
    base = HookedTransformer(
        small_config("attnres", 1, n_layers=6, dtype=torch.float64, depth_attention_backend="reference")
    )
    randomize_depth_parameters(base)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(5))

    def edit(x, hook):
        x[:, 0] = 0.0
        return x

    hooks = [] if edited is None else [(base.sublayer_input_hook(edited), edit)]
    with base.hooks(fwd_hooks=hooks):
        expected_loss = base(tokens, return_type="loss")
    expected_loss.backward()
    model = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend="cpu"))
    model.load_state_dict(base.state_dict())
    monkeypatch.setattr(depth_execution, "MIN_SHARED_SOURCES_WITH_GRAD", 8)
    if shared_gradients:
        monkeypatch.setattr(depth_execution, "MIN_SHARED_GRADIENT_ELEMENTS", 0)
    calls = _count_two_phase_calls(monkeypatch)
    with model.hooks(fwd_hooks=hooks):
        loss = model(tokens, return_type="loss")
    loss.backward()
    # as without a gradient, windows at consumers 7-10 and 11-12 (the readout merges its partial sum); a hooked
    # input mixes on its own, so with consumer 7 hooked the windows are 8-11 and 12
    assert calls[0] == {None: 4 + 2, 7: 4 + 2, 9: 3 + 2}[edited]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
    expected = dict(base.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name].grad, rtol=1e-9, atol=1e-11, msg=name)


def test_a_stacked_stream_mixes_its_windows_with_a_gradient_without_the_no_grad_copies_path():
    """Two streams holding the same 17 blocks, stacked (as exact interventions stack branches): with a gradient the
    window's phase 1 reads the stacked sources (the copies' shared-prior path has no backward) and equals the
    readable mix."""
    model = HookedTransformer(
        small_config("attnres", 1, n_layers=10, dtype=torch.float64, depth_attention_backend="cpu")
    )
    randomize_depth_parameters(model)
    consumers = [module for _, module in sorted(model.depth_attention_modules().items())]
    generator = torch.Generator().manual_seed(2)
    embedding = torch.randn(2, 5, 32, generator=generator, dtype=torch.float64)
    outputs = [torch.randn(2, 5, 32, generator=generator, dtype=torch.float64) for _ in range(17)]
    streams = []
    for _ in range(2):
        stream = DepthStream(embedding, 1, consumers)
        for consumer, output in zip(consumers, outputs):
            stream.read(consumer)
            stream.write(output)
        streams.append(stream)
    stacked = concat_states(streams)
    assert stacked._copies is not None
    with torch.enable_grad():
        h = stacked.read(consumers[17])
    expected = depth_attention(
        [torch.cat([s, s]) for s in [embedding, *outputs]],
        consumers[17].query,
        consumers[17].key_norm.w,
        consumers[17].key_norm.eps,
        backend="reference",
    )
    assert h.requires_grad
    torch.testing.assert_close(h, expected, rtol=1e-10, atol=1e-12)


def test_block_attnres_mixes_one_pass_per_consumer_on_the_cpu(monkeypatch):
    model = HookedTransformer(small_config("attnres", 2, n_layers=6, depth_attention_backend="cpu"))
    calls = _count_two_phase_calls(monkeypatch)
    with torch.no_grad():
        model(torch.randint(0, 20, (2, 9)))
    assert calls[0] == 0


def test_a_hooked_consumer_inside_a_two_phase_window(monkeypatch):
    """Full AttnRes: knocking a source out of the second consumer of a window (a logit-bias hook) sends only that
    consumer down its own path; the window's other consumers keep their phase-1 state and the result equals the
    readable path with the same knockout."""
    base = HookedTransformer(small_config("attnres", 1, n_layers=5, dtype=torch.float64))
    randomize_depth_parameters(base)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(6))
    knockout = ("blocks.4.attn_res.hook_logit_bias", _knockout([1, 3]))  # consumer 8: the window opened at 7
    watch = (lambda name: name.endswith("hook_weights"), lambda w, hook: None)
    with base.hooks(fwd_hooks=[knockout, watch]):
        expected = base(tokens).detach()
    model = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend="cpu"))
    model.load_state_dict(base.state_dict())
    calls = _count_two_phase_calls(monkeypatch)
    with torch.no_grad(), model.hooks(fwd_hooks=[knockout]):
        logits = model(tokens)
    assert calls[0] == 3  # phase 1 at consumer 7 and the merges of 9 and 10: the hooked 8 mixes on its own
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


WATCHED_EDITS = {  # hook point, and the hook: each reads, or edits its tensor one way
    "weights read": ("hook_weights", lambda x: None),
    "weights edited in place": ("hook_weights", lambda x: x[..., 0].add_(0.75)),
    "weights edited through .data": ("hook_weights", lambda x: x.data[..., -1].mul_(0.25)),
    "weights returned anew": ("hook_weights", lambda x: x.flip(-1)),
    "logits read": ("hook_logits", lambda x: None),
    "logits edited in place": ("hook_logits", lambda x: x[..., -1].sub_(3.0)),
    "logits returned anew": ("hook_logits", lambda x: x + torch.linspace(0, 2, x.shape[-1], dtype=x.dtype)),
    # at consumer 0 (one source, α = 1) the cast keeps every value: only its dtype says it changed
    "weights cast anew": ("hook_weights", lambda x: x.float()),
}


@pytest.mark.parametrize("edit", list(WATCHED_EDITS))
@pytest.mark.parametrize("block_size", [1, 2])
def test_without_a_gradient_a_watched_mix_runs_the_kernel_and_honours_every_edit(edit, block_size, monkeypatch):
    """Under no_grad on the C kernel, hooks on a consumer's logits or weights fire on the kernel's own
    (`depth_execution.watched_kernel_mix`): what they see and the model's logits equal the readable path's (the
    reference backend) for a hook that only reads and for each way to edit, in place, through `.data` (which no
    version counter sees) or by returning a new tensor. With a gradient the readable path runs, as it must for a
    gradient through the weights."""
    point, change = WATCHED_EDITS[edit]
    # float64 (the C kernel's other build): the two paths' rounding stays far below the edits' effects
    base = HookedTransformer(small_config("attnres", block_size, depth_attention_backend="cpu", dtype=torch.float64))
    randomize_depth_parameters(base)
    with torch.no_grad():  # embeddings off the float32 grid (the model initialised them there), as the cast needs
        base.embed.W_E.add_(1e-3 * torch.randn(base.embed.W_E.shape, dtype=torch.float64))
    reference = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend="reference"))
    reference.load_state_dict(base.state_dict())
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(4))
    names = [
        f"blocks.0.attn_res.{point}",
        f"blocks.1.attn_res.{point}",
        f"blocks.2.mlp_res.{point}",
        f"final_res.{point}",
    ]
    kernel_calls = []
    watched = depth_execution.watched_kernel_mix
    monkeypatch.setattr(
        depth_execution, "watched_kernel_mix", lambda mixer, *args: kernel_calls.append(1) or watched(mixer, *args)
    )

    def run(model: HookedTransformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seen = {}

        def hook(x, hook):
            seen[hook.name] = x.clone()
            assert x.is_contiguous() and x.shape == (2, 9, len(x[0, 0]))
            edited = change(x)
            return edited if edit.endswith("anew") else None

        return model.run_with_hooks(tokens, fwd_hooks=[(name, hook) for name in names]), seen

    with torch.no_grad():
        expected, expected_seen = run(reference)
        assert not kernel_calls
        got, got_seen = run(base)
    assert len(kernel_calls) == len(names)
    assert got_seen.keys() == expected_seen.keys() == set(names)
    for name in names:
        torch.testing.assert_close(got_seen[name], expected_seen[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        unhooked = base(tokens)
    # every edit reaches the output, the cast by its float32 rounding (~1e-8); a read leaves it to fp64 rounding
    assert torch.allclose(got, unhooked, rtol=0, atol=1e-12) == edit.endswith("read")
    run(base)  # with a gradient
    assert len(kernel_calls) == len(names)


@pytest.mark.parametrize("block_size", [1, 2])
def test_a_watched_kernel_mix_serves_a_cache_and_a_source_a_hook_edits(block_size, monkeypatch):
    """Without a gradient, `run_with_cache` (which hooks every point, the logit bias too) reads every consumer's
    logits and weights from the C kernel, equal to the reference backend's; a hook on the weights that edits a
    source it kept (the first sublayer's output, zeroed while the second consumer reads it) reaches the mix as on
    the readable path, which mixes after its hooks, whether it edits in place or through `.data` or a NumPy view
    (which no version counter sees); under inference mode as under no_grad; under forward-mode AD the readable
    path runs."""
    base = HookedTransformer(small_config("attnres", block_size, depth_attention_backend="cpu", dtype=torch.float64))
    randomize_depth_parameters(base)
    reference = HookedTransformer(dataclasses.replace(base.cfg, depth_attention_backend="reference"))
    reference.load_state_dict(base.state_dict())
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(5))
    kernel_calls = []
    watched = depth_execution.watched_kernel_mix
    monkeypatch.setattr(
        depth_execution, "watched_kernel_mix", lambda mixer, *args: kernel_calls.append(1) or watched(mixer, *args)
    )
    with torch.no_grad():
        expected, expected_cache = reference.run_with_cache(tokens)
        got, cache = base.run_with_cache(tokens)
    assert len(kernel_calls) == len(base.depth_attention_modules())
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    depth_points = [name for name in cache.cache_dict if "_res." in name]
    assert {name.rsplit(".", 1)[1] for name in depth_points} == {"hook_logits", "hook_weights", "hook_logit_bias"}
    for name in depth_points:
        torch.testing.assert_close(cache[name], expected_cache[name], rtol=1e-10, atol=1e-12)

    def zero_kept_output(model: HookedTransformer, zero: Callable[[torch.Tensor], None]) -> torch.Tensor:
        kept = []

        def zero_it(weights, hook):  # returns None: the weights stay as they are
            zero(kept[0])

        hooks = [
            ("blocks.0.hook_attn_out", lambda x, hook: kept.append(x)),
            ("blocks.0.mlp_res.hook_weights", zero_it),
        ]  # consumer 1 reads f0 itself
        return model.run_with_hooks(tokens, fwd_hooks=hooks)

    def numpy_zero(x: torch.Tensor) -> None:
        x.numpy()[...] = 0

    for zero in (torch.Tensor.zero_, lambda x: x.data.zero_(), numpy_zero):
        with torch.no_grad():
            edited, expected_edited = zero_kept_output(base, zero), zero_kept_output(reference, zero)
        torch.testing.assert_close(edited, expected_edited, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(edited, got, atol=1e-6)

    def mix_after_a_poisoned_channel(model: HookedTransformer, value: float, prompt: torch.Tensor) -> torch.Tensor:
        """Consumer 2's input after a hook on its weights wrote `value` into one channel of a source it reads."""
        kept, mixed = [], []

        def poison(weights, hook):  # returns None: the weights stay as they are
            kept[0][0, 2, 5] = value

        hooks = [
            ("blocks.0.hook_attn_out", lambda x, hook: kept.append(x)),
            ("blocks.1.attn_res.hook_weights", poison),
            ("blocks.1.hook_resid_pre", lambda h, hook: mixed.append(h.clone())),
        ]
        model.run_with_hooks(prompt, fwd_hooks=hooks)
        return mixed[0]

    # the value stays in its channel, as on the readable path (the C kernel's key norm would spread it over the
    # token): with 5 tokens (part of a tile) and 18
    for value, prompt in itertools.product((float("inf"), float("nan")), (torch.arange(5)[None], tokens)):
        with torch.no_grad():
            poisoned = mix_after_a_poisoned_channel(base, value, prompt)
            expected_poisoned = mix_after_a_poisoned_channel(reference, value, prompt)
        if block_size == 1:  # Block AttnRes reads layer 0's sum, taken before the edit
            assert poisoned[0, 2].isfinite().sum() == poisoned.shape[-1] - 1
        torch.testing.assert_close(poisoned, expected_poisoned, rtol=1e-10, atol=1e-12, equal_nan=True)
    calls = len(kernel_calls)
    with torch.inference_mode():  # inference tensors: no version counters, and none needed
        inferred, inferred_cache = base.run_with_cache(tokens)
        edited = zero_kept_output(base, torch.Tensor.zero_)
    assert len(kernel_calls) == calls + len(base.depth_attention_modules()) + 1
    torch.testing.assert_close(inferred, expected, rtol=1e-10, atol=1e-12)
    for name in depth_points:
        torch.testing.assert_close(inferred_cache[name], expected_cache[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(edited, expected_edited, rtol=1e-10, atol=1e-12)
    calls = len(kernel_calls)
    with torch.no_grad(), forward_ad.dual_level():
        base.run_with_cache(tokens)
    assert len(kernel_calls) == calls
