"""Attention Residuals: the depth aggregation of SPEC §3.2, in one place.

Sublayers are numbered j = 0 … J−1 in forward order (attn_0, mlp_0, attn_1, …). With block size S:

* `b_0 = e` (the embedding) is always its own source;
* sublayer j starts a block when `j mod S == 0`; the block being built holds the partial sum `p` of its
  sublayers' raw outputs, and a completed block `b_n` is the sum of all its sublayers' outputs;
* the sources of sublayer j are `[b_0, …, b_{n−1}]`, plus `p` when j does not start its block;
* `α = softmax_s(w_j · RMSNorm_g(v_s))` (zero-initialised query w_j, no 1/√d) and `h_j = Σ_s α_s v_s`;
* the final readout attends over every source `[b_0, …, b_{N−1}, last partial]`.

S = 1 is Full AttnRes: the sources of sublayer j are `[e, f_0, …, f_{j−1}]`.

`source_layout` states the bookkeeping as plain index lists (what analyses and plot labels use);
`DepthStream` carries the tensors through a forward pass; `DepthAttention` is the softmax over depth.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens.components import RMSNorm
from attnres_lens.kernels import BlockStats, block_phase1, depth_attention, merge_partial

EMBEDDING = -1  # sublayer index used for the embedding e in source layouts


def source_layout(consumer: int, n_sublayers: int, block_size: int) -> list[list[int]]:
    """Which sublayer outputs are summed into each source read by `consumer`.

    `consumer` is a sublayer index in 0 … J−1, or J for the final readout. Each source is a list of
    sublayer indices; `[EMBEDDING]` is `b_0 = e`. For the final readout the last source is the last
    block's (possibly complete) partial sum.
    """
    if not 0 <= consumer <= n_sublayers:
        raise ValueError(f"consumer must be in 0..{n_sublayers} (J = final readout), got {consumer}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    completed_blocks = consumer // block_size if consumer < n_sublayers else (consumer - 1) // block_size
    sources = [[EMBEDDING]]
    sources += [list(range(n * block_size, (n + 1) * block_size)) for n in range(completed_blocks)]
    partial = list(range(completed_blocks * block_size, consumer))
    if partial:
        sources.append(partial)
    return sources


class DepthStream:
    """The residual state between sublayers of an AttnRes model (tensors, not indices).

    `mix(module)` gives the next consumer's input (a sublayer's, or the final readout's once every sublayer has
    written); `read()` gives its sources; `write(f)` adds a sublayer's output to the current block's partial sum;
    `final_sources()` gives the sources of the final readout.

    With `consumers` (every sublayer's depth attention, then the final readout's), Block AttnRes runs two-phase
    (paper Alg. 1): at a block's first unhooked consumer, one phase-1 pass scores all of the block's pseudo-queries
    against the completed blocks; each consumer then merges in its own partial sum. A hooked consumer still takes
    its readable path, so hook values are unchanged.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, consumers: Optional[list["DepthAttention"]] = None):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = [embedding]  # b_0 = e, then completed blocks b_1, b_2, …
        self.partial: Optional[torch.Tensor] = None  # sum of the current block's outputs so far
        self.n_written = 0  # index of the next sublayer
        self.consumers = consumers
        self._phase1: Optional[tuple[int, BlockStats]] = None  # (first sublayer of the block, its phase-1 state)

    def read(self) -> list[torch.Tensor]:
        starts_block = self.n_written % self.block_size == 0
        if starts_block and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None
        return self.final_sources()

    def write(self, output: torch.Tensor) -> None:
        self.partial = output if self.partial is None else self.partial + output
        self.n_written += 1

    def final_sources(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def mix(self, module: "DepthAttention", final: bool = False) -> torch.Tensor:
        sources = self.final_sources() if final else self.read()
        if self.consumers is None or module.observed():
            return module(sources)
        n_sublayers = len(self.consumers) - 1
        consumer = n_sublayers if final else self.n_written
        # the final readout belongs to the last block: it reads that block's (possibly complete) partial sum
        block_start = (min(consumer, n_sublayers - 1) // self.block_size) * self.block_size
        if self._phase1 is None or self._phase1[0] != block_start:
            block_end = block_start + self.block_size
            members = list(range(block_start, min(block_end, n_sublayers)))
            members += [n_sublayers] if block_end >= n_sublayers else []
            self._phase1 = (block_start, self._score_block([self.consumers[i] for i in members]))
        partial = None if self.partial is None else self.partial.to(self._phase1[1].out_dtype)
        return merge_partial(self._phase1[1], consumer - block_start, partial)

    def _score_block(self, members: list["DepthAttention"]) -> BlockStats:
        blocks = _common_dtype(self.blocks + ([self.partial] if self.partial is not None else []))[: len(self.blocks)]
        queries = torch.stack([member.query for member in members])
        gains = torch.stack([member.key_norm.w for member in members])
        return block_phase1(blocks, queries, gains, members[0].key_norm.eps, backend=members[0].backend)


def _common_dtype(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Under autocast the embedding stays fp32 while sublayer outputs are bf16: mix in the wider type."""
    dtype = functools.reduce(torch.promote_types, (value.dtype for value in sources))
    return [value.to(dtype) for value in sources]


class DepthAttention(nn.Module):
    """Softmax over depth with a learned, zero-initialised pseudo-query (one per sublayer).

    Parameters: `query` [d_model] (zeros, so weights start uniform) and `key_norm.w` [d_model] (ones).
    Hooks: `hook_logits`, `hook_weights`, both [batch, pos, n_sources].

    When nothing is hooked here, the mix runs through the fused `kernels.depth_attention` (`backend`),
    which never materialises α; a hook switches to the readable path below, whose every step it can
    see, edit and differentiate.
    """

    def __init__(self, d_model: int, eps: float, backend: str = "auto"):
        super().__init__()
        self.backend = backend
        self.query = nn.Parameter(torch.zeros(d_model))
        self.key_norm = RMSNorm(d_model, eps, hooked=False)  # keys only; values stay un-normalised
        self.hook_logits = HookPoint()
        self.hook_weights = HookPoint()

    def observed(self) -> bool:
        """Whether a hook watches this depth attention (then it runs the readable path)."""
        return self.hook_logits.has_hooks() or self.hook_weights.has_hooks()

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        sources = _common_dtype(sources)
        if not self.observed():
            return depth_attention(sources, self.query, self.key_norm.w, self.key_norm.eps, backend=self.backend)
        keys = [self.key_norm(value) for value in sources]
        logits = torch.stack([key @ self.query for key in keys], dim=-1)  # no temperature, no 1/√d
        weights = self.hook_weights(self.hook_logits(logits).softmax(dim=-1))
        return sum(weights[..., s, None] * value for s, value in enumerate(sources))
