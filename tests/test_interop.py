"""Import from and export to flash-linear-attention, checked against FLA's own forward pass (docs/interop.md).

FLA's TransformerForCausalLM is the oracle: it runs on this CPU through tests/fla_cpu.py (Triton interpreter, an
SDPA stand-in for flash-attn, FLA's naive_attnres for its CUDA-only fused kernel). Every comparison uses non-trivial
weights: random pseudo-queries and key-norm gains (they start at 0 and 1, where every depth mix is uniform).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fla_cpu import fla_logits, fla_runtime  # noqa: E402  (first: it sets TRITON_INTERPRET before FLA imports triton)

pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install attnres_lens[fla])")

from attnres_lens import ModelConfig, load_run  # noqa: E402
from attnres_lens.cli import main  # noqa: E402
from attnres_lens.config import RESIDUAL_KINDS  # noqa: E402
from attnres_lens.interop import (  # noqa: E402
    FlaInteropError,
    check_exportable,
    default_task,
    export_fla_run,
    fla_config_dict,
    from_fla,
    import_fla_run,
    model_config_from_fla,
    read_fla_dir,
    save_fla,
    state_dict_to_fla,
    to_fla,
)
from attnres_lens.rundir import RunDir  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-4  # fp32 logits, FLA's forward against ours

with fla_runtime(DEVICE):
    from fla.models import TransformerConfig, TransformerForCausalLM


def make_fla(seed: int = 0, **overrides) -> TransformerForCausalLM:
    """A small FLA Transformer with every weight drawn at a scale that makes logits O(1): a wrong head split,
    transpose or source order changes them far beyond the tolerance."""
    params = dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=40,
        max_position_embeddings=24,
        intermediate_size=48,
        norm_eps=1e-5,
        attnres_block_size=2,
    )
    params.update(overrides)
    torch.manual_seed(seed)
    with fla_runtime(DEVICE):
        model = TransformerForCausalLM(TransformerConfig(**params)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):  # pre-norm, final-norm and depth key-norm gains
                param.copy_(1 + 0.3 * noise)
            elif "res_proj" in name:  # pseudo-queries: non-zero, depth logits of std ~2 (far from uniform weights)
                param.copy_(2 * noise / param.shape[-1] ** 0.5)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.to(DEVICE)


def tokens(vocab: int, batch: int = 2, length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_state(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].cpu(), tensor.cpu()), name


# (layers, d_model, heads, kv heads, block size, tied): standard, Full, Block 2/4/6 (6 leaves a partial last block
# in 4 layers and spans the whole 3-layer model), GQA from MHA to a single KV head, tied and untied
CASES = [
    (3, 32, 4, 4, None, False),
    (3, 32, 4, 2, None, True),
    (3, 32, 4, 2, 1, False),
    (2, 48, 6, 3, 1, True),
    (3, 32, 4, 1, 2, False),
    (4, 32, 2, 2, 2, True),
    (3, 64, 8, 2, 4, False),
    (4, 32, 4, 4, 4, True),
    (4, 32, 4, 2, 6, False),
    (3, 16, 2, 1, 6, True),
]


@pytest.mark.parametrize("layers, width, heads, kv_heads, block_size, tied", CASES)
@pytest.mark.slow
def test_logits_match_fla_and_the_round_trip_is_exact(layers, width, heads, kv_heads, block_size, tied):
    fla = make_fla(
        seed=layers * width + heads,
        hidden_size=width,
        num_hidden_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        attnres_block_size=block_size,
        tie_word_embeddings=tied,
        intermediate_size=width + 16,
    )
    ids = tokens(40, seed=width)
    expected = fla_logits(fla, ids).cpu()
    assert expected.std() > 0.3  # logits far from zero: the comparison below can fail

    ours = from_fla(fla)
    assert ours.cfg.residual == ("standard" if block_size is None else "attnres")
    assert ours.cfg.attnres_block_size == (block_size or 1) and ours.cfg.tie_word_embeddings == tied
    assert (ours(ids) - expected).abs().max().item() < TOLERANCE
    # the hooked (readable) depth mix computes the same thing
    hooked, cache = ours.run_with_cache(ids)
    assert (hooked - expected).abs().max().item() < TOLERANCE
    if block_size is not None:
        assert not torch.allclose(cache["final_res.hook_weights"][0, 0], cache["final_res.hook_weights"][0, 1])

    # FLA -> ours -> FLA: the same state dict, bit for bit; and the model built from it computes the same logits
    assert_same_state(state_dict_to_fla(ours.state_dict(), ours.cfg), fla.state_dict())
    with fla_runtime(DEVICE):
        back = to_fla(ours).to(DEVICE)
    assert_same_state(back.state_dict(), fla.state_dict())
    assert torch.equal(fla_logits(back, ids), fla_logits(fla, ids))


@pytest.mark.parametrize("tied", [False, True])
def test_directories_round_trip_through_from_pretrained(tmp_path, tied):
    fla = make_fla(seed=3, tie_word_embeddings=tied, attnres_block_size=4)
    fla.save_pretrained(tmp_path / "fla")
    ids = tokens(40, seed=1)
    expected = fla_logits(fla, ids).cpu()

    ours = from_fla(tmp_path / "fla")  # read without FLA: config.json + model.safetensors
    assert (ours(ids) - expected).abs().max().item() < TOLERANCE
    save_fla(ours, tmp_path / "ours")
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors"]
    with fla_runtime(DEVICE):
        reloaded = TransformerForCausalLM.from_pretrained(tmp_path / "ours").eval().to(DEVICE)
    assert_same_state(reloaded.state_dict(), fla.state_dict())
    assert torch.equal(fla_logits(reloaded, ids), fla_logits(fla, ids))
    assert_same_state(
        load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "fla" / "model.safetensors")
    )


def test_a_bf16_directory_imports_upcast_and_exports_back_bit_for_bit(tmp_path):
    fla = make_fla(seed=5, attnres_block_size=1).to(torch.bfloat16)
    fla.save_pretrained(tmp_path / "fla")
    config, weights = read_fla_dir(tmp_path / "fla")
    assert config["dtype"] == "bfloat16" and all(t.dtype == torch.bfloat16 for t in weights.values())
    run, _ = import_fla_run(tmp_path / "fla", tmp_path / "run")
    assert load_run(run).model.cfg.dtype == torch.float32  # upcast exactly for analysis
    export_fla_run(run, tmp_path / "back")  # in the dtype it came in, with the config it came with
    assert_same_state(
        load_file(tmp_path / "back" / "model.safetensors"), load_file(tmp_path / "fla" / "model.safetensors")
    )
    original, written = (
        json.loads((tmp_path / "fla" / "config.json").read_text()),
        json.loads((tmp_path / "back" / "config.json").read_text()),
    )
    assert written == original


def test_a_sharded_directory_imports(tmp_path):
    fla = make_fla(seed=7, attnres_block_size=None)
    fla.save_pretrained(tmp_path / "one")
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(tmp_path / "one" / "config.json", folder)
    weights = load_file(tmp_path / "one" / "model.safetensors")
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / file, metadata={"format": "pt"})
    index = {"weight_map": {key: file for file, keys in shards.items() for key in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = tokens(40)
    assert torch.equal(from_fla(folder)(ids), from_fla(tmp_path / "one")(ids))


# ---------------------------------------------------------------------------- refusals
BASE = dict(
    model_type="transformer",
    hidden_size=32,
    num_hidden_layers=2,
    num_heads=4,
    vocab_size=40,
    max_position_embeddings=24,
    attnres_block_size=2,
)


@pytest.mark.parametrize(
    "option, value",
    [
        ("qk_norm", True),
        ("qkv_bias", True),
        ("window_size", 16),
        ("hidden_act", "powlu"),
        ("rope_theta", None),
        ("attnres_block_size", 3),
        ("attnres_block_size", 0),
        ("model_type", "gla"),
        ("num_heads", 5),
    ],
)
def test_import_refuses_what_it_cannot_represent_naming_the_option(option, value):
    with pytest.raises(FlaInteropError, match=option):
        model_config_from_fla({**BASE, option: value})


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(hidden_size=None), "'hidden_size'"),
        (dict(num_heads=None), "'num_heads'"),
        (dict(num_heads=0), "num_heads=0"),
        (dict(intermediate_size=47.9), "intermediate_size=47.9"),
        (dict(vocab_size="40"), "vocab_size='40'"),
        (dict(tie_word_embeddings="false"), "tie_word_embeddings='false'"),
        (dict(num_kv_heads=2.0), "num_kv_heads=2.0"),
        (dict(rope_theta="x"), "rope_theta='x'"),
        (dict(norm_eps="1e-5"), "norm_eps='1e-5'"),
        (dict(hidden_ratio="4"), "hidden_ratio='4'"),
    ],
)
def test_import_refuses_a_malformed_config_naming_the_field(change, named):
    """A missing, mistyped or zero field is an FlaInteropError (the CLI's one-line error), never a KeyError,
    ZeroDivisionError, a truncated float or a string read as true."""
    config = {key: value for key, value in {**BASE, **change}.items() if value is not None}
    with pytest.raises(FlaInteropError, match=re.escape(named)):
        model_config_from_fla(config)


def test_a_standard_model_imports_and_exports_without_attnres_fields():
    """norm_eps is the standard model's eps alone (its AttnRes fields stay at their defaults), so it exports."""
    cfg = model_config_from_fla({**BASE, "attnres_block_size": None, "norm_eps": 1e-5})
    assert cfg.residual == "standard" and cfg.eps == 1e-5 and cfg.attnres_eps == 1e-6 and cfg.attnres_block_size == 1
    check_exportable(cfg)
    assert model_config_from_fla(fla_config_dict(cfg)).to_dict() == cfg.to_dict()


def test_save_takes_a_dtype_by_name_and_refuses_others(tmp_path):
    model = from_fla(make_fla(seed=4, num_hidden_layers=1))
    save_fla(model, tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    for bad in (torch.int8, "bf16"):
        with pytest.raises(FlaInteropError, match="dtype must be one of"):
            save_fla(model, tmp_path / f"bad{bad}", dtype=bad)


@pytest.mark.parametrize("dtype_key", ["dtype", "torch_dtype"])  # transformers 5's name, and the one before
def test_a_checkpoint_in_several_dtypes_exports_each_tensor_in_its_own(tmp_path, dtype_key):
    fla = make_fla(seed=6, num_hidden_layers=2, intermediate_size=None).to(torch.bfloat16)
    fla.save_pretrained(tmp_path / "fla")
    if dtype_key == "torch_dtype":
        config = json.loads((tmp_path / "fla" / "config.json").read_text())
        config["torch_dtype"] = config.pop("dtype")
        (tmp_path / "fla" / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "fla" / "model.safetensors")
    weights = {name: tensor.float() if "norm" in name else tensor for name, tensor in weights.items()}
    save_file(weights, tmp_path / "fla" / "model.safetensors", metadata={"format": "pt"})
    run, _ = import_fla_run(tmp_path / "fla", tmp_path / "run")
    export_fla_run(run, tmp_path / "back")
    assert_same_state(load_file(tmp_path / "back" / "model.safetensors"), weights)
    original, written = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("fla", "back"))
    assert original["intermediate_size"] is None and written["intermediate_size"] is None  # derived stays derived
    original["dtype"] = original.pop(dtype_key)  # written under transformers 5's name
    assert written == original

    config = json.loads((run / "config.json").read_text())  # a run imported before per-tensor dtypes were kept
    del config["provenance"]["stored_dtypes"]
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlaInteropError, match=re.escape("several dtypes (['bfloat16', 'float32'])") + ".*--dtype"):
        export_fla_run(run, tmp_path / "again")
    export_fla_run(run, tmp_path / "again", dtype="float32")


def test_an_index_naming_shards_outside_its_folder_is_refused(tmp_path):
    make_fla(seed=8, num_hidden_layers=1).save_pretrained(tmp_path / "fla")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(tmp_path / "fla" / "config.json", folder)
    names = load_file(tmp_path / "fla" / "model.safetensors")
    index = {"weight_map": {name: "../fla/model.safetensors" for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FlaInteropError, match="outside its folder"):
        read_fla_dir(folder)
    # a Hugging Face cache: snapshots/REV holds symlinks into blobs/, which are shards beside their index
    blobs, snapshot = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    shutil.copy(tmp_path / "fla" / "model.safetensors", blobs / "abc123")
    shutil.copy(tmp_path / "fla" / "config.json", snapshot)
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(Path("../../blobs/abc123"))
    index = {"weight_map": {name: "model-00001-of-00001.safetensors" for name in names}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(read_fla_dir(snapshot)[1]) == set(names)


def test_the_flash_attn_stand_in_aligns_the_causal_mask_bottom_right():
    """Fewer queries than keys (cached decoding): query i sees keys up to i + (keys − queries), as flash-attn's;
    checked against a float64 softmax written out."""
    from tests.fla_cpu import sdpa_flash_attn

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, length, 4, 8, generator=generator, dtype=torch.float64) for length in (2, 5, 5))
    out = sdpa_flash_attn(q, k, v, causal=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    visible = torch.arange(5)[None, :] <= torch.arange(2)[:, None] + 3
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    assert torch.allclose(out, expected, atol=1e-12)


def test_import_refuses_pickles_and_mismatched_weights(tmp_path):
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FlaInteropError, match="pytorch_model.bin are pickles"):
        from_fla(tmp_path / "pickled")
    fla = make_fla(seed=1)
    fla.save_pretrained(tmp_path / "fla")
    weights = load_file(tmp_path / "fla" / "model.safetensors")
    del weights["model.layers.0.attn_res_proj.weight"]
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, tmp_path / "fla" / "model.safetensors")
    with pytest.raises(FlaInteropError, match=r"missing \['model.layers.0.attn_res_proj.weight'\].*model.norm.weight"):
        from_fla(tmp_path / "fla")


def exportable(**overrides) -> ModelConfig:
    params = dict(
        d_model=32,
        n_heads=4,
        n_layers=2,
        n_ctx=24,
        d_vocab=40,
        gated_mlp=True,
        act_fn="silu",
        use_bias=False,
        residual="attnres",
        attnres_block_size=2,
        eps=1e-5,
        attnres_eps=1e-5,
    )
    return ModelConfig(**{**params, **overrides})


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(attention="kv_shift"), "attention='kv_shift'"),
        (dict(attnres_block_size=3), "attnres_block_size=3"),
        (dict(attn_only=True, gated_mlp=False), "attn_only=True"),
        (dict(positional_embedding_type="standard"), "positional_embedding_type='standard'"),
        (dict(gated_mlp=False), "gated_mlp=False"),
        (dict(act_fn="gelu"), "act_fn='gelu'"),
        (dict(use_bias=True), "use_bias=True"),
        (dict(attnres_eps=1e-6), "attnres_eps=1e-06"),
    ],
)
def test_export_refuses_what_fla_lacks_naming_the_option(overrides, named):
    check_exportable(exportable())
    with pytest.raises(FlaInteropError, match=named.replace("(", r"\(").replace("[", r"\[")):
        check_exportable(exportable(**overrides))


def test_export_refuses_every_other_option_fla_has_no_equivalent_for():
    """Fields added to ModelConfig later are caught too: anything that differs from a model FLA could describe."""
    extras = {}
    if "attnres_score" in ModelConfig.__dataclass_fields__:
        extras["attnres_score"] = "sigmoid"
    if "denseformer" in RESIDUAL_KINDS:
        extras["residual"] = "denseformer"
    if not extras:
        pytest.skip("this checkout has no residual kinds or AttnRes options beyond FLA's")
    for name, value in extras.items():
        overrides = {name: value} if name != "residual" else {name: value, "attnres_block_size": 1, "attnres_eps": 1e-6}
        with pytest.raises(FlaInteropError, match=name):
            check_exportable(exportable(**overrides))


def test_exported_config_describes_the_same_model():
    cfg = exportable(n_key_value_heads=2, rotary_base=5e5, tie_word_embeddings=True, d_mlp=80)
    fla = fla_config_dict(cfg)
    assert fla["attnres_block_size"] == 2 and fla["num_kv_heads"] == 2 and fla["rope_theta"] == 5e5
    back = model_config_from_fla(fla)
    assert {k: v for k, v in back.to_dict().items() if k != "seed"} == {
        k: v for k, v in cfg.to_dict().items() if k != "seed"
    }
    assert (
        fla_config_dict(exportable(residual="standard", attnres_block_size=1, attnres_eps=1e-6))["attnres_block_size"]
        is None
    )


# ---------------------------------------------------------------------------- run directories and the CLI
def cli(*args: str) -> subprocess.CompletedProcess:
    """`attnres-lens ARGS` in this process (a subprocess would spend seconds importing TransformerLens each time)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_import_analyze_prune_export_on_an_fla_directory(tmp_path):
    fla = make_fla(seed=11, num_hidden_layers=2, vocab_size=48, max_position_embeddings=33, attnres_block_size=2)
    fla.save_pretrained(tmp_path / "fla")
    run = tmp_path / "run"
    result = cli("import-fla", str(tmp_path / "fla"), "--out", str(run))
    assert result.returncode == 0, result.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["provenance"]["source"] == "flash-linear-attention"
    assert config["provenance"]["fla_config"]["attnres_block_size"] == 2
    assert config["task"] == {"name": "copy", "vocab_size": 48, "seq_len": 33, "min_len": 8, "max_len": 16}
    assert RunDir(run).is_complete() and not (run / "metrics.jsonl").exists() and not (run / "records").exists()
    assert not list((run / "checkpoints").glob("*.state.safetensors"))  # nothing to resume

    loaded = load_run(run)
    assert loaded.checkpoint == "step_0000000" and loaded.metrics.empty and not loaded.records
    ids = tokens(48, length=33)
    assert (loaded.model(ids) - fla_logits(fla, ids).cpu()).abs().max().item() < TOLERANCE

    assert cli("analyze", str(run), "--samples", "4", "--no-progress").returncode == 0
    assert (run / "analysis" / "depth_weights.csv").is_file()
    result = cli("prune", str(run), "--samples", "4", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert (run / "analysis" / "prune_report.html").is_file()

    result = cli("export-fla", str(run), "--out", str(tmp_path / "back"))
    assert result.returncode == 0, result.stderr
    with fla_runtime(DEVICE):
        back = TransformerForCausalLM.from_pretrained(tmp_path / "back").eval().to(DEVICE)
    assert torch.equal(fla_logits(back, ids), fla_logits(fla, ids))

    resumed = cli("train", "--resume", str(run))
    assert resumed.returncode == 2 and "imported from flash-linear-attention" in resumed.stderr


def test_cli_errors_are_one_line(tmp_path):
    fla_dir = tmp_path / "fla"
    fla_dir.mkdir()
    (fla_dir / "config.json").write_text(json.dumps({**BASE, "qk_norm": True}))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    good = tmp_path / "good"
    make_fla(seed=2, num_hidden_layers=1).save_pretrained(good)
    raw = tmp_path / "ids.bin"
    (np.arange(1000, dtype=np.uint16) % 100).tofile(raw)
    cases = [
        (["import-fla", str(fla_dir), "--out", str(tmp_path / "r")], "qk_norm=True"),
        (["import-fla", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")], "is not a directory"),
        (["import-fla", str(good), "--out", str(tmp_path / "full")], "is not empty"),
        (["import-fla", str(good), "--out", str(tmp_path / "r"), "--set", "model.d_model=8"], "task.KEY=VALUE"),
        (["import-fla", str(good), "--out", str(tmp_path / "r"), "--tokens", str(raw)], "does not record its dtype"),
        (
            ["import-fla", str(good), "--out", str(tmp_path / "r"), "--tokens", str(raw), "--tokens-dtype", "uint16"],
            "out of range for vocab_size=40",
        ),
        (["import-fla", str(good), "--out", str(tmp_path / "r"), "--task", "ngram9"], "unknown task"),
        (["export-fla", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")], "does not exist"),
    ]
    for args, message in cases:
        result = cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnres-lens: error: ") and message in lines[0], (args, lines)
    assert not (tmp_path / "r").exists()


def test_export_of_a_run_trained_here_refuses_what_fla_lacks(tmp_path):
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    config = apply_overrides(get_preset("smoke"), ["train.steps=2", "train.eval_size=4", "train.record_size=4"])
    train(config, tmp_path / "smoke", progress=False)  # Block S=2 with KV shift, GELU MLP with biases
    result = cli("export-fla", str(tmp_path / "smoke"), "--out", str(tmp_path / "fla"))
    assert result.returncode == 2
    assert "attention='kv_shift'" in result.stderr and "use_bias=True" in result.stderr
    assert not (tmp_path / "fla").exists()


@pytest.mark.slow
def test_a_run_trained_here_in_fla_form_exports_and_fla_reproduces_it(tmp_path):
    """Train here with FLA's architecture, export, and FLA's forward gives our logits: the way to continue there."""
    from attnres_lens.config import apply_overrides
    from attnres_lens.presets import get_preset
    from attnres_lens.training import train

    fla_form = [
        "model.gated_mlp=true",
        "model.act_fn=silu",
        "model.use_bias=false",
        "model.attention=standard",
        "model.attnres_eps=1e-5",
        "model.tie_word_embeddings=true",
        "train.steps=3",
        "train.eval_size=4",
        "train.record_size=4",
    ]
    train(apply_overrides(get_preset("smoke"), fla_form), tmp_path / "run", progress=False)
    model = load_run(tmp_path / "run").model
    save_fla(model, tmp_path / "fla")
    with fla_runtime(DEVICE):
        fla = TransformerForCausalLM.from_pretrained(tmp_path / "fla").eval().to(DEVICE)
    ids = tokens(model.cfg.d_vocab, length=model.cfg.n_ctx)
    assert (fla_logits(fla, ids).cpu() - model(ids)).abs().max().item() < TOLERANCE


@pytest.mark.slow
def test_the_fla_preset_trains_and_exports_as_trained(tmp_path):
    """`fla-attnres-block` is in FLA's form: a run trained from it exports with no --set flags, and FLA's forward
    of the export gives the run's logits."""
    run = tmp_path / "run"
    result = cli(
        "train",
        "--preset",
        "fla-attnres-block",
        "--out",
        str(run),
        "--steps",
        "2",
        "--no-progress",
        "--set",
        "train.eval_size=4",
        "--set",
        "train.record_size=4",
    )  # the cadence only, not the model
    assert result.returncode == 0, result.stderr
    result = cli("export-fla", str(run), "--out", str(tmp_path / "fla"))
    assert result.returncode == 0, result.stderr
    model = load_run(run).model
    with fla_runtime(DEVICE):
        fla = TransformerForCausalLM.from_pretrained(tmp_path / "fla").eval().to(DEVICE)
    assert fla.config.attnres_block_size == 4 and fla.config.num_hidden_layers == 12
    ids = tokens(model.cfg.d_vocab, length=model.cfg.n_ctx)
    assert (fla_logits(fla, ids).cpu() - model(ids)).abs().max().item() < TOLERANCE


def test_default_evaluation_task_fits_the_model():
    assert default_task(exportable(n_ctx=2048, d_vocab=32000)) == {
        "name": "copy",
        "vocab_size": 32000,
        "seq_len": 2048,
        "min_len": 8,
        "max_len": 16,
    }
    short = default_task(exportable(n_ctx=13, d_vocab=40))
    assert short["max_len"] == 6 and short["min_len"] == 6
    small_vocab = default_task(exportable(n_ctx=128, d_vocab=20))
    assert small_vocab["seq_len"] == 39  # one content token per two positions
    for params in (short, small_vocab):
        from attnres_lens.tasks import make_task

        make_task(**params)


@pytest.mark.slow
def test_the_dashboard_opens_an_imported_run_and_says_what_it_lacks(tmp_path):
    """Every page renders an imported run without errors; the pages built on training records say it has none, and
    the depth-attention heatmap is computed from its checkpoint instead."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    make_fla(seed=13, num_hidden_layers=2, vocab_size=48, max_position_embeddings=33).save_pretrained(tmp_path / "fla")
    runs = tmp_path / "runs"
    import_fla_run(tmp_path / "fla", runs / "imported")
    app = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "apps" / "app.py"), default_timeout=180)
    app.session_state["served_dir"] = str(runs)  # as `dashboard --runs RUNS` serves it
    app.run()
    assert not app.exception and not app.error
    assert list(app.dataframe[0].value["steps"]) == ["imported"]
    said = {}
    app_source = (Path(__file__).resolve().parent.parent / "apps" / "app.py").read_text()
    pages = [page for page in re.findall(r'st\.Page\("([^"]+)"', app_source) if page != "views/runs.py"]
    for page in pages:  # every page of the app, those added later too
        app.switch_page(page).run()
        assert not app.exception, (page, [e.value for e in app.exception])
        assert not app.error, (page, [e.value for e in app.error])
        said[page] = " ".join(e.value for e in [*app.warning, *app.info])
        if page == "views/depth_attention.py":
            titles = [json.loads(chart.proto.spec)["layout"]["title"]["text"] for chart in app.get("plotly_chart")]
            assert any("imported checkpoint" in title for title in titles), titles
    needs_records = {
        "views/depth_attention.py",
        "views/training_dynamics.py",
        "views/induction.py",
        "views/depth_mixing.py",
        "views/attribution.py",
    } & set(pages)
    for page in needs_records:
        assert "imported from flash-linear-attention" in said[page], (page, said[page])
    app.switch_page("views/pruning.py").run()
    app.button(key="pruning-compute").click().run()
    assert not app.exception and not app.error


@pytest.mark.slow
def test_the_worked_example_runs_and_reports_agreement(tmp_path):
    from analyses import fla_roundtrip

    lines = fla_roundtrip.main(
        [
            "--layers",
            "2",
            "--width",
            "32",
            "--block-size",
            "2",
            "--samples",
            "4",
            "--out",
            str(tmp_path / "work"),
            "--report",
            str(tmp_path / "report.md"),
        ]
    )
    text = "\n".join(lines)
    assert "Exported state dict identical to the original, tensor for tensor: True." in text
    rows = [line for line in lines if line.startswith("| ours (imported) vs FLA")]
    assert rows and float(rows[0].split("|")[2]) < TOLERANCE
    assert (tmp_path / "report.md").read_text().startswith("# An FLA AttnRes model")
    assert ("Skipped: no CUDA device" in text) == (DEVICE == "cpu")


# ---------------------------------------------------------------------------- hostile folders (issue 41)
@pytest.fixture(scope="module")
def saved_fla(tmp_path_factory) -> Path:
    """A 2-layer FLA directory written by FLA itself; tests copy it before changing anything."""
    folder = tmp_path_factory.mktemp("hostile") / "fla"
    make_fla(seed=11, num_hidden_layers=2).save_pretrained(folder)
    return folder


def edited_copy(saved: Path, tmp_path: Path, **config_changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(hidden_ratio=float("inf"), intermediate_size=None), "hidden_ratio=inf"),
        (dict(hidden_ratio=float("nan"), intermediate_size=None), "hidden_ratio=nan"),
        (dict(hidden_ratio=1e300, intermediate_size=None), "hidden_ratio=1e+300"),
        (dict(norm_eps=float("inf")), "norm_eps=inf"),
        (
            dict(num_hidden_layers=10**6),
            "num_hidden_layers=1000000 in the FLA config, but its weights hold layers 0..1",
        ),
        (dict(max_position_embeddings=2**40), "n_ctx × d_head rotary tables"),
    ],
)
def test_sizes_a_config_asks_for_are_bounded_before_anything_is_allocated(saved_fla, tmp_path, changes, named):
    """json.dumps writes inf/nan as Infinity/NaN, as a hostile config.json would hold them."""
    with pytest.raises(FlaInteropError if "rotary" not in named else ValueError, match=re.escape(named)):
        from_fla(edited_copy(saved_fla, tmp_path, **changes))


def test_a_model_that_cannot_fit_is_refused_naming_what_asks_for_the_memory():
    from attnres_lens import HookedTransformer

    with pytest.raises(ValueError, match=r"GiB .*mostly n_ctx × d_head rotary tables.*check those fields"):
        HookedTransformer(ModelConfig(n_ctx=2**40, d_model=64, n_heads=4, n_layers=2, d_vocab=20))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(tie_word_embeddings=True, gated_mlp=True, act_fn="silu", use_bias=False),
        dict(positional_embedding_type="standard", attn_only=True),
        dict(n_key_value_heads=2, residual="attnres"),
        dict(dtype="bfloat16"),
    ],
)
def test_the_allocation_floor_never_exceeds_what_a_model_allocates(overrides):
    """The memory check must never refuse a model that fits: its estimate is at most the bytes a built model's
    parameters and buffers hold (counted here from the model itself)."""
    from attnres_lens import HookedTransformer

    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=3, n_ctx=24, d_vocab=40, **overrides)
    model = HookedTransformer(cfg)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    floor = sum(cfg.allocation_floor().values())
    assert 0.5 * held < floor <= held


def test_non_utf8_files_are_refused_naming_the_file(saved_fla, tmp_path):
    folder = edited_copy(saved_fla, tmp_path)
    (folder / "config.json").write_bytes(b'{"model_type": "transformer\xff"}')
    with pytest.raises(FlaInteropError, match=re.escape(f"{folder / 'config.json'} is not UTF-8")):
        from_fla(folder)
    folder = edited_copy(saved_fla, tmp_path / "b")
    (folder / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xfe": "x"}}')
    with pytest.raises(FlaInteropError, match="model.safetensors.index.json is not UTF-8"):
        from_fla(folder)


@pytest.mark.parametrize("weight_map", [[1, 2], "model.safetensors", None, {"a": 3}, {"a": ["x"]}])
def test_a_malformed_shard_index_is_refused_naming_it(saved_fla, tmp_path, weight_map):
    folder = edited_copy(saved_fla, tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FlaInteropError, match="is not a safetensors index: its weight_map must be an object"):
        from_fla(folder)


def test_non_finite_weights_are_refused_naming_the_tensor(saved_fla, tmp_path):
    folder = edited_copy(saved_fla, tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(FlaInteropError, match=r"NaN or infinite values in model\.layers\.1\.mlp\.down_proj\.weight"):
        from_fla(folder)
    assert cli("import-fla", str(folder), "--out", str(tmp_path / "run")).returncode == 2
    assert not (tmp_path / "run").exists()


def test_folders_are_never_run_or_unpickled(saved_fla, tmp_path):
    folder = edited_copy(saved_fla, tmp_path, auto_map={"AutoModelForCausalLM": "modeling_evil.Model"})
    (folder / "modeling_evil.py").write_text("raise SystemExit('ran code from the model folder')\n")
    with pytest.raises(FlaInteropError, match="auto_map=.*never runs code from a model folder"):
        from_fla(folder)
    pickled = tmp_path / "pickled"
    shutil.copytree(saved_fla, pickled)
    torch.save({}, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    with pytest.raises(
        FlaInteropError,
        match=r"pytorch_model\.bin are pickles, which are never loaded.*"
        r"weights_only=True.*model\.safetensors",
    ):
        from_fla(pickled)


def test_import_reads_and_hashes_only_the_weight_files_it_names(saved_fla, tmp_path):
    """A FIFO named like a shard would block a reader forever, and a folder so named cannot be hashed: neither is
    one of the model's files, so neither is opened."""
    import os

    folder = edited_copy(saved_fla, tmp_path)
    os.mkfifo(folder / "notes.safetensors")
    (folder / "old.safetensors").mkdir()
    result = cli("import-fla", str(folder), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    sha = json.loads((tmp_path / "run" / "config.json").read_text())["provenance"]["weights_sha256"]
    assert list(sha) == ["model.safetensors"]


@pytest.mark.parametrize("stored", [[1, 2], "x", None])
def test_export_refuses_a_damaged_fla_config_record_naming_it(saved_fla, tmp_path, stored):
    run = tmp_path / "run"
    assert cli("import-fla", str(saved_fla), "--out", str(run)).returncode == 0
    config = json.loads((run / "config.json").read_text())
    config["provenance"]["fla_config"] = stored
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlaInteropError, match=r"provenance\.fla_config=.*edited or damaged"):
        export_fla_run(run, tmp_path / "out")
    with pytest.raises(FlaInteropError, match="template must be an FLA config"):
        save_fla(from_fla(saved_fla), tmp_path / "out2", template=[1])


def test_a_refused_import_leaves_no_lock_behind(saved_fla, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert cli("import-fla", str(saved_fla), "--out", str(full)).returncode == 2
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"  # refused after the lock was taken: the task does not fit
    empty.mkdir()
    assert cli("import-fla", str(saved_fla), "--out", str(empty), "--task", "ngram9").returncode == 2
    assert list(empty.iterdir()) == []


def test_a_named_shard_that_is_not_a_regular_file_is_refused(saved_fla, tmp_path):
    """A FIFO the index names would block the read forever."""
    import os

    folder = edited_copy(saved_fla, tmp_path)
    names = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "shard.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "shard.safetensors" for n in names}})
    )
    with pytest.raises(FlaInteropError, match="shard.safetensors is not a regular file"):
        from_fla(folder)


def test_the_memory_check_counts_a_low_precision_model_as_built_in_float32(monkeypatch):
    """A model is built in float32 on the CPU, then cast: memory for the bf16 weights alone is not enough."""
    import attnres_lens.resources as resources
    from attnres_lens import HookedTransformer

    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=2, n_ctx=24, d_vocab=40, dtype="bfloat16")
    bf16, fp32 = (sum(cfg.allocation_floor(size).values()) for size in (2, 4))
    monkeypatch.setattr(resources, "available_memory", lambda device: (bf16 + fp32) // 2)
    with pytest.raises(ValueError, match="on cpu to build it"):
        HookedTransformer(cfg)
    monkeypatch.setattr(resources, "available_memory", lambda device: fp32)
    assert HookedTransformer(cfg).embed.W_E.dtype == torch.bfloat16
