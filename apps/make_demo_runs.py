"""Train the dashboard's demo runs into `data/demo_runs/` (only those missing), with progress bars.

The set covers standard / Full / Block AttnRes on the depth task, 1- and 2-layer vanilla / KV-shift attention on
the induction task and Block AttnRes on real text (byte-level Shakespeare): the project's presets, at 6 layers for
the depth runs, trained long enough that their heatmaps show structure (about 30 minutes for all eight on a 2-core
CPU).
Optimiser state files are deleted to keep the folder small, so demo runs cannot be resumed; train a preset
with `attnres-lens train` for a run you want to continue.

    python apps/make_demo_runs.py [--out data/demo_runs] [--force]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "data" / "demo_runs"

# Long enough to show structure: the induction runs cover 2-layer vanilla's late transition (~5000 steps), the
# depth runs the preset's whole budget at 6 layers; frequent records give the step sliders snapshots to scrub.
# One kept checkpoint (plus the best) keeps the folder within a few MB. One torch thread: on a busy 2-core machine a
# second thread makes steps many times slower, on a quiet one it saves little at these sizes.
INDUCTION_OVERRIDES = [
    "train.steps=6000",
    "train.eval_every=100",
    "train.record_every=250",
    "train.log_every=50",
    "train.checkpoint_every=1000",
    "train.keep_checkpoints=1",
    "train.threads=1",
]
DEPTH_OVERRIDES = [
    "model.n_layers=6",
    "train.steps=1500",
    "train.eval_every=100",
    "train.record_every=100",
    "train.log_every=25",
    "train.checkpoint_every=500",
    "train.keep_checkpoints=1",
    "train.threads=1",
]

# Real text: the preset's own budget (the real-text study's runs, docs/tasks.md §6), with finer records.
SHAKESPEARE_OVERRIDES = [
    "train.record_every=100",
    "train.keep_checkpoints=1",
    "train.threads=1",
]

DEMO_RUNS: dict[str, tuple[str, list[str]]] = {
    "induction-1l-vanilla": ("induction-1l-vanilla", INDUCTION_OVERRIDES),
    "induction-1l-kvshift": ("induction-1l-kvshift", INDUCTION_OVERRIDES),
    "induction-2l-vanilla": ("induction-2l-vanilla", INDUCTION_OVERRIDES),
    "induction-2l-kvshift": ("induction-2l-kvshift", INDUCTION_OVERRIDES),
    "depth-standard-6l": ("depth-standard", DEPTH_OVERRIDES),
    "depth-full-6l": ("depth-full", DEPTH_OVERRIDES),
    "depth-block-6l": ("depth-block", DEPTH_OVERRIDES),
    "shakespeare-block-6l": ("shakespeare-block", SHAKESPEARE_OVERRIDES),
}


def train_demo_run(name: str, out: Path) -> None:
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.rundir import RunDir
    from attnres_lens.training import train

    preset, overrides = DEMO_RUNS[name]
    run_dir = out / name
    if run_dir.exists():  # an interrupted demo run: start it again rather than mix two histories
        shutil.rmtree(run_dir)
    train(apply_overrides(get_preset(preset), overrides), run_dir, progress=True)
    RunDir(run_dir).drop_training_state()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder of demo runs (default {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="retrain every demo run, even complete ones")
    args = parser.parse_args(argv)
    from attnres_lens.rundir import run_is_complete

    missing = [name for name in DEMO_RUNS if args.force or not run_is_complete(args.out / name)]
    if not missing:
        print(f"demo runs present in {args.out} ({len(DEMO_RUNS)} runs)")
        return 0
    print(f"training {len(missing)} demo run(s) into {args.out}: {', '.join(missing)}", flush=True)
    start = time.perf_counter()
    for number, name in enumerate(missing, start=1):
        print(f"[{number}/{len(missing)}] {name}", flush=True)
        train_demo_run(name, args.out)
    print(f"demo runs ready in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
