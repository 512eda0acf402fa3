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
`DepthAttention` is the softmax over depth.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens.components import RMSNorm, any_hooked, is_hooked, module_hooked, norm_fuses_into, parameter
from attnres_lens.kernels import BlockStats, block_phase1, depth_attention, merge_partial
from attnres_lens.kernels._common import builds_no_graph
from attnres_lens.kernels.backends import elementwise_runs_cpu_kernel, stream_two_phase_backend
from attnres_lens.kernels.cpu_autograd import share_gradient
from attnres_lens.kernels.cpu_depth import depth_attention_copies_cpu, depth_attention_multi_cpu, fused_mix_and_norm
from attnres_lens.kernels.reference import depth_logits, mix_sources
from attnres_lens.streams import ResidualStream

EMBEDDING = -1  # sublayer index used for the embedding e in source layouts


def starts_block(sublayer: int, block_size: int) -> bool:
    """Whether sublayer j opens a new block (the previous partial sum then becomes a completed source)."""
    return sublayer % block_size == 0


def block_start(consumer: int, n_sublayers: int, block_size: int) -> int:
    """First sublayer of the block `consumer` belongs to; the final readout (consumer J) belongs to the last block."""
    return (min(consumer, n_sublayers - 1) // block_size) * block_size


def source_layout(consumer: int, n_sublayers: int, block_size: int, window: Optional[int] = None) -> list[list[int]]:
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


def windowed(sources: list, window: Optional[int]) -> list:
    """The embedding (always first) plus the last `window` other sources; all of them when `window` is None."""
    return sources if window is None else sources[:1] + sources[1:][-window:]


class _Copies(NamedTuple):
    """A stream stacked from `n_copies` states that share their leading sources (`DepthStream.stacked_from`): one
    copy's tensors (`originals`) and the stacked ones that repeat them (`stacked`), position for position."""

    originals: list[torch.Tensor]
    stacked: list[torch.Tensor]
    n_copies: int


class _Phase1(NamedTuple):
    """A two-phase window: consumers `first` … `last` scored against the stream's first `n_sources` sources."""

    first: int
    last: int
    n_sources: int
    stats: BlockStats


# Full AttnRes without a gradient on the CPU: this many consecutive consumers share one read of their common
# sources (a larger window saves little more: its merges re-read the sources written since); two-phase only from
# this many shared sources: below it the sources sit in cache and the extra calls cost more than the reads
# saved (the measurements: docs/kernels.md §7)
LOOKAHEAD = 4
MIN_SHARED_SOURCES = 8
# With a gradient (training), windows from this many: the C two-phase backward moves half the bytes of one-pass
# backwards but does the same arithmetic, and each merge adds a call and a separate pre-norm, so windows pay only
# in deep models (docs/kernels.md §7)
MIN_SHARED_SOURCES_WITH_GRAD = 16
# Training on the C kernel: completed blocks' gradients are summed in place (DepthStream._one_pass) from this many
# elements per source; below it the sums' nodes and buffers cost more than autograd's additions they save
# (docs/kernels.md §5, "Gradients of shared sources")
MIN_SHARED_GRADIENT_ELEMENTS = 1 << 16


class DepthStream(ResidualStream):
    """The residual state between sublayers of an AttnRes model: completed blocks and the current partial sum.

    `read(module)` mixes the next consumer's input, `write(f, input)` adds a sublayer's output to the partial sum,
    `readout(module)` mixes the final readout's input; `state` is the current partial sum.

    With `consumers` (every sublayer's depth attention, then the final readout's), consumers may mix two-phase
    (paper Alg. 1; `kernels.backends.stream_two_phase_backend` says where): at a window's first unhooked consumer,
    one phase-1 pass scores the pseudo-queries of every consumer in the window against the sources they all read;
    each consumer then merges in what phase 1 could not see. The window is the rest of the block for Block AttnRes
    (its partial sum is merged), the next `LOOKAHEAD` consumers for Full AttnRes (the outputs written since are
    merged). A hooked consumer still takes its readable path, so hook values are unchanged.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, consumers: Optional[list["DepthAttention"]] = None,
                 window: Optional[int] = None):
        self.block_size = block_size
        self.window = window
        self.blocks: list[torch.Tensor] = [embedding]  # b_0 = e, then completed blocks b_1, b_2, …
        self.partial: Optional[torch.Tensor] = None  # sum of the current block's outputs so far
        self.n_written = 0  # index of the next sublayer
        self.consumers = consumers
        self._phase1: Optional[_Phase1] = None
        # set once the backend policy refused a window: it answers the same for the rest of this forward (grad
        # mode, backend and device do not change, and sources that need a gradient keep needing it), so the
        # later consumers of a training step skip the question
        self._one_pass_only = False
        self._shared: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block, its share_gradient view), see _one_pass
        self._copies: Optional[_Copies] = None  # see `stacked_from`

    @property
    def state(self) -> Optional[torch.Tensor]:
        return self.partial

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self.partial = value

    def read(self, mixer: "DepthAttention") -> torch.Tensor:
        self._close_block()
        return self._mix(mixer, self.n_written)

    def read_normed(self, mixer: "DepthAttention", hook_in: HookPoint, norm: RMSNorm
                    ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
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

    def write(self, output: torch.Tensor, input: Optional[torch.Tensor] = None) -> None:
        self.partial = output if self.partial is None else self.partial + output
        self.n_written += 1

    def readout(self, mixer: "DepthAttention") -> torch.Tensor:
        return self._mix(mixer, self.n_written)

    def readout_normed(self, mixer: "DepthAttention", norm: nn.Module) -> torch.Tensor:
        """As `ResidualStream.readout_normed`: the final readout is a consumer like a sublayer, its norm fused into
        the mix on the same terms as a sublayer's pre-norm (no hook on the mix, the norm or its hook points)."""
        return self._mix(mixer, self.n_written, norm)[1]

    def batch_changed(self) -> None:
        self._phase1 = None  # the window's phase-1 statistics were computed for the old batch
        self._shared = []  # views of the old batch's blocks
        self._copies = None

    def stacked_from(self, states: list["DepthStream"]) -> None:
        """Note that this stream is `states` stacked along the batch (exact interventions run branches so): the
        leading completed blocks that every state holds as the same tensor are one block repeated, so a window's
        phase 1 mixes those once, at one copy's batch, for every copy, and a consumer with a logit-bias hook reads
        them once for all its copies (docs/kernels.md §7)."""
        def leading(state: "DepthStream") -> list[torch.Tensor]:
            # with S = 1 the partial sum is the last output, which the next read closes into a block unchanged
            return state.blocks + ([state.partial] if state.partial is not None and self.block_size == 1 else [])

        sources = [leading(state) for state in states]
        shared = 0
        for column in zip(*sources):
            if any(block is not column[0] for block in column):
                break
            shared += 1
        self._copies = (_Copies(sources[0][:shared], leading(self)[:shared], len(states))
                        if shared and len(states) > 1 else None)

    def sources(self) -> list[torch.Tensor]:
        """The sources the next consumer reads (after `read` has closed a completed block)."""
        return windowed(self.blocks + ([self.partial] if self.partial is not None else []), self.window)

    def _mix(self, module: "DepthAttention", consumer: int, norm: Optional[RMSNorm] = None
             ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The consumer's input h, or with `norm` (its pre-norm) `(h, norm(h))`."""
        if (self.consumers is None or self._one_pass_only or module.hooked()
                or (self.block_size == 1 and len(self.blocks) < MIN_SHARED_SOURCES)):  # too few for a Full window
            return self._one_pass(module, norm)
        # in training on the C kernel, the blocks' gradients are summed in place as in a one-pass mix
        sources = _common_dtype(self._gradient_shared_sources() if self._shares_gradients(module)
                                else self.sources())
        phase1 = self._phase1
        if phase1 is None or not phase1.first <= consumer <= phase1.last:
            phase1 = self._phase1 = self._start_window(consumer, sources)
        if phase1 is None:
            return self._one_pass(module, norm)
        unseen = [source.to(phase1.stats.out_dtype) for source in sources[phase1.n_sources:]]
        h = merge_partial(phase1.stats, consumer - phase1.first, unseen)
        return h if norm is None else (h, norm(h))

    def _one_pass(self, module: "DepthAttention", norm: Optional[RMSNorm]
                  ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self._copies is not None and (mixed := self._mix_over_copies(module, norm)) is not None:
            return mixed
        sources = self.sources()
        fused = None if norm is None else module.fused_with_norm(sources, norm)
        if self._shares_gradients(module, fused is not None):
            sources = self._gradient_shared_sources()
        # with the norm, the sublayer reads norm(h) alone (`write` ignores its input): the kernel need not keep h
        if fused is not None:
            return fused_mix_and_norm(sources, *fused, False)
        return module(sources) if norm is None else module.mix_and_norm(sources, norm, keep_h=False)

    def _mix_over_copies(self, module: "DepthAttention", norm: Optional[RMSNorm]
                         ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None]:
        """A consumer's mix of stacked copies (`stacked_from`) whose leading sources every copy shares, each copy
        with its own logit bias (a knockout), reading the shared sources once for all copies
        (`cpu_depth.depth_attention_copies_cpu`), as `_one_pass` returns it (with `norm`, `(h, norm(h))`, the norm
        fused unless something watches it); None where the one-pass mix must run: an autograd that could see it
        (`builds_no_graph`), a hook that watches the mix (`observed`) or the module, a window, another backend, or
        a shared source since replaced."""
        if (not builds_no_graph() or self.window is not None or not module.fusable or module.observed()
                or module_hooked(module)):
            return None
        sources = self.sources()
        originals, _, n_copies = self._copies
        n_shared = min(len(originals), len(sources))  # the final readout may read fewer (a partial not closed)
        if (not self._copies_intact(sources)
                or not elementwise_runs_cpu_kernel(module.backend, *sources)
                or any(source.dtype != sources[0].dtype for source in sources)):
            return None
        bias = module.logit_bias(sources)
        fused = norm_fuses_into(norm, sources[0].dtype)
        mixed = depth_attention_copies_cpu(originals[:n_shared], sources[n_shared:], n_copies, module.query,
                                           module.key_norm.w, module.key_norm.eps, bias,
                                           norm=(norm.w, norm.eps) if fused else None)
        if norm is None or fused:
            return mixed
        return mixed, norm(mixed)

    def _copies_intact(self, sources: list[torch.Tensor]) -> bool:
        """Whether `sources` (the stream's, from the first) still hold the stacked tensors `stacked_from` saw where
        the copies share a source: none was replaced since, so each still repeats its original."""
        return all(source is stacked for source, stacked in zip(sources, self._copies.stacked))

    def _shares_gradients(self, module: "DepthAttention", fused: bool = False) -> bool:
        """Whether this consumer's C backward adds its source gradients into buffers the completed blocks share
        (`kernels.cpu_autograd.SharedGradient`; docs/kernels.md §5): with a gradient, on the C kernel, for sources
        of `MIN_SHARED_GRADIENT_ELEMENTS` or more, when nothing hooked on the mix could see the blocks' shared
        views (a module hook sees its inputs). `fused`: the consumer's `fused_with_norm` allowed its fused call,
        which answers the rest."""
        # elementwise_runs_cpu_kernel: the C kernel's rule for these tensors (false under torch.compile, whose
        # custom ops take no shared buffers)
        return (torch.is_grad_enabled() and self.blocks[0].numel() >= MIN_SHARED_GRADIENT_ELEMENTS
                and (fused or (module.fusable and not module.hooked() and not module_hooked(module)
                               and elementwise_runs_cpu_kernel(module.backend, self.blocks[0]))))

    def _gradient_shared_sources(self) -> list[torch.Tensor]:
        """`sources()` with every completed block seen through its `share_gradient` view (made once per block)."""
        for i, block in enumerate(self.blocks):
            if i == len(self._shared) or self._shared[i][0] is not block:  # new, or replaced (a copied stream)
                self._shared[i:] = [(block, share_gradient(block))]
        del self._shared[len(self.blocks):]
        return windowed([view for _, view in self._shared] + ([self.partial] if self.partial is not None else []),
                        self.window)

    def _start_window(self, consumer: int, sources: list[torch.Tensor]) -> Optional[_Phase1]:
        """Phase 1 for the window that starts at `consumer`, or None where it mixes one pass per consumer."""
        shared = sources[: len(self.blocks)]  # the current partial sum changes within the window: merged later
        final = len(self.consumers) - 1
        if self.block_size > 1:  # the rest of the block; the final readout belongs to the last block
            end = block_start(consumer, final, self.block_size) + self.block_size
            last = end - 1 if end < final else final
        else:
            last = min(consumer + LOOKAHEAD - 1, final)
        members = self.consumers[consumer : last + 1]
        module = members[0]
        needs_grad = torch.is_grad_enabled() and _any_requires_grad(shared, members)
        backend = stream_two_phase_backend(self.block_size, module.backend, shared[0].device)
        self._one_pass_only = backend is None
        if backend is None or (backend == "cpu" and len(shared) < (MIN_SHARED_SOURCES_WITH_GRAD if needs_grad
                                                                   else MIN_SHARED_SOURCES)):
            return None
        queries = torch.stack([member.query for member in members])
        gains = torch.stack([member.key_norm.w for member in members])
        stats = None
        if backend == "cpu" and self._copies is not None and self.window is None and builds_no_graph():
            stats = self._phase1_over_copies(shared, queries, gains, module.key_norm.eps)
        if stats is None:
            stats = block_phase1(shared, queries, gains, module.key_norm.eps, backend=backend)
        return _Phase1(consumer, last, len(shared), stats)

    def _phase1_over_copies(self, shared: list[torch.Tensor], queries: torch.Tensor, gains: torch.Tensor,
                            eps: float) -> Optional[BlockStats]:
        """Phase 1 over `shared` (stacked copies of a batch, `stacked_from`) with the blocks the copies share
        mixed once at one copy's batch, that part then the prior of every copy's mix of the other blocks; None
        where too few blocks are shared to pay for the extra call, or a shared block was replaced since stacking."""
        if not self._copies_intact(shared):
            return None
        originals, _, n_copies = self._copies
        # the final readout reads the last partial sum without closing it into a block, so `shared` (the blocks)
        # may end before the shared sources do
        originals = originals[: len(shared)]
        if len(originals) < MIN_SHARED_SOURCES:
            return None
        originals = [block.to(shared[0].dtype) for block in originals]  # as _common_dtype made `shared`
        once = block_phase1(originals, queries, gains, eps, backend="cpu")
        if len(shared) == len(originals):
            mix = once.mix.repeat(1, n_copies, *[1] * (once.mix.dim() - 2))
            lse = once.lse.repeat(1, n_copies, *[1] * (once.lse.dim() - 2))
        else:
            folded = queries.to(once.mix.dtype) * gains.to(once.mix.dtype)  # as block_phase1 folds them
            mix, lse = depth_attention_multi_cpu(shared[len(originals):], folded, eps, prior=(once.mix, once.lse))
        return once._replace(mix=mix, lse=lse)


def _unchanged(seen: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether a hook's output is `kept` as it was: the same dtype, device, shape and values (an edit in place,
    through `.data` or a new tensor all count; `torch.equal` alone calls an exact cast equal)."""
    return seen.dtype == kept.dtype and seen.device == kept.device and torch.equal(seen, kept)


def _any_requires_grad(sources: list[torch.Tensor], modules: list["DepthAttention"]) -> bool:
    # the modules first: in training their parameters answer at once, without a look at every source
    return (any(module.query.requires_grad or module.key_norm.w.requires_grad for module in modules)
            or any(source.requires_grad for source in sources))


def _common_dtype(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Under autocast the embedding stays fp32 while sublayer outputs are bf16: mix in the wider type."""
    if all(value.dtype == sources[0].dtype for value in sources):
        return sources
    dtype = functools.reduce(torch.promote_types, (value.dtype for value in sources))
    return [value.to(dtype) for value in sources]


class DepthAttention(nn.Module):
    """Attention over depth with a learned, zero-initialised pseudo-query (one per sublayer).

    Default (the AttnRes paper's method): `α = softmax_s(w · RMSNorm_g(v_s))`, `h = Σ_s α_s v_s`. Parameters:
    `query` [d_model] (zeros, so weights start uniform) and `key_norm.w` [d_model] (ones). Hooks: `hook_logits`,
    `hook_weights`, [batch, pos, n_sources] ([batch, pos, heads, n_sources] with `heads > 1`), and
    `hook_logit_bias` [batch, pos, n_sources]: zeros that a hook may edit, added to every head's logits (−inf
    takes a source out of a token's mix; how interventions knock sources out without leaving the fused kernel).

    The paper's ablations (docs/model.md §11), each an option: `score="sigmoid"` (α_s = sigmoid(z_s), not
    normalised); `key_norm=False` (keys are the raw sources); `query="input"` (q = W · RMSNorm(x) per token, from
    the most recent source x, i.e. the last one read, with `query_proj` [d_model, d_model] zero-initialised);
    `heads=H` (the channels split into H groups, each with its own query slice, key norm and softmax);
    `mixing="scalar"` (learned input-independent weights `scalar_logits` [n_sources], softmax-normalised).

    With the default options and nothing hooked on the logits or weights, the mix runs through the fused
    `kernels.depth_attention` (`backend`), which never materialises α; a hook there (or any option) takes the
    readable path, whose every step a hook can see, edit and differentiate. A bias that needs a gradient does too.
    Without a gradient on the C kernel the hooks fire on the kernel's logits and weights instead, and a second C
    pass (or, where they edited them, the readable mix) mixes the sources after them (`_watched_kernel_mix`).
    """

    def __init__(self, d_model: int, eps: float, backend: str = "auto", score: str = "softmax", key_norm: bool = True,
                 query: str = "static", heads: int = 1, mixing: str = "attention", n_sources: Optional[int] = None):
        super().__init__()
        self.backend = backend
        self.score, self.query_kind, self.heads, self.mixing, self.eps = score, query, heads, mixing, eps
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
        return (self.score == "softmax" and self.mixing == "attention" and self.query_kind == "static"
                and self.heads == 1 and "key_norm" in self._modules)

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
        sources = _common_dtype(sources)
        bias = self.logit_bias(sources)
        if self.fusable and not self.observed() and (bias is None or not bias.requires_grad):
            return depth_attention(sources, self.query, self.key_norm.w, self.key_norm.eps, backend=self.backend,
                                   logit_bias=bias)
        if self.fusable and builds_no_graph() and elementwise_runs_cpu_kernel(self.backend, *sources):
            return self._watched_kernel_mix(sources, bias)
        logits = self.logits(sources)
        if bias is not None:
            logits = logits + (bias if self.heads == 1 else bias.unsqueeze(-2)).to(logits.dtype)
        return self._mix_from_logits(self.hook_logits(logits), sources)

    def _mix_from_logits(self, logits: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        """The readable path from the (hooked) logits on: the weights through `hook_weights`, then the mix."""
        weights = self.hook_weights(logits.softmax(dim=-1) if self.score == "softmax" else torch.sigmoid(logits))
        if self.heads == 1:
            return mix_sources(weights, sources)
        grouped = [v.unflatten(-1, (self.heads, -1)) for v in sources]  # [..., heads, d_model / heads]
        return mix_sources(weights, grouped).flatten(-2)

    def _watched_kernel_mix(self, sources: list[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The readable path's hooks, fired on the C kernel's logits (bias added) and weights where no autograd
        sees the call (inference, the analyses' reads of α, `run_with_cache` under no_grad); the mix then runs
        after them, from what they left, as the readable path's does. Left as they were (same dtype and values),
        the logits go back into the C kernel as its logit bias with a zero query (softmax(0 + z) is the same α),
        a second one-pass mix that reads the sources as the hooks left them: an edit of a source in place,
        through `.data` or a NumPy view (which no version counter sees) takes effect there too. Edited, the mix
        goes on from the hooked tensors in PyTorch. The kernel computes the same logits and softmax in the same
        dtype, to rounding; its two passes replace the readable path's ~4S (docs/kernels.md §11)."""
        _, weights, logits = depth_attention(sources, self.query, self.key_norm.w, self.key_norm.eps, backend="cpu",
                                             return_weights=True, return_logits=True, logit_bias=bias)
        # each hook gets a contiguous copy of its own, in the readable path's layout, held against the kernel's
        seen = self.hook_logits(logits.clone(memory_format=torch.contiguous_format))
        if not _unchanged(seen, logits):
            return self._mix_from_logits(seen, sources)
        seen = self.hook_weights(weights.clone(memory_format=torch.contiguous_format))
        if not _unchanged(seen, weights):
            return mix_sources(seen, sources)
        h = depth_attention(sources, torch.zeros_like(self.query), self.key_norm.w, self.key_norm.eps,
                            backend="cpu", logit_bias=logits)
        if not bool(h.sum().isfinite()):
            # an inf or NaN a hook wrote into a source spreads over its token through the key norm the second
            # pass recomputes (0 · NaN); the readable mix confines it to its channel, as the readable path does
            return mix_sources(weights, sources)
        return h

    def mix_and_norm(self, sources: list[torch.Tensor], norm: RMSNorm, keep_h: bool = True
                     ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """`(h, norm(h))` for this mix h of `sources` (a consumer and its pre-norm): one C kernel call each way
        where `fused_with_norm` allows it (docs/kernels.md §4). Without `keep_h` that kernel leaves h out,
        `(None, norm(h))`: h is neither written nor read back."""
        sources = _common_dtype(sources)
        fused = self.fused_with_norm(sources, norm)
        if fused is not None:
            return fused_mix_and_norm(sources, *fused, keep_h)
        h = self(sources)
        return h, norm(h)

    def fused_with_norm(self, sources: list[torch.Tensor], norm: nn.Module
                        ) -> Optional[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, float]]:
        """`fused_mix_and_norm`'s arguments after the sources, `(query, key-norm gain, eps, norm gain, norm eps)`,
        where this mix of `sources` and `norm` may run as one C kernel call: the mix would run the C kernel
        (sources of one shape and dtype, fp32 or fp64, on the CPU, outside torch.compile), its parameters and the
        norm's have the sources' dtype and width, and nothing watches the mix or the norm (hook points, PyTorch
        hooks on either, global module hooks; `components.norm_fuses_into`); else None. A hook that changed the
        width takes the checked path, whose error names the mismatch. Each consumer asks this on every forward, so
        the parameters are read from the modules' dicts where they are plain parameters (`components.parameter`)."""
        first = sources[0]
        dtype, width = first.dtype, first.shape[-1:]
        if (not self.fusable or module_hooked(self) or any_hooked(self, self.hook_points)
                or not norm_fuses_into(norm, dtype)):
            return None
        key_norm = self._modules["key_norm"]
        query, gain, norm_weight = parameter(self, "query"), parameter(key_norm, "w"), parameter(norm, "w")
        if (query.dtype == gain.dtype == dtype and query.shape == gain.shape == norm_weight.shape == width
                and elementwise_runs_cpu_kernel(self.backend, *sources)):
            return query, gain, key_norm.eps, norm_weight, norm.eps
        return None

    def logit_bias(self, sources: list[torch.Tensor]) -> Optional[torch.Tensor]:
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
            recent = sources[-1].to(dtype)
            recent = recent * torch.rsqrt(recent.pow(2).mean(-1, keepdim=True) + self.eps)
            query = (recent @ self.query_proj.to(dtype)).unflatten(-1, (self.heads, -1))  # [..., heads, d / heads]
        else:
            query = self.query.to(dtype).unflatten(-1, (self.heads, -1))
        logits = (values * query.unsqueeze(-3)).sum(-1).transpose(-1, -2)  # [..., heads, n_sources]
        return logits.squeeze(-2) if self.heads == 1 else logits
