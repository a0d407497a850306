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


def test_a_passing_verify_says_the_same_plain_and_rich(tiny_llama, tmp_path):
    """``verify`` with and without ``--plain`` (a pipe, every column fits): the same lines around the table, the same
    title, header and rows in it (plain: aligned words; rich: boxed cells), no caption in either; ``--json`` unchanged."""
    import json
    import re

    from click.testing import CliRunner

    from ctconvert import api
    from ctconvert.cli import main

    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    runs = {}
    for plain in (False, True):
        r = CliRunner(env={"COLUMNS": "200"}).invoke(main, [*(["--plain"] * plain), "verify", str(q), "--reference", str(tiny_llama)])
        assert r.exit_code == 0, r.output
        runs[plain] = r.stdout.splitlines()
    rows = [["module", "format", "rel L2", "max abs", "SNR dB", "gain", "limit", "ok"]] + [
        [t["module"], t["format"], f"{t['rel_l2']:.4f}", f"{t['max_abs']:.3g}", f"{t['snr_db']:.1f}", f"{t['gain']:.4f}", str(t["threshold"]), "yes"]
        for t in api.verify(q, reference=tiny_llama)["tensors"]
    ]
    boxed = [ln for ln in runs[False] if ln[:1] in "┏┃┡│└"]
    cells = [[c.strip() for c in ln.strip("┃│").split("┃" if "┃" in ln else "│")] for ln in boxed if ln[:1] in "┃│"]
    names = {r[0] for r in rows}
    assert cells == rows and [re.split(r"\s{2,}", ln.strip()) for ln in runs[True] if ln.split(" ", 1)[0] in names] == rows
    title = f"quantization error against {tiny_llama}"
    around = lambda lines: [ln for ln in lines if ln[:1] not in "┏┃┡│└" and ln.split(" ", 1)[0] not in names]  # noqa: E731
    assert [ln.strip() for ln in around(runs[False])] == [ln.strip() for ln in around(runs[True])] and title in around(runs[True])
    assert around(runs[True])[-1] == "verify: passed" and not any("not shown" in ln for ln in runs[False] + runs[True])
    r = CliRunner().invoke(main, ["--json", "--plain", "verify", str(q), "--reference", str(tiny_llama)])
    assert json.loads(r.stdout)["ok"] and json.loads(r.stdout)["exit_code"] == 0


def test_the_last_column_wraps_between_words_never_inside_one():
    """A reason holding a long pattern wraps at its spaces; the pattern and each name stay whole on one line."""
    ctx, buf = _ctx(plain=False, width=100)
    pattern = r"re:.*(gate|up|down)_proj$,re:.*self_attn\.(q|k|v|o)_proj$"
    rows = [["model.layers.0.mlp.down_proj.weight", "BF16", f"Linear not matched by recipe targets {pattern}"], ["lm_head.weight", "BF16", "x"]]
    render.table(ctx, [("tensor", 0), ("dtype", 3), ("reason", 1)], rows)
    lines = buf.getvalue().splitlines()
    assert any(pattern in line for line in lines) and any("model.layers.0.mlp.down_proj.weight" in line for line in lines)
    assert all(len(line) <= 100 for line in lines)
