"""The layout versions have one home (ctconvert/layouts/versions.py), which imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path

from ctconvert.layouts import kernels, versions


def test_the_default_is_the_newest_release():
    assert versions.DEFAULT_LAYOUT_VERSION == versions.LAYOUT_VERSIONS[0] == "0.33"
    assert sorted(versions.LAYOUT_VERSIONS, key=lambda v: tuple(map(int, v.split("."))), reverse=True) == list(versions.LAYOUT_VERSIONS)
    assert kernels.DEFAULT_LAYOUT_VERSION is versions.DEFAULT_LAYOUT_VERSION and kernels.LAYOUT_VERSIONS is versions.LAYOUT_VERSIONS


def test_it_imports_nothing():
    tree = ast.parse(Path(versions.__file__).read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [getattr(n, "module", None) for n in imports] == ["__future__"]
