"""Token-file task: windows of a file of token ids written by any tokenizer (docs/tasks.md §5).

The one task that is not synthetic. The file is memory-mapped, never read whole: a raw array of uint16 or uint32 ids
(`dtype` says which: a raw file does not record it) or a `.npy` file (its header records the dtype). Its last
`holdout` fraction is the held-out split; training windows start anywhere in the rest. `holdout` = 1 holds out the
whole file, for a model that is only evaluated (an imported one): such a task refuses to draw training windows.

* Sequences are `seq_len` consecutive ids exactly as the file holds them. Unlike the synthetic tasks no BOS is
  inserted and id 0 is not reserved: the ids are the tokenizer's (if its documents start with a BOS, the file has it).
* Every position with a target is an answer position: on real text no position is determined by a rule, so the
  accuracy is plain next-token top-1 accuracy.
* `eval_batch(n)` is n windows spread evenly over the held-out split, the same for a given n.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import Batch, Task, check_int

TOKEN_DTYPES = ("uint16", "uint32")
_SCAN_CHUNK = 1 << 24  # ids per chunk when scanning a file for its largest id (64 MiB of uint32)
# (path, size, mtime, dtype) -> (ids, largest id): building a run's task happens on every config read (dashboard
# reruns included), and a scan of a multi-GB file should happen once
_SCANNED: dict[tuple, tuple[int, int]] = {}


def open_token_file(path: str, dtype: str | None) -> np.ndarray:
    """The ids of `path` as a read-only memory map (1-D, uint16 or uint32); ValueError says what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"tokens: token file {path} does not exist")
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise ValueError(f"tokens: dtype must be one of {list(TOKEN_DTYPES)} (or null for a .npy file), got {dtype!r}")
    if file.suffix == ".npy":
        try:
            ids = np.load(file, mmap_mode="r", allow_pickle=False)
        except ValueError as err:  # object arrays, damaged headers
            raise ValueError(f"tokens: {path} is not a readable .npy array of token ids ({err})") from err
        if ids.dtype.name not in TOKEN_DTYPES:
            raise ValueError(
                f"tokens: {path} holds {ids.dtype.name} values; token ids must be uint16 or uint32 "
                "(convert with array.astype(numpy.uint32))"
            )
        if dtype is not None and ids.dtype.name != dtype:
            raise ValueError(
                f"tokens: {path} holds {ids.dtype.name} ids but the task says dtype={dtype!r}; "
                "leave dtype unset for .npy files"
            )
        if ids.ndim != 1:
            raise ValueError(f"tokens: {path} has shape {ids.shape}; a token file is one flat sequence of ids")
        return ids
    if dtype is None:
        raise ValueError(
            f"tokens: {path} is a raw file, which does not record its dtype; say which with "
            f"task.dtype={TOKEN_DTYPES[0]} or {TOKEN_DTYPES[1]} (import-fla and import-hf: --tokens-dtype), or save "
            "it as .npy"
        )
    itemsize = np.dtype(dtype).itemsize
    size = file.stat().st_size
    if size % itemsize:
        raise ValueError(
            f"tokens: {path} has {size} bytes, not a whole number of {dtype} ids: is its dtype really {dtype}?"
        )
    if size == 0:
        raise ValueError(f"tokens: {path} is empty")
    return np.memmap(file, dtype=dtype, mode="r")


def _largest_id(path: str, ids: np.ndarray) -> int:
    stat = os.stat(path)
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, ids.dtype.name)
    if key not in _SCANNED:
        largest = max(int(ids[start : start + _SCAN_CHUNK].max()) for start in range(0, len(ids), _SCAN_CHUNK))
        _SCANNED[key] = (len(ids), largest)
    return _SCANNED[key][1]


@dataclass(kw_only=True)
class TokensTask(Task):
    """Windows of `seq_len` ids from the token file `path`; the last `holdout` fraction is held out.

    Parameters: `path` (relative paths are relative to the working directory; an import-hf run's config.json names
    its own tokens.npy, resolved by `RunDir.read_config`), `dtype` ("uint16" / "uint32"; needed
    for raw files, read from the header of `.npy` files), `holdout` (default 0.1; 1: the whole file, evaluation
    only), plus `vocab_size` (every id must be below it: the model's vocabulary), `seq_len` and `seed` (training
    windows only).
    """

    name = "tokens"
    path: str = ""
    dtype: str | None = None
    holdout: float = 0.1

    def _validate(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError("tokens: give the token file as task.path")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not 0 < self.holdout <= 1:
            raise ValueError(
                f"tokens: holdout must be a fraction above 0 and at most 1 (1: evaluation only), got {self.holdout!r}"
            )
        ids = open_token_file(self.path, self.dtype)
        n_eval = math.ceil(len(ids) * self.holdout)
        self._split = len(ids) - n_eval
        if self.holdout == 1 and n_eval < self.seq_len:
            raise ValueError(
                f"tokens: {self.path} holds {len(ids)} ids, fewer than one window of seq_len={self.seq_len}; use a "
                "longer file or a smaller seq_len"
            )
        if self.holdout < 1 and min(self._split, n_eval) < self.seq_len:
            raise ValueError(
                f"tokens: {self.path} holds {len(ids)} ids, too short for seq_len={self.seq_len}: its training part "
                f"has {self._split} and its held-out part ({self.holdout:g} of the file) {n_eval}, and each needs at "
                f"least one window of {self.seq_len}; use a longer file, a smaller seq_len or another holdout"
            )
        largest = _largest_id(self.path, ids)
        if largest >= self.vocab_size:
            raise ValueError(
                f"tokens: {self.path} holds id {largest}, out of range for vocab_size={self.vocab_size} "
                f"(valid ids 0..{self.vocab_size - 1}); set vocab_size to the tokenizer's vocabulary "
                "(the model's d_vocab), or check the file's dtype"
            )
        self._ids = ids

    def _windows(self, starts: np.ndarray) -> Batch:
        rows = np.stack([np.asarray(self._ids[start : start + self.seq_len], dtype=np.int64) for start in starts])
        tokens = torch.from_numpy(rows)
        return self._batch(tokens, torch.ones_like(tokens, dtype=torch.bool))  # every position with a target

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        if self._split == 0:
            raise ValueError(
                f"tokens: holdout=1 holds out the whole of {self.path}, so there are no training windows; train with "
                "a holdout below 1 (task.holdout=0.1)"
            )
        starts = torch.randint(0, self._split - self.seq_len + 1, (batch_size,), generator=generator)
        return self._windows(starts.numpy())

    def eval_batch(self, n: int) -> Batch:
        """n windows spread evenly over the held-out split (overlapping only when n windows do not fit side by side)."""
        check_int(self.name, "n", n, 1)
        last = len(self._ids) - self.seq_len  # the last window that fits
        starts = np.linspace(self._split, last, n).round().astype(np.int64) if n > 1 else np.array([self._split])
        return self._windows(starts)
