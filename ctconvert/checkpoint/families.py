"""Model families: how each stores fused 3-D MoE experts, and which layers are multi-token prediction (MTP).

Many checkpoints store a MoE layer's experts as two 3-D tensors (``...experts.gate_up_proj``
and ``...experts.down_proj``, with or without ``.weight``), not as one 2-D Linear per expert.
No name or shape says whether such a tensor is ``[E, 2I, H]`` or its transpose
``[E, H, 2I]``, nor whether gate and up are two halves or interleaved ``[g0, u0, g1, u1, ...]``:
that is a property of the family (config ``model_type``), recorded once in :data:`FAMILIES`,
with the source it was read from. A family not in the table is refused by name
(:func:`split_fused_experts`), never guessed.

ctconvert writes every expert as its own 2-D Linear under the names the family's vLLM loader
maps into its fused-MoE parameters (``experts.{e}.gate_proj``/``up_proj``/``down_proj``, or
``w1``/``w3``/``w2``), and each expert's gate and up form one fused set (one NVFP4 global
scale). Expert biases are split with their weights. Each expert's slice is read by itself:
one expert of a 3-D tensor is a contiguous byte range; a transposed or interleaved member is
taken from it through a :class:`~.safetensors_io.SliceView`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import BadInputError, UnsupportedError
from .architectures import model_types, vllm_types
from .expert_count import expert_count
from .safetensors_io import SliceView, TensorInfo

__all__ = [
    "FAMILIES",
    "VLLM_HEAD",
    "ExpertLayout",
    "FusedExperts",
    "config_value",
    "dense_experts_reason",
    "indexer_dense_reason",
    "is_expert",
    "is_fused_expert",
    "is_mtp",
    "model_types",
    "mtp_dense_reason",
    "split_fused_experts",
    "transformers_per_expert_reason",
    "vllm_head",
]


@dataclass(frozen=True)
class ExpertLayout:
    """How one family stores fused 3-D experts, and the per-expert names its vLLM loader reads.

    ``transposed``: stored ``[E, H, 2I]`` (gate/up) and ``[E, I, H]`` (down), so each expert's
    Linear weight is the transpose; else ``[E, 2I, H]`` and ``[E, H, I]``; None where the family's
    checkpoints come both ways (its transformers conversion compares the shape with the model's,
    ``Transpose(check_dims=True)``): the axis that equals the config's ``hidden_size`` decides, and a
    tensor where both would is refused. ``interleaved``: gate and
    up alternate along the ``2I`` axis; else the gate half comes first. ``names``: the output
    leaf names of gate, up and down. ``vllm_dense``: None where vLLM loads the family's experts
    quantized under those names; else why it cannot, and the experts stay dense by default
    (:func:`dense_experts_reason`)."""

    transposed: bool | None  # None: either orientation, told apart by the config's hidden_size (never guessed when square)
    interleaved: bool
    names: tuple[str, str, str]
    source: str
    vllm_dense: str | None = None


_GUD = ("gate_proj", "up_proj", "down_proj")
_QWEN2_MOE = ExpertLayout(
    False,
    False,
    _GUD,
    "transformers 5.24 conversion_mapping.py, 'qwen2_moe' (shared by qwen3_moe, deepseek_v3, glm4_moe, olmoe, qwen3_next ...): "
    "experts.*.gate_proj/up_proj merged with MergeModulelist(dim=0) + Concatenate(dim=1) into gate_up_proj [E, 2I, H], gate first; "
    "vLLM qwen3_moe.py / deepseek_v2.py load_weights: expert_params_mapping(ckpt_gate_proj_name='gate_proj', 'down_proj', 'up_proj')",
)
_MIXTRAL = ExpertLayout(
    False,
    False,
    ("w1", "w3", "w2"),
    "transformers 5.24 conversion_mapping.py, 'mixtral': experts.*.w1/w3 -> gate_up_proj [E, 2I, H] (Concatenate(dim=1), w1 first), "
    "w2 -> down_proj; vLLM mixtral.py load_weights: expert_params_mapping(ckpt_gate_proj_name='w1', ckpt_down_proj_name='w2', ckpt_up_proj_name='w3')",
)
_GEMMA4 = ExpertLayout(
    False,
    False,
    _GUD,
    "vLLM gemma4.py Gemma4ForCausalLM.load_weights (_weight_iterator): gate_up_proj [E, 2I, H] split into experts.{e}.gate_proj "
    "(first half) and up_proj, down_proj [E, H, I] into experts.{e}.down_proj; per-expert 2-D weights are read as they are (quantized checkpoints)",
)
_LLAMA4 = ExpertLayout(
    True,
    False,
    _GUD,
    "transformers 5.24 models/llama4/modeling_llama4.py Llama4TextExperts: gate_up_proj [E, H, 2I] used as bmm(x, gate_up_proj).chunk(2, -1), "
    "down_proj [E, I, H]; vLLM llama4.py Llama4Model.load_moe_expert_weights: the fused tensor chunk(2, dim=-1) (transposed), "
    "per-expert experts.{e}.gate_proj/up_proj/down_proj through fused_moe_make_expert_params_mapping",
)
_GPT_OSS = ExpertLayout(
    True,
    True,
    _GUD,
    "transformers 5.24 models/gpt_oss/modeling_gpt_oss.py GptOssExperts: gate_up_proj [E, H, 2I] (x @ W), gate = [..., ::2], up = [..., 1::2], "
    "biases gate_up_proj_bias [E, 2I] / down_proj_bias [E, H]; vLLM 0.33 gpt_oss.py GptOssModel._load_weights_other reads the fused "
    "gate_up_proj [E, H, 2I] / down_proj [E, I, H] (x @ W) and their biases as stored",
    vllm_dense=(
        "gpt-oss experts: vLLM 0.33 cannot load them quantized (gpt_oss.py reads per-expert w13_*/w2_* names with no path for "
        "weight_shape or weight_global_scale; its FP8, NVFP4 and MXFP4 MoE methods have no expert bias)"
    ),
)
_QWEN3_VL_MOE = ExpertLayout(
    None,
    False,
    _GUD,
    "transformers 5.24 conversion_mapping.py, 'qwen3_vl_moe': mlp.experts.gate_up_proj / down_proj go through Transpose(1, 2, check_dims=True) "
    "(the Hub's original [E, H, 2I] / [E, I, H] is transposed, transformers 5's own save [E, 2I, H] / [E, H, I] is not; gate first); "
    "vLLM qwen3_vl_moe.py load_weights transposes the fused tensors",
)

#: config ``model_type`` -> how its fused 3-D experts are stored (the one table of such choices).
FAMILIES: dict[str, ExpertLayout] = {
    **{
        t: _QWEN2_MOE
        for t in (
            "qwen2_moe",
            "qwen3_moe",
            "qwen3_next",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "olmoe",
            "flex_olmo",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "kimi_k2",
            "glm4_moe",
            "glm4v_moe",
            "glm4_moe_lite",
            "dots1",
            "ernie4_5_moe",
            "hunyuan_v1_moe",
        )
    },
    "mixtral": _MIXTRAL,
    "minimax": _MIXTRAL,
    "gemma4": _GEMMA4,
    "gemma4_text": _GEMMA4,
    "llama4": _LLAMA4,
    "llama4_text": _LLAMA4,
    "gpt_oss": _GPT_OSS,
    "qwen3_vl_moe": _QWEN3_VL_MOE,
    "qwen3_vl_moe_text": _QWEN3_VL_MOE,
}

#: a fused 3-D expert tensor (or its bias): ``<parent>.experts.<member>[.weight|.bias|_bias]``
_FUSED = re.compile(r"^(?P<parent>.*(?:^|\.)experts)\.(?P<member>gate_up_proj|gate_proj|up_proj|down_proj)(?P<suffix>\.weight|\.bias|_bias)?$")


def is_fused_expert(name: str) -> bool:
    """Whether ``name`` is that of a fused 3-D expert tensor (``<parent>.experts.gate_up_proj`` and the other members,
    with or without ``.weight``, or its bias). The name alone: the caller checks the shape."""
    return _FUSED.match(name) is not None


def transformers_per_expert_reason(config: dict) -> str | None:
    """Why transformers cannot load this family's experts written one Linear per expert (``experts.{e}.gate_proj``
    ...) into its fused 3-D expert parameters, or None where it can (or cannot be asked). transformers 5 maps
    per-expert names onto fused experts only through a checkpoint conversion registered for the model type
    (``transformers/conversion_mapping.py``, ``get_checkpoint_conversion_mapping``: Qwen3-MoE, Mixtral, DeepSeek-V3,
    GLM-4.5 have one; Gemma-4, Llama-4 and gpt-oss, as of 5.24, do not)."""
    types = [t for t in model_types(config) if t in FAMILIES]
    if not types:
        return None
    try:
        import transformers
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # another transformers: not asked
        return None
    if any(get_checkpoint_conversion_mapping(t) for t in model_types(config)):
        return None
    return (
        f"transformers {transformers.__version__} builds {types[0]} with fused 3-D experts and has no conversion of "
        "per-expert names into them: it would load these experts as random weights (vLLM maps the per-expert names)"
    )


_EXPERT_MODULE = re.compile(r"(^|\.)experts\.\d+\.")


def is_expert(name: str) -> bool:
    """Whether ``name`` is (a tensor of) a per-expert Linear, ``...experts.<e>.<leaf>``."""
    return _EXPERT_MODULE.search(name) is not None


#: the DeepSeek V3.2 (and GLM-5 DSA) sparse-attention indexer's key and head-weight projections
_INDEXER_DENSE = re.compile(r"(^|\.)indexer\.(wk|weights_proj)$")


def indexer_dense_reason(module: str, config: dict, weights: dict | None = None, inputs: dict | None = None) -> str | None:
    """Why ``module`` stays dense for vLLM 0.33: the indexer's ``wk`` or ``weights_proj`` of a model whose config has
    ``index_topk`` (DeepSeek V3.2, GLM-5 DSA). vLLM fuses the two into one ``wk_weights_proj`` built without a
    quantization config (vllm 0.33 ``vllm/models/deepseek_v32/attention.py`` ``Indexer``; ``deepseek_v2.py`` likewise),
    so a quantized ``weights_proj`` cannot be loaded (its scale has no parameter; its FP8 codes would be taken as bf16
    values), nor a packed ``wk``. An 8-bit float ``wk`` with dynamic or no input scales is the one exception: the
    loader dequantizes it to bf16 (``deepseek_v2.py`` ``_try_load_fp8_indexer_wk``). ``weights``/``inputs``: the
    module's ``QuantizationArgs`` dicts; None for the module-only rule (the plan's default: both stay dense, since
    vLLM would only dequantize ``wk`` again). None for any other module or config."""
    found = _INDEXER_DENSE.search(module)
    if found is None or not any(isinstance(c, dict) and "index_topk" in c for c in (config, config.get("text_config"))):
        return None
    fp8 = isinstance(weights, dict) and weights.get("type") == "float" and weights.get("num_bits") == 8
    if found.group(2) == "wk" and fp8 and (not isinstance(inputs, dict) or inputs.get("dynamic") is True):
        return None
    return (
        "the sparse-attention indexer's wk/weights_proj (DeepSeek-V3.2, GLM-5): vLLM 0.33 fuses them into wk_weights_proj, built unquantized "
        "(models/deepseek_v32/attention.py Indexer), so it cannot load them quantized (only an FP8 wk, which it dequantizes)"
    )


def dense_experts_reason(module: str, config: dict) -> str | None:
    """Why ``module``, a per-expert Linear (``...experts.<e>.<leaf>``, stored so or split from fused 3-D
    experts), stays dense by default: its family's :attr:`ExpertLayout.vllm_dense`; None for any other
    module or family."""
    if not is_expert(module):
        return None
    layout = next((FAMILIES[t] for t in model_types(config) if t in FAMILIES), None)
    return layout.vllm_dense if layout is not None else None


#: How vLLM 0.33 builds a family's ``lm_head`` (its CausalLM class, read in ``vllm/model_executor/models/``), by
#: config ``model_type`` (outer first; the family of the class ``architectures`` names where it names another:
#: :func:`.architectures.vllm_types`): ``"embedding"``, no ``lm_head`` parameter at all (the logits are computed with
#: ``embed_tokens``, so any stored ``lm_head.`` tensor is refused); ``"config"``, a head tied to ``embed_tokens`` iff
#: ``tie_word_embeddings`` (``tie_weights``; ``utils.py`` ``AutoWeightsLoader`` skips the aliased ``lm_head.weight``);
#: ``"own"``, always its own head whatever ``tie_word_embeddings`` says (it must be stored).
#: A model_type not listed is judged by the ``"config"`` rule. The one table of these choices: data, not branches.
VLLM_HEAD: dict[str, tuple[str, str, str]] = {
    "llama": ("config", "llama.py", "LlamaForCausalLM"),
    "mistral": ("config", "mistral.py", "MistralForCausalLM"),
    "phi3": ("config", "phi3.py", "Phi3ForCausalLM"),
    "qwen2": ("config", "qwen2.py", "Qwen2ForCausalLM"),
    "qwen2_vl": ("config", "qwen2.py", "Qwen2ForCausalLM"),
    "qwen2_5_vl": ("config", "qwen2.py", "Qwen2ForCausalLM"),
    "qwen3": ("config", "qwen3.py", "Qwen3ForCausalLM"),
    "gemma2": ("embedding", "gemma2.py", "Gemma2ForCausalLM"),
    "gemma3": ("config", "gemma3.py", "Gemma3ForCausalLM"),
    "gemma3_text": ("config", "gemma3.py", "Gemma3ForCausalLM"),
    "mixtral": ("config", "mixtral.py", "MixtralForCausalLM"),
    "qwen2_moe": ("config", "qwen2_moe.py", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("config", "qwen3_moe.py", "Qwen3MoeForCausalLM"),
    "deepseek_v2": ("own", "deepseek_v2.py", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("own", "deepseek_v2.py", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("own", "deepseek_v2.py", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("own", "glm4_moe.py", "Glm4MoeForCausalLM"),
    "olmoe": ("own", "olmoe.py", "OlmoeForCausalLM"),
    "gpt_oss": ("own", "gpt_oss.py", "GptOssForCausalLM"),
}


def vllm_head(config: dict) -> tuple[str, str, str] | None:
    """``(kind, vLLM file, class)`` of :data:`VLLM_HEAD` for the first listed model type of the class vLLM 0.33 builds
    (:func:`.architectures.vllm_types`: ``architectures`` before ``model_type``), else None."""
    return next((VLLM_HEAD[t] for t in vllm_types(config) if t in VLLM_HEAD), None)


#: model_type -> the vLLM 0.33 model file (``vllm/model_executor/models/``) that builds the family's MoE router
#: (``gate``/``router``) as a ``GateLinear`` without ``quant_config``: unquantized, so a quantized router's tensors have
#: no parameters to load into (read in each file's MoE block; Qwen3-MoE's ``qwen3_moe.py`` passes its quant_config).
VLLM_DENSE_ROUTER: dict[str, str] = {
    "mixtral": "mixtral.py",
    "qwen2_moe": "qwen2_moe.py",
    "qwen3_next": "qwen3_next.py",
    "deepseek_v2": "deepseek_v2.py",
    "deepseek_v3": "deepseek_v2.py",
    "deepseek_v32": "deepseek_v2.py",
    "kimi_k2": "deepseek_v2.py",
    "glm4_moe": "glm4_moe.py",
    "olmoe": "olmoe.py",
    "llama4": "llama4.py",
    "llama4_text": "llama4.py",
    "gpt_oss": "gpt_oss.py",
    "granitemoe": "granitemoe.py",
    "phimoe": "phimoe.py",
    "minimax_m2": "minimax_m2.py",
    "ernie4_5_moe": "ernie45_moe.py",
    "jamba": "jamba.py",
    "gemma4": "gemma4.py",  # (its router's Linear is ``router.proj``)
    "gemma4_text": "gemma4.py",
}
_ROUTER = re.compile(r"(^|\.)((mlp|block_sparse_moe|feed_forward|moe)\.(gate|router)|router\.proj)$")
#: the shared expert's gate (one output row): every vLLM 0.33 file that builds one builds it as a ``ReplicatedLinear``
#: without ``quant_config`` (``qwen2_moe.py``, ``qwen3_moe.py``, ``qwen3_next.py``, ``interns2_mobius.py``, ``alice_ai.py``)
_SHARED_EXPERT_GATE = re.compile(r"(^|\.)shared_expert_gate$")


def vllm_expert_scheme_reason(weights: dict | None, inputs: dict | None) -> str | None:
    """Why vLLM 0.33 has no fused-MoE method for experts quantized with ``weights`` and ``inputs`` (compressed-tensors
    ``QuantizationArgs`` dicts: ``type``, ``num_bits``, ``strategy``, ``dynamic``), or None where it has one: integer
    weights with integer inputs load only with dynamic per-token inputs (vLLM 0.33
    ``compressed_tensors_moe/compressed_tensors_moe.py``: ``CompressedTensorsMoEMethod.get_moe_method`` takes them
    through ``_is_dynamic_token_w8a8`` / ``_is_dynamic_token_w4a8_int`` and raises "Unsupported FusedMoe scheme"
    otherwise), so static INT8 inputs (W8A8_STATIC, W8A8_STATIC_ASYM) cannot serve experts."""
    if not weights or not inputs or weights.get("type") != "int" or inputs.get("type") != "int":
        return None
    if inputs.get("dynamic") is True and inputs.get("strategy") == "token":
        return None
    how = "static" if inputs.get("dynamic") is False else f"{inputs.get('strategy')}"
    return (
        f"vLLM 0.33 has no fused-MoE method for int{weights.get('num_bits')} experts with {how} int{inputs.get('num_bits')} inputs "
        "(compressed_tensors_moe.py: get_moe_method takes integer inputs only dynamic per token: use W8A8 for an MoE)"
    )


def vllm_dense_reason(module: str, config: dict, weights: dict | None = None, inputs: dict | None = None) -> str | None:
    """Why vLLM 0.33 cannot load ``module`` quantized, or None where it can (as far as this table knows): the
    experts of a family whose :attr:`ExpertLayout.vllm_dense` says so (:func:`dense_experts_reason`), experts of any
    family quantized with a scheme vLLM has no fused-MoE method for (``weights``/``inputs``: the module's
    ``QuantizationArgs`` dicts, :func:`vllm_expert_scheme_reason`), and the MoE router of a family
    :data:`VLLM_DENSE_ROUTER` lists, the shared expert's gate, and the DeepSeek V3.2 indexer's ``wk``/``weights_proj``
    (:func:`indexer_dense_reason`). The plan refuses to quantize such a module unless ``--allow-unloadable``;
    ``verify`` reports one that is quantized."""
    if (why := dense_experts_reason(module, config)) is not None:
        return why
    if is_expert(module) and (why := vllm_expert_scheme_reason(weights, inputs)) is not None:
        return why
    if (why := indexer_dense_reason(module, config, weights, inputs)) is not None:
        return why
    if _SHARED_EXPERT_GATE.search(module):
        return (
            "the shared expert's gate: vLLM 0.33 builds it unquantized (qwen2_moe.py, qwen3_next.py: ReplicatedLinear "
            "without quant_config), so it cannot load it quantized"
        )
    if _ROUTER.search(module):
        t = next((t for t in model_types(config) if t in VLLM_DENSE_ROUTER), None)
        if t is not None:
            return (
                f"{t} router: vLLM 0.33 builds it unquantized (models/{VLLM_DENSE_ROUTER[t]}: GateLinear without quant_config), so it cannot load it quantized"
            )
    return None


def config_value(config: dict, *keys: str):
    """The first of ``keys`` found in the config's ``text_config`` or the config itself, else None."""
    for cfg in (config.get("text_config"), config):
        if isinstance(cfg, dict):
            for k in keys:
                if isinstance(cfg.get(k), int):
                    return cfg[k]
    return None


@dataclass
class FusedExperts:
    """One stored fused expert tensor and its per-expert parts (derived tensors, in expert order)."""

    name: str
    parent: str  # the ``...experts`` module
    member: str  # gate_up_proj | gate_proj | up_proj | down_proj
    bias: bool
    model_type: str
    layout: ExpertLayout
    parts: list[TensorInfo]
    transposed: bool = False  # this tensor's orientation (the family's, or told by the config for a family that has both)


def split_fused_experts(tensors: dict[str, TensorInfo], config: dict) -> dict[str, FusedExperts]:
    """Every fused 3-D expert tensor of a checkpoint (and expert bias) with its per-expert parts, by stored name.

    Parts are named ``<parent>.<e>.<leaf>.weight`` (or ``.bias``) with the family's leaf names
    (:data:`FAMILIES`); gate and up come from ``gate_up_proj`` as the family lays them out. Raises
    :class:`UnsupportedError` naming file and tensor for a family not in the table (its layout cannot
    be known), a shape that disagrees with the family's layout and the config's sizes, or a part name
    the checkpoint already holds."""
    out: dict[str, FusedExperts] = {}
    for name, info in tensors.items():
        m = _FUSED.match(name)
        if m is None or info.dtype not in ("BF16", "F16", "F32"):
            continue
        bias = m["suffix"] in (".bias", "_bias")
        if len(info.shape) != (2 if bias else 3):
            continue
        types = model_types(config)
        mt = next((t for t in types if t in FAMILIES), None)
        if mt is None:
            raise UnsupportedError(
                f"fused {len(info.shape)}-D weight {list(info.shape)} of MoE experts, but model_type {types[0] if types else None!r} is not in ctconvert's "
                "family table (ctconvert/checkpoint/families.py), so whether it is stored transposed and whether gate/up are interleaved cannot be known; "
                "keep it dense with --keep-unclassified, or report the family",
                file=str(info.file),
                tensor=name,
            )
        layout = FAMILIES[mt]
        parts, transposed = _parts(name, info, m["parent"], m["member"], bias, layout, config)
        out[name] = FusedExperts(name, m["parent"], m["member"], bias, mt, layout, parts, transposed)
    for fe in out.values():
        for p in fe.parts:
            if p.name in tensors:
                raise UnsupportedError(f"splitting the fused experts would give {p.name}, which the checkpoint also holds", file=str(p.file), tensor=fe.name)
    return out


def _parts(name: str, info: TensorInfo, parent: str, member: str, bias: bool, layout: ExpertLayout, config: dict) -> tuple[list[TensorInfo], bool]:
    """The per-expert derived tensors of one fused tensor, expert-major (gate before up), and whether it is stored transposed."""
    e = info.shape[0]
    hidden = config_value(config, "hidden_size")
    counted = expert_count(config)  # the count vLLM 0.33 builds (every FAMILIES type is listed there)
    experts = counted[1] if counted is not None else None

    def refuse(why: str, contradicts: bool = False):
        """A layout the family does not have (unsupported, exit 4), or a config the tensor contradicts (bad input, exit 3)."""
        cls, words = (BadInputError, "; the config and the checkpoint describe different models") if contradicts else (UnsupportedError, "")
        raise cls(
            f"fused experts {list(info.shape)} do not fit this family's layout ({_LAYOUT_WORDS[layout.transposed]}): {why}{words}",
            file=str(info.file),
            tensor=name,
        )

    if experts is not None and e != experts:
        refuse(f"{e} experts, config says {experts}", contradicts=True)
    transposed = _orientation(info, member, layout, hidden, refuse)
    gate, up, down = layout.names
    leaves = {"gate_up_proj": (gate, up), "gate_proj": (gate,), "up_proj": (up,), "down_proj": (down,)}[member]
    suffix = "bias" if bias else "weight"
    per = info.nbytes // max(1, e)  # bytes of one expert
    isz = info.itemsize
    out: list[TensorInfo] = []
    if bias:
        width = info.shape[1]
        if len(leaves) == 2 and width % 2:
            refuse("odd gate/up width")
        n = width // len(leaves)
        for x in range(e):
            start = info.start + x * per
            for j, leaf in enumerate(leaves):
                pname = f"{parent}.{x}.{leaf}.{suffix}"
                if layout.interleaved and len(leaves) == 2:
                    out.append(TensorInfo(pname, info.file, info.dtype, (n,), start, n * isz, base=name, view=SliceView(width, 1, False, j, 2)))
                else:
                    out.append(TensorInfo(pname, info.file, info.dtype, (n,), start + j * n * isz, n * isz, base=name))
        return out, False
    a, b = info.shape[1], info.shape[2]  # one expert's region: a rows x b columns
    in_dim = a if transposed else b  # K of a gate/up Linear, N of down (the hidden size)
    if member == "down_proj":
        in_dim = b if transposed else a
    if hidden is not None and in_dim != hidden:
        refuse(f"hidden size {in_dim} where the config's hidden_size is {hidden}", contradicts=True)
    wide = b if transposed else a  # the axis that holds the experts' outputs (gate+up) or down's K
    if len(leaves) == 2 and wide % 2:
        refuse("odd gate/up width")
    n = wide // len(leaves)
    k = a if transposed else b
    for x in range(e):
        start = info.start + x * per
        for j, leaf in enumerate(leaves):
            pname = f"{parent}.{x}.{leaf}.{suffix}"
            if transposed:
                off, step = (j, 2) if layout.interleaved and len(leaves) == 2 else (j * n, 1)
                out.append(TensorInfo(pname, info.file, info.dtype, (n, k), start, n * k * isz, base=name, view=SliceView(a, b, True, off, step)))
            elif layout.interleaved and len(leaves) == 2:
                out.append(TensorInfo(pname, info.file, info.dtype, (n, k), start, n * k * isz, base=name, view=SliceView(a, b, False, j, 2)))
            else:
                out.append(TensorInfo(pname, info.file, info.dtype, (n, k), start + j * n * k * isz, n * k * isz, base=name))
    return out, transposed


_LAYOUT_WORDS = {False: "[E, 2I, H] and [E, H, I]", True: "[E, H, 2I] and [E, I, H]", None: "either orientation"}


def _orientation(info: TensorInfo, member: str, layout: ExpertLayout, hidden: int | None, refuse) -> bool:
    """Whether a fused weight is stored transposed: the family's rule, or (``layout.transposed is None``) the
    axis that equals ``hidden_size``; refused where the config cannot tell (no hidden size, or both axes fit)."""
    if layout.transposed is not None or len(info.shape) != 3:
        return bool(layout.transposed)
    if hidden is None:
        refuse("the config has no hidden_size to tell its orientation")
    plain_axis, transposed_axis = (1, 2) if member == "down_proj" else (2, 1)
    plain, flipped = info.shape[plain_axis] == hidden, info.shape[transposed_axis] == hidden
    if plain == flipped:
        refuse(f"hidden_size {hidden} {'fits both orientations' if plain else 'fits neither orientation'}")
    return flipped


_MTP_NAME = re.compile(r"(^|\.)(mtp|mtp_layers)(\.|$)")
_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


#: an MTP layer's own modules, beside its decoder block (vLLM 0.33 deepseek_mtp.py DeepSeekMultiTokenPredictorLayer)
MTP_PARTS = "eh_proj|enorm|hnorm|shared_head"
_MTP_PART = re.compile(_LAYER.pattern + rf"(?:{MTP_PARTS})\.")


def mtp_part_layers(names) -> frozenset[int]:
    """The decoder layer indices among tensor ``names`` that hold an MTP layer's own modules (``eh_proj``, ``enorm``,
    ``hnorm``, ``shared_head``: vLLM 0.33 deepseek_mtp.py DeepSeekMultiTokenPredictorLayer), for :func:`is_mtp`."""
    return frozenset(int(m.group(1)) for m in map(_MTP_PART.match, names) if m)


def is_mtp(name: str, config: dict, parts: frozenset[int] | None = None) -> bool:
    """Whether a tensor belongs to a multi-token-prediction (MTP) layer.

    DeepSeek-V3 / Kimi-K2 / GLM-4.5 store it as a decoder layer past the model's
    ``num_hidden_layers``, one of the ``num_nextn_predict_layers`` their config declares (``model.layers.61.`` of a
    61-layer model; vLLM deepseek_mtp.py ``get_spec_layer_idx_from_weight_name``, which counts them from that key);
    Qwen3-Next, Qwen3.5 and MiMo under ``mtp.`` / ``mtp_layers.`` (vLLM qwen3_next_mtp.py). A layer past
    ``num_hidden_layers`` where the config declares none is not one: a config that contradicts the tensors, which
    ``verify`` fails (:func:`.depth.layer_count_problems`), not a layer to keep dense quietly; nor, where ``parts``
    (:func:`mtp_part_layers` of the checkpoint) is given, one that holds none of an MTP layer's own modules (a decoder
    layer the count leaves out, which vLLM skips)."""
    if _MTP_NAME.search(name):
        return True
    m = _LAYER.match(name)
    n = config_value(config, "num_hidden_layers")
    if m is None or not isinstance(n, int):
        return False
    extra, i = config_value(config, "num_nextn_predict_layers"), int(m.group(1))
    return n <= i < n + (extra if isinstance(extra, int) else 0) and (parts is None or i in parts)


#: MTP modules that vLLM 0.33 builds without a quantization method, so only their dense weight loads
#: (deepseek_mtp.py DeepSeekMultiTokenPredictorLayer and SharedHead, the same in glm4_moe_mtp.py and
#: glm4_moe_lite_mtp.py); the rest of an MTP layer (its decoder block) is built with the model's
#: quantization config under the checkpoint's own names (``mtp_block`` / ``Glm4MoeDecoderLayer(prefix=...)``).
_MTP_DENSE = {
    "eh_proj": (
        "MTP eh_proj: vLLM 0.33 deepseek_mtp.py / glm4_moe_mtp.py build it as a plain torch nn.Linear (no quantization method), so only a dense weight loads"
    ),
    "shared_head.head": (
        "MTP shared_head.head: vLLM 0.33 deepseek_mtp.py / glm4_moe_mtp.py SharedHead build it as a ParallelLMHead "
        "named <layer>.head, which neither 'Linear' nor this module's name matches, so it loads unquantized"
    ),
}
_MTP_DENSE_MODULE = re.compile(r"(?:^|\.)(eh_proj|shared_head\.head)$")


def mtp_dense_reason(module: str, config: dict) -> str | None:
    """Why a Linear of an MTP layer (:func:`is_mtp`) stays dense even with ``--quantize-mtp``: vLLM's MTP module
    builds it unquantized (:data:`_MTP_DENSE`); None for every other module."""
    m = _MTP_DENSE_MODULE.search(module)
    if m is None or not is_mtp(module + ".weight", config):
        return None
    return _MTP_DENSE[m.group(1)]
