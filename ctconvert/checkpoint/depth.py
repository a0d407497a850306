"""``config.json``'s layer, expert and vision block counts against the tensors a checkpoint stores (``verify``, no reference needed).

A loader builds the model from the config and then fills it from the tensors. vLLM 0.33 builds ``num_hidden_layers``
decoder layers and, in each MoE block, as many experts as the config's expert count
(``vllm/model_executor/models/*.py``: ``make_layers(config.num_hidden_layers, ...)``, ``FusedMoE(num_experts=...)``).
Where the two disagree, the model is refused (a stored layer or expert the model has no parameter for) or runs with
random weights (a layer or expert the model has but no tensor fills). Neither shows in the tensors' values, so
``verify`` compares the counts:

- **Layers** (:func:`layer_count_problems`): the language model's decoder layers are ``<P>layers.N.`` where
  ``<P>embed_tokens.weight`` is the checkpoint's token embedding (as :func:`.files_check.attention_shape_problems`
  finds them; towers and resamplers are not counted). Every index below the config's ``num_hidden_layers`` (the
  ``text_config``'s first) must hold tensors, and none may be past it, but for the MTP layers DeepSeek-V3 and
  GLM-4.5 store after the decoder (``num_nextn_predict_layers`` of them; vLLM 0.33 deepseek_mtp.py
  ``get_spec_layer_idx_from_weight_name``), which an output may hold or leave out.
- **Experts** (:func:`expert_count_problems`): every ``...experts`` module stored one Linear per expert
  (``experts.E.<leaf>``) holds experts ``0 .. n-1`` exactly, and every fused 3-D expert weight
  (``experts.gate_up_proj`` ...) has ``n`` rows in its first dimension, ``n`` being the count vLLM 0.33 builds: the
  key its family's model reads, with transformers 5.20's precedence where ``config.json`` holds it under two names
  (:func:`.expert_count.expert_count`: a Qwen3-MoE's ``num_local_experts`` over its ``num_experts``, a gpt-oss's
  ``num_experts`` over its ``num_local_experts``); for a family :data:`.expert_count.EXPERT_COUNT` does not list, each of
  ``num_experts``, ``num_local_experts`` and ``n_routed_experts`` it holds (``text_config`` first).
- **Vision blocks** (:func:`vision_depth_problems`): the vision tower's block stack, found by the tensor names each
  family's HF checkpoints store (:data:`_TOWERS`, by the config's ``model_type``), holds exactly the blocks vLLM 0.33
  builds from ``n``, ``vision_config``'s ``depth`` (else its ``num_hidden_layers``; transformers maps the one onto
  the other for Qwen's towers through ``attribute_map``): blocks ``0 .. n-1``, but for LLaVA (below):

  - Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE): ``visual.blocks.N.``, or ``model.visual.blocks.N.`` (Qwen3-VL's
    checkpoints, transformers 5's module names); vLLM 0.33 builds ``vision_config.depth`` blocks (qwen2_vl.py
    ``Qwen2VisionTransformer``, qwen2_5_vl.py ``Qwen2_5_VisionTransformer``, qwen3_vl.py
    ``Qwen3_VisionTransformer``, which qwen3_vl_moe.py reuses) and its ``load_weights`` looks every stored name up
    in its parameters: a block past them is refused.
  - Llama-4: ``vision_model.model.layers.N.``; vLLM 0.33 mllama4.py ``Llama4VisionEncoder`` builds
    ``vision_config.num_hidden_layers`` layers, and ``Llama4ForConditionalGeneration.load_weights`` refuses a
    stored layer past them the same way.
  - Gemma-3 (SigLIP): ``vision_tower.vision_model.encoder.layers.N.`` as released, ``model.`` before it in
    transformers 5's module names, and ``vision_tower.encoder.layers.N.`` as transformers 5.25 saves it (its
    ``CLIPVisionModel``/``SiglipVisionModel`` drop the ``vision_model`` level: conversion_mapping.py ``PrefixChange``);
    vLLM 0.33 gemma3_mm.py builds ``SiglipVisionModel(config.vision_config)`` with all
    ``num_hidden_layers``, and siglip.py ``SiglipVisionModel.load_weights`` *skips* a stored layer past the ones it
    built: no refusal, but a tower shallower than the one stored, which is an error all the same.
  - LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video, LLaVA-OneVision (CLIP or SigLIP towers, same names as Gemma-3): vLLM 0.33
    llava.py ``init_vision_tower_for_llava`` builds only the layers up to ``vision_feature_layer`` (the deepest of
    a list; ``_get_num_hidden_layers`` with utils.py ``get_layer_index``: ``n + k + 1`` for a negative ``k``, else
    ``k``; transformers' default ``-2``, LLaVA-OneVision's ``-1``, where the config omits it), and clip.py /
    siglip.py ``load_weights`` skip the stored layers past those. So a released LLaVA stores all ``n`` layers of
    which vLLM builds ``n - 1``: layers ``0 .. built-1`` must be stored, ``built .. n-1`` may or may not be, and a
    layer at or past ``n`` is an error (the config's tower is shallower than the stored one, and the feature layer
    moves with it). A ``vision_feature_layer`` that is not an integer or a list of them is not judged.

  A depth that is not an integer (``"32"``, ``32.0``, ``true``) is an error of its own. Other families (Pixtral's
  ``vision_tower.transformer.layers``, GLM-4V, InternVL, MiniCPM-V, Qwen2.5-Omni ...) are not judged: their loaders
  were not checked. Nor is a judged family whose config has no depth key or that stores no block (a text-only
  extraction).

A decoder layer index below ``num_hidden_layers`` holding an MTP layer's own modules (``eh_proj``, ``enorm``,
``hnorm``, ``shared_head``) is an error too: the config counts the MTP layer as a decoder layer. A count that is not an
integer (``"4"``, ``4.0``, ``true``) is an error of its own
(:func:`count_type_problems`). A config without these keys, or a checkpoint whose decoder stack cannot be found, is
not judged (nothing is said).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import agree, plural
from .expert_count import EXPERT_KEYS, expert_count, expert_family
from .families import MTP_PARTS, config_value, is_fused_expert
from .naming import decoder_layers_prefix
from .reader import CONFIG_NAME, Problem
from .safetensors_io import TensorInfo

__all__ = [
    "COUNTS_CHECK",
    "EXPERT_KEYS",
    "SIZE_KEYS",
    "VISION_DEPTH_KEYS",
    "count_problems",
    "count_type_problems",
    "expert_count_problems",
    "layer_count_problems",
    "vision_depth_problems",
]

#: the line ``verify`` lists among its checks
COUNTS_CHECK = "decoder layers, experts and vision blocks against config.json's counts"

_PER_EXPERT = re.compile(r"^(?P<parent>.*(?:^|\.)experts)\.(?P<e>\d+)\.")
_SHOWN = 3  # runs of indices shown in a message
#: the config's size keys vLLM 0.33 reads as integers (the widths :mod:`.widths` compares, and the attention's)
SIZE_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim")
#: the ``vision_config`` keys naming the vision tower's depth, the first present read
VISION_DEPTH_KEYS = ("depth", "num_hidden_layers")


@dataclass(frozen=True)
class _Tower:
    """How vLLM 0.33 builds and loads one family's vision blocks (see the module's docstring for the sources)."""

    stack: re.Pattern  # a stored tensor of block N: group "p" the stack's prefix, group "i" the index
    builder: str  # the vLLM file and class that build the blocks, named by the errors
    skips_past: bool  # its loader skips a stored block past those it built (CLIP/SigLIP) instead of refusing it
    feature_layer: int | None = None  # LLaVA: built up to vision_feature_layer, this its default


_QWEN_BLOCKS = re.compile(r"^(?P<p>(?:model\.)?visual\.blocks\.)(?P<i>\d+)\.")
_CLIP_LAYERS = re.compile(r"^(?P<p>(?:model\.)?vision_tower\.(?:vision_model\.)?encoder\.layers\.)(?P<i>\d+)\.")
_LLAVA = "llava.py init_vision_tower_for_llava (CLIPVisionModel/SiglipVisionModel)"
#: the judged families' vision towers, by the config's ``model_type``
_TOWERS = {
    "qwen2_vl": _Tower(_QWEN_BLOCKS, "qwen2_vl.py Qwen2VisionTransformer", False),
    "qwen2_5_vl": _Tower(_QWEN_BLOCKS, "qwen2_5_vl.py Qwen2_5_VisionTransformer", False),
    "qwen3_vl": _Tower(_QWEN_BLOCKS, "qwen3_vl.py Qwen3_VisionTransformer", False),
    "qwen3_vl_moe": _Tower(_QWEN_BLOCKS, "qwen3_vl.py Qwen3_VisionTransformer", False),
    "llama4": _Tower(re.compile(r"^(?P<p>vision_model\.model\.layers\.)(?P<i>\d+)\."), "mllama4.py Llama4VisionEncoder", False),
    "gemma3": _Tower(_CLIP_LAYERS, "gemma3_mm.py SiglipVisionModel", True),
    "llava": _Tower(_CLIP_LAYERS, _LLAVA, True, -2),
    "llava_next": _Tower(_CLIP_LAYERS, _LLAVA, True, -2),
    "llava_next_video": _Tower(_CLIP_LAYERS, _LLAVA, True, -2),
    "llava_onevision": _Tower(_CLIP_LAYERS, _LLAVA, True, -1),
}


def count_problems(config: dict, tensors: dict[str, TensorInfo], folder: str) -> list[Problem]:
    """:func:`layer_count_problems`, :func:`expert_count_problems` and :func:`vision_depth_problems` of one checkpoint
    (``folder``: its path); empty where ``config`` is not a dict (a broken ``config.json``, reported by the reader)."""
    if not isinstance(config, dict):
        return []
    file = f"{folder}/{CONFIG_NAME}"
    found = layer_count_problems(config, tensors, file) + expert_count_problems(config, tensors, file)  # (types: config_types.parse_problems, first)
    return found + vision_depth_problems(config, tensors, file)


def layer_count_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """An error where the decoder layers stored (``<P>layers.N.``) are not the config's ``num_hidden_layers``: a layer
    index below it without tensors, or one at or past it that is not an MTP layer (``num_nextn_predict_layers``).

    ``config``: the parsed ``config.json``; ``tensors``: the checkpoint's tensors by name; ``file``: the config's
    path, named by the error. Empty where the config has no integer ``num_hidden_layers`` or no token embedding
    named ``...embed_tokens.weight`` is found."""
    n = _count(config, "num_hidden_layers")
    stack = decoder_layers_prefix(tensors)
    if n is None or stack is None:
        return []
    pattern = re.compile(re.escape(stack) + rf"(\d+)\.(?:({MTP_PARTS})\.)?")
    stored, mtp_like = set(), set()
    for m in map(pattern.match, tensors):
        if m:
            stored.add(int(m.group(1)))
            if m.group(2):
                mtp_like.add(int(m.group(1)))
    if not stored:
        return []
    mtp = _count(config, "num_nextn_predict_layers") or 0
    missing = sorted(set(range(n)) - stored)
    extra = sorted(i for i in stored if i >= n + mtp)
    counted = sorted(i for i in mtp_like if i < n)
    unlike = sorted(i for i in stored if n <= i < n + mtp and i not in mtp_like)  # a decoder layer the count left out
    out = []
    if missing:
        out.append(f"{len(missing)} of them ({_indices(missing)}) {agree(len(missing), 'has', 'have')} no tensors: vLLM would run them with random weights")
    if extra:
        allowed = f" (after the decoder, num_nextn_predict_layers {mtp} MTP layers may be stored)" if mtp else ""
        past = f"the checkpoint stores {plural(len(extra), 'layer')} past them ({_indices(extra)}){allowed}"
        out.append(f"{past}: vLLM has no parameter for {agree(len(extra), 'it', 'them')} and refuses the checkpoint")
    if unlike:
        which = f"{agree(len(unlike), 'layer', 'layers')} {_indices(unlike)} past them {agree(len(unlike), 'holds', 'hold')}"
        out.append(
            f"{which} no eh_proj/enorm/hnorm/shared_head, so {agree(len(unlike), 'it is', 'they are')} no MTP layer but a decoder layer the count "
            "leaves out: vLLM 0.33 deepseek_v2.py skips the layers past num_hidden_layers that it does not load as MTP layers (a shallower model)"
        )
    if counted:
        which = f"{agree(len(counted), 'layer', 'layers')} {_indices(counted)} {agree(len(counted), 'holds', 'hold')}"
        out.append(f"{which} an MTP layer's eh_proj/enorm/hnorm/shared_head, which a decoder layer has no parameter for")
    span = f" ({stack}0 .. {stack}{n - 1})" if n > 0 else ""
    return [Problem("error", f"config.json's num_hidden_layers is {n}{span}, but " + "; ".join(out), file)] if out else []


def expert_count_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """An error for each way the stored experts disagree with the config's expert count (the count vLLM 0.33 builds
    for the family, :func:`.expert_count.expert_count`; each key of :data:`EXPERT_KEYS` for a family it does not
    list): an ``...experts`` module stored per expert whose indices are not ``0 .. n-1``, and a fused 3-D expert weight
    whose first dimension is not ``n``. Each error names up to three such modules and how many there are.

    ``config``, ``tensors``, ``file``: as :func:`layer_count_problems`. Empty where the config has no integer
    expert count or the checkpoint stores no experts."""
    keys = _expert_counts(config)
    if not keys:
        return []
    per_expert: dict[str, set[int]] = {}
    fused: dict[str, int] = {}
    for name, info in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is not None:
            per_expert.setdefault(m["parent"], set()).add(int(m["e"]))
        elif len(info.shape) == 3 and is_fused_expert(name):
            fused[name] = int(info.shape[0])
    out = []
    for key, n in keys.items():  # (several only for a family expert_count does not list: which one its loader reads is not known)
        wrong = {p: sorted(s) for p, s in per_expert.items() if s != set(range(n))}
        if wrong:
            p = min(wrong)
            what = f"{p} holds {len(wrong[p])} ({_indices(wrong[p])})"
            do = agree(len(wrong), "does", "do")
            summary = f"{len(wrong)} of {plural(len(per_expert), 'MoE block')} stored per expert {do} not hold experts 0 .. {n - 1}"
            out.append(_expert_error(key, n, summary, what, file))
        bad = {name: e for name, e in fused.items() if e != n}
        if bad:
            name = min(bad)
            what = f"{name} holds {bad[name]}"
            summary = f"{len(bad)} of {plural(len(fused), 'fused expert weight')} {agree(len(bad), 'does', 'do')} not hold {plural(n, 'expert')}"
            out.append(_expert_error(key, n, summary, what, file))
    return out


def count_type_problems(config: dict, file: str | None = None, worded: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """An error for each count or size key (``num_hidden_layers``, ``num_nextn_predict_layers``, :data:`EXPERT_KEYS`,
    :data:`SIZE_KEYS`, at the top level or in ``text_config``) whose value is not an integer (``"4"``, ``4.0``,
    ``true``): vLLM refuses such a config (a trial's ``hidden_size: 256.0``: "expected int, got float"), and the checks
    here and in :mod:`.widths` read integers only (a float width equal to the tensors' passed them). ``worded``: the
    keys (``text_config.head_dim``) another check judges and words (:func:`.config_types.parse_problems`: the class
    declaring them an integer), left out here."""
    out = []
    for prefix, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in ("num_hidden_layers", "num_nextn_predict_layers", *EXPERT_KEYS, *SIZE_KEYS):
            v = cfg.get(key)
            if f"{prefix}{key}" in worded:
                continue
            if key in cfg and v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                out.append(_type_error(f"{prefix}{key}", v, "the model", file))
    return out


def vision_depth_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """An error where a judged family's vision blocks (:data:`_TOWERS`) are not what vLLM 0.33 builds from the
    ``vision_config``'s depth (:data:`VISION_DEPTH_KEYS`, the first present): a block it builds without tensors (run
    with random weights), or one stored past the config's depth (refused, or skipped by CLIP/SigLIP loaders: a
    shallower tower than the one stored); a depth that is not an integer is an error of its own. The error names
    config.json, the key, its value and the stored block indices.

    ``config``, ``tensors``, ``file``: as :func:`layer_count_problems`. Empty for another family, a config without
    ``vision_config`` or its depth key, or a checkpoint that stores no block of the family's stack."""
    model_type = config.get("model_type")
    tower = _TOWERS.get(model_type) if isinstance(model_type, str) else None
    vc = config.get("vision_config")
    key = next((k for k in VISION_DEPTH_KEYS if isinstance(vc, dict) and vc.get(k) is not None), None)
    if tower is None or key is None:
        return []
    n, path = vc[key], f"vision_config.{key}"
    if isinstance(n, bool) or not isinstance(n, int):
        return [_type_error(path, n, "the vision tower", file)]
    prefix, stored = None, set()
    for m in map(tower.stack.match, tensors):
        if m:
            prefix = prefix or m["p"]
            stored.add(int(m["i"]))
    built = n if tower.feature_layer is None else _llava_built(config, n, tower.feature_layer)
    if prefix is None or built is None:
        return []
    missing = sorted(set(range(built)) - stored)
    extra = sorted(i for i in stored if i >= max(n, built))  # a LLaVA feature layer past n: vLLM builds and loads them
    out = []
    if missing:
        has = agree(len(missing), "has", "have")
        out.append(f"{len(missing)} of the {plural(built, 'block')} vLLM 0.33 builds ({_indices(missing)}) {has} no tensors and would run with random weights")
    if extra:
        them = agree(len(extra), "it", "them")
        fate = f"builds no layer for {them} (its CLIP/SigLIP loader skips {them}): a shallower tower than the one stored"
        fate = fate if tower.skips_past else f"has no parameter for {them} and refuses the checkpoint"
        out.append(f"{len(extra)} of those stored ({_indices(extra)}) {agree(len(extra), 'is', 'are')} at or past {n}: vLLM 0.33 {fate}")
    if not out:
        return []
    span = f"{prefix}0 .. {prefix}{built - 1}" if built > 0 else "none"
    if built != n:
        span = f"with vision_feature_layer {json.dumps(config.get('vision_feature_layer', tower.feature_layer))}, vLLM builds {span}"
    head = f"config.json's {path} is {n} ({span}; {tower.builder}), but the checkpoint stores vision blocks {_indices(sorted(stored))}"
    return [Problem("error", f"{head}: " + "; ".join(out), file)]


def _llava_built(config: dict, n: int, default: int) -> int | None:
    """How many vision layers vLLM 0.33 builds for a LLaVA config (llava.py ``_get_num_hidden_layers``): up to the
    deepest ``vision_feature_layer`` (``default`` where absent), None where that is not an integer or a list of them."""
    layers = config.get("vision_feature_layer", default)
    layers = layers if isinstance(layers, list) else [layers]
    if not layers or any(isinstance(k, bool) or not isinstance(k, int) for k in layers):
        return None
    return max(n + k + 1 if k < 0 else k for k in layers)


def _type_error(key: str, value, what: str, file: str | None) -> Problem:
    return Problem("error", f"config.json's {key} is {json.dumps(value)}, not an integer: vLLM cannot build {what} from it", file)


def _expert_counts(config: dict) -> dict[str, int]:
    """Expert key -> the count to judge: for a family :data:`.expert_count.EXPERT_COUNT` lists, the one vLLM 0.33 builds
    (:func:`.expert_count.expert_count`; none where it is not an integer); else each of :data:`EXPERT_KEYS` the config
    holds as an integer (``text_config`` first)."""
    if expert_family(config) is not None:
        counted = expert_count(config)
        return {counted[0]: counted[1]} if counted is not None else {}
    return {k: v for k in EXPERT_KEYS if (v := _count(config, k)) is not None}


def _count(config: dict, key: str) -> int | None:
    """:func:`.families.config_value` of one count key, None for a boolean (an integer to Python, not a count)."""
    v = config_value(config, key)
    return None if isinstance(v, bool) else v


def _expert_error(key: str, n: int, summary: str, example: str, file: str | None) -> Problem:
    why = (
        f"vLLM builds {plural(n, 'expert')} per block: an expert among them that no tensor fills is refused or left uninitialised, "
        "and one past them is never loaded (the config and the checkpoint describe different models)"
    )
    return Problem("error", f"config.json's {key} is {n}, but {summary} (e.g. {example}): {why}", file)


def _indices(xs: list[int]) -> str:
    """A sorted list of indices in a few characters: runs collapsed (``0..47, 50``), the first :data:`_SHOWN` runs shown."""
    runs: list[str] = []
    start = prev = xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        runs.append(str(start) if start == prev else f"{start}..{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(runs[:_SHOWN]) + (f", ... ({len(runs) - _SHOWN} more runs)" if len(runs) > _SHOWN else "")
