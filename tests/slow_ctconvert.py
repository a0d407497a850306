"""``python slow_ctconvert.py SECONDS ARGS...``: ``python -m ctconvert ARGS...`` with every piece written to a shard delayed by SECONDS.

For the interrupt tests (tests/test_faults.py): a conversion slow enough to be
interrupted mid-way. Nothing of ctconvert is imported here: an import hook
wraps ``ShardFile.write_many`` (which ``ShardFile.write`` calls) when ``ctconvert.checkpoint.shard_file`` is first
loaded, inside ctconvert's own Ctrl-C-deferred imports, and the CLI then runs
exactly as ``python -m ctconvert`` does. The production code has no hook for it.
"""

import importlib.abc
import importlib.util
import runpy
import sys
import time

DELAY = float(sys.argv.pop(1))
TARGET = "ctconvert.checkpoint.shard_file"


class _SlowWrites(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            write = module.ShardFile.write_many

            def slow_write(self, pieces):
                time.sleep(DELAY * len(pieces))  # per piece written, as when each was its own write
                return write(self, pieces)

            module.ShardFile.write_many = slow_write

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SlowWrites())
runpy.run_module("ctconvert", run_name="__main__", alter_sys=True)
