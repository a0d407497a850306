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

A config without these keys, or a checkpoint whose decoder stack cannot be found, is not judged (nothing is said).
"""

from __future__ import annotations

import re

from .families import config_value, is_fused_expert
from .naming import decoder_layers_prefix
from .reader import CONFIG_NAME, Problem
from .safetensors_io import TensorInfo

__all__ = ["COUNTS_CHECK", "count_problems", "expert_count_problems", "layer_count_problems"]

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
    return layer_count_problems(config, tensors, file) + expert_count_problems(config, tensors, file)


def layer_count_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """An error where the decoder layers stored (``<P>layers.N.``) are not the config's ``num_hidden_layers``: a layer
    index below it without tensors, or one at or past it that is not an MTP layer (``num_nextn_predict_layers``).

    ``config``: the parsed ``config.json``; ``tensors``: the checkpoint's tensors by name; ``file``: the config's
    path, named by the error. Empty where the config has no integer ``num_hidden_layers`` or no token embedding
    named ``...embed_tokens.weight`` is found."""
    n = config_value(config, "num_hidden_layers")
    stack = decoder_layers_prefix(tensors)
    if n is None or stack is None:
        return []
    pattern = re.compile(re.escape(stack) + r"(\d+)\.")
    stored = {int(m.group(1)) for m in map(pattern.match, tensors) if m}
    if not stored:
        return []
    mtp = config_value(config, "num_nextn_predict_layers") or 0
    missing = sorted(set(range(n)) - stored)
    extra = sorted(i for i in stored if i >= n + mtp)
    out = []
    if missing:
        out.append(f"{len(missing)} of them ({_indices(missing)}) have no tensors: vLLM would run them with random weights")
    if extra:
        also = f" + num_nextn_predict_layers {mtp} MTP layers" if mtp else ""
        out.append(f"the checkpoint stores {len(extra)} more ({_indices(extra)}{also} allowed): vLLM has no parameter for them and refuses it")
    head = f"config.json's num_hidden_layers is {n} ({stack}0 .. {stack}{n - 1}), but "
    return [Problem("error", head + "; ".join(out), file)] if out else []


def expert_count_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """An error for each way the stored experts disagree with the config's expert count (:data:`EXPERT_KEYS`): an
    ``...experts`` module stored per expert whose indices are not ``0 .. n-1``, and a fused 3-D expert weight whose
    first dimension is not ``n``. Each error names up to three such modules and how many there are.

    ``config``, ``tensors``, ``file``: as :func:`layer_count_problems`. Empty where the config has no integer
    expert count or the checkpoint stores no experts."""
    key, n = next(((k, v) for k in EXPERT_KEYS if (v := config_value(config, k)) is not None), (None, None))
    if n is None:
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
