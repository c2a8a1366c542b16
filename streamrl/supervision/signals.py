"""Stop signals to a supervisor: `stop_signals` turns SIGINT (Ctrl-C) and SIGTERM into an event
its main loop waits on; `stopping_despite_interrupts` answers a further one, while the run stops,
with a notice instead of cutting the stop short. Used by every supervisor of processes
(`streamrl.supervision.supervisor`, the `streamrl` flow)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from streamrl.supervision.launch import STOP_GRACE_S

__all__ = ["Signalled", "stop_signals", "stopping_despite_interrupts"]

log = logging.getLogger("streamrl.supervision.supervisor")  # where its notices always appeared


@contextlib.contextmanager
def stopping_despite_interrupts(grace_s: float):
    """While the run stops, a further Ctrl-C or SIGTERM (an impatient user presses it twice) is
    answered with a notice instead of cutting the stop short: the processes would be left
    running, and the learner's checkpoint on stop lost (main thread only). Every supervisor's
    stop on an interrupt runs inside it: `Supervisor.run` and the `streamrl` flow's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def notice(signum: int, frame: object) -> None:
        _still_stopping(grace_s)

    previous = {sig: signal.signal(sig, notice) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Signalled(threading.Event):
    """Set by a stop signal; `name` says which (SIGINT, SIGTERM)."""

    name = ""


@contextlib.contextmanager
def stop_signals(grace_s: float):
    """SIGINT (Ctrl-C) and SIGTERM to the supervisor set the event it yields (main thread only;
    elsewhere it is never set); a further one gets `stopping_despite_interrupts`'s notice. The
    handler raises nothing: a `KeyboardInterrupt` raised into `Thread.join` marks a running
    thread as ended (CPython 3.11, bpo-45274's fix), and the supervisor would then report a
    stop while the learner still runs, its checkpoint unmade."""
    signalled = Signalled()
    if threading.current_thread() is not threading.main_thread():
        yield signalled
        return

    def note(signum: int, frame: object) -> None:
        if signalled.is_set():
            _still_stopping(grace_s)
            return
        signalled.name = signal.Signals(signum).name
        signalled.set()

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield signalled
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _still_stopping(grace_s: float) -> None:
    log.warning(
        "still stopping: every process of the run ends within %.0f s (the learner "
        "checkpoints the step in hand first)",
        grace_s + STOP_GRACE_S,
    )
