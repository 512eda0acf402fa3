"""Hook-based interventions shared by the analyses: capture, evaluate, remove, replace, mask.

Everything acts from outside the model through its hook points (docs/hooks.md), so the same code serves the
standard residual, Full and Block AttnRes.

Removing a set R of sublayers (docs/analysis.md §6) is one rule for every residual kind:

* every output `f_j`, j ∈ R, is zeroed, which drops it from every sum that contains it: the standard
  residual `e + Σ f_i`, and an AttnRes block sum or partial sum (the block sum minus `f_j`, key and value);
* an AttnRes source whose members are *all* removed is masked out of every softmax that reads it
  (a logit bias of −inf, on `hook_logit_bias`, which keeps the mix in the fused kernel) instead of being left
  as a zero vector: a zero source would still take softmax mass
  (its key is zero, so its logit is 0), which is not "absent".

For Full AttnRes (S = 1) every source is a single output, so removal is exactly "mask f_j's source in every
later softmax, the final readout included"; for Block AttnRes it is "subtract f_j from its block sum", and a
sublayer alone in its block (or alone in a partial) is masked, the consistent limit of subtraction.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import itertools
import multiprocessing
import queue
import sys
import threading
import traceback
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from tqdm.auto import tqdm
from transformer_lens.hook_points import HookPoint

from attnres_lens.attnres import DepthStream
from attnres_lens.components import module_hooked
from attnres_lens.evaluation import Evaluation, score_logits
from attnres_lens.model import HookedTransformer
from attnres_lens.streams import ResidualStream, SumStream
from attnres_lens.tasks.base import Batch

Hook = tuple[str, Callable]


# ---------------------------------------------------------------------------- running
@torch.no_grad()
def capture(model: HookedTransformer, tokens: torch.Tensor, names: Iterable[str],
            fwd_hooks: Sequence[Hook] = ()) -> dict[str, torch.Tensor]:
    """Activations at the hook points `names` for one forward pass (with optional interventions)."""
    saved: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, hook) -> None:
        saved[hook.name] = tensor

    hooks = list(fwd_hooks) + [(name, save) for name in set(names)]
    model.run_with_hooks(tokens, return_type=None, fwd_hooks=hooks)
    return saved


def evaluate(model: HookedTransformer, batch: Batch, fwd_hooks: Sequence[Hook] = ()) -> Evaluation:
    """The batch's loss, answer loss and accuracy with the hooks `fwd_hooks` applied."""
    if not fwd_hooks:
        return clean_result("evaluate", model, (batch.tokens, batch.targets, batch.answer_mask),
                            lambda: evaluate_many(model, batch, [()])[0])
    return evaluate_many(model, batch, [fwd_hooks])[0]


class _Session:
    """What `analysis_session` shares: clean results by (kind, model, token tensor), and idle model replicas by
    model, each with the fingerprint of the model it copied (`_fingerprint`)."""

    def __init__(self) -> None:
        self.clean: dict[tuple, tuple[tuple, Any]] = {}  # key -> (what keeps the key's ids alive, result)
        self.replicas: dict[int, tuple[tuple, list[nn.Module]]] = {}
        self.lock = threading.Lock()  # replicas are taken and given back by worker threads


_SESSION: contextvars.ContextVar[Optional[_Session]] = contextvars.ContextVar("attnres_lens_analysis_session",
                                                                              default=None)


@contextlib.contextmanager
def analysis_session() -> Iterator[None]:
    """Inside, analyses of a model that does not change meanwhile share work: a clean (unhooked) result — the
    evaluation, the residual states, the depth weights — is computed once per model and token tensor and reused,
    and the worker threads' copies of the model (`model_replica`, ~60 ms of Python each for a 12-layer model) are
    kept from one `evaluate_many` call to the next. For callers that derive several tables from one model
    (`prune_tables`: eight clean passes become four, and 12 replicas 2). Nested sessions are one."""
    token = _SESSION.set(_SESSION.get() or _Session())
    try:
        yield
    finally:
        _SESSION.reset(token)


def clean_result(kind: str, model: nn.Module, inputs: Union[torch.Tensor, tuple[torch.Tensor, ...]],
                 compute: Callable[[], Any]) -> Any:
    """`compute()`, or inside `analysis_session` its first result for this kind, the same input tensors and the
    model as it is now (its modules, parameters, buffers, hooks and train/eval mode: a result under a hook is
    not a clean one). The model and inputs are held, so their ids are not reused meanwhile."""
    session = _SESSION.get()
    if session is None:
        return compute()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    key = (kind, id(model), _fingerprint(model), *map(id, inputs))
    if key not in session.clean:
        held = (model, inputs, [hook for module in model.modules() for hook in _hooks_of(module)])
        session.clean[key] = (held, compute())
    return session.clean[key][1]


def _fingerprint(model: nn.Module) -> tuple:
    """What a replica copies: the module tree, its parameters and buffers, train/eval mode and the hooks attached
    (by id: whoever keeps a fingerprint keeps those objects alive too, so no id is reused meanwhile)."""
    return tuple((id(module), module.training, tuple(map(id, module._parameters.values())),
                  tuple(map(id, module._buffers.values())), tuple(map(id, _hooks_of(module))))
                 for module in model.modules())


def _hooks_of(module: nn.Module) -> list[Callable]:
    return [hook for name, value in vars(module).items() if name.endswith("hooks") and isinstance(value, dict)
            for hook in value.values()]


def _take_replica(model: nn.Module, session: Optional[_Session]) -> tuple[nn.Module, tuple]:
    """An idle replica of the session's that still matches `model`, else a new one; with the fingerprint of the
    model it copies."""
    if session is None:
        return model_replica(model), ()
    fingerprint = _fingerprint(model)
    with session.lock:
        kept = session.replicas.get(id(model))
        if kept is not None and kept[0] == fingerprint and kept[1]:
            return kept[1].pop(), fingerprint
    return model_replica(model), fingerprint


def _give_back_replica(model: nn.Module, replica: nn.Module, fingerprint: tuple, session: Optional[_Session]) -> None:
    if session is None:
        return
    with session.lock:
        kept = session.replicas.get(id(model))
        if kept is None or kept[0] != fingerprint:
            session.replicas[id(model)] = kept = (fingerprint, [])
        kept[1].append(replica)


# Stacks hold up to this many elements per activation (d_model x tokens; 4 MB in fp32) unless `max_sequences` says:
# the tables of a prune of the 12-layer d_model-64 Full model (32 sequences of 65 tokens, 2 workers) took less time
# in stacks of 128-512 sequences than in stacks of 64 (docs/analysis.md §11); a budget in elements keeps the stacks
# of wide or long models from growing with them.
STACK_ELEMENTS = 1 << 20


@torch.no_grad()
def evaluate_many(model: HookedTransformer, batch: Batch, interventions: Sequence[Sequence[Hook]],
                  max_sequences: Optional[int] = None, progress: bool = False, desc: str = "interventions",
                  cache: Optional[StateCache] = None, score: Callable[[torch.Tensor, Batch], Any] = score_logits,
                  workers: int = 1, remember: Optional[Iterable[int]] = None) -> list[Any]:
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
    they must not depend on each other's side effects (`analysis_workers` gives the analyses' default)."""
    if not interventions:
        return []
    if max_sequences is None:
        max_sequences = _default_stack(model, batch)
    for name, value in (("max_sequences", max_sequences), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if workers > 1 and (problem := _parallel_problem(model)) is not None:
        raise ValueError(f"workers={workers} needs worker threads, but {problem}; use workers=1 "
                         "(analysis_workers(model) chooses)")
    with tqdm(total=len(interventions), desc=desc, disable=not progress, leave=False) as bar:
        return _SharedEvaluation(model, batch, interventions, max_sequences, bar, cache, score, workers,
                                 remember).run()


def _default_stack(model: HookedTransformer, batch: Batch) -> int:
    """Sequences a stack holds by default: whole copies of the batch within `STACK_ELEMENTS` per activation (a
    hyper-connection stream's state holds its n streams of d_model per token), at least one."""
    cfg = model.cfg
    width = cfg.d_model * (cfg.mhc_streams if cfg.residual == "mhc" else 1)
    return batch.tokens.shape[0] * max(1, STACK_ELEMENTS // (batch.tokens.numel() * width))


MAX_ANALYSIS_WORKERS = 4  # each worker holds a stack of activations; beyond this, workers split torch's threads


def analysis_workers(model: nn.Module) -> int:
    """How many threads the analyses give `evaluate_many`: on the CPU one per torch thread up to
    `MAX_ANALYSIS_WORKERS` (independent stacked passes scale across cores, measured 1.6-2.0x on two, where
    splitting each op over two threads gave 1.1-1.4x; docs/analysis.md §11); one on a GPU (its kernels already
    fill it) and under autocast (`_parallel_problem`)."""
    return min(torch.get_num_threads(), MAX_ANALYSIS_WORKERS) if _parallel_problem(model) is None else 1


def _parallel_problem(model: nn.Module) -> Optional[str]:
    """Why interventions cannot run on worker threads, or None: a worker does not inherit the caller's autocast or
    CUDA device and stream (thread-local in torch), so it would compute something else."""
    devices = sorted({str(parameter.device) for parameter in model.parameters()} - {"cpu"})
    if devices:
        return f"the model is on {', '.join(devices)} (worker threads run CPU models only)"
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return "autocast is on (worker threads would not inherit it)"
    return None


def fork_available(model: nn.Module) -> bool:
    """Whether `ForkedJob` can run an analysis of `model` beside this process: Linux (fork), a CPU model, no
    autocast (`_parallel_problem`)."""
    return (sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
            and _parallel_problem(model) is None)


class ForkedJob:
    """`compute()` in a forked child process on one torch thread, started at once; `result()` waits for its
    pickled result. Worker threads share one interpreter, which cost `prune`'s tables about 1.2 s of their ~6.5
    on two workers (docs/analysis.md §11); a second process does not share it. One thread, because GNU OpenMP's
    thread pool does not survive a fork: a child that opens a parallel region of two or more threads waits forever
    for the parent's pool. The child copies only the calling thread, so this is for processes that run no threads
    of their own meanwhile (a command line, not a server or a notebook kernel): `prune_tables(fork_routing=True)`.
    The child writes nothing to the terminal; its failure (an unpicklable result included) is raised here as a
    RuntimeError with its traceback, and `cancel` ends it."""

    def __init__(self, compute: Callable[[], Any]):
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_run_forked, args=(self._receive, send, compute), daemon=True)
        self._process.start()
        send.close()  # the child holds the sending end: a child that dies unheard ends recv with EOFError

    def result(self) -> Any:
        try:
            succeeded, value = self._receive.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the forked analysis process exited with code {self._process.exitcode} before "
                               "sending its result") from None
        finally:
            self._receive.close()
        self._process.join()
        if not succeeded:
            raise RuntimeError(f"the forked analysis process failed:\n{value}")
        return value

    def cancel(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._receive.close()


def _run_forked(receive: Any, send: Any, compute: Callable[[], Any]) -> None:
    receive.close()  # else a child whose parent was killed could block on a full pipe it holds open itself
    try:
        torch.set_num_threads(1)
        send.send((True, compute()))  # pickles before it writes: an unpicklable result raises here
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        send.send((False, traceback.format_exc()))
    finally:
        send.close()


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
        model = self.model
        mixer = model.final_mixer() if hasattr(model, "final_mixer") else getattr(model, "final_res", None)
        return model.unembed(stream.readout_normed(mixer, model.ln_final))

    def run(self, state: Union[torch.Tensor, ResidualStream], stage: int, skipped: Sequence[int] = (),
            n_copies: int = 1) -> Union[ResidualStream, torch.Tensor]:
        """Run one stage on `state` (tokens before stage −1, else a stream, which is copied, not changed): the
        stream before stage + 1, or the logits after stage J. `skipped`: as `sublayer`."""
        if stage == EMBEDDING_STAGE:
            return self.embed(state)
        stream = map_state(state, lambda tensor: tensor)
        if stage == self.n_sublayers:
            return self.final(stream)
        self.sublayer(stream, stage, skipped, n_copies)
        return stream


def _on_kept_copies(sublayer: Callable[[torch.Tensor], torch.Tensor], skipped: Sequence[int], n_copies: int
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`sublayer` computed on the rows of the copies not `skipped` only (batch rows are independent), zeros in
    the others' rows (a sublayer's output has its input's shape)."""
    def run(normed: torch.Tensor) -> torch.Tensor:
        kept = [slot for slot in range(n_copies) if slot not in skipped]
        if not kept:
            return torch.zeros_like(normed)
        copies = list(normed.chunk(n_copies))
        results = iter(sublayer(torch.cat([copies[slot] for slot in kept]) if len(kept) > 1 else copies[kept[0]])
                       .chunk(len(kept)))
        return torch.cat([next(results) if slot in kept else torch.zeros_like(copies[slot])
                          for slot in range(n_copies)])

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


def map_state(state: Union[torch.Tensor, ResidualStream], function: Callable[[torch.Tensor], torch.Tensor]
              ) -> Union[torch.Tensor, ResidualStream]:
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
        self.owner: Optional[tuple[int, torch.Tensor]] = None
        self.states: dict[tuple, Any] = {}
        self.functions: list[Callable] = []

    def check(self, model: HookedTransformer, batch: Batch) -> None:
        if self.owner is not None and (self.owner[0] != id(model) or self.owner[1] is not batch.tokens):
            raise ValueError("a StateCache serves one model and one batch; use a new one for another")
        self.owner = (id(model), batch.tokens)


def model_replica(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules that shares its parameters and buffers (in place edits of the weights reach
    both) and the hooks attached to it now (the same callables, so a bound method's object sees the calls):
    hooks attached to the copy later fire only there."""
    shared = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    for module in model.modules():  # _forward_hooks, _forward_pre_hooks, …
        shared.update((id(hook), hook) for hook in _hooks_of(module))
    return copy.deepcopy(model, shared)


class _Workers:
    """Jobs `job(forward)` on `n` threads, each thread with a `StagedForward` of its own replica of the model and
    an equal share of torch's threads (one each when there are no more threads than workers; the caller's thread
    count is restored on close). The newest job runs first, as in the depth-first walk of one thread, so the
    states that queued jobs hold stay few. After a failure the jobs not yet started are skipped, and `wait`
    re-raises it."""

    def __init__(self, model: HookedTransformer, n: int):
        self.model = model
        self.jobs: queue.LifoQueue = queue.LifoQueue()
        self.done = threading.Condition()
        self.outstanding = 0
        self.errors: list[BaseException] = []
        self.skip = False
        self.previous_threads = torch.get_num_threads()
        self.threads_each = max(1, self.previous_threads // n)
        self.grad_enabled = torch.is_grad_enabled()  # thread-local in torch: the jobs run with the caller's
        self.session = _SESSION.get()  # the caller's: worker threads take their replicas from it and give them back
        self.threads = [threading.Thread(target=self._work, name=f"attnres-lens-evaluate-{i}", daemon=True)
                        for i in range(n)]
        for thread in self.threads:
            thread.start()

    def submit(self, job: Callable[[StagedForward], None]) -> None:
        with self.done:
            self.outstanding += 1
        self.jobs.put(job)

    def _work(self) -> None:
        torch.set_num_threads(self.threads_each)
        forward: Optional[StagedForward] = None
        fingerprint: tuple = ()
        while (job := self.jobs.get()) is not None:
            try:
                if not self.skip:
                    if forward is None:
                        replica, fingerprint = _take_replica(self.model, self.session)
                        forward = StagedForward(replica)
                    with torch.set_grad_enabled(self.grad_enabled):
                        job(forward)
            except BaseException as err:  # re-raised in the caller by wait()
                with self.done:
                    self.errors.append(err)
                    self.skip = True
            finally:
                with self.done:
                    self.outstanding -= 1
                    self.done.notify_all()
        if forward is not None and not self.errors:  # after a failure a replica may hold a failed job's hooks
            _give_back_replica(self.model, forward.model, fingerprint, self.session)

    def _wait_idle(self) -> None:
        """Until every job has ended, those that jobs submit included (a job submits its children before it ends)."""
        with self.done:
            self.done.wait_for(lambda: self.outstanding == 0)

    def wait(self) -> None:
        """`_wait_idle`, then re-raise the first failure."""
        self._wait_idle()
        if self.errors:
            raise self.errors[0]

    def close(self, cancel: bool = False) -> None:
        """`wait`, stop the threads and restore torch's thread count; with `cancel` (the caller is failing
        already), skip the jobs not yet started and raise nothing."""
        try:
            if cancel:
                self.skip = True
                self._wait_idle()
            else:
                self.wait()
        finally:
            for _ in self.threads:
                self.jobs.put(None)
            for thread in self.threads:
                thread.join()
            torch.set_num_threads(self.previous_threads)


class _SharedEvaluation:
    """`evaluate_many`'s traversal of the tree of interventions (see its docstring)."""

    def __init__(self, model: HookedTransformer, batch: Batch, interventions: Sequence[Sequence[Hook]],
                 max_sequences: int, bar: tqdm, cache: Optional[StateCache] = None,
                 score: Callable[[torch.Tensor, Batch], Any] = score_logits, workers: int = 1,
                 remember: Optional[Iterable[int]] = None):
        self.model = model
        self.score = score
        self.batch = batch
        self.forward = StagedForward(model)
        self.workers = workers
        self.pool: Optional[_Workers] = None
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
        self.keys = [[tuple((name, id(function)) for name, function in hooks_at) for hooks_at in plan]
                     for plan in self.plans]
        self.results: list[Any] = [None] * len(interventions)
        self.cache = cache
        self.seen: dict[tuple, Any] = {}  # this call's states, by the keys of every stage up to theirs
        self.path_points = {f"{name}.{hook}" for name, module in model.named_modules()
                            for hook in getattr(module, "path_hooks", ())}
        # per sublayer: its output's hook point, and the hook points inside the sublayer (see `_skipped`); None
        # where the sublayer always runs: a hook already on the model watches it, its output or a module call
        self.outputs: list[Optional[str]] = []
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
            self.pool = _Workers(self.model, min(self.workers, len(self.plans)))
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
                state = cached if cached is not None else self._step(forward, state, stage,
                                                                      [self.plans[members[0]][stage + 1]])
                self._remember(members, stage, state)
                if stage == self.last:
                    self._finish([members], state)
                    return
                stage += 1
                continue
            groups = list(children.values())
            # a branch whose members agree from here on never parts again: those run stacked to the end
            leaves = [group for group in groups if len({tuple(self.keys[m][stage + 1:]) for m in group}) == 1]
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
            points = {name for hooks in self.plans[leaf[0]][start + 1:] for name, _ in hooks} & self.path_points
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
                self._remember(group, current, state if len(groups) == 1 else
                               slice_state(state, slot * self.n_batch, self.n_batch, copies))
        self._finish(groups, state)

    def _step(self, forward: StagedForward, state: Any, stage: int, hooks_per_copy: list[tuple[Hook, ...]]) -> Any:
        if len(hooks_per_copy) == 1:
            fwd_hooks = list(hooks_per_copy[0])
        else:
            by_name: dict[str, list[tuple[int, Callable]]] = defaultdict(list)
            for slot, hooks in enumerate(hooks_per_copy):
                for name, function in hooks:
                    by_name[name].append((slot, function))
            fwd_hooks = [(name, _on_copies(self.n_batch, functions)) for name, functions in by_name.items()]
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
        if (not 0 <= stage < self.last or self.outputs[stage] is None or torch.is_autocast_enabled("cpu")
                or torch.is_autocast_enabled("cuda")):
            return []
        output, inside = self.outputs[stage], self.inside[stage]
        if any(name in inside for hooks in hooks_per_copy for name, _ in hooks):
            return []
        return [slot for slot, hooks in enumerate(hooks_per_copy)
                if next((getattr(function, "replaces_activation", False) for name, function in hooks
                         if name == output), False)]

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
            setattr(stacked, key, [torch.cat(list(column)) if isinstance(column[0], torch.Tensor) else column[0]
                                   for column in columns])
    stacked.batch_changed()
    stacked.stacked_from(states)
    return stacked


def slice_state(state: Union[torch.Tensor, ResidualStream], start: int, length: int,
                copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Union[torch.Tensor, ResidualStream]:
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


def _on_copies(n_batch: int, functions: list[tuple[int, Callable]]) -> Callable:
    def apply(tensor: torch.Tensor, hook) -> torch.Tensor:  # TL passes the hook point as `hook=`
        copies = list(tensor.split(n_batch))
        for slot, function in functions:
            copies[slot] = function(copies[slot], hook=hook)
        return torch.cat(copies)

    return apply


# ---------------------------------------------------------------------------- interventions
def replaces_activation(hook: Callable) -> Callable:
    """Mark `hook` as one whose result does not depend on the activation it is given (only on its shape and
    dtype): on a sublayer's output, `evaluate_many` then skips computing that sublayer for the copies it serves."""
    hook.replaces_activation = True
    return hook


def replace_hook(replacement: torch.Tensor) -> Callable:
    """Hook that replaces an activation by `replacement` (broadcast to the activation's shape)."""

    @replaces_activation
    def hook(tensor: torch.Tensor, hook) -> torch.Tensor:
        return replacement.to(tensor.dtype).expand_as(tensor)

    return hook


def mask_sources_hook(sources: Sequence[int]) -> Callable:
    """Hook on a depth attention's `hook_logit_bias` (or `hook_logits`) that knocks `sources` out of its softmax.
    The same sources give the same function object, so `evaluate_many` sees removal sets that agree on a consumer
    as sharing it."""
    return _mask_sources_hook(tuple(int(source) for source in sources))


@functools.lru_cache(maxsize=None)
def _mask_sources_hook(sources: tuple[int, ...]) -> Callable:
    index = torch.tensor(list(sources))

    def hook(bias: torch.Tensor, hook) -> torch.Tensor:
        return bias.index_fill(-1, index.to(bias.device), float("-inf"))

    return hook


@replaces_activation
def _zero(tensor: torch.Tensor, hook) -> torch.Tensor:
    return torch.zeros_like(tensor)


def removal_hooks(model: HookedTransformer, removed: Iterable[int]) -> list[Hook]:
    """Hooks that remove the sublayers in `removed` (see the module docstring for the rule)."""
    removed = set(removed)
    bad = sorted(j for j in removed if not 0 <= j < model.cfg.n_sublayers)
    if bad:
        raise ValueError(f"sublayers {bad} are out of range 0..{model.cfg.n_sublayers - 1}")
    hooks: list[Hook] = [(model.sublayer_output_hook(j), _zero) for j in sorted(removed)]
    for consumer, module in model.depth_attention_modules().items():
        emptied = [s for s, members in enumerate(model.sources(consumer)) if set(members) <= removed]
        if emptied:
            hooks.append((module.hook_logit_bias.name, mask_sources_hook(emptied)))
    return hooks


def source_mask_hooks(model: HookedTransformer, consumer: int, sources: Sequence[int]) -> list[Hook]:
    """Hooks that knock `sources` out of one consumer's depth softmax (AttnRes only)."""
    modules = model.depth_attention_modules()
    if consumer not in modules:
        raise ValueError(f"consumer {consumer} has no depth attention (residual={model.cfg.residual!r})")
    n_sources = len(model.sources(consumer))
    if not sources or any(not 0 <= s < n_sources for s in sources) or len(set(sources)) >= n_sources:
        raise ValueError(f"consumer {consumer} reads {n_sources} sources; cannot mask {list(sources)}")
    return [(modules[consumer].hook_logit_bias.name, mask_sources_hook(sources))]


def resample_permutation(batch_size: int) -> torch.Tensor:
    """Each sequence takes its activations from the next one (a derangement, so never from itself)."""
    if batch_size < 2:
        raise ValueError("resample ablation needs at least 2 sequences (samples >= 2)")
    return torch.roll(torch.arange(batch_size), -1)
