"""attnres_lens dashboard. Start it with `attnres-lens dashboard [--runs DIR]`, or
`streamlit run apps/app.py -- --runs DIR`; the runs folder defaults to data/demo_runs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent
if str(APP_DIR) not in sys.path:  # page modules import lens_ui, wherever streamlit was started from
    sys.path.insert(0, str(APP_DIR))

import streamlit as st  # noqa: E402
from lens_ui.data import (  # noqa: E402
    DEFAULT_RUNS_DIR,
    SERVED_KEY,
    SHOWN_KEY,
    runs_dir,
    selected_paths,
    served_dir,
    shown_paths,
)
from lens_ui.text import plain  # noqa: E402

ICON = APP_DIR / "assets" / "favicon.svg"  # shipped: a Material icon name as page_icon is fetched from a font CDN


def runs_dir_from_command_line() -> str:
    """--runs after streamlit's `--`, else $ATTNRES_LENS_RUNS, else the demo runs."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--runs", default=os.environ.get("ATTNRES_LENS_RUNS", str(DEFAULT_RUNS_DIR)))
    args, _ = parser.parse_known_args(sys.argv[1:])
    return str(Path(args.runs).expanduser().resolve())


def folder_note() -> str:
    """The sidebar's line on the folder the pages show (and the served one, when that is a folder under it)."""
    folder = runs_dir()
    return f"Runs folder: {plain(folder)}" + ("" if folder == served_dir() else f" (under {plain(served_dir())})")


st.set_page_config(page_title="attnres_lens", page_icon=str(ICON), layout="wide")
if SERVED_KEY not in st.session_state:  # the folder this server was started on; the pages read nothing outside it
    st.session_state[SERVED_KEY] = runs_dir_from_command_line()

PAGES = [
    st.Page("views/runs.py", title="Runs", icon=":material/table_view:", default=True),
    st.Page("views/depth_attention.py", title="Depth attention", icon=":material/grid_on:"),
    st.Page("views/depth_mixing.py", title="Depth-mixing matrix", icon=":material/functions:"),
    st.Page("views/training_dynamics.py", title="Training dynamics", icon=":material/show_chart:"),
    st.Page("views/induction.py", title="Induction heads", icon=":material/repeat:"),
    st.Page("views/pruning.py", title="Pruning", icon=":material/content_cut:"),
    st.Page("views/attribution.py", title="Attribution", icon=":material/account_tree:"),
]
page = st.navigation(PAGES)


with st.sidebar:
    selection = st.empty()
    selection.caption(folder_note())  # while the page runs
st.session_state.pop(SHOWN_KEY, None)  # set again by this page's run picker, if it has one
try:
    page.run()
finally:  # after the page, whose run picker may have set the selection (a page's st.stop() ends up here too)
    picked, shown = selected_paths(), shown_paths()
    text = "Selected: " + (", ".join(plain(Path(p).name) for p in picked) if picked else "none")
    if shown and not set(shown) <= set(picked):  # the page could not show the selection and shows other runs
        text += "  \nShown on this page instead: " + ", ".join(plain(Path(p).name) for p in shown)
    selection.caption(f"{text}  \n{folder_note()}")  # the Runs page may have moved to a folder under the served one
