"""``python slow_ctconvert.py SECONDS ARGS...``: ``python -m ctconvert ARGS...`` with every shard write delayed by SECONDS.

For the interrupt tests (tests/test_faults.py): a conversion slow enough to be
interrupted mid-way. Nothing of ctconvert is imported here: an import hook
wraps ``ShardFile.write`` when ``ctconvert.checkpoint.safetensors_io`` is first
loaded, inside ctconvert's own Ctrl-C-deferred imports, and the CLI then runs
exactly as ``python -m ctconvert`` does. The production code has no hook for it.
"""

import importlib.abc
import importlib.util
import runpy
import sys
import time

DELAY = float(sys.argv.pop(1))
TARGET = "ctconvert.checkpoint.safetensors_io"


class _SlowWrites(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            write = module.ShardFile.write

            def slow_write(self, *args, **kwargs):
                time.sleep(DELAY)
                return write(self, *args, **kwargs)

            module.ShardFile.write = slow_write

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SlowWrites())
runpy.run_module("ctconvert", run_name="__main__", alter_sys=True)
