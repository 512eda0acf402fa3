"""Depth maps: where each sublayer reads from over depth (docs/analysis.md §4-§5).

Consumers are numbered like sublayers, `0 … J−1`, with `J` the final readout; `kind` is "attn" (pre-attention
panel), "mlp" (pre-MLP panel) or "final". Sources are numbered per consumer as in `model.sources(consumer)`,
with the model's labels ("emb", "L3.attn", "B2 (L2–L3)", "partial").
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from attnres_lens.analysis.engine import capture
from attnres_lens.analysis.session import clean_result
from attnres_lens.attnres import EMBEDDING
from attnres_lens.mixing import check_mixing_defined, mixing_coefficients, mixing_rows, stream_dominance
from attnres_lens.model import HookedTransformer
from attnres_lens.protocol import (
    DepthMixingModel,
    consumer_index,
    consumer_kind,
    consumer_label,
    depth_consumers,
    direct_inputs,
)


@torch.no_grad()
def depth_weights_by_route(model: DepthMixingModel, tokens: torch.Tensor) -> dict[int | str, torch.Tensor]:
    """α of every consumer per route, `{consumer: [batch, pos, route, n_sources]}` (one route: an axis of one), read
    at `model.depth_hook(consumer, "weights")` in one pass; message consumers (`protocol.message_consumers`, named
    by strings) after the sublayer consumers."""
    consumers = depth_consumers(model)
    if not consumers:
        residual = f"a residual={model.cfg.residual!r} model" if isinstance(model, HookedTransformer) else "this model"
        raise ValueError(f"{residual} has no depth attention; its mixing weights are in depth_mixing_matrix")
    names = {consumer: model.depth_hook(consumer, "weights") for consumer in consumers}
    saved = clean_result("depth_weights", model, tokens, lambda: capture(model, tokens, names.values()))
    return {
        consumer: saved[name].float() if len(model.routes(consumer)) > 1 else saved[name].float().unsqueeze(-2)
        for consumer, name in names.items()
    }


def depth_weights_by_consumer(model: DepthMixingModel, tokens: torch.Tensor) -> dict[int | str, torch.Tensor]:
    """α of every consumer, `{consumer: [batch, pos, n_sources]}`, averaged over its routes: with the toolkit's
    `attnres_heads > 1` each channel group has its own α and the vector's effective weight is their mean."""
    return {consumer: weights.mean(-2) for consumer, weights in depth_weights_by_route(model, tokens).items()}


def edge_info(model: DepthMixingModel, consumer: int | str, source: int) -> dict:
    """The columns naming a depth edge in every edge table: consumer (`protocol.consumer_index`: J + 1 + k for the
    k-th message consumer), consumer_label, kind, source, source_label, members (the sublayer indices summed in the
    source, −1 = the embedding)."""
    return dict(
        consumer=consumer_index(model, consumer),
        consumer_label=consumer_label(model, consumer),
        kind=consumer_kind(model, consumer),
        source=source,
        source_label=model.source_labels(consumer)[source],
        members=",".join(map(str, model.sources(consumer)[source])),
    )


def _source_rows(model: DepthMixingModel, consumer: int | str) -> list[dict]:
    label = consumer_label(model, consumer)
    return [
        dict(
            consumer=consumer_index(model, consumer),
            consumer_label=label,
            kind=consumer_kind(model, consumer),
            route=route,
            source=source,
            source_label=source_label,
        )
        for route in model.routes(consumer)
        for source, source_label in enumerate(model.source_labels(consumer))
    ]


def depth_weights(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """Token-averaged α per consumer × route × source: consumer, consumer_label, kind, route ('mix' for a
    consumer with one softmax; 'h0', … or 'q', 'k', 'v' for several), source, source_label, weight. A message
    consumer ('L2.msg@2', kind 'msg', routes q, k, v, mlp) has consumer J + 1 + k (`protocol.consumer_index`)."""
    rows = []
    for consumer, weights in depth_weights_by_route(model, tokens).items():
        for row, weight in zip(_source_rows(model, consumer), weights.mean(dim=(0, 1)).flatten().tolist()):
            rows.append({**row, "weight": weight})
    return pd.DataFrame(rows)


def depth_weights_per_token(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """α at every token: sequence, position, token, consumer, consumer_label, kind, route, source, source_label,
    weight. Meant for one or a few sequences (the table has batch × pos × Σ routes × n_sources rows)."""
    tokens = model.to_tokens(tokens)
    frames = []
    for consumer, weights in depth_weights_by_route(model, tokens).items():
        batch, pos, n_routes, n_sources = weights.shape
        index = pd.MultiIndex.from_product(
            [range(batch), range(pos), range(n_routes * n_sources)], names=["sequence", "position", "_slot"]
        )
        frame = pd.DataFrame({"weight": weights.reshape(-1).cpu().numpy()}, index=index).reset_index()
        frame["token"] = tokens.cpu().numpy()[frame["sequence"], frame["position"]]
        labels = pd.DataFrame(_source_rows(model, consumer)).rename_axis("_slot").reset_index()
        frames.append(frame.merge(labels, on="_slot"))
    columns = [
        "sequence",
        "position",
        "token",
        "consumer",
        "consumer_label",
        "kind",
        "route",
        "source",
        "source_label",
        "weight",
    ]
    # frames come in consumer order, each in (sequence, position, route, source) order: a stable sort by token
    # keeps that within a token (routes in the model's order, q, k, v)
    return pd.concat(frames, ignore_index=True)[columns].sort_values(
        ["sequence", "position"], ignore_index=True, kind="stable"
    )


def depth_summary(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """Per consumer and route: n_sources; entropy (nats) of α's shares (α / Σ α per token: α itself for softmax
    scores, sigmoid ones do not sum to 1), averaged over tokens, and normalized_entropy (divided by log n_sources:
    1 = uniform, 0 = one source; undefined for a single source); sink_score, the largest token-averaged share any
    one source takes (1/n_sources when uniform, 1 for a perfect sink), with that source as sink_source /
    sink_label; embedding_weight, the token-averaged weight α on e itself. `route` as in `depth_weights`."""
    rows = []
    for consumer, by_route in depth_weights_by_route(model, tokens).items():
        for route, weights in zip(model.routes(consumer), by_route.unbind(-2)):
            n_sources = weights.shape[-1]
            shares = weights / weights.sum(-1, keepdim=True)
            entropy = -(shares * shares.clamp_min(1e-30).log()).sum(-1).mean().item()
            mean_shares = shares.mean(dim=(0, 1))
            sink = int(mean_shares.argmax())
            rows.append(
                dict(
                    consumer=consumer_index(model, consumer),
                    consumer_label=consumer_label(model, consumer),
                    kind=consumer_kind(model, consumer),
                    route=route,
                    n_sources=n_sources,
                    entropy=entropy,
                    normalized_entropy=entropy / math.log(n_sources) if n_sources > 1 else float("nan"),
                    sink_score=mean_shares[sink].item(),
                    sink_source=sink,
                    sink_label=model.source_labels(consumer)[sink],
                    embedding_weight=weights[..., 0].mean().item(),
                )
            )
    return pd.DataFrame(rows)


def depth_mixing_matrix(model: DepthMixingModel, tokens: torch.Tensor | None = None) -> pd.DataFrame:
    """The effective weight of each sublayer output (and of the embedding) in each sublayer input, token-averaged.

    `M[c, i]` is the coefficient of f_i in h_c (`attnres_lens.mixing`): standard residual, all ones
    (`h_c = e + Σ_{i<c} f_i`); Full AttnRes, the α themselves; Block AttnRes, α of the block source for each of its
    members; DenseFormer, products of its depth-weighted-average weights; mHC, read × mix × write weights along
    the streams. Rows: consumer, consumer_label (J = "final"), sublayer (−1 = embedding), sublayer_label, weight;
    only `sublayer < consumer` (lower triangle). `tokens` is needed where the weights depend on the input.
    """
    return _mixing_frame(model, mixing_coefficients(model, tokens).mean(dim=(0, 1)))


def depth_mixing_per_token(model: DepthMixingModel, tokens: torch.Tensor) -> pd.DataFrame:
    """`depth_mixing_matrix` at every token: sequence, position, token, then its columns. For a few sequences."""
    tokens = model.to_tokens(tokens)
    coefficients = mixing_coefficients(model, tokens)
    frames = []
    for sequence in range(tokens.shape[0]):
        for position in range(tokens.shape[1]):
            frame = _mixing_frame(model, coefficients[sequence, position])
            frame.insert(0, "token", int(tokens[sequence, position]))
            frame.insert(0, "position", position)
            frame.insert(0, "sequence", sequence)
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def _mixing_frame(model: DepthMixingModel, matrix: torch.Tensor) -> pd.DataFrame:
    return pd.DataFrame(mixing_rows(model, matrix))


def mixing_diagnostics(model: DepthMixingModel, tokens: torch.Tensor | None = None) -> pd.DataFrame:
    """Per consumer, on its row of the token-averaged M normalised to shares p (|M| / Σ|M|): effective_sources
    (exp of the entropy of p: how many outputs it really reads), max_weight (the largest share: 1 = collapse onto one
    output), embedding_mass (the embedding's share); for mHC also stream_dominance (`mixing.stream_dominance`)."""
    matrix = mixing_coefficients(model, tokens).mean(dim=(0, 1))
    mhc = isinstance(model, HookedTransformer) and model.cfg.residual == "mhc"
    dominance = stream_dominance(model, tokens) if mhc else {}
    rows = []
    for consumer in range(model.n_sublayers + 1):
        shares = matrix[consumer, : consumer + 1].abs()
        shares = shares / shares.sum()
        entropy = -(shares * shares.clamp_min(1e-30).log()).sum().item()
        row = dict(
            consumer=consumer,
            consumer_label=model.sublayer_name(consumer),
            kind=model.sublayer_kind(consumer),
            n_outputs=consumer + 1,
            effective_sources=math.exp(entropy),
            max_weight=shares.max().item(),
            embedding_mass=shares[0].item(),
        )
        if dominance:
            row["stream_dominance"] = dominance[consumer]
        rows.append(row)
    return pd.DataFrame(rows)


def mixing_matrix_from_weights(model: DepthMixingModel, weights: pd.DataFrame) -> pd.DataFrame:
    """`depth_mixing_matrix` from token-averaged source weights (columns consumer, source, weight), such as
    `depth_weights` or a recorded snapshot (`records/depth_weights.parquet` at one step): M is linear in them.
    Rows per route (a `route` column) are averaged over routes: the toolkit's channel groups are equal, so that is
    the coefficient averaged over channels; a protocol model must mix raw sources with one route per consumer
    (token-averaged α cannot give the token-averaged α_s r_s of normalised values, `mixing`)."""
    direct = {}
    if not isinstance(model, HookedTransformer):
        check_mixing_defined(model)
        several = [c for c in model.consumers() if len(model.routes(c)) > 1]
        if several or any(hasattr(model, name) for name in ("depth_values", "mixing_coefficients")):
            raise ValueError(
                "M from token-averaged weights needs one route per consumer mixing raw sources; "
                f"{type(model).__name__} "
                + (f"runs several routes at {[model.sublayer_name(c) for c in several]}" if several else "does not")
                + ": use depth_mixing_matrix(model, tokens), which reads M per token"
            )
        direct = direct_inputs(model)
    if "route" in weights.columns:
        weights = weights.groupby(["consumer", "source"], as_index=False)["weight"].mean()
    by_consumer = {
        int(c): dict(zip(group["source"].astype(int), group["weight"])) for c, group in weights.groupby("consumer")
    }
    rows = []
    for consumer in range(model.n_sublayers + 1):
        if consumer in direct:  # a plain sum: weight 1 on each member
            by_consumer[consumer] = {0: 1.0}
            sources = [direct[consumer]]
        else:
            sources = model.sources(consumer)
        if consumer not in by_consumer:
            raise ValueError(
                f"the source weights have no rows for consumer {consumer} ({model.sublayer_name(consumer)})"
            )
        effective = {i: 0.0 for i in [EMBEDDING, *range(consumer)]}
        for source, members in enumerate(sources):
            for member in members:
                effective[member] += by_consumer[consumer][source]
        for sublayer, weight in effective.items():
            rows.append(
                dict(
                    consumer=consumer,
                    consumer_label=model.sublayer_name(consumer),
                    sublayer=sublayer,
                    sublayer_label="emb" if sublayer == EMBEDDING else model.sublayer_name(sublayer),
                    weight=float(weight),
                )
            )
    return pd.DataFrame(rows)
