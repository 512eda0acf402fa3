"""attnres_lens: mechanistic interpretability for Attention Residuals and KV-shifting attention.

The top-level names are imported lazily: `attnres_lens.kernels` must import with torch alone (no
transformer_lens, which takes seconds), and the CLI's `--help` must be instant.
"""

from importlib import import_module
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "ModelConfig": "attnres_lens.config",
    "HookedTransformer": "attnres_lens.model",
    "next_token_loss": "attnres_lens.model",
    "param_groups": "attnres_lens.model",
    "adamw": "attnres_lens.model",
    "DepthMixingModel": "attnres_lens.protocol",
    "Run": "attnres_lens.rundir",
    "RunDirError": "attnres_lens.rundir",
    "load_run": "attnres_lens.rundir",
    "from_transformers": "attnres_lens.bridge",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnres_lens' has no attribute {name!r}")
