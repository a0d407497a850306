"""An output's ``config.json`` and other files against the reference it was made from, and the config's attention shapes.

What ``verify`` checks beyond the tensors (:mod:`ctconvert.commands.verify` calls it). Like the tensor checks it reads
the two folders and nothing else, never the writer's plan or code: what the output should hold is computed here from
the reference and the rules the README states, each listed below with its reason.

- ``config.json`` (:func:`config_problems`): every key of the reference's config is in the output's with the same
  value, and the output adds no key, except what a conversion changes (:data:`CONFIG_RULES`). Nested configs (a
  VLM's ``text_config``) are compared key by key, named with dots (``text_config.rope_theta``).
- Copied files (:func:`copied_file_problems`): every file of the reference but its weights, index and ``config.json``
  is in the output with the same bytes, except those the conversion leaves out or rewrites (:data:`FILE_RULES`).
  A file of the output that the reference lacks and ctconvert does not write is a user's: a warning naming it.
- Attention shapes (:func:`attention_shape_problems`, no reference needed): ``num_key_value_heads * head_dim`` is
  the output rows of every ``k_proj``/``v_proj`` and ``num_attention_heads * head_dim`` those of every ``q_proj``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config_types import head_dim, kv_heads
from .conformance import conforms
from .model_card import CARD, HEADING
from .modules import Module
from .naming import DEFAULT_IGNORE_PATTERNS, decoder_layers_prefix, find_embedding
from .reader import CONFIG_NAME, INDEX_NAME, Checkpoint, Problem
from .widths import dense_dims, tied_head_problems
from .writer import PROVENANCE

__all__ = ["CONFIG_RULES", "FILE_RULES", "attention_shape_problems", "config_problems", "copied_file_problems", "reference_problems"]

#: the keys of ``config.json`` a conversion changes (README wording): key -> reason
CONFIG_RULES = {
    "quantization_config": (
        "quantize and convert write `config.json` with a `quantization_config` in compressed-tensors' own serialization "
        "(added, or replacing a quantized input's own); repack writes the kernel-native one or restores the source's; "
        "decompress writes the dense copy without one (at the top level and in `text_config`)"
    ),
    "torch_dtype": "--dense-dtype: `config.json`'s `torch_dtype` (and `dtype`, where present) names the new dtype; decompress --dtype sets that dtype",
    "dtype": "--dense-dtype: `config.json`'s `torch_dtype` (and `dtype`, where present) names the new dtype; decompress --dtype sets that dtype",
    "tie_word_embeddings": "--lm-head: tied embeddings are untied (both tensors written, `tie_word_embeddings: false`)",
}
#: the dtype names ``--dense-dtype`` and ``decompress --dtype`` write, and the safetensors dtype each names
_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

#: files of the reference a correct output may lack or hold other bytes of (README wording): rule -> reason
FILE_RULES = {
    "weights": "every `*.safetensors` shard and the index are the output's own (their tensors are compared by verify)",
    CONFIG_NAME: "`config.json` is compared key by key (CONFIG_RULES)",
    "other weights": "--keep-other-weights: weights in other formats (`*.bin`, `*.pth`, `*.gguf`, `*.onnx`, `original/` ...) are left out by default",
    "source quantization configs": "`hf_quant_config.json`, `quantize_config.json` and `quant_config.json` of a quantized source are not copied",
    "ctconvert-provenance.json": "each quantize or convert output writes its own provenance (repack and decompress keep their input's)",
    CARD: "the output's copy of the model card gets a short \"Conversion (ctconvert)\" section (appended to the reference's text)",
    "hidden": "hidden files and folders (`.cache/` of a Hub download, `.git/`) are not copied; `.gitattributes` is",
}
_OTHER_WEIGHT_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".onnx_data", ".tflite", ".mlmodel", ".npz")
_OTHER_WEIGHT_FOLDERS = ("original", "onnx", "openvino", "coreml", "tflite", "gguf", "flax")
_SOURCE_CONFIG_FILES = ("hf_quant_config.json", "quantize_config.json", "quant_config.json")
_SHOWN = 80  # characters of a value shown in a message


def reference_problems(ckpt: Checkpoint, ref: Checkpoint) -> list[Problem]:
    """``config.json`` and the copied files of the output ``ckpt`` against the reference ``ref``."""
    return config_problems(ckpt, ref) + copied_file_problems(Path(ckpt.path), Path(ref.path))


# -- config.json ---------------------------------------------------------------------------------


def config_problems(ckpt: Checkpoint, ref: Checkpoint) -> list[Problem]:
    """Every key of the reference's ``config.json`` in the output's with the same value, and no key added, but for
    :data:`CONFIG_RULES`. An untied head (``tie_word_embeddings`` true -> false) must be stored in the output; where
    :func:`.widths.tied_head_problems` already fails that (a generating model), it is said once, there."""
    file, out, untied = str(Path(ckpt.path) / CONFIG_NAME), [], []
    for name, message in _compare(ckpt.config, ref.config, ""):
        if message == "untied":
            untied.append(name)
        else:
            out.append(_error(message, file))
    headless = untied and not any(n.startswith("lm_head.") or ".lm_head." in n for n in ckpt.tensors)
    if headless and not tied_head_problems(ckpt.config, ckpt.tensors):  # (an encoder's, or no embedding found)
        out.append(_error(f"{untied[0]} is false but the output stores no lm_head (the reference ties it): the head would be random", file))
    return out + _dtype_problems(ckpt, ref, file)  # a head tied over a stored lm_head: widths.tied_head_problems, with or without a reference


def _dtype_problems(ckpt: Checkpoint, ref: Checkpoint, file: str) -> list[Problem]:
    """``torch_dtype``/``dtype`` (top level, ``text_config``) must name the dtype of the output's token embedding, the
    dense tensor every conversion copies or casts (``--dense-dtype``, ``decompress --dtype``), wherever the reference's
    names its own (a reference whose config and tensors disagree is copied as it is): a loader's ``dtype="auto"``
    builds the model in the dtype the config names (a new user changed it by hand and verify passed)."""
    e_out, e_ref = find_embedding(ckpt.tensors), find_embedding(ref.tensors)
    if not e_out or not e_ref:
        return []
    have, out = ckpt.tensors[e_out].dtype, []
    for prefix in ("", "text_config."):
        o = ckpt.config.get("text_config") if prefix else ckpt.config
        r = ref.config.get("text_config") if prefix else ref.config
        for key in ("torch_dtype", "dtype") if isinstance(o, dict) and isinstance(r, dict) else ():
            if key in o and _ST_DTYPE.get(r.get(key)) == ref.tensors[e_ref].dtype and _ST_DTYPE.get(o[key]) != have:
                msg = f"config.json's {prefix}{key} is {_short(o[key])}, but the output's dense tensors are {have} ({e_out})"
                out.append(_error(msg, file))
    return out


def _compare(got: dict, want: dict, prefix: str) -> list[tuple[str, str]]:
    """``(dotted key, message)`` for each difference that :data:`CONFIG_RULES` do not explain (message ``"untied"``:
    the head was untied, which the output's tensors must bear out)."""
    found = []
    for key in sorted(set(got) | set(want)):
        name = prefix + key
        if key in got and key in want and _same(got[key], want[key]):
            continue
        allowed = _allowed(key, prefix, got, want)
        if allowed == "untied":
            found.append((name, "untied"))
        elif allowed:
            continue
        elif isinstance(got.get(key), dict) and isinstance(want.get(key), dict):
            found += _compare(got[key], want[key], name + ".")
        else:
            found.append((name, _message(name, got, want, key)))
    return found


def _allowed(key: str, prefix: str, got: dict, want: dict) -> bool | str:
    """Whether :data:`CONFIG_RULES` explain a difference at ``key`` (``"untied"``: the head was untied)."""
    if key == "quantization_config":
        return not prefix or key not in got  # replaced or added at the top level; only removed in a nested config
    if key in ("torch_dtype", "dtype"):
        return got.get(key) in _ST_DTYPE
    if key == "tie_word_embeddings" and got.get(key) is False:
        tied = want.get(key, want.get("text_config", {}).get(key) if isinstance(want.get("text_config"), dict) else None)
        return "untied" if tied is True else False
    return False


def _message(name: str, got: dict, want: dict, key: str) -> str:
    if key not in got:
        return f"config.json lacks {name} (the reference's: {_short(want[key])})"
    if key not in want:
        return f"config.json adds {name}: {_short(got[key])} (not in the reference, and no conversion writes it)"
    return f"config.json's {name} is {_short(got[key])}, the reference's {_short(want[key])}"


def _same(a, b) -> bool:
    return a == b or json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN == NaN


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


# -- the copied files ----------------------------------------------------------------------------


def copied_file_problems(out: Path, ref: Path) -> list[Problem]:
    """Every file of the reference folder ``ref`` that a conversion copies is in ``out`` with the same bytes
    (:data:`FILE_RULES`); files of ``out`` that neither the reference nor ctconvert has are named in a warning."""
    problems = []
    ref_files = _files(ref)
    for rel in ref_files:
        if _own(rel) or _hidden(rel):
            continue
        dest = out / rel
        if not dest.is_file():
            if not (_other_weights(rel) or rel in _SOURCE_CONFIG_FILES):
                problems.append(_error(f"{rel} of the reference is missing from the output (a conversion copies it)", str(dest)))
        elif rel == CARD:
            if not _card_kept(dest, ref / rel):
                problems.append(_error(f"{rel} is not the reference's model card (with the conversion section appended)", str(dest)))
        elif not _same_file(dest, ref / rel):
            problems.append(_error(f"{rel} differs from the reference's (a conversion copies it unchanged)", str(dest)))
    extra = [rel for rel in _files(out) if rel not in ref_files and not _own(rel) and not _hidden(rel)]
    if extra:
        problems.append(Problem("warning", f"files that are not in the reference and that ctconvert does not write: {', '.join(extra)}", str(out)))
    return problems


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _own(rel: str) -> bool:
    """A file every conversion writes itself: shards (top-level safetensors; a subfolder's, a sentence-transformers
    module's, is copied), the index, ``config.json``, the provenance."""
    return (rel.endswith(".safetensors") and len(Path(rel).parts) == 1) or Path(rel).name == INDEX_NAME or rel in (CONFIG_NAME, PROVENANCE)


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") and part != ".gitattributes" for part in Path(rel).parts)


def _other_weights(rel: str) -> bool:
    p = Path(rel)
    return p.suffix.lower() in _OTHER_WEIGHT_SUFFIXES or (len(p.parts) > 1 and p.parts[0].lower() in _OTHER_WEIGHT_FOLDERS)


def _same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while chunk := fa.read(1 << 20):
            if chunk != fb.read(len(chunk)):
                return False
    return True


def _card_kept(got: Path, want: Path) -> bool:
    """The output's card is the reference's, or its text followed by conversion sections."""
    a, b = (p.read_text(encoding="utf-8", errors="replace") for p in (got, want))
    return a == b or a.startswith(b.rstrip("\n") + "\n\n" + HEADING)


# -- attention shapes ------------------------------------------------------------------------------


#: config keys of architectures whose q/k/v rows follow other rules (MLA's LoRA ranks, Gemma 4's global layers,
#: Qwen3-Next's gated query of twice the rows)
_OTHER_ATTENTION = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "global_head_dim", "num_global_key_value_heads", "attn_output_gate")
_OTHER_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


def attention_shape_problems(mods: dict[str, Module], config: dict, tensors: dict) -> list[Problem]:
    """Each ``q_proj``/``k_proj``/``v_proj`` of the language model's decoder layers has the rows its config says:
    ``num_attention_heads * head_dim`` and ``num_key_value_heads * head_dim`` (``head_dim`` from the config, else the
    class's fixed default where transformers 5.20 has one, else ``hidden_size / num_attention_heads``:
    :func:`.config_types.head_dim`). The decoder layers are ``<P>layers.N.`` where ``<P>embed_tokens.weight`` is
    the checkpoint's token embedding (``tensors``: the checkpoint's, by name): towers and resamplers of any naming
    (MiniCPM-V's ``vpm.``, Idefics2's perceiver) are not the text model's and are skipped, as is everything when no
    such embedding is found. Architectures whose rows follow other rules are not checked, nor a quantized module whose
    tensors contradict the ``quantization_config`` (:func:`.conformance.conforms`: its own error is the cause)."""
    stack = decoder_layers_prefix(tensors)
    if stack is None:
        return []
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    mt = cfg.get("model_type") or config.get("model_type")
    heads, (hd, hd_words) = cfg.get("num_attention_heads"), head_dim(cfg, mt)
    if not isinstance(heads, int) or hd is None or any(k in cfg or k in config for k in _OTHER_ATTENTION):
        return []
    if {cfg.get("model_type"), config.get("model_type")} & set(_OTHER_MODEL_TYPES):
        return []
    want = {"q_proj": ("num_attention_heads", heads), "k_proj": kv_heads(cfg, mt, heads)}
    want["v_proj"] = want["k_proj"]
    out, qcfg = [], config["quantization_config"] if isinstance(config.get("quantization_config"), dict) else {}
    for name in sorted(mods):
        parent, _, leaf = name.rpartition(".")
        key, n = want.get(leaf, (None, None))
        if not isinstance(n, int) or not name.startswith(stack) or f"{parent}.kv_a_proj_with_mqa" in mods or not conforms(mods[name], qcfg):
            continue
        if DEFAULT_IGNORE_PATTERNS["vision"].search(name + "."):
            continue
        rows = _rows(mods[name])
        if rows is not None and rows != n * hd:
            how = "" if hd_words == "head_dim" else f" (config.json has no head_dim: {hd_words.partition('absent: ')[2]})"
            if hd_words.startswith("hidden_size"):
                how = f" (config.json has no head_dim: hidden_size {cfg.get('hidden_size')} / num_attention_heads {heads})"
            count = "" if key.endswith(f", {n})") else f" {n}"  # (a class default's words carry its number: kv_heads)
            msg = f"config.json's {key}{count} x head_dim {hd}{how} = {n * hd} output rows, but {leaf} has {rows}"
            out.append(Problem("error", msg, mods[name].file, name))
    return out


def _rows(m: Module) -> int | None:
    """The dense output rows of a module: its dense shape when quantized, else its weight's (:func:`.widths.dense_dims`)."""
    dims = dense_dims(m)
    return None if dims is None else dims[0]


def _error(msg: str, file: str | None = None) -> Problem:
    return Problem("error", msg, file)
