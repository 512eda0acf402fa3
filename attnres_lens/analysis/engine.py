"""Running a model under interventions: `capture`, `evaluate`, and `evaluate_many`, which evaluates many
interventions sharing every computation they share (docs/analysis.md §11).

The engine cuts the forward pass into stages (`StagedForward`: the embedding, each sublayer, the final readout)
and walks the tree of interventions: those whose hooks agree up to a stage share it; where they part, each branch
gets its own copy of the state, and branches that never part again run stacked along the batch; a depth-mixing
model other than the toolkit's (docs/architecture.md §7) runs whole hooked forward passes, the interventions
stacked along the batch. What an
intervention is (its hooks, the removal rule) lives in `interventions`; the worker threads in `workers`; what a
session shares in `session`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformer_lens.hook_points import HookPoint

from attnres_lens.analysis.interventions import Hook
from attnres_lens.analysis.session import clean_result
from attnres_lens.analysis.workers import WorkerPool, parallel_problem
from attnres_lens.attnres import DepthStream
from attnres_lens.evaluation import Evaluation, score_logits
from attnres_lens.hook_checks import module_hooked
from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import DepthMixingModel
from attnres_lens.streams import ResidualStream, SumStream
from attnres_lens.tasks.base import Batch, check_batch


@torch.no_grad()
def capture(
    model: DepthMixingModel, tokens: torch.Tensor, names: Iterable[str], fwd_hooks: Sequence[Hook] = ()
) -> dict[str, torch.Tensor]:
    """Activations at the hook points `names` for one forward pass (with optional interventions)."""
    saved: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, hook) -> None:
        saved[hook.name] = tensor

    hooks = list(fwd_hooks) + [(name, save) for name in set(names)]
    # the toolkit model can skip its unembedding; the protocol's forward takes tokens alone
    skip_logits = dict(return_type=None) if isinstance(model, HookedTransformer) else {}
    model.run_with_hooks(tokens, fwd_hooks=hooks, **skip_logits)
    return saved


def evaluate(model: DepthMixingModel, batch: Batch, fwd_hooks: Sequence[Hook] = ()) -> Evaluation:
    """The batch's loss, answer loss and accuracy with the hooks `fwd_hooks` applied."""
    check_batch(batch)
    if not fwd_hooks:
        return clean_result(
            "evaluate",
            model,
            (batch.tokens, batch.targets, batch.answer_mask),
            lambda: evaluate_many(model, batch, [()])[0],
        )
    return evaluate_many(model, batch, [fwd_hooks])[0]


# Stacks hold up to this many elements per activation (d_model x tokens; 4 MB in fp32) unless `max_sequences` says:
# the tables of a prune of the 12-layer d_model-64 Full model (32 sequences of 65 tokens, 2 workers) took less time
# in stacks of 128-512 sequences than in stacks of 64 (docs/analysis.md §11); a budget in elements keeps the stacks
# of wide or long models from growing with them.
STACK_ELEMENTS = 1 << 20


@torch.no_grad()
def evaluate_many(
    model: DepthMixingModel,
    batch: Batch,
    interventions: Sequence[Sequence[Hook]],
    max_sequences: int | None = None,
    progress: bool = False,
    desc: str = "interventions",
    cache: StateCache | None = None,
    score: Callable[[torch.Tensor, Batch], Any] = score_logits,
    workers: int = 1,
    remember: Iterable[int] | None = None,
) -> list[Any]:
    """`evaluate` for each intervention (a list of hooks), sharing every computation the interventions share.

    The forward pass runs in stages (embedding, each sublayer, the final readout; `hook_stages`). Interventions
    whose hooks agree up to a stage (the same hook functions at the same hook points, compared by identity) share
    one computation of it; where they part, each branch gets its own copy of the state, and branches that do not
    part again run stacked along the batch, up to `max_sequences` sequences per pass (default: as many copies of
    the batch as keep one activation of the stack within `STACK_ELEMENTS`), each intervention's hooks seeing only
    its own copy. So knocking a source out of consumer c recomputes only sublayers c … J, and
    removal sets that agree on the first sublayers share them; with a `StateCache`, a call also resumes from the
    states of the previous call (`remember`: the indices of the interventions whose states it keeps, default all;
    a kept state holds copies of its own rows, not views that would pin the stacks it was computed in). Results
    equal one full pass per intervention up to float rounding of the
    larger batches. `score(logits, batch)` turns each intervention's logits into its result (default: the
    evaluation metric).

    `workers` > 1 runs the stacked branches on that many threads, which share torch's threads, every thread on its
    own copy of the model's modules (sharing the parameters), so one thread's hooks never fire in another; the
    results are the same numbers as with one worker. Hooks then run on worker threads, in no fixed order, so
    they must not depend on each other's side effects (`analysis_workers` gives the analyses' default).

    The stages are the toolkit's `HookedTransformer`'s; any other depth-mixing model (docs/architecture.md §7) runs
    whole hooked forward passes with the interventions stacked along the batch, up to `max_sequences` sequences a
    pass (default: as many copies of the batch as keep its logits within `STACK_ELEMENTS`), each intervention's
    hooks seeing only its own copy (`cache`, `workers` and `remember` then change nothing), the same numbers up
    to float rounding of the larger batches."""
    check_batch(batch)
    if not interventions:
        return []
    checked = {"workers": workers} | ({} if max_sequences is None else {"max_sequences": max_sequences})
    for name, value in checked.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(model, HookedTransformer):
        return _plain_evaluations(model, batch, interventions, score, progress, desc, max_sequences)
    if max_sequences is None:
        max_sequences = _default_stack(model, batch)
    if workers > 1 and (problem := parallel_problem(model)) is not None:
        raise ValueError(
            f"workers={workers} needs worker threads, but {problem}; use workers=1 (analysis_workers(model) chooses)"
        )
    with tqdm(total=len(interventions), desc=desc, disable=not progress, leave=False) as bar:
        return _SharedEvaluation(model, batch, interventions, max_sequences, bar, cache, score, workers, remember).run()


def _plain_evaluations(
    model: DepthMixingModel,
    batch: Batch,
    interventions: Sequence[Sequence[Hook]],
    score: Callable[[torch.Tensor, Batch], Any],
    progress: bool,
    desc: str,
    max_sequences: int | None,
) -> list[Any]:
    """`evaluate_many` for a model the staged engine does not know (docs/architecture.md §7): whole hooked forward
    passes through `run_with_hooks` alone, the interventions stacked along the batch (the protocol's forward keeps
    a batch's rows independent), each intervention's hooks on its own copy; the same numbers as one pass per
    intervention up to float rounding of the larger batches."""
    tokens = model.to_tokens(batch.tokens)
    for hooks in interventions:
        for name, _ in hooks:
            if not isinstance(name, str) or name not in model.hook_dict:
                raise ValueError(f"no hook point named {name!r} in this model (hook names must be strings)")
    n_batch = tokens.shape[0]
    if max_sequences is None:  # the logits are the widest per-token tensor of a language model's forward
        max_sequences = n_batch * max(1, STACK_ELEMENTS // (tokens.numel() * model.d_vocab))
    per_pass = max(1, max_sequences // n_batch)
    results: list[Any] = []
    with tqdm(total=len(interventions), desc=desc, disable=not progress, leave=False) as bar:
        for first in range(0, len(interventions), per_pass):
            stack = interventions[first : first + per_pass]
            if len(stack) == 1:
                logits = model.run_with_hooks(tokens, fwd_hooks=list(stack[0]))
            else:
                fwd_hooks = _stacked_hooks(stack, n_batch, check_rows=True)
                logits = model.run_with_hooks(tokens.repeat(len(stack), 1), fwd_hooks=fwd_hooks)
            results.extend(score(copy_logits, batch) for copy_logits in logits.split(n_batch))
            bar.update(len(stack))
    return results


def _default_stack(model: HookedTransformer, batch: Batch) -> int:
    """Sequences a stack holds by default: whole copies of the batch within `STACK_ELEMENTS` per activation (a
    hyper-connection stream's state holds its n streams of d_model per token), at least one."""
    cfg = model.cfg
    width = cfg.d_model * (cfg.mhc_streams if cfg.residual == "mhc" else 1)
    return batch.tokens.shape[0] * max(1, STACK_ELEMENTS // (batch.tokens.numel() * width))


EMBEDDING_STAGE = -1


def hook_stages(model: HookedTransformer) -> dict[str, int]:
    """The stage of the forward pass in which each hook point fires: −1 the embedding, j sublayer j (its input
    mix, input, pre-norm, the sublayer and its output; for a layer's last sublayer also whatever closes the layer,
    such as the post-layer state), J the final readout (its mix and the final norm). Read off the module tree."""
    forward = StagedForward(model)
    stages: dict[str, int] = {}
    for j in range(forward.n_sublayers):
        layer, block = forward.block_of(j)
        mixer, hook_in, norm, sublayer, hook_out = forward.sublayer_parts(j)
        for module in (mixer, hook_in, norm, sublayer, hook_out):
            if module is not None:
                for point in _hook_points(module):
                    stages[point.name] = j
        if forward.closes_layer(j):  # the rest of the block fires after its last sublayer
            for point in _hook_points(block):
                stages.setdefault(point.name, j)
    for name in model.hook_dict:
        stages.setdefault(name, EMBEDDING_STAGE if name in ("hook_embed", "hook_pos_embed") else forward.n_sublayers)
    return stages


def _hook_points(module: nn.Module) -> list[HookPoint]:
    return [child for child in module.modules() if isinstance(child, HookPoint)]


class StagedForward:
    """The model's forward pass cut at sublayer boundaries: `embed(tokens)` gives the residual stream before
    sublayer 0, `sublayer(stream, j)` runs sublayer j (and closes the layer after its last one), and
    `final(stream)` the readout, final norm and unembedding. Each step calls the model's own pieces (its stream,
    `TransformerBlock._sublayer`, the layer's post-layer hook); tests check that the stages compose to
    `model(tokens)` exactly."""

    def __init__(self, model: HookedTransformer):
        self.model = model
        self.cfg = model.cfg
        self.n_sublayers = model.cfg.n_sublayers

    def block_of(self, j: int) -> tuple[int, nn.Module]:
        layer = j if self.cfg.attn_only else j // 2
        return layer, self.model.blocks[layer]

    def closes_layer(self, j: int) -> bool:
        return self.cfg.attn_only or j % 2 == 1

    def sublayer_parts(self, j: int) -> tuple:
        """(input mixer, input hook, pre-norm, sublayer, output hook) of sublayer j."""
        _, block = self.block_of(j)
        if hasattr(block, "mixers"):
            attn_mixer, mlp_mixer = block.mixers()
        else:
            attn_mixer, mlp_mixer = getattr(block, "attn_res", None), getattr(block, "mlp_res", None)
        if self.model.sublayer_kind(j) == "attn":
            return attn_mixer, block.hook_resid_pre, block.ln1, block.attn, block.hook_attn_out
        return mlp_mixer, block.hook_resid_mid, block.ln2, block.mlp, block.hook_mlp_out

    def embed(self, tokens: torch.Tensor) -> ResidualStream:
        model = self.model
        embedding = model.hook_embed(model.embed(tokens))
        if self.cfg.positional_embedding_type == "standard":
            embedding = embedding + model.hook_pos_embed(model.pos_embed(tokens))
        if hasattr(model, "_stream"):
            return model._stream(embedding)
        if self.cfg.residual == "standard":
            return SumStream(embedding)
        return DepthStream(embedding, self.cfg.attnres_block_size)

    def sublayer(self, stream: ResidualStream, j: int, skipped: Sequence[int] = (), n_copies: int = 1) -> None:
        """Run sublayer j; the copies `skipped` (of `n_copies` stacked along the batch) do not compute the sublayer
        itself: their output is zeros, for a hook that replaces it whatever it was (`replaces_activation`)."""
        layer, block = self.block_of(j)
        mixer, hook_in, norm, sublayer, hook_out = self.sublayer_parts(j)
        if skipped:
            sublayer = _on_kept_copies(sublayer, skipped, n_copies)
        type(block)._sublayer(stream, mixer, hook_in, norm, sublayer, hook_out)
        if self.closes_layer(j):
            if hasattr(stream, "end_layer"):
                stream.end_layer(getattr(block, "dwa", None))
            if hasattr(self.model, "post_layer_hook"):
                post = self.model.hook_dict[self.model.post_layer_hook(layer)]
            else:
                post = block.hook_block_partial if self.cfg.residual == "attnres" else block.hook_resid_post
            stream.state = post(stream.state)

    def final(self, stream: ResidualStream) -> torch.Tensor:
        return self.model.read_out(stream)

    def run(
        self, state: torch.Tensor | ResidualStream, stage: int, skipped: Sequence[int] = (), n_copies: int = 1
    ) -> ResidualStream | torch.Tensor:
        """Run one stage on `state` (tokens before stage −1, else a stream, which is copied, not changed): the
        stream before stage + 1, or the logits after stage J. `skipped`: as `sublayer`."""
        if stage == EMBEDDING_STAGE:
            return self.embed(state)
        stream = map_state(state, lambda tensor: tensor)
        if stage == self.n_sublayers:
            return self.final(stream)
        self.sublayer(stream, stage, skipped, n_copies)
        return stream


def _on_kept_copies(
    sublayer: Callable[[torch.Tensor], torch.Tensor], skipped: Sequence[int], n_copies: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`sublayer` computed on the rows of the copies not `skipped` only (batch rows are independent), zeros in
    the others' rows (a sublayer's output has its input's shape)."""

    def run(normed: torch.Tensor) -> torch.Tensor:
        kept = [slot for slot in range(n_copies) if slot not in skipped]
        if not kept:
            return torch.zeros_like(normed)
        copies = list(normed.chunk(n_copies))
        results = iter(
            sublayer(torch.cat([copies[slot] for slot in kept]) if len(kept) > 1 else copies[kept[0]]).chunk(len(kept))
        )
        return torch.cat(
            [next(results) if slot in kept else torch.zeros_like(copies[slot]) for slot in range(n_copies)]
        )

    return run


@contextlib.contextmanager
def hooks_on(model: HookedTransformer, fwd_hooks: Sequence[Hook]) -> Iterator[None]:
    """`model.hooks(fwd_hooks)` for a handful of hook points: TL's context resets every hook point of the model
    on exit, which costs more than a stage of a small model; this removes only the hooks it added (by level)."""
    model.context_level += 1
    level = model.context_level
    touched = []
    try:
        for name, function in fwd_hooks:
            point = model.hook_dict[name]
            point.add_hook(function, dir="fwd", level=level)
            touched.append(point)
        yield
    finally:
        for point in touched:
            point.remove_hooks("fwd", level=level)
        model.context_level -= 1


def map_state(
    state: torch.Tensor | ResidualStream, function: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | ResidualStream:
    """A copy of tokens or of a residual stream with `function` applied to every tensor it holds (the stream's
    lists are copied too, so running the copy leaves the original as it was)."""
    if isinstance(state, torch.Tensor):
        return function(state)
    copy_ = copy.copy(state)
    for key, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(copy_, key, function(value))
        elif isinstance(value, list):
            setattr(copy_, key, [function(item) if isinstance(item, torch.Tensor) else item for item in value])
    return copy_


class StateCache:
    """The states an `evaluate_many` call passed through, for the next call on the same model and batch to resume
    from wherever its interventions agree with the last call's (a cumulative removal curve: each set is the
    previous one plus one sublayer). Keeps the latest call's states only; keeps their hook functions alive, so
    the identities the states are keyed by cannot be reused."""

    def __init__(self) -> None:
        self.owner: tuple[int, torch.Tensor] | None = None
        self.states: dict[tuple, Any] = {}
        self.functions: list[Callable] = []

    def check(self, model: HookedTransformer, batch: Batch) -> None:
        if self.owner is not None and (self.owner[0] != id(model) or self.owner[1] is not batch.tokens):
            raise ValueError("a StateCache serves one model and one batch; use a new one for another")
        self.owner = (id(model), batch.tokens)


class _SharedEvaluation:
    """`evaluate_many`'s traversal of the tree of interventions (see its docstring)."""

    def __init__(
        self,
        model: HookedTransformer,
        batch: Batch,
        interventions: Sequence[Sequence[Hook]],
        max_sequences: int,
        bar: tqdm,
        cache: StateCache | None = None,
        score: Callable[[torch.Tensor, Batch], Any] = score_logits,
        workers: int = 1,
        remember: Iterable[int] | None = None,
    ):
        self.model = model
        self.score = score
        self.batch = batch
        self.forward = StagedForward(model)
        self.workers = workers
        self.pool: WorkerPool[StagedForward] | None = None
        self.lock = threading.Lock()  # results, progress and remembered states are written from worker threads
        self.n_batch = batch.tokens.shape[0]
        self.max_copies = max(1, max_sequences // self.n_batch)
        self.bar = bar
        self.last = model.cfg.n_sublayers
        stages = hook_stages(model)
        self.plans: list[list[tuple[Hook, ...]]] = []  # per intervention, per stage (index stage + 1): its hooks
        for hooks in interventions:
            plan: list[list[Hook]] = [[] for _ in range(self.last + 2)]  # embedding, sublayers, final readout
            for name, function in hooks:
                if not isinstance(name, str) or name not in stages:
                    raise ValueError(f"no hook point named {name!r} in this model (hook names must be strings)")
                plan[stages[name] + 1].append((name, function))
            # hooks on different points fire in forward order whatever the list order: sort for a canonical form
            self.plans.append([tuple(sorted(hooks_at, key=lambda hook: hook[0])) for hooks_at in plan])
        self.keys = [
            [tuple((name, id(function)) for name, function in hooks_at) for hooks_at in plan] for plan in self.plans
        ]
        self.results: list[Any] = [None] * len(interventions)
        self.cache = cache
        self.seen: dict[tuple, Any] = {}  # this call's states, by the keys of every stage up to theirs
        self.path_points = {
            f"{name}.{hook}" for name, module in model.named_modules() for hook in getattr(module, "path_hooks", ())
        }
        # per sublayer: its output's hook point, and the hook points inside the sublayer (see `_skipped`); None
        # where the sublayer always runs: a hook already on the model watches it, its output or a module call
        self.outputs: list[str | None] = []
        self.inside: list[set[str]] = []
        for j in range(self.last):
            _, _, _, sublayer, hook_out = self.forward.sublayer_parts(j)
            watched = any(module_hooked(module) for module in (*sublayer.modules(), hook_out))
            self.outputs.append(None if watched else model.sublayer_output_hook(j))
            self.inside.append({point.name for point in _hook_points(sublayer)})
        self.kept = set(range(len(interventions))) if remember is None else set(remember)  # states the cache keeps
        if cache is not None:
            cache.check(model, batch)

    def run(self) -> list[Any]:
        tokens = self.model.to_tokens(self.batch.tokens)
        if self.workers > 1 and len(self.plans) > 1:  # one intervention is one chain of stages: nothing to share
            self.pool = WorkerPool(self.model, min(self.workers, len(self.plans)), StagedForward)
        try:
            self._spawn(list(range(len(self.plans))), tokens, EMBEDDING_STAGE)
        except BaseException:
            if self.pool is not None:
                self.pool.close(cancel=True)
            raise
        if self.pool is not None:
            self.pool.close()
        if self.cache is not None:
            self.cache.states = self.seen
            self.cache.functions = [function for plan in self.plans for hooks in plan for _, function in hooks]
        return self.results  # type: ignore[return-value]

    def _prefix(self, member: int, stage: int) -> tuple:
        return tuple(self.keys[member][: stage + 2])

    def _cached(self, member: int, stage: int) -> Any:
        if self.cache is None:
            return None
        return self.cache.states.get(self._prefix(member, stage))

    def _keeps(self, members: list[int]) -> bool:
        return self.cache is not None and not self.kept.isdisjoint(members)

    def _remember(self, members: list[int], stage: int, state: Any) -> None:
        """Keep `state` (the input of stage + 1) for the next call, if the cache keeps any of `members`."""
        if self._keeps(members):
            with self.lock:
                self.seen[self._prefix(members[0], stage)] = state

    def _dispatch(self, job: Callable[[StagedForward], None]) -> None:
        """Run `job` here on the model, or queue it for a worker and its replica."""
        if self.pool is None:
            job(self.forward)
        else:
            self.pool.submit(job)

    def _descend(self, forward: StagedForward, members: list[int], state: Any, stage: int) -> None:
        """`members` share every computation before `stage`, whose input is `state` (one copy of the batch).
        Branches that part again descend on their own, and leaves run stacked (on the workers, if any, in
        parallel)."""
        while True:
            children: dict[tuple, list[int]] = defaultdict(list)
            for member in members:
                children[self.keys[member][stage + 1]].append(member)
            if len(children) == 1:
                cached = self._cached(members[0], stage)
                state = (
                    cached
                    if cached is not None
                    else self._step(forward, state, stage, [self.plans[members[0]][stage + 1]])
                )
                self._remember(members, stage, state)
                if stage == self.last:
                    self._finish([members], state)
                    return
                stage += 1
                continue
            groups = list(children.values())
            # a branch whose members agree from here on never parts again: those run stacked to the end
            leaves = [group for group in groups if len({tuple(self.keys[m][stage + 1 :]) for m in group}) == 1]
            self._run_leaves(leaves, state, stage)
            for group in groups:
                if not any(group is leaf for leaf in leaves):
                    self._spawn(group, state, stage)
            return

    def _spawn(self, members: list[int], state: Any, stage: int) -> None:
        self._dispatch(lambda forward: self._descend(forward, members, state, stage))

    def _run_leaves(self, leaves: list[list[int]], state: Any, stage: int) -> None:
        """Run each leaf from `stage`, or from after the deepest stage an earlier call cached: leaves that start at
        the same stage stacked, up to `max_copies` copies a pass, here or on the workers. (Stacking leaves of
        different branches or start stages too, each joining the stack at its own stage, measured slower: every
        join copies the stack.) A hook on a point that changes a module's path (a module's `path_hooks`: a depth
        attention's logits or weights, an attention's scores or pattern, a sublayer's input or its norm, which keep
        the norm out of the depth mix's kernel) sends the whole stack down that path, so leaves are grouped by those
        points too."""
        similar: dict[tuple, list[tuple[list[int], Any]]] = defaultdict(list)
        for leaf in leaves:
            start, start_state = stage, state
            while start <= self.last and (cached := self._cached(leaf[0], start)) is not None:
                self._remember(leaf, start, cached)
                start, start_state = start + 1, cached
            if start > self.last:
                self._finish([leaf], start_state)
                continue
            points = {name for hooks in self.plans[leaf[0]][start + 1 :] for name, _ in hooks} & self.path_points
            similar[(start, tuple(sorted(points)))].append((leaf, start_state))
        for (start, _), items in similar.items():
            for first in range(0, len(items), self.max_copies):
                chunk = items[first : first + self.max_copies]
                self._dispatch(lambda forward, chunk=chunk, start=start: self._run_stacked(forward, chunk, start))

    def _run_stacked(self, forward: StagedForward, items: list[tuple[list[int], Any]], stage: int) -> None:
        """Run leaves from `stage` (each its own input state, one copy of the batch) to the logits, stacked."""
        groups = [leaf for leaf, _ in items]
        state = items[0][1] if len(items) == 1 else concat_states([leaf_state for _, leaf_state in items])
        kept = [(slot, group, {}) for slot, group in enumerate(groups) if self._keeps(group)]
        for current in range(stage, self.last + 1):
            state = self._step(forward, state, current, [self.plans[group[0]][current + 1] for group in groups])
            for slot, group, copies in kept:
                self._remember(
                    group,
                    current,
                    state if len(groups) == 1 else slice_state(state, slot * self.n_batch, self.n_batch, copies),
                )
        self._finish(groups, state)

    def _step(self, forward: StagedForward, state: Any, stage: int, hooks_per_copy: list[tuple[Hook, ...]]) -> Any:
        if len(hooks_per_copy) == 1:
            fwd_hooks = list(hooks_per_copy[0])
        else:
            fwd_hooks = _stacked_hooks(hooks_per_copy, self.n_batch)
        skipped = self._skipped(stage, hooks_per_copy)
        if not fwd_hooks:
            return forward.run(state, stage)
        with hooks_on(forward.model, fwd_hooks):
            return forward.run(state, stage, skipped, len(hooks_per_copy))

    def _skipped(self, stage: int, hooks_per_copy: list[tuple[Hook, ...]]) -> list[int]:
        """The copies whose sublayer at `stage` need not run: the first hook on its output replaces it whatever
        it was (`replaces_activation`: a removal or an ablation). Only when no copy hooks a point inside the
        sublayer (its tensors would then hold fewer copies than its hooks expect), no hook already on the model
        watches the sublayer or its output, and autocast is off (the zeros would not have the sublayer's dtype)."""
        if (
            not 0 <= stage < self.last
            or self.outputs[stage] is None
            or torch.is_autocast_enabled("cpu")
            or torch.is_autocast_enabled("cuda")
        ):
            return []
        output, inside = self.outputs[stage], self.inside[stage]
        if any(name in inside for hooks in hooks_per_copy for name, _ in hooks):
            return []
        return [
            slot
            for slot, hooks in enumerate(hooks_per_copy)
            if next(
                (getattr(function, "replaces_activation", False) for name, function in hooks if name == output), False
            )
        ]

    def _finish(self, groups: list[list[int]], logits: torch.Tensor) -> None:
        for group, part in zip(groups, logits.split(self.n_batch)):
            result = self.score(part, self.batch)
            with self.lock:
                for member in group:
                    self.results[member] = result
                self.bar.update(len(group))


def concat_states(states: list[Any]) -> Any:
    """Tokens or residual streams at the same stage, stacked along the batch (the first state's layout)."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(states)
    stacked = copy.copy(first)
    for key, value in vars(first).items():
        if isinstance(value, torch.Tensor):
            setattr(stacked, key, torch.cat([vars(state)[key] for state in states]))
        elif isinstance(value, list):
            columns = zip(*[vars(state)[key] for state in states])
            setattr(
                stacked,
                key,
                [torch.cat(list(column)) if isinstance(column[0], torch.Tensor) else column[0] for column in columns],
            )
    stacked.batch_changed()
    stacked.stacked_from(states)
    return stacked


def slice_state(
    state: torch.Tensor | ResidualStream, start: int, length: int, copies: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor | ResidualStream:
    """Rows start … start + length − 1 of a stacked state, as copies, not views that would keep the whole stack
    alive. `copies` (one dict per copy of the batch, kept while its stack runs) maps each stacked tensor to its
    copy, so the states of consecutive stages share the copies of the tensors they share (a stream's sources)."""

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:  # the stacked tensor is held too, so its id is not reused meanwhile
            copies[id(tensor)] = (tensor, tensor[start : start + length].clone())
        return copies[id(tensor)][1]

    sliced = map_state(state, rows)
    if not isinstance(sliced, torch.Tensor):
        sliced.batch_changed()
    return sliced


def _stacked_hooks(hooks_per_copy: Sequence[Sequence[Hook]], n_batch: int, check_rows: bool = False) -> list[Hook]:
    """One hook per hook point for a stack of copies of a batch of `n_batch` sequences (copy-major along the batch):
    each copy's hooks see only its own rows. With `check_rows`, an activation that does not hold every copy's
    rows is refused by the hook point's name (a staged stack's sublayer may hold only the copies it computes)."""
    by_name: dict[str, list[tuple[int, Callable]]] = defaultdict(list)
    for slot, hooks in enumerate(hooks_per_copy):
        for name, function in hooks:
            by_name[name].append((slot, function))
    n_copies = len(hooks_per_copy) if check_rows else None
    return [(name, _on_copies(n_batch, functions, n_copies)) for name, functions in by_name.items()]


def _on_copies(n_batch: int, functions: list[tuple[int, Callable]], n_copies: int | None) -> Callable:
    """One hook applying each `(slot, function)` to its copy's rows only; a function returning None leaves its
    copy as it was, as a TransformerLens hook does."""

    def apply(tensor: torch.Tensor, hook) -> torch.Tensor:  # TL passes the hook point as `hook=`
        if n_copies is not None and (tensor.dim() == 0 or tensor.shape[0] != n_batch * n_copies):
            raise ValueError(
                f"hook point {hook.name!r} gave shape {tuple(tensor.shape)}, not {n_copies} stacked copies of "
                f"{n_batch} sequences on its first axis: interventions are stacked along the batch, so every "
                "hook point's tensor must lead with the batch axis (docs/architecture.md §7)"
            )
        copies = list(tensor.split(n_batch))
        for slot, function in functions:
            result = function(copies[slot], hook=hook)
            if result is not None:
                copies[slot] = result
        return torch.cat(copies)

    return apply
