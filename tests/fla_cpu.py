"""Running flash-linear-attention's own TransformerForCausalLM on a CPU, as the oracle of the interop tests.

FLA 0.6 is written for GPUs; three things stand in for what a CPU lacks, inside `fla_runtime()` only:

* its Triton kernels (RMSNorm, SwiGLU, rotary) run under the Triton interpreter (`TRITON_INTERPRET=1`, which must
  be set before triton is first imported: tests/conftest.py does it), once Triton's autotuner is kept from timing
  configs (timing needs a GPU driver): it is given the first config only;
* `fla.layers.attn` calls `flash_attn_func` (flash-attn, CUDA only): `sdpa_flash_attn` computes the same causal
  softmax attention with PyTorch's SDPA, query head h reading key/value head h // (heads / kv_heads);
* the transformer calls `fused_attnres`, whose Triton kernel refuses CPU tensors: FLA's own `naive_attnres`
  (the same mathematics and signature, less `checkpoint_level`) stands in.

Nothing here is used by the package: it is how the tests (and the worked example) run FLA's forward.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set; FLA's kernels cannot run on the CPU in this process"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def sdpa_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: Any = None,
    **unused: Any,
) -> torch.Tensor:
    """flash-attn's `flash_attn_func` for [batch, pos, heads, d_head] tensors, through PyTorch's SDPA."""
    if tuple(window_size) != (-1, -1) or unused.get("dropout_p", 0.0):
        raise NotImplementedError("the SDPA stand-in covers full causal attention without dropout only")
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    n_queries, n_keys = q.shape[1], k.shape[1]
    # flash-attn aligns the causal mask to the bottom right (the queries are the last n_queries positions, as in
    # cached decoding); SDPA's is_causal aligns it to the top left, the same only when the lengths are equal
    mask = torch.ones(n_queries, n_keys, dtype=torch.bool, device=q.device).tril(n_keys - n_queries) if causal else None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=softmax_scale
    )
    return out.transpose(1, 2)


@contextlib.contextmanager
def fla_runtime(device: str = "cpu", flash_attention: bool = False) -> Iterator[None]:
    """Within the block FLA's Transformer builds and runs on `device`.

    On the CPU all three stand-ins of the module docstring apply. On CUDA FLA runs its real kernels, and its attention
    is flash-attn's only with `flash_attention` (flash-attn computes in fp16/bf16 only, so fp32 comparisons use the
    SDPA stand-in there too).
    """
    import fla.layers.attn as fla_attn
    import fla.models.transformer.modeling_transformer as fla_transformer
    from fla.ops.attnres import naive_attnres
    from triton.runtime.autotuner import Autotuner

    def attnres(*args: Any, checkpoint_level: Any = None, **kwargs: Any) -> torch.Tensor:
        return naive_attnres(*args, **kwargs)

    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "FLA's Triton kernels run on the CPU only under TRITON_INTERPRET=1, set before triton is first imported"
        )
    if flash_attention and fla_attn.flash_attn_func in (None, sdpa_flash_attn):
        raise RuntimeError("flash_attention=True needs flash-attn installed")
    saved = (Autotuner.prune_configs, fla_attn.flash_attn_func, fla_transformer.fused_attnres)
    if not flash_attention:
        fla_attn.flash_attn_func = sdpa_flash_attn
    if on_cpu:
        Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]
        fla_transformer.fused_attnres = attnres
    try:
        yield
    finally:
        Autotuner.prune_configs, fla_attn.flash_attn_func, fla_transformer.fused_attnres = saved


def fla_logits(fla_model: torch.nn.Module, tokens: torch.Tensor, flash_attention: bool = False) -> torch.Tensor:
    """FLA's logits for `tokens` [batch, pos] (no cache, no labels), on the model's device."""
    device = next(fla_model.parameters()).device
    with fla_runtime(str(device), flash_attention), torch.no_grad():
        return fla_model(input_ids=tokens.to(device), use_cache=False).logits
