"""run_stages: every stage prepared, then each reported (dry run) or run, then each finished, in list order."""

from __future__ import annotations

import pytest

from ctconvert.pipeline.options import QuantizeOptions
from ctconvert.stages.job import QuantizeJob, Stage, run_stages


class _Recording(Stage):
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def prepare(self, job):
        self.log.append(("prepare", self.name))

    def report(self, job):
        self.log.append(("report", self.name))

    def run(self, job):
        self.log.append(("run", self.name))

    def finish(self, job):
        self.log.append(("finish", self.name))
        job.result = "the result"


@pytest.mark.parametrize("dry_run", [True, False])
def test_rounds_in_order(dry_run):
    log: list = []
    job = QuantizeJob("src", None, QuantizeOptions(dry_run=dry_run))
    assert run_stages([_Recording("a", log), _Recording("b", log)], job) == "the result"
    middle = "report" if dry_run else "run"
    assert log == [("prepare", "a"), ("prepare", "b"), (middle, "a"), (middle, "b"), ("finish", "a"), ("finish", "b")]


def test_every_hook_is_optional():
    job = QuantizeJob("src", None, QuantizeOptions())
    assert run_stages([Stage()], job) is None
