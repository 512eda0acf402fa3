"""Hook checks asked on every forward, several times per sublayer: whether a hook point, a module or PyTorch's
global module hooks would see a call, and a parameter read, each without nn.Module's slow attribute fallback or
TransformerLens's per-call closures (docs/kernels.md §11). The fast paths take these answers to decide whether
they may skip a readable step."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module  # its global hooks (register_module_*_hook)
from transformer_lens.hook_points import HookPoint


def is_hooked(point: HookPoint) -> bool:
    """`point.has_hooks()` with its defaults (any forward or backward hook, permanent ones included), without
    the closures that builds per call: asked several times per sublayer on every forward (docs/kernels.md §11)."""
    return bool(point.fwd_hooks or point.bwd_hooks)


def any_hooked(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether any of `module`'s hook points `names` `is_hooked`, read from its submodules directly: nn.Module's
    attribute fallback is slow for a question each sublayer asks several times per forward (docs/kernels.md §11)."""
    points = module._modules
    for name in names:  # a loop, not any(generator): asked for every consumer of every step
        point = points[name]
        if point.fwd_hooks or point.bwd_hooks:  # is_hooked, inlined
            return True
    return False


def parameter(module: nn.Module, name: str) -> torch.Tensor:
    """`getattr(module, name)` for a parameter, read from `module._parameters` where it is a plain one: nn.Module's
    attribute fallback is slow, and each depth-mix consumer reads three per forward (docs/kernels.md §11). A
    parametrized parameter (`torch.nn.utils.parametrize`) is not there, and is computed as usual."""
    value = module._parameters.get(name)
    return value if value is not None else getattr(module, name)


def module_hooked(module: nn.Module) -> bool:
    """Whether a PyTorch hook would see a call of `module`: one of its own (TransformerLens's hooks on a hook point
    are such hooks) or a global module hook. A fused path that skips the call must not run then."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )
