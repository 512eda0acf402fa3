"""README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

from attnres_lens.config import apply_overrides
from attnres_lens.presets import get_preset
from attnres_lens.training import train

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run(capsys, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no Python example"
    # The examples read the run that README's training command writes to runs/x: a quick stand-in.
    monkeypatch.chdir(tmp_path)
    train(apply_overrides(get_preset("smoke"), ["train.steps=10"]), tmp_path / "runs" / "x", progress=False)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert "emb" in capsys.readouterr().out
