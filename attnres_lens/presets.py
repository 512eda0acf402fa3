"""Named run configurations, each sized to train on a 2-core CPU in minutes (docs/tasks.md §3-§4).

Induction presets follow the calibration in docs/tasks.md §3: attention-only, 64 wide, vocab 64, length 65,
batch 32, AdamW 3e-3, on the variable-offset copy task (a fixed-period probe is solvable by a
positional head). Their shared step budget covers the slowest variant's transition (2-layer vanilla
needed ~5500 steps at this scale). Depth presets: 12 layers with MLPs on the mixed task, one per depth-mixing
rule (docs/model.md §11-§13). `fla-attnres-block` is Block AttnRes in flash-linear-attention's form, so that
`attnres-lens export-fla` writes it as trained (docs/interop.md §3). `shakespeare-block` is Block AttnRes on real
text: bytes of Shakespeare's plays (docs/tasks.md §6).

This module imports no torch: the command line checks a preset name before its heavy imports (the configs are
built, and `attnres_lens.config` imported, when a preset is asked for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnres_lens.config import RunConfig

INDUCTION_TASK = {"name": "copy", "vocab_size": 64, "seq_len": 65, "min_len": 8, "max_len": 16}
INDUCTION_TRAIN = dict(
    steps=7000,
    batch_size=32,
    lr=3e-3,
    warmup_steps=100,
    eval_every=100,
    record_every=250,
    checkpoint_every=1000,
    log_every=50,
)
DEPTH_TASK = {"name": "mixed", "vocab_size": 64, "seq_len": 65}
DEPTH_TRAIN = dict(
    steps=1500,
    batch_size=16,
    lr=3e-3,
    warmup_steps=100,
    eval_every=100,
    record_every=100,
    checkpoint_every=500,
    log_every=25,
    eval_size=128,
)
# flash-linear-attention's Transformer: a bias-free SwiGLU MLP and one epsilon for every norm (docs/interop.md §1)
FLA_FORM = {"gated_mlp": True, "act_fn": "silu", "use_bias": False, "eps": 1e-5, "attnres_eps": 1e-5}


def _induction(n_layers: int, attention: str) -> RunConfig:
    from attnres_lens.config import ModelConfig, RunConfig, TrainConfig

    model = ModelConfig(
        d_model=64, n_heads=4, n_layers=n_layers, n_ctx=65, d_vocab=64, attn_only=True, attention=attention
    )
    return RunConfig(model, dict(INDUCTION_TASK), TrainConfig(**INDUCTION_TRAIN))


def _depth(residual: str, block_size: int = 1, **options: Any) -> RunConfig:
    from attnres_lens.config import ModelConfig, RunConfig, TrainConfig

    model = ModelConfig(
        d_model=64,
        n_heads=4,
        n_layers=12,
        n_ctx=65,
        d_vocab=64,
        d_mlp=128,
        residual=residual,
        attnres_block_size=block_size,
        **options,
    )
    return RunConfig(model, dict(DEPTH_TASK), TrainConfig(**DEPTH_TRAIN))


# The input-dependent query as the ablation trains it (docs/model.md §11): read from the sum of the sources (for
# Full AttnRes the standard residual's h_j), logits divided by d so that under Adam they move at the static
# pseudo-query's rate (W's d² entries each step by ~lr, q·k summing d·d of them) instead of d times faster.
INPUT_QUERY = {"attnres_query": "input", "attnres_query_scale": "d", "attnres_query_read": "sum"}

# The depth-mixing rules compared by analyses/depth_mixing_ablation.py (the AttnRes paper's Table 4), at the depth
# presets' size: name -> (description, residual, block size, options). The paper's multi-head row is Block AttnRes.
DEPTH_MIXING_VARIANTS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "depth-standard": ("standard residual (PreNorm)", "standard", 1, {}),
    "depth-denseformer": ("DenseFormer: depth-weighted average after every block", "denseformer", 1, {}),
    "depth-mhc": ("mHC (manifold-constrained hyper-connections), 4 streams", "mhc", 1, {}),
    "depth-full": ("Full AttnRes (S = 1)", "attnres", 1, {}),
    "depth-block": ("Block AttnRes (S = 4: two layers per block)", "attnres", 4, {}),
    "depth-full-sigmoid": ("Full AttnRes, sigmoid instead of softmax", "attnres", 1, {"attnres_score": "sigmoid"}),
    "depth-full-no-keynorm": ("Full AttnRes without key RMSNorm", "attnres", 1, {"attnres_key_norm": False}),
    "depth-block-no-keynorm": ("Block AttnRes (S = 4) without key RMSNorm", "attnres", 4, {"attnres_key_norm": False}),
    "depth-full-input-query": (
        "Full AttnRes, input-dependent query read from the sum of the sources, logits / d",
        "attnres",
        1,
        INPUT_QUERY,
    ),
    "depth-block-heads16": (
        "Block AttnRes (S = 4), multi-head depth attention (H = 16 channel groups)",
        "attnres",
        4,
        {"attnres_heads": 16},
    ),
    "depth-full-window8": (
        "Full AttnRes, sliding window (embedding + last 8 sources)",
        "attnres",
        1,
        {"attnres_window": 8},
    ),
    "depth-full-scalar": (
        "Full AttnRes sources, input-independent scalar mixing",
        "attnres",
        1,
        {"attnres_mixing": "scalar"},
    ),
}


def _shakespeare(block_size: int | None) -> RunConfig:
    """The real-text model: AttnRes with blocks of `block_size` sublayers, or the standard residual (None)."""
    from attnres_lens.config import ModelConfig, RunConfig, TrainConfig

    model = ModelConfig(
        d_model=128,
        n_heads=4,
        n_layers=6,
        n_ctx=128,
        d_vocab=257,
        d_mlp=512,
        **(
            {"residual": "standard"}
            if block_size is None
            else {"residual": "attnres", "attnres_block_size": block_size}
        ),
    )
    train = TrainConfig(
        steps=2000,
        batch_size=16,
        lr=3e-3,
        warmup_steps=100,
        eval_every=100,
        eval_size=128,
        record_every=200,
        checkpoint_every=500,
        log_every=25,
    )
    return RunConfig(model, {"name": "shakespeare", "seq_len": 128}, train)


def _smoke() -> RunConfig:
    from attnres_lens.config import ModelConfig, RunConfig, TrainConfig

    model = ModelConfig(
        d_model=32,
        n_heads=2,
        n_layers=2,
        n_ctx=33,
        d_vocab=24,
        residual="attnres",
        attnres_block_size=2,
        attention="kv_shift",
    )
    train = TrainConfig(
        steps=40,
        batch_size=8,
        warmup_steps=5,
        eval_every=10,
        eval_size=32,
        record_every=10,
        record_size=8,
        checkpoint_every=20,
        log_every=5,
    )
    return RunConfig(model, {"name": "copy", "vocab_size": 24, "seq_len": 33, "min_len": 4, "max_len": 8}, train)


PRESETS: dict[str, tuple[str, Callable[[], RunConfig]]] = {
    "induction-1l-vanilla": (
        "1-layer attention-only, standard attention, copy task (expected to fail)",
        lambda: _induction(1, "standard"),
    ),
    "induction-2l-vanilla": (
        "2-layer attention-only, standard attention, copy task (late sharp transition)",
        lambda: _induction(2, "standard"),
    ),
    "induction-1l-kvshift": (
        "1-layer attention-only, KV-shifting attention, copy task (solves it fast)",
        lambda: _induction(1, "kv_shift"),
    ),
    "induction-2l-kvshift": (
        "2-layer attention-only, KV-shifting attention, copy task",
        lambda: _induction(2, "kv_shift"),
    ),
    **{
        name: (
            f"12-layer model with MLPs, {description}, mixed task",
            lambda residual=residual, block=block, options=options: _depth(residual, block, **options),
        )
        for name, (description, residual, block, options) in DEPTH_MIXING_VARIANTS.items()
    },
    "depth-full-heads16": (
        "12-layer model with MLPs, Full AttnRes, multi-head depth attention (H = 16 channel groups), mixed task",
        lambda: _depth("attnres", 1, attnres_heads=16),
    ),
    "fla-attnres-block": (
        "12-layer Block AttnRes (S = 4) in flash-linear-attention's form (SwiGLU, no biases, one "
        "norm epsilon), mixed task: `export-fla` writes it as trained",
        lambda: _depth("attnres", 4, **FLA_FORM),
    ),
    "shakespeare-block": (
        "6-layer Block AttnRes (S = 4) with MLPs, d_model 128, byte-level Shakespeare (real text, held-out plays)",
        lambda: _shakespeare(4),
    ),
    "shakespeare-standard": (
        "6-layer standard residual with MLPs, d_model 128, byte-level Shakespeare (the real-text baseline)",
        lambda: _shakespeare(None),
    ),
    "shakespeare-full": (
        "6-layer Full AttnRes with MLPs, d_model 128, byte-level Shakespeare (real text, held-out plays)",
        lambda: _shakespeare(1),
    ),
    "smoke": ("tiny Block AttnRes + KV-shift model, 40 steps: checks the pipeline end to end in seconds", _smoke),
}


# Presets earlier versions named otherwise: old name -> today's (docs/run_directory.md §2, compatibility).
RENAMED_PRESETS = {"depth-hyper": "depth-mhc"}


def check_preset(name: str) -> None:
    from attnres_lens.analysis_options import did_you_mean

    if name in RENAMED_PRESETS:
        raise ValueError(f"preset {name!r} was renamed {RENAMED_PRESETS[name]!r}; use --preset {RENAMED_PRESETS[name]}")
    if name not in PRESETS:
        raise ValueError(
            f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; choose one of {sorted(PRESETS)} (list them with "
            "`attnres-lens presets`)"
        )


def get_preset(name: str) -> RunConfig:
    """A fresh copy of the preset `name`, its `preset` field set so the run records where it came from."""
    check_preset(name)
    config = PRESETS[name][1]()
    config.preset = name
    return config
