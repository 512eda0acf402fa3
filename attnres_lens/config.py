"""Every configuration type of a run, in one place (docs/architecture.md §2).

* `ModelConfig` extends TransformerLens's `TransformerLensConfig`, so `model.cfg` satisfies the
  `TransformerLensModel` protocol that TL utilities (`head_detector`, `ActivationCache`) rely on;
* `TrainConfig`: optimiser, schedule, evaluation, recording and checkpoint cadence;
* `TaskConfig`: the task's name and the parameters given, checked by the task class itself;
* `RunConfig`: model + task + train, what `config.json` of a run directory holds, and the task it builds;
* `apply_overrides`: `--set section.field=value` on a `RunConfig`.

Every field round-trips through JSON; invalid values raise `ValueError` naming the field and the allowed values.
Derived fields (`d_head`, `d_mlp`, `n_key_value_heads`) stay derived under overrides: changing `d_model` on a preset
re-derives them unless they were given.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformer_lens.config import TransformerLensConfig

import attnres_lens
from attnres_lens.analysis_options import did_you_mean
from attnres_lens.kernels.backends import BACKENDS

if TYPE_CHECKING:
    from attnres_lens.hf_runs import TransformersModel
    from attnres_lens.tasks.base import Task

RESIDUAL_KINDS = ("standard", "attnres", "denseformer", "mhc")
ATTNRES_SCORES = ("softmax", "sigmoid")
ATTNRES_QUERIES = ("static", "input")
# the input-dependent query's logit scale (divide by 1, √d or d; d = channels per head) and what it reads
ATTNRES_QUERY_SCALES = ("none", "sqrt_d", "d")
ATTNRES_QUERY_READS = ("recent", "sum")
ATTNRES_MIXINGS = ("attention", "scalar")
# AttnRes options (the paper's Table 4 ablations) and their defaults, today's AttnRes (docs/model.md §11).
ATTNRES_OPTION_DEFAULTS: dict[str, Any] = {
    "attnres_score": "softmax",
    "attnres_key_norm": True,
    "attnres_query": "static",
    "attnres_query_scale": "none",
    "attnres_query_read": "recent",
    "attnres_heads": 1,
    "attnres_window": None,
    "attnres_mixing": "attention",
}
MAX_SINKHORN_ITERS = 1000
MHC_DEFAULTS: dict[str, Any] = {"mhc_streams": 4, "mhc_sinkhorn_iters": 20, "mhc_eps": 1e-6}
# Names earlier versions wrote: mHC was residual="hyper" with hyper_* fields. A stored config (config.json, a
# checkpoint's metadata) is read with the new names; a new setting with an old name is refused naming the new one
# (docs/run_directory.md §2, compatibility).
RENAMED_RESIDUALS = {"hyper": "mhc"}
RENAMED_MODEL_FIELDS = {
    "hyper_streams": "mhc_streams",
    "hyper_sinkhorn_iters": "mhc_sinkhorn_iters",
    "hyper_eps": "mhc_eps",
}
# the fields only one residual kind reads, with their defaults: any other kind refuses them changed
RESIDUAL_OWN_FIELDS: dict[str, dict[str, Any]] = {
    "attnres": {"attnres_block_size": 1, "attnres_eps": 1e-6, **ATTNRES_OPTION_DEFAULTS},
    "mhc": MHC_DEFAULTS,
}
ATTENTION_KINDS = ("standard", "kv_shift")
POSITIONAL_KINDS = ("rotary", "standard")  # "standard" = learned absolute positions, as in TL
ACT_FNS = ("gelu", "relu", "silu")
DEPTH_BACKENDS = BACKENDS
# Fields whose unset value means "derive from the others" (d_head = d_model / n_heads, d_mlp = 4 d_model,
# n_key_value_heads = n_heads).
DERIVED_FIELDS: dict[str, Any] = {"d_head": -1, "d_mlp": None, "n_key_value_heads": None}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig(TransformerLensConfig):
    """Hyper-parameters of one `attnres_lens.HookedTransformer`.

    Width: give `n_heads` and leave `d_head=-1` to derive it as `d_model // n_heads`, or give both
    (then `n_heads * d_head` must equal `d_model`).
    """

    d_model: int = 128
    d_head: int = -1
    n_layers: int = 2
    n_ctx: int = 128
    n_heads: int = 4
    d_vocab: int = 64
    d_mlp: int | None = None  # None: 4 * d_model
    act_fn: str = "gelu"
    gated_mlp: bool = False  # True: act(x W_gate + b_gate) * (x W_in + b_in), then W_out (act_fn="silu": SwiGLU)
    use_bias: bool = True  # MLP and unembedding biases (b_in, b_gate, b_out, b_U); False: bias-free projections
    tie_word_embeddings: bool = False  # True: the unembedding is the token embedding, W_U = W_E transposed
    attn_only: bool = False
    positional_embedding_type: str = "rotary"
    rotary_base: float = 10000.0
    normalization_type: str | None = "RMS"
    uses_rms_norm: bool = True
    eps: float = 1e-5  # RMSNorm epsilon of the sublayer pre-norms and the final norm
    init_range: float = 0.02
    seed: int | None = None

    residual: str = "standard"
    attnres_block_size: int = 1  # sublayers per block (attention and MLP count separately); 1 = Full AttnRes
    attnres_eps: float = 1e-6  # epsilon of the depth-attention key norm
    attnres_score: str = "softmax"  # or "sigmoid": α_s = sigmoid(z_s), not normalised over sources
    attnres_key_norm: bool = True  # False: keys are the raw sources (no RMSNorm, no gain)
    attnres_query: str = "static"  # or "input": q_j = RMSNorm(most recent source) @ W_j, W_j zero-initialised
    attnres_query_scale: str = "none"  # input query only: logits divided by 1, "sqrt_d" √d or "d" d (per head)
    attnres_query_read: str = "recent"  # input query only: reads the most recent source, or "sum" of all sources
    attnres_heads: int = 1  # H channel groups, each with its own query slice, key norm and softmax
    attnres_window: int | None = None  # W: read the embedding plus only the last W sources
    attnres_mixing: str = "attention"  # or "scalar": learned input-independent weights over the same sources
    mhc_streams: int = 4  # mHC: residual streams n
    mhc_sinkhorn_iters: int = 20  # mHC: Sinkhorn-Knopp iterations making the stream mix doubly stochastic
    mhc_eps: float = 1e-6  # mHC: epsilon added to read weights and the stream mix
    attention: str = "standard"
    depth_attention_backend: str = "auto"

    def __post_init__(self) -> None:
        # Validation replaces TL's __post_init__ (which asserts and silently derives values).
        # Fields left to be derived; `settings()` hands them back unset so overrides re-derive them.
        self._derived = {name for name, unset in DERIVED_FIELDS.items() if getattr(self, name) == unset}
        check_field_types(self)
        for name, supported in UNIMPLEMENTED_TL_FIELDS.items():
            if getattr(self, name) != supported:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not implemented by attnres_lens models "
                    f"(only {name}={supported!r}); remove the setting"
                )
        if self.residual in RENAMED_RESIDUALS:
            raise ValueError(
                f"residual={self.residual!r} was renamed {RENAMED_RESIDUALS[self.residual]!r}; "
                f"set residual={RENAMED_RESIDUALS[self.residual]!r}"
            )
        _check_choice("residual", self.residual, RESIDUAL_KINDS)
        _check_choice("attention", self.attention, ATTENTION_KINDS)
        _check_choice("positional_embedding_type", self.positional_embedding_type, POSITIONAL_KINDS)
        _check_choice("act_fn", self.act_fn, ACT_FNS)
        _check_choice("depth_attention_backend", self.depth_attention_backend, DEPTH_BACKENDS)
        for name in ("d_model", "n_layers", "n_ctx", "n_heads", "d_vocab", "attnres_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.d_head == -1:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible into n_heads={self.n_heads} heads; "
                    "choose d_model a multiple of n_heads"
                )
            self.d_head = self.d_model // self.n_heads
        elif self.d_head < 1 or self.n_heads * self.d_head != self.d_model:
            raise ValueError(
                f"n_heads * d_head must equal d_model, got {self.n_heads} * {self.d_head} != {self.d_model}; "
                "leave d_head=-1 to derive it"
            )
        if self.positional_embedding_type == "rotary" and self.d_head % 2:
            raise ValueError(f"rotary embeddings need an even d_head, got d_head={self.d_head}")
        if self.n_key_value_heads is None:
            self.n_key_value_heads = self.n_heads
        if self.n_key_value_heads < 1 or self.n_heads % self.n_key_value_heads:
            raise ValueError(
                f"n_key_value_heads={self.n_key_value_heads} must be >= 1 and divide n_heads={self.n_heads}"
            )
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        if self.d_mlp < 1:
            raise ValueError(f"d_mlp must be >= 1, got {self.d_mlp}")
        if self.gated_mlp and self.attn_only:
            raise ValueError("gated_mlp=True needs MLP sublayers, but attn_only=True; drop one of them")
        for name in ("eps", "attnres_eps", "init_range", "rotary_base"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.dtype, str):
            _check_choice("dtype", self.dtype, tuple(DTYPES))
            self.dtype = DTYPES[self.dtype]
        if self.device is None:
            self.device = "cpu"
        self._check_residual_options()

    def _check_residual_options(self) -> None:
        """Options belong to their residual kind, and only meaningful combinations are accepted."""
        _check_choice("attnres_score", self.attnres_score, ATTNRES_SCORES)
        _check_choice("attnres_query", self.attnres_query, ATTNRES_QUERIES)
        _check_choice("attnres_query_scale", self.attnres_query_scale, ATTNRES_QUERY_SCALES)
        _check_choice("attnres_query_read", self.attnres_query_read, ATTNRES_QUERY_READS)
        _check_choice("attnres_mixing", self.attnres_mixing, ATTNRES_MIXINGS)
        for name in ("attnres_heads", "mhc_streams", "mhc_sinkhorn_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.mhc_sinkhorn_iters > MAX_SINKHORN_ITERS:
            raise ValueError(
                f"mhc_sinkhorn_iters={self.mhc_sinkhorn_iters} is more than {MAX_SINKHORN_ITERS}: the "
                "Sinkhorn-Knopp normalisation converges geometrically (mHC uses 20), and each iteration "
                "is a sequential step of every forward pass"
            )
        if self.attnres_window is not None and self.attnres_window < 1:
            raise ValueError(f"attnres_window must be None (every source) or >= 1, got {self.attnres_window!r}")
        if not self.mhc_eps > 0:
            raise ValueError(f"mhc_eps must be > 0, got {self.mhc_eps!r}")
        for kind, fields in RESIDUAL_OWN_FIELDS.items():
            changed = [name for name, default in fields.items() if getattr(self, name) != default]
            if changed and self.residual != kind:
                raise ValueError(
                    f"{', '.join(changed)} only appl{'y' if len(changed) > 1 else 'ies'} to "
                    f"residual={kind!r}, got residual={self.residual!r}"
                )
        if self.d_model % self.attnres_heads:
            raise ValueError(f"attnres_heads={self.attnres_heads} must divide d_model={self.d_model}")
        query_options = [
            name
            for name in ("attnres_query_scale", "attnres_query_read")
            if getattr(self, name) != ATTNRES_OPTION_DEFAULTS[name]
        ]
        if query_options and self.attnres_query != "input":
            raise ValueError(
                f"{', '.join(query_options)} set the input-dependent query's scale and read; they need "
                f"attnres_query='input', got attnres_query={self.attnres_query!r}"
            )
        if self.attnres_mixing == "scalar":
            conflicts = [
                name
                for name in ("attnres_score", "attnres_key_norm", "attnres_query", "attnres_heads")
                if getattr(self, name) != ATTNRES_OPTION_DEFAULTS[name]
            ]
            if conflicts:
                raise ValueError(
                    f"attnres_mixing='scalar' has no query or keys (softmax over learned weights), so "
                    f"{', '.join(conflicts)} cannot be changed with it"
                )

    @property
    def attnres_options(self) -> dict[str, Any]:
        """The AttnRes options that differ from their defaults (empty for today's AttnRes)."""
        return {
            name: getattr(self, name)
            for name, default in ATTNRES_OPTION_DEFAULTS.items()
            if getattr(self, name) != default
        }

    # ------------------------------------------------------------------ structure
    def allocation_floor(self, element_size: int | None = None) -> dict[str, int]:
        """Bytes that this model's weights and tables take at least, by what asks for them: the embeddings, the
        projections and the rotary tables (smaller parameters are left out, so the sum is a floor), at
        `element_size` bytes a value (default: the model's dtype). Each part names the fields it grows with, for
        `resources.check_model_fits`'s message."""
        size = element_size or torch.empty((), dtype=self.dtype).element_size()
        d, layers, kv_heads = self.d_model, self.n_layers, self.n_key_value_heads or self.n_heads
        parts = {
            "d_vocab × d_model embeddings": self.d_vocab * d * (1 if self.tie_word_embeddings else 2),
            "n_layers × attention projections": layers * (2 * self.n_heads + 2 * kv_heads) * self.d_head * d,
            "n_layers × d_mlp MLPs": 0 if self.attn_only else layers * (3 if self.gated_mlp else 2) * d * self.d_mlp,
        }
        if self.residual == "mhc":  # each mixer's projection [(2 + n) n, n d] (docs/model.md §13)
            n = self.mhc_streams
            parts["mhc_streams² × d_model stream mixers"] = self.n_sublayers * (2 + n) * n * n * d
        if self.positional_embedding_type == "rotary":  # cos and sin tables [n_ctx, d_head] in every layer
            parts["n_ctx × d_head rotary tables"] = layers * 2 * self.n_ctx * self.d_head
        else:
            parts["n_ctx × d_model position embeddings"] = self.n_ctx * d
        return {what: count * size for what, count in parts.items()}

    @property
    def n_sublayers(self) -> int:
        """J: attention sublayers, plus MLP sublayers unless `attn_only` (docs/model.md §1)."""
        return self.n_layers if self.attn_only else 2 * self.n_layers

    @property
    def variant(self) -> str:
        """Short machine-friendly label, e.g. 'block4+kv_shift', 'full+sigmoid', 'mhc4' (file names, tables)."""
        if self.residual == "attnres":
            residual = "full" if self.attnres_block_size == 1 else f"block{self.attnres_block_size}"
            residual += "".join(f"+{_option_tag(name, value)}" for name, value in self.attnres_options.items())
        elif self.residual == "mhc":
            residual = f"mhc{self.mhc_streams}"
        else:
            residual = self.residual
        return residual + ("+kv_shift" if self.attention == "kv_shift" else "")

    @property
    def residual_label(self) -> str:
        """'standard', 'DenseFormer', 'mHC n=4', 'Full AttnRes', 'Block AttnRes S=4 (sigmoid)', …"""
        if self.residual == "standard":
            return "standard"
        if self.residual == "denseformer":
            return "DenseFormer"
        if self.residual == "mhc":
            return f"mHC n={self.mhc_streams}"
        label = "Full AttnRes" if self.attnres_block_size == 1 else f"Block AttnRes S={self.attnres_block_size}"
        options = ", ".join(_option_tag(name, value) for name, value in self.attnres_options.items())
        return f"{label} ({options})" if options else label

    @property
    def attention_label(self) -> str:
        return "KV shift" if self.attention == "kv_shift" else "vanilla"

    @property
    def description(self) -> str:
        """Human label, e.g. '6L Block AttnRes S=4, vanilla' (plot titles, the dashboard)."""
        return f"{self.n_layers}L {self.residual_label}, {self.attention_label}"

    # ------------------------------------------------------------------ JSON
    def settings(self) -> dict[str, Any]:
        """`to_dict()` with the derived fields unset again: the base that `apply_overrides` edits."""
        out = self.to_dict()
        out.update({name: DERIVED_FIELDS[name] for name in getattr(self, "_derived", ())})
        return out

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dtype"] = next(name for name, dtype in DTYPES.items() if dtype == self.dtype)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> ModelConfig:
        """Strict inverse of `to_dict`: unknown keys are errors, not silently dropped (unlike TL's)."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(config_dict) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {unknown}{_renamed_hint(unknown)}; known fields: {sorted(known)}"
            )
        return cls(**config_dict)

    @classmethod
    def from_stored(cls, config_dict: dict[str, Any]) -> ModelConfig:
        """`from_dict` for a config read back from a run (config.json, a checkpoint's metadata): the fields of a
        residual kind the model is not, which it never reads and which earlier versions recorded (e.g. a preset's
        block size after `--set model.residual=standard`), return to their defaults instead of being refused; the
        names earlier versions wrote (`RENAMED_RESIDUALS`, `RENAMED_MODEL_FIELDS`) are read as today's."""
        data = dict(config_dict)
        for old, new in RENAMED_MODEL_FIELDS.items():
            if old in data:
                if new in data:
                    raise ValueError(f"the stored model config has both {old!r} and {new!r} (its new name); keep one")
                data[new] = data.pop(old)
        if isinstance(data.get("residual"), str) and data["residual"] in RENAMED_RESIDUALS:
            data["residual"] = RENAMED_RESIDUALS[data["residual"]]
        for kind, fields in RESIDUAL_OWN_FIELDS.items():
            if data.get("residual", "standard") != kind:
                data.update({name: default for name, default in fields.items() if name in data})
        return cls.from_dict(data)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"model config is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"model config JSON must be an object, got {type(data).__name__}")
        return cls.from_stored(data)


# TransformerLens config fields the model does not implement: only these values are accepted.
UNIMPLEMENTED_TL_FIELDS: dict[str, Any] = {
    "use_attn_result": False,
    "use_split_qkv_input": False,
    "default_prepend_bos": True,
    "uses_rms_norm": True,
    "layer_norm_folding": False,
    "normalization_type": "RMS",
    "num_experts": None,
    "experts_per_token": None,
    "final_rms": False,
}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(expected: Any) -> str:
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        torch.dtype: f"one of {list(DTYPES)}",
    }
    if typing.get_origin(expected) is tuple:
        return f"a list of {len(typing.get_args(expected))} numbers"
    return names.get(expected, getattr(expected, "__name__", str(expected)))


def _is_union(expected: Any) -> bool:
    """`Optional[X]` / `Union[X, Y]` and their `X | None` spelling (a `types.UnionType`)."""
    return typing.get_origin(expected) in (typing.Union, types.UnionType)


def _matches(value: Any, expected: Any) -> bool:
    if _is_union(expected):
        return any(_matches(value, option) for option in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if expected is torch.dtype:
        return isinstance(value, (torch.dtype, str))
    if typing.get_origin(expected) is tuple:
        args = typing.get_args(expected)
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(map(_matches, value, args))
    return isinstance(value, expected)


def check_field_types(config: Any, prefix: str = "") -> None:
    """Every field of the dataclass `config` holds a value of its declared type (no coercion: `"no"` is not a bool,
    `1.5` not a size, `inf` not a rate); raises ValueError naming the field, the value and the expected type."""
    for name, expected in _field_types(type(config)).items():
        if name.startswith("_") or typing.get_origin(expected) is typing.ClassVar:
            continue
        value = getattr(config, name)
        if not _matches(value, expected):
            optional = _is_union(expected) and type(None) in typing.get_args(expected)
            wanted = _describe(
                next(a for a in typing.get_args(expected) if a is not type(None)) if optional else expected
            ) + (" or null" if optional else "")
            raise ValueError(f"{prefix}{name} must be {wanted}, got {value!r}")


def _option_tag(name: str, value: Any) -> str:
    """A short tag for a non-default AttnRes option: 'sigmoid', 'no-keynorm', 'input-query', 'query-scale-d',
    'query-sum', 'heads8', 'window8', 'scalar'."""
    return {
        "attnres_score": str(value),
        "attnres_key_norm": "no-keynorm",
        "attnres_query": f"{value}-query",
        "attnres_query_scale": f"query-scale-{value}",
        "attnres_query_read": f"query-{value}",
        "attnres_heads": f"heads{value}",
        "attnres_window": f"window{value}",
        "attnres_mixing": str(value),
    }[name]


def _renamed_hint(fields: list[str]) -> str:
    """' (renamed: hyper_eps -> mhc_eps)' for the old names among `fields`, else ''."""
    renamed = [f"{field} -> {RENAMED_MODEL_FIELDS[field]}" for field in fields if field in RENAMED_MODEL_FIELDS]
    return f" (renamed: {', '.join(renamed)})" if renamed else ""


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {list(allowed)}, got {value!r}")


# ---------------------------------------------------------------------------- training and runs
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    """How a run trains: optimiser, schedule, evaluation, recording and checkpoint cadence (config.json's `train`).
    Checked on construction, so a bad value fails before a run starts, naming the field."""

    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_every: int = 100
    eval_size: int = 256  # sequences in the fixed held-out set
    record_every: int = 100
    record_size: int = 32  # sequences of the eval set used by the recorder
    checkpoint_every: int = 500
    keep_checkpoints: int = 2  # the last K are kept, plus the best by eval loss
    log_every: int = 10
    device: str = "auto"
    # torch threads on CPU; 0 = torch's default (one per core), the fastest for a single run; give each process
    # 1 thread when several train side by side, as the reproductions do (docs/kernels.md §11).
    threads: int = 0
    seed: int = 0
    # None: training batches come in the order the task's seed gives (task.seed); an int: in the order this seed
    # gives, on the same task, so runs that share one task (one language, one held-out set) differ in data order
    data_seed: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "train.")
        self.betas = tuple(self.betas)
        for name in (
            "steps",
            "batch_size",
            "eval_every",
            "eval_size",
            "record_every",
            "record_size",
            "checkpoint_every",
            "keep_checkpoints",
            "log_every",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"train.seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.data_seed is not None and not 0 <= self.data_seed < 2**63:
            raise ValueError(
                f"train.data_seed must be null (the task's own order) or an integer in [0, 2**63), got {self.data_seed!r}"
            )
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"train.threads must be an integer >= 0 (0 = one per core), got {self.threads!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"train.lr must be a number > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(
                f"train.betas must be two numbers in [0, 1) (AdamW's moment decays), got {list(self.betas)!r}"
            )
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("train.weight_decay and train.grad_clip must be >= 0")
        if self.device not in DEVICES:
            raise ValueError(f"train.device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.record_size > self.eval_size:
            raise ValueError(f"train.record_size={self.record_size} must be <= train.eval_size={self.eval_size}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """config.json's `train` section, strictly: an unknown field is an error naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown train field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def lr_at(self, step: int) -> float:
        """Linear warm-up over `warmup_steps`, then cosine down to `lr * min_lr_ratio` at `steps`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class TaskConfig:
    """The task of a run (config.json's `task` section): the task's `name` and the parameters given for it, exactly as
    given (a preset lists only those it changes; the task's own defaults fill the rest when it is built).

    The task class `TASKS[name]` owns its parameters and their checks (docs/tasks.md), so construction builds it once
    to check: an unknown name is refused listing the known tasks, an unknown parameter naming it and the task's
    parameters, a bad value with the task's own message. config.json stores it flat, `{"name": …, **params}`
    (`from_dict` / `to_dict`, docs/run_directory.md §2).
    """

    name: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        from attnres_lens.tasks import TASKS

        if not isinstance(self.name, str):
            raise ValueError(f"the task name must be a string, one of {sorted(TASKS)}; got {self.name!r}")
        if not isinstance(self.params, Mapping) or not all(isinstance(key, str) for key in self.params):
            raise ValueError(f"task parameters must be a mapping of parameter names to values, got {self.params!r}")
        if "name" in self.params:
            raise ValueError(
                f"'name' is the task's name, not a parameter: give TaskConfig({self.params['name']!r}, "
                "params) or TaskConfig.from_dict({'name': …, **params})"
            )
        object.__setattr__(self, "params", dict(self.params))  # a copy: the caller's dict cannot change it later
        self.build()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TaskConfig:
        """From config.json's flat form `{"name": …, **params}`."""
        from attnres_lens.tasks import TASKS

        if not isinstance(data, Mapping):
            raise ValueError(f'a task section must be an object {{"name": …, **parameters}}, got {data!r}')
        params = dict(data)
        if "name" not in params:
            raise ValueError(f"the task has no 'name'; give one of {sorted(TASKS)}")
        return cls(params.pop("name"), params)

    def to_dict(self) -> dict[str, Any]:
        """config.json's flat form `{"name": …, **params}`, what `make_task` takes."""
        return {"name": self.name, **self.params}

    def build(self) -> Task:
        """A new task built from this config (the task's defaults fill the parameters not given)."""
        from attnres_lens.tasks import make_task

        return make_task(self.name, **self.params)


@dataclass
class RunConfig:
    """What config.json holds: model, task and train sections (and where an imported model came from). It fully
    determines a run, so resuming or reloading one rebuilds the same model and task (docs/run_directory.md §2).

    `task` is a `TaskConfig`; a mapping in config.json's form `{"name": …, **parameters}` is accepted too and
    converted on construction (`TaskConfig.from_dict`), so `RunConfig(model, {"name": "copy"}, train)` works and the
    attribute is always a checked `TaskConfig`."""

    # a toolkit model, or a transformers model folder the run refers to (`hf_runs.TransformersModel`, import-hf)
    model: ModelConfig | TransformersModel
    task: TaskConfig
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    preset: str | None = None
    # Where a model that was not trained here came from ({"source": "flash-linear-attention", "path", …}); None for
    # runs trained by attnres_lens. An imported run has one checkpoint and no training records (docs/interop.md §4).
    provenance: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.task, Mapping):
            self.task = TaskConfig.from_dict(self.task)
        elif not isinstance(self.task, TaskConfig):
            raise ValueError(
                f'a run config\'s task must be a TaskConfig or a mapping {{"name": …, **parameters}}, got {self.task!r}'
            )

    @property
    def imported(self) -> bool:
        """Whether the run holds a model trained elsewhere (its `train` section was never run)."""
        return self.provenance is not None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "model": self.model.to_dict(),
            "task": self.task.to_dict(),
            "train": dataclasses.asdict(self.train),
            "preset": self.preset,
            "seed": self.train.seed,
            "version": attnres_lens.__version__,
        }
        if self.provenance is not None:
            out["provenance"] = self.provenance
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Inverse of `to_dict`, strict (unknown train fields are errors); the model section goes through
        `ModelConfig.from_stored`, which reads what earlier versions wrote."""
        for section in ("model", "task", "train"):
            if not isinstance(data.get(section), dict):
                raise ValueError(f"a run config needs a '{section}' object, got {data.get(section)!r}")
        provenance = data.get("provenance")
        if provenance is not None and not isinstance(provenance, dict):
            raise ValueError(f"a run config's 'provenance' must be an object or absent, got {provenance!r}")
        model, train = stored_model(data["model"]), TrainConfig.from_dict(data["train"])
        return cls(model, TaskConfig.from_dict(data["task"]), train, data.get("preset"), provenance)

    def build_task(self) -> Task:
        """The run's task, built from `task` (a new one each call)."""
        return self.task.build()


def stored_model(section: Mapping[str, Any]) -> ModelConfig | TransformersModel:
    """config.json's model section: a transformers folder the run refers to (`"source": "transformers"`,
    docs/run_directory.md §2) or a toolkit `ModelConfig`."""
    from attnres_lens.hf_runs import TransformersModel, is_transformers_section

    if is_transformers_section(section):
        return TransformersModel.from_dict(section)
    return ModelConfig.from_stored(dict(section))


def task_fields(task: dict[str, Any]) -> set[str]:
    from attnres_lens.tasks import TASKS

    task_class = TASKS.get(task.get("name"))
    return {f.name for f in dataclasses.fields(task_class) if f.init} | {"name"} if task_class else set(task)


def apply_overrides(config: RunConfig, assignments: list[str]) -> RunConfig:
    """Apply `key=value` settings: `model.n_layers=4`, `train.lr=1e-3`, `task.vocab_size=48`, or an
    unqualified field name when exactly one section has it. Values are parsed as JSON (else a string)."""
    sections = {
        "model": config.model.settings(),
        "task": config.task.to_dict(),
        "train": dataclasses.asdict(config.train),
    }
    given_task_fields, given_model_fields = set(), set()
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ValueError(f"--set expects key=value with key a field or section.field, got {assignment!r}")
        section, _, field = key.rpartition(".")
        if not section:
            owners = [name for name, values in sections.items() if field in values and name != "task"]
            owners += ["task"] if field in task_fields(sections["task"]) else []
            if len(owners) != 1:
                where = (
                    f"it is in {owners}; write section.{field}"
                    if owners
                    else f"no section has it{_renamed_hint([field])}"
                )
                raise ValueError(f"cannot set {key!r}: {where} (sections: model, task, train)")
            section = owners[0]
        if section not in sections:
            raise ValueError(f"unknown section {section!r} in {assignment!r}; use model., task. or train.")
        # Task parameters are checked by the task itself (a preset lists only the ones it changes).
        if section != "task" and field not in sections[section]:
            raise ValueError(
                f"unknown {section} field {field!r}{_renamed_hint([field]) or did_you_mean(field, sections[section])}; "
                f"known: {sorted(sections[section])}"
            )
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        sections[section][field] = value
        if section == "task":
            given_task_fields.add(field)
        elif section == "model":
            given_model_fields.add(field)
    old_residual = config.model.residual
    if sections["model"].get("residual") != old_residual:
        # another residual kind: the old kind's own fields (e.g. a preset's block size) return to their defaults
        # unless given here, where the new kind would refuse them
        for name, default in RESIDUAL_OWN_FIELDS.get(old_residual, {}).items():
            if name not in given_model_fields:
                sections["model"][name] = default
    if sections["task"].get("name") != config.task.name:
        # another task keeps the parameters it shares with the old one (vocab_size, seq_len, seed …); the old task's
        # own parameters, which the new one would refuse, go unless they were given here
        shared = task_fields(sections["task"])
        sections["task"] = {k: v for k, v in sections["task"].items() if k in shared or k in given_task_fields}
    try:
        train = TrainConfig(**sections["train"])
        model = ModelConfig.from_dict(sections["model"])
    except TypeError as err:
        raise ValueError(str(err)) from err
    # TaskConfig checks the task parameters now, not after the run has started
    return RunConfig(model, TaskConfig.from_dict(sections["task"]), train, config.preset, config.provenance)
