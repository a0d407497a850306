"""``quantize`` as a list of stages, each an object with its options, its dry-run report and its run.

source -> plan -> (calibrate) -> quantize -> (target) -> write:

* :class:`~.source.SourceStage`: the input opened once, as dense tensors (a quantized one dequantized on the fly);
* :class:`~.plan.PlanStage`: every tensor's fate from the headers, and the result;
* :class:`~.calibrate.CalibrateStage`: static activation and KV-cache scales from calibration data (when needed);
* :class:`~.quantize.QuantizeStage`: the devices, the tensor-parallel plan, the ``quantization_config``, what the executor is told;
* :class:`~.target.TargetStage`: ``--target``, the kernel-native layout in the same pass (when asked);
* :class:`~.write.WriteStage`: the output folder, the streaming executor into it, the config and provenance.

:func:`~.job.run_stages` prepares every stage (headers only), then reports (a dry run) or runs each;
:class:`~.job.QuantizeJob` is what they hand on. Above ``pipeline/`` (they drive it), below ``commands/``.
"""
