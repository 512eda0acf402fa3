"""Widgets shared by the pages: run pickers, figures with HTML/PNG export, checkpoint and token inputs."""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import streamlit as st
import torch
from lens_ui.data import (
    SELECTION_KEY,
    SHOWN_KEY,
    ModelHandle,
    RunTables,
    all_runs,
    describe_error,
    load_model,
    selected_paths,
)
from lens_ui.text import plain

PLOTLY_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}


# ---------------------------------------------------------------------------- runs
def loadable_runs(
    predicate: Callable[[RunTables], bool] | None = None, none_message: str = "No readable runs in this folder."
) -> list[RunTables]:
    """Loadable runs (optionally filtered); with none, `none_message` on the page and the page stops there."""
    runs, broken = all_runs()
    if broken:
        st.caption(f"{len(broken)} run folder(s) could not be read; see the Runs page.")
    if predicate is not None:
        runs = [run for run in runs if predicate(run)]
    if not runs:
        st.info(none_message)
        st.stop()
    return runs


def _select(paths: list[str]) -> None:
    """Make `paths` the selection: the one state every page's run picker shows and the sidebar reports."""
    st.session_state[SELECTION_KEY] = list(paths)


UNREADABLE = "it is not among the readable runs of this folder"  # why a page without a run filter leaves one out


def _starting_choice(
    runs: list[RunTables],
    fallback: int,
    max_runs: int | None,
    prefer: Callable[[RunTables], bool] | None = None,
    unshowable: str = UNREADABLE,
) -> list[str]:
    """The selected runs this page can show, else the first `fallback` (preferred) runs. With nothing selected these
    become the selection, so the sidebar names the runs on the page; a selection the page cannot show is kept (it
    changes only when the user picks) and the page says why (`unshowable`) and which runs it shows instead."""
    by_path = {run.path: run for run in runs}
    selected = selected_paths()
    chosen = [path for path in selected if path in by_path]
    left_out = [plain(Path(path).name) for path in selected if path not in by_path]
    if not chosen:
        preferred = [run.path for run in runs if prefer is None or prefer(run)] or [run.path for run in runs]
        chosen = preferred[:fallback]
        if not selected:
            _select(chosen)
    chosen = chosen[:max_runs] if max_runs else chosen
    if left_out:
        shown = ", ".join(plain(by_path[path].name) for path in chosen)
        st.info(
            f"Selected run{'s' if len(left_out) > 1 else ''} {', '.join(left_out)} not shown here: {unshowable}. "
            f"Showing {shown}; pick below to change the selection.",
            icon=":material/info:",
        )
    st.session_state[SHOWN_KEY] = chosen
    return chosen


def pick_runs(
    runs: list[RunTables],
    key: str,
    max_runs: int | None = 2,
    label: str = "Runs",
    fallback: int = 1,
    unshowable: str = UNREADABLE,
) -> list[RunTables]:
    """A multiselect over `runs`, showing (and changing) the selection; with none, the first `fallback` runs.
    `unshowable`: why a selected run missing from `runs` is not shown (the page says so)."""
    by_path = {run.path: run for run in runs}
    st.session_state[key] = _starting_choice(runs, fallback, max_runs, unshowable=unshowable)  # the widget follows
    chosen = st.multiselect(
        label,
        list(by_path),
        key=key,
        max_selections=max_runs,
        format_func=lambda path: by_path[path].label,
        on_change=lambda: _select(st.session_state[key]),
    )
    return [by_path[path] for path in chosen]


def pick_run(
    runs: list[RunTables], key: str, label: str = "Run", prefer: Callable[[RunTables], bool] | None = None
) -> RunTables:
    """A selectbox over `runs`: the first selected run, else the first `prefer`red one; picking one selects it."""
    by_path = {run.path: run for run in runs}
    st.session_state[key] = _starting_choice(runs, 1, 1, prefer)[0]

    def select_first() -> None:  # the picked run leads the selection; a second selected run stays second
        _select(list(dict.fromkeys([st.session_state[key], *selected_paths()]))[:2])

    path = st.selectbox(label, list(by_path), key=key, format_func=lambda p: by_path[p].label, on_change=select_first)
    return by_path[path]


def pick_model(run: RunTables, key: str) -> ModelHandle | None:
    """Checkpoint selectbox, then the cached model; an error message (and None) if it cannot be loaded."""
    if not run.checkpoints:
        st.warning(f"Run {plain(run.name)} has no checkpoint yet, so nothing can be computed with its model.")
        return None
    checkpoint = st.selectbox(
        "Checkpoint", run.checkpoints, key=key, help="latest / best (lowest eval loss) or a kept checkpoint"
    )
    handle, error = load_model(run, checkpoint)
    if error:
        st.error(f"Cannot load checkpoint {plain(repr(checkpoint))} of {plain(run.name)}: {plain(error)}")
    return handle


# ---------------------------------------------------------------------------- computed on demand
# finished results kept, the least recently shown dropped first: a pruning result holds its HTML report (MBs with
# plotly inlined), and a run still training gets a new key with every metrics line
COMPUTED_KEEP = 16
_STORE_LOCK = threading.Lock()


@st.cache_resource(max_entries=1)
def _computed_results() -> dict[tuple, Any]:
    """Finished on-demand computations by (page, key), shared by sessions, in the order they were last shown. A
    plain dict rather than st.cache_data, because the computations report progress to widgets created outside
    them."""
    return {}


def computed_on_demand(
    page: str,
    key: tuple,
    button: str,
    compute: Callable[[Callable[[float, str], Any]], Any],
    failure: str,
    waiting: str,
) -> Any:
    """The result of `compute(progress)` for `key`, computed when the user presses `button` (with a progress bar)
    and kept while it is among the `COMPUTED_KEEP` most recently shown; stops the page with `waiting` until then,
    and shows `failure: error` as a message instead of a traceback."""
    store, full_key = _computed_results(), (page, *key)
    if full_key not in store and st.button(button, type="primary", key=f"{page}-compute"):
        bar = st.progress(0.0, text="starting…")
        try:
            result = compute(lambda done, text: bar.progress(done, text=text))
            with _STORE_LOCK:
                store[full_key] = result
        except Exception as err:  # noqa: BLE001 - a bad checkpoint or task config becomes a message
            st.error(f"{failure}: {plain(describe_error(err))}")
        bar.empty()
    with _STORE_LOCK:  # sessions run in threads of one server
        found = full_key in store
        if found:
            store[full_key] = result = store.pop(full_key)  # now the most recently shown
            while len(store) > COMPUTED_KEEP:
                store.pop(next(iter(store)))
    if not found:
        st.info(waiting)
        st.stop()
    return result


# ---------------------------------------------------------------------------- inputs
TEXT_EXAMPLE = "To be, or not to be"  # the typed-text box's starting value


def repeated_tokens_input(run: RunTables, key: str, max_len: int) -> torch.Tensor:
    """[1, 2L+1] repeated random tokens [BOS, r, r] from the run's task vocabulary; L and seed from widgets."""
    from attnres_lens.analysis.induction import repeated_batch

    vocab = run.build_task().vocab_size
    longest = max(2, (max_len - 1) // 2)
    left, right = st.columns(2)
    half_len = left.number_input("Half length L", 2, longest, min(16, longest), key=f"{key}-half")
    seed = right.number_input("Seed", 0, 10_000, 0, key=f"{key}-seed")
    return repeated_batch(1, int(half_len), vocab, int(seed)).tokens


def token_input(
    run: RunTables, handle: ModelHandle, key: str, label: str, default: str, default_tokens: Callable[[], torch.Tensor]
) -> torch.Tensor | None:
    """[1, pos] tokens: the page's `default` input, text the user types (where the run encodes text:
    `prompts.text_codec`) or ids the user types; typed input is checked as `--prompt` is, errors shown on the page."""
    from attnres_lens.analysis.prompts import encode_prompt, encodes_text, text_codec

    typed_text = ["text I type"] if encodes_text(run.config) else []
    source = st.radio(label, [default, *typed_text, "token ids I type"], horizontal=True, key=f"{key}-source")
    if source == default:
        return default_tokens()
    n_ctx = run.model_config.n_ctx
    if source == "text I type":
        label = f"Text (at most {n_ctx} tokens through the run's text encoding, BOS included)"
        typed = st.text_input(label, TEXT_EXAMPLE, key=f"{key}-text")
        codec = text_codec(run.config, run.path)
    else:
        typed = st.text_input(
            f"Token ids, space-separated (0…{handle.model.d_vocab - 1}, at most {n_ctx})",
            "0 5 9 13 5 9",
            key=f"{key}-ids",
        )
        codec = None
    try:
        return encode_prompt(handle.model, typed, codec, what="the input", n_ctx=n_ctx).cpu()
    except ValueError as err:
        st.error(plain(err))
        return None


# ---------------------------------------------------------------------------- figures
def show_figure(fig: go.Figure, key: str) -> None:
    """The chart (hover values, modebar) and download buttons for standalone HTML and PNG."""
    st.plotly_chart(fig, key=f"chart-{key}", theme=None, config=PLOTLY_CONFIG)
    buttons = st.container(horizontal=True)
    buttons.download_button(
        "⬇ HTML",
        functools.partial(figure_html, fig),
        file_name=f"{key}.html",
        mime="text/html",
        key=f"html-{key}",
        on_click="ignore",
        help="Standalone HTML with plotly.js embedded (works offline)",
    )
    chrome = png_browser()
    buttons.download_button(
        "⬇ PNG",
        functools.partial(figure_png, fig),
        file_name=f"{key}.png",
        mime="image/png",
        key=f"png-{key}",
        on_click="ignore",
        disabled=chrome is None,
        help="Rendered by kaleido with the local Chromium (takes a few seconds)"
        if chrome
        else "PNG export needs Chromium or Chrome for kaleido; use the camera icon above the chart",
    )


def figure_html(fig: go.Figure) -> str:
    return fig.to_html(include_plotlyjs=True, full_html=True)


def figure_png(fig: go.Figure) -> bytes:
    import kaleido

    # mathjax=False: kaleido would otherwise add a CDN script tag; plotly.js comes from the plotly package.
    width = fig.layout.width or 900
    height = fig.layout.height or 500
    return kaleido.calc_fig_sync(
        fig.to_dict(), opts={"format": "png", "width": width, "height": height, "scale": 2}, kopts={"mathjax": False}
    )


@functools.cache
def png_browser() -> str | None:
    """The Chrome/Chromium kaleido will use, or None (PNG export then disabled)."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return None
    candidates = [os.environ.get("BROWSER_PATH"), "/usr/bin/chromium"]
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")]
    return next((path for path in candidates if path and os.path.isfile(path)), None)
