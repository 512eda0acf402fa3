"""Reading run directories for the dashboard: discovery, cached tables and models, run summaries.

Tables are cached with `st.cache_data` and models with `st.cache_resource`, both keyed by the run's path and a
signature of its files' mtimes and sizes, so a run that is still training shows its new records on the next rerun.
A cached model is shared by every browser session: all forward passes go through `ModelHandle.lock`, and only
through calls that remove their hooks on exit, so one session's hooks never reach another's forward pass.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from lens_ui.text import plain

from attnres_lens import HookedTransformer, ModelConfig, load_run
from attnres_lens.config import RunConfig
from attnres_lens.hf_runs import TransformersModel
from attnres_lens.protocol import DepthMixingModel
from attnres_lens.rundir import RunDir, RunDirError
from attnres_lens.tasks.base import Batch, Task

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RUNS_DIR = REPO_ROOT / "data" / "demo_runs"


@dataclass
class RunTables:
    """What the pages need from a run directory, without its model."""

    path: str
    name: str
    config: RunConfig
    metrics: pd.DataFrame
    records: dict[str, pd.DataFrame]
    checkpoints: list[str]  # "latest", "best", then the kept checkpoint names

    @property
    def model_config(self) -> ModelConfig | TransformersModel:
        """The toolkit model's config, or the transformers folder a run made by import-hf refers to."""
        return self.config.model

    @property
    def refers_to_folder(self) -> bool:
        """A run made by import-hf: its model is a transformers folder, opened through the bridge."""
        return isinstance(self.config.model, TransformersModel)

    @property
    def variant(self) -> str:
        return self.model_config.description

    @property
    def task(self) -> str:
        return self.config.task.name

    def build_task(self) -> Task:
        return self.config.build_task()

    @property
    def label(self) -> str:
        return f"{self.name} ({self.variant})"

    def record(self, table: str) -> pd.DataFrame:
        return self.records.get(table, pd.DataFrame())

    @property
    def imported(self) -> bool:
        """A model trained elsewhere (docs/interop.md §4): one checkpoint, never any metrics or records."""
        return self.config.imported


@dataclass
class LoadResult:
    tables: RunTables | None = None
    error: str | None = None


@dataclass
class ModelHandle:
    model: HookedTransformer | DepthMixingModel  # the bridge for a run made by import-hf
    checkpoint: str
    key: tuple  # (path, checkpoint, file signature): the cache key of results computed with this model
    lock: threading.Lock = field(default_factory=threading.Lock)


def discover_runs(root: Path) -> list[Path]:
    """The runs folder itself if it is a run, else its non-hidden subfolders (each shown, even if broken)."""
    if RunDir(root).holds_run():
        return [root]
    if not root.is_dir():
        return []
    return sorted(child for child in root.iterdir() if child.is_dir() and not child.name.startswith("."))


# ---------------------------------------------------------------------------- the served folder
# The folder given at start (`--runs`) is the only one the dashboard reads (docs/architecture.md §5): anyone who can
# reach the port uses the app, so the "Runs folder" box may only move to folders under it, and a symbolic link
# under it that leads elsewhere counts as elsewhere.
SERVED_KEY = "served_dir"  # set once per session from the command line (apps/app.py); no widget writes it
RUNS_DIR_KEY = "runs_dir"  # the folder the pages show now: the served folder or one under it


def served_dir() -> Path:
    return Path(st.session_state.get(SERVED_KEY, DEFAULT_RUNS_DIR)).resolve()


def is_served(path: Path) -> bool:
    """Whether `path`, symbolic links resolved, is the served folder or lies under it (a link loop is not)."""
    try:
        return path.resolve().is_relative_to(served_dir())
    except (RuntimeError, OSError):  # a symbolic link loop (RuntimeError before Python 3.13)
        return False


def folder_under_served(typed: str) -> Path:
    """The folder the user typed (relative: to the served folder), resolved; ValueError naming it and the served
    folder if it lies outside. Nothing outside is read, so the message never carries another folder's content."""
    served = served_dir()
    try:
        folder = (served / Path(typed.strip()).expanduser()).resolve()
    except (RuntimeError, OSError) as err:  # a symbolic link loop (RuntimeError before Python 3.13)
        raise ValueError(f"{typed.strip()} cannot be resolved ({err}); give a folder under {served}") from None
    if not folder.is_relative_to(served):
        raise ValueError(
            f"{typed.strip()} is outside the folder this dashboard serves, {served}; give that folder or "
            "one under it (to serve another folder, start the dashboard with --runs DIR)"
        )
    return folder


def outside_files(path: Path) -> list[Path]:
    """The files of run `path` that a page would read but that lead outside the served folder (symbolic links)."""
    return [file for file in RunDir(path).watched_files() if file.exists() and not is_served(file)]


def outside_message(what: str) -> str:
    return (
        f"{what} leads outside the folder this dashboard serves ({served_dir()}) through a symbolic link, so it "
        f"is not read"
    )


def run_signature(path: Path) -> tuple:
    """(relative name, mtime, size) of the files a page reads: changes whenever training writes something."""
    signature = []
    for file in RunDir(path).watched_files():
        try:
            stat = file.stat()
        except OSError:
            continue
        signature.append((str(file.relative_to(path)), stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


@st.cache_data(show_spinner=False, max_entries=64)
def _load_tables(path: str, signature: tuple) -> LoadResult:
    del signature  # part of the cache key only
    run_path = Path(path)
    try:
        run = load_run(run_path, load_model=False)
        # a run referring to a transformers folder has one set of weights, its "latest"
        checkpoints = (
            ["latest"] if isinstance(run.config.model, TransformersModel) else RunDir(run_path).read_index().names()
        )
    except Exception as err:  # noqa: BLE001 - any damage becomes a message on the page, never a traceback
        return LoadResult(error=describe_error(err))
    tables = RunTables(path, run_path.name, run.config, run.metrics, run.records, checkpoints)
    return LoadResult(tables=tables)


def load_tables(path: Path) -> LoadResult:
    """The run's tables, or an error; a run (or a file of it) outside the served folder is never read."""
    if not is_served(path):
        return LoadResult(error=outside_message(f"run folder {path.name}"))
    outside = outside_files(path)
    if outside:
        return LoadResult(error=outside_message(f"{outside[0].relative_to(path)} of run {path.name}"))
    return _load_tables(str(path), run_signature(path))


@st.cache_resource(show_spinner="Loading model…", max_entries=16)
def _load_model(path: str, checkpoint: str, signature: tuple) -> ModelHandle:
    run = load_run(path, checkpoint=checkpoint, load_model=True)
    return ModelHandle(run.model, run.checkpoint, (path, checkpoint, signature))


def load_model(tables: RunTables, checkpoint: str) -> tuple[ModelHandle | None, str | None]:
    """The run's model at `checkpoint` ("latest", "best" or a name), or an error message."""
    path = Path(tables.path)
    try:
        if tables.refers_to_folder:  # keyed by the model folder's files: a changed file is re-checked on load
            folder = Path(tables.model_config.folder)
            files = tuple(
                (name, file.stat().st_mtime_ns, file.stat().st_size)
                for name in tables.model_config.files_sha256
                if (file := folder / name).is_file()
            )
            return _load_model(tables.path, checkpoint, (run_signature(path), files)), None
        # keyed by the weights file the alias points to now, so a new "latest" loads the new model
        weights = RunDir(path).weights_path(RunDir(path).resolve_checkpoint(checkpoint))
        if weights.exists() and not is_served(weights):
            return None, outside_message(f"checkpoint {checkpoint} of run {path.name}")
        mtime = weights.stat().st_mtime_ns if weights.is_file() else None
        return _load_model(tables.path, checkpoint, (run_signature(path), mtime)), None
    except Exception as err:  # noqa: BLE001
        return None, describe_error(err)


def describe_error(err: BaseException) -> str:
    if isinstance(err, RunDirError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def last_value(frame: pd.DataFrame, column: str) -> float:
    if column not in frame:
        return math.nan
    values = frame[column].dropna()
    return float(values.iloc[-1]) if len(values) else math.nan


def no_records_message(run: RunTables, what: str, where: str) -> str:
    """Why a page shows no `what` (training records at `where`) for `run`: an imported run never has any; another
    has none yet. Markdown: the run's name and provenance are escaped (`plain`)."""
    if run.imported:
        source = plain(run.config.provenance.get("source", "elsewhere"))
        return (
            f"Run {plain(run.name)} was imported from {source} (trained elsewhere), so it has no training records "
            f"and no {what}; the views computed from its checkpoint work."
        )
    return f"Run {plain(run.name)} has no {what} yet ({where})."


# Runs-table columns that say which positions each metric covers (docs/architecture.md §2, the evaluation metric):
# the loss averages every target position, the answer loss and the accuracy only the task's answer positions.
# Short enough that the table fits a 1500 px window with every column (the Runs page's caption spells them out).
TRAIN_LOSS, EVAL_LOSS = "train loss (all pos.)", "eval loss (all pos.)"
ANSWER_LOSS, ACCURACY = "eval loss (answer pos.)", "accuracy (answer pos.)"


def summary_row(tables: RunTables) -> dict[str, Any]:
    """One Runs-table row; the answer-position loss is NaN for runs that did not log it (`eval_answer_loss` is
    newer than some runs)."""
    cfg = tables.model_config
    metrics = tables.metrics
    last_step = int(metrics["step"].max()) if "step" in metrics and len(metrics) else 0
    total = tables.config.train.steps
    steps = "imported" if tables.imported else f"{last_step}/{total}"  # an imported run's train.steps never ran
    return {
        "run": tables.name,
        "variant": tables.variant,
        "task": tables.task,
        "residual": cfg.residual_label,
        "attention": cfg.attention_label,
        "layers": cfg.n_layers,
        "steps": steps,
        TRAIN_LOSS: last_value(metrics, "loss"),
        EVAL_LOSS: last_value(metrics, "eval_loss"),
        ANSWER_LOSS: last_value(metrics, "eval_answer_loss"),
        ACCURACY: last_value(metrics, "eval_accuracy"),
    }


def runs_dir() -> Path:
    """The folder the pages show: the one picked on the Runs page if it is under the served folder, else that."""
    picked = st.session_state.get(RUNS_DIR_KEY)
    return Path(picked).resolve() if picked and is_served(Path(picked)) else served_dir()


def all_runs() -> tuple[list[RunTables], dict[str, str]]:
    """Loadable runs of the runs folder, and {run name: error} for the broken ones."""
    loaded, broken = [], {}
    for path in discover_runs(runs_dir()):
        result = load_tables(path)
        if result.tables is not None:
            loaded.append(result.tables)
        else:
            broken[path.name] = result.error or "unreadable"
    return loaded, broken


SELECTION_KEY = "selected_runs"  # the runs the pages show: one state, set by any page's run picker
# the runs the current page shows: the selection, or (when the page cannot show a selected run) the ones it offers
# instead; the sidebar names both when they differ
SHOWN_KEY = "shown_runs"


def selected_paths() -> list[str]:
    return list(st.session_state.get(SELECTION_KEY, []))


def shown_paths() -> list[str]:
    return list(st.session_state.get(SHOWN_KEY, []))


def task_batch(run: RunTables, n_sequences: int = 32) -> Batch:
    """The first `n_sequences` of the run's fixed held-out set (the data the recorder's snapshots use)."""
    return run.build_task().eval_batch(n_sequences)
