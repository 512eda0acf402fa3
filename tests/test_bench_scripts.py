"""Benchmark scripts that only run for real on a GPU still run end to end here, on a tiny model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def test_compile_benchmark_runs_fullgraph_on_a_tiny_model():
    lines = load("bench_compile").main(["--tiny", "--repeats", "2", "--backend", "aot_eager",
                                        "--variants", "standard", "full [cpu kernel]"])
    rows = [line for line in lines if line.startswith("| ") and "variant" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["standard", "full [cpu kernel]"]


def test_depth_scaling_benchmark_on_tiny_models():
    lines = load("bench_depth_scaling").main(["--depths", "2", "4", "--contexts", "8", "--n-ctx", "16",
                                              "--d-model", "16", "--batch", "2", "--repeats", "1"])
    rows = [line.split("|") for line in lines if line.startswith("| ") and "variant" not in line]
    assert {(row[1].strip(), row[3].strip()) for row in rows} >= {("2", "full"), ("4", "block4"), ("4", "standard")}
    growth = next(line for line in lines if line.startswith("Saved activations"))
    full = float(growth.split("full ")[1].split("×")[0])
    assert 1.0 < full < 2.0  # twice the depth, less than twice the saved bytes (embedding and readout are fixed)


def test_inference_benchmark_reports_every_variant(monkeypatch):
    module = load("bench_inference")
    monkeypatch.setitem(module.SHAPES, "small", dict(n_layers=1, d_model=16, n_heads=4, n_ctx=8, batch=2))
    lines = module.main(["--shapes", "small", "--repeats", "2"])
    rows = [line.split("|") for line in lines if line.startswith("| small")]
    assert [row[2].strip() for row in rows] == list(module.VARIANTS)
    assert rows[0][4].strip() == "1.000"
