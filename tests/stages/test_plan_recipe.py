"""``--recipe`` end to end (the plan stage's recipe, the quantize stage's per-group observers): ctconvert on the source
weights of ``tests/data/recipes/llmc_recipes.safetensors`` writes, for each recipe file there, the bytes of every tensor
llm-compressor 0.14.0.1's ``oneshot(recipe=FILE)`` wrote and the same config groups (compared by targets: their
names and order are llm-compressor's save order there); the CLI and a batch job take it; the dry-run plan names each
tensor's group; what the recipe decides cannot be given beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from ctconvert import api
from ctconvert.cli import main
from ctconvert.errors import UsageError

from conftest import write_checkpoint
from helpers import assert_reference_tensors, llama_around

DATA = Path(__file__).resolve().parent.parent / "data" / "recipes"
REF = DATA / "llmc_recipes.safetensors"
HIDDEN, VOCAB = 128, 64


def _meta() -> dict:
    with safe_open(str(REF), "pt") as f:
        return json.loads(f.metadata()["reference"])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The reference's one-layer bf16 Llama: its Linear weights, plus embeddings, norms and an lm_head."""
    with safe_open(str(REF), "pt") as f:
        linear = {f"{m}.weight": f.get_tensor(f"source/{m}.weight") for m in _meta()["modules"]}
    t, cfg = llama_around(linear, torch.bfloat16, VOCAB, HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    return write_checkpoint(tmp_path_factory.mktemp("recipe") / "src", t, cfg)


def _semantic(group: dict) -> dict:
    """A config group without its null/empty fields (llm-compressor dumps every QuantizationArgs field)."""

    def args(a):
        return None if a is None else {k: v for k, v in a.items() if v is not None and v != {}}

    return {"targets": group["targets"], "format": group["format"], **{k: args(group.get(k)) for k in ("weights", "input_activations", "output_activations")}}


def _assert_llmc_output(recipe: str, out: Path) -> None:
    prefix = f"{recipe}/"
    theirs = assert_reference_tensors(REF, prefix, out)
    with safe_open(str(out / "model.safetensors"), "pt") as got:
        mine_keys = {k for k in got.keys() if k.startswith("model.layers.")} - set(theirs)
        assert all(k.endswith("layernorm.weight") for k in mine_keys), mine_keys  # no quantized tensor of ours they lack
    theirs, mine = _meta()["recipes"][recipe], json.loads((out / "config.json").read_text())["quantization_config"]
    by_targets = lambda qc: sorted((_semantic(g) for g in qc["config_groups"].values()), key=lambda g: g["targets"])  # noqa: E731
    assert by_targets(mine) == by_targets(theirs)
    assert mine["format"] == theirs["format"] == "mixed-precision" and mine["ignore"] == theirs["ignore"]


@pytest.mark.parametrize("recipe", sorted(_meta()["recipes"]))
def test_api_writes_oneshots_bytes(recipe, source, tmp_path):
    api.quantize(source, tmp_path / "out", None, recipe=DATA / f"{recipe}.yaml", chunk_elems=32 * HIDDEN)
    _assert_llmc_output(recipe, tmp_path / "out")


def test_cli_recipe_and_its_dry_run_plan(source, tmp_path):
    recipe = DATA / "mixed_w4a16_fp8.yaml"
    r = CliRunner().invoke(main, ["quantize", str(source), "-o", str(tmp_path / "out"), "--recipe", str(recipe)])
    assert r.exit_code == 0, r.output
    _assert_llmc_output("mixed_w4a16_fp8", tmp_path / "out")
    r = CliRunner().invoke(main, ["--json", "quantize", str(source), "--recipe", str(recipe), "--dry-run"])
    assert r.exit_code == 0, r.output
    rows = {t["name"]: t for t in json.loads(r.output)["plan"]["tensors"]}
    assert {(rows[f"model.layers.0.{m}.weight"]["scheme"], rows[f"model.layers.0.{m}.weight"]["group"]) for m in ("mlp.up_proj", "self_attn.q_proj")} == {
        ("W4A16", "group_0"),
        ("FP8_DYNAMIC", "group_1"),
    }


def test_batch_recipe_key(source, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(json.dumps({"jobs": [{"model": str(source), "output": str(tmp_path / "out"), "recipe": str(DATA / "nvfp4_mse_mlp_w4a16_attn.yaml")}]}))
    assert api.batch(jobs, emit=lambda *a: None) == 0
    _assert_llmc_output("nvfp4_mse_mlp_w4a16_attn", tmp_path / "out")


def test_what_the_recipe_decides_is_refused_beside_it(source, tmp_path):
    recipe = DATA / "mixed_w4a16_fp8.yaml"
    with pytest.raises(UsageError, match="--recipe and --scheme W4A16 cannot be combined"):
        api.quantize(source, tmp_path / "a", "W4A16", recipe=recipe)
    for kw, flag in ((dict(observer="memoryless_mse"), "--observer"), (dict(lm_head="fp8"), "--lm-head"), (dict(ignore=["x"]), "--ignore")):
        with pytest.raises(UsageError, match=f"--recipe cannot be combined with {flag}"):
            api.quantize(source, tmp_path / "b", None, recipe=recipe, **kw)
    with pytest.raises(UsageError, match="--recipe with --target marlin: a kernel-native layout of a recipe's output is not implemented"):
        api.quantize(source, tmp_path / "e", None, recipe=recipe, target="marlin")
    with pytest.raises(UsageError, match="no scheme"):
        api.quantize(source, tmp_path / "c", None)
    r = CliRunner().invoke(main, ["quantize", str(source), "-o", str(tmp_path / "d")])
    assert r.exit_code == 2 and "Missing option" in r.output
    assert not any((tmp_path / x).exists() for x in "abcde")


def test_a_tied_head_the_recipe_takes_is_refused(tmp_path):
    """llm-compressor unties and quantizes a tied lm_head that a group's targets take; ctconvert refuses it by name."""
    from conftest import LLAMA_CONFIG, llama_tensors

    cfg = {**LLAMA_CONFIG, "tie_word_embeddings": True}
    t = {k: v for k, v in llama_tensors(cfg).items() if k != "lm_head.weight"}
    src = write_checkpoint(tmp_path / "tied", t, cfg)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: W4A16\n      targets: [Linear]\n")
    with pytest.raises(UsageError, match=r"config group group_0 \(Linear\) takes lm_head, which this model ties"):
        api.quantize(src, tmp_path / "out", None, recipe=recipe)
    recipe.write_text(recipe.read_text() + "      ignore: [lm_head]\n")
    assert api.quantize(src, None, None, recipe=recipe, dry_run=True).quantized_modules == 14


def test_the_plan_names_a_recipes_targets_and_ignore_as_the_recipes(source, tmp_path):
    """A recipe's reasons and notes name its own targets and ignore, not the --targets/--ignore it was not given;
    the same checkpoint planned with those options names the options."""
    r = CliRunner().invoke(main, ["--json", "quantize", str(source), "--recipe", str(DATA / "mixed_w4a16_fp8.yaml"), "--dry-run"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rows = {t["name"]: t for t in doc["plan"]["tensors"]}
    assert rows["lm_head.weight"]["reason"].startswith("Linear not matched by recipe targets re:")
    assert "recipe ignore 'lm_head' matched only modules that stay dense anyway" in doc["notes"]
    assert "--targets" not in r.output and "--ignore" not in r.output
    args = ["--json", "quantize", str(source), "-s", "W4A16", "--targets", r"re:.*mlp\.(gate|up|down)_proj$", "--dry-run"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {t["name"]: t for t in doc["plan"]["tensors"]}["model.layers.0.self_attn.q_proj.weight"]["reason"].startswith("Linear not matched by --targets re:")
