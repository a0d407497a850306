"""Error classes and the exit codes they map to.

Every error carries a one-line message that names the file and, where there is
one, the tensor. The CLI prints ``error: <message>`` and exits with
``exit_code``; it prints a traceback only with ``--debug``.
"""

from __future__ import annotations

import signal

# Documented exit codes (README "Exit codes").
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_UNSUPPORTED = 4
EXIT_VERIFY_FAILED = 5
EXIT_OUTPUT = 6
EXIT_INTERRUPTED = 130
INTERRUPTED_MESSAGE = "interrupted: nothing was written to the output path"
#: commands that write an output path (the others only read)
WRITING_COMMANDS = ("quantize", "repack", "decompress", "batch")


#: the signals that stop a command like Ctrl-C (batch schedulers send SIGTERM, a closed terminal SIGHUP)
STOP_SIGNALS = tuple(sig for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if sig is not None)


def stops_to_handle() -> tuple:
    """The :data:`STOP_SIGNALS` this process was not started ignoring: ``nohup`` starts a command with SIGHUP
    ignored (a closed terminal must not stop it) and a shell's background job may have SIGINT ignored; a handler
    installed over that would stop the run anyway. Read before the process installs handlers of its own."""
    return tuple(sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN)


def stop_exit_code(signum: int) -> int:
    """130 for Ctrl-C, 128 + the signal for SIGTERM (143) and SIGHUP (129)."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum


def stop_message(signum: int, argv: list[str]) -> str:
    """The stop line: :func:`interrupted_message`, prefixed with the signal's name unless it was Ctrl-C."""
    prefix = "" if signum == signal.SIGINT else f"{signal.Signals(signum).name}: "
    return prefix + interrupted_message(argv)


def interrupted_message(argv: list[str]) -> str:
    """The Ctrl-C line for the command in ``argv``: read-only commands have no output path to mention."""
    command = next((a for a in argv if not a.startswith("-")), "")  # the group's own options are flags
    # batch: earlier jobs may have written their outputs; the CLI's hint says which job stopped and what it left
    return INTERRUPTED_MESSAGE if command in WRITING_COMMANDS and command != "batch" else "interrupted"


def plural(n: int, noun: str, many: str | None = None) -> str:
    """A count and its noun in agreement, for every message that counts things: ``plural(1, "tensor")`` is
    ``"1 tensor"``, ``plural(3, "tensor")`` ``"3 tensors"``; ``many`` for an irregular plural
    (``plural(n, "other entry", "other entries")``)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, for every message and table that shows a size (``512 B``, ``1.50 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def agree(n: int, one: str, many: str) -> str:
    """The verb (or word) that agrees with a count: ``agree(n, "is", "are")``."""
    return one if n == 1 else many


class CTConvertError(Exception):
    """Base class: a clear, one-line error with an exit code."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        self.message = message  # without the file and tensor prefix
        where = []
        if file:
            where.append(str(file))
        if tensor:
            where.append(f"tensor {tensor!r}")
        prefix = ": ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class UsageError(CTConvertError):
    """Bad arguments (unknown scheme, conflicting options)."""

    exit_code = EXIT_USAGE


class BadInputError(CTConvertError):
    """The input checkpoint is unreadable or inconsistent, or a tensor is invalid."""

    exit_code = EXIT_BAD_INPUT


class UnsupportedError(CTConvertError):
    """The input is valid but asks for something ctconvert cannot do (yet)."""

    exit_code = EXIT_UNSUPPORTED


class OutputError(CTConvertError):
    """The output path cannot be written (exists, read-only, disk full)."""

    exit_code = EXIT_OUTPUT


def one_line(text: object) -> str:
    """``text`` on one line: a line break, tab or other control character (a file name may hold one) written as its
    escape (``\\n``), so that a message stays one line on a terminal and in a log."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)
