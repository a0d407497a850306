"""The routed-expert count vLLM 0.33 builds, read from config.json as transformers 5.20 resolves its aliases
(:mod:`ctconvert.checkpoint.expert_count`). A new-user trial: a Qwen3-MoE config with ``num_experts: 8`` and
``num_local_experts: 4`` failed verify (it took 8) while vLLM built 4 experts and loaded the checkpoint
(``vllm_accept.py``: ACCEPT; with ``num_local_experts: 8`` REJECT)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ctconvert import api
from ctconvert.checkpoint.depth import expert_count_problems
from ctconvert.checkpoint.expert_count import EXPERT_COUNT, EXPERT_KEYS, expert_count, expert_count_keys
from ctconvert.checkpoint.safetensors_io import TensorInfo

from conftest import gpt_oss_checkpoint, moe_checkpoint

_WHY = (
    "vLLM builds 8 experts per block: an expert among them that no tensor fills is refused or left uninitialised, and one past them is never "
    "loaded (the config and the checkpoint describe different models)"
)


def _moe(tmp_path, **keys):
    """The conftest Qwen3-MoE (4 experts per block) with ``keys`` in its config in place of its ``num_experts``."""
    src = moe_checkpoint(tmp_path, inter=128)
    cfg = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "num_experts"}
    (src / "config.json").write_text(json.dumps({**cfg, **keys}))
    return src


def _errors(report: dict) -> list[str]:
    return [p["message"] for p in report["problems"] if p["severity"] == "error"]


@pytest.mark.parametrize("keys", [{"num_experts": 8, "num_local_experts": 4}, {"num_local_experts": 4, "num_experts": 8}, {"num_experts": 4}])
def test_qwen3_moe_builds_the_num_local_experts_over_num_experts(tmp_path, keys):
    """Both keys, in either order: transformers' Qwen3MoeConfig sets its field num_experts first, then the alias
    num_local_experts over it; vLLM builds 4 experts and loads the output (the trial's m-q3moe-numexp8): verify passes."""
    src = _moe(tmp_path, **keys)
    api.quantize(src, tmp_path / "out", "W4A16")
    report = api.verify(tmp_path / "out")
    assert report["ok"], _errors(report)


@pytest.mark.parametrize("keys", [{"num_experts": 4, "num_local_experts": 8}, {"num_local_experts": 8}])
def test_qwen3_moe_with_8_built_experts_fails_verify(tmp_path, keys):
    """num_local_experts 8 wins whatever num_experts says: vLLM builds 8 experts per block and refuses the output
    (vllm_accept.py: REJECT); verify names the key vLLM's count comes from, and the router it builds [8, 256]."""
    src = _moe(tmp_path, **keys)
    api.quantize(src, tmp_path / "out", "W4A16")
    out = tmp_path / "out"
    head = "config.json's num_local_experts is 8, but 2 of 2 MoE blocks stored per expert do not hold experts 0 .. 7"
    router = (
        "model.layers.0.mlp.gate.weight is [4, 256], where vLLM 0.33 qwen3_moe.py Qwen3MoeSparseMoeBlock builds [num_local_experts, hidden_size] "
        "= [8, 256] (config.json num_local_experts, hidden_size): vLLM refuses the checkpoint"
    )
    assert _errors(api.verify(out)) == [f"{head} (e.g. model.layers.0.mlp.experts holds 4 (0..3)): {_WHY}", router, router.replace("layers.0", "layers.1")]


def test_gpt_oss_builds_the_num_experts_over_num_local_experts(tmp_path):
    """gpt-oss's field is num_local_experts and num_experts its alias: with num_local_experts 8 and num_experts 4,
    vLLM builds 4 (vllm_accept.py: ACCEPT): verify passes, the router and expert biases judged against 4; the reverse
    contradicts the fused experts, which quantize refuses (exit 3) naming the count vLLM would build."""
    src = gpt_oss_checkpoint(tmp_path / "src", num_local_experts=8, num_experts=4)
    api.quantize(src, tmp_path / "out", "W4A16")
    report = api.verify(tmp_path / "out")
    assert report["ok"], _errors(report)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert expert_count(cfg) == ("num_experts", 4) and expert_count({**cfg, "num_experts": 8})[1] == 8
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 4, "num_experts": 8, "quantization_config": None}))
    with pytest.raises(Exception, match=re.escape("4 experts, config says 8; the config and the checkpoint describe different models")) as e:
        api.quantize(src, tmp_path / "out2", "W4A16")
    assert e.value.exit_code == 3


def test_a_family_without_an_alias_reads_its_own_key():
    """Qwen2-MoE's vLLM block reads num_experts, and its class has no alias: a num_local_experts beside it is never
    read; DeepSeek-V3's num_local_experts is its n_routed_experts' alias and wins; a family not listed is judged on
    every expert key it holds (which one its loader reads is not known)."""
    infos = _per_expert(4)
    assert expert_count({"model_type": "qwen2_moe", "num_experts": 4, "num_local_experts": 8}) == ("num_experts", 4)
    assert expert_count_problems({"model_type": "qwen2_moe", "num_experts": 4, "num_local_experts": 8}, infos) == []
    assert expert_count({"model_type": "deepseek_v3", "n_routed_experts": 8, "num_local_experts": 4}) == ("num_local_experts", 4)
    assert expert_count({"model_type": "qwen3_vl_moe", "text_config": {"num_experts": 8}, "num_local_experts": 4}) == ("num_experts", 8)
    assert expert_count({"model_type": "qwen3_moe", "num_local_experts": "4"}) is None
    assert expert_count_keys({"model_type": "some_moe", "num_experts": 4}) == EXPERT_KEYS
    assert len(expert_count_problems({"model_type": "some_moe", "num_experts": 4, "num_local_experts": 8}, infos)) == 1


def _per_expert(n: int) -> dict:
    names = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")]
    return {name: TensorInfo(name, Path("model.safetensors"), "BF16", (8, 8), 0, 128) for name in names}


_READ = re.compile(r"\(config\.(\w+)\)")


@pytest.mark.parametrize("family", sorted(EXPERT_COUNT))
def test_the_table_is_what_transformers_builds(family):
    """Each listed family's class, given both keys with different values in either order (or a foreign key beside its
    own), yields the table's winner in the attribute vLLM 0.33 reads: the installed transformers' (>= 5; the table is
    5.20's, what vLLM 0.33 runs)."""
    transformers = pytest.importorskip("transformers")
    from transformers import CONFIG_MAPPING

    keys, reader = EXPERT_COUNT[family]
    read = _READ.search(reader)
    if family not in CONFIG_MAPPING or not hasattr(CONFIG_MAPPING[family], "__dataclass_fields__"):  # kimi_k2: vLLM parses it as deepseek_v3
        pytest.skip(f"{family}: no config class of its own in transformers {transformers.__version__}")
    cls = CONFIG_MAPPING[family]
    if "text_config" in cls.__dataclass_fields__:  # a composite: its text class holds the count (listed under its own name)
        pytest.skip(f"{family}: a composite, judged by its text class")
    others = [k for k in (*EXPERT_KEYS, "moe_num_experts") if k not in keys]
    given = {keys[-1]: 5, keys[0]: 7} if len(keys) > 1 else {others[0]: 5, keys[0]: 7}
    attr = read[1] if read is not None else keys[-1]  # (the Transformers backend reads either name: they are one attribute)
    assert getattr(cls(**given), attr) == 7
    assert getattr(cls(**dict(reversed(given.items()))), attr) == 7
