"""The training loop: AdamW + warm-up/cosine, periodic eval, recording and checkpoints, resumable.

One `RunConfig` (model + task + train) fully determines a run. `train(config, out_dir)` starts one,
`resume(out_dir)` continues it after a crash with the same loss curve. Data parallel: launch with
`torchrun --nproc-per-node N -m attnres_lens.cli train …`; every rank draws the same global batch and
keeps its rows, gradients are averaged with `all_reduce`, and only rank 0 writes the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import attnres_lens
from attnres_lens.config import ModelConfig
from attnres_lens.model import HookedTransformer, next_token_loss, param_groups
from attnres_lens.recorder import Recorder
from attnres_lens.rundir import (
    RunDirError,
    atomic_save_safetensors,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_parquet,
    checkpoint_name,
    read_checkpoint_index,
    read_records,
    read_run_config,
    read_safetensors,
)
from attnres_lens.tasks import make_task
from attnres_lens.tasks.base import IGNORE_INDEX, Batch
from attnres_lens.tasks.induction import repeated_tokens

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    eval_every: int = 100
    eval_size: int = 256  # sequences in the fixed held-out set
    record_every: int = 100
    record_size: int = 32  # sequences of the eval set used by the recorder
    checkpoint_every: int = 500
    keep_checkpoints: int = 2  # the last K are kept, plus the best by eval loss
    log_every: int = 10
    device: str = "auto"
    # torch threads on CPU; 0 = torch's default (one per core). Measured on 2 cores, one training process runs
    # 1.4-1.6x faster with 2 threads than with 1 (analyses/reports/bench_cpu_step.md); give each process
    # 1 thread when several train side by side, as the reproductions do.
    threads: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for name in ("steps", "batch_size", "eval_every", "eval_size", "record_every", "record_size",
                     "checkpoint_every", "keep_checkpoints", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"train.threads must be an integer >= 0 (0 = one per core), got {self.threads!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"train.lr must be a number > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("train.weight_decay and train.grad_clip must be >= 0")
        if self.device not in DEVICES:
            raise ValueError(f"train.device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.record_size > self.eval_size:
            raise ValueError(f"train.record_size={self.record_size} must be <= train.eval_size={self.eval_size}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up over `warmup_steps`, then cosine down to `lr * min_lr_ratio` at `steps`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class RunConfig:
    model: ModelConfig
    task: dict[str, Any]  # {"name": ..., **task parameters}
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "task": dict(self.task),
            "train": dataclasses.asdict(self.train),
            "preset": self.preset,
            "seed": self.train.seed,
            "version": attnres_lens.__version__,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(data["train"]) - train_fields)
        if unknown:
            raise ValueError(f"unknown train field(s) {unknown}; known fields: {sorted(train_fields)}")
        return cls(ModelConfig.from_dict(data["model"]), dict(data["task"]), TrainConfig(**data["train"]), data.get("preset"))

    def build_task(self):
        params = dict(self.task)
        name = params.pop("name")
        return make_task(name, **params)


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
    def __init__(self, config: RunConfig, out_dir: Path, progress: bool = True):
        self.config = config
        self.out_dir = Path(out_dir)
        self.progress = progress
        train_cfg = config.train
        self.rank, self.world = distributed_context()
        if train_cfg.batch_size % self.world:
            raise ValueError(f"train.batch_size={train_cfg.batch_size} must be divisible by the {self.world} processes")
        self.device = resolve_device(train_cfg.device)
        if self.device.type == "cpu" and train_cfg.threads:
            torch.set_num_threads(train_cfg.threads)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

        self.task = config.build_task()
        if not getattr(self.task, "for_training", True):
            raise ValueError(f"task {self.task.name!r} is a scoring probe, not a training task (a positional head solves it)")
        model_cfg = config.model
        if self.task.vocab_size > model_cfg.d_vocab or self.task.seq_len > model_cfg.n_ctx:
            raise ValueError(
                f"task needs vocab {self.task.vocab_size} and length {self.task.seq_len}, but the model has "
                f"d_vocab={model_cfg.d_vocab}, n_ctx={model_cfg.n_ctx}; set model.d_vocab / model.n_ctx to at least those"
            )
        model_cfg = dataclasses.replace(model_cfg, device=str(self.device), seed=train_cfg.seed)
        self.model = HookedTransformer(model_cfg)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, train_cfg.weight_decay), lr=train_cfg.lr, betas=train_cfg.betas,
            fused=self.device.type == "cuda",
        )
        self.data_generator = self.task.train_generator()
        self.eval_batch = self.task.eval_batch(train_cfg.eval_size).to(self.device)
        probe_half = (min(self.task.seq_len, model_cfg.n_ctx) - 1) // 2
        probe = repeated_tokens(train_cfg.record_size, probe_half, self.task.vocab_size,
                                torch.Generator().manual_seed(train_cfg.seed + 1))
        self.recorder = Recorder(self.model, self._head(self.eval_batch, train_cfg.record_size), probe.to(self.device))
        self.step = 0
        self.last_eval: dict[str, float] = {}

    @staticmethod
    def _head(batch: Batch, n: int) -> Batch:
        return Batch(batch.tokens[:n], batch.targets[:n], batch.answer_mask[:n])

    # ------------------------------------------------------------------ public
    def fit(self) -> None:
        cfg = self.config.train
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.out_dir / "config.json", self.config.to_dict())
            if self.step == 0:
                self._evaluate_and_log(0, {})
                self.recorder.record(0)
                self._write_records()
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not self.progress or self.rank != 0,
                   desc=self.out_dir.name, unit="step", dynamic_ncols=True)
        window = {"loss": 0.0, "tokens": 0, "n": 0, "time": time.perf_counter()}
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
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    elapsed = time.perf_counter() - window["time"]
                    train_metrics = {"loss": window["loss"] / window["n"], "grad_norm": grad_norm,
                                     "lr": cfg.lr_at(self.step - 1), "tokens_per_s": window["tokens"] / max(elapsed, 1e-9)}
                    self._evaluate_and_log(self.step, train_metrics)
                    bar.set_postfix(self._postfix(train_metrics))
                    window = {"loss": 0.0, "tokens": 0, "n": 0, "time": time.perf_counter()}
                if self.step % cfg.record_every == 0 or self.step == cfg.steps:
                    self.recorder.record(self.step)
                    self._write_records()
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self._save_checkpoint()
        finally:
            bar.close()
            if dist.is_initialized():
                dist.barrier()

    def _postfix(self, train_metrics: dict[str, float]) -> dict[str, str]:
        postfix = {"loss": f"{train_metrics['loss']:.3f}", "tok/s": f"{train_metrics['tokens_per_s']:.0f}"}
        if self.last_eval:
            postfix["acc"] = f"{self.last_eval['eval_accuracy']:.1%}"
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
        if not torch.isfinite(loss):
            raise TrainingDiverged(
                f"loss became {loss.item()} at step {self.step + 1}; training stopped. The last good checkpoint is "
                f"kept in {self.out_dir / 'checkpoints'}; start a new run with a lower learning rate "
                "(--set train.lr=...) or a longer warm-up (--set train.warmup_steps=...)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.world > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                    param.grad /= self.world
            dist.all_reduce(loss_for_log := loss.detach().clone(), op=dist.ReduceOp.SUM)
            loss_value = loss_for_log.item() / self.world
        else:
            loss_value = loss.item()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.optimizer.step()
        return loss_value, grad_norm, batch.tokens.numel()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss over every next-token position and accuracy over the answer positions, on the held-out set."""
        self.model.eval()
        batch = self.eval_batch
        losses, correct, counted = [], 0, 0
        for start in range(0, batch.tokens.shape[0], 64):
            tokens = batch.tokens[start : start + 64]
            targets = batch.targets[start : start + 64]
            mask = batch.answer_mask[start : start + 64]
            logits = self.model(tokens).float()
            losses.append(torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"))
            correct += (logits.argmax(-1) == targets)[mask].sum().item()
            counted += mask.sum().item()
        n_targets = (batch.targets != IGNORE_INDEX).sum().item()
        self.model.train()
        return {"eval_loss": torch.stack(losses).sum().item() / n_targets,
                "eval_accuracy": correct / counted if counted else float("nan")}

    def _evaluate_and_log(self, step: int, train_metrics: dict[str, float]) -> None:
        cfg = self.config.train
        record = {"step": step, "tokens": step * cfg.batch_size * self.task.seq_len, **train_metrics}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            self.last_eval = self.evaluate()
            record.update(self.last_eval)
        with open(self.out_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    # ------------------------------------------------------------------ persistence
    def _write_records(self) -> None:
        records_dir = self.out_dir / "records"
        records_dir.mkdir(exist_ok=True)
        for name, frame in self.recorder.tables().items():
            atomic_write_parquet(records_dir / f"{name}.parquet", frame)

    def _save_checkpoint(self) -> None:
        checkpoints = self.out_dir / "checkpoints"
        checkpoints.mkdir(exist_ok=True)
        name = checkpoint_name(self.step)
        eval_loss = self.evaluate()["eval_loss"]
        weights_meta = {"model_config": self.model.cfg.to_json(), "run_config": json.dumps(self.config.to_dict()),
                        "step": str(self.step), "eval_loss": repr(eval_loss)}
        state, state_meta = self._training_state()
        # State first, weights second: a weights file on disk implies its state file is complete.
        atomic_save_safetensors(checkpoints / f"{name}.state.safetensors", state, state_meta)
        atomic_save_safetensors(checkpoints / f"{name}.safetensors", dict(self.model.state_dict()), weights_meta)

        index = read_checkpoint_index(self.out_dir)
        kept = [n for n in index.get("kept", []) if n != name] + [name]
        if eval_loss < index.get("best_eval_loss", math.inf) or index.get("best") is None:
            index.update(best=name, best_eval_loss=eval_loss)
        keep = set(kept[-self.config.train.keep_checkpoints :]) | {index["best"]}
        index.update(latest=name, kept=[n for n in kept if n in keep])
        atomic_write_json(checkpoints / "index.json", index)
        for old in set(kept) - keep:  # only after the index no longer names them
            for suffix in (".safetensors", ".state.safetensors"):
                (checkpoints / f"{old}{suffix}").unlink(missing_ok=True)

    def _training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Optimiser moments, RNG states and counters as tensors + JSON metadata (no pickle)."""
        tensors: dict[str, torch.Tensor] = {}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                tensors[f"optim.{names[id(param)]}.{key}"] = torch.as_tensor(value).clone()
        tensors["rng.data"] = self.data_generator.get_state()
        tensors["rng.torch"] = torch.get_rng_state()
        meta = {"step": str(self.step), "format": "attnres_lens.state.v1"}
        return tensors, meta

    def load_training_state(self, name: str) -> None:
        checkpoints = self.out_dir / "checkpoints"
        weights, meta = read_safetensors(checkpoints / f"{name}.safetensors")
        state, state_meta = read_safetensors(checkpoints / f"{name}.state.safetensors")
        try:
            self.model.load_state_dict({k: v.to(self.device) for k, v in weights.items()})
        except RuntimeError as err:
            raise RunDirError(f"checkpoint {name} does not match the run's model config: {err}") from err
        params = dict(self.model.named_parameters())
        for key, value in state.items():
            if key.startswith("optim."):
                param_name, _, slot = key[len("optim."):].rpartition(".")
                if param_name not in params:
                    raise RunDirError(f"checkpoint {name}: optimiser state for unknown parameter {param_name}")
                self.optimizer.state[params[param_name]][slot] = value.to(self.device)
        self.data_generator.set_state(state["rng.data"])
        torch.set_rng_state(state["rng.torch"])
        self.step = int(state_meta["step"])


# ---------------------------------------------------------------------------- entry points
def train(config: RunConfig, out_dir: str | Path, progress: bool = True) -> Trainer:
    """Start a new run in `out_dir` (which must not hold a run yet) and train it to the end."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        raise FileExistsError(f"{out_dir} already holds a run; resume it with `attnres-lens train --resume {out_dir}` "
                              "or choose another --out")
    trainer = Trainer(config, out_dir, progress)
    trainer.fit()
    return trainer


def resume(out_dir: str | Path, progress: bool = True, steps: Optional[int] = None) -> Trainer:
    """Continue a run from its latest checkpoint; the loss curve continues as if never interrupted.

    `steps` sets a new, larger total step budget (the cosine schedule then stretches to it); a run that has
    reached its budget needs one to continue.
    """
    out_dir = Path(out_dir)
    raw = read_run_config(out_dir)
    try:
        config = RunConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise RunDirError(f"{out_dir / 'config.json'} is invalid: {err}") from err
    if steps is not None:
        config.train.steps = steps
    trainer = Trainer(config, out_dir, progress)
    index = read_checkpoint_index(out_dir)
    if index.get("latest") is None:
        raise RunDirError(f"{out_dir} has no checkpoint to resume from; remove it and start again with `attnres-lens train`")
    trainer.load_training_state(index["latest"])
    if trainer.step >= config.train.steps:  # checked before fit() rewrites config.json
        if steps is None:
            raise ValueError(f"{out_dir} is complete (step {trainer.step} of {config.train.steps}); to train further "
                             f"give a larger total with --steps N (N > {trainer.step})")
        raise ValueError(f"--steps {steps} is not above the step of {out_dir}'s latest checkpoint ({trainer.step}); "
                         f"give a larger total")
    if trainer.rank == 0:
        truncate_metrics(out_dir, trainer.step)
        trainer.recorder.load(read_records(out_dir), trainer.step)
    trainer.fit()
    return trainer


def truncate_metrics(out_dir: Path, step: int) -> None:
    """Drop metric lines logged after `step` (they are logged again, identically, after resuming)."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a line torn by the crash
    atomic_write_bytes(path, ("\n".join(kept) + "\n").encode() if kept else b"")
