"""Import from and export to flash-linear-attention (FLA) 0.6's `TransformerForCausalLM` (docs/interop.md).

The model knows nothing of FLA: this module translates configurations and state dicts in both directions.

* `from_fla(model_or_dir)`: an FLA model in memory, or a Hugging Face-format directory (config.json + safetensors),
  becomes a `HookedTransformer` with the same logits: standard residual (`attnres_block_size=None`), Full AttnRes
  (1) and Block AttnRes (even S). Reading a directory does not need FLA installed.
* `to_fla(model)`: an FLA `TransformerForCausalLM` with our weights (needs FLA installed, and flash-attn for FLA's
  attention layer); `save_fla(model, out_dir)` writes a directory FLA's `from_pretrained` opens, without FLA.
* Anything one side can express and the other cannot is refused with `FlaInteropError` naming the option.

The translation is exact: weights are only reshaped and transposed (docs/interop.md §2), so FLA → ours → FLA
reproduces FLA's state dict bit for bit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from attnres_lens.config import DTYPES, ModelConfig
from attnres_lens.rundir import RunDir, atomic_save_safetensors, atomic_write_json, read_json_file

if TYPE_CHECKING:
    from fla.models import TransformerForCausalLM  # optional dependency: attnres_lens[fla]

    from attnres_lens.config import TrainConfig
    from attnres_lens.model import HookedTransformer

FLA_MODEL_TYPE = "transformer"
FLA_ARCHITECTURE = "TransformerForCausalLM"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

# FLA options with no attnres_lens equivalent, the value that means "off", and what the option does.
UNSUPPORTED_FLA_OPTIONS: dict[str, tuple[Any, str]] = {
    "qk_norm": (False, "an RMSNorm on every query and key head"),
    "qkv_bias": (False, "biases on the query, key and value projections"),
    "window_size": (None, "sliding-window token attention"),
    "attn": (None, "hybrid layers (a per-layer attention spec)"),
}
# Config keys that only choose FLA kernels or its training loss: they do not change the forward pass. FLA's
# Transformer builds its norms with a gain whatever `elementwise_affine` says, so that key has no effect either.
KERNEL_ONLY_FLA_OPTIONS = (
    "fuse_norm",
    "fuse_swiglu",
    "fuse_cross_entropy",
    "fuse_linear_cross_entropy",
    "use_l2warp",
    "use_cache",
    "elementwise_affine",
)
# ModelConfig fields that do not change the function the model computes; everything else must map to FLA.
_UNMAPPED_FIELDS = ("device", "seed", "init_range", "depth_attention_backend", "dtype")

PathLike = str | Path


class FlaInteropError(ValueError):
    """A model or directory cannot cross between FLA and attnres_lens; the message names the option and why."""


# ---------------------------------------------------------------------------- configurations
def fla_mlp_width(fla: Mapping[str, Any]) -> int:
    """FLA's MLP width: `intermediate_size`, else 2/3 · hidden_ratio · hidden_size rounded up to a multiple of 256
    (the rule of FLA's GatedMLP)."""
    if fla.get("intermediate_size") is not None:
        return _fla_int(fla, "intermediate_size")
    ratio, hidden = _fla_number(fla, "hidden_ratio", 4), _fla_int(fla, "hidden_size")
    width = hidden * ratio * 2 / 3
    if not 0 < width < 2**53:  # beyond 2**53 a float no longer holds every integer: no model is that wide
        raise FlaInteropError(
            f"hidden_ratio={ratio!r} gives an MLP width of {width:.3g} for hidden_size={hidden}; "
            "it must give a width >= 1 that a model can have"
        )
    return 256 * math.ceil(int(width) / 256)


def model_config_from_fla(fla: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of an FLA `TransformerConfig` (as a dict, e.g. a config.json); refuses what it cannot map."""
    model_type = fla.get("model_type")
    if model_type != FLA_MODEL_TYPE:
        raise FlaInteropError(
            f"model_type={model_type!r}: only flash-linear-attention's Transformer "
            f"(model_type={FLA_MODEL_TYPE!r}, {FLA_ARCHITECTURE}) can be imported"
        )
    for option, (off, what) in UNSUPPORTED_FLA_OPTIONS.items():
        if fla.get(option) not in (None, False):
            raise FlaInteropError(
                f"{option}={fla[option]!r} ({what}) has no attnres_lens equivalent; only "
                f"{option}={off!r} can be imported"
            )
    if fla.get("hidden_act", "swish") != "swish":
        raise FlaInteropError(
            f"hidden_act={fla['hidden_act']!r}: only FLA's SwiGLU MLP (hidden_act='swish') can be imported"
        )
    if fla.get("rope_theta", 10000.0) is None:
        raise FlaInteropError("rope_theta=None (no rotary embedding): only RoPE models can be imported")
    block_size = fla.get("attnres_block_size")
    if block_size is not None and (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or not (block_size == 1 or (block_size >= 2 and block_size % 2 == 0))
    ):
        raise FlaInteropError(
            f"attnres_block_size={block_size!r}: FLA's AttnRes takes None (standard residual), 1 "
            "(Full) or an even block size"
        )
    tied = fla.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise FlaInteropError(f"tie_word_embeddings={tied!r} in the FLA config must be true or false")
    try:
        hidden, heads = _fla_int(fla, "hidden_size"), _fla_int(fla, "num_heads")
        if heads < 1 or hidden % heads:
            raise FlaInteropError(f"hidden_size={hidden} must be a multiple of num_heads={heads} (>= 1)")
        kv_heads = heads if fla.get("num_kv_heads") is None else _fla_int(fla, "num_kv_heads")
        norm_eps = _fla_number(fla, "norm_eps", 1e-6)
        return ModelConfig(
            d_model=hidden,
            n_layers=_fla_int(fla, "num_hidden_layers"),
            n_heads=heads,
            n_key_value_heads=kv_heads,
            d_vocab=_fla_int(fla, "vocab_size"),
            n_ctx=_fla_int(fla, "max_position_embeddings", 2048),
            d_mlp=fla_mlp_width(fla),
            act_fn="silu",
            gated_mlp=True,
            use_bias=False,
            tie_word_embeddings=tied,
            positional_embedding_type="rotary",
            rotary_base=_fla_number(fla, "rope_theta", 10000.0),
            # FLA uses norm_eps for every norm: pre-norms, final norm, depth-attention key norms
            eps=norm_eps,
            init_range=_fla_number(fla, "initializer_range", 0.02),
            dtype=dtype,
            **(
                {}
                if block_size is None
                else dict(residual="attnres", attnres_block_size=block_size, attnres_eps=norm_eps)
            ),
        )
    except KeyError as err:
        raise FlaInteropError(f"the FLA config has no {err.args[0]!r}; it is not a TransformerConfig") from err
    except FlaInteropError:
        raise
    except ValueError as err:
        raise FlaInteropError(f"the FLA config does not describe a valid model: {err}") from err


def _fla_number(fla: Mapping[str, Any], key: str, default: float) -> float:
    """A real-valued field of an FLA config (its default where absent or null); a string is refused, not parsed."""
    value = fla.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FlaInteropError(f"{key}={value!r} in the FLA config must be a number")
    if not math.isfinite(value):
        raise FlaInteropError(f"{key}={value!r} in the FLA config must be a finite number")
    return float(value)


def _fla_int(fla: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """An integer field of an FLA config (KeyError where it is required and missing); a float or a string is
    refused, not truncated or parsed."""
    value = fla[key] if default is None else fla.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FlaInteropError(f"{key}={value!r} in the FLA config must be an integer")
    return value


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse, naming the option, every feature of `cfg` that FLA's Transformer cannot express."""
    problems = []
    if cfg.residual not in ("standard", "attnres"):
        problems.append(f"residual={cfg.residual!r} (FLA's Transformer has the standard residual and AttnRes)")
    if cfg.residual == "attnres" and cfg.attnres_block_size > 1 and cfg.attnres_block_size % 2:
        problems.append(
            f"attnres_block_size={cfg.attnres_block_size} (FLA's blocks are whole layers: S must be 1 or even)"
        )
    if cfg.attention != "standard":
        problems.append(f"attention={cfg.attention!r} (FLA's Transformer has standard attention only)")
    if cfg.attn_only:
        problems.append("attn_only=True (every FLA Transformer layer has an MLP)")
    if cfg.positional_embedding_type != "rotary":
        problems.append(f"positional_embedding_type={cfg.positional_embedding_type!r} (FLA uses RoPE)")
    if not cfg.gated_mlp or cfg.act_fn != "silu":
        problems.append(
            f"gated_mlp={cfg.gated_mlp}, act_fn={cfg.act_fn!r} (FLA's MLP is SwiGLU: gated_mlp=True, act_fn='silu')"
        )
    if cfg.use_bias:
        problems.append("use_bias=True (FLA's projections have no biases)")
    if cfg.residual == "attnres" and cfg.eps != cfg.attnres_eps:
        problems.append(
            f"eps={cfg.eps:g} with attnres_eps={cfg.attnres_eps:g} (FLA has one norm_eps for the "
            "pre-norms and the depth-attention key norms)"
        )
    if not problems:  # whatever else differs from a model FLA could describe (e.g. AttnRes ablation options)
        expected = model_config_from_fla(fla_config_dict(cfg, check=False))
        ours, theirs = cfg.to_dict(), expected.to_dict()
        problems = [
            f"{name}={ours[name]!r} (FLA's Transformer needs {name}={theirs[name]!r})"
            for name in sorted(ours)
            if name not in _UNMAPPED_FIELDS and ours[name] != theirs[name]
        ]
    if problems:
        raise FlaInteropError(
            "cannot export to flash-linear-attention, which has no equivalent of " + "; ".join(problems)
        )


def fla_config_dict(
    cfg: ModelConfig, template: Mapping[str, Any] | None = None, check: bool = True, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The FLA `TransformerConfig` (as config.json holds it) of `cfg`.

    `template` is the config the model was imported from, if any: its other keys (token ids, kernel choices) are
    kept, so an imported model exports with the config it came with.
    """
    if template is not None and not isinstance(template, Mapping):
        raise FlaInteropError(f"template must be an FLA config (a JSON object / dict), got {template!r:.80}")
    if check:
        check_exportable(cfg)
    out: dict[str, Any] = {
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False,
        "use_l2warp": False,
        "use_cache": True,
        "elementwise_affine": True,
        "bos_token_id": 0,
        "eos_token_id": None,
        "pad_token_id": None,
    }  # BOS: the id our tasks reserve (docs/tasks.md §1)
    out.update({key: value for key, value in (template or {}).items() if not key.startswith("_")})
    out.update(
        {
            "model_type": FLA_MODEL_TYPE,
            "architectures": [FLA_ARCHITECTURE],
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "num_heads": cfg.n_heads,
            "num_kv_heads": cfg.n_key_value_heads,
            "vocab_size": cfg.d_vocab,
            "max_position_embeddings": cfg.n_ctx,
            "intermediate_size": cfg.d_mlp,
            "hidden_act": "swish",
            "rope_theta": cfg.rotary_base,
            "norm_eps": cfg.eps,
            "initializer_range": cfg.init_range,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attnres_block_size": cfg.attnres_block_size if cfg.residual == "attnres" else None,
            "qk_norm": False,
            "qkv_bias": False,
            "window_size": None,
            "dtype": _dtype_name(dtype or cfg.dtype),
        }
    )
    if template is not None and template.get("num_kv_heads") is None and cfg.n_key_value_heads == cfg.n_heads:
        out["num_kv_heads"] = None  # FLA's spelling of "as many as the heads", kept as it came
    if (
        template is not None
        and template.get("intermediate_size") is None
        and fla_mlp_width({**out, "intermediate_size": None}) == cfg.d_mlp
    ):
        out["intermediate_size"] = None  # FLA derives it from hidden_ratio; kept as it came
    out.pop("torch_dtype", None)  # transformers 5 reads "dtype"
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise FlaInteropError(f"dtype {dtype} cannot be written; use one of {list(DTYPES)}")


def _torch_dtype(dtype: None | str | torch.dtype) -> torch.dtype | None:
    """A dtype asked for by name ('bfloat16') or as the torch dtype; None stays None (the model's own)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise FlaInteropError(f"dtype must be one of {list(DTYPES)} (a name or the torch dtype), got {dtype!r}")


# ---------------------------------------------------------------------------- state dicts
def _layer_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, FLA name) of every parameter copied without reshaping."""
    pairs = [("embed.W_E", "model.embeddings.weight"), ("ln_final.w", "model.norm.weight")]
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        pairs += [(ours + "ln1.w", theirs + "attn_norm.weight"), (ours + "ln2.w", theirs + "mlp_norm.weight")]
        if cfg.residual == "attnres":
            pairs += [
                (ours + "attn_res.key_norm.w", theirs + "attn_res_norm.weight"),
                (ours + "mlp_res.key_norm.w", theirs + "mlp_res_norm.weight"),
            ]
    if cfg.residual == "attnres":
        pairs.append(("final_res.key_norm.w", "model.res_norm.weight"))
    return pairs


def _queries(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our pseudo-query [d], FLA's projection [1, d]) pairs."""
    if cfg.residual != "attnres":
        return []
    pairs = [("final_res.query", "model.res_proj.weight")]
    for layer in range(cfg.n_layers):
        pairs += [
            (f"blocks.{layer}.attn_res.query", f"model.layers.{layer}.attn_res_proj.weight"),
            (f"blocks.{layer}.mlp_res.query", f"model.layers.{layer}.mlp_res_proj.weight"),
        ]
    return pairs


def state_dict_from_fla(fla_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from FLA's. nn.Linear stores `weight [out, in]` and computes `x @ weight.T`; ours are
    `[in, out]` (MLP, unembedding) or split per head (`W_Q [head, d_model, d_head]`, `W_O [head, d_head, d_model]`,
    head h owning rows h·d_head … (h+1)·d_head − 1 of FLA's projections)."""
    _check_fla_keys(fla_state, cfg)
    H, K, D, dh = cfg.n_heads, cfg.n_key_value_heads, cfg.d_model, cfg.d_head
    out = {ours: fla_state[theirs] for ours, theirs in _layer_names(cfg)}
    out.update({ours: fla_state[theirs][0] for ours, theirs in _queries(cfg)})
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        out[ours + "attn.W_Q"] = fla_state[theirs + "attn.q_proj.weight"].reshape(H, dh, D).transpose(1, 2)
        out[ours + "attn.W_K"] = fla_state[theirs + "attn.k_proj.weight"].reshape(K, dh, D).transpose(1, 2)
        out[ours + "attn.W_V"] = fla_state[theirs + "attn.v_proj.weight"].reshape(K, dh, D).transpose(1, 2)
        out[ours + "attn.W_O"] = fla_state[theirs + "attn.o_proj.weight"].T.reshape(H, dh, D)
        out[ours + "mlp.W_gate"] = fla_state[theirs + "mlp.gate_proj.weight"].T
        out[ours + "mlp.W_in"] = fla_state[theirs + "mlp.up_proj.weight"].T
        out[ours + "mlp.W_out"] = fla_state[theirs + "mlp.down_proj.weight"].T
    if not cfg.tie_word_embeddings:
        out["unembed.W_U"] = fla_state["lm_head.weight"].T
    return {name: tensor.contiguous() for name, tensor in out.items()}


def state_dict_to_fla(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, tied_head: bool = True
) -> dict[str, torch.Tensor]:
    """FLA's state dict from ours (the inverse of `state_dict_from_fla`). With tied embeddings `lm_head.weight` is
    included when `tied_head` (what `load_state_dict` expects) and left out otherwise (what a saved file holds)."""
    H, K, D, dh = cfg.n_heads, cfg.n_key_value_heads, cfg.d_model, cfg.d_head
    out = {theirs: state[ours] for ours, theirs in _layer_names(cfg)}
    out.update({theirs: state[ours][None] for ours, theirs in _queries(cfg)})
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        out[theirs + "attn.q_proj.weight"] = state[ours + "attn.W_Q"].transpose(1, 2).reshape(H * dh, D)
        out[theirs + "attn.k_proj.weight"] = state[ours + "attn.W_K"].transpose(1, 2).reshape(K * dh, D)
        out[theirs + "attn.v_proj.weight"] = state[ours + "attn.W_V"].transpose(1, 2).reshape(K * dh, D)
        out[theirs + "attn.o_proj.weight"] = state[ours + "attn.W_O"].reshape(H * dh, D).T
        out[theirs + "mlp.gate_proj.weight"] = state[ours + "mlp.W_gate"].T
        out[theirs + "mlp.up_proj.weight"] = state[ours + "mlp.W_in"].T
        out[theirs + "mlp.down_proj.weight"] = state[ours + "mlp.W_out"].T
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state["unembed.W_U"].T
    elif tied_head:
        out["lm_head.weight"] = state["embed.W_E"]
    return {name: tensor.detach().contiguous() for name, tensor in out.items()}


def expected_fla_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the FLA model `cfg` describes, with its shape (tied: `lm_head.weight` optional)."""
    from attnres_lens.rundir import _expected_shapes

    ours = {name: torch.empty(shape, device="meta") for name, shape in _expected_shapes(cfg).items()}
    return {name: tuple(tensor.shape) for name, tensor in state_dict_to_fla(ours, cfg).items()}


def _check_fla_keys(fla_state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    # the layer count first, from the names alone: the shapes below build every layer the config asks for
    layers = {int(match[1]) for name in fla_state if (match := re.match(r"model\.layers\.(\d+)\.", name))}
    if layers != set(range(cfg.n_layers)):
        held = (
            f"layers 0..{max(layers)}"
            if layers == set(range(max(layers) + 1))
            else sorted(layers)[:8]
            if layers
            else "no layers"
        )
        raise FlaInteropError(f"num_hidden_layers={cfg.n_layers} in the FLA config, but its weights hold {held}")
    wanted = expected_fla_shapes(cfg)
    shapes = {name: tuple(tensor.shape) for name, tensor in fla_state.items()}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(wanted) - set(shapes) - optional)
    unexpected = sorted(set(shapes) - set(wanted))
    wrong = [
        f"{n} {shapes[n]} (expected {wanted[n]})" for n in sorted(set(shapes) & set(wanted)) if shapes[n] != wanted[n]
    ]
    if missing or unexpected or wrong:
        raise FlaInteropError(
            f"the FLA weights do not match their config: missing {missing}, unexpected "
            f"{unexpected}, wrong shapes {wrong}"
        )
    if (
        cfg.tie_word_embeddings
        and "lm_head.weight" in fla_state
        and not torch.equal(fla_state["lm_head.weight"], fla_state["model.embeddings.weight"])
    ):
        raise FlaInteropError("tie_word_embeddings=True but lm_head.weight differs from model.embeddings.weight")


# ---------------------------------------------------------------------------- directories
def read_fla_config(path: PathLike) -> dict[str, Any]:
    """config.json of a Hugging Face-format model directory."""
    folder = Path(path)
    if not folder.is_dir():
        raise FlaInteropError(
            f"{folder} is not a directory (an FLA model directory holds config.json and model.safetensors)"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FlaInteropError(f"{folder} has no config.json; it is not a Hugging Face model directory")
    config = read_json_file(config_path, FlaInteropError)
    if not isinstance(config, dict):
        raise FlaInteropError(f"{config_path} must hold a JSON object")
    if config.get("auto_map") is not None:  # transformers' trust_remote_code: Python files of the folder
        raise FlaInteropError(
            f"{config_path} names code of its own (auto_map={config['auto_map']!r}); attnres_lens "
            "never runs code from a model folder: only models whose code ships with an installed "
            "package can be opened"
        )
    return config


def read_fla_dir(path: PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of a Hugging Face-format FLA directory: `model.safetensors`, or shards named by
    `model.safetensors.index.json` (`fla_weight_files`); nothing else in the folder is opened."""
    folder = Path(path)
    config = read_fla_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for name in fla_weight_files(folder):
        if (folder / name).exists() and not (folder / name).is_file():  # a FIFO would block the read forever
            raise FlaInteropError(f"{folder / name} is not a regular file; a model's weights are safetensors files")
        try:
            tensors.update(load_file(str(folder / name)))
        except (SafetensorError, OSError) as err:
            raise FlaInteropError(f"{folder / name} is missing, corrupt or truncated ({err})") from err
    return config, tensors


def fla_weight_files(folder: Path) -> list[str]:
    """The weight files of a model directory, by name: the shards its index names, else `model.safetensors`.
    Pickled weights (`pytorch_model.bin`, `*.pt`) are refused: unpickling runs code."""
    if (folder / WEIGHTS_INDEX).is_file():
        index = read_json_file(folder / WEIGHTS_INDEX, FlaInteropError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()
        ):
            raise FlaInteropError(
                f"{folder / WEIGHTS_INDEX} is not a safetensors index: its weight_map must be an "
                "object mapping tensor names to shard file names (strings)"
            )
        files = sorted(set(weight_map.values()))
        # names, not resolved paths: a Hugging Face cache's shards are symlinks into its blobs folder
        outside = [name for name in files if Path(name).is_absolute() or ".." in Path(name).parts]
        if outside:
            raise FlaInteropError(
                f"{folder / WEIGHTS_INDEX} names shards outside its folder ({outside[:3]}); "
                "a model directory's shards are files beside its index"
            )
        return files
    if (folder / WEIGHTS_FILE).is_file():
        return [WEIGHTS_FILE]
    pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in folder.glob(pattern))
    hint = (
        f" ({', '.join(pickled)} are pickles, which are never loaded: unpickling runs code. If you trust the "
        f'file, convert it once: python -c "import torch; from safetensors.torch import save_file; '
        f"save_file(torch.load('{folder / pickled[0]}', weights_only=True), '{folder / WEIGHTS_FILE}')\")"
        if pickled
        else ""
    )
    raise FlaInteropError(f"{folder} has no {WEIGHTS_FILE}{hint}")


def _fla_parts(model_or_dir: Any, dtype: str) -> tuple[dict[str, Any], ModelConfig, dict[str, torch.Tensor], str]:
    """(FLA config, our config, FLA tensors, where they came from); the config is checked before any weight is read."""
    if isinstance(model_or_dir, (str, Path)):
        config = read_fla_config(model_or_dir)
        cfg = model_config_from_fla(config, dtype=dtype)
        return config, cfg, read_fla_dir(model_or_dir)[1], str(Path(model_or_dir).resolve())
    config = getattr(model_or_dir, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(model_or_dir, "state_dict"):
        raise FlaInteropError(
            f"expected an FLA TransformerForCausalLM or a model directory, got {type(model_or_dir).__name__}"
        )
    config = config.to_dict()
    cfg = model_config_from_fla(config, dtype=dtype)
    return config, cfg, dict(model_or_dir.state_dict()), f"<in-memory {type(model_or_dir).__name__}>"


def from_fla(model_or_dir: Any, dtype: str = "float32") -> HookedTransformer:
    """A `HookedTransformer` computing the same function as an FLA `TransformerForCausalLM` (in memory, or a
    Hugging Face-format directory). `dtype` is the model's dtype (bf16 weights upcast to float32 exactly)."""
    return import_fla(model_or_dir, dtype)[0]


def import_fla(model_or_dir: Any, dtype: str = "float32") -> tuple[HookedTransformer, dict[str, Any]]:
    """`from_fla`, plus the provenance of the import (source, FLA config, stored dtype) for a run directory."""
    from attnres_lens.model import HookedTransformer

    fla_config, cfg, fla_state, source = _fla_parts(model_or_dir, dtype)
    state = state_dict_from_fla(fla_state, cfg)
    non_finite = [
        name for name, tensor in fla_state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()
    ]
    if non_finite:  # as training never keeps a non-finite checkpoint
        raise FlaInteropError(
            f"the FLA weights hold NaN or infinite values in {', '.join(non_finite[:5])}"
            f"{', …' if len(non_finite) > 5 else ''}; a model with non-finite weights is not imported"
        )
    stored = {name: _dtype_name(t.dtype) for name, t in fla_state.items() if t.dtype in DTYPES.values()}
    model = HookedTransformer(cfg)
    model.load_state_dict({name: t.to(cfg.dtype) for name, t in state.items()}, strict=True)
    kinds = sorted(set(stored.values()))
    provenance = {
        "source": "flash-linear-attention",
        "path": source,
        "fla_config": _jsonable(fla_config),
        "stored_dtype": kinds[0] if len(kinds) == 1 else kinds,
    }
    if len(kinds) > 1:  # which tensor had which, so an export writes each back in its own
        provenance["stored_dtypes"] = stored
    return model.eval(), provenance


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def to_fla(
    model: HookedTransformer, dtype: torch.dtype | None = None, template: Mapping[str, Any] | None = None
) -> TransformerForCausalLM:
    """An FLA `TransformerForCausalLM` computing the same function as `model` (refuses what FLA cannot express)."""
    dtype = _torch_dtype(dtype)
    fla_config = fla_config_dict(model.cfg, template, dtype=dtype)
    try:
        from fla.models import TransformerConfig, TransformerForCausalLM
    except ImportError as err:
        raise FlaInteropError(f"flash-linear-attention is not installed ({err}); install attnres_lens[fla]") from err
    config = TransformerConfig(**{k: v for k, v in fla_config.items() if k not in ("model_type", "architectures")})
    try:
        fla_model = TransformerForCausalLM(config)
    except ImportError as err:  # FLA's attention layer needs flash-attn (CUDA)
        raise FlaInteropError(f"FLA could not build its attention layer: {err}") from err
    state = state_dict_to_fla(model.state_dict(), model.cfg)
    fla_model.load_state_dict({k: v.to(dtype or model.cfg.dtype) for k, v in state.items()}, strict=True)
    return fla_model.to(dtype or model.cfg.dtype).eval()


def save_fla(
    model: HookedTransformer,
    out_dir: PathLike,
    dtype: None | str | torch.dtype = None,
    template: Mapping[str, Any] | None = None,
    tensor_dtypes: Mapping[str, str | torch.dtype] | None = None,
) -> Path:
    """Write `model` as a Hugging Face-format FLA directory (config.json + model.safetensors) that FLA's
    `TransformerForCausalLM.from_pretrained` opens, without FLA installed. `out_dir` must be empty or
    new: files of another model are never mixed in. `dtype` (default: the model's) is the config's and every
    tensor's, except those `tensor_dtypes` names (FLA tensor name → dtype: a checkpoint stored in several)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FlaInteropError(f"{out} exists and is not an empty folder; give a new folder for the FLA model")
    dtype = _torch_dtype(dtype)
    fla_config = fla_config_dict(model.cfg, template, dtype=dtype)
    weights = state_dict_to_fla(model.state_dict(), model.cfg, tied_head=False)
    per_tensor = {name: _torch_dtype(value) for name, value in (tensor_dtypes or {}).items()}
    weights = {name: tensor.to(per_tensor.get(name) or dtype or model.cfg.dtype) for name, tensor in weights.items()}
    atomic_save_safetensors(out / WEIGHTS_FILE, weights, {"format": "pt"})  # "pt": what transformers expects
    atomic_write_json(out / "config.json", fla_config)
    return out


# ---------------------------------------------------------------------------- run directories
# An imported run's train section is required by the run format but was never run: the smallest valid settings,
# with eval_size the number of held-out sequences its checkpoint's eval_loss was measured on (docs/interop.md §4).
IMPORT_EVAL_SEQUENCES = 16


def imported_train_config(eval_sequences: int = IMPORT_EVAL_SEQUENCES) -> TrainConfig:
    from attnres_lens.config import TrainConfig

    return TrainConfig(
        steps=1,
        warmup_steps=0,
        eval_every=1,
        eval_size=eval_sequences,
        record_every=1,
        record_size=min(32, eval_sequences),
        checkpoint_every=1,
        keep_checkpoints=1,
    )


def default_task(cfg: ModelConfig, name: str = "copy") -> dict[str, Any]:
    """The evaluation task of an imported model: task `name` at the model's vocabulary and context. The copy task's
    segments shrink to fit a short context (8–16 tokens by default), and its length to what the vocabulary can fill
    (docs/tasks.md §2: one content token per two positions)."""
    params: dict[str, Any] = {"name": name, "vocab_size": cfg.d_vocab, "seq_len": cfg.n_ctx}
    if name == "copy":
        seq_len = min(cfg.n_ctx, 2 * (cfg.d_vocab - 1) + 1)
        max_len = min(16, (seq_len - 1) // 2)
        params.update(seq_len=seq_len, max_len=max_len, min_len=min(8, max_len))
    elif name == "repeated" and cfg.n_ctx % 2 == 0:
        params["seq_len"] = cfg.n_ctx - 1  # [BOS, r, r] has odd length
    return params


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def import_fla_run(
    source: Any,
    out: PathLike,
    task: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    eval_sequences: int = IMPORT_EVAL_SEQUENCES,
) -> tuple[Path, float]:
    """Write an FLA model (directory or in-memory model) as a run directory that `load_run`, `analyze`, `prune` and
    the dashboard open: config.json with the provenance and `task` (default: `default_task`), one checkpoint whose
    eval_loss is measured on `eval_sequences` of the task's held-out set, no metrics or records (docs/interop.md §4).
    Returns the run's path and that loss."""
    import datetime
    import importlib.metadata

    import attnres_lens
    from attnres_lens.config import RunConfig, TaskConfig
    from attnres_lens.evaluation import evaluate_model

    model, provenance = import_fla(source, dtype)
    cfg = model.cfg
    try:
        task_config = TaskConfig.from_dict(task if task is not None else default_task(cfg))
    except ValueError as err:
        raise FlaInteropError(f"the evaluation task: {err}") from err
    run_config = RunConfig(cfg, task_config, imported_train_config(eval_sequences))
    built = run_config.build_task()
    if built.vocab_size > cfg.d_vocab or built.seq_len > cfg.n_ctx:
        raise FlaInteropError(
            f"the task needs vocab {built.vocab_size} and length {built.seq_len}, but the model has "
            f"d_vocab={cfg.d_vocab} and n_ctx={cfg.n_ctx}; set task.vocab_size / task.seq_len within "
            "them"
        )
    if isinstance(source, (str, Path)):
        folder = Path(source)  # the files the import read, by name: nothing else in the folder is opened
        provenance["weights_sha256"] = {name: _sha256(folder / name) for name in fla_weight_files(folder)}
    try:
        fla_version = importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:
        fla_version = None
    provenance.update(
        installed_fla_version=fla_version,
        imported_by=f"attnres_lens {attnres_lens.__version__}",
        imported_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    run_config.provenance = provenance

    run_dir = RunDir(out)
    with run_dir.writing_new_run(_refuse_used_folder):  # a failure before config.json leaves nothing behind
        loss = evaluate_model(model, built.eval_batch(eval_sequences)).loss
        meta = {"model_config": cfg.to_json(), "run_config": json.dumps(run_config.to_dict()), "step": "0"}
        run_dir.write_imported(run_config, dict(model.state_dict()), meta, loss)
    return run_dir.path, loss


def _refuse_used_folder(run_dir: RunDir) -> None:
    if run_dir.holds_run():
        raise FlaInteropError(f"{run_dir.path} already holds a run; give a new folder with --out")
    if foreign := run_dir.foreign_entries():
        raise FlaInteropError(f"{run_dir.path} is not empty ({', '.join(foreign[:5])}); give a new folder with --out")


def export_fla_run(run: PathLike, out: PathLike, checkpoint: str = "latest", dtype: str | None = None) -> Path:
    """Write a run's model (at `checkpoint`) as an FLA directory. A run imported from FLA exports with the config it
    came with and, unless `dtype` says otherwise, in the dtype its weights were stored in, so FLA → run → FLA gives
    back the same files' tensors."""
    from attnres_lens.rundir import RunDir, load_run

    if not isinstance(RunDir(run).read_config().model, ModelConfig):
        raise FlaInteropError(
            f"run {run} refers to a transformers model folder (import-hf); export-fla writes the toolkit's own models"
        )
    loaded = load_run(run, checkpoint=checkpoint)
    provenance = loaded.config.provenance or {}
    from_fla_run = provenance.get("source") == "flash-linear-attention"
    template = provenance.get("fla_config") if from_fla_run else None
    if from_fla_run and not isinstance(template, dict):
        raise FlaInteropError(
            f"{run}'s config.json has provenance.fla_config={template!r:.80}, not the FLA config "
            "object it was imported with; the run directory was edited or damaged"
        )
    tensor_dtypes = None
    if dtype is None and from_fla_run:
        stored = provenance.get("stored_dtype")
        if isinstance(stored, str):
            dtype = stored
        elif isinstance(provenance.get("stored_dtypes"), dict):  # several: each tensor as it came, config's kept
            tensor_dtypes = provenance["stored_dtypes"]
            # the config's own dtype, as it came: "dtype" since transformers 5, "torch_dtype" before
            named = [template.get(key) for key in ("dtype", "torch_dtype")] if isinstance(template, dict) else []
            dtype = next((name for name in named if name in DTYPES), None)
        elif stored:
            raise FlaInteropError(
                f"{run} was imported from weights stored in several dtypes ({stored}) without a "
                f"record of which tensor had which; pass --dtype (one of {list(DTYPES)})"
            )
    return save_fla(loaded.model, out, dtype, template, tensor_dtypes)
