"""The model class vLLM 0.33 builds for a checkpoint, read from ``config.json`` as vLLM reads it: by ``architectures``,
not by ``model_type``.

vLLM 0.33 passes ``hf_config.architectures`` to its model registry (``model_executor/model_loader/utils.py``
``_get_model_architecture``), and ``model_executor/models/registry.py`` ``_ModelRegistry.resolve_model_cls`` tries the
entries in order and builds the first one its registry holds (``_VLLM_MODELS``, each name after ``_normalize_arch``);
only where it holds none does it fall back to the Transformers backend for the first entry (``_try_resolve_transformers``)
or refuse the model. ``model_type`` only picks the transformers config class that reads ``config.json``
(``transformers_utils/config.py`` ``get_config``). So a Llama checkpoint whose ``architectures`` is
``["Qwen3ForCausalLM"]`` is built as Qwen3 (its q/k norms filled by no tensor: refused), while one whose
``model_type`` is ``qwen3`` under ``["LlamaForCausalLM"]`` loads. Where ``architectures`` is absent or empty, vLLM puts
transformers' class of the model_type in its place (``get_config``, ``MODEL_MAPPING_NAMES``) and ctconvert judges by
``model_type``, as it always did.

:data:`ARCHITECTURES` holds the ``architectures`` entries that vLLM 0.33's registry maps onto the class of a family
:mod:`.expected` judges (``registry.py`` ``_TEXT_GENERATION_MODELS`` and ``_MULTIMODAL_MODELS``, read for 0.33.0),
each with the text model class that builds ``embed_tokens``, the decoder layers and ``norm`` and the top-level towers
it also builds (a VLM's). Left out: the pooling adapters (``...Model``, ``...ForSequenceClassification``: another
class around the layers) and the registry's aliases for other model types (``InternLM3ForCausalLM``,
``TeleChat3ForCausalLM`` ... are built as Llama from configs verify does not know). :func:`resolve` applies vLLM's rule:
the entry built is the first one vLLM 0.33's registry holds (:func:`registered`, from the release's list of its 415
names: an unknown ``FooForCausalLM`` before ``Qwen3ForCausalLM`` is skipped, as vLLM skips it, and Qwen3 is judged),
else the first entry. Where that entry is one of :data:`ARCHITECTURES`, its class is judged; where it is any other
name, the decoder layers are judged by ``model_type`` as before and nothing outside them (:mod:`.expected` says so in a
note).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from .reader import Problem

__all__ = ["ARCHITECTURES", "Resolved", "VllmClass", "family_class", "mismatch_problems", "model_types", "registered", "resolve", "vllm_types"]


@dataclass(frozen=True)
class VllmClass:
    """A vLLM 0.33 model class: ``where``, its file and class (``llama.py LlamaForCausalLM``); ``model``, the file and
    class of the text model that builds ``embed_tokens``, the decoder layers and ``norm``; ``families``, the
    ``model_type`` values built with it, the first judged where the config's model_type is none of them; ``towers``, the
    top-level prefixes of the other modules it builds (a VLM's vision tower and projector, in the checkpoint's names
    before and after transformers 4.52: each file's ``hf_to_vllm_mapper``), which :mod:`.top_level` does not judge;
    ``heads``, the stored names of its ``lm_head`` module (a VLM's mapper also takes ``language_model.lm_head``)."""

    where: str
    model: str
    families: tuple[str, ...]
    towers: tuple[str, ...] = ()
    heads: tuple[str, ...] = ("lm_head",)

    @property
    def name(self) -> str:
        """The class name alone (``LlamaForCausalLM``)."""
        return self.where.rpartition(" ")[2]


_LLAMA = VllmClass("llama.py LlamaForCausalLM", "llama.py LlamaModel", ("llama",))
_QWEN_VL_TOWER = ("visual.", "model.visual.")  # qwen2_vl.py / qwen2_5_vl.py hf_to_vllm_mapper: "model.visual." -> "visual."
_GEMMA3_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")  # gemma3_mm.py
_VLM_HEADS = ("lm_head", "language_model.lm_head")  # the VLM files' mappers: "lm_head." -> "language_model.lm_head."
_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k2")  # deepseek_v2.py: DeepseekV3ForCausalLM(DeepseekV2ForCausalLM) adds nothing

#: ``architectures`` entry -> the vLLM 0.33 class its registry builds for it (module docstring), for the judged families
ARCHITECTURES: dict[str, VllmClass] = {
    "LlamaForCausalLM": _LLAMA,
    "LLaMAForCausalLM": _LLAMA,
    "MistralForCausalLM": VllmClass("mistral.py MistralForCausalLM", "mistral.py MistralModel", ("mistral",)),
    "Phi3ForCausalLM": VllmClass("phi3.py Phi3ForCausalLM", "llama.py LlamaModel", ("phi3",)),
    "Qwen2ForCausalLM": VllmClass("qwen2.py Qwen2ForCausalLM", "qwen2.py Qwen2Model", ("qwen2",)),
    "Qwen2VLForConditionalGeneration": VllmClass(
        "qwen2_vl.py Qwen2VLForConditionalGeneration", "qwen2.py Qwen2Model", ("qwen2_vl",), _QWEN_VL_TOWER, _VLM_HEADS
    ),
    "Qwen2_5_VLForConditionalGeneration": VllmClass(
        "qwen2_5_vl.py Qwen2_5_VLForConditionalGeneration", "qwen2.py Qwen2Model", ("qwen2_5_vl",), _QWEN_VL_TOWER, _VLM_HEADS
    ),
    "Qwen3ForCausalLM": VllmClass("qwen3.py Qwen3ForCausalLM", "qwen3.py Qwen3Model", ("qwen3",)),
    "Qwen2MoeForCausalLM": VllmClass("qwen2_moe.py Qwen2MoeForCausalLM", "qwen2_moe.py Qwen2MoeModel", ("qwen2_moe",)),
    "Qwen3MoeForCausalLM": VllmClass("qwen3_moe.py Qwen3MoeForCausalLM", "qwen3_moe.py Qwen3MoeModel", ("qwen3_moe",)),
    "Gemma2ForCausalLM": VllmClass("gemma2.py Gemma2ForCausalLM", "gemma2.py Gemma2Model", ("gemma2",)),
    "Gemma3ForCausalLM": VllmClass("gemma3.py Gemma3ForCausalLM", "gemma3.py Gemma3Model", ("gemma3_text",)),
    "Gemma3ForConditionalGeneration": VllmClass(
        "gemma3_mm.py Gemma3ForConditionalGeneration", "gemma3.py Gemma3Model", ("gemma3",), _GEMMA3_TOWERS, _VLM_HEADS
    ),
    "MixtralForCausalLM": VllmClass("mixtral.py MixtralForCausalLM", "mixtral.py MixtralModel", ("mixtral",)),
    "DeepseekV2ForCausalLM": VllmClass("deepseek_v2.py DeepseekV2ForCausalLM", "deepseek_v2.py DeepseekV2Model", _DEEPSEEK),
    "DeepseekV3ForCausalLM": VllmClass("deepseek_v2.py DeepseekV3ForCausalLM", "deepseek_v2.py DeepseekV2Model", ("deepseek_v3", "kimi_k2", "deepseek_v2")),
    "Glm4MoeForCausalLM": VllmClass("glm4_moe.py Glm4MoeForCausalLM", "glm4_moe.py Glm4MoeModel", ("glm4_moe",)),
    "OlmoeForCausalLM": VllmClass("olmoe.py OlmoeForCausalLM", "olmoe.py OlmoeModel", ("olmoe",)),
    "GptOssForCausalLM": VllmClass("gpt_oss.py GptOssForCausalLM", "gpt_oss.py GptOssModel", ("gpt_oss",)),
}
#: every model_type a class of :data:`ARCHITECTURES` is built for
_KNOWN = frozenset(t for c in ARCHITECTURES.values() for t in c.families)


def model_types(config: dict) -> list[str]:
    """The ``model_type`` of a config and of its ``text_config`` (outer first)."""
    out = [config.get("model_type")]
    tc = config.get("text_config")
    if isinstance(tc, dict):
        out.append(tc.get("model_type"))
    return [t for t in out if isinstance(t, str)]


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` reads from a config: ``architecture``, the ``architectures`` entry vLLM 0.33 builds (None
    where the config has none); ``cls``, the class vLLM builds for the whole checkpoint where :data:`ARCHITECTURES`
    knows it (without ``architectures``: the class of the outer ``model_type``'s family, if judged); ``declared``, the
    family the config's ``model_type`` names (the outer's or the ``text_config``'s, the first judged one, else None);
    ``types``, the model types the loadability checks judge by: :func:`model_types` where ``architectures`` agrees with
    them, is absent or names a class verify does not know (as before: a wrapper's ``text_config`` family judges its
    decoder layers), ``cls``'s family where it names another known class."""

    architecture: str | None
    cls: VllmClass | None
    declared: str | None
    types: tuple[str, ...]

    @property
    def mismatch(self) -> bool:
        """Whether ``architectures`` makes vLLM build a known class other than the one of the family ``model_type``
        names (a model_type verify does not know names none)."""
        return self.architecture is not None and self.cls is not None and self.declared is not None and self.declared not in self.cls.families


def _own_class(family: str | None) -> VllmClass | None:
    """The class vLLM 0.33 builds for ``family``'s own ``architectures``: the one whose ``families`` lists it first
    (Kimi-K2's is ``DeepseekV3ForCausalLM``)."""
    built = [c for c in ARCHITECTURES.values() if family in c.families]
    return min(built, key=lambda c: c.families.index(family)) if built else None


def resolve(config: dict) -> Resolved:
    """The class vLLM 0.33 builds for ``config`` and the model types verify judges it by (module docstring)."""
    types = model_types(config) if isinstance(config, dict) else []
    declared = next((t for t in types if t in _KNOWN), None)
    archs = config.get("architectures") if isinstance(config, dict) else None
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    first = next((a for a in names if registered(a)), names[0] if names else None)  # vLLM skips a name it does not hold
    if first is None:  # vLLM puts transformers' class of the model_type in its place: judged by model_type, as before
        return Resolved(None, _own_class(config.get("model_type")) if types else None, declared, tuple(types))
    cls = ARCHITECTURES.get(first)
    if cls is None:  # a class verify does not know (or one vLLM skips): the decoder layers judged by model_type, as before
        return Resolved(first, None, declared, tuple(types))
    return Resolved(first, cls, declared, tuple(types) if declared in cls.families else (cls.families[0],))


#: the suffixes vLLM 0.33 swaps for one another to find a registered class (``config/model.py``
#: ``iter_architecture_defaults``, used by ``registry.py`` ``_ModelRegistry._normalize_arch``)
_SUFFIXES = (
    "ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel", "ForTextEncoding", "EmbeddingModel", "ForSequenceClassification",
    "ForTokenClassification", "ForAudioClassification", "ForImageClassification", "ForVideoClassification", "ClassificationModel",
    "ForRewardModeling", "RewardModel", "Model",
)  # fmt: skip


@functools.cache
def _registry() -> frozenset[str]:
    """vLLM 0.33.0's registered architecture names (``registry.py`` ``_VLLM_MODELS``, 415 names, listed from the release
    in ``vllm_033_architectures.txt``)."""
    return frozenset((Path(__file__).with_name("vllm_033_architectures.txt")).read_text().split())


def registered(name: str) -> bool:
    """Whether vLLM 0.33's registry holds ``name`` (an ``architectures`` entry), as ``_normalize_arch`` finds it: the
    name itself, or the name with its suffix (:data:`_SUFFIXES`, the first that ends it) swapped for another. vLLM tries
    the entries in order and skips one it does not hold (``resolve_model_cls``)."""
    reg = _registry()
    if name in reg:
        return True
    suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
    return suffix is not None and any(name.replace(suffix, other) in reg for other in _SUFFIXES)


def vllm_types(config: dict) -> list[str]:
    """The model types of ``config`` that vLLM 0.33 builds the model for (:func:`resolve`): the loadability checks'."""
    return list(resolve(config).types)


def family_class(family: str, config: dict) -> VllmClass | None:
    """The class vLLM 0.33 builds for the whole checkpoint, where it is one of judged ``family`` (:func:`resolve`); None
    where verify does not know it (``architectures`` names another class, or a wrapper's ``text_config`` is the family:
    LLaVA's Llama), so nothing outside the decoder layers is judged."""
    cls = resolve(config).cls
    return cls if cls is not None and family in cls.families else None


def mismatch_problems(config: dict, file: str | None = None) -> list[Problem]:
    """A warning where ``architectures`` and ``model_type`` name different families (:attr:`Resolved.mismatch`): vLLM
    0.33 builds the class ``architectures`` names, and verify judges the tensors as that class builds them (a failure
    only where they are wrong for it); or where it names no class vLLM's registry holds (:func:`registered`: vLLM then
    tries the Transformers backend, which needs transformers' own class of that name). ``file``: the config's path,
    which the warning names."""
    r = resolve(config) if isinstance(config, dict) else None
    if r is not None and r.architecture is not None and not registered(r.architecture):
        msg = (
            f"config.json's architectures {config['architectures']} names no class vLLM 0.33's registry holds (registry.py "
            f"resolve_model_cls): vLLM builds transformers' own {r.architecture} through its Transformers backend if "
            "transformers has one, else refuses the model"
        )
        return [Problem("warning", msg, file)]
    if r is None or not r.mismatch:
        return []
    msg = (
        f"config.json's architectures {config['architectures']} and model_type {r.declared!r} name different families: vLLM 0.33 builds "
        f"{r.cls.where} (the first entry of architectures its registry holds: registry.py resolve_model_cls; model_type "
        f"only picks the config class), so verify judges the tensors as {r.cls.name} builds them"
    )
    return [Problem("warning", msg, file)]
