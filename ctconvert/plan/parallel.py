"""The tensor-parallel plan: whether each rank's slice of every quantized tensor is one vLLM can load.

Pure: it works from module names, dense shapes ``[N, K]`` (out-features,
in-features), the weight :class:`~ctconvert.formats.WeightArgs`, an optional
kernel layout and the model config, so the same rules serve ``quantize
--dry-run`` (from the plan) and ``verify`` (from a ``quantization_config``).

The rules for one tensor, and the vLLM code each comes from, are in :mod:`.shard_rules`.

The largest degree reported is the largest power of two up to which every
power of two works (the degrees GPU hosts offer); ``--tp N`` checks any N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoint.expert_count import EXPERT_KEYS, expert_count, expert_family
from ..checkpoint.modules import Module, dense_shape
from ..checkpoint.naming import resolve_group
from ..errors import agree, plural
from ..formats import WeightArgs
from ..layouts.versions import DEFAULT_LAYOUT_VERSION
from .shard_rules import EXPERT, MAX_DEGREE, ParallelModule, dense_at, expert_at, heads_of, layer_kind

__all__ = ["ParallelModule", "ParallelReport", "ShardRow", "checkpoint_modules", "kernel_native_modules", "layer_kind", "parallel_report", "plan_modules"]


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
                if bad:
                    split = f"{plural(len(bad), 'tensor')} {agree(len(bad), 'does', 'do')} not split ({names})"
                    line += f"; at {at}: {split}" + "".join(f"; {p}" for p in model_bad)
                else:  # the tensors split, the model does not (its heads, its experts): one clause, not two that disagree
                    line += f"; at {at}: every tensor splits, but " + "; ".join(model_bad)
            else:
                line += f"; at {at}: every tensor splits"
            line += "".join(f"; {w}" for w in self.uneven)
        return line


# -- the rules -----------------------------------------------------------------------------


def _largest(works) -> int:
    t = 1
    while t < MAX_DEGREE and works(2 * t):
        t *= 2
    return t


def _count_experts(names: list[str], config: dict) -> dict[str, int]:
    """Experts per MoE layer (the prefix before ``experts.``), counted from the names; the config's count where a
    layer's names do not say (the key vLLM 0.33 reads for the family, :func:`~ctconvert.checkpoint.expert_count.expert_count`;
    the first integer of ``num_experts``/``num_local_experts``/``n_routed_experts`` for a family it does not list)."""
    seen: dict[str, set[int]] = {}
    for name in names:
        mt = EXPERT.search(name)
        if mt:
            seen.setdefault(name[: mt.start(2)], set()).add(int(mt.group(2)))
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    counted = expert_count(config) if expert_family(config) is not None else next(((k, c[k]) for k in EXPERT_KEYS if _positive(c.get(k))), None)
    from_cfg = counted[1] if counted is not None and _positive(counted[1]) else None
    return {p: max(len(ix), max(ix) + 1, from_cfg or 0) for p, ix in seen.items()}


def _positive(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


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
        expert = EXPERT.search(m.name) is not None
        if expert:
            kind = {"column": "expert-column", "row": "expert-row"}.get(kind, "expert-unknown")
        if kind == "expert-unknown" or kind == "unknown":
            row = _unknown_row(m, kind, tp, hidden, config, expert and not use_ep)
        elif expert and use_ep:
            row = ShardRow(m.name, kind, m.shape, m.shape, max_tp=None)
        elif expert:
            per, probs, warn = expert_at(m, kind, tp, hidden)
            row = ShardRow(m.name, kind, m.shape, per, probs, warn, _largest(lambda t, m=m, kind=kind: not _fails(expert_at(m, kind, t, hidden))))
        else:
            per, probs, warn = dense_at(m, kind, tp, config)
            mx = None if kind == "replicated" else _largest(lambda t, m=m, kind=kind: not _fails(dense_at(m, kind, t, config)))
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
    best = min((x for x, _ in limits), default=MAX_DEGREE)
    limited_by = [name for x, name in limits if x == best] if limits else []
    return ParallelReport(tp, ep, rows, model, best, limited_by, max_ep, notes)


def _fails(result) -> bool:
    per, probs, _ = result
    return per is None or bool(probs)


def _unknown_row(m: ParallelModule, kind: str, tp: int, hidden, config: dict, expert_tp: bool) -> ShardRow:
    """A tensor whose split is not known: checked both ways; it fails at ``tp`` when either split fails."""
    if expert_tp:
        ways = [lambda t, k=k: expert_at(m, k, t, hidden) for k in ("expert-column", "expert-row")]
    elif kind == "expert-unknown":
        return ShardRow(m.name, kind, m.shape, m.shape, max_tp=None, warnings=["an expert of unknown kind; whole under EP"])
    else:
        ways = [lambda t, k=k: dense_at(m, k, t, config) for k in ("column", "row")]
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
    heads, _ = heads_of(config)
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


def plan_modules(
    plan, tensors: dict, kernel: str | None = None, layout_version: str = DEFAULT_LAYOUT_VERSION
) -> tuple[list[ParallelModule], dict[str, list[str]]]:
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
        out.append(ParallelModule(mod, shape, args, fmt, kernel_family(rec.get("kernel")), str(rec.get("layout_version", DEFAULT_LAYOUT_VERSION))))
    native = set(qcfg.get("modules") or {})
    out += [v for name, info in tensors.items() if name.removesuffix(".weight") not in native and (v := _vocab(name, info)) is not None]
    return out
