"""Looped layers' visits, one by one and all together (docs/interop.md §7, "Visits").

A looped layer of Inkling-2-Mini runs once per pass; each run is a visit with its own sublayer indices and names
('L3.attn@1', 'L3.attn@2', …). Removal sets and knockouts name a visit by its sublayer name, and every visit of a
looped sublayer at once by 'L3.attn@*'. `visit_removals` removes each looped sublayer's visits together;
`visit_knockouts` knocks one source (by label) out of every visit's depth softmax together.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from attnres_lens.analysis.engine import evaluate, evaluate_many
from attnres_lens.analysis.interventions import Hook, mask_sources_hook, removal_hooks
from attnres_lens.protocol import DepthMixingModel, model_device
from attnres_lens.tasks.base import Batch

ALL_VISITS = "@*"  # 'L3.attn@*': every visit of a looped sublayer


def visit_groups(model: DepthMixingModel) -> dict[str, list[int]]:
    """'L{l}.{kind}@*' → the sublayer indices of its visits, for every sublayer that runs more than once (in forward
    order of the first visit); empty for a model without looped layers."""
    groups: dict[str, list[int]] = {}
    for sublayer in range(model.n_sublayers):
        name = model.sublayer_name(sublayer)
        base, at, _ = name.partition("@")
        if at:
            groups.setdefault(base + ALL_VISITS, []).append(sublayer)
    return groups


def sublayers_named(model: DepthMixingModel, names: Iterable[str]) -> list[int]:
    """The sublayer indices `names` address: a sublayer name ('L0.mlp', 'L3.attn@2': one visit) or a looped
    sublayer's every visit ('L3.attn@*'). An unknown name is an error listing the valid ones."""
    by_name = {model.sublayer_name(j): [j] for j in range(model.n_sublayers)} | visit_groups(model)
    indices: set[int] = set()
    for name in names:
        if name not in by_name:
            looped = [group for group in by_name if group.startswith(name + "@")]
            hint = (
                f"; {name} runs several times: name one visit ({', '.join(looped[:-1])}) or all of them ({looped[-1]})"
                if looped
                else f"; valid names: {', '.join(list(by_name)[:12])}{' …' if len(by_name) > 12 else ''}"
            )
            raise ValueError(f"no sublayer is named {name!r}{hint}")
        indices.update(by_name[name])
    return sorted(indices)


def visit_removals(model: DepthMixingModel, batch: Batch, progress: bool = False) -> pd.DataFrame:
    """One row per looped sublayer ('L3.attn@*'): the loss and accuracy change when every visit is removed together
    (the removal rule of `interventions.removal_hooks`), beside the sum of removing each visit alone."""
    batch = batch.to(model_device(model))
    groups = visit_groups(model)
    base = evaluate(model, batch)
    singles = sorted({j for members in groups.values() for j in members})
    interventions = [removal_hooks(model, members) for members in groups.values()]
    interventions += [removal_hooks(model, [j]) for j in singles]
    results = evaluate_many(model, batch, interventions, progress=progress, desc="removing visits")
    alone = {j: results[len(groups) + index].loss - base.loss for index, j in enumerate(singles)}
    return pd.DataFrame(
        [
            dict(
                sublayers=name,
                visits=len(members),
                dloss_together=result.loss - base.loss,
                dacc_together=result.accuracy - base.accuracy,
                dloss_sum_alone=sum(alone[j] for j in members),
            )
            for (name, members), result in zip(groups.items(), results)
        ]
    )


def visit_knockouts(model: DepthMixingModel, batch: Batch, progress: bool = False) -> pd.DataFrame:
    """One row per looped consumer ('L3.attn@*') and source label every visit reads ('emb', 'B1 (L2–L3)', …): the
    loss change when that source is knocked out of every visit's depth softmax together (each visit's other
    sources renormalise), beside the sum of the knockouts in one visit at a time."""
    batch = batch.to(model_device(model))
    base = evaluate(model, batch)
    consumers = set(model.consumers())
    rows, interventions = [], []
    for name, members in visit_groups(model).items():
        visits = [j for j in members if j in consumers]
        if not visits:
            continue
        labels = [model.source_labels(j) for j in visits]
        shared = [label for label in labels[0] if all(label in others for others in labels[1:])]
        for label in shared:
            masks: list[Hook] = [
                (model.depth_hook(j, "logit_bias"), mask_sources_hook([model.source_labels(j).index(label)]))
                for j in visits
                if len(model.source_labels(j)) > 1  # a softmax over one source cannot lose it
            ]
            if not masks:
                continue
            rows.append(dict(consumer=name, source_label=label, visits=len(masks)))
            interventions.append(masks)
            interventions += [[mask] for mask in masks]
    results = iter(evaluate_many(model, batch, interventions, progress=progress, desc="knocking out visits"))
    for row in rows:
        row["dloss_together"] = next(results).loss - base.loss
        row["dloss_sum_alone"] = sum(next(results).loss - base.loss for _ in range(row["visits"]))
    return pd.DataFrame(rows, columns=["consumer", "source_label", "visits", "dloss_together", "dloss_sum_alone"])
