"""``python -m ctconvert`` and the ``ctconvert`` console script.

The CLI imports torch, which can take seconds; a Ctrl-C that lands during
those imports must still give the one-line message and exit code 130
(never a traceback), so the imports happen inside the handler.
"""

import os
import signal
import sys


def main() -> None:
    try:
        from .cli import run
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn the exit into a traceback
        sys.stderr.write("interrupted: nothing was written to the output path\n")
        sys.stderr.flush()
        os._exit(130)  # nothing was opened yet; a half-imported torch must not run its exit hooks
    run()


if __name__ == "__main__":
    main()
