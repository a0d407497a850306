"""What a conversion did: one result type for ``quantize`` (also with ``--target``) and the lossless ``convert``.

It lives below ``commands/`` so that both commands (which do not import each
other), the API and ``batch`` read the same fields; ``to_dict`` is the
``--json`` document of either command.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .parallel import ParallelReport
from .planner import Plan

__all__ = ["ConversionResult"]


@dataclass
class ConversionResult:
    """What a conversion did (``to_dict`` is the ``--json`` document).

    ``input_bytes``/``output_bytes``: bytes of tensors; ``seconds``: wall time; ``shards``: output shard
    file names; ``reused_shards``: kept from the interrupted run (``--resume``) or the old output (``--refresh``);
    ``rewritten_shards``: written by this run (every shard of a new output; with ``--resume`` or ``--refresh`` the
    others: together they are ``shards``). A lossless conversion
    (:mod:`ctconvert.commands.convert`) has ``lossless`` set and names the ``source_format``."""

    output: str | None
    scheme: str
    format: str
    dry_run: bool
    input_bytes: int
    output_bytes: int = 0
    seconds: float = 0.0
    shards: list[str] = field(default_factory=list)
    quantized_modules: int = 0
    kept_dense: dict[str, int] = field(default_factory=dict)  # reason -> Linear weights kept dense for it (Plan.kept_dense)
    ignore: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # those of the notes that say vLLM 0.33 refuses the output or builds another class
    device: str = "cpu"
    reused_shards: list[str] = field(default_factory=list)
    error: Exception | None = None  # dry run only: why the real run would stop
    rewritten_shards: list[str] = field(default_factory=list)
    plan: Plan | None = None
    parallel: ParallelReport | None = None  # the tensor-parallel plan (dry run, or --tp/--ep given)
    parallel_of: dict[str, list[str]] = field(default_factory=dict)  # input tensor -> its modules in ``parallel``
    zero_quantized: list[dict] = field(default_factory=list)  # tensors quantized to all zeros from non-zero rows
    calibration: dict | None = None  # what calibration costs (dry run) or did: layers, tokens, source, peak estimate
    source_format: str | None = None  # a lossless conversion: the source's format (modelopt, awq, gptq)
    lossless: bool = False
    nodes: list[dict] | None = None  # --executor ray: [{"node", "node_id", "bytes", "shards"}] (None, not in --json: a local run)

    @classmethod
    def of_plan(cls, plan: Plan, out, dry_run: bool, input_bytes: int, devs) -> ConversionResult:
        return cls(
            output=str(out) if out is not None else None,
            scheme=plan.scheme.name,
            format=plan.format,
            dry_run=dry_run,
            input_bytes=input_bytes,
            quantized_modules=plan.quantized_modules,
            kept_dense={why: len(names) for why, names in plan.kept_dense.items()},
            ignore=plan.ignore,
            notes=plan.notes,
            warnings=plan.warnings,
            device=",".join(map(str, devs)),
            plan=plan,
        )

    def to_dict(self) -> dict:
        hidden = {"plan", "error", "parallel", "parallel_of", *(() if self.lossless else ("source_format", "lossless"))}
        if self.nodes is None:  # a local run: no nodes field (--executor ray: the Ray nodes)
            hidden.add("nodes")
        d = {k: v for k, v in self.__dict__.items() if k not in hidden}
        if self.error is not None:  # a dry run that found what the real run would stop at: its message and exit code
            d["error"] = str(self.error)
            d["exit_code"] = getattr(self.error, "exit_code", 1)
        if self.parallel is not None:
            d["parallel"] = self.parallel.to_dict()
        if self.plan is not None and self.plan.observers:  # each config group's weight observer other than min/max, run or dry run
            d["observers"] = dict(self.plan.observers)
        if self.dry_run and self.plan is not None:
            d["plan"] = self.plan.to_dict()
            if self.plan.observers:  # --observer, per config group (min/max: today's plan)
                d["plan"]["observers"] = dict(self.plan.observers)
            if self.parallel is not None:
                for row in d["plan"]["tensors"]:
                    if (tp := self.max_tp_of(row["name"])) is not None:
                        row["max_tp"] = tp
                d["plan"]["parallel"] = d["parallel"]
        return d

    def max_tp_of(self, tensor: str) -> int | None:
        """The largest TP degree of the modules made from input ``tensor`` (None: not split, or not planned)."""
        if self.parallel is None:
            return None
        rows = [r for m in self.parallel_of.get(tensor, ()) if (r := self.parallel.row(m)) is not None and r.max_tp is not None]
        return min((r.max_tp for r in rows), default=None)
