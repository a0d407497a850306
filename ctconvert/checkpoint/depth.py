"""``config.json``'s layer and expert counts against the tensors a checkpoint stores (``verify``, no reference needed).

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
  (``experts.gate_up_proj`` ...) has ``n`` rows in its first dimension, ``n`` being the config's
  ``num_experts``, ``num_local_experts`` or ``n_routed_experts`` (``text_config`` first; Qwen-MoE, Mixtral/gpt-oss/Llama-4,
  DeepSeek spell it so).

A decoder layer index below ``num_hidden_layers`` holding an MTP layer's own modules (``eh_proj``, ``enorm``,
``hnorm``, ``shared_head``) is an error too: the config counts the MTP layer as a decoder layer. Every expert key the
config holds is compared (transformers maps one onto another through a config's ``attribute_map``, so either may be
the one read), and a count that is not an integer (``"4"``, ``4.0``, ``true``) is an error of its own
(:func:`count_type_problems`). A config without these keys, or a checkpoint whose decoder stack cannot be found, is
not judged (nothing is said).
"""

from __future__ import annotations

import json
import re

from .families import config_value, is_fused_expert
from .naming import decoder_layers_prefix
from .reader import CONFIG_NAME, Problem
from .safetensors_io import TensorInfo

__all__ = ["COUNTS_CHECK", "EXPERT_KEYS", "count_problems", "count_type_problems", "expert_count_problems", "layer_count_problems"]

#: the line ``verify`` lists among its checks
COUNTS_CHECK = "decoder layers and experts against config.json's counts"

#: the config keys naming the routed experts of each MoE block, in the order they are looked up
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_PER_EXPERT = re.compile(r"^(?P<parent>.*(?:^|\.)experts)\.(?P<e>\d+)\.")
_SHOWN = 3  # runs of indices shown in a message


def count_problems(config: dict, tensors: dict[str, TensorInfo], folder: str) -> list[Problem]:
    """:func:`layer_count_problems` and :func:`expert_count_problems` of one checkpoint (``folder``: its path); empty
    where ``config`` is not a dict (a broken ``config.json``, reported by the reader)."""
    if not isinstance(config, dict):
        return []
    file = f"{folder}/{CONFIG_NAME}"
    return count_type_problems(config, file) + layer_count_problems(config, tensors, file) + expert_count_problems(config, tensors, file)


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
    pattern = re.compile(re.escape(stack) + r"(\d+)\.(?:(eh_proj|enorm|hnorm|shared_head)\.)?")
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
    out = []
    if missing:
        out.append(f"{len(missing)} of them ({_indices(missing)}) have no tensors: vLLM would run them with random weights")
    if extra:
        allowed = f" (after the decoder, num_nextn_predict_layers {mtp} MTP layers may be stored)" if mtp else ""
        out.append(f"the checkpoint stores {len(extra)} layers past them ({_indices(extra)}){allowed}: vLLM has no parameter for them and refuses it")
    if counted:
        out.append(f"layer {_indices(counted)} holds an MTP layer's eh_proj/enorm/hnorm/shared_head, which a decoder layer has no parameter for")
    span = f" ({stack}0 .. {stack}{n - 1})" if n > 0 else ""
    return [Problem("error", f"config.json's num_hidden_layers is {n}{span}, but " + "; ".join(out), file)] if out else []


def expert_count_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """An error for each way the stored experts disagree with the config's expert count (:data:`EXPERT_KEYS`): an
    ``...experts`` module stored per expert whose indices are not ``0 .. n-1``, and a fused 3-D expert weight whose
    first dimension is not ``n``. Each error names up to three such modules and how many there are.

    ``config``, ``tensors``, ``file``: as :func:`layer_count_problems`. Empty where the config has no integer
    expert count or the checkpoint stores no experts."""
    keys = {k: v for k in EXPERT_KEYS if (v := _count(config, k)) is not None}
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
    for key, n in keys.items():  # every key the config holds: transformers maps one onto another (attribute_map), either may be read
        wrong = {p: sorted(s) for p, s in per_expert.items() if s != set(range(n))}
        if wrong:
            p = min(wrong)
            what = f"{p} holds {len(wrong[p])} ({_indices(wrong[p])})"
            out.append(_expert_error(key, n, f"{len(wrong)} of {len(per_expert)} MoE blocks stored per expert do not hold experts 0 .. {n - 1}", what, file))
        bad = {name: e for name, e in fused.items() if e != n}
        if bad:
            name = min(bad)
            what = f"{name} holds {bad[name]}"
            out.append(_expert_error(key, n, f"{len(bad)} of {len(fused)} fused expert weights do not hold {n} experts", what, file))
    return out


def count_type_problems(config: dict, file: str | None = None) -> list[Problem]:
    """An error for each count key (``num_hidden_layers``, ``num_nextn_predict_layers``, :data:`EXPERT_KEYS`, at the top
    level or in ``text_config``) whose value is not an integer (``"4"``, ``4.0``, ``true``): vLLM refuses such a config,
    and the other checks here read integers only."""
    out = []
    for prefix, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in ("num_hidden_layers", "num_nextn_predict_layers", *EXPERT_KEYS):
            v = cfg.get(key)
            if key in cfg and v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                out.append(Problem("error", f"config.json's {prefix}{key} is {json.dumps(v)}, not an integer: vLLM cannot build the model from it", file))
    return out


def _count(config: dict, key: str) -> int | None:
    """:func:`.families.config_value` of one count key, None for a boolean (an integer to Python, not a count)."""
    v = config_value(config, key)
    return None if isinstance(v, bool) else v


def _expert_error(key: str, n: int, summary: str, example: str, file: str | None) -> Problem:
    why = f"vLLM builds {n} experts per block and would refuse the checkpoint or route to random weights"
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
