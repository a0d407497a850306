"""The CLI's human output (ctconvert/render.py): sizes, tables that fit, problem lines."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from ctconvert import render


def _ctx(plain: bool, width: int = 200):
    buf = io.StringIO()
    return SimpleNamespace(plain=plain, console=lambda: Console(file=buf, width=width, highlight=False)), buf


def test_human_sizes():
    assert [render.human(n) for n in (0, 1023, 1024, 3 * 2**30, 2**50)] == ["0 B", "1023 B", "1.00 KiB", "3.00 GiB", "1024.00 TiB"]


def test_plain_table_is_aligned_text(capsys):
    ctx, _ = _ctx(plain=True)
    render.table(ctx, [("name", 0), ("why", 1)], [["a.weight", "copied"], ["model.embed", "re:[a-z]"]], title="t")
    assert capsys.readouterr().out == "t\nname         why\na.weight     copied\nmodel.embed  re:[a-z]\n"


def test_narrow_table_drops_columns_and_says_so():
    ctx, buf = _ctx(plain=False, width=40)
    render.table(ctx, [("tensor", 0), ("dtype", 3), ("shape", 2), ("reason", 1)], [["model.layers.0.mlp.down_proj.weight", "BF16", "64x128", "quantized"]])
    text = buf.getvalue()
    assert "model.layers.0.mlp.down_proj.weight" in text and "not shown at this width: dtype" in " ".join(text.split())


def test_problems_are_one_line_each_and_not_markup():
    ctx, buf = _ctx(plain=False)
    render.problems(
        ctx.console(), [{"severity": "error", "file": "a.safetensors", "tensor": "x", "message": "bad re:[a-z]"}, {"severity": "warning", "message": "w"}]
    )
    assert buf.getvalue() == "error: a.safetensors: x: bad re:[a-z]\nwarning: w\n"
