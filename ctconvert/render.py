"""Human output of the CLI: the tables and summary lines every command prints (``--json`` aside).

Each function takes the CLI's context (``ctx.plain``: plain aligned columns; ``ctx.console()``: a rich
console that fits the terminal or pipe) and what the API returned, and prints; nothing here parses a
command line or calls the engine. rich is imported on first use.
"""

from __future__ import annotations

import click

from .errors import human_bytes, one_line, plural

__all__ = ["convert", "decompress", "human", "inspect", "plan", "problems", "quantized", "repack", "schemes", "table", "verify"]


def _escape(text: str) -> str:
    """``text`` shown as it is inside rich markup (a pattern like ``re:.*[a-z]_proj`` is not a style tag)."""
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def problems(con, found: list[dict]) -> None:
    """The problems of an inspect or verify report, one line each (``error: file: tensor: what``)."""
    for p in found:
        where = ": ".join(x for x in (p.get("file"), p.get("tensor")) if x)  # "file: tensor: what", as the error lines
        text = _escape(one_line(f"{where + ': ' if where else ''}{p['message']}"))  # names and patterns hold [...]: not markup
        con.print(f"[{'red' if p['severity'] == 'error' else 'yellow'}]{p['severity']}[/]: {text}")


#: ``n`` bytes in binary units (``512 B``, ``1.50 GiB``): :func:`ctconvert.errors.human_bytes`
human = human_bytes


def table(ctx, columns: list[tuple[str, int]], rows: list[list[str]], title: str | None = None, caption: str | None = None, styles=None):
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
    # the last column wraps at spaces: at least as wide as its longest word (up to 60), so that no name or pattern is split
    word = min(60, max([len(w) for r in rows for w in r[last].split()] + [len(columns[last][0]), 14])) if rows else 14
    need = lambda i: (min(widths[i], word) if i == last else widths[i]) + 3  # noqa: E731 - cell padding and border
    while sum(need(i) for i in keep) + 1 > con.width and any(columns[i][1] > 0 for i in keep):
        keep.remove(max((i for i in keep if columns[i][1] > 0), key=lambda i: (columns[i][1], i)))
    dropped = [columns[i][0] for i in range(len(columns)) if i not in keep]
    if dropped:
        note = f"not shown at this width: {', '.join(dropped)} (--plain or --json show every column)"
        caption = f"{caption}; {note}" if caption else note
    table = Table(title=Text(title) if title else None, caption=Text(caption) if caption else None, show_lines=False)  # ([...] not markup)
    for i in keep:
        if i == last and columns[i][1] > 0:
            table.add_column(columns[i][0], overflow="fold", min_width=min(widths[i], word))
        else:
            table.add_column(columns[i][0], no_wrap=True, min_width=widths[i])
    for j, r in enumerate(rows):  # cells as Text: a reason or pattern holding [a-z] is not rich markup
        table.add_row(*(Text(r[i]) for i in keep), style=styles[j] if styles else None)
    con.print(table)


def _reason_kind(row) -> str:
    """A plan row's reason without its per-tensor part (fused sets differ by layer; their kind does not)."""
    if row.fused_set:  # "fused {gate_proj, up_proj}": a space after each comma, so a narrow table wraps between names
        return "fused " + row.fused_set.rpartition(".")[2].replace(",", ", ")
    return _with_cast(row.reason or "", row)


def _with_cast(text: str, row) -> str:
    """A plan row's reason, with the ``--dense-dtype`` cast of a tensor kept dense (``embedding; cast fp32->bf16``)."""
    cast = getattr(row, "cast", None)
    return f"{text}; cast {cast}" if cast and text else (f"cast {cast}" if cast else text)


def plan(ctx, result, target=None, all_rows: bool = False) -> None:
    """A dry run's plan (quantize, convert): one row per tensor (a summary per kind for more than 60), counts, notes.
    ``target``: ``(target, layout_version, act_dtype)`` of ``quantize --target``."""
    plan = result.plan
    sourced = any(getattr(r, "source", None) for r in plan.rows)  # a quantized input: the format each tensor comes from
    grouped = any(getattr(r, "group", None) for r in plan.rows)  # a recipe: each quantized tensor's config group
    cols = [("tensor", 0), ("dtype", 3), ("shape", 2), *([("source", 2)] if sourced else []), ("action", 0), ("scheme", 5)]
    cols += [*([("group", 5)] if grouped else []), ("max TP", 4)]
    cols.append(("fused set / reason", 1))
    max_tp = getattr(result, "max_tp_of", lambda name: None)
    tps = [max_tp(r.name) for r in plan.rows]
    rows = [
        [r.name, r.dtype, "x".join(map(str, r.shape)), *([r.source or "dense"] if sourced else []), r.action, r.scheme or ""]
        + [*([r.group or ""] if grouped else []), "" if tp is None else str(tp)]
        + [_with_cast(r.fused_set or r.reason or "", r)]
        for r, tp in zip(plan.rows, tps)
    ]
    styles = [{"quantize": "green", "convert": "green", "ignore": "yellow", "drop": "red"}.get(r.action) for r in plan.rows]
    con = ctx.console()
    title = f"plan: {result.scheme if grouped else plan.scheme.name} ({plan.format})"
    if observers := getattr(plan, "observers", None):
        title += ", observer " + ", ".join(f"{name} (config group {g})" for g, name in observers.items())
    if target:
        title += f", then repacked for {target[0]} (vLLM layout {target[1]}, {target[2]} activations)"
    if all_rows or len(rows) <= 60:
        table(ctx, cols, rows, title=title, styles=styles)
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
        table(
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
    con.print(f"output: {human(result.output_bytes)} of tensors (input {human(result.input_bytes)})")
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
        con.print(f"{'warning' if n in getattr(plan, 'warnings', ()) else 'note'}: {n}", markup=False)


def _cell_format(row: dict) -> str:
    """A layer's format cell; a dense layer ``quantize --dense-dtype`` cast says so (``dense, cast fp32->bf16``)."""
    return f"{row['format'] or ''}, cast {row['cast']}" if row.get("cast") else row["format"] or ""


def _cell_scheme(row: dict) -> str:
    """A layer's scheme cell; a fused 3-D expert tensor says how many experts it holds (``dense, 32 experts``)."""
    return f"{row['scheme'] or ''}, {row['experts']} experts" if row.get("experts") else row["scheme"] or ""


def _parts(tensors: dict) -> str:
    return ", ".join(f"{p}:{t['dtype']}{t['shape']}" for p, t in tensors.items())


def inspect(ctx, report: dict, all_layers: bool) -> None:
    """``ctconvert inspect``: what the checkpoint is, its config groups, a row per layer (or per scheme), totals, problems."""
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
        acts = f" activations={v['activations']}" if v.get("activations") else ""
        con.print(f"  config group {g}: targets={v['targets']} scheme={v['scheme']} format={v['format']}{acts}", markup=False)
    if report.get("kv_cache_scheme"):
        con.print(f"  kv cache: {report['kv_cache_scheme']} (k_scale/v_scale per attention module)", markup=False)
    layers = report["layers"]
    cols = [("layer", 0), ("scheme", 2), ("format", 3), ("bytes", 1), ("bits/w", 0), ("tensors (dtype shape)", 4)]
    if all_layers or len(layers) <= 60:
        rows = [[r["module"], _cell_scheme(r), _cell_format(r), human(r["bytes"]), str(r["bits_per_weight"]), _parts(r["tensors"])] for r in layers]
        caption = None
    else:
        agg: dict[tuple, list] = {}
        for r in layers:
            a = agg.setdefault((_cell_scheme(r), r["format"]), [[], 0, 0, {}])
            a[0].append(r["module"])
            a[1] += r["bytes"]
            a[2] += r["params"]
            for part, t in r["tensors"].items():
                a[3].setdefault(part, set()).add(t["dtype"])
        rows = []
        for (sch, f), (names, b, p, parts) in agg.items():
            ts = ", ".join(f"{part}:{'/'.join(sorted(d))}" for part, d in sorted(parts.items()))  # shapes differ: dtypes only
            label = names[0] if len(names) == 1 else f"{len(names)} layers ({names[0]} ...)"  # a summary row names its layer(s)
            rows.append([label, sch or "", f or "", human(b), f"{8 * b / p:.3f}" if p else "", ts])
        caption = f"{len(layers)} Linear layers summarized per scheme; --all-layers lists each"
    if rows:  # an unreadable folder: no empty table above its errors
        table(ctx, cols, rows, caption=caption)
    t = report["totals"]
    con.print(
        f"{plural(t['tensors'], 'tensor')} in {plural(t['files'], 'file')}, {human(t['bytes'])}; "
        f"{t['quantized_layers']}/{plural(t['linear_layers'], 'Linear layer')} quantized"
        + (f", {t['linear_bits_per_weight']} bits per Linear weight" if t["linear_bits_per_weight"] is not None else "")
        + (f", {t['quantized_bits_per_weight']} per quantized weight" if t.get("quantized_bits_per_weight") is not None else ""),
        markup=False,
    )
    if report["problems"]:
        problems(con, report["problems"])
    else:
        con.print("no problems found in the headers and config that inspect reads (`ctconvert verify` also judges the bytes and the values)")


def quantized(result, refresh: bool) -> None:
    """What a quantize run wrote (stdout), then what it resumed or refreshed and its notes (stderr)."""
    ratio = result.input_bytes / max(1, result.output_bytes)
    click.echo(
        f"wrote {result.output}: {result.scheme} ({result.format}), {plural(result.quantized_modules, 'Linear layer')} quantized, "
        f"{plural(sum(result.kept_dense.values()), 'weight tensor')} kept dense, {plural(len(result.shards), 'shard')}, "
        f"{human(result.input_bytes)} -> {human(result.output_bytes)} ({ratio:.2f}x) "
        f"in {result.seconds:.1f} s on {result.device}"
    )
    if result.reused_shards and not refresh:
        click.echo(f"resumed: {plural(len(result.reused_shards), 'shard')} kept from the interrupted run", err=True)
    if refresh:
        kept = f", kept {len(result.reused_shards)} unchanged" if result.reused_shards else ""
        click.echo(f"refreshed: rewrote {len(result.rewritten_shards)} of {plural(len(result.shards), 'shard')}{kept}", err=True)
    for why, n in result.kept_dense.items():
        if not why.startswith("lm_head (default"):  # the one every run has: in the count above, and --dry-run lists it
            click.echo(f"note: kept dense: {plural(n, 'weight')}: {why}", err=True)
    for n in result.notes:
        click.echo(f"{'warning' if n in result.warnings else 'note'}: {one_line(n)}", err=True)


def warnings(result) -> None:
    """``-q``: what a quantize run still says, on stderr: the warnings that vLLM refuses the output."""
    for n in result.warnings:
        click.echo(f"warning: {one_line(n)}", err=True)


def verify(ctx, report: dict, reference) -> None:
    """``ctconvert verify``: what was checked, the error against ``reference`` (a line, a table), the TP plan, problems, verdict."""
    con = ctx.console()
    if ctx.quiet:  # -q: no summary; what failed (its error rows, the problems) and the verdict
        if bad := [r for r in report["tensors"] if not r["ok"]]:
            _error_table(ctx, bad, reference)
        problems(con, report["problems"])
        con.print("[green]verify: passed[/]" if report["ok"] else "[red]verify: FAILED[/]")
        return
    c = report["checked"]
    con.print(f"checked {plural(c['shards'], 'shard')}, {plural(c['tensors'], 'tensor')} ({human(c['bytes'])}): {'; '.join(c['checks'])}", markup=False)
    if (sm := report["summary"]) is not None:
        con.print(
            f"{plural(sm['modules'], 'weight')} compared with {reference}: {sm['failed']} failed{_gain_failures(sm)}; worst {sm['worst_module']} "
            f"(relative L2 {sm['worst_rel_l2']:.4f}, limit {sm['worst_threshold']}), lowest SNR {sm['min_snr_db']:.1f} dB"
            + (f", gain {sm['min_gain']:.4f}-{sm['max_gain']:.4f}" if sm.get("min_gain") is not None else ""),
            markup=False,
        )
        if "worst_rel_l2_dense" in sm:  # 2:4: judged against the pruned reference, the pruning's error beside it
            con.print(
                f"{plural(sm['sparse_modules'], '2:4 sparse weight')} judged against the reference pruned 2:4; against the dense "
                f"reference (the pruning's own error, not judged) the worst is {sm['worst_dense_module']} (relative L2 {sm['worst_rel_l2_dense']:.4f})",
                markup=False,
            )
    if report["tensors"]:
        _error_table(ctx, report["tensors"], reference)
    par = report.get("parallel")
    if par:
        ep_note = f", largest even EP degree {par['max_ep']}" if par["max_ep"] else ""
        con.print(f"tensor parallel: largest TP degree {par['max_tp']}{ep_note}", markup=False)
    problems(con, report["problems"])
    if reference is not None:  # (what the README says: --reference compares values, the plain run judges loadability)
        con.print("with --reference the parameters vLLM builds are not judged: `ctconvert verify OUT` without it judges them", markup=False)
    elif (left := report.get("checked", {}).get("not_checked")) and not report.get("values_uncompared"):  # kernel-native: its compressed-tensors form is judged
        said = "the parameters vLLM builds are not judged in a kernel-native output: plain `ctconvert verify` of its compressed-tensors form judges them"
        con.print(said, markup=False)
    elif left:  # a dense output judged by its records: its values need the checkpoint it came from
        con.print(f"not compared: {'; '.join(left)} (`ctconvert verify DENSE --reference SRC` compares every tensor)", markup=False)
    con.print("[green]verify: passed[/]" if report["ok"] else "[red]verify: FAILED[/]")


def _gain_failures(sm: dict) -> str:
    why = [f"{n} on the gain: a scale off by a factor" for n in [sm.get("gain_failed", 0)] if n]
    why += [f"{n} with values off the grid" for n in [sm.get("values_failed", 0)] if n]
    return f" ({'; '.join(why)})" if why else ""


def _gain(row: dict) -> str:
    return f"{row['gain']:.4f}" if "gain" in row else ""


def _error_table(ctx, tensors: list[dict], reference) -> None:
    sparse = any("rel_l2_dense" in r for r in tensors)
    cols = [("module", 0), ("format", 3), ("rel L2", 0), ("max abs", 2), ("SNR dB", 1), ("gain", 3), ("limit", 4), ("ok", 0)]
    rows = [
        [r["module"], r["format"], f"{r['rel_l2']:.4f}", f"{r['max_abs']:.3g}", f"{r['snr_db']:.1f}", _gain(r), str(r["threshold"])]
        + ["yes" if r["ok"] else "NO"]
        for r in tensors
    ]
    if sparse:  # the rel L2 column is against the pruned reference for 2:4 modules; this one against the dense one
        cols.insert(6, ("rel L2 dense", 2))
        for row, r in zip(rows, tensors):
            row.insert(6, f"{r['rel_l2_dense']:.4f}" if "rel_l2_dense" in r else "")
    title = f"quantization error against {reference}" + (" (2:4 modules: rel L2 against it pruned 2:4, rel L2 dense against it as it is)" if sparse else "")
    table(ctx, cols, rows, title=title, styles=[None if r["ok"] else "red" for r in tensors])


def decompress(res: dict) -> None:
    """What ``ctconvert decompress`` wrote, and what it left out."""
    click.echo(
        f"wrote {res['output']}: {plural(res['modules_decompressed'], 'module')} decompressed to {res['dtype']}"
        + (", every float tensor cast to it" if res["cast_all"] else ", other tensors as stored")
        + ", "
        f"{human(res['input_bytes'])} -> {human(res['output_bytes'])} in {res['seconds']:.1f} s"
    )
    if res["left_out"]:
        click.echo(f"note: left out {plural(len(res['left_out']), 'KV-cache scale')} (k_scale/v_scale: a dense checkpoint has no kv_cache_scheme)")
    for note in res["notes"]:
        click.echo(f"note: {note}")


def convert(res) -> None:
    """What ``ctconvert convert`` wrote (stdout) and its notes (stderr)."""
    click.echo(
        f"wrote {res.output}: {res.source_format} -> {res.scheme} ({res.format}), {plural(res.quantized_modules, 'module')} converted losslessly, "
        f"{human(res.input_bytes)} -> {human(res.output_bytes)} in {res.seconds:.1f} s"
    )
    for n in res.notes:
        click.echo(f"{'warning' if n in res.warnings else 'note'}: {n}", err=True)


def repack(res: dict, target: str, layout_version: str) -> None:
    """What ``ctconvert repack`` wrote."""
    what = "restored to compressed-tensors" if target == "compressed-tensors" else f"repacked for {target} (vLLM layout {layout_version})"
    click.echo(f"wrote {res['output']}: {plural(res['modules'], 'module')} {what} in {res['seconds']:.1f} s on {res['device']}")


def schemes(ctx, rows: list[dict]) -> None:
    """``ctconvert schemes``: one row per scheme (its aliases after it), its format, weights and activations."""
    cols = [("scheme", 0), ("compressed-tensors format", 0), ("weights", 0), ("activations", 0)]
    table(ctx, cols, [[" = ".join([r["name"], *r["aliases"]]), r["format"], r["weights"], r["activations"]] for r in rows])
