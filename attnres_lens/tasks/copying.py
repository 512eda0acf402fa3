"""Variable-offset copy task: random tokens with one segment repeated at a random later offset.

Also holds the copy machinery the mixed task reuses (segment placement, insertion, answer masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BOS, Batch, Task, check_int, earlier_occurrences, random_content, uniform_int


def copy_layout(
    batch_size: int, seq_len: int, n_copies: int, min_len: int, max_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random placements of `n_copies` copies per sequence: (src_start, dst_start, seg_len), each [B, K].

    Content positions 1..T-1 are split into K equal chunks; copy k lands wholly inside chunk k (so copies
    never overlap) at a uniform position, and copies a segment starting uniformly anywhere before it
    (the segment ends before its copy starts, so offsets range from seg_len to almost the whole sequence).
    """
    chunk = (seq_len - 1) // n_copies
    shape = (batch_size, n_copies)
    seg_len = torch.randint(min_len, max_len + 1, shape, generator=generator)
    chunk_start = 1 + chunk * torch.arange(n_copies).expand(shape)
    dst_start = uniform_int(chunk_start.maximum(1 + seg_len), chunk_start + chunk - seg_len, generator)
    src_start = uniform_int(torch.ones_like(dst_start), dst_start - seg_len, generator)
    return src_start, dst_start, seg_len


def insert_copies(
    tokens: torch.Tensor, src_start: torch.Tensor, dst_start: torch.Tensor, seg_len: torch.Tensor
) -> torch.Tensor:
    """Overwrite tokens[dst : dst+len] with tokens[src : src+len] for each copy, in order of destination."""
    positions = torch.arange(tokens.shape[1])
    for k in range(dst_start.shape[1]):
        src, dst, length = src_start[:, k : k + 1], dst_start[:, k : k + 1], seg_len[:, k : k + 1]
        inside = (positions >= dst) & (positions < dst + length)
        source = (positions - (dst - src)).clamp(min=0)
        tokens = torch.where(inside, tokens.gather(1, source), tokens)
    return tokens


def copy_answer_mask(tokens: torch.Tensor, dst_start: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """Answer positions of the copy task, [B, T] bool.

    t counts when its token is a copied one that is not the copy's last (so the next token is copied
    too) and occurs exactly once in tokens[:t] - necessarily in the source segment, so "predict what
    followed the earlier occurrence" is unambiguous.
    """
    offset = torch.arange(tokens.shape[1]) - dst_start[:, :, None]  # [B, K, T]
    in_copy = ((offset >= 0) & (offset <= seg_len[:, :, None] - 2)).any(1)
    return in_copy & (earlier_occurrences(tokens) == 1)


def window_answer_mask(tokens: torch.Tensor, dst_start: torch.Tensor, seg_len: torch.Tensor) -> torch.Tensor:
    """Answer positions of the mixed task, [B, T] bool.

    t = dst + i counts when 1 <= i <= len-2 and every occurrence, before t, of the copied window
    tokens[dst : t+1] is followed by the same token (the source's is one of them, so that token is the
    answer). The longest suffix of the context that occurred earlier occurs only where the window does,
    so "continue the longest earlier match" answers every such position.
    """
    batch, seq_len = tokens.shape
    max_len = int(seg_len.max())
    starts = torch.arange(seq_len)
    # window_tokens[b, q, r] = tokens[b, q + r], or -1 past the end (never equal to a token).
    index = starts[:, None] + torch.arange(max_len)[None, :]
    window_tokens = tokens[:, index.clamp(max=seq_len - 1)].masked_fill(index >= seq_len, -1)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for k in range(dst_start.shape[1]):
        dst = dst_start[:, k]
        copied = window_tokens[torch.arange(batch), dst]  # [B, max_len]: tokens[dst + r]
        # How far the text from each start q agrees with the copy; a window occurrence at q < dst
        # whose agreement stops right after the window (match length i + 1) is followed by another token.
        match_len = (window_tokens == copied[:, None, :]).cumprod(-1).sum(-1)  # [B, T]
        earlier = (starts[None, :] < dst[:, None]).long()
        conflicts = torch.zeros(batch, max_len + 1, dtype=torch.long)
        conflicts.scatter_add_(1, match_len, earlier)  # [b, m]: earlier starts that match exactly m tokens
        offset = starts[None, :] - dst[:, None]
        in_copy = (offset >= 1) & (offset <= seg_len[:, k : k + 1] - 2)
        mask |= in_copy & (conflicts.gather(1, (offset + 1).clamp(0, max_len)) == 0)
    return mask


@dataclass(kw_only=True)
class CopyTask(Task):
    """Random tokens with one segment of min_len..max_len tokens repeated at a random later offset.

    The default induction training task: the offset varies per sequence, so no positional head solves it.
    Answer positions: see `copy_answer_mask`. Layout: src_start, dst_start, seg_len, each [B, 1].
    """

    name = "copy"
    min_len: int = 8
    max_len: int = 16

    def _validate(self) -> None:
        check_int(self.name, "min_len", self.min_len, 2)
        check_int(self.name, "max_len", self.max_len, self.min_len)
        if self.seq_len < 2 * self.max_len + 1:
            raise ValueError(
                f"copy: seq_len={self.seq_len} cannot hold BOS, a segment of max_len={self.max_len} and its copy; "
                f"use seq_len >= {2 * self.max_len + 1} or a smaller max_len"
            )
        needed = self.seq_len // 2  # ⌈(seq_len − 1) / 2⌉ content tokens
        if self.vocab_size - 1 < needed:
            raise ValueError(
                f"copy: vocab_size={self.vocab_size} is too small for seq_len={self.seq_len}: most copied "
                "tokens would occur more than once earlier, leaving few answer positions; use "
                f"vocab_size >= {needed + 1} (one content token per two positions) or a shorter seq_len"
            )

    def _generate(self, batch_size: int, generator: torch.Generator) -> Batch:
        tokens = random_content((batch_size, self.seq_len), self.vocab_size, generator)
        tokens[:, 0] = BOS
        src, dst, length = copy_layout(batch_size, self.seq_len, 1, self.min_len, self.max_len, generator)
        tokens = insert_copies(tokens, src, dst, length)
        answer_mask = copy_answer_mask(tokens, dst, length)
        return self._batch(tokens, answer_mask, src_start=src, dst_start=dst, seg_len=length)
