"""Component log files of a run on object storage are copied to the run's storage: while the
component runs (a container killed outright keeps what was copied) and when the logs close. The
terminal shows a component's progress lines (`noteworthy`)."""

from __future__ import annotations

import time

from storage.fs import open_location
from streamrl.supervision.output import ComponentLogs, noteworthy


def test_logs_are_copied_while_they_grow_and_when_they_close(tmp_path):
    run = open_location(str(tmp_path / "run"))
    target = run.join("logs", "host-a")
    logs = ComponentLogs(tmp_path / "local", copy_to=(run, target), copy_every_s=0.05)
    logs.write("gen0", "first line")
    copied = tmp_path / "run" / "logs" / "host-a" / "gen0.log"
    deadline = time.monotonic() + 10
    while not (copied.exists() and copied.read_text() == "first line\n"):
        assert time.monotonic() < deadline, "no copy while the component runs"
        time.sleep(0.02)
    logs.write("gen0", "last line")
    logs.write("learner", "step 1/2: ...")
    logs.close()
    assert copied.read_text() == "first line\nlast line\n"
    assert (copied.parent / "learner.log").read_text() == "step 1/2: ...\n"


def test_a_copy_that_fails_is_retried_and_never_raises(tmp_path):
    run = open_location(str(tmp_path / "run"))
    blocked = tmp_path / "run" / "logs"
    blocked.write_text("a file where the folder should be")  # every copy fails
    logs = ComponentLogs(
        tmp_path / "local", copy_to=(run, run.join("logs", "h")), copy_every_s=0.05
    )
    logs.write("gen0", "a line")
    time.sleep(0.3)  # a few failed copies
    blocked.unlink()
    copied = tmp_path / "run/logs/h/gen0.log"
    deadline = time.monotonic() + 10
    while not copied.exists():
        assert time.monotonic() < deadline, "the copy was not retried"
        time.sleep(0.02)
    logs.close()
    assert copied.read_text() == "a line\n"


def test_logs_of_a_local_run_are_written_in_place_and_not_copied(tmp_path):
    logs = ComponentLogs.for_run(open_location(str(tmp_path / "run")))
    logs.write("gen0", "a line")
    logs.close()
    assert (tmp_path / "run" / "logs" / "gen0.log").read_text() == "a line\n"
    assert [p.name for p in (tmp_path / "run" / "logs").iterdir()] == ["gen0.log"]


def test_the_terminal_shows_progress_lines_before_the_first_step():
    """INFO records of the logger `streamrl.progress` are shown (a component's start-up); an
    INFO record of any other logger is not, whatever it says."""
    engine_up = "2026-11-23 10:00:01,123 INFO streamrl.progress: engine up in 42 s, weights v0"
    assert noteworthy(engine_up) == "engine up in 42 s, weights v0"
    assert noteworthy(engine_up.replace("streamrl.progress", "streamrl.generator.main")) is None
    assert noteworthy(engine_up.replace("streamrl.progress", "streamrl.progressbar")) is None
    assert noteworthy(engine_up.replace(" INFO ", " DEBUG ")) is None


def test_what_the_model_wrote_cannot_act_on_the_terminal():
    """A warning quoting model output (an agent's error) with an ANSI escape, a carriage return
    and a bidi override: each is shown as an escape, never sent raw."""
    line = ("2026-01-01 00:00:00,000 WARNING streamrl.generator.agent_episodes: agent failed: "
            "\x1b]52;c;cm0gLXJmIH4=\x07 done\rok \u202egnp.exe")  # fmt: skip
    shown = noteworthy(line)
    assert shown is not None
    assert not any(c in shown for c in "\x1b\x07\r\u202e")
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07 done\\rok \\u202egnp.exe" in shown
