"""The depth-mixing coefficients of every residual kind, on one footing (docs/analysis.md §5).

Every residual kind writes each sublayer input as a linear combination of the embedding and the earlier sublayer
outputs, `h_c = M[c, e] e + Σ_i M[c, i] f_i`, with coefficients that may depend on the token. `mixing_coefficients`
gives them per token, `[batch, pos, J+1, J+1]` over consumers c = 0 … J (J = the final norm's input) and the basis
(column 0 = e, column 1 + i = f_i):

* standard: every coefficient 1 (`h_c = e + Σ_{i<c} f_i`);
* AttnRes: the depth weight of the source that contains f_i (averaged over channel groups with `attnres_heads`);
* DenseFormer: products of the depth-weighted-average weights along every path from f_i to c (input-independent);
* mHC: the read weights of c applied to each stream's coefficient of f_i, which f_i's write weights created and each
  stream mix in between moved (`C ← combᵀ C + post ⊗ [f_j]`), per token;
* any other depth-mixing model (`attnres_lens.protocol`, docs/architecture.md §7): its own `mixing_coefficients`
  method where it has one (DeepSeek V4's mHC); else as AttnRes, from the weights at each consumer's
  `depth_hook(c, "weights")` times the scale its value transform gives each source, per token (`M[c, i] = Σ_{s ∋ i}
  α_s r_s`: Inkling mixes RMS-normalised sources `v_s = r_s b_s`; `r_s = 1` for raw sources). A sublayer that reads
  a plain sum (`direct_inputs`: Inkling's layer 0 reads e) has weight 1 on each member. A consumer with several
  routes (separate query, key and value inputs) has one row per route: `route=None` takes each consumer's first
  route (its `sublayer_input_hook`'s, 'q'), `route='k'` the key input's where a consumer has that route. A row is
  the depth mix (`route_input_hook`), before any message gate (Inkling-2-Mini's later visits), which is not
  linear in the outputs.

Input-dependent mixing weights (AttnRes, mHC) are read through their hook points in one forward pass; DenseFormer's,
the same for every token, from its parameters (`dwa.weights`, what `hook_dwa_weights` sees); nothing is stored on
the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnres_lens.attnres import EMBEDDING
from attnres_lens.protocol import depth_values, direct_inputs

if TYPE_CHECKING:  # named for types only: this module sits beside the model, so the model's modules may import it
    from transformer_lens.hook_points import HookPoint

    from attnres_lens.model import HookedTransformer
    from attnres_lens.protocol import DepthMixingModel


def basis_index(sublayer: int) -> int:
    """Column of the embedding (EMBEDDING) or of f_i in the coefficient matrices."""
    return 0 if sublayer == EMBEDDING else sublayer + 1


def _dtype(model: HookedTransformer) -> torch.dtype:
    """fp32, or fp64 for a float64 model (the exactness tests)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def _like(model: HookedTransformer) -> dict[str, Any]:
    """dtype and device of the coefficient tensors: the model's device, so they combine with captured weights."""
    return dict(dtype=_dtype(model), device=next(model.parameters()).device)


@torch.no_grad()
def _capture(
    model: DepthMixingModel, tokens: torch.Tensor, names: list[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The activations at `names` for one pass, in `dtype` (default: the model's `_dtype`)."""
    saved: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, hook: HookPoint) -> None:
        saved[hook.name] = tensor.detach().to(dtype or _dtype(model))

    model.run_with_hooks(tokens, return_type=None, fwd_hooks=[(name, save) for name in names])
    return saved


def mixing_coefficients(
    model: DepthMixingModel, tokens: torch.Tensor | None = None, per_group: bool = False, route: str | None = None
) -> torch.Tensor:
    """`[batch, pos, J+1, J+1]` (fp32; fp64 for a float64 model): the coefficient of e (column 0) and of each f_i
    (column 1+i) in the input of each consumer (row c; row J is the final norm's input). Zero above the diagonal
    (c reads e and f_i, i < c).

    `tokens` is needed where the weights depend on the input (AttnRes, mHC); without it the standard residual and
    DenseFormer give `[1, 1, J+1, J+1]`. With `attnres_heads = H > 1` each group of d_model / H channels has its own
    coefficients: `per_group=True` gives them, `[batch, pos, H, J+1, J+1]`; by default their mean (the groups are
    equal, so it is the coefficient averaged over channels).

    Any other depth-mixing model: its own `mixing_coefficients(tokens)` where it has one, else from its depth
    weights and value scales (see the module docstring); `route` picks the route of multi-route consumers (default:
    each one's first); `per_group` adds an axis of one.
    """
    from attnres_lens.model import HookedTransformer  # the model's modules may import this one: not at the top

    if not isinstance(model, HookedTransformer):
        if tokens is None:
            raise ValueError("the mixing weights of a depth-mixing model depend on the input: pass tokens")
        own = getattr(model, "mixing_coefficients", None)
        if own is not None and route is not None:
            raise ValueError(
                f"{type(model).__name__} computes M itself (its mixing_coefficients method), with no route; "
                f"drop route={route!r}"
            )
        tokens = model.to_tokens(tokens)
        coefficients = own(tokens) if own is not None else _protocol_attnres(model, tokens, route)
        return coefficients.unsqueeze(-3) if per_group else coefficients
    if route is not None and route != "mix":
        raise ValueError(f"the toolkit model's M has one row per consumer; route must be None, got {route!r}")
    cfg = model.cfg
    n = cfg.n_sublayers + 1
    residual = cfg.residual
    if residual in ("attnres", "mhc"):
        if tokens is None:
            raise ValueError(f"the mixing weights of residual={residual!r} depend on the input: pass tokens")
        tokens = model.to_tokens(tokens)
    if per_group:
        if residual != "attnres" or cfg.attnres_heads == 1:
            return mixing_coefficients(model, tokens).unsqueeze(-3)
        return _attnres(model, tokens, n, per_group=True)
    shape = (1, 1) if tokens is None else tuple(tokens.shape)
    if residual == "standard":
        return torch.ones(*shape, n, n, **_like(model)).tril()
    if residual == "denseformer":
        return _denseformer(model).expand(*shape, n, n).clone()
    if residual == "attnres":
        return _attnres(model, tokens, n)
    return _mhc(model, tokens, n)


def _attnres(model: HookedTransformer, tokens: torch.Tensor, n: int, per_group: bool = False) -> torch.Tensor:
    modules = model.depth_attention_modules()
    saved = _capture(model, tokens, [module.hook_weights.name for module in modules.values()])
    groups = model.cfg.attnres_heads
    coefficients = torch.zeros(*tokens.shape, groups, n, n, **_like(model))
    for consumer, module in modules.items():
        weights = saved[module.hook_weights.name]
        if groups == 1:
            weights = weights.unsqueeze(-2)  # [batch, pos, groups, sources]
        for source, members in enumerate(model.sources(consumer)):
            for member in members:
                coefficients[..., consumer, basis_index(member)] += weights[..., source]
    return coefficients if per_group else coefficients.mean(-3)


def _protocol_attnres(model: DepthMixingModel, tokens: torch.Tensor, route: str | None = None) -> torch.Tensor:
    """M of a protocol model from its consumers' depth weights and value scales (fp32, or fp64 where the weights
    are), once `check_mixing_defined` allows it: `M[c, i] = Σ_{s ∋ i} α_s r_s`, per token."""
    n_sublayers = model.n_sublayers
    check_mixing_defined(model, route)
    names = {consumer: model.depth_hook(consumer, "weights") for consumer in model.consumers()}
    scaled = getattr(model, "depth_values", None) is not None  # raw sources: r_s = 1, nothing more to read
    members = [*model.embedding_hooks, *(model.sublayer_output_hook(j) for j in range(n_sublayers))]
    saved: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, hook: HookPoint) -> None:
        saved[hook.name] = tensor.detach()

    wanted = set(names.values()) | (set(members) if scaled else set())
    model.run_with_hooks(tokens, fwd_hooks=[(name, save) for name in wanted])
    first = saved[names[n_sublayers]]
    dtype = torch.promote_types(first.dtype, torch.float32)
    if scaled:
        embedding = sum(saved[name].to(torch.float64) for name in model.embedding_hooks)
        outputs = [saved[model.sublayer_output_hook(j)].to(torch.float64) for j in range(n_sublayers)]
    coefficients = torch.zeros(*tokens.shape, n_sublayers + 1, n_sublayers + 1, dtype=dtype, device=first.device)
    for consumer, name in names.items():
        weights = saved[name].to(dtype)
        routes = model.routes(consumer)
        if len(routes) > 1:
            weights = weights[..., routes.index(route) if route in routes else 0, :]
        if scaled:
            weights = weights * _value_scales(model, consumer, embedding, outputs).to(dtype)
        for source, source_members in enumerate(model.sources(consumer)):
            for member in source_members:
                coefficients[..., consumer, basis_index(member)] += weights[..., source]
    for sublayer, direct in direct_inputs(model).items():
        for member in direct:
            coefficients[..., sublayer, basis_index(member)] += 1.0
    return coefficients


def _value_scales(
    model: DepthMixingModel, consumer: int, embedding: torch.Tensor, outputs: list[torch.Tensor]
) -> torch.Tensor:
    """`[batch, pos, n_sources]`: the scalar r_s with `v_s = r_s b_s` per token, read off the model's value transform
    as `⟨v_s, b_s⟩ / ‖b_s‖²` (exact for a per-token rescaling such as an RMS norm), in float64."""
    sources = [
        sum(embedding if member == EMBEDDING else outputs[member] for member in source_members)
        for source_members in model.sources(consumer)
    ]
    values = depth_values(model, consumer, sources)
    return torch.stack(
        [(v * b).sum(-1) / (b * b).sum(-1).clamp_min(1e-300) for v, b in zip(values, sources, strict=True)], -1
    )


def check_mixing_defined(model: DepthMixingModel, route: str | None = None) -> None:
    """Refuse a protocol model whose sublayer inputs are not each a depth mix of its sources or a plain sum
    (`direct_inputs`), or a `route` no consumer has (docs/analysis.md §5). A model with its own
    `mixing_coefficients` defines M itself."""
    if getattr(model, "mixing_coefficients", None) is not None:
        return
    expected = list(range(model.n_sublayers + 1))
    consumers = model.consumers()
    covered = set(consumers) | set(direct_inputs(model))
    missing = [c for c in expected if c not in covered]
    if missing:
        raise ValueError(
            f"the depth-mixing matrix M needs every sublayer and the final readout to read a depth mix; this model's "
            f"{[model.sublayer_name(c) for c in missing]} do not (nor a plain sum it names in direct_inputs)"
        )
    unheld = [c for c in consumers if not routes_are_inputs(model, c)]
    if unheld:
        raise ValueError(
            "the depth-mixing matrix M is defined where each route of a consumer is one whole input; "
            f"{[model.sublayer_name(c) for c in unheld]} run several routes ({model.routes(unheld[0])}) over "
            "one source set that no one input holds: read their depth weights per route (depth_weights)"
        )
    if route is not None:
        every = sorted({r for c in consumers for r in model.routes(c)})
        if route not in every:
            raise ValueError(f"route must be one of this model's routes {every} (or None), got {route!r}")


def routes_are_inputs(model: DepthMixingModel, consumer: int) -> bool:
    """Whether each route of `consumer` mixes one whole input (`route_input_hook` names it: Inkling's q, k, v),
    not a slice of one (the toolkit's channel groups 'h0', …, which that member refuses)."""
    routes = model.routes(consumer)
    if len(routes) == 1:
        return True
    try:
        model.route_input_hook(consumer, routes[0])
    except ValueError:
        return False
    return True


def _denseformer(model: HookedTransformer) -> torch.Tensor:
    """The DWA recursion on coefficient vectors: `X_0 = Y_0 = e`, `X_k = Y_{k−1} + f_attn + f_mlp`, `Y_k = Σ a X`."""
    n = model.cfg.n_sublayers + 1
    coefficients = torch.zeros(n, n, **_like(model))
    unit = torch.eye(n, **_like(model))
    outputs = [unit[0]]  # X_0 = e
    current = unit[0]
    per_layer = 1 if model.cfg.attn_only else 2
    for layer, block in enumerate(model.blocks):
        for offset in range(per_layer):
            sublayer = per_layer * layer + offset
            coefficients[sublayer] = current
            current = current + unit[basis_index(sublayer)]
        outputs.append(current)
        weights = block.dwa.weights.detach().to(_dtype(model))
        current = sum(weight * output for weight, output in zip(weights, outputs))
    coefficients[n - 1] = current
    return coefficients


def _mhc(model: HookedTransformer, tokens: torch.Tensor, n: int) -> torch.Tensor:
    modules = model.mixer_modules()
    names = [module.hook_read_weights.name for module in modules.values()]
    names += [
        name
        for module in list(modules.values())[:-1]
        for name in (module.hook_write_weights.name, module.hook_stream_mix.name)
    ]
    saved = _capture(model, tokens, names)
    n_streams = model.cfg.mhc_streams
    streams = torch.zeros(*tokens.shape, n_streams, n, **_like(model))  # each stream's coefficients
    streams[..., 0] = 1.0  # every stream starts as the embedding
    coefficients = torch.zeros(*tokens.shape, n, n, **_like(model))
    for consumer, module in modules.items():
        read = saved[module.hook_read_weights.name]  # [batch, pos, n_streams]
        coefficients[..., consumer, :] = (read.unsqueeze(-1) * streams).sum(-2)
        if consumer < n - 1:
            write = saved[module.hook_write_weights.name]
            mix = saved[module.hook_stream_mix.name]
            streams = mix.transpose(-1, -2) @ streams
            streams[..., basis_index(consumer)] += write
    return coefficients


def stream_dominance(model: HookedTransformer, tokens: torch.Tensor) -> dict[int, float]:
    """mHC only: per consumer, the token-averaged share of its read weight on its most-read stream
    (1/n when it reads the streams evenly, 1 when it reads one)."""
    if model.cfg.residual != "mhc":
        raise ValueError(f"stream dominance is defined for residual='mhc', got {model.cfg.residual!r}")
    modules = model.mixer_modules()
    saved = _capture(model, model.to_tokens(tokens), [module.hook_read_weights.name for module in modules.values()])
    out = {}
    for consumer, module in modules.items():
        read = saved[module.hook_read_weights.name]
        out[consumer] = (read.max(-1).values / read.sum(-1)).mean().item()
    return out


def mixing_rows(model: DepthMixingModel, matrix: torch.Tensor) -> list[dict[str, Any]]:
    """One row per consumer × earlier output of a `[J+1, J+1]` coefficient matrix: consumer, consumer_label
    (J = "final"), sublayer (−1 = embedding), sublayer_label, weight (the lower triangle only)."""
    rows = []
    for consumer in range(model.n_sublayers + 1):
        for sublayer in [EMBEDDING, *range(consumer)]:
            rows.append(
                dict(
                    consumer=consumer,
                    consumer_label=model.sublayer_name(consumer),
                    sublayer=sublayer,
                    sublayer_label="emb" if sublayer == EMBEDDING else model.sublayer_name(sublayer),
                    weight=float(matrix[consumer, basis_index(sublayer)]),
                )
            )
    return rows
