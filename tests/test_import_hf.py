"""`attnres-lens import-hf` (docs/interop.md §7): run directories that refer to a transformers Inkling or DeepSeek V4
folder, their checks when the folder moves or changes, and analyze / prune / attribute on them (tiny models from
tests/helpers.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnres_lens import from_transformers  # noqa: E402
from attnres_lens import hf_runs as hf_runs_module  # noqa: E402
from attnres_lens.analysis.applicability import INDUCTION_TOOLKIT_ONLY  # noqa: E402
from attnres_lens.analysis.attribution_report import bridge_visits  # noqa: E402
from attnres_lens.analysis.engine import evaluate  # noqa: E402
from attnres_lens.analysis.induction import task_probe  # noqa: E402
from attnres_lens.analysis.interventions import removal_hooks  # noqa: E402
from attnres_lens.analysis.kv_shift import conv_tap_decomposition  # noqa: E402
from attnres_lens.analysis.prompts import text_codec  # noqa: E402
from attnres_lens.analysis.visits import sublayers_named, visit_groups, visit_knockouts, visit_removals  # noqa: E402
from attnres_lens.bridge import SUPPORTED_MODELS as INKLING_MODELS  # noqa: E402
from attnres_lens.bridge_mhc import SUPPORTED_MODEL as DEEPSEEK_V4_MODEL  # noqa: E402
from attnres_lens.bridge_mhc import DeepseekV4Bridge  # noqa: E402
from attnres_lens.hf_runs import EVAL_SEQUENCES, RESIDUALS, TransformersModel  # noqa: E402
from attnres_lens.rundir import RunDirError, load_run  # noqa: E402
from attnres_lens.tasks import make_task  # noqa: E402
from tests.helpers import HF_RUN_TEXT, TINY_TOKENIZER_WORDS, run_cli  # noqa: E402


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_refers_to_the_folder_by_path_and_hashes(inkling_folders, hf_runs):
    folder = Path(inkling_folders["plain"])
    config = json.loads((hf_runs["plain"] / "config.json").read_text())
    model = config["model"]
    assert model["source"] == "transformers" and model["folder"] == str(folder.resolve())
    assert model["architecture"] == "Inkling2ForCausalLM" and model["transformers_version"] == transformers.__version__
    assert model["files_sha256"] == {name: _sha256(folder / name) for name in ("config.json", "model.safetensors")}
    assert not list(hf_runs["plain"].rglob("*.safetensors"))  # no copy of the weights
    run = load_run(hf_runs["plain"])
    assert run.checkpoint == "model_folder" and run.model_config.residual == "attnres"
    tokens = torch.tensor([[3, 17, 42, 5, 59, 0, 21, 8]])
    reference = transformers.Inkling2ForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(run.model(tokens), reference(input_ids=tokens, use_cache=False).logits)


def test_text_goes_through_the_folders_tokenizer(inkling_folders, hf_runs):
    run = load_run(hf_runs["loop"], load_model=False)
    words = HF_RUN_TEXT.split()
    expected = [TINY_TOKENIZER_WORDS.index(word) for word in words]  # the word-level vocabulary, by hand
    assert np.load(run.config.task.params["path"]).tolist() == expected
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(run.model_config.files_sha256)
    assert run.config.task.name == "tokens" and run.config.task.params["seq_len"] == 24
    # the text is evaluation data only: its windows span all of it, the first from its first token
    windows = run.config.build_task().eval_batch(16).tokens
    assert windows[0].tolist() == expected[:24] and windows[-1].tolist() == expected[-24:]


def test_a_changed_or_moved_folder_is_refused_naming_it(inkling_folders, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(inkling_folders["plain"], folder)
    assert run_cli(["import-hf", str(folder), "--out", str(tmp_path / "run")], capsys)[0] == 0
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunDirError, match=r"model.*changed since the import.*config\.json.*import-hf"):
        load_run(tmp_path / "run")
    folder.rename(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match=rf"{folder}.*gone.*import-hf"):
        load_run(tmp_path / "run")
    code, _, err = run_cli(["analyze", str(tmp_path / "run"), "--samples", "8"], capsys)
    assert code == 2 and "gone" in err and "Traceback" not in err


def test_import_refuses_remote_code_pickles_no_tokenizer_and_used_folders(inkling_folders, tmp_path, capsys):
    remote = tmp_path / "remote"
    shutil.copytree(inkling_folders["plain"], remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Model"}}))
    code, _, err = run_cli(["import-hf", str(remote), "--out", str(tmp_path / "r1")], capsys)
    assert code == 2 and "auto_map" in err and not (tmp_path / "r1").exists()

    pickled = tmp_path / "pickled"
    shutil.copytree(inkling_folders["plain"], pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    code, _, err = run_cli(["import-hf", str(pickled), "--out", str(tmp_path / "r2")], capsys)
    assert code == 2 and "pytorch_model.bin" in err and "pickle" in err

    (tmp_path / "text.txt").write_text(HF_RUN_TEXT)
    code, _, err = run_cli(
        ["import-hf", inkling_folders["plain"], "--out", str(tmp_path / "r3"), "--text", str(tmp_path / "text.txt")],
        capsys,
    )
    assert code == 2 and "no tokenizer" in err and not (tmp_path / "r3").exists()
    code, _, err = run_cli(
        ["import-hf", inkling_folders["loop"], "--out", str(tmp_path / "r4"), "--text", str(tmp_path / "nope.txt")],
        capsys,
    )
    assert code == 2 and "--text" in err and "nope.txt is not a file" in err and not (tmp_path / "r4").exists()

    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    code, _, err = run_cli(["import-hf", inkling_folders["plain"], "--out", str(tmp_path / "used")], capsys)
    assert code == 2 and "not empty" in err and (tmp_path / "used" / "notes.txt").read_text() == "mine"


def test_a_run_with_its_own_tokens_moves_and_a_model_folder_is_not_taken_for_a_run(
    inkling_folders, smoke_run, tmp_path, capsys, monkeypatch
):
    """An import-hf run's config.json names its own tokens.npy relative to the run, so the run reads its text
    wherever it is moved; a trained run's relative token path stays the working directory's; a transformers model
    folder given where a run goes is named as one, with the commands that make it a run."""
    (tmp_path / "text.txt").write_text(HF_RUN_TEXT)
    first = tmp_path / "first"
    command = ["import-hf", inkling_folders["loop"], "--out", str(first), "--text", str(tmp_path / "text.txt")]
    assert run_cli([*command, "--set", "task.seq_len=24"], capsys)[0] == 0
    assert json.loads((first / "config.json").read_text())["task"]["path"] == "tokens.npy"
    expected = load_run(first, load_model=False).config.build_task().eval_batch(4).tokens
    moved = first.rename(tmp_path / "moved")
    run = load_run(moved, load_model=False)
    assert run.config.task.params["path"] == str((moved / "tokens.npy").resolve())
    assert torch.equal(run.config.build_task().eval_batch(4).tokens, expected)

    trained = tmp_path / "trained"  # a toolkit run trained on ./tokens.npy of its working directory
    shutil.copytree(smoke_run, trained)
    config = json.loads((trained / "config.json").read_text())
    task = config["task"]
    config["task"] = {"name": "tokens", "path": "tokens.npy", "vocab_size": task["vocab_size"], "seq_len": 9}
    (trained / "config.json").write_text(json.dumps(config))
    (tmp_path / "cwd").mkdir()
    np.save(tmp_path / "cwd" / "tokens.npy", np.arange(200, dtype=np.uint32) % task["vocab_size"])
    monkeypatch.chdir(tmp_path / "cwd")
    assert load_run(trained, load_model=False).config.task.params["path"] == "tokens.npy"

    with pytest.raises(RunDirError, match=r"is a model folder .*'inkling2.*import-hf FOLDER --out RUN"):
        load_run(inkling_folders["plain"])
    with pytest.raises(RunDirError, match=r"does not exist; .*`import-hf` or `import-fla`"):
        load_run(tmp_path / "nope")


def test_a_run_offers_only_what_a_referred_folder_has(hf_runs, tmp_path, capsys):
    with pytest.raises(RunDirError, match="one set of weights.*latest"):
        load_run(hf_runs["plain"], checkpoint="best_of_three")
    code, _, err = run_cli(["export-fla", str(hf_runs["plain"]), "--out", str(tmp_path / "fla")], capsys)
    assert code == 2 and "refers to a transformers model folder" in err and not (tmp_path / "fla").exists()
    records = load_run(hf_runs["plain"], load_model=False).records
    with pytest.raises(KeyError, match="run plain has no 'magnitudes' records: it was imported .* no training records"):
        records["magnitudes"]
    with pytest.raises(KeyError, match="no record table is named 'magnitude'; the tables are \\['depth_weights'"):
        records["magnitude"]


@pytest.mark.parametrize("kind", ["plain", "loop"])
@pytest.mark.slow  # every analysis command on each model: about a minute each (make test-fast skips it)
def test_analyze_prune_attribute_run_and_say_what_they_skip(hf_runs, kind, tmp_path, capsys):
    run = tmp_path / kind
    shutil.copytree(hf_runs[kind], run)
    for command in ("analyze", "prune", "attribute"):
        extra = ["--prompt", "the cat sat on the mat"] if command == "attribute" and kind == "loop" else []
        code, out, err = run_cli([command, str(run), "--samples", "8", "--no-progress", *extra], capsys)
        assert code == 0, err
        assert "Traceback" not in out + err
        if command == "analyze":  # a bridged model's missing TransformerLens score comes with its reason
            assert "TransformerLens induction score not computed (TransformerLens' detect_head" in out
    analysis = json.loads((run / "analysis" / "analysis_summary.json").read_text())
    skipped = {row["table"]: row["reason"] for row in analysis.get("skipped", [])}
    assert "induction_heads" not in skipped and analysis["top_induction_heads"]
    assert "top_depth_sources" in analysis and (run / "analysis" / "depth_weights.csv").is_file()
    attribution = json.loads((run / "analysis" / "attribution_summary.json").read_text())
    assert not {"depth_dla", "depth_dla_summary"} & {row["table"] for row in attribution["skipped"]}
    dla = pd.read_parquet(run / "analysis" / "depth_dla.parquet")  # the pre-cap logit, split exactly
    totals = dla.groupby(["sequence", "position"]).agg(sum=("contribution", "sum"), logit=("logit", "first"))
    assert ((totals["sum"] - totals["logit"]).abs() < 1e-4).all()
    assert "kv_shift" not in {row["table"] for row in attribution["skipped"]}
    assert attribution["top_edges"]  # exact knockouts ran
    assert "not computed: depth_dla: " not in out
    # the K/V tap table is conv_tap_decomposition of the transformers model on the run's repeated-tokens probe
    loaded = load_run(run)
    probe = task_probe(loaded.model, loaded.config.build_task(), 8)
    expected = conv_tap_decomposition(loaded.model.hf_model, probe)
    written = pd.read_parquet(run / "analysis" / "kv_shift.parquet")
    assert list(written.columns) == list(expected.columns) and set(expected["width"]) == {4}
    pd.testing.assert_frame_equal(written, expected, check_dtype=False, rtol=1e-6)
    induction = pd.read_parquet(run / "analysis" / "induction_heads.parquet")
    # one row per (layer, visit, head) in both tables, the tap table's visits (from 0) renumbered as the bridge's
    visits = {(step.layer, step.visit or 0) for step in loaded.model.visits}
    assert set(zip(induction["layer"], induction["visit"])) == visits
    assert set(zip(expected["layer"], bridge_visits(expected))) == visits and len(induction) == len(expected)
    if kind == "loop":  # the prompt went through the folder's tokenizer, and the report names its tokens
        assert attribution["prompt"] == "0 1 2 3 0 4"
        report = (run / "analysis" / "attribution_report.html").read_text()
        assert all(json.dumps(label) in report for label in ("0: the→cat", "4: the→mat")), "tokens not by their text"
        prune = json.loads((run / "analysis" / "prune_summary.json").read_text())
        assert {row["sublayers"] for row in prune["visits_removed_together"]} >= {"L3.attn@*", "L3.mlp@*"}
    # the report the CLI writes and the Pruning page shows: the looped layers' visits removed together, on the Mini
    prune_report = (run / "analysis" / "prune_report.html").read_text()
    assert "<h2>Sublayers removable within" in prune_report
    assert ("Looped layers: every visit removed together" in prune_report) == (kind == "loop")


def test_visits_are_named_one_by_one_and_all_together(inkling_folders):
    model = from_transformers(inkling_folders["loop"]).eval()
    names = [model.sublayer_name(j) for j in range(model.n_sublayers)]
    everyone = [j for j, name in enumerate(names) if name.startswith("L3.attn@")]
    assert len(everyone) == 3 and sublayers_named(model, ["L3.attn@*"]) == everyone
    assert sublayers_named(model, ["L3.attn@2", "L0.mlp"]) == sorted([names.index("L3.attn@2"), names.index("L0.mlp")])
    assert set(visit_groups(model)) == {f"L{layer}.{kind}@*" for layer in range(2, 6) for kind in ("attn", "mlp")}
    with pytest.raises(ValueError, match=r"'L3\.attn'.*L3\.attn@1.*L3\.attn@\*"):
        sublayers_named(model, ["L3.attn"])
    with pytest.raises(ValueError, match="no sublayer is named 'L9.mlp'"):
        sublayers_named(model, ["L9.mlp"])

    batch = make_task("copy", vocab_size=60, seq_len=17, min_len=4, max_len=8).eval_batch(4)
    base = evaluate(model, batch).loss
    removals = visit_removals(model, batch).set_index("sublayers")
    each = removal_hooks(model, [names.index(f"L3.attn@{v}") for v in (1, 2, 3)])
    assert removals.loc["L3.attn@*", "dloss_together"] == pytest.approx(evaluate(model, batch, each).loss - base)

    # every visit's softmax loses 'emb' together, by hook names written here from docs/interop.md §7
    knockouts = visit_knockouts(model, batch).set_index(["consumer", "source_label"])
    hooks = []
    for visit in (1, 2, 3):
        consumer = names.index(f"L3.attn@{visit}")
        position = model.source_labels(consumer).index("emb")

        def knock(bias, hook, position=position):
            bias = bias.clone()
            bias[..., position] = float("-inf")
            return bias

        hooks.append((f"blocks.3.visit{visit}.attn_res.hook_logit_bias", knock))
    direct = evaluate(model, batch, hooks).loss - base
    assert knockouts.loc[("L3.attn@*", "emb"), "dloss_together"] == pytest.approx(direct, rel=1e-5, abs=1e-6)
    assert knockouts.loc[("L3.attn@*", "emb"), "dloss_together"] != 0


def _answer_loss(logits: torch.Tensor, batch) -> float:
    """Mean next-token cross-entropy over the batch's answer positions, written here from the definition."""
    answers = batch.answer_mask & (batch.targets != -100)
    return torch.nn.functional.cross_entropy(logits[answers].double(), batch.targets[answers]).item()


@pytest.mark.parametrize("kind", ["plain", "loop"])
def test_induction_scores_on_a_bridged_model_are_transformers_attentions(inkling_folders, kind):
    """The prefix and previous-token scores per (layer, visit, head) against transformers' own attentions
    (`output_attentions` on an untouched instance, in forward order), and one head's zero ablation against the same
    head's slice of the attention output zeroed before transformers' output projection."""
    from attnres_lens.analysis.induction import BRIDGE_NAN_REASONS, induction_head_scores, repeated_batch

    bridge = from_transformers(inkling_folders[kind]).eval()
    batch = repeated_batch(3, 4, 60, seed=1)  # L = 4: the tiny models' sliding window
    scores = induction_head_scores(bridge, batch)
    architecture = json.loads((Path(inkling_folders[kind]) / "config.json").read_text())["architectures"][0]
    reference = getattr(transformers, architecture).from_pretrained(inkling_folders[kind]).eval()
    with torch.no_grad():
        attentions = reference(input_ids=batch.tokens, use_cache=False, output_attentions=True).attentions
    assert len(attentions) == len(bridge.visits) == scores[["layer", "visit"]].drop_duplicates().shape[0]
    queries = torch.arange(5, 9)  # second-copy queries of [BOS, r1..r4, r1..r4]; their target is 3 tokens back
    for step, pattern in zip(bridge.visits, attentions, strict=True):
        rows = scores[(scores["layer"] == step.layer) & (scores["visit"] == (step.visit or 0))].set_index("head")
        prefix = pattern[:, :, queries, queries - 3].double().mean(dim=(0, 2))
        previous = torch.stack([pattern[:, :, q, q - 1] for q in range(1, 9)], -1).double().mean(dim=(0, 2))
        np.testing.assert_allclose(rows["prefix_score"], prefix.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(rows["previous_token_score"], previous.numpy(), rtol=1e-5, atol=1e-7)
    assert scores[list(BRIDGE_NAN_REASONS)].isna().all().all()
    assert scores["ablation_zero_score"].notna().all() and (scores["ablation_zero_score"] != 0).any()

    step = max(bridge.visits, key=lambda s: s.visit or 0) if kind == "loop" else bridge.visits[2]  # a last visit
    layer, head = step.layer, 1
    d_head = reference.model.layers[layer].self_attn.head_dim
    calls = {"n": 0}

    def zero_head(module, args):
        calls["n"] += 1
        if calls["n"] != (step.visit or 1):
            return None
        z = args[0].clone()
        z[..., head * d_head : (head + 1) * d_head] = 0
        return (z, *args[1:])

    with torch.no_grad():
        clean = _answer_loss(reference(input_ids=batch.tokens, use_cache=False).logits, batch)
        reference.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero_head)
        ablated = _answer_loss(reference(input_ids=batch.tokens, use_cache=False).logits, batch)
    row = scores.set_index(["layer", "visit", "head"]).loc[(layer, step.visit or 0, head)]
    assert ablated != clean and row["ablation_zero_score"] == pytest.approx(ablated - clean, rel=1e-4, abs=1e-6)


def test_prompts_and_labels_go_through_the_folders_tokenizer_where_it_has_one(hf_runs, smoke_run):
    loop, plain = (load_run(hf_runs[kind], load_model=False) for kind in ("loop", "plain"))
    codec = text_codec(loop.config, loop.path)
    assert codec.encode("the cat sat", "x") == [0, 1, 2] and [codec.name(token) for token in (0, 1, 2)] == [
        "the",
        "cat",
        "sat",
    ]
    assert codec.name(40) == "#40"  # the model has ids its tokenizer has no token for
    loads = hf_runs_module._load_tokenizer.cache_info().misses
    text_codec(loop.config, loop.path)  # the dashboard asks on every rerun: the tokenizer is loaded once
    assert hf_runs_module._load_tokenizer.cache_info().misses == loads
    for run in (plain, load_run(smoke_run, load_model=False)):  # no tokenizer; a synthetic task: ids only
        assert text_codec(run.config, run.path) is None


# ---------------------------------------------------------------------------- DeepSeek V4 (mHC)
def _deepseek_v4(folder: str):
    """A second, untouched instance of the saved DeepSeek V4: transformers' own forward."""
    return transformers.DeepseekV4ForCausalLM.from_pretrained(folder).eval()


def test_a_deepseek_v4_folder_imports_as_an_mhc_run(deepseek_v4_folder, deepseek_v4_run, tmp_path, capsys):
    folder = Path(deepseek_v4_folder)
    saved = json.loads((folder / "config.json").read_text())
    assert json.loads((deepseek_v4_run / "config.json").read_text())["model"] == {  # the Inkling runs' fields
        "source": "transformers",
        "folder": str(folder.resolve()),
        "architecture": "DeepseekV4ForCausalLM",
        "model_type": "deepseek_v4",
        "transformers_version": transformers.__version__,
        "d_vocab": saved["vocab_size"],
        "n_ctx": saved["max_position_embeddings"],
        "n_layers": saved["num_hidden_layers"],
        "files_sha256": {name: _sha256(folder / name) for name in ("config.json", "model.safetensors")},
        "dtype": "float32",
    }
    run = load_run(deepseek_v4_run)
    assert isinstance(run.model, DeepseekV4Bridge) and run.model_config.residual == "mhc"
    assert run.model_config.residual_label.startswith("mHC")
    # the loss measured at import is transformers' own loss on the task's held-out sequences
    tokens = run.config.build_task().eval_batch(EVAL_SEQUENCES).tokens
    with torch.no_grad():
        expected = _deepseek_v4(deepseek_v4_folder)(input_ids=tokens, labels=tokens, use_cache=False).loss
    assert run.config.provenance["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)

    base = tmp_path / "base"  # the bare DeepseekV4Model has no lm_head: refused by its architecture, naming both
    shutil.copytree(folder, base)
    (base / "config.json").write_text(json.dumps({**saved, "architectures": ["DeepseekV4Model"]}))
    code, _, err = run_cli(["import-hf", str(base), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "DeepseekV4Model" in err and "DeepseekV4ForCausalLM" in err
    with pytest.raises(ValueError, match=r"model\.architecture must be one of .*got 'LlamaForCausalLM'"):
        TransformersModel.from_dict({**run.model_config.to_dict(), "architecture": "LlamaForCausalLM"})
    # import-hf opens exactly what the bridges open (the table is spelled in hf_runs so a config reads without them)
    assert set(RESIDUALS) == {*INKLING_MODELS, DEEPSEEK_V4_MODEL}


def test_analyze_prune_attribute_on_a_deepseek_v4_run(deepseek_v4_folder, deepseek_v4_run, tmp_path, capsys):
    """What applies to an mHC model is computed and checked against transformers and the bridge's M; the rest is
    listed as not computed, with the reason."""
    run = tmp_path / "mhc"
    shutil.copytree(deepseek_v4_run, run)
    outputs = {}
    for command, samples in (("analyze", 4), ("prune", 2), ("attribute", 2)):
        code, out, err = run_cli([command, str(run), "--samples", str(samples), "--no-progress"], capsys)
        assert code == 0, err
        assert "Traceback" not in out + err
        outputs[command] = out
    written = run / "analysis"
    loaded = load_run(run)
    bridge, task = loaded.model, loaded.config.build_task()
    reference = _deepseek_v4(deepseek_v4_folder)

    analysis = json.loads((written / "analysis_summary.json").read_text())
    assert analysis["residual"] == "mhc"
    assert {row["table"]: row["reason"] for row in analysis["skipped"]} == {"induction_heads": INDUCTION_TOOLKIT_ONLY}
    assert "not computed: induction_heads" in outputs["analyze"]
    assert not (written / "depth_weights.parquet").exists()  # no depth softmax: no α to write
    mixing = pd.read_parquet(written / "depth_mixing.parquet")  # M, token-averaged over the analysed sequences
    coefficients = bridge.mixing_coefficients(task.eval_batch(4).tokens).mean(dim=(0, 1)).double()
    expected_m = [coefficients[c, s + 1].item() for c, s in zip(mixing["consumer"], mixing["sublayer"])]
    assert len(mixing) == sum(c + 1 for c in range(bridge.n_sublayers + 1))  # every (consumer, earlier output)
    np.testing.assert_allclose(mixing["weight"], expected_m, rtol=1e-6)
    assert len(pd.read_parquet(written / "mixing_diagnostics.parquet")) == bridge.n_sublayers + 1

    batch = task.eval_batch(2)
    sensitivity = pd.read_parquet(written / "pruning_sensitivity.parquet").set_index("label")
    with torch.no_grad():
        clean = reference(input_ids=batch.tokens, labels=batch.tokens, use_cache=False).loss.item()
        handle = reference.model.layers[1].mlp.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out))
        removed = reference(input_ids=batch.tokens, labels=batch.tokens, use_cache=False).loss.item()
        handle.remove()
    assert sensitivity["base_loss"].iloc[0] == pytest.approx(clean, rel=1e-5)
    assert sensitivity.loc["L1.mlp", "dloss_remove"] == pytest.approx(removed - clean, rel=1e-4, abs=1e-6)
    prune = json.loads((written / "prune_summary.json").read_text())
    assert "routing_correlations" not in prune and not (written / "routing.parquet").exists()  # nothing to route

    attribution = json.loads((written / "attribution_summary.json").read_text())
    skipped = {row["table"]: row["reason"] for row in attribution["skipped"]}
    assert set(skipped) == {"kv_shift", "edge_knockouts", "edge_sensitivity", "routing_audit"}
    assert "DeepseekV4Bridge has none" in skipped["edge_knockouts"]  # no depth softmax: no edges, and why
    assert all(f"not computed: {name}: " in outputs["attribute"] for name in skipped)
    # depth DLA on the prompt: its logit column is transformers' logit of each next token, which the terms add up to
    prompt = torch.tensor([[int(token) for token in attribution["prompt"].split()]])
    with torch.no_grad():
        prompt_logits = reference(input_ids=prompt, use_cache=False).logits[0].double()
    dla = pd.read_parquet(written / "depth_dla.parquet")
    per_position = dla.groupby("position").agg(
        total=("contribution", "sum"), bias=("bias", "first"), logit=("logit", "first"), target=("target", "first")
    )
    assert per_position["target"].tolist() == prompt[0, per_position.index + 1].tolist()  # the next token
    expected_logit = prompt_logits[per_position.index, per_position["target"]].numpy()
    np.testing.assert_allclose(per_position["logit"], expected_logit, rtol=1e-6)
    np.testing.assert_allclose(per_position["total"] + per_position["bias"], expected_logit, rtol=0, atol=1e-6)
    summary = pd.read_parquet(written / "depth_dla_summary.parquet")  # one row per source of the final readout
    assert summary["source_label"].tolist() == bridge.source_labels(bridge.n_sublayers)
    # every input split by M into its terms M[c, s] v_s, which rebuild the hooked input: the shares sum to 1
    inputs = pd.read_parquet(written / "depth_inputs.parquet")
    coefficients = bridge.mixing_coefficients(batch.tokens).mean(dim=(0, 1)).double()
    assert sorted(set(inputs["consumer"])) == list(range(bridge.n_sublayers + 1))
    np.testing.assert_allclose(inputs.groupby("consumer")["share"].sum(), 1.0, rtol=1e-5)
    members = inputs["members"].astype(int)  # one output per source: "-1" is e, M's column 0
    expected_alpha = [coefficients[c, s + 1].item() for c, s in zip(inputs["consumer"], members)]
    np.testing.assert_allclose(inputs["alpha"], expected_alpha, rtol=1e-6)
    assert "top_edges" not in attribution and not (written / "edge_knockouts.parquet").exists()
    # the lens of the final norm's input is the model's prediction: its top-1 rate is transformers' accuracy
    with torch.no_grad():
        predicted = reference(input_ids=batch.tokens, use_cache=False).logits.argmax(-1)
    answers = batch.answer_mask & (batch.targets != -100)
    accuracy = (predicted[answers] == batch.targets[answers]).double().mean().item()
    assert attribution["lens_final_top1"] == pytest.approx(accuracy)
