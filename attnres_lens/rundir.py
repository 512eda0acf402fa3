"""Run directories (docs/run_directory.md): the one owner of their layout, every write and every read.

`RunDir` names every path of a run and performs every write to it (config, metrics append/truncate, records,
checkpoints with the keep/best rules and the index) and every read; `load_run` opens a run for analysis. Nothing
else in the project builds a path inside a run directory.

```
config.json        model + task + train config, package version, seed
checkpoints/       step_XXXXXXX.safetensors (weights, config in metadata), step_XXXXXXX.state.safetensors
                   (optimiser, scheduler and RNG state), index.json (latest, best, kept)
metrics.jsonl      one JSON object per logged step
records/           Parquet snapshots in long format (see `attnres_lens.recorder`)
analysis/          outputs of analysis commands
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from attnres_lens.config import ModelConfig, RunConfig

if TYPE_CHECKING:  # the model module imports transformer_lens; load it only when a model is built
    from attnres_lens.model import HookedTransformer

PathLike = Union[str, Path]
RECORD_TABLES = ("depth_weights", "magnitudes", "param_grad_norms", "induction_scores", "kv_shift")


class RunDirError(ValueError):
    """A run directory or checkpoint is missing, partial or corrupt; the message says which file and why."""


# ---------------------------------------------------------------------------- atomic writes
def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes files private (0600); run files are meant to be shared
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_save_safetensors(path: PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def atomic_write_parquet(path: PathLike, frame: pd.DataFrame) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- checkpoints
def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def read_safetensors(path: PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file, with a clear error for a missing or corrupt file."""
    path = Path(path)
    if not path.is_file():
        raise RunDirError(f"checkpoint file {path} does not exist")
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            metadata = json.loads(handle.read(header_len)).get("__metadata__", {}) or {}
    except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as err:
        raise RunDirError(f"checkpoint file {path} is corrupt or truncated ({err}); use another checkpoint") from err
    return tensors, metadata


def load_model_checkpoint(path: PathLike) -> tuple["HookedTransformer", dict[str, str]]:
    """Rebuild a model from a weights checkpoint alone (its config is in the metadata)."""
    from attnres_lens.model import HookedTransformer

    tensors, metadata = read_safetensors(path)
    if "model_config" not in metadata:
        raise RunDirError(f"checkpoint file {path} has no model_config in its metadata; it was not written by attnres_lens")
    cfg = ModelConfig.from_json(metadata["model_config"])
    cfg.device = "cpu"
    model = HookedTransformer(cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise RunDirError(f"checkpoint file {path} does not match its config: missing {missing}, unexpected {unexpected}")
    return model, metadata


# ---------------------------------------------------------------------------- the run directory
@dataclass
class CheckpointIndex:
    """checkpoints/index.json: the latest and best checkpoint names, the best eval loss, the kept names."""

    latest: Optional[str] = None
    best: Optional[str] = None
    best_eval_loss: float = math.inf
    kept: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        """"latest", "best" (those that exist), then the kept checkpoint names: what a user may pick."""
        return [alias for alias in ("latest", "best") if getattr(self, alias)] + list(self.kept)


class RunDir:
    """One run directory: its paths, and every read and write of its files."""

    CONFIG = "config.json"
    METRICS = "metrics.jsonl"
    RECORDS = "records"
    CHECKPOINTS = "checkpoints"
    INDEX = "index.json"
    ANALYSIS = "analysis"

    def __init__(self, path: PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------ paths
    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    @property
    def records_dir(self) -> Path:
        return self.path / self.RECORDS

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def index_path(self) -> Path:
        return self.checkpoints_dir / self.INDEX

    @property
    def analysis_dir(self) -> Path:
        return self.path / self.ANALYSIS

    def record_path(self, table: str) -> Path:
        return self.records_dir / f"{table}.parquet"

    def weights_path(self, name: str) -> Path:
        return self.checkpoints_dir / f"{name}.safetensors"

    def state_path(self, name: str) -> Path:
        return self.checkpoints_dir / f"{name}.state.safetensors"

    def watched_files(self) -> list[Path]:
        """The files whose change means the run has new content (config, metrics, index, records)."""
        return [self.config_path, self.metrics_path, self.index_path, *sorted(self.records_dir.glob("*.parquet"))]

    # ------------------------------------------------------------------ reads
    def holds_run(self) -> bool:
        return self.config_path.is_file()

    def read_config_dict(self) -> dict[str, Any]:
        """config.json as written, checked to have its model, task and train sections."""
        if not self.path.is_dir():
            raise RunDirError(f"run directory {self.path} does not exist")
        if not self.config_path.is_file():
            raise RunDirError(f"{self.path} is not a run directory: {self.CONFIG} is missing")
        try:
            config = json.loads(self.config_path.read_text())
        except json.JSONDecodeError as err:
            raise RunDirError(f"{self.config_path} is not valid JSON ({err})") from err
        for section in ("model", "task", "train"):
            if not isinstance(config, dict) or not isinstance(config.get(section), dict):
                raise RunDirError(f"{self.config_path} has no '{section}' section; it was not written by attnres_lens")
        return config

    def read_config(self) -> RunConfig:
        """config.json as a typed `RunConfig` (its task is checked to build)."""
        raw = self.read_config_dict()
        section = "model"
        try:
            ModelConfig.from_dict(raw["model"])
            section = "train or task"
            config = RunConfig.from_dict(raw)
            section = "task"
            config.build_task()
        except (KeyError, TypeError, ValueError) as err:
            raise RunDirError(f"{self.config_path} has an invalid {section} section: {err}") from err
        return config

    def read_index(self) -> CheckpointIndex:
        if not self.index_path.is_file():
            return CheckpointIndex()
        try:
            data = json.loads(self.index_path.read_text())
        except json.JSONDecodeError as err:
            raise RunDirError(f"{self.index_path} is not valid JSON ({err})") from err
        known = {f.name for f in dataclasses.fields(CheckpointIndex)}
        if not isinstance(data, dict) or set(data) - known:
            raise RunDirError(f"{self.index_path} is not a checkpoint index (an object with keys {sorted(known)})")
        return CheckpointIndex(**data)

    def resolve_checkpoint(self, checkpoint: Union[str, int] = "latest") -> str:
        """The checkpoint name meant by "latest", "best", a step number or a name such as "step_0000100"."""
        if isinstance(checkpoint, int) or str(checkpoint).isdigit():
            return checkpoint_name(int(checkpoint))
        if checkpoint in ("latest", "best"):
            name = getattr(self.read_index(), checkpoint)
            if name is None:
                raise RunDirError(f"run directory {self.path} has no {checkpoint} checkpoint yet ({self.index_path})")
            return name
        if str(checkpoint).startswith("step_"):
            return str(checkpoint)
        raise RunDirError(
            f"checkpoint must be 'latest', 'best', a step number or a name like 'step_0000100', got {checkpoint!r}")

    def is_complete(self) -> bool:
        """True when the latest checkpoint is at the run's final step and its weights file exists."""
        try:
            steps = self.read_config_dict()["train"]["steps"]
            latest = self.read_index().latest
        except (RunDirError, KeyError):
            return False
        return latest == checkpoint_name(steps) and self.weights_path(latest).is_file()

    def read_metrics(self) -> pd.DataFrame:
        """metrics.jsonl as a DataFrame; a torn last line (crash mid-write) is skipped, other bad lines are errors."""
        if not self.metrics_path.is_file():
            return pd.DataFrame()
        lines = self.metrics_path.read_text().splitlines()
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number == len(lines):
                    break
                raise RunDirError(f"{self.metrics_path} line {number} is not valid JSON ({err})") from err
        return pd.DataFrame(rows)

    def read_records(self) -> dict[str, pd.DataFrame]:
        records = {}
        for table in RECORD_TABLES:
            table_path = self.record_path(table)
            if table_path.is_file():
                try:
                    records[table] = pd.read_parquet(table_path)
                except Exception as err:  # pyarrow raises several types for a damaged file
                    raise RunDirError(f"{table_path} is corrupt ({err})") from err
        return records

    def load_model(self, checkpoint: Union[str, int] = "latest") -> tuple["HookedTransformer", str]:
        """The model at `checkpoint` and the checkpoint's name."""
        name = self.resolve_checkpoint(checkpoint)
        model, _ = load_model_checkpoint(self.weights_path(name))
        return model, name

    def read_checkpoint(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
        """(weights, training state, state metadata) of checkpoint `name`, for resuming."""
        weights, _ = read_safetensors(self.weights_path(name))
        state, state_meta = read_safetensors(self.state_path(name))
        return weights, state, state_meta

    def training_seconds(self) -> float:
        """Wall time the run spent training, from its files: config.json (written at the start and again on a
        resume) to the last checkpoint index. Survives re-running a report on reused runs."""
        return max(0.0, self.index_path.stat().st_mtime - self.config_path.stat().st_mtime)

    # ------------------------------------------------------------------ writes
    def write_config(self, config: RunConfig) -> None:
        atomic_write_json(self.config_path, config.to_dict())

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl, flushed (a crash tears at most this line, which readers skip)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines logged after `step` (a resumed run logs them again, identically)."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError):
                continue  # a line torn by the crash
        atomic_write_bytes(self.metrics_path, ("\n".join(kept) + "\n").encode() if kept else b"")

    def write_records(self, tables: dict[str, pd.DataFrame]) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        for name, frame in tables.items():
            atomic_write_parquet(self.record_path(name), frame)

    def save_checkpoint(self, step: int, weights: dict[str, torch.Tensor], weights_meta: dict[str, str],
                        state: dict[str, torch.Tensor], state_meta: dict[str, str], eval_loss: float,
                        keep_last: int) -> str:
        """Write checkpoint `step` and update the index: it becomes latest, best if its eval loss is the lowest,
        and only the last `keep_last` checkpoints plus the best stay on disk. Returns its name."""
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        name = checkpoint_name(step)
        # State first, weights second: a weights file on disk implies its state file is complete.
        atomic_save_safetensors(self.state_path(name), state, state_meta)
        atomic_save_safetensors(self.weights_path(name), weights, {**weights_meta, "eval_loss": repr(eval_loss)})

        index = self.read_index()
        kept = [n for n in index.kept if n != name] + [name]
        if index.best is None or eval_loss < index.best_eval_loss:
            index.best, index.best_eval_loss = name, eval_loss
        keep = set(kept[-keep_last:]) | {index.best}
        index.latest, index.kept = name, [n for n in kept if n in keep]
        atomic_write_json(self.index_path, dataclasses.asdict(index))
        for old in set(kept) - keep:  # only after the index no longer names them
            self.weights_path(old).unlink(missing_ok=True)
            self.state_path(old).unlink(missing_ok=True)
        return name

    def drop_training_state(self) -> None:
        """Delete the optimiser/RNG state files (weights stay loadable; the run can no longer be resumed)."""
        for name in self.read_index().kept:
            self.state_path(name).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- reading a run
@dataclass
class Run:
    """Everything `load_run` reads from a run directory."""

    path: Path
    config: RunConfig
    model: Optional["HookedTransformer"]
    checkpoint: Optional[str]
    metrics: pd.DataFrame
    records: dict[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model


def run_is_complete(path: PathLike) -> bool:
    return RunDir(path).is_complete()


def load_run(path: PathLike, checkpoint: Union[str, int] = "latest", load_model: bool = True) -> Run:
    """Load a run directory: typed config, model (from `checkpoint`), metrics and records as DataFrames.

    `checkpoint` is "latest", "best", a step number, or a checkpoint name such as "step_0000100".
    Nothing is unpickled. Raises `RunDirError` naming the missing or corrupt part.
    """
    run_dir = RunDir(path)
    config = run_dir.read_config()
    model, name = None, None
    if load_model:
        model, name = run_dir.load_model(checkpoint)
        model.eval()
    return Run(run_dir.path, config, model, name, run_dir.read_metrics(), run_dir.read_records())
