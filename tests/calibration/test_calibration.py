"""Calibration: layer-by-layer equals whole-model, the scales equal compressed-tensors' observers on the same
activations, the calibrated checkpoints load in transformers close to the dense model, and bad inputs are refused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from ctconvert import api
from ctconvert.calibration.data import CORPUS, load_tokens
from ctconvert.calibration.model import calibrate, calibrate_whole_model
from ctconvert.calibration.observe import input_qparams, kv_qparams
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError, UnsupportedError, UsageError

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")

SMALL = dict(LLAMA_CONFIG, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def add_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer (vocab 380 < the models' 384) trained on the shipped corpus, saved with the checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS.read_text()], trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(str(path))
    return path


def _moe_config(kind: str):
    common = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **common)
    return transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common)


def make_moe(path: Path, kind: str) -> Path:
    """A tiny MoE saved by transformers (per-expert checkpoint names: ``mlp.experts.E.gate_proj`` / ``block_sparse_moe.experts.E.w1``)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_moe_config(kind), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    p = write_checkpoint(tmp_path_factory.mktemp("cal") / "llama", llama_tensors(SMALL, seed=3), SMALL)
    return add_tokenizer(p)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "mixtral"])
def model_path(request, tmp_path_factory, llama) -> Path:
    if request.param == "llama":
        return llama
    return add_tokenizer(make_moe(tmp_path_factory.mktemp("cal") / request.param, request.param))


def _tokens(n=6, seq=32, seed=0):
    return torch.randint(0, 380, (n, seq), generator=torch.Generator().manual_seed(seed))


def _devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].min, b[k].min) and torch.equal(a[k].max, b[k].max), k


@pytest.mark.parametrize("device", _devices())
def test_layer_by_layer_equals_whole_model(model_path, device):
    ckpt = open_checkpoint(model_path)
    tok = _tokens()
    s = calibrate(ckpt, tok, torch.device(device), kv_cache=True, batch_tokens=64)
    w = calibrate_whole_model(ckpt, tok, torch.device(device), kv_cache=True, batch_tokens=64)
    _same(s.inputs, w.inputs)
    _same(s.keys, w.keys)
    _same(s.values, w.values)
    linear = {n[: -len(".weight")] for n, t in ckpt.tensors.items() if n.endswith("_proj.weight") or n.endswith((".w1.weight", ".w2.weight", ".w3.weight"))}
    assert linear - {"lm_head"} <= set(s.inputs) | {n for n in linear if ".experts." in n}  # every dense Linear observed
    assert len(s.keys) == 2 and all(v.max.shape == (2,) for v in s.keys.values())  # per KV head


def _reference_activations(path: Path, tok: torch.Tensor, batch: int):
    """Every Linear input and every attention key/value state of the fully loaded model, through plain forward hooks
    on transformers' own model (dense Llama) -- collected independently of ctconvert's hooks."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    acts: dict[str, list[torch.Tensor]] = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def record(module, q, k, v, mask, **kw):  # what the KV cache would store: key/value states after RoPE
        acts.setdefault(f"model.layers.{module.layer_idx}.self_attn.k", []).append(k.clone())
        acts.setdefault(f"model.layers.{module.layer_idx}.self_attn.v", []).append(v.clone())
        return sdpa(module, q, k, v, mask, **kw)

    transformers.AttentionInterface.register("test_record_kv", record)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="test_record_kv").eval()
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            handles.append(m.register_forward_pre_hook(lambda mod, a, name=name: acts.setdefault(name, []).append(a[0].clone())))
    with torch.no_grad():
        for i in range(0, tok.shape[0], batch):
            model(tok[i : i + batch])
    for h in handles:
        h.remove()
    return acts


def _ct_static_minmax(values: list[torch.Tensor]):
    """llm-compressor's ``static_minmax`` statistic for a TENSOR / TENSOR_GROUP activation: ``_flatten_activation``
    (``(-1, groups, group)``), ``amin``/``amax`` over dims (0, -1), running min/max over the observations."""
    lo = hi = None
    for v in values:
        f = v.reshape(-1, 1, v.shape[-1])
        a, b = torch.amin(f, dim=(0, -1)), torch.amax(f, dim=(0, -1))
        lo = a if lo is None else torch.min(a, lo)
        hi = b if hi is None else torch.max(b, hi)
    return lo, hi


@pytest.fixture(scope="module")
def observed(llama):
    """ctconvert's statistics (with the KV cache) and the reference activations, on the same tokens and batches."""
    tok = _tokens(4, 24, seed=1)
    return calibrate(open_checkpoint(llama), tok, torch.device("cpu"), kv_cache=True, batch_tokens=48), _reference_activations(llama, tok, 2)


@pytest.mark.parametrize("scheme", ["NVFP4", "FP8", "W8A8_STATIC", "W8A8_STATIC_ASYM"])
def test_scales_equal_compressed_tensors_observers(observed, scheme):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from ctconvert.plan.schemes import get_scheme

    stats, acts = observed
    acts = dict(acts)
    args = get_scheme(scheme).input_args
    kv_acts = {n: acts.pop(n) for n in [n for n in acts if n.endswith((".k", ".v"))]}
    assert set(acts) == set(stats.inputs)
    for name, vals in acts.items():
        lo, hi = _ct_static_minmax(vals)
        assert torch.equal(stats.inputs[name].min.reshape(1), lo) and torch.equal(stats.inputs[name].max.reshape(1), hi), name
        ours = input_qparams(args, [stats.inputs[name]], torch.bfloat16)
        if args["strategy"] == "tensor_group":
            absmax = torch.max(-lo.min(), hi.max())
            ref = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
            assert ours["input_global_scale"].dtype == torch.float32 and torch.equal(ours["input_global_scale"], ref), name
        else:
            qa = QuantizationArgs(**{k: v for k, v in args.items() if k != "observer"}, observer="static_minmax")
            scale, zp = calculate_qparams(lo, hi, qa)
            assert torch.equal(ours["input_scale"], scale.to(torch.bfloat16)), name
            if not qa.symmetric:
                assert torch.equal(ours["input_zero_point"], zp.to(torch.int8)) and ours["input_zero_point"].dtype == torch.int8
            else:
                assert "input_zero_point" not in ours
    # the KV cache: compressed-tensors' calculate_qparams on the min/max of the key/value states per head
    # ([batch, kv_heads, seq, head_dim]; llm-compressor _flatten_attention for attn_head keeps dim 1)
    for a, k in stats.keys.items():
        v = stats.values[a]
        for s, part in ((k, "k"), (v, "v")):
            ref = kv_acts[f"{a}.{part}"]
            lo = torch.stack([torch.amin(x, dim=(0, 2, 3)) for x in ref]).amin(0)
            hi = torch.stack([torch.amax(x, dim=(0, 2, 3)) for x in ref]).amax(0)
            assert torch.equal(s.min, lo) and torch.equal(s.max, hi), (a, part)
        per_head = kv_qparams("fp8-head", k, v, torch.bfloat16)
        per_tensor = kv_qparams("fp8", k, v, torch.bfloat16)
        qa = QuantizationArgs(num_bits=8, type="float", strategy="attn_head", symmetric=True, dynamic=False)
        assert torch.equal(per_head["k_scale"].reshape(-1), calculate_qparams(k.min, k.max, qa)[0].to(torch.bfloat16))
        assert per_head["k_scale"].shape == (2, 1, 1) and per_tensor["v_scale"].shape == (1,)
        assert torch.equal(per_tensor["v_scale"], per_head["v_scale"].max().reshape(1))  # the tensor range is the heads' union


def _ids():
    return torch.randint(0, 380, (2, 24), generator=torch.Generator().manual_seed(5))


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize(
    ("scheme", "kv", "min_cos"),
    [("NVFP4", "fp8", 0.95), ("FP8", "fp8-head", 0.99), ("W8A8_STATIC", "none", 0.99), ("W8A8_STATIC_ASYM", "fp8", 0.99)],
)
def test_calibrated_checkpoint_loads_and_matches_dense(llama, tmp_path, scheme, kv, min_cos):
    from safetensors import safe_open

    out = tmp_path / "q"
    before = {p.name: p.stat().st_mtime_ns for p in llama.iterdir()}
    r = api.quantize(llama, out, scheme, kv_cache=kv, calibration_samples=4, calibration_seq_len=64)
    assert {p.name: p.stat().st_mtime_ns for p in llama.iterdir()} == before  # the input is untouched
    assert any("built-in English corpus" in n for n in r.notes)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (cfg["kv_cache_scheme"] or {}).get("strategy") == {"none": None, "fp8": "tensor", "fp8-head": "attn_head"}[kv]
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        part = {"NVFP4": "input_global_scale"}.get(scheme, "input_scale")
        qkv = [f.get_tensor(f"model.layers.1.self_attn.{m}_proj.{part}") for m in "qkv"]
        assert all(torch.equal(qkv[0], t) for t in qkv)  # one input: one scale for the fused set
        if kv != "none":
            assert "model.layers.0.self_attn.k_scale" in names and "model.layers.1.self_attn.v_scale" in names
        if scheme.endswith("ASYM"):
            assert f.get_tensor("model.layers.0.mlp.down_proj.input_zero_point").dtype == torch.int8
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.bfloat16).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        a, b = dense(_ids()).logits, model(_ids()).logits
    assert torch.isfinite(b).all() and min_cos <= _cos(a, b) < 1.0
    assert api.verify(out, llama)["ok"]


@pytest.mark.parametrize("kind", ["fp8", "fp8-head"])
def test_kv_cache_scheme_is_compressed_tensors_dump(kind):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    from ctconvert.calibration.apply import kv_cache_config

    ours = kv_cache_config(kind)
    args = QuantizationArgs(num_bits=8, type="float", strategy=ours["strategy"], symmetric=True, dynamic=False, observer="static_minmax")
    assert ours == args.model_dump()
    QuantizationConfig(config_groups={}, kv_cache_scheme=ours)  # the library accepts it


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_calibrated_schemes_weights_are_compressed_tensors_bytes(llama, tmp_path, scheme):
    """The weights of the calibrated schemes (FP8: one scale per tensor) are the bytes compressed-tensors' compressor writes."""
    from safetensors.torch import load_file

    from ct_reference import ct_compress

    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 300) for i in range(512)))
    api.quantize(llama, tmp_path / "q", scheme, calibration=ids, calibration_samples=2, calibration_seq_len=256)
    ours = load_file(next((tmp_path / "q").glob("*.safetensors")))
    dense = load_file(next(llama.glob("*.safetensors")))
    mods = sorted(n[: -len(".weight_scale")] for n in ours if n.endswith(".weight_scale"))
    assert len(mods) == 14
    for m in mods:
        parent, _, leaf = m.rpartition(".")
        sets = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}
        members = next((s for s in sets.values() if leaf in s), (leaf,))
        ref = ct_compress(dense[m + ".weight"], scheme, fused_with=[dense[f"{parent}.{x}.weight"] for x in members])
        for k, v in ref.items():
            if k in ("weight_zero_point",):
                continue
            got = ours[f"{m}.{k}"]
            assert got.dtype == v.dtype and got.shape == v.shape, (m, k)
            assert torch.equal(got.reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), (m, k)


def test_w4afp8_is_data_free_and_loads(tmp_path):
    p = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG, seed=3), LLAMA_CONFIG)  # no tokenizer: none needed
    r = api.quantize(p, tmp_path / "q", "W4AFP8")
    assert r.calibration is None
    g = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert g["input_activations"]["dynamic"] is True and g["weights"]["num_bits"] == 4
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.bfloat16).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert 0.85 <= _cos(dense(ids).logits, model(ids).logits) < 1.0


def test_moe_nvfp4_experts_get_their_own_input_scales(tmp_path):
    from safetensors import safe_open

    p = add_tokenizer(make_moe(tmp_path / "m", "qwen3_moe"))
    out = tmp_path / "q"
    api.quantize(p, out, "NVFP4", calibration_samples=4, calibration_seq_len=64)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        g = [f.get_tensor(f"model.layers.0.mlp.experts.{e}.gate_proj.input_global_scale") for e in range(4)]
        u = [f.get_tensor(f"model.layers.0.mlp.experts.{e}.up_proj.input_global_scale") for e in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(g, u))  # gate/up of an expert: one input
    assert len({float(x) for x in g}) > 1  # experts see different tokens
    assert api.verify(out, p)["ok"]


def test_nvfp4_output_repacks_for_cutlass(llama, tmp_path):
    from ctconvert.api import quantize_to_target, repack

    q = tmp_path / "q"
    api.quantize(llama, q, "NVFP4", calibration_samples=2, calibration_seq_len=64)
    repack(q, tmp_path / "k", "cutlass-nvfp4", device="cpu")
    quantize_to_target(llama, tmp_path / "k2", "NVFP4", "cutlass-nvfp4", device="cpu", calibration_samples=2, calibration_seq_len=64)
    assert api.verify(tmp_path / "k", q)["ok"] and api.verify(tmp_path / "k2", q)["ok"]
    from safetensors.torch import load_file

    a = {}
    b = {}
    for f in (tmp_path / "k").glob("*.safetensors"):
        a.update(load_file(f))
    for f in (tmp_path / "k2").glob("*.safetensors"):
        b.update(load_file(f))
    assert a.keys() == b.keys() and all(torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8)) for n in a)


def test_dry_run_says_what_calibration_costs(llama):
    r = api.quantize(llama, None, "NVFP4", dry_run=True, kv_cache="fp8", calibration_samples=4, calibration_seq_len=128)
    c = r.calibration
    assert c["layers"] == 2 and c["tokens"] == 512 and c["schemes"] == ["NVFP4"] and c["peak_bytes"] > 0
    assert any(n.startswith("calibration (NVFP4 + KV cache fp8): 2 decoder layers") for n in r.notes)
    assert any(o[0] == "model.layers.0.self_attn.k_scale" for u in r.plan.units for o in u.outputs)
    assert "no calibration needed" in " ".join(api.quantize(llama, None, "W8A16", dry_run=True, skip_incompatible=True).notes)


# -- data ----------------------------------------------------------------------------------------------


def test_data_formats(llama, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text(CORPUS.read_text()[:4000])
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in CORPUS.read_text()[:4000].split("\n\n")))
    ids = tmp_path / "c.json"
    ids.write_text(json.dumps(list(range(300))))
    ws = tmp_path / "d.txt"
    ws.write_text(" ".join(str(i % 7) for i in range(64)))
    assert load_tokens(llama, text, 4, 32, 384).kind == "text"
    assert load_tokens(llama, jl, 4, 32, 384).kind == "jsonl"
    d = load_tokens(llama, ids, 2, 100, 384)
    assert d.kind == "token ids" and d.tokens.tolist() == [list(range(100)), list(range(100, 200))]
    assert load_tokens(llama, ws, 2, 32, 384).tokens[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    dflt = load_tokens(llama, None, 8, 256, 384)
    assert dflt.source == "the built-in English corpus" and dflt.tokens.shape == (8, 256)


def _refused(src: Path, tmp_path: Path, exc, match: str, **kw):
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    out = tmp_path / "out"
    with pytest.raises(exc, match=match):
        api.quantize(src, out, kw.pop("scheme", "NVFP4"), **kw)
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # nothing written, not even the hidden folder
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before


def test_too_few_tokens(llama, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("Too short.")
    _refused(llama, tmp_path, BadInputError, r"needs 8 x 256 = 2048 tokens, .*short.txt has \d+", calibration=f)
    _refused(llama, tmp_path, BadInputError, "the built-in English corpus has", calibration_samples=100, calibration_seq_len=512)


def test_no_tokenizer(tmp_path):
    p = write_checkpoint(tmp_path / "m", llama_tensors(SMALL), SMALL)
    _refused(p, tmp_path, BadInputError, "no usable tokenizer in the checkpoint")
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 300) for i in range(2048)))
    api.quantize(p, tmp_path / "ok", "FP8", calibration=ids)  # token ids need no tokenizer


def test_no_tokenizer_files_for_a_model_type_transformers_builds_an_empty_tokenizer_for(tmp_path):
    """transformers 5 builds an empty Qwen2 tokenizer (one token) from a Qwen3-MoE ``config.json`` alone: that is no
    tokenizer, not a corpus of one token (a new user's trial)."""
    from conftest import moe_checkpoint

    p = moe_checkpoint(tmp_path)
    assert not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    _refused(p, tmp_path, BadInputError, r"no usable tokenizer in the checkpoint \(looked for .*; found none\)")


def test_architecture_transformers_cannot_build(tmp_path):
    cfg = dict(SMALL, architectures=["NoSuchForCausalLM"], model_type="no_such_model")
    p = add_tokenizer(write_checkpoint(tmp_path / "m", llama_tensors(SMALL), cfg))
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 300) for i in range(2048)))
    _refused(p, tmp_path, UnsupportedError, "cannot build architecture NoSuchForCausalLM", calibration=ids)


def test_forward_failure_is_one_line(llama, tmp_path, monkeypatch):
    from ctconvert.calibration import model as cal_model

    def broken(self, i, hidden, recs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\nsecond line")

    monkeypatch.setattr(cal_model.CalibrationModel, "run_layer", broken)
    msg = r"LlamaForCausalLM's forward failed in decoder layer 0 \(RuntimeError: mat1 and mat2 shapes cannot be multiplied\)$"
    _refused(llama, tmp_path, UnsupportedError, msg)


def test_bad_calibration_files(llama, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"nottext": 1}\n')
    _refused(llama, tmp_path, BadInputError, "line 2 has no 'text'", calibration=bad)
    oov = tmp_path / "oov.txt"
    oov.write_text(" ".join(["5000"] * 2048))
    _refused(llama, tmp_path, BadInputError, "outside the vocabulary", calibration=oov)
    _refused(llama, tmp_path, UsageError, "calibration file not found", calibration=tmp_path / "missing.txt")
    _refused(llama, tmp_path, UsageError, "at least 1", calibration_samples=0)
    _refused(llama, tmp_path, UsageError, "unknown --kv-cache", kv_cache="int4")


def test_cli_calibrated_run(llama, tmp_path):
    from click.testing import CliRunner

    from ctconvert.cli import main

    r = CliRunner().invoke(main, ["quantize", str(llama), "-o", str(tmp_path / "q"), "-s", "nvfp4", "--calibration-samples", "2", "--kv-cache", "fp8"])
    assert r.exit_code == 0, r.output
    assert "calibration data: the built-in English corpus" in r.stderr
    r = CliRunner().invoke(main, ["quantize", str(llama), "-s", "fp8", "--dry-run"])
    assert r.exit_code == 0 and "calibration (FP8): 2 decoder layers" in r.stdout
    f = tmp_path / "short.txt"
    f.write_text("no")
    r = CliRunner().invoke(main, ["quantize", str(llama), "-o", str(tmp_path / "q2"), "-s", "fp8", "--calibration", str(f)])
    assert r.exit_code == 3 and r.stderr.count("\n") == 1 and "tokens" in r.stderr and not (tmp_path / "q2").exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_encoder_is_refused_for_calibration_before_any_work(minilm_path, tmp_path, dry_run):
    """BERT (all-MiniLM-L6-v2) has no decoder layers to calibrate: one clear line, exit 4, nothing written (a dry run says so too)."""
    out = tmp_path / "o"
    with pytest.raises(UnsupportedError, match="calibration runs decoder language models layer by layer; BertModel is not one"):
        api.quantize(minilm_path, out, "FP8", dry_run=dry_run)
    assert not out.exists() and not any(tmp_path.iterdir())


def test_kv_cache_without_k_and_v_projections_says_why(minilm_path, tmp_path):
    with pytest.raises(UsageError, match=r"an encoder has no KV cache; MLA attention has no k_proj/v_proj"):
        api.quantize(minilm_path, tmp_path / "o", "W4A16", kv_cache="fp8")


@pytest.mark.parametrize("scheme,kv", [("NVFP4", "none"), ("FP8", "none"), ("FP8_DYNAMIC", "fp8")])
def test_non_finite_activations_get_no_made_up_static_scale(tmp_path, scheme, kv):
    """A NaN norm weight kept with --allow-non-finite makes the next modules' inputs (the MLP's, or the
    attention's keys and values) NaN: the run is refused naming the first such module, never given a scale of 1.0
    or NaN; nothing is written."""
    t = llama_tensors(LLAMA_CONFIG)
    norm = "post_attention_layernorm" if kv == "none" else "input_layernorm"  # before the MLP / before the attention
    t[f"model.layers.1.{norm}.weight"][3] = float("nan")
    src = write_checkpoint(tmp_path / "m", t, LLAMA_CONFIG)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % LLAMA_CONFIG["vocab_size"] for i in range(64)]))
    with pytest.raises(BadInputError, match=r"calibration: the (inputs|keys|values) of model\.layers\.[1-9]\.\S+ are not finite") as e:
        api.quantize(src, tmp_path / "q", scheme, allow_nonfinite=True, calibration=ids, calibration_samples=2, calibration_seq_len=16, kv_cache=kv)
    assert e.value.exit_code == 3
    assert ("mlp" in str(e.value)) if kv == "none" else ("self_attn" in str(e.value))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "tensor,scale,first",
    [
        ("model.layers.0.post_attention_layernorm.weight", None, "mlp.gate_proj"),  # activations of 6e4 x O(1): inf
        ("model.layers.0.self_attn.q_proj.weight", 2.5e5, "self_attn.o_proj"),  # queries overflow; the softmax makes NaN
    ],
)
def test_float16_activations_that_overflow_name_the_overflow(tmp_path, dtype, tensor, scale, first):
    """An fp16 model whose weights are all finite but whose activations pass 65504 (norm weights of 6e4: inf reaches
    the MLP; q_proj weights x 2.5e5: the attention turns the overflow into NaN) is refused naming float16's overflow
    as the likelier cause, before a non-finite tensor (it has none); the same model in bf16 does not overflow, and
    calibrates."""
    t = {k: v.to(dtype) for k, v in llama_tensors(LLAMA_CONFIG).items()}
    if scale is None:
        t[tensor][:] = 6e4
    else:
        t[tensor] = (t[tensor].float() * scale).to(dtype)
    assert all(bool(torch.isfinite(v).all()) for v in t.values())
    src = write_checkpoint(tmp_path / "m", t, {**LLAMA_CONFIG, "torch_dtype": str(dtype).removeprefix("torch.")})
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % LLAMA_CONFIG["vocab_size"] for i in range(64)]))
    run = lambda: api.quantize(src, tmp_path / "q", "FP8", calibration=ids, calibration_samples=2, calibration_seq_len=16)  # noqa: E731
    if dtype == torch.bfloat16:
        assert run().calibration is not None and (tmp_path / "q").is_dir()
        return
    with pytest.raises(BadInputError, match=rf"the inputs of model\.layers\.0\.{first} are not finite") as e:
        run()
    msg = str(e.value)
    assert "float16 overflowed upstream of it" in msg and msg.index("float16 overflowed") < msg.index("a non-finite tensor upstream")
    assert "calibrate a bfloat16 copy" in msg and e.value.exit_code == 3
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("norm,first", [("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.gate_proj")])
def test_non_finite_activations_name_the_first_module_the_forward_reached(tmp_path, norm, first):
    """The refusal names the module a NaN reached first in the forward (q_proj after the input norm, gate_proj after
    the MLP's norm), not the first in file order (down_proj), so it points at the bad tensor upstream of it."""
    t = llama_tensors(LLAMA_CONFIG)
    t[f"model.layers.0.{norm}.weight"][3] = float("nan")
    src = write_checkpoint(tmp_path / "m", t, LLAMA_CONFIG)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([i % LLAMA_CONFIG["vocab_size"] for i in range(64)]))
    with pytest.raises(BadInputError, match=rf"the inputs of model\.layers\.0\.{first} are not finite"):
        api.quantize(src, tmp_path / "q", "NVFP4", allow_nonfinite=True, calibration=ids, calibration_samples=2, calibration_seq_len=16)
    assert not (tmp_path / "q").exists()
