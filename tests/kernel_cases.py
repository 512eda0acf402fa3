"""Shared inputs and an independent float64 oracle for the depth-attention kernel tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    gain: torch.Tensor | None,
    eps: float = 1e-6,
    logit_bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    normalize_values: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The depth mix (docs/model.md §2) written out again in float64, independent of the package: ``(h, weights,
    logits)``, with ``logit_bias`` ``[..., S]`` (or ``[..., R, S]``) added to the scaled logits before the
    softmax. ``gain`` None is an unweighted key norm; a query ``[R, D]`` gives ``h`` ``[..., R, D]`` and weights
    ``[..., R, S]``; ``normalize_values`` mixes the sources RMS-normalised without a gain."""
    values = torch.stack([source.double() for source in sources], dim=-2)  # [..., S, D]
    d_model = values.shape[-1]
    mean_square = (values * values).sum(dim=-1, keepdim=True) / d_model
    normalized = values / torch.sqrt(mean_square + eps)
    keys = normalized if gain is None else normalized * gain.double()
    queries = query.double().reshape(-1, d_model)  # [R, D]
    logits = torch.einsum("...sd,rd->...rs", keys, queries) * logit_scale  # [..., R, S]
    if logit_bias is not None:
        logits = logits + (
            logit_bias.double() if logit_bias.dim() == logits.dim() else logit_bias.double()[..., None, :]
        )
    shifted = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    weights = shifted / shifted.sum(dim=-1, keepdim=True)
    mixed = normalized if normalize_values else values
    h = torch.einsum("...rs,...sd->...rd", weights, mixed)
    if query.dim() == 1:  # one query: no route axis
        return h.squeeze(-2), weights.squeeze(-2), logits.squeeze(-2)
    return h, weights, logits


@dataclass(frozen=True)
class Knobs:
    """One combination of the op's knobs (docs/kernels.md §1): ``routes`` queries (None: one ``[D]`` query), a
    key-norm gain or none, the logit scale (1, or ``D**-0.5`` as Inkling-2 when ``inkling_scale``), raw or
    normalised values."""

    routes: int | None = None
    gained: bool = True
    inkling_scale: bool = False
    normalize_values: bool = False

    def __str__(self) -> str:
        parts = [f"R{self.routes}" if self.routes else "R-", "g" if self.gained else "nog"]
        parts += ["isqrtD" if self.inkling_scale else "s1", "vnorm" if self.normalize_values else "vraw"]
        return "-".join(parts)

    def scale(self, d_model: int) -> float:
        return d_model**-0.5 if self.inkling_scale else 1.0

    def kwargs(self, d_model: int) -> dict:
        return dict(logit_scale=self.scale(d_model), normalize_values=self.normalize_values)


# every combination: the paper/FLA defaults first, Inkling-2's set (several routes, no gain, 1/sqrt(D), normalised
# values) last
KNOB_CASES = [
    Knobs(routes, gained, inkling_scale, normalize_values)
    for routes in (None, 3)
    for gained in (True, False)
    for inkling_scale in (False, True)
    for normalize_values in (False, True)
]
INKLING = Knobs(routes=3, gained=False, inkling_scale=True, normalize_values=True)

# smaller than SHAPES: every knob combination runs each of them
KNOB_SHAPES = [(1, (5,), 7), (4, (2, 9), 33), (9, (23,), 20)]


def make_knob_inputs(
    knobs: Knobs,
    n_sources: int,
    token_shape: tuple[int, ...],
    d_model: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """`make_inputs` for ``knobs``: ``routes`` distinct queries, no gain where the norm is unweighted, and the
    queries scaled up by ``1/logit_scale`` so the scaled logits stay of order 1-3."""
    sources, query, gain = make_inputs(n_sources, token_shape, d_model, dtype, seed, device)
    if knobs.routes is not None:
        generator = torch.Generator().manual_seed(seed + 1)
        query = (2.0 * torch.randn(knobs.routes, d_model, generator=generator) / math.sqrt(d_model)).to(device)
    return sources, query / knobs.scale(d_model), gain if knobs.gained else None


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double().cpu(),
        expected.double().cpu(),
        atol=tolerance["atol"] * scale,
        rtol=tolerance["rtol"] * scale,
    )
