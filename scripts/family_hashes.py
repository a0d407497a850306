"""Hash the outputs of a fixed set of conversions of every family the tests build, to compare two versions of
ctconvert byte for byte (the companion of ``scripts/output_hashes.sh``, which uses one large Llama).

    python3 scripts/family_hashes.py CODE_DIR [--work DIR] > hashes.txt

CODE_DIR: a checkout whose ``ctconvert/`` is imported. The source checkpoints are built by this checkout's
test builders (``tests/test_conservation.py``, ``tests/foreign_formats.py``: transformers' own classes, fixed
seeds) into ``--work``/src once and reused, so two versions read the same bytes. Every family goes through
data-free and calibrated schemes, ``--target``, ``repack``, ``decompress`` and requantize; the Llama also
through 2:4 and marlin-24; the foreign formats through ``convert`` and requantize; every dry run's plan
(``to_dict()`` without its timings) is hashed too. Prints ``== NAME ok|ERROR`` then ``file sha256`` per file
(the provenance without its source path). Compare two runs with diff.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


WORK = "<work>"  # the --work folder, as every path under it is written in the hashed texts (two runs use two folders)


def _hash_tree(path: Path, work: str) -> list[str]:
    lines = []
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path)
        if f.name == "ctconvert-provenance.json":
            d = json.loads(f.read_text().replace(work, WORK))
            d.pop("source", None)
            digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
        elif f.suffix in (".json", ".md", ".txt"):
            digest = hashlib.sha256(f.read_text().replace(work, WORK).encode()).hexdigest()
        else:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
        lines.append(f"{rel} {digest}")
    return lines


def _plan_digest(result, work: str) -> str:
    d = result.to_dict()
    for k in ("seconds", "output", "source"):
        d.pop(k, None)
    if isinstance(d.get("calibration"), dict):
        d["calibration"].pop("seconds", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).replace(work, WORK).encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("code")
    ap.add_argument("--work", default="/tmp/famhash")
    a = ap.parse_args()
    sys.path[:0] = [str(Path(a.code).resolve()), str(HERE / "tests")]
    warnings.filterwarnings("ignore")
    import foreign_formats as ff
    import test_conservation as tc
    import torch

    from ctconvert import api

    work = Path(a.work).resolve()
    src_root = work / "src"
    src_root.mkdir(parents=True, exist_ok=True)
    runs = tc.Runs(src_root)  # its source() builds each family once (fixed seed) into src_root
    cal = runs.calibration
    out_root = work / "out"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir(parents=True)

    def source(family: str) -> Path:
        path = src_root / f"src-{family}"
        if not (path / "config.json").exists():
            torch.manual_seed(0)
            return runs.source(family)
        return path

    def foreign(kind: str) -> Path:
        path = src_root / f"foreign-{kind}"
        if not (path / "config.json").exists():
            {"awq": ff.awq_checkpoint, "gptq": ff.gptq_checkpoint, "modelopt": ff.modelopt_checkpoint, "fp8-block": ff.deepseek_checkpoint}[kind](path)
        return path

    def run(name: str, fn) -> Path | None:
        out = out_root / name.replace("/", "_").replace(" ", "_")
        try:
            res = fn(out)
        except Exception as e:  # noqa: BLE001 - a failure is part of the record
            print(f"== {name} ERROR {type(e).__name__}: {str(e).replace(str(work), WORK).splitlines()[0][:200]}")
            return None
        print(f"== {name} ok")
        if res is not None and hasattr(res, "to_dict") and getattr(res, "dry_run", False):
            print(f"plan {_plan_digest(res, str(work))}")
        if out.exists():
            print("\n".join(_hash_tree(out, str(work))))
        return out

    for family in tc.FAMILIES:
        src = source(family)
        for scheme in ("W4A16", "NVFP4A16", "FP8_DYNAMIC", "MXFP4A16"):
            run(f"{family}/{scheme}", lambda o, s=scheme: api.quantize(src, o, s))
        run(f"{family}/NVFP4-dry", lambda o: api.quantize(src, o, "NVFP4", dry_run=True, **cal))
        run(f"{family}/W4A16-dry-target", lambda o: api.quantize(src, o, "W4A16", dry_run=True, target="marlin"))
        run(f"{family}/NVFP4", lambda o: api.quantize(src, o, "NVFP4", **cal))
        run(f"{family}/FP8-kv", lambda o: api.quantize(src, o, "FP8", kv_cache="fp8", **cal))
        run(f"{family}/W4A16-marlin", lambda o: api.quantize(src, o, "W4A16", target="marlin"))
        run(f"{family}/NVFP4-cutlass", lambda o: api.quantize(src, o, "NVFP4", target="cutlass-nvfp4", **cal))
        w4 = out_root / f"{family}_W4A16"
        if w4.exists():
            run(f"{family}/repack-W4A16-back", lambda o: api.repack(out_root / f"{family}_W4A16-marlin", o, "compressed-tensors", device="cpu"))
            run(f"{family}/repack-W4A16", lambda o: api.repack(w4, o, "marlin", device="cpu"))
            run(f"{family}/decompress-W4A16", lambda o: api.decompress(w4, o))
            run(f"{family}/requantize-W4A16-NVFP4A16", lambda o: api.quantize(w4, o, "NVFP4A16"))
    llama = source("llama")
    for scheme in ("DENSE", "FP8_DYNAMIC", "W8A8"):
        run(f"llama/2:4-{scheme}", lambda o, s=scheme: api.quantize(llama, o, s, sparsity="2:4"))
    run("llama/marlin-24", lambda o: api.quantize(llama, o, "W4A16", sparsity="2:4", target="marlin-24", skip_incompatible=True))
    run("llama/2:4-cutlass", lambda o: api.quantize(llama, o, "FP8_DYNAMIC", sparsity="2:4", target="cutlass-2of4"))
    sp = out_root / "llama_2:4-FP8_DYNAMIC"
    if sp.exists():
        run("llama/2:4-decompress", lambda o: api.decompress(sp, o))
    for kind in ("awq", "gptq", "modelopt", "fp8-block"):
        path = foreign(kind)
        if kind != "fp8-block":
            run(f"{kind}/convert", lambda o, p=path: api.convert(p, o))
            run(f"{kind}/convert-dry", lambda o, p=path: api.convert(p, o, dry_run=True))
        own = {"awq": "W4A16_ASYM", "gptq": "W4A16", "modelopt": "NVFP4"}.get(kind, "FP8_BLOCK")
        run(f"{kind}/quantize-own", lambda o, p=path, s=own: api.quantize(p, o, s))
        run(f"{kind}/requantize", lambda o, p=path, k=kind: api.quantize(p, o, "W4A16" if k in ("gptq", "modelopt") else "NVFP4A16"))
        run(f"{kind}/decompress", lambda o, p=path: api.decompress(p, o))


if __name__ == "__main__":
    main()
