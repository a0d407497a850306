"""The tensors a judged family stores outside its decoder layers, against what its vLLM 0.33 class builds there
(:mod:`.expected`'s top-level rule: ``verify`` without a reference, ``inspect``, ``quantize``'s source checks).

vLLM 0.33 loads every judged family through ``model_executor/models/utils.py`` ``AutoWeightsLoader`` (the CausalLM's
``load_weights``, which hands ``model.`` to the text model's own: llama.py ``LlamaModel.load_weights`` and each judged
file's alike), whose ``_load_module`` raises for a name its modules have no parameter or persistent buffer for
("There is no module or parameter named 'foo' in LlamaModel"): vLLM refuses the checkpoint. Outside the decoder layers
(``<P>layers.N.``, MTP layers included) a judged class builds only:

- the text model's ``<P>embed_tokens`` and ``<P>norm`` (every judged file's ``...Model.__init__``: llama.py
  ``LlamaModel``, qwen2.py ``Qwen2Model``, deepseek_v2.py ``DeepseekV2Model``, gpt_oss.py ``GptOssModel`` ...; a
  missing one is :mod:`.expected`'s error);
- the CausalLM's ``lm_head`` (:attr:`.architectures.VllmClass.heads`), judged by :func:`.widths.tied_head_problems`
  (tied, untied, or none at all: :data:`.families.VLLM_HEAD`);
- a VLM's vision tower and projector (:attr:`.architectures.VllmClass.towers`), not judged here
  (:func:`.depth.vision_depth_problems` counts its blocks).

The loader skips on purpose (``AutoWeightsLoader.load_weights``), and so does this rule:

- RoPE buffers an old checkpoint saved: a name holding one of :data:`ROTARY_DROPPED`
  (``REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER`` maps them to None before any module sees them);
- an unexpected ``.bias`` of a module it builds (it adds ``.bias`` to ``ignore_unexpected_suffixes``, which
  ``_load_module`` asks of a name below a module it has): the embedding's, the final norm's or the head's bias is
  dropped while the module's weight loads, so the checkpoint holds values vLLM never runs, an error here all the same.
  Another name below such a module (``lm_head.foo``, ``model.norm.weight2``) has no parameter, an error as any other.
  The bias of a module it does not build is refused as any other name (``model.foo.bias``: no module named 'foo');
- the quantization's activation and KV-cache scales (``_ignore_unexpected_suffixes``; left out before this rule by
  :func:`.expected.parameters`, :mod:`.conformance` judges them).

Every other tensor outside the layers is an error naming it, its shard and the class that has no parameter for it:
the text model for a name under ``<P>`` (as vLLM's own message does), else the class ``architectures`` builds.
"""

from __future__ import annotations

from .architectures import VllmClass
from .naming import natural_key
from .reader import Problem

__all__ = ["ROTARY_DROPPED", "rotary_dropped", "top_level_problems"]

#: the substrings of the tensor names vLLM 0.33's loader drops unread (utils.py ``AutoWeightsLoader``
#: ``REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``: "Models trained using early version ColossalAI or quantized by GPTQModel may
#: include these tensors in checkpoint. Drop them.")
ROTARY_DROPPED = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def rotary_dropped(name: str) -> bool:
    """Whether vLLM 0.33's loader drops stored tensor ``name`` unread as a saved RoPE buffer (:data:`ROTARY_DROPPED`)."""
    return any(s in name for s in ROTARY_DROPPED)


def top_level_problems(params: dict[str, str], stack: str, cls: VllmClass, file_of) -> list[Problem]:
    """Errors for the parameters outside decoder stack ``stack`` (``<P>layers.``) that vLLM 0.33 class ``cls`` has no
    parameter for (module docstring). ``params``: :func:`.expected.parameters` (each model parameter with one stored
    name); ``file_of``: the shard of a name (as :func:`.expected.expected_problems` makes it)."""
    top = stack[: -len("layers.")]
    built = {top + "embed_tokens", top + "norm"}
    out = []
    for name in sorted(params, key=natural_key):
        module, _, leaf = name.rpartition(".")
        if name.startswith(stack) or name.startswith(cls.towers):  # (the RoPE buffers vLLM drops: not in params)
            continue
        if (module in built or module in cls.heads) and leaf in ("weight", "bias"):  # (another leaf: no parameter, below)
            if leaf == "bias":  # a bias of a module vLLM builds without one: dropped while its weight loads
                owner = cls.where if module in cls.heads else cls.model
                msg = f"extra: {name} is stored, but vLLM 0.33 {owner} builds {module} without a bias: its loader drops this one "
                msg += "(utils.py AutoWeightsLoader ignores an unexpected .bias) while it loads the weight, so vLLM runs without the stored values"
                out.append(Problem("error", msg, file_of(name), name))
            continue  # the weight: missing is expected.py's, the head's every rule is widths.py's
        owner = cls.model if top and name.startswith(top) else cls.where
        msg = f"extra: {name} is stored outside the decoder layers, which vLLM 0.33 {owner} does not build: its loader has no parameter to load it into"
        out.append(Problem("error", msg, file_of(name), name))
    return out
