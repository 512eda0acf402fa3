"""Fused Triton depth attention: on CUDA when present, else on the CPU under TRITON_INTERPRET=1.

Select alone with ``pytest -m triton``. The interpreter reads TRITON_INTERPRET when triton is first imported, so it
is set here before anything imports triton; tiles are large so each test runs few (slow, interpreted) programs.
"""

from __future__ import annotations

import os
import sys

import torch

# triton reads the variable once, when first imported: if something imported it earlier without the variable,
# its kernels cannot run on the CPU and the module is skipped below
INTERPRETER_TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed")

import attnres_lens.kernels as kernels  # noqa: E402
from attnres_lens.kernels import block_phase1, depth_attention, merge_partial  # noqa: E402
from tests.kernel_cases import INKLING, KNOB_CASES, assert_close, make_inputs, make_knob_inputs, oracle  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("poisoned_outputs")]

if DEVICE == "cpu" and INTERPRETER_TOO_LATE:
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on the CPU; "
        "run these tests with TRITON_INTERPRET=1 in the environment",
        allow_module_level=True,
    )

from attnres_lens.kernels.triton_fused import depth_attention_triton  # noqa: E402
from attnres_lens.kernels.triton_two_phase import merge_triton, phase1_triton  # noqa: E402

# (n_sources, token shape, d_model, block_rows): token counts that leave a ragged last tile, more tiles than the
# interpreter's 8 backward programs (so the persistent loop runs), non-power-of-two widths
SHAPES = [
    (1, (7,), 5, 64),
    (3, (2, 50), 33, 16),
    (9, (130,), 48, 8),
    (17, (45,), 20, 32),
]


def test_hand_example():
    sources = [torch.tensor([1.0, 0, 0, 0], device=DEVICE), torch.tensor([0, 1.0, 0, 0], device=DEVICE)]
    h, weights = depth_attention(
        sources,
        torch.tensor([2.0, 0, 0, 0], device=DEVICE),
        torch.ones(4, device=DEVICE),
        backend="triton",
        return_weights=True,
    )
    assert h[0].item() == pytest.approx(0.9820138, abs=1e-6)
    assert weights.cpu().tolist() == pytest.approx([0.9820138, 0.0179862], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_sources,token_shape,d_model,block_rows", SHAPES)
def test_forward_and_backward_match_reference(dtype, n_sources, token_shape, d_model, block_rows):
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype, device=DEVICE)
    query, gain = query.to(dtype), gain.to(dtype)  # same rounded inputs for every run
    grad_output = torch.randn(sources[0].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    leaves = [t.detach().clone().requires_grad_() for t in (*sources, query, gain)]
    h, weights, logits = depth_attention_triton(
        leaves[:-2], leaves[-2], leaves[-1], 1e-6, want_stats=True, block_rows=block_rows
    )
    (h.float() * grad_output).sum().backward()

    expected_h, expected_weights, expected_logits = oracle(sources, query, gain)
    assert h.dtype == dtype
    assert_close(h, expected_h, dtype)
    assert_close(weights.t().reshape(*token_shape, n_sources), expected_weights, dtype)
    assert_close(logits.t().reshape(*token_shape, n_sources), expected_logits, dtype, scale=4.0)

    reference_leaves = [t.detach().double().requires_grad_() for t in (*sources, query, gain)]
    reference_h = depth_attention(
        reference_leaves[:-2], reference_leaves[-2], reference_leaves[-1], backend="reference"
    )
    (reference_h * grad_output.double()).sum().backward()
    for leaf, reference_leaf in zip(leaves, reference_leaves):
        assert leaf.grad.dtype == dtype
        assert_close(leaf.grad, reference_leaf.grad, dtype, scale=4.0)


@pytest.mark.parametrize("knobs", KNOB_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_knobs_forward_and_backward_match_reference(knobs, dtype, monkeypatch):
    """Every combination of the op's knobs (docs/kernels.md §1) against the float64 oracle and the reference's
    float64 gradients; 70 tokens in tiles of 8 leave a ragged tile and more tiles than backward programs."""
    import attnres_lens.kernels.triton_fused as triton_fused

    if DEVICE == "cpu":  # the interpreter's tiles are 64 rows; 8 makes the backward's persistent loop run
        monkeypatch.setattr(triton_fused, "default_block_rows", lambda d_model: 8)
    n_sources, token_shape, d_model = 5, (70,), 20
    sources, query, gain = make_knob_inputs(knobs, n_sources, token_shape, d_model, dtype, seed=31, device=DEVICE)
    params = [query.to(dtype)] + ([] if gain is None else [gain.to(dtype)])
    routes = () if knobs.routes is None else (knobs.routes,)
    grad_output = torch.randn(*token_shape, *routes, d_model, generator=torch.Generator().manual_seed(32)).to(DEVICE)

    def run(backend, inputs_dtype):
        leaves = [t.detach().to(inputs_dtype).requires_grad_() for t in (*sources, *params)]
        gain_in = leaves[n_sources + 1] if gain is not None else None
        h, weights, logits = depth_attention(
            leaves[:n_sources],
            leaves[n_sources],
            gain_in,
            backend=backend,
            return_weights=True,
            return_logits=True,
            **knobs.kwargs(d_model),
        )
        (h.double() * grad_output.double()).sum().backward()
        return h, weights, logits, [leaf.grad for leaf in leaves]

    h, weights, logits, grads = run("triton", dtype)
    expected_h, expected_weights, expected_logits = oracle(
        sources, params[0], params[1] if gain is not None else None, **knobs.kwargs(d_model)
    )
    assert h.dtype == dtype and h.shape == expected_h.shape
    assert_close(h, expected_h, dtype)
    assert_close(weights, expected_weights, dtype)
    assert_close(logits, expected_logits, dtype, scale=4.0)
    for grad, expected in zip(grads, run("reference", torch.float64)[3]):
        assert grad.dtype == dtype
        assert_close(grad, expected, dtype, scale=4.0)


def test_knobs_read_a_depth_buffer_in_place_as_a_list():
    sources, query, _ = make_knob_inputs(INKLING, 4, (3, 21), 24, seed=33, device=DEVICE)
    buffer = torch.stack(sources).requires_grad_()
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    from_buffer = depth_attention(buffer, query, None, backend="triton", **INKLING.kwargs(24))
    from_list = depth_attention(leaves, query, None, backend="triton", **INKLING.kwargs(24))
    assert torch.equal(from_buffer, from_list)
    (buffer_grad,) = torch.autograd.grad(from_buffer.sin().sum(), [buffer])
    list_grads = torch.autograd.grad(from_list.sin().sum(), leaves)
    assert torch.equal(buffer_grad, torch.stack(list_grads))


def test_knobs_with_a_logit_bias_leave_triton_under_auto_and_are_refused_by_name(monkeypatch):
    sources, query, _ = make_knob_inputs(INKLING, 3, (4,), 8, seed=34, device=DEVICE)
    bias = torch.zeros(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="triton depth-attention kernel takes no logit_bias"):
        depth_attention(sources, query, None, backend="triton", logit_bias=bias, **INKLING.kwargs(8))
    monkeypatch.setattr(kernels.backends, "triton_available", lambda: True)
    assert kernels.resolve_backend("auto", torch.device("cuda"), logit_bias=True, features=("logit_scale",)) == "torch"


def test_depth_buffer_matches_list_and_is_deterministic():
    sources, query, gain = make_inputs(6, (3, 41), 24, device=DEVICE, seed=2)
    buffer = torch.stack(sources).requires_grad_()
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    query = query.requires_grad_()
    from_buffer, buffer_weights = depth_attention(buffer, query, gain, backend="triton", return_weights=True)
    from_list, list_weights = depth_attention(leaves, query, gain, backend="triton", return_weights=True)
    assert torch.equal(from_buffer, from_list) and torch.equal(buffer_weights, list_weights)

    buffer_grads = torch.autograd.grad(from_buffer.sin().sum(), [buffer, query])
    list_grads = torch.autograd.grad(from_list.sin().sum(), [*leaves, query])
    assert torch.equal(buffer_grads[0], torch.stack(list_grads[:-1]))
    assert torch.equal(buffer_grads[1], list_grads[-1])  # no atomics: the query gradient is bitwise reproducible


def test_matches_fla_naive():
    attnres = pytest.importorskip("fla.ops.attnres", reason="fla-core is not installed")
    sources, query, gain = make_inputs(5, (2, 33), 40, device=DEVICE, seed=3)
    h, weights = depth_attention(sources, query, gain, backend="triton", return_weights=True)
    fla_h, fla_weights = attnres.naive_attnres(query, sources, gain, rms_eps=1e-6, scale=1.0, return_weights=True)
    assert_close(h, fla_h, torch.float32)
    assert_close(weights, fla_weights.movedim(0, -1), torch.float32)


def test_auto_picks_triton_only_on_cuda():
    expected = "triton" if DEVICE == "cuda" else "cpu"
    assert kernels.resolve_backend("auto", torch.device(DEVICE)) == expected


def test_gpu_check_dry_run(tmp_path):
    """The one GPU check runs end to end here (tiny shapes, the interpreter): every section, every check ok."""
    from analyses import gpu_check

    out, results = tmp_path / "gpu_check.md", tmp_path / "results.jsonl"
    lines = gpu_check.main(["--dry-run", "--out", str(out), "--results", str(results)])
    report = out.read_text()
    assert report.splitlines() == lines
    for title in ("## 1. Correctness", "## 3. Two-phase", "## 4. Training step"):
        assert title in report
    assert "FAILED" not in report and "MISMATCH" not in report and "skipped: " not in report
    statuses = [
        line.rsplit("|", 2)[-2].strip()
        for line in lines
        if line.startswith("| ") and line.count("|") >= 8 and not line.startswith("| tokens")
    ]
    assert statuses and set(statuses) <= {"ok", "skipped (needs CUDA or fla)"}
    from analyses.results import read_rows

    ratios = {row["variant"]: row for row in read_rows(results) if row["metric"] == "step ratio"}
    assert list(ratios) == ["standard", "block S=2", "full"] and ratios["standard"]["value"] == 1.0
    assert ratios["block S=2"]["target"] == 1.03 and "met" in ratios["block S=2"] and "met" not in ratios["full"]
    assert all(
        row["bench"] == "gpu_check" and row["command"].startswith("python -m analyses.gpu_check --dry-run")
        for row in ratios.values()
    )


# --- two-phase Block AttnRes ---------------------------------------------------------------------------------


def _block_inputs(n_completed, n_queries, token_shape, d_model, dtype, seed):
    sources, _, _ = make_inputs(n_completed + 1, token_shape, d_model, dtype, seed=seed, device=DEVICE)
    generator = torch.Generator().manual_seed(seed + 1)
    queries = (torch.randn(n_queries, d_model, generator=generator) * 2 / d_model**0.5).to(dtype).to(DEVICE)
    gains = (1 + 0.3 * torch.randn(n_queries, d_model, generator=generator)).to(dtype).to(DEVICE)
    return sources[:-1], sources[-1], queries, gains


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_completed,n_queries", [(1, 1), (3, 4), (5, 3), (2, 6)])
def test_two_phase_matches_single_pass_reference(dtype, n_completed, n_queries):
    """Every sublayer of a block (with and without a partial sum) against one float64 softmax over all its
    sources, in value and in the gradients of every source, query and gain."""
    completed, partial, queries, gains = _block_inputs(n_completed, n_queries, (2, 45), 20, dtype, seed=20)
    grad_output = torch.randn(partial.shape, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    for index in range(n_queries):
        for with_partial in (False, True):
            leaves = [t.detach().clone().requires_grad_() for t in (*completed, partial, queries, gains)]
            stats = block_phase1(leaves[:n_completed], leaves[-2], leaves[-1], return_logits=True, backend="triton")
            merged, weights = merge_partial(
                stats, index, leaves[n_completed] if with_partial else None, return_weights=True
            )
            (merged.float() * grad_output).sum().backward()

            sources = [*completed, partial] if with_partial else list(completed)
            expected_h, expected_weights, _ = oracle(sources, queries[index], gains[index])
            assert merged.dtype == dtype
            assert_close(merged, expected_h, dtype)
            assert_close(weights, expected_weights, dtype)

            reference = [t.detach().double().requires_grad_() for t in (*completed, partial, queries, gains)]
            reference_h = depth_attention(
                reference[: n_completed + with_partial], reference[-2][index], reference[-1][index], backend="reference"
            )
            (reference_h * grad_output.double()).sum().backward()
            for leaf, reference_leaf in zip(leaves, reference):
                if reference_leaf.grad is None:  # the partial sum, when the sublayer starts its block
                    assert leaf.grad is None
                else:
                    assert_close(leaf.grad, reference_leaf.grad, dtype, scale=4.0)


def test_two_phase_ragged_tiles_and_persistent_backward():
    # 70 tokens in tiles of 4: a ragged last tile, and 18 tiles for the interpreter's 8 backward programs
    completed, partial, queries, gains = _block_inputs(3, 3, (70,), 37, torch.float32, seed=22)
    leaves = [t.detach().clone().requires_grad_() for t in (*completed, partial, queries, gains)]
    mix, lse, _ = phase1_triton(leaves[:3], leaves[-2], leaves[-1], 1e-6, False, block_rows=4)
    h, _ = merge_triton(mix[2], lse[2], leaves[3], leaves[-2][2], leaves[-1][2], 1e-6, False, block_rows=4)
    h.sin().sum().backward()
    reference = [t.detach().double().requires_grad_() for t in (*completed, partial, queries, gains)]
    reference_h = depth_attention(reference[:4], reference[-2][2], reference[-1][2], backend="reference")
    reference_h.sin().sum().backward()
    assert_close(h, reference_h, torch.float32)
    for leaf, reference_leaf in zip(leaves, reference):
        assert_close(leaf.grad, reference_leaf.grad, torch.float32, scale=4.0)


def test_two_phase_gradients_are_bitwise_reproducible():
    completed, partial, queries, gains = _block_inputs(4, 2, (3, 30), 24, torch.float32, seed=23)

    def gradients():
        leaves = [t.detach().clone().requires_grad_() for t in (*completed, partial, queries, gains)]
        stats = block_phase1(leaves[:4], leaves[-2], leaves[-1], backend="triton")
        total = merge_partial(stats, 0, None).sum() + merge_partial(stats, 1, leaves[4]).cos().sum()
        return torch.autograd.grad(total, leaves)

    for first, second in zip(gradients(), gradients()):
        assert torch.equal(first, second)
