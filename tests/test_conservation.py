"""The conservation matrix (issue 22): every family the tests build x every scheme x every command chain.

Each cell runs a command chain through the public API (:mod:`ctconvert.api`) and reads what it wrote with
safetensors, independently of ctconvert's own checks:

- every source tensor is in the output under its name (bit for bit where it is not quantized), or replaced by
  its quantized parts (its module then in a config group's targets and not in ``ignore``), or split per expert
  (each part equal to the family's own slice), or named in the notes; and no output tensor is left that the
  source and the config do not explain;
- a dense Linear layer of the output is listed in ``ignore``;
- every round trip (``repack`` there and back, for every target) restores every byte of every tensor and the
  ``quantization_config``; ``quantize --target T`` writes what ``quantize`` then ``repack --target T`` writes;
- ``decompress`` gives every source tensor back under its name and shape: the copies bit for bit, the weights
  within their format's error (the pruned weight's for 2:4); ``convert`` of another tool's format is exact;
- every command run twice writes identical bytes (calibrated runs included).

CI (``python3 -m pytest -q``) runs one complete row per family (its scheme through every chain) and one per
chain (every scheme on the dense Llama, every family through ``quantize``); ``-m slow`` runs the rest of the
product. A case that fails because of a bug being fixed on another branch is ``xfail(strict=True)`` with the
bug and the branch (:data:`KNOWN`).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import foreign_formats as ff
import pytest
import torch
from safetensors.torch import load_file

from ctconvert import api
from ctconvert.errors import CTConvertError, UnsupportedError

from helpers import bitwise_equal, randomized, tree_hash

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore")

import test_moe_families as moe  # noqa: E402  (its builders and the families' expert math; not edited here)

# ------------------------------------------------------------------------------------------ the families

TEXT = moe.TEXT


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT))


def _qwen2():  # q/k/v with biases
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TEXT))


def _bert():
    cfg = transformers.BertConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_hidden_layers=2, vocab_size=256)
    return transformers.BertModel(cfg)


#: family -> (builder, save_pretrained keywords, how its fused 3-D experts split (test_moe_families._expert_weights), leaves)
FAMILIES = {
    "llama": (_llama, {}, None, None),
    "qwen2": (_qwen2, {}, None, None),
    "bert": (_bert, {}, None, None),
    "qwen3_moe": (moe._qwen3_moe, {}, None, None),
    "qwen3_moe_fused": (moe._qwen3_moe, {"save_original_format": False}, "contiguous", moe.GUD),
    "mixtral": (moe._mixtral, {}, None, None),
    "deepseek_v3": (moe._deepseek_v3, {}, None, None),
    "gpt_oss": (moe._gpt_oss, {}, "gpt_oss", moe.GUD),
    "gemma4": (moe._gemma4, {}, "contiguous", moe.GUD),
    "llama4": (moe._llama4, {}, "llama4", moe.GUD),
    "qwen2_5_vl": (moe._qwen2_5_vl, {}, None, None),
}

# ------------------------------------------------------------------------------------------ the schemes

DATA_FREE = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8", "W4AFP8"]
CALIBRATED = ["NVFP4", "FP8", "W8A8_STATIC", "KV_FP8"]
SCHEMES = DATA_FREE + CALIBRATED
#: the matrix's own scheme names -> quantize keywords (KV_FP8: FP8_DYNAMIC weights, calibrated FP8 k/v scales)
#: W8A8_STATIC: MoE experts with static INT8 inputs are ours to conserve; vLLM 0.33 cannot load them (refused without
#: allow_unloadable: tests/checkpoint/test_conformance.py), which is not what this matrix checks
SCHEME_ARGS = {
    "KV_FP8": ("FP8_DYNAMIC", {"kv_cache": "fp8"}),
    "FP8_BLOCK": ("FP8_BLOCK", {"skip_incompatible": True}),
    "W8A8_STATIC": ("W8A8_STATIC", {"allow_unloadable": True}),
}
#: the kernel-layout targets each scheme's modules go to (every other scheme: repack refuses it)
TARGETS = {
    "FP8_DYNAMIC": ["marlin"],
    "KV_FP8": ["marlin"],
    "FP8": ["marlin"],
    "W4A16": ["marlin"],
    "W4A16_ASYM": ["marlin"],
    "W8A16": ["marlin"],
    "W4AFP8": ["marlin"],
    "NVFP4A16": ["marlin"],
    "NVFP4": ["marlin", "cutlass-nvfp4"],
    "MXFP4A16": ["marlin"],
    "MXFP4": ["marlin"],
}
#: relative L2 limit of a dequantized weight against its source (README "verify": 8-bit float, 8-bit int, 4-bit int, 4-bit float)
LIMIT = {"FP8_DYNAMIC": 0.08, "FP8_BLOCK": 0.08, "FP8": 0.08, "KV_FP8": 0.08, "MXFP8": 0.08, "W8A8": 0.04, "W8A16": 0.04, "W8A8_STATIC": 0.04}
LIMIT.update({s: 0.25 for s in ("W4A16", "W4A16_ASYM", "W4AFP8")} | {s: 0.30 for s in ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4")})
#: the second scheme of the requantize chain (quantize of a quantized output)
REQUANT = {s: ("NVFP4A16" if s == "W4A16" else "W4A16") for s in SCHEMES}

# ------------------------------------------------------------------------------------------ the chains

CHAINS = ["quantize", "quantize --target", "repack", "decompress", "requantize"]
SPARSE_SCHEMES = ["DENSE", "FP8_DYNAMIC", "W8A8"]
#: the 2:4 kernel layouts each sparse scheme goes to (README "2:4 sparsity": the SM80 layout takes no FP8)
SPARSE_TARGETS = {"DENSE": ["cutlass-2of4", "cutlass-2of4-sm80"], "FP8_DYNAMIC": ["cutlass-2of4"], "W8A8": ["cutlass-2of4", "cutlass-2of4-sm80"]}
SPARSE_CHAINS = ["quantize", "repack cutlass-2of4", "repack cutlass-2of4-sm80", "quantize --target cutlass-2of4", "decompress"]

#: the scheme each family runs through every chain in CI (together they cover every scheme)
ROW = {
    "llama": "W4A16",
    "qwen2": "NVFP4",
    "bert": "W8A8",
    "qwen3_moe": "KV_FP8",
    "qwen3_moe_fused": "NVFP4A16",
    "mixtral": "W8A8_STATIC",
    "deepseek_v3": "FP8_BLOCK",
    "gpt_oss": "MXFP4A16",
    "gemma4": "W4A16_ASYM",
    "llama4": "FP8_DYNAMIC",
    "qwen2_5_vl": "MXFP4",
}
#: the family whose row runs every scheme through every chain in CI
CHAIN_ROW = "llama"

BIASED = {"qwen2", "bert", "gpt_oss", "qwen2_5_vl"}  # families with Linear biases
NO_CALIBRATION = {"bert": "calibration runs decoder language models (README: Calibration)"}
NO_KV = {"bert": "an encoder has no KV cache", "deepseek_v3": "MLA attention has no k_proj/v_proj"}

_REPACK = "issue 22: {} (branch repack)"
_CALIB = "issue 23/22: {} (branch calib)"
#: the schemes whose Linear biases repack --target marlin leaves out
BIAS_DROPPED = ("NVFP4", "NVFP4A16", "MXFP4A16", "MXFP4")
ROUTES = "quantize --target leaves Linear biases out of the repacked module (unpermuted, not in its config tensors); repack puts them in"


def known(family: str, scheme: str, chain: str) -> tuple[str, bool] | None:
    """The bug (and the branch fixing it) a cell fails on today, and whether it fails every time; None: the cell passes.
    Every bug the matrix found when it was written is fixed (repack's dropped biases, input_global_scale and
    input_scale, the two --target routes, Gemma-4 / Llama-4 / VLM calibration, DeepSeek-V3's routing buffer): a new one
    goes here as ``(reason, strict)`` until its fix lands."""
    return None


def applicable(family: str, scheme: str) -> str | None:
    """Why a (family, scheme) cell does not exist (None: it does)."""
    if scheme in CALIBRATED and family in NO_CALIBRATION:
        return NO_CALIBRATION[family]
    if scheme == "KV_FP8" and family in NO_KV:
        return NO_KV[family]
    return None


def in_ci(family: str, scheme: str, chain: str) -> bool:
    """The CI rows: each family's scheme through every chain, every scheme of the Llama row, every family through
    ``quantize`` with each data-free scheme, and the ``quantize`` cell of every bug that fails each time (a fix shows)."""
    bug = known(family, scheme, chain)
    return ROW[family] == scheme or family == CHAIN_ROW or (chain == "quantize" and (scheme in DATA_FREE or (bug is not None and bug[1])))


def _cells():
    for family in FAMILIES:
        for scheme in SCHEMES:
            if applicable(family, scheme):
                continue
            for chain in CHAINS:
                marks = [] if in_ci(family, scheme, chain) else [pytest.mark.slow]
                bug = known(family, scheme, chain)
                if bug:
                    marks.append(pytest.mark.xfail(strict=bug[1], reason=bug[0]))
                yield pytest.param(family, scheme, chain, marks=marks, id=f"{family}-{scheme}-{chain.replace(' ', '')}")


# ------------------------------------------------------------------------------------------ reading outputs


def tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard under ``path``, by name (a name in two shards is an error)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(out), f"{f.name}: tensors also in another shard: {sorted(set(part) & set(out))[:3]}"
        out.update(part)
    return out


def qconfig(path) -> dict:
    return json.loads((path / "config.json").read_text()).get("quantization_config") or {}


def matches(module: str, patterns) -> bool:
    """compressed-tensors' target rule: the class name ``Linear`` (every module checked here is one), a full name, or ``re:`` + ``re.match``."""
    return any(p == "Linear" or p == module or (p.startswith("re:") and re.match(p[3:], module)) for p in patterns)


#: the tensors a quantized module is written as (compressed-tensors formats, the calibrated scales, 2:4, marlin-24)
PARTS = {"weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape", "input_scale", "input_global_scale"}
PARTS |= {"input_zero_point", "compressed", "bitmask", "shape", "meta", "scale_packed"}
#: the fused 3-D expert tensors -> the per-expert Linear leaves they are written as (and whether it is the bias)
FUSED = {"gate_up_proj": (("gate_proj", "up_proj"), "weight"), "down_proj": (("down_proj",), "weight")}
FUSED |= {"gate_up_proj_bias": (("gate_proj", "up_proj"), "bias"), "down_proj_bias": (("down_proj",), "bias")}


class _Src:
    def __init__(self, t):
        self.t = t

    def get_tensor(self, name):
        return self.t[name]


def split_experts(family: str, src: dict) -> dict[str, tuple[str, torch.Tensor]]:
    """The per-expert tensors the family's fused 3-D experts are, by name -> (source tensor, the family's own slice)."""
    how, leaves = FAMILIES[family][2], FAMILIES[family][3]
    out = {}
    if how is None:
        return out
    for name in src:
        parent, _, leaf = name.rpartition(".")
        if leaf not in FUSED or src[name].dim() < 2 or not parent.endswith("experts"):
            continue
        members, kind = FUSED[leaf]
        for e in range(src[name].shape[0]):
            if kind == "weight":
                w = moe._expert_weights(how, _Src(src), parent, leaves, e)
                out.update({f"{parent}.{e}.{m}.weight": (name, w[m]) for m in members})
            else:  # biases follow the weights' split: gpt-oss interleaves gate and up
                b = src[name][e]
                if members == ("down_proj",):
                    out[f"{parent}.{e}.down_proj.bias"] = (name, b)
                elif how == "gpt_oss":
                    out.update({f"{parent}.{e}.gate_proj.bias": (name, b[::2]), f"{parent}.{e}.up_proj.bias": (name, b[1::2])})
                else:
                    half = b.shape[0] // 2
                    out.update({f"{parent}.{e}.gate_proj.bias": (name, b[:half]), f"{parent}.{e}.up_proj.bias": (name, b[half:])})
    return out


def quantized_modules(out: dict) -> set[str]:
    """Modules the output holds quantized (a scale, or the 2:4 parts), read from the tensor names alone."""
    return {n.rpartition(".")[0] for n in out if n.endswith((".weight_scale", ".compressed", ".weight_packed", ".scale_packed"))}


def conservation(family: str, src_path, out_path, notes=(), ignore=None) -> None:
    """Every source tensor of ``src_path`` accounted for in the compressed-tensors output ``out_path``, and every
    output tensor explained (module docstring); ``ignore``: the result's, which must equal the config's. ``src_path``
    may be the source's tensors themselves (a quantized source's, dense modules dequantized)."""
    src = src_path if isinstance(src_path, dict) else tensors(src_path)
    out, qc = tensors(out_path), qconfig(out_path)
    groups = qc.get("config_groups") or {}
    ignored = qc.get("ignore") or []
    sparse = qc.get("sparsity_config") or {}
    if sparse and not groups:  # 2:4 pruning only (--scheme DENSE): the sparsity config's targets and ignore
        groups, ignored = {"sparsity": {"targets": sparse.get("targets")}}, sparse.get("ignore") or []
    elif sparse:
        assert sparse.get("ignore") == ignored, (sparse.get("ignore"), ignored)
    if ignore is not None:
        assert list(ignore) == ignored, (ignore, ignored)
    quant = quantized_modules(out)
    # fused 3-D experts the output holds as stored (kept dense: gpt-oss by default, as vLLM 0.33 loads it) are plain
    # copies; the others must be there per expert (quantized, or the family's slice)
    split = {n: v for n, v in split_experts(family, src).items() if v[0] not in out}
    fused_src = {s for s, _ in split.values()}
    problems = []
    for n, t in src.items():
        mod, _, leaf = n.rpartition(".")
        if n in fused_src:
            continue  # checked below, per expert
        if mod in quant and leaf != "bias":
            continue  # replaced by its quantized parts
        if n not in out:
            if not any(n in note for note in notes):
                problems.append(f"source tensor {n} left out of the output without a note")
        elif not bitwise_equal(out[n], t):
            problems.append(f"{n}: not quantized, yet not the source's bytes ({out[n].dtype} {list(out[n].shape)} vs {t.dtype} {list(t.shape)})")
    for n, (whence, want) in split.items():
        mod = n.rpartition(".")[0]
        if n.endswith(".weight") and mod in quant:
            continue
        if n not in out:
            problems.append(f"{n}: expert part of {whence} missing")
        elif not bitwise_equal(out[n], want.contiguous()):
            problems.append(f"{n}: not the family's slice of {whence}")
    explained = set(src) | set(split)
    kv = qc.get("kv_cache_scheme") is not None
    for n in out:
        mod, _, leaf = n.rpartition(".")
        if n in explained:
            continue
        if leaf in PARTS and mod in quant and (f"{mod}.weight" in src or f"{mod}.weight" in split or any(s.startswith(mod + ".") for s in src)):
            continue
        if kv and leaf in ("k_scale", "v_scale") and f"{mod}.k_proj.weight" in src:
            continue
        problems.append(f"output tensor {n} that neither the source nor the config explains")
    for m in sorted(quant):
        if not any(matches(m, g.get("targets") or []) for g in groups.values()):
            problems.append(f"{m}: quantized, but in no config group's targets")
        if matches(m, [p for p in ignored if p != "Linear"]):
            problems.append(f"{m}: quantized, but listed in ignore")
    linear_targets = any("Linear" in (g.get("targets") or []) for g in groups.values())
    for n, t in out.items():
        mod, _, leaf = n.rpartition(".")
        if leaf == "weight" and t.dim() == 2 and mod not in quant and "embed" not in n and linear_targets and t.is_floating_point():
            if not matches(mod, [p for p in ignored if p != "Linear"]):
                problems.append(f"{mod}: a dense 2-D weight the config's Linear target takes, not in ignore")
    assert not problems, "\n".join(problems[:20]) + (f"\n... {len(problems)} in all" if len(problems) > 20 else "")


#: where the dense Llama's source holds an exact -0.0 (the first 8 columns of row 0), as every requantized FP8 source does
NEGATIVE_ZEROS = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight")


def same_checkpoint(a, b) -> None:
    """``a`` and ``b`` hold the same tensors (names, dtypes, shapes, bytes) and the same quantization_config."""
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb), (sorted(set(ta) - set(tb))[:10], sorted(set(tb) - set(ta))[:10])
    differ = [n for n in ta if not bitwise_equal(ta[n], tb[n])]
    assert not differ, f"{len(differ)} tensors differ: {differ[:10]}"
    assert qconfig(a) == qconfig(b)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.float(), want.float()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def prune24(w: torch.Tensor) -> torch.Tensor:
    """Keep the two largest |w| of every 4 along K (the reference of a 2:4 output, computed here)."""
    n, k = w.shape
    g = w.float().reshape(n, k // 4, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.abs().topk(2, dim=-1).indices, True)
    return (g * keep).reshape(n, k).to(w.dtype)


def decompressed(family: str, src_path, dense_path, limit: float, pruned: bool = False) -> None:
    """A ``decompress`` output against the dense source: every tensor under its name and shape, copies bit for bit,
    dequantized weights within ``limit`` (of the 2:4 pruned source, and 2:4 themselves, when ``pruned``); ``src_path``
    may be the tensors themselves."""
    src = src_path if isinstance(src_path, dict) else tensors(src_path)
    dense = tensors(dense_path)
    split = {n: v for n, v in split_experts(family, src).items() if v[0] not in dense}  # experts kept fused stay fused
    want = {n: t for n, t in src.items() if n not in {s for s, _ in split.values()}} | {n: t for n, (_, t) in split.items()}
    assert set(dense) == set(want), (sorted(set(want) - set(dense))[:10], sorted(set(dense) - set(want))[:10])
    problems = []
    for n, w in want.items():
        d = dense[n]
        if d.shape != w.shape or d.dtype != w.dtype:
            problems.append(f"{n}: {d.dtype} {list(d.shape)}, source {w.dtype} {list(w.shape)}")
        elif not bitwise_equal(d, w.contiguous()):
            if not n.endswith(".weight") or w.dim() != 2:
                problems.append(f"{n}: not the source's bytes")
                continue
            ref = w
            if pruned:
                ref = prune24(w)
                if (d.reshape(d.shape[0], -1, 4) != 0).sum(-1).max() > 2:
                    problems.append(f"{n}: more than 2 of 4 non-zero")
            if rel_l2(d, ref) > limit:
                problems.append(f"{n}: relative L2 {rel_l2(d, ref):.4f} > {limit}")
    assert not problems, "\n".join(problems[:20])


# ------------------------------------------------------------------------------------------ the runs (built once)


class Runs:
    """Each family saved once and each command's output written once (and, for determinism, a second time)."""

    def __init__(self, root):
        self.root = root
        self.cache = {}
        ids = root / "ids.txt"
        ids.write_text(" ".join(str((i * 37 + 11) % 250) for i in range(1024)))
        self.calibration = dict(calibration=str(ids), calibration_samples=2, calibration_seq_len=32)

    def _once(self, key, fn):
        if key not in self.cache:
            try:
                self.cache[key] = (fn(), None)
            except CTConvertError as e:
                self.cache[key] = (None, e)
        value, err = self.cache[key]
        if err is not None:
            raise err
        return value

    def _dir(self, *parts):
        d = self.root / "-".join(p.replace("/", "_").replace(" ", "") for p in parts)
        if d.exists():
            shutil.rmtree(d)
        return d

    def source(self, family: str):
        def build():
            torch.manual_seed(0)
            model = randomized(FAMILIES[family][0]().to(torch.bfloat16))
            if family == "llama":
                params = dict(model.named_parameters())
                with torch.no_grad():
                    for n in NEGATIVE_ZEROS:
                        params[n][0, :8] = -0.0
            path = self.root / f"src-{family}"
            model.save_pretrained(str(path), **FAMILIES[family][1])
            return path

        return self._once(("src", family), build)

    def scheme_args(self, scheme: str) -> tuple[str, dict]:
        name, kw = SCHEME_ARGS.get(scheme, (scheme, {}))
        kw = dict(kw)
        if scheme in CALIBRATED:
            kw = {**kw, **self.calibration}
        return name, kw

    def quantize(self, family: str, scheme: str, copy: int = 0, target: str | None = None, sparsity: str | None = None):
        """(output, result) of quantizing ``family`` with ``scheme`` (``copy`` 1: the second, identical run)."""
        name, kw = self.scheme_args(scheme)
        if target:
            kw["target"] = target
        if sparsity:
            kw["sparsity"] = sparsity
        if target == "marlin-24":
            kw["skip_incompatible"] = True

        def run():
            out = self._dir("q", family, scheme, str(target), str(sparsity), str(copy))
            return out, api.quantize(self.source(family), out, name, **kw)

        return self._once(("q", family, scheme, target, sparsity, copy), run)

    def repack(self, src, target: str, copy: int = 0):
        def run():
            out = self._dir("r", src.name, target, str(copy))
            api.repack(src, out, target, device="cpu")
            return out

        return self._once(("r", str(src), target, copy), run)

    def decompress(self, src, copy: int = 0):
        def run():
            out = self._dir("d", src.name, str(copy))
            api.decompress(src, out)
            return out

        return self._once(("d", str(src), copy), run)

    def convert(self, src, copy: int = 0):
        def run():
            out = self._dir("cv", src.name, str(copy))
            return out, api.convert(src, out)

        return self._once(("cv", str(src), copy), run)

    def requantize(self, src, scheme: str, copy: int = 0):
        def run():
            out = self._dir("rq", src.name, scheme, str(copy))
            return out, api.quantize(src, out, scheme)

        return self._once(("rq", str(src), scheme, copy), run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's outputs (~430 MB): removed when its last test ends, not with the session."""
    folder = tmp_path_factory.mktemp("conservation")
    yield Runs(folder)
    shutil.rmtree(folder, ignore_errors=True)


def deterministic(a, b) -> None:
    assert tree_hash(a) == tree_hash(b), f"{a.name} and {b.name}: the same command wrote different bytes"


# ------------------------------------------------------------------------------------------ the matrix


@pytest.mark.parametrize("family, scheme, chain", list(_cells()))
def test_conservation(runs, family, scheme, chain):
    src = runs.source(family)
    out, res = runs.quantize(family, scheme)
    if chain == "quantize":
        conservation(family, src, out, res.notes, res.ignore)
        deterministic(out, runs.quantize(family, scheme, copy=1)[0])
    elif chain == "quantize --target":
        targets = TARGETS.get(scheme)
        if not targets:
            with pytest.raises(UnsupportedError):
                runs.quantize(family, scheme, target="marlin")
            return
        for t in targets:
            direct = runs.quantize(family, scheme, target=t)[0]
            same_checkpoint(direct, runs.repack(out, t))
            same_checkpoint(runs.repack(direct, "compressed-tensors"), out)
            deterministic(direct, runs.quantize(family, scheme, target=t, copy=1)[0])
    elif chain == "repack":
        targets = TARGETS.get(scheme)
        if not targets:
            with pytest.raises(UnsupportedError):
                runs.repack(out, "marlin")
            return
        q = tensors(out)
        for t in targets:
            native = runs.repack(out, t)
            kn = tensors(native)
            quant = quantized_modules(q)
            lost = [n for n in q if n.endswith(".bias") and n not in kn]  # a Marlin bias is permuted, as vLLM does
            lost += [n for n in q if n.rpartition(".")[0] not in quant and not n.endswith(".bias") and not (n in kn and bitwise_equal(kn[n], q[n]))]
            assert not lost, f"repack --target {t}: {len(lost)} tensors not carried: {lost[:8]}"
            back = runs.repack(native, "compressed-tensors")
            same_checkpoint(back, out)
            deterministic(native, runs.repack(out, t, copy=1))
    elif chain == "decompress":
        dense = runs.decompress(out)
        decompressed(family, src, dense, LIMIT[scheme])
        deterministic(dense, runs.decompress(out, copy=1))
    elif chain == "requantize":
        second = REQUANT[scheme]
        again, res2 = runs.requantize(out, second)
        conservation(family, src, again, res2.notes, res2.ignore)
        deterministic(again, runs.requantize(out, second, copy=1)[0])


# ------------------------------------------------------------------------------------------ 2:4 sparsity


def _sparse_cells():
    for family in FAMILIES:
        for scheme in SPARSE_SCHEMES:
            for chain in SPARSE_CHAINS:
                ci = family == CHAIN_ROW or (ROW[family] in SPARSE_SCHEMES and ROW[family] == scheme) or (scheme, chain) == ("FP8_DYNAMIC", "quantize")
                marks = [] if ci else [pytest.mark.slow]
                yield pytest.param(family, scheme, chain, marks=marks, id=f"{family}-{scheme}-{chain.replace(' ', '')}")
        ci = family == CHAIN_ROW
        yield pytest.param(family, "W4A16", "quantize --target marlin-24", marks=[] if ci else [pytest.mark.slow], id=f"{family}-W4A16-marlin24")


@pytest.mark.parametrize("family, scheme, chain", list(_sparse_cells()))
def test_conservation_sparse24(runs, family, scheme, chain):
    src = runs.source(family)
    if chain == "quantize --target marlin-24":
        out, res = runs.quantize(family, scheme, target="marlin-24", sparsity="2:4")
        conservation(family, src, out, res.notes, res.ignore)
        decompressed(family, src, runs.decompress(out), LIMIT[scheme], pruned=True)
        deterministic(out, runs.quantize(family, scheme, target="marlin-24", sparsity="2:4", copy=1)[0])
        return
    out, res = runs.quantize(family, scheme, sparsity="2:4")
    if chain == "quantize":
        conservation(family, src, out, res.notes, res.ignore)
        deterministic(out, runs.quantize(family, scheme, sparsity="2:4", copy=1)[0])
    elif chain == "decompress":
        dense = runs.decompress(out)
        decompressed(family, src, dense, LIMIT.get(scheme, 0.0), pruned=True)
        deterministic(dense, runs.decompress(out, copy=1))
    elif chain.startswith("quantize --target"):
        target = chain.split()[-1]
        direct = runs.quantize(family, scheme, target=target, sparsity="2:4")[0]
        same_checkpoint(direct, runs.repack(out, target))
        deterministic(direct, runs.quantize(family, scheme, target=target, sparsity="2:4", copy=1)[0])
    else:
        target = chain.split()[1]
        if target not in SPARSE_TARGETS[scheme]:
            with pytest.raises(UnsupportedError):
                runs.repack(out, target)
            return
        native = runs.repack(out, target)
        same_checkpoint(runs.repack(native, "compressed-tensors"), out)
        deterministic(native, runs.repack(out, target, copy=1))


# ------------------------------------------------------------------------------------------ other tools' formats


def _dequant_fp8_block(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Hugging Face FP8 block -> fp32 (``weight_scale_inv`` per 128x128 block), computed here."""
    n, k = q.shape
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return q.float() * full


def _foreign(runs, kind: str):
    """(path, the source's tensors with every quantized weight as its dense value, the dense reference dtype)."""

    def build():
        path = runs.root / f"foreign-{kind}"
        if kind == "fp8-block":
            ff.deepseek_checkpoint(path)
            stored = tensors(path)
            view = {n: t for n, t in stored.items() if not n.endswith("weight_scale_inv")}
            for n, t in stored.items():
                if n.endswith("weight_scale_inv"):
                    w = n.removesuffix("_scale_inv")
                    view[w] = _dequant_fp8_block(stored[w], t).to(torch.bfloat16)
            return path, view
        path, refs = {"awq": ff.awq_checkpoint, "gptq": ff.gptq_checkpoint, "modelopt": ff.modelopt_checkpoint}[kind](path)
        stored = tensors(path)
        dtype = torch.bfloat16 if kind == "modelopt" else torch.float16
        view = {n: t for n, t in stored.items() if n.rpartition(".")[0] not in refs}
        view.update({f"{m}.weight": w.to(dtype) for m, w in refs.items()})
        return path, view

    return runs._once(("foreign", kind), build)


FOREIGN = ["awq", "gptq", "modelopt", "fp8-block"]
FOREIGN_CHAINS = ["convert", "convert + decompress", "decompress", "requantize", "requantize + repack"]


def _foreign_cells():
    for kind in FOREIGN:
        for chain in FOREIGN_CHAINS:
            if kind == "fp8-block" and chain.startswith("convert"):
                continue  # no lossless target: quantize requantizes it (the requantize chain)
            yield pytest.param(kind, chain, id=f"{kind}-{chain.replace(' ', '')}")


@pytest.mark.parametrize("kind, chain", list(_foreign_cells()))
def test_conservation_foreign(runs, kind, chain):
    """``convert`` of another tool's checkpoint: conserved, and its values are the format's own, bit for bit."""
    path, view = _foreign(runs, kind)
    if chain == "convert":
        out, res = runs.convert(path)
        conservation("llama", tensors(path), out, res.notes, res.ignore)
        deterministic(out, runs.convert(path, copy=1)[0])
    elif chain == "convert + decompress":
        out = runs.convert(path)[0]
        decompressed("llama", view, runs.decompress(out), 0.0)
        same_checkpoint(runs.decompress(out), runs.decompress(path))
    elif chain == "decompress":
        dense = runs.decompress(path)
        decompressed("llama", view, dense, 0.0)
        deterministic(dense, runs.decompress(path, copy=1))
    elif chain == "requantize + repack":  # the MTP layer (fp8-block) and every dense tensor there and back
        again = runs.requantize(path, "W4A16" if kind in ("gptq", "modelopt") else "NVFP4A16")[0]
        same_checkpoint(runs.repack(runs.repack(again, "marlin"), "compressed-tensors"), again)
    else:
        second = "W4A16" if kind in ("gptq", "modelopt") else "NVFP4A16"  # the MLA shapes of fp8-block: K = 192
        again, res = runs.requantize(path, second)
        conservation("llama", view, again, res.notes, res.ignore)
        deterministic(again, runs.requantize(path, second, copy=1)[0])


# ------------------------------------------------------------------------------------------ the checks can fail


def _corrupt(path, how: str) -> None:
    from safetensors.torch import save_file

    (shard,) = path.glob("*.safetensors")
    t = load_file(str(shard))
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    if how == "bias left out":
        del t["model.layers.0.self_attn.q_proj.bias"]
    elif how == "unexplained tensor":
        t["model.layers.0.mlp.extra"] = torch.zeros(4)
    elif how == "copy changed":
        t["model.norm.weight"] = t["model.norm.weight"].clone()
        t["model.norm.weight"].view(torch.int16)[3] ^= 1
    elif how == "quantized module ignored":
        qc["ignore"] = [*qc["ignore"], "model.layers.1.mlp.up_proj"]
    elif how == "dense Linear not ignored":
        qc["ignore"] = [p for p in qc["ignore"] if p != "lm_head"]
    elif how == "scale changed":
        t["model.layers.1.mlp.down_proj.weight_scale"] = t["model.layers.1.mlp.down_proj.weight_scale"] * 2
    save_file(t, str(shard), metadata={"format": "pt"})
    if how in ("bias left out", "unexplained tensor"):
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: shard.name for n in t}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "how, message",
    [
        ("bias left out", "source tensor model.layers.0.self_attn.q_proj.bias left out of the output without a note"),
        ("unexplained tensor", "output tensor model.layers.0.mlp.extra that neither the source nor the config explains"),
        ("copy changed", "model.norm.weight: not quantized, yet not the source's bytes"),
        ("quantized module ignored", "model.layers.1.mlp.up_proj: quantized, but listed in ignore"),
        ("dense Linear not ignored", "lm_head: a dense 2-D weight the config's Linear target takes, not in ignore"),
        ("scale changed", "1 tensors differ: ['model.layers.1.mlp.down_proj.weight_scale']"),
    ],
)
def test_the_checks_fail_on_a_wrong_output(runs, tmp_path, how, message):
    """Each check of the matrix, on a Qwen2 W4A16 output with one defect: it fails, naming the tensor."""
    out, res = runs.quantize("qwen2", "W4A16")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    conservation("qwen2", runs.source("qwen2"), bad)  # a copy passes
    _corrupt(bad, how)
    with pytest.raises(AssertionError, match=re.escape(message)):
        if how == "scale changed":
            same_checkpoint(bad, out)
        else:
            conservation("qwen2", runs.source("qwen2"), bad)
