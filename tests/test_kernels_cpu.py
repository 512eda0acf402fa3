"""The fused C kernel of the ``cpu`` backend: threading, determinism, odd layouts, and how it fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.autograd import forward_ad

from attnres_lens import components
from attnres_lens.kernels import (
    backends,
    cpu_attention,
    cpu_autograd,
    cpu_build,
    cpu_depth,
    cpu_elementwise,
    depth_attention,
)
from tests.helpers import randomize_depth_parameters
from tests.kernel_cases import INKLING, SHAPES, Knobs, assert_close, make_inputs, make_knob_inputs, oracle

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


@pytest.fixture
def many_threads(monkeypatch):
    """Split even tiny inputs over 4 kernel threads, more than some inputs have rows."""
    monkeypatch.setattr(cpu_build, "MIN_ELEMENTS_PER_THREAD", 1)
    monkeypatch.setattr(cpu_build, "PTHREAD_MIN_ELEMENTS_PER_THREAD", 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(previous)


def forward_backward(sources, query, gain):
    leaves = [t.detach().clone().requires_grad_() for t in (*sources, query, gain)]
    h, weights = depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend="cpu", return_weights=True)
    (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
    return h.detach(), weights, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("n_tokens", [1, 3, 97])
def test_threaded_split_matches_oracle_and_one_thread(many_threads, n_tokens):
    sources, query, gain = make_inputs(6, (n_tokens,), 40, seed=11)
    h, weights, grads = forward_backward(sources, query, gain)
    expected_h, expected_weights, _ = oracle(sources, query, gain)
    assert_close(h, expected_h, torch.float32)
    assert_close(weights, expected_weights, torch.float32)
    torch.set_num_threads(1)
    h_one, _, grads_one = forward_backward(sources, query, gain)
    torch.testing.assert_close(h, h_one, rtol=0, atol=0)  # rows are independent: the split cannot change them
    for threaded, single in zip(grads, grads_one):
        # the query and gain gradients are sums over tokens reduced per thread: fp32 rounding of that order,
        # relative to the size of what is summed (elements near zero come from cancellation)
        torch.testing.assert_close(threaded, single, rtol=1e-5, atol=1e-6 * max(1.0, single.abs().max().item()))


def test_repeated_runs_are_bitwise_identical(many_threads):
    # the query gradient is reduced per thread, then in a fixed order: no atomics, no run-to-run noise
    sources, query, gain = make_inputs(5, (64,), 24, seed=12)
    first, second = forward_backward(sources, query, gain)[2], forward_backward(sources, query, gain)[2]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_the_kernel_threads_are_torchs_openmp_pool():
    """The shipped build runs its row split on OpenMP, and its OpenMP runtime is the one torch loaded: its thread
    count follows torch.set_num_threads (a second runtime would keep its own count and its own threads)."""
    library = cpu_build.cpu_library(torch.float32)
    if not library.thread_pool:
        pytest.skip("this C compiler builds the kernel without OpenMP (the pthread form)")
    previous = torch.get_num_threads()
    try:
        for threads in (3, 1, 2):
            torch.set_num_threads(threads)
            assert library.openmp_threads() == threads
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("n_tokens", [5, 97])
@pytest.mark.slow
def test_the_pthread_build_splits_rows_as_the_openmp_build(many_threads, tmp_path, monkeypatch, n_tokens):
    """A compiler without OpenMP builds the pthread form of the split: the same ranges and the same per-thread
    sums reduced in the same order, so forward and backward equal the OpenMP build's bit for bit (and float64)."""
    shipped = cpu_build.cpu_library(torch.float32)
    if not shipped.thread_pool:
        pytest.skip("this C compiler builds the kernel without OpenMP: there is no OpenMP build to compare with")
    monkeypatch.setenv(cpu_build.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_build, "THREAD_FLAGS", ([],))
    pthreads = cpu_build._build_library("float")
    assert shipped.openmp_threads() == 4 and pthreads.openmp_threads() == 0
    sources, query, gain = make_inputs(7, (n_tokens,), 40, seed=14)
    results = {}
    for name, library in (("openmp", shipped), ("pthreads", pthreads)):
        monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype, library=library: library)
        results[name] = forward_backward(sources, query, gain)
    q, k, v = (torch.randn(2, n_tokens, 3, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(3))
    monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype: shipped)
    results["attention"] = cpu_attention.causal_attention_cpu(q, k, v, 0.25)
    monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype: pthreads)
    expected_h, expected_weights, _ = oracle(sources, query, gain)
    assert_close(results["pthreads"][0], expected_h, torch.float32)
    assert_close(results["pthreads"][1], expected_weights, torch.float32)
    for got, want in zip(
        [*results["pthreads"][:2], *results["pthreads"][2]], [*results["openmp"][:2], *results["openmp"][2]]
    ):
        assert torch.equal(got, want)
    # the causal attention's (batch, head) pairs run on one thread there, the same arithmetic
    q, k, v = (torch.randn(2, n_tokens, 3, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(3))
    assert torch.equal(cpu_attention.causal_attention_cpu(q, k, v, 0.25), results["attention"])


@pytest.mark.slow
def test_the_forward_reads_a_tile_in_either_order_to_the_same_bits(tmp_path, monkeypatch):
    """Below GROUPED_FORWARD_MIN_SOURCES the forward reads a tile token row by token row, from it on source group
    by source group (cpu_depth.c): a build that reads by groups at every source count gives the shipped build's
    outputs and gradients bit for bit where the shipped one reads by rows (the same group_sums, only in another
    order), and both the float64 oracle's."""
    shipped = cpu_build.cpu_library(torch.float32)
    monkeypatch.setenv(cpu_build.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_build, "ARCH_FLAGS", ([*cpu_build.ARCH_FLAGS[0], "-DGROUPED_FORWARD_MIN_SOURCES=1"],))
    grouped = cpu_build._build_library("float")
    for n_sources in (1, 3, 6):  # all below the shipped threshold; 6: a group of four and a short one
        sources, query, gain = make_inputs(n_sources, (37,), 40, seed=n_sources)  # a short last tile, odd width
        results = []
        for library in (shipped, grouped):
            monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype, library=library: library)
            results.append(forward_backward(sources, query, gain))
        expected_h, expected_weights, _ = oracle(sources, query, gain)
        assert_close(results[0][0], expected_h, torch.float32)
        assert_close(results[0][1], expected_weights, torch.float32)
        for got, want in zip([*results[0][:2], *results[0][2]], [*results[1][:2], *results[1][2]]):
            assert torch.equal(got, want), n_sources


def test_non_contiguous_sources_and_leading_dims():
    sources, query, gain = make_inputs(3, (4, 6), 10, seed=13)
    transposed = [source.transpose(0, 1) for source in sources]  # [6, 4, 10] views, not contiguous
    h = depth_attention(transposed, query, gain, backend="cpu")
    assert h.shape == (6, 4, 10)
    assert_close(h, oracle(transposed, query, gain)[0], torch.float32)


def test_non_cpu_tensors_are_refused():
    sources = [torch.empty(3, 4, device="meta")]
    with pytest.raises(ValueError, match="cpu backend needs CPU tensors.*meta"):
        cpu_depth.depth_attention_cpu(sources, torch.empty(4, device="meta"), torch.empty(4, device="meta"), 1e-6)


def _run_in_fresh_process(tmp_path, compiler: str, backend: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (the library cache is per process) with $CC set and its own kernel cache folder."""
    code = textwrap.dedent(
        f"""
        import warnings, torch
        from attnres_lens.kernels import depth_attention
        warnings.simplefilter("always")
        h = depth_attention([torch.ones(2, 3)], torch.zeros(3), torch.ones(3), backend={backend!r})
        print("ok", h.sum().item())
        """
    )
    env = {**os.environ, "CC": compiler, cpu_build.CACHE_ENV_VAR: str(tmp_path / "cache")}
    env.pop(backends.BACKEND_ENV_VAR, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_missing_compiler_names_it_and_auto_falls_back_to_torch(tmp_path):
    explicit = _run_in_fresh_process(tmp_path, "no-such-cc", "cpu")
    assert explicit.returncode != 0
    assert "no C compiler 'no-such-cc' was found" in explicit.stderr and "backend='torch'" in explicit.stderr
    automatic = _run_in_fresh_process(tmp_path, "no-such-cc", "auto")
    assert automatic.returncode == 0, automatic.stderr
    assert "ok 6.0" in automatic.stdout
    assert "falls back to the slower torch path" in automatic.stderr


def test_failed_build_reports_the_compiler_output(tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'broken-cc: internal error 42' >&2\nexit 1\n")
    broken.chmod(0o755)
    result = _run_in_fresh_process(tmp_path, str(broken), "cpu")
    assert result.returncode != 0
    assert "building or loading the cpu depth-attention kernel failed" in result.stderr
    assert "internal error 42" in result.stderr
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build must not leave a library behind"


@pytest.mark.slow
def test_library_is_cached_per_element_type(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_build.CACHE_ENV_VAR, str(tmp_path))
    cpu_build._library.cache_clear()
    try:
        cpu_build.cpu_library(torch.float32)
        cpu_build.cpu_library(torch.float64)
        built = sorted(path.name for path in tmp_path.iterdir())
        assert (
            len(built) == 2
            and built[0].startswith("depth_attention_double_")
            and built[1].startswith("depth_attention_float_")
        )
        cpu_build._library.cache_clear()
        cpu_build.cpu_library(torch.float32)  # a second process finds the built file instead of compiling
        assert sorted(path.name for path in tmp_path.iterdir()) == built
    finally:
        cpu_build._library.cache_clear()


@pytest.mark.slow
def test_an_edit_to_any_kernel_source_rebuilds_the_library(tmp_path, monkeypatch):
    """The C files compile into one library whose cache key covers every one of them and their shared header: an
    edit to any file builds a new library (a stale cached one would run the old code), unchanged files load the
    cached one, and the library runs the edited code. Unoptimised builds of copies of the sources, for speed."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    for path in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        (folder / path.name).write_text(path.read_text())
    sources = tuple(folder / path.name for path in cpu_build.SOURCES)
    monkeypatch.setattr(cpu_build, "SOURCES", sources)
    monkeypatch.setattr(cpu_build, "HEADERS", tuple(folder / path.name for path in cpu_build.HEADERS))
    monkeypatch.setattr(cpu_build, "_BASE_FLAGS", [*(flag for flag in cpu_build._BASE_FLAGS if flag != "-O3"), "-O0"])
    monkeypatch.setattr(cpu_build, "ARCH_FLAGS", ([],))
    monkeypatch.setattr(cpu_build, "THREAD_FLAGS", ([],))
    cache = tmp_path / "cache"
    monkeypatch.setenv(cpu_build.CACHE_ENV_VAR, str(cache))
    assert len(sources) > 1 and cpu_build.HEADERS  # several files: the point of the test
    cpu_build._build_library("float")
    built = set(cache.glob("*.so"))
    cpu_build._build_library("float")
    assert set(cache.glob("*.so")) == built and len(built) == 1  # nothing changed: the cached library
    for path in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        path.write_text(path.read_text() + "\n/* edited */\n")
        cpu_build._build_library("float")
        now = set(cache.glob("*.so"))
        assert len(now - built) == 1, f"an edit to {path.name} did not rebuild the library"
        built = now
    shipped = "int vector_sums(void) { return VECTOR_SUMS; }"
    (build_source,) = (path for path in sources if shipped in path.read_text())
    build_source.write_text(build_source.read_text().replace(shipped, "int vector_sums(void) { return 7; }"))
    assert cpu_build._build_library("float").vector_sums() == 7  # the edited code is what runs


def test_damaged_cached_library_is_rebuilt(tmp_path):
    # fresh interpreters: dlopen hands a process the library it already loaded from a path, whatever the file holds
    first = _run_in_fresh_process(tmp_path, os.environ.get("CC") or "cc", "cpu")
    assert first.returncode == 0, first.stderr
    (built,) = (tmp_path / "cache").glob("depth_attention_float_*.so")
    assert built.stat().st_mode & 0o044 == 0o044, "a shared cache needs libraries its other users can read"
    built.write_bytes(b"not a shared library")  # e.g. truncated by a full disk
    second = _run_in_fresh_process(tmp_path, os.environ.get("CC") or "cc", "cpu")
    assert second.returncode == 0, second.stderr
    assert "ok 6.0" in second.stdout and built.stat().st_size > 1000


def _gradients(backend, sources, query, gain, grad_output):
    leaves = [t.detach().clone().requires_grad_() for t in (*sources, query, gain)]
    h = depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend=backend)
    (h * grad_output).sum().backward()
    return [h.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("d_model", [32, 64, 128, 256, 96])  # the C file's compile-time widths, and one that is not
@pytest.mark.parametrize("n_sources", [5, 34])  # by-token and tiled backward (tiles from 9 sources)
def test_every_specialised_width_matches_reference(d_model, n_sources):
    sources, query, gain = make_inputs(n_sources, (19,), d_model, torch.float64, seed=21)
    grad_output = torch.randn(19, d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(22))
    for fused, expected in zip(
        _gradients("cpu", sources, query, gain, grad_output), _gradients("reference", sources, query, gain, grad_output)
    ):
        torch.testing.assert_close(fused, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n_sources", [8, 9, 40])  # either side of the switch to the tiled backward
@pytest.mark.parametrize("n_tokens", [1, 15, 37])  # under, within and across TILE = 16 token rows
def test_many_sources_backward_matches_reference(n_sources, n_tokens):
    sources, query, gain = make_inputs(n_sources, (n_tokens,), 24, torch.float64, seed=13)
    grad_output = torch.randn(n_tokens, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    for fused, expected in zip(
        _gradients("cpu", sources, query, gain, grad_output), _gradients("reference", sources, query, gain, grad_output)
    ):
        torch.testing.assert_close(fused, expected, rtol=1e-10, atol=1e-10)


def test_many_sources_threaded_split_matches_one_thread(many_threads):
    sources, query, gain = make_inputs(40, (50,), 24, seed=15)
    threaded = forward_backward(sources, query, gain)
    torch.set_num_threads(1)
    single = forward_backward(sources, query, gain)
    torch.testing.assert_close(threaded[0], single[0], rtol=0, atol=0)
    for a, b in zip(threaded[2][:-2], single[2][:-2]):  # source gradients: rows are independent
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------- KV token shift
def _shift_oracle(x: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """c1 x_t + c2 x_{t-1} in float64, from its definition (x_{-1} = 0)."""
    x, c = x.double(), pair.double()
    previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    return c[:, 0, None] * x + c[:, 1, None] * previous


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 5, 3, 7), (3, 17, 2, 16), (1, 33, 5, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kv_shift_kernel_matches_its_definition_and_gradients(shape, dtype):
    _check_kv_shift(shape, dtype, rotary=None, seed=sum(shape))


def _check_kv_shift(shape, dtype, rotary, seed: int) -> None:
    """`kv_shift_cpu` (with `rotary` tables or None) against the float64 definitions: the shifted K (rotated where
    tables are given) and V, and the gradients of k, v and the coefficients; outputs NaN-poisoned: all must be
    written."""
    generator = torch.Generator().manual_seed(seed)
    k, v, grad_k, grad_v = (torch.randn(*shape, generator=generator).to(dtype) for _ in range(4))
    k.requires_grad_(), v.requires_grad_()
    coefficients = torch.randn(shape[2], 4, generator=generator).to(dtype).requires_grad_()
    shifted_k, shifted_v = cpu_elementwise.kv_shift_cpu(k, v, coefficients, rotary)
    ((shifted_k * grad_k).sum() + (shifted_v * grad_v).sum()).backward()
    k64, v64, c64 = (t.detach().double().requires_grad_() for t in (k, v, coefficients))
    expected_k, expected_v = _shift_oracle(k64, c64[:, :2]), _shift_oracle(v64, c64[:, 2:])
    if rotary is not None:
        expected_k = _rotary_oracle(expected_k, *rotary)
    ((expected_k * grad_k.double()).sum() + (expected_v * grad_v.double()).sum()).backward()
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    pairs = (
        (shifted_k, expected_k),
        (shifted_v, expected_v),
        (k.grad, k64.grad),
        (v.grad, v64.grad),
        (coefficients.grad, c64.grad),
    )
    for got, want in pairs:
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.detach(), **tolerance)


def _rotary_oracle(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64 from its definition: each pair (x_d, x_{d+half}) turned by position t's angle."""
    half, n_pos = x.shape[-1] // 2, x.shape[1]
    c, s = cos[:n_pos, None, :half].double(), sin[:n_pos, None, :half].double()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * c - second * s, second * c + first * s], dim=-1)


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 8), (3, 17, 2, 16), (1, 33, 5, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kv_shift_kernel_rotates_k_in_the_same_pass(shape, dtype):
    """With rotary tables, K comes out shifted and then rotated (V only shifted), outputs and the gradients of k, v
    and the coefficients as the float64 composition of the two definitions; the tables hold more positions than
    the input (strided rows)."""
    from attnres_lens.components import rotary_tables

    _check_kv_shift(shape, dtype, rotary_tables(shape[1] + 7, shape[-1], 10000.0), seed=sum(shape) + 1)


def test_kv_shift_with_rotary_passes_gradcheck_and_equals_the_two_kernels_in_turn():
    from attnres_lens.components import rotary_tables

    generator = torch.Generator().manual_seed(6)
    k, v = (torch.randn(2, 6, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(2))
    coefficients = torch.randn(3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    cos, sin = rotary_tables(8, 4, 10000.0)
    assert torch.autograd.gradcheck(lambda *x: cpu_elementwise.kv_shift_cpu(*x, (cos, sin)), (k, v, coefficients))
    shifted_k, shifted_v = cpu_elementwise.kv_shift_cpu(k, v, coefficients)
    fused_k, fused_v = cpu_elementwise.kv_shift_cpu(k, v, coefficients, (cos, sin))
    torch.testing.assert_close(fused_k, cpu_elementwise.rotary_cpu(shifted_k, cos, sin), rtol=1e-14, atol=1e-14)
    assert torch.equal(fused_v, shifted_v)
    with pytest.raises(ValueError, match="kv_shift_cpu's rotary embedding needs an even last dim"):
        cpu_elementwise.kv_shift_cpu(k[..., :3], v[..., :3], coefficients, (cos[:, :3], sin[:, :3]))
    with pytest.raises(ValueError, match=r"n_ctx >= 6, 4\] tables, got \(5, 4\)"):
        cpu_elementwise.kv_shift_cpu(k, v, coefficients, (cos[:5], sin[:5]))


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 8), (3, 17, 2, 16)])  # 1 row: fewer rows than threads
def test_elementwise_kernels_split_rows_over_threads(many_threads, shape):
    """KV shift (without and with K's rotary), rotary and RMSNorm at 4 threads (the OpenMP build; the pthread build
    keeps one): every output and input gradient bitwise as at one thread (rows are independent), the parameters'
    gradients (sums over rows, per thread and then in thread order) equal to float rounding, and the KV shift's
    against its float64 definition."""
    from attnres_lens.components import rotary_tables

    generator = torch.Generator().manual_seed(sum(shape))
    k, v, grad_k, grad_v = (torch.randn(*shape, generator=generator) for _ in range(4))
    coefficients = torch.randn(shape[2], 4, generator=generator)
    cos, sin = rotary_tables(shape[1], shape[-1], 10000.0)
    rows, gain = torch.randn(7, shape[-1], generator=generator), torch.randn(shape[-1], generator=generator)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (k, v, coefficients, rows, gain)]
        shifted_k, shifted_v = cpu_elementwise.kv_shift_cpu(*leaves[:3])
        rotated = cpu_elementwise.rotary_cpu(leaves[0], cos, sin)
        normed = cpu_elementwise.rms_norm_cpu(leaves[3], leaves[4], 1e-5)
        shifted_rotated_k, _ = cpu_elementwise.kv_shift_cpu(*leaves[:3], (cos, sin))
        outputs = [shifted_k, shifted_v, rotated, normed, shifted_rotated_k]
        torch.autograd.backward(outputs, [grad_k, grad_v, grad_v, torch.ones_like(normed), grad_v])
        return [*(output.detach() for output in outputs), *(leaf.grad for leaf in leaves)]

    threaded = run()
    torch.set_num_threads(1)
    single = run()
    for index, (got, want) in enumerate(zip(threaded, single)):
        if index in (7, 9):  # the KV pairs' and the gain's gradients: sums over rows
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, want), index
    c64 = coefficients.double().requires_grad_()
    (
        (_shift_oracle(k.double(), c64[:, :2]) * grad_k.double()).sum()
        + (_shift_oracle(v.double(), c64[:, 2:]) * grad_v.double()).sum()
        + (_rotary_oracle(_shift_oracle(k.double(), c64[:, :2]), cos, sin) * grad_v.double()).sum()
    ).backward()
    torch.testing.assert_close(threaded[7].double(), c64.grad, rtol=2e-5, atol=2e-5)


def test_kv_shift_kernel_passes_gradcheck_and_agrees_with_the_torch_twin():
    from attnres_lens.kernels import TokenShiftMix

    generator = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 6, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(2))
    coefficients = torch.randn(3, 5, dtype=torch.float64, generator=generator, requires_grad=True)[:, 1:]  # a view
    assert torch.autograd.gradcheck(cpu_elementwise.kv_shift_cpu, (k, v, coefficients))
    twin = TokenShiftMix.apply(k, coefficients[:, :2]), TokenShiftMix.apply(v, coefficients[:, 2:])
    strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, not contiguous
    shift = cpu_elementwise.kv_shift_cpu
    for got in (shift(k, v, coefficients), shift(strided, v, coefficients)):
        for a, b in zip(got, twin):
            torch.testing.assert_close(a, b)


def test_kv_shift_kernel_refuses_what_it_cannot_run():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match="4-D fp32/fp64 CPU tensors, got k 3-D"):
        cpu_elementwise.kv_shift_cpu(x[0], x[0], torch.rand(4, 4))
    with pytest.raises(ValueError, match="got v 4-D torch.bfloat16"):
        cpu_elementwise.kv_shift_cpu(x, x.bfloat16(), torch.rand(4, 4))
    with pytest.raises(ValueError, match="k and v must match"):
        cpu_elementwise.kv_shift_cpu(x, x[:, :2], torch.rand(4, 4))
    with pytest.raises(ValueError, match=r"coefficients must be a CPU tensor \[heads, 4\] = \[4, 4\], got \[4, 2\]"):
        cpu_elementwise.kv_shift_cpu(x, x, torch.rand(4, 2))
    with pytest.raises(ValueError, match="got \\[4, 4\\] on meta"):
        cpu_elementwise.kv_shift_cpu(x, x, torch.rand(4, 4, device="meta"))
    k = x.clone().requires_grad_()
    (shifted, _) = cpu_elementwise.kv_shift_cpu(k, x, torch.rand(4, 4))
    (grad,) = torch.autograd.grad(shifted.square().sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        grad.sum().backward()  # no second derivative through the C backward, rather than a silent zero


def _attention_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention in float64 from its definition, [B, P, H, Dh] in and out."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n_pos = q.shape[1]
    scores = scores.masked_fill(torch.ones(n_pos, n_pos, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


ATTENTION_SHAPES = [
    (1, 1, 1, 16),
    (2, 7, 3, 24),
    (3, 17, 2, 8),
    (2, 33, 4, 16),
    (2, 65, 2, 40),
    (1, 50, 1, 2),
    (2, 20, 2, 17),
]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_causal_attention_kernel_matches_float64(shape, dtype):
    # token counts on both sides of the 16- and 32-key chunks, head widths past the last 16 columns; outputs
    # NaN-poisoned, so every element must be written
    generator = torch.Generator().manual_seed(sum(shape))
    q, k, v = (torch.randn(*shape, generator=generator).mul(2).to(dtype) for _ in range(3))
    scale = shape[-1] ** -0.5
    got = cpu_attention.causal_attention_cpu(q, k, v, scale)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: the scores' rounding, amplified by the softmax (values up to ~6 here)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), _attention_oracle(q, k, v, scale), **tolerance)


def test_causal_attention_kernel_splits_heads_over_threads_bitwise(many_threads):
    q, k, v = (torch.randn(3, 40, 5, 16, generator=torch.Generator().manual_seed(seed)) for seed in range(3))
    threaded = cpu_attention.causal_attention_cpu(q, k, v, 0.25)  # 15 (batch, head) pairs over 4 threads
    torch.set_num_threads(1)
    assert torch.equal(threaded, cpu_attention.causal_attention_cpu(q, k, v, 0.25))
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not contiguous
    assert torch.equal(cpu_attention.causal_attention_cpu(strided, k, v, 0.25), threaded)


def test_causal_attention_kernel_softmax_survives_large_and_equal_scores():
    # scores 1e3 apart (the softmax is one-hot), and all equal (uniform over the causal prefix)
    q = torch.zeros(1, 9, 1, 8)
    k = torch.zeros(1, 9, 1, 8)
    v = torch.arange(9.0).view(1, 9, 1, 1).expand(1, 9, 1, 8).contiguous()
    uniform = cpu_attention.causal_attention_cpu(q, k, v, 1.0)
    torch.testing.assert_close(uniform[0, :, 0, 0], torch.arange(9.0) / 2)  # mean of 0 … t
    q[..., 0], k[0, 4, 0, 0] = 1.0, 1e3  # key 4 dominates every query that sees it
    peaked = cpu_attention.causal_attention_cpu(q, k, v, 1.0)
    torch.testing.assert_close(peaked[0, 4:, 0, 0], torch.full((5,), 4.0))
    torch.testing.assert_close(peaked[0, :4, 0, 0], torch.arange(4.0) / 2)


def test_causal_attention_kernel_refuses_what_it_cannot_run():
    x = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="4-D fp32/fp64 CPU tensors, got q 3-D"):
        cpu_attention.causal_attention_cpu(x[0], x[0], x[0], 1.0)
    with pytest.raises(ValueError, match="got v 4-D torch.bfloat16"):
        cpu_attention.causal_attention_cpu(x, x, x.bfloat16(), 1.0)
    with pytest.raises(ValueError, match=r"must agree in shape and dtype, got \[2, 3, 4, 8\] torch.float32 and k"):
        cpu_attention.causal_attention_cpu(x, x[:, :2], x, 1.0)
    with pytest.raises(ValueError, match="has no derivative, but q requires a gradient"):
        cpu_attention.causal_attention_cpu(x.clone().requires_grad_(), x, x, 1.0)
    with torch.no_grad():  # no gradient is needed there
        cpu_attention.causal_attention_cpu(x.clone().requires_grad_(), x, x, 1.0)
    assert cpu_attention.causal_attention_cpu(x[:0], x[:0], x[:0], 1.0).shape == (0, 3, 4, 8)  # nothing to attend


def test_the_forward_softmax_matches_float64_across_the_whole_range_of_logits():
    # With a zero query every logit is 0, so the weights are softmax(bias): the kernel's own exp (float build) is
    # checked against float64 over logit gaps from 0 down past float underflow, a -inf bias included.
    gaps = torch.cat([-torch.logspace(-6, 2, 200), torch.tensor([0.0, -87.2, -87.5, float("-inf")])])
    n_tokens, d_model = len(gaps), 64  # 204 tokens: not a multiple of the 16-token tile
    bias = torch.stack([torch.zeros(n_tokens), gaps])
    sources = [torch.randn(n_tokens, d_model) for _ in range(2)]
    _, (_, logits, weights) = cpu_depth._forward_kernel(sources, torch.zeros(d_model), bias, 1e-6)
    assert torch.equal(logits, torch.zeros_like(logits))
    expected = torch.softmax(bias.double(), dim=0)
    # within ~2.5 ulp (exp, the division, the rounding), or below float's normal range
    assert ((weights.double() - expected).abs() <= 3e-7 * expected + 1.2e-38).all()
    assert (weights[1][gaps == float("-inf")] == 0).all()  # a masked source takes no weight at all


def _several_queries_oracle(sources, folded_queries, eps, prior=None):
    """Each query's softmax over the prior part (logit its lse, value its mix) and the sources, in float64."""
    values = torch.stack([source.double() for source in sources], dim=-2)  # [..., S, D]
    rstd = (values.pow(2).mean(-1) + eps).rsqrt()
    logits = torch.einsum("...sd,qd->q...s", values, folded_queries.double()) * rstd  # [Q, ..., S]
    values = values.expand(folded_queries.shape[0], *values.shape)
    if prior is not None:
        logits = torch.cat([prior[1].double()[..., None], logits], dim=-1)
        values = torch.cat([prior[0].double()[..., None, :], values], dim=-2)
    return (logits.softmax(-1)[..., None] * values).sum(-2), logits.logsumexp(-1)


@pytest.mark.parametrize("n_sources, token_shape, d_model", SHAPES)
@pytest.mark.parametrize("n_queries", [1, 3, 9])  # 9 > MAX_QUERIES: split into two kernel calls
@pytest.mark.parametrize("with_prior", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_several_queries_at_once_match_float64(
    many_threads, n_sources, token_shape, d_model, n_queries, with_prior, dtype
):
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype)
    generator = torch.Generator().manual_seed(7)
    folded = (query * gain + 0.5 * torch.randn(n_queries, d_model, generator=generator) / d_model**0.5).to(dtype)
    prior = None
    if with_prior:  # a part over other sources, its lse spread around the sources' logits
        prior = (
            torch.randn(n_queries, *token_shape, d_model, generator=generator).to(dtype),
            (2 * torch.randn(n_queries, *token_shape, generator=generator)).to(dtype),
        )
    mix, lse = cpu_depth.depth_attention_multi_cpu(sources, folded, 1e-6, prior=prior)
    expected_mix, expected_lse = _several_queries_oracle(sources, folded, 1e-6, prior)
    assert mix.shape == (n_queries, *token_shape, d_model) and lse.shape == (n_queries, *token_shape)
    assert_close(mix, expected_mix, dtype)
    assert_close(lse, expected_lse, dtype)


@pytest.mark.parametrize("copies, batch_shape, d_model", [(1, (3, 5), 8), (3, (2, 5), 8), (4, (1, 17), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_prior_for_one_copy_of_a_stacked_batch_serves_every_copy(many_threads, copies, batch_shape, d_model, dtype):
    """Sources that stack `copies` copies of a batch along their first dim take one copy's prior: the same as
    that prior stacked as often, against the float64 oracle."""
    batch, *rest = batch_shape
    sources, query, gain = make_inputs(6, (copies * batch, *rest), d_model, dtype)
    generator = torch.Generator().manual_seed(11)
    folded = torch.stack([query * gain, gain + 0.1 * torch.randn(d_model, generator=generator)]).to(dtype)
    prior = (
        torch.randn(2, batch, *rest, d_model, generator=generator).to(dtype),
        (2 * torch.randn(2, batch, *rest, generator=generator)).to(dtype),
    )
    mix, lse = cpu_depth.depth_attention_multi_cpu(sources, folded, 1e-6, prior=prior)
    stacked = (prior[0].repeat(1, copies, *[1] * len(rest), 1), prior[1].repeat(1, copies, *[1] * len(rest)))
    expected_mix, expected_lse = _several_queries_oracle(sources, folded, 1e-6, stacked)
    assert_close(mix, expected_mix, dtype)
    assert_close(lse, expected_lse, dtype)


def test_kernels_without_a_jvp_refuse_a_forward_mode_tangent_instead_of_dropping_it():
    """Inside a forward-mode AD level (even without grad mode) a tangent on an operand of a C kernel that has no
    jvp raises; before, the multi-query mix and the C attention returned their outputs without it. Operands
    without a tangent there still run, with the values they have outside the level."""
    from attnres_lens.kernels.backends import attention_runs_cpu_kernel

    sources, query, gain = make_inputs(3, (2, 5), 8, torch.float64)
    folded = torch.stack([query * gain, gain])
    x = torch.randn(2, 65, 4, 16, dtype=torch.float64)
    shared, stacked, q, g, bias = _copies_inputs((3, 2, 8, 16, 2, 1), torch.float64)
    plain_mix, plain_lse = cpu_depth.depth_attention_multi_cpu(sources, folded, 1e-6)
    for grad_mode in (False, True):
        with torch.set_grad_enabled(grad_mode), forward_ad.dual_level():
            dual = forward_ad.make_dual(sources[0], torch.ones_like(sources[0]))
            with pytest.raises(NotImplementedError, match="jvp"):
                cpu_depth.depth_attention_multi_cpu([dual, *sources[1:]], folded, 1e-6)
            with pytest.raises(NotImplementedError, match="jvp"):
                cpu_depth.depth_attention_multi_cpu(sources, forward_ad.make_dual(folded, folded), 1e-6)
            mix, lse = cpu_depth.depth_attention_multi_cpu(sources, folded, 1e-6)  # no tangent: as outside
            assert torch.equal(mix, plain_mix) and torch.equal(lse, plain_lse)
            dual_x = forward_ad.make_dual(x, torch.ones_like(x))
            with pytest.raises(ValueError, match="carries a forward-mode tangent"):
                cpu_attention.causal_attention_cpu(x, dual_x, x, 1.0)
            assert not attention_runs_cpu_kernel("cpu", x, x, dual_x)  # the model's attention takes SDPA there
            with pytest.raises(ValueError, match="no backward or forward-mode derivative"):
                cpu_depth.depth_attention_copies_cpu(
                    [forward_ad.make_dual(shared[0], shared[0]), shared[1]], stacked, 3, q, g, 1e-6
                )
            one_copy = (plain_mix[:, :1], plain_lse[:, :1])  # a prior for the first of two stacked copies
            with pytest.raises(ValueError, match="one copy of stacked sources .*forward-mode derivative"):
                cpu_depth.depth_attention_multi_cpu([dual, *sources[1:]], folded, 1e-6, prior=one_copy)


def test_a_prior_that_covers_no_whole_copy_is_refused():
    sources, query, gain = make_inputs(3, (6, 5), 8)
    folded = (query * gain)[None]
    for batch in (4, 12):  # 4 does not divide 6; 12 is more than the sources hold
        with pytest.raises(ValueError, match="prior must be .*divisor"):
            cpu_depth.depth_attention_multi_cpu(
                sources, folded, 1e-6, prior=(torch.zeros(1, batch, 5, 8), torch.zeros(1, batch, 5))
            )
    with pytest.raises(ValueError, match="prior must be"):  # lse of another shape
        cpu_depth.depth_attention_multi_cpu(sources, folded, 1e-6, prior=(torch.zeros(1, 3, 5, 8), torch.zeros(1, 3)))


# (copies, batch, pos, d_model, shared sources, stacked sources): tokens per copy on both sides of a TILE of 16 and
# of a span of 64, widths past the last vector, no stacked source (knockouts where the copies part), one copy
COPY_CASES = [(3, 2, 8, 64, 4, 2), (2, 1, 33, 24, 1, 0), (4, 3, 5, 70, 2, 3), (1, 2, 16, 8, 3, 1), (5, 2, 40, 16, 6, 1)]


def _copies_inputs(case, dtype):
    n_copies, batch, pos, d_model, n_shared, n_stacked = case
    generator = torch.Generator().manual_seed(sum(case))
    shared = [torch.randn(batch, pos, d_model, generator=generator).mul(1 + i).to(dtype) for i in range(n_shared)]
    stacked = [torch.randn(n_copies * batch, pos, d_model, generator=generator).to(dtype) for _ in range(n_stacked)]
    query = torch.randn(d_model, generator=generator).to(dtype)
    gain = torch.rand(d_model, generator=generator).add(0.5).to(dtype)
    n_sources = n_shared + n_stacked
    bias = torch.randn(n_copies * batch, pos, n_sources, generator=generator).to(dtype)
    if n_sources > 1:  # each copy knocks its own source out of some tokens' softmax (never the last one)
        knocked = torch.rand(n_copies * batch, pos, generator=generator) < 0.4
        column = torch.arange(n_copies).repeat_interleave(batch)[:, None].expand(-1, pos) % (n_sources - 1)
        bias.scatter_(-1, column[..., None], torch.where(knocked, float("-inf"), 0.0).to(dtype)[..., None])
    return shared, stacked, query, gain, bias


@pytest.mark.parametrize("case", COPY_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stacked_copies_with_their_own_bias_read_shared_sources_once(many_threads, case, dtype):
    """`depth_attention_copies_cpu` equals the float64 mix of the shared sources repeated for every copy (as the
    stacked batch holds them) followed by the stacked ones, each copy with its own -inf knockouts; outputs are
    NaN-poisoned, so every row of every copy is written; at 4 threads and at 1 the same bits; where a copy's tokens
    fill whole tiles, the same bits as the one-pass C mix of the stacked batch."""
    n_copies = case[0]
    shared, stacked, query, gain, bias = _copies_inputs(case, dtype)
    with torch.no_grad():
        got = cpu_depth.depth_attention_copies_cpu(shared, stacked, n_copies, query, gain, 1e-6, bias)
        repeated = [source.repeat(n_copies, 1, 1) for source in shared] + stacked
        want = depth_attention(
            [source.double() for source in repeated],
            query.double(),
            gain.double(),
            1e-6,
            backend="reference",
            logit_bias=bias.double(),
        )
        assert got.dtype == dtype and got.shape == repeated[0].shape
        assert_close(got, want, dtype)
        torch.set_num_threads(1)
        assert torch.equal(
            got, cpu_depth.depth_attention_copies_cpu(shared, stacked, n_copies, query, gain, 1e-6, bias)
        )
        if shared[0][..., 0].numel() % 16 == 0:
            assert torch.equal(got, depth_attention(repeated, query, gain, 1e-6, backend="cpu", logit_bias=bias))
        unbiased = cpu_depth.depth_attention_copies_cpu(shared, stacked, n_copies, query, gain, 1e-6)
        assert_close(
            unbiased,
            depth_attention(
                [source.double() for source in repeated], query.double(), gain.double(), 1e-6, backend="reference"
            ),
            dtype,
        )
        # the consumer's pre-norm fused: RMSNorm(h) * w of the float64 mix; a half-precision bias converted
        weight = torch.linspace(0.5, 1.5, query.shape[0]).to(dtype)
        h, y = cpu_depth.depth_attention_copies_cpu(
            shared, stacked, n_copies, query, gain, 1e-6, bias.to(torch.bfloat16), norm=(weight, 1e-5)
        )
        want = depth_attention(
            [source.double() for source in repeated],
            query.double(),
            gain.double(),
            1e-6,
            backend="reference",
            logit_bias=bias.to(torch.bfloat16).double(),
        )
        assert_close(h, want, dtype)
        assert_close(y, want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double(), dtype)


def test_stacked_copies_refuse_what_they_cannot_mix():
    shared, stacked, query, gain, bias = _copies_inputs((3, 2, 8, 16, 2, 1), torch.float32)
    run = cpu_depth.depth_attention_copies_cpu
    with pytest.raises(ValueError, match="at least one shared source"):
        run([], stacked, 3, query, gain, 1e-6)
    with pytest.raises(ValueError, match="n_copies must be a positive integer, got 0"):
        run(shared, stacked, 0, query, gain, 1e-6)
    with pytest.raises(ValueError, match=r"stacked ones \[8, 8, 16\] \(4 copies\)"):
        run(shared, stacked, 4, query, gain, 1e-6)  # the stacked sources hold 3 copies
    with pytest.raises(ValueError, match=r"logit_bias must have shape \[6, 8, 3\]"):
        run(shared, stacked, 3, query, gain, 1e-6, bias[..., :2])
    with pytest.raises(ValueError, match="fp32/fp64 CPU sources, got torch.bfloat16"):
        run([shared[0].bfloat16(), shared[1]], stacked, 3, query, gain, 1e-6)
    with pytest.raises(ValueError, match="no backward or forward-mode derivative.*no_grad"):
        run(shared, stacked, 3, query.clone().requires_grad_(), gain, 1e-6)
    with pytest.raises(ValueError, match=r"query must have shape \[16\]"):  # the C kernel would read past it
        run(shared, stacked, 3, query[:3], gain, 1e-6)
    with pytest.raises(ValueError, match=r"norm weight must have shape \[16\]"):
        run(shared, stacked, 3, query, gain, 1e-6, norm=(gain[None], 1e-5))
    with pytest.raises(ValueError, match="logit_bias must be floating point"):
        run(shared, stacked, 3, query, gain, 1e-6, torch.zeros(6, 8, 3, dtype=torch.long))


@pytest.mark.parametrize("n_sources, token_shape, d_model", SHAPES)
@pytest.mark.parametrize("n_queries", [1, 4, 9])  # 4: the unrolled gradient rows' widest; 9: two kernel calls
@pytest.mark.parametrize("with_prior", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_several_queries_backward_matches_float64(
    many_threads, n_sources, token_shape, d_model, n_queries, with_prior, dtype
):
    """The two-phase kernel's C backward: the gradients of the sources, the folded queries and the prior against
    float64 autograd through the oracle, with one query's mix and another's log-sum-exp unused (no gradient to
    give: their terms must vanish, not read garbage). Outputs and gradient buffers start NaN-poisoned."""
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype)
    generator = torch.Generator().manual_seed(7)
    folded = (query * gain + 0.5 * torch.randn(n_queries, d_model, generator=generator) / d_model**0.5).to(dtype)
    prior = None
    if with_prior:
        prior = (
            torch.randn(n_queries, *token_shape, d_model, generator=generator).to(dtype),
            (2 * torch.randn(n_queries, *token_shape, generator=generator)).to(dtype),
        )
    mix_weights = torch.randn(n_queries, *token_shape, d_model, generator=generator, dtype=torch.float64)
    lse_weights = torch.randn(n_queries, *token_shape, generator=generator, dtype=torch.float64)
    unused_mix, unused_lse = (n_queries // 2, n_queries - 1) if n_queries > 1 else (None, None)

    def loss(mix, lse):
        return sum((mix[q].double() * mix_weights[q]).sum() for q in range(n_queries) if q != unused_mix) + sum(
            (lse[q].double() * lse_weights[q]).sum() for q in range(n_queries) if q != unused_lse
        )

    leaves = [t.detach().clone().requires_grad_() for t in (*sources, folded, *(prior or ()))]
    n_prior = len(prior or ())
    mix, lse = cpu_depth.depth_attention_multi_cpu(
        leaves[:n_sources], leaves[n_sources], 1e-6, prior=tuple(leaves[n_sources + 1 :]) or None
    )
    assert isinstance(mix, tuple) and len(mix) == n_queries and mix[0].shape == (*token_shape, d_model)
    got = torch.autograd.grad(loss(mix, lse), leaves, allow_unused=True)
    oracle_leaves = [t.detach().double().requires_grad_() for t in leaves]
    expected_prior = tuple(oracle_leaves[n_sources + 1 :]) if n_prior else None
    want = torch.autograd.grad(
        loss(*_several_queries_oracle(oracle_leaves[:n_sources], oracle_leaves[n_sources], 1e-6, expected_prior)),
        oracle_leaves,
    )
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None, f"leaf {i} got no gradient"
        assert_close(a, b, dtype, scale=10)


def test_several_queries_sum_a_shared_source_gradient_in_place(many_threads):
    """Sources seen through `share_gradient`: the two-phase backward adds into the one-pass consumers' buffers
    (the first part written, the others added), and the leaves' gradients equal those of plain sources."""
    sources, query, gain = make_inputs(6, (37,), 24, torch.float64)
    folded = torch.stack([query * gain, gain, -query]).double()

    def loss(views, pool):
        mix, lse = cpu_depth.depth_attention_multi_cpu(views, folded, 1e-6)
        merged, _ = cpu_depth.depth_attention_multi_cpu(
            views[4:], folded[1:2], 1e-6, prior=(mix[1][None], lse[1][None])
        )
        one_pass = depth_attention(views, query, gain, backend="cpu")
        return (
            (mix[0] * pool[0]).sum()
            + (merged[0] * pool[1]).sum()
            + (lse[2] * pool[2]).sum()
            + (one_pass * pool[3]).sum()
        )

    generator = torch.Generator().manual_seed(3)
    pool = [torch.randn(37, 24, generator=generator, dtype=torch.float64) for _ in range(2)] + [
        torch.randn(37, generator=generator, dtype=torch.float64),
        torch.randn(37, 24, generator=generator, dtype=torch.float64),
    ]
    leaves = [s.requires_grad_() for s in sources]
    got = torch.autograd.grad(loss([cpu_autograd.share_gradient(leaf) for leaf in leaves], pool), leaves)
    want = torch.autograd.grad(loss(leaves, pool), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_several_queries_with_a_gradient_give_tensors_a_consumer_may_edit_in_place():
    """Each query's mix is a tensor of its own (not a view of a shared block) and the backward does not read it:
    an in-place edit of one, as a TransformerLens hook does to a sublayer's input, leaves the gradients right."""
    sources, query, gain = make_inputs(4, (9,), 16, torch.float64)
    leaves = [t.requires_grad_() for t in sources]
    folded = torch.stack([query * gain, gain]).double()
    mix, _ = cpu_depth.depth_attention_multi_cpu(leaves, folded, 1e-6)
    mix[1][:, 0] = 0.0
    got = torch.autograd.grad((mix[0] * 2 + mix[1]).sum(), leaves)
    oracle_leaves = [t.detach().requires_grad_() for t in leaves]
    expected_mix, _ = _several_queries_oracle(oracle_leaves, folded, 1e-6)
    edited = expected_mix[1].clone()
    edited[:, 0] = 0.0
    want = torch.autograd.grad((expected_mix[0] * 2 + edited).sum(), oracle_leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_several_queries_refuse_a_gradient_through_a_prior_for_one_copy():
    sources, query, gain = make_inputs(3, (6, 5), 8)
    prior = (torch.zeros(1, 3, 5, 8), torch.zeros(1, 3, 5))  # one copy of 3 rows for sources of 6
    sources[1].requires_grad_()
    with pytest.raises(ValueError, match="one copy of stacked sources .*no backward"):
        cpu_depth.depth_attention_multi_cpu(sources, (query * gain)[None], 1e-6, prior=prior)
    with torch.no_grad():
        cpu_depth.depth_attention_multi_cpu(sources, (query * gain)[None], 1e-6, prior=prior)


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 5, 3, 8), (3, 17, 2, 16), (1, 33, 5, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_kernel_matches_its_twin_and_gradients(shape, dtype):
    from attnres_lens.components import rotary_tables
    from attnres_lens.kernels import apply_rotary

    cos, sin = rotary_tables(40, shape[-1], 10000.0)  # more positions than the input has: rows are strided reads
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()
    n_pos = shape[1]
    expected = apply_rotary(x, cos[:n_pos, None].double(), sin[:n_pos, None].double())
    got = cpu_elementwise.rotary_cpu(x.detach().to(dtype).requires_grad_(), cos, sin)  # output NaN-poisoned
    assert_close(got, expected, dtype)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    leaf = x.detach().to(dtype).requires_grad_()
    (got_grad,) = torch.autograd.grad(cpu_elementwise.rotary_cpu(leaf, cos, sin), leaf, grad.to(dtype))
    assert_close(got_grad, expected_grad, dtype)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda t: cpu_elementwise.rotary_cpu(t, cos, sin), (x,))


def test_rotary_kernel_refuses_what_it_cannot_run():
    cos, sin = torch.ones(8, 4), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="even last dim"):
        cpu_elementwise.rotary_cpu(torch.zeros(1, 2, 1, 3), torch.ones(8, 3), torch.zeros(8, 3))
    with pytest.raises(ValueError, match="4-D fp32/fp64"):
        cpu_elementwise.rotary_cpu(torch.zeros(2, 1, 4).bfloat16(), cos, sin)
    with pytest.raises(ValueError, match=r"n_ctx >= 9"):
        cpu_elementwise.rotary_cpu(torch.zeros(1, 9, 1, 4), cos, sin)
    with pytest.raises(ValueError, match="must not require grad"):
        cpu_elementwise.rotary_cpu(torch.zeros(1, 2, 1, 4), cos.requires_grad_(), sin)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 33), (2, 17, 64), (5, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_kernel_matches_float64_and_gradients(shape, dtype):
    generator = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(shape, generator=generator, dtype=torch.float64)).requires_grad_()
    w = (1 + 0.3 * torch.randn(shape[-1], generator=generator, dtype=torch.float64)).requires_grad_()
    expected = x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w  # the definition, float64
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w)]
    got = cpu_elementwise.rms_norm_cpu(*leaves, 1e-5)  # outputs NaN-poisoned
    assert_close(got, expected, dtype)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64)
    for got_grad, expected_grad in zip(
        torch.autograd.grad(got, leaves, grad.to(dtype)), torch.autograd.grad(expected, (x, w), grad)
    ):
        assert_close(got_grad, expected_grad, dtype, scale=10)  # dw sums over rows
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda a, b: cpu_elementwise.rms_norm_cpu(a, b, 1e-5), (x, w))


def test_rms_norm_kernel_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="fp32/fp64 CPU tensor"):
        cpu_elementwise.rms_norm_cpu(torch.zeros(2, 4).bfloat16(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match=r"gain must be \[4\]"):
        cpu_elementwise.rms_norm_cpu(torch.zeros(2, 4), torch.ones(5), 1e-5)
    with pytest.raises(ValueError, match="gain must be"):
        cpu_elementwise.rms_norm_cpu(torch.zeros(2, 4), torch.ones(4, dtype=torch.float64), 1e-5)


def test_two_phase_on_the_cpu_folds_low_precision_queries_in_fp32():
    """A bf16 model's pseudo-queries and gains are folded (u = w * g) in fp32, as the single-pass kernel does:
    folding them in bf16 first put the logits 0.1 off."""
    from attnres_lens.kernels import block_phase1, merge_partial

    sources, query, gain = make_inputs(6, (4, 9), 64)
    queries = torch.stack([query, -query, 2 * query]).bfloat16()
    gains = torch.stack([gain, gain.flip(0), gain]).bfloat16()
    with torch.no_grad():
        fused = block_phase1(sources[:5], queries, gains, backend="cpu")
        readable = block_phase1(sources[:5], queries, gains, backend="torch")
        assert fused.backend == "cpu" and readable.backend == "torch"
        torch.testing.assert_close(fused.mix, readable.mix, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            merge_partial(fused, 1, [sources[5]]), merge_partial(readable, 1, [sources[5]]), rtol=1e-5, atol=1e-5
        )


def test_a_kv_shift_model_rotates_k_in_the_shift_unless_a_hook_reads_the_shifted_k(monkeypatch):
    """With RoPE, a KV-shift layer on the cpu backend rotates K inside the shift's C pass (rotary_cpu then runs for
    Q alone); a hook on hook_k_shifted brings back the separate passes, so that it sees K̂ unrotated; both give the
    same loss and gradients (GQA: 2 query heads per key head), and the cache's K̂ and rotated K are the float64
    definitions applied to its K."""
    from attnres_lens import HookedTransformer, ModelConfig

    calls = []
    monkeypatch.setattr(
        "attnres_lens.kernels.layer_ops.rotary_cpu", lambda *args: calls.append(1) or cpu_elementwise.rotary_cpu(*args)
    )
    cfg = ModelConfig(
        d_model=16,
        n_heads=4,
        n_key_value_heads=2,
        n_layers=2,
        d_vocab=32,
        n_ctx=9,
        attention="kv_shift",
        depth_attention_backend="cpu",
        dtype=torch.float64,
        seed=2,
    )
    model = HookedTransformer(cfg)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.kv_shift.normal_(generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for hooks in ([], [(f"blocks.{layer}.attn.hook_k_shifted", lambda x, hook: x) for layer in range(2)]):
        model.zero_grad()
        calls.clear()
        loss = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=hooks)
        loss.backward()
        assert len(calls) == (4 if hooks else 2)  # q and k of each layer, or q alone
        results.append([loss.detach(), *(parameter.grad.clone() for parameter in model.parameters())])
    for fused, separate in zip(*results):
        torch.testing.assert_close(fused, separate, rtol=1e-12, atol=1e-14)
    _, cache = model.run_with_cache(tokens)
    for layer, block in enumerate(model.blocks):
        name = f"blocks.{layer}.attn."
        shift = block.attn.kv_shift.detach()
        shifted = _shift_oracle(cache[name + "hook_k"], shift[:, :2])
        torch.testing.assert_close(cache[name + "hook_k_shifted"], shifted, rtol=1e-12, atol=1e-14)
        rotated = _rotary_oracle(shifted, block.attn.rotary_cos, block.attn.rotary_sin)
        torch.testing.assert_close(cache[name + "hook_rot_k"], rotated, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_sources,shape", [(3, (2, 5, 8)), (1, (4, 6)), (40, (3, 7, 16))])  # 40: the tiled backward
def test_the_mix_with_its_pre_norm_fused_matches_the_mix_then_the_norm(dtype, n_sources, shape):
    """`depth_attention_normed_cpu` against the readable mix followed by PyTorch's RMSNorm, for y alone, for y and
    h together (h's gradient added to the norm's) and for h alone (the gain gets none)."""
    generator = torch.Generator().manual_seed(n_sources)
    d_model = shape[-1]
    sources = [torch.randn(*shape, generator=generator, dtype=dtype, requires_grad=True) for _ in range(n_sources)]
    query, gain, norm_weight = (
        torch.randn(d_model, generator=generator, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    leaves = [*sources, query, gain, norm_weight]
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for use_y, use_h in ((True, False), (True, True), (False, True)):
        h, y = cpu_depth.depth_attention_normed_cpu(sources, query, gain, 1e-6, norm_weight, 1e-5)
        want_h = depth_attention(sources, query, gain, 1e-6, backend="reference")
        want_y = torch.nn.functional.rms_norm(want_h, (d_model,), norm_weight, 1e-5)
        torch.testing.assert_close(h, want_h, **tolerance)
        torch.testing.assert_close(y, want_y, **tolerance)
        probe_h, probe_y = torch.randn_like(h), torch.randn_like(y)

        def loss(h, y):
            return (y * probe_y).sum() * use_y + (h * probe_h).sum() * use_h

        got = torch.autograd.grad(loss(h, y), leaves, allow_unused=True)
        want = torch.autograd.grad(loss(want_h, want_y), leaves, allow_unused=True)
        for name, a, b in zip([f"source {i}" for i in range(n_sources)] + ["query", "gain", "norm_weight"], got, want):
            if b is None or not use_y and name == "norm_weight":
                assert a is None or not a.any(), name
            else:
                torch.testing.assert_close(a, b, **tolerance, msg=name)
    if dtype == torch.float64 and n_sources < 10:

        def fused(*tensors):
            return cpu_depth.depth_attention_normed_cpu(
                list(tensors[:n_sources]), *tensors[n_sources : n_sources + 2], 1e-6, tensors[-1], 1e-5
            )

        assert torch.autograd.gradcheck(fused, tuple(leaves))


def test_the_fused_pre_norm_writes_every_output(many_threads):
    """With outputs NaN-poisoned before the kernel writes them (this file's fixture), none stays NaN: an odd token
    count, 33 sources (the tiled backward), split over threads."""
    sources = [torch.randn(37, 24, requires_grad=True) for _ in range(33)]
    query, gain, norm_weight = (torch.randn(24, requires_grad=True) for _ in range(3))
    h, y = cpu_depth.depth_attention_normed_cpu(sources, query, gain, 1e-6, norm_weight, 1e-5)
    assert torch.isfinite(h).all() and torch.isfinite(y).all()
    grads = torch.autograd.grad(y.square().sum() + h.sum(), [*sources, query, gain, norm_weight])
    assert all(torch.isfinite(grad).all() for grad in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_sources", [3, 10, 33])  # 10, 33: the tiled backward, its remix by groups and a tail
@pytest.mark.parametrize("width", [24, 64, 70])  # 64: a backward compiled for that width; 70: vector tails
def test_a_fused_mix_that_leaves_h_out_gives_the_same_y_and_gradients(many_threads, dtype, n_sources, width):
    """Without keep_h the fused mix writes no h and its backward mixes each row again (the same mix_row, the same
    weights, row by row or a tile by source groups): y and every gradient equal the kept-h call's bit for bit,
    split over threads, and the fp64 call passes gradcheck."""
    generator = torch.Generator().manual_seed(n_sources)
    sources = [torch.randn(2, 19, width, dtype=dtype, generator=generator) for _ in range(n_sources)]
    parameters = [torch.randn(width, dtype=dtype, generator=generator) for _ in range(3)]
    grad_y = torch.randn(2, 19, width, dtype=dtype, generator=generator)

    def run(keep_h: bool):
        leaves = [t.clone().requires_grad_() for t in (*sources, *parameters)]
        h, y = cpu_depth.fused_mix_and_norm(leaves[:-3], leaves[-3], leaves[-2], 1e-6, leaves[-1], 1e-5, keep_h)
        y.backward(grad_y)
        return h, y.detach(), [leaf.grad for leaf in leaves]

    h_kept, y_kept, grads_kept = run(True)
    h_left, y_left, grads_left = run(False)
    assert h_kept is not None and h_left is None
    assert torch.equal(y_left, y_kept)
    for left, kept in zip(grads_left, grads_kept, strict=True):
        assert torch.equal(left, kept)
    if dtype == torch.float64 and n_sources == 3 and width == 24:
        leaves = tuple(t.clone().requires_grad_() for t in (*sources, *parameters))
        assert torch.autograd.gradcheck(
            lambda *t: cpu_depth.fused_mix_and_norm(list(t[:-3]), t[-3], t[-2], 1e-6, t[-1], 1e-5, False)[1], leaves
        )
    with pytest.raises(ValueError, match="only a mix with its pre-norm fused can leave h out"):
        cpu_depth._run_forward(sources, parameters[0], None, 1e-6, keep_h=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [24, 128])  # 128: a backward compiled for that width
def test_the_kernel_folds_the_query_as_torch_does(dtype, width):
    """Given the pseudo-query and the gain, the C kernel takes their product itself, forward and backward (the
    eager nodes pass both): every output equals the call given torch's product ``u = w * g`` bit for bit."""
    generator = torch.Generator().manual_seed(width)
    sources = [torch.randn(3, 7, width, dtype=dtype, generator=generator) for _ in range(4)]
    query, gain, norm_weight = (torch.randn(width, dtype=dtype, generator=generator) for _ in range(3))
    grad_y = torch.randn(3, 7, width, dtype=dtype, generator=generator)
    folded = (query * gain).contiguous()
    given = cpu_depth._run_forward(sources, folded, None, 1e-6, norm_weight, 1e-5, True)
    taken = cpu_depth._run_forward(sources, query, None, 1e-6, norm_weight, 1e-5, True, gain)
    for a, b in zip(given, taken, strict=True):
        assert torch.equal(a, b)
    _h, stats, _y, norm_rstd = taken
    norm = (None, norm_weight, norm_rstd, grad_y)
    given = cpu_depth._run_backward(sources, folded, stats, None, None, norm, (query, gain))
    taken = cpu_depth._run_backward(sources, None, stats, None, None, norm, (query, gain))
    for a, b in zip([*given[0], *given[1:]], [*taken[0], *taken[1:]], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(taken[1], taken[2])  # dw = du * g and dg = du * w, not one product twice


@pytest.mark.slow
def test_sums_added_in_place_equal_each_threads_own_sums(many_threads, tmp_path, monkeypatch):
    """Each thread adds its parameter-gradient sums in pages of its own and copies them out once; where those pages
    cannot be had it adds in place, in the caller's [threads, D] block (the build with -DSHARED_THREAD_SUMS takes
    that path every time). Both give the same sums bit for bit: the depth mix's query and fused gain gradients
    (both backward loops), RMSNorm's gain and the KV shift's coefficients, split over threads."""
    shipped = cpu_build.cpu_library(torch.float32)
    if not shipped.thread_pool:
        pytest.skip("this C compiler builds the kernel without OpenMP: one thread, no per-thread sums to place")
    monkeypatch.setenv(cpu_build.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_build, "ARCH_FLAGS", ([*cpu_build.ARCH_FLAGS[0], "-DSHARED_THREAD_SUMS"],))
    in_place = cpu_build._build_library("float")
    generator = torch.Generator().manual_seed(21)
    k, v, grad_kv = (torch.randn(3, 17, 2, 16, generator=generator) for _ in range(3))
    coefficients = torch.randn(2, 4, generator=generator)
    rows, gain = torch.randn(53, 40, generator=generator), torch.randn(40, generator=generator)
    cases = [[torch.randn(45, 40, generator=generator) for _ in range(n_sources)] for n_sources in (3, 33)]
    parameters = [torch.randn(40, generator=generator) for _ in range(3)]

    def gradients() -> list[torch.Tensor]:
        found = []
        for sources in cases:
            leaves = [t.clone().requires_grad_() for t in (*sources, *parameters)]
            h, y = cpu_depth.depth_attention_normed_cpu(leaves[:-3], leaves[-3], leaves[-2], 1e-6, leaves[-1], 1e-5)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            found += [leaf.grad for leaf in leaves]
        leaves = [t.clone().requires_grad_() for t in (k, v, coefficients, rows, gain)]
        shifted_k, shifted_v = cpu_elementwise.kv_shift_cpu(*leaves[:3])
        normed = cpu_elementwise.rms_norm_cpu(leaves[3], leaves[4], 1e-5)
        torch.autograd.backward([shifted_k, shifted_v, normed], [grad_kv, grad_kv, torch.ones_like(normed)])
        return found + [leaf.grad for leaf in leaves]

    expected = gradients()
    monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype: in_place)
    for got, want in zip(gradients(), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_hook_that_changes_the_width_is_refused_by_the_mix(backend):
    """A hook that widens the stream leaves the mix's query, key-norm gain and pre-norm gain at the old width: the
    fused path (which skips the public function's argument checks) must not run on it, and every backend refuses
    it at the mix with an error naming the mismatch, instead of reading past the parameters."""
    from attnres_lens import HookedTransformer, ModelConfig

    model = HookedTransformer(
        ModelConfig(
            d_model=16,
            n_heads=2,
            n_layers=1,
            d_vocab=32,
            n_ctx=8,
            residual="attnres",
            depth_attention_backend=backend,
            seed=0,
        )
    )
    tokens = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"query must have shape \[32\]"):
        model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", lambda x, hook: torch.cat([x, x], -1))])


def test_the_fused_pre_norm_refuses_what_it_cannot_run():
    sources = [torch.randn(2, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"norm_weight must be \[8\] torch.float32"):
        cpu_depth.depth_attention_normed_cpu(sources, torch.zeros(8), torch.ones(8), 1e-6, torch.ones(8).double(), 1e-5)
    with pytest.raises(ValueError, match="fp32/fp64 CPU tensors, got torch.bfloat16"):
        cpu_depth.depth_attention_normed_cpu(
            [s.bfloat16() for s in sources], torch.zeros(8), torch.ones(8), 1e-6, torch.ones(8), 1e-5
        )


@pytest.mark.parametrize(
    "watch",
    [
        "blocks.0.hook_resid_pre",
        "blocks.0.ln1.hook_normalized",
        "module blocks.0.ln1",
        "module blocks.0.attn_res",
        "module blocks.0.hook_resid_pre",
        "global",
        "ln_final.hook_normalized",
        "module ln_final",
        "module final_res",
    ],
)
def test_a_watched_sublayer_input_or_norm_is_not_fused(watch, monkeypatch):
    """A hook on a sublayer's input or on its norm (TransformerLens hooks, PyTorch hooks on the norm, the depth
    attention or the input's hook point, or a global module hook) sends that sublayer down the unfused path, so
    the hook sees and edits what it did: the output equals a reference-backend model's (never fused) with the
    same hook; with a TransformerLens or module hook the other sublayers stay fused. The final readout and the
    final norm likewise."""
    from attnres_lens import HookedTransformer, ModelConfig

    calls = []
    real = cpu_depth.fused_mix_and_norm
    monkeypatch.setattr(
        "attnres_lens.depth_execution.fused_mix_and_norm", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    models = {}
    for backend in ("cpu", "reference"):
        models[backend] = HookedTransformer(
            ModelConfig(
                d_model=16,
                n_heads=2,
                n_layers=2,
                d_vocab=32,
                n_ctx=8,
                residual="attnres",
                depth_attention_backend=backend,
                seed=0,
            )
        )
        randomize_depth_parameters(models[backend])
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    clean = models["cpu"](tokens)
    assert len(calls) == 5  # four sublayers and the final readout

    def edited(model: HookedTransformer) -> torch.Tensor:
        shift = lambda tensor, hook=None: tensor + 0.5  # noqa: E731
        if watch == "global":  # shifts the first sublayer's input, through its hook point

            def on_input(module, args, output):
                return shift(output) if module is model.blocks[0].hook_resid_pre else output

            handle = torch.nn.modules.module.register_module_forward_hook(on_input)
        elif watch.startswith("module "):
            handle = model.get_submodule(watch.split()[1]).register_forward_hook(lambda m, a, output: shift(output))
        else:
            return model.run_with_hooks(tokens, fwd_hooks=[(watch, shift)])
        try:
            return model(tokens)
        finally:
            handle.remove()

    calls.clear()
    got = edited(models["cpu"])
    assert len(calls) == (0 if watch == "global" else 4)  # the watched consumer ran unfused
    torch.testing.assert_close(got, edited(models["reference"]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, clean, atol=1e-3)


def _shared_gradient_case(dtype: torch.dtype, n_tokens: int = 7, d_model: int = 24, n_sources: int = 5):
    generator = torch.Generator().manual_seed(n_sources)
    leaves = [
        torch.randn(n_tokens, d_model, generator=generator, dtype=dtype, requires_grad=True) for _ in range(n_sources)
    ]
    queries = [torch.randn(d_model, generator=generator, dtype=dtype) for _ in range(3)]
    gain, norm_weight = (torch.randn(d_model, generator=generator, dtype=dtype) for _ in range(2))
    probes = [torch.randn(n_tokens, d_model, generator=generator, dtype=dtype) for _ in range(4)]

    def loss(sources: list[torch.Tensor], backend: str = "cpu") -> torch.Tensor:
        """Four consumers of the same sources: the plain C mix, the C mix with its pre-norm (y and h used), one on
        a non-C backend (whose gradient reaches the shared view through autograd), another plain C mix."""
        h0 = depth_attention(sources, queries[0], gain, 1e-6, backend=backend)
        if backend == "cpu":
            h1, y1 = cpu_depth.depth_attention_normed_cpu(sources, queries[1], gain, 1e-6, norm_weight, 1e-5)
        else:
            h1 = depth_attention(sources, queries[1], gain, 1e-6, backend=backend)
            y1 = torch.nn.functional.rms_norm(h1, (d_model,), norm_weight, 1e-5)
        h2 = depth_attention(sources[1:], queries[2], gain, 1e-6, backend="reference")
        h3 = depth_attention(sources[::2], queries[2], gain, 1e-6, backend=backend)
        return sum((tensor * probe).sum() for tensor, probe in zip((h0, y1 + h1, h2, h3), probes))

    return leaves, loss


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_sources", [5, 34])  # 34: the mixes of all sources take the tiled backward
def test_consumers_sum_a_shared_source_gradient_in_place(many_threads, dtype, n_sources):
    """Sources seen through `share_gradient`: the C backwards of the consumers that read them add into one buffer
    per source (the first writes it: the buffers start NaN-poisoned) and the node hands the sum on, together with
    the gradient of an unfused consumer. The leaves' gradients equal the readable path's, split over threads."""
    leaves, loss = _shared_gradient_case(dtype, n_sources=n_sources)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    calls = {True: 0, False: 0}
    target = cpu_autograd.SharedGradient.target

    def counted(self, like):
        buffer, accumulate = target(self, like)
        calls[accumulate] += 1
        return buffer, accumulate

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_autograd.SharedGradient, "target", counted)
        got = torch.autograd.grad(loss([cpu_autograd.share_gradient(leaf) for leaf in leaves]), leaves)
    want = torch.autograd.grad(loss(leaves, backend="reference"), leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **tolerance, msg=f"source {i}")
    # three C consumers read n + n + ceil(n / 2) sources: each source's first part is written, the others added
    assert calls == {False: n_sources, True: n_sources + (n_sources + 1) // 2}


def test_a_shared_source_gradient_survives_retained_graphs_and_partial_backwards():
    """A second backward through a retained graph starts its sums afresh, and a backward that ran a consumer but
    stopped short of the shared nodes (a gradient with respect to its query only) leaves the next one correct
    (that its buffers are freed at its end is checked by the next test)."""
    leaves, loss = _shared_gradient_case(torch.float64)
    want = torch.autograd.grad(loss(leaves, backend="reference"), leaves)
    total = loss([cpu_autograd.share_gradient(leaf) for leaf in leaves])
    for _ in range(2):
        got = torch.autograd.grad(total, leaves, retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    views = [cpu_autograd.share_gradient(leaf) for leaf in leaves]
    query = torch.randn(leaves[0].shape[-1], dtype=torch.float64, requires_grad=True)
    stopped = (depth_attention(views, query, torch.ones_like(query), 1e-6, backend="cpu") ** 2).sum()
    torch.autograd.grad(stopped, [query], retain_graph=True)  # runs the mix's backward, not the shared nodes'
    got = torch.autograd.grad(stopped + loss(views), leaves)
    extra = torch.autograd.grad(
        (depth_attention(leaves, query, torch.ones_like(query), 1e-6, backend="reference") ** 2).sum(), leaves
    )
    for a, b, c in zip(got, want, extra):
        torch.testing.assert_close(a, b + c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_size,window", [(1, None), (2, None), (1, 2)])
def test_a_model_shares_source_gradients_only_where_nothing_can_see_them(block_size, window, monkeypatch):
    """In training on the C kernel the completed blocks' fused consumers sum their gradients in shared buffers:
    loss and gradients equal the reference backend's in float64. A module hook on a depth attention receives the
    stream's own tensors, never the shared views, so a gradient taken with respect to what it saw is complete."""
    from attnres_lens import HookedTransformer, ModelConfig

    shared = []
    real = cpu_autograd.share_gradient
    monkeypatch.setattr("attnres_lens.depth_execution.share_gradient", lambda source: shared.append(1) or real(source))
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    model = HookedTransformer(
        ModelConfig(
            d_model=16, n_heads=2, n_layers=3, d_vocab=32, n_ctx=9, residual="attnres", depth_attention_backend="cpu"
        )
    )
    model(tokens, return_type="loss").backward()
    assert not shared  # sources of 288 elements: below MIN_SHARED_GRADIENT_ELEMENTS, autograd adds
    monkeypatch.setattr("attnres_lens.depth_execution.MIN_SHARED_GRADIENT_ELEMENTS", 0)
    results = {}
    for backend in ("cpu", "reference"):
        model = HookedTransformer(
            ModelConfig(
                d_model=16,
                n_heads=2,
                n_layers=3,
                d_vocab=32,
                n_ctx=9,
                residual="attnres",
                attnres_block_size=block_size,
                attnres_window=window,
                depth_attention_backend=backend,
                dtype=torch.float64,
                seed=1,
            )
        )
        randomize_depth_parameters(model)
        seen = []
        handle = model.blocks[2].mlp_res.register_forward_hook(lambda module, args, output: seen.extend(args[0]))
        loss = model(tokens, return_type="loss")
        handle.remove()
        assert not any(hasattr(tensor, "shared_gradient") for tensor in seen)
        parameters = dict(model.named_parameters())
        results[backend] = [loss.detach(), *torch.autograd.grad(loss, [*seen, *parameters.values()])]
    assert shared  # the other consumers did share
    for got, want in zip(results["cpu"], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_the_portable_build_and_the_vector_sums_agree_with_float64(tmp_path, monkeypatch):
    """The float library built without -march=native (the fallback for compilers that reject it) runs the C
    file's portable loops, the default build its AVX2 vector sums where the processor has them: in each, one mix
    forward and backward against float64, the several-query kernel against the float64 oracle, gradients summed
    into shared buffers against the readable path; and the two builds agree."""
    native = cpu_build.cpu_library(torch.float32)  # as shipped, before the flags change
    monkeypatch.setenv(cpu_build.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(cpu_build, "ARCH_FLAGS", ([],))
    portable = cpu_build._build_library("float")
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    assert native.vector_sums() == ("avx2" in flags and "fma" in flags) and portable.vector_sums() == 0
    results = {}
    for name, library in (("portable", portable), ("native", native)):
        monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype, library=library: library)
        outputs = []
        for n_sources, token_shape, d_model in SHAPES:
            sources, query, gain = make_inputs(n_sources, token_shape, d_model)
            leaves, loss = _shared_gradient_case(
                torch.float32,
                n_tokens=int(torch.tensor(token_shape).prod()),
                d_model=d_model,
                n_sources=max(2, n_sources),
            )
            with torch.no_grad():
                mix, _ = cpu_depth.depth_attention_multi_cpu(sources, torch.stack([query * gain, gain]), 1e-6)
            shared = torch.autograd.grad(loss([cpu_autograd.share_gradient(leaf) for leaf in leaves]), leaves)
            grad_output = torch.linspace(-1, 1, mix[0].numel()).view(*token_shape, d_model)
            plain = _gradients("cpu", sources, query, gain, grad_output)
            want_plain = _gradients(
                "reference", [s.double() for s in sources], query.double(), gain.double(), grad_output.double()
            )
            for got, want in zip(plain, want_plain):
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
            outputs.append((mix, *plain, *shared))
            want_mix = oracle(sources, query * gain, torch.ones_like(gain))[0]
            torch.testing.assert_close(mix[0].double(), want_mix, rtol=1e-4, atol=1e-5)
            routed_query = torch.stack([query, -query, gain]) * d_model**0.5
            with torch.no_grad():
                routed = depth_attention(sources, routed_query, None, backend="cpu", **INKLING.kwargs(d_model))
            outputs[-1] += (routed,)
            want_routed = oracle(sources, routed_query, None, **INKLING.kwargs(d_model))[0]
            torch.testing.assert_close(routed.double(), want_routed, rtol=1e-4, atol=1e-5)
            want_shared = torch.autograd.grad(loss(leaves, backend="reference"), leaves)
            for got, want in zip(shared, want_shared):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        results[name] = outputs
    for portable_case, native_case in zip(results["portable"], results["native"]):
        for a, b in zip(portable_case, native_case):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(cpu_build, "cpu_library", lambda dtype: portable)  # its causal attention: portable loops
    for shape in ATTENTION_SHAPES:
        q, k, v = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) for seed in range(3))
        torch.testing.assert_close(
            cpu_attention.causal_attention_cpu(q, k, v, 0.3).double(),
            _attention_oracle(q, k, v, 0.3),
            rtol=1e-5,
            atol=1e-5,
        )


def test_a_shared_source_gradient_refuses_a_second_derivative(monkeypatch):
    """A double backward through fused consumers raises, shared sources or not (their buffers carry no graph, so
    a consumer whose incoming gradient builds one returns fresh gradients that `once_differentiable` guards)."""
    from attnres_lens import HookedTransformer, ModelConfig

    monkeypatch.setattr("attnres_lens.depth_execution.MIN_SHARED_GRADIENT_ELEMENTS", 0)

    model = HookedTransformer(
        ModelConfig(
            d_model=16,
            n_heads=2,
            n_layers=2,
            d_vocab=32,
            n_ctx=9,
            residual="attnres",
            depth_attention_backend="cpu",
            dtype=torch.float64,
            seed=1,
        )
    )
    randomize_depth_parameters(model)
    saved = []

    def leaf(embedding, hook):
        saved.append(embedding.detach().requires_grad_())
        return saved[-1]

    with model.hooks(fwd_hooks=[("hook_embed", leaf)]):
        loss = model(torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0)), return_type="loss")
    (penalty,) = torch.autograd.grad(loss, saved, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (loss + penalty.square().sum()).backward()


def test_concurrent_and_reentrant_backwards_keep_their_own_sums():
    """Two threads differentiating one retained graph at once, and a backward started from a hook inside another,
    each get the readable path's gradients; a backward that stopped short of the shared nodes frees its buffers."""
    import threading

    leaves, loss = _shared_gradient_case(torch.float64, n_tokens=512, d_model=64, n_sources=6)
    want = torch.autograd.grad(loss(leaves, backend="reference"), leaves)
    views = [cpu_autograd.share_gradient(leaf) for leaf in leaves]
    total = loss(views)
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(torch.autograd.grad(total, leaves, retain_graph=True)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for got in results:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    query = torch.randn(64, dtype=torch.float64)
    inner_loss = (depth_attention(views, query, torch.ones_like(query), 1e-6, backend="cpu") * 2).sum()
    want_inner = torch.autograd.grad(
        (depth_attention(leaves, query, torch.ones_like(query), 1e-6, backend="reference") * 2).sum(), leaves
    )
    inner = []
    probe = depth_attention(views, -query, torch.ones_like(query), 1e-6, backend="cpu")
    probe.register_hook(lambda grad: inner.append(torch.autograd.grad(inner_loss, leaves, retain_graph=True)))
    outer = torch.autograd.grad(total + probe.sum(), leaves, retain_graph=True)
    want_probe = torch.autograd.grad(
        depth_attention(leaves, -query, torch.ones_like(query), 1e-6, backend="reference").sum(), leaves
    )
    for a, b, c in zip(outer, want, want_probe):
        torch.testing.assert_close(a, b + c, rtol=1e-10, atol=1e-12)
    for a, b in zip(inner[0], want_inner):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    shared = [view.shared_gradient for view in views]
    gain = torch.ones(64, dtype=torch.float64, requires_grad=True)
    torch.autograd.grad(depth_attention(views, query, gain, 1e-6, backend="cpu").sum(), [gain])
    assert all(not item.buffers for item in shared)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward AD's first use
def test_without_grad_mode_every_eager_kernel_gives_the_same_bits_and_builds_no_node(monkeypatch):
    """Under no_grad (inference, exact interventions) `cpu_autograd.apply_function` runs a kernel's forward without
    its autograd.Function: the outputs equal the grad-mode call's bit for bit, with parameters that require a gradient,
    and no Function is applied (no node, no saved tensors)."""
    generator = torch.Generator().manual_seed(5)
    sources = [torch.randn(2, 7, 16, generator=generator) for _ in range(3)]
    query, gain, norm_weight = (torch.randn(16, generator=generator).requires_grad_() for _ in range(3))
    k, v = (torch.randn(2, 7, 3, 8, generator=generator) for _ in range(2))
    coefficients = torch.randn(3, 4, generator=generator).requires_grad_()
    cos, sin = components.rotary_tables(7, 8, 10000.0)
    calls = {
        "depth_attention_cpu": lambda: cpu_depth.depth_attention_cpu(sources, query, gain, 1e-6),
        "fused_mix_and_norm": lambda: cpu_depth.fused_mix_and_norm(sources, query, gain, 1e-6, norm_weight, 1e-5),
        "kv_shift_cpu": lambda: cpu_elementwise.kv_shift_cpu(k, v, coefficients, (cos, sin)),
        "rotary_cpu": lambda: cpu_elementwise.rotary_cpu(k, cos, sin),
        "rms_norm_cpu": lambda: cpu_elementwise.rms_norm_cpu(sources[0], norm_weight, 1e-5),
        "routed_depth_attention_cpu": lambda: cpu_depth.routed_depth_attention_cpu(
            sources, torch.stack([query, gain]), None, 1e-6, logit_scale=0.25, normalize_values=True
        ),
    }
    with_grad = {name: call() for name, call in calls.items()}
    applied = []
    shipped = torch.autograd.Function.apply.__func__

    def counted_apply(cls, *args, **kwargs):
        applied.append(cls.__name__)
        return shipped(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counted_apply))
    for name, call in calls.items():
        with torch.no_grad():
            outputs = call()
        expected = with_grad[name]
        for got, want in zip(*((o,) if torch.is_tensor(o) else o for o in (outputs, expected)), strict=True):
            assert not got.requires_grad and got.grad_fn is None
            assert torch.equal(got, want.detach()), name
    assert applied == []
    # inside a forward-mode AD level the Function is applied even without grad mode: its missing jvp makes a dual
    # input raise, where the forward alone would return the output without its tangent
    with torch.no_grad(), forward_ad.dual_level():
        dual = forward_ad.make_dual(sources[0], torch.ones_like(sources[0]))
        with pytest.raises(NotImplementedError):
            cpu_elementwise.rms_norm_cpu(dual, norm_weight, 1e-5)
    assert applied == ["_EagerRMSNorm"]
    # under a torch.func transform too: its error names what the Function lacks, where the forward alone would
    # fail on a wrapped tensor's missing storage
    with torch.no_grad(), pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.vmap(lambda x: cpu_elementwise.rms_norm_cpu(x, norm_weight, 1e-5))(sources[0])
    assert applied == ["_EagerRMSNorm"] * 2


# --- the routed op (docs/kernels.md §1's knobs) on the C kernel -------------------------------------------------


def _routed_forward_backward(sources, query, gain, knobs, bias, grad_output, backend="cpu"):
    params = [query] if gain is None else [query, gain]
    leaves = [t.detach().clone().requires_grad_() for t in (*sources, *params)]
    gain_in = leaves[len(sources) + 1] if gain is not None else None
    h, weights, logits = depth_attention(
        leaves[: len(sources)],
        leaves[len(sources)],
        gain_in,
        backend=backend,
        return_weights=True,
        return_logits=True,
        logit_bias=bias,
        **knobs.kwargs(sources[0].shape[-1]),
    )
    (h * grad_output).sum().backward()
    return [h.detach(), weights, logits] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("n_sources", [3, 9, 40])
@pytest.mark.parametrize("n_tokens", [1, 15, 37])  # under, within and across TILE = 16 token rows
@pytest.mark.parametrize("routes", [1, 4, 11])  # 4: the unrolled gradient rows' widest; 11: two kernel calls
@pytest.mark.parametrize("bias_kind", [None, "shared", "per_route"])
def test_routed_kernel_matches_reference_on_threads_and_one_thread(
    many_threads, n_sources, n_tokens, routes, bias_kind
):
    knobs = Knobs(routes=routes, gained=routes != 4, inkling_scale=True, normalize_values=routes != 1)
    sources, query, gain = make_knob_inputs(knobs, n_sources, (n_tokens,), 24, torch.float64, seed=41)
    bias = None
    if bias_kind is not None:
        bias_shape = (n_tokens, routes, n_sources) if bias_kind == "per_route" else (n_tokens, n_sources)
        bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(42), dtype=torch.float64)
        bias[..., 0] = float("-inf")  # a knocked-out source; others stay
    grad_output = torch.randn(n_tokens, routes, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(43))
    fused = _routed_forward_backward(sources, query, gain, knobs, bias, grad_output)
    expected = _routed_forward_backward(sources, query, gain, knobs, bias, grad_output, backend="reference")
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.set_num_threads(1)
    single = _routed_forward_backward(sources, query, gain, knobs, bias, grad_output)
    for got, one in zip(fused[:3], single[:3]):  # rows are independent: the split cannot change them
        torch.testing.assert_close(got, one, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_routed_kernel_upcasts_half_precision(dtype):
    sources, query, _ = make_knob_inputs(INKLING, 5, (3, 7), 24, dtype, seed=44)
    h, weights = depth_attention(sources, query, None, backend="cpu", return_weights=True, **INKLING.kwargs(24))
    expected_h, expected_weights, _ = oracle(sources, query, None, **INKLING.kwargs(24))
    assert h.dtype == dtype and weights.dtype == torch.float32
    assert_close(h, expected_h, dtype)
    assert_close(weights, expected_weights, dtype)


def test_routed_kernel_sums_a_shared_source_gradient_in_place(many_threads):
    """Sources seen through `share_gradient`: the routed backward adds into the buffer the other C consumers
    share, and the leaves' gradients equal those of plain sources."""
    sources, query, _ = make_knob_inputs(INKLING, 6, (37,), 24, torch.float64, seed=45)
    _, single_query, gain = make_inputs(6, (37,), 24, torch.float64, seed=46)
    generator = torch.Generator().manual_seed(47)
    probes = [
        torch.randn(37, 3, 24, generator=generator, dtype=torch.float64),
        torch.randn(37, 24, generator=generator, dtype=torch.float64),
    ]

    def loss(views):
        routed = depth_attention(views, query, None, backend="cpu", **INKLING.kwargs(24))
        one_pass = depth_attention(views, single_query, gain, backend="cpu")
        return (routed * probes[0]).sum() + (one_pass * probes[1]).sum()

    leaves = [s.requires_grad_() for s in sources]
    got = torch.autograd.grad(loss([cpu_autograd.share_gradient(leaf) for leaf in leaves]), leaves)
    want = torch.autograd.grad(loss(leaves), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
