"""DenseFormer (Pagliardini et al., arXiv 2402.02622): a depth-weighted average after every block (docs/model.md §12).

With `X_0 = Y_0 = e`, block k maps its input `Y_{k−1}` through a standard residual inside the block,
`X_k = Y_{k−1} + f_attn,k + f_mlp,k`, and its depth-weighted average (DWA) `Y_k = Σ_{i=0}^{k} a_{k,i} X_i` becomes the
next block's input; the final norm reads `Y_L`. The weights are learned scalars, independent of the input,
initialised `a_{k,k} = 1` and the others 0, so at step 0 the model is exactly the standard residual.
"""

from __future__ import annotations

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens.streams import ResidualStream


class DepthWeightedAverage(nn.Module):
    """The DWA after block `layer` (0-based): weights `a` over `[X_0 = e, X_1, …, X_{layer+1}]`."""

    def __init__(self, layer: int):
        super().__init__()
        weights = torch.zeros(layer + 2)
        weights[-1] = 1.0  # a_{k,k} = 1: the block's own output, as in the standard residual
        self.weights = nn.Parameter(weights)
        self.hook_dwa_weights = HookPoint()  # [layer + 2] the weights a_{k,i} (the same for every token)

    def forward(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        weights = self.hook_dwa_weights(self.weights.clone())  # a cache holds a snapshot; an edit lasts one pass
        return sum(weights[i].to(x.dtype) * x for i, x in enumerate(outputs))


class DenseStream(ResidualStream):
    """Inside a block, a running sum from the block's input; after it, the DWA over every block output so far."""

    def __init__(self, embedding: torch.Tensor):
        self.outputs = [embedding]  # X_0 = e, then X_1, X_2, …
        self.state = embedding  # within a block: Y_{k−1} plus the block's outputs so far; after it: Y_k

    def read(self, mixer: nn.Module | None = None) -> torch.Tensor:
        return self.state

    def write(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.state = input + output

    def end_layer(self, dwa: DepthWeightedAverage) -> None:
        self.outputs.append(self.state)  # X_k
        self.state = dwa(self.outputs)  # Y_k

    def readout(self, mixer: nn.Module | None = None) -> torch.Tensor:
        return self.state
