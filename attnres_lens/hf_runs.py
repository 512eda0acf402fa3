"""Run directories that refer to a transformers model folder (docs/interop.md §7, docs/run_directory.md §2).

`attnres-lens import-hf DIR --out RUN` writes a run whose config.json names the folder by its absolute path and
records the sha256 of every file opened from it (config.json, the safetensors weights, the tokenizer's files); no
weight is copied. `load_run` re-hashes those files and opens the folder through `attnres_lens.from_transformers`:
a moved folder or a changed file is a `RunDirError` naming the folder, the file and the fix (import again).

The run's `RunConfig.model` is a `TransformersModel` (not a toolkit `ModelConfig`): the few facts the analyses and the
dashboard ask of a run's model (vocabulary, context, residual and attention kind, a description), read from the
folder's config.json at import. The residual kind follows from the architecture (`RESIDUALS`): Inkling-2 and
Inkling-2-Mini mix depth by Block AttnRes ("attnres"), DeepSeek V4 by mHC hyper-connections ("mhc"), so the
dashboard and the analyses treat such a run as the toolkit's runs of that kind.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from attnres_lens.rundir import PathLike, RunDir, RunDirError, read_json_file, read_text_file

if TYPE_CHECKING:
    from attnres_lens.bridge import TransformersBridge

SOURCE = "transformers"  # config.json's model.source for a referenced transformers model
# The files a tokenizer may be saved as; those present are hashed with the model's (docs/run_directory.md §2).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
REFERENCED_CHECKPOINT = "model_folder"  # `Run.checkpoint` of a referenced run: the folder's weights, as they are
DEFAULT_SEQ_LEN = 256  # the held-out windows' length unless --set task.seq_len (real contexts are ~10^6 tokens)
DTYPES = ("float32", "float64", "bfloat16")
EVAL_SEQUENCES = 16  # held-out sequences the import's sanity loss is measured on
# The architectures import-hf opens (`bridge.SUPPORTED_MODELS` and `bridge_mhc.SUPPORTED_MODEL`, spelled here so
# that reading a run's config imports no model code) and the residual kind each one's depth mixing is
# (docs/interop.md §7): what `TransformersModel.residual` reports to the dashboard and the analyses.
RESIDUALS = {
    "Inkling2ForCausalLM": "attnres",
    "Inkling2LoopForCausalLM": "attnres",
    "DeepseekV4ForCausalLM": "mhc",
}
RESIDUAL_LABELS = {"attnres": "Block AttnRes (transformers)", "mhc": "mHC hyper-connections (transformers)"}


class ImportHfError(ValueError):
    """A transformers folder cannot be imported; the message names the file or option and the fix."""


@dataclass(frozen=True)
class TransformersModel:
    """config.json's `model` section of a run referring to a transformers model folder (`source: "transformers"`).

    `folder` is absolute; `files_sha256` maps each file read from it (by name inside the folder) to its sha256;
    `d_vocab` is the unembedding's valid ids and `n_ctx` the model's maximum context, both from its config.json.
    """

    folder: str
    architecture: str
    model_type: str
    transformers_version: str
    d_vocab: int
    n_ctx: int
    n_layers: int
    files_sha256: dict[str, str]
    dtype: str = "float32"
    source: ClassVar[str] = SOURCE
    # what the dashboard and the analyses' headers ask of every run's model (docs/run_directory.md §2)
    attention: ClassVar[str] = "transformers"  # transformers' own token attention (no toolkit KV shift)

    def __post_init__(self) -> None:
        for name in ("folder", "architecture", "model_type", "transformers_version"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"model.{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.architecture not in RESIDUALS:
            raise ValueError(
                f"model.architecture must be one of {list(RESIDUALS)} (the models import-hf opens), got "
                f"{self.architecture!r}"
            )
        if not Path(self.folder).is_absolute():
            raise ValueError(f"model.folder must be an absolute path, got {self.folder!r}")
        for name in ("d_vocab", "n_ctx", "n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.files_sha256, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.files_sha256.items()
        ):
            raise ValueError(f"model.files_sha256 must map file names to sha256 strings, got {self.files_sha256!r}")
        if "config.json" not in self.files_sha256:
            raise ValueError("model.files_sha256 must include config.json")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {list(DTYPES)}, got {self.dtype!r}")

    @property
    def residual(self) -> str:
        """The residual kind of the architecture (`RESIDUALS`): "attnres" (Inkling) or "mhc" (DeepSeek V4)."""
        return RESIDUALS[self.architecture]

    @property
    def variant(self) -> str:
        return self.model_type

    @property
    def description(self) -> str:
        return f"{self.architecture} (transformers {self.transformers_version}) from {self.folder}"

    @property
    def residual_label(self) -> str:
        return RESIDUAL_LABELS[self.residual]

    @property
    def attention_label(self) -> str:
        return f"{self.model_type} (transformers)"

    @property
    def has_tokenizer(self) -> bool:
        return any(name in TOKENIZER_FILES for name in self.files_sha256)

    def to_dict(self) -> dict[str, Any]:
        return {"source": SOURCE, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransformersModel:
        """config.json's model section, strictly: unknown or missing fields are errors naming them."""
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {key: value for key, value in data.items() if key != "source"}
        if unknown := sorted(set(given) - fields):
            raise ValueError(f"unknown field(s) {unknown} of a transformers model; known fields: {sorted(fields)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if missing := sorted(required - set(given)):
            raise ValueError(f"a transformers model section needs {missing}")
        return cls(**given)


def is_transformers_section(model_section: Mapping[str, Any]) -> bool:
    """Whether config.json's model section refers to a transformers folder (else it is a toolkit `ModelConfig`)."""
    return model_section.get("source") == SOURCE


# ---------------------------------------------------------------------------- hashing
# (path, size, mtime_ns, inode) -> sha256: the dashboard re-opens a run on every rerun; a multi-GB shard is hashed
# once per process unless it changes
_HASHED: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    stat = os.stat(path)
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _HASHED:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
        _HASHED[key] = digest.hexdigest()
    return _HASHED[key]


# ---------------------------------------------------------------------------- the folder
def read_model_folder(path: PathLike) -> tuple[dict[str, Any], list[str]]:
    """(config.json, the names of the files a load opens) of a transformers Inkling-2, Inkling-2-Mini or DeepSeek V4
    folder, refused by name when it is no folder, names code of its own (`auto_map`), holds pickled weights only or
    another architecture."""
    from attnres_lens.interop import FlaInteropError, fla_weight_files

    folder = Path(path)
    if not folder.is_dir():
        raise ImportHfError(f"{folder} is not a folder; give the folder a transformers save_pretrained wrote")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ImportHfError(f"{folder} has no config.json; it is not a transformers model folder")
    config = read_json_file(config_path, ImportHfError)
    if not isinstance(config, dict):
        raise ImportHfError(f"{config_path} must hold a JSON object")
    tokenizer_config = folder / "tokenizer_config.json"
    tokenizer_settings = read_json_file(tokenizer_config, ImportHfError) if tokenizer_config.is_file() else {}
    for file, settings in ((config_path, config), (tokenizer_config, tokenizer_settings)):
        if isinstance(settings, dict) and settings.get("auto_map") is not None:  # trust_remote_code's Python files
            raise ImportHfError(
                f"{file} names code of its own (auto_map={settings['auto_map']!r}); attnres_lens never runs code "
                "from a model folder: only models whose code ships with transformers can be opened"
            )
    architectures = config.get("architectures") or []
    if not any(name in RESIDUALS for name in architectures):
        raise ImportHfError(
            f"{config_path} describes {', '.join(map(str, architectures)) or 'a model of unnamed architecture'}; "
            f"import-hf opens {', '.join(RESIDUALS)}"
        )
    try:
        weights = fla_weight_files(folder)  # safetensors by name (the index's shards); pickles refused
    except FlaInteropError as err:
        raise ImportHfError(str(err)) from None
    tokenizer = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    return config, ["config.json", *weights, *tokenizer]


def _hashes(folder: Path, names: list[str]) -> dict[str, str]:
    hashes = {}
    for name in names:
        path = folder / name
        if not path.is_file():  # a FIFO would block the read forever; a missing shard is named
            raise ImportHfError(f"{path} is missing or not a regular file; the folder is incomplete")
        hashes[name] = file_sha256(path)
    return hashes


def check_model_folder(model: TransformersModel, run_path: PathLike) -> None:
    """Re-hash every file the run recorded: a moved folder, a missing or changed file is a `RunDirError` naming it."""
    folder = Path(model.folder)
    fix = f"re-import the model: attnres-lens import-hf FOLDER --out NEW_RUN (run {run_path} refers to {folder})"
    if not folder.is_dir():
        raise RunDirError(f"the model folder {folder} of run {run_path} is gone (moved or deleted); {fix}")
    missing = [name for name in model.files_sha256 if not (folder / name).is_file()]
    changed = [
        name
        for name, digest in model.files_sha256.items()
        if name not in missing and file_sha256(folder / name) != digest
    ]
    if missing or changed:
        what = "; ".join(
            part
            for part in (
                f"missing: {', '.join(missing)}" if missing else "",
                f"changed since the import (sha256 differs): {', '.join(changed)}" if changed else "",
            )
            if part
        )
        raise RunDirError(f"the model folder {folder} of run {run_path} is not the one imported ({what}); {fix}")


def open_model(model: TransformersModel, run_path: PathLike) -> TransformersBridge:
    """The referenced model as a bridge (eval mode), after `check_model_folder`: an `InklingBridge` for Inkling-2 /
    Inkling-2-Mini, a `DeepseekV4Bridge` for DeepSeek V4 (`from_transformers` picks it by the folder's model type)."""
    import torch

    from attnres_lens.bridge import from_transformers

    check_model_folder(model, run_path)
    return from_transformers(model.folder, dtype=getattr(torch, model.dtype)).eval()


def open_tokenizer(model: TransformersModel, run_path: PathLike) -> Any:
    """The folder's own tokenizer (after `check_model_folder`), or None when the folder has none. Loaded once per
    folder and file hashes: the dashboard asks on every rerun."""
    if not model.has_tokenizer:
        return None
    check_model_folder(model, run_path)
    return _load_tokenizer(model.folder, tuple(sorted(model.files_sha256.items())))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(folder: str, files_sha256: tuple[tuple[str, str], ...]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def tokenize(tokenizer: Any, text: str, d_vocab: int, what: str) -> list[int]:
    """The ids of `text` through `tokenizer`, checked to be ids of the model (`what` names the input in errors)."""
    ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError(f"{what} tokenizes to no tokens; give some text")
    if (largest := max(ids)) >= d_vocab:
        raise ValueError(
            f"{what}: the tokenizer gave id {largest}, out of range for the model's d_vocab={d_vocab} (the folder's "
            "tokenizer does not fit its model: give token ids instead)"
        )
    return ids


# ---------------------------------------------------------------------------- import
def _d_vocab(config: Mapping[str, Any]) -> int:
    """The valid ids: the unembedding's rows (Inkling pads its embedding to `vocab_size`)."""
    return int(config.get("unpadded_vocab_size") or config["vocab_size"])


def _n_ctx(config: Mapping[str, Any]) -> int:
    return int(config.get("max_position_embeddings") or DEFAULT_SEQ_LEN)


def model_sizes(config: Mapping[str, Any]) -> dict[str, int]:
    """A task's `vocab_size` and default `seq_len` for a transformers model's config.json."""
    return {"vocab_size": _d_vocab(config), "seq_len": min(_n_ctx(config), DEFAULT_SEQ_LEN)}


def model_section(folder: Path, config: dict[str, Any], files: list[str], dtype: str) -> TransformersModel:
    import transformers

    return TransformersModel(
        folder=str(folder.resolve()),
        architecture=next(name for name in config["architectures"] if name in RESIDUALS),
        model_type=str(config.get("model_type") or ""),
        transformers_version=transformers.__version__,
        d_vocab=_d_vocab(config),
        n_ctx=_n_ctx(config),
        n_layers=int(config["num_hidden_layers"]),
        files_sha256=_hashes(folder, files),
        dtype=dtype,
    )


def import_hf_run(
    path: PathLike,
    out: PathLike,
    *,
    task: Mapping[str, Any] | None = None,
    text: PathLike | None = None,
    dtype: str = "float32",
) -> tuple[Path, float]:
    """Write a run directory referring to the transformers folder `path` (docs/interop.md §7): config.json with the
    `TransformersModel` section, the task and a provenance, no checkpoint. The task is `task` (config.json's form,
    e.g. the tokens task on a `--tokens` file), or with `text` the file's text through the folder's tokenizer, saved
    as RUN/tokens.npy and read by the tokens task, all of it held out, or by default the copy task at the model's vocabulary. Returns the
    run's path and the model's loss on `EVAL_SEQUENCES` held-out sequences (measured before config.json is written:
    a task that does not fit the model leaves no run)."""
    import attnres_lens
    from attnres_lens.config import RunConfig, TaskConfig
    from attnres_lens.interop import default_task, imported_train_config

    if dtype not in DTYPES:
        raise ImportHfError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if text is not None and task is not None and task.get("name") != "tokens":
        raise ImportHfError("--text makes the task the tokens of the text; it cannot be combined with --task")
    folder = Path(path)
    config, files = read_model_folder(folder)
    model = model_section(folder, config, files, dtype)
    run_dir = RunDir(out)
    with run_dir.writing_new_run(_refuse_used_folder):
        params = dict(task) if task is not None else None
        if text is not None:
            tokenizer = open_tokenizer(model, run_dir.path)
            if tokenizer is None:
                raise ImportHfError(
                    f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES[:2])} …): give token ids with --tokens"
                )
            if not Path(text).is_file():
                raise ImportHfError(f"--text {text} is not a file; give the text to evaluate the model on")
            ids = tokenize(tokenizer, read_text_file(text, ImportHfError), model.d_vocab, f"--text {text}")
            run_dir.write_tokens(np.asarray(ids, dtype=np.uint32))
            # the text is for evaluation only (an imported model never trains): all of it is held out
            params = {"seq_len": min(model.n_ctx, DEFAULT_SEQ_LEN), "holdout": 1.0, **(params or {}), "name": "tokens"}
            params.update(path=str(run_dir.tokens_path.resolve()), vocab_size=model.d_vocab)
        elif params is None:
            params = default_task(Sizes(model.d_vocab, min(model.n_ctx, DEFAULT_SEQ_LEN)), "copy")
        try:
            task_config = TaskConfig.from_dict(params)
        except ValueError as err:
            raise ImportHfError(f"the evaluation task: {err}") from err
        built = task_config.build()
        if built.vocab_size > model.d_vocab or built.seq_len > model.n_ctx:
            raise ImportHfError(
                f"the task needs vocab {built.vocab_size} and length {built.seq_len}, but the model has "
                f"d_vocab={model.d_vocab} and n_ctx={model.n_ctx}; set task.vocab_size / task.seq_len within them"
            )
        bridge = open_model(model, run_dir.path)
        import torch

        with torch.no_grad():
            loss = float(bridge(built.eval_batch(EVAL_SEQUENCES).tokens, return_type="loss"))
        run_config = RunConfig(model, task_config, imported_train_config(EVAL_SEQUENCES))
        run_config.provenance = {
            "source": SOURCE,
            "path": model.folder,
            "eval_loss": loss,
            "imported_by": f"attnres_lens {attnres_lens.__version__}",
            "imported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        run_dir.write_config(run_config)
    return run_dir.path, loss


@dataclass(frozen=True)
class Sizes:
    """What `interop.default_task` reads of a model: its vocabulary and the context the task may use."""

    d_vocab: int
    n_ctx: int


def _refuse_used_folder(run_dir: RunDir) -> None:
    if run_dir.holds_run():
        raise ImportHfError(f"{run_dir.path} already holds a run; give a new folder with --out")
    if foreign := run_dir.foreign_entries():
        raise ImportHfError(f"{run_dir.path} is not empty ({', '.join(foreign[:5])}); give a new folder with --out")
