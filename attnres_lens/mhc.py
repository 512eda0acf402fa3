"""Manifold-constrained hyper-connections (mHC; arXiv 2512.24880, DeepSeek V4's residual), docs/model.md §13.

The residual is n streams `X ∈ R^{n×d}` per token, the embedding copied into each. Before every sublayer one linear
map of the flattened, unweighted-RMS-normalised streams gives raw read weights `pre ∈ R^n`, write weights
`post ∈ R^n` and a stream mix `comb ∈ R^{n×n}`, each with a learned bias and a learned scalar scale:

    pre  = sigmoid(scale_pre · W_pre x̂ + b_pre) + ε            (the sublayer reads h = Σ_i pre_i X_i)
    post = 2 · sigmoid(scale_post · W_post x̂ + b_post)         (it writes post_k · f into stream k)
    comb = Sinkhorn(softmax_rows(scale_comb · W_comb x̂ + b_comb) + ε)   (doubly stochastic)
    X ← combᵀ X + post ⊗ f

Sinkhorn: normalise columns once, then `iters − 1` times rows then columns, each sum offset by ε. A final head
collapses the streams, `h = Σ_i (sigmoid(scale · W x̂ + b) + ε)_i X_i`, before the final norm. This is the
arithmetic of transformers' `DeepseekV4HyperConnection` / `DeepseekV4HyperHead` (parameter names `fn`, `base`,
`scale`, `hc_fn`, `hc_base`, `hc_scale` kept so the test suite can load ours into theirs and compare).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens.components import normal_init
from attnres_lens.streams import ResidualStream


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a gain, as DeepSeek V4 normalises the flattened streams: the linear map after it
    (`fn`) has its own scale, so a gain would only duplicate it."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _compute_dtype(streams: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 / bf16 streams, as DeepSeek V4 computes the weights; fp64 for fp64 (the float64 tests)."""
    return torch.promote_types(streams.dtype, torch.float32)


def sinkhorn(matrix: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns normalised, then `iters − 1` rounds of rows then columns: a doubly stochastic matrix [..., n, n]."""
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    return matrix


class MHCConnection(nn.Module):
    """Read, write and stream-mix weights of one sublayer, computed from the streams it reads."""

    def __init__(
        self,
        n_streams: int,
        d_model: int,
        norm_eps: float,
        eps: float,
        sinkhorn_iters: int,
        init_range: float,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.n, self.norm_eps, self.eps, self.sinkhorn_iters = n_streams, norm_eps, eps, sinkhorn_iters
        shape = ((2 + n_streams) * n_streams, n_streams * d_model)
        self.fn = nn.Parameter(normal_init(shape, init_range, generator=generator))
        self.base = nn.Parameter(torch.zeros((2 + n_streams) * n_streams))
        self.scale = nn.Parameter(torch.ones(3))
        self.hook_read_weights = HookPoint()  # [batch, pos, n] pre: how much the sublayer reads from each stream
        self.hook_write_weights = HookPoint()  # [batch, pos, n] post: how much of its output each stream gets
        self.hook_stream_mix = HookPoint()  # [batch, pos, n, n] comb, doubly stochastic: X ← combᵀ X + post ⊗ f

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(h, post, comb)` from streams [batch, pos, n, d]: the sublayer's input and the weights of its update."""
        n, dtype = self.n, _compute_dtype(streams)
        flat = unweighted_rms_norm(streams.flatten(-2).to(dtype), self.norm_eps)
        raw = F.linear(flat, self.fn.to(dtype))
        pre_w, post_w, comb_w = raw.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.to(dtype).split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.to(dtype).unbind(0)
        pre = self.hook_read_weights(torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps)
        post = self.hook_write_weights(2 * torch.sigmoid(post_w * post_scale + post_b))
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n), dim=-1) + self.eps
        comb = self.hook_stream_mix(sinkhorn(comb, self.sinkhorn_iters, self.eps))
        h = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return h, post, comb


class MHCHead(nn.Module):
    """The final collapse of the streams into one vector, before the final norm."""

    def __init__(
        self,
        n_streams: int,
        d_model: int,
        norm_eps: float,
        eps: float,
        init_range: float,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        self.norm_eps, self.eps = norm_eps, eps
        self.hc_fn = nn.Parameter(normal_init((n_streams, n_streams * d_model), init_range, generator=generator))
        self.hc_base = nn.Parameter(torch.zeros(n_streams))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.hook_read_weights = HookPoint()  # [batch, pos, n]

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """The final norm's input [batch, pos, d] from streams [batch, pos, n, d], weighted by the head's reads."""
        dtype = _compute_dtype(streams)
        flat = unweighted_rms_norm(streams.flatten(-2).to(dtype), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.to(dtype)) * self.hc_scale.to(dtype) + self.hc_base.to(dtype))
        pre = self.hook_read_weights(pre + self.eps)
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


class MHCStream(ResidualStream):
    """n residual streams; each sublayer reads a weighted sum of them and writes into all of them."""

    def __init__(self, embedding: torch.Tensor, n_streams: int):
        self.state = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n_streams, embedding.shape[-1])
        self._update: tuple[torch.Tensor, torch.Tensor] | None = None  # (post, comb) of the sublayer being run

    def read(self, mixer: MHCConnection) -> torch.Tensor:
        h, post, comb = mixer(self.state)
        self._update = (post, comb)
        return h

    def write(self, output: torch.Tensor, input: torch.Tensor) -> None:
        post, comb = self._update
        dtype = self.state.dtype
        self.state = post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ self.state

    def readout(self, mixer: MHCHead) -> torch.Tensor:
        return mixer(self.state)
