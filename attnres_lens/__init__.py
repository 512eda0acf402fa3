"""attnres_lens: mechanistic interpretability for Attention Residuals and KV-shifting attention."""

from attnres_lens.config import ModelConfig
from attnres_lens.model import HookedTransformer, next_token_loss, param_groups
from attnres_lens.rundir import Run, RunDirError, load_run

__version__ = "0.1.0"
__all__ = ["ModelConfig", "HookedTransformer", "Run", "RunDirError", "load_run", "next_token_loss", "param_groups",
           "__version__"]
