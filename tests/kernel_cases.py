"""Shared inputs and an independent float64 oracle for the depth-attention kernel tests."""

from __future__ import annotations

import math

import torch

# (n_sources, token shape, d_model): non-power-of-two widths, 1..17 sources, token counts that are not a
# multiple of any tile size used in the tests.
SHAPES = [
    (1, (7,), 5),
    (2, (3, 11), 33),
    (3, (100,), 64),
    (5, (2, 37), 48),
    (9, (61,), 130),
    (17, (45,), 17),
]

# loose tolerances for half precision: inputs and outputs are rounded, the arithmetic itself runs in fp32
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}


def make_inputs(
    n_sources: int,
    token_shape: tuple[int, ...],
    d_model: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Sources with differing scales, a query giving logits of order 1-3 (a softmax that is neither flat nor
    one-hot), and a gain away from 1 so a gain folded in the wrong place shows."""
    generator = torch.Generator().manual_seed(seed)
    sources = [
        (torch.randn(*token_shape, d_model, generator=generator) * (0.5 + s % 3)).to(dtype).to(device)
        for s in range(n_sources)
    ]
    query = (2.0 * torch.randn(d_model, generator=generator) / math.sqrt(d_model)).to(device)
    gain = (1.0 + 0.3 * torch.randn(d_model, generator=generator)).to(device)
    return sources, query, gain


def oracle(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    gain: torch.Tensor,
    eps: float = 1e-6,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The depth mix (docs/model.md §2) written out again in float64, independent of the package: ``(h, weights,
    logits)``, with ``logit_bias`` ``[..., S]`` added to the logits before the softmax."""
    values = torch.stack([source.double() for source in sources], dim=-2)  # [..., S, D]
    d_model = values.shape[-1]
    mean_square = (values * values).sum(dim=-1, keepdim=True) / d_model
    keys = values / torch.sqrt(mean_square + eps) * gain.double()
    logits = (keys * query.double()).sum(dim=-1)
    if logit_bias is not None:
        logits = logits + logit_bias.double()
    shifted = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    weights = shifted / shifted.sum(dim=-1, keepdim=True)
    h = (weights[..., None] * values).sum(dim=-2)
    return h, weights, logits


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double().cpu(),
        expected.double().cpu(),
        atol=tolerance["atol"] * scale,
        rtol=tolerance["rtol"] * scale,
    )
