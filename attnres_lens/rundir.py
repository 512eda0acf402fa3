"""Run directories (SPEC §7): atomic writes, pickle-free checkpoints, and `load_run`.

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

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from attnres_lens.config import ModelConfig

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


# ---------------------------------------------------------------------------- reading a run
@dataclass
class Run:
    """Everything `load_run` reads from a run directory."""

    path: Path
    config: dict[str, Any]
    model_config: ModelConfig
    model: Optional["HookedTransformer"]
    checkpoint: Optional[str]
    metrics: pd.DataFrame
    records: dict[str, pd.DataFrame] = field(default_factory=dict)


def read_run_config(path: PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"run directory {path} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise RunDirError(f"{path} is not a run directory: config.json is missing")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise RunDirError(f"{config_path} is not valid JSON ({err})") from err
    for section in ("model", "task", "train"):
        if not isinstance(config, dict) or not isinstance(config.get(section), dict):
            raise RunDirError(f"{config_path} has no '{section}' section; it was not written by attnres_lens")
    return config


def read_checkpoint_index(path: PathLike) -> dict[str, Any]:
    index_path = Path(path) / "checkpoints" / "index.json"
    if not index_path.is_file():
        return {"latest": None, "best": None, "kept": []}
    try:
        return json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise RunDirError(f"{index_path} is not valid JSON ({err})") from err


def run_is_complete(path: PathLike) -> bool:
    """True when a run's latest checkpoint is at its final step and its weights file exists."""
    path = Path(path)
    try:
        steps = read_run_config(path)["train"]["steps"]
        latest = read_checkpoint_index(path).get("latest")
    except (RunDirError, KeyError):
        return False
    return latest == checkpoint_name(steps) and (path / "checkpoints" / f"{latest}.safetensors").is_file()


def read_metrics(path: PathLike) -> pd.DataFrame:
    """metrics.jsonl as a DataFrame; a torn last line (crash mid-write) is skipped, other bad lines are errors."""
    metrics_path = Path(path) / "metrics.jsonl"
    if not metrics_path.is_file():
        return pd.DataFrame()
    lines = metrics_path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise RunDirError(f"{metrics_path} line {number} is not valid JSON ({err})") from err
    return pd.DataFrame(rows)


def read_records(path: PathLike) -> dict[str, pd.DataFrame]:
    records = {}
    for table in RECORD_TABLES:
        table_path = Path(path) / "records" / f"{table}.parquet"
        if table_path.is_file():
            try:
                records[table] = pd.read_parquet(table_path)
            except Exception as err:  # pyarrow raises several types for a damaged file
                raise RunDirError(f"{table_path} is corrupt ({err})") from err
    return records


def load_run(path: PathLike, checkpoint: str = "latest", load_model: bool = True) -> Run:
    """Load a run directory: config, model (from `checkpoint`), metrics and records as DataFrames.

    `checkpoint` is "latest", "best", a step number, or a checkpoint name such as "step_0000100".
    Nothing is unpickled. Raises `RunDirError` naming the missing or corrupt part.
    """
    path = Path(path)
    config = read_run_config(path)
    try:
        model_config = ModelConfig.from_dict(config["model"])
    except (TypeError, ValueError) as err:
        raise RunDirError(f"{path / 'config.json'} has an invalid model section: {err}") from err
    model, name = None, None
    if load_model:
        index = read_checkpoint_index(path)
        name = resolve_checkpoint(index, checkpoint, path)
        model, _ = load_model_checkpoint(path / "checkpoints" / f"{name}.safetensors")
        model.eval()
    return Run(path, config, model_config, model, name, read_metrics(path), read_records(path))


def resolve_checkpoint(index: dict[str, Any], checkpoint: Union[str, int], path: Path) -> str:
    if isinstance(checkpoint, int) or str(checkpoint).isdigit():
        return checkpoint_name(int(checkpoint))
    if checkpoint in ("latest", "best"):
        name = index.get(checkpoint)
        if name is None:
            raise RunDirError(f"run directory {path} has no {checkpoint} checkpoint yet (checkpoints/index.json)")
        return name
    if str(checkpoint).startswith("step_"):
        return str(checkpoint)
    raise RunDirError(f"checkpoint must be 'latest', 'best', a step number or a name like 'step_0000100', got {checkpoint!r}")
