"""The command-line tools' process settings: thread count and glibc's freed-memory policy."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from attnres_lens import cpu_settings
from attnres_lens.cli import main


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_set_threads_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match=r"threads must be a whole number >= 0.*got"):
        cpu_settings.set_threads(bad)


def test_set_threads_zero_keeps_the_default_and_n_sets_n():
    before = torch.get_num_threads()
    try:
        cpu_settings.set_threads(0)
        assert torch.get_num_threads() == before
        cpu_settings.set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cli_names_a_bad_thread_count(capsys, tmp_path):
    assert main(["prune", str(tmp_path), "--threads", "-2"]) == 2
    assert "threads must be a whole number >= 0" in capsys.readouterr().err


# Six 4 MB blocks allocated and freed together, over and over: glibc's default trims the freed top of its heap
# (more than twice its adapted mmap threshold) and faults the pages in again on the next round.
_FAULT_PROBE = """
import ctypes, resource, sys
from attnres_lens import cpu_settings
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    for _ in range(3):  # warm-up rounds: the first allocation faults either way
        rounds()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rounds()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def rounds():
    for _ in range(20):
        blocks = [libc.malloc(4 << 20) for _ in range(6)]
        for block in blocks:
            ctypes.memset(block, 1, 4 << 20)
        for block in blocks:
            libc.free(block)
default = faults()
applied = cpu_settings.keep_freed_memory()
print(default, faults(), applied)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
@pytest.mark.slow
def test_keep_freed_memory_stops_repeated_page_faults():
    out = subprocess.run([sys.executable, "-c", _FAULT_PROBE], capture_output=True, text=True, check=True).stdout
    default, kept, applied = out.split()
    assert applied == "True"
    # 20 rounds x 24 MB is ~120k pages: the default faults most of them in again, the setting almost none
    assert int(default) > 10_000, out
    assert int(kept) < int(default) / 20, out


@pytest.mark.slow
def test_configure_freezes_the_objects_alive_out_of_the_collector():
    probe = (
        "import gc\nfrom attnres_lens import cpu_settings\nbefore = gc.get_freeze_count()\n"
        "cpu_settings.configure(0)\nprint(before, gc.get_freeze_count())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert before == 0 and after > 10_000  # every object of the imports (torch alone has far more)


def test_the_train_command_configures_its_process_like_the_analysis_commands(monkeypatch, tmp_path):
    """`train` keeps freed memory and freezes its imports too: a training step's activations are freed and
    allocated again every step (without it a 4-layer step page-faulted hundreds of times, docs/kernels.md §11)."""
    calls = []
    monkeypatch.setattr(cpu_settings, "configure", lambda threads=0: calls.append(threads))
    assert main(["train", "--preset", "smoke", "--out", str(tmp_path / "run"), "--steps", "2", "--no-progress"]) == 0
    assert calls == [0]  # the run's own thread count (train.threads) is then set by the trainer
