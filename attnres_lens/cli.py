"""`attnres-lens` command line: presets, train, resume."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres-lens", description="Train and inspect AttnRes / KV-shift models.")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("presets", help="list the training presets")

    train = commands.add_parser("train", help="train a preset (or resume a run)")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="preset name (see `attnres-lens presets`)")
    source.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    train.add_argument("--out", metavar="DIR", help="run directory to create (required with --preset)")
    train.add_argument("--steps", type=int, help="total training steps (overrides the preset; extends a resumed run)")
    train.add_argument("--seed", type=int, help="seed for model init and data (train.seed and task.seed)")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where to train (default: the preset's, auto)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set model.n_layers=3 --set train.lr=1e-3 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # Imports after parsing, so `--help` is instant (transformer_lens takes seconds to import).
    from attnres_lens.presets import PRESETS

    if args.command == "presets":
        width = max(map(len, PRESETS))
        for name, (description, _) in PRESETS.items():
            print(f"{name:<{width}}  {description}")
        return 0
    if args.command == "train":
        return _train(args)
    raise AssertionError(args.command)


def _train(args: argparse.Namespace) -> int:
    from attnres_lens.presets import apply_overrides, get_preset
    from attnres_lens.rundir import RunDirError
    from attnres_lens.training import TrainingDiverged, resume, train

    try:
        if args.resume:
            if args.out or args.overrides or args.seed is not None or args.device:
                raise ValueError("--resume continues a run with its own config; only --steps may be given with it")
            trainer = resume(args.resume, progress=not args.no_progress, steps=args.steps)
        else:
            if not args.out:
                raise ValueError("--out DIR is required with --preset")
            overrides = list(args.overrides)
            if args.steps is not None:
                overrides.append(f"train.steps={args.steps}")
            if args.seed is not None:
                overrides += [f"train.seed={args.seed}", f"task.seed={args.seed}"]
            if args.device:
                overrides.append(f"train.device={args.device}")
            config = apply_overrides(get_preset(args.preset), overrides)
            trainer = train(config, args.out, progress=not args.no_progress)
    except (ValueError, FileExistsError, RunDirError, TrainingDiverged) as err:
        print(f"attnres-lens: error: {err}", file=sys.stderr)
        return 2 if not isinstance(err, TrainingDiverged) else 3
    if trainer.rank == 0:
        final = trainer.last_eval
        summary = ", ".join(f"{k}={v:.4g}" for k, v in final.items())
        print(f"run saved in {trainer.out_dir} (step {trainer.step}; {summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
