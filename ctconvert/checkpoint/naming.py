"""How Hugging Face checkpoints name their tensors, and how compressed-tensors matches module names.

These rules are read from the names alone (no model is built): which 2-D
weights are Linear layers, which stay dense by default (``lm_head``,
embeddings, norms, MoE routers, vision and audio towers), which modules form
one fused layer in vLLM, where the decoder blocks are, and where the token
embedding sits. Both sides use them: the planner (what to quantize) and the
readers of compressed checkpoints (``inspect``, ``verify``, ``decompress``,
``repack``), so they live with the checkpoint, below both.

Matching follows compressed-tensors (``compressed_tensors/utils/match.py``,
release 0.20; docs/compressed-tensors-format.md §7.5): a ``targets``/``ignore``
entry is a module's full name, ``re:<pattern>`` (``re.match``, anchored at
the start), or a class name; the only class name a checkpoint without a model
can resolve is ``Linear`` (:func:`is_linear_weight`). Among a config's groups,
exact names win over ``re:`` patterns, which win over ``Linear``.
"""

from __future__ import annotations

import re

from .safetensors_io import TensorInfo

__all__ = [
    "BLOCK",
    "DEFAULT_IGNORE_PATTERNS",
    "FLOAT_DTYPES",
    "FUSED_OF",
    "FUSED_SETS",
    "decoder_layer_index",
    "dense_kind",
    "find_embedding",
    "fused_key",
    "fused_set_name",
    "is_generative",
    "is_lm_head",
    "is_linear_weight",
    "is_multimodal",
    "loader_patterns",
    "matches",
    "natural_key",
    "resolve_group",
    "tie_word_embeddings",
]

FLOAT_DTYPES = ("BF16", "F16", "F32")

# Module names that hold 2-D weights but are not Linear layers.
_NOT_LINEAR = re.compile(
    r"(^|\.)(embed_tokens|embed_tokens_per_layer|embeddings?|word_embeddings|position_embeddings|token_type_embeddings|wte|wpe|"
    r"shared|embed_positions|rotary_emb|relative_attention_bias)(\.|$)|norm|(^|\.)ln_?\w*$"
)
#: Default ignore: kept dense and listed in ``ignore`` (docs/field-notes.md §4, reports 9, F6).
DEFAULT_IGNORE_PATTERNS = {
    "lm_head": re.compile(r"(^|\.)lm_head$|^output$"),
    "router": re.compile(r"(^|\.)(mlp\.gate|block_sparse_moe\.gate|router|router\.proj|router\.layer|gate\.wg|shared_expert_gate|moe\.gate)$"),
    "vision": re.compile(
        r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|multi_modal_projector|mm_projector|"
        r"vision_embed_tokens|audio_tower|audio_model|image_newline|vision|embed_vision|embed_audio)\."
    ),
}
#: A decoder (or encoder) block: ``...layers.7.``, ``...layer.7.``, ``...h.7.``, ``...blocks.7.``
BLOCK = re.compile(r"(^|\.)(layers|layer|h|blocks|block|decoder_layers)\.\d+\.")
_DECODER_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")

#: Fused sets: vLLM loads these as one layer and keeps one NVFP4 global scale
#: (docs/compressed-tensors-format.md §9.1; docs/field-notes.md F5).
FUSED_SETS = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)
#: member leaf name -> its fused set
FUSED_OF = {m: s for s in FUSED_SETS for m in s}

_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight", "embed_tokens.weight")


def is_linear_weight(name: str, info: TensorInfo) -> bool:
    """Whether ``name`` looks like the weight of an ``nn.Linear``: 2-D float ``*.weight``, not an embedding or norm."""
    if not name.endswith(".weight") or info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
        return False
    module = name[: -len(".weight")]
    return not _NOT_LINEAR.search(module)


_CONV = re.compile(r"(^|\.)(conv\w*|patch_embed\w*|patch_embedding)(\.|$)")
_STATE_SPACE = re.compile(r"(^|\.)(A_log|D|dt_bias)$")
_ROTARY = re.compile(r"(^|\.)(rotary_emb|rotary_embedding|rope)(\.|$)|(^|\.)inv_freq$")  # RoPE's saved buffers (inv_freq, cos/sin caches)


def dense_kind(name: str) -> str | None:
    """Why a floating tensor that is not a Linear weight is copied as it is (``norm``, ``embedding``, ``rotary embedding
    buffer`` (an old checkpoint's saved ``rotary_emb.inv_freq``), ``convolution``, ``vision/audio tower``,
    ``state-space parameter``), or None when no naming rule explains it."""
    module = name.rpartition(".")[0] if name.endswith((".weight", ".bias")) else name
    if DEFAULT_IGNORE_PATTERNS["vision"].search(name):
        return "vision/audio tower"
    if "norm" in module or re.search(r"(^|\.)ln_?\w*$", module):
        return "norm"
    if _ROTARY.search(name):
        return "rotary embedding buffer"
    if _NOT_LINEAR.search(module):
        return "embedding"
    if _CONV.search(module):
        return "convolution"
    if _STATE_SPACE.search(name):
        return "state-space parameter"
    return None


def matches(module: str, patterns: list[str], *, is_linear: bool) -> str | None:
    """The first pattern of ``patterns`` that matches ``module`` (compressed-tensors rules), else None."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return p
        elif p == module or (p == "Linear" and is_linear):
            return p
    return None


def resolve_group(module: str, qcfg: dict, is_linear: bool) -> str | None:
    """The config group of a ``quantization_config`` that applies to ``module`` (None when ignored or untargeted).

    A module matched by ``ignore`` is dense; otherwise exact names win over ``re:`` patterns,
    which win over ``Linear``; ties go to the first group."""
    if matches(module, qcfg.get("ignore") or [], is_linear=is_linear):
        return None
    best = None
    for gname, g in (qcfg.get("config_groups") or {}).items():
        for t in g.get("targets") or []:
            if t == module:
                kind = 0
            elif t.startswith("re:") and re.match(t[3:], module):
                kind = 1
            elif t == "Linear" and is_linear:
                kind = 2
            else:
                continue
            if best is None or kind < best[0]:
                best = (kind, gname)
    return best[1] if best else None


def fused_key(module: str) -> tuple[str, tuple[str, ...]] | None:
    """``(parent, fused set)`` of a fused-set member, else None."""
    parent, _, leaf = module.rpartition(".")
    s = FUSED_OF.get(leaf)
    return (parent, s) if s else None


def fused_set_name(parent: str, members) -> str:
    """How the plan and reports name a fused set: ``parent.{q_proj,k_proj,v_proj}``."""
    return f"{parent}.{{{','.join(members)}}}"


def natural_key(name: str) -> list:
    """Sort key that orders ``layers.9`` before ``layers.10`` (numbers compare as numbers)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def decoder_layer_index(name: str) -> int | None:
    """N of a plain decoder model's ``model.layers.N.`` tensor, else None."""
    m = _DECODER_LAYER.match(name)
    return int(m.group(1)) if m else None


def is_lm_head(module: str) -> bool:
    """Whether ``module`` is a language model's head: ``lm_head``, or one nested in a wrapper (``language_model.lm_head``)."""
    return module == "lm_head" or module.endswith(".lm_head")


def find_embedding(tensors: dict[str, TensorInfo]) -> str | None:
    """The token embedding's tensor name (what a tied ``lm_head`` reads), or None when not unique."""
    for cand in _EMBEDDINGS:
        if cand in tensors:
            return cand
    hits = [n for n in tensors if n.endswith("embed_tokens.weight")]
    return hits[0] if len(hits) == 1 else None


def decoder_layers_prefix(tensors: dict[str, TensorInfo]) -> str | None:
    """The prefix of the text model's decoder layers, ``<P>layers.``, where ``<P>embed_tokens.weight`` is the
    checkpoint's token embedding (:func:`find_embedding`); None where the embedding is not so named (BERT's
    ``embeddings.word_embeddings``, none, several). Towers and resamplers of other namings are not under it."""
    emb = find_embedding(tensors) or ""
    return emb[: -len("embed_tokens.weight")] + "layers." if emb.endswith("embed_tokens.weight") else None


def tie_word_embeddings(config: dict) -> bool:
    """``tie_word_embeddings`` of a config (or of its ``text_config``); False when absent."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    tc = config.get("text_config")
    if isinstance(tc, dict) and "tie_word_embeddings" in tc:
        return bool(tc["tie_word_embeddings"])
    return False


def is_generative(config: dict) -> bool:
    """Whether the architecture builds an ``lm_head`` (``*ForCausalLM``, ``*ForConditionalGeneration``, ``*LMHeadModel``)."""
    return any(a.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) for a in config.get("architectures") or [])


def is_multimodal(config: dict) -> bool:
    """Whether a config nests its text model beside other towers (``text_config``, ``vision_config``, ``audio_config``)."""
    return any(isinstance(config.get(k), dict) for k in ("text_config", "vision_config", "audio_config"))


def loader_patterns(ignored: list[str], linear_modules: set[str], config: dict) -> list[str]:
    r"""``ignore`` patterns that also match the module names loaders build from a legacy multimodal layout.

    LLaVA-style checkpoints store ``language_model.model.*``, ``language_model.lm_head``,
    ``vision_tower.*``, ``multi_modal_projector.*``; transformers 5 renames them on load to
    ``model.language_model.*``, ``lm_head``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``
    (``transformers/conversion_mapping.py``, the ``llava`` family's ``WeightRenaming`` list, release 5.24),
    while vLLM keeps the stored names. For every ignored module of such a layout (a name not under
    ``model.``), a pattern matches both: ``re:(.*\.)?lm_head$`` for the head,
    ``re:(.*\.)?language_model\.(model\.)?X$`` for a text module, and for another component one
    pattern ``re:(.*\.)?vision_tower\..*`` when all its Linear layers are ignored (else one per module).
    Nothing is added for other layouts."""
    if not is_multimodal(config):
        return []
    out: list[str] = []
    groups: dict[str, list[str]] = {}
    for n in ignored:
        if not n.startswith("model.") and n != "lm_head" and "." in n:
            groups.setdefault(n.split(".", 1)[0], []).append(n)
    for comp, names in groups.items():
        if comp == "language_model":
            for n in names:
                rest = n[len("language_model.") :]
                if rest == "lm_head":
                    out.append(r"re:(.*\.)?lm_head$")
                else:
                    out.append(rf"re:(.*\.)?language_model\.(model\.)?{re.escape(rest.removeprefix('model.'))}$")
        elif {m for m in linear_modules if m.startswith(comp + ".")} <= set(names):
            out.append(rf"re:(.*\.)?{re.escape(comp)}\..*")
        else:
            out += [rf"re:(.*\.)?{re.escape(n)}$" for n in names]
    return out
