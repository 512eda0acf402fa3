"""Benchmark scripts that only run for real on a GPU still run end to end here, on a tiny model."""

from __future__ import annotations

import collections
import importlib.util
import os
from pathlib import Path

import pytest
import torch

ANALYSES = Path(__file__).resolve().parent.parent / "analyses"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ANALYSES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_block_step_benchmark_dry_run():
    lines = load("bench_block_step_gpu").main(["--dry-run"])
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "ms" not in line}
    assert set(rows) == {"standard", "block S=2", "full"}
    assert rows["standard"].rstrip(" |").endswith("1.000")


@pytest.mark.slow
def test_compile_benchmark_runs_fullgraph_on_a_tiny_model():
    lines = load("bench_compile").main(["--tiny", "--repeats", "2", "--backend", "aot_eager",
                                        "--variants", "standard", "full [cpu kernel]"])
    rows = [line for line in lines if line.startswith("| ") and "variant" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["standard", "full [cpu kernel]"]


@pytest.mark.slow
def test_depth_scaling_benchmark_on_tiny_models():
    lines = load("bench_depth_scaling").main(["--depths", "2", "4", "--contexts", "8", "--n-ctx", "16",
                                              "--d-model", "16", "--batch", "2", "--repeats", "1"])
    rows = [line.split("|") for line in lines if line.startswith("| ") and "variant" not in line]
    assert {(row[1].strip(), row[3].strip()) for row in rows} >= {("2", "full"), ("4", "block4"), ("4", "standard")}
    growth = next(line for line in lines if line.startswith("Saved activations"))
    full = float(growth.split("full ")[1].split("×")[0])
    assert 1.0 < full < 2.0  # twice the depth, less than twice the saved bytes (embedding and readout are fixed)


@pytest.mark.parametrize("block_size, batch", [(1, 8), (2, 8), (2, 1)])
def test_kernel_traffic_counts_the_depth_mix_bytes_its_source_layouts_imply(block_size, batch):
    """A training step's C depth-mix calls, counted by `kernel_traffic.kernel_bytes` from their arguments, move
    the bytes the model's source layouts say (docs/kernels.md §8): per consumer, forward n sources read and one row
    written (y: every consumer's norm is fused, the final readout's too) with 3n + 1 statistics per token (the
    fused norm's rstd); backward
    the sources read, their gradients written, dy or dh read, the statistics again; and one more read for every
    reader of a completed block beyond its first, where the gradients are summed in shared buffers (at 64K
    elements a source, batch 8, and not below it, batch 1)."""
    from attnres_lens import HookedTransformer, ModelConfig
    from attnres_lens.attnres import MIN_SHARED_GRADIENT_ELEMENTS

    traffic = load("kernel_traffic")
    cfg = ModelConfig(n_layers=2, d_model=128, n_heads=4, n_ctx=64, d_vocab=32, residual="attnres",
                      attnres_block_size=block_size, seed=0)
    model = HookedTransformer(cfg)
    tokens = torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    counting = traffic.counted_calls(lambda: model(tokens, return_type="loss").backward())
    calls, seconds, counted = counting.summed(traffic.DEPTH_MIX_KERNELS)

    n_tokens, final = tokens.numel(), cfg.n_sublayers
    layouts = [model.sources(consumer) for consumer in range(final + 1)]
    rows = stats = 0
    for consumer, layout in enumerate(layouts):
        n = len(layout)
        rows += (n + 1) + (2 * n + 1)
        stats += 2 * (3 * n + 1)
    shares = n_tokens * cfg.d_model >= MIN_SHARED_GRADIENT_ELEMENTS
    readers = collections.Counter(tuple(source) for layout in layouts for source in layout)
    added = sum(count - 1 for count in readers.values()) if shares else 0
    assert calls == 2 * (final + 1) and seconds > 0
    assert counted == 4 * ((rows + added) * n_tokens * cfg.d_model + stats * n_tokens)
    assert (added > 0) == (batch == 8)
    assert not {"rms_norm_forward", "rms_norm_backward"} & set(counting.totals)  # no norm runs on its own
    assert cpu_fused_library_restored()


@pytest.mark.parametrize("with_prior", [False, True])
def test_kernel_traffic_counts_the_two_phase_bytes_its_arguments_imply(with_prior):
    """The two-phase kernel's calls, counted by `kernel_traffic.kernel_bytes`: forward, the S sources read, each
    query's mix and lse written, the prior read; backward, the sources read and their gradients written, each
    query's dh read (one query's left out here: its mix unused), the prior read and its gradient written, the
    lse read, dlse read where given, dl written."""
    from attnres_lens.kernels import cpu_fused

    traffic = load("kernel_traffic")
    n_sources, n_queries, n_tokens, d_model = 5, 3, 12, 16
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(n_tokens, d_model, generator=generator).requires_grad_() for _ in range(n_sources)]
    queries = torch.randn(n_queries, d_model, generator=generator).requires_grad_()
    prior = None
    if with_prior:
        prior = (torch.randn(n_queries, n_tokens, d_model, generator=generator).requires_grad_(),
                 torch.randn(n_queries, n_tokens, generator=generator).requires_grad_())

    def step():
        mix, lse = cpu_fused.depth_attention_multi_cpu(sources, queries, 1e-6, prior=prior)
        (mix[0].sum() + mix[2].sum() + lse[1].sum()).backward()

    counting = traffic.counted_calls(step)
    (forward_calls, _, forward), (backward_calls, _, backward) = (
        counting.totals[name] for name in ("depth_attention_multi", "depth_attention_multi_backward"))
    assert forward_calls == backward_calls == 1
    rows, per_token = n_sources + n_queries + n_queries * with_prior, n_queries + n_queries * with_prior
    assert forward == 4 * (rows * n_tokens * d_model + per_token * n_tokens)
    rows = 2 * n_sources + 2 + 2 * n_queries * with_prior  # two queries' dh
    per_token = n_queries * (1 + 2 * with_prior) + 1  # one query's dlse
    assert backward == 4 * (rows * n_tokens * d_model + per_token * n_tokens)
    assert cpu_fused_library_restored()


def test_inference_benchmark_reports_every_variant(monkeypatch):
    module = load("bench_inference")
    tiny = dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2)
    monkeypatch.setitem(module.SHAPES, "small", tiny)
    monkeypatch.setitem(module.INFERENCE_SHAPES, "small", tiny)
    monkeypatch.setattr(module, "PRUNE_SHAPE", tiny)
    monkeypatch.setattr(module, "ATTENTION_OP_SHAPES", [(2, 8, 2, 4), (1, 600, 1, 32)])
    shipped = module.components.attention_runs_cpu_kernel
    lines = module.main(["--shapes", "small", "--repeats", "2"])
    rows = [line.split("|") for line in lines if line.startswith("| small")]
    assert [row[2].strip() for row in rows][:len(module.VARIANTS)] == list(module.VARIANTS)
    assert rows[0][4].strip() == "1.000"
    excess = lines[lines.index("## Where the excess goes"):lines.index("## The token attention's C kernel against "
                                                                         "PyTorch's SDPA")]
    excess = {row[2]: row for row in ([cell.strip() for cell in line.split("|")] for line in excess
                                      if line.startswith("| small"))}
    assert list(excess) == [name for name in module.VARIANTS if name != "standard"]
    assert excess["standard+kv_shift"][5:8] == ["–", "–", "–"]  # no depth mix
    for name in ("full", "block2", "block4"):  # every consumer's mix counted: 2 sublayers and the readout
        assert float(excess[name][6]) > 0
    # Full reads 1, 2 and 3 sources of [2, 8, 16] fp32 and writes y: more than a Block consumer's mix can
    assert float(excess["full"][6]) >= float(excess["block4"][6])
    after = lines[lines.index("## The token attention's C kernel against PyTorch's SDPA"):]
    attention = [[cell.strip() for cell in line.split("|")[1:3]] for line in after
                 if line.startswith("| small") or line.startswith("| prune")]
    assert attention == [["small", "standard"], ["small", "full"], ["prune", "standard"], ["prune", "full"]]
    assert module.components.attention_runs_cpu_kernel is shipped
    ops = [[cell.strip() for cell in line.split("|")[1:7]] for line in lines if line.startswith("| 2 x 8 x 2 x 4")
           or line.startswith("| 1 x 600 x 1 x 32")]
    assert [(op[0], op[1], op[5]) for op in ops] == [("2 x 8 x 2 x 4", "32", "C kernel"),
                                                     ("1 x 600 x 1 x 32", "19200", "SDPA")]


@pytest.mark.slow
def test_cpu_kernels_benchmark_on_tiny_shapes():
    from attnres_lens.kernels import cpu_fused

    shipped = (cpu_fused.ARCH_FLAGS, cpu_fused.cpu_library, os.environ.get(cpu_fused.CACHE_ENV_VAR))
    lines = load("bench_cpu_kernels").main(["--tiny", "--repeats", "1", "--processes", "1"])
    ops = [line.split("|")[1].strip() for line in lines if line.startswith("| RMSNorm") or line.startswith("| rotary")]
    assert ops == ["RMSNorm [2, 8, 16]", "rotary [2, 8, 2, 4]", "RMSNorm [2, 8, 16]"]  # the last: per-thread sums
    assert any(line.startswith("| 3 x [2, 8, 16] |") for line in lines)  # the fused pre-norm
    assert any(line.startswith("| 2 layers") for line in lines)
    assert any(line.startswith("| 5 x [2, 8, 16] |") for line in lines)  # the vector sums against portable loops
    assert any(line.startswith("| forward, Full 2 layers") for line in lines)
    threads = [[cell.strip() for cell in line.split("|")[1:3]] for line in lines if line.startswith("| tiny |")]
    assert threads == [["tiny", "full"], ["tiny", "block4"],  # the pthread build against the OpenMP pool
                       *(["tiny", name] for name in ("standard", "standard+kv_shift", "full", "block4")),  # elementwise
                       *(["tiny", name] for name in ("standard", "standard+kv_shift", "full", "block2", "block4"))]
    kept = [[cell.strip() for cell in line.split("|")[1:3]] for line in lines
            if line.startswith("| tiny, 1 thread(s) |")]
    assert kept == [["tiny, 1 thread(s)", name] for name in ("standard", "full", "block2", "block4")]  # h kept or not
    from attnres_lens import attnres
    assert attnres.fused_mix_and_norm is cpu_fused.fused_mix_and_norm  # the shipped mix, restored
    sums = [line.split("|")[1].strip() for line in lines if line.startswith(("| depth mix + pre-norm", "| KV shift"))]
    assert sums == ["depth mix + pre-norm, 3 x [2, 8, 16]", "depth mix + pre-norm, 9 x [2, 8, 16]",
                    "KV shift [2, 8, 4, 4]"]
    assert cpu_fused._elementwise_threads.__name__ == "_elementwise_threads"  # the shipped rule, restored
    assert any(line.startswith("Process costs:") and "gc.freeze" in line for line in lines)
    assert (cpu_fused.ARCH_FLAGS, cpu_fused.cpu_library, os.environ.get(cpu_fused.CACHE_ENV_VAR)) == shipped


@pytest.mark.slow
def test_prune_baseline_benchmark_alternates_two_trees(tmp_path):
    """Against HEAD itself on a one-layer model: both trees run, the worktree is removed afterwards."""
    import subprocess

    repository = ANALYSES.parent
    if subprocess.run(["git", "-C", str(repository), "rev-parse", "HEAD"], capture_output=True).returncode:
        raise AssertionError("the benchmark needs the repository's git history; run the tests in a git checkout")

    def worktrees() -> str:
        return subprocess.run(["git", "-C", str(repository), "worktree", "list"], capture_output=True, text=True).stdout

    before = worktrees()
    lines = load("bench_prune_baseline").main(["--baseline", "HEAD", "--steps", "2", "--samples", "2", "--repeats",
                                               "1", "--set", "model.n_layers=1", "--out", str(tmp_path / "r.md")])
    rows = [line for line in lines if line.startswith("| baseline") or line.startswith("| this checkout")]
    assert len(rows) == 2 and (tmp_path / "r.md").exists()
    assert worktrees() == before  # the baseline's worktree is removed


@pytest.mark.slow
def test_step_baseline_benchmark_alternates_two_trees(tmp_path):
    """Against HEAD itself on a one-layer model: each tree's process steps every variant, each gets a ratio per
    process from both trees, and the worktree is removed afterwards."""
    import subprocess

    repository = ANALYSES.parent

    def worktrees() -> str:
        return subprocess.run(["git", "-C", str(repository), "worktree", "list"], capture_output=True, text=True).stdout

    before = worktrees()
    module = load("bench_step_baseline")
    lines = module.main(["--baseline", "HEAD", "--tiny", "--threads", "1", "--processes", "2", "--rounds", "2",
                         "--out", str(tmp_path / "r.md")])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| 1 |")]
    assert [row[1] for row in rows] == ["standard+kv_shift", "full [cpu]", "block2 [cpu]", "block4 [cpu]",
                                        "standard (second instance)"]
    for row in rows:
        assert len(row[2].split(" / ")) == 2 and len(row[4].split(" / ")) == 2  # one ratio per process, each tree
        assert all(float(ratio) > 0 for ratio in (*row[2].split(" / "), *row[4].split(" / ")))
    assert (tmp_path / "r.md").exists() and worktrees() == before


@pytest.mark.slow
def test_step_profile_reports_every_variant_at_both_shapes(monkeypatch):
    module = load("profile_cpu_step")
    monkeypatch.setitem(module.SHAPES, "small", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=16, batch=2))
    lines = module.main(["--repeats", "1", "--steps", "1", "--threads", "1", "2"])
    assert [line for line in lines if line.startswith("## ")] == [
        "## 1 torch thread", "## 2 torch threads", "## One mix at 8 tokens, layer by layer, 1 torch thread",
        "## Profile at the small shape, 1 torch thread"]
    one_thread = lines[lines.index("## 1 torch thread"):lines.index("## 2 torch threads")]

    def table(header: str) -> list[list[str]]:
        start = next(i for i, line in enumerate(one_thread) if line.startswith(header))
        rows = []
        for line in one_thread[start + 2:]:
            if not line.startswith("| "):
                break
            rows.append([cell.strip() for cell in line.split("|")[1:-1]])
        return rows

    fixed = {row[0]: row for row in table("| variant | small step")}
    assert list(fixed) == [*module.variants("cpu"), module.LOOPED_ADAMW]
    assert fixed["standard"][2] == "1.000" and fixed["standard"][3] == "+0.0"
    phases = [float(x) for x in fixed["full"][6].split("/")]
    assert len(phases) == 3 and all(x > 0 for x in phases)
    kernels = table("| variant | C kernel")
    # each variant's own kernels: the depth mix (AttnRes), the KV shift, the rotary embedding and the norms
    assert {row[1] for row in kernels if row[0] == "full"} >= {"depth_attention_forward", "depth_attention_backward"}
    assert {row[1] for row in kernels if row[0] == "standard+kv_shift"} >= {"token_shift_forward",
                                                                            "token_shift_backward"}
    assert {row[1] for row in kernels if row[0] == "standard"} == {"rms_norm_forward", "rms_norm_backward",
                                                                   "rotary_forward"}
    assert all(float(row[3]) > 0 and float(row[5]) > 0 for row in kernels)  # ms and GB/s
    floors = {row[0]: row for row in table("| variant | × standard")}
    assert list(floors) == [name for name in module.variants("cpu") if name != "standard"]
    for row in floors.values():  # the excess splits into fixed + kernels + rest, and the floor is 1 + (fixed + kernels)
        assert float(row[2]) == pytest.approx(float(row[3]) + float(row[4]) + float(row[5]), abs=0.02)
    assert floors["block4"][7].startswith("≤ 1.05: floor ")
    assert cpu_fused_library_restored()
    assert [line for line in lines if line.startswith("### standard:")]
    # the layers of one mix: each pass's layers add up to the pass, and the C calls are timed on their own
    start = lines.index("| layer | standard pre-norm (us) | Block consumer, 3 sources (us) |")
    layers = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        label, norm_us, mix_us = [cell.strip() for cell in line.split("|")[1:-1]]
        layers[label] = (float(norm_us) if norm_us else None, float(mix_us))
    for direction, parts in (("forward", 4), ("backward", 3)):
        own = [mix for label, (_, mix) in layers.items() if label.startswith(f"{direction}: ")]
        assert len(own) == parts
        assert sum(own) == pytest.approx(layers[f"{direction}, all"][1], abs=0.1 * parts)
    assert all(layers[label][0] > 0 and layers[label][1] > 0
               for label in layers if label.endswith(("the C call", "(ctypes' argument conversion included)")))
    both = layers["forward + backward"]
    assert both[0] == pytest.approx(layers["forward, all"][0] + layers["backward, all"][0], abs=0.2)


def cpu_fused_library_restored() -> bool:
    from attnres_lens.kernels import cpu_fused

    return cpu_fused.cpu_library.__name__ == "cpu_library"


def test_step_benchmark_takes_each_ratio_within_its_round(monkeypatch):
    module = load("bench_cpu_step")
    monkeypatch.setitem(module.SHAPES, "small", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2))
    # fake step times (ms) after the 3 warm-up steps: the machine is slow in rounds 1 and 2 for everyone; every
    # variant takes 1.1x the standard step of its round, except one spell of its own in the last round. Per round
    # the ratio is 1.1 four times out of five; the medians of each variant's own times would give 9.9 / 1 = 9.9.
    standard = [1, 9, 9, 1, 1]
    counts: dict[int, int] = {}

    def fake_step(self) -> float:
        count = counts[id(self)] = counts.get(id(self), -1) + 1
        round_ = max(count - 3, 0)
        if self.model.cfg.residual == "standard" and self.model.cfg.attention == "standard":
            return standard[round_] / 1000
        return (10 if round_ == 4 else 1.1 * standard[round_]) / 1000

    monkeypatch.setattr(module.Stepper, "step", fake_step)
    rows = module.bench("small", 1, 5, ["cpu"])
    assert [row["variant"] for row in rows] == ["standard", "standard+kv_shift", "full [cpu]", "block2 [cpu]",
                                                "block4 [cpu]", module.SECOND_STANDARD]
    assert [round(row["ratio"], 6) for row in rows] == [1.0, 1.1, 1.1, 1.1, 1.1, 1.0]


def test_ratio_spread_sets_runs_side_by_side_with_their_range_and_targets(monkeypatch, tmp_path):
    """Three `bench_cpu_step` reports made by its own `main` (fake step times: every variant 1.04x the standard step
    in the first run, 1.08x in the second, 1.0503x in the third) come out cell by cell with their range and how many
    meet the target, by each report's own verdict (1.0503 prints as 1.050 and misses 1.05); a committed report
    reads as REVISION:PATH, and what is not a report is refused by name."""
    step_module, spread = load("bench_cpu_step"), load("ratio_spread")
    monkeypatch.setitem(step_module.SHAPES, "small", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2))
    factor = {"value": 1.04}

    def fake_step(self) -> float:
        standard = self.model.cfg.residual == "standard" and self.model.cfg.attention == "standard"
        return 0.01 if standard else 0.01 * factor["value"]

    monkeypatch.setattr(step_module.Stepper, "step", fake_step)
    reports = []
    for value in (1.04, 1.08, 1.0503):
        factor["value"] = value
        reports.append(tmp_path / f"run{value}.md")
        step_module.main(["--shapes", "small", "--threads", "1", "--repeats", "3", "--paths", "cpu",
                          "--out", str(reports[-1])])
    lines = spread.main([str(path) for path in reports])
    rows = {cells[2]: cells for line in lines if line.startswith("| small")
            for cells in [[cell.strip() for cell in line.split("|")[1:-1]]]}
    assert rows["full [cpu]"] == ["small", "1", "full [cpu]", "1.040", "1.080", "1.050", "1.040–1.080", "≤ 1.10",
                                  "3 of 3"]
    assert rows["block2 [cpu]"][6:] == ["1.040–1.080", "≤ 1.05", "1 of 3"]
    assert rows["standard+kv_shift"][6:] == ["1.040–1.080", "≤ 1.03", "0 of 3"]
    assert rows["standard"][3:8] == ["1.000", "1.000", "1.000", "1.000–1.000", ""]
    assert sum(line.startswith("* run ") for line in lines) == 3

    committed = spread.parse_report("HEAD:analyses/reports/bench_cpu_step.md",
                                    spread.report_text("HEAD:analyses/reports/bench_cpu_step.md"))
    assert ("small", 1, "full [cpu]") in committed.ratios and committed.machine
    (tmp_path / "notes.md").write_text("# not a report\n")
    with pytest.raises(ValueError, match="notes.md.*not a bench_cpu_step report"):
        spread.main([str(tmp_path / "notes.md")])
    with pytest.raises(FileNotFoundError, match="missing.md"):
        spread.main([str(tmp_path / "missing.md")])


def test_within_rounds_compares_each_round_to_its_own_baseline():
    from analyses.common import within_rounds

    base = [1, 9, 9, 1, 1]  # the machine slow in rounds 1 and 2; the variant's own slow spell in the last round
    assert within_rounds([1.1, 9.9, 9.9, 1.1, 10], base) == pytest.approx(1.1)  # own medians: 9.9 / 1
    assert within_rounds([1.1, 9.1, 9.1, 1.1, 10], base, "difference") == pytest.approx(0.1)  # own: 9.1 - 1
    with pytest.raises(ValueError, match="one baseline time per round: got 2 samples and 3"):
        within_rounds([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="compare must be 'ratio' or 'difference', got 'sum'"):
        within_rounds([1], [1], "sum")


def test_shared_gradient_benchmark_turns_the_sums_off_and_on(monkeypatch):
    module = load("bench_shared_gradients")
    from attnres_lens import attnres
    from attnres_lens.kernels import cpu_fused

    shared = []
    monkeypatch.setattr(attnres, "share_gradient", lambda source: shared.append(1) or cpu_fused.share_gradient(source))
    stepper = module.Stepper(module.TINY, module.VARIANTS["full"], eager=False)
    stepper.step()
    assert not shared  # the tiny model's sources are below the shipped threshold
    with module.sums_on(), module.sums_off():
        stepper.step()
    assert not shared
    with module.sums_on():
        stepper.step()
    assert shared
    assert attnres.MIN_SHARED_GRADIENT_ELEMENTS > 0  # restored on exit
    lines = module.main(["--tiny", "--repeats", "2"])
    rows = [line.split("|") for line in lines if line.startswith("| tiny")]
    assert [row[3].strip() for row in rows] == ["full", "block4"]
    assert all(float(row[8]) > 0 for row in rows)


def test_page_fault_benchmark_reports_each_variant_and_setting(monkeypatch):
    """Each variant and allocator setting runs in its own process; here the children run in this one (without the
    process-wide allocator setting) on a tiny model."""
    import json
    import types

    module = load("step_page_faults")
    monkeypatch.setitem(module.SHAPES, "small", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2))
    children = []
    run = module.subprocess.run

    def child(command, **kwargs):
        if "--child" not in command:  # machine_info's own commands
            return run(command, **kwargs)
        variant, setting = command[command.index("--child") + 1:][:2]
        children.append((variant, setting))
        return types.SimpleNamespace(stdout=json.dumps(module.measure(variant, False, "small", 1)))

    monkeypatch.setattr(module.subprocess, "run", child)
    lines = module.main(["--steps", "1", "--processes", "1"])
    assert children == [(name, setting) for name in module.VARIANTS for setting in ("default", "kept")]
    rows = [line.split("|") for line in lines if line.startswith("| ") and "variant" not in line]
    assert [row[1].strip() for row in rows] == list(module.VARIANTS)
    assert all(float(row[4]) > 0 and float(row[5]) > 0 for row in rows)  # step times


@pytest.mark.slow
def test_stack_size_benchmark_on_a_tiny_model():
    from attnres_lens.analysis import interventions
    from attnres_lens.attnres import DepthStream

    shipped = (interventions.evaluate_many.__wrapped__.__defaults__, DepthStream.stacked_from)
    lines = load("bench_stack_size").main(["--steps", "2", "--samples", "2", "--set", "model.n_layers=5",
                                           "--sizes", "2", "4", "--rounds", "1"])
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "seconds" not in line]
    assert rows[:2] == ["2 sequences", "4 sequences"] and rows[2].startswith("default (")
    assert rows[3:] == ["shared sources mixed once", "every copy mixes all", "the batch (2 sequences)",
                         "2 sequences"]
    difference = next(line for line in lines if line.startswith("Largest difference"))
    assert float(difference.rstrip(".").split()[-1]) < 1e-5  # the shared mix changes nothing but the time
    assert (interventions.evaluate_many.__wrapped__.__defaults__, DepthStream.stacked_from) == shipped  # restored


@pytest.mark.slow
def test_cold_mix_benchmark_times_every_build_warm_and_cold():
    import torch

    from attnres_lens.kernels import cpu_fused

    module = load("bench_cold_mix")
    shipped = (cpu_fused.ARCH_FLAGS, cpu_fused.SOURCE, cpu_fused.cpu_library, os.environ.get(cpu_fused.CACHE_ENV_VAR))
    lines = module.main(["--tiny", "--repeats", "1", "--threads", "1", "--baseline", "HEAD"])
    mixes = [[cell.strip() for cell in line.split("|")[1:6]] for line in lines if line.startswith("| 1 | ")]
    baseline = module.baseline_name("HEAD")
    builds = ["shipped", "grouped reads", baseline, "torch sum of the stacked sources (same bytes as the forward)"]
    assert mixes == [["1", sources, "16", caches, build] for sources in ("2", "5") for caches in ("warm", "cold")
                     for build in builds]
    steps = [[cell.strip() for cell in line.split("|")[1:4]] for line in lines if line.startswith("| tiny |")]
    assert steps == [["tiny", "1", name] for name in ("standard", "full", "block2", "block4")]
    assert (cpu_fused.ARCH_FLAGS, cpu_fused.SOURCE, cpu_fused.cpu_library,
            os.environ.get(cpu_fused.CACHE_ENV_VAR)) == shipped
    # the builds compute the same mix: grouped reads at 5 sources, the baseline commit's own loops
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randn(2, 24, 16, generator=generator, dtype=torch.float32, requires_grad=True) for _ in range(5)]
    query, gain, norm_weight = (torch.rand(16, generator=generator).add(0.5).requires_grad_() for _ in range(3))
    results = {}
    for name, library in module.builds("HEAD").items():
        with module.kernels_from(library):
            _, y = cpu_fused.depth_attention_normed_cpu(sources, query, gain, 1e-6, norm_weight, 1e-5)
            results[name] = (y, *torch.autograd.grad((y * y).sum(), [*sources, query, gain, norm_weight]))
    for name in ("grouped reads", baseline):
        for got, expected in zip(results[name], results["shipped"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cold_mix_benchmark_names_a_baseline_git_cannot_show():
    module = load("bench_cold_mix")
    with pytest.raises(SystemExit, match="--baseline 'no-such-commit'"):
        module.builds("no-such-commit")


def test_kv_rotary_benchmark_steps_both_paths_and_restores_the_hook_check(monkeypatch):
    """The shipped KV model rotates K inside the shift (rotary_cpu for Q alone), the compared one runs rotary_cpu
    for Q and K: over 3 warm-up steps and 1 round, 2 layers, (2 + 1 + 2) calls per layer and round of the three
    models; the layer's hook check is the shipped one afterwards."""
    from attnres_lens import components
    from attnres_lens.kernels import cpu_fused

    module = load("bench_kv_rotary")
    calls = []
    monkeypatch.setattr(components, "rotary_cpu", lambda *args: calls.append(1) or cpu_fused.rotary_cpu(*args))
    shipped = components.is_hooked
    lines = module.main(["--shapes", "tiny", "--repeats", "1", "--threads", "1"])
    assert components.is_hooked is shipped
    assert len(calls) == 4 * 2 * (2 + 1 + 2)
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| tiny |")]
    assert len(rows) == 1 and rows[0][:2] == ["tiny", "1"]
    assert all(float(cell) > 0 for cell in rows[0][2:])


def test_two_phase_benchmark_sets_each_threshold_and_restores_the_shipped_one(monkeypatch):
    """The model table steps one Full model with windows from no count, from 8 and from the shipped count of
    shared sources; with the shipped count set low here, the tiny model's two-phase rounds run the C two-phase
    kernel, and the shipped count is back afterwards."""
    from attnres_lens import attnres
    from attnres_lens.kernels import cpu_fused

    module = load("bench_two_phase_cpu")
    monkeypatch.setattr(module, "MODEL_SHAPES", [(5, 16, 8, 2)])  # 11 consumers: windows from 8 sources
    monkeypatch.setattr(attnres, "MIN_SHARED_SOURCES_WITH_GRAD", 9)
    seen = []
    multi = cpu_fused._EagerMultiDepthAttention.apply
    monkeypatch.setattr(cpu_fused._EagerMultiDepthAttention, "apply",
                        lambda *args: seen.append(attnres.MIN_SHARED_SOURCES_WITH_GRAD) or multi(*args))
    rows = module.training_steps(2)
    assert len(rows) == 1 and rows[0].startswith("| 10 | 16 | 8 | 2 |") and rows[0].count("×)") == 3
    # windows at consumers 7-10 (from 8 sources) or 8-10 (from 9): never with the one-pass threshold
    assert seen and set(seen) == {8, 9}
    assert attnres.MIN_SHARED_SOURCES_WITH_GRAD == 9


def test_no_graph_benchmark_times_both_ways_and_restores_the_wrappers(monkeypatch):
    from attnres_lens.kernels import cpu_fused

    module = load("bench_no_graph")
    shipped = cpu_fused._apply
    x, w = torch.randn(3, 8), torch.ones(8, requires_grad=True)
    applied = []
    original = torch.autograd.Function.apply.__func__
    monkeypatch.setattr(torch.autograd.Function, "apply",
                        classmethod(lambda cls, *args: applied.append(cls.__name__) or original(cls, *args)))
    with torch.no_grad():
        for enabled in (False, True):
            with module.with_node(enabled):
                cpu_fused.rms_norm_cpu(x, w, 1e-5)
    assert applied == ["_EagerRMSNorm"]  # only with the node
    monkeypatch.undo()
    lines = module.main(["--tiny", "--repeats", "2"])
    assert cpu_fused._apply is shipped
    assert sum(line.startswith("| 8 x 16, 3 sources |") for line in lines) == 1
    assert [line.split("|")[2].strip() for line in lines if line.startswith("| tiny |")] == list(module.VARIANTS)


@pytest.mark.parametrize("df", [1, 2, 5, 11, 30, 31, 45, 200])
def test_the_ablation_confidence_intervals_use_student_t_quantiles(df):
    """Checked by integrating the t density in float64: 95% of its mass lies within ±t95(df), from the table and
    beyond it (11 and more seeds once fell back to the normal quantile, 11% too narrow at 12 seeds)."""
    import math

    from analyses.depth_mixing_ablation import t95

    q = t95(df)
    x = torch.linspace(-q, q, 400_001, dtype=torch.float64)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = torch.exp(log_norm - (df + 1) / 2 * torch.log1p(x ** 2 / df))
    assert torch.trapezoid(density, x).item() == pytest.approx(0.95, abs=5e-5)  # the table has 3 decimals
