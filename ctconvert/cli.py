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

from . import __version__, errors, jsonout, render
from .options import COMMANDS, OPTIONS, click_spec


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


def split_list(values: tuple[str, ...]) -> list[str]:
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


def api_keywords(values: dict) -> dict:
    """The API keywords of a command line's click ``values`` (click parameter name -> value): every quantize
    option given, a repeated one split (:func:`split_list`), an inverted flag inverted. An option the command line
    left at ``None`` is left out (its API default applies)."""
    out = {}
    for o in OPTIONS.values():
        if o.flags is None or o.cli_name not in values:
            continue
        v = values[o.cli_name]
        if o.multiple:
            v = split_list(v) or o.empty
        elif o.invert:
            v = not v
        if v is not None:
            out[o.name] = v
    return out


def _stop(signum, frame) -> None:
    """SIGTERM/SIGHUP: stop the command the way Ctrl-C does (the API then aborts or keeps its partial output)."""
    _received.append(signum)
    raise KeyboardInterrupt


def _ignore_stops() -> None:
    for sig in errors.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _interrupted(hint=None, ctx: _Ctx | None = None):
    """Ctrl-C, SIGTERM or SIGHUP: one line, exit 130 (128 + the signal for the others), and with ``--json`` the
    document of a failure (``ok`` false, ``error`` that line, ``exit_code``, ``type`` ``Interrupted``). A second signal
    is ignored; the output folder was already aborted (by the API), and the exit skips library exit hooks,
    which could re-raise the interrupt. ``hint``: a function giving what was left behind and how to resume
    or remove it (None when nothing was)."""
    _ignore_stops()
    signum = _received[0] if _received else signal.SIGINT
    msg = errors.stop_message(signum, sys.argv[1:]) if _AS_PROGRAM else errors.INTERRUPTED_MESSAGE
    left = hint() if hint else None
    if left:
        msg += f"; {left}"
    if ctx is not None and ctx.json:
        ctx.emit_json({"ok": False, "error": msg, "exit_code": errors.stop_exit_code(signum), "type": "Interrupted"})
    click.echo(msg, err=True)
    _flush()
    os._exit(errors.stop_exit_code(signum))


def _partial_hint(output) -> str | None:
    from . import api

    return api.partial_hint(output)


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
        click.echo(f"error: {errors.one_line(e)}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _interrupted(hint, ctx)
    except Exception as e:  # noqa: BLE001 - last-resort reporting
        if ctx.debug:
            traceback.print_exc()
        msg = f"internal error: {type(e).__name__}: {str(e).removeprefix('error: ')}" + ("" if ctx.debug else " (run with --debug for the traceback)")
        if ctx.json:
            ctx.emit_json({"ok": False, "error": msg, "exit_code": errors.EXIT_INTERNAL, "type": type(e).__name__})
        click.echo(f"error: {errors.one_line(msg)}", err=True)
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


_HELP = {"help_option_names": ["-h", "--help"]}


@click.group(context_settings=_HELP)
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


_TYPES = {"int": lambda o: int, "int>=1": lambda o: click.IntRange(min=1), "path": lambda o: click.Path(path_type=str)}
_TYPES |= {"file": lambda o: click.Path(dir_okay=False, path_type=str), "choice": lambda o: click.Choice(list(o.choices), case_sensitive=o.case_sensitive)}


def _options(command: str):
    """The click options of ``command``, from the option table (:data:`ctconvert.options.COMMANDS`), in its order."""

    def add(f):
        for o in reversed(COMMANDS[command]):
            decls, kw = click_spec(o)
            f = click.option(*decls, **({"type": _TYPES[o.type](o)} if o.type in _TYPES else {}), **kw)(f)
        return f

    return add


def _command(name: str, argument: str | None = None, **path):
    """A command of the group: its path ``argument`` (``path``: click.Path's checks), its options from the option
    table, the group's flags after its name, and the context object."""

    def wrap(f):
        f = _json_option(click.pass_obj(f))
        if name in COMMANDS:
            f = _options(name)(f)
        if argument:
            f = click.argument(argument, type=click.Path(path_type=str, **path))(f)
        return main.command(name, context_settings=_HELP)(f)  # -h on the command itself: the same help however it is invoked

    return wrap


def _need_output(output, dry_run: bool) -> None:
    if not dry_run and not output:
        raise click.UsageError("missing option -o/--output (or use --dry-run)")


@_command("quantize", "src")
def quantize(ctx: _Ctx, src, output, scheme, all_layers, **given):
    """Quantize the Linear weights of the checkpoint SRC.

    The output is a compressed-tensors checkpoint (kernel-native with --target). SRC may already be
    quantized (compressed-tensors, Hugging Face FP8 block, ModelOpt NVFP4, AutoAWQ, GPTQ): it is
    dequantized on the fly and requantized, or converted losslessly when --scheme is its own."""
    from . import api

    target, dry_run = given["target"], given["dry_run"]
    if scheme is None and not given["recipe"]:
        raise click.UsageError("Missing option '-s' / '--scheme' (or --recipe FILE.yaml).")
    _need_output(output, dry_run)
    if target is None and (given["layout_version"] or given["act_dtype"]):
        named = " and ".join(o for o, v in (("--layout-version", given["layout_version"]), ("--act-dtype", given["act_dtype"])) if v)
        msg = f"{named} without --target: they choose a kernel-native layout; add --target marlin (or cutlass-nvfp4), or leave them out"
        _run(ctx, lambda: _raise(errors.UsageError(msg)))
    if target and (given["resume"] or given["refresh"]) and not dry_run:
        raise click.UsageError("--target cannot be combined with --resume or --refresh")
    options = api.QuantizeOptions.from_kwargs(**api_keywords(given) | ({"resume": False, "refresh": False} if target else {}))
    result = _run(
        ctx,
        hint=None if dry_run or target else lambda: _partial_hint(output),
        fn=lambda: api.quantize(src, output, scheme, options=options, progress=_progress_factory(ctx)),
    )
    layout = (target, options.layout_version, options.act_dtype) if target else None
    if ctx.json:
        extra = {"target": dict(zip(("target", "layout_version", "act_dtype"), layout))} if target and dry_run else {}
        ctx.emit_json({"ok": result.error is None, **result.to_dict(), **extra})
    elif dry_run:
        render.plan(ctx, result, target=layout, all_rows=all_layers)
        if result.error is not None:
            click.echo(f"error: {errors.one_line(result.error)}", err=True)
    elif not ctx.quiet:
        render.quantized(result, given["refresh"])
    else:
        render.warnings(result)
    if result.error is not None and (ctx.json or dry_run):  # a dry run that found what the real run would stop at
        sys.exit(result.error.exit_code)


@_command("inspect", "path")
def inspect_cmd(ctx: _Ctx, path, all_layers):
    """Describe the checkpoint PATH from its headers.

    Per layer: scheme, format, dtypes, shapes, bytes and bits per weight; then the problems found (exit 3 for an error)."""
    from . import api

    report = _run(ctx, lambda: api.inspect(path))
    errs = [p for p in report["problems"] if p["severity"] == "error"]
    if ctx.json:
        ctx.emit_json({"ok": not errs, **report, "exit_code": errors.EXIT_BAD_INPUT if errs else 0})
    else:
        render.inspect(ctx, report, all_layers)
    if errs:
        sys.exit(errors.EXIT_BAD_INPUT)


@_command("verify", "path")
def verify_cmd(ctx: _Ctx, path, reference, **checks):
    """Check the compressed-tensors checkpoint PATH.

    Exit 5 when a check fails; 3 for a dense checkpoint without --reference (with it, its values are compared)."""
    from . import api

    report = _run(ctx, lambda: api.verify(path, reference, **checks, progress=_progress_factory(ctx, "verify")))
    if ctx.json:
        ctx.emit_json({**report, "exit_code": 0 if report["ok"] else errors.EXIT_VERIFY_FAILED})
    else:
        render.verify(ctx, report, reference)
    if not report["ok"]:
        sys.exit(errors.EXIT_VERIFY_FAILED)


@_command("decompress", "src")
def decompress_cmd(ctx: _Ctx, src, output, **options):
    """Write a dense copy of the compressed-tensors checkpoint SRC."""
    from . import api

    res = _run(ctx, lambda: api.decompress(src, output, **options, progress=_progress_factory(ctx, "decompress")))
    if ctx.json:
        ctx.emit_json({"ok": True, **res})
    elif not ctx.quiet:
        render.decompress(res)


@_command("convert", "src", file_okay=False)
def convert_cmd(ctx: _Ctx, src, output, **options):
    """Losslessly re-express AWQ, GPTQ or ModelOpt NVFP4 checkpoints.

    The ModelOpt NVFP4, AutoAWQ or GPTQ checkpoint SRC is written as compressed-tensors, without rounding."""
    from . import api

    _need_output(output, options["dry_run"])
    res = _run(ctx, lambda: api.convert(src, output, **options))
    if ctx.json:
        ctx.emit_json({"ok": True, **res.to_dict()})
    elif options["dry_run"]:
        render.plan(ctx, res)
    elif not ctx.quiet:
        render.convert(res)


@_command("repack", "src")
def repack_cmd(ctx: _Ctx, src, output, target, **options):
    """Rebuild SRC's quantized weights in a kernel-native layout.

    The layout vLLM builds at load time, done offline; --target compressed-tensors restores the checkpoint."""
    from . import api

    res = _run(ctx, lambda: api.repack(src, output, target, **options, progress=_progress_factory(ctx, "repack")))
    if ctx.json:
        ctx.emit_json({"ok": True, **res})
    elif not ctx.quiet:
        render.repack(res, target, options["layout_version"])


@_command("batch", "jobs_file", dir_okay=False)
def batch_cmd(ctx: _Ctx, jobs_file, keep_going, executor, ray_address, ray_keep_workers):
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
    cluster = (("executor", executor), ("ray_address", ray_address), ("ray_keep_workers", ray_keep_workers))
    given = {k: v for k, v in cluster if v is not None}  # --executor ray ...: every job's default
    code = _run(ctx, lambda: api.run_jobs(jobs, keep_going=keep_going, emit=click.echo, on_job=on_job, stop_code=stop_code, **given), hint=hint)
    sys.exit(code)


@_command("schemes")
def schemes(ctx: _Ctx):
    """List the schemes and the compressed-tensors format of each."""
    from . import api

    rows = api.schemes()
    if ctx.json:
        ctx.emit_json({"schemes": rows})
    else:
        render.schemes(ctx, rows)


def command_word(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not one of the group's flags (which take no
    values: ``--json``, ``--debug``, ``-q``, ``--plain``, ``--help``, ``--version``); None when there is none."""
    return next((a for a in argv if not a.startswith("-")), None)


def quantize_reads(argv: list[str]) -> tuple[str, bool] | None:
    """What a ``quantize`` command line reads, as its own click command parses it (resiliently: nothing runs,
    nothing is printed, nothing raises): ``(SRC, every tensor)``, ``every tensor`` False for ``--dry-run``,
    ``--resume`` and ``--refresh`` (headers only, or not every shard); None for another command or a line
    without SRC. The console script reads SRC ahead while it imports torch (:mod:`ctconvert.__main__`)."""
    name = command_word(argv)
    if name != "quantize":
        return None
    try:
        params = quantize.make_context(name, argv[argv.index(name) + 1 :], resilient_parsing=True).params
    except Exception:  # noqa: BLE001 - a line click refuses: cli.run says why, nothing is read ahead
        return None
    if not params.get("src"):
        return None
    return params["src"], not (params.get("dry_run") or params.get("resume") or params.get("refresh"))


def run() -> None:
    """Console entry point: click's own handling, except that Ctrl-C exits 130 with one line."""
    global _AS_PROGRAM
    _AS_PROGRAM = True
    if hasattr(signal, "SIGPIPE"):  # `ctconvert inspect OUT | head`: end quietly like other Unix tools, not "exit 1"
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for sig in errors.stops_to_handle():  # not one the process was started ignoring (nohup's SIGHUP)
        if sig != signal.SIGINT:  # (Python's own handler raises KeyboardInterrupt)
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
        click.echo(f"error: {errors.one_line(msg)}{hint}", err=True)
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
