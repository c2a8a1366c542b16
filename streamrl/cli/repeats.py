"""Warnings that repeat, printed once and then counted: `RepeatedWarnings`, the filter the
command line (`streamrl.cli.main`) puts on the handler every streamrl process logs through.

A generator whose user code fails on every call would print the same warning for every episode
— thousands a minute, burying everything else in its terminal and log. So a warning (or error)
is printed the first time; the ones like it — the same logger, level and message template
(`record.msg`, before its arguments are filled in: the same warning about another response or
prompt) — are held back for `window_s` seconds, and then one line stands for them: the latest of
them, followed by "… ×511 more in the last 60 s". A flood that goes on gets one such line per
window; once a window ends with nothing held back, the next one like it is printed again. A
record with a traceback is always printed: streamrl logs one only for the first failure of its
kind. What is held back when the process ends is printed by `flush`, which the command line
calls on its way out. Records below WARNING (progress lines, which repeat by design) pass
untouched.

Windows end when the next record of any level passes through (a generator logs its throughput
every 30 s), or at `flush`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WINDOW_S", "RepeatedWarnings"]

WINDOW_S = 60.0
_SUMMARY = "_streamrl_repeats_summary"  # set on the records this filter writes


@dataclass
class _Window:
    started: float
    held: int = 0
    latest: logging.LogRecord | None = None


class RepeatedWarnings(logging.Filter):
    """The filter of `handler` that holds repeated warnings back (module docstring). `clock`:
    seconds, monotonic."""

    def __init__(
        self,
        handler: logging.Handler,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.handler, self.window_s, self._clock = handler, window_s, clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, int, str], _Window] = {}

    @classmethod
    def on(cls, handler: logging.Handler, window_s: float = WINDOW_S) -> RepeatedWarnings:
        """A filter added to `handler`."""
        repeats = cls(handler, window_s)
        handler.addFilter(repeats)
        return repeats

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY, False):
            return True
        now = self._clock()
        with self._lock:
            summaries = self._ended(now, every=False)
            shown = self._admit(record, now)
        for summary in summaries:  # handled before `record`, whose turn comes after
            self.handler.handle(summary)
        return shown

    def flush(self) -> None:
        """Print a line for every warning held back so far (on the way out)."""
        with self._lock:
            summaries = self._ended(self._clock(), every=True)
        for summary in summaries:
            self.handler.handle(summary)

    def _admit(self, record: logging.LogRecord, now: float) -> bool:
        if record.levelno < logging.WARNING or record.exc_info:
            return True
        key = (record.name, record.levelno, str(record.msg))
        window = self._windows.get(key)
        if window is None:
            self._windows[key] = _Window(now)
            return True
        window.held += 1
        window.latest = record
        return False

    def _ended(self, now: float, *, every: bool) -> list[logging.LogRecord]:
        """The lines for the windows that ended by `now` (`every`: all of them), which are
        closed; a window that held records back opens the next one, so a flood goes on
        being counted, not printed."""
        summaries = []
        for key, window in list(self._windows.items()):
            if not every and now - window.started < self.window_s:
                continue
            if window.latest is None:
                del self._windows[key]
                continue
            summaries.append(_summary(window, now))
            self._windows[key] = _Window(now)
        if every:
            self._windows.clear()
        return summaries


def _summary(window: _Window, now: float) -> logging.LogRecord:
    """The line standing for a window's held records: the latest, then how many."""
    assert window.latest is not None
    seconds = max(1, math.ceil(now - window.started))
    text = f"{_message(window.latest)} … ×{window.held} more in the last {seconds} s"
    summary = logging.makeLogRecord(vars(window.latest))
    summary.msg, summary.args = text, None
    summary.exc_info = summary.exc_text = summary.stack_info = None
    setattr(summary, _SUMMARY, True)
    return summary


def _message(record: logging.LogRecord) -> str:
    """The record's message; its template when the arguments do not fit it (logging's own
    error report is the handler's, when it formats the original)."""
    try:
        return record.getMessage()
    except (TypeError, ValueError):
        return str(record.msg)
