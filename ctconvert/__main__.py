"""``python -m ctconvert`` and the ``ctconvert`` console script.

Every command imports torch, which can take seconds. A Ctrl-C that lands
during those imports must still give the one-line message and exit code 130,
never a traceback, and must never be lost: a KeyboardInterrupt raised inside
torch's import can be swallowed, and the conversion then runs to the end. So
the heavy imports happen here, up front, while SIGINT (and SIGTERM, SIGHUP)
only set a flag, which is checked once they are done.
"""

import os
import signal
import sys

from .errors import EXIT_INTERRUPTED, interrupted_message  # light: no torch


def main() -> None:
    stops = [sig for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if sig is not None]
    hits: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: hits.append(signum)) for sig in stops}
    try:
        from . import api  # noqa: F401 - torch and the rest of the heavy imports, inside the window
        from .cli import run
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if hits:
        for sig in stops:
            signal.signal(sig, signal.SIG_IGN)
        name = "" if hits[0] == signal.SIGINT else f"{signal.Signals(hits[0]).name}: "
        sys.stderr.write(name + interrupted_message(sys.argv[1:]) + "\n")
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED if hits[0] == signal.SIGINT else 128 + hits[0])  # nothing was opened yet
    run()


if __name__ == "__main__":
    main()
