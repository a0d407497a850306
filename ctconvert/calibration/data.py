"""Calibration tokens: ``--calibration FILE`` (or the shipped corpus) -> int64 ``[samples, seq_len]``.

A file is read as, in this order: JSON lines (``.jsonl``, or every line a JSON object)
with a ``text`` field (or ``input_ids``); token ids (a JSON array of ints or of arrays
of ints, or whitespace/comma-separated integers); otherwise plain text. Text is
tokenized with the checkpoint's own tokenizer (transformers ``AutoTokenizer``), the
documents joined with the EOS token where there is one, and the stream cut into
``samples`` rows of ``seq_len`` tokens (no padding, so no token is a pad). Without a
file, the English corpus in ``ctconvert/calibration/corpus.txt`` (original prose
written for this project) is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInputError, UsageError
from ..options import DEFAULT_CALIBRATION_SAMPLES as DEFAULT_SAMPLES
from ..options import DEFAULT_CALIBRATION_SEQ_LEN as DEFAULT_SEQ_LEN

__all__ = ["CORPUS", "DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN", "TOKENIZER_FILES", "CalibrationData", "load_tokens"]

CORPUS = Path(__file__).with_name("corpus.txt")
_IDS = re.compile(r"^[\s\d,\[\]]+$")


@dataclass
class CalibrationData:
    """The tokens and where they came from (for the output's notes)."""

    tokens: torch.Tensor  # int64 [samples, seq_len]
    source: str  # "the built-in English corpus" | the file's path
    kind: str  # text | jsonl | token ids
    available: int  # tokens the source had

    @property
    def note(self) -> str:
        """The output's note on the data: where it came from, how many tokens it had, how many are used."""
        samples, seq_len = self.tokens.shape
        return f"calibration data: {self.source} ({self.kind}, {self.available} tokens; using {samples} x {seq_len})"


def _read_docs(path: Path) -> tuple[str, list]:
    """``(kind, docs)``: ``docs`` are strings (text) or lists of ints (token ids)."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"cannot read the calibration file: {e}", file=path) from None
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    if path.suffix == ".jsonl" or (lines and all(ln.lstrip().startswith("{") for ln in lines)):
        docs = []
        for i, ln in enumerate(lines, 1):
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError as e:
                raise BadInputError(f"line {i} is not JSON ({e.msg}); a JSON lines file needs one object with a 'text' field per line", file=path) from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                docs.append(rec["text"])
            elif isinstance(rec, dict) and isinstance(rec.get("input_ids"), list):
                docs.append(rec["input_ids"])
            else:
                raise BadInputError(f"line {i} has no 'text' string (or 'input_ids' list)", file=path)
        return "jsonl", docs
    if raw.strip() and _IDS.match(raw):
        try:
            val = json.loads(raw)
        except json.JSONDecodeError:
            val = [int(x) for x in re.split(r"[\s,]+", raw.strip()) if x]
        if isinstance(val, list) and val and all(isinstance(x, int) for x in val):
            return "token ids", [val]
        if isinstance(val, list) and all(isinstance(r, list) and all(isinstance(x, int) for x in r) for r in val):
            return "token ids", val
        raise BadInputError("token ids must be a JSON array of ints or of arrays of ints, or integers separated by spaces/commas", file=path)
    return "text", [raw]


#: the files a Hugging Face tokenizer is loaded from (transformers ``AutoTokenizer``: fast, SentencePiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")


def _tokenizer(model_path: Path, source: str):
    """The checkpoint's tokenizer (transformers ``AutoTokenizer``). Raises :class:`BadInputError` naming the folder where
    it has no tokenizer files, where transformers cannot load them, or where what loads has no vocabulary
    (transformers 5 builds an empty tokenizer of one token from a ``config.json`` alone)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:  # pragma: no cover - installed with the test extras
        raise UsageError("calibrating from text needs transformers (pip install transformers), or pass token ids with --calibration") from None
    found = [f for f in TOKENIZER_FILES if (model_path / f).is_file()]
    if not found:
        raise _no_tokenizer(model_path, source, found, "")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
    except Exception as e:  # noqa: BLE001 - any failure to load it is one clear line
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise _no_tokenizer(model_path, source, found, f": transformers could not load them ({first})") from None
    if len(tok) < 2:
        raise _no_tokenizer(model_path, source, found, f": what transformers loads from them has {len(tok)} token")
    return tok


def _no_tokenizer(model_path: Path, source: str, found: list[str], why: str) -> BadInputError:
    return BadInputError(
        f"no usable tokenizer in the checkpoint (looked for {', '.join(TOKENIZER_FILES)}; found {', '.join(found) or 'none'}{why}); "
        f"{source} is text and calibration tokenizes it with the model's tokenizer: copy the model's "
        "tokenizer files into the checkpoint folder (or a copy of it, if it is read-only), or pass token ids with --calibration FILE "
        "(a JSON array of ints, or integers separated by spaces)",
        file=model_path,
    )


def checkpoint_tokens(ckpt, file: str | Path | None, samples: int, seq_len: int) -> CalibrationData:
    """:func:`load_tokens` for a checkpoint (``ckpt.path``, its tokenizer; ids checked against its config's
    ``vocab_size``, the text config's for a multimodal model). Raises what :func:`load_tokens` raises."""
    return load_tokens(ckpt.path, file, samples, seq_len, (ckpt.config.get("text_config") or ckpt.config).get("vocab_size"))


def load_tokens(model_path: Path, file: str | Path | None, samples: int, seq_len: int, vocab_size: int | None) -> CalibrationData:
    """Read and tokenize the calibration data; ``samples * seq_len`` tokens are taken from its start.

    Raises :class:`UsageError` (bad counts), :class:`BadInputError` (unreadable file, no tokenizer for text,
    fewer tokens than needed, token ids outside the vocabulary).
    """
    if samples < 1 or seq_len < 1:
        raise UsageError(f"--calibration-samples and --calibration-seq-len must be at least 1 (got {samples} and {seq_len})")
    path = Path(file) if file is not None else CORPUS
    source = str(path) if file is not None else "the built-in English corpus"
    if file is not None and not path.is_file():
        raise UsageError(f"calibration file not found: {path}")
    kind, docs = _read_docs(path)
    stream: list[int] = []
    if any(isinstance(d, str) for d in docs):
        from transformers.utils import logging as hf_logging

        tok = _tokenizer(model_path, source)
        eos = tok.eos_token_id
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "sequence length is longer than the maximum": the stream is cut into rows of seq_len below
        try:
            for d in docs:
                ids = d if isinstance(d, list) else tok(d, add_special_tokens=False)["input_ids"]
                stream += list(ids) + ([eos] if eos is not None else [])
        finally:
            hf_logging.set_verbosity(verbosity)
    else:
        for d in docs:
            stream += list(d)
    need = samples * seq_len
    if len(stream) < need:
        raise BadInputError(
            f"calibration needs {samples} x {seq_len} = {need} tokens, {source} has {len(stream)}: "
            "give more data with --calibration, or lower --calibration-samples / --calibration-seq-len",
            file=path if file is not None else None,
        )
    t = torch.tensor(stream[:need], dtype=torch.int64).reshape(samples, seq_len)
    if vocab_size and (int(t.max()) >= vocab_size or int(t.min()) < 0):
        raise BadInputError(f"token id {int(t.max()) if int(t.max()) >= vocab_size else int(t.min())} is outside the vocabulary (size {vocab_size})", file=path)
    return CalibrationData(t, source, kind, len(stream))
