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

from .errors import STOP_SIGNALS, stop_exit_code, stop_message  # light: no torch


def main() -> None:
    hits: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: hits.append(signum)) for sig in STOP_SIGNALS}
    try:
        from . import api  # noqa: F401 - torch and the rest of the heavy imports, inside the window
        from .cli import run
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if hits:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        sys.stderr.write(stop_message(hits[0], sys.argv[1:]) + "\n")
        sys.stderr.flush()
        os._exit(stop_exit_code(hits[0]))  # nothing was opened yet
    run()


if __name__ == "__main__":
    main()
