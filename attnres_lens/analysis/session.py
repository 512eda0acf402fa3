"""What analyses of one unchanged model share (docs/analysis.md §11): clean results and the worker threads' model
replicas, kept for the length of an `analysis_session`.

A result or a replica is reused only while the model is the one it was made from: the same modules, parameters,
buffers, hooks and train/eval mode (`fingerprint`). Outside a session nothing is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class Session:
    """What `analysis_session` shares: clean results by (kind, model, token tensor), and idle model replicas by
    model, each with the fingerprint of the model it copied (`fingerprint_of`)."""

    def __init__(self) -> None:
        self.clean: dict[tuple, tuple[tuple, Any]] = {}  # key -> (what keeps the key's ids alive, result)
        self.replicas: dict[int, tuple[tuple, list[nn.Module]]] = {}
        self.lock = threading.Lock()  # replicas are taken and given back by worker threads


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("attnres_lens_analysis_session", default=None)


def current_session() -> Session | None:
    """The session this thread's (or task's) caller opened, or None."""
    return _SESSION.get()


@contextlib.contextmanager
def analysis_session() -> Iterator[None]:
    """Inside, analyses of a model that does not change meanwhile share work: a clean (unhooked) result — the
    evaluation, the residual states, the depth weights — is computed once per model and token tensor and reused,
    and the worker threads' copies of the model (`model_replica`, ~60 ms of Python each for a 12-layer model) are
    kept from one `evaluate_many` call to the next. For callers that derive several tables from one model
    (`prune_tables`: eight clean passes become four, and 12 replicas 2). Nested sessions are one."""
    token = _SESSION.set(_SESSION.get() or Session())
    try:
        yield
    finally:
        _SESSION.reset(token)


def clean_result(
    kind: str, model: nn.Module, inputs: torch.Tensor | tuple[torch.Tensor, ...], compute: Callable[[], Any]
) -> Any:
    """`compute()`, or inside `analysis_session` its first result for this kind, the same input tensors and the
    model as it is now (its modules, parameters, buffers, hooks and train/eval mode: a result under a hook is
    not a clean one). The model and inputs are held, so their ids are not reused meanwhile. A model that is not a
    torch module (a protocol-only wrapper) has no fingerprint: its results are computed each time."""
    session = _SESSION.get()
    if session is None or not isinstance(model, nn.Module):
        return compute()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    key = (kind, id(model), fingerprint_of(model), *map(id, inputs))
    if key not in session.clean:
        held = (model, inputs, [hook for module in model.modules() for hook in hooks_of(module)])
        session.clean[key] = (held, compute())
    return session.clean[key][1]


def fingerprint_of(model: nn.Module) -> tuple:
    """What a replica copies: the module tree, its parameters and buffers, train/eval mode and the hooks attached
    (by id: whoever keeps a fingerprint keeps those objects alive too, so no id is reused meanwhile)."""
    return tuple(
        (
            id(module),
            module.training,
            tuple(map(id, module._parameters.values())),
            tuple(map(id, module._buffers.values())),
            tuple(map(id, hooks_of(module))),
        )
        for module in model.modules()
    )


def hooks_of(module: nn.Module) -> list[Callable]:
    """The hook callables attached to `module` itself (forward, pre-forward, backward, state-dict hooks, …)."""
    return [
        hook
        for name, value in vars(module).items()
        if name.endswith("hooks") and isinstance(value, dict)
        for hook in value.values()
    ]


def take_replica(model: nn.Module, session: Session | None) -> tuple[nn.Module, tuple]:
    """An idle replica of the session's that still matches `model`, else a new one; with the fingerprint of the
    model it copies."""
    if session is None:
        return model_replica(model), ()
    fingerprint = fingerprint_of(model)
    with session.lock:
        kept = session.replicas.get(id(model))
        if kept is not None and kept[0] == fingerprint and kept[1]:
            return kept[1].pop(), fingerprint
    return model_replica(model), fingerprint


def give_back_replica(model: nn.Module, replica: nn.Module, fingerprint: tuple, session: Session | None) -> None:
    """Keep `replica` of `model` (copied when the model's fingerprint was `fingerprint`) for the session's next
    `take_replica`; replicas of an earlier state of the model are dropped. Outside a session, nothing."""
    if session is None:
        return
    with session.lock:
        kept = session.replicas.get(id(model))
        if kept is None or kept[0] != fingerprint:
            session.replicas[id(model)] = kept = (fingerprint, [])
        kept[1].append(replica)


def model_replica(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules that shares its parameters and buffers (in place edits of the weights reach
    both) and the hooks attached to it now (the same callables, so a bound method's object sees the calls):
    hooks attached to the copy later fire only there."""
    shared = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    for module in model.modules():  # _forward_hooks, _forward_pre_hooks, …
        shared.update((id(hook), hook) for hook in hooks_of(module))
    return copy.deepcopy(model, shared)
