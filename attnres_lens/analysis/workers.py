"""Where exact interventions run besides the calling thread: worker threads, each on its own replica of the model
(`WorkerPool`, used by `evaluate_many`), and a forked process for a whole analysis (`ForkedJob`, used by
`prune_tables`); and how many threads the analyses use (`analysis_workers`). docs/analysis.md §11.

Both exist because torch's per-op threading scales poorly on small models, while independent passes scale across
cores; both refuse what they would compute differently from the calling thread (a GPU model, autocast).
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from attnres_lens.analysis.session import current_session, give_back_replica, take_replica

MAX_ANALYSIS_WORKERS = 4  # each worker holds a stack of activations; beyond this, workers split torch's threads


def analysis_workers(model: object) -> int:
    """How many threads the analyses give `evaluate_many`: on the CPU one per torch thread up to
    `MAX_ANALYSIS_WORKERS` (independent stacked passes scale across cores, measured 1.6-2.0x on two, where
    splitting each op over two threads gave 1.1-1.4x; docs/analysis.md §11); one on a GPU (its kernels already
    fill it) and under autocast (`parallel_problem`); one for a model the staged engine does not run (any but the
    toolkit's `HookedTransformer`: whole hooked passes, its interventions stacked along the batch)."""
    from attnres_lens.model import HookedTransformer  # the model imports nothing of analysis: no cycle, but heavy

    if not isinstance(model, HookedTransformer):
        return 1
    return min(torch.get_num_threads(), MAX_ANALYSIS_WORKERS) if parallel_problem(model) is None else 1


def parallel_problem(model: nn.Module) -> str | None:
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
    autocast (`parallel_problem`)."""
    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and parallel_problem(model) is None
    )


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
            raise RuntimeError(
                f"the forked analysis process exited with code {self._process.exitcode} before sending its result"
            ) from None
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


Context = TypeVar("Context")


class WorkerPool(Generic[Context]):
    """Jobs `job(context)` on `n` threads, each thread with the context `make_context(replica)` of its own replica
    of the model (`session.model_replica`, or an idle one of the caller's `analysis_session`), so one thread's
    hooks never fire in another; and an equal share of torch's threads (one each when there are no more threads
    than workers; the caller's thread count is restored on close). The newest job runs first, as in the
    depth-first walk of one thread, so the states that queued jobs hold stay few. After a failure the jobs not
    yet started are skipped, and `wait` re-raises it."""

    def __init__(self, model: nn.Module, n: int, make_context: Callable[[nn.Module], Context]):
        self.model = model
        self.make_context = make_context
        self.jobs: queue.LifoQueue = queue.LifoQueue()
        self.done = threading.Condition()
        self.outstanding = 0
        self.errors: list[BaseException] = []
        self.skip = False
        self.previous_threads = torch.get_num_threads()
        self.threads_each = max(1, self.previous_threads // n)
        self.grad_enabled = torch.is_grad_enabled()  # thread-local in torch: the jobs run with the caller's
        self.session = current_session()  # the caller's: worker threads take their replicas from it and give them back
        self.threads = [
            threading.Thread(target=self._work, name=f"attnres-lens-evaluate-{i}", daemon=True) for i in range(n)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, job: Callable[[Context], None]) -> None:
        with self.done:
            self.outstanding += 1
        self.jobs.put(job)

    def _work(self) -> None:
        torch.set_num_threads(self.threads_each)
        replica: nn.Module | None = None
        context: Context | None = None
        fingerprint: tuple = ()
        while (job := self.jobs.get()) is not None:
            try:
                if not self.skip:
                    if replica is None:
                        replica, fingerprint = take_replica(self.model, self.session)
                        context = self.make_context(replica)
                    with torch.set_grad_enabled(self.grad_enabled):
                        job(context)
            except BaseException as err:  # re-raised in the caller by wait()
                with self.done:
                    self.errors.append(err)
                    self.skip = True
            finally:
                with self.done:
                    self.outstanding -= 1
                    self.done.notify_all()
        if replica is not None and not self.errors:  # after a failure a replica may hold a failed job's hooks
            give_back_replica(self.model, replica, fingerprint, self.session)

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
