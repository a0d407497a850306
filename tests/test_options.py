"""The option table (ctconvert/options.py) is where every option is declared: the CLI, QuantizeOptions, batch and the API doc follow it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ctconvert import api, options
from ctconvert.cli import api_keywords, main
from ctconvert.commands import batch
from ctconvert.layouts import kernels
from ctconvert.options import COMMANDS, OPTIONS, job_keys
from ctconvert.pipeline.options import QuantizeOptions
from ctconvert.plan import kernel_targets

ROOT = Path(__file__).resolve().parents[1]
#: `ctconvert <command> --help` as main at 515cc14 printed it (before the table), at a fixed width of 100
HELP = ROOT / "tests" / "data" / "help"
NAMES = ["ctconvert", "quantize", "inspect", "verify", "decompress", "convert", "repack", "batch", "schemes"]


@pytest.mark.parametrize("name", NAMES)
def test_help_is_the_same_text_as_before_the_table(name):
    args = ["--help"] if name == "ctconvert" else [name, "--help"]
    out = CliRunner().invoke(main, args, prog_name="ctconvert", terminal_width=100).output
    assert out == (HELP / f"{name}.txt").read_text()


def _param(p) -> dict:
    a = dict(opts=p.opts, secondary=p.secondary_opts, type=p.type.to_info_dict(), default=repr(p.default), required=p.required, multiple=p.multiple)
    a.update(expose=p.expose_value, eager=p.is_eager)
    if isinstance(p, click.Option):
        a.update(is_flag=p.is_flag, flag_value=repr(p.flag_value), show_default=p.show_default, help=p.help)
    return a


def test_click_parameters_are_the_same_as_before_the_table():
    """Every click parameter of every command as at 515cc14 (tests/data/help/params.json): flags, type, default
    (an explicit None and none at all differ to click: a required option given a None default is not required). One
    parameter name changed: --allow-non-finite's is its option's, ``allow_nonfinite`` (the file is keyed so). An option
    added since is added to the file (``--allow-unloadable``), never a changed one."""
    now = {f"{c} {p.name}": _param(p) for c, cmd in sorted(main.commands.items()) for p in cmd.params}
    before = json.loads((HELP / "params.json").read_text())
    assert json.loads(json.dumps(now, default=str)) == before


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_click_options_are_the_tables(command):
    """Each command's click options are its table entries, in order: the same flags, help, default and choices."""
    params = [p for p in main.commands[command].params if isinstance(p, click.Option) and p.expose_value]
    table = COMMANDS[command]
    assert [p.name for p in params] == [o.cli_name for o in table]
    for p, o in zip(params, table):
        assert p.help == o.help and p.required == o.required and p.multiple == o.multiple, o.name
        assert tuple(p.opts + p.secondary_opts) == tuple(f for spelling in o.cli_flags for f in spelling.split("/")), o.name
        if o.type == "choice":
            assert tuple(p.type.choices) == o.choices and p.type.case_sensitive == o.case_sensitive, o.name
        if o.type != "flag" and not (o.multiple or o.required or o.type == "path"):
            assert p.default == (o.default if o.cli_default is options.SAME else o.cli_default), o.name


@pytest.mark.parametrize("args", [["quantize", "x", "--dry-run"], ["repack", "x", "-o", "y"], ["decompress", "x"]])
def test_required_options_are_required(args):
    res = CliRunner().invoke(main, args, prog_name="ctconvert")
    assert res.exit_code == 2 and "Missing option" in res.output


def test_quantize_options_are_the_table():
    assert QuantizeOptions.names() == tuple(OPTIONS)
    default = QuantizeOptions()
    assert {n: getattr(default, n) for n in OPTIONS} == {n: o.default for n, o in OPTIONS.items()}
    assert {f.name: f.type for f in dataclasses.fields(QuantizeOptions)} == {n: o.annotation for n, o in OPTIONS.items()}
    assert all(o.field for o in OPTIONS.values())


def test_batch_keys_are_the_tables():
    assert job_keys() == {o.job_key or o.name: o.name for o in OPTIONS.values()}
    assert batch.ALLOWED == {"model", "output", "scheme", *job_keys()}
    assert batch.PATH_KEYS == ("model", "output", "recipe", "calibration")


def test_the_api_doc_names_every_option():
    doc = api.quantize.__doc__
    assert "{options}" not in doc
    for name, o in OPTIONS.items():
        assert f"{name} (default ``{o.default!r}``): " in doc, name
        assert " ".join(o.doc.split()[:4]) in " ".join(doc.split()), name


def test_api_keywords_of_a_command_line():
    """What the CLI hands the API: repeated options split, --no-default-ignore inverted, None left to the API's default."""
    given = {"targets": (), "ignore": ("a,re:b{1,2}", "c"), "no_default_ignore": True, "allow_nonfinite": True, "layout_version": None, "tp": 2}
    assert api_keywords(given) == {"ignore": ["a", "re:b{1,2}", "c"], "default_ignore": False, "allow_nonfinite": True, "tp": 2}
    assert api_keywords({"ignore": ()}) == {"ignore": ()}  # no --ignore: an empty list, as before (the fingerprint records it)


def test_constants_have_one_home():
    assert kernels.DEFAULT_LAYOUT_VERSION is options.DEFAULT_LAYOUT_VERSION
    assert kernels.LAYOUT_VERSIONS is options.LAYOUT_VERSIONS
    assert OPTIONS["max_shard_size"].default == options.DEFAULT_SHARD_SIZE == "5GB"
    assert OPTIONS["layout_version"].default == "0.33"


def test_the_table_imports_no_torch():
    code = "import sys, ctconvert.options, ctconvert.render, ctconvert.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_target_choices_are_the_kernels_targets():
    """The CLI's --target spellings (torch-free, for a fast --help) are the names of the target table (plan/kernel_targets.py)."""
    assert options.QUANTIZE_TARGETS == kernel_targets.QUANTIZE_TARGETS
    assert options.REPACK_TARGETS == kernel_targets.REPACK_TARGETS


def test_the_observer_choices_are_the_observers():
    """The CLI's --observer names (torch-free, for a fast --help) are the observer registry's (formats/observers/)."""
    from ctconvert.formats.observers import OBSERVERS

    assert options.OBSERVER_NAMES == tuple(OBSERVERS)
    assert OPTIONS["observer"].choices == options.OBSERVER_NAMES and OPTIONS["observer"].default == "minmax"
