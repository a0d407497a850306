"""The command line: a thin click shell over :mod:`ctconvert.api`.

Machine-readable output (``--json``) is one JSON document on stdout; human
output (tables) goes to stdout and logs/progress to stderr. Errors print one
line, ``error: ...``, and exit with the code of their class
(:mod:`ctconvert.errors`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback

import click

from . import __version__, errors, jsonout
from .errors import plural


class _Ctx:
    def __init__(self, as_json: bool, debug: bool, quiet: bool, plain: bool = False):
        self.json = as_json
        self.debug = debug
        self.quiet = quiet
        self.plain = plain
        self.lines = False  # batch: JSON Lines, so a --json error document is one line too

    def console(self, stderr: bool = False):
        from rich.console import Console

        cols = os.environ.get("COLUMNS", "")
        tty = (sys.stderr if stderr else sys.stdout).isatty()
        width = None if tty else int(cols) if cols.isdigit() else 160  # a pipe: COLUMNS, else 160
        # a pipe without COLUMNS: a line of text stays one line (grep, awk), only tables fit the width; a terminal
        # (or COLUMNS) wraps it at spaces
        return Console(stderr=stderr, highlight=False, soft_wrap=not tty and not cols.isdigit(), width=width)

    def emit_json(self, data: dict) -> None:
        click.echo(jsonout.dumps(data, indent=None if self.lines else 2))


_AS_PROGRAM = False  # set by run(): the process is ctconvert itself (not a test runner or a host program)


_received: list[int] = []  # the stop signals received, in order


def _stop(signum, frame) -> None:
    """SIGTERM/SIGHUP: stop the command the way Ctrl-C does (the API then aborts or keeps its partial output)."""
    _received.append(signum)
    raise KeyboardInterrupt


def _ignore_stops() -> None:
    for sig in errors.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _interrupted(hint=None):
    """Ctrl-C, SIGTERM or SIGHUP: one line, exit 130 (128 + the signal for the others). A second signal is
    ignored; the output folder was already aborted (by the API), and the exit skips library exit hooks,
    which could re-raise the interrupt. ``hint``: a function giving what was left behind and how to resume
    or remove it (None when nothing was)."""
    _ignore_stops()
    signum = _received[0] if _received else signal.SIGINT
    msg = errors.stop_message(signum, sys.argv[1:]) if _AS_PROGRAM else errors.INTERRUPTED_MESSAGE
    left = hint() if hint else None
    if left:
        msg += f"; {left}"
    click.echo(msg, err=True)
    _flush()
    os._exit(errors.stop_exit_code(signum))


def _partial_hint(output) -> str | None:
    from . import api

    return api.partial_hint(output)


def _escape(text: str) -> str:
    """``text`` shown as it is inside rich markup (a pattern like ``re:.*[a-z]_proj`` is not a style tag)."""
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def _print_problems(con, problems: list[dict]) -> None:
    for p in problems:
        where = ": ".join(x for x in (p.get("file"), p.get("tensor")) if x)  # "file: tensor: what", as the error lines
        text = _escape(f"{where + ': ' if where else ''}{p['message']}")  # names and patterns hold [...]: not markup
        con.print(f"[{'red' if p['severity'] == 'error' else 'yellow'}]{p['severity']}[/]: {text}")


def _run(ctx: _Ctx, fn, hint=None, last: bool = True):
    """Call ``fn``; turn errors into one line and an exit code. ``last``: the command's work is done
    when ``fn`` returns (from then on Ctrl-C is ignored: it must not turn a success into a failure)."""
    try:
        out = fn()
        if _AS_PROGRAM and last:  # done, the output is in place: a Ctrl-C now must not report a failure (or die by signal at exit)
            _ignore_stops()
        return out
    except errors.CTConvertError as e:
        if ctx.debug:
            traceback.print_exc()
        if ctx.json:
            ctx.emit_json({"ok": False, "error": str(e), "exit_code": e.exit_code, "type": type(e).__name__})
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _interrupted(hint)
    except Exception as e:  # noqa: BLE001 - last-resort reporting
        if ctx.debug:
            traceback.print_exc()
        msg = f"internal error: {type(e).__name__}: {str(e).removeprefix('error: ')}" + ("" if ctx.debug else " (run with --debug for the traceback)")
        if ctx.json:
            ctx.emit_json({"ok": False, "error": msg, "exit_code": errors.EXIT_INTERNAL, "type": type(e).__name__})
        click.echo(f"error: {msg}", err=True)
        sys.exit(errors.EXIT_INTERNAL)


def _raise(e: Exception):
    raise e


def _progress_factory(ctx: _Ctx, desc: str = "quantize"):
    """A progress bar on stderr for a terminal; None (no bar) with -q, --json or when stderr is not a terminal."""
    if ctx.json or ctx.quiet or not sys.stderr.isatty():
        return None

    @contextlib.contextmanager
    def factory(total: int, unit: str = "B", desc: str = desc):  # bytes; or calibration's decoder layers (unit="layer")
        from tqdm import tqdm

        scaled = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
        with tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True, **scaled) as bar:
            yield bar

    return factory


def _print_table(ctx: _Ctx, columns: list[tuple[str, int]], rows: list[list[str]], title: str | None = None, caption: str | None = None, styles=None):
    """A table that fits the terminal. ``columns`` are ``(header, priority)``: priority 0 columns hold names,
    never split or cut (as wide as their longest entry); the last column (a reason, a list) may wrap at spaces
    and commas; the other columns are whole tokens. Columns of the highest priority number are dropped first
    until the rest fits (the caption says which). ``--plain``: aligned text with every column, no box, no wrap."""
    widths = [max([len(columns[i][0]), *(len(r[i]) for r in rows)]) for i in range(len(columns))]
    last = len(columns) - 1
    if ctx.plain:
        keep = [i for i in range(len(columns))]
        for line in ([title] if title else []) + [[c for c, _ in columns], *rows] + ([caption] if caption else []):
            click.echo(line if isinstance(line, str) else "  ".join(line[i].ljust(widths[i]) for i in keep).rstrip())
        return
    from rich.table import Table
    from rich.text import Text

    con = ctx.console()
    keep = list(range(len(columns)))
    need = lambda i: (min(widths[i], 14) if i == last else widths[i]) + 3  # noqa: E731 - cell padding and border
    while sum(need(i) for i in keep) + 1 > con.width and any(columns[i][1] > 0 for i in keep):
        keep.remove(max((i for i in keep if columns[i][1] > 0), key=lambda i: (columns[i][1], i)))
    dropped = [columns[i][0] for i in range(len(columns)) if i not in keep]
    if dropped:
        note = f"not shown at this width: {', '.join(dropped)} (--plain or --json show every column)"
        caption = f"{caption}; {note}" if caption else note
    table = Table(title=title, caption=caption, show_lines=False)
    for i in keep:
        if i == last and columns[i][1] > 0:
            table.add_column(columns[i][0], overflow="fold", min_width=min(widths[i], 14))
        else:
            table.add_column(columns[i][0], no_wrap=True, min_width=widths[i])
    for j, r in enumerate(rows):  # cells as Text: a reason or pattern holding [a-z] is not rich markup
        table.add_row(*(Text(r[i]) for i in keep), style=styles[j] if styles else None)
    con.print(table)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ctconvert")
@click.option("--json", "as_json", is_flag=True, help="Print one machine-readable JSON document on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary.")
@click.option("--plain", is_flag=True, help="Tables as plain aligned columns, one row per line (for grep, awk and narrow terminals).")
@click.pass_context
def main(click_ctx, as_json, debug, quiet, plain):
    """Convert Hugging Face checkpoints to compressed-tensors checkpoints that vLLM loads."""
    click_ctx.obj = _Ctx(as_json, debug, quiet, plain)


def _json_option(f):
    """The group's ``--json``, ``-q`` and ``--debug`` accepted after the command name too
    (``ctconvert inspect X --json``, ``ctconvert quantize ... -q``)."""

    def flag(attr):
        def cb(click_ctx, _param, value):
            if value:
                setattr(click_ctx.find_object(_Ctx), attr, True)
            return value

        return cb

    for names, attr, text in (
        (("--plain",), "plain", "Tables as plain aligned columns."),
        (("--debug",), "debug", "Show tracebacks on errors."),
        (("-q", "--quiet"), "quiet", "No progress bar or summary."),
    ):
        f = click.option(*names, f"{attr}_flag", is_flag=True, expose_value=False, callback=flag(attr), is_eager=True, help=text)(f)
    return click.option(
        "--json", "json_flag", is_flag=True, expose_value=False, callback=flag("json"), is_eager=True, help="One machine-readable JSON document on stdout."
    )(f)


def _split(values: tuple[str, ...]) -> list[str]:
    """Repeated options, each possibly a comma-separated list. A comma inside ``()``, ``[]`` or ``{}`` stays
    in its entry, so a ``re:`` pattern may hold commas there (``re:.*{1,3}``, ``re:.*(a,b)``)."""
    out = []
    for v in values:
        depth, start = 0, 0
        for i, ch in enumerate(v + ","):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth = max(0, depth - 1)
            elif ch == "," and depth == 0:
                if entry := v[start:i].strip():
                    out.append(entry)
                start = i + 1
    return out


@main.command()
@click.argument("src", type=click.Path(path_type=str))
@click.option("-o", "--output", "output", type=click.Path(path_type=str), help="Output folder (created; must not exist unless --overwrite).")
@click.option(
    "-s",
    "--scheme",
    required=True,
    help="compressed-tensors preset: FP8_DYNAMIC, FP8_BLOCK, W8A8, W4A16, W4A16_ASYM, W8A16, NVFP4A16, MXFP4A16, MXFP4, MXFP8A16, MXFP8, W4AFP8; "
    "calibrated: NVFP4, FP8, W8A8_STATIC, W8A8_STATIC_ASYM (DENSE: with --sparsity only); or a .json/.yaml file holding a compressed-tensors "
    "QuantizationScheme.",
)
@click.option(
    "--sparsity",
    type=click.Choice(["2:4"]),
    default=None,
    help="Magnitude 2:4 pruning along K. With DENSE, FP8_DYNAMIC or W8A8: sparse-24-bitmask, which vLLM <= 0.18 loads "
    "(SM90; current vLLM does not); with W4A16 and --target marlin-24: marlin-24, which vLLM <= 0.15 loads.",
)
@click.option("--all-layers", is_flag=True, help="With --dry-run: list every tensor (default: each when <= 60, else a summary).")
@click.option("--group-size", type=click.IntRange(min=1), default=None, help="W4A16/W8A16: columns per weight scale (default: the preset's, 128).")
@click.option("--symmetric/--asymmetric", "symmetric", default=None, help="W4A16/W8A16: weights without / with a zero point (default: the preset's).")
@click.option(
    "--lm-head",
    type=click.Choice(["none", "nvfp4a16", "fp8"], case_sensitive=False),
    default="none",
    show_default=True,
    help="Also quantize lm_head (own config group).",
)
@click.option("--targets", multiple=True, help="Modules to quantize: names, re:patterns or Linear (default Linear). Repeat, or separate with commas.")
@click.option("--ignore", multiple=True, help="Modules to leave dense (names or re:patterns), added to the defaults. Repeat, or separate with commas.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard (e.g. 5GB, 500MB).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder (atomically, at the end).")
@click.option("--dry-run", is_flag=True, help="Print the plan and exit without reading tensor data.")
@click.option("--skip-incompatible", is_flag=True, help="Keep weights the scheme cannot take dense (listed in ignore and reported) instead of failing.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N, cuda:0,1 or all (every GPU).")
@click.option("--lm-head-chunk-rows", type=click.IntRange(min=1), default=8192, show_default=True, help="Rows of lm_head processed at a time.")
@click.option("--resume", is_flag=True, help="Reuse the shards an interrupted run of the same command finished (checked by content hash).")
@click.option("--refresh", is_flag=True, help="Against an existing output: re-derive only tensors whose source changed; rewrite only their shards.")
@click.option(
    "--target",
    "target",
    type=click.Choice(["marlin", "cutlass-nvfp4", "cutlass-2of4", "cutlass-2of4-sm80", "marlin-24"]),
    default=None,
    help="Also repack into this kernel-native layout (see `ctconvert repack`). marlin-24 (with --sparsity 2:4 and W4A16) "
    "writes the compressed-tensors marlin-24 format, which vLLM <= 0.15 loads.",
)
@click.option("--layout-version", default=None, help="With --target: vLLM release whose layout to build  [default: 0.33]")
@click.option("--act-dtype", type=click.Choice(["bf16", "fp16"]), default=None, help="With --target: activation dtype  [default: bf16]")
@click.option("--allow-non-finite", is_flag=True, help="Copy pass-through tensors holding NaN/inf (with a note) instead of failing.")
@click.option("--keep-other-weights", is_flag=True, help="Also copy weights in other formats (*.bin, *.pth, original/, *.gguf ...).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Check that every tensor splits over this many tensor-parallel ranks.")
@click.option("--ep", type=click.IntRange(min=1), default=None, help="Check the MoE experts for this many expert-parallel ranks (then not split by --tp).")
@click.option(
    "--calibration",
    "calibration",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Calibration data: plain text, JSON lines with a 'text' field, or token ids (default: the built-in English corpus).",
)
@click.option("--calibration-samples", type=int, default=8, show_default=True, help="Calibration samples (rows of tokens).")
@click.option("--calibration-seq-len", type=int, default=256, show_default=True, help="Tokens per calibration sample.")
@click.option(
    "--kv-cache",
    type=click.Choice(["none", "fp8", "fp8-head"], case_sensitive=False),
    default="none",
    show_default=True,
    help="FP8 KV cache with calibrated k_scale/v_scale: per tensor (fp8) or per KV head (fp8-head).",
)
@click.option("--keep-unclassified", is_flag=True, help="Keep tensors no rule classifies dense (listed in ignore and reported) instead of failing.")
@click.option("--no-default-ignore", is_flag=True, help="Drop every default ignore (lm_head, routers, towers, MTP, Linear outside the blocks).")
@click.option("--quantize-mtp", is_flag=True, help="Also quantize multi-token-prediction (MTP) layers (dense by default).")
@click.option(
    "--dense-dtype",
    type=click.Choice(["keep", "bf16", "fp16", "fp32"], case_sensitive=False),
    default="keep",
    show_default=True,
    help="Cast the tensors that are not quantized (embeddings, norms, biases, a dense lm_head ...) to this dtype, like mlx_lm.convert --dtype; "
    "config.json's torch_dtype follows. keep: their stored dtype.",
)
@_json_option
@click.pass_obj
def quantize(
    ctx: _Ctx,
    src,
    output,
    scheme,
    lm_head,
    targets,
    ignore,
    max_shard_size,
    overwrite,
    dry_run,
    skip_incompatible,
    device,
    lm_head_chunk_rows,
    resume,
    refresh,
    target,
    layout_version,
    act_dtype,
    allow_non_finite,
    keep_other_weights,
    tp,
    ep,
    sparsity,
    group_size,
    symmetric,
    all_layers,
    calibration,
    calibration_samples,
    calibration_seq_len,
    kv_cache,
    keep_unclassified,
    no_default_ignore,
    quantize_mtp,
    dense_dtype,
):
    """Quantize the Linear weights of the checkpoint SRC.

    The output is a compressed-tensors checkpoint (kernel-native with --target). SRC may already be
    quantized (compressed-tensors, Hugging Face FP8 block, ModelOpt NVFP4, AutoAWQ, GPTQ): it is
    dequantized on the fly and requantized, or converted losslessly when --scheme is its own."""
    from . import api

    if not dry_run and not output:
        raise click.UsageError("missing option -o/--output (or use --dry-run)")
    if target is None and (layout_version or act_dtype):
        given = " and ".join(o for o, v in (("--layout-version", layout_version), ("--act-dtype", act_dtype)) if v)
        msg = f"{given} without --target: they choose a kernel-native layout; add --target marlin (or cutlass-nvfp4), or leave them out"
        _run(ctx, lambda: _raise(errors.UsageError(msg)))
    default = api.QuantizeOptions()
    layout_version, act_dtype = layout_version or default.layout_version, act_dtype or default.act_dtype
    if target and (resume or refresh) and not dry_run:
        raise click.UsageError("--target cannot be combined with --resume or --refresh")
    options = api.QuantizeOptions(
        lm_head=lm_head,
        targets=_split(targets) or None,
        ignore=_split(ignore),
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        dry_run=dry_run,
        resume=resume and not target,
        refresh=refresh and not target,
        skip_incompatible=skip_incompatible,
        device=device,
        lm_head_chunk_rows=lm_head_chunk_rows,
        allow_nonfinite=allow_non_finite,
        keep_other_weights=keep_other_weights,
        tp=tp,
        ep=ep,
        sparsity=sparsity,
        group_size=group_size,
        symmetric=symmetric,
        calibration=calibration,
        calibration_samples=calibration_samples,
        calibration_seq_len=calibration_seq_len,
        kv_cache=kv_cache,
        keep_unclassified=keep_unclassified,
        default_ignore=not no_default_ignore,
        quantize_mtp=quantize_mtp,
        dense_dtype=dense_dtype,
        **(dict(target=target, layout_version=layout_version, act_dtype=act_dtype) if target else {}),
    )
    result = _run(
        ctx,
        hint=None if dry_run or target else lambda: _partial_hint(output),
        fn=lambda: api.quantize(src, output, scheme, options=options, progress=_progress_factory(ctx)),
    )
    if ctx.json:
        extra = {"target": {"target": target, "layout_version": layout_version, "act_dtype": act_dtype}} if target and dry_run else {}
        ctx.emit_json({"ok": result.error is None, **result.to_dict(), **extra})
        if result.error is not None:
            sys.exit(result.error.exit_code)
        return
    if dry_run:
        _print_plan(ctx, result, target=(target, layout_version, act_dtype) if target else None, all_rows=all_layers)
        if result.error is not None:
            click.echo(f"error: {result.error}", err=True)
            sys.exit(result.error.exit_code)
        return
    if not ctx.quiet:
        ratio = result.input_bytes / max(1, result.output_bytes)
        click.echo(
            f"wrote {result.output}: {result.scheme} ({result.format}), {plural(result.quantized_modules, 'Linear layer')} quantized, "
            f"{plural(len(result.shards), 'shard')}, {_human(result.input_bytes)} -> {_human(result.output_bytes)} ({ratio:.2f}x) "
            f"in {result.seconds:.1f} s on {result.device}"
        )
        if result.reused_shards:
            click.echo(f"resumed: {plural(len(result.reused_shards), 'shard')} kept from the interrupted run", err=True)
        if refresh:
            click.echo(f"refreshed: rewrote {len(result.rewritten_shards)} of {plural(len(result.shards), 'shard')}", err=True)
        for n in result.notes:
            click.echo(f"note: {n}", err=True)


def _reason_kind(row) -> str:
    """A plan row's reason without its per-tensor part (fused sets differ by layer; their kind does not)."""
    if row.fused_set:  # "fused {gate_proj, up_proj}": a space after each comma, so a narrow table wraps between names
        return "fused " + row.fused_set.rpartition(".")[2].replace(",", ", ")
    return _with_cast(row.reason or "", row)


def _with_cast(text: str, row) -> str:
    """A plan row's reason, with the ``--dense-dtype`` cast of a tensor kept dense (``embedding; cast fp32->bf16``)."""
    cast = getattr(row, "cast", None)
    return f"{text}; cast {cast}" if cast and text else (f"cast {cast}" if cast else text)


def _print_plan(ctx: _Ctx, result, target=None, all_rows: bool = False) -> None:
    plan = result.plan
    sourced = any(getattr(r, "source", None) for r in plan.rows)  # a quantized input: the format each tensor comes from
    cols = [("tensor", 0), ("dtype", 3), ("shape", 2), *([("source", 2)] if sourced else []), ("action", 0), ("scheme", 5), ("max TP", 4)]
    cols.append(("fused set / reason", 1))
    max_tp = getattr(result, "max_tp_of", lambda name: None)
    tps = [max_tp(r.name) for r in plan.rows]
    rows = [
        [r.name, r.dtype, "x".join(map(str, r.shape)), *([r.source or "dense"] if sourced else []), r.action, r.scheme or "", "" if tp is None else str(tp)]
        + [_with_cast(r.fused_set or r.reason or "", r)]
        for r, tp in zip(plan.rows, tps)
    ]
    styles = [{"quantize": "green", "convert": "green", "ignore": "yellow", "drop": "red"}.get(r.action) for r in plan.rows]
    con = ctx.console()
    title = f"plan: {plan.scheme.name} ({plan.format})"
    if target:
        title += f", then repacked for {target[0]} (vLLM layout {target[1]}, {target[2]} activations)"
    if all_rows or len(rows) <= 60:
        _print_table(ctx, cols, rows, title=title, styles=styles)
    else:  # a big model: one row per (action, scheme, reason), naming the first tensor of each
        agg: dict[tuple, list] = {}
        for r, tp in zip(plan.rows, tps):
            key = (r.action, r.scheme or "", _reason_kind(r))
            agg.setdefault(key, []).append((r.name, tp))
        srows = []
        for (a, sch, why), members in agg.items():
            known = [tp for _, tp in members if tp is not None]  # the group's max TP: its most limiting tensor's
            name = f"{len(members)} x {members[0][0]}" + (" ..." if len(members) > 1 else "")
            srows.append([name, a, sch, str(min(known)) if known else "", why])
        _print_table(
            ctx,
            [("tensors (count x first)", 0), ("action", 0), ("scheme", 3), ("max TP", 4), ("fused set / reason", 1)],
            srows,
            title=title,
            caption=f"{len(rows)} tensors summarized; --all-layers lists each",
        )
    counts = {a: sum(1 for r in plan.rows if r.action == a) for a in ("quantize", "convert", "ignore", "copy", "split", "drop")}
    more = "".join(
        f", {w}"
        for a, w in (
            ("convert", f"{counts['convert']} converted losslessly"),
            ("split", f"{plural(counts['split'], 'fused expert tensor')} split per expert"),
            ("drop", f"{counts['drop']} dropped"),
        )
        if counts[a]
    )
    con.print(f"{plural(counts['quantize'], 'tensor')} to quantize, {counts['ignore']} Linear kept dense (ignore), {counts['copy']} copied{more}", markup=False)
    if plan.defaults:
        applied = ", ".join(f"{k}: {v}" for k, v in plan.defaults.items())
        con.print(f"defaults applied (modules kept dense; --no-default-ignore drops them): {applied}", markup=False)
    con.print(f"output: {_human(result.output_bytes)} of tensors (input {_human(result.input_bytes)})")
    con.print(f"ignore: {plan.ignore}", markup=False)  # re: patterns hold [a-z]: not markup
    parallel = getattr(result, "parallel", None)
    if parallel is not None:
        con.print(result.parallel.summary(), markup=False)
        failing = result.parallel.failing
        for r in failing[:10]:
            con.print(f"  {r.name}: {'; '.join(r.problems)}", markup=False)
        if len(failing) > 10:
            con.print(f"  ... and {len(failing) - 10} more (--json lists every tensor)", markup=False)
    for n in plan.notes + (parallel.notes if parallel is not None else []):
        con.print(f"note: {n}", markup=False)


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--all-layers", is_flag=True, help="List every layer (default: every layer when <= 60, else a summary per scheme).")
@_json_option
@click.pass_obj
def inspect_cmd(ctx: _Ctx, path, all_layers):
    """Describe the checkpoint PATH from its headers.

    Per layer: scheme, format, dtypes, shapes, bytes and bits per weight; then the problems found (exit 3 for an error)."""
    from . import api

    report = _run(ctx, lambda: api.inspect(path))
    errs = [p for p in report["problems"] if p["severity"] == "error"]
    if ctx.json:
        ctx.emit_json({"ok": not errs, **report, "exit_code": errors.EXIT_BAD_INPUT if errs else 0})
    else:
        _print_inspect(ctx, report, all_layers)
    if errs:
        sys.exit(errors.EXIT_BAD_INPUT)


def _cell_format(row: dict) -> str:
    """A layer's format cell; a dense layer ``quantize --dense-dtype`` cast says so (``dense, cast fp32->bf16``)."""
    return f"{row['format'] or ''}, cast {row['cast']}" if row.get("cast") else row["format"] or ""


def _parts(tensors: dict) -> str:
    return ", ".join(f"{p}:{t['dtype']}{t['shape']}" for p, t in tensors.items())


def _print_inspect(ctx: _Ctx, report: dict, all_layers: bool) -> None:

    con = ctx.console()
    q = report["quantization_config"]
    from . import api

    if api.is_kernel_native(q):
        con.print(
            f"[bold]{_escape(report['path'])}[/bold]: kernel-native ({q['target']}, vLLM layout {q['layout_version']}, activations {q['act_dtype']}); "
            "not loadable as compressed-tensors: `ctconvert repack --target compressed-tensors` restores it"
        )
    else:
        if not q:
            what = "dense (no quantization_config)"
        elif q.get("quant_method") == "compressed-tensors":
            what = f"{q['quant_method']} / {q['format']} / {q['quantization_status']}"
        else:  # another method: its own settings, not compressed-tensors' (empty) fields
            what = f"{q.get('quant_method')} (not compressed-tensors): " + ", ".join(f"{k}={v}" for k, v in q.items() if k != "quant_method" and v is not None)
        con.print(f"[bold]{_escape(report['path'])}[/bold]: {_escape(what)}", markup=True)
    if sp := report.get("sparsity_config"):
        legacy = "a legacy format: vLLM <= 0.18 loads sparse-24-bitmask, <= 0.15 marlin-24"
        con.print(f"  sparsity: {sp.get('sparsity_structure')} {sp.get('format')} ({legacy})", markup=False)
    if (d := report.get("derived_from")) is not None:
        how = "converted losslessly" if d.get("conversion") == "lossless" else "requantized"
        formats = "; ".join(d.get("formats") or [])
        qm = str(d.get("quant_method") or "")
        what = formats if qm and formats.lower().startswith(qm.lower()) else f"{qm}: {formats}"  # "awq gemm int4 ...", not "awq: awq gemm"
        con.print(f"  {how} from {d.get('path')} ({what})", markup=False)
    if c := report.get("dense_cast"):
        casts = ", ".join(f"{plural(n, 'tensor')} {k}" for k, n in c["casts"].items())
        con.print(f"  cast at conversion (--dense-dtype): {casts}", markup=False)
    for g, v in report["config_groups"].items():
        con.print(f"  config group {g}: targets={v['targets']} scheme={v['scheme']} format={v['format']}", markup=False)
    layers = report["layers"]
    cols = [("layer", 0), ("scheme", 2), ("format", 3), ("bytes", 1), ("bits/w", 0), ("tensors (dtype shape)", 4)]
    if all_layers or len(layers) <= 60:
        rows = [[r["module"], r["scheme"] or "", _cell_format(r), _human(r["bytes"]), str(r["bits_per_weight"]), _parts(r["tensors"])] for r in layers]
        caption = None
    else:
        agg: dict[tuple, list] = {}
        for r in layers:
            a = agg.setdefault((r["scheme"], r["format"]), [[], 0, 0, {}])
            a[0].append(r["module"])
            a[1] += r["bytes"]
            a[2] += r["params"]
            for part, t in r["tensors"].items():
                a[3].setdefault(part, set()).add(t["dtype"])
        rows = []
        for (sch, f), (names, b, p, parts) in agg.items():
            ts = ", ".join(f"{part}:{'/'.join(sorted(d))}" for part, d in sorted(parts.items()))  # shapes differ: dtypes only
            label = names[0] if len(names) == 1 else f"{len(names)} layers ({names[0]} ...)"  # a summary row names its layer(s)
            rows.append([label, sch or "", f or "", _human(b), f"{8 * b / p:.3f}" if p else "", ts])
        caption = f"{len(layers)} Linear layers summarized per scheme; --all-layers lists each"
    if rows:  # an unreadable folder: no empty table above its errors
        _print_table(ctx, cols, rows, caption=caption)
    t = report["totals"]
    con.print(
        f"{plural(t['tensors'], 'tensor')} in {plural(t['files'], 'file')}, {_human(t['bytes'])}; "
        f"{t['quantized_layers']}/{plural(t['linear_layers'], 'Linear layer')} quantized"
        + (f", {t['linear_bits_per_weight']} bits per Linear weight" if t["linear_bits_per_weight"] is not None else "")
        + (f", {t['quantized_bits_per_weight']} per quantized weight" if t.get("quantized_bits_per_weight") is not None else ""),
        markup=False,
    )
    if report["problems"]:
        _print_problems(con, report["problems"])
    else:
        con.print("no problems found")


@main.command("verify")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--reference", type=click.Path(path_type=str), help="The dense source: compare every tensor with it.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Check that every tensor splits over this many tensor-parallel ranks.")
@click.option("--ep", type=click.IntRange(min=1), default=None, help="Check the MoE experts for this many expert-parallel ranks (then not split by --tp).")
@_json_option
@click.pass_obj
def verify_cmd(ctx: _Ctx, path, reference, tp, ep):
    """Check the compressed-tensors checkpoint PATH.

    Exit 5 when a check fails; 3 for a dense checkpoint without --reference (with it, its values are compared)."""
    from . import api

    report = _run(ctx, lambda: api.verify(path, reference, tp=tp, ep=ep, progress=_progress_factory(ctx, "verify")))
    if ctx.json:
        ctx.emit_json({**report, "exit_code": 0 if report["ok"] else errors.EXIT_VERIFY_FAILED})
    else:
        con = ctx.console()
        c = report["checked"]
        con.print(f"checked {plural(c['shards'], 'shard')}, {plural(c['tensors'], 'tensor')} ({_human(c['bytes'])}): {'; '.join(c['checks'])}", markup=False)
        if (sm := report["summary"]) is not None:
            con.print(
                f"{plural(sm['modules'], 'weight')} compared with {reference}: {sm['failed']} over the limit; worst {sm['worst_module']} "
                f"(relative L2 {sm['worst_rel_l2']:.4f}, limit {sm['worst_threshold']}), lowest SNR {sm['min_snr_db']:.1f} dB",
                markup=False,
            )
            if "worst_rel_l2_dense" in sm:  # 2:4: judged against the pruned reference, the pruning's error beside it
                con.print(
                    f"{plural(sm['sparse_modules'], '2:4 sparse weight')} judged against the reference pruned 2:4; against the dense "
                    f"reference (the pruning's own error, not judged) the worst is {sm['worst_dense_module']} (relative L2 {sm['worst_rel_l2_dense']:.4f})",
                    markup=False,
                )
        if report["tensors"]:
            sparse = any("rel_l2_dense" in r for r in report["tensors"])
            cols = [("module", 0), ("format", 3), ("rel L2", 0), ("max abs", 2), ("SNR dB", 1), ("limit", 4), ("ok", 0)]
            rows = [
                [r["module"], r["format"], f"{r['rel_l2']:.4f}", f"{r['max_abs']:.3g}", f"{r['snr_db']:.1f}", str(r["threshold"]), "yes" if r["ok"] else "NO"]
                for r in report["tensors"]
            ]
            if sparse:  # the rel L2 column is against the pruned reference for 2:4 modules; this one against the dense one
                cols.insert(5, ("rel L2 dense", 2))
                for row, r in zip(rows, report["tensors"]):
                    row.insert(5, f"{r['rel_l2_dense']:.4f}" if "rel_l2_dense" in r else "")
            title = f"error against {reference}" + (" (2:4 modules: rel L2 against it pruned 2:4, rel L2 dense against it as it is)" if sparse else "")
            _print_table(ctx, cols, rows, title=title, styles=[None if r["ok"] else "red" for r in report["tensors"]])
        par = report.get("parallel")
        if par:
            ep_note = f", largest even EP degree {par['max_ep']}" if par["max_ep"] else ""
            con.print(f"tensor parallel: largest TP degree {par['max_tp']}{ep_note}", markup=False)
        _print_problems(con, report["problems"])
        con.print("[green]verify: passed[/]" if report["ok"] else "[red]verify: FAILED[/]")
    if not report["ok"]:
        sys.exit(errors.EXIT_VERIFY_FAILED)


@main.command("decompress")
@click.argument("src", type=click.Path(path_type=str))
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=str), help="Output folder.")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Cast every float tensor to this dtype (and say so in config.json). Default: dequantized weights in the model's dtype, other tensors as stored.",
)
@click.option("--max-shard-size", default="5GB", show_default=True)
@click.option("--overwrite", is_flag=True)
@_json_option
@click.pass_obj
def decompress_cmd(ctx: _Ctx, src, output, dtype, max_shard_size, overwrite):
    """Write a dense copy of the compressed-tensors checkpoint SRC."""
    from . import api

    res = _run(
        ctx,
        lambda: api.decompress(src, output, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, progress=_progress_factory(ctx, "decompress")),
    )
    if ctx.json:
        ctx.emit_json({"ok": True, **res})
    elif not ctx.quiet:
        click.echo(
            f"wrote {res['output']}: {plural(res['modules_decompressed'], 'module')} decompressed to {res['dtype']}"
            + (", every float tensor cast to it" if res["cast_all"] else ", other tensors as stored")
            + ", "
            f"{_human(res['input_bytes'])} -> {_human(res['output_bytes'])} in {res['seconds']:.1f} s"
        )
        if res["left_out"]:
            click.echo(f"note: left out {plural(len(res['left_out']), 'KV-cache scale')} (k_scale/v_scale: a dense checkpoint has no kv_cache_scheme)")
        for note in res["notes"]:
            click.echo(f"note: {note}")


@main.command("convert")
@click.argument("src", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", "output", type=click.Path(path_type=str), help="Output folder (created; must not exist unless --overwrite).")
@click.option("-s", "--scheme", default=None, help="The target, when not the source's own: NVFP4A16 for a ModelOpt NVFP4 source drops its input scales.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard (e.g. 5GB, 500MB).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder (atomically, at the end).")
@click.option("--dry-run", is_flag=True, help="Print the plan and exit without writing.")
@_json_option
@click.pass_obj
def convert_cmd(ctx: _Ctx, src, output, scheme, max_shard_size, overwrite, dry_run):
    """Losslessly re-express AWQ, GPTQ or ModelOpt NVFP4 checkpoints.

    The ModelOpt NVFP4, AutoAWQ or GPTQ checkpoint SRC is written as compressed-tensors, without rounding."""
    from . import api

    if not dry_run and not output:
        raise click.UsageError("missing option -o/--output (or use --dry-run)")
    res = _run(ctx, lambda: api.convert(src, output, scheme=scheme, max_shard_size=max_shard_size, overwrite=overwrite, dry_run=dry_run))
    if ctx.json:
        ctx.emit_json({"ok": True, **res.to_dict()})
    elif dry_run:
        _print_plan(ctx, res)
    elif not ctx.quiet:
        click.echo(
            f"wrote {res.output}: {res.source_format} -> {res.scheme} ({res.format}), {plural(res.quantized_modules, 'module')} converted losslessly, "
            f"{_human(res.input_bytes)} -> {_human(res.output_bytes)} in {res.seconds:.1f} s"
        )
        for n in res.notes:
            click.echo(f"note: {n}", err=True)


@main.command("repack")
@click.argument("src", type=click.Path(path_type=str))
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=str), help="Output folder.")
@click.option(
    "-t",
    "--target",
    required=True,
    type=click.Choice(["marlin", "cutlass-nvfp4", "cutlass-2of4", "cutlass-2of4-sm80", "compressed-tensors"]),
    help="Kernel layout to build, or compressed-tensors to undo a repack. cutlass-2of4: the SM90 CUTLASS 2:4 tensors of vLLM <= 0.18; "
    "cutlass-2of4-sm80: PyTorch's SM80 semi-structured layout.",
)
@click.option("--layout-version", default="0.33", show_default=True, help="vLLM release whose layout to build (0.21, 0.25, 0.29 ... 0.33).")
@click.option("--act-dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True, help="Activation dtype the kernel will run with.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--max-shard-size", default="5GB", show_default=True)
@click.option("--overwrite", is_flag=True)
@_json_option
@click.pass_obj
def repack_cmd(ctx: _Ctx, src, output, target, layout_version, act_dtype, device, max_shard_size, overwrite):
    """Rebuild SRC's quantized weights in a kernel-native layout.

    The layout vLLM builds at load time, done offline; --target compressed-tensors restores the checkpoint."""
    from . import api

    res = _run(
        ctx,
        lambda: api.repack(
            src,
            output,
            target,
            layout_version=layout_version,
            act_dtype=act_dtype,
            device=device,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            progress=_progress_factory(ctx, "repack"),
        ),
    )
    if ctx.json:
        ctx.emit_json({"ok": True, **res})
    elif not ctx.quiet:
        what = "restored to compressed-tensors" if target == "compressed-tensors" else f"repacked for {target} (vLLM layout {layout_version})"
        click.echo(f"wrote {res['output']}: {plural(res['modules'], 'module')} {what} in {res['seconds']:.1f} s on {res['device']}")


@main.command("batch")
@click.argument("jobs_file", type=click.Path(dir_okay=False, path_type=str))
@click.option("--keep-going", is_flag=True, help="Run every job even after one fails.")
@_json_option
@click.pass_obj
def batch_cmd(ctx: _Ctx, jobs_file, keep_going):
    """Run the conversions listed in JOBS_FILE (YAML or JSON).

    JSON Lines on stdout: one line per job, then a summary line."""
    from . import api

    ctx.lines = True  # JSON Lines on stdout, also for an error (one compact line)
    as_json, ctx.json = ctx.json, False  # a refused jobs file: its error line and summary line are on stdout already
    jobs = _run(ctx, lambda: api.load_jobs(jobs_file, emit=click.echo), last=False)
    ctx.json = as_json
    running: dict = {}

    def hint() -> str | None:  # what an interrupt stopped: the running job, what it left, and what earlier jobs wrote
        if not running:
            return "no job had started"
        left = api.partial_hint(running["output"], batch=True)
        n = running["i"]
        done = (  # a batch run again stops at a finished job's output (exit 6) unless the job is dropped
            ""
            if not n
            else "; job 0 finished and its output is in place (drop it from the jobs file before running the batch again)"
            if n == 1
            else f"; jobs 0-{n - 1} finished and their outputs are in place (drop them from the jobs file before running the batch again)"
        )
        return f"job {running['i']} ({running['output']}) was stopped, nothing was written at its output path{done}" + (f"; {left}" if left else "")

    def stop_code() -> int:
        return errors.stop_exit_code(_received[0] if _received else signal.SIGINT)

    on_job = lambda i, job: running.update(i=i, output=job["output"])  # noqa: E731
    code = _run(ctx, lambda: api.run_jobs(jobs, keep_going=keep_going, emit=click.echo, on_job=on_job, stop_code=stop_code), hint=hint)
    sys.exit(code)


@main.command()
@_json_option
@click.pass_obj
def schemes(ctx: _Ctx):
    """List the schemes and the compressed-tensors format of each."""
    from . import api

    rows = api.schemes()
    if ctx.json:
        ctx.emit_json({"schemes": rows})
        return
    cols = [("scheme", 0), ("compressed-tensors format", 0), ("weights", 0), ("activations", 0)]
    _print_table(ctx, cols, [[" = ".join([r["name"], *r["aliases"]]), r["format"], r["weights"], r["activations"]] for r in rows])


def run() -> None:
    """Console entry point: click's own handling, except that Ctrl-C exits 130 with one line."""
    global _AS_PROGRAM
    _AS_PROGRAM = True
    if hasattr(signal, "SIGPIPE"):  # `ctconvert inspect OUT | head`: end quietly like other Unix tools, not "exit 1"
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for sig in errors.STOP_SIGNALS[1:]:
        signal.signal(sig, _stop)
    code = 0
    try:
        main.main(standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _interrupted()
    except click.exceptions.NoArgsIsHelpError as e:  # `ctconvert` alone: the help, as `--help` prints it
        click.echo(e.ctx.get_help())
    except click.exceptions.ClickException as e:  # usage errors: one line too, and a JSON document with --json
        msg = e.format_message()
        if "--json" in sys.argv[1:]:
            click.echo(jsonout.dumps({"ok": False, "error": msg, "exit_code": e.exit_code, "type": type(e).__name__}, indent=2))
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None and isinstance(e, click.UsageError) else ""
        click.echo(f"error: {msg}{hint}", err=True)
        code = e.exit_code
    except click.exceptions.Exit as e:
        code = e.exit_code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    # Every file is written, synced and renamed (or removed) by now. Skip the interpreter's teardown: its
    # final garbage collection over torch's objects costs ~0.8 s of a 4 s conversion on 2 cores.
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more can be said there
            pass


if __name__ == "__main__":
    run()
