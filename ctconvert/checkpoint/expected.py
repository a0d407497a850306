"""The tensors a decoder model's architecture expects, judged from the checkpoint's own structure and ``config.json``
(``verify`` without a reference: a foreign checkpoint carries no ctconvert records to compare with).

vLLM 0.33 builds every parameter from the config and then fills it from the stored tensors: a parameter no tensor fills
is refused (``model_loader/default_loader.py`` ``DefaultModelLoader.load_weights``: "Following weights were not
initialized from checkpoint"), and a stored name the model has no parameter for raises in the model's ``load_weights``
(``params_dict[name]``: KeyError) or is dropped unused (llama.py skips "extra bias for GPTQ models"). Neither shows in
any tensor's values. Without a model, these rules judge the stored names of the families in :data:`JUDGED` (read in
each family's vLLM 0.33 file, ``vllm/model_executor/models/``); every other family is not judged (a note says so).
The family is that of the class vLLM builds: ``architectures``' where it names one, else ``model_type``'s
(:func:`.architectures.resolve`, which tells how vLLM 0.33 picks it):

- **Top level**: the text model's token embedding ``<P>embed_tokens.weight`` and final norm ``<P>norm.weight`` are
  stored, ``<P>layers.N.`` being the decoder stack (every judged family's ``...Model`` builds ``embed_tokens``, its
  layers and ``norm``); not judged where the checkpoint stores decoder layers and nothing else (a slice of a model,
  not one to serve). A missing untied ``lm_head`` is :func:`.widths.tied_head_problems`' error. Every other tensor
  outside the decoder layers is one the class builds (its head, a VLM's tower) or its loader drops (RoPE buffers),
  else an error: :func:`.top_level.top_level_problems`; not judged where the class is one verify does not know (a
  note says so).
- **Decoder layers alike** (:func:`layer_problems`): a judged family builds every decoder layer below
  ``num_hidden_layers`` with the same attention and norms, and every MLP of one kind (dense, or MoE: DeepSeek's
  ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers``/``decoder_sparse_step`` make some layers dense) alike
  (llama.py ``LlamaDecoderLayer``, qwen3_moe.py ``Qwen3MoeDecoderLayer``, deepseek_v2.py ``DeepseekV2DecoderLayer``,
  gpt_oss.py ``TransformerBlock`` ...; sliding and full attention layers hold the same parameters). So every layer
  must hold the same parameters but for its MLP, and every MLP of one kind the same: a parameter most layers of a kind
  hold is missing from the others, one that few hold is extra (two layers that disagree: one of the two).
  A parameter is a tensor's name but for a quantized module, whose ``weight_packed``/``weight_scale``/... stand for
  its ``weight`` (:data:`.modules.QUANT_PARTS`), and activation and KV-cache scales, which the config's quantization
  explains (:mod:`.conformance` judges them). MTP layers past ``num_hidden_layers`` are not compared.
- **Experts alike** (:func:`expert_problems`): every expert of a block stored one Linear per expert holds the same
  projections (the minority is the stray: a projection most experts hold is missing from the others, one few hold is
  extra; in a layer-set family the set's projections are the ones expected) (vLLM's ``FusedMoE`` fills ``w13``/``w2`` of every expert: ``fused_moe/layer.py``
  ``make_expert_params_mapping``), in a judged family every expert of the model the same ones, at least the family's
  gate, up and down (:data:`.families.FAMILIES` names); a fused 3-D block (gpt-oss) holds ``gate_up_proj`` and
  ``down_proj`` and both biases or neither (gpt_oss.py ``_load_weights_other``). A judged family's MoE block holds its
  router beside its experts (``gate``; ``router`` for gpt-oss) and the experts beside its router.
- **Biases against the config** (:data:`_BIASES`): where the family's vLLM file reads the attention or MLP bias from
  the config (or fixes it), each stored q/k/v/o (and llama's gate/up/down) projection holds a bias exactly when it
  says so (llama.py ``LlamaModel``, mistral.py and phi3.py too: ``attention_bias`` or ``bias``, ``qkv_bias`` for
  q/k/v, ``mlp_bias``; Phi-3's fused ``qkv_proj``/``gate_up_proj`` as their members; qwen2.py and qwen2_moe.py: q/k/v
  always; qwen3.py, qwen3_moe.py, glm4_moe.py: ``attention_bias``; gemma2.py, gemma3.py: ``attention_bias`` for all
  four; gpt_oss.py: always; mixtral.py, deepseek_v2.py, olmoe.py: never).

- **Each layer's parameters** (:func:`set_problems`): for the families of :data:`.layer_params.LAYER_FILES` (llama,
  mistral, phi3, qwen2 and its VL models' text layers, qwen3, gemma2, gemma3, mixtral, qwen2_moe, qwen3_moe,
  deepseek_v2/v3 and kimi_k2 (MLA, no indexer: :func:`.layer_params.has_layer_set`), glm4_moe, olmoe, gpt_oss),
  every decoder layer below ``num_hidden_layers`` holds exactly the parameters its vLLM 0.33 decoder layer builds
  (:func:`.layer_params.layer_parameters`: that module names each file and class; a fused ``qkv_proj``/``gate_up_proj``
  or its members, as the layer stores it, where the loader takes both): one it lacks is missing, one it stores that
  the layer has none for is extra, in one layer or in all (the layer-alike rule cannot see those), and a
  layer storing nothing is missing; a checkpoint of decoder layers only is judged by the layer-alike rule. RoPE
  buffers vLLM drops (``utils.py`` ``AutoWeightsLoader`` ``REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``) are left out by
  :func:`parameters`. These families skip the layer-alike rule.

What a rule cannot judge says nothing: in a family without a layer set, a parameter stored in every layer that the
architecture lacks (but a bias) or a whole sub-block missing from every layer; MTP layers past ``num_hidden_layers``;
a checkpoint whose decoder stack is not found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import agree, plural
from .architectures import family_class, resolve, vllm_types
from .families import FAMILIES, config_value, model_types
from .layer_params import LAYER_FILES, has_layer_set, layer_parameters, stored_form
from .modules import ACT_PARTS, KV_PARTS, QUANT_PARTS, Module
from .naming import natural_key
from .reader import Checkpoint, Problem
from .top_level import rotary_dropped, top_level_problems

__all__ = ["EXPECTED_CHECK", "JUDGED", "builds_bias", "expected_problems", "expert_problems", "is_router_bias", "layer_problems", "parameters", "set_problems"]

#: the line ``verify`` lists among its checks
EXPECTED_CHECK = (
    "every tensor the architecture builds is stored and none it lacks (decoder layers and outside them, experts, routers, biases; "
    "judged families, as architectures names the class)"
)


def _attr(key: str, default: bool = False):
    return lambda cfg: bool(cfg.get(key, default))


def _llama_qkv(cfg: dict) -> bool:
    """vLLM 0.33 llama.py ``LlamaDecoderLayer``: ``qkv_bias`` where the config has it, else ``attention_bias`` or ``bias``."""
    return bool(cfg["qkv_bias"]) if "qkv_bias" in cfg else bool(cfg.get("attention_bias") or cfg.get("bias"))


def _llama_o(cfg: dict) -> bool:
    return bool(cfg.get("attention_bias") or cfg.get("bias"))


def _always(cfg: dict) -> bool:
    return True


def _never(cfg: dict) -> bool:
    return False


@dataclass(frozen=True)
class _Biases:
    """Whether vLLM 0.33 builds a bias for q/k/v, o and (llama) the dense MLP's gate/up/down, from the text config;
    None: not judged."""

    qkv: object = None
    o: object = None
    mlp: object = None


#: model_type -> the biases its vLLM 0.33 file builds (module docstring: the files and the config keys they read)
_BIASES = {
    **dict.fromkeys(("llama", "mistral", "phi3"), _Biases(_llama_qkv, _llama_o, _attr("mlp_bias"))),
    **dict.fromkeys(("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen2_moe"), _Biases(_always, _never)),
    **dict.fromkeys(("qwen3", "qwen3_moe", "glm4_moe"), _Biases(_attr("attention_bias"), _never)),
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text"), _Biases(_attr("attention_bias"), _attr("attention_bias"))),
    "gpt_oss": _Biases(_always, _always),
    **dict.fromkeys(("mixtral", "deepseek_v2", "deepseek_v3", "kimi_k2", "olmoe"), _Biases(_never, _never)),
}

#: the judged families (config ``model_type``, outer or ``text_config``'s) and the vLLM 0.33 file that builds each;
#: their decoder layers differ by MLP kind only (module docstring)
JUDGED = {
    "llama": "llama.py",
    "mistral": "mistral.py (llama.py's layers)",
    "qwen2": "qwen2.py",
    "qwen2_vl": "qwen2_vl.py (qwen2.py's layers)",
    "qwen2_5_vl": "qwen2_5_vl.py (qwen2.py's layers)",
    "qwen3": "qwen3.py",
    "qwen2_moe": "qwen2_moe.py",
    "qwen3_moe": "qwen3_moe.py",
    "gemma2": "gemma2.py",
    "gemma3": "gemma3_mm.py (gemma3.py's layers)",
    "gemma3_text": "gemma3.py",
    "phi3": "phi3.py (llama.py's layers)",
    "mixtral": "mixtral.py",
    "deepseek_v2": "deepseek_v2.py",
    "deepseek_v3": "deepseek_v2.py",
    "kimi_k2": "deepseek_v2.py",
    "glm4_moe": "glm4_moe.py",
    "olmoe": "olmoe.py",
    "gpt_oss": "gpt_oss.py",
}
#: the router's leaf name beside the experts, where it is not ``gate``
_ROUTER_NAME = {"gpt_oss": "router"}
#: model_type -> whether its vLLM 0.33 file builds the router's ``e_score_correction_bias`` (deepseek_v2.py
#: ``DeepseekV2MoE``: where ``topk_method`` is ``noaux_tc``; glm4_moe.py ``Glm4MoE``: always)
_ROUTER_BIAS = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "kimi_k2"), lambda cfg: cfg.get("topk_method") == "noaux_tc"),
    "glm4_moe": _always,
}
#: why a DeepSeek router's stored e_score_correction_bias is refused where topk_method is not noaux_tc
_NO_ROUTER_BIAS = (
    'vLLM 0.33 deepseek_v2.py DeepseekV2MoE builds that parameter only where getattr(config, "topk_method", None) == "noaux_tc" '
    "(config.json topk_method: {}), so its load_weights has no parameter for it (KeyError) and vLLM refuses the checkpoint{}: "
    'set "topk_method": "noaux_tc" in the source\'s config.json if its router was trained with that bias, then convert again'
)
#: what the message adds where config.json has no topk_method (a transformers-saved DeepSeek-V3: its config class has none)
_NO_TOPK_METHOD = "; transformers' DeepseekV3Config saves none, while the Hub's DeepSeek-V3 and Kimi-K2 configs hold noaux_tc"
#: the text decoder stacks looked for when no token embedding names one (a deleted embedding)
_STACKS = ("model.layers.", "model.language_model.layers.", "language_model.model.layers.")
_MLP_ROOTS = ("mlp", "block_sparse_moe", "feed_forward")
_MOE_PART = re.compile(r"(^|\.)(experts|shared_experts?|router|gate|shared_expert_gate)\.")
_PER_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")
_ATTN_LEAF = re.compile(r"^self_attn\.(q_proj|k_proj|v_proj|qkv_proj|o_proj)\.(weight|bias)$")  # qkv_proj: Phi-3's fused
_MLP_LEAF = re.compile(r"^mlp\.(gate_proj|up_proj|gate_up_proj|down_proj)\.(weight|bias)$")
_FUSED_MEMBER = re.compile(r"^(gate_up_proj|down_proj)(_bias|\.bias|\.weight)?$")


def parameters(mods: dict[str, Module]) -> dict[str, str]:
    """The model parameters a checkpoint stores, each with one stored tensor's name: a quantized module's
    :data:`.modules.QUANT_PARTS` (and FP8's ``weight``) stand for its ``weight``, activation and KV-cache scales
    (:data:`.modules.ACT_PARTS`, :data:`.modules.KV_PARTS`; the quantization's, not the architecture's) and the RoPE
    buffers vLLM 0.33's loader drops (:func:`.top_level.rotary_dropped`: ``rotary_emb.inv_freq`` ... exactly; a
    ``rope.inv_freq`` it has no parameter for, and refuses) are left out; every other tensor is itself."""
    out: dict[str, str] = {}
    for m in mods.values():
        for part in m.parts:
            if part in ACT_PARTS or part in KV_PARTS:
                continue
            leaf = "weight" if m.quantized and (part in QUANT_PARTS or part == "weight") else part
            name = f"{m.name}.{leaf}" if m.name else leaf
            if rotary_dropped(f"{m.name}.{part}"):
                continue
            out.setdefault(name, f"{m.name}.{part}" if m.name else part)
    return out


def _family(config: dict) -> str | None:
    """The judged family of the class vLLM 0.33 builds for ``config`` (:func:`.architectures.vllm_types`), or None."""
    return next((t for t in vllm_types(config) if t in JUDGED), None)


def _stack(params: dict[str, str]) -> str | None:
    """``<P>layers.`` of the text decoder: the one beside ``<P>embed_tokens.weight``, else the first of :data:`_STACKS` stored."""
    for name in params:
        if name.endswith("embed_tokens.weight"):
            cand = name[: -len("embed_tokens.weight")] + "layers."
            if any(n.startswith(cand) for n in params):
                return cand
    return next((s for s in _STACKS if any(n.startswith(s) for n in params)), None)


def expected_problems(ckpt: Checkpoint, mods: dict[str, Module]) -> list[Problem]:
    """The errors of the module docstring's rules for one checkpoint, or one note where its family is not judged.

    ``ckpt``: the checkpoint (its ``config`` and tensors); ``mods``: its modules (:func:`.modules.modules_of`). Each
    error names one tensor (or module) and a file: the stored tensor's shard, or for a missing one the index (the
    only shard where there is none). Nothing where the config is not a dict or no module is stored."""
    config = ckpt.config
    if not isinstance(config, dict) or not mods:
        return []
    params = parameters(mods)
    file_of = _file_namer(ckpt, params)
    family = _family(config)
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out = expert_problems(params, config, file_of, family is not None, _expert_leaves(family, cfg))
    if family is None:
        types = ", ".join(repr(t) for t in model_types(config)) or "none"
        why = f"model_type {types} is not among the families whose layers verify knows ({', '.join(sorted(JUDGED))})"
        return out + [Problem("note", f"missing or extra tensors are not judged without --reference: {why}")]
    stack = _stack(params)
    if stack is None:
        return out + [Problem("note", f"missing or extra tensors are not judged: no decoder stack ({', '.join(_STACKS)}) is stored")]
    top = stack[: -len("layers.")]
    fragment = all(n.startswith(stack) for n in params)  # decoder layers only (a test's or a shard's slice): no top level to judge
    for leaf, what in (("embed_tokens.weight", "token embedding"), ("norm.weight", "final norm")):
        if top + leaf not in params and not fragment:
            why = f"missing: the {what}, which vLLM 0.33 {JUDGED[family]} builds, is not stored: vLLM refuses a parameter no tensor fills"
            out.append(Problem("error", why, file_of(top + leaf), top + leaf))
    cls = family_class(family, config)
    if cls is not None and not fragment:
        out += top_level_problems(params, stack, cls, file_of)
    elif not fragment:
        out.append(Problem("note", f"the tensors outside the decoder layers are not judged: {_unknown_class(config)}"))
    out += _bias_problems(params, stack, family, cfg, file_of) + _router_problems(params, stack, family, cfg, file_of)
    n = config_value(config, "num_hidden_layers")
    if has_layer_set(family, cfg) and not fragment:  # a slice of decoder layers (a test's, a shard's): alike only
        return out + set_problems(params, stack, family, cfg, n, file_of, {p.tensor for p in out})
    return out + layer_problems(params, stack, n, file_of, {p.tensor for p in out})


def _unknown_class(config: dict) -> str:
    """Why the class vLLM 0.33 builds for ``config`` is not known (:func:`.architectures.family_class` None)."""
    r = resolve(config)
    if r.architecture is not None:
        return f"architectures' first entry {r.architecture!r} is not a class whose modules verify knows (vLLM 0.33 builds it if its registry holds it)"
    return f"model_type {config.get('model_type')!r} wraps the {_family(config)!r} text model in a class verify does not know"


def _file_namer(ckpt: Checkpoint, params: dict[str, str]):
    """``name -> file``: a stored parameter's shard; for a missing one (or a module) the shard of the nearest module
    above it that is stored (its layer's, its block's), else the index (the only shard, the folder where neither is one)."""
    if ckpt.index is not None:
        fallback = str(ckpt.path / "model.safetensors.index.json")
    else:
        fallback = str(ckpt.files[0]) if len(ckpt.files) == 1 else str(ckpt.path)

    below: dict[str, str] = {}  # module prefix -> the shard of the first stored tensor below it (made at the first miss)

    def file_of(name: str) -> str:
        info = ckpt.tensors.get(params.get(name, name))
        if info is not None:
            return str(info.file)
        if not below:  # once, not a scan of every tensor per missing name (a MoE's errors can number thousands)
            for t in params.values():
                prefix = t
                while "." in prefix:
                    prefix = prefix.rpartition(".")[0]
                    below.setdefault(prefix, str(ckpt.tensors[t].file))
        prefix = name
        while "." in prefix:
            prefix = prefix.rpartition(".")[0]
            if prefix in below:
                return below[prefix]
        return fallback

    return file_of


def _layers(params: dict[str, str], stack: str, n: int | None) -> dict[int, dict[str, list[str]]]:
    """Decoder layer -> its parameters' names relative to it, per-expert indices as ``*`` (below ``n`` when given), each
    with the parameter names it stands for (one, or one per expert)."""
    pat = re.compile(re.escape(stack) + r"(\d+)\.(.+)$")
    out: dict[int, dict[str, list[str]]] = {}
    for name in params:
        m = pat.match(name)
        if m and (n is None or int(m[1]) < n):
            out.setdefault(int(m[1]), {}).setdefault(_PER_EXPERT.sub(r"\1experts.*.", m[2]), []).append(name)
    return out


def _is_mlp(rel: str) -> bool:
    return rel.split(".", 1)[0] in _MLP_ROOTS


def layer_problems(params: dict[str, str], stack: str, n: int | None, file_of, skip: set[str] = frozenset()) -> list[Problem]:
    """Errors where decoder layers of one kind hold different parameters (module docstring): per parameter, the layers
    that lack it (most layers hold it) or hold it extra (few do). ``params``: :func:`parameters`; ``stack``:
    ``<P>layers.``; ``n``: the config's ``num_hidden_layers`` (layers at or past it, MTP, not compared; None: all);
    ``skip``: tensor names another rule reported already (their parameter is not compared in any layer)."""
    layers = _layers(params, stack, n)
    skip = set().union(*_layers(dict.fromkeys(skip, ""), stack, None).values())  # relative to their layer
    rest = {i: {r for r in rels if not _is_mlp(r)} for i, rels in layers.items()}
    mlp = {i: {r for r in rels if _is_mlp(r)} for i, rels in layers.items()}
    out = _differ(rest, stack, "decoder layers", params, file_of, skip)
    for moe in (False, True):
        kind = {i: rels for i, rels in mlp.items() if any(_MOE_PART.search(r) for r in rels) == moe}
        out += _differ(kind, stack, "MoE layers" if moe else "dense-MLP layers", params, file_of, skip)
    return out


def _differ(sets: dict[int, set[str]], stack: str, what: str, params: dict[str, str], file_of, skip: set[str]) -> list[Problem]:
    if len(sets) < 2:
        return []
    out = []
    total = len(sets)
    for rel in sorted(set().union(*sets.values()), key=natural_key):
        held = sorted(i for i, s in sets.items() if rel in s)
        lack = sorted(i for i in sets if i not in held)
        if not lack:
            continue
        if 2 * len(held) >= total:  # most hold it (or half, as in a two-layer model): missing from the others
            name = _name(stack, lack[0], rel)
            if rel in skip:
                continue
            if 2 * len(held) > total:
                others = f"the other {len(held)} {agree(len(held), 'holds', 'hold')}"
            else:
                one = len(held) == 1
                others = f"layer{'' if one else 's'} {_list(held)} {'holds' if one else 'hold'} (or {'that holds' if one else 'those hold'} it extra)"
            msg = f"missing: {plural(len(lack), 'layer')} ({_list(lack)}) of the {total} {what} {agree(len(lack), 'lacks', 'lack')} {rel}, which {others}"
            out.append(Problem("error", f"{msg}: vLLM 0.33 builds these layers alike and refuses a parameter no tensor fills", file_of(name), name))
        else:
            name = _name(stack, held[0], rel)
            if rel in skip:
                continue
            msg = f"extra: {rel} is stored in {plural(len(held), 'layer')} ({_list(held)}) of the {total} {what} and not in the other {len(lack)}"
            out.append(Problem("error", f"{msg}: vLLM 0.33 builds these layers alike and has no parameter for it", file_of(name), name))
    return out


_FUSED_EXPERTS = re.compile(r"(^|\.)experts\.(?!\d)")  # a fused 3-D expert block's names (``experts.gate_up_proj``)


def set_problems(params: dict[str, str], stack: str, family: str, cfg: dict, n: int | None, file_of, skip=frozenset(), fragment=False) -> list[Problem]:
    """Errors where a decoder layer below ``n`` lacks a parameter of its family's set (:func:`.layer_params.layer_parameters`)
    or stores one the set lacks: one error per parameter, naming the first layer. A layer below ``n`` storing nothing
    is missing (unless ``fragment``: decoder layers only). Not judged here: the q/k/v/o and dense-MLP biases the bias
    rule judges, the experts' projections (the expert rule's: missing per expert, here only names outside the set),
    a fused expert block, tensors in ``skip`` (another rule's), layers at or past ``n`` (MTP)."""
    held = _layers(params, stack, n)  # layer -> relative parameter (experts as *) -> its stored names
    if not held:
        return []
    where, rule = f"vLLM 0.33 {LAYER_FILES[family]}", _BIASES.get(family)
    missing: dict[str, list[int]] = {}
    extra: dict[str, list[int]] = {}
    out = []
    for i in range(n if n is not None and not fragment else max(held) + 1):
        if i not in held:
            if not fragment and n is not None:
                name = _name(stack, i, "")[:-1]
                msg = f"missing: decoder layer {i} of the config's {n} stores no tensor, and {where} builds it: vLLM refuses a parameter no tensor fills"
                out.append(Problem("error", msg, file_of(name), name))
            continue
        want, delegated = layer_parameters(family, cfg, i)
        want = stored_form(family, want, held[i])  # fused qkv_proj/gate_up_proj or their members, as stored
        for rel in sorted(want - set(held[i]), key=natural_key):
            if "*" not in rel and _name(stack, i, rel) not in skip:
                missing.setdefault(rel, []).append(i)
        for rel, names in held[i].items():
            bias = _ATTN_LEAF.match(rel) or _MLP_LEAF.match(rel)
            judged = bias is not None and bias[2] == "bias" and rule is not None and _wants_bias(rule, bias[1], cfg) is not None
            if rel in want or judged or rel.startswith(delegated) or _FUSED_EXPERTS.search(rel) or all(x in skip for x in names):
                continue
            extra.setdefault(rel, []).append(i)
    for rel, layers in sorted(missing.items(), key=lambda kv: natural_key(kv[0])):
        name = _name(stack, layers[0], rel)
        msg = f"missing: {plural(len(layers), 'decoder layer')} ({_list(layers)}) of {len(held)} {agree(len(layers), 'lacks', 'lack')} {rel}"
        out.append(Problem("error", f"{msg}, which {where} builds in every such layer: vLLM refuses a parameter no tensor fills", file_of(name), name))
    for rel, layers in sorted(extra.items(), key=lambda kv: natural_key(kv[0])):
        name = next(x for x in sorted(held[layers[0]][rel], key=natural_key) if x not in skip)
        msg = f"extra: {rel} is stored in {plural(len(layers), 'decoder layer')} ({_list(layers)}) of {len(held)}"
        out.append(Problem("error", f"{msg}, which {where} does not build: its loader has no parameter to load it into", file_of(name), name))
    return out


def _name(stack: str, layer: int, rel: str) -> str:
    return f"{stack}{layer}.{rel}"


def _list(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:6])) + (f", ... ({len(xs) - 6} more)" if len(xs) > 6 else "")


def _bias_problems(params: dict[str, str], stack: str, family: str, cfg: dict, file_of) -> list[Problem]:
    """A q/k/v/o (llama: and dense gate/up/down) bias stored where the family's vLLM file builds none, or missing
    where it builds one (:data:`_BIASES`)."""
    rule = _BIASES.get(family)
    if rule is None:
        return []
    pat = re.compile(re.escape(stack) + r"\d+\.(.+)$")
    out = []
    for name in sorted(params, key=natural_key):
        m = pat.match(name)
        leaf = (_ATTN_LEAF.match(m[1]) or _MLP_LEAF.match(m[1])) if m else None
        want = None if leaf is None else _wants_bias(rule, leaf[1], cfg)
        if want is None:
            continue
        key, where = _bias_key(family, leaf), f"vLLM 0.33 {JUDGED[family]}"
        if leaf[2] == "bias" and not want:
            msg = f"extra: with config.json's {key}, {where} builds {leaf[1]} without a bias and has no parameter for this one"
            out.append(Problem("error", msg, file_of(name), name))
        elif leaf[2] == "weight" and want and (bias := name[: -len("weight")] + "bias") not in params:
            msg = f"missing: with config.json's {key}, {where} builds {leaf[1]} with a bias, which no tensor fills"
            out.append(Problem("error", msg, file_of(bias), bias))
    return out


def builds_bias(family: str | None, member: str, cfg: dict) -> bool | None:
    """Whether the vLLM 0.33 file of ``family`` (a ``model_type``) builds projection ``member`` (``q_proj``, ``o_proj``,
    ``gate_proj`` ...) of a decoder layer with a bias under the text config ``cfg`` (:data:`_BIASES`); None: not judged."""
    return _wants_bias(_BIASES.get(family), member, cfg)


def _wants_bias(rule: _Biases | None, member: str, cfg: dict) -> bool | None:
    """Whether the family of ``rule`` builds projection ``member`` with a bias (None: not judged)."""
    if rule is None:
        return None
    fn = rule.mlp if member in ("gate_proj", "up_proj", "gate_up_proj", "down_proj") else rule.o if member == "o_proj" else rule.qkv
    return None if fn is None else fn(cfg)


def _bias_key(family: str, leaf: re.Match) -> str:
    """The config key the family's vLLM file reads for ``leaf``'s bias, for the message."""
    if leaf[1] in ("gate_proj", "up_proj", "gate_up_proj", "down_proj"):
        return "mlp_bias"
    if family in ("llama", "mistral", "phi3"):
        return "attention_bias (qkv_bias for q/k/v where present)"
    if family in ("qwen3", "qwen3_moe", "glm4_moe", "gemma2", "gemma3", "gemma3_text"):
        return "attention_bias"
    return f"model_type {family!r} (fixed)"


def _router_problems(params: dict[str, str], stack: str, family: str, cfg: dict, file_of) -> list[Problem]:
    """A judged MoE block that holds experts and no router, or a router and no experts; a router without the
    ``e_score_correction_bias`` its family builds (:data:`_ROUTER_BIAS`), and one stored where it builds none (DeepSeek
    with ``topk_method`` not ``noaux_tc``, absent included: a config transformers 5 saved drops it, and vLLM 0.33 reads
    ``getattr(config, "topk_method", None)``)."""
    router = _ROUTER_NAME.get(family, "gate")
    blocks: dict[str, set[str]] = {}
    pat = re.compile(re.escape(stack) + r"\d+\.(?:" + "|".join(_MLP_ROOTS) + r")\.")
    for name in params:
        m = pat.match(name)
        if m:
            blocks.setdefault(m[0][:-1], set()).add(name[m.end() :])
    out = []
    for block, rels in sorted(blocks.items(), key=lambda kv: natural_key(kv[0])):
        experts = any(r.startswith("experts.") for r in rels)
        routed = f"{router}.weight" in rels
        if experts and not routed:
            msg = f"missing: MoE block {block} stores experts but no router ({router}.weight), which vLLM 0.33 {JUDGED[family]} builds and no tensor fills"
            out.append(Problem("error", msg, file_of(block), f"{block}.{router}.weight"))
        elif routed and not experts:
            msg = f"missing: MoE block {block} stores a router but no experts, which vLLM 0.33 {JUDGED[family]} builds and no tensor fills"
            out.append(Problem("error", msg, file_of(block), f"{block}.experts"))
        rule, name = _ROUTER_BIAS.get(family), f"{block}.{router}.e_score_correction_bias"
        if routed and rule is not None and rule(cfg) and f"{router}.e_score_correction_bias" not in rels:
            out.append(Problem("error", f"missing: {_router_bias_missing(family, cfg)}", file_of(name), name))
        elif rule is not None and not rule(cfg) and f"{router}.e_score_correction_bias" in rels:
            out.append(Problem("error", f"extra: {_router_bias_unbuilt(name, cfg)}", file_of(name), name))
    return out


def _router_bias_missing(family: str, cfg: dict) -> str:
    """Why a router without ``e_score_correction_bias`` is refused where the family's vLLM 0.33 file builds one."""
    return f"the router lacks e_score_correction_bias, which vLLM 0.33 {JUDGED[family]} builds (topk_method {cfg.get('topk_method')!r}) and refuses unfilled"


def _router_bias_unbuilt(name: str, cfg: dict) -> str:
    """Why router bias ``name`` (stored) has no parameter in vLLM 0.33 under text config ``cfg`` (:data:`_NO_ROUTER_BIAS`)."""
    method, why = (repr(cfg["topk_method"]), "") if "topk_method" in cfg else ("absent", _NO_TOPK_METHOD)
    return f"{name} is stored, but {_NO_ROUTER_BIAS.format(method, why)}"


def is_router_bias(problem: Problem) -> bool:
    """Whether ``problem`` is one :func:`expected_problems` gives of a router's ``e_score_correction_bias`` (stored
    where vLLM 0.33 builds none, or missing where it builds one): what :func:`router_bias_problem` says of the source."""
    return (problem.tensor or "").endswith(".e_score_correction_bias") and problem.message.startswith(("missing: ", "extra: "))


def router_bias_problem(config: dict, names) -> tuple[str, int] | None:
    """What :func:`expected_problems` will say of the first MoE router among tensor ``names`` whose
    ``e_score_correction_bias`` disagrees with the family's vLLM 0.33 file, and how many routers do: one stored where it
    builds none (DeepSeek-V2/V3, Kimi-K2 with ``topk_method`` not ``noaux_tc``, absent included) or none stored where it
    builds one (those with ``noaux_tc``, GLM-4.5); None where every router agrees or the family has no such rule. Scans
    the names once: ``quantize`` asks it of its source in its plan (a note), where the whole check would cost a MoE's
    plan as much again."""
    if not isinstance(config, dict) or (rule := _ROUTER_BIAS.get(family := _family(config))) is None:
        return None
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    router = "." + _ROUTER_NAME.get(family, "gate") + "."
    routers, biases = [], set()
    for n in names:
        if n.endswith(router + "weight") and ".experts." not in n:
            routers.append(n[: -len("weight")])
        elif n.endswith(router + "e_score_correction_bias"):
            biases.add(n[: -len("e_score_correction_bias")])
    if not rule(cfg):
        stored = sorted(biases, key=natural_key)
        return (f"extra: {_router_bias_unbuilt(stored[0] + 'e_score_correction_bias', cfg)}", len(stored)) if stored else None
    bare = sorted((r for r in routers if r not in biases), key=natural_key)
    return (f"missing: {bare[0]}e_score_correction_bias: {_router_bias_missing(family, cfg)}", len(bare)) if bare else None


def _expert_leaves(family: str | None, cfg: dict) -> set[str] | None:
    """The per-expert projections (``w1.weight`` ...) the family's decoder layer set names (:mod:`.layer_params`), or
    None where it names none (not a set family, gpt-oss's experts judged alone)."""
    if not has_layer_set(family, cfg):
        return None
    n = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else 1
    rels = set().union(*(layer_parameters(family, cfg, i)[0] for i in range(max(n, 1))))
    return {r.split("experts.*.", 1)[1] for r in rels if "experts.*." in r} or None


def expert_problems(params: dict[str, str], config: dict, file_of, judged: bool, leaves: set[str] | None = None) -> list[Problem]:
    """Per-expert blocks whose experts hold different projections (every family: vLLM's ``FusedMoE`` fills every
    expert's): a projection most experts of the block hold (half, of two), or in a ``judged`` family (:data:`JUDGED`)
    one the model's other blocks' experts mostly hold or one of the family's gate/up/down (:data:`.families.FAMILIES`),
    is missing from the experts that lack it; any other is extra where stored (the stray is the minority). ``leaves``:
    the family's exact per-expert projections (:func:`_expert_leaves`): those are missing where absent, any other extra.
    Fused 3-D blocks without both members (or with one member's bias only). ``file_of``: as :func:`expected_problems`
    makes it."""
    blocks: dict[str, dict[int, set[str]]] = {}
    fused: dict[str, set[str]] = {}
    for name in params:
        if m := re.match(r"^(.*(?:^|\.)experts)\.(\d+)\.(.+)$", name):
            blocks.setdefault(m[1], {}).setdefault(int(m[2]), set()).add(m[3])
        elif (f := re.match(r"^(.*(?:^|\.)experts)\.(.+)$", name)) and (member := _FUSED_MEMBER.match(f[2])):
            fused.setdefault(f[1], set()).add(member[1] + ("_bias" if member[2] in ("_bias", ".bias") else ""))
    layout = next((FAMILIES[t] for t in vllm_types(config) if t in FAMILIES), None)
    wanted = {f"{leaf}.weight" for leaf in layout.names} if judged and layout is not None else set()
    major = {b: {leaf for leaf in set().union(*ex.values()) if 2 * sum(leaf in s for s in ex.values()) >= len(ex)} for b, ex in blocks.items()}
    model_wide = set().union(*major.values()) if judged and blocks else set()
    out = []
    for block, experts in sorted(blocks.items(), key=lambda kv: natural_key(kv[0])):
        expect = leaves if leaves is not None else major[block] | model_wide | wanted
        for e in sorted(experts):
            for leaf in sorted(expect - experts[e]):
                where = (
                    "the family's experts hold"
                    if leaves is not None or (leaf in wanted and leaf not in major[block])
                    else "the other experts of this block hold"
                    if leaf in major[block]
                    else "the model's other experts hold"
                )
                msg = f"missing: expert {e} of {block} lacks {leaf}, which {where}: vLLM 0.33 fills every expert's and refuses a parameter no tensor fills"
                out.append(Problem("error", msg, file_of(f"{block}.{e}"), f"{block}.{e}.{leaf}"))
            for leaf in sorted(experts[e] - expect):
                holders = sum(leaf in s for s in experts.values())
                why = "no other expert of this block holds it" if holders == 1 else f"{holders} of the block's {len(experts)} experts hold it"
                why += "; the family's experts hold " + ", ".join(sorted(expect)) if leaves is not None else ""
                msg = f"extra: expert {e} of {block} holds {leaf} ({why}): vLLM 0.33 has no parameter for it"
                out.append(Problem("error", msg, file_of(f"{block}.{e}.{leaf}"), f"{block}.{e}.{leaf}"))
    for block, members in sorted(fused.items(), key=lambda kv: natural_key(kv[0])):
        want = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if any(m.endswith("_bias") for m in members) else set())
        for missing in sorted(want - members):
            msg = f"missing: fused experts {block} hold {', '.join(sorted(members))} but not {missing}: vLLM 0.33 loads both (gpt_oss.py _load_weights_other)"
            out.append(Problem("error", msg, file_of(block), f"{block}.{missing}"))
    return out
