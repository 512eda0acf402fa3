"""Test-session setup that must happen before any module imports triton, and the fixtures several test files share."""

import gc
import hashlib
import os
from pathlib import Path

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


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A command or trainer run in-process sets torch's thread count for its process; the next test must not inherit
    it (float32 sums split over another number of threads round differently)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _fingerprint(root: Path) -> dict[str, str]:
    """Every file's hash, but the writer lock's: a command refused on the run still takes the lock and writes its
    own name into it (docs/run_directory.md), by design."""
    from attnres_lens.rundir import RunDir

    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != RunDir.LOCK
    }


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The smoke preset (Block AttnRes + KV shift, 40 steps, snapshots every 10, checkpoints at 20 and 40), trained
    once for the session. Tests read it; a test that writes into a run copies it first (shutil.copytree): the run is
    checked unchanged at the end of the session."""
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    out = tmp_path_factory.mktemp("shared") / "smoke"
    train(get_preset("smoke"), out, progress=False)
    trained = _fingerprint(out)
    yield out
    now = _fingerprint(out)
    changed = sorted(name for name in trained.keys() | now.keys() if trained.get(name) != now.get(name))
    assert not changed, f"a test changed the shared smoke run (copy it before writing into it): {changed}"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer a kernel allocates starts as NaN, so an element it fails to write cannot pass; and no
    $ATTNRES_LENS_BACKEND from the environment picks the backend a test asks for."""
    from attnres_lens.kernels import _common, backends

    monkeypatch.setattr(_common, "POISON_OUTPUTS", True)
    monkeypatch.delenv(backends.BACKEND_ENV_VAR, raising=False)


@pytest.fixture(scope="session")
def inkling_folders(tmp_path_factory) -> dict[str, str]:
    """A tiny Inkling-2 ('plain') and Inkling-2-Mini ('loop') saved to folders once per session (tests/helpers.py's
    `save_tiny_inkling`); the Mini's folder also holds a tiny word-level tokenizer. Tests only read them."""
    pytest.importorskip("transformers")
    from tests.helpers import save_tiny_inkling, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("inkling")
    folders = {kind: save_tiny_inkling(kind, root / kind) for kind in ("plain", "loop")}
    save_tiny_tokenizer(folders["loop"])
    return folders


@pytest.fixture(scope="session")
def hf_runs(inkling_folders, tmp_path_factory) -> dict[str, Path]:
    """Runs made by `import-hf`, once per session, in one folder (a dashboard can serve it): 'plain' refers to the
    Inkling-2 folder, evaluated on a token file; 'loop' to the Mini's, on text through its tokenizer. Tests that
    write into a run copy it first."""
    import numpy as np

    from attnres_lens.cli import main
    from tests.helpers import HF_RUN_TEXT

    data, root = tmp_path_factory.mktemp("hf_inputs"), tmp_path_factory.mktemp("hf_runs")
    (data / "text.txt").write_text(HF_RUN_TEXT)
    np.save(data / "ids.npy", np.random.default_rng(0).integers(0, 60, 2000).astype(np.uint32))
    options = {
        "plain": ["--tokens", str(data / "ids.npy"), "--set", "task.seq_len=24"],
        "loop": ["--text", str(data / "text.txt"), "--set", "task.seq_len=24"],
    }
    for kind, extra in options.items():
        assert main(["import-hf", inkling_folders[kind], "--out", str(root / kind), *extra]) == 0
    return {kind: root / kind for kind in options}


@pytest.fixture(scope="session")
def deepseek_v4_folder(tmp_path_factory) -> str:
    """A tiny DeepSeek V4 (mHC) saved to a folder once per session (tests/helpers.py's `save_tiny_deepseek_v4`).
    Tests only read it."""
    pytest.importorskip("transformers")
    from tests.helpers import save_tiny_deepseek_v4

    return save_tiny_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4") / "tiny")


@pytest.fixture(scope="session")
def deepseek_v4_run(deepseek_v4_folder, tmp_path_factory) -> Path:
    """A run made by `import-hf` from the DeepSeek V4 folder, once per session, alone in its folder (a dashboard can
    serve it), evaluated on 16-token windows of a token file. Tests that write into it copy it first."""
    import numpy as np

    from attnres_lens.cli import main

    data, root = tmp_path_factory.mktemp("deepseek_v4_inputs"), tmp_path_factory.mktemp("deepseek_v4_runs")
    np.save(data / "ids.npy", np.random.default_rng(0).integers(0, 64, 1000).astype(np.uint32))
    argv = ["import-hf", deepseek_v4_folder, "--out", str(root / "mhc"), "--tokens", str(data / "ids.npy")]
    assert main([*argv, "--set", "task.seq_len=16"]) == 0
    return root / "mhc"
