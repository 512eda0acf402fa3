"""Model configuration (SPEC §3.1).

`ModelConfig` extends TransformerLens's `TransformerLensConfig`, so `model.cfg` satisfies the
`TransformerLensModel` protocol that TL utilities (`head_detector`, `ActivationCache`) rely on.
Every field round-trips through JSON; invalid values raise `ValueError` naming the field and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformer_lens.config import TransformerLensConfig

from attnres_lens.kernels._common import BACKENDS

RESIDUAL_KINDS = ("standard", "attnres")
ATTENTION_KINDS = ("standard", "kv_shift")
POSITIONAL_KINDS = ("rotary", "standard")  # "standard" = learned absolute positions, as in TL
ACT_FNS = ("gelu", "relu", "silu")
DEPTH_BACKENDS = BACKENDS
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
    d_mlp: Optional[int] = None  # None: 4 * d_model
    act_fn: str = "gelu"
    attn_only: bool = False
    positional_embedding_type: str = "rotary"
    rotary_base: float = 10000.0
    normalization_type: Optional[str] = "RMS"
    uses_rms_norm: bool = True
    eps: float = 1e-5  # RMSNorm epsilon of the sublayer pre-norms and the final norm
    init_range: float = 0.02
    seed: Optional[int] = None

    residual: str = "standard"
    attnres_block_size: int = 1  # sublayers per block (attention and MLP count separately); 1 = Full AttnRes
    attnres_eps: float = 1e-6  # epsilon of the depth-attention key norm
    attention: str = "standard"
    depth_attention_backend: str = "auto"

    def __post_init__(self) -> None:
        # Validation replaces TL's __post_init__ (which asserts and silently derives values).
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
        for name in ("eps", "attnres_eps", "init_range", "rotary_base"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if isinstance(self.dtype, str):
            _check_choice("dtype", self.dtype, tuple(DTYPES))
            self.dtype = DTYPES[self.dtype]
        if self.device is None:
            self.device = "cpu"

    # ------------------------------------------------------------------ structure
    @property
    def n_sublayers(self) -> int:
        """J: attention sublayers, plus MLP sublayers unless `attn_only` (SPEC §3.2)."""
        return self.n_layers if self.attn_only else 2 * self.n_layers

    @property
    def variant(self) -> str:
        """Short human label, e.g. 'block4+kv_shift'."""
        if self.residual == "standard":
            residual = "standard"
        elif self.attnres_block_size == 1:
            residual = "full"
        else:
            residual = f"block{self.attnres_block_size}"
        return residual + ("+kv_shift" if self.attention == "kv_shift" else "")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dtype"] = next(name for name, dtype in DTYPES.items() if dtype == self.dtype)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "ModelConfig":
        """Strict inverse of `to_dict`: unknown keys are errors, not silently dropped (unlike TL's)."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(config_dict) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**config_dict)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"model config is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"model config JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {list(allowed)}, got {value!r}")
