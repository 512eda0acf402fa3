"""Attribution through depth (docs/analysis.md §11): which earlier sublayers a prediction, or a sublayer's input,
uses, and whether through the value a source carries or the routing weight it gets.

Notation as in docs/analysis.md §1: consumer c (sublayer, or J = the final readout) reads sources `v_s` with
weights `α_s` (all 1 for the standard residual, whose sources are `e` and each `f_j`) and input `h_c = Σ_s α_s v_s`.
Everything is read through hook points from one clean pass: the embedding, every sublayer output `f_j` (sources
are sums of them, rebuilt from `model.sources(c)`), every input, α and the depth logits, and the final norm's
scale; the final readout's input at `readout_input_hook`. All reads are the depth-mixing model protocol's
(docs/architecture.md §7); the direct logit attribution also needs its optional `frozen_readout`.

* `depth_logit_attribution` — direct logit attribution through depth. With the final norm's scale σ frozen at
  its clean value (as TransformerLens does), `logit_t = Σ_s α_s (g ⊙ v_s / σ) · W_U[:, t] + b_U[t]` exactly, one
  term per source of the final readout (standard: `e` and each `f_j`, TL's per-component form; Inkling: v_s the
  normalised sources, `depth_values`; mHC and DeepSeek V4: α is M's row J), or the same for a logit difference
  `t − t'`. On Inkling the logit is the pre-soft-cap one.
* `depth_input_decomposition` — the same split of every sublayer input: `α_s v_s` per source, its norm and its
  projection share `⟨α_s v_s, h_c⟩ / ‖h_c‖²` (the shares of a consumer sum to 1).
* `source_logit_lens` — every source and every sublayer input decoded through the final norm (recomputed on the
  vector itself) and the unembedding: top-k tokens and the correct token's rank, per depth.
* `edge_sensitivity` — first-order estimates, from one forward and one backward pass, of knocking source s out
  of consumer c (for every edge at once), split into value and routing paths; or of patching each source from a
  corrupted input. `edge_agreement` compares them with the exact knockouts of `causal_routing`.
* `routing_audit` — α mass against the exact causal effect per consumer, with bootstrap confidence intervals over
  sequences, and two content-independent null schedules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from attnres_lens.analysis.engine import evaluate_many
from attnres_lens.analysis.interventions import Hook, replace_hook, source_mask_hooks
from attnres_lens.analysis.knockouts import bootstrap_weights, ranking_agreement
from attnres_lens.analysis.pruning import spearman
from attnres_lens.analysis.workers import analysis_workers
from attnres_lens.attnres import EMBEDDING
from attnres_lens.evaluation import per_sequence_losses
from attnres_lens.mixing import basis_index, mixing_coefficients, routes_are_inputs
from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import (
    SINGLE_ROUTE,
    DepthMixingModel,
    check_frozen_readout,
    depth_values,
    frozen_readout,
    model_device,
)
from attnres_lens.tasks.base import IGNORE_INDEX, Batch, check_scored_batch, check_target_ids, next_token_targets

BatchLike = Batch | torch.Tensor
# residual kinds whose inputs are weighted sums of e and every f_i with weights from `attnres_lens.mixing`
MIXED_RESIDUALS = ("denseformer", "mhc")


# ---------------------------------------------------------------------------- one clean pass, through hooks
@dataclass
class DepthTerms:
    """What one clean pass shows about depth: inputs, outputs, weights and logits."""

    tokens: torch.Tensor
    embedding: torch.Tensor  # e (token plus learned position embedding), [batch, pos, d_model]
    outputs: list[torch.Tensor]  # f_j
    inputs: list[torch.Tensor]  # h_c for c = 0 … J (J: the final readout's input)
    mixes: dict[tuple[int, str], torch.Tensor]  # per consumer and route whose route is one whole input: what the
    # depth mix hands the layer (`route_input_hook`; h_c itself unless a message gate follows)
    weights: dict[int, torch.Tensor]  # α per consumer, [batch, pos, n_sources] ([batch, pos, route, n_sources] with
    # several routes; for DenseFormer and mHC the depth-mixing coefficient of each output, docs/analysis.md §5)
    depth_logits: dict[int, torch.Tensor]  # z per consumer (depth-mixing consumers only)
    logits: torch.Tensor
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    def source_vectors(self, model: DepthMixingModel, consumer: int) -> list[torch.Tensor]:
        """The sources `consumer` reads, rebuilt as the model sums them (members in forward order)."""
        vectors = []
        for members in model.sources(consumer):
            total = None
            for member in members:
                vector = self.embedding if member == EMBEDDING else self.outputs[member]
                total = vector if total is None else total + vector
            vectors.append(total)
        return vectors

    def alpha(self, model: DepthMixingModel, consumer: int) -> torch.Tensor:
        """α of `consumer` ([batch, pos, n_sources]; ones for the standard residual)."""
        if consumer in self.weights:
            return self.weights[consumer]
        n_sources = len(model.sources(consumer))
        return torch.ones(
            *self.embedding.shape[:-1], n_sources, dtype=self.embedding.dtype, device=self.embedding.device
        )


def _check_single_head_mix(model: DepthMixingModel, what: str) -> None:
    """Refuse consumers whose routes mix slices of one input (the toolkit's channel groups); routes that are whole
    inputs (Inkling's q, k, v) are each decomposed on their own."""
    for consumer in model.consumers():
        routes = model.routes(consumer)
        if not routes_are_inputs(model, consumer):
            heads = f"heads={model.cfg.attnres_heads}" if isinstance(model, HookedTransformer) else f"routes {routes}"
            raise ValueError(
                f"{what} needs one weight per source; this model's depth attention has {heads} "
                f"({model.sublayer_name(consumer)})"
            )


def _mixed_by_coefficients(model: DepthMixingModel) -> bool:
    """Whether `model`'s sublayer inputs are sums weighted by M with no depth softmax: the toolkit's DenseFormer and
    mHC, or a protocol model without consumers that computes M itself (DeepSeek V4's bridge, docs/interop.md §7)."""
    if isinstance(model, HookedTransformer):
        return model.cfg.residual in MIXED_RESIDUALS
    return not model.consumers() and getattr(model, "mixing_coefficients", None) is not None


def _require_consumers(model: DepthMixingModel, what: str) -> list[int]:
    """The model's depth-mixing consumers; none is a clear error naming the residual."""
    consumers = model.consumers()
    if not consumers and isinstance(model, HookedTransformer):
        raise ValueError(f"{what} needs depth attention; this model's residual is {model.cfg.residual!r}")
    if not consumers:  # DeepSeek V4's bridge: hyper-connections, whose mixing is M (docs/interop.md §7)
        mixing = " (its mixing is M: mixing_coefficients, the depth_mixing table)"
        raise ValueError(
            f"{what} needs depth attention; {type(model).__name__} has no depth softmax"
            + (mixing if getattr(model, "mixing_coefficients", None) is not None else "")
        )
    return consumers


def depth_terms(model: DepthMixingModel, tokens: torch.Tensor, gradient_of: Callable | None = None) -> DepthTerms:
    """One pass read through hook points. With `gradient_of(logits) -> scalar`, also the gradients of that
    scalar with respect to α of every consumer (`grads["weights", c]`) and every input (`grads["inputs", c]`),
    by `torch.autograd.grad` (the model's parameter gradients are left untouched)."""
    tokens = model.to_tokens(tokens)
    n_sublayers = model.n_sublayers
    consumers = model.consumers()
    embedding_hooks = model.embedding_hooks
    names: dict[Any, str] = {("embed", i): name for i, name in enumerate(embedding_hooks)}
    names.update({("out", j): model.sublayer_output_hook(j) for j in range(n_sublayers)})
    names.update({("in", j): model.sublayer_input_hook(j) for j in range(n_sublayers)})
    names[("in", n_sublayers)] = model.readout_input_hook
    for consumer in consumers:
        names[("alpha", consumer)] = model.depth_hook(consumer, "weights")
        names[("z", consumer)] = model.depth_hook(consumer, "logits")
        if routes_are_inputs(model, consumer):
            names.update({("mix", consumer, r): model.route_input_hook(consumer, r) for r in model.routes(consumer)})
    saved: dict[Any, torch.Tensor] = {}
    by_name: dict[str, list[Any]] = {}  # one hook may serve several keys (a mix that is its sublayer's input)
    for key, name in names.items():
        by_name.setdefault(name, []).append(key)

    def save(tensor: torch.Tensor, hook) -> None:
        for key in by_name[hook.name]:
            saved[key] = tensor

    def leaf(tensor: torch.Tensor, hook) -> torch.Tensor:
        # a fresh leaf, so gradients exist even if the parameters are frozen; same values
        tensor = tensor.detach().requires_grad_(True)
        saved[("embed", 0)] = tensor
        return tensor

    root = embedding_hooks[0]
    fwd_hooks: list[Hook] = [(name, save) for name in names.values() if name != root]
    fwd_hooks.append((root, leaf if gradient_of is not None else save))
    with torch.set_grad_enabled(gradient_of is not None), model.hooks(fwd_hooks=fwd_hooks):
        logits = model(tokens)
    embedding = saved[("embed", 0)]
    for i in range(1, len(embedding_hooks)):
        embedding = embedding + saved[("embed", i)]
    terms = DepthTerms(
        tokens=tokens,
        embedding=embedding,
        outputs=[saved[("out", j)] for j in range(n_sublayers)],
        inputs=[saved[("in", j)] for j in range(n_sublayers + 1)],
        mixes={key[1:]: tensor for key, tensor in saved.items() if key[0] == "mix"},
        weights={c: saved[("alpha", c)] for c in consumers},
        depth_logits={c: saved[("z", c)] for c in consumers},
        logits=logits,
    )
    if gradient_of is not None:
        targets = [(("weights", c), terms.weights[c]) for c in terms.weights]
        targets += [(("inputs", c), terms.inputs[c]) for c in range(n_sublayers + 1)]
        grads = torch.autograd.grad(gradient_of(logits), [tensor for _, tensor in targets], allow_unused=True)
        terms.grads = {
            key: (torch.zeros_like(tensor) if grad is None else grad).detach()
            for (key, tensor), grad in zip(targets, grads)
        }
    terms = _detached(terms)
    if _mixed_by_coefficients(model):
        # h_c = Σ_i M[c, i] f_i + M[c, e] e exactly, token by token
        coefficients = mixing_coefficients(model, tokens).to(terms.embedding)
        terms.weights = {
            c: coefficients[..., c, [basis_index(members[0]) for members in model.sources(c)]]
            for c in range(n_sublayers + 1)
        }
    return terms


def _detached(terms: DepthTerms) -> DepthTerms:
    detach = lambda tensor: tensor.detach()  # noqa: E731
    terms.embedding = detach(terms.embedding)
    terms.outputs = [detach(t) for t in terms.outputs]
    terms.inputs = [detach(t) for t in terms.inputs]
    terms.mixes = {key: detach(t) for key, t in terms.mixes.items()}
    terms.weights = {c: detach(t) for c, t in terms.weights.items()}
    terms.depth_logits = {c: detach(t) for c, t in terms.depth_logits.items()}
    terms.logits = detach(terms.logits)
    return terms


def _as_batch(model: DepthMixingModel, batch: BatchLike) -> Batch:
    """A Batch as given, or tokens with next-token targets at every position but the last (all of them answers)."""
    if isinstance(batch, Batch):
        return check_scored_batch(batch.to(model_device(model)), model.d_vocab)
    return check_scored_batch(Batch.from_tokens(model.to_tokens(batch)), model.d_vocab)  # refuses one-token rows


def _target_ids(model: DepthMixingModel, tokens: torch.Tensor, targets: torch.Tensor | None, what: str) -> torch.Tensor:
    if targets is None:
        return next_token_targets(tokens)
    return check_target_ids(targets, tokens.shape, model.d_vocab, what).to(tokens.device)


def _source_info(model: DepthMixingModel, consumer: int) -> list[dict[str, Any]]:
    return [
        dict(source=s, source_label=label, members=",".join(map(str, members)))
        for s, (label, members) in enumerate(zip(model.source_labels(consumer), model.sources(consumer)))
    ]


def _consumer_info(model: DepthMixingModel, consumer: int) -> dict[str, Any]:
    return dict(consumer=consumer, consumer_label=model.sublayer_name(consumer), kind=model.sublayer_kind(consumer))


# ---------------------------------------------------------------------------- direct logit attribution
@torch.no_grad()
def depth_logit_attribution(
    model: DepthMixingModel,
    tokens: torch.Tensor,
    targets: torch.Tensor | None = None,
    incorrect: torch.Tensor | None = None,
) -> pd.DataFrame:
    """Exact per-source decomposition of a logit (or logit difference) at every position, the final norm's scale
    frozen at its clean value.

    `targets` [batch, pos] are the token ids whose logit is attributed (default: the next token; the last
    position has none); `incorrect` [batch, pos], if given, turns it into `logit(target) − logit(incorrect)`.
    Positions whose target is −100 are skipped. One row per (sequence, position, source of the final readout):
    sequence, position, token, target, incorrect, source, source_label, members (sublayer indices summed in the
    source, −1 = embedding), alpha, contribution; and per position, repeated on its rows: logit (the clean value
    attributed) and bias (the unembedding bias term). `Σ_source contribution + bias = logit` exactly, with
    contribution `α_s (g ⊙ v_s / σ) · W_U[:, t]` and v_s the vector the final mix sums (`depth_values`: the source
    itself, or Inkling's RMS-normalised source).

    Needs the model's optional `frozen_readout` (docs/architecture.md §7): the toolkit's `HookedTransformer`, the
    bridged Inkling-2 / Inkling-2-Mini and DeepSeek V4 have it. On Inkling the logit soft-cap follows the
    unembedding and is not linear: `logit` is the pre-cap logit (what `lm_head` returns), attributed exactly. On
    DeepSeek V4 α is M's row J, the `hc_head` read weights frozen at the clean pass as σ is (docs/interop.md §7).
    """
    check_frozen_readout(model)
    _check_single_head_mix(model, "depth_logit_attribution")
    tokens = model.to_tokens(tokens)
    targets = _target_ids(model, tokens, targets, "targets")
    if incorrect is not None:
        incorrect = _target_ids(model, tokens, incorrect, "incorrect")
        incorrect = torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, incorrect)
    terms = depth_terms(model, tokens)
    final = model.n_sublayers
    frozen = frozen_readout(model, terms.inputs[final])
    keep = targets != IGNORE_INDEX
    if incorrect is not None:
        keep &= incorrect != IGNORE_INDEX
    sequence, position = keep.nonzero(as_tuple=True)
    target = targets[keep]
    W_U = frozen.unembedding.double()
    direction = W_U[:, target].T  # [n, d_model]
    bias = _bias(frozen.bias, target)
    if incorrect is not None:
        wrong = incorrect[keep]
        direction = direction - W_U[:, wrong].T
        bias = bias - _bias(frozen.bias, wrong)
    # the final norm with its scale frozen: v ↦ g ⊙ v / σ, linear in v
    gain, scale = frozen.gain.double(), frozen.scale[keep].double()
    alpha = terms.alpha(model, final)[keep].double()  # [n, n_sources]
    values = depth_values(model, final, terms.source_vectors(model, final))
    rows = []
    for source, (info, vector) in enumerate(zip(_source_info(model, final), values)):
        contribution = alpha[:, source] * ((vector[keep].double() / scale * gain) * direction).sum(-1)
        rows.append(
            pd.DataFrame(
                {
                    **info,
                    "alpha": alpha[:, source].cpu().numpy(),
                    "contribution": contribution.cpu().numpy(),
                    "_row": np.arange(len(target)),
                }
            )
        )
    clean = frozen.logits[keep].double()
    logit = clean.gather(-1, target[:, None]).squeeze(-1)
    if incorrect is not None:
        logit = logit - clean.gather(-1, incorrect[keep][:, None]).squeeze(-1)
    per_position = pd.DataFrame(
        {
            "_row": np.arange(len(target)),
            "sequence": sequence.cpu().numpy(),
            "position": position.cpu().numpy(),
            "token": tokens[keep].cpu().numpy(),
            "target": target.cpu().numpy(),
            "incorrect": (incorrect[keep].cpu().numpy() if incorrect is not None else np.full(len(target), -1)),
            "logit": logit.cpu().numpy(),
            "bias": bias.cpu().numpy(),
        }
    )
    frame = pd.concat(rows, ignore_index=True).merge(per_position, on="_row")
    columns = [
        "sequence",
        "position",
        "token",
        "target",
        "incorrect",
        "source",
        "source_label",
        "members",
        "alpha",
        "contribution",
        "logit",
        "bias",
    ]
    return frame.sort_values(["sequence", "position", "source"], ignore_index=True)[columns]


def _bias(b_U: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(len(ids), dtype=torch.float64, device=ids.device) if b_U is None else b_U.double()[ids]


def logit_attribution_summary(attribution: pd.DataFrame) -> pd.DataFrame:
    """Per source: mean contribution over the attributed positions, its share of the mean |contribution|, and
    the mean α (columns source, source_label, members, mean_contribution, mean_abs_contribution, share, mean_alpha)."""
    grouped = attribution.groupby(["source", "source_label", "members"], sort=True)
    summary = grouped.agg(
        mean_contribution=("contribution", "mean"),
        mean_abs_contribution=("contribution", lambda c: c.abs().mean()),
        mean_alpha=("alpha", "mean"),
    ).reset_index()
    total = summary["mean_abs_contribution"].sum()
    summary["share"] = summary["mean_abs_contribution"] / total if total > 0 else float("nan")
    return summary


@torch.no_grad()
def depth_input_decomposition(model: DepthMixingModel, tokens: torch.Tensor, per_token: bool = False) -> pd.DataFrame:
    """Every consumer's input split into its per-source terms `α_s v_s` (v_s the vector the mix sums:
    the source itself, or with a value transform, `depth_values`, Inkling's RMS-normalised `r_s b_s`).

    Token-averaged (default), one row per (consumer, route, source): consumer, consumer_label, kind, route ('mix'
    for one softmax; 'q', 'k', 'v' where a consumer feeds several inputs), source, source_label, members, alpha,
    term_norm (‖α_s v_s‖), share (`⟨α_s v_s, h⟩ / ‖h‖²` with h the route's mix output, `route_input_hook`; a
    route's shares sum to 1 at every token, since `Σ_s α_s v_s = h`). With `per_token`, the same per (sequence,
    position). Every sublayer and the final readout for the toolkit's model (a plain sum has α = 1) and for a
    protocol model mixed by M alone (DeepSeek V4: α is M); a protocol model's consumers otherwise (a message gate
    that follows a mix is not part of it).
    """
    _check_single_head_mix(model, "depth_input_decomposition")
    terms = depth_terms(model, tokens)
    frames = []
    batch, pos = terms.tokens.shape
    every = isinstance(model, HookedTransformer) or _mixed_by_coefficients(model)
    mixes = set(model.consumers())  # DenseFormer's and mHC's weights come from M: no depth softmax, one route
    for consumer in range(model.n_sublayers + 1) if every else _require_consumers(model, "the input decomposition"):
        routes = model.routes(consumer) if consumer in mixes else [SINGLE_ROUTE]
        alpha = terms.alpha(model, consumer).double()
        by_route = alpha if len(routes) > 1 else alpha.unsqueeze(-2)
        sources = [vector.double() for vector in terms.source_vectors(model, consumer)]
        values = depth_values(model, consumer, sources) if consumer in mixes else sources
        for r, route in enumerate(routes):
            h = terms.mixes.get((consumer, route), terms.inputs[consumer]).double()
            norm2 = (h * h).sum(-1).clamp_min(1e-300)
            for info, vector, a in zip(_source_info(model, consumer), values, by_route[..., r, :].unbind(-1)):
                term = a[..., None] * vector
                values_of = {"alpha": a, "term_norm": term.norm(dim=-1), "share": (term * h).sum(-1) / norm2}
                if per_token:
                    frame = pd.DataFrame({key: value.reshape(-1).cpu().numpy() for key, value in values_of.items()})
                    frame.insert(0, "position", np.tile(np.arange(pos), batch))
                    frame.insert(0, "sequence", np.repeat(np.arange(batch), pos))
                else:
                    frame = pd.DataFrame({key: [value.mean().item()] for key, value in values_of.items()})
                labels = {**_consumer_info(model, consumer), "route": route, **info}
                for key, value in reversed(list(labels.items())):
                    frame.insert(0, key, value)
                frames.append(frame)
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------------------- logit lens over depth
@torch.no_grad()
def source_logit_lens(
    model: DepthMixingModel, tokens: torch.Tensor, k: int = 5, targets: torch.Tensor | None = None
) -> pd.DataFrame:
    """Every source and every sublayer input decoded through the final norm (its scale recomputed on the vector
    itself) and the unembedding.

    Vectors, in depth order: the sources `e` and each `f_j` (for Block AttnRes also each completed block sum
    and the last partial the final readout reads), then each sublayer input `h_c` and the final readout's input.
    One row per (sequence, position, vector) with a target (default: the next token): sequence, position, token,
    target, vector ("source" / "input"), index (sublayer or consumer, −1 = embedding), label, target_rank (0 =
    top), target_prob, target_logit, top_tokens and top_probs (the k best, space-separated).
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= model.d_vocab:
        raise ValueError(f"k must be an integer in 1..{model.d_vocab}, got {k!r}")
    tokens = model.to_tokens(tokens)
    targets = _target_ids(model, tokens, targets, "targets")
    terms = depth_terms(model, tokens)
    keep = targets != IGNORE_INDEX
    sequence, position = keep.nonzero(as_tuple=True)
    target = targets[keep]
    frames = []
    for vector_kind, index, label, vector in _lens_vectors(model, terms):
        logits = model.readout(vector[keep]).double()
        probs = logits.softmax(-1)
        target_logit = logits.gather(-1, target[:, None]).squeeze(-1)
        top_probs, top_ids = probs.topk(k, dim=-1)
        frames.append(
            pd.DataFrame(
                {
                    "sequence": sequence.cpu().numpy(),
                    "position": position.cpu().numpy(),
                    "token": tokens[keep].cpu().numpy(),
                    "target": target.cpu().numpy(),
                    "vector": vector_kind,
                    "index": index,
                    "label": label,
                    "target_rank": (logits > target_logit[:, None]).sum(-1).cpu().numpy(),
                    "target_prob": probs.gather(-1, target[:, None]).squeeze(-1).cpu().numpy(),
                    "target_logit": target_logit.cpu().numpy(),
                    "top_tokens": [" ".join(map(str, row)) for row in top_ids.tolist()],
                    "top_probs": [" ".join(f"{p:.3f}" for p in row) for row in top_probs.tolist()],
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def _lens_vectors(model: DepthMixingModel, terms: DepthTerms) -> list[tuple[str, int, str, torch.Tensor]]:
    n_sublayers = model.n_sublayers
    vectors = [("source", EMBEDDING, "emb", terms.embedding)]
    vectors += [("source", j, model.sublayer_name(j), terms.outputs[j]) for j in range(n_sublayers)]
    # Block AttnRes: the sums the final readout reads, where they are not single outputs
    for members, label, vector in zip(
        model.sources(n_sublayers), model.source_labels(n_sublayers), terms.source_vectors(model, n_sublayers)
    ):
        if len(members) > 1:
            vectors.append(
                ("source", members[-1], f"{label} = " + "+".join(model.sublayer_name(m) for m in members), vector)
            )
    vectors += [("input", c, f"→{model.sublayer_name(c)}", terms.inputs[c]) for c in range(n_sublayers + 1)]
    return vectors


def logit_lens_summary(lens: pd.DataFrame) -> pd.DataFrame:
    """Per decoded vector, in depth order: mean target_rank, top1 (share of positions where the target ranks
    first) and mean target_prob."""
    order = lens[["vector", "index", "label"]].drop_duplicates().reset_index(drop=True)
    summary = (
        lens.groupby(["vector", "index", "label"], sort=False)
        .agg(
            mean_rank=("target_rank", "mean"),
            top1=("target_rank", lambda r: float((r == 0).mean())),
            mean_target_prob=("target_prob", "mean"),
        )
        .reset_index()
    )
    return order.merge(summary, on=["vector", "index", "label"])


# ---------------------------------------------------------------------------- edge attribution
METRICS = ("loss", "answer_loss")


def _differentiable_metric(batch: Batch, metric: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The evaluation metric (evaluation.py) as a differentiable function of the logits."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    targets = batch.targets
    if metric == "answer_loss":
        targets = torch.where(batch.answer_mask, targets, IGNORE_INDEX)
    if not (targets != IGNORE_INDEX).any():
        raise ValueError(f"the batch has no positions to score for metric {metric!r}")

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), ignore_index=IGNORE_INDEX)

    return loss


def edge_sensitivity(
    model: DepthMixingModel, batch: BatchLike, corrupted: torch.Tensor | None = None, metric: str = "loss"
) -> pd.DataFrame:
    """First-order estimates of Δ`metric` for every (consumer, source) edge of an AttnRes model, from one forward
    and one backward pass (gradients of the metric with respect to every consumer's α and input).

    Knockout (default; the first-order version of `causal_routing`): masking source s out of consumer c changes
    its input by `Δh = h' − h` with `h'` the renormalised mix of the other sources, `α_s (h − v_s)/(1 − α_s)`,
    which splits into the value path `−α_s v_s` and the routing path `Δh + α_s v_s`; the estimate is
    `Σ_positions (∂metric/∂h_c) · Δh`, evaluated through `∂metric/∂α_r = (∂metric/∂h_c) · v_r`. With a sigmoid
    score nothing renormalises, so the routing path is 0.

    Corrupted (`corrupted` tokens of the batch's shape): source s of consumer c is patched to its value on the
    corrupted input, `v_s + δ`, in that consumer only; to first order the value path is `α_s (∂metric/∂h_c) · δ`
    and the routing path `α_s (∂z_s/∂v_s · δ)((∂metric/∂h_c) · (v_s − h_c))`.

    One row per edge of the consumers with at least two sources: consumer, consumer_label, kind, source,
    source_label, members, alpha_mass (token-mean α_s), max_alpha (its largest value at any token: near 1 the
    knockout is far from the linear regime and the estimate fails), value_path, routing_path, total, mode.
    """
    consumers = _require_consumers(model, "edge attribution")
    batch = _as_batch(model, batch)
    objective = _differentiable_metric(batch, metric)
    terms = depth_terms(model, batch.tokens, gradient_of=objective)
    if corrupted is not None:
        corrupted = model.to_tokens(corrupted)
        if corrupted.shape != batch.tokens.shape:
            raise ValueError(
                f"corrupted tokens must have the batch's shape {tuple(batch.tokens.shape)}, got "
                f"{tuple(corrupted.shape)}"
            )
        corrupt_terms = depth_terms(model, corrupted)
    rows = []
    for consumer in consumers:
        n_sources = len(model.sources(consumer))
        if n_sources < 2:
            continue
        alpha = terms.weights[consumer].double()  # with several routes [..., route, n_sources]: their paths add
        grad = terms.grads[("weights", consumer)].double()  # ∂metric/∂α_r = g_c · v_r
        if corrupted is None:
            value, routing = _knockout_paths(
                _score(model, consumer), alpha, terms.depth_logits[consumer].double(), grad
            )
        else:
            value, routing = _patch_paths(model, consumer, alpha, grad, terms, corrupt_terms)
        for info in _source_info(model, consumer):
            s = info["source"]
            rows.append(
                {
                    **_consumer_info(model, consumer),
                    **info,
                    "alpha_mass": alpha[..., s].mean().item(),
                    "max_alpha": alpha[..., s].max().item(),
                    "value_path": value[..., s].sum().item(),
                    "routing_path": routing[..., s].sum().item(),
                    "mode": "knockout" if corrupted is None else "corrupted",
                }
            )
    frame = pd.DataFrame(rows)
    frame["total"] = frame["value_path"] + frame["routing_path"]
    return frame


def _score(model: DepthMixingModel, consumer: int) -> str:
    """How a consumer scores its logits: the toolkit's depth attention says ('softmax' or 'sigmoid'); the protocol's
    consumers run softmaxes."""
    if isinstance(model, HookedTransformer):
        return model.depth_attention_modules()[consumer].score
    return "softmax"


def _knockout_paths(
    score: str, alpha: torch.Tensor, logits: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value and routing paths of knocking out each source: [..., n_sources] each."""
    value = -alpha * grad
    if score != "softmax":  # sigmoid: the others keep their weights
        return value, torch.zeros_like(value)
    n = alpha.shape[-1]
    mixed = (alpha * grad).sum(-1, keepdim=True)  # g · h
    # the renormalised weights after masking s, from the logits (stable even when α_s rounds to 1)
    masked = logits.unsqueeze(-2).expand(*logits.shape[:-1], n, n).clone()
    masked.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
    after = (masked.softmax(-1) * grad.unsqueeze(-2)).sum(-1)  # g · h'
    return value, (after - mixed) - value


def _patch_paths(
    model: DepthMixingModel,
    consumer: int,
    alpha: torch.Tensor,
    grad: torch.Tensor,
    clean: DepthTerms,
    corrupt: DepthTerms,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(model, HookedTransformer):  # the derivative of z_s needs the query and key norm's gain
        raise ValueError(
            "patching sources from a corrupted input is derived for the toolkit's default depth attention, whose "
            "query and key-norm gain the depth-mixing model protocol does not name; use the knockout mode "
            "(corrupted=None)"
        )
    module = model.depth_attention_modules()[consumer]
    if not module.fusable:  # the options change z_s(v_s); the derivative below is the default's
        raise ValueError(
            "patching sources from a corrupted input is derived for the default depth attention "
            "(softmax over a static pseudo-query with key RMSNorm, one head)"
        )
    input_grad = clean.grads[("inputs", consumer)].double()  # g_c
    u = (module.query * module.key_norm.w).double()
    eps = module.key_norm.eps
    mixed = (alpha * grad).sum(-1, keepdim=True)  # g · h
    values, routings = [], []
    for s, (v, v_corrupt) in enumerate(
        zip(clean.source_vectors(model, consumer), corrupt.source_vectors(model, consumer))
    ):
        v = v.double()
        delta = v_corrupt.double() - v
        r = torch.rsqrt(v.pow(2).mean(-1) + eps)
        # z_s = r (u · v):  dz = r (u · δ) − r³ (u · v)(v · δ)/d
        dz = r * (delta @ u) - r.pow(3) * (v @ u) * (v * delta).sum(-1) / v.shape[-1]
        values.append(alpha[..., s] * (input_grad * delta).sum(-1))
        routings.append(alpha[..., s] * dz * (grad[..., s] - mixed[..., 0]))
    return torch.stack(values, -1), torch.stack(routings, -1)


def edge_agreement(
    edges: pd.DataFrame, routing: pd.DataFrame, top: int = 10, recall_top: int = 10
) -> tuple[dict[str, float], pd.DataFrame]:
    """How well the first-order sensitivity (`edge_sensitivity`) ranks the exact knockouts (`causal_routing`, or
    `edge_knockouts`' delta_loss).

    Returns `{spearman, pearson, top_recall (the share of the `recall_top` edges with the largest exact Δloss that
    are among the estimate's `recall_top` largest, `knockouts.ranking_agreement`), recall_top,
    spearman_within_consumer (mean over consumers with ≥ 3 sources), sign_agreement (share of edges whose exact
    |Δloss| > 1e-6 where the signs agree), n_edges}` and the `top` worst disagreements (largest |estimate − exact|)
    with both values, their ratio and max_alpha.
    """
    keys = ["consumer", "source"]
    merged = edges.merge(routing[keys + ["delta_loss"]], on=keys, how="inner")
    if merged.empty:
        raise ValueError("the edge table and the routing table share no (consumer, source) pair")
    per_consumer = [
        spearman(group["total"], group["delta_loss"]) for _, group in merged.groupby("consumer") if len(group) >= 3
    ]
    per_consumer = [value for value in per_consumer if value == value]
    clear = merged[merged["delta_loss"].abs() > 1e-6]
    ranking = ranking_agreement(merged.set_index(keys)["total"], merged.set_index(keys)["delta_loss"], recall_top)
    summary = dict(
        spearman=ranking["spearman"],
        pearson=ranking["pearson"],
        top_recall=ranking["top_recall"],
        recall_top=ranking["top"],
        spearman_within_consumer=float(np.mean(per_consumer)) if per_consumer else float("nan"),
        sign_agreement=float((np.sign(clear["total"]) == np.sign(clear["delta_loss"])).mean())
        if len(clear)
        else float("nan"),
        n_edges=int(len(merged)),
    )
    merged = merged.assign(
        error=merged["total"] - merged["delta_loss"],
        ratio=merged["total"] / merged["delta_loss"].where(merged["delta_loss"] != 0),
    )
    worst = merged.reindex(merged["error"].abs().sort_values(ascending=False, kind="stable").index).head(top)
    columns = [
        "consumer_label",
        "source_label",
        "alpha_mass",
        "max_alpha",
        "delta_loss",
        "total",
        "value_path",
        "routing_path",
        "error",
        "ratio",
    ]
    return summary, worst[columns].reset_index(drop=True)


# ---------------------------------------------------------------------------- routing audit
def routing_audit(
    model: DepthMixingModel, batch: Batch, n_boot: int = 1000, seed: int = 0, progress: bool = False
) -> dict[str, pd.DataFrame]:
    """α mass against causal effect, per consumer (and route) of an AttnRes model, with bootstrap confidence
    intervals over sequences (95%, percentile), and two content-independent null schedules.

    Exact effects: each source knocked out of each consumer alone, every route of it (as `causal_routing`), per
    sequence. Null schedules, each replacing one consumer's α at every token (`hook_weights`), every route with its
    own: `mean` — its token-averaged α (the same mass, no dependence on the content); `recency` — one profile over
    "how many sources back" pooled over all consumers and routes (the token-averaged α at each recency, averaged,
    renormalised per consumer).

    Returns `pairs` (consumer × route × source: alpha_mass (the route's), delta_loss with _low / _high) and
    `consumers` (per consumer and route: n_sources; spearman of the route's mass vs Δloss over its sources with
    _low / _high (NaN for two sources); top_mass_label, top_effect_label; null_mean_dloss and null_recency_dloss
    with _low / _high, the consumer's, the same on each of its routes). `route` is 'mix' for one softmax.
    """
    _require_consumers(model, "the routing audit")
    _check_single_head_mix(model, "routing_audit")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
        raise ValueError(f"n_boot must be an integer >= 10, got {n_boot!r}")
    batch = _as_batch(model, batch)
    n_seq = batch.tokens.shape[0]
    if n_seq < 2:
        raise ValueError("a bootstrap over sequences needs at least 2 sequences")
    terms = depth_terms(model, batch.tokens)
    consumers = [c for c in sorted(terms.weights) if terms.weights[c].shape[-1] > 1]
    by_route = {c: _with_route_axis(model, c, terms.weights[c]).double() for c in consumers}  # [b, p, route, src]
    counts = (batch.targets != IGNORE_INDEX).sum(-1).double().cpu()  # per sequence
    mass = {c: by_route[c].mean(1).cpu() for c in consumers}  # [seq, route, n_sources]
    schedules = _null_schedules(by_route, consumers, terms.embedding.dtype)

    interventions: list[list[Hook]] = [[]]
    keys: list[tuple] = [("clean",)]
    for c in consumers:
        for s in range(terms.weights[c].shape[-1]):
            interventions.append(source_mask_hooks(model, c, [s]))
            keys.append(("knockout", c, s))
        for name, schedule in schedules[c].items():
            interventions.append([(model.depth_hook(c, "weights"), replace_hook(schedule))])
            keys.append((name, c))
    losses = evaluate_many(
        model,
        batch,
        interventions,
        progress=progress,
        desc="routing audit",
        score=lambda logits, part: per_sequence_losses(logits, part.targets),
        workers=analysis_workers(model),
    )
    by_key = dict(zip(keys, losses))
    clean = by_key[("clean",)]
    weight = bootstrap_weights(n_seq, n_boot, seed)  # [n_boot, seq]

    def effect(key: tuple) -> tuple[float, torch.Tensor]:
        diff = by_key[key] - clean
        return float(diff.sum() / counts.sum()), (weight @ diff) / (weight @ counts)

    pair_rows, consumer_rows = [], []
    for c in consumers:
        n_sources = terms.weights[c].shape[-1]
        labels = model.source_labels(c)
        effects = [effect(("knockout", c, s)) for s in range(n_sources)]
        boot_effects = torch.stack([boots for _, boots in effects], -1)  # [n_boot, n_sources]
        point_effects = [value for value, _ in effects]
        nulls = {name: effect((name, c)) for name in schedules[c]}
        routes = model.routes(c)
        for r, route in enumerate(routes):
            route_mass = mass[c][:, r]  # [seq, n_sources]
            point_mass = route_mass.mean(0)  # equal positions per sequence: the token mean
            boot_mass = (weight @ route_mass) / weight.sum(-1, keepdim=True)
            info = {**_consumer_info(model, c), "route": route}
            for s in range(n_sources):
                pair_rows.append(
                    {
                        **info,
                        "source": s,
                        "source_label": labels[s],
                        "alpha_mass": point_mass[s].item(),
                        **_interval("alpha_mass", boot_mass[:, s]),
                        "delta_loss": effects[s][0],
                        **_interval("delta_loss", boot_effects[:, s]),
                    }
                )
            row = {
                **info,
                "n_sources": n_sources,
                "spearman": spearman(point_mass.tolist(), point_effects) if n_sources > 2 else float("nan"),
            }
            if n_sources > 2:
                boots = spearman_rows(boot_mass, boot_effects)
                row.update(_interval("spearman", boots[~boots.isnan()]))
            else:
                row.update(spearman_low=float("nan"), spearman_high=float("nan"))
            row.update(
                top_mass_label=labels[int(point_mass.argmax())], top_effect_label=labels[int(np.argmax(point_effects))]
            )
            for name, (value, boots) in nulls.items():
                row[f"null_{name}_dloss"] = value
                row.update(_interval(f"null_{name}_dloss", boots))
            consumer_rows.append(row)
    return {"pairs": pd.DataFrame(pair_rows), "consumers": pd.DataFrame(consumer_rows)}


def _with_route_axis(model: DepthMixingModel, consumer: int, weights: torch.Tensor) -> torch.Tensor:
    """`[batch, pos, route, n_sources]`: a one-route consumer's weights gain an axis of one."""
    return weights if len(model.routes(consumer)) > 1 else weights.unsqueeze(-2)


def spearman_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman correlation of each row of `a` with the same row of `b` ([rows, n] each; average ranks for ties,
    as `pruning.spearman`); NaN for a row where either side is constant."""

    def ranks(x: torch.Tensor) -> torch.Tensor:
        below = (x[..., :, None] > x[..., None, :]).sum(-1).double()
        ties = (x[..., :, None] == x[..., None, :]).sum(-1).double()
        return below + (ties + 1) / 2

    ra, rb = ranks(a.double()), ranks(b.double())
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    denominator = (ra.pow(2).sum(-1) * rb.pow(2).sum(-1)).sqrt()
    return torch.where(denominator > 0, (ra * rb).sum(-1) / denominator.clamp_min(1e-300), float("nan"))


def _interval(name: str, samples: torch.Tensor) -> dict[str, float]:
    if len(samples) == 0:
        return {f"{name}_low": float("nan"), f"{name}_high": float("nan")}
    low, high = torch.quantile(samples.double(), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {f"{name}_low": low, f"{name}_high": high}


def _null_schedules(
    by_route: dict[int, torch.Tensor], consumers: Sequence[int], dtype: torch.dtype
) -> dict[int, dict[str, torch.Tensor]]:
    """Per consumer, the `mean` and `recency` schedules (see `routing_audit`), each [n_sources], or [route,
    n_sources] where the consumer's weights have a route axis (`by_route[c]` always has one)."""
    means = {c: by_route[c].mean(dim=(0, 1)) for c in consumers}  # [route, n_sources]
    by_recency: dict[int, list[float]] = {}
    for c in consumers:
        for route_means in means[c]:
            for back, weight in enumerate(reversed(route_means.tolist())):  # 0 = the most recent source
                by_recency.setdefault(back, []).append(weight)
    profile = {back: float(np.mean(weights)) for back, weights in by_recency.items()}
    schedules = {}
    for c in consumers:
        n_routes, n = means[c].shape
        recency = torch.tensor([profile[n - 1 - s] for s in range(n)], dtype=torch.float64)
        recency = (recency / recency.sum()).expand(n_routes, n)
        shape = means[c].shape if n_routes > 1 else means[c].shape[1:]  # as the consumer's hook_weights
        schedules[c] = {"mean": means[c].reshape(shape).to(dtype), "recency": recency.reshape(shape).to(dtype)}
    return schedules


def audit_summary(audit: dict[str, pd.DataFrame]) -> dict[str, float]:
    """Headline numbers of `routing_audit`: the mean within-consumer Spearman (consumers with > 2 sources), and
    the mean Δloss of each null schedule over consumers."""
    consumers = audit["consumers"]
    return dict(
        mean_spearman=float(consumers["spearman"].mean()),
        null_mean_dloss=float(consumers["null_mean_dloss"].mean()),
        null_recency_dloss=float(consumers["null_recency_dloss"].mean()),
        n_consumers=int(len(consumers)),
    )
