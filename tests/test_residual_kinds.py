"""Depth-mixing rules beside AttnRes (docs/model.md §11-§13): DenseFormer, mHC hyper-connections and the AttnRes
paper's ablations, each re-derived in float64 from its definition, checked against transformers' DeepSeek V4
modules where they exist, and reduced to the rule it generalises where one exists. One footing: the mixing matrix M
of every kind predicts, per token, how each sublayer input moves when one earlier output moves."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pandas as pd
import pytest
import torch

from attnres_lens import HookedTransformer
from attnres_lens.analysis.depth import depth_mixing_matrix, mixing_diagnostics
from attnres_lens.analysis.run import prune_tables
from attnres_lens.attnres import EMBEDDING
from attnres_lens.mixing import basis_index, mixing_coefficients
from attnres_lens.tasks import make_task
from tests.helpers import block_sources, small_config

OPTIONS = [
    dict(attnres_score="sigmoid"),
    dict(attnres_key_norm=False),
    dict(attnres_query="input"),
    dict(attnres_heads=4),
    dict(attnres_window=2),
    dict(attnres_mixing="scalar"),
    dict(attnres_heads=2, attnres_query="input", attnres_window=3),
]
KINDS = [
    dict(residual="standard"),
    dict(residual="denseformer"),
    dict(residual="mhc"),
    dict(residual="mhc", mhc_streams=2, attn_only=True),
    dict(residual="attnres", attnres_block_size=1),
    dict(residual="attnres", attnres_block_size=4),
]
KINDS += [dict(residual="attnres", attnres_block_size=block, **option) for option in OPTIONS for block in (1, 2)]


def model_of(**fields) -> HookedTransformer:
    fields = dict(fields)
    residual, block_size = fields.pop("residual", "standard"), fields.pop("attnres_block_size", 1)
    return HookedTransformer(small_config(residual, block_size, **fields))


def randomize(model: HookedTransformer, seed: int = 3) -> HookedTransformer:
    """Non-trivial values for every mixing parameter (queries, gains, DWA weights, mHC maps start trivial)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(key in name for key in ("_res.", "final_res", "dwa", "_hc.", "final_hc")):
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    return model


def sublayers_of(model: HookedTransformer) -> list[tuple]:
    """(norm, sublayer, AttnRes mixer, mHC mixer) in forward order, from a model's modules."""
    out = []
    for block in model.blocks:
        out.append((block.ln1, block.attn, getattr(block, "attn_res", None), getattr(block, "attn_hc", None)))
        if not model.cfg.attn_only:
            out.append((block.ln2, block.mlp, getattr(block, "mlp_res", None), getattr(block, "mlp_hc", None)))
    return out


def tokens_for(model: HookedTransformer, batch: int = 2, pos: int = 9) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------------------- DenseFormer
def denseformer_float64(model: HookedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """X_0 = Y_0 = e; X_k = Y_{k−1} + f_attn + f_mlp (a plain residual inside the block); Y_k = Σ_i a_{k,i} X_i."""
    m = copy.deepcopy(model).double()
    y = m.embed(tokens)
    outputs = [y]
    for block in m.blocks:
        x = y + block.attn(block.ln1(y))
        if not m.cfg.attn_only:
            x = x + block.mlp(block.ln2(x))
        outputs.append(x)
        y = sum(a * out for a, out in zip(block.dwa.weights, outputs))
    return m.unembed(m.ln_final(y))


def test_denseformer_matches_its_equations_in_float64():
    model = randomize(model_of(residual="denseformer"))
    tokens = tokens_for(model)
    torch.testing.assert_close(model.double()(tokens), denseformer_float64(model, tokens), rtol=1e-10, atol=1e-10)


def test_denseformer_at_initialisation_is_the_standard_residual_exactly():
    dense = model_of(residual="denseformer")
    standard = model_of()
    standard.load_state_dict({k: v for k, v in dense.state_dict().items() if "dwa" not in k})
    tokens = tokens_for(dense)
    assert torch.equal(dense(tokens), standard(tokens))
    _, cache = dense.run_with_cache(tokens)
    assert cache["blocks.2.dwa.hook_dwa_weights"].tolist() == [0.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------- mHC
deepseek = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def deepseek_config(model: HookedTransformer):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    cfg = model.cfg
    return DeepseekV4Config(
        hidden_size=cfg.d_model,
        hc_mult=cfg.mhc_streams,
        hc_eps=cfg.mhc_eps,
        hc_sinkhorn_iters=cfg.mhc_sinkhorn_iters,
        rms_norm_eps=cfg.eps,
    )


def test_mhc_connection_and_head_match_deepseek_v4_in_float64():
    model = randomize(model_of(residual="mhc", mhc_streams=3)).double()
    config = deepseek_config(model)
    streams = torch.randn(2, 5, 3, model.cfg.d_model, dtype=torch.float64)
    ours = model.blocks[1].mlp_hc
    theirs = deepseek.DeepseekV4HyperConnection(config).double()
    theirs.load_state_dict(ours.state_dict())
    h, post, comb = ours(streams)
    their_post, their_comb, their_h = theirs(streams)
    for mine, reference in [(h, their_h), (post, their_post), (comb, their_comb)]:  # theirs computes in fp32
        torch.testing.assert_close(mine.double(), reference.double(), rtol=1e-5, atol=1e-6)
    single = streams.float()  # in fp32 both compute the same operations: equal to rounding
    for mine, reference in zip(ours.float()(single), [theirs.float()(single)[i] for i in (2, 0, 1)]):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=2e-6)
    # doubly stochastic stream mix: columns exactly (the last Sinkhorn step), rows to its convergence after 20 rounds
    torch.testing.assert_close(comb.sum(-1), torch.ones_like(comb.sum(-1)), atol=0.1, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones_like(comb.sum(-2)), atol=1e-5, rtol=0)
    head = deepseek.DeepseekV4HyperHead(config).double()
    head.load_state_dict(model.final_hc.state_dict())
    torch.testing.assert_close(model.final_hc(streams).double(), head(streams).double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.final_hc.float()(streams.float()), head.float()(streams.float()))


@pytest.mark.parametrize("attn_only", [False, True])
def test_mhc_model_matches_a_forward_built_from_deepseek_modules(attn_only):
    """The whole residual, re-derived with transformers' modules as the mixing and our sublayers as f_j."""
    model = randomize(model_of(residual="mhc", attn_only=attn_only)).double()
    config = deepseek_config(model)
    tokens = tokens_for(model)
    streams = model.embed(tokens).unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()
    for norm, sublayer, _, ours in sublayers_of(model):
        theirs = deepseek.DeepseekV4HyperConnection(config).double()
        theirs.load_state_dict(ours.state_dict())
        post, comb, collapsed = theirs(streams)
        output = sublayer(norm(collapsed))
        streams = post.unsqueeze(-1) * output.unsqueeze(-2) + comb.transpose(-1, -2) @ streams
    head = deepseek.DeepseekV4HyperHead(config).double()
    head.load_state_dict(model.final_hc.state_dict())
    expected = model.unembed(model.ln_final(head(streams)))
    # transformers computes the mixing weights in fp32 (ours in the streams' dtype, fp64 here)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- AttnRes options
def option_mix_float64(module, cfg, sources: list[torch.Tensor]) -> torch.Tensor:
    """The ablations written out from their definitions, independently of `DepthAttention`."""
    values = [v.double() for v in sources]
    if cfg.attnres_mixing == "scalar":
        weights = torch.softmax(module.scalar_logits.double(), -1)
        return sum(w * v for w, v in zip(weights, values))
    heads, d = cfg.attnres_heads, cfg.d_model
    group = d // heads
    out = torch.zeros_like(values[0])
    for h in range(heads):
        channels = slice(h * group, (h + 1) * group)
        keys = []
        for v in values:
            part = v[..., channels]
            if cfg.attnres_key_norm:
                part = part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + cfg.attnres_eps)
                part = part * module.key_norm.w.double()[channels]
            keys.append(part)
        if cfg.attnres_query == "input":
            recent = values[-1] / torch.sqrt(values[-1].pow(2).mean(-1, keepdim=True) + cfg.attnres_eps)
            query = (recent @ module.query_proj.double())[..., channels]
        else:
            query = module.query.double()[channels]
        logits = torch.stack([(k * query).sum(-1) for k in keys], dim=-1)
        weights = torch.softmax(logits, -1) if cfg.attnres_score == "softmax" else torch.sigmoid(logits)
        out[..., channels] = sum(weights[..., s, None] * v[..., channels] for s, v in enumerate(values))
    return out


def attnres_options_float64(model: HookedTransformer, tokens: torch.Tensor) -> torch.Tensor:
    m = copy.deepcopy(model).double()
    cfg = m.cfg
    embedding, outputs = m.embed(tokens), []
    layers = sublayers_of(m)
    window = cfg.attnres_window
    for j, (norm, sublayer, mixer, _) in enumerate(layers):
        sources = block_sources(j, embedding, outputs, cfg.attnres_block_size, len(layers))
        sources = sources if window is None else sources[:1] + sources[1:][-window:]
        outputs.append(sublayer(norm(option_mix_float64(mixer, cfg, sources))))
    sources = block_sources(len(layers), embedding, outputs, cfg.attnres_block_size, len(layers))
    sources = sources if window is None else sources[:1] + sources[1:][-window:]
    return m.unembed(m.ln_final(option_mix_float64(m.final_res, cfg, sources)))


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: "+".join(f"{k[8:]}={v}" for k, v in o.items()))
def test_attnres_options_match_their_definitions_in_float64(option, block_size):
    model = randomize(model_of(residual="attnres", attnres_block_size=block_size, **option))
    tokens = tokens_for(model)
    torch.testing.assert_close(model.double()(tokens), attnres_options_float64(model, tokens), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "option",
    [dict(attnres_query="input"), dict(attnres_mixing="scalar"), dict(attnres_window=100), dict(attnres_heads=1)],
)
def test_options_that_start_as_attnres_do(option):
    """Zero-initialised input queries and scalar logits give uniform weights like the zero pseudo-query, and a window
    wider than the depth reads every source: at initialisation each is exactly default AttnRes."""
    base = model_of(residual="attnres", attnres_block_size=2)
    varied = model_of(residual="attnres", attnres_block_size=2, **option)
    varied.load_state_dict({k: v for k, v in base.state_dict().items() if k in varied.state_dict()}, strict=False)
    tokens = tokens_for(base)
    torch.testing.assert_close(varied(tokens), base(tokens), rtol=1e-6, atol=1e-6)


def test_sigmoid_scores_do_not_normalise():
    model = model_of(residual="attnres", attnres_score="sigmoid")
    _, cache = model.run_with_cache(tokens_for(model))
    weights = cache["blocks.1.attn_res.hook_weights"]
    torch.testing.assert_close(weights, torch.full_like(weights, 0.5))  # sigmoid(0): the sum grows with depth


def test_sliding_window_reads_the_embedding_and_the_last_sources():
    model = model_of(residual="attnres", attnres_window=2)
    assert model.source_labels(5) == ["emb", "L1.mlp", "L2.attn"]
    assert model.sources(6) == [[EMBEDDING], [4], [5]]
    _, cache = model.run_with_cache(tokens_for(model))
    assert cache["final_res.hook_weights"].shape[-1] == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(residual="standard", attnres_score="sigmoid"), "attnres_score only applies to residual='attnres'"),
        (dict(residual="denseformer", mhc_streams=2), "mhc_streams only applies to residual='mhc'"),
        (dict(residual="standard", block_size=4), "attnres_block_size only applies to residual='attnres'"),
        (dict(residual="mhc", attnres_eps=1e-5), "attnres_eps only applies to residual='attnres'"),
        (
            dict(residual="attnres", attnres_mixing="scalar", attnres_query="input"),
            "attnres_mixing='scalar' has no query or keys.*attnres_query",
        ),
        (dict(residual="attnres", attnres_heads=5), "attnres_heads=5 must divide d_model=32"),
        (dict(residual="attnres", attnres_window=0), "attnres_window must be None"),
        (dict(residual="attnres", attnres_score="tanh"), "attnres_score must be one of"),
        (dict(residual="mhc", mhc_streams=0), "mhc_streams must be an integer >= 1"),
        (dict(residual="hyper"), "residual='hyper' was renamed 'mhc'; set residual='mhc'"),
    ],
)
def test_invalid_combinations_name_the_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        small_config(**fields)


# ---------------------------------------------------------------------------- one footing
def _freeze_and_perturb(model: HookedTransformer, tokens: torch.Tensor, target: int, delta: torch.Tensor):
    """Sublayer inputs with every mixing weight and every other sublayer output frozen at their clean values, and
    output `target` (EMBEDDING: the embedding) moved by `delta`: then each input is linear in the moved output."""
    outputs = ["hook_embed"] + [model.sublayer_output_hook(j) for j in range(model.cfg.n_sublayers)]
    inputs = [model.sublayer_input_hook(j) for j in range(model.cfg.n_sublayers)]
    weights = [
        name
        for name in model.hook_dict
        if name.endswith(("hook_weights", "hook_read_weights", "hook_write_weights", "hook_stream_mix"))
    ]
    _, clean = model.run_with_cache(tokens)
    moved = outputs[basis_index(target)]
    hooks = [(name, lambda t, hook: clean[hook.name]) for name in outputs + weights if name != moved]
    hooks.append((moved, lambda t, hook: clean[hook.name] + delta))
    seen = {}
    hooks += [(name, lambda t, hook: seen.__setitem__(hook.name, t)) for name in inputs]
    model.run_with_hooks(tokens, fwd_hooks=hooks)
    return [seen[name] - clean[name] for name in inputs]


@pytest.mark.parametrize("fields", KINDS, ids=lambda f: "-".join(f"{v}" for v in f.values()))
def test_the_mixing_matrix_predicts_how_every_input_moves(fields):
    """Per token, h_c = Σ_i M[c, i] f_i (+ M[c, e] e) with the mixing weights held: moving f_i by δ moves h_c by
    M[c, i] δ. An oracle independent of how each kind computes M."""
    model = randomize(model_of(**fields)).double()
    tokens = tokens_for(model)
    groups = mixing_coefficients(model, tokens, per_group=True).double()  # [batch, pos, groups, J+1, J+1]
    for target in [EMBEDDING, 0, model.cfg.n_sublayers // 2]:
        delta = torch.randn(*tokens.shape, model.cfg.d_model, dtype=torch.float64)
        changes = _freeze_and_perturb(model, tokens, target, delta)
        for consumer, change in enumerate(changes):
            per_group = groups[..., consumer, basis_index(target)]  # each channel group moves by its own weight
            expected = (per_group[..., None] * delta.unflatten(-1, (per_group.shape[-1], -1))).flatten(-2)
            torch.testing.assert_close(change, expected, rtol=1e-6, atol=1e-8, msg=f"{fields} f{target} -> {consumer}")
    averaged = mixing_coefficients(model, tokens)
    torch.testing.assert_close(averaged.double(), groups.mean(-3))


def test_mixing_matrix_of_each_kind_at_initialisation():
    tokens = tokens_for(model_of())
    standard = depth_mixing_matrix(model_of(), tokens)
    assert (standard["weight"] == 1.0).all()
    dense = depth_mixing_matrix(model_of(residual="denseformer"), tokens)
    assert dense["weight"].tolist() == standard["weight"].tolist()
    mhc = mixing_diagnostics(model_of(residual="mhc"), tokens)
    assert ((mhc["stream_dominance"] > 0.25) & (mhc["stream_dominance"] < 1)).all()
    full = mixing_diagnostics(model_of(residual="attnres"), tokens)  # uniform α: every earlier output read equally
    assert full["effective_sources"].tolist() == pytest.approx(list(range(1, 8)))
    assert full["max_weight"].tolist() == pytest.approx([1 / n for n in range(1, 8)])


@pytest.mark.parametrize(
    "fields",
    [dict(residual="denseformer"), dict(residual="mhc"), dict(residual="attnres", attnres_heads=2, attnres_window=2)],
)
def test_pruning_runs_on_every_kind(fields):
    model = randomize(model_of(**fields))
    task = make_task("copy", vocab_size=20, seq_len=24, min_len=4, max_len=6)
    tables = prune_tables(model, task.eval_batch(4))
    sensitivity = tables["pruning_sensitivity"]
    assert len(sensitivity) == model.cfg.n_sublayers and sensitivity["routing_mass"].notna().all()
    assert all(math.isfinite(value) for value in sensitivity["dloss_remove"])


# ---------------------------------------------------------------------------- end to end
KIND_RUNS = {
    "denseformer": ["model.residual=denseformer"],
    "mhc": ["model.residual=mhc"],
    "ablations": ["model.attnres_heads=2", "model.attnres_query=input", "model.attnres_window=2"],
}


@pytest.fixture(scope="module")
def kind_runs(tmp_path_factory):
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    root = tmp_path_factory.mktemp("kinds")
    for name, overrides in KIND_RUNS.items():
        train(
            apply_overrides(get_preset("smoke"), [*overrides, "train.steps=20", "train.checkpoint_every=20"]),
            root / name,
            progress=False,
        )
    return root


@pytest.mark.parametrize("name", list(KIND_RUNS))
@pytest.mark.slow
def test_every_kind_trains_records_and_analyses(kind_runs, name):
    from attnres_lens import load_run
    from attnres_lens.analysis.run import analyze_run, prune_run

    run = load_run(kind_runs / name)
    recorded = run.records["depth_mixing"]
    last = recorded[recorded["step"] == 20].drop(columns="step").reset_index(drop=True)
    tokens = run.config.build_task().eval_batch(run.config.train.eval_size).tokens[: run.config.train.record_size]
    computed = depth_mixing_matrix(run.model, tokens)
    torch.testing.assert_close(
        torch.tensor(last["weight"].to_numpy()), torch.tensor(computed["weight"].to_numpy()), rtol=1e-4, atol=1e-5
    )
    analyzed = analyze_run(kind_runs / name, samples=4, progress=False)
    assert "depth_mixing" in analyzed.tables and analyzed.report_path.is_file()
    result = prune_run(kind_runs / name, samples=4, progress=False)
    assert result.report_path.is_file()


# ---------------------------------------------------------------------------- names of earlier versions
# What versions before the rename wrote for mHC (docs/run_directory.md §2): spelled out here, not taken from config.py.
OLD_MHC_FIELDS = {"mhc_streams": "hyper_streams", "mhc_sinkhorn_iters": "hyper_sinkhorn_iters", "mhc_eps": "hyper_eps"}


def as_written_before_the_mhc_rename(model: dict) -> dict:
    old = {OLD_MHC_FIELDS.get(name, name): value for name, value in model.items()}
    assert old["residual"] == "mhc"
    return {**old, "residual": "hyper"}


def rewrite_with_old_mhc_names(run) -> None:
    """config.json and every weights checkpoint's metadata as an earlier version wrote them (the parameter names,
    `attn_hc.fn` …, did not change)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((run / "config.json").read_text())
    config["model"] = as_written_before_the_mhc_rename(config["model"])
    (run / "config.json").write_text(json.dumps(config))
    weights = [path for path in (run / "checkpoints").glob("step_*.safetensors") if ".state." not in path.name]
    assert weights
    for path in weights:
        with safe_open(str(path), "pt") as handle:
            metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
        metadata["model_config"] = json.dumps(as_written_before_the_mhc_rename(json.loads(metadata["model_config"])))
        save_file(tensors, str(path), metadata=metadata)


def test_a_run_written_with_the_old_mhc_names_loads_evaluates_and_resumes(kind_runs, tmp_path):
    from attnres_lens import load_run
    from attnres_lens.training import resume

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(kind_runs / "mhc", old)
    shutil.copytree(kind_runs / "mhc", new)
    rewrite_with_old_mhc_names(old)
    assert '"hyper_streams"' in (old / "config.json").read_text()
    old_run, new_run = load_run(old), load_run(new)
    assert old_run.model_config.residual == "mhc" and old_run.model_config == new_run.model_config
    tokens = new_run.config.build_task().eval_batch(4).tokens
    torch.testing.assert_close(old_run.model(tokens), new_run.model(tokens), rtol=0, atol=0)
    for run in (old, new):
        resume(run, progress=False, steps=30)
    old_metrics, new_metrics = load_run(old, load_model=False).metrics, load_run(new, load_model=False).metrics
    assert old_metrics["step"].max() == 30
    columns = ["step", "loss", "eval_loss"]
    pd.testing.assert_frame_equal(old_metrics[columns], new_metrics[columns])
    rewritten = json.loads((old / "config.json").read_text())["model"]  # a resume writes today's names
    assert rewritten["residual"] == "mhc" and "mhc_streams" in rewritten and "hyper_streams" not in rewritten


@pytest.mark.parametrize(
    "assignment, message",
    [
        ("model.residual=hyper", "residual='hyper' was renamed 'mhc'; set residual='mhc'"),
        ("model.hyper_streams=2", r"unknown model field 'hyper_streams' \(renamed: hyper_streams -> mhc_streams\)"),
        ("hyper_eps=1e-5", r"no section has it \(renamed: hyper_eps -> mhc_eps\)"),
    ],
)
def test_old_mhc_names_in_new_settings_are_refused_naming_the_new_ones(assignment, message):
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset

    with pytest.raises(ValueError, match=message):
        apply_overrides(get_preset("smoke"), [assignment])
    with pytest.raises(ValueError, match="preset 'depth-hyper' was renamed 'depth-mhc'; use --preset depth-mhc"):
        get_preset("depth-hyper")


def test_a_stored_config_with_both_the_old_and_the_new_name_is_refused():
    from attnres_lens.config import ModelConfig

    stored = small_config("mhc").to_dict()
    ModelConfig.from_stored(stored)
    with pytest.raises(ValueError, match="both 'hyper_eps' and 'mhc_eps'"):
        ModelConfig.from_stored({**stored, "hyper_eps": 1e-6})


@pytest.mark.parametrize("fields", [dict(residual="denseformer"), dict(residual="mhc")])
def test_depth_logit_attribution_is_exact_for_every_kind(fields):
    """Through M, DenseFormer's and mHC's final input splits exactly into per-output terms: they sum to the logit."""
    from attnres_lens.analysis.attribution import depth_input_decomposition, depth_logit_attribution

    model = randomize(model_of(**fields)).double()
    tokens = tokens_for(model)
    table = depth_logit_attribution(model, tokens)
    per_position = table.groupby(["sequence", "position"]).agg(
        total=("contribution", "sum"), logit=("logit", "first"), bias=("bias", "first")
    )
    torch.testing.assert_close(
        torch.tensor((per_position["total"] + per_position["bias"]).to_numpy()),
        torch.tensor(per_position["logit"].to_numpy()),
        rtol=1e-9,
        atol=1e-9,
    )
    assert len(depth_input_decomposition(model, tokens)) > 0


def test_attribute_runs_on_an_attnres_option_and_analysis_out_is_never_a_run(tmp_path, capsys):
    from attnres_lens.cli import main as cli_main
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    run = tmp_path / "sigmoid"
    train(
        apply_overrides(
            get_preset("smoke"), ["model.attnres_score=sigmoid", "train.steps=10", "train.checkpoint_every=10"]
        ),
        run,
        progress=False,
    )
    assert cli_main(["attribute", str(run), "--samples", "3", "--no-progress"]) == 0  # corrupted patching skipped
    capsys.readouterr()
    for command in ("attribute", "prune"):
        assert cli_main([command, str(run), "--samples", "3", "--out", str(run), "--no-progress"]) == 2
        assert "is a run directory" in capsys.readouterr().err
    # inside a run only its analysis folder: records/ holds tables an output could replace (depth_weights)
    records = {path.name: path.read_bytes() for path in (run / "records").iterdir()}
    for inside in (run / "records", run / "checkpoints" / "new"):
        assert cli_main(["analyze", str(run), "--samples", "3", "--out", str(inside), "--no-progress"]) == 2
        assert "is inside the run directory" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in (run / "records").iterdir()} == records
    assert not (run / "checkpoints" / "new").exists()
    assert (
        cli_main(["analyze", str(run), "--samples", "3", "--out", str(run / "analysis" / "again"), "--no-progress"])
        == 0
    )
    # another run's analysis folder would get this run's tables under that run's name
    shutil.copytree(run, tmp_path / "other")
    assert (
        cli_main(
            ["analyze", str(run), "--samples", "3", "--out", str(tmp_path / "other" / "analysis"), "--no-progress"]
        )
        == 2
    )
    assert "is inside another run directory" in capsys.readouterr().err


def test_hooks_editing_mixing_weights_in_place_leave_the_parameters_alone():
    """A hook's tensor is the pass's copy: an in-place edit (a knockout) lasts one pass and a cache is a snapshot.
    Scalar mixing once handed hook_logits a view of its parameter, DenseFormer hook_dwa_weights the parameter."""
    scalar = randomize(model_of(residual="attnres", attnres_mixing="scalar"))
    before = scalar.final_res.scalar_logits.detach().clone()

    def knock_out_the_embedding(z, hook):
        z[..., 0] = float("-inf")

    with torch.no_grad():  # batch 2: the expanded view would even refuse the write
        scalar.run_with_hooks(tokens_for(scalar), fwd_hooks=[("final_res.hook_logits", knock_out_the_embedding)])
    assert torch.equal(scalar.final_res.scalar_logits, before)

    dense = randomize(model_of(residual="denseformer"))
    name, tokens = "blocks.1.dwa.hook_dwa_weights", tokens_for(dense)
    _, cache = dense.run_with_cache(tokens)
    snapshot = cache[name].clone()
    weights = dense.blocks[1].dwa.weights
    with torch.no_grad():
        weights.add_(1.0)
        dense.run_with_hooks(tokens, fwd_hooks=[(name, lambda w, hook: w.zero_())])
    assert torch.equal(cache[name], snapshot) and torch.equal(weights, snapshot + 1)


def test_per_group_mixing_without_tokens_asks_for_them():
    model = model_of(residual="attnres", attnres_heads=2)
    with pytest.raises(ValueError, match="depend on the input: pass tokens"):
        mixing_coefficients(model, None, per_group=True)
