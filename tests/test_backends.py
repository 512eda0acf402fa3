"""Backend policy (attnres_lens/kernels/backends.py, docs/kernels.md §2): which implementation ``auto`` and the
environment pick, and where a model runs the C kernels of the ``cpu`` backend and where their PyTorch twins."""

from __future__ import annotations

import pytest
import torch

import attnres_lens.kernels as kernels
from attnres_lens.kernels import backends, cpu_attention, cpu_build, cpu_depth, cpu_elementwise, depth_attention
from tests.helpers import float32_chain_length, randomize_depth_parameters, reordering_bound
from tests.kernel_cases import make_inputs

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


def test_a_logit_bias_never_runs_on_triton(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    assert backends.resolve_backend("auto", cuda) == "triton"
    assert backends.resolve_backend("auto", cuda, logit_bias=True) == "torch"
    with pytest.raises(ValueError, match="triton depth-attention kernel takes no logit_bias"):
        backends.resolve_backend("triton", cuda, logit_bias=True)
    monkeypatch.setenv(backends.BACKEND_ENV_VAR, "triton")
    with pytest.raises(ValueError, match="leave \\$ATTNRES_LENS_BACKEND unset"):
        backends.resolve_backend("auto", cuda, logit_bias=True)
    for spelled in ("auto", " auto "):  # the environment asking for auto is auto, not triton by name
        monkeypatch.setenv(backends.BACKEND_ENV_VAR, spelled)
        assert backends.resolve_backend("auto", cuda, logit_bias=True) == "torch"


def test_a_knob_a_backend_lacks_routes_auto_onward_and_refuses_a_named_backend(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    lacking = {"triton": frozenset({"logit_bias", "logit_scale"}), "torch": frozenset({"logit_scale"})}
    monkeypatch.setattr(backends, "_MISSING_FEATURES", {**backends._MISSING_FEATURES, **lacking})
    assert backends.resolve_backend("auto", cuda, features=("normalize_values",)) == "triton"
    assert backends.resolve_backend("auto", cuda, logit_bias=True) == "torch"
    assert backends.resolve_backend("auto", cuda, features=("logit_scale",)) == "reference"  # past torch too
    with pytest.raises(
        ValueError,
        match="triton depth-attention kernel takes no logit_bias, logit_scale; use "
        "backend='reference'.*for calls with them",
    ):
        backends.resolve_backend("triton", cuda, logit_bias=True, features=("logit_scale",))
    with pytest.raises(ValueError, match="torch depth-attention kernel takes no logit_scale; use backend='reference'"):
        backends.resolve_backend("torch", cuda, features=("logit_scale",))
    monkeypatch.setenv(backends.BACKEND_ENV_VAR, "torch")
    with pytest.raises(ValueError, match="leave \\$ATTNRES_LENS_BACKEND unset"):
        backends.resolve_backend("auto", cuda, features=("logit_scale",))


def test_every_knob_has_a_backend_and_the_reference_takes_them_all():
    assert backends._MISSING_FEATURES["reference"] == frozenset()
    assert set().union(*backends._MISSING_FEATURES.values()) <= set(backends.DEPTH_FEATURES)


def test_auto_backend_and_environment_override(monkeypatch):
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "cpu"  # a C compiler is part of the setup
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "reference")
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "reference"
    assert kernels.resolve_backend("torch", torch.device("cpu")) == "torch"  # an explicit choice wins
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "cuda-magic")
    with pytest.raises(ValueError, match="ATTNRES_LENS_BACKEND.*cuda-magic"):
        kernels.resolve_backend("auto", torch.device("cpu"))


def test_invalid_backend_names_value_and_choices():
    sources, query, gain = make_inputs(2, (3,), 4)
    with pytest.raises(ValueError) as error:
        depth_attention(sources, query, gain, backend="fast")
    assert "'fast'" in str(error.value)
    assert all(name in str(error.value) for name in ("reference", "torch", "cpu", "triton"))


def test_kv_shift_falls_back_to_the_twin_when_k_and_v_differ():
    from attnres_lens.kernels.backends import elementwise_runs_cpu_kernel

    k = torch.randn(2, 3, 4, 5)
    assert elementwise_runs_cpu_kernel("auto", k, k.clone())
    assert not elementwise_runs_cpu_kernel("auto", k, k.double())  # e.g. a hook on hook_v changed its dtype
    assert not elementwise_runs_cpu_kernel("reference", k, k.clone())
    assert not elementwise_runs_cpu_kernel("auto", k.bfloat16(), k.bfloat16())


def test_the_c_attention_runs_only_where_it_measured_faster(monkeypatch):
    """Heads whose keys fit in MAX_CPU_ATTENTION_KEYS values; at several torch threads, only on the OpenMP pool
    and with as many (batch, head) pairs as threads (what the kernel splits)."""
    from types import SimpleNamespace

    from attnres_lens.kernels.backends import MAX_CPU_ATTENTION_KEYS, attention_runs_cpu_kernel

    def runs(batch: int, pos: int, heads: int, d_head: int) -> bool:
        x = torch.empty(batch, pos, heads, d_head)
        return attention_runs_cpu_kernel("auto", x, x, x)

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert runs(1, 65, 1, 16) and runs(1, MAX_CPU_ATTENTION_KEYS // 64, 1, 64)
        assert not runs(1, MAX_CPU_ATTENTION_KEYS // 64 + 1, 1, 64)  # a long head: PyTorch's flash kernel
        torch.set_num_threads(2)
        assert runs(1, 65, 2, 16) and not runs(1, 65, 1, 16)  # one pair would leave a thread idle
        monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype: SimpleNamespace(thread_pool=False))
        assert not runs(4, 65, 4, 16)  # a build without OpenMP runs it on one thread: SDPA uses both
    finally:
        torch.set_num_threads(previous)
    x = torch.empty(2, 65, 4, 16, requires_grad=True)
    assert not attention_runs_cpu_kernel("auto", x, x, x)  # a gradient is needed
    assert not attention_runs_cpu_kernel("torch", x.detach(), x.detach(), x.detach())


def test_the_models_attention_runs_the_kernel_exactly_where_no_gradient_is_needed(monkeypatch):
    """Without a gradient (inference, exact interventions) every variant's attention runs the C kernel, with one
    SDPA: the same logits to float rounding; with a gradient, under a hook on the scores, or for another backend,
    it does not run."""
    from attnres_lens import HookedTransformer, ModelConfig
    from attnres_lens.kernels import layer_ops

    calls = []
    kernel = cpu_attention.causal_attention_cpu
    monkeypatch.setattr(layer_ops, "causal_attention_cpu", lambda *args: calls.append(1) or kernel(*args))
    tokens = torch.randint(0, 32, (3, 11), generator=torch.Generator().manual_seed(0))
    for extra in (
        dict(),
        dict(attention="kv_shift"),
        dict(residual="attnres", attnres_block_size=2),
        dict(n_key_value_heads=1),
    ):
        model = HookedTransformer(ModelConfig(d_model=32, n_heads=4, n_layers=2, d_vocab=32, n_ctx=16, seed=3, **extra))
        calls.clear()
        with_grad = model(tokens)
        assert calls == []
        with torch.no_grad():
            without = model(tokens)
        assert len(calls) == model.cfg.n_layers, extra
        # the C attention and SDPA sum the same terms in other orders: float32 rounding of that many terms
        bound = reordering_bound(float32_chain_length(model.cfg, tokens), with_grad.abs().max().item())
        torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=bound)
        calls.clear()
        with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, hook: t)]):
            model(tokens)
        assert len(calls) == model.cfg.n_layers - 1  # the watched layer computes its pattern explicitly
    reference = HookedTransformer(
        ModelConfig(d_model=32, n_heads=4, n_layers=2, d_vocab=32, n_ctx=16, depth_attention_backend="torch")
    )
    calls.clear()
    with torch.no_grad():
        reference(tokens)
    assert calls == []


# (the C function a model calls, model options, calls per forward of 2 layers, parameters whose gradients compare)
_MODEL_KERNELS = {
    "kv_shift_cpu": (dict(attention="kv_shift", n_ctx=9), 2, ["blocks.0.attn.kv_shift", "blocks.1.attn.W_K"]),
    "rotary_cpu": (dict(n_ctx=12), 2 * 2, ["blocks.0.attn.W_Q", "blocks.1.attn.W_K"]),  # q and k of each layer
    # the standard model's norms: an AttnRes model's run inside its depth mixes (next entry)
    "rms_norm_cpu": (
        dict(n_ctx=12, residual="standard"),
        2 * 2 + 1,
        ["ln_final.w", "blocks.0.ln1.w", "blocks.1.mlp.W_in"],
    ),
    # each sublayer's mix with its pre-norm, and the final readout's with the final norm
    "fused_mix_and_norm": (
        dict(n_ctx=12),
        2 * 2 + 1,
        [
            "blocks.0.ln1.w",
            "blocks.1.ln2.w",
            "ln_final.w",
            "blocks.0.attn_res.query",
            "blocks.1.mlp_res.key_norm.w",
            "final_res.query",
            "blocks.0.attn.W_Q",
        ],
    ),
}


@pytest.mark.parametrize("kernel", list(_MODEL_KERNELS))
def test_a_model_runs_each_elementwise_kernel_only_on_the_cpu_backend(kernel, monkeypatch):
    """The KV shift (one fused call per layer for K and V), rotary, RMSNorm and depth mix + pre-norm kernels run on
    the cpu backend, none on the reference one, and loss and gradients agree to float64 rounding."""
    from attnres_lens import HookedTransformer, ModelConfig

    options, expected_calls, compared = _MODEL_KERNELS[kernel]
    calls = []
    real = getattr(cpu_depth if kernel == "fused_mix_and_norm" else cpu_elementwise, kernel)
    caller = "depth_execution" if kernel == "fused_mix_and_norm" else "kernels.layer_ops"
    monkeypatch.setattr(
        f"attnres_lens.{caller}.{kernel}", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    )
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("cpu", "reference"):
        cfg = ModelConfig(
            **{
                **dict(
                    d_model=16,
                    n_heads=2,
                    n_layers=2,
                    d_vocab=32,
                    residual="attnres",
                    depth_attention_backend=backend,
                    dtype=torch.float64,
                    seed=1,
                ),
                **options,
            }
        )
        model = HookedTransformer(cfg)
        randomize_depth_parameters(model)  # non-uniform depth weights
        with torch.no_grad():  # and gains other than 1
            for name, parameter in model.named_parameters():
                if name.endswith(("ln1.w", "ln2.w", "ln_final.w")):
                    parameter.mul_(torch.linspace(0.5, 1.5, parameter.numel(), dtype=parameter.dtype))
        loss = model(tokens, return_type="loss")
        loss.backward()
        parameters = dict(model.named_parameters())
        results[backend] = [loss.detach()] + [parameters[name].grad for name in compared]
        if backend == "cpu":
            assert len(calls) == expected_calls
    assert len(calls) == expected_calls  # none on the reference backend
    for got, want in zip(results["cpu"], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
