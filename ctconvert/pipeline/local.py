"""This machine's devices: the units of a plan dealt to one :class:`~.executor.Executor` per device.

:func:`execute` runs a plan on one device, or on several (each GPU of the machine) with the units dealt by
size; :class:`LocalExecutor` is it behind the interface the write stage holds, the one
:class:`~ctconvert.pipeline.ray_executor.RayExecutor` also has.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from ..checkpoint.reader import Checkpoint
from ..checkpoint.shard_file import ShardFile
from ..plan.planner import Plan, WorkUnit
from .executor import ExecOptions, Executor
from .reads import split_units

__all__ = ["LocalExecutor", "execute"]


class LocalExecutor:
    """This machine's devices, with the interface of :class:`~ctconvert.pipeline.ray_executor.RayExecutor` (the
    write stage holds one or the other): :meth:`start` and :meth:`connect` have nothing to join; :meth:`run` is
    :func:`execute` and gives no ``nodes``; the write stage hashes the sources beside it (``hashes_sources``)."""

    hashes_sources = True

    def start(self, device: str = "cpu") -> None:
        pass

    def connect(self) -> None:
        pass

    def run(self, ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions, devices, out) -> None:
        execute(ckpt, plan, shards, opts, devices)


def execute(ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions, devices: list[torch.device] | None = None) -> None:
    """Run every unit of ``plan``, writing into ``shards``.

    With several devices, units (a fused set or a tensor: the unit of work)
    are dealt to one executor per device by size; all write into the same
    shard files at disjoint offsets, so the output is the same bytes.
    """
    devices = devices or [opts.device]
    if len(devices) == 1:
        Executor(ckpt, plan, shards, dataclasses.replace(opts, device=devices[0])).run()
        return
    errors: list[BaseException] = []

    def work(units: list[WorkUnit], dev: torch.device) -> None:
        try:
            Executor(ckpt, dataclasses.replace(plan, units=units), shards, dataclasses.replace(opts, device=dev)).run()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=(part, dev), name=f"ctconvert-{dev}", daemon=True)
        for part, dev in zip(split_units(ckpt, plan.units, len(devices)), devices)
        if part
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
