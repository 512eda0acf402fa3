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
    # The examples read the run that README's training command writes to runs/x (a quick stand-in: the same preset
    # and settings, 10 steps) and the shipped demo runs, by paths relative to the repository
    text = README.read_text()
    command = re.search(r"attnres-lens train --preset (\S+) --out runs/x((?: --set \S+)*)\n", text)
    preset, settings = command.group(1), command.group(2).split()[1::2]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(README.parent / "data")
    overrides = [*settings, "train.steps=10", "train.record_every=5", "train.eval_every=5", "train.checkpoint_every=10"]
    train(apply_overrides(get_preset(preset), overrides), tmp_path / "runs" / "x", progress=False)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert "emb" in capsys.readouterr().out
