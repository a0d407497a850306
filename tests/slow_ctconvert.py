"""``python slow_ctconvert.py SECONDS ARGS...``: the ctconvert CLI with every shard write delayed by SECONDS.

For the interrupt tests (tests/test_faults.py): a conversion slow enough to be
interrupted mid-way. The delay is installed after ctconvert's own deferred
imports (so a Ctrl-C during them is handled as in production), by wrapping
``ctconvert.cli.run``; the production code has no hook for it.
"""

import sys
import time

import ctconvert.cli as cli

DELAY = float(sys.argv.pop(1))
_run = cli.run


def _slow_run() -> None:
    from ctconvert.checkpoint.safetensors_io import ShardFile

    write = ShardFile.write

    def slow_write(self, *args, **kwargs):
        time.sleep(DELAY)
        return write(self, *args, **kwargs)

    ShardFile.write = slow_write
    _run()


cli.run = _slow_run

from ctconvert.__main__ import main  # noqa: E402 - after the wrap

main()
