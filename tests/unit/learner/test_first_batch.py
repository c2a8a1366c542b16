"""The learner's progress lines while it waits for its first batch (`FirstBatchWait`): the
first after 30 s of waiting, then each time the wait has doubled, none once the batch is
collected; each one a line the terminal shows (`noteworthy`)."""

from __future__ import annotations

import logging

import pytest

from streamrl.learner.first_batch import FIRST_NOTICE_S, FirstBatchWait
from streamrl.supervision.output import noteworthy

# How a component's process writes its log records (streamrl.cli.main).
COMPONENT_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _shown(caplog: pytest.LogCaptureFixture) -> list[str | None]:
    return [noteworthy(COMPONENT_FORMAT.format(r)) for r in caplog.records]


def test_a_long_wait_for_the_first_batch_shows_a_few_lines(caplog) -> None:
    clock = Clock()
    wait = FirstBatchWait(4, 1, clock=clock)
    caplog.set_level(logging.INFO)
    polls = [0, 1, 10, 29, 30, 31, 59, 61, 100, 121, 200, 243, 300, 360]  # seconds of waiting
    accepted = {30: 0, 61: 1, 200: 3}  # the groups accepted by then
    for second in polls:
        clock.now = 1000.0 + 5 + second  # the wait starts at the first poll, not at creation
        wait.waiting(accepted.get(second, 0))
    assert FIRST_NOTICE_S == 30
    assert _shown(caplog) == [
        "waiting for the groups of step 1: 0 of 4 after 30 s",
        "waiting for the groups of step 1: 1 of 4 after 61 s",  # the next due at 122 s
        "waiting for the groups of step 1: 3 of 4 after 200 s",  # the next due at 400 s
    ]


def test_nothing_is_said_once_the_first_batch_is_collected(caplog) -> None:
    clock = Clock()
    wait = FirstBatchWait(8, 13, clock=clock)  # a resumed learner: its first step is 13
    caplog.set_level(logging.INFO)
    wait.waiting(0)
    clock.now += 45
    wait.waiting(2)
    wait.collected()  # the step trains: the reader still polls, idle
    for _ in range(5):
        clock.now += 600
        wait.waiting(8)
    assert _shown(caplog) == ["waiting for the groups of step 13: 2 of 8 after 45 s"]
