"""Test-session setup that must happen before any module imports triton."""

import gc
import os

import pytest
import torch

# Triton reads TRITON_INTERPRET once, at import: without a GPU its kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny tensors on a shared 2-core CPU: one torch thread is many times faster than two (docs/kernels.md §11).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _unfreeze_after_commands():
    """A command run in-process (`cli.main`) freezes the objects alive then out of the garbage collector's
    traversals (cpu_settings.configure): right for a command's own process, not for the test session's."""
    yield
    gc.unfreeze()
