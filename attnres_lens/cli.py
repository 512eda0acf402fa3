"""`attnres-lens` command line: presets, train, resume, analyze, prune, attribute, import-fla, export-fla, import-hf,
dashboard."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# Both import nothing heavy: arguments are checked before torch and transformer_lens load (seconds).
from attnres_lens.analysis_options import (
    ANALYZE_SAMPLES,
    ATTRIBUTE_SAMPLES,
    MIN_SAMPLES,
    PRUNE_METRICS,
    PRUNE_SAMPLES,
    check_metric,
    check_samples,
    plural,
)
from attnres_lens.presets import PRESETS, check_preset

# The dashboard lives in the source tree (apps/), next to the package: an editable install from a clone finds it.
REPO_ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_APP = REPO_ROOT / "apps" / "app.py"


def build_parser() -> argparse.ArgumentParser:
    """Every `attnres-lens` command and its options; built without importing torch, so `--help` is instant."""
    parser = argparse.ArgumentParser(prog="attnres-lens", description="Train and inspect AttnRes / KV-shift models.")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.subcommand_parsers = commands.choices  # each command's parser, for its own usage line in errors

    commands.add_parser("presets", help="list the training presets")

    train = commands.add_parser("train", help="train a preset (or resume a run)")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="preset name (see `attnres-lens presets`)")
    source.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    train.add_argument("--out", metavar="DIR", help="run directory to create (required with --preset)")
    train.add_argument(
        "--steps",
        type=int,
        help="total training steps (overrides the preset; with --resume, a larger total extends the run)",
    )
    train.add_argument("--seed", type=int, help="seed for model init and data (train.seed and task.seed)")
    train.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help="where to train (default: the preset's, auto; with --resume: the run's)",
    )
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set model.n_layers=3 --set train.lr=1e-3 (repeatable)",
    )
    train.add_argument(
        "--threads",
        type=int,
        help="with --resume: torch threads to continue with (0: one per core; default: the run's); a new run "
        "takes --set train.threads=N",
    )
    train.add_argument(
        "--checkpoint",
        help="with --resume: continue from this checkpoint ('latest', 'best', a step "
        "or a name; default latest), e.g. when the latest one is damaged",
    )
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    analyze = commands.add_parser("analyze", help="induction heads, in-context learning and depth maps of a run")
    analyze.add_argument("run", metavar="RUN", help="run directory")
    analyze.add_argument(
        "--samples", type=int, default=ANALYZE_SAMPLES, help=f"evaluation sequences (default: {ANALYZE_SAMPLES})"
    )
    analyze.add_argument("--out", metavar="DIR", help="output folder (default: RUN/analysis)")

    prune = commands.add_parser("prune", help="layer-pruning sensitivity report of a run (tables + HTML)")
    prune.add_argument("run", metavar="RUN", help="run directory")
    prune.add_argument(
        "--metric", default="loss", help=f"order and plot by {' or '.join(map(repr, PRUNE_METRICS))} (default: loss)"
    )
    prune.add_argument("--out", metavar="DIR", help="output folder (default: RUN/analysis)")
    prune.add_argument(
        "--samples",
        type=int,
        default=PRUNE_SAMPLES,
        help=f"evaluation sequences (default: {PRUNE_SAMPLES}; at least {MIN_SAMPLES['prune']})",
    )
    attribute = commands.add_parser(
        "attribute",
        help="attribution through depth: which sources a prediction uses, and through which path (tables + HTML)",
    )
    attribute.add_argument("run", metavar="RUN", help="run directory")
    attribute.add_argument(
        "--samples",
        type=int,
        default=ATTRIBUTE_SAMPLES,
        help=f"held-out sequences (default: {ATTRIBUTE_SAMPLES}; at least {MIN_SAMPLES['attribute']})",
    )
    attribute.add_argument(
        "--prompt",
        metavar="TEXT",
        help="the prompt of the per-position views: text for a run on real text (the shakespeare task, as bytes) "
        "or made by import-hf from a folder with a tokenizer (through it), else space-separated token ids "
        "(default: the first held-out sequence)",
    )
    attribute.add_argument("--out", metavar="DIR", help="output folder (default: RUN/analysis)")
    for command in (analyze, prune, attribute):
        command.add_argument(
            "--checkpoint", default="latest", help="'latest', 'best' or a step number (default: latest)"
        )
        command.add_argument("--no-progress", action="store_true", help="hide the progress bars")
        command.add_argument(
            "--threads",
            type=int,
            default=0,
            help="torch threads (default 0: one per core; interventions run stacked and use them)",
        )

    import_fla = commands.add_parser("import-fla", help="open a flash-linear-attention Transformer as a run directory")
    import_fla.add_argument("path", metavar="PATH", help="FLA model directory (config.json + model.safetensors)")
    import_fla.add_argument("--out", metavar="RUN", required=True, help="run directory to create")
    evaluation = import_fla.add_mutually_exclusive_group()
    evaluation.add_argument(
        "--task",
        metavar="NAME",
        help="the analyses' evaluation task, at the model's vocabulary and context (default: copy)",
    )
    evaluation.add_argument(
        "--tokens",
        metavar="FILE",
        help="evaluate on windows of a token-id file instead (uint16/uint32 raw or .npy; task 'tokens')",
    )
    import_fla.add_argument("--tokens-dtype", choices=["uint16", "uint32"], help="dtype of a raw --tokens file")
    import_fla.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="task.KEY=VALUE",
        help="override a task parameter, e.g. --set task.seq_len=129 (repeatable)",
    )
    import_fla.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16"],
        help="dtype of the imported model (default float32; bf16 weights upcast exactly)",
    )

    export_fla = commands.add_parser("export-fla", help="write a run's model as a flash-linear-attention directory")
    export_fla.add_argument("run", metavar="RUN", help="run directory")
    export_fla.add_argument("--out", metavar="DIR", required=True, help="new folder for the FLA model")
    export_fla.add_argument(
        "--checkpoint", default="latest", help="'latest', 'best' or a step number (default: latest)"
    )
    export_fla.add_argument(
        "--dtype",
        choices=["float32", "float64", "bfloat16", "float16"],
        help="dtype of the written weights (default: the model's; for a run imported from FLA, the dtype it came in)",
    )

    import_hf = commands.add_parser(
        "import-hf",
        help="a run directory referring to a transformers Inkling-2 / Inkling-2-Mini / DeepSeek V4 folder (no copy of the weights)",
    )
    import_hf.add_argument("path", metavar="DIR", help="the folder save_pretrained wrote (config.json + safetensors)")
    import_hf.add_argument("--out", metavar="RUN", required=True, help="run directory to create")
    held_out = import_hf.add_mutually_exclusive_group()
    held_out.add_argument(
        "--tokens",
        metavar="FILE",
        help="evaluate on windows of a token-id file (uint16/uint32 raw or .npy; task 'tokens')",
    )
    held_out.add_argument(
        "--text",
        metavar="FILE",
        help="evaluate on a UTF-8 text file, tokenized by the folder's own tokenizer (saved as RUN/tokens.npy)",
    )
    held_out.add_argument(
        "--task", metavar="NAME", help="a synthetic evaluation task at the model's vocabulary (default: copy)"
    )
    import_hf.add_argument("--tokens-dtype", choices=["uint16", "uint32"], help="dtype of a raw --tokens file")
    import_hf.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="task.KEY=VALUE",
        help="override a task parameter, e.g. --set task.seq_len=512 (default length: 256) (repeatable)",
    )
    import_hf.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64", "bfloat16"],
        help="dtype the analyses open the model in (default float32)",
    )

    dashboard = commands.add_parser("dashboard", help="open the Streamlit dashboard on a folder of runs")
    dashboard.add_argument(
        "--runs",
        metavar="DIR",
        default=str(REPO_ROOT / "data" / "demo_runs"),
        help="a run directory or a folder of them (default: data/demo_runs)",
    )
    dashboard.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    dashboard.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (bad input is a one-line error, not a traceback)."""
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(words)
    if unknown:  # after the command, its own usage says what it takes; before it, the top-level usage
        after_command = words.index(args.command) < min(words.index(word) for word in unknown)
        (parser.subcommand_parsers[args.command] if after_command else parser).error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    if args.command == "dashboard":  # the dashboard process does its own imports
        return _dashboard(args)
    # Arguments are checked here, before the commands import torch and transformer_lens (seconds): a typo is
    # answered at once.
    try:
        check_arguments(args)
    except ValueError as err:
        print(f"attnres-lens: error: {err}", file=sys.stderr)
        return 2
    if args.command == "presets":
        width = max(map(len, PRESETS))
        for name, (description, _) in PRESETS.items():
            print(f"{name:<{width}}  {description}")
        return 0
    if args.command == "train":
        return _train(args)
    if args.command in ("analyze", "prune", "attribute"):
        return _analysis(args)
    if args.command in ("import-fla", "export-fla"):
        return _fla(args)
    if args.command == "import-hf":
        return _import_hf(args)
    raise AssertionError(args.command)


def check_arguments(args: argparse.Namespace) -> None:
    """What can be refused without torch: sample counts, the pruning metric, preset names and run directories that
    do not exist. The libraries check the rest (--set fields, thread counts, a run's contents, checkpoints)."""
    if args.command in ("analyze", "prune", "attribute"):
        check_samples(args.samples, MIN_SAMPLES[args.command])
        if args.command == "prune":
            check_metric(args.metric)
    if args.command == "train":
        if args.preset is not None:
            check_preset(args.preset)
    run = args.resume if args.command == "train" else getattr(args, "run", None)
    if run is not None and not Path(run).is_dir():
        what = "is a file, not a folder" if Path(run).exists() else "does not exist"
        raise ValueError(
            f"run directory {run} {what}; give a folder that holds a run (one `attnres-lens train --out DIR` wrote)"
        )


def _train(args: argparse.Namespace) -> int:
    from attnres_lens import cpu_settings
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.rundir import RunDir, RunDirError
    from attnres_lens.training import TrainingDiverged, resume, train

    cpu_settings.configure()  # freed memory kept, imports frozen; the run's own thread count is set by train
    try:
        if args.resume:
            if args.out or args.overrides or args.seed is not None:
                raise ValueError(
                    "--resume continues a run with its own config; only --steps, --checkpoint, --device and "
                    "--threads may be given with it"
                )
            trainer = resume(
                args.resume,
                progress=not args.no_progress,
                steps=args.steps,
                checkpoint=args.checkpoint or "latest",
                device=args.device,
                threads=args.threads,
            )
        else:
            if args.threads is not None:
                raise ValueError("--threads is for --resume; a new run takes --set train.threads=N")
            if not args.out:
                raise ValueError("--out DIR is required with --preset")
            if args.checkpoint:
                raise ValueError("--checkpoint picks where --resume continues; a new run starts from scratch")
            overrides = list(args.overrides)
            if args.steps is not None:
                overrides.append(f"train.steps={args.steps}")
            if args.seed is not None:
                overrides += [f"train.seed={args.seed}", f"task.seed={args.seed}"]
            if args.device:
                overrides.append(f"train.device={args.device}")
            config = apply_overrides(get_preset(args.preset), overrides)
            trainer = train(config, args.out, progress=not args.no_progress)
    except (ValueError, OSError, RunDirError, TrainingDiverged) as err:  # OSError: e.g. --out under a file
        print(f"attnres-lens: error: {err}", file=sys.stderr)
        return 2 if not isinstance(err, TrainingDiverged) else 3
    except KeyboardInterrupt:
        run_dir = RunDir(args.resume or args.out)
        latest = run_dir.read_index().latest if run_dir.holds_run() else None
        where = (
            f"the latest checkpoint is {latest}; continue with `attnres-lens train --resume {run_dir.path}`"
            if latest
            else f"no checkpoint was written yet; remove {run_dir.path} and train again"
        )
        print(f"\nattnres-lens: interrupted: {where}", file=sys.stderr)
        return 130
    if trainer.rank == 0:
        final = trainer.last_eval
        summary = ", ".join(f"{k}={v:.4g}" for k, v in final.items())
        print(f"run saved in {trainer.out_dir} (step {trainer.step}; {summary})")
    return 0


def _analysis(args: argparse.Namespace) -> int:
    """analyze / prune / attribute: the run-level analyses (docs/analysis.md §10), with their headline figures."""
    from attnres_lens import cpu_settings
    from attnres_lens.analysis.run import analyze_run, attribute_run, prune_run
    from attnres_lens.rundir import RunDirError

    common = dict(checkpoint=args.checkpoint, samples=args.samples, out=args.out, progress=not args.no_progress)
    try:
        cpu_settings.configure(args.threads)
        if args.command == "analyze":
            result = analyze_run(args.run, **common)
        elif args.command == "prune":
            # a command line runs no threads of its own, so the routing table may run in a forked process
            result = prune_run(args.run, **common, metric=args.metric, fork_routing=True)
        else:
            result = attribute_run(args.run, **common, prompt=args.prompt)
    except (ValueError, RunDirError) as err:
        print(f"attnres-lens: error: {err}", file=sys.stderr)
        return 2
    print(
        {"analyze": _analyze_lines, "prune": _prune_lines, "attribute": _attribute_lines}[args.command](result.summary)
    )
    print(f"tables in {result.report_path.parent}/; report: {result.report_path}")
    return 0


def _number(value: float | None, spec: str) -> str:
    """`value` formatted by `spec`; "n/a" where the JSON summary holds null (a NaN: e.g. no answer positions)."""
    return "n/a" if value is None else format(value, spec)


def _skipped_lines(summary: dict) -> list[str]:
    """One line per table that does not apply to the run's model, with the reason (the summary's `skipped`)."""
    return [f"not computed: {row['table']}: {row['reason']}" for row in summary.get("skipped", [])]


def _head_name(row: dict) -> str:
    """'L2H1', or 'L3@2H1' for a head on a looped layer's visit (a bridged Mini; visit 0: the layer runs once)."""
    return f"L{row['layer']}" + (f"@{row['visit']}" if row.get("visit") else "") + f"H{row['head']}"


def _analyze_lines(summary: dict) -> str:
    lines = []
    if "top_induction_heads" in summary:
        heads = ", ".join(
            f"{_head_name(row)} {_number(row['prefix_score'], '.3f')}" for row in summary["top_induction_heads"]
        )
        best = summary["top_induction_head"]
        reason = summary.get("induction_columns_not_computed", {}).get("tl_induction_score")
        if reason:
            tl_score = f"TransformerLens induction score not computed ({reason})"
        else:
            tl_score = f"TransformerLens induction score {_number(best['tl_induction_score'], '.3f')}"
        lines += [
            f"top induction heads (prefix-matching score): {heads}",
            f"best head {_head_name(best)}: prefix score {_number(best['prefix_score'], '.3f')}, {tl_score}",
        ]
    lines += [
        f"in-context learning score {_number(summary['icl_score'], '+.4f')} ({summary['icl_score_definition']})",
        *_skipped_lines(summary),
    ]
    if "top_depth_sources" in summary:
        lines.append("top depth sources per consumer (token-mean α):")
        width = max(len(row["consumer_label"]) for row in summary["top_depth_sources"])
        lines += [
            f"  {row['consumer_label']:>{width}}: "
            + ", ".join(f"{source['source_label']} {_number(source['weight'], '.2f')}" for source in row["sources"])
            for row in summary["top_depth_sources"]
        ]
    return "\n".join(lines)


def _prune_lines(summary: dict) -> str:
    lines = [
        f"clean loss {_number(summary['base_loss'], '.4f')} over all positions, accuracy "
        f"{_number(summary['base_accuracy'], '.1%')} over answer positions "
        f"({plural(summary['samples'], 'held-out sequence')})"
    ]
    if summary.get("metric") not in (None, "loss"):  # --metric orders the removals; removability is judged on loss
        lines.append(f"removals ordered by {summary['metric']}; removable while the loss stays within the tolerance")
    lines += [
        f"{row['strategy']:>22}: {plural(row['n_removable'], 'sublayer')} removable within "
        f"+{row.get('tolerance', 0.05):.0%} loss"
        for row in summary["removable"]
    ]
    return "\n".join(lines)


def _attribute_lines(summary: dict) -> str:
    lines = []
    if "top_logit_sources" in summary:
        top = ", ".join(
            f"{row['source_label']} ({_number(row['share'], '.0%')})" for row in summary["top_logit_sources"]
        )
        lines.append(f"correct-token logit carried by: {top}")
    if "top_edges" in summary:
        edges = ", ".join(
            f"{row['consumer_label']} ← {row['source_label']} {_number(row['delta_loss'], '+.3g')}"
            for row in summary["top_edges"][:3]
        )
        lines.append(f"knockouts that hurt most (exact Δloss): {edges}")
    if "edge_agreement" in summary:
        agreement = summary["edge_agreement"]
        lines.append(
            f"first-order sensitivity vs exact knockouts: Spearman {_number(agreement['spearman'], '.3f')}, "
            f"top-{agreement['recall_top']} recall {_number(agreement['top_recall'], '.2f')} over "
            f"{plural(agreement['n_edges'], 'edge')}"
        )
    return "\n".join(lines + _skipped_lines(summary))


def _fla(args: argparse.Namespace) -> int:
    """import-fla / export-fla (docs/interop.md §4)."""
    import torch

    from attnres_lens import interop
    from attnres_lens.rundir import RunDirError

    torch.set_num_threads(1)  # import/export evaluate one small batch (the analysis commands take --threads)
    try:
        if args.command == "export-fla":
            out = interop.export_fla_run(args.run, args.out, args.checkpoint, args.dtype)
            print(
                f"wrote {out}/config.json and {out}/{interop.WEIGHTS_FILE} (open with FLA's "
                "TransformerForCausalLM.from_pretrained)"
            )
            return 0
        task = _import_task(args, interop)
        run, loss = interop.import_fla_run(args.path, args.out, task, dtype=args.dtype)
        print(
            f"imported {args.path} as run {run} (eval loss {loss:.4g} on task {task['name'] if task else 'copy'}); "
            f"next: attnres-lens analyze {run}"
        )
    except (ValueError, RunDirError, OSError) as err:
        print(f"attnres-lens: error: {err}", file=sys.stderr)
        return 2
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    """import-hf (docs/interop.md §7): a run directory referring to a transformers folder."""
    import torch

    from attnres_lens import hf_runs
    from attnres_lens.rundir import RunDirError

    torch.set_num_threads(1)  # the import evaluates one small batch
    try:
        if args.tokens_dtype and not args.tokens:
            raise ValueError("--tokens-dtype describes a --tokens file; give one")
        task = None
        if args.tokens or args.task or args.overrides:
            config, _ = hf_runs.read_model_folder(args.path)
            sizes = hf_runs.model_sizes(config)
            if args.tokens:
                task = {"name": "tokens", "path": str(Path(args.tokens).resolve()), **sizes}
                if args.tokens_dtype:
                    task["dtype"] = args.tokens_dtype
            elif args.task:
                task = interop_default_task(sizes, args.task)
            else:  # --set alone: on the held-out text's tokens, or on the copy task
                task = {"name": "tokens"} if args.text else interop_default_task(sizes, "copy")
            _apply_task_overrides(task, args.overrides, "the model comes from the transformers folder")
        run, loss = hf_runs.import_hf_run(args.path, args.out, task=task, text=args.text, dtype=args.dtype)
    except (ValueError, RunDirError, OSError) as err:
        print(f"attnres-lens: error: {err}", file=sys.stderr)
        return 2
    name = json.loads((run / "config.json").read_text())["task"]["name"]
    print(
        f"imported {args.path} as run {run}, referring to the folder (loss {loss:.4g} on 16 held-out sequences of "
        f"task {name}); next: attnres-lens analyze {run}"
    )
    return 0


def interop_default_task(sizes: dict, name: str) -> dict:
    """`interop.default_task` at a transformers model's vocabulary and task length."""
    from attnres_lens import hf_runs
    from attnres_lens.interop import default_task

    return default_task(hf_runs.Sizes(sizes["vocab_size"], sizes["seq_len"]), name)


def _apply_task_overrides(task: dict, overrides: list[str], why: str) -> None:
    """--set task.KEY=VALUE on an import's task section (values parsed as JSON, else kept as strings)."""
    for assignment in overrides:
        key, sep, raw = assignment.partition("=")
        if not sep or not key.startswith("task.") or len(key) == len("task."):
            raise ValueError(f"--set takes task.KEY=VALUE here ({why}), got {assignment!r}")
        try:
            task[key[len("task.") :]] = json.loads(raw)
        except json.JSONDecodeError:
            task[key[len("task.") :]] = raw


def _import_task(args: argparse.Namespace, interop: ModuleType) -> dict | None:
    """The task section of an imported run: --task NAME or --tokens FILE at the model's vocabulary and context, with
    --set task.KEY=VALUE on top; None for the default (copy)."""
    if args.tokens_dtype and not args.tokens:
        raise ValueError("--tokens-dtype describes a --tokens file; give one")
    if not (args.task or args.tokens or args.overrides):
        return None
    cfg = interop.model_config_from_fla(interop.read_fla_config(args.path), dtype=args.dtype)
    if args.tokens:
        task = {
            "name": "tokens",
            "path": str(Path(args.tokens).resolve()),
            "vocab_size": cfg.d_vocab,
            "seq_len": cfg.n_ctx,
        }
        if args.tokens_dtype:
            task["dtype"] = args.tokens_dtype
    else:
        task = interop.default_task(cfg, args.task or "copy")
    _apply_task_overrides(task, args.overrides, "the model comes from the FLA directory")
    return task


def _dashboard(args: argparse.Namespace) -> int:
    """Replace this process with `streamlit run apps/app.py` (so signals reach the server directly)."""
    runs = Path(args.runs).expanduser().resolve()
    problem = None
    if not DASHBOARD_APP.is_file():
        problem = (
            f"the dashboard app {DASHBOARD_APP} is missing; it ships with the source tree, so install "
            "attnres_lens from a clone with `pip install -e .`"
        )
    elif not runs.is_dir():
        what = "is a file, not a folder of runs" if runs.exists() else "no such folder"
        problem = f"--runs {args.runs}: {what} (train a run with `attnres-lens train`, or run `make demo`)"
    elif not 0 < args.port < 65536:
        problem = f"--port must be in 1..65535, got {args.port}"
    if problem:
        print(f"attnres-lens: error: {problem}", file=sys.stderr)
        return 2
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(DASHBOARD_APP),
        "--server.address",
        args.host,
        "--server.port",
        str(args.port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",
        "--",
        "--runs",
        str(runs),
    ]
    print(f"attnres-lens dashboard: http://{args.host}:{args.port}  (runs: {runs}; Ctrl+C stops it)", flush=True)
    os.execv(sys.executable, command)
    return 0  # not reached: execv does not return


if __name__ == "__main__":
    sys.exit(main())
