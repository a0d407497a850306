"""Small helpers shared by the tests."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from functools import cache
from pathlib import Path

import torch

from ctconvert import cbuild

#: the integer dtype of each element size, to compare or rebuild tensors bit for bit
INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: devices for device-parametrized tests: the CPU, and CUDA when present
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def stable_seed(*parts) -> int:
    """A generator seed from ``parts`` that is the same in every process.

    ``hash()`` of a str (or of a tuple holding one) changes with PYTHONHASHSEED, so a
    failure seeded from it cannot be reproduced; crc32 of the parts' ``repr`` can.
    """
    return zlib.crc32(repr(parts).encode())


def tree_hash(path: Path, skip: tuple[str, ...] = ()) -> str:
    """sha256 over every file (relative name and bytes) under ``path``, except names in ``skip``."""
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file() and p.name not in skip:
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns, on the CPU, as the integer dtype of its element size."""
    return t.detach().cpu().contiguous().view(INT_BY_SIZE[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(bits(a.reshape(-1)), bits(b.reshape(-1)))


#: the kernel-layout reference vectors (a copy of shared/testvectors; $CTCONVERT_TESTVECTORS overrides)
VECTORS = Path(os.environ.get("CTCONVERT_TESTVECTORS") or Path(__file__).resolve().parent / "data" / "testvectors")


@cache
def vector_cases(name: str) -> tuple:
    """Every case of a vector file as ``(i, params, inputs, expected)``; empty when the file is absent."""
    path = VECTORS / name
    if not path.is_file():
        return ()
    from safetensors import safe_open

    out = []
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        for i in range(json.loads(meta["file"])["num_cases"]):
            p = json.loads(meta[f"case{i}"])
            ins = {n: f.get_tensor(f"case{i}.input.{n}") for n in p["inputs"]}
            exp = {n: f.get_tensor(f"case{i}.expected.{n}") for n in p["expected"]}
            out.append((i, p, ins, exp))
    return tuple(out)


def case_on(cases, idx: int, device: str) -> tuple:
    """Case ``idx`` of ``cases`` (from :func:`vector_cases`) as ``(i, params, inputs, expected)``, its inputs moved to ``device``."""
    i, p, ins, exp = cases[idx]
    return i, p, {k: v.to(device) for k, v in ins.items()}, exp


def randomized(model):
    """``model`` with every 2-D-or-more parameter drawn from N(0, 0.05) (seed 0), in place: the tiny transformers
    models of the family and calibration tests, with weights that are not the library's init."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def save_tiny(make, src: Path) -> Path:
    """A tiny checkpoint saved by transformers' own class: ``make()`` (the model, built after ``torch.manual_seed(0)``)
    in bf16, :func:`randomized`, written to ``src`` by ``save_pretrained``; returns ``src``."""
    torch.manual_seed(0)
    randomized(make().to(torch.bfloat16)).save_pretrained(str(src))
    return src


def scalar_build(monkeypatch, tmp_path: Path, src, signatures, stem: str):
    """A native library (``src`` with its ``signatures``, as ``cbuild.Library`` takes them) built without the vector
    flags (``-m...``: AVX2/F16C/FMA/AVX-512, another CPU) into ``tmp_path`` (the cache), for the rest of the test;
    asserts that it built (``STEM-*.so`` is there) and returns it."""
    plain = [f for f in cbuild.flags() if not f.startswith("-m")]
    monkeypatch.setattr(cbuild, "flags", lambda: plain)
    monkeypatch.setenv("CTCONVERT_CACHE", str(tmp_path))
    lib = cbuild.Library(src, signatures)
    assert lib.get() is not None and list(tmp_path.glob(f"{stem}-*.so"))
    return lib


class RecordingBar:
    """A progress bar for the API's ``progress`` factories that records every ``update(n)`` in ``log``."""

    def __init__(self, log: list, total=None):
        self.log, self.total = log, total

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.log.append(n)


def llama_around(linear: dict[str, torch.Tensor], dtype: torch.dtype, vocab: int, hidden: int, **config) -> tuple[dict[str, torch.Tensor], dict]:
    """A Llama checkpoint around the Linear weights ``linear`` (``model.layers.N.*.weight``): zero embeddings and
    ``lm_head``, unit norms for every layer the weights name; and its ``config.json`` (``config`` amends it: heads,
    ``head_dim`` ...). For tests that feed reference weights (another tool's source tensors) through a whole run."""
    t = dict(linear)
    layers = 1 + max(int(n.split(".")[2]) for n in linear)
    t["model.embed_tokens.weight"] = torch.zeros(vocab, hidden, dtype=dtype)
    t["lm_head.weight"] = torch.zeros(vocab, hidden, dtype=dtype)
    t["model.norm.weight"] = torch.ones(hidden, dtype=dtype)
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 256,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
        **config,
    }
    return t, cfg


def assert_reference_tensors(reference: Path, prefix: str, out: Path) -> list[str]:
    """Every tensor of the safetensors file ``reference`` under ``prefix`` is in ``out/model.safetensors`` (without
    the prefix), with its dtype, shape and bytes; the output's names of those tensors."""
    from safetensors import safe_open

    with safe_open(str(reference), "pt") as ref, safe_open(str(out / "model.safetensors"), "pt") as got:
        keys = [k for k in ref.keys() if k.startswith(prefix)]
        assert keys, f"no reference tensor under {prefix!r}"
        for key in keys:
            a, b = ref.get_tensor(key), got.get_tensor(key[len(prefix) :])
            assert a.dtype == b.dtype and a.shape == b.shape and bitwise_equal(a, b), key
        return [k[len(prefix) :] for k in keys]
