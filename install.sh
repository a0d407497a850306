#!/usr/bin/env bash
# Install ctconvert into the current Python environment (a virtualenv, or the
# machine's Python). Keeps a torch that is already installed (e.g. a CUDA
# build); where there is none, installs the CPU build of torch 2.13.0 first so
# that nothing pulls a multi-GB CUDA wheel.
#   ./install.sh            # the tool
#   ./install.sh test       # the tool and what the test suite needs
#   ./install.sh ray        # the tool and Ray, for --executor ray (README "Ray cluster")
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extra=""
case "${1:-}" in
    test | ray) extra="[$1]" ;;
esac
"$PY" -m pip install --quiet -e ".${extra}"
# An editable install leaves the package's bytecode to the first import, which a Python that may not write bytecode
# (PYTHONDONTWRITEBYTECODE, common in containers) never writes: every run would compile ctconvert's ~120 modules
# again (~0.15 s of a 2.5 s conversion on 2 cores). Write it now, next to the sources (ignored by git); a module
# edited later is compiled again at its import, as usual.
"$PY" -m compileall -q -j 0 ctconvert >/dev/null
