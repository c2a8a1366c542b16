"""Repeated warnings are printed once, then counted (`streamrl.cli.repeats`): a flood of the same
warning is one line and, once its window ends, one line saying how many more there were; other
warnings, lower levels and tracebacks pass; what is held back at the end is printed by flush.
The filter sits on a real handler writing to a buffer, its clock the test's."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from streamrl.cli.repeats import RepeatedWarnings


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO, RepeatedWarnings, _Clock]]:
    out, clock = io.StringIO(), _Clock()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    repeats = RepeatedWarnings(handler, window_s=60.0, clock=clock)
    handler.addFilter(repeats)
    logger = logging.getLogger("streamrl.test_repeats")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    try:
        yield logger, out, repeats, clock
    finally:
        logger.removeHandler(handler)


def _lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_a_flood_is_one_line_then_one_count_per_window(logged) -> None:
    logger, out, repeats, clock = logged
    for episode in range(512):
        logger.warning("agent %r: a run failed: %s", "pkg:fn", "it raised TypeError: x")
        clock.now += 0.1 if episode < 511 else 0.0
    assert _lines(out) == ["WARNING streamrl.test_repeats: agent 'pkg:fn': a run failed: "
                           "it raised TypeError: x"]  # fmt: skip
    clock.now += 60.0  # the window has ended: the next record of any kind closes it
    logger.info("generator gen0: 0.00 groups/s")
    *_, summary, info = _lines(out)
    assert summary == (
        "WARNING streamrl.test_repeats: agent 'pkg:fn': a run failed: it raised TypeError: x"
        " … ×511 more in the last 112 s"
    )
    assert info.endswith("0.00 groups/s")
    for _ in range(10):  # still flooding: counted in the next window, not printed
        logger.warning("agent %r: a run failed: %s", "pkg:fn", "it raised TypeError: x")
    assert len(_lines(out)) == 3
    repeats.flush()  # on the way out
    assert _lines(out)[-1].endswith("it raised TypeError: x … ×10 more in the last 1 s")
    repeats.flush()
    assert len(_lines(out)) == 4, "nothing is held back twice"


def test_other_warnings_lower_levels_and_tracebacks_pass(logged) -> None:
    logger, out, repeats, _ = logged
    for i in range(3):
        logger.warning("reward %r failed on response %s", "fn", i)
        logger.warning("environment %r: a step call failed", "env")
        logger.info("progress %d", i)
    try:
        raise ValueError("boom")
    except ValueError:
        logger.warning("reward %r failed on response %s", "fn", "with its traceback", exc_info=True)
    lines = _lines(out)
    assert [line for line in lines if "progress" in line] == [
        f"INFO streamrl.test_repeats: progress {i}" for i in range(3)
    ]
    assert sum("a step call failed" in line for line in lines) == 1
    assert sum("failed on response 0" in line for line in lines) == 1
    assert "failed on response with its traceback" in out.getvalue()
    assert "ValueError: boom" in out.getvalue()
    repeats.flush()  # the latest held back stands for them
    assert "failed on response 2 … ×2 more in the last 1 s" in out.getvalue()


def test_a_warning_printed_again_once_a_quiet_window_passed(logged) -> None:
    logger, out, repeats, clock = logged
    logger.warning("weights v%d vanished", 3)
    clock.now += 61.0
    logger.warning("weights v%d vanished", 4)
    clock.now += 61.0
    logger.warning("weights v%d vanished", 5)
    repeats.flush()
    assert [line.split(": ", 1)[1] for line in _lines(out)] == [
        "weights v3 vanished",
        "weights v4 vanished",
        "weights v5 vanished",
    ]
