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
tokens.npy         a run importing a transformers folder with --text: the text's ids (docs/run_directory.md §2)
```
A run made by `import-hf` refers to a transformers model folder instead of holding checkpoints (`hf_runs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from attnres_lens.config import ModelConfig, RunConfig, TaskConfig, TrainConfig, stored_model

if TYPE_CHECKING:  # the model module imports transformer_lens; load it only when a model is built
    from attnres_lens.bridge import InklingBridge
    from attnres_lens.hf_runs import TransformersModel
    from attnres_lens.model import HookedTransformer

PathLike = str | Path
# The columns of each records/ table (written by `attnres_lens.recorder`, long format, one row per step and item).
RECORD_COLUMNS: dict[str, tuple[str, ...]] = {
    "depth_weights": ("step", "consumer", "consumer_label", "kind", "source", "source_label", "weight"),
    "depth_mixing": ("step", "consumer", "consumer_label", "sublayer", "sublayer_label", "weight"),
    "magnitudes": ("step", "sublayer", "label", "kind", "output_rms", "input_rms", "grad_norm"),
    "param_grad_norms": ("step", "block", "grad_norm"),
    "induction_scores": ("step", "layer", "head", "prefix_score"),
    "kv_shift": ("step", "layer", "head", "alpha1", "alpha2", "beta1", "beta2"),
}
RECORD_TABLES = tuple(RECORD_COLUMNS)


class RunDirError(ValueError):
    """A run directory or checkpoint is missing, partial or corrupt; the message says which file and why."""


class RunDirBusy(RunDirError):
    """Another process is writing this run directory (it holds the run's lock)."""


class RunLock:
    """The exclusive writer lock of a run directory: an `flock` on `RUN/.lock`, held for the writer's life.

    The operating system releases it when the process ends, however it ends, so a killed run stays resumable; the
    file itself stays (removing lock files races) and names the last holder, for the refusal message.
    """

    def __init__(self, path: Path):
        self.path = path
        self.created = False  # whether this holder made the lock file
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open()
            if fd is None:  # discarded in between: create it
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                break  # held: refused below
            except BaseException:
                self._abandon(fd)
                raise
            # a holder that wrote nothing may remove the file (`discard`): a lock taken on a removed file is no lock
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    return self._name_holder(fd)
                except BaseException:  # Ctrl-C while naming itself: a lock file it made does not stay
                    self._abandon(fd)
                    raise
            os.close(fd)
        # the holder names itself just after taking the lock: a refusal in that instant waits briefly for it
        holder = ""
        for _ in range(20):
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            if holder:
                break
            time.sleep(0.01)
        holder = holder or "another process"
        os.close(fd)
        raise RunDirBusy(
            f"{self.path.parent} is being written by {holder}; a run directory has one writer at "
            "a time: wait for it to finish, or stop it and resume"
        ) from None

    def _open(self) -> int | None:
        """The lock file's descriptor (made if missing: `created`), None if it vanished in between. Never through a
        symbolic link: a run folder handed over with `.lock` linking to another file would have that file emptied
        and overwritten by the holder's name."""
        flags = os.O_RDWR | os.O_NOFOLLOW
        try:
            fd, self.created = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, self.created = os.open(self.path, flags), False
            except FileNotFoundError:
                return None
            except OSError as err:  # ELOOP: a symbolic link
                raise RunDirError(
                    f"{self.path} is not a plain file ({err.strerror}); a run's lock file is one: "
                    "remove it and try again"
                ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirError(f"{self.path} is not a plain file; a run's lock file is one: remove it and try again")
        return fd

    def _abandon(self, fd: int) -> None:
        """Close `fd` unlocked, removing the lock file if this holder made it (safe: `acquire` re-checks)."""
        if self.created:
            self.path.unlink(missing_ok=True)
        os.close(fd)

    def _name_holder(self, fd: int) -> RunLock:
        command = " ".join(sys.argv)
        command = command if len(command) <= 300 else command[:299] + "…"  # the refusal reads 4096 bytes back
        holder = (
            f"process {os.getpid()} on {socket.gethostname()} (`{command}`, since {time.strftime('%Y-%m-%d %H:%M:%S')})"
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def discard(self) -> None:
        """Remove the lock file, then release: for a writer refused before it wrote anything into a folder that
        holds no run, so the refusal leaves nothing behind. Safe while held: `acquire` re-checks the file it locked
        is still the one at the path."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _make_folders(path: Path) -> list[Path]:
    """Create `path` and its missing parents; returns those this call created (not one another process made in
    between), outermost first."""
    made = []
    for folder in [*reversed(path.parents), path]:
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        made.append(folder)
    return made


# ---------------------------------------------------------------------------- reads of text files
def read_text_file(path: PathLike, error: type[ValueError] | None = None) -> str:
    """A text file of a run or model folder, decoded as strict UTF-8: bytes that are not UTF-8 are an error naming
    the file (`error`, default `RunDirError`), not a UnicodeDecodeError from deep inside a parser."""
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise (error or RunDirError)(
            f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); it was not "
            "written by attnres_lens or was damaged"
        ) from None


def read_json_file(path: PathLike, error: type[ValueError] | None = None) -> Any:
    """A JSON file, read by `read_text_file`; invalid JSON is an error naming the file."""
    text = read_text_file(path, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise (error or RunDirError)(f"{path} is not valid JSON ({err})") from err


# ---------------------------------------------------------------------------- atomic writes
def _atomic_write(path: PathLike, write: Callable[[Path], None]) -> None:
    """`write` a temporary file in the same folder, fsync it, then rename it over `path`: readers never see half a
    file, and a crash leaves the previous version. Files are world-readable: run directories are meant to be shared."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes files private (0600)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    _atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_save_safetensors(path: PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    cpu_tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _atomic_write(path, lambda tmp: save_file(cpu_tensors, str(tmp), metadata=metadata))


def atomic_write_parquet(path: PathLike, frame: pd.DataFrame) -> None:
    _atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


# ---------------------------------------------------------------------------- checkpoints
# A checkpoint's training state file (step_N.state.safetensors): optimiser moments ("optim.<param>.<slot>"), these
# RNG states, and from this format on the open log window ("log.loss_sum", "log.steps": the losses since the last
# metrics line, so a resumed run logs that line with the same mean); its metadata holds the step and the format.
STATE_FORMAT = "attnres_lens.state.v1"
STATE_TENSORS = ("rng.data", "rng.torch")
LOG_WINDOW_TENSORS = ("log.loss_sum", "log.steps")  # optional, as a pair


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint name such as "step_0000100" (the inverse of `checkpoint_name`)."""
    return int(name[len("step_") :])


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


def _config_differences(written: ModelConfig, expected: ModelConfig) -> list[str]:
    """Fields on which a checkpoint's model config disagrees with the run's (device and seed are set per run)."""
    a, b = written.to_dict(), expected.to_dict()
    return [
        f"{key}: checkpoint {a[key]!r}, config.json {b[key]!r}"
        for key in sorted(a)
        if key not in ("device", "seed") and a[key] != b[key]
    ]


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the model `cfg` describes, from a model on the meta device (nothing is allocated, so a
    config with absurd sizes costs nothing)."""
    from attnres_lens.model import HookedTransformer

    with torch.device("meta"):
        model = HookedTransformer(dataclasses.replace(cfg, device="meta"))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def load_model_checkpoint(
    path: PathLike, expected: ModelConfig | None = None
) -> tuple[HookedTransformer, dict[str, str]]:
    """Rebuild a model from a weights checkpoint (its config is in the metadata).

    Nothing in the file is trusted before it is checked: the metadata config must agree with `expected` (the run's
    config.json) when given, and every tensor's shape must match the config before the model is built.
    """
    from attnres_lens.model import HookedTransformer

    tensors, metadata = read_safetensors(path)
    if "model_config" not in metadata:
        raise RunDirError(
            f"checkpoint file {path} has no model_config in its metadata; it was not written by attnres_lens"
        )
    try:
        cfg = ModelConfig.from_json(metadata["model_config"])
    except ValueError as err:
        raise RunDirError(f"checkpoint file {path} has an invalid model_config in its metadata: {err}") from err
    if expected is not None and (differences := _config_differences(cfg, expected)):
        raise RunDirError(
            f"checkpoint file {path} was written for another model than config.json describes "
            f"({'; '.join(differences)}); the run directory is inconsistent"
        )
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    wanted = _expected_shapes(cfg)
    if shapes != wanted:
        missing, unexpected = sorted(set(wanted) - set(shapes)), sorted(set(shapes) - set(wanted))
        wrong = [
            f"{n} {shapes[n]} (expected {wanted[n]})"
            for n in sorted(set(shapes) & set(wanted))
            if shapes[n] != wanted[n]
        ]
        raise RunDirError(
            f"checkpoint file {path} does not match its config: missing {missing}, unexpected "
            f"{unexpected}, wrong shapes {wrong}"
        )
    cfg.device = "cpu"
    model = HookedTransformer(cfg)
    model.load_state_dict(tensors)
    return model, metadata


# ---------------------------------------------------------------------------- the run directory
@dataclass
class CheckpointIndex:
    """checkpoints/index.json: the latest and best checkpoint names, the best eval loss, the kept names."""

    latest: str | None = None
    best: str | None = None
    best_eval_loss: float = math.inf
    kept: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        """ "latest", "best" (those that exist), then the kept checkpoint names: what a user may pick."""
        return [alias for alias in ("latest", "best") if getattr(self, alias)] + list(self.kept)


class RunDir:
    """One run directory: its paths, and every read and write of its files."""

    LOCK = ".lock"
    CONFIG = "config.json"
    METRICS = "metrics.jsonl"
    RECORDS = "records"
    CHECKPOINTS = "checkpoints"
    INDEX = "index.json"
    ANALYSIS = "analysis"
    TOKENS = "tokens.npy"

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

    @property
    def tokens_path(self) -> Path:
        return self.path / self.TOKENS

    def lock(self) -> RunLock:
        """The writer lock (a context manager); `RunDirBusy` names the holder when another process has it."""
        return RunLock(self.path / self.LOCK)

    @contextlib.contextmanager
    def writing_new_run(self, check_folder: Callable[[RunDir], None]) -> Iterator[RunLock]:
        """The writer lock for a new run. `check_folder` refuses a folder the run may not use (one holding a run, or
        anything else); it runs before the lock, so a refused folder gets no lock file, and again under it, since
        another writer may have started in between. If the body fails before config.json exists (a refusal, an
        error, Ctrl-C), nothing this call made stays: the lock's holder removes a folder it created, or else the
        lock file it created; the parents it created go when empty. A writer refused by the lock removes only empty
        folders: it may have seen no folder only because the holder had not made it yet."""
        check_folder(self)
        made = _make_folders(self.path)  # the folders this call created, outermost first
        lock = self.lock()
        try:
            lock.acquire()
            check_folder(self)
            yield lock
        except BaseException:
            if not self.holds_run():
                if lock.held and self.path in made:  # nobody else writes in it
                    shutil.rmtree(self.path, ignore_errors=True)
                elif lock.held and lock.created:
                    lock.discard()
                for folder in reversed(made):  # innermost first; a folder someone else wrote into stays
                    with contextlib.suppress(OSError):
                        folder.rmdir()
            raise
        finally:
            lock.release()

    def remove_stale_temporaries(self) -> list[Path]:
        """Remove the temporary files of atomic writes that a killed writer left (`.NAME.*.tmp` in the run's folders);
        called by a writer holding the lock, so none of them is being written. Returns what it removed."""
        stale = [
            path
            for folder in (self.path, self.checkpoints_dir, self.records_dir, self.analysis_dir)
            if folder.is_dir()
            for path in folder.glob(".*.tmp")
            if path.is_file()
        ]
        for path in stale:
            path.unlink(missing_ok=True)
        return stale

    def foreign_entries(self) -> list[str]:
        """Entries of a folder that does not hold a run yet, other than the lock: a new run must not mix with them."""
        if not self.path.is_dir() or self.holds_run():
            return []
        return sorted(entry.name for entry in self.path.iterdir() if entry.name != self.LOCK)

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
            what = "is a file, not a folder" if self.path.exists() else "does not exist"
            raise RunDirError(
                f"run directory {self.path} {what}; give a folder that holds a run's "
                f"{self.CONFIG} (one `attnres-lens train`, `import-hf` or `import-fla` wrote)"
            )
        if not self.config_path.is_file():
            try:  # a folder of runs given for one run: name them (an unreadable entry is simply not named)
                runs = sorted(child.name for child in self.path.iterdir() if (child / self.CONFIG).is_file())
            except OSError:
                runs = []
            inside = (
                f"; it holds run directories ({', '.join(runs[:5])}{', …' if len(runs) > 5 else ''}): give one"
                if runs
                else ""
            )
            raise RunDirError(f"{self.path} is not a run directory: {self.CONFIG} is missing{inside}")
        config = read_json_file(self.config_path)
        if isinstance(config, dict) and ("architectures" in config or "model_type" in config):
            raise RunDirError(
                f"{self.path} is a model folder (its {self.CONFIG} names model_type {config.get('model_type')!r}), not "
                "a run directory: `attnres-lens import-hf FOLDER --out RUN` (transformers Inkling-2, Inkling-2-Mini, "
                "DeepSeek V4) or `attnres-lens import-fla FOLDER --out RUN` (flash-linear-attention) makes it a run"
            )
        for section in ("model", "task", "train"):
            if not isinstance(config, dict) or not isinstance(config.get(section), dict):
                raise RunDirError(f"{self.config_path} has no '{section}' section; it was not written by attnres_lens")
        return config

    def read_config(self) -> RunConfig:
        """config.json as a typed `RunConfig` (its task is checked to build); an import-hf run's tokens task on its
        own tokens.npy reads it wherever the run is now (any other relative task path is the working directory's)."""
        raw = self.read_config_dict()
        if _reads_own_tokens(raw) and raw["task"].get("path") == self.TOKENS:
            raw["task"] = {**raw["task"], "path": str(self.tokens_path.resolve())}
        section = "model"  # checked in this order, so the message names the first bad section
        try:
            stored_model(raw["model"])
            section = "train"
            TrainConfig.from_dict(raw["train"])
            section = "task"
            TaskConfig.from_dict(raw["task"])
            section = "provenance"  # all that is left to check
            config = RunConfig.from_dict(raw)
        except (TypeError, ValueError) as err:
            raise RunDirError(f"{self.config_path} has an invalid {section} section: {err}") from err
        return config

    def read_index(self) -> CheckpointIndex:
        """checkpoints/index.json, checked for its shape; an empty index before the run's first checkpoint."""
        if not self.index_path.is_file():
            return CheckpointIndex()
        data = read_json_file(self.index_path)
        known = {f.name for f in dataclasses.fields(CheckpointIndex)}
        valid = (
            isinstance(data, dict)
            and not set(data) - known
            and all(isinstance(data.get(key), (str, type(None))) for key in ("latest", "best"))
            and isinstance(data.get("kept", []), list)
            and all(isinstance(n, str) for n in data.get("kept", []))
            and isinstance(data.get("best_eval_loss", 0.0), (int, float))
        )
        if not valid:
            raise RunDirError(
                f"{self.index_path} is not a checkpoint index (an object with latest and best names, "
                f"best_eval_loss and a kept list); got {json.dumps(data)[:120]}"
            )
        return CheckpointIndex(**data)

    def resolve_checkpoint(self, checkpoint: str | int = "latest") -> str:
        """The checkpoint name meant by "latest", "best", a step number or a name such as "step_0000100"."""
        if checkpoint in ("latest", "best"):
            name = getattr(self.read_index(), checkpoint)
            if name is None:
                raise RunDirError(f"run directory {self.path} has no {checkpoint} checkpoint yet ({self.index_path})")
            return name
        if isinstance(checkpoint, int) or str(checkpoint).isdigit():
            name = checkpoint_name(int(checkpoint))
        elif str(checkpoint).startswith("step_"):
            name = str(checkpoint)
        else:
            raise RunDirError(
                f"checkpoint must be 'latest', 'best', a step number or a name like 'step_0000100', got {checkpoint!r}"
            )
        if not self.weights_path(name).is_file():
            raise RunDirError(
                f"run directory {self.path} has no checkpoint {checkpoint!r}; it has: "
                f"{', '.join(self.read_index().names()) or 'none'}"
            )
        return name

    def is_complete(self) -> bool:
        """True when the latest checkpoint is at the run's final step and its weights file exists. A run holding
        an imported model (config.json has a provenance) is complete once its one checkpoint exists: it was never
        trained here, so its train.steps say nothing."""
        try:
            config = self.read_config_dict()
            if config["model"].get("source") == "transformers":  # refers to a model folder: nothing to train
                return True
            steps = config["train"]["steps"]
            latest = self.read_index().latest
        except (RunDirError, KeyError):
            return False
        if config.get("provenance") is not None:
            return latest is not None and self.weights_path(latest).is_file()
        return latest == checkpoint_name(steps) and self.weights_path(latest).is_file()

    def _metric_lines(self) -> list[tuple[str, dict[str, Any]]]:
        """(line, object) for each line of metrics.jsonl; a torn last line (crash mid-write) is skipped, any other
        line that is not a JSON object with an integer step is an error naming the line."""
        lines = read_text_file(self.metrics_path).splitlines() if self.metrics_path.is_file() else []
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                if number == len(lines):
                    break
                raise RunDirError(f"{self.metrics_path} line {number} is not valid JSON ({err})") from err
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise RunDirError(
                    f"{self.metrics_path} line {number} is not a metrics record (a JSON object with an "
                    f"integer step): {line[:80]}"
                )
            rows.append((line, row))
        return rows

    def read_metrics(self) -> pd.DataFrame:
        """metrics.jsonl as a DataFrame (see `_metric_lines` for what is refused)."""
        return pd.DataFrame([row for _, row in self._metric_lines()])

    def read_records(self) -> Records:
        records = Records(self.path)
        for table, columns in RECORD_COLUMNS.items():
            table_path = self.record_path(table)
            if table_path.is_file():
                try:
                    frame = pd.read_parquet(table_path)
                except Exception as err:  # pyarrow raises several types for a damaged file
                    raise RunDirError(f"{table_path} is corrupt ({err})") from err
                missing = [column for column in columns if column not in frame.columns]
                if missing:
                    raise RunDirError(
                        f"{table_path} lacks the columns {missing} (it has {list(frame.columns)}); "
                        "it was not written by attnres_lens"
                    )
                records[table] = frame
        return records

    def load_model(self, checkpoint: str | int = "latest") -> tuple[HookedTransformer | InklingBridge, str]:
        """The model at `checkpoint` and the checkpoint's name. A run referring to a transformers folder has one
        "checkpoint", the folder's weights as imported (`hf_runs.REFERENCED_CHECKPOINT`): the folder is re-hashed
        and opened through `from_transformers`."""
        config = self.read_config()
        if not isinstance(config.model, ModelConfig):
            from attnres_lens import hf_runs

            if str(checkpoint) not in ("latest", "best", hf_runs.REFERENCED_CHECKPOINT):
                raise RunDirError(
                    f"run directory {self.path} refers to the model folder {config.model.folder}, which has one "
                    f"set of weights: give checkpoint 'latest' (or leave it out), not {checkpoint!r}"
                )
            return hf_runs.open_model(config.model, self.path), hf_runs.REFERENCED_CHECKPOINT
        name = self.resolve_checkpoint(checkpoint)
        model, _ = load_model_checkpoint(self.weights_path(name), expected=config.model)
        return model, name

    def read_checkpoint(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
        """(weights, training state, state metadata) of checkpoint `name`, for resuming; a state file that is not
        one (another format, missing RNG states or step) is a RunDirError naming it."""
        weights, _ = read_safetensors(self.weights_path(name))
        path = self.state_path(name)
        state, state_meta = read_safetensors(path)
        missing = [key for key in STATE_TENSORS if key not in state]
        if any(key in state for key in LOG_WINDOW_TENSORS):  # the open log window comes as a pair
            missing += [key for key in LOG_WINDOW_TENSORS if key not in state]
        if state_meta.get("format") != STATE_FORMAT or missing or not str(state_meta.get("step", "")).isdigit():
            raise RunDirError(
                f"{path} is not a training state file (format {STATE_FORMAT}, tensors "
                f"{list(STATE_TENSORS)} and a step; missing {missing or 'none'}, format "
                f"{state_meta.get('format')!r}, step {state_meta.get('step')!r}); resume from another "
                "checkpoint with --checkpoint"
            )
        return weights, state, state_meta

    def training_seconds(self) -> float:
        """Wall time the run spent training, from its files: config.json (written at the start and again on a
        resume) to the last checkpoint index. Survives re-running a report on reused runs."""
        return max(0.0, self.index_path.stat().st_mtime - self.config_path.stat().st_mtime)

    # ------------------------------------------------------------------ writes
    def write_config(self, config: RunConfig) -> None:
        """config.json; the tokens task of a run referring to a transformers folder, on the run's own tokens.npy
        (import-hf's `--text`), names it relative to the run (`TOKENS`), so the run can move (`read_config` resolves
        it)."""
        data = config.to_dict()
        task = data["task"]
        if _reads_own_tokens(data) and task.get("path") == str(self.tokens_path.resolve()):
            task["path"] = self.TOKENS
        atomic_write_json(self.config_path, data)

    def write_tokens(self, ids: Any) -> None:
        """tokens.npy: a 1-D uint32 array of token ids (import-hf's tokenized --text), written atomically."""
        import numpy as np

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:  # a handle: np.save given a path would append ".npy" to the name
                np.save(handle, np.asarray(ids, dtype=np.uint32), allow_pickle=False)

        _atomic_write(self.tokens_path, write)

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl, flushed (a crash tears at most this line, which readers skip)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines logged after `step` (a resumed run logs them again, identically). A damaged line other
        than a torn last one is an error, as when reading: nothing is dropped silently."""
        if not self.metrics_path.exists():
            return
        kept = [line for line, row in self._metric_lines() if row["step"] <= step]
        atomic_write_bytes(self.metrics_path, ("\n".join(kept) + "\n").encode() if kept else b"")

    def write_records(self, tables: dict[str, pd.DataFrame]) -> None:
        self.records_dir.mkdir(parents=True, exist_ok=True)
        for name, frame in tables.items():
            atomic_write_parquet(self.record_path(name), frame)

    def save_checkpoint(
        self,
        step: int,
        weights: dict[str, torch.Tensor],
        weights_meta: dict[str, str],
        state: dict[str, torch.Tensor],
        state_meta: dict[str, str],
        eval_loss: float,
        keep_last: int,
    ) -> str:
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

    def truncate_checkpoints(self, resumed_from: str) -> None:
        """Forget the checkpoints after `resumed_from`: a run resumed from an earlier one trains a different
        branch, which must never be continued from, or picked as "best", later. The index is rewritten first
        (`resumed_from` kept and latest, even if a crash had left it on disk unindexed; best recomputed from the
        remaining checkpoints' stored eval losses), then the later files go, with any left by a crash between an
        index write and its deletions."""
        index, step = self.read_index(), checkpoint_step(resumed_from)
        kept = sorted(
            {name for name in index.kept if checkpoint_step(name) <= step} | {resumed_from}, key=checkpoint_step
        )
        if kept != index.kept:
            losses = {name: self._stored_eval_loss(name) for name in kept}
            finite = {name: loss for name, loss in losses.items() if math.isfinite(loss)}
            best = min(finite, key=finite.__getitem__) if finite else None
            index = CheckpointIndex(
                latest=resumed_from, best=best, best_eval_loss=finite[best] if best else math.inf, kept=kept
            )
            atomic_write_json(self.index_path, dataclasses.asdict(index))
        for path in self.checkpoints_dir.glob("step_*.safetensors"):
            name = path.name.split(".")[0]
            if name[len("step_") :].isdigit() and checkpoint_step(name) > step:
                path.unlink(missing_ok=True)

    def _stored_eval_loss(self, name: str) -> float:
        """The eval loss a checkpoint's weights file records (its metadata); NaN where it records none or cannot be
        read (it is then never "best": loading it names the damage)."""
        try:
            with safe_open(str(self.weights_path(name)), "pt") as handle:
                return float((handle.metadata() or {}).get("eval_loss", "nan"))
        except (SafetensorError, OSError, ValueError):
            return math.nan

    def write_imported(
        self, config: RunConfig, weights: dict[str, torch.Tensor], weights_meta: dict[str, str], eval_loss: float
    ) -> str:
        """A run holding a model trained elsewhere (docs/interop.md §4): one weights checkpoint at step 0 with no
        training state (there is nothing to resume), its index, then config.json with the provenance, written last so
        a folder with a config.json is whole. No metrics and no records. Returns the checkpoint's name."""
        if not config.imported:
            raise ValueError("write_imported needs a run config with a provenance (where the model came from)")
        name = checkpoint_name(0)
        atomic_save_safetensors(self.weights_path(name), weights, {**weights_meta, "eval_loss": repr(eval_loss)})
        finite = math.isfinite(eval_loss)
        index = CheckpointIndex(
            latest=name, best=name if finite else None, best_eval_loss=eval_loss if finite else math.inf, kept=[name]
        )
        atomic_write_json(self.index_path, dataclasses.asdict(index))
        self.write_config(config)
        return name

    def drop_training_state(self) -> None:
        """Delete the optimiser/RNG state files (weights stay loadable; the run can no longer be resumed)."""
        for name in self.read_index().kept:
            self.state_path(name).unlink(missing_ok=True)


def _reads_own_tokens(config: dict[str, Any]) -> bool:
    """Whether config.json's task may be the run's own tokens.npy: a tokens task of a run referring to a
    transformers folder (only import-hf writes the file)."""
    return config["task"].get("name") == "tokens" and config["model"].get("source") == "transformers"


# ---------------------------------------------------------------------------- reading a run
class Records(dict):
    """The run's training records by table name (`RECORD_COLUMNS`); a table the run lacks is a KeyError saying which
    it has and why (an imported run was trained elsewhere: it has none)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __missing__(self, table: str) -> pd.DataFrame:
        if table not in RECORD_COLUMNS:
            raise KeyError(f"no record table is named {table!r}; the tables are {list(RECORD_COLUMNS)}")
        imported = RunDir(self.path).read_config_dict().get("provenance") is not None  # read on this error path only
        why = (
            "it was imported (trained elsewhere), so it has no training records"
            if imported
            else f"it has {list(self) or 'none yet'}"
        )
        raise KeyError(f"run {self.path.name} has no {table!r} records: {why}")


@dataclass
class Run:
    """Everything `load_run` reads from a run directory."""

    path: Path
    config: RunConfig
    model: HookedTransformer | InklingBridge | None  # a bridge for a run referring to a transformers folder
    checkpoint: str | None
    metrics: pd.DataFrame
    records: dict[str, pd.DataFrame] = field(default_factory=dict)  # a `Records` when read from a run

    @property
    def model_config(self) -> ModelConfig | TransformersModel:
        return self.config.model


def run_is_complete(path: PathLike) -> bool:
    return RunDir(path).is_complete()


def load_run(path: PathLike, checkpoint: str | int = "latest", load_model: bool = True) -> Run:
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
