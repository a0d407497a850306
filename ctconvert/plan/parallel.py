"""The tensor-parallel plan: whether each rank's slice of every quantized tensor is one vLLM can load.

Pure: it works from module names, dense shapes ``[N, K]`` (out-features,
in-features), the weight :class:`~ctconvert.formats.WeightArgs`, an optional
kernel layout and the model config, so the same rules serve ``quantize
--dry-run`` (from the plan) and ``verify`` (from a ``quantization_config``).

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

The largest degree reported is the largest power of two up to which every
power of two works (the degrees GPU hosts offer); ``--tp N`` checks any N.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..checkpoint.modules import Module, dense_shape
from ..checkpoint.naming import resolve_group
from ..errors import agree, plural
from ..formats import WeightArgs
from ..layouts import marlin_base

__all__ = ["ParallelModule", "ParallelReport", "ShardRow", "checkpoint_modules", "kernel_native_modules", "layer_kind", "parallel_report", "plan_modules"]

VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE (0.33)
_MAX_DEGREE = 1024  # the search for the largest degree stops here

_COLUMN = {
    "q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "query_key_value", "Wqkv",
    "gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "dense_h_to_4h", "q_b_proj", "kv_b_proj",
}  # fmt: skip
_ROW = {"o_proj", "down_proj", "w2", "out_proj", "fc2", "dense_4h_to_h", "wo"}
_REPLICATED = {"q_a_proj", "kv_a_proj_with_mqa", "gate", "router", "shared_expert_gate"}
_VOCAB = {"lm_head", "embed_tokens", "word_embeddings", "wte"}
_HEADS = {"q_proj": "q", "query": "q", "k_proj": "kv", "key": "kv", "v_proj": "kv", "value": "kv"}
_EXPERT = re.compile(r"(^|\.)experts\.(\d+)\.")


def layer_kind(module: str) -> str:
    """``column`` | ``row`` | ``replicated`` | ``vocab`` | ``unknown``: how vLLM splits ``module`` (module docstring).

    ``dense`` is told by its parent: ``...attention.output.dense`` and ``...output.dense`` (BERT) and
    ``self_attn.dense``/``attention.dense`` (Phi, Falcon, GPT-NeoX) are row-parallel, ``intermediate.dense``
    column-parallel, ``pooler.dense`` replicated; elsewhere ``dense`` is unknown."""
    parent, _, leaf = module.rpartition(".")
    if module == "output" or leaf in _VOCAB:
        return "vocab"
    if leaf in _COLUMN:
        return "column"
    if leaf in _ROW:
        return "row"
    if leaf in _REPLICATED or (leaf == "proj" and parent.endswith("router")):
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
    layout_version: str = "0.33"


@dataclass
class ShardRow:
    """One tensor of the report: how it splits, its per-rank ``[N, K]`` at the asked degree, and why it fails."""

    name: str
    kind: str  # column | row | replicated | vocab | unknown | expert-column | expert-row | expert-unknown
    shape: tuple[int, int]
    per_rank: tuple[int, int] | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    max_tp: int | None = None  # None: not split by TP (replicated, or an expert under EP)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = {"tensor": self.name, "kind": self.kind, "shape": list(self.shape), "per_rank": list(self.per_rank) if self.per_rank else None}
        d.update(ok=self.ok, max_tp=self.max_tp)
        if self.problems:
            d["problems"] = self.problems
        if self.warnings:
            d["warnings"] = self.warnings
        return d


@dataclass
class ParallelReport:
    """The tensor-parallel plan at degree ``tp`` (and ``ep`` for experts)."""

    tp: int
    ep: int | None
    rows: list[ShardRow]
    model: list[dict]  # model-wide limits (attention heads, expert count): {"what", "max_tp"/"max_ep", "problem"?}
    max_tp: int
    limited_by: list[str]
    max_ep: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and not any("problem" in m for m in self.model)

    @property
    def failing(self) -> list[ShardRow]:
        return [r for r in self.rows if not r.ok]

    @property
    def uneven(self) -> list[str]:
        """The expert-parallel splits that load but are uneven (``--ep`` not dividing the experts): vLLM gives the
        first ranks one expert more (``determine_expert_map``); said in the dry run, the run and ``verify``."""
        return [m["warning"] for m in self.model if "warning" in m and m.get("max_ep") is not None]

    def row(self, name: str) -> ShardRow | None:
        """The row of tensor (module) ``name``, or None."""
        if len(getattr(self, "_by_name", ())) != len(self.rows):
            self._by_name = {r.name: r for r in self.rows}
        return self._by_name.get(name)

    def to_dict(self) -> dict:
        return {
            "tp": self.tp,
            "ep": self.ep,
            "ok": self.ok,
            "max_tp": self.max_tp,
            "limited_by": self.limited_by,
            "max_ep": self.max_ep,
            "model": self.model,
            "notes": self.notes,
            "tensors": [r.to_dict() for r in self.rows],
        }

    def summary(self) -> str:
        """One line: the largest degree, what limits it, the failures at the asked degree and an uneven expert split."""
        lim = f" (limited by {', '.join(self.limited_by[:3])}{' ...' if len(self.limited_by) > 3 else ''})" if self.limited_by else ""
        line = f"tensor parallel: largest TP degree {self.max_tp}{lim}"
        if self.max_ep is not None:
            line += f"; largest even EP degree {self.max_ep}"
        if self.tp > 1 or self.ep:
            at = f"--tp {self.tp}" + (f" --ep {self.ep}" if self.ep else "")
            bad = self.failing
            model_bad = [m["problem"] for m in self.model if "problem" in m]
            if bad or model_bad:
                names = ", ".join(r.name for r in bad[:3]) + (" ..." if len(bad) > 3 else "")
                split = f"{plural(len(bad), 'tensor')} {agree(len(bad), 'does', 'do')} not split" if bad else "every tensor splits"
                line += f"; at {at}: {split}" + (f" ({names})" if bad else "") + "".join(f"; {p}" for p in model_bad)
            else:
                line += f"; at {at}: every tensor splits"
            line += "".join(f"; {w}" for w in self.uneven)
        return line


# -- the rules -----------------------------------------------------------------------------


def _group(args: WeightArgs | None) -> int | None:
    if args is None or args.strategy not in ("group", "tensor_group"):
        return None
    return args.group_size or None


def _groups(args: WeightArgs) -> str:
    g = args.group_size
    if args.type == "float":
        return f"{g}-element {'NVFP4' if args.strategy == 'tensor_group' else 'MX'} blocks"
    return f"groups of {g}"


def _packed_bits(m: ParallelModule) -> int:
    """Bits per value packed into int32 words (``pack-quantized``), else 0."""
    return m.args.num_bits if m.args is not None and m.format == "pack-quantized" else 0


def _quant_problems(n_r: int, k_r: int, m: ParallelModule, t: int, split: str) -> list[str]:
    """Quantization rules on a rank's ``[n_r, k_r]`` for a layer split along ``split`` (``N``/``K``/``none``)."""
    out = []
    args = m.args
    g = _group(args)
    if g and k_r % g:
        out.append(f"K per rank {k_r} is not a whole number of {_groups(args)} (vLLM verify_group_size_divides_partition)")
    bits = _packed_bits(m)
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


def _kernel_problems(n_r: int, k_r: int, args: WeightArgs | None, kernel: str | None, version: str) -> list[str]:
    """Kernel-native rules: a rank's share of the stored (whole-matrix) layout must be whole tiles/atoms."""
    if kernel == "marlin":
        g = _group(args) or -1
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


def _heads(config: dict) -> tuple[int | None, int | None]:
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = c.get("num_attention_heads")
    kv = c.get("num_key_value_heads") or heads
    return heads, kv


def _column_parts(m: ParallelModule, t: int, config: dict, warn: list[str]) -> list[int] | str:
    """Each rank's rows of a column-parallel tensor, per fused member (one entry unless the checkpoint
    stores a fused ``gate_up_proj``/``qkv_proj``), or the reason it does not split. Heads follow
    ``QKVParallelLinear`` (module docstring); a fused gate/up splits each half (``MergedColumnParallelLinear``)."""
    n = m.shape[0]
    leaf = m.name.rpartition(".")[2]
    heads, kv = _heads(config)
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


def _dense_at(m: ParallelModule, kind: str, t: int, config: dict) -> tuple[tuple[int, int] | None, list[str], list[str]]:
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
        parts = _column_parts(m, t, config, warn)
        if isinstance(parts, str):
            return None, [parts], warn
        per, split = (sum(parts), k), "N"
        if len(parts) > 1:  # a fused tensor: each member's slice must split on its own
            probs = []
            for n_i in parts:
                probs += _quant_problems(n_i, k, m, t, "N") + _kernel_problems(n_i, k, m.args, m.kernel, m.layout_version) if m.args is not None else []
            return per, list(dict.fromkeys(probs)), warn
    elif kind == "row":
        if k % t:
            return None, [f"K={k} is not divisible by {t}"], warn
        per, split = (n, k // t), "K"
    else:
        raise ValueError(kind)
    probs = _quant_problems(*per, m, t, split) if m.args is not None else []
    if m.args is not None and split != "none":
        probs += _kernel_problems(*per, m.args, m.kernel, m.layout_version)
    return per, probs, warn


def _expert_at(m: ParallelModule, kind: str, t: int, hidden: int | None) -> tuple[tuple[int, int] | None, list[str], list[str]]:
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
    g = _group(args)
    if g and i_r % g:
        probs.append(f"moe intermediate per rank {i_r} is not a whole number of {_groups(args)} (vLLM compressed-tensors MoE create_weights)")
    bits = _packed_bits(m)
    if bits and not args.symmetric and 2 * i_r * bits % 32:
        probs.append(f"gate+up rows per rank {2 * i_r} split an int32 word of packed {bits}-bit zero points")
    if args.strategy == "block":
        bn, bk = args.block_structure
        if i_r % bn or (t > 1 and i_r % bk):
            probs.append(f"moe intermediate per rank {i_r} is not a multiple of the FP8 block {bn}x{bk} (vLLM validate_fp8_block_shape_moe)")
    if t > 1:
        probs += _kernel_problems(*per, args, m.kernel, m.layout_version)
    return per, probs, []


def _largest(works) -> int:
    t = 1
    while t < _MAX_DEGREE and works(2 * t):
        t *= 2
    return t


def _count_experts(names: list[str], config: dict) -> dict[str, int]:
    """Experts per MoE layer (the prefix before ``experts.``), counted from the names; the config's
    ``num_experts``/``num_local_experts``/``n_routed_experts`` where a layer's names do not say."""
    seen: dict[str, set[int]] = {}
    for name in names:
        mt = _EXPERT.search(name)
        if mt:
            seen.setdefault(name[: mt.start(2)], set()).add(int(mt.group(2)))
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    from_cfg = next((int(c[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts") if c.get(k)), None)
    return {p: max(len(ix), max(ix) + 1, from_cfg or 0) for p, ix in seen.items()}


def parallel_report(modules: list[ParallelModule], config: dict | None = None, tp: int = 1, ep: int | None = None) -> ParallelReport:
    """Check every module at degree ``tp`` (experts at ``ep`` when given) and find the largest TP degree.

    ``modules``: the quantized modules and the dense vocabularies (``lm_head``, token embeddings);
    ``config``: the model's ``config.json`` (heads, expert count, hidden size), may be empty. Raises
    ``ValueError`` for ``tp < 1`` or ``ep < 1``."""
    if tp < 1 or (ep is not None and ep < 1):
        raise ValueError(f"tensor/expert parallel degrees must be >= 1, got tp={tp}, ep={ep}")
    config = config or {}
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = c.get("hidden_size")
    experts = _count_experts([m.name for m in modules], config)
    use_ep = ep is not None and ep > 1
    rows: list[ShardRow] = []
    notes: list[str] = []
    limits: list[tuple[int, str]] = []
    unchecked = [m.name for m in modules if m.shape == (0, 0)]
    if unchecked:
        notes.append(f"not checked (no 2-D [N, K] weight): {', '.join(unchecked[:5])}{' ...' if len(unchecked) > 5 else ''}")
    for m in (m for m in modules if m.shape != (0, 0)):
        kind = layer_kind(m.name)
        expert = _EXPERT.search(m.name) is not None
        if expert:
            kind = {"column": "expert-column", "row": "expert-row"}.get(kind, "expert-unknown")
        if kind == "expert-unknown" or kind == "unknown":
            row = _unknown_row(m, kind, tp, hidden, config, expert and not use_ep)
        elif expert and use_ep:
            row = ShardRow(m.name, kind, m.shape, m.shape, max_tp=None)
        elif expert:
            per, probs, warn = _expert_at(m, kind, tp, hidden)
            row = ShardRow(m.name, kind, m.shape, per, probs, warn, _largest(lambda t, m=m, kind=kind: not _fails(_expert_at(m, kind, t, hidden))))
        else:
            per, probs, warn = _dense_at(m, kind, tp, config)
            mx = None if kind == "replicated" else _largest(lambda t, m=m, kind=kind: not _fails(_dense_at(m, kind, t, config)))
            row = ShardRow(m.name, kind, m.shape, per, probs, warn, mx)
        rows.append(row)
        if row.max_tp is not None:
            limits.append((row.max_tp, row.name))
    model, max_ep = _model_limits(config, experts, tp, ep, limits)
    if ep is not None and not experts:
        notes.append(f"--ep {ep}: no quantized MoE experts (modules named experts.N.), so it changes nothing")
    if any(r.kind.endswith("unknown") for r in rows):
        unk = [r.name for r in rows if r.kind.endswith("unknown")]
        notes.append(
            f"{plural(len(unk), 'tensor')} of a kind the names do not tell (column- or row-parallel), e.g. {unk[0]}: "
            "their largest degree is the one that works under either split"
        )
    best = min((x for x, _ in limits), default=_MAX_DEGREE)
    limited_by = [name for x, name in limits if x == best] if limits else []
    return ParallelReport(tp, ep, rows, model, best, limited_by, max_ep, notes)


def _fails(result) -> bool:
    per, probs, _ = result
    return per is None or bool(probs)


def _unknown_row(m: ParallelModule, kind: str, tp: int, hidden, config: dict, expert_tp: bool) -> ShardRow:
    """A tensor whose split is not known: checked both ways; it fails at ``tp`` when either split fails."""
    if expert_tp:
        ways = [lambda t, k=k: _expert_at(m, k, t, hidden) for k in ("expert-column", "expert-row")]
    elif kind == "expert-unknown":
        return ShardRow(m.name, kind, m.shape, m.shape, max_tp=None, warnings=["an expert of unknown kind; whole under EP"])
    else:
        ways = [lambda t, k=k: _dense_at(m, k, t, config) for k in ("column", "row")]
    probs: list[str] = []
    for way, label in zip(ways, ("as column-parallel", "as row-parallel")):
        per, p, _ = way(tp)
        probs += [f"{label}: {x}" for x in p] + ([] if per is not None or p else [f"{label}: does not split"])
    mx = _largest(lambda t: not any(_fails(w(t)) for w in ways))
    return ShardRow(m.name, kind, m.shape, None, probs, ["column or row parallel: not known from the name; checked both ways"], mx)


def _model_limits(config: dict, experts: dict[str, int], tp: int, ep: int | None, limits: list) -> tuple[list[dict], int | None]:
    """Model-wide limits: attention heads (vLLM ``ModelConfig.verify_with_parallel_config``) and, with
    experts, the EP degrees (``determine_expert_map``)."""
    out: list[dict] = []
    heads, _ = _heads(config)
    if heads:
        mx = _largest(lambda t: heads % t == 0)
        d = {"what": f"num_attention_heads {heads}", "max_tp": mx}
        if heads % tp:
            d["problem"] = f"num_attention_heads {heads} is not divisible by --tp {tp} (vLLM ModelConfig.verify_with_parallel_config)"
        out.append(d)
        limits.append((mx, "num_attention_heads"))
    max_ep = None
    if experts:
        counts = sorted(set(experts.values()))
        e = counts[0]
        max_ep = _largest(lambda p: all(x % p == 0 for x in counts))
        d = {"what": f"{e if len(counts) == 1 else counts} experts per MoE layer", "max_ep": max_ep}
        if ep:
            if any(x < ep for x in counts):
                d["problem"] = f"{e} experts cannot fill --ep {ep} ranks (ranks without experts)"
            elif any(x % ep for x in counts):
                first = "the first rank holds" if e % ep == 1 else f"the first {e % ep} ranks hold"
                d["warning"] = f"{e} experts over --ep {ep}: {first} {e // ep + 1}, the others {e // ep} (vLLM determine_expert_map)"
        out.append(d)
    elif ep:  # a dense model: nothing for --ep to place
        out.append({"what": "MoE experts: none", "max_ep": None, "warning": f"--ep {ep}: no MoE experts (modules named experts.N.), so it changes nothing"})
    return out, max_ep


# -- where the modules come from ---------------------------------------------------------------


def kernel_family(kernel: str | None) -> str | None:
    """``marlin`` for every Marlin kernel (``marlin-int``, ``marlin-fp8``, ``marlin-nvfp4``), else the name."""
    return "marlin" if kernel and kernel.startswith("marlin") else kernel


def _vocab(name: str, info) -> ParallelModule | None:
    module = name.removesuffix(".weight")
    if name.endswith(".weight") and len(info.shape) == 2 and layer_kind(module) == "vocab":
        return ParallelModule(module, tuple(info.shape))
    return None


def plan_modules(plan, tensors: dict, kernel: str | None = None, layout_version: str = "0.33") -> tuple[list[ParallelModule], dict[str, list[str]]]:
    """The modules of a quantize plan (:class:`ctconvert.plan.planner.Plan`) and, per input tensor,
    the modules made from it. The dense ``[N, K]`` is the format's answer for the planned output
    shapes, so any unit the planner makes (a fused 3-D tensor split into experts too) is covered.
    ``kernel``: the ``--target``. Dense vocabularies (embeddings, a dense ``lm_head``) are added."""
    mods: list[ParallelModule] = []
    made: dict[str, list[str]] = {}
    quantized: set[str] = set()
    for u in plan.units:
        if u.kind != "quantize":
            continue
        fmt, args = u.scheme.weight_format, u.scheme.weights
        for module in u.modules:
            shapes = {name[len(module) + 1 :]: tuple(shape) for name, _, shape in u.outputs if name.startswith(module + ".")}
            try:
                n, k = fmt.dense_shape(shapes, args)
            except (ValueError, KeyError, TypeError):  # not a 2-D [N, K] module: stated by parallel_report
                mods.append(ParallelModule(module, (0, 0)))
                continue
            mods.append(ParallelModule(module, (int(n), int(k)), args, u.scheme.format.value, kernel_family(kernel), layout_version))
        # each source to the modules made from it (one each, or all of them where one tensor makes several)
        pairs = zip(u.sources, u.modules) if len(u.sources) == len(u.modules) else ((s, m) for s in u.sources for m in u.modules)
        for src, module in pairs:
            made.setdefault(src, []).append(module)
            quantized.add(src)
    for name, info in tensors.items():
        if name not in quantized and (v := _vocab(name, info)) is not None:
            mods.append(v)
            made.setdefault(name, []).append(v.name)
    return mods, made


def checkpoint_modules(mods: dict[str, Module], tensors: dict) -> list[ParallelModule]:
    """The quantized modules of a compressed-tensors checkpoint (:func:`ctconvert.checkpoint.modules.modules_of`)
    and its dense vocabularies. Modules whose format or shape cannot be read are left out."""
    out: list[ParallelModule] = []
    for m in mods.values():
        if m.quantized and m.group is not None:
            try:
                shape = dense_shape(m)
            except (ValueError, KeyError):
                continue
            out.append(ParallelModule(m.name, tuple(int(x) for x in shape), WeightArgs.from_dict(m.weights), m.format))
    quantized = {m.name + ".weight" for m in mods.values() if m.quantized}
    out += [v for name, info in tensors.items() if name not in quantized and (v := _vocab(name, info)) is not None]
    return out


def kernel_native_modules(qcfg: dict, tensors: dict) -> list[ParallelModule]:
    """The modules of a kernel-native checkpoint (its ``modules`` records: kernel, ``size_n``, ``size_k``),
    with the weight args of the source config's group, and its dense vocabularies."""
    src = qcfg.get("source_quantization_config") or {}
    groups = src.get("config_groups") or {}
    out: list[ParallelModule] = []
    for mod, rec in (qcfg.get("modules") or {}).items():
        g = groups.get(resolve_group(mod, src, True) or "", {})
        args = WeightArgs.from_dict(g.get("weights"))
        fmt = g.get("format") or src.get("format")
        shape = (int(rec["size_n"]), int(rec["size_k"]))
        out.append(ParallelModule(mod, shape, args, fmt, kernel_family(rec.get("kernel")), str(rec.get("layout_version", "0.33"))))
    native = set(qcfg.get("modules") or {})
    out += [v for name, info in tensors.items() if name.removesuffix(".weight") not in native and (v := _vocab(name, info)) is not None]
    return out
