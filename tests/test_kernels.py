"""Depth-attention kernels on the CPU: reference and torch backends, two-phase Block AttnRes, API checks."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnres_lens.kernels import block_phase1, depth_attention, merge_partial
from tests.kernel_cases import (
    INKLING,
    KNOB_CASES,
    KNOB_SHAPES,
    SHAPES,
    Knobs,
    assert_close,
    make_inputs,
    make_knob_inputs,
    oracle,
)

CPU_BACKENDS = ["reference", "torch", "cpu"]
FAST_BACKENDS = ["torch", "cpu"]  # hand-derived backwards, checked against the reference's autograd

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


@pytest.fixture(scope="session")
def naive_attnres():
    """fla-core's pure-PyTorch AttnRes, imported late: fla imports triton, which must not happen before the
    triton tests have set TRITON_INTERPRET."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attnres = pytest.importorskip("fla.ops.attnres", reason="fla-core is not installed")
    return attnres.naive_attnres


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_hand_example(backend):
    # keys are [2,0,0,0] and [0,2,0,0] (rms 1/2), so the logits are 4 and 0 and alpha_0 = e^4 / (e^4 + 1)
    sources = [torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 1.0, 0, 0])]
    query = torch.tensor([2.0, 0, 0, 0])
    h, weights, logits = depth_attention(
        sources, query, torch.ones(4), backend=backend, return_weights=True, return_logits=True
    )
    assert h[0].item() == pytest.approx(0.9820138, abs=1e-6)
    assert h[1].item() == pytest.approx(1 - 0.9820138, abs=1e-6)
    assert weights.tolist() == pytest.approx([0.9820138, 0.0179862], abs=1e-6)
    assert logits.tolist() == pytest.approx([4.0, 0.0], abs=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_sources,token_shape,d_model", SHAPES)
def test_forward_matches_float64_oracle(backend, dtype, n_sources, token_shape, d_model):
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype)
    h, weights, logits = depth_attention(sources, query, gain, backend=backend, return_weights=True, return_logits=True)
    expected_h, expected_weights, expected_logits = oracle(sources, query, gain)
    assert h.dtype == dtype and h.shape == sources[0].shape
    assert weights.shape == (*token_shape, n_sources) and logits.shape == weights.shape
    assert_close(h, expected_h, dtype)
    assert_close(weights, expected_weights, dtype)
    assert_close(logits, expected_logits, dtype, scale=4.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n_sources,token_shape,d_model", SHAPES)
def test_forward_matches_fla_naive(naive_attnres, backend, n_sources, token_shape, d_model):
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, seed=1)
    h, weights = depth_attention(sources, query, gain, backend=backend, return_weights=True)
    fla_h, fla_weights = naive_attnres(query, sources, gain, rms_eps=1e-6, scale=1.0, return_weights=True)
    assert_close(h, fla_h, torch.float32)
    assert_close(weights, fla_weights.movedim(0, -1), torch.float32)  # fla puts sources first


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@settings(max_examples=25, deadline=None)
@given(
    n_sources=st.integers(1, 17),
    n_tokens=st.integers(1, 70),
    d_model=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_fast_backends_random_shapes(backend, n_sources, n_tokens, d_model, seed):
    sources, query, gain = make_inputs(n_sources, (n_tokens,), d_model, seed=seed)
    h, weights = depth_attention(sources, query, gain, backend=backend, return_weights=True)
    expected_h, expected_weights, _ = oracle(sources, query, gain)
    assert_close(h, expected_h, torch.float32)
    assert_close(weights, expected_weights, torch.float32)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_sources,token_shape,d_model", SHAPES)
def test_fast_gradients_match_reference_autograd(backend, dtype, n_sources, token_shape, d_model):
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype, seed=2)
    grad_output = torch.randn(sources[0].shape, generator=torch.Generator().manual_seed(3))

    def gradients(backend, inputs_dtype):
        # round everything to `dtype` first so both runs see identical inputs
        leaves = [t.detach().to(dtype).to(inputs_dtype).requires_grad_() for t in (*sources, query, gain)]
        h = depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend=backend)
        (h.double() * grad_output.double()).sum().backward()
        return [leaf.grad for leaf in leaves]

    expected = gradients("reference", torch.float64)
    for actual, wanted in zip(gradients(backend, dtype), expected):
        assert actual.dtype == dtype
        assert_close(actual, wanted, dtype, scale=4.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck_float64(backend):
    sources, query, gain = make_inputs(3, (2, 3), 7, torch.float64, seed=4)
    inputs = [t.detach().double().requires_grad_() for t in (*sources, query, gain)]

    def mix(*tensors):
        return depth_attention(list(tensors[:-2]), tensors[-2], tensors[-1], backend=backend)

    assert torch.autograd.gradcheck(mix, inputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_depth_buffer_equals_list(backend):
    sources, query, gain = make_inputs(4, (3, 5), 12, seed=5)
    buffer = torch.stack(sources).requires_grad_()
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    from_buffer = depth_attention(buffer, query, gain, backend=backend)
    from_list = depth_attention(leaves, query, gain, backend=backend)
    torch.testing.assert_close(from_buffer, from_list)
    from_buffer.sum().backward()
    from_list.sum().backward()
    torch.testing.assert_close(buffer.grad, torch.stack([leaf.grad for leaf in leaves]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_query_gives_uniform_weights(backend):
    # a zero-initialised pseudo-query (docs/model.md §2) must give the plain average of the sources
    sources, _, gain = make_inputs(5, (9,), 16, seed=6)
    h, weights = depth_attention(sources, torch.zeros(16), gain, backend=backend, return_weights=True)
    torch.testing.assert_close(weights, torch.full((9, 5), 0.2))
    torch.testing.assert_close(h, sum(sources) / 5)


def test_single_source_passes_through():
    sources, query, gain = make_inputs(1, (4, 3), 10, seed=7)
    for backend in CPU_BACKENDS:
        torch.testing.assert_close(depth_attention(sources, query, gain, backend=backend), sources[0])


def random_bias(token_shape: tuple[int, ...], n_sources: int, seed: int) -> torch.Tensor:
    """A logit bias of order 1 with about a third of its entries −inf, never a whole row (one source stays)."""
    generator = torch.Generator().manual_seed(seed)
    bias = torch.randn(*token_shape, n_sources, generator=generator)
    masked = torch.rand(*token_shape, n_sources, generator=generator) < 1 / 3
    masked[..., torch.randint(0, n_sources, (), generator=generator)] = False
    return bias.masked_fill(masked, float("-inf"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_sources,token_shape,d_model", SHAPES)
def test_logit_bias_matches_float64_oracle(backend, dtype, n_sources, token_shape, d_model):
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype, seed=11)
    bias = random_bias(token_shape, n_sources, seed=12)
    h, weights, logits = depth_attention(
        sources, query, gain, backend=backend, return_weights=True, return_logits=True, logit_bias=bias
    )
    expected_h, expected_weights, expected_logits = oracle(sources, query, gain, logit_bias=bias)
    assert_close(h, expected_h, dtype)
    assert_close(weights, expected_weights, dtype)
    assert (weights[bias == float("-inf")] == 0).all()
    assert torch.equal(logits.isinf(), bias.isinf())  # the logits reported are the softmax's input
    finite = ~bias.isinf()
    assert_close(logits[finite], expected_logits[finite], dtype, scale=4.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_minus_inf_bias_equals_leaving_the_sources_out(backend):
    # independent ground truth for a knockout: the mix of the sources that remain
    sources, query, gain = make_inputs(6, (4, 7), 24, seed=13)
    bias = torch.zeros(4, 7, 6)
    bias[..., [1, 4]] = float("-inf")
    kept = [source for s, source in enumerate(sources) if s not in (1, 4)]
    masked = depth_attention(sources, query, gain, backend=backend, logit_bias=bias)
    assert_close(masked, oracle(kept, query, gain)[0], torch.float32)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_with_a_logit_bias_match_reference_autograd(backend, dtype):
    sources, query, gain = make_inputs(5, (3, 13), 40, dtype, seed=14)
    bias = random_bias((3, 13), 5, seed=15)
    grad_output = torch.randn(sources[0].shape, generator=torch.Generator().manual_seed(16))

    def gradients(backend, inputs_dtype):
        leaves = [t.detach().to(dtype).to(inputs_dtype).requires_grad_() for t in (*sources, query, gain)]
        h = depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend=backend, logit_bias=bias)
        (h.double() * grad_output.double()).sum().backward()
        return [leaf.grad for leaf in leaves]

    expected = gradients("reference", torch.float64)
    for actual, wanted in zip(gradients(backend, dtype), expected):
        assert torch.isfinite(actual).all()  # a masked source's zero weight must not turn into 0 * inf
        assert_close(actual, wanted, dtype, scale=4.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradcheck_float64_with_a_logit_bias(backend):
    sources, query, gain = make_inputs(4, (2, 3), 7, torch.float64, seed=17)
    bias = random_bias((2, 3), 4, seed=18).double()
    inputs = [t.detach().double().requires_grad_() for t in (*sources, query, gain)]

    def mix(*tensors):
        return depth_attention(list(tensors[:-2]), tensors[-2], tensors[-1], backend=backend, logit_bias=bias)

    assert torch.autograd.gradcheck(mix, inputs)


@pytest.mark.parametrize(
    "bias,message",
    [
        (torch.zeros(3, 3), r"logit_bias must have shape \[3, 2\]"),
        (torch.zeros(3, 2, dtype=torch.long), "logit_bias must be floating point"),
    ],
)
def test_bad_logit_bias_raises_clear_errors(bias, message):
    sources, query, gain = make_inputs(2, (3,), 4)
    with pytest.raises(ValueError, match=message):
        depth_attention(sources, query, gain, backend="torch", logit_bias=bias)


def test_a_bias_that_needs_a_gradient_is_refused_where_it_would_get_none():
    sources, query, gain = make_inputs(2, (3,), 4)
    bias = torch.zeros(3, 2, requires_grad=True)
    with pytest.raises(ValueError, match="backend='reference' for a gradient"):
        depth_attention(sources, query, gain, backend="cpu", logit_bias=bias)
    h = depth_attention(sources, query, gain, backend="reference", logit_bias=bias)
    h.sum().backward()
    assert bias.grad is not None


# --- the op's knobs: logit scale, unweighted key norm, normalised values, several queries ----------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_sources,token_shape,d_model", KNOB_SHAPES)
@pytest.mark.parametrize("knobs", KNOB_CASES, ids=str)
def test_knobs_match_float64_oracle(backend, dtype, n_sources, token_shape, d_model, knobs):
    sources, query, gain = make_knob_inputs(knobs, n_sources, token_shape, d_model, dtype, seed=21)
    h, weights, logits = depth_attention(
        sources, query, gain, backend=backend, return_weights=True, return_logits=True, **knobs.kwargs(d_model)
    )
    expected_h, expected_weights, expected_logits = oracle(sources, query, gain, **knobs.kwargs(d_model))
    routes = () if knobs.routes is None else (knobs.routes,)
    assert h.dtype == dtype and h.shape == (*token_shape, *routes, d_model)
    assert weights.shape == (*token_shape, *routes, n_sources) and logits.shape == weights.shape
    assert_close(h, expected_h, dtype)
    assert_close(weights, expected_weights, dtype)
    assert_close(logits, expected_logits, dtype, scale=4.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "knobs,per_route",
    [(Knobs(routes=3), False), (INKLING, False), (INKLING, True), (Knobs(gained=False, normalize_values=True), False)],
    ids=str,
)
def test_knobs_with_a_logit_bias_match_float64_oracle(backend, knobs, per_route):
    token_shape, n_sources, d_model = (3, 7), 5, 24
    sources, query, gain = make_knob_inputs(knobs, n_sources, token_shape, d_model, seed=22)
    bias_shape = (*token_shape, knobs.routes) if per_route else token_shape
    bias = random_bias(bias_shape, n_sources, seed=23)
    h, weights, logits = depth_attention(
        sources,
        query,
        gain,
        backend=backend,
        return_weights=True,
        return_logits=True,
        logit_bias=bias,
        **knobs.kwargs(d_model),
    )
    expected_h, expected_weights, expected_logits = oracle(
        sources, query, gain, logit_bias=bias, **knobs.kwargs(d_model)
    )
    assert_close(h, expected_h, torch.float32)
    assert_close(weights, expected_weights, torch.float32)
    finite = expected_logits.isfinite()
    assert torch.equal(logits.isfinite(), finite)  # the reported logits are the softmax's input, bias included
    assert_close(logits[finite], expected_logits[finite], torch.float32, scale=4.0)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("knobs", KNOB_CASES, ids=str)
def test_knob_gradients_match_reference_autograd(backend, dtype, knobs):
    n_sources, token_shape, d_model = 4, (2, 9), 33
    sources, query, gain = make_knob_inputs(knobs, n_sources, token_shape, d_model, dtype, seed=24)
    params = [query] if gain is None else [query, gain]
    routes = () if knobs.routes is None else (knobs.routes,)
    grad_output = torch.randn(*token_shape, *routes, d_model, generator=torch.Generator().manual_seed(25))

    def gradients(backend, inputs_dtype):
        leaves = [t.detach().to(dtype).to(inputs_dtype).requires_grad_() for t in (*sources, *params)]
        sources_in, query_in = leaves[:n_sources], leaves[n_sources]
        gain_in = leaves[n_sources + 1] if gain is not None else None
        h = depth_attention(sources_in, query_in, gain_in, backend=backend, **knobs.kwargs(d_model))
        (h.double() * grad_output.double()).sum().backward()
        return [leaf.grad for leaf in leaves]

    expected = gradients("reference", torch.float64)
    for actual, wanted in zip(gradients(backend, dtype), expected):
        assert actual.dtype == dtype
        assert_close(actual, wanted, dtype, scale=4.0)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("per_route", [False, True])
def test_inkling_gradients_with_a_logit_bias_match_reference_autograd(backend, per_route):
    sources, query, _ = make_knob_inputs(INKLING, 5, (3, 13), 40, seed=31)
    bias = random_bias((3, 13, 3) if per_route else (3, 13), 5, seed=32)
    grad_output = torch.randn(3, 13, 3, 40, generator=torch.Generator().manual_seed(33))

    def gradients(backend, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (*sources, query)]
        h = depth_attention(leaves[:-1], leaves[-1], None, backend=backend, logit_bias=bias, **INKLING.kwargs(40))
        (h.double() * grad_output.double()).sum().backward()
        return [leaf.grad for leaf in leaves]

    for actual, wanted in zip(gradients(backend, torch.float32), gradients("reference", torch.float64)):
        assert torch.isfinite(actual).all()  # a masked source's zero weight must not turn into 0 * inf
        assert_close(actual, wanted, torch.float32, scale=4.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("knobs", KNOB_CASES, ids=str)
def test_knob_gradcheck_float64(backend, knobs):
    sources, query, gain = make_knob_inputs(knobs, 3, (2, 3), 7, torch.float64, seed=26)
    params = [query] if gain is None else [query, gain]
    inputs = [t.detach().double().requires_grad_() for t in (*sources, *params)]

    def mix(*tensors):
        gain_in = tensors[4] if gain is not None else None
        return depth_attention(list(tensors[:3]), tensors[3], gain_in, backend=backend, **knobs.kwargs(7))

    assert torch.autograd.gradcheck(mix, inputs)


def inkling_mix_float64(sources: list[torch.Tensor], queries: torch.Tensor, eps: float) -> torch.Tensor:
    """Inkling-2's depth mix from its equations, one token and route at a time in float64: ``n_s = v_s /
    sqrt(mean(v_s^2) + eps)`` (no gain), ``z_rs = (q_r . n_s) / sqrt(D)``, ``a_r = softmax(z_r)``,
    ``h_r = sum_s a_rs n_s``. Returns ``[..., R, D]``."""
    d_model = sources[0].shape[-1]
    rows = torch.stack([s.double() for s in sources], dim=-2).reshape(-1, len(sources), d_model)
    out = torch.empty(rows.shape[0], queries.shape[0], d_model, dtype=torch.float64)
    for token, values in enumerate(rows):
        normed = [v / math.sqrt(float((v * v).sum()) / d_model + eps) for v in values]
        for route, q in enumerate(queries.double()):
            scores = [float(q @ n) / math.sqrt(d_model) for n in normed]
            top = max(scores)
            exps = [math.exp(z - top) for z in scores]
            out[token, route] = sum(e / sum(exps) * n for e, n in zip(exps, normed))
    return out.reshape(*sources[0].shape[:-1], queries.shape[0], d_model)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inkling_formula_from_its_equations(backend, dtype):
    sources, queries, _ = make_knob_inputs(INKLING, 4, (2, 5), 16, dtype, seed=27)
    h = depth_attention(sources, queries, None, backend=backend, logit_scale=16**-0.5, normalize_values=True)
    assert_close(h, inkling_mix_float64(sources, queries, 1e-6), dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inkling_knobs_equal_transformers_block_attention_residual(backend):
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    config = Inkling2TextConfig(hidden_size=16)
    config._attn_implementation = "eager"
    module = modeling.Inkling2BlockAttentionResidual(config, num_queries=3)
    sources, queries, _ = make_knob_inputs(INKLING, 4, (2, 5), 16, seed=28)
    with torch.no_grad():
        module.query.copy_(queries)
        expected = module(torch.stack(sources[:-1], dim=-2), sources[-1])  # completed blocks, then the partial
        h = depth_attention(sources, queries, None, backend=backend, logit_scale=16**-0.5, normalize_values=True)
    for route, wanted in enumerate(expected):
        assert_close(h[..., route, :], wanted, torch.float32)


def test_normalized_values_take_no_gain():
    # docs/kernels.md §1: the values are normalised without the keys' gain, so a gain changes only the weights
    sources, query, gain = make_knob_inputs(Knobs(normalize_values=True), 3, (4,), 8, torch.float64, seed=29)
    h, weights = depth_attention(sources, query, gain, backend="reference", normalize_values=True, return_weights=True)
    normalized = [v / (v.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() for v in sources]
    torch.testing.assert_close(h, sum(weights[..., s, None] * n for s, n in enumerate(normalized)))


def test_one_route_equals_the_single_query():
    sources, query, gain = make_inputs(3, (2, 4), 12, torch.float64, seed=30)
    single = depth_attention(sources, query, gain, backend="reference", return_weights=True)
    routed = depth_attention(sources, query[None], gain, backend="reference", return_weights=True)
    for one, many in zip(single, routed):
        torch.testing.assert_close(many.squeeze(-2), one)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(logit_scale=0.0), "logit_scale must be finite and > 0.*got 0.0"),
        (dict(logit_scale=-1.0), "logit_scale must be finite and > 0.*got -1.0"),
        (dict(logit_scale=float("inf")), "logit_scale must be finite and > 0.*got inf"),
        (dict(logit_scale=float("nan")), "logit_scale must be finite and > 0.*got nan"),
        (dict(logit_scale=torch.tensor(0.5)), "logit_scale must be a Python number.*got Tensor"),
        (dict(logit_scale=True), "logit_scale must be a Python number.*got bool"),
        (dict(normalize_values="yes"), "normalize_values must be True or False, got 'yes'"),
        (dict(query=torch.zeros(2, 5)), r"query must have shape \[4\] or \[n_routes, 4\].*got \(2, 5\)"),
        (dict(query=torch.zeros(1, 2, 4)), r"query must have shape \[4\] or \[n_routes, 4\].*got \(1, 2, 4\)"),
        (dict(query=torch.zeros(0, 4)), r"query must have shape \[4\] or \[n_routes, 4\].*got \(0, 4\)"),
        (dict(query=torch.zeros(2, 4, dtype=torch.long)), "query must be floating point"),
        (
            dict(query=torch.zeros(2, 4), logit_bias=torch.zeros(3, 3, 2)),
            r"logit_bias must have shape \[3, 2\].* or \[3, 2, 2\] \(one bias per route\), got \(3, 3, 2\)",
        ),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "torch", "cpu", "auto"])
def test_bad_knobs_raise_clear_errors(kwargs, message, backend):
    sources, query, gain = make_inputs(2, (3,), 4)
    kwargs = {"query": query, **kwargs}
    with pytest.raises(ValueError, match=message):
        depth_attention(sources, key_norm_weight=gain, backend=backend, **kwargs)


# --- input validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda s, q, g: ([s[0], s[1][:2]], q, g), "same shape"),
        (lambda s, q, g: ([s[0], s[1].double()], q, g), "same dtype"),
        (lambda s, q, g: ([], q, g), "at least one source"),
        (lambda s, q, g: (s, q[:3], g), "query must have shape"),
        (lambda s, q, g: (s, q, g[None]), "key_norm_weight must have shape"),
        (lambda s, q, g: ([t.long() for t in s], q, g), "floating point"),
        (lambda s, q, g: ([s[0], [1.0] * 4], q, g), "source 1 is list"),
        (lambda s, q, g: ([t[..., :0] for t in s], q[:0], g[:0]), "width D >= 1"),
    ],
)
@pytest.mark.parametrize("backend", ["reference", "torch", "cpu"])
def test_bad_inputs_raise_clear_errors(change, message, backend):
    sources, query, gain = make_inputs(2, (3,), 4)
    bad_sources, bad_query, bad_gain = change(sources, query, gain)
    with pytest.raises(ValueError, match=message):
        depth_attention(bad_sources, bad_query, bad_gain, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_two_phase_api_checks_what_the_single_pass_op_checks(backend):
    from attnres_lens.kernels.two_phase import block_phase1, merge_partial

    sources, query, gain = make_inputs(3, (2,), 4)
    queries, gains = torch.stack([query, query]), torch.stack([gain, gain])
    with pytest.raises(ValueError, match="queries must be floating point"):
        block_phase1(sources, queries.long(), gains, 1e-6, backend=backend)
    with pytest.raises(ValueError, match="key_norm_weights must be floating point"):
        block_phase1(sources, queries, gains.long(), 1e-6, backend=backend)
    stats = block_phase1(sources, queries, gains, 1e-6, backend=backend)
    with pytest.raises(ValueError, match="partial must be a floating tensor"):
        merge_partial(stats, 0, sources[0].long())


def test_kernels_import_without_triton_or_transformer_lens():
    code = (
        "import sys, attnres_lens.kernels; "
        "bad = [m for m in ('triton', 'transformer_lens') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- two-phase Block AttnRes ---------------------------------------------------------------------------------


def test_merge_partial_equals_single_pass_in_value_and_gradient():
    sources, _, _ = make_inputs(4, (2, 9), 20, torch.float64, seed=8)
    generator = torch.Generator().manual_seed(9)
    queries = (torch.randn(3, 20, generator=generator, dtype=torch.float64) * 0.5).requires_grad_()
    gains = (1 + 0.3 * torch.randn(3, 20, generator=generator, dtype=torch.float64)).requires_grad_()
    completed = [s.detach().clone().requires_grad_() for s in sources[:3]]
    partial = sources[3].detach().clone().requires_grad_()

    stats = block_phase1(completed, queries, gains, return_logits=True)
    for index in range(3):
        merged, weights = merge_partial(stats, index, partial, return_weights=True)
        single, single_weights = depth_attention(
            [*completed, partial], queries[index], gains[index], backend="reference", return_weights=True
        )
        torch.testing.assert_close(merged, single)
        torch.testing.assert_close(weights, single_weights)
        leaves = [*completed, partial, queries, gains]
        merged_grads = torch.autograd.grad(merged.sin().sum(), leaves, retain_graph=True)
        single_grads = torch.autograd.grad(single.sin().sum(), leaves, retain_graph=True)
        for merged_grad, single_grad in zip(merged_grads, single_grads):
            torch.testing.assert_close(merged_grad, single_grad)
    # the sublayer that starts a block has no partial sum: phase 1 alone is the answer
    torch.testing.assert_close(
        merge_partial(stats, 1, None), depth_attention(completed, queries[1], gains[1], backend="reference")
    )


def _block_attnres_stack(block_size: int, n_sublayers: int, two_phase: bool) -> tuple[torch.Tensor, list]:
    """A toy Block AttnRes stack (sublayer f_j = tanh(h_j W_j)), run single-pass or two-phase; returns the
    loss and its gradients w.r.t. the embedding, every W_j, every query and every gain."""
    generator = torch.Generator().manual_seed(block_size * 100 + n_sublayers)
    d_model, token_shape = 12, (2, 5)
    embedding = torch.randn(*token_shape, d_model, generator=generator, dtype=torch.float64, requires_grad=True)
    mixers = torch.randn(n_sublayers, d_model, d_model, generator=generator, dtype=torch.float64) / d_model**0.5
    mixers.requires_grad_()
    # one query and gain per sublayer plus the final readout; random, not zero, so the softmax matters
    queries = torch.randn(n_sublayers + 1, d_model, generator=generator, dtype=torch.float64).requires_grad_()
    gains = 1 + 0.3 * torch.randn(n_sublayers + 1, d_model, generator=generator, dtype=torch.float64)
    gains.requires_grad_()

    blocks, partial, stats, block_start = [embedding], None, None, 0
    for j in range(n_sublayers + 1):
        is_final = j == n_sublayers
        if j % block_size == 0 and not is_final:
            if partial is not None:
                blocks.append(partial)
                partial = None
            block_start = j
            if two_phase:
                block_end = min(j + block_size, n_sublayers)
                stats = block_phase1(blocks, queries[block_start:block_end], gains[block_start:block_end])
        if two_phase and is_final:
            h = merge_partial(block_phase1(blocks, queries[j:], gains[j:]), 0, partial)
        elif two_phase:
            h = merge_partial(stats, j - block_start, partial)
        else:
            sources = blocks + ([partial] if partial is not None else [])
            h = depth_attention(sources, queries[j], gains[j], backend="reference")
        if is_final:
            loss = (h * torch.linspace(-1, 1, d_model, dtype=torch.float64)).sum()
        else:
            output = torch.tanh(h @ mixers[j])
            partial = output if partial is None else partial + output
    return loss, list(torch.autograd.grad(loss, [embedding, mixers, queries, gains]))


@pytest.mark.parametrize("block_size", [2, 4, 6])
@pytest.mark.parametrize("n_sublayers", [7, 12])
def test_two_phase_stack_equals_single_pass(block_size, n_sublayers):
    loss, grads = _block_attnres_stack(block_size, n_sublayers, two_phase=False)
    two_phase_loss, two_phase_grads = _block_attnres_stack(block_size, n_sublayers, two_phase=True)
    torch.testing.assert_close(two_phase_loss, loss)
    for two_phase_grad, grad in zip(two_phase_grads, grads):
        torch.testing.assert_close(two_phase_grad, grad)


def test_phase1_low_precision_sources():
    sources, _, _ = make_inputs(3, (17,), 24, torch.bfloat16, seed=10)
    queries = torch.randn(2, 24, generator=torch.Generator().manual_seed(11)) * 0.4
    gains = torch.ones(2, 24)
    stats = block_phase1(sources, queries, gains)
    assert stats.mix.dtype == torch.float32 and stats.lse.dtype == torch.float32  # kept wide between phases
    h = merge_partial(stats, 1, sources[0])
    assert h.dtype == torch.bfloat16
    expected, _, _ = oracle([*sources, sources[0]], queries[1], gains[1])
    assert_close(h, expected, torch.bfloat16)


def test_two_phase_validation():
    sources, _, _ = make_inputs(2, (3,), 8)
    with pytest.raises(ValueError, match="queries must have shape"):
        block_phase1(sources, torch.zeros(8), torch.ones(8))
    stats = block_phase1(sources, torch.zeros(2, 8), torch.ones(2, 8))
    with pytest.raises(ValueError, match="index must be in 0..1"):
        merge_partial(stats, 2, None)
    with pytest.raises(ValueError, match="return_logits=True"):
        merge_partial(stats, 0, None, return_weights=True)
