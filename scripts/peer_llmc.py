#!/usr/bin/env python3
"""Peer baseline: quantize a safetensors checkpoint folder with llm-compressor.

Run with the interpreter of a separate venv that has llmcompressor installed
(e.g. /work/venvs/llmc/bin/python), NOT the project's own venv:

    python scripts/peer_llmc.py SRC_DIR OUT_DIR --scheme FP8_DYNAMIC|W4A16|NVFP4A16|... (SCHEMES) \
        [--device cpu|cuda] [--ignore PATTERN ...] [--max-workers N]

It calls llm-compressor's model-free PTQ entrypoint (no model class is built;
tensors are selected purely by name) with a compressed-tensors preset scheme,
and prints exactly one JSON line on stdout, e.g.
    {"seconds": 1.23, "scheme": "W4A16", "ok": true, ...}
All library logging (which llm-compressor sends to stdout) is diverted to stderr
so stdout carries only that JSON line. Exit code is 0 on success, 1 on failure.

Tensor selection used by model_free_ptq: every tensor whose name ends in
".weight" is a candidate, except those whose module name ends in "norm"
(skipped automatically). Embeddings and lm_head are 2-D ".weight" tensors too,
so they must be excluded through `ignore`; the default ignore list below does
that, leaving only the Linear weights inside the decoder layers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# the presets whose activations model_free_ptq accepts (dynamic or none: it refuses static input scales)
SCHEMES = ("FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W4AFP8", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8")

# Module-name patterns (compressed-tensors syntax: exact name or "re:" + regex,
# matched with re.match against the module name, i.e. tensor name minus ".weight").
DEFAULT_IGNORE = [
    "lm_head",
    r"re:.*embed_tokens$",
]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="folder with *.safetensors (+ index, config.json)")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--scheme", required=True, choices=SCHEMES)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    ap.add_argument(
        "--ignore",
        nargs="*",
        default=None,
        help=f"extra module-name patterns to ignore, appended to the defaults {DEFAULT_IGNORE}",
    )
    ap.add_argument("--max-workers", type=int, default=1)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    ignore = DEFAULT_IGNORE + list(args.ignore or [])

    result: dict = {"seconds": None, "scheme": args.scheme, "ok": False}

    # llm-compressor's loguru sink writes to sys.stdout (and warns at import
    # time), so point fd 1 at stderr while the library is imported and runs.
    sys.stdout.flush()
    saved_stdout_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        t_import = time.perf_counter()
        import torch  # noqa: F401
        from llmcompressor import __version__ as llmc_version
        from llmcompressor.entrypoints.model_free import model_free_ptq

        result["import_seconds"] = round(time.perf_counter() - t_import, 3)
        result["llmcompressor"] = llmc_version

        device = args.device
        if device == "cuda":
            device = "cuda:0"

        t0 = time.perf_counter()
        model_free_ptq(
            model_stub=args.src,
            save_directory=args.out,
            scheme=args.scheme,
            ignore=ignore,
            max_workers=args.max_workers,
            device=device,
        )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        result["seconds"] = round(time.perf_counter() - t0, 3)
        result["ok"] = True
        result["device"] = device
        result["ignore"] = ignore
    except Exception as exc:  # report failures as JSON too
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout_fd, 1)
        os.close(saved_stdout_fd)

    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
