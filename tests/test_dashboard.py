"""The Streamlit dashboard (apps/) under streamlit's AppTest, on the shipped demo runs."""

from __future__ import annotations

import base64
import gc
import json
import re
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit")
from markdown_it import MarkdownIt  # noqa: E402 - streamlit's dependency rich brings it
from streamlit.testing.v1 import AppTest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
APP = REPO_ROOT / "apps" / "app.py"
DEMO_RUNS = REPO_ROOT / "data" / "demo_runs"
MARKDOWN = MarkdownIt("commonmark").enable(["table", "strikethrough"])
PAGES = [
    "views/runs.py",
    "views/depth_attention.py",
    "views/depth_mixing.py",
    "views/training_dynamics.py",
    "views/induction.py",
    "views/pruning.py",
    "views/attribution.py",
]

if not (DEMO_RUNS / "induction-1l-kvshift" / "config.json").is_file():
    pytest.skip(
        f"demo runs missing in {DEMO_RUNS}: run `make demo` or `python apps/make_demo_runs.py`", allow_module_level=True
    )


def open_page(page: str, runs: Path = DEMO_RUNS) -> AppTest:
    """The app serving `runs`, as `attnres-lens dashboard --runs RUNS` would, on `page`."""
    app = AppTest.from_file(str(APP), default_timeout=180)
    app.session_state["served_dir"] = str(runs)
    app.run()
    if page != "views/runs.py":
        app.switch_page(page)
        app.run()
    return app


def assert_clean(app: AppTest) -> None:
    assert not app.exception, [element.value for element in app.exception]
    assert not app.error, [element.value for element in app.error]


def chart_specs(app: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]


# Each page takes seconds under AppTest: the fast lane (make test-fast) renders the runs page alone.
@pytest.mark.parametrize(
    "page", [pytest.param(page, marks=() if page == "views/runs.py" else pytest.mark.slow) for page in PAGES]
)
def test_every_page_renders_on_the_demo_runs(page):
    app = open_page(page)
    assert_clean(app)
    if page not in ("views/runs.py", "views/pruning.py"):
        assert chart_specs(app), f"{page} drew no chart"


DEMO_RUN_NAMES = sorted(path.name for path in DEMO_RUNS.iterdir() if (path / "config.json").is_file())


@pytest.mark.parametrize("run", DEMO_RUN_NAMES)
@pytest.mark.slow
def test_every_page_renders_every_demo_run(run):
    """Each shipped demo run selected, every page: messages where a page cannot show it, never a traceback."""
    app = open_page("views/runs.py")
    app.multiselect(key="runs-pick").set_value([str(DEMO_RUNS / run)]).run()
    for page in PAGES[1:]:
        app.switch_page(page).run()
        assert_clean(app)
        assert app.session_state["selected_runs"] == [str(DEMO_RUNS / run)], page


@pytest.mark.slow
def test_runs_page_lists_runs_and_keeps_the_selection_across_pages():
    app = open_page("views/runs.py")
    assert len(app.dataframe[0].value) >= 6
    full = str(DEMO_RUNS / "depth-full-6l")
    app.multiselect(key="runs-pick").set_value([full]).run()
    assert app.session_state["selected_runs"] == [full]
    app.switch_page("views/depth_attention.py").run()
    assert_clean(app)
    assert app.multiselect(key="depth-runs").value == [full]


@pytest.mark.slow
def test_the_sidebar_names_the_runs_every_page_shows():
    """One selection state: with nothing picked, a page's default runs become the selection the sidebar reports,
    and a pick on any page is what the next page shows."""
    app = open_page("views/depth_mixing.py")
    shown = app.multiselect(key="mixing-runs").value
    assert shown and app.session_state["selected_runs"] == shown
    sidebar = " ".join(element.value for element in app.sidebar.caption)
    assert all(Path(path).name in sidebar for path in shown) and "none" not in sidebar
    block = str(DEMO_RUNS / "depth-block-6l")
    app.multiselect(key="mixing-runs").set_value([block]).run()
    assert app.session_state["selected_runs"] == [block]
    app.switch_page("views/runs.py").run()
    assert app.multiselect(key="runs-pick").value == [block]
    assert "depth-block-6l" in " ".join(element.value for element in app.sidebar.caption)


@pytest.mark.slow
def test_a_page_that_cannot_show_the_selected_run_says_so_and_keeps_the_selection():
    """A standard-residual run selected on Runs: Depth attention (AttnRes only) says why it is not shown and which
    runs it shows instead, the selection stays (the sidebar names both, the next page shows the selected run), and
    only a pick on the page changes it."""
    app = open_page("views/runs.py")
    kv_shift = str(DEMO_RUNS / "induction-1l-kvshift")
    app.multiselect(key="runs-pick").set_value([kv_shift]).run()
    app.switch_page("views/depth_attention.py").run()
    assert_clean(app)
    assert app.session_state["selected_runs"] == [kv_shift]
    notes = [info.value for info in app.info if "not shown here" in info.value]
    assert len(notes) == 1 and "induction-1l-kvshift" in notes[0] and "AttnRes" in notes[0], notes
    shown = app.multiselect(key="depth-runs").value
    assert shown and all(Path(path).name in notes[0] for path in shown)
    assert {Path(path).name for path in shown} <= {"depth-block-6l", "depth-full-6l"}
    sidebar = " ".join(element.value for element in app.sidebar.caption)
    assert "Selected: induction-1l-kvshift" in sidebar and f"instead: {Path(shown[0]).name}" in sidebar

    app.switch_page("views/training_dynamics.py").run()
    assert app.multiselect(key="dynamics-runs").value == [kv_shift]
    assert "instead" not in " ".join(element.value for element in app.sidebar.caption)

    app.switch_page("views/depth_attention.py").run()
    block = str(DEMO_RUNS / "depth-block-6l")
    app.multiselect(key="depth-runs").set_value([block]).run()
    assert app.session_state["selected_runs"] == [block]
    assert not [info.value for info in app.info if "not shown here" in info.value]


@pytest.mark.slow
def test_runs_table_says_which_positions_each_metric_covers(tmp_path):
    """Loss over all positions beside accuracy over answer positions, each column saying so; the answer-position
    loss is shown where metrics.jsonl has it (`eval_answer_loss`) and left out for runs from before it."""
    shutil.copytree(DEMO_RUNS / "induction-1l-kvshift", tmp_path / "old")
    app = open_page("views/runs.py", runs=tmp_path)
    table = app.dataframe[0].value
    assert {"train loss (all pos.)", "eval loss (all pos.)", "accuracy (answer pos.)"} <= set(table.columns)
    assert "eval loss (answer pos.)" not in table.columns  # no run logged it
    metrics = [json.loads(line) for line in (tmp_path / "old" / "metrics.jsonl").read_text().splitlines()]
    last_eval = max(index for index, line in enumerate(metrics) if "eval_loss" in line)
    assert table["eval loss (all pos.)"][0] == pytest.approx(metrics[last_eval]["eval_loss"])
    assert table["accuracy (answer pos.)"][0] == pytest.approx(metrics[last_eval]["eval_accuracy"])

    shutil.copytree(tmp_path / "old", tmp_path / "new")
    metrics[last_eval]["eval_answer_loss"] = 0.0123
    (tmp_path / "new" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in metrics))
    app = open_page("views/runs.py", runs=tmp_path)
    assert_clean(app)
    table = app.dataframe[0].value.set_index("run")
    assert table.loc["new", "eval loss (answer pos.)"] == pytest.approx(0.0123)
    assert np.isnan(table.loc["old", "eval loss (answer pos.)"])
    app.session_state["selected_runs"] = [str(tmp_path / "new")]
    app.switch_page("views/training_dynamics.py").run()
    assert_clean(app)
    loss = next(spec for spec in chart_specs(app) if spec["layout"]["title"]["text"] == "Loss")
    assert "new · eval, answer positions" in [trace["name"] for trace in loss["data"]]


@pytest.mark.slow
def test_training_timeline_tells_every_line_apart_and_names_every_consumer():
    """16 lines (13 consumers of a 6-layer Full AttnRes run, 3 model-wide series): no two share a colour and dash,
    the two fastest-change labels sit in different panels, and the model-wide rows are labelled, not blank."""
    from attnres_lens import load_run
    from attnres_lens.analysis.attribution_report import timeline_figure
    from attnres_lens.analysis.timeline import fastest_changes, training_timeline

    run = load_run(DEMO_RUNS / "depth-full-6l", load_model=False)
    timeline = training_timeline(run.records, run.metrics)
    figure = timeline_figure(timeline, fastest_changes(timeline))
    styles = {trace.name: (trace.line.color, trace.line.dash) for trace in figure.data}
    assert len(styles) == timeline["consumer_label"].nunique() - 1 + 3  # consumers, loss, eval_loss, induction
    assert None not in {colour for colour, _ in styles.values()}
    assert len(set(styles.values())) == len(styles), styles
    for trace in figure.data:  # a consumer keeps its style in every panel
        assert (trace.line.color, trace.line.dash) == styles[trace.name]
    labels = [note for note in figure.layout.annotations if note.text.startswith("fastest")]
    assert len(labels) == 2 and labels[0].yref != labels[1].yref

    app = open_page("views/runs.py")
    app.session_state["selected_runs"] = [str(DEMO_RUNS / "depth-full-6l")]
    app.switch_page("views/attribution.py").run()
    assert_clean(app)
    changes = next(frame.value for frame in app.dataframe if "series" in frame.value)
    by_series = changes.set_index("series")["consumer"]
    assert by_series["loss"] == by_series["induction_score"] == "whole model"
    assert "final" in set(changes["consumer"]) and "" not in set(changes["consumer"])


@pytest.mark.slow
def test_heatmap_cells_print_values_by_grid_size(monkeypatch):
    """Block (4 sources) and Full AttnRes (up to 13 sources) panels of a 6-layer run both print α in their cells;
    a grid too large for printed values shows them on hover only."""
    app = open_page("views/runs.py")
    app.session_state["selected_runs"] = [str(DEMO_RUNS / "depth-block-6l"), str(DEMO_RUNS / "depth-full-6l")]
    app.switch_page("views/depth_attention.py").run()
    assert_clean(app)
    heatmaps = {
        spec["layout"]["title"]["text"]: spec["data"][0]
        for spec in chart_specs(app)
        if spec["data"][0]["type"] == "heatmap" and "step" in spec["layout"]["title"]["text"]
    }
    assert any("depth-full-6l" in title for title in heatmaps) and any("depth-block-6l" in title for title in heatmaps)
    for title, trace in heatmaps.items():
        assert trace.get("texttemplate") == "%{z:.2f}", title
    monkeypatch.syspath_prepend(str(REPO_ROOT / "apps"))
    from lens_ui.figures import cell_text

    assert cell_text((6, 4))[0] and cell_text((7, 13))[1] < cell_text((6, 4))[1]
    assert cell_text((24, 25)) == (None, cell_text((24, 25))[1])


@pytest.mark.parametrize("metric", ["loss", "accuracy"])
@pytest.mark.slow
def test_pruning_curve_axis_holds_every_point_with_a_margin(metric):
    """The cumulative-removal figure of the pruning report sets its y range from the curves (and the +5% line),
    a margin on each side, so no curve or marker is cut off."""
    import pandas as pd

    from attnres_lens.analysis.report import _figures

    labels = ["L0.attn", "L0.mlp"]
    sensitivity = pd.DataFrame(
        {
            "label": labels,
            **{
                f"{column}_{mode}": [0.1, 0.2]
                for column in ("dloss", "dacc")
                for mode in ("remove", "mean", "resample")
            },
        }
    )
    curves = pd.DataFrame(
        {
            "strategy": ["measured"] * 3 + ["drop_deepest"] * 3,
            "n_removed": [0, 1, 2] * 2,
            "loss": [1.8, 2.5, 9.7, 1.8, 1.85, 6.0],
            "accuracy": [0.9, 0.4, 0.02, 0.9, 0.88, 0.1],
        }
    )
    distances = pd.DataFrame({"start": [0, 0], "start_label": ["L0.attn"] * 2, "n": [1, 2], "distance": [0.1, 0.2]})
    tables = {"pruning_sensitivity": sensitivity, "pruning_curves": curves, "angular_distance": distances}
    figure = next(figure for heading, figure, _ in _figures(tables, metric, 0.05) if "removed" in heading)
    low, high = figure.layout.yaxis.range
    values = curves[metric]
    span = values.max() - values.min()
    assert low < values.min() - 0.03 * span and high > values.max() + 0.03 * span
    assert low > values.min() - 0.2 * span and high < values.max() + 0.2 * span  # a margin, not a zoom-out


@pytest.mark.slow
def test_text_is_typed_where_the_run_encodes_text():
    """The real-text demo run takes typed text (BOS, then byte b as id b + 1); a synthetic-task run takes ids only."""
    app = open_page("views/depth_attention.py")
    app.multiselect(key="depth-runs").set_value([str(DEMO_RUNS / "depth-block-6l")]).run()
    assert "text I type" not in app.radio(key="depth-token-input-source").options
    app.multiselect(key="depth-runs").set_value([str(DEMO_RUNS / "shakespeare-block-6l")]).run()
    app.radio(key="depth-token-input-source").set_value("text I type").run()
    app.text_input(key="depth-token-input-text").input("Good morrow").run()
    assert_clean(app)
    per_token = next(spec for spec in chart_specs(app) if "per token" in spec["layout"]["title"]["text"])
    labels = ["BOS", *"Good", "␣", *"morrow"]  # the tokens by their bytes (BOS, then byte b as id b + 1)
    assert list(per_token["data"][0]["y"]) == [f"{position}: {label}" for position, label in enumerate(labels)]

    app = open_page("views/attribution.py")
    app.selectbox(key="attribution-run").set_value(str(DEMO_RUNS / "shakespeare-block-6l")).run()
    app.radio(key="attribution-prompt-source").set_value("text I type").run()
    app.text_input(key="attribution-prompt-text").input("O").run()  # BOS and one byte: one position to attribute
    assert_clean(app)
    app.text_input(key="attribution-prompt-text").input("").run()
    assert any("the input is empty" in element.value for element in app.error)


@pytest.mark.slow
def test_depth_mixing_page_scrubs_through_training():
    app = open_page("views/depth_mixing.py")
    app.multiselect(key="mixing-runs").set_value([str(DEMO_RUNS / "depth-full-6l")]).run()
    slider = app.select_slider(key="mixing-step")
    late = chart_specs(app)[0]["data"][0]["z"]
    slider.set_value(slider.options[0]).run()
    assert_clean(app)
    early = chart_specs(app)[0]["data"][0]["z"]
    assert early != late and "step 0" in chart_specs(app)[0]["layout"]["title"]["text"]
    app.radio(key="mixing-source").set_value("a checkpoint's model").run()
    assert_clean(app)
    assert "M (step_" in chart_specs(app)[0]["layout"]["title"]["text"]  # the checkpoint the model came from


@pytest.mark.slow
def test_step_slider_changes_the_depth_heatmap():
    app = open_page("views/depth_attention.py")
    slider = app.select_slider(key="depth-step")
    steps = slider.options
    assert len(steps) > 2
    late = chart_specs(app)[0]["data"][0]["z"]
    slider.set_value(steps[0]).run()  # step 0: zero-initialised queries, uniform weights
    assert_clean(app)
    early = chart_specs(app)[0]["data"][0]["z"]
    assert early != late
    assert "step 0" in chart_specs(app)[0]["layout"]["title"]["text"]


@pytest.mark.slow
def test_per_token_view_rejects_bad_token_ids_with_a_message():
    app = open_page("views/depth_attention.py")
    app.radio(key="depth-token-input-source").set_value("token ids I type").run()
    app.text_input(key="depth-token-input-ids").input("1 2 9999").run()
    assert not app.exception
    assert any("out of range" in element.value for element in app.error)


@pytest.mark.slow
def test_live_induction_scores_and_pruning_report_compute():
    app = open_page("views/induction.py")
    run = str(DEMO_RUNS / "induction-1l-kvshift")
    app.selectbox(key="induction-run").set_value(run).run()
    app.selectbox(key="induction-metric").set_value("tl_induction_score").run()
    assert_clean(app)
    titles = [spec["layout"]["title"]["text"] for spec in chart_specs(app)]
    assert any("detect_head" in title for title in titles)

    app.switch_page("views/pruning.py").run()
    app.selectbox(key="pruning-run").set_value(run).run()
    app.button(key="pruning-compute").click().run()
    assert_clean(app)
    frames = app.get("iframe")
    assert len(frames) == 1, "the pruning report was not shown"
    report = frames[0].proto.srcdoc
    # every summary table once: in the report, none beside it in narrow columns
    assert not app.dataframe and report.count("<h2>Sublayers removable within") == 1
    assert report.count("<h2>Cheap metrics vs measured removal effect") == 1


@pytest.mark.slow
def test_attribution_page_computes_and_toggles_the_edge_path():
    app = open_page("views/attribution.py")
    app.selectbox(key="attribution-run").set_value(str(DEMO_RUNS / "depth-full-6l")).run()
    assert_clean(app)
    assert any("Training timeline" in spec["layout"]["title"]["text"] for spec in chart_specs(app))
    app.number_input(key="attribution-samples").set_value(3).run()
    app.button(key="attribution-compute").click().run()
    assert_clean(app)
    titles = [spec["layout"]["title"]["text"] for spec in chart_specs(app)]
    assert any("Direct logit attribution" in title for title in titles)
    assert any(title.startswith("Edge knockouts: exact") for title in titles)
    assert any(title.startswith("First-order sensitivity (total") for title in titles)
    total = next(
        spec for spec in chart_specs(app) if spec["layout"]["title"]["text"].startswith("First-order sensitivity (")
    )
    app.radio(key="attribution-edge-path").set_value("routing_path").run()
    assert_clean(app)
    routing = next(
        spec for spec in chart_specs(app) if spec["layout"]["title"]["text"].startswith("First-order sensitivity (")
    )
    assert "routing path" in routing["layout"]["title"]["text"] and routing["data"][0]["z"] != total["data"][0]["z"]


@pytest.mark.parametrize("run", ["induction-1l-vanilla", "induction-1l-kvshift"])
@pytest.mark.slow
def test_kv_shift_decomposition_only_for_models_with_kv_shift(run):
    app = open_page("views/attribution.py")
    app.selectbox(key="attribution-run").set_value(str(DEMO_RUNS / run)).run()
    app.number_input(key="attribution-samples").set_value(2).run()
    app.button(key="attribution-compute").click().run()
    assert_clean(app)
    titles = [spec["layout"]["title"]["text"] for spec in chart_specs(app)]
    drawn = any(title.startswith("KV-shift decomposition") for title in titles)
    said = any("no KV shift to decompose" in info.value for info in app.info)
    assert (drawn, said) == ((True, False) if run.endswith("kvshift") else (False, True)), titles


@pytest.mark.slow
def test_broken_run_directories_show_messages_not_tracebacks(tmp_path):
    shutil.copytree(DEMO_RUNS / "induction-1l-kvshift", tmp_path / "good")
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text("{not json")
    truncated = tmp_path / "truncated-checkpoint"
    shutil.copytree(DEMO_RUNS / "induction-1l-kvshift", truncated)
    for weights in (truncated / "checkpoints").glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])

    app = open_page("views/runs.py", runs=tmp_path)
    assert not app.exception
    errors = " ".join(element.value for element in app.error)
    assert "config.json is missing" in errors and "not valid JSON" in errors
    assert len(app.dataframe[0].value) == 2

    app.session_state["selected_runs"] = [str(truncated)]
    app.switch_page("views/induction.py").run()
    assert not app.exception
    assert any("corrupt or truncated" in element.value for element in app.error)


# What the browser's renderer finds in parsed text, which markdown-it's CommonMark parser leaves as text: GFM's
# extended autolinks (a URL, a "www." host, an e-mail address) and Streamlit's emoji, icons and directives
FOUND_IN_TEXT = {
    "gfm_autolink": re.compile(r"(?i)https?://|\bwww\.|[\w.+-]@[\w-]+\.\w"),
    "streamlit_syntax": re.compile(r":(?:material/|streamlit:|[\w+-]+:|[a-z][a-z0-9-]*\[)"),
}


def rendered(markdown: str) -> tuple[str, set[str]]:
    """What a browser shows for Streamlit Markdown (CommonMark and GFM tables, strikethrough), as (text as it reads,
    the token types it becomes, with the `FOUND_IN_TEXT` kinds in its text): independent of the app's escaping."""

    def walk(tokens):
        for token in tokens:
            yield token
            yield from walk(token.children or [])

    tokens = list(walk(MARKDOWN.parse(markdown)))
    text = "".join(
        token.content if token.type in ("text", "code_inline") else " " if "break" in token.type else ""
        for token in tokens
    )
    kinds = {token.type for token in tokens} | {kind for kind, found in FOUND_IN_TEXT.items() if found.search(text)}
    visible = "".join(char for char in text if unicodedata.category(char) != "Cf")  # format characters are invisible
    return visible, kinds


def page_markdown(app: AppTest) -> list[str]:
    """Every string on the page that Streamlit renders as Markdown: titles, headers, captions, messages, expander
    labels, radio options and help tooltips."""
    texts = [
        element.value
        for kind in ("title", "header", "subheader", "caption", "markdown", "info", "warning", "error", "success")
        for element in getattr(app, kind)
    ]
    texts += [expander.label for expander in app.expander]
    texts += [option for radio in app.radio for option in radio.options]
    texts += [
        element.proto.help
        for kind in ("text_input", "selectbox", "multiselect", "number_input", "radio")
        for element in getattr(app, kind)
        if element.proto.help
    ]
    return texts


@pytest.mark.slow
def test_the_runs_folder_box_never_leaves_the_served_folder(tmp_path):
    """The dashboard serves the folder it was started on (issue 41 item 1): the Runs folder box moves to folders under
    it and refuses any other path by name, a symbolic link that leads out included; nothing outside is listed, opened
    or quoted in a message."""
    served, outside = tmp_path / "served", tmp_path / "outside"
    shutil.copytree(DEMO_RUNS / "induction-1l-vanilla", served / "top-run")
    shutil.copytree(DEMO_RUNS / "induction-1l-kvshift", served / "group" / "inner-run")
    shutil.copytree(DEMO_RUNS / "induction-1l-kvshift", outside / "private-run")
    secret = "secret_field_4711"  # what the server could read outside: an error message would quote this key
    (outside / "private-config").mkdir()
    (outside / "private-config" / "config.json").write_text(json.dumps({"model": {secret: 1}, "task": {}, "train": {}}))
    (served / "link-out").symlink_to(outside, target_is_directory=True)
    (served / "linked-run").symlink_to(outside / "private-run", target_is_directory=True)
    (served / "borrowed-config").mkdir()
    (served / "borrowed-config" / "config.json").symlink_to(outside / "private-config" / "config.json")

    def shown(app: AppTest) -> str:
        texts = [rendered(text)[0] for text in page_markdown(app)]
        return " ".join(texts + [app.dataframe[0].value.to_string()] if app.dataframe else texts)

    app = open_page("views/runs.py", runs=served)
    assert list(app.dataframe[0].value["run"]) == ["top-run"]
    errors = {rendered(error.value)[0].split(":")[0]: rendered(error.value)[0] for error in app.error}
    for link in ("linked-run", "borrowed-config", "link-out"):
        assert "leads outside the folder this dashboard serves" in errors[link] and str(served) in errors[link], errors
    assert secret not in shown(app) and "private-run" not in shown(app)

    for typed in (
        str(outside),
        str(outside / "private-run"),
        str(outside / "private-config"),
        str(served / "link-out"),
        str(served / "linked-run"),
        "../outside",
        "/",
    ):
        app.text_input[0].input(typed).run()
        refusals = [rendered(error.value)[0] for error in app.error if "is outside the folder" in error.value]
        assert len(refusals) == 1 and refusals[0].startswith(
            f"{typed} is outside the folder this dashboard serves, {served};"
        ), (typed, refusals)
        assert list(app.dataframe[0].value["run"]) == ["top-run"], typed  # still the served folder's runs
        assert secret not in shown(app), typed  # the refusal names the typed path, nothing read there

    (served / "loop-a").symlink_to(served / "loop-b")  # a symbolic link loop cannot be resolved: a message
    (served / "loop-b").symlink_to(served / "loop-a")
    app.text_input[0].input("loop-a").run()
    assert not app.exception, [element.value for element in app.exception]
    assert any("loop-a cannot be resolved" in rendered(error.value)[0] for error in app.error)

    app.text_input[0].input("group").run()  # relative to the served folder
    assert_clean(app)
    assert list(app.dataframe[0].value["run"]) == ["inner-run"]
    assert f"Runs folder: {served / 'group'} (under {served})" in rendered(app.sidebar.caption[0].value)[0]
    app.switch_page("views/induction.py").run()
    assert_clean(app)
    assert app.selectbox(key="induction-run").value == str(served / "group" / "inner-run")


HOSTILE = (
    "![pixel](http://tracker.invalid/p.png) <img src=http://tracker.invalid/q.png> www.tracker.invalid "
    "me@tracker.invalid **bold** :red[red] :material/home: :smile: $x$"
)


@pytest.mark.slow
def test_text_from_run_files_is_shown_as_text_on_every_page(tmp_path):
    """A provenance source, an unknown config key and a run folder's name holding Markdown and HTML (issue 41 item
    3): on every page each is shown literally, never as an image, a link or HTML, in messages, titles, captions,
    expander labels and radio options, and figure titles and legends hold it escaped (Plotly reads them as HTML)."""
    imported = tmp_path / "imported"
    shutil.copytree(DEMO_RUNS / "depth-block-6l", imported)
    (imported / "metrics.jsonl").unlink()
    shutil.rmtree(imported / "records")
    config = json.loads((imported / "config.json").read_text())
    (imported / "config.json").write_text(json.dumps({**config, "provenance": {"source": HOSTILE}}))
    odd_name = "![p](p.png) <b>bold _run_"  # a folder name cannot hold a slash, so no absolute URL
    shutil.copytree(DEMO_RUNS / "depth-full-6l", tmp_path / odd_name)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({**config, "model": {HOSTILE: 1}}))

    app = open_page("views/runs.py", runs=tmp_path)
    app.multiselect(key="runs-pick").set_value([str(imported), str(tmp_path / odd_name)]).run()
    seen = []
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception, (page, [element.value for element in app.exception])
        for text in page_markdown(app) + [caption.value for caption in app.sidebar.caption]:
            shown, kinds = rendered(text)
            assert not kinds & {"image", "link_open", "html_inline", "html_block", *FOUND_IN_TEXT}, (page, text)
            seen.append(shown)
        for spec in chart_specs(app):
            titles = [spec["layout"]["title"]["text"], *(trace.get("name", "") for trace in spec["data"])]
            assert not [title for title in titles if "<b>bold" in title or "<img" in title], (page, titles)
    seen = " ".join(seen)
    assert HOSTILE in seen and odd_name in seen  # shown, literally
    assert f"unknown ModelConfig field(s) ['{HOSTILE}']" in seen  # the broken run's error, quoting the key


def test_html_reports_show_run_text_as_text():
    """The pruning report (shown on the Pruning page) and the attribution report (`attnres-lens attribute`) escape
    run-derived text: a run, variant or checkpoint holding `<img src=…>` is text in the report, never an element."""
    from html.parser import HTMLParser

    from attnres_lens import load_run
    from attnres_lens.analysis.attribution_report import (
        attribution_report_html,
        attribution_summary,
        attribution_tables,
    )
    from attnres_lens.analysis.report import prune_report_html
    from attnres_lens.analysis.run import REMOVAL_TOLERANCE, prune_summary, prune_tables

    class Elements(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags, self.text = [], []

        def handle_starttag(self, tag, attrs) -> None:
            self.tags.append((tag, dict(attrs)))

        def handle_data(self, data) -> None:
            self.text.append(data)

    hostile = "<img src=http://tracker.invalid/p.png> & <b>bold"
    run = load_run(DEMO_RUNS / "induction-1l-kvshift")
    batch = run.config.build_task().eval_batch(2)
    header = {"run": hostile, "checkpoint": hostile, "variant": hostile, "samples": 2}
    pruning = prune_tables(run.model, batch)
    attribution = attribution_tables(run.model, batch, batch.tokens[:1], n_boot=10)
    reports = {
        "pruning": prune_report_html(pruning, prune_summary(pruning, header), "loss", REMOVAL_TOLERANCE),
        "attribution": attribution_report_html(attribution, attribution_summary(attribution, header)),
    }
    for name, report in reports.items():
        parsed = Elements()
        parsed.feed(report)
        assert not [attrs for tag, attrs in parsed.tags if tag in ("img", "b")], name
        assert not [attrs for tag, attrs in parsed.tags if any("tracker" in str(value) for value in attrs.values())]
        assert hostile in "".join(parsed.text), name  # in the title and the header line, as text


@pytest.mark.slow
def test_a_damaged_checkpoint_index_is_a_message_on_every_page(tmp_path):
    run = tmp_path / "damaged"
    shutil.copytree(DEMO_RUNS / "depth-full-6l", run)
    (run / "checkpoints" / "index.json").write_text("[]")
    shutil.copytree(DEMO_RUNS / "depth-block-6l", tmp_path / "good")
    app = open_page("views/runs.py", runs=tmp_path)
    assert any("index.json is not a checkpoint index" in element.value for element in app.error)
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception, (page, [element.value for element in app.exception])


@pytest.mark.slow
def test_every_residual_kind_renders_every_page(tmp_path):
    """DenseFormer, mHC and an AttnRes ablation (tiny runs trained here) on every page, with the kind in the table."""
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    for name, overrides in {
        "dense": ["model.residual=denseformer"],
        "mhc": ["model.residual=mhc"],
        "sigmoid": ["model.attnres_score=sigmoid"],
    }.items():
        train(
            apply_overrides(get_preset("smoke"), [*overrides, "train.steps=10", "train.checkpoint_every=10"]),
            tmp_path / name,
            progress=False,
        )
    app = open_page("views/runs.py", runs=tmp_path)
    kinds = set(app.dataframe[0].value["residual"])
    assert {"DenseFormer", "mHC n=4", "Block AttnRes S=2 (sigmoid)"} <= kinds, kinds
    for run in ("dense", "mhc", "sigmoid"):
        app.session_state["selected_runs"] = [str(tmp_path / run)]
        for page in PAGES:
            app.switch_page(page).run()
            assert not app.exception, (run, page, [element.value for element in app.exception])
            assert not app.error, (run, page, [element.value for element in app.error])


@pytest.mark.slow
def test_a_run_that_has_only_started_renders_every_page(tmp_path):
    """config.json written, no metrics, records or checkpoints yet: messages, never a traceback."""
    (tmp_path / "started").mkdir()
    shutil.copy(DEMO_RUNS / "depth-block-6l" / "config.json", tmp_path / "started" / "config.json")
    app = open_page("views/runs.py", runs=tmp_path)
    app.session_state["selected_runs"] = [str(tmp_path / "started")]
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception, (page, [element.value for element in app.exception])
        assert not app.error, (page, [element.value for element in app.error])


@pytest.mark.slow
def test_models_keep_no_hooks_after_the_pages_ran():
    """Cached models are shared by all sessions: every forward pass must remove the hooks it added."""
    from attnres_lens import HookedTransformer

    app = open_page("views/depth_attention.py")  # per-token view
    app.switch_page("views/induction.py").run()  # attention pattern of a head
    assert_clean(app)
    models = [obj for obj in gc.get_objects() if type(obj) is HookedTransformer]
    assert models
    for model in models:
        for hook_point in model.hook_dict.values():
            assert not hook_point._forward_hooks and not hook_point._backward_hooks, hook_point.name


@pytest.mark.slow
def test_pages_without_a_run_to_show_say_so(tmp_path):
    (tmp_path / "empty").mkdir()
    for page in PAGES[1:]:
        app = open_page(page, runs=tmp_path)
        assert_clean(app)
        expected = "No AttnRes run" if page == "views/depth_attention.py" else "No readable runs in this folder."
        assert any(expected in info.value for info in app.info), (page, [info.value for info in app.info])


@pytest.mark.slow
def test_pages_score_what_the_commands_score_and_draw_recorded_mixing_without_a_model(tmp_path):
    """A run whose task seed is not 0: the Induction page's scores at a checkpoint are `analyze`'s (the same probe,
    `task_probe`; the page once drew its probe from seed 0). A run without checkpoints still shows its recorded M.
    A negative M (DenseFormer's weights are unconstrained) is drawn on the signed scale centred on zero."""
    from attnres_lens import load_run
    from attnres_lens.analysis.induction import induction_head_scores, task_probe
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    runs = tmp_path / "runs"
    train(
        apply_overrides(
            get_preset("smoke"),
            ["train.seed=3", "task.seed=3", "train.steps=10", "train.checkpoint_every=10", "train.record_every=10"],
        ),
        runs / "seed3",
        progress=False,
    )
    loaded = load_run(runs / "seed3")
    expected = induction_head_scores(loaded.model, task_probe(loaded.model, loaded.config.build_task(), 16))
    app = open_page("views/induction.py", runs=runs)
    app.selectbox(key="induction-metric").set_value("tl_induction_score").run()
    assert_clean(app)
    heatmap = next(spec for spec in chart_specs(app) if "detect_head" in spec["layout"]["title"]["text"])
    z = heatmap["data"][0]["z"]  # plotly's typed-array form: base64 bytes of a float64 array
    shown = sorted(np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).tolist())
    assert shown == pytest.approx(sorted(expected["tl_induction_score"]), abs=1e-6)

    train(
        apply_overrides(
            get_preset("smoke"),
            ["model.residual=standard", "train.steps=10", "train.checkpoint_every=10", "train.record_every=10"],
        ),
        runs / "standard",
        progress=False,
    )
    for run in ("seed3", "standard"):  # AttnRes and the standard residual both record M
        shutil.copytree(runs / run, runs / f"{run}_no_checkpoint")
        shutil.rmtree(runs / f"{run}_no_checkpoint" / "checkpoints")
        app = open_page("views/depth_mixing.py", runs=runs)
        app.multiselect(key="mixing-runs").set_value([str(runs / f"{run}_no_checkpoint")]).run()
        assert_clean(app)
        assert not app.warning and "M (step 10)" in chart_specs(app)[0]["layout"]["title"]["text"], run

    import importlib.util

    spec = importlib.util.spec_from_file_location("figures_under_test", REPO_ROOT / "apps" / "lens_ui" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    frame = load_run(runs / "seed3", load_model=False).records["depth_mixing"]
    frame = frame[frame["step"] == 10].assign(weight=lambda f: f["weight"] - 0.5)
    trace = figures.mixing_heatmap(frame, "M", float(frame["weight"].max()), float(frame["weight"].min())).data[0]
    assert trace.zmid == 0 and trace.zmin == -trace.zmax and trace.zmax >= 0.5


@pytest.mark.slow
def test_on_demand_results_keep_only_the_most_recently_shown(monkeypatch):
    """A pruning result holds its HTML report: the store keeps COMPUTED_KEEP results, the least recently shown
    going first, instead of every one for the server's life (a run still training makes a new key per line)."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "apps"))
    from lens_ui import widgets

    store = widgets._computed_results()
    store.clear()
    keep = widgets.COMPUTED_KEEP
    for key in range(keep):
        store[("page", key)] = f"result {key}"
    assert widgets.computed_on_demand("page", (0,), "go", None, "failed", "waiting") == "result 0"  # shown again
    store[("page", keep)] = "one more"
    assert widgets.computed_on_demand("page", (keep,), "go", None, "failed", "waiting") == "one more"
    assert len(store) == keep and ("page", 0) in store and ("page", 1) not in store
    store.clear()


@pytest.mark.slow
def test_every_page_opens_a_run_referring_to_a_transformers_folder(hf_runs):
    """Runs made by import-hf (Inkling-2, the looped Mini): every page renders them, with a message where an analysis
    does not apply, and the pruning and attribution pages compute on the bridged model."""
    served = hf_runs["plain"].parent
    app = open_page("views/runs.py", served)
    assert_clean(app)
    for kind in ("plain", "loop"):
        run = str(hf_runs[kind])
        app.switch_page("views/runs.py").run()
        app.multiselect(key="runs-pick").set_value([run]).run()
        for page in PAGES[1:]:
            app.switch_page(page).run()
            assert_clean(app)
        app.switch_page("views/depth_attention.py").run()
        assert chart_specs(app), f"no depth map of the {kind} run"
        app.switch_page("views/depth_mixing.py").run()
        app.radio(key="mixing-source").set_value("a checkpoint's model").run()
        assert_clean(app)  # M refuses Inkling (layer 0 reads the embedding directly): a message, with the reason
        assert chart_specs(app) or any("Not computed" in message.value for message in app.info), kind
        app.switch_page("views/induction.py").run()
        app.selectbox(key="induction-run").set_value(run).run()
        app.selectbox(key="induction-metric").set_value("prefix_score").run()
        app.slider(key="induction-samples").set_value(4).run()
        assert_clean(app)
        titles = [spec["layout"]["title"]["text"] for spec in chart_specs(app)]
        assert any(title.startswith("prefix-matching score") for title in titles), kind  # scored per visit
        assert any("attention on [BOS, r, r]" in title for title in titles), kind  # a head's pattern
        heatmap = next(spec for spec in chart_specs(app) if spec["layout"]["title"]["text"].startswith("prefix"))
        assert any("@" in row for row in heatmap["data"][0]["y"]) == (kind == "loop")  # the Mini's visits apart
        app.selectbox(key="induction-metric").set_value("copying_score").run()
        assert any("copying_score" in message.value for message in app.info), kind  # NaN on the bridge, and why
        if kind == "plain":  # the page only shows prune_tables' report: the Mini's visits are checked on the CLI's
            app.switch_page("views/pruning.py").run()
            app.selectbox(key="pruning-run").set_value(run).run()
            app.number_input(key="pruning-samples").set_value(8).run()
            app.button(key="pruning-compute").click().run()
            assert_clean(app)
            assert "<h2>Sublayers removable within" in app.get("iframe")[0].proto.srcdoc
        app.switch_page("views/attribution.py").run()
        app.selectbox(key="attribution-run").set_value(run).run()
        app.number_input(key="attribution-samples").set_value(4).run()
        app.button(key="attribution-compute").click().run()
        assert_clean(app)
        titles = [spec["layout"]["title"]["text"] for spec in chart_specs(app)]
        assert any(title.startswith("Edge knockouts: exact") for title in titles), kind
        assert any(title.startswith("Direct logit attribution") for title in titles), kind
        assert any(title.startswith("K/V convolution taps") for title in titles), kind


def test_every_page_opens_a_deepseek_v4_run(deepseek_v4_run):  # a few seconds: in the fast lane
    """A run made by import-hf from a DeepSeek V4 folder (mHC): every page renders it, the Depth-mixing page draws
    its M as the bridge computes it, the Attribution page its depth DLA, and the pages and tabs that need depth
    attention, induction heads or K/V taps say why they show nothing."""
    import torch

    from attnres_lens.analysis.applicability import INDUCTION_TOOLKIT_ONLY
    from attnres_lens.rundir import load_run

    run = str(deepseek_v4_run)
    app = open_page("views/runs.py", deepseek_v4_run.parent)
    app.multiselect(key="runs-pick").set_value([run]).run()
    for page in PAGES[1:]:
        app.switch_page(page).run()
        assert_clean(app)
    app.switch_page("views/depth_attention.py").run()
    assert any("depth attention exists only with `residual=attnres`" in message.value for message in app.info)
    app.switch_page("views/depth_mixing.py").run()
    app.radio(key="mixing-source").set_value("a checkpoint's model").run()
    app.slider(key="mixing-n").set_value(4).run()
    assert_clean(app)
    (spec,) = chart_specs(app)
    loaded = load_run(run)
    with torch.no_grad():
        expected = loaded.model.mixing_coefficients(loaded.config.build_task().eval_batch(4).tokens).mean(dim=(0, 1))
    expected = np.where(np.tril(np.ones(expected.shape, dtype=bool)), expected.double().numpy(), np.nan)
    z = spec["data"][0]["z"]  # plotly's typed-array form: base64 bytes of a float64 array
    shown = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).reshape(expected.shape)
    np.testing.assert_allclose(shown, expected, rtol=1e-6)
    app.switch_page("views/induction.py").run()
    messages = " ".join(message.value for message in app.info)
    assert INDUCTION_TOOLKIT_ONLY.split(" (")[0] in messages and "neither a KV shift nor short K/V" in messages
    app.switch_page("views/pruning.py").run()
    app.number_input(key="pruning-samples").set_value(2).run()
    app.button(key="pruning-compute").click().run()
    assert_clean(app)
    report = app.get("iframe")[0].proto.srcdoc
    assert "<h2>Sublayers removable within" in report
    app.switch_page("views/attribution.py").run()
    app.number_input(key="attribution-samples").set_value(2).run()
    app.button(key="attribution-compute").click().run()
    assert_clean(app)
    titles = [spec["layout"]["title"]["text"] for spec in chart_specs(app)]
    assert any(title.startswith("Logit lens over depth") for title in titles)
    assert any(title.startswith("Direct logit attribution") for title in titles)  # the bridge's frozen_readout
    messages = " ".join(message.value for message in app.info)
    assert "(kv_shift)" in messages
    for table in ("depth_dla", "depth_inputs"):  # computed: split by M, as on the toolkit's mHC runs
        assert f"({table})" not in messages, table
    assert "no edges to attribute (its depth DLA treats e and every f_j as sources)." in messages
