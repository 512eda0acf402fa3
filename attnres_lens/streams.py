"""The residual state between sublayers, one interface for every residual kind (docs/architecture.md §3).

A forward pass drives a stream with three calls, in sublayer order:

* `read(mixer)`: the input `h_j` of the next sublayer (`mixer` is its depth attention, None for the standard sum),
  which the block asks for as `read_normed(mixer, hook_in, norm)`: `(hook_in(h_j), norm(...))`;
* `write(output, input)`: record the sublayer's output `f_j` (with the input it was given, possibly hook-edited,
  or None where the stream's `read_normed` left it out);
* `readout(mixer)`: the input of the final norm once every sublayer has written, which the model asks for as
  `readout_normed(mixer, norm)`: the final norm's output.

`end_layer(mixer)` closes a layer (DenseFormer averages over depth there). `state` is the post-layer state that
`blocks.{l}.hook_resid_post` (standard), `hook_block_partial` (AttnRes), `hook_dwa_out` (DenseFormer) or `hook_streams`
(mHC) shows and may replace. The other streams are `attnres.DepthStream`, `denseformer.DenseStream` and
`mhc.MHCStream`.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualStream:
    """Interface of a residual stream; subclasses keep their own tensors."""

    state: torch.Tensor

    def read(self, mixer: nn.Module | None) -> torch.Tensor:
        raise NotImplementedError

    def read_normed(
        self, mixer: nn.Module | None, hook_in: nn.Module, norm: nn.Module
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The next sublayer's input through its hook point and its pre-norm, `(x, norm(x))` (a stream may compute
        both in one kernel where nothing watches x, and leave x None where its `write` does not read it)."""
        x = hook_in(self.read(mixer))
        return x, norm(x)

    def write(self, output: torch.Tensor, input: torch.Tensor) -> None:
        raise NotImplementedError

    def readout(self, mixer: nn.Module | None) -> torch.Tensor:
        raise NotImplementedError

    def readout_normed(self, mixer: nn.Module | None, norm: nn.Module) -> torch.Tensor:
        """`norm(readout(mixer))`, the final norm's output (a stream may compute the readout and its norm in one
        kernel where nothing watches either)."""
        return norm(self.readout(mixer))

    def end_layer(self, mixer: nn.Module | None) -> None:
        """After a layer's sublayers (DenseFormer's depth-weighted average happens here); nothing by default."""

    def batch_changed(self) -> None:
        """After this copy's tensors were sliced or stacked along the batch (interventions do): drop whatever was
        derived from the old batch; nothing by default."""

    def stacked_from(self, states: list[ResidualStream]) -> None:
        """After `batch_changed`, when this stream is `states` stacked along the batch: what a stream may learn
        from the copies' shared tensors (Full AttnRes mixes its shared sources once); nothing by default."""


class SumStream(ResidualStream):
    """The standard PreNorm residual: sublayer j reads `e + Σ_{i<j} f_i`, and so does the final norm.

    A hook that edits a sublayer's input edits the residual itself (`write` continues from that input).
    """

    def __init__(self, embedding: torch.Tensor):
        self.state = embedding

    def read(self, mixer: nn.Module | None = None) -> torch.Tensor:
        return self.state

    def write(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.state = input + output

    def readout(self, mixer: nn.Module | None = None) -> torch.Tensor:
        return self.state
