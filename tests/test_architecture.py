"""The package's import rules hold (README "Layout"): read from the source with ``ast``, nothing is imported.

* no command module imports another command;
* ``cli`` reaches the engine only through ``api`` (and the error vocabulary, ``errors``);
* ``formats/`` and ``layouts/`` import nothing of the package but the C-build helper (and their own folder);
* data flows one way: the lower layers never import the higher ones;
* no module imports another module's ``_private`` name, or reads one as ``module._name``;
* no import circles (module-level and function-level imports alike);
* every module's top-level part has a line in ``LAYERS``;
* size: no module over :data:`MAX_MODULE_LINES` lines, no function or method over :data:`MAX_FUNCTION_LINES`
  (``end_lineno - lineno + 1`` of the ``def``, docstring included);
* compressed-tensors format names (the values of ``CompressionFormat``, read from ``formats/base.py``) are never
  spelled as string literals outside ``formats/base.py``: code names them as ``CompressionFormat.X``.

Every rule is parametrized over the modules found on disk (``ctconvert/**/*.py``), never over a list written by
hand, so a new command or a new folder is covered the day it lands. A known exception is listed once, with its
reason, in :data:`PENDING` (run as a strict xfail, so it turns red when fixed) or, for a format name a module must
spell, in :data:`SPELLED`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ctconvert"
#: layer of each top-level part, lowest first; a module may import only its own layer or lower ones
LAYERS = {
    "errors": 0,
    "cbuild": 0,
    "jsonout": 0,  # standard JSON for --json documents and batch lines (imports json only)
    "__init__": 0,
    "formats": 1,
    "layouts": 1,
    "options": 1.5,  # the option table: every option's name, default, help, CLI spelling, batch key (torch-free; reads layouts' version)
    "checkpoint": 2,
    "sources": 2.5,  # every input format as dense tensors (reads checkpoint, uses formats)
    "plan": 3,
    "calibration": 3.5,  # between plan and the quantizer (read -> plan -> calibrate -> quantize -> write)
    "pipeline": 4,
    "stages": 4.5,  # the stages of a conversion (source, plan, calibrate, quantize, layout, write): above pipeline, below commands
    "commands": 5,
    "api": 6,
    "cli": 7,
    "render": 7,  # the CLI's tables and summary lines
    "__main__": 8,
}


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: known violations, ``(rule, module) -> the part of issue 24 that fixes it``; rules: "size", "functions", "literals"
#: (rule, module) -> why: the known exceptions to a rule, each with its reason (empty when there are none)
PENDING: dict[tuple[str, str], str] = {}

#: (module, literal) -> why: a format name a module may spell, each with its reason
SPELLED = {
    ("ctconvert.options", "marlin-24"): "the CLI spelling of --target marlin-24, kept torch-free for a fast --help; "
    "tests/test_options.py holds the option table's target names equal to plan/kernel_targets.py's table",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _rule(rule: str) -> list:
    """Every module, as pytest params; the :data:`PENDING` ones of ``rule`` marked as strict xfails."""
    params = []
    for m in sorted(MODULES):
        part = PENDING.get((rule, m))
        marks = [pytest.mark.xfail(strict=True, reason=part)] if part else []
        params.append(pytest.param(m, marks=marks, id=m))
    return params


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


@functools.cache
def _tree(mod: str) -> ast.Module:
    return ast.parse(MODULES[mod].read_text())


def _imports(mod: str):
    """``(imported module, imported names, node)`` of every import of ``mod`` that names a ctconvert module."""
    path = MODULES[mod]
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(_tree(mod)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ctconvert"):
                    yield a.name, [], node
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, is_pkg, node.level, node.module) if node.level else node.module
            if not target or not target.startswith("ctconvert"):
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest:
                yield target, rest, node
            for s in subs:
                yield s, [], node


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.cache
def _edges() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            if target in MODULES and target != m:
                out[m].add(target)
    return out


def test_modules_found():
    assert {"ctconvert.api", "ctconvert.cli", "ctconvert.commands.quantize", "ctconvert.formats.base", "ctconvert.layouts.kernels"} <= set(MODULES)


@pytest.mark.parametrize("mod", [m for m in MODULES if m.startswith("ctconvert.commands.")])
def test_no_command_imports_another(mod):
    others = {t for t in _edges()[mod] if t.startswith("ctconvert.commands") and t != mod}
    assert not others, f"{mod} imports {sorted(others)}"


def test_cli_goes_through_api():
    # jsonout: the standard-JSON writer the CLI's --json documents and batch's lines share (a leaf: imports json only)
    # render: the tables and summaries (a module at cli's level); options: the option table (a torch-free leaf)
    allowed = {"ctconvert", "ctconvert.api", "ctconvert.errors", "ctconvert.jsonout", "ctconvert.render", "ctconvert.options"}
    assert _edges()["ctconvert.cli"] <= allowed, sorted(_edges()["ctconvert.cli"] - allowed)


@pytest.mark.parametrize("mod", [m for m in MODULES if _part(m) in ("formats", "layouts")])
def test_formats_and_layouts_are_pure(mod):
    own = mod.split(".")[1]
    bad = {t for t in _edges()[mod] if _part(t) not in (own, "cbuild")}
    assert not bad, f"{mod} imports {sorted(bad)}"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_data_flows_one_way(mod):
    missing = sorted({_part(t) for t in [mod, *_edges()[mod]] if _part(t) not in LAYERS})
    assert not missing, f"{mod}: parts {missing} have no line in LAYERS (tests/test_architecture.py)"
    up = {t for t in _edges()[mod] if LAYERS[_part(t)] > LAYERS[_part(mod)]}
    assert not up, f"{mod} (layer {_part(mod)}) imports higher layers {sorted(up)}"


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_private_names_of_other_modules(mod):
    bad = []
    aliases: set[str] = set()  # local names bound to ctconvert modules
    for target, names, node in _imports(mod):
        bad += [f"{target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
        if isinstance(node, ast.Import):
            aliases.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif target in MODULES and not names:  # ``from pkg import module [as alias]``
            aliases.update(a.asname or a.name for a in node.names if target.endswith("." + a.name) or target == a.name)
    for node in ast.walk(_tree(mod)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{node.value.id}.{node.attr}")
    assert not bad, f"{mod} uses private names {bad}"


def test_no_import_circles():
    edges = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t) :] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_pending_names_real_modules():
    rules = {"size", "functions", "literals"}
    bad = [(r, m) for r, m in PENDING if r not in rules or m not in MODULES]
    assert not bad, f"PENDING entries naming no rule or no module: {bad}"
    names = _format_names()
    stale = [(m, v) for m, v in SPELLED if m not in MODULES or v not in names or repr(v) not in MODULES[m].read_text().replace('"', "'")]
    assert not stale, f"SPELLED entries naming no module, no format name, or a literal the module no longer spells: {stale}"


def test_every_command_module_is_covered():
    # the rules are parametrized over what rglob finds, so every command module (inspection and convert included) is in
    on_disk = {p.stem for p in (PKG / "commands").glob("*.py") if p.stem != "__init__"}
    assert {"inspection", "convert", "quantize", "verify"} <= on_disk
    assert {f"ctconvert.commands.{s}" for s in on_disk} <= set(MODULES)
    assert set(MODULES) == {_module_name(p) for p in PKG.rglob("*.py")}


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_every_part_has_a_layer(mod):
    assert _part(mod) in LAYERS, f"{mod}: its top-level part {_part(mod)!r} has no line in LAYERS (tests/test_architecture.py); add one"


@pytest.mark.parametrize("mod", _rule("size"))
def test_module_size(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= MAX_MODULE_LINES, f"{MODULES[mod].relative_to(PKG.parent)}: {n} lines (at most {MAX_MODULE_LINES})"


@pytest.mark.parametrize("mod", _rule("functions"))
def test_function_size(mod):
    long = [
        f"{MODULES[mod].relative_to(PKG.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(_tree(mod))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@functools.cache
def _format_names() -> frozenset[str]:
    """The values of ``CompressionFormat`` (``formats/base.py``), read from its source; ``dense`` is a plain word, not a name."""
    for node in _tree("ctconvert.formats.base").body:
        if isinstance(node, ast.ClassDef) and node.name == "CompressionFormat":
            values = {
                stmt.value.value
                for stmt in node.body
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
                if not stmt.targets[0].id.startswith("_")
            }
            return frozenset(values - {"dense"})
    raise AssertionError("ctconvert/formats/base.py defines no CompressionFormat")


def test_format_names_read_from_the_enum():
    assert {"pack-quantized", "marlin-24", "mixed-precision", "sparse-24-bitmask"} <= _format_names()


@pytest.mark.parametrize("mod", [p for p in _rule("literals") if p.values[0] != "ctconvert.formats.base"])
def test_no_format_name_literals(mod):
    names = _format_names()
    found = [
        f"{MODULES[mod].relative_to(PKG.parent)}:{node.lineno} {node.value!r}"
        for node in ast.walk(_tree(mod))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names and (mod, node.value) not in SPELLED
    ]
    assert not found, f"format names spelled as literals (use CompressionFormat.X): {found}"
