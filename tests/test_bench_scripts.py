"""The standing benchmarks run end to end here through their runner on tiny shapes (rows written to a temporary
results file: their structure and invariants, never their timings), the results page renders from rows, and the
GPU-only scripts run their dry runs."""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from .helpers import reordering_bound

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


def run_tiny(name: str, results: Path) -> list[dict]:
    """Benchmark `name` on tiny shapes through the runner; the rows it appended to `results`, read back."""
    from analyses import benchmarks
    from analyses.results import read_rows

    before = len(read_rows(results)) if results.exists() else 0
    returned = benchmarks.main([name, "--tiny", "--results", str(results)])
    rows = read_rows(results)[before:]
    assert rows == json.loads(json.dumps(returned))  # what was appended is what the run returned
    return rows


def cells(rows: list[dict], metric: str) -> dict[tuple, dict]:
    return {(row["shape"], row["variant"], row["threads"]): row for row in rows if row["metric"] == metric}


def test_every_row_carries_its_provenance_and_the_command_that_reproduces_it(tmp_path):
    import subprocess

    rows = run_tiny("bench_cpu_step", tmp_path / "results.jsonl")
    head = subprocess.run(
        ["git", "-C", str(ANALYSES.parent), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    for row in rows:
        assert row["bench"] == "bench_cpu_step" and row["commit"] == head and isinstance(row["dirty"], bool)
        assert row["utc"].endswith("Z") and len(row["utc"]) == len("2026-12-07T09:00:00Z")
        assert row["machine"]["cores"] == os.cpu_count() and row["machine"]["cpu"]
        assert row["command"] == "python -m analyses.benchmarks bench_cpu_step --tiny"
    assert len({(row["commit"], row["utc"]) for row in rows}) == 1  # one run


def test_cpu_step_rows_hold_each_variants_ratio_time_and_target_verdict(tmp_path):
    from analyses.bench_cpu_step import SECOND_STANDARD, TARGETS

    rows = run_tiny("bench_cpu_step", tmp_path / "results.jsonl")
    ratios, times = cells(rows, "step ratio"), cells(rows, "step time")
    variants = ["standard", "standard+kv_shift", "full [cpu]", "block2 [cpu]", "block4 [cpu]", SECOND_STANDARD]
    assert list(ratios) == list(times) == [("tiny", name, 1) for name in variants]
    assert ratios[("tiny", "standard", 1)]["value"] == 1.0  # the standard step over itself, round by round
    for (_, variant, _), row in ratios.items():
        target = TARGETS.get(variant.split(" [")[0])
        assert row["unit"] == "× standard" and row["target"] == target
        if target is None:
            assert "met" not in row
        else:
            assert row["met"] == (row["value"] <= target)
    assert all(row["unit"] == "ms" and row["value"] > 0 and row["target"] is None for row in times.values())


def test_depth_scaling_rows_grow_linearly_in_saved_activations(tmp_path):
    rows = run_tiny("bench_depth_scaling", tmp_path / "results.jsonl")
    saved = cells(rows, "saved activations")
    shape = "{} sublayers, n_ctx {}, d_model 16, batch 2"
    assert {
        (shape.format(2, 16), "full", 1),
        (shape.format(4, 16), "block4", 1),
        (shape.format(4, 8), "standard", 1),
    } <= set(saved)
    full = saved[(shape.format(4, 16), "full", 1)]["value"] / saved[(shape.format(2, 16), "full", 1)]["value"]
    assert 1.0 < full < 2.0  # twice the depth, less than twice the saved bytes (embedding and readout are fixed)
    ratios = cells(rows, "step ratio")
    assert all(ratios[(shape, "standard", 1)]["value"] == 1.0 for shape, variant, _ in ratios if variant == "full")
    mixes = cells(rows, "depth mix bandwidth")  # only models with a depth mix have one
    assert {variant for _, variant, _ in mixes} == {"full", "block4"} and all(r["value"] > 0 for r in mixes.values())
    floors = cells(rows, "bandwidth floor")
    assert all(row["value"] > 1 for row in floors.values())  # the mix's bytes cost something on top of the standard
    assert [row["unit"] for row in rows if row["metric"] == "copy bandwidth"] == ["GB/s"]


def test_inference_rows_split_each_variants_excess(tmp_path):
    from analyses.bench_inference import VARIANTS

    rows = run_tiny("bench_inference", tmp_path / "results.jsonl")
    ratios = cells(rows, "forward ratio")
    assert list(ratios) == [("tiny", name, 1) for name in VARIANTS]
    assert ratios[("tiny", "standard", 1)]["value"] == 1.0
    hooked = cells(rows, "hooked forward ratio")  # no depth weights to watch in a standard model
    assert [variant for _, variant, _ in hooked] == ["full", "block2", "block4"]
    excess, kernels, rest = (
        cells(rows, metric) for metric in ("forward excess", "C kernels' excess", "the rest of the excess")
    )
    assert list(excess) == [("tiny", name, 1) for name in VARIANTS if name != "standard"]
    for key, row in excess.items():  # the excess splits into the C kernels' share and the rest
        assert row["value"] == pytest.approx(kernels[key]["value"] + rest[key]["value"])
    mix = cells(rows, "depth mix bytes")  # every consumer's mix counted: 2 sublayers and the readout
    assert [variant for _, variant, _ in mix] == ["full", "block2", "block4"]
    # Full reads 1, 2 and 3 sources of [2, 8, 16] fp32 and writes y: more than a Block consumer's mix can
    assert mix[("tiny", "full", 1)]["value"] >= mix[("tiny", "block4", 1)]["value"] > 0
    attention = cells(rows, "forward with the attention kernel")
    assert list(attention) == [
        ("tiny", "standard", 1),
        ("tiny", "full", 1),
        ("prune", "standard", 1),
        ("prune", "full", 1),
    ]
    ops = cells(rows, "attention op, C kernel")
    assert [(shape, variant) for shape, variant, _ in ops] == [
        ("2 x 8 x 2 x 4 (pos × d_head 32)", "policy runs C kernel"),
        ("1 x 600 x 1 x 32 (pos × d_head 19200)", "policy runs SDPA"),
    ]
    from attnres_lens.kernels import layer_ops
    from attnres_lens.kernels.backends import attention_runs_cpu_kernel

    assert layer_ops.attention_runs_cpu_kernel is attention_runs_cpu_kernel  # the shipped policy, restored


@pytest.mark.slow
def test_compile_rows_on_a_tiny_model(tmp_path):
    rows = run_tiny("bench_compile", tmp_path / "results.jsonl")
    ratios = cells(rows, "compiled / eager")
    assert [variant for _, variant, _ in ratios] == ["standard", "full [cpu kernel]"]
    assert next(row for row in rows if row["metric"] == "eager step ratio")["value"] == 1.0  # standard first
    for key, row in ratios.items():
        eager, compiled = cells(rows, "eager step")[key]["value"], cells(rows, "compiled step")[key]["value"]
        assert row["value"] == pytest.approx(compiled / eager)


@pytest.mark.slow
def test_edge_knockout_rows_score_each_measure_against_the_exact_knockouts(tmp_path):
    rows = run_tiny("bench_edge_knockouts", tmp_path / "results.jsonl")
    shapes = sorted({row["shape"] for row in rows})
    assert len(shapes) == 3 and all("8 sequences" in shape for shape in shapes)  # one per demo run measured
    for shape in shapes:
        by_cell = {(row["variant"], row["metric"]): row["value"] for row in rows if row["shape"] == shape}
        assert by_cell["exact", "wall"] > 0
        for variant in ("two-stage", "first-order sensitivity"):
            assert -1 <= by_cell[variant, "Spearman vs exact"] <= 1 and -1 <= by_cell[variant, "Pearson vs exact"] <= 1
            assert 0 <= by_cell[variant, "top-10 recall"] <= 1 and by_cell[variant, "wall"] > 0
        # 8 sequences: a screen of 2, then the 20 largest on the other 6
        passes = next(value for (variant, metric), value in by_cell.items() if metric == "knockout passes")
        n_edges = int(shape.split(", ")[-1].split()[0])
        assert passes == pytest.approx((2 * n_edges + 6 * min(20, n_edges)) / (8 * n_edges))


@pytest.mark.slow
def test_bridge_rows_compare_the_bridged_forward_with_transformers(tmp_path):
    rows = run_tiny("bench_bridge", tmp_path / "results.jsonl")
    forward = [row for row in rows if "removals" not in row["shape"]]
    assert sorted({row["shape"].rsplit(", ", 1)[1] for row in forward}) == ["forward + backward", "no grad"]
    for row in forward:
        assert row["value"] > 0
        if row["variant"] == "bridge":
            assert row["unit"] == "× transformers" and row["target"] == 1.0 and "met" in row
    # the stacked interventions against one pass each: 4 layers, 8 removals, the same losses to float rounding
    stacking = {row["metric"]: row for row in rows if "removals" in row["shape"]}
    assert set(stacking) == {
        "evaluate_many time",
        "evaluate_many / one pass each",
        "max |Δloss| stacked vs one pass each",
    }
    assert all(row["shape"].endswith("8 removals") for row in stacking.values())
    assert stacking["evaluate_many time"]["value"] > 0 and stacking["evaluate_many / one pass each"]["value"] > 0
    # float32 reordering of the tiny shape's longest chain (32 tokens, 512 logits, 8 sublayers of 32 + 16 + 4 · 32
    # sums) at the scale of a random model's loss, within twice the uniform loss log 512
    chain = 32 + 512 + 8 * (32 + 16 + 4 * 32)
    assert stacking["max |Δloss| stacked vs one pass each"]["value"] <= reordering_bound(chain, 2 * math.log(512))


def test_the_runner_lists_refuses_and_appends(tmp_path, capsys):
    from analyses import benchmarks

    benchmarks.main(["--list"])
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert (
        listed
        == list(benchmarks.BENCHMARKS)
        == [
            "bench_cpu_step",
            "bench_depth_scaling",
            "bench_inference",
            "bench_attribution",
            "bench_edge_knockouts",
            "bench_bridge",
            "bench_compile",
            "gpu_check",
        ]
    )
    for argv, message in (
        (["bench_cpu_stepp"], "unknown benchmark.*bench_cpu_stepp"),
        ([], "name one or more"),
        (["bench_cpu_step", "--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["render", "bench_cpu_step"], "unknown benchmark.*'render'"),
    ):
        with pytest.raises(SystemExit):
            benchmarks.main(argv)
        assert re.search(message, capsys.readouterr().err)
    results = tmp_path / "results.jsonl"
    results.write_text('{"earlier": "line"}\n')
    from analyses.results import append_rows

    append_rows([{"a": 1}, {"b": "é"}], results)
    append_rows([], results)
    assert results.read_text().splitlines() == ['{"earlier": "line"}', '{"a": 1}', '{"b": "é"}']


RENDER_ROWS = [  # (bench, machine cpu, shape, variant, value, target, commit, utc): a synthetic history
    ("bench_cpu_step", "CPU A", "small", "full [cpu]", 1.071, 1.10, "a" * 40, "2026-12-05T12:06:00Z"),
    ("bench_cpu_step", "CPU A", "small", "full [cpu]", 1.1004, 1.10, "b" * 40, "2026-12-06T00:00:00Z"),
    ("bench_cpu_step", "CPU A", "small", "full [cpu]", 1.055, 1.10, "c" * 40, "2026-12-05T23:22:00Z"),
    ("bench_cpu_step", "CPU A", "small", "standard", 1.0, None, "a" * 40, "2026-12-05T12:06:00Z"),
    ("bench_cpu_step", "CPU B", "small", "full [cpu]", 1.2, 1.10, "d" * 40, "2026-12-01T10:00:00Z"),
    ("bench_compile", "CPU A", "tiny", "standard", 48.44, None, "e" * 40, "2026-12-05T12:00:00Z"),
]


def test_the_results_page_shows_latest_range_and_targets_met(tmp_path):
    from analyses import benchmarks
    from analyses.results import append_rows

    results = tmp_path / "results.jsonl"
    for bench, cpu, shape, variant, value, target, commit, utc in RENDER_ROWS:
        row = dict(
            bench=bench,
            metric="step ratio",
            shape=shape,
            variant=variant,
            threads=1,
            value=value,
            unit="× standard" if bench == "bench_cpu_step" else "ms",
            target=target,
            commit=commit,
            dirty=commit.startswith("d"),
            utc=utc,
            machine=dict(cpu=cpu, cores=2, gpu=None),
            command="x",
        )
        if target is not None:
            row["met"] = value <= target
        append_rows([row], results)
    out = tmp_path / "results.md"
    benchmarks.main(["render", "--results", str(results), "--out", str(out)])
    page = out.read_text()
    assert [line for line in page.splitlines() if line.startswith("#")] == [
        "# Benchmark results",
        "## bench_cpu_step",
        "### CPU A, 2 cores",
        "### CPU B, 2 cores",
        "## bench_compile",
        "### CPU A, 2 cores",
    ]
    table = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in page.splitlines()
        if line.startswith("| step ratio")
    ]
    # CPU A's Full: latest by time is b (1.1004, misses ≤ 1.1 though it prints as 1.100); range over the three runs
    assert table == [
        [
            "step ratio",
            "small",
            "full [cpu]",
            "1",
            "1.100",
            "× standard",
            "bbbbbbb",
            "2026-12-06T00:00:00Z",
            "1.055–1.100",
            "3",
            "≤ 1.1",
            "2 of 3",
        ],
        [
            "step ratio",
            "small",
            "standard",
            "1",
            "1.000",
            "× standard",
            "aaaaaaa",
            "2026-12-05T12:06:00Z",
            "1.000–1.000",
            "1",
            "",
            "",
        ],
        [
            "step ratio",
            "small",
            "full [cpu]",
            "1",
            "1.200",
            "× standard",
            "ddddddd+",
            "2026-12-01T10:00:00Z",
            "1.200–1.200",
            "1",
            "≤ 1.1",
            "0 of 1",
        ],
        [
            "step ratio",
            "tiny",
            "standard",
            "1",
            "48.4",
            "ms",
            "eeeeeee",
            "2026-12-05T12:00:00Z",
            "48.4–48.4",
            "1",
            "",
            "",
        ],
    ]
    assert "3 run(s)." in page.split("### CPU A, 2 cores")[1].split("###")[0]
    benchmarks.main(["render", "--results", str(results), "--out", str(tmp_path / "again.md")])
    assert (tmp_path / "again.md").read_text() == page  # deterministic


def test_a_results_file_line_that_is_not_a_row_is_refused_by_number(tmp_path):
    from analyses.results import read_rows

    results = tmp_path / "results.jsonl"
    results.write_text('{"bench": "x"}\n')
    with pytest.raises(ValueError, match="results.jsonl:1 is not a results row"):
        read_rows(results)
    results.write_text("\nnot json\n")
    with pytest.raises(ValueError, match="results.jsonl:2 is not JSON"):
        read_rows(results)


def test_the_committed_results_file_renders_to_the_committed_page():
    """docs/results.md is what `render` makes of analyses/results.jsonl: re-render after appending rows."""
    from analyses.results import RESULTS, RESULTS_PAGE, read_rows, render

    assert render(read_rows(RESULTS)) == RESULTS_PAGE.read_text()


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
    from attnres_lens.depth_execution import MIN_SHARED_GRADIENT_ELEMENTS

    traffic = load("kernel_traffic")
    cfg = ModelConfig(
        n_layers=2,
        d_model=128,
        n_heads=4,
        n_ctx=64,
        d_vocab=32,
        residual="attnres",
        attnres_block_size=block_size,
        seed=0,
    )
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
    assert cpu_library_restored()


@pytest.mark.parametrize("with_prior", [False, True])
def test_kernel_traffic_counts_the_two_phase_bytes_its_arguments_imply(with_prior):
    """The two-phase kernel's calls, counted by `kernel_traffic.kernel_bytes`: forward, the S sources read, each
    query's mix and lse written, the prior read; backward, the sources read and their gradients written, each
    query's dh read (one query's left out here: its mix unused), the prior read and its gradient written, the
    lse read, dlse read where given, dl written."""
    from attnres_lens.kernels import cpu_depth

    traffic = load("kernel_traffic")
    n_sources, n_queries, n_tokens, d_model = 5, 3, 12, 16
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(n_tokens, d_model, generator=generator).requires_grad_() for _ in range(n_sources)]
    queries = torch.randn(n_queries, d_model, generator=generator).requires_grad_()
    prior = None
    if with_prior:
        prior = (
            torch.randn(n_queries, n_tokens, d_model, generator=generator).requires_grad_(),
            torch.randn(n_queries, n_tokens, generator=generator).requires_grad_(),
        )

    def step():
        mix, lse = cpu_depth.depth_attention_multi_cpu(sources, queries, 1e-6, prior=prior)
        (mix[0].sum() + mix[2].sum() + lse[1].sum()).backward()

    counting = traffic.counted_calls(step)
    (forward_calls, _, forward), (backward_calls, _, backward) = (
        counting.totals[name] for name in ("depth_attention_multi", "depth_attention_multi_backward")
    )
    assert forward_calls == backward_calls == 1
    rows, per_token = n_sources + n_queries + n_queries * with_prior, n_queries + n_queries * with_prior
    assert forward == 4 * (rows * n_tokens * d_model + per_token * n_tokens)
    rows = 2 * n_sources + 2 + 2 * n_queries * with_prior  # two queries' dh
    per_token = n_queries * (1 + 2 * with_prior) + 1  # one query's dlse
    assert backward == 4 * (rows * n_tokens * d_model + per_token * n_tokens)
    assert cpu_library_restored()


@pytest.mark.slow
def test_step_profile_reports_every_variant_at_both_shapes(monkeypatch):
    module = load("profile_cpu_step")
    monkeypatch.setitem(module.SHAPES, "small", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=16, batch=2))
    lines = module.main(["--repeats", "1", "--steps", "1", "--threads", "1", "2"])
    assert [line for line in lines if line.startswith("## ")] == [
        "## 1 torch thread",
        "## 2 torch threads",
        "## One mix at 8 tokens, layer by layer, 1 torch thread",
        "## Profile at the small shape, 1 torch thread",
    ]
    one_thread = lines[lines.index("## 1 torch thread") : lines.index("## 2 torch threads")]

    def table(header: str) -> list[list[str]]:
        start = next(i for i, line in enumerate(one_thread) if line.startswith(header))
        rows = []
        for line in one_thread[start + 2 :]:
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
    assert {row[1] for row in kernels if row[0] == "standard+kv_shift"} >= {
        "token_shift_forward",
        "token_shift_backward",
    }
    assert {row[1] for row in kernels if row[0] == "standard"} == {
        "rms_norm_forward",
        "rms_norm_backward",
        "rotary_forward",
    }
    assert all(float(row[3]) > 0 and float(row[5]) > 0 for row in kernels)  # ms and GB/s
    floors = {row[0]: row for row in table("| variant | × standard")}
    assert list(floors) == [name for name in module.variants("cpu") if name != "standard"]
    for row in floors.values():  # the excess splits into fixed + kernels + rest, and the floor is 1 + (fixed + kernels)
        assert float(row[2]) == pytest.approx(float(row[3]) + float(row[4]) + float(row[5]), abs=0.02)
    assert floors["block4"][7].startswith("≤ 1.05: floor ")
    assert cpu_library_restored()
    assert [line for line in lines if line.startswith("### standard:")]
    # the layers of one mix: each pass's layers add up to the pass, and the C calls are timed on their own
    start = lines.index("| layer | standard pre-norm (us) | Block consumer, 3 sources (us) |")
    layers = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        label, norm_us, mix_us = [cell.strip() for cell in line.split("|")[1:-1]]
        layers[label] = (float(norm_us) if norm_us else None, float(mix_us))
    for direction, parts in (("forward", 4), ("backward", 3)):
        own = [mix for label, (_, mix) in layers.items() if label.startswith(f"{direction}: ")]
        assert len(own) == parts
        assert sum(own) == pytest.approx(layers[f"{direction}, all"][1], abs=0.1 * parts)
    assert all(
        layers[label][0] > 0 and layers[label][1] > 0
        for label in layers
        if label.endswith(("the C call", "(ctypes' argument conversion included)"))
    )
    both = layers["forward + backward"]
    assert both[0] == pytest.approx(layers["forward, all"][0] + layers["backward, all"][0], abs=0.2)


def cpu_library_restored() -> bool:
    from attnres_lens.kernels import cpu_build

    return cpu_build.cpu_library.__name__ == "cpu_library"


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
    assert [row["variant"] for row in rows] == [
        "standard",
        "standard+kv_shift",
        "full [cpu]",
        "block2 [cpu]",
        "block4 [cpu]",
        module.SECOND_STANDARD,
    ]
    assert [round(row["ratio"], 6) for row in rows] == [1.0, 1.1, 1.1, 1.1, 1.1, 1.0]


def test_within_rounds_compares_each_round_to_its_own_baseline():
    from analyses.common import within_rounds

    base = [1, 9, 9, 1, 1]  # the machine slow in rounds 1 and 2; the variant's own slow spell in the last round
    assert within_rounds([1.1, 9.9, 9.9, 1.1, 10], base) == pytest.approx(1.1)  # own medians: 9.9 / 1
    assert within_rounds([1.1, 9.1, 9.1, 1.1, 10], base, "difference") == pytest.approx(0.1)  # own: 9.1 - 1
    with pytest.raises(ValueError, match="one baseline time per round: got 2 samples and 3"):
        within_rounds([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="compare must be 'ratio' or 'difference', got 'sum'"):
        within_rounds([1], [1], "sum")


@pytest.mark.parametrize("df", [1, 2, 5, 11, 30, 31, 45, 200])
def test_the_ablation_confidence_intervals_use_student_t_quantiles(df):
    """Checked by integrating the t density in float64: 95% of its mass lies within ±t95(df), from the table and
    beyond it (11 and more seeds once fell back to the normal quantile, 11% too narrow at 12 seeds)."""
    import math

    from analyses.depth_mixing_ablation import t95

    q = t95(df)
    x = torch.linspace(-q, q, 400_001, dtype=torch.float64)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = torch.exp(log_norm - (df + 1) / 2 * torch.log1p(x**2 / df))
    assert torch.trapezoid(density, x).item() == pytest.approx(0.95, abs=5e-5)  # the table has 3 decimals


def test_a_pipe_in_a_cell_does_not_split_the_table_row():
    """Metrics such as `max |Δ| vs shared prefixes` hold a `|`: escaped, every row keeps the header's 12 cells."""
    import re

    from analyses.results import render

    row = dict(
        bench="b",
        metric="max |Δ| vs x",
        shape="s|t",
        variant="v",
        threads=1,
        value=0.5,
        unit="abs",
        target=None,
        commit="abc1234",
        dirty=False,
        utc="2026-12-07T00:00:00Z",
        machine=dict(cpu="CPU", cores=2, gpu=None),
        command="x",
    )
    rows = [line for line in render([row]).splitlines() if line.startswith("| ")]
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in rows]
    assert [len(c) for c in cells] == [12, 12] and cells[1][0].strip() == r"max \|Δ\| vs x"
