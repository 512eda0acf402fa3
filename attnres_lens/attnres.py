"""Attention Residuals: the depth aggregation (docs/model.md §2), in one place.

Glossary (sublayers j = 0 … J−1 in forward order: attn_0, mlp_0, attn_1, …; J is the final readout):

* block size S: sublayers per block, attention and MLP counted separately; S = 1 is Full AttnRes;
* `b_0 = e`, the embedding, is always its own source;
* sublayer j starts a block when `j mod S == 0` (`starts_block`); the final readout belongs to the last block;
* partial sum `p`: the sum of the raw outputs of the current block's sublayers so far; a completed block `b_n` is
  the sum of all its sublayers' outputs (sources are raw outputs or sums of them, never cumulative states);
* sources of sublayer j: `[b_0, …, b_{n−1}]`, plus `p` when j does not start its block; the final readout reads
  every source `[b_0, …, b_{N−1}, last partial]`;
* depth attention: `α = softmax_s(w_j · RMSNorm_g(v_s))` with a zero-initialised pseudo-query `w_j` (no 1/√d, no
  temperature), and `h_j = Σ_s α_s v_s` with the values un-normalised.

`starts_block` and `block_start` are the one statement of the block rule; `source_layout` states the bookkeeping as
index lists (what analyses and plot labels use), `DepthStream` carries the tensors through a forward pass and
`DepthAttention` is the softmax over depth. How the mixes run fast (fused with the pre-norm, two-phase windows,
shared gradients, stacked copies) is `depth_execution.py`'s; kernel ops come from `attnres_lens.kernels` alone.
"""

from __future__ import annotations

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens import depth_execution
from attnres_lens.components import RMSNorm
from attnres_lens.depth_execution import DepthExecution, common_dtype, kernel_serves_hooks
from attnres_lens.hook_checks import any_hooked, is_hooked, module_hooked
from attnres_lens.kernels import depth_attention, depth_logits, mix_sources
from attnres_lens.streams import ResidualStream

EMBEDDING = -1  # sublayer index used for the embedding e in source layouts


def starts_block(sublayer: int, block_size: int) -> bool:
    """Whether sublayer j opens a new block (the previous partial sum then becomes a completed source)."""
    return sublayer % block_size == 0


def block_start(consumer: int, n_sublayers: int, block_size: int) -> int:
    """First sublayer of the block `consumer` belongs to; the final readout (consumer J) belongs to the last block."""
    return (min(consumer, n_sublayers - 1) // block_size) * block_size


def source_layout(consumer: int, n_sublayers: int, block_size: int, window: int | None = None) -> list[list[int]]:
    """Which sublayer outputs are summed into each source read by `consumer`.

    `consumer` is a sublayer index in 0 … J−1, or J for the final readout. Each source is a list of
    sublayer indices; `[EMBEDDING]` is `b_0 = e`. For the final readout the last source is the last
    block's (possibly complete) partial sum. With a sliding `window` W the consumer reads the embedding plus
    only the last W of the other sources.
    """
    if not 0 <= consumer <= n_sublayers:
        raise ValueError(f"consumer must be in 0..{n_sublayers} (J = final readout), got {consumer}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    first = block_start(consumer, n_sublayers, block_size)  # the blocks before it are complete
    sources = [[EMBEDDING]]
    sources += [list(range(start, start + block_size)) for start in range(0, first, block_size)]
    if first < consumer:
        sources.append(list(range(first, consumer)))
    return windowed(sources, window)


def windowed(sources: list, window: int | None) -> list:
    """The embedding (always first) plus the last `window` other sources; all of them when `window` is None."""
    return sources if window is None else sources[:1] + sources[1:][-window:]


class DepthStream(DepthExecution, ResidualStream):
    """The residual state between sublayers of an AttnRes model: completed blocks and the current partial sum.

    `read(module)` mixes the next consumer's input, `write(f, input)` adds a sublayer's output to the partial sum,
    `readout(module)` mixes the final readout's input; `state` is the current partial sum.

    How each mix runs (one fused pass, two-phase windows over `consumers`, stacked copies, shared gradients) is
    `depth_execution.DepthExecution`'s (`_mix`): every way computes the mix `DepthAttention` states.
    """

    def __init__(
        self,
        embedding: torch.Tensor,
        block_size: int,
        consumers: list[DepthAttention] | None = None,
        window: int | None = None,
    ):
        super().__init__(consumers)
        self.block_size = block_size
        self.window = window
        self.blocks: list[torch.Tensor] = [embedding]  # b_0 = e, then completed blocks b_1, b_2, …
        self.partial: torch.Tensor | None = None  # sum of the current block's outputs so far
        self.n_written = 0  # index of the next sublayer

    @property
    def state(self) -> torch.Tensor | None:
        return self.partial

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self.partial = value

    def read(self, mixer: DepthAttention) -> torch.Tensor:
        self._close_block()
        return self._mix(mixer, self.n_written)

    def read_normed(
        self, mixer: DepthAttention, hook_in: HookPoint, norm: RMSNorm
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """As `ResidualStream.read_normed`; x is None where the C kernel mixed and normed in one call: nothing
        reads it (this stream's `write` ignores the sublayer's input, and a hook on it takes the path below)."""
        if module_hooked(hook_in):  # a hook may see or edit x: the norm must read what it returns
            if self.block_size == 1 and torch.is_grad_enabled():
                # a window's phase-1 part is saved by its later merges: edited in place by the hook, their backward
                # would fail, so in training this consumer mixes on its own
                self._close_block()
                x = hook_in(self._one_pass(mixer, None))
                return x, norm(x)
            return super().read_normed(mixer, hook_in, norm)
        self._close_block()
        return self._mix(mixer, self.n_written, norm)

    def _close_block(self) -> None:
        if starts_block(self.n_written, self.block_size) and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None

    def write(self, output: torch.Tensor, input: torch.Tensor | None = None) -> None:
        self.partial = output if self.partial is None else self.partial + output
        self.n_written += 1

    def readout(self, mixer: DepthAttention) -> torch.Tensor:
        return self._mix(mixer, self.n_written)

    def readout_normed(self, mixer: DepthAttention, norm: nn.Module) -> torch.Tensor:
        """As `ResidualStream.readout_normed`: the final readout is a consumer like a sublayer, its norm fused into
        the mix on the same terms as a sublayer's pre-norm (no hook on the mix, the norm or its hook points)."""
        return self._mix(mixer, self.n_written, norm)[1]

    def sources(self, blocks: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The sources the next consumer reads (after `read` has closed a completed block); with `blocks`, those
        in place of the completed blocks (their views that share a gradient)."""
        blocks = self.blocks if blocks is None else blocks
        return windowed(blocks + ([self.partial] if self.partial is not None else []), self.window)

    def last_in_block(self, consumer: int) -> int:
        """The last of `consumers` in `consumer`'s block (the final readout belongs to the last block)."""
        final = len(self.consumers) - 1
        end = block_start(consumer, final, self.block_size) + self.block_size
        return end - 1 if end < final else final


class DepthAttention(nn.Module):
    """Attention over depth with a learned, zero-initialised pseudo-query (one per sublayer).

    Default (the AttnRes paper's method): `α = softmax_s(w · RMSNorm_g(v_s))`, `h = Σ_s α_s v_s`. Parameters:
    `query` [d_model] (zeros, so weights start uniform) and `key_norm.w` [d_model] (ones). Hooks: `hook_logits`,
    `hook_weights`, [batch, pos, n_sources] ([batch, pos, heads, n_sources] with `heads > 1`), and
    `hook_logit_bias` [batch, pos, n_sources]: zeros that a hook may edit, added to every head's logits (−inf
    takes a source out of a token's mix; how interventions knock sources out without leaving the fused kernel).

    The paper's ablations (docs/model.md §11), each an option: `score="sigmoid"` (α_s = sigmoid(z_s), not
    normalised); `key_norm=False` (keys are the raw sources); `query="input"` (q = W · RMSNorm(x) per token, from
    the most recent source x, i.e. the last one read, with `query_proj` [d_model, d_model] zero-initialised; with
    `query_read="sum"` x is the sum of the sources read, and `query_scale` "sqrt_d" or "d" divides its logits by √d
    or d, d the channels per head);
    `heads=H` (the channels split into H groups, each with its own query slice, key norm and softmax);
    `mixing="scalar"` (learned input-independent weights `scalar_logits` [n_sources], softmax-normalised).

    With the default options and nothing hooked on the logits or weights, the mix runs through the fused
    `kernels.depth_attention` (`backend`), which never materialises α; a hook there (or any option) takes the
    readable path, whose every step a hook can see, edit and differentiate. A bias that needs a gradient does too.
    Without a gradient on the C kernel the hooks fire on the kernel's logits and weights instead, and a second C
    pass (or, where they edited them, the readable mix) mixes the sources after them
    (`depth_execution.watched_kernel_mix`).
    """

    def __init__(
        self,
        d_model: int,
        eps: float,
        backend: str = "auto",
        score: str = "softmax",
        key_norm: bool = True,
        query: str = "static",
        heads: int = 1,
        mixing: str = "attention",
        n_sources: int | None = None,
        query_scale: str = "none",
        query_read: str = "recent",
    ):
        super().__init__()
        self.backend = backend
        self.score, self.query_kind, self.heads, self.mixing, self.eps = score, query, heads, mixing, eps
        self.query_read = query_read
        # the input query's logits are divided by this (docs/model.md §11); d = the channels of one head
        self.query_divisor = {"none": 1.0, "sqrt_d": (d_model // heads) ** 0.5, "d": float(d_model // heads)}[
            query_scale
        ]
        if mixing == "scalar":
            if n_sources is None:
                raise ValueError("scalar depth mixing needs n_sources, the number of sources it weighs")
            self.scalar_logits = nn.Parameter(torch.zeros(n_sources))
        elif query == "input":
            self.query_proj = nn.Parameter(torch.zeros(d_model, d_model))
        else:
            self.query = nn.Parameter(torch.zeros(d_model))
        if mixing == "attention" and key_norm:
            self.key_norm = RMSNorm(d_model, eps, hooked=False)  # keys only; values stay un-normalised
        self.hook_logits = HookPoint()  # [batch, pos, n_sources] ([batch, pos, heads, n_sources] with heads > 1)
        self.hook_weights = HookPoint()  # same shape as hook_logits
        self.hook_logit_bias = HookPoint()  # [batch, pos, n_sources]; fires only when hooked

    @property
    def fusable(self) -> bool:
        """Whether the fused kernels compute this mix (the paper's default method only). Asked by every consumer
        on every forward: the key norm is looked up in `_modules`, not through nn.Module's attribute fallback."""
        return (
            self.score == "softmax"
            and self.mixing == "attention"
            and self.query_kind == "static"
            and self.heads == 1
            and "key_norm" in self._modules
        )

    # hook points whose hooks send the mix down the readable path (interventions stack copies by them)
    path_hooks = ("hook_logits", "hook_weights")
    hook_points = (*path_hooks, "hook_logit_bias")

    def observed(self) -> bool:
        """Whether a hook watches the logits or weights (then this depth attention runs the readable path)."""
        return any_hooked(self, self.path_hooks)

    def hooked(self) -> bool:
        """Whether any hook is on this depth attention (then Block AttnRes mixes it on its own, not two-phase)."""
        return any_hooked(self, self.hook_points)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        sources = common_dtype(sources)
        bias = self.logit_bias(sources)
        if self.fusable and not self.observed() and (bias is None or not bias.requires_grad):
            return depth_attention(
                sources, self.query, self.key_norm.w, self.key_norm.eps, backend=self.backend, logit_bias=bias
            )
        if self.fusable and kernel_serves_hooks(self, sources):  # no autograd sees it: hooks fire on the kernel's
            return depth_execution.watched_kernel_mix(self, sources, bias)
        logits = self.logits(sources)
        if bias is not None:
            logits = logits + (bias if self.heads == 1 else bias.unsqueeze(-2)).to(logits.dtype)
        return self.mix_from_logits(self.hook_logits(logits), sources)

    def mix_from_logits(self, logits: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        """The readable path from the (hooked) logits on: the weights through `hook_weights`, then the mix."""
        weights = self.hook_weights(logits.softmax(dim=-1) if self.score == "softmax" else torch.sigmoid(logits))
        if self.heads == 1:
            return mix_sources(weights, sources)
        grouped = [v.unflatten(-1, (self.heads, -1)) for v in sources]  # [..., heads, d_model / heads]
        return mix_sources(weights, grouped).flatten(-2)

    def logit_bias(self, sources: list[torch.Tensor]) -> torch.Tensor | None:
        """`hook_logit_bias`'s output [..., n_sources] when it is hooked (it then fires on zeros), else None."""
        if not is_hooked(self.hook_logit_bias):
            return None
        first = sources[0]
        dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        return self.hook_logit_bias(first.new_zeros((*first.shape[:-1], len(sources)), dtype=dtype))

    def logits(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """Pre-score logits `z_s` over the sources: [..., n_sources], or [..., heads, n_sources]."""
        dtype = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
        if self.mixing == "scalar":
            # a copy: a hook editing z in place must not write into the parameter (expand alone is a view of it)
            return self.scalar_logits.to(dtype).expand(*sources[0].shape[:-1], len(sources)).clone()
        if self.fusable:
            return depth_logits(sources, self.query, self.key_norm.w, self.key_norm.eps)
        # the readable path of the ablations: sources stacked once, [..., n_sources, heads, d_model / heads]
        values = torch.stack([v.to(dtype) for v in sources], dim=-2).unflatten(-1, (self.heads, -1))
        if hasattr(self, "key_norm"):  # each channel group normalised on its own, then the gain
            gain = self.key_norm.w.to(dtype).unflatten(-1, (self.heads, -1))
            values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.key_norm.eps) * gain
        if self.query_kind == "input":
            read = sources[-1].to(dtype) if self.query_read == "recent" else sum(v.to(dtype) for v in sources)
            read = read * torch.rsqrt(read.pow(2).mean(-1, keepdim=True) + self.eps)
            query = (read @ self.query_proj.to(dtype)).unflatten(-1, (self.heads, -1))  # [..., heads, d / heads]
            if self.query_divisor != 1.0:
                query = query / self.query_divisor
        else:
            query = self.query.to(dtype).unflatten(-1, (self.heads, -1))
        logits = (values * query.unsqueeze(-3)).sum(-1).transpose(-1, -2)  # [..., heads, n_sources]
        return logits.squeeze(-2) if self.heads == 1 else logits
