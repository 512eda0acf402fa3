"""What the machine can give a model: memory, checked before anything large is allocated (docs/run_directory.md §12).

A config or a file can ask for any size; a model or batch that cannot fit must be an error naming what asked for
it, not a process the kernel kills without a word, or one that pages for hours.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnres_lens.config import ModelConfig
    from attnres_lens.model import HookedTransformer
    from attnres_lens.protocol import DepthMixingModel


def available_memory(device: torch.device) -> int | None:
    """Bytes this process can still allocate on `device`, or None where it cannot tell: on a GPU what torch reports
    free; on Linux the kernel's MemAvailable, or less when a cgroup limit is nearer."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = (
            int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:"))) * 1024
        )
    except (OSError, StopIteration, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def check_model_fits(cfg: ModelConfig) -> None:
    """Before a model is built: refuse a config whose parameters and buffers cannot fit in the memory left, naming
    the fields that ask for most of it. The bound is a floor (`ModelConfig.allocation_floor`), so it never refuses
    a model that would fit. A model is built in float32 on the CPU, then cast and moved (`HookedTransformer`), so
    the CPU must hold it in float32 (or wider) and the target device in the model's dtype."""
    device = torch.device(cfg.device or "cpu")
    if device.type == "meta":
        return
    model_size = torch.empty((), dtype=cfg.dtype).element_size()
    _check_fits(cfg.allocation_floor(max(4, model_size)), torch.device("cpu"), "to build it")
    if device.type != "cpu":
        _check_fits(cfg.allocation_floor(model_size), device, "for its weights and tables")


def _check_fits(parts: dict[str, int], device: torch.device, purpose: str) -> None:
    needed, available = sum(parts.values()), available_memory(device)
    if available is None or needed <= available:
        return
    largest = sorted(parts.items(), key=lambda item: -item[1])[:2]
    raise ValueError(
        f"this model needs at least {needed / 2**30:.3g} GiB on {device} {purpose} "
        f"(mostly {' and '.join(f'{what}: {size / 2**30:.3g} GiB' for what, size in largest)}), but "
        f"{available / 2**30:.3g} GiB are available there; check those fields"
    )


def check_samples_fit(model: HookedTransformer | DepthMixingModel, n_sequences: int, n_positions: int) -> None:
    """Before an analysis does any work, its batch included: a `samples` whose one forward pass cannot fit gets an error, not a
    process killed without a word. The bound is a floor, so it never refuses what would fit: the residual stream's
    tensors at the final readout (every source it reads for AttnRes, else one) and the logits; for another
    depth-mixing model (the protocol names no width) its float32 logits alone."""
    from attnres_lens.model import HookedTransformer
    from attnres_lens.protocol import model_device

    available = available_memory(model_device(model))
    if available is None:
        return
    if isinstance(model, HookedTransformer):
        cfg = model.cfg
        n_tensors = len(model.sources(cfg.n_sublayers)) if cfg.residual == "attnres" else 1
        per_sequence = n_positions * (n_tensors * cfg.d_model + cfg.d_vocab) * model.embed.W_E.element_size()
    else:
        per_sequence = n_positions * model.d_vocab * 4
    if n_sequences * per_sequence > available:
        raise ValueError(
            f"samples={n_sequences} needs at least {n_sequences * per_sequence / 2**30:.1f} GiB for one forward pass "
            f"of this model (its residual stream and logits), but {available / 2**30:.1f} GiB are available; use "
            f"far fewer: samples={max(1, available // per_sequence)} is the most that could fit even that one pass, "
            "and the analyses hold several"
        )
