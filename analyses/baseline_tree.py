"""Another commit's code beside this checkout's, for the benchmarks that compare the two side by side.

`checked_out(revision)` puts the commit in a temporary git worktree; `tree_command(tree, code)` is a Python command
line that imports the `attnres_lens` package from that tree (ahead of this checkout's editable install, in the
same environment, so only the code differs) and then runs `code`. On a shared machine only such alternating runs
compare two versions: the same command swings ±30% within an hour.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

REPOSITORY = Path(__file__).resolve().parent.parent

# Imports the package from the tree in argv[1] (not the editable install); argv[1] is removed, so the code that
# follows sees its own arguments from argv[1] on.
_FROM_TREE = """
import sys
tree = sys.argv.pop(1)
sys.meta_path = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
sys.path.insert(0, tree)
import attnres_lens
assert attnres_lens.__file__.startswith(tree), attnres_lens.__file__
"""


def short_revision(revision: str) -> str:
    return subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", revision],
                          capture_output=True, text=True, check=True).stdout.strip()


def this_checkout() -> str:
    """How reports name this checkout: its commit, and whether code (.py, .c) has uncommitted changes."""
    edited = subprocess.run(["git", "-C", str(REPOSITORY), "status", "--porcelain", "--untracked-files=no", "--",
                             "*.py", "*.c", "*.h"], capture_output=True, text=True, check=True).stdout.strip()
    return f"this checkout ({short_revision('HEAD')}{' + uncommitted changes' if edited else ''})"


@contextlib.contextmanager
def checked_out(revision: str) -> Iterator[Path]:
    """`revision` in a temporary worktree (removed afterwards, whatever happens), with a scratch folder beside it:
    yields the tree's path."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", str(tree), revision],
                       check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)


def tree_command(tree: Path, code: str, *arguments: str) -> list[str]:
    """The command line that runs `code` (a Python script; `arguments` are its sys.argv[1:]) with `attnres_lens`
    imported from `tree`."""
    return [sys.executable, "-c", _FROM_TREE + code, str(tree), *arguments]
