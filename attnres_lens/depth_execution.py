"""How Attention Residuals run fast: the execution strategies of `attnres.DepthStream` and `attnres.DepthAttention`.

`attnres.py` states the method (docs/model.md §2); this module decides how each mix runs, and every strategy
computes what the readable mix computes (docs/kernels.md §4–§7, §11):

* **fused with its norm** (`fused_with_norm`, `mix_and_norm`): a consumer's mix and its pre-norm in one C call;
* **two-phase windows** (`DepthExecution._start_window`): one phase-1 pass scores several consumers' pseudo-queries
  against the sources they share, and each consumer merges in what phase 1 could not see;
* **shared gradients** (`DepthExecution._gradient_shared_sources`): in training on the C kernel, the completed
  blocks' gradients are summed in place;
* **stacked copies** (`DepthExecution.stacked_from`): exact interventions stack branches along the batch; the
  sources every branch shares are read once for all of them;
* **hooks served by the kernel** (`watched_kernel_mix`): hooks on the logits or weights fire on the C kernel's,
  where no autograd sees the call.

Each strategy steps aside for the readable path wherever a hook, an autograd or a backend could tell them apart.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from attnres_lens.components import RMSNorm
from attnres_lens.hook_checks import any_hooked, module_hooked, parameter
from attnres_lens.kernels import (
    BlockStats,
    block_phase1,
    builds_no_graph,
    depth_attention,
    depth_attention_copies_cpu,
    depth_attention_multi_cpu,
    elementwise_runs_cpu_kernel,
    fused_mix_and_norm,
    merge_partial,
    mix_sources,
    share_gradient,
    stream_two_phase_backend,
)

if TYPE_CHECKING:  # named for types only: attnres.py imports this module
    from attnres_lens.attnres import DepthAttention, DepthStream

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
# Training on the C kernel: completed blocks' gradients are summed in place (DepthExecution._one_pass) from this
# many elements per source; below it the sums' nodes and buffers cost more than autograd's additions they save
# (docs/kernels.md §5, "Gradients of shared sources")
MIN_SHARED_GRADIENT_ELEMENTS = 1 << 16


def common_dtype(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Under autocast the embedding stays fp32 while sublayer outputs are bf16: mix in the wider type."""
    if all(value.dtype == sources[0].dtype for value in sources):
        return sources
    dtype = functools.reduce(torch.promote_types, (value.dtype for value in sources))
    return [value.to(dtype) for value in sources]


def norm_fuses_into(norm: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a C depth mix of `dtype` may compute `norm` inside its kernel: it is the model's `RMSNorm` (a module
    a user put in its place runs on its own), nothing watches it, and its gain has the mix's dtype (docs/kernels.md
    §4)."""
    return isinstance(norm, RMSNorm) and not norm.watched() and parameter(norm, "w").dtype == dtype


def fused_with_norm(
    mixer: DepthAttention, sources: list[torch.Tensor], norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor, float] | None:
    """`fused_mix_and_norm`'s arguments after the sources, `(query, key-norm gain, eps, norm gain, norm eps)`,
    where `mixer`'s mix of `sources` and `norm` may run as one C kernel call: the mix would run the C kernel
    (sources of one shape and dtype, fp32 or fp64, on the CPU, outside torch.compile), its parameters and the
    norm's have the sources' dtype and width, and nothing watches the mix or the norm (hook points, PyTorch
    hooks on either, global module hooks; `norm_fuses_into`); else None. A hook that changed the width takes the
    checked path, whose error names the mismatch. Each consumer asks this on every forward, so the parameters are
    read from the modules' dicts where they are plain parameters (`hook_checks.parameter`)."""
    first = sources[0]
    dtype, width = first.dtype, first.shape[-1:]
    if (
        not mixer.fusable
        or module_hooked(mixer)
        or any_hooked(mixer, mixer.hook_points)
        or not norm_fuses_into(norm, dtype)
    ):
        return None
    key_norm = mixer._modules["key_norm"]
    query, gain, norm_weight = parameter(mixer, "query"), parameter(key_norm, "w"), parameter(norm, "w")
    if (
        query.dtype == gain.dtype == dtype
        and query.shape == gain.shape == norm_weight.shape == width
        and elementwise_runs_cpu_kernel(mixer.backend, *sources)
    ):
        return query, gain, key_norm.eps, norm_weight, norm.eps
    return None


def mix_and_norm(
    mixer: DepthAttention, sources: list[torch.Tensor], norm: RMSNorm, keep_h: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`(h, norm(h))` for `mixer`'s mix h of `sources` (a consumer and its pre-norm): one C kernel call each way
    where `fused_with_norm` allows it (docs/kernels.md §4). Without `keep_h` that kernel leaves h out,
    `(None, norm(h))`: h is neither written nor read back."""
    sources = common_dtype(sources)
    fused = fused_with_norm(mixer, sources, norm)
    if fused is not None:
        return fused_mix_and_norm(sources, *fused, keep_h)
    h = mixer(sources)
    return h, norm(h)


def kernel_serves_hooks(mixer: DepthAttention, sources: list[torch.Tensor]) -> bool:
    """Whether `watched_kernel_mix` may fire `mixer`'s hooks on the C kernel's logits and weights: no autograd can
    see the call and the C kernel runs on `sources`."""
    return builds_no_graph() and elementwise_runs_cpu_kernel(mixer.backend, *sources)


def watched_kernel_mix(mixer: DepthAttention, sources: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """The readable path's hooks, fired on the C kernel's logits (bias added) and weights where no autograd
    sees the call (`kernel_serves_hooks`: inference, the analyses' reads of α, `run_with_cache` under no_grad);
    the mix then runs after them, from what they left, as the readable path's does. Left as they were (same dtype
    and values), the logits go back into the C kernel as its logit bias with a zero query (softmax(0 + z) is the
    same α), a second one-pass mix that reads the sources as the hooks left them: an edit of a source in place,
    through `.data` or a NumPy view (which no version counter sees) takes effect there too. Edited, the mix
    goes on from the hooked tensors in PyTorch. The kernel computes the same logits and softmax in the same
    dtype, to rounding; its two passes replace the readable path's ~4S (docs/kernels.md §11)."""
    _, weights, logits = depth_attention(
        sources,
        mixer.query,
        mixer.key_norm.w,
        mixer.key_norm.eps,
        backend="cpu",
        return_weights=True,
        return_logits=True,
        logit_bias=bias,
    )
    # each hook gets a contiguous copy of its own, in the readable path's layout, held against the kernel's
    seen = mixer.hook_logits(logits.clone(memory_format=torch.contiguous_format))
    if not _unchanged(seen, logits):
        return mixer.mix_from_logits(seen, sources)
    seen = mixer.hook_weights(weights.clone(memory_format=torch.contiguous_format))
    if not _unchanged(seen, weights):
        return mix_sources(seen, sources)
    h = depth_attention(
        sources, torch.zeros_like(mixer.query), mixer.key_norm.w, mixer.key_norm.eps, backend="cpu", logit_bias=logits
    )
    if not bool(h.sum().isfinite()):
        # an inf or NaN a hook wrote into a source spreads over its token through the key norm the second
        # pass recomputes (0 · NaN); the readable mix confines it to its channel, as the readable path does
        return mix_sources(weights, sources)
    return h


def _unchanged(seen: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether a hook's output is `kept` as it was: the same dtype, device, shape and values (an edit in place,
    through `.data` or a new tensor all count; `torch.equal` alone calls an exact cast equal)."""
    return seen.dtype == kept.dtype and seen.device == kept.device and torch.equal(seen, kept)


def _any_requires_grad(sources: list[torch.Tensor], modules: list[DepthAttention]) -> bool:
    # the modules first: in training their parameters answer at once, without a look at every source
    return any(module.query.requires_grad or module.key_norm.w.requires_grad for module in modules) or any(
        source.requires_grad for source in sources
    )


class _Copies(NamedTuple):
    """A stream stacked from `n_copies` states that share their leading sources (`DepthExecution.stacked_from`):
    one copy's tensors (`originals`) and the stacked ones that repeat them (`stacked`), position for position."""

    originals: list[torch.Tensor]
    stacked: list[torch.Tensor]
    n_copies: int


class _Phase1(NamedTuple):
    """A two-phase window: consumers `first` … `last` scored against the stream's first `n_sources` sources."""

    first: int
    last: int
    n_sources: int
    stats: BlockStats


class DepthExecution:
    """The execution strategies of a depth stream (`attnres.DepthStream`, which derives from this class):
    `_mix(module, consumer, norm)` is the consumer's input h (with `norm`, `(h, norm(h))`), run one pass per
    consumer (`_one_pass`), in a two-phase window (paper Alg. 1; `kernels.stream_two_phase_backend` says where) or
    over stacked copies. A base class rather than a member, so that this per-forward state sits in the stream's own
    attributes, which interventions copy, slice and stack attribute by attribute (docs/kernels.md §7).

    Two-phase: at a window's first unhooked consumer, one phase-1 pass scores the pseudo-queries of every consumer
    in the window against the sources they all read; each consumer then merges in what phase 1 could not see. The
    window is the rest of the block for Block AttnRes (its partial sum is merged), the next `LOOKAHEAD` consumers
    for Full AttnRes (the outputs written since are merged). A hooked consumer still takes its readable path, so
    hook values are unchanged.
    """

    # the stream's state that the strategies read; the stream also answers `sources(blocks)` and
    # `last_in_block(consumer)` (`attnres.DepthStream`)
    block_size: int
    window: int | None
    blocks: list[torch.Tensor]
    partial: torch.Tensor | None

    def __init__(self, consumers: list[DepthAttention] | None):
        self.consumers = consumers  # every sublayer's depth attention, then the final readout's: windows may open
        self._phase1: _Phase1 | None = None
        # set once the backend policy refused a window: it answers the same for the rest of this forward (grad
        # mode, backend and device do not change, and sources that need a gradient keep needing it), so the
        # later consumers of a training step skip the question
        self._one_pass_only = False
        self._shared: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block, its share_gradient view), see _one_pass
        self._copies: _Copies | None = None  # see `stacked_from`

    def batch_changed(self) -> None:
        self._phase1 = None  # the window's phase-1 statistics were computed for the old batch
        self._shared = []  # views of the old batch's blocks
        self._copies = None

    def stacked_from(self, states: list[DepthStream]) -> None:
        """Note that this stream is `states` stacked along the batch (exact interventions run branches so): the
        leading completed blocks that every state holds as the same tensor are one block repeated, so a window's
        phase 1 mixes those once, at one copy's batch, for every copy, and a consumer with a logit-bias hook reads
        them once for all its copies (docs/kernels.md §7)."""

        def leading(state: DepthStream) -> list[torch.Tensor]:
            # with S = 1 the partial sum is the last output, which the next read closes into a block unchanged
            return state.blocks + ([state.partial] if state.partial is not None and self.block_size == 1 else [])

        sources = [leading(state) for state in states]
        shared = 0
        for column in zip(*sources):
            if any(block is not column[0] for block in column):
                break
            shared += 1
        self._copies = (
            _Copies(sources[0][:shared], leading(self)[:shared], len(states)) if shared and len(states) > 1 else None
        )

    def _mix(
        self, module: DepthAttention, consumer: int, norm: RMSNorm | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The consumer's input h, or with `norm` (its pre-norm) `(h, norm(h))`."""
        if (
            self.consumers is None
            or self._one_pass_only
            or module.hooked()
            or (self.block_size == 1 and len(self.blocks) < MIN_SHARED_SOURCES)
        ):  # too few for a Full window
            return self._one_pass(module, norm)
        # in training on the C kernel, the blocks' gradients are summed in place as in a one-pass mix
        sources = common_dtype(self._gradient_shared_sources() if self._shares_gradients(module) else self.sources())
        phase1 = self._phase1
        if phase1 is None or not phase1.first <= consumer <= phase1.last:
            phase1 = self._phase1 = self._start_window(consumer, sources)
        if phase1 is None:
            return self._one_pass(module, norm)
        unseen = [source.to(phase1.stats.out_dtype) for source in sources[phase1.n_sources :]]
        h = merge_partial(phase1.stats, consumer - phase1.first, unseen)
        return h if norm is None else (h, norm(h))

    def _one_pass(
        self, module: DepthAttention, norm: RMSNorm | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._copies is not None and (mixed := self._mix_over_copies(module, norm)) is not None:
            return mixed
        sources = self.sources()
        fused = None if norm is None else fused_with_norm(module, sources, norm)
        if self._shares_gradients(module, fused is not None):
            sources = self._gradient_shared_sources()
        # with the norm, the sublayer reads norm(h) alone (`write` ignores its input): the kernel need not keep h
        if fused is not None:
            return fused_mix_and_norm(sources, *fused, False)
        return module(sources) if norm is None else mix_and_norm(module, sources, norm, keep_h=False)

    def _mix_over_copies(
        self, module: DepthAttention, norm: RMSNorm | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """A consumer's mix of stacked copies (`stacked_from`) whose leading sources every copy shares, each copy
        with its own logit bias (a knockout), reading the shared sources once for all copies
        (`cpu_depth.depth_attention_copies_cpu`), as `_one_pass` returns it (with `norm`, `(h, norm(h))`, the norm
        fused unless something watches it); None where the one-pass mix must run: an autograd that could see it
        (`builds_no_graph`), a hook that watches the mix (`observed`) or the module, a window, another backend, or
        a shared source since replaced."""
        if (
            not builds_no_graph()
            or self.window is not None
            or not module.fusable
            or module.observed()
            or module_hooked(module)
        ):
            return None
        sources = self.sources()
        originals, _, n_copies = self._copies
        n_shared = min(len(originals), len(sources))  # the final readout may read fewer (a partial not closed)
        if (
            not self._copies_intact(sources)
            or not elementwise_runs_cpu_kernel(module.backend, *sources)
            or any(source.dtype != sources[0].dtype for source in sources)
        ):
            return None
        bias = module.logit_bias(sources)
        fused = norm_fuses_into(norm, sources[0].dtype)
        mixed = depth_attention_copies_cpu(
            originals[:n_shared],
            sources[n_shared:],
            n_copies,
            module.query,
            module.key_norm.w,
            module.key_norm.eps,
            bias,
            norm=(norm.w, norm.eps) if fused else None,
        )
        if norm is None or fused:
            return mixed
        return mixed, norm(mixed)

    def _copies_intact(self, sources: list[torch.Tensor]) -> bool:
        """Whether `sources` (the stream's, from the first) still hold the stacked tensors `stacked_from` saw where
        the copies share a source: none was replaced since, so each still repeats its original."""
        return all(source is stacked for source, stacked in zip(sources, self._copies.stacked))

    def _shares_gradients(self, module: DepthAttention, fused: bool = False) -> bool:
        """Whether this consumer's C backward adds its source gradients into buffers the completed blocks share
        (`kernels.cpu_autograd.SharedGradient`; docs/kernels.md §5): with a gradient, on the C kernel, for sources
        of `MIN_SHARED_GRADIENT_ELEMENTS` or more, when nothing hooked on the mix could see the blocks' shared
        views (a module hook sees its inputs). `fused`: the consumer's `fused_with_norm` allowed its fused call,
        which answers the rest."""
        # elementwise_runs_cpu_kernel: the C kernel's rule for these tensors (false under torch.compile, whose
        # custom ops take no shared buffers)
        return (
            torch.is_grad_enabled()
            and self.blocks[0].numel() >= MIN_SHARED_GRADIENT_ELEMENTS
            and (
                fused
                or (
                    module.fusable
                    and not module.hooked()
                    and not module_hooked(module)
                    and elementwise_runs_cpu_kernel(module.backend, self.blocks[0])
                )
            )
        )

    def _gradient_shared_sources(self) -> list[torch.Tensor]:
        """`sources()` with every completed block seen through its `share_gradient` view (made once per block)."""
        for i, block in enumerate(self.blocks):
            if i == len(self._shared) or self._shared[i][0] is not block:  # new, or replaced (a copied stream)
                self._shared[i:] = [(block, share_gradient(block))]
        del self._shared[len(self.blocks) :]
        return self.sources([view for _, view in self._shared])

    def _start_window(self, consumer: int, sources: list[torch.Tensor]) -> _Phase1 | None:
        """Phase 1 for the window that starts at `consumer`, or None where it mixes one pass per consumer."""
        shared = sources[: len(self.blocks)]  # the current partial sum changes within the window: merged later
        final = len(self.consumers) - 1
        if self.block_size > 1:  # the rest of the block; the final readout belongs to the last block
            last = self.last_in_block(consumer)
        else:
            last = min(consumer + LOOKAHEAD - 1, final)
        members = self.consumers[consumer : last + 1]
        module = members[0]
        needs_grad = torch.is_grad_enabled() and _any_requires_grad(shared, members)
        backend = stream_two_phase_backend(self.block_size, module.backend, shared[0].device)
        self._one_pass_only = backend is None
        if backend is None or (
            backend == "cpu" and len(shared) < (MIN_SHARED_SOURCES_WITH_GRAD if needs_grad else MIN_SHARED_SOURCES)
        ):
            return None
        queries = torch.stack([member.query for member in members])
        gains = torch.stack([member.key_norm.w for member in members])
        stats = None
        if backend == "cpu" and self._copies is not None and self.window is None and builds_no_graph():
            stats = self._phase1_over_copies(shared, queries, gains, module.key_norm.eps)
        if stats is None:
            stats = block_phase1(shared, queries, gains, module.key_norm.eps, backend=backend)
        return _Phase1(consumer, last, len(shared), stats)

    def _phase1_over_copies(
        self, shared: list[torch.Tensor], queries: torch.Tensor, gains: torch.Tensor, eps: float
    ) -> BlockStats | None:
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
        originals = [block.to(shared[0].dtype) for block in originals]  # as common_dtype made `shared`
        once = block_phase1(originals, queries, gains, eps, backend="cpu")
        if len(shared) == len(originals):
            mix = once.mix.repeat(1, n_copies, *[1] * (once.mix.dim() - 2))
            lse = once.lse.repeat(1, n_copies, *[1] * (once.lse.dim() - 2))
        else:
            folded = queries.to(once.mix.dtype) * gains.to(once.mix.dtype)  # as block_phase1 folds them
            mix, lse = depth_attention_multi_cpu(shared[len(originals) :], folded, eps, prior=(once.mix, once.lse))
        return once._replace(mix=mix, lse=lse)
