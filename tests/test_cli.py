"""The command line's front door: one sample default per analysis shared with the dashboard, arguments checked
before torch loads, and messages in the number their counts need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_lens.analysis_options import plural
from attnres_lens.cli import _attribute_lines, _prune_lines, build_parser

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_RUNS = REPO_ROOT / "data" / "demo_runs"


def test_commands_and_run_functions_share_one_sample_default_each(capsys):
    import inspect

    from attnres_lens.analysis import run

    parser = build_parser()
    for command, function, default in (
        ("analyze", run.analyze_run, run.ANALYZE_SAMPLES),
        ("prune", run.prune_run, run.PRUNE_SAMPLES),
        ("attribute", run.attribute_run, run.ATTRIBUTE_SAMPLES),
    ):
        assert parser.parse_args([command, "RUN"]).samples == default, command
        assert inspect.signature(function).parameters["samples"].default == default, command
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert f"(default: {default}" in " ".join(capsys.readouterr().out.split()), command


def test_an_unknown_option_is_answered_with_the_commands_own_usage(capsys):
    from attnres_lens.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "RUN", "--bogus"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: attnres-lens analyze" in err
    assert "attnres-lens analyze: error: unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main(["--bogus", "presets"])
    assert "attnres-lens: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_run_functions_share_their_leading_signature():
    import inspect

    from attnres_lens.analysis.run import AnalysisResult, analyze_run, attribute_run, prune_run

    leading = ["path", "checkpoint", "samples", "out", "progress"]
    for function in (analyze_run, prune_run, attribute_run):
        parameters = inspect.signature(function).parameters
        assert list(parameters)[: len(leading)] == leading, function.__name__
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in leading[1:])
        assert parameters["checkpoint"].default == "latest" and parameters["out"].default is None
        assert inspect.signature(function).return_annotation in (AnalysisResult, "AnalysisResult")


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEMO_RUNS / "depth-full-6l" / "config.json").is_file(), reason="demo runs missing: run `make demo`"
)
def test_dashboard_pages_start_from_the_commands_defaults():
    from streamlit.testing.v1 import AppTest

    from attnres_lens.analysis.run import ATTRIBUTE_SAMPLES, PRUNE_SAMPLES

    parser = build_parser()
    for page, key, default, command in (
        ("views/pruning.py", "pruning-samples", PRUNE_SAMPLES, "prune"),
        ("views/attribution.py", "attribution-samples", ATTRIBUTE_SAMPLES, "attribute"),
    ):
        app = AppTest.from_file(str(REPO_ROOT / "apps" / "app.py"), default_timeout=180)
        app.session_state["served_dir"] = str(DEMO_RUNS)  # as `dashboard --runs` serves it
        app.run()
        app.switch_page(page).run()
        assert not app.exception, [element.value for element in app.exception]
        assert app.number_input(key=key).value == default == parser.parse_args([command, "RUN"]).samples, page


BAD_COMMANDS = [
    (["analyze", "{missing}"], "run directory {missing} does not exist"),
    (["prune", "{run}", "--metric", "perplexity"], "metric must be one of ['loss', 'accuracy']"),
    (["prune", "{run}", "--samples", "1"], "samples must be an integer >= 2"),
    (["attribute", "{run}", "--samples", "0"], "samples must be an integer >= 2"),
    (["train", "--preset", "smok", "--out", "{missing}"], "unknown preset 'smok' (did you mean 'smoke'?)"),
    (["train", "--resume", "{missing}"], "does not exist"),
    (["export-fla", "{missing}", "--out", "{missing}-fla"], "does not exist"),
]


def test_bad_arguments_are_refused_before_torch_is_imported(tmp_path):
    """Each bad command returns 2 with its message, in a fresh interpreter that never imported torch or
    transformer_lens (the seconds those take are what a typo used to cost)."""
    run = tmp_path / "run"
    run.mkdir()
    cases = [[part.format(missing=tmp_path / "missing", run=run) for part in argv] for argv, _ in BAD_COMMANDS]
    script = (
        "import contextlib, io, json, sys\n"
        "from attnres_lens.cli import main\n"
        "results = []\n"
        f"for argv in {cases!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = main(argv)\n"
        "    results.append([code, err.getvalue()])\n"
        "print(json.dumps({'results': results, 'heavy': sorted(name for name in ('torch', 'transformer_lens')\n"
        "                                                     if name in sys.modules)}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["heavy"] == []
    for (code, err), (argv, message) in zip(report["results"], BAD_COMMANDS):
        expected = message.format(missing=tmp_path / "missing")
        assert code == 2 and err.startswith("attnres-lens: error: ") and expected in err, (argv, err)


def test_counts_take_the_number_they_need():
    assert [plural(n, "sublayer") for n in (0, 1, 2)] == ["0 sublayers", "1 sublayer", "2 sublayers"]
    removable = [
        {"strategy": "measured", "n_removable": 1},
        {"strategy": "block_influence", "n_removable": 0},
        {"strategy": "last_first", "n_removable": 3},
    ]
    lines = _prune_lines({"base_loss": 1.0, "base_accuracy": 0.5, "samples": 1, "removable": removable}).splitlines()
    assert lines[0].endswith("(1 held-out sequence)")
    assert [line.strip() for line in lines[1:]] == [
        "measured: 1 sublayer removable within +5% loss",
        "block_influence: 0 sublayers removable within +5% loss",
        "last_first: 3 sublayers removable within +5% loss",
    ]
    by_accuracy = _prune_lines(  # --metric orders the removals; the tolerance stays on loss, and the line says so
        {
            "base_loss": 1.0,
            "base_accuracy": 0.5,
            "samples": 2,
            "metric": "accuracy",
            "removable": [{"strategy": "measured", "n_removable": 2, "tolerance": 0.1}],
        }
    ).splitlines()
    assert by_accuracy[1] == "removals ordered by accuracy; removable while the loss stays within the tolerance"
    assert by_accuracy[2].strip() == "measured: 2 sublayers removable within +10% loss"
    no_answers = _prune_lines({"base_loss": 1.0, "base_accuracy": None, "samples": 2, "removable": []})  # NaN in JSON
    assert (
        no_answers == "clean loss 1.0000 over all positions, accuracy n/a over answer positions (2 held-out sequences)"
    )
    summary = {
        "top_logit_sources": [{"source_label": "emb", "share": 1.0}],
        "top_edges": [{"consumer_label": "final", "source_label": "emb", "delta_loss": 0.25}],
        "edge_agreement": {"spearman": None, "n_edges": 1, "recall_top": 1, "top_recall": 1.0},
    }
    lines = _attribute_lines(summary).splitlines()
    assert lines[1] == "knockouts that hurt most (exact Δloss): final ← emb +0.25"
    assert lines[2] == "first-order sensitivity vs exact knockouts: Spearman n/a, top-1 recall 1.00 over 1 edge"
