"""The streaming pipeline: devices, the quantize executor, and the task runner of ``repack``/``decompress``.

:mod:`.devices` parses ``--device``; :mod:`.executor` runs a plan (read ->
quantize -> [repack] -> write, by row chunks, with a reader and a writer
thread), with its absmax pass (:mod:`.scales`), host buffers (:mod:`.buffers`)
and NaN/inf checks (:mod:`.nonfinite`); :mod:`.tasks` runs the copy/cast/compute
tasks of the commands that rewrite a checkpoint without quantizing it.
"""
