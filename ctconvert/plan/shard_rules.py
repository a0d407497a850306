"""vLLM's tensor-parallel rules for one tensor: which dimension a layer splits, and what each rank's slice must hold.

Pure, from the module name, the dense ``[N, K]`` (out-features, in-features), the weight
:class:`~ctconvert.formats.WeightArgs`, an optional kernel layout and the model config. :mod:`.parallel`
applies them to every tensor of a conversion and finds the largest degree.

**Which dimension a layer splits.** vLLM shards a column-parallel layer
(``ColumnParallelLinear``, ``MergedColumnParallelLinear``, ``QKVParallelLinear``:
``q/k/v_proj``, ``gate/up_proj``, ``w1/w3``, ``fc1``, BERT's
``query/key/value`` and ``intermediate.dense``) along N, a row-parallel layer
(``RowParallelLinear``: ``o_proj``, ``down_proj``, ``w2``, ``out_proj``,
``fc2``, BERT's ``attention.output.dense`` and ``output.dense``) along K,
keeps a ``ReplicatedLinear`` whole (DeepSeek MLA's ``q_a_proj`` and
``kv_a_proj_with_mqa``, ``vllm/model_executor/models/deepseek_v2.py``; MoE routers
``mlp.gate``/``router``, ``GateLinear(ReplicatedLinear)`` in
``model_executor/layers/fused_moe/router/gate_linear.py``, and Qwen-MoE's
``shared_expert_gate``; BERT's pooler is a plain ``nn.Linear``, ``models/bert.py``
``BertPooler``), and
splits a vocabulary (``VocabParallelEmbedding``/``ParallelLMHead``) by rows
after padding it. A layer whose kind the name does not tell is reported as
``unknown``: its largest degree is the one that works under either split,
and the report says so.

**What each rank must hold** (vLLM 0.33.0, commit ``g4ba787ec9``; paths under
``vllm/``):

* every split divides exactly: ``distributed/utils.py`` ``divide`` (used by
  ``model_executor/layers/linear.py`` for ``output_size``/``input_size``), and
  for q/k/v heads ``QKVParallelLinear.__init__``: ``num_heads = divide(heads, tp)``;
  ``tp >= kv_heads`` replicates each KV head (``divide(tp, kv_heads)``), else
  ``divide(kv_heads, tp)``; ``config/model.py`` ``verify_with_parallel_config``
  also requires ``num_attention_heads % tp == 0``;
* whole quantization groups along K: ``verify_group_size_divides_partition``
  (``distributed/utils.py``), called by ``CompressedTensorsWNA16.create_weights``
  (``model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py``)
  for every grouped layer; NVFP4, MXFP4 and MXFP8 size the scale
  ``input_size_per_partition // group_size`` (``compressed_tensors_w4a4_nvfp4.py``,
  ``compressed_tensors_w4a4_mxfp4.py``, ``compressed_tensors_w8a8_mxfp8.py``), so a
  split inside a 16- (32-) element block misreads it. Channelwise scales are whole per row and are repeated on
  every rank of a row-parallel layer (``marlin_repeat_scales_on_all_ranks``);
* whole int32 words: ``weight_packed`` packs ``32 / bits`` values along K
  (``PackedvLLMParameter(packed_dim=1)``), an asymmetric ``weight_zero_point``
  packs them along N (``packed_dim=0``), so a row-parallel K (a zero point's N)
  per rank must be a multiple of the pack factor;
* FP8 blocks: ``validate_fp8_block_shape``
  (``model_executor/layers/quantization/utils/fp8_utils.py``): at tp > 1 a
  row-parallel K per rank must be a multiple of ``block_k`` and a column-parallel
  N per rank of ``block_n``;
* a vocabulary: ``pad_vocab_size`` rounds V up to 64
  (``DEFAULT_VOCAB_PADDING_SIZE``, ``model_executor/layers/vocab_parallel_embedding.py``),
  then ``num_embeddings_per_partition = divide(padded, tp)``: tp must divide
  ``roundup(V, 64)``;
* MoE experts under TP (``FusedMoEConfig.__post_init__``,
  ``model_executor/layers/fused_moe/config.py``: ``intermediate_size % tp == 0``):
  gate/up and down share ``I / tp``, which must hold whole groups for both
  (``CompressedTensorsWNA16MoEMethod.create_weights``,
  ``compressed_tensors_moe/compressed_tensors_moe_wna16.py``; asymmetric: ``2 I / tp``
  a multiple of the pack factor), whole NVFP4 blocks
  (``compressed_tensors_moe_w4a4_nvfp4.py``: ``intermediate_size_per_partition // 16``)
  and, for FP8 blocks, ``validate_fp8_block_shape_moe``: ``I / tp`` a multiple of
  ``block_n``, and at tp > 1 of ``block_k``;
* MoE experts under EP: whole experts per rank; ``determine_expert_map``
  (``model_executor/layers/fused_moe/expert_map_manager.py``) gives the first
  ``E % ep`` ranks one more expert, so an uneven E loads (reported), and
  ``E < ep`` leaves ranks without experts (an error);
* kernel-native Marlin (``--target marlin``, or a checkpoint repacked for it):
  the stored tensor is one repack of the whole ``[N, K]``, laid out in 16 x 64
  tiles (docs/kernel-layouts.md §3.1), so a rank's share is a run of whole tiles
  only when its ``N/tp``, ``K/tp`` need no padding of their own:
  ``marlin_padded_nk(n, k, g) == (n, k)`` from vLLM 0.25 on
  (``model_executor/layers/quantization/utils/marlin_utils.py``; §3.4), and
  ``n % 64 == 0``, ``k % 128 == 0`` before (``verify_marlin_supports_shape``),
  plus whole groups (``MarlinLinearKernel.can_implement``,
  ``model_executor/kernels/linear/mixed_precision/marlin.py``). A compressed-tensors
  checkpoint needs only the whole groups for Marlin in 0.33: ``can_implement`` notes that
  "tile misalignment is fixed by zero-padding at weight prep" (``marlin_padded_nk`` per
  partition); the strict ``check_marlin_supports_shape`` (N % 64, K % 128 per rank) is
  what releases before 0.25 required;
* kernel-native CUTLASS NVFP4: block scales are swizzled in 128 x 4 atoms
  (docs/kernel-layouts.md §6.1): ``n % 128 == 0`` and ``(k / 16) % 4 == 0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..checkpoint.config_types import kv_head_count
from ..formats import CompressionFormat, WeightArgs
from ..layouts import marlin_base
from ..layouts.versions import DEFAULT_LAYOUT_VERSION

__all__ = ["EXPERT", "MAX_DEGREE", "VOCAB_PADDING", "ParallelModule", "dense_at", "expert_at", "heads_of", "layer_kind"]

VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE (0.33)
MAX_DEGREE = 1024  # the search for the largest degree stops here

_COLUMN = {
    "q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "query_key_value", "Wqkv",
    "gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "dense_h_to_4h", "q_b_proj", "kv_b_proj",
}  # fmt: skip
_ROW = {"o_proj", "down_proj", "w2", "out_proj", "fc2", "dense_4h_to_h", "wo"}
_REPLICATED = {"q_a_proj", "kv_a_proj_with_mqa", "gate", "router", "shared_expert_gate"}
_VOCAB = {"lm_head", "embed_tokens", "word_embeddings", "wte"}
#: DeepSeek-V3.2/GLM-5's sparse-attention indexer: never split (vLLM 0.33 models/deepseek_v32/attention.py ``Indexer``:
#: ``wq_b`` a ReplicatedLinear, ``wk`` and ``weights_proj`` one ``wk_weights_proj`` built with ``disable_tp=True``)
_INDEXER = {"wq_b", "wk", "weights_proj"}
_HEADS = {"q_proj": "q", "query": "q", "k_proj": "kv", "key": "kv", "v_proj": "kv", "value": "kv"}
EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")


def layer_kind(module: str) -> str:
    """``column`` | ``row`` | ``replicated`` | ``vocab`` | ``unknown``: how vLLM splits ``module`` (module docstring).

    ``dense`` is told by its parent: ``...attention.output.dense`` and ``...output.dense`` (BERT) and
    ``self_attn.dense``/``attention.dense`` (Phi, Falcon, GPT-NeoX) are row-parallel, ``intermediate.dense``
    column-parallel, ``pooler.dense`` replicated; elsewhere ``dense`` is unknown. The DSA indexer's ``wq_b``, ``wk`` and
    ``weights_proj`` are replicated (:data:`_INDEXER`)."""
    parent, _, leaf = module.rpartition(".")
    if module == "output" or leaf in _VOCAB:
        return "vocab"
    if leaf in _COLUMN:
        return "column"
    if leaf in _ROW:
        return "row"
    if leaf in _REPLICATED or (leaf == "proj" and parent.endswith("router")):
        return "replicated"
    if leaf in _INDEXER and parent.rpartition(".")[2] == "indexer":
        return "replicated"
    if leaf == "dense":
        up = parent.rpartition(".")[2]
        if up in ("output", "self_attn", "attention", "self_attention", "attn"):
            return "row"
        if up == "intermediate":
            return "column"
        if up == "pooler":
            return "replicated"
    return "unknown"


@dataclass(frozen=True)
class ParallelModule:
    """One tensor to check: a quantized module (``args`` set) or a dense vocabulary (``args`` None).

    ``shape``: the dense ``[N, K]``; ``kernel``: ``marlin`` or ``cutlass-nvfp4`` when the output is (or will
    be) kernel-native for that kernel, else None; ``layout_version``: the vLLM release of that layout."""

    name: str
    shape: tuple[int, int]
    args: WeightArgs | None = None
    format: str | None = None  # the compressed-tensors format (``pack-quantized`` packs into int32 words)
    kernel: str | None = None
    layout_version: str = DEFAULT_LAYOUT_VERSION


def group_of(args: WeightArgs | None) -> int | None:
    if args is None or args.strategy not in ("group", "tensor_group"):
        return None
    return args.group_size or None


def groups_of(args: WeightArgs) -> str:
    g = args.group_size
    if args.type == "float":
        return f"{g}-element {'NVFP4' if args.strategy == 'tensor_group' else 'MX'} blocks"
    return f"groups of {g}"


def packed_bits(m: ParallelModule) -> int:
    """Bits per value packed into int32 words (``pack-quantized``), else 0."""
    return m.args.num_bits if m.args is not None and m.format == CompressionFormat.PACK_QUANTIZED else 0


def quant_problems(n_r: int, k_r: int, m: ParallelModule, t: int, split: str) -> list[str]:
    """Quantization rules on a rank's ``[n_r, k_r]`` for a layer split along ``split`` (``N``/``K``/``none``)."""
    out = []
    args = m.args
    g = group_of(args)
    if g and k_r % g:
        out.append(f"K per rank {k_r} is not a whole number of {groups_of(args)} (vLLM verify_group_size_divides_partition)")
    bits = packed_bits(m)
    if bits and split == "K" and k_r * bits % 32:
        out.append(f"K per rank {k_r} splits an int32 word of packed {bits}-bit values")
    if bits and not args.symmetric and split == "N" and n_r * bits % 32:
        out.append(f"N per rank {n_r} splits an int32 word of packed {bits}-bit zero points (packed along N)")
    if args is not None and args.strategy == "block" and t > 1:
        bn, bk = args.block_structure
        if split == "K" and k_r % bk:
            out.append(f"K per rank {k_r} is not a multiple of the FP8 block width {bk} (vLLM validate_fp8_block_shape)")
        if split == "N" and n_r % bn:
            out.append(f"N per rank {n_r} is not a multiple of the FP8 block height {bn} (vLLM validate_fp8_block_shape)")
    return out


def kernel_problems(n_r: int, k_r: int, args: WeightArgs | None, kernel: str | None, version: str) -> list[str]:
    """Kernel-native rules: a rank's share of the stored (whole-matrix) layout must be whole tiles/atoms."""
    if kernel == "marlin":
        g = group_of(args) or -1
        if g > 0 and k_r % g:
            return []  # already reported as a split group
        try:
            padded = marlin_base.marlin_padded_nk(n_r, k_r, g, version)
        except ValueError as e:
            return [f"per-rank [{n_r}, {k_r}] is not a whole Marlin tile run: {e}"]
        if padded != (n_r, k_r):
            return [
                f"per-rank [{n_r}, {k_r}] is not whole Marlin tiles (vLLM {version} would pad it to {list(padded)}; "
                "a repack of the whole tensor cannot be cut into per-rank layouts)"
            ]
    if kernel == "cutlass-nvfp4" and (n_r % 128 or k_r % 64):
        return [f"per-rank [{n_r}, {k_r}] is not whole 128x4 CUTLASS scale atoms (needs N % 128 == 0 and K % 64 == 0)"]
    return []


def heads_of(config: dict) -> tuple[int | None, int | None]:
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return c.get("num_attention_heads"), kv_head_count(config)  # null/absent: the class's default (a Qwen2's 32)


def column_parts(m: ParallelModule, t: int, config: dict, warn: list[str]) -> list[int] | str:
    """Each rank's rows of a column-parallel tensor, per fused member (one entry unless the checkpoint
    stores a fused ``gate_up_proj``/``qkv_proj``), or the reason it does not split. Heads follow
    ``QKVParallelLinear`` (module docstring); a fused gate/up splits each half (``MergedColumnParallelLinear``)."""
    n = m.shape[0]
    leaf = m.name.rpartition(".")[2]
    heads, kv = heads_of(config)
    if heads and t > 1 and (leaf in _HEADS or (leaf == "qkv_proj" and n % (heads + 2 * kv) == 0)):
        if heads % t:  # one QKVParallelLinear: its constructor divides the query heads first
            return f"{heads} attention heads do not divide over {t} ranks (vLLM QKVParallelLinear)"
        if kv % t and t % kv:
            return f"{kv} KV heads do not divide over {t} ranks, nor {t} ranks over them (vLLM QKVParallelLinear)"
        kv_r = max(1, kv // t)
        if kv_r == 1 and kv < t:
            warn.append(f"{kv} KV heads replicated {t // kv}x across {t} ranks")
        if leaf == "qkv_proj":
            hd = n // (heads + 2 * kv)
            return [hd * heads // t, hd * kv_r, hd * kv_r]
        count = heads if _HEADS[leaf] == "q" else kv
        if n % count:
            return f"N={n} is not a whole number of its {count} heads"
        return [n // count * (heads // t if _HEADS[leaf] == "q" else kv_r)]
    if leaf == "gate_up_proj" and n % 2 == 0:
        if (n // 2) % t:
            return f"each half ({n // 2} rows) of the fused gate/up is not divisible by {t}"
        return [n // 2 // t] * 2
    if n % t:
        return f"N={n} is not divisible by {t}"
    return [n // t]


def dense_at(m: ParallelModule, kind: str, t: int, config: dict) -> tuple[tuple[int, int] | None, list[str], list[str]]:
    """Per-rank shape and problems of a dense-model tensor at degree ``t``."""
    n, k = m.shape
    warn: list[str] = []
    if kind == "replicated" or t == 1:
        per = (n, k)
        split = "none"
    elif kind == "vocab":
        vp = -(-n // VOCAB_PADDING) * VOCAB_PADDING
        if vp % t:
            return None, [f"padded vocabulary {vp} (V={n} rounded up to {VOCAB_PADDING}) is not divisible by {t} (vLLM VocabParallelEmbedding)"], warn
        per, split = (vp // t, k), "N"
        if vp != n:
            warn.append(f"vocabulary {n} is padded to {vp} rows ({vp // t} per rank)")
    elif kind == "column":
        parts = column_parts(m, t, config, warn)
        if isinstance(parts, str):
            return None, [parts], warn
        per, split = (sum(parts), k), "N"
        if len(parts) > 1:  # a fused tensor: each member's slice must split on its own
            probs = []
            for n_i in parts:
                probs += quant_problems(n_i, k, m, t, "N") + kernel_problems(n_i, k, m.args, m.kernel, m.layout_version) if m.args is not None else []
            return per, list(dict.fromkeys(probs)), warn
    elif kind == "row":
        if k % t:
            return None, [f"K={k} is not divisible by {t}"], warn
        per, split = (n, k // t), "K"
    else:
        raise ValueError(kind)
    probs = quant_problems(*per, m, t, split) if m.args is not None else []
    if m.args is not None and split != "none":
        probs += kernel_problems(*per, m.args, m.kernel, m.layout_version)
    return per, probs, warn


def expert_at(m: ParallelModule, kind: str, t: int, hidden: int | None) -> tuple[tuple[int, int] | None, list[str], list[str]]:
    """Per-rank shape and problems of one expert's 2-D weight when the MoE layer is split by TP ``t``:
    gate/up ``[I, H]`` and down ``[H, I]`` share ``I / t`` (module docstring)."""
    n, k = m.shape
    fused = kind == "expert-column" and m.name.endswith("gate_up_proj")  # one expert's gate and up: [2I, H]
    inter = (n // 2 if fused else n) if kind == "expert-column" else k
    if inter % t:
        return None, [f"moe intermediate size {inter} is not divisible by {t} (vLLM FusedMoEConfig)"], []
    i_r = inter // t
    per = ((2 * i_r if fused else i_r), k) if kind == "expert-column" else (n, i_r)
    args, probs = m.args, []
    if args is None:
        return per, probs, []
    g = group_of(args)
    if g and i_r % g:
        probs.append(f"moe intermediate per rank {i_r} is not a whole number of {groups_of(args)} (vLLM compressed-tensors MoE create_weights)")
    bits = packed_bits(m)
    if bits and not args.symmetric and 2 * i_r * bits % 32:
        probs.append(f"gate+up rows per rank {2 * i_r} split an int32 word of packed {bits}-bit zero points")
    if args.strategy == "block":
        bn, bk = args.block_structure
        if i_r % bn or (t > 1 and i_r % bk):
            probs.append(f"moe intermediate per rank {i_r} is not a multiple of the FP8 block {bn}x{bk} (vLLM validate_fp8_block_shape_moe)")
    if t > 1:
        probs += kernel_problems(*per, args, m.kernel, m.layout_version)
    return per, probs, []
