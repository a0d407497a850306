"""``python -m ctconvert`` and the ``ctconvert`` console script.

Every command imports torch, which can take seconds. A Ctrl-C that lands
during those imports must still give the one-line message and exit code 130,
never a traceback, and must never be lost: a KeyboardInterrupt raised inside
torch's import can be swallowed, and the conversion then runs to the end. So
the heavy imports happen here, up front, while SIGINT only sets a flag, which
is checked once they are done.
"""

import os
import signal
import sys

from .errors import EXIT_INTERRUPTED, interrupted_message  # light: no torch


def main() -> None:
    hits: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        from . import api  # noqa: F401 - torch and the rest of the heavy imports, inside the window
        from .cli import run
    finally:
        signal.signal(signal.SIGINT, previous)
    if hits:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stderr.write(interrupted_message(sys.argv[1:]) + "\n")
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)  # nothing was opened yet
    run()


if __name__ == "__main__":
    main()
