"""The training loop: AdamW + warm-up/cosine, periodic eval, recording and checkpoints, resumable.

One `RunConfig` (model + task + train, `attnres_lens.config`) fully determines a run. `train(config, out_dir)` starts one,
`resume(out_dir)` continues it after a crash with the same loss curve. Data parallel: launch with
`torchrun --nproc-per-node N -m attnres_lens.cli train …`; every rank draws the same global batch and
keeps its rows, gradients are averaged with `all_reduce`, and only rank 0 writes the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from attnres_lens import cpu_settings
from attnres_lens.config import RunConfig
from attnres_lens.evaluation import evaluate_model
from attnres_lens.model import HookedTransformer, adamw, next_token_loss
from attnres_lens.recorder import Recorder
from attnres_lens.rundir import LOG_WINDOW_TENSORS, STATE_FORMAT, RunDir, RunDirError
from attnres_lens.tasks.base import Batch
from attnres_lens.tasks.induction import repeated_tokens


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run directory keeps its last good checkpoint."""


# ---------------------------------------------------------------------------- environment
def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is available; use --device cpu or auto")
    return torch.device(device)


def distributed_context() -> tuple[int, int]:
    """(rank, world size); initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# ---------------------------------------------------------------------------- the trainer
class Trainer:
    """One process's training of a run (one rank under torchrun): model, optimiser, data and recorder built from a
    `RunConfig`; rank 0 writes the run directory. `train` and `resume` drive it."""

    def __init__(self, config: RunConfig, out_dir: Path, progress: bool = True):
        self.config = config
        self.out_dir = Path(out_dir)
        self.run_dir = RunDir(out_dir)
        self.progress = progress
        train_cfg = config.train
        self.rank, self.world = distributed_context()
        if train_cfg.batch_size % self.world:
            raise ValueError(f"train.batch_size={train_cfg.batch_size} must be divisible by the {self.world} processes")
        self.device = resolve_device(train_cfg.device)
        if self.device.type == "cpu" and config.model.dtype == torch.float16:
            raise ValueError(
                "model.dtype=float16 is not supported for training on the CPU (its half-precision "
                "arithmetic overflows within steps); use float32, or bfloat16"
            )
        if self.device.type == "cpu":
            cpu_settings.set_threads(train_cfg.threads)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

        self.task = config.build_task()
        if not getattr(self.task, "for_training", True):
            raise ValueError(
                f"task {self.task.name!r} is a scoring probe, not a training task (a positional head solves it)"
            )
        model_cfg = config.model
        if self.task.vocab_size > model_cfg.d_vocab or self.task.seq_len > model_cfg.n_ctx:
            raise ValueError(
                f"task needs vocab {self.task.vocab_size} and length {self.task.seq_len}, but the model has "
                f"d_vocab={model_cfg.d_vocab}, n_ctx={model_cfg.n_ctx}; set model.d_vocab / model.n_ctx to at least those"
            )
        model_cfg = dataclasses.replace(model_cfg, device=str(self.device), seed=train_cfg.seed)
        self.model = HookedTransformer(model_cfg)
        self.optimizer = adamw(self.model, train_cfg.lr, train_cfg.weight_decay, train_cfg.betas)
        self.data_generator = self.task.train_generator(train_cfg.data_seed)
        self.eval_batch = self.task.eval_batch(train_cfg.eval_size).to(self.device)
        if not self.eval_batch.answer_mask.any():  # eval_accuracy would be NaN at every evaluation
            raise ValueError(
                f"the held-out set of train.eval_size={train_cfg.eval_size} sequences has no answer "
                "position to score accuracy on; raise train.eval_size"
            )
        probe_half = (min(self.task.seq_len, model_cfg.n_ctx) - 1) // 2
        probe = repeated_tokens(
            train_cfg.record_size, probe_half, self.task.vocab_size, torch.Generator().manual_seed(train_cfg.seed + 1)
        )
        self.recorder = Recorder(self.model, self._head(self.eval_batch, train_cfg.record_size), probe.to(self.device))
        self.step = 0
        self._log_window = {"loss": 0.0, "n": 0}  # training losses since the last metrics line
        self.last_eval: dict[str, float] = {}

    @staticmethod
    def _head(batch: Batch, n: int) -> Batch:
        return Batch(batch.tokens[:n], batch.targets[:n], batch.answer_mask[:n])

    # ------------------------------------------------------------------ public
    def fit(self) -> None:
        """Train from `self.step` to `train.steps`, logging, evaluating, recording and checkpointing at their
        cadences; config.json is written first, so a resumed run records what it continued with."""
        cfg = self.config.train
        if self.rank == 0:
            self.run_dir.write_config(self.config)
            if self.step == 0:
                self._evaluate_and_log(0, {})
                self.recorder.record(0)
                self._write_records()
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not self.progress or self.rank != 0,
            desc=self.out_dir.name,
            unit="step",
            dynamic_ncols=True,
        )
        window = {**self._log_window, "tokens": 0, "time": time.perf_counter()}
        try:
            while self.step < cfg.steps:
                loss, grad_norm, tokens = self._train_step()
                self.step += 1
                window["loss"] += loss
                window["tokens"] += tokens
                window["n"] += 1
                bar.update(1)
                if self.rank != 0:
                    continue
                if self.step % cfg.log_every == 0 or self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    elapsed = time.perf_counter() - window["time"]
                    train_metrics = {
                        "loss": window["loss"] / window["n"],
                        "grad_norm": grad_norm,
                        "lr": cfg.lr_at(self.step - 1),
                        "tokens_per_s": window["tokens"] / max(elapsed, 1e-9),
                    }
                    self._evaluate_and_log(self.step, train_metrics)
                    bar.set_postfix(self._postfix(train_metrics))
                    window = {"loss": 0.0, "tokens": 0, "n": 0, "time": time.perf_counter()}
                self._log_window = {"loss": window["loss"], "n": window["n"]}  # what a checkpoint carries on
                if self.step % cfg.record_every == 0 or self.step == cfg.steps:
                    self.recorder.record(self.step)
                    self._write_records()
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self._save_checkpoint()
        finally:
            bar.close()
        # Not on the way out of an error: a rank stopped alone (rank 0's checkpoint found non-finite) must exit, so
        # that torchrun stops the others, instead of waiting here for ranks that wait in their next step's collective
        if dist.is_initialized():
            dist.barrier()

    def _postfix(self, train_metrics: dict[str, float]) -> dict[str, str]:
        """The bar's figures, each naming the positions it covers: the training loss over every position, and the
        held-out loss and accuracy over the answer positions (the same positions, so they read together)."""
        postfix = {"loss (train, all positions)": f"{train_metrics['loss']:.3f}"}
        if self.last_eval:
            postfix["answer loss (eval)"] = f"{self.last_eval['eval_answer_loss']:.3f}"
            postfix["answer acc (eval)"] = f"{self.last_eval['eval_accuracy']:.1%}"
        postfix["tok/s"] = f"{train_metrics['tokens_per_s']:.0f}"
        return postfix

    # ------------------------------------------------------------------ steps
    def _train_step(self) -> tuple[float, float, int]:
        cfg = self.config.train
        batch = self.task.sample(cfg.batch_size, self.data_generator)
        rows = slice(self.rank * cfg.batch_size // self.world, (self.rank + 1) * cfg.batch_size // self.world)
        tokens = batch.tokens[rows].to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.step)
        self.model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(tokens)
        loss = next_token_loss(logits, tokens)
        mean_loss = loss.detach().clone()
        if self.world > 1:  # before the check: every rank sees the same mean, so all stop or none (no rank left
            dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)  # waiting in a collective the others never join)
            mean_loss /= self.world
        loss_value = mean_loss.item()
        if not math.isfinite(loss_value):
            self._diverged(f"the training loss became {loss_value} at step {self.step + 1}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                    param.grad /= self.world
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.optimizer.step()
        return loss_value, grad_norm, batch.tokens.numel()

    def evaluate(self) -> dict[str, float]:
        """On the held-out set: loss over every next-token position, and loss and accuracy over the answer
        positions (docs/run_directory.md §3)."""
        self.model.eval()
        result = evaluate_model(self.model, self.eval_batch)
        self.model.train()
        return {"eval_loss": result.loss, "eval_answer_loss": result.answer_loss, "eval_accuracy": result.accuracy}

    def _evaluate_and_log(self, step: int, train_metrics: dict[str, float]) -> None:
        cfg = self.config.train
        record = {"step": step, "tokens": step * cfg.batch_size * self.task.seq_len, **train_metrics}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            self.last_eval = self.evaluate()
            record.update(self.last_eval)
        self.run_dir.append_metrics(record)

    # ------------------------------------------------------------------ persistence
    def _write_records(self) -> None:
        self.run_dir.write_records(self.recorder.tables())

    def _diverged(self, what: str) -> None:
        """Stop with a message that says which checkpoint, if any, is left (never a non-finite one)."""
        latest = self.run_dir.read_index().latest if self.rank == 0 else None
        kept = (
            f"the last good checkpoint, {latest}, is kept in {self.run_dir.checkpoints_dir} (resume from it with "
            f"`attnres-lens train --resume {self.run_dir.path}`)"
            if latest
            else f"no checkpoint was written before it (the first was due at step {self.config.train.checkpoint_every})"
            if self.rank == 0
            else "rank 0 says which checkpoint is kept"
        )
        raise TrainingDiverged(
            f"{what}; training stopped and {kept}. Start a new run with a lower learning rate "
            "(--set train.lr=...) or a longer warm-up (--set train.warmup_steps=...)"
        )

    def _save_checkpoint(self) -> None:
        eval_loss = self.evaluate()["eval_loss"]
        if not math.isfinite(eval_loss) or not all(torch.isfinite(p).all() for p in self.model.parameters()):
            self._diverged(
                f"at step {self.step} the held-out loss is {eval_loss} (non-finite weights or outputs), "
                "so that checkpoint was not saved"
            )
        weights_meta = {
            "model_config": self.model.cfg.to_json(),
            "run_config": json.dumps(self.config.to_dict()),
            "step": str(self.step),
        }
        state, state_meta = self._training_state()
        self.run_dir.save_checkpoint(
            self.step,
            dict(self.model.state_dict()),
            weights_meta,
            state,
            state_meta,
            eval_loss,
            self.config.train.keep_checkpoints,
        )

    def _training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Optimiser moments, RNG states and counters as tensors + JSON metadata (no pickle)."""
        tensors: dict[str, torch.Tensor] = {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                tensors[f"optim.{names[id(param)]}.{key}"] = torch.as_tensor(value).clone()
        tensors["rng.data"] = self.data_generator.get_state()
        tensors["rng.torch"] = torch.get_rng_state()
        loss_sum, steps = LOG_WINDOW_TENSORS
        tensors[loss_sum] = torch.tensor(self._log_window["loss"], dtype=torch.float64)
        tensors[steps] = torch.tensor(self._log_window["n"], dtype=torch.int64)
        meta = {"step": str(self.step), "format": STATE_FORMAT}
        return tensors, meta

    def load_training_state(self, name: str) -> None:
        """Weights, optimiser moments, RNG states, step and open log window of checkpoint `name`: what makes a
        resumed run log the losses an uninterrupted one would (docs/run_directory.md §9)."""
        weights, state, state_meta = self.run_dir.read_checkpoint(name)
        try:
            self.model.load_state_dict({k: v.to(self.device) for k, v in weights.items()})
        except RuntimeError as err:
            raise RunDirError(f"checkpoint {name} does not match the run's model config: {err}") from err
        params = dict(self.model.named_parameters())
        for key, value in state.items():
            if key.startswith("optim."):
                param_name, _, slot = key[len("optim.") :].rpartition(".")
                if param_name not in params:
                    raise RunDirError(f"checkpoint {name}: optimiser state for unknown parameter {param_name}")
                self.optimizer.state[params[param_name]][slot] = value.to(self.device)
        self.data_generator.set_state(state["rng.data"])
        torch.set_rng_state(state["rng.torch"])
        self.step = int(state_meta["step"])
        loss_sum, steps = LOG_WINDOW_TENSORS
        if steps in state:  # older state files lack the open log window: it restarts empty
            self._log_window = {"loss": float(state[loss_sum]), "n": int(state[steps])}


# ---------------------------------------------------------------------------- entry points
def _is_writer() -> bool:
    """Rank 0 writes the run directory (and holds its lock); other data-parallel ranks only train."""
    return int(os.environ.get("RANK", "0")) == 0


def train(config: RunConfig, out_dir: str | Path, progress: bool = True) -> Trainer:
    """Start a new run in `out_dir` (empty or absent) and train it to the end, holding the run's writer lock."""
    run_dir = RunDir(out_dir)
    if not _is_writer():  # other data-parallel ranks write nothing
        _check_new_folder(run_dir)
        return _train_new(config, run_dir, progress)
    # refused or failed before config.json exists: nothing made here stays
    with run_dir.writing_new_run(_check_new_folder):
        return _train_new(config, run_dir, progress)


def _check_used(config: RunConfig) -> None:
    """A new run seeds its model with train.seed and puts it on train.device: model.seed and model.device must be
    their defaults or agree, else config.json would record a setting training never used. (A resumed run is not
    asked: runs of earlier versions may record one, and --resume cannot change it.)"""
    model, train_cfg = config.model, config.train
    if model.seed not in (None, train_cfg.seed):
        raise ValueError(
            f"model.seed={model.seed} is not used by training, which seeds the model with "
            f"train.seed={train_cfg.seed}; set train.seed instead (and leave model.seed unset)"
        )
    try:
        kind = torch.device(model.device).type
    except RuntimeError as err:
        raise ValueError(f"model.device={model.device!r} is not a device ({err}); set train.device instead") from err
    if kind != "cpu" and kind != resolve_device(train_cfg.device).type:
        raise ValueError(
            f"model.device={model.device!r} is not used by training, which runs on "
            f"train.device={train_cfg.device!r}; set train.device instead"
        )


def _check_new_folder(run_dir: RunDir) -> None:
    if run_dir.holds_run():
        raise FileExistsError(
            f"{run_dir.path} already holds a run; resume it with `attnres-lens train --resume "
            f"{run_dir.path}` or choose another --out"
        )
    if foreign := run_dir.foreign_entries():
        raise FileExistsError(
            f"{run_dir.path} is not empty and holds no run ({', '.join(foreign[:5])}"
            f"{', …' if len(foreign) > 5 else ''}); a new run needs an empty or new folder"
        )


def _train_new(config: RunConfig, run_dir: RunDir, progress: bool) -> Trainer:
    _check_used(config)
    trainer = Trainer(config, run_dir.path, progress)
    trainer.fit()
    return trainer


def resume(
    out_dir: str | Path,
    progress: bool = True,
    steps: int | None = None,
    checkpoint: str = "latest",
    device: str | None = None,
    threads: int | None = None,
) -> Trainer:
    """Continue a run from a checkpoint (default its latest); the loss curve continues as if never interrupted.

    `steps` sets a new, larger total step budget (the cosine schedule then stretches to it); a run that has
    reached its budget needs one to continue. `checkpoint` ("latest", "best", a step or a name) picks an earlier
    checkpoint, e.g. when the latest state file is damaged: what was logged after it, and the checkpoints after
    it, are dropped and redone. `device` moves the run (e.g. trained on a GPU, continued on a CPU; the arithmetic
    then differs in rounding), recorded in config.json. `threads` sets its torch threads (a run recorded on a
    machine with more cores may ask for more than this one runs), recorded too.
    """
    run_dir = RunDir(out_dir)
    run_dir.read_config_dict()  # a missing or foreign folder is refused before the lock would create anything
    with run_dir.lock() if _is_writer() else contextlib.nullcontext():
        if _is_writer():
            run_dir.remove_stale_temporaries()  # a killed writer's half-written files
        config = run_dir.read_config()
        if config.imported:
            raise ValueError(
                f"{run_dir.path} holds a model imported from {config.provenance.get('source', 'elsewhere')}: "
                "it has no training state to resume (continue training it where it was trained, e.g. "
                "after `attnres-lens export-fla`)"
            )
        changed = {
            name: value
            for name, value in (("steps", steps), ("device", device), ("threads", threads))
            if value is not None
        }
        if changed:  # replace() validates them as a new config would
            config.train = dataclasses.replace(config.train, **changed)
        if run_dir.read_index().latest is None:
            raise RunDirError(
                f"{run_dir.path} has no checkpoint to resume from; remove it and start again with `attnres-lens train`"
            )
        name = run_dir.resolve_checkpoint(checkpoint)
        trainer = Trainer(config, run_dir.path, progress)
        trainer.load_training_state(name)
        if trainer.step >= config.train.steps:  # checked before fit() rewrites config.json
            if steps is None:
                raise ValueError(
                    f"{run_dir.path} is complete (step {trainer.step} of {config.train.steps}); to train "
                    f"further give a larger total with --steps N (N > {trainer.step})"
                )
            raise ValueError(
                f"--steps {steps} is not above the step of {run_dir.path}'s checkpoint {name} "
                f"({trainer.step}); give a larger total"
            )
        if trainer.rank == 0:
            run_dir.truncate_checkpoints(name)
            run_dir.truncate_metrics(trainer.step)
            trainer.recorder.load(run_dir.read_records(), trainer.step)
        trainer.fit()
    return trainer
