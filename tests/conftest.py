"""Test-session setup that must happen before any module imports triton."""

import os

import torch

# Triton reads TRITON_INTERPRET once, at import: without a GPU its kernels run on the CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny tensors on a shared 2-core CPU: one torch thread is many times faster than two (docs/kernels.md §11).
torch.set_num_threads(1)
