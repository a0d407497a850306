#!/usr/bin/env python3
"""Make tests/data/vllm_accept_033.json: vLLM 0.33's own loader as the judge of every family x scheme the tests build.

Run from the repository root with the project's interpreter (torch, transformers, this tree's ctconvert); vLLM is
only ever imported by the venv given with ``--vllm-python`` (kept outside the project and out of CI,
../shared/tools/README.md):

    PYTHONPATH=. python3 scripts/vllm_accept_matrix.py --vllm-python ~/venv-vllm/bin/python \\
        --accept /work/shared/tools/vllm_accept.py --out tests/data/vllm_accept_033.json [--jobs 2] [--families a,b]

For each family it builds the tiny checkpoint with transformers' own classes (the builders of
tests/test_moe_families.py and the shapes of the other family tests, saved with ``save_pretrained``), converts it
with this tree's ``ctconvert quantize`` for each scheme (NVFP4 calibrated on a fixed token batch) and each recipe of
:data:`RECIPES` (``--recipe``: several schemes in one output, for the families it lists), and runs
``vllm_accept.py`` on every output: sm_90 for all, sm_100 as well for NVFP4 (W4A4). One vLLM process per
capability runs all its checkpoints one after another (vLLM's import is most of the time; a run after the first
takes a second). The record has, per family,
scheme and capability, the verdict (``ACCEPT``, ``REJECT``, ``not buildable on CPU`` where vLLM cannot build the
architecture without a GPU, ``convert failed``) and the first problem; ``notes`` say what was checked by reading
vLLM's model file where it cannot build. ``--readme README.md`` rewrites the README's table from the record
(tests/test_vllm_record.py checks that the two agree).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ["FP8_DYNAMIC", "W4A16", "NVFP4A16", "NVFP4", "MXFP4A16"]
CAPABILITIES = {"NVFP4": [90, 100]}  # every other scheme: [90]
#: llm-compressor recipes (``--recipe``) recorded as a "scheme" of the families listed: several schemes in one output
RECIPES = {"recipe:mixed_w4a16_fp8": ("tests/data/recipes/mixed_w4a16_fp8.yaml", ["llama"])}
FAMILIES = [
    "llama",
    "qwen2",
    "qwen3_moe",
    "qwen3_moe_fused",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "gemma4",
    "llama4",
    "qwen2_5_vl",
    "llava",
    "glm4_moe_mtp",
    "deepseek_v32",
    "glm_moe_dsa",
]
#: families whose architecture vLLM 0.33 cannot build on a CPU machine, and what was read in its model file instead
NOT_BUILDABLE = {
    "deepseek_v3": (
        "MLA attention: no MLA backend builds without a GPU (vllm_accept's model stage). Read instead: vLLM 0.33 "
        "deepseek_v2.py DeepseekV2ForCausalLM.load_weights stacks q_a_proj + kv_a_proj_with_mqa into fused_qkv_a_proj "
        "(one scheme: ctconvert's fused set) and gate_proj/up_proj into gate_up_proj; experts through "
        "fused_moe_make_expert_params_mapping(gate_proj, down_proj, up_proj): the per-expert names ctconvert writes; "
        "deepseek_mtp.py builds eh_proj as a torch nn.Linear and shared_head.head as a ParallelLMHead named <layer>.head "
        "(both kept dense by ctconvert, also with --quantize-mtp)"
    ),
    "llama4": (
        "vLLM 0.33 builds Llama4ForConditionalGeneration only with a GPU (vllm_accept's model stage stops at a CUDA call; "
        "its scheme probe finds a scheme for every Linear of the checkpoint). Read instead: llama4.py Llama4Model.load_weights "
        "maps the per-expert feed_forward.experts.{e}.gate_proj/up_proj/down_proj ctconvert writes through "
        "fused_moe_make_expert_params_mapping(ckpt_gate_proj_name='gate_proj', 'down_proj', 'up_proj') (fused=False in "
        "load_moe_expert_weights); mllama4.py keeps the vision model and projector under the names ctconvert lists in ignore"
    ),
    "glm4_moe_mtp": (
        "vLLM 0.33 builds Glm4MoeForCausalLM (and its MTP draft, glm4_moe_mtp.py Glm4MoeMTP) only with a GPU (the model "
        "stage stops at a CUDA call). Read instead: glm4_moe.py load_weights maps the per-expert gate_proj/up_proj/down_proj "
        "through the fused-MoE expert mapping and skips the MTP layer (get_spec_layer_idx_from_weight_name); "
        "Glm4MoeMultiTokenPredictorLayer builds eh_proj as a torch nn.Linear and "
        "SharedHead.head as a ParallelLMHead named <layer>.head (ctconvert keeps both dense with --quantize-mtp), "
        "and the decoder block with the model's quantization config under the checkpoint's names"
    ),
    "deepseek_v32": (
        "DeepSeek sparse attention (the indexer): no backend builds without a GPU (vllm_accept's model stage). Read instead: "
        "vLLM 0.33 models/deepseek_v32/attention.py Indexer builds wq_b with the model's quantization config and fuses wk and "
        "weights_proj into wk_weights_proj, a MergedColumnParallelLinear with quant_config=None (nvidia/model.py load_weights "
        "stacks wk as shard 0, weights_proj as shard 1; deepseek_v2.py _try_load_fp8_indexer_wk dequantizes an FP8 wk with "
        "its weight_scale): ctconvert keeps both dense, lists them in ignore, and refuses a target naming them; the MLA, "
        "router and expert names are DeepSeek-V3's (see deepseek_v3)"
    ),
    "glm_moe_dsa": (
        "GLM-5 (GlmMoeDsaForCausalLM) is built by vLLM 0.33 from models/deepseek_v32 (registry.py), with the same Indexer: "
        "no backend builds it without a GPU. Read instead: as deepseek_v32 (wk and weights_proj fused into an unquantized "
        "wk_weights_proj, kept dense by ctconvert; wq_b quantized)"
    ),
}


# -- building (project interpreter) -----------------------------------------------------------


def _builders():
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import test_moe_families as t
    import torch
    import transformers

    from helpers import randomized

    text = dict(t.TEXT)

    def llama():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**text))

    def qwen2():
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text))

    def llava():
        tc = transformers.LlamaConfig(**text)
        vc = transformers.CLIPVisionConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_hidden_layers=2, image_size=32, patch_size=8)
        cfg = transformers.LlavaConfig(text_config=tc, vision_config=vc, image_token_id=250, projector_hidden_act="gelu")
        return transformers.LlavaForConditionalGeneration(cfg)

    def glm4_moe():
        cfg = transformers.Glm4MoeConfig(
            **{**text, "num_hidden_layers": 3},
            moe_intermediate_size=t.I,
            n_routed_experts=t.E,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
        return transformers.Glm4MoeForCausalLM(cfg)

    def dsa(config_class, **extra):
        def make():
            mla = dict(q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)
            moe = dict(moe_intermediate_size=t.I, n_routed_experts=t.E, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
            moe.update(n_group=1, topk_group=1, topk_method="noaux_tc")
            dsa = dict(index_topk=16, index_head_dim=64, index_n_heads=2)
            cfg = getattr(transformers, config_class)(**{**text, "num_key_value_heads": 2}, **moe, **mla, **dsa, **extra)
            return transformers.AutoModelForCausalLM.from_config(cfg)

        return make

    return (
        torch,
        randomized,
        {
            "llama": llama,
            "qwen2": qwen2,
            "qwen3_moe": t._qwen3_moe,
            "qwen3_moe_fused": t._qwen3_moe,
            "mixtral": t._mixtral,
            "deepseek_v3": t._deepseek_v3,
            "gpt_oss": t._gpt_oss,
            "gemma4": t._gemma4,
            "llama4": t._llama4,
            "qwen2_5_vl": t._qwen2_5_vl,
            "llava": llava,
            "glm4_moe_mtp": glm4_moe,
            "deepseek_v32": dsa("DeepseekV32Config"),
            "glm_moe_dsa": dsa("GlmMoeDsaConfig", indexer_types=["full", "full"]),
        },
    )


def build(family: str, path: Path) -> None:
    """The family's tiny checkpoint, saved by transformers (with the names the Hub ships where they differ)."""
    torch, randomized, builders = _builders()
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = randomized(builders[family]().to(torch.bfloat16))
    model.save_pretrained(str(path), save_original_format=family != "qwen3_moe_fused")
    if family == "llava":  # Hub LLaVA checkpoints store the CLIP tower as vision_tower.vision_model.* (vLLM maps those)
        _rename(path, load_file, save_file, lambda n: n.replace("vision_tower.", "vision_tower.vision_model.", 1) if n.startswith("vision_tower.") else n)
    if family == "glm4_moe_mtp":  # layer 2 of 3 becomes the MTP layer of a 2-layer model, with GLM-4.5's MTP tensors
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(num_hidden_layers=2, num_nextn_predict_layers=1)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        g = torch.Generator().manual_seed(1)
        h, v = cfg["hidden_size"], cfg["vocab_size"]
        extra = {
            "model.layers.2.enorm.weight": torch.ones(h),
            "model.layers.2.hnorm.weight": torch.ones(h),
            "model.layers.2.eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.05,
            "model.layers.2.shared_head.norm.weight": torch.ones(h),
            "model.layers.2.shared_head.head.weight": torch.randn(v, h, generator=g) * 0.05,
        }
        f = next(path.glob("*.safetensors"))
        tensors = load_file(str(f))
        tensors.update({k: x.to(torch.bfloat16) for k, x in extra.items()})
        save_file(tensors, str(f), metadata={"format": "pt"})
        _reindex(path)


def _rename(path, load_file, save_file, fn):
    for f in path.glob("*.safetensors"):
        save_file({fn(k): x for k, x in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    _reindex(path)


def _reindex(path: Path) -> None:
    idx = path / "model.safetensors.index.json"
    if idx.exists():  # one shard at these sizes; drop a stale index rather than rewrite it
        idx.unlink()


def convert(src: Path, out: Path, scheme: str, ids: Path) -> str | None:
    """``ctconvert quantize`` of this tree; None, or the error line."""
    how = ["--recipe", str(ROOT / RECIPES[scheme][0])] if scheme in RECIPES else ["-s", scheme]
    args = [sys.executable, "-m", "ctconvert", "quantize", str(src), *how, "-o", str(out)]
    if scheme == "NVFP4":
        args += ["--calibration", str(ids), "--calibration-samples", "4", "--calibration-seq-len", "64"]
    if "mtp" in src.parent.name:
        args.append("--quantize-mtp")
    r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode:
        return (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1].replace(str(src.parent.parent), "<work>")[:300]
    return None


# -- judging (the vLLM venv's interpreter) ------------------------------------------------------


def worker(accept: str, jobs: list[dict]) -> None:
    """Run vllm_accept.main on each job in this process (one capability per process), writing its JSON report."""
    sys.path.insert(0, os.path.dirname(accept))
    import vllm_accept

    for job in jobs:
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                rc = vllm_accept.main([job["ckpt"], "--capability", str(job["cap"]), "--json", job["json"]])
        except BaseException as e:  # noqa: BLE001 - a crash of one run is that run's verdict
            rc = f"crashed: {type(e).__name__}: {e}"
        Path(job["log"]).write_text(buf.getvalue() + f"\nrc={rc}\n")
        try:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001
            pass


def _first_problem(report: dict) -> str | None:
    for name, st in report.get("stages", {}).items():
        if not st["ok"]:
            return f"{name} stage: {st['msg']}"[:300]
    for m in report.get("modules", []):
        if m.get("problems"):
            return f"{m.get('name')}: {m['problems'][0]}"[:300]
    if report.get("other_problems"):
        return str(report["other_problems"][0])[:300]
    return None


def verdict(family: str, report: dict | None, log: str) -> tuple[str, str | None]:
    if report is None:
        return "REJECT", (log.strip().splitlines() or ["no report"])[-1][:300]
    if report.get("accepted"):
        return "ACCEPT", None
    first = _first_problem(report)
    model = report.get("stages", {}).get("model")
    if family in NOT_BUILDABLE and model is not None and not model["ok"]:
        return "not buildable on CPU", first
    return "REJECT", first


# -- README ----------------------------------------------------------------------------------

MARK = ("<!-- vllm-accept-033: generated by scripts/vllm_accept_matrix.py from tests/data/vllm_accept_033.json -->", "<!-- /vllm-accept-033 -->")
_SHORT = {"ACCEPT": "✓", "REJECT": "✗", "not buildable on CPU": "not buildable on CPU", "convert failed": "convert failed"}


def readme_table(record: dict) -> str:
    """The README's family table column "vLLM 0.33 loads", one row per family, from the record."""
    rows = ["| family | vLLM 0.33 loads (sm_90; NVFP4 also sm_100) |", "|---|---|"]
    by = {}
    for r in record["results"]:
        by.setdefault(r["family"], {}).setdefault(r["scheme"], {})[r["capability"]] = r["verdict"]
    for fam in [f for f in FAMILIES if f in by]:
        cells = []
        for s in SCHEMES + [k for k in RECIPES if k in by[fam]]:
            caps = by[fam].get(s, {})
            cells.append(f"{s} " + " / ".join(f"{_SHORT[v]}" + (f" (sm_{c})" if len(caps) > 1 else "") for c, v in sorted(caps.items())))
        rows.append(f"| {fam} | {' · '.join(cells)} |")
    return "\n".join([MARK[0], *rows, MARK[1]])


def write_readme(readme: Path, record: dict) -> None:
    text = readme.read_text()
    start, end = text.index(MARK[0]), text.index(MARK[1]) + len(MARK[1])
    readme.write_text(text[:start] + readme_table(record) + text[end:])


# -- driver ------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default=os.path.expanduser("~/venv-vllm/bin/python"))
    ap.add_argument("--accept", default="/work/shared/tools/vllm_accept.py")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "vllm_accept_033.json"))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--schemes", default=",".join([*SCHEMES, *RECIPES]))
    ap.add_argument("--jobs", type=int, default=2, help="vLLM processes at a time")
    ap.add_argument("--work", help="folder for checkpoints and logs (default: a temporary one)")
    ap.add_argument("--readme", help="rewrite this README's table from the record")
    ap.add_argument("--update", action="store_true", help="keep the --out record's rows of the families and schemes not run now")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.accept, json.loads(Path(args.worker).read_text()))
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    families, schemes = args.families.split(","), args.schemes.split(",")
    ids = work / "ids.json"
    ids.write_text(json.dumps([[(7 * i + 13 * j) % 250 for j in range(64)] for i in range(4)]))
    t0 = time.time()
    results, groups = [], {}
    for fam in families:
        src = work / fam / "src"
        if not (src / "config.json").exists():
            src.mkdir(parents=True, exist_ok=True)
            build(fam, src)
        for s in schemes:
            if s in RECIPES and fam not in RECIPES[s][1]:
                continue
            out = work / fam / s
            err = None if (out / "config.json").exists() else convert(src, out, s, ids)
            for cap in CAPABILITIES.get(s, [90]):
                row = {"family": fam, "scheme": s, "capability": cap}
                if err is not None:
                    results.append({**row, "verdict": "convert failed", "first_problem": err})
                    continue
                job = {"ckpt": str(out), "cap": cap, "json": str(work / fam / f"{s}.sm{cap}.json"), "log": str(work / fam / f"{s}.sm{cap}.log")}
                groups.setdefault(cap, []).append((row, job))
        print(f"[{time.time() - t0:6.0f}s] built and converted {fam}", flush=True)

    def judge(cap):
        spec = work / f"jobs-sm{cap}.json"
        spec.write_text(json.dumps([j for _, j in groups[cap]]))
        subprocess.run([args.vllm_python, __file__, "--worker", str(spec), "--accept", args.accept], capture_output=True)
        print(f"[{time.time() - t0:6.0f}s] judged {len(groups[cap])} checkpoints at sm_{cap}", flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(judge, list(groups)))
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True).stdout.strip()
    for items in groups.values():
        for row, job in items:
            rep = json.loads(Path(job["json"]).read_text()) if Path(job["json"]).exists() else None
            log = Path(job["log"]).read_text() if Path(job["log"]).exists() else "no log"
            v, first = verdict(row["family"], rep, log)
            results.append({**row, "verdict": v, "first_problem": first})
    if args.update and Path(args.out).exists():
        ran = {(r["family"], r["scheme"]) for r in results}
        results += [r for r in json.loads(Path(args.out).read_text())["results"] if (r["family"], r["scheme"]) not in ran]
        families = [f for f in FAMILIES if f in {r["family"] for r in results}]
    order = {f: i for i, f in enumerate(FAMILIES)}
    for r in results:
        r["capability"] = int(r["capability"])
    results.sort(key=lambda r: (order.get(r["family"], 99), [*SCHEMES, *RECIPES].index(r["scheme"]), r["capability"]))
    record = {
        "vllm": version,
        "tool": "../shared/tools/vllm_accept.py (vLLM's config parse, scheme choice, create_weights, load_weights, coverage, layout; no kernels)",
        "made_by": "scripts/vllm_accept_matrix.py",
        "results": [{**r, "vllm": r.get("vllm", version)} for r in results],
        "notes": {f: NOT_BUILDABLE[f] for f in families if f in NOT_BUILDABLE},
    }
    Path(args.out).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    if args.readme:
        write_readme(Path(args.readme), record)
    print(
        f"[{time.time() - t0:6.0f}s] wrote {args.out}: "
        + ", ".join(f"{k}: {sum(r['verdict'] == k for r in results)}" for k in sorted({r["verdict"] for r in results}))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
