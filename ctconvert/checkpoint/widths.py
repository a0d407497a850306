"""``config.json``'s widths (hidden, vocabulary, MLP and expert sizes) and tied head against the tensors a checkpoint
stores (``verify``, no reference needed).

vLLM 0.33 builds every parameter from the config and then copies the checkpoint's tensors in: ``llama.py``
``LlamaModel``/``LlamaAttention``/``LlamaMLP`` build ``VocabParallelEmbedding(vocab_size, hidden_size)``,
``RMSNorm(hidden_size)``, ``QKVParallelLinear(hidden_size, ...)``, ``MergedColumnParallelLinear(hidden_size,
[intermediate_size] * 2)`` and ``RowParallelLinear(intermediate_size, hidden_size)``; the MoE models build
``FusedMoE(intermediate_size=config.moe_intermediate_size)`` (``qwen3_moe.py``, ``deepseek_v2.py``) or
``config.intermediate_size`` (``mixtral.py``, ``gpt_oss.py``, ``llama4.py``). Their weight loaders assert each stored
shape (``linear.py`` ``weight_loader``: ``param_data.shape == loaded_weight.shape``; ``vocab_parallel_embedding.py``
``VocabParallelEmbedding.weight_loader``: rows ``== org_vocab_size``), so a config edited after the run (a trial
changed ``hidden_size``, ``intermediate_size``, ``moe_intermediate_size``, ``vocab_size``) gives a model vLLM
refuses, which no tensor value shows. :func:`size_problems` compares, in the language model's decoder stack
``<P>layers.N.`` (where ``<P>embed_tokens.weight`` is the token embedding, as :func:`.files_check.attention_shape_problems`
finds it; vision towers skipped), with the ``text_config``'s sizes where there is one (as that function reads them: a
VLM's text model is built from its ``text_config``, never from top-level keys):

- ``hidden_size``: the embedding's columns; the elements of ``<P>norm.weight`` and of each layer's
  ``input_layernorm``/``post_attention_layernorm``; the inputs (K) of the Linears that read the residual stream
  (``self_attn.`` q/k/v, ``qkv_proj``, MLA ``q_a_proj``/``kv_a_proj_with_mqa``; gate/up, ``gate_up_proj``,
  ``w1``/``w3`` of a layer's ``mlp``/``block_sparse_moe``/``feed_forward``, of its experts and shared experts) and
  the output rows (N) of those writing into it (``o_proj``, ``down_proj``, ``w2``). Only modules directly under a
  layer's attention or MLP are judged: Zamba's shared transformer (``2 x hidden_size`` inputs), cross-attention and
  the towers of other architectures have other widths. A config with ``word_embed_proj_dim`` or ``embedding_size``
  (OPT, ALBERT: an embedding narrower than the layers) is not judged on the embedding.
- ``vocab_size``: the embedding's rows, and the output rows of a stored ``lm_head`` (not judged with
  ``draft_vocab_size``, an EAGLE draft's own head). Equal: vLLM's loader asserts it; but for Mllama, whose
  embedding vLLM 0.33 builds ``vocab_size + 8`` rows (``mllama.py`` ``MllamaTextModel``: the image tokens).
- ``intermediate_size``: the output rows of a dense ``mlp.gate_proj``/``mlp.up_proj`` and the inputs of
  ``mlp.down_proj`` (not judged where Gemma 4's ``use_double_wide_mlp`` doubles some layers, or Nemotron-NAS
  ``block_configs`` sets each layer's); ``feed_forward`` MLPs are not judged (Llama-4 builds them
  ``intermediate_size_mlp`` wide). Routed experts (``experts.E.`` gate/up/``w1``/``w3`` rows, down/``w2`` inputs)
  against ``moe_intermediate_size`` where the config has that key, else ``intermediate_size``. Shared experts
  against ``shared_expert_intermediate_size`` (Qwen2-MoE, Qwen3-Next), else ``moe_intermediate_size x
  n_shared_experts`` (DeepSeek, GLM-4.5: transformers 5.25 ``DeepseekV3MoE``) where the config names no other
  shared width; otherwise not judged. Fused 3-D expert weights are judged where :data:`.families.FAMILIES` gives the
  family's one orientation (gpt-oss ``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``; Qwen-MoE
  ``[E, 2I, H]``, ``[E, H, I]``); Qwen3-VL-MoE's come both ways, told apart by ``hidden_size`` itself, and are skipped.
- Tied head (:func:`tied_head_problems`): ``tie_word_embeddings`` true (top level, else ``text_config``) while the output
  stores an ``lm_head``: vLLM 0.33 ties the head to ``embed_tokens`` (``llama.py`` ``LlamaForCausalLM.__init__``
  ``tie_weights``) and its ``utils.py`` ``AutoWeightsLoader`` skips the aliased ``lm_head.weight``, so a quantized head
  is an error, and a dense ``lm_head.weight`` one where its bytes are not the embedding's. That is the rule of the
  families :data:`.families.VLLM_HEAD` marks ``"config"`` (and of those it does not list); Gemma 2's ``gemma2.py``
  builds no ``lm_head`` at all (any stored ``lm_head.`` tensor is an error, a missing one never is), and the families
  marked ``"own"`` (OLMoE, DeepSeek-V2/V3, Kimi-K2, GLM-4.5, gpt-oss) always build their own head, so a missing
  ``lm_head`` is an error whatever ``tie_word_embeddings`` says (and a stored one is never judged against the flag).

Quantized modules are judged by their dense shape (:func:`.modules.dense_shape`), never the packed tensor's, and only
where their tensors agree with their config group (:func:`.conformance.conforms`): an edited ``format`` or
``weight_shape`` gives a module no dense shape to judge a width by, and its own error is the cause. Each
disagreeing key is one error naming ``config.json``, the key and its value, the first tensor and what it holds, and how
many other tensors disagree. A config without a key, or whose value is not an integer, is not judged on it (nor is
a checkpoint whose decoder stack cannot be found); a missing ``tie_word_embeddings`` is not judged either
(transformers' default differs by config class).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import agree, plural
from .comparison import same_bytes
from .conformance import conforms
from .families import FAMILIES, is_fused_expert, model_types, vllm_head
from .modules import Module, dense_shape
from .naming import DEFAULT_IGNORE_PATTERNS, decoder_layers_prefix, find_embedding, is_lm_head, natural_key
from .reader import CONFIG_NAME, Problem
from .safetensors_io import TensorInfo

__all__ = ["WIDTHS_CHECK", "config_size", "dense_dims", "size_problems", "tied_head_problems", "width_problems"]

#: the line ``verify`` lists among its checks
WIDTHS_CHECK = "embedding, norm, MLP and expert widths and a tied lm_head against config.json"

_ATTN_IN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa")
_MLP_IN = ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3")
_GATE_UP = ("gate_proj", "up_proj", "w1", "w3")  # each intermediate-size wide (gate_up_proj: twice, not judged)
_DOWN = ("down_proj", "w2")
#: a Linear directly under a decoder layer's attention or MLP (after ``<P>layers.``): ``N.self_attn.q_proj``,
#: ``N.mlp.experts.7.w1``, ``N.experts.7.gate_proj`` (Gemma 4), ``N.mlp.shared_experts.down_proj`` ...
_LINEAR = re.compile(r"\d+\.(?:(?P<block>self_attn|mlp|block_sparse_moe|feed_forward)\.)?(?:(?P<group>experts\.\d+|shared_experts?)\.)?(?P<leaf>\w+)$")
_NORM = re.compile(r"\d+\.(?:input_layernorm|post_attention_layernorm)\.weight$")
#: model types whose embedding vLLM 0.33 builds with more rows than ``vocab_size`` (mllama.py MllamaTextModel)
_EXTRA_ROWS = {"mllama": 8}
_NARROW_EMBEDDING = ("word_embed_proj_dim", "embedding_size")
_HIDDEN_WHY = "vLLM 0.33 builds the model this wide and refuses the checkpoint"
_VOCAB_WHY = "vLLM 0.33's vocabulary weight loader asserts rows == vocab_size (vocab_parallel_embedding.py)"
_MLP_WHY = "vLLM 0.33 builds the MLPs this wide and refuses the checkpoint"


def width_problems(config: dict, tensors: dict[str, TensorInfo], mods: dict[str, Module], folder: str) -> list[Problem]:
    """:func:`size_problems` and :func:`tied_head_problems` of one checkpoint (``folder``: its path; ``mods``: its modules,
    :func:`.modules.modules_of`, or none for a kernel-native one, whose layouts have no dense shape to read here);
    empty where ``config`` is not a dict (a broken ``config.json``, reported by the reader)."""
    if not isinstance(config, dict):
        return []
    file = f"{folder}/{CONFIG_NAME}"
    return size_problems(config, tensors, mods, file) + tied_head_problems(config, tensors, file)


def size_problems(config: dict, tensors: dict[str, TensorInfo], mods: dict[str, Module], file: str | None = None) -> list[Problem]:
    """One error per config size (``hidden_size``, ``vocab_size``, ``intermediate_size``, ``moe_intermediate_size``,
    the shared experts') that a stored tensor of the decoder stack contradicts (module docstring), naming the key,
    its value, the first such tensor (natural order) and what it holds, and how many others disagree.

    ``config``: the parsed ``config.json``; ``tensors``: the checkpoint's tensors by name; ``mods``: its modules by
    name; ``file``: the config's path, named by each error. Empty where no ``<P>embed_tokens.weight`` is found. A quantized
    module whose tensors contradict the config's ``quantization_config`` is not judged (its own error says why)."""
    stack = decoder_layers_prefix(tensors)
    if stack is None:
        return []
    cfg, where = (config["text_config"], "text_config.") if isinstance(config.get("text_config"), dict) else (config, "")
    qcfg = config["quantization_config"] if isinstance(config.get("quantization_config"), dict) else {}
    judged = {name: m for name, m in mods.items() if (name.startswith(stack) or is_lm_head(name)) and conforms(m, qcfg)}  # (module docstring)
    dims = {name: d for name, m in judged.items() if (d := dense_dims(m)) is not None}
    found = _hidden_found(cfg, stack, tensors, dims) + _vocab_found(config, cfg, stack, tensors, dims)
    found += _mlp_found(cfg, stack, dims) + _fused_found(config, cfg, stack, tensors)
    claims: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for claim, why, tensor, what in found:
        if not DEFAULT_IGNORE_PATTERNS["vision"].search(tensor + "."):
            claims.setdefault((claim, why), []).append((tensor, what))
    out = []
    for (claim, why), hits in claims.items():
        hits.sort(key=lambda h: natural_key(h[0]))
        more = f" ({plural(len(hits) - 1, 'other tensor')} {agree(len(hits) - 1, 'disagrees', 'disagree')} too)" if len(hits) > 1 else ""
        out.append(Problem("error", f"config.json's {where}{claim}, but {hits[0][0]} {hits[0][1]}{more}: {why}", file, hits[0][0]))
    return out


def tied_head_problems(config: dict, tensors: dict[str, TensorInfo], file: str | None = None) -> list[Problem]:
    """``tie_word_embeddings`` false while a generating model (:func:`_generates`) stores no ``lm_head`` beside its
    embedding: an error (vLLM builds a head of its own that no tensor fills). ``tie_word_embeddings`` true (top level,
    else ``text_config``) while the checkpoint stores an ``lm_head``: an
    error for a quantized head (any ``lm_head.`` tensor but a dense ``weight``, or a ``weight`` beside a scale), and for
    a dense ``lm_head.weight`` whose dtype, shape or bytes are not the token embedding's (:func:`.naming.find_embedding`;
    not judged without one). vLLM 0.33 ties the head to ``embed_tokens`` and skips the stored one (module docstring).
    Used with and without ``--reference`` (``--lm-head`` unties a tied head: README). Families
    :data:`.families.VLLM_HEAD` marks otherwise follow vLLM's class instead: ``"embedding"`` (Gemma 2), any stored
    ``lm_head.`` tensor is an error; ``"own"`` (OLMoE ...), a missing head is one, whatever the flag."""
    tied = config.get("tie_word_embeddings")
    if tied is None and isinstance(config.get("text_config"), dict):
        tied = config["text_config"].get("tie_word_embeddings")
    heads: dict[str, list[str]] = {}  # lm_head module -> its tensors
    for name in sorted((n for n in tensors if is_lm_head(n.rpartition(".")[0])), key=natural_key):
        heads.setdefault(name.rpartition(".")[0], []).append(name)
    head = vllm_head(config)
    if head is not None and head[0] == "embedding":  # vLLM builds no lm_head: logits from the embedding, whatever the flag
        if not heads:
            return []
        first = next(iter(heads.values()))[0]
        msg = f"{first} is stored ({Path(tensors[first].file).name}), but vLLM 0.33 {head[1]} {head[2]} builds no lm_head: "
        msg += "it computes logits with the embedding; a stored head is refused"
        return [Problem("error", msg, file, first)]
    if head is not None and head[0] == "own":  # vLLM always builds its own head, never tied
        if heads or not _generates(config) or find_embedding(tensors) is None:
            return []
        flag = f"tie_word_embeddings is {str(tied).lower()}" if tied is not None else "tie_word_embeddings is absent"
        msg = f"config.json's {flag}, but the checkpoint stores no lm_head: vLLM 0.33 {head[1]} {head[2]} always builds lm_head; "
        return [Problem("error", msg + "tie_word_embeddings is not followed: store lm_head.weight", file)]
    if tied is False and not heads and _generates(config) and find_embedding(tensors) is not None:
        msg = "config.json's tie_word_embeddings is false, but the checkpoint stores no lm_head: vLLM 0.33 builds an untied head no tensor fills"
        return [Problem("error", msg, file)]
    if tied is not True:
        return []
    why = "vLLM 0.33 ties the head to embed_tokens and skips the stored one (tie_weights; utils.py AutoWeightsLoader skips the aliased lm_head.weight)"
    quantized = [n for names in heads.values() for n in names if n.rpartition(".")[2] not in ("weight", "bias")]
    if quantized:
        msg = f"config.json's tie_word_embeddings is true, but the output stores a quantized lm_head ({quantized[0]}): {why}"
        return [Problem("error", msg, file, quantized[0])]
    emb, out = find_embedding(tensors), []
    for name in (f"{m}.weight" for m in heads if f"{m}.weight" in tensors and emb is not None):
        a, b = tensors[name], tensors[emb]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or not same_bytes(a, b):
            held = f"other values than {emb} ({a.dtype} {list(a.shape)}, {b.dtype} {list(b.shape)})"
            out.append(Problem("error", f"config.json's tie_word_embeddings is true, but {name} holds {held}: {why}", file, name))
    return out


def _generates(config: dict) -> bool:
    """Whether the config's architectures build a language-model head (``...ForCausalLM``,
    ``...ForConditionalGeneration``): an encoder's (BERT's) has none to fill."""
    archs = config.get("architectures")
    return isinstance(archs, list) and any(isinstance(a, str) and a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs)


def dense_dims(m: Module) -> tuple[int, int] | None:
    """``(N, K)`` of a Linear module: its dense shape when quantized (:func:`.modules.dense_shape`), else its 2-D
    weight's; None for anything else, or a quantized module whose shape cannot be read."""
    try:
        if m.quantized:
            n, k = dense_shape(m)
            return int(n), int(k)
        w = m.parts.get("weight")
        return (int(w.shape[0]), int(w.shape[1])) if w is not None and len(w.shape) == 2 else None
    except (ValueError, KeyError, TypeError):
        return None


# -- what each size must match: (claim, why, tensor, what it holds) for each tensor that disagrees ---------------------


def _hidden_found(cfg: dict, stack: str, tensors: dict[str, TensorInfo], dims: dict[str, tuple[int, int]]) -> list[tuple[str, str, str, str]]:
    h = config_size(cfg, "hidden_size")
    if h is None:
        return []
    base, have = stack[: -len("layers.")], []  # (tensor, its width, what it holds)
    emb = tensors.get(base + "embed_tokens.weight")
    if emb is not None and len(emb.shape) == 2 and not any(k in cfg for k in _NARROW_EMBEDDING):
        have.append((emb.name, int(emb.shape[1]), "{} columns"))
    for name, info in tensors.items():
        if len(info.shape) == 1 and (name == base + "norm.weight" or name.startswith(stack) and _NORM.fullmatch(name[len(stack) :])):
            have.append((name, int(info.shape[0]), "{} elements"))
    for name, (n, k) in dims.items():
        _, _, leaf = _linear(stack, name)
        if leaf in _ATTN_IN or leaf in _MLP_IN:
            have.append((name, k, "takes {} inputs"))
        elif leaf in ("o_proj", *_DOWN):
            have.append((name, n, "has {} output rows"))
    return [(f"hidden_size is {h}", _HIDDEN_WHY, name, _holds(what, w)) for name, w, what in have if w != h]


def _vocab_found(config: dict, cfg: dict, stack: str, tensors: dict[str, TensorInfo], dims: dict[str, tuple[int, int]]) -> list[tuple[str, str, str, str]]:
    v = config_size(cfg, "vocab_size")
    if v is None:
        return []
    out = []
    extra = max((_EXTRA_ROWS.get(t, 0) for t in model_types(config)), default=0)
    emb = tensors.get(stack[: -len("layers.")] + "embed_tokens.weight")
    if emb is not None and len(emb.shape) == 2 and emb.shape[0] != v + extra:
        claim = f"vocab_size is {v}" + (f" (the embedding: {v} + {extra} = {v + extra} rows in vLLM 0.33 mllama.py)" if extra else "")
        out.append((claim, _VOCAB_WHY, emb.name, f"holds {emb.shape[0]} rows"))
    if "draft_vocab_size" not in cfg:
        out += [(f"vocab_size is {v}", _VOCAB_WHY, name, f"has {n} output rows") for name, (n, _) in dims.items() if is_lm_head(name) and n != v]
    return out


def _mlp_found(cfg: dict, stack: str, dims: dict[str, tuple[int, int]]) -> list[tuple[str, str, str, str]]:
    dense = None if cfg.get("use_double_wide_mlp") or "block_configs" in cfg else config_size(cfg, "intermediate_size")
    expert = _expert_size(cfg)
    shared = _shared_size(cfg)
    out = []
    for name, (n, k) in dims.items():
        block, group, leaf = _linear(stack, name)
        if group is None and block == "mlp":
            want = dense and (f"intermediate_size is {dense}", dense)
        elif group and group.startswith("experts."):
            want = expert
        else:
            want = shared if group else None
        if not want or leaf not in _GATE_UP + _DOWN:
            continue
        have = n if leaf in _GATE_UP else k
        if have != want[1]:
            out.append((want[0], _MLP_WHY, name, f"has {have} output rows" if leaf in _GATE_UP else f"takes {have} inputs"))
    return out


def _fused_found(config: dict, cfg: dict, stack: str, tensors: dict[str, TensorInfo]) -> list[tuple[str, str, str, str]]:
    """Fused 3-D expert weights of a family with one known orientation (:data:`.families.FAMILIES`): the hidden axis
    against ``hidden_size``, the other against the experts' size (twice it for ``gate_up_proj``)."""
    layout = next((FAMILIES[t] for t in model_types(config) if t in FAMILIES), None)
    if layout is None or layout.transposed is None:  # Qwen3-VL-MoE: the orientation is told by hidden_size itself
        return []
    h, expert, out = config_size(cfg, "hidden_size"), _expert_size(cfg), []
    for name, info in tensors.items():
        if len(info.shape) != 3 or not name.startswith(stack) or not is_fused_expert(name) or info.dtype not in ("BF16", "F16", "F32"):
            continue
        member = name.removesuffix(".weight").rpartition(".")[2]
        a, b = int(info.shape[1]), int(info.shape[2])  # one expert: a x b
        hidden_axis, inner = (b, a) if (member == "down_proj") == layout.transposed else (a, b)
        if h is not None and hidden_axis != h:
            out.append((f"hidden_size is {h}", _HIDDEN_WHY, name, f"holds {list(info.shape)}, a hidden width of {hidden_axis} per expert"))
        times = 2 if member == "gate_up_proj" else 1
        if expert is not None and inner != times * expert[1]:
            width = f"a gate and up width of {inner} (2 x {inner / 2:g})" if times == 2 else f"an intermediate width of {inner}"
            out.append((expert[0], _MLP_WHY, name, f"holds {list(info.shape)}, {width} per expert"))
    return out


def _expert_size(cfg: dict) -> tuple[str, int] | None:
    """``(claim, size)`` of the routed experts: ``moe_intermediate_size`` where the config has that key, else
    ``intermediate_size``; None where the one read is not an integer."""
    key = "moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size"
    n = config_size(cfg, key)
    return None if n is None else (f"{key} is {n}", n)


def _shared_size(cfg: dict) -> tuple[str, int] | None:
    """``(claim, size)`` of the shared experts, or None where the config does not say it (module docstring)."""
    if "shared_expert_intermediate_size" in cfg:
        n = config_size(cfg, "shared_expert_intermediate_size")
        return None if n is None else (f"shared_expert_intermediate_size is {n}", n)
    if any("shared" in k and "intermediate" in k for k in cfg):  # another family's own key (dots3, Nemotron-H ...)
        return None
    moe, count = config_size(cfg, "moe_intermediate_size"), config_size(cfg, "n_shared_experts")
    return None if moe is None or count is None else (f"moe_intermediate_size x n_shared_experts is {moe} x {count} = {moe * count}", moe * count)


def _linear(stack: str, name: str) -> tuple[str | None, str | None, str | None]:
    """``(block, group, leaf)`` of a Linear directly under a decoder layer's attention or MLP (:data:`_LINEAR`), else
    ``(None, None, None)``; attention leaves only under ``self_attn``, MLP leaves only under an MLP block or group."""
    m = _LINEAR.fullmatch(name[len(stack) :]) if name.startswith(stack) else None
    if m is None:
        return None, None, None
    block, group, leaf = m["block"], m["group"], m["leaf"]
    attn = block == "self_attn" and group is None and leaf in (*_ATTN_IN, "o_proj")
    mlp = block != "self_attn" and (block or group) and leaf in (*_MLP_IN, *_DOWN)
    return (block, group, leaf) if attn or mlp else (None, None, None)


def _holds(what: str, n: int) -> str:
    return what.format(n) if what.startswith(("takes", "has")) else "holds " + what.format(n)


def config_size(cfg: dict, key: str) -> int | None:
    """An integer size of the config (``cfg[key]``), None where absent or not an integer (``"4"``, ``4.0``, ``true``, a list)."""
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None
