"""torch.compile: a training step of every model variant traces into one graph (fullgraph=True), the fused C
kernel included (a torch.library custom op with shape-only and autograd rules), and computes what eager does.

The graphs are compiled with the `aot_eager` backend: it traces forward and backward exactly as inductor
would see them, without inductor's minutes of C++ code generation (analyses/bench_compile.py times inductor).
"""

from __future__ import annotations

import pytest
import torch

from attnres_lens import HookedTransformer
from tests.helpers import assert_same_step, randomize_depth_parameters, small_config

VARIANTS = {
    "standard": dict(),
    "kv_shift": dict(attention="kv_shift"),
    "full": dict(residual="attnres", block_size=1),
    "full+kv_shift": dict(residual="attnres", block_size=1, attention="kv_shift"),
    "block2": dict(residual="attnres", block_size=2),
    "block4+gqa": dict(residual="attnres", block_size=4, n_key_value_heads=2),
    "full torch backend": dict(residual="attnres", block_size=1, depth_attention_backend="torch"),
    "full reference backend": dict(residual="attnres", block_size=1, depth_attention_backend="reference"),
    "sigmoid, 2 heads, window 2": dict(residual="attnres", attnres_score="sigmoid", attnres_heads=2, attnres_window=2),
    "input-dependent query": dict(residual="attnres", attnres_query="input"),
    "scalar mixing": dict(residual="attnres", attnres_mixing="scalar"),
    "denseformer": dict(residual="denseformer"),
    "mhc": dict(residual="mhc", mhc_streams=2, mhc_sinkhorn_iters=3),
    "gated, biased, tied": dict(
        residual="attnres", gated_mlp=True, act_fn="silu", use_bias=True, tie_word_embeddings=True
    ),
}


def loss_and_grads(model: HookedTransformer, loss_fn, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(tokens)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # one trace of forward and backward per variant: seconds each
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_training_step_compiles_into_one_graph(name):
    overrides = dict(VARIANTS[name])
    residual, block_size = overrides.pop("residual", "standard"), overrides.pop("block_size", 1)
    attention = overrides.pop("attention", "standard")
    model = HookedTransformer(small_config(residual, block_size, attention, n_layers=2, **overrides))
    if residual == "attnres" and model.cfg.attnres_mixing == "attention" and model.cfg.attnres_query == "static":
        randomize_depth_parameters(model)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: model(t, return_type="loss"), fullgraph=True, backend="aot_eager")
    loss, grads = loss_and_grads(model, compiled, tokens)  # fullgraph: any graph break raises here
    expected_loss, expected_grads = loss_and_grads(model, lambda t: model(t, return_type="loss"), tokens)
    # the same float32 sums in other orders: the compiled graph runs the torch twins of the C kernels and
    # aot_autograd's backward
    assert_same_step(model, tokens, loss, grads, expected_loss, expected_grads)


@pytest.mark.slow
def test_compiled_token_range_check_still_fires():
    model = HookedTransformer(small_config("attnres", 1, n_layers=1))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: model(t, return_type="loss"), fullgraph=True, backend="aot_eager")
    compiled(torch.randint(0, 20, (1, 5)))
    with pytest.raises(RuntimeError, match=r"token ids must be in 0\.\.19"):
        compiled(torch.tensor([[1, 2, 25]]))


def test_the_cpu_kernel_ops_pass_torch_library_checks():
    """torch.library.opcheck: schema, fake (shape-only) rule, autograd registration and dispatch agree."""
    from attnres_lens.kernels import cpu_depth

    generator = torch.Generator().manual_seed(1)
    sources = [torch.randn(6, 8, generator=generator, requires_grad=True) for _ in range(3)]
    query = torch.randn(8, generator=generator, requires_grad=True)
    bias = torch.zeros(3, 6)
    bias[1, :2] = float("-inf")
    for args in ((sources, query, None, 1e-6), (sources, query, bias, 1e-6)):
        torch.library.opcheck(cpu_depth._forward_op, args)


def test_the_knobs_on_the_cpu_backend_trace_into_one_graph():
    """A call with the op's knobs (docs/kernels.md §1) on the cpu backend runs the torch Function under
    torch.compile (the C kernel's ctypes call cannot be traced): one graph, the eager values and gradients."""
    from attnres_lens.kernels import depth_attention
    from tests.kernel_cases import INKLING, make_knob_inputs

    sources, query, _ = make_knob_inputs(INKLING, 4, (2, 5), 16, seed=3)

    def mix(*tensors):
        h = depth_attention(list(tensors[:-1]), tensors[-1], None, backend="cpu", **INKLING.kwargs(16))
        return (h * torch.linspace(-1, 1, 16)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(mix, fullgraph=True, backend="aot_eager")
    results = []
    for run in (compiled, mix):
        leaves = [t.detach().clone().requires_grad_() for t in (*sources, query)]
        loss = run(*leaves)
        results.append([loss.detach(), *torch.autograd.grad(loss, leaves)])
    for traced, eager in zip(*results):
        torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)
