"""Worked example: a flash-linear-attention AttnRes model opened, analysed here and sent back (docs/interop.md §6).

1. builds an FLA `TransformerForCausalLM` with Block AttnRes and saves it in Hugging Face format; an untrained FLA
   model's pseudo-queries are zero (uniform depth weights), so unless it is trained (`--train-steps`, FLA's own
   forward and loss on the copy task; a GPU does hundreds of steps in seconds, this CPU takes seconds per step) its
   queries and key-norm gains are drawn at random, to give the depth attention something to show;
2. imports the directory as a run (what `attnres-lens import-fla` does) and shows its depth-attention heatmap;
3. writes the prune report (`attnres-lens prune`);
4. exports the run back (`attnres-lens export-fla`) and reloads it with FLA's `from_pretrained`;
5. prints the logit agreement in fp32: FLA against this toolkit, and FLA against the re-exported FLA model;
6. on CUDA, the same comparison in bf16 with FLA's real fused kernels (flash-attn when installed); skipped otherwise.

    python -m analyses.fla_roundtrip                   # CPU: FLA under the Triton interpreter (about a minute)
    python -m analyses.fla_roundtrip --train-steps 300 # on a GPU: train in FLA first

FLA is GPU software: on a CPU its forward runs through the tests' stand-ins (tests/fla_cpu.py: Triton interpreter,
SDPA for flash-attn, FLA's own naive_attnres for its CUDA-only fused kernel), imported from the repository root.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is first imported (FLA imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from analyses.common import REPO, command_line, emit_report, provenance  # noqa: E402
from attnres_lens.analysis.run import analyze_run, prune_run  # noqa: E402
from attnres_lens.interop import export_fla_run, from_fla, import_fla_run  # noqa: E402
from attnres_lens.rundir import load_run  # noqa: E402
from attnres_lens.tasks import make_task  # noqa: E402
from tests.fla_cpu import fla_logits, fla_runtime  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_fla(args: argparse.Namespace):
    from fla.models import TransformerConfig, TransformerForCausalLM

    config = TransformerConfig(
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.ctx,
        attnres_block_size=args.block_size,
        intermediate_size=2 * args.width,
        fuse_cross_entropy=False,
    )
    torch.manual_seed(args.seed)
    with fla_runtime(DEVICE):
        return TransformerForCausalLM(config).to(DEVICE)


def randomise_depth_attention(model, seed: int) -> None:
    """Pseudo-queries with depth logits of std ~2 and key-norm gains around 1 (an untrained model has 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator).to(param.device)
            if "res_proj" in name:
                param.copy_(2 * noise / param.shape[-1] ** 0.5)
            elif name.endswith("res_norm.weight"):
                param.copy_(1 + 0.3 * noise)


def train_in_fla(model, args: argparse.Namespace) -> list[str]:
    """FLA's own forward and loss, AdamW, on the copy task at the model's vocabulary and context."""
    task = make_task("copy", vocab_size=args.vocab, seq_len=args.ctx, min_len=4, max_len=min(8, (args.ctx - 1) // 2))
    generator = task.train_generator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    losses = []
    with fla_runtime(DEVICE):
        for step in range(args.train_steps):
            tokens = task.sample(32, generator).tokens.to(DEVICE)
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    model.eval()
    return [f"Trained {args.train_steps} steps in FLA on `copy` (batch 32): loss {losses[0]:.3f} → {losses[-1]:.3f}."]


def shown(path: Path) -> str:
    """A path for the report: relative to the repository when inside it (reports are committed)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def heatmap_table(frame, kind: str) -> list[str]:
    """Token-averaged α as a Markdown table: one row per consumer, one column per source."""
    rows = frame[frame["kind"] == kind]
    sources = list(dict.fromkeys(rows.sort_values("source")["source_label"]))
    lines = ["| consumer | " + " | ".join(sources) + " |", "|---|" + "---|" * len(sources)]
    for consumer, group in rows.groupby("consumer", sort=True):
        weights = dict(zip(group["source_label"], group["weight"]))
        cells = [f"{weights[s]:.2f}" if s in weights else "" for s in sources]
        lines.append(f"| {group['consumer_label'].iloc[0]} | " + " | ".join(cells) + " |")
    return lines


def agreement(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.float().cpu(), b.float().cpu()
    diff = (a - b).abs().max().item()
    same_top = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return f"| {name} | {diff:.3g} | {diff / b.abs().max().item():.3g} | {same_top:.1%} |"


def bf16_comparison(fla_dir: Path, ours, tokens: torch.Tensor) -> list[str]:
    """FLA in bf16 on the GPU with its fused kernels, against this toolkit's fp32 model (the reference) and bf16."""
    from fla.models import TransformerForCausalLM

    try:
        import flash_attn  # noqa: F401

        flash = True
    except ImportError:
        flash = False
    with fla_runtime(DEVICE, flash_attention=flash):
        fla16 = TransformerForCausalLM.from_pretrained(fla_dir, dtype=torch.bfloat16).to(DEVICE).eval()
    reference = ours.to(DEVICE)(tokens.to(DEVICE))
    fla_bf16 = fla_logits(fla16, tokens, flash_attention=flash)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ours_bf16 = ours(tokens.to(DEVICE))
    attention = "flash-attn" if flash else "PyTorch SDPA (flash-attn is not installed)"
    return [
        f"bf16 on {torch.cuda.get_device_name()}: FLA's fused `fused_attnres`, norm and SwiGLU kernels; token "
        f"attention through {attention}. Reference: this toolkit's fp32 model.",
        "",
        "| comparison | max abs diff | relative to max logit | same argmax |",
        "|---|---|---|---|",
        agreement("FLA bf16 vs ours fp32", fla_bf16, reference),
        agreement("ours bf16 autocast vs ours fp32", ours_bf16, reference),
    ]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=4, help="FLA's attnres_block_size (None/1/even)")
    parser.add_argument("--vocab", type=int, default=48)
    parser.add_argument("--ctx", type=int, default=33)
    parser.add_argument("--train-steps", type=int, default=0, help="train in FLA first (sensible on a GPU)")
    parser.add_argument("--samples", type=int, default=8, help="held-out sequences for the analyses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "fla_roundtrip", help="working folder (new)")
    parser.add_argument("--report", type=Path, default=REPO / "analyses" / "reports" / "fla_roundtrip.md")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty; give a new folder")
    torch.set_num_threads(1)

    lines = ["# An FLA AttnRes model, analysed here and sent back", "", f"`{command_line()}`, {provenance()}.", ""]
    fla = build_fla(args)
    if args.train_steps:
        lines += train_in_fla(fla, args)
    else:
        randomise_depth_attention(fla, args.seed)
        lines.append(
            "Untrained FLA model; its pseudo-queries and key-norm gains drawn at random (an untrained model's "
            "are 0 and 1: uniform depth weights)."
        )
    fla.eval()
    fla_dir = args.out / "fla"
    fla.save_pretrained(fla_dir)
    lines += [
        "",
        f"FLA `TransformerForCausalLM`: {args.layers} layers, width {args.width}, {args.heads} heads "
        f"({args.kv_heads} KV), `attnres_block_size={args.block_size}`; saved to `{shown(fla_dir)}`.",
        "",
    ]

    run, loss = import_fla_run(fla_dir, args.out / "run")
    tables = analyze_run(run, samples=args.samples, progress=False).tables
    lines += [
        f"## Imported as run `{shown(run)}`",
        "",
        f"Held-out loss on the default evaluation task (copy, vocab {args.vocab}, length {args.ctx}): "
        f"{loss:.3f}. Depth attention, α averaged over {args.samples} held-out sequences "
        "(`RUN/analysis/depth_weights.csv`; the dashboard draws it as a heatmap):",
        "",
    ]
    for kind in ("attn", "mlp", "final"):
        lines += [f"**{kind} consumers**", "", *heatmap_table(tables["depth_weights"], kind), ""]

    pruned = prune_run(run, samples=args.samples, progress=False)
    worst = pruned.tables["pruning_sensitivity"].nlargest(3, "dloss_remove")
    lines += [
        "## Prune report",
        "",
        f"`{shown(pruned.report_path)}`; base loss {pruned.summary['base_loss']:.3f}.",
        "",
        "| removal order | sublayers removable within +5% loss |",
        "|---|---|",
    ]
    lines += [f"| {row['strategy']} | {row['n_removable']} |" for row in pruned.summary["removable"]]
    lines += [
        "",
        "Most damaging single removals:",
        "",
        "| sublayer | Δloss removed | Δloss mean-ablated | block influence |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {row.label} | {row.dloss_remove:+.3f} | {row.dloss_mean:+.3f} | {row.block_influence:.3f} |"
        for row in worst.itertuples()
    ]
    lines.append("")

    export_fla_run(run, args.out / "back")
    with fla_runtime(DEVICE):
        from fla.models import TransformerForCausalLM

        back = TransformerForCausalLM.from_pretrained(args.out / "back").to(DEVICE).eval()
    original, exported = fla.state_dict(), back.state_dict()
    identical = set(original) == set(exported) and all(torch.equal(original[k], exported[k]) for k in original)
    tokens = (
        make_task("copy", vocab_size=args.vocab, seq_len=args.ctx, min_len=4, max_len=min(8, (args.ctx - 1) // 2))
        .eval_batch(args.samples)
        .tokens
    )
    ours = load_run(run).model
    reference = fla_logits(fla, tokens)
    where = "FLA's Triton kernels under the interpreter" if DEVICE == "cpu" else "FLA's Triton kernels on the GPU"
    lines += [
        "## Logit agreement, fp32",
        "",
        f"{args.samples} sequences of {args.ctx} tokens; FLA runs {where}, token attention through PyTorch SDPA.",
        "",
        "| comparison | max abs diff | relative to max logit | same argmax |",
        "|---|---|---|---|",
        agreement("ours (imported) vs FLA", ours(tokens), reference),
        agreement("ours, hooked path vs FLA", ours.run_with_cache(tokens)[0], reference),
        agreement("FLA re-exported vs FLA", fla_logits(back, tokens), reference),
        agreement("from_fla(in-memory model) vs FLA", from_fla(fla.cpu())(tokens), reference),
        "",
        f"Exported state dict identical to the original, tensor for tensor: {identical}.",
        "",
    ]
    lines += ["## bf16 with FLA's fused kernels", ""]
    lines += (
        bf16_comparison(fla_dir, ours, tokens)
        if DEVICE == "cuda"
        else ["Skipped: no CUDA device here (FLA's fused kernels need one). Run this script on a GPU for it."]
    )
    emit_report("\n".join(lines) + "\n", args.report)
    return lines


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
