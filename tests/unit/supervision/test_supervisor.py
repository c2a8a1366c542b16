"""The supervision core (`streamrl.supervision.supervisor.Supervisor`) with stand-in processes:
restarts, a component failing for good stops the others, the terminal's share of the output, and no
process outliving a killed supervisor."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from storage.control.requests import stop_requested
from streamrl.config.loading import load_config
from streamrl.isolation.lifetime import dying_with_parent
from streamrl.supervision import supervisor as core
from streamrl.supervision.output import noteworthy
from streamrl.supervision.signals import stopping_despite_interrupts
from streamrl.supervision.supervisor import ComponentFailedError, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]
# A stand-in generator: it flushes and exits 0 on SIGTERM, as a real one does.
FLUSHER = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
           "lambda *_: exit(0)); print('ready', flush=True); time.sleep(300)"]  # fmt: skip


def _until_stop_marker(run: Path, first: str = "") -> str:
    """Code for a stand-in generator that, after `first`, flushes and exits 0 once the run's
    stop marker is written (a completed learner writes it), as a real one does, rather than
    running into the finishing grace."""
    return (
        f"{first}\nimport time\nfrom storage.fs import open_location\n"
        "from storage.control.requests import stop_requested\n"
        f"while not stop_requested(open_location({str(run)!r})): time.sleep(0.2)"
    )


def _completing(run: Path) -> str:
    """Code for a stand-in learner that completes as a real one does: it writes the stop marker."""
    return (
        "from storage.fs import open_location; from storage.control.requests import request_stop\n"
        f"request_stop(open_location({str(run)!r}), 'stand-in learner completed')"
    )


def _config(tmp_path: Path):
    return load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={tmp_path / 'run'}"])


def test_a_generator_failing_for_good_stops_the_run_with_its_last_lines(tmp_path, monkeypatch):
    failing = [sys.executable, "-c", "import sys; print('reward exploded'); sys.exit(1)"]
    taken_over: list[bool] = []

    def generator(config, index, *, take_over=False):
        taken_over.append(take_over)
        return failing

    monkeypatch.setattr(core, "learner_command", lambda config, node=None, **kw: SLEEPER)
    monkeypatch.setattr(core, "generator_command", generator)
    shown: list[tuple[str, str]] = []
    supervisor = Supervisor.for_run(
        _config(tmp_path),
        generators=1,
        max_restarts=2,
        on_line=lambda c, text: shown.append((c, text)),
    )
    started = time.monotonic()
    with pytest.raises(ComponentFailedError, match=r"gen0 failed for good \(exit code 1 after 2"):
        supervisor.run()
    assert time.monotonic() - started < 60  # the learner was stopped, not waited for
    result = supervisor.result()
    assert result["gen0"] == {"exit_code": 1, "restarts": 2}
    assert taken_over == [False, True, True]  # a restart takes the crashed one's index over
    assert result["learner"]["exit_code"] == -signal.SIGTERM
    assert stop_requested(supervisor.run_location)
    assert sum(line.startswith("exited with code 1; restart") for _, line in shown) == 2
    log = (tmp_path / "run" / "logs" / "gen0.log").read_text()
    assert log.count("reward exploded") == 3  # every attempt's output, in its log file


def test_a_restarted_learner_takes_the_run_over_and_its_success_ends_the_run(tmp_path, monkeypatch):
    started: list[bool] = []

    run = tmp_path / "run"

    def learner(config, node=None, *, take_over=False):
        started.append(take_over)  # the first attempt crashes, the restart completes
        return [sys.executable, "-c", _completing(run) if take_over else "import sys; sys.exit(1)"]

    generator = [sys.executable, "-c", _until_stop_marker(run)]
    monkeypatch.setattr(core, "learner_command", learner)
    monkeypatch.setattr(core, "generator_command", lambda config, index, **kw: generator)
    supervisor = Supervisor.for_run(_config(tmp_path), generators=1, evaluator=False)
    result = supervisor.run()
    assert started == [False, True]  # only a restart takes the lease over
    assert result == {
        "learner": {"exit_code": 0, "restarts": 1},
        "gen0": {"exit_code": 0, "restarts": 0},
    }


def test_the_terminal_shows_step_lines_and_streamrls_warnings_only():
    step = "2026-11-23 10:00:01,123 INFO streamrl.learner.reporting: step 3/16: reward 0.5"
    warning = "2026-11-23 10:00:01,123 WARNING storage.stream.reader: storage failed: retrying"
    assert noteworthy(step) == "step 3/16: reward 0.5"
    assert noteworthy(warning) == "WARNING: storage failed: retrying"
    restart = "exited with code 3; restart 1 of 3 (log: runs/x/logs/gen0.log)"
    assert noteworthy(restart) == f"WARNING: {restart}"
    for chatter in (
        "2026-11-23 10:00:01,123 INFO streamrl.generator.loop: generator gen0 generating",
        "INFO 11-23 10:00:01 [core.py:71] Initializing a V1 LLM engine",
        "WARNING 11-23 10:00:01 [config.py:12] some vLLM warning",
        "  warnings.warn(  # a FutureWarning from a library",
    ):
        assert noteworthy(chatter) is None, chatter


def test_a_killed_supervisor_takes_its_processes_with_it(tmp_path):
    """SIGKILL runs no cleanup in the supervisor: the kernel sends its component SIGTERM."""
    pid_file = tmp_path / "child.pid"
    child = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    )
    supervisor = (
        "import sys; from streamrl.supervision.launch import run_process; "
        f"run_process([sys.executable, '-c', {child!r}], print)"
    )
    process = subprocess.Popen([sys.executable, "-c", supervisor])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the component outlived its supervisor"
        time.sleep(0.1)


def test_components_start_with_no_python_between_fork_and_exec(monkeypatch, tmp_path):
    """A preexec_fn runs Python in the forked child of a threaded supervisor, which can crash
    on state another thread left mid-change (a SIGSEGV seen in CI); the exec wrapper does the
    same work in a fresh interpreter."""
    import streamrl.supervision.launch

    started: list[dict] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(kwargs)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(streamrl.supervision.launch.subprocess, "Popen", popen)
    lines: list[str] = []
    program = [sys.executable, "-c", "print('ran')"]
    code = streamrl.supervision.launch.run_process(program, lines.append)
    assert (code, lines) == (0, ["ran"])
    assert [kwargs.get("preexec_fn") for kwargs in started] == [None]
    # The wrapper refuses to run a program whose parent is already gone.
    marker = tmp_path / "ran"
    orphan = subprocess.run(
        dying_with_parent([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], parent_pid=1),
        timeout=60,
    )
    assert orphan.returncode == 1
    assert not marker.exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "refused",
    [
        "print('error: another learner holds run x'); import sys; sys.exit(3)",
        # under torchrun the exit code is lost; the learner's line says it
        'print("error: another learner holds the run\'s lease: ..."); import sys; sys.exit(1)',
    ],
)
def test_a_learner_displaced_by_another_learner_ends_the_run_without_a_take_over(
    tmp_path, monkeypatch, refused
):
    started: list[bool] = []

    def learner(config, node=None, *, take_over=False):
        started.append(take_over)
        return [sys.executable, "-c", refused]

    monkeypatch.setattr(core, "learner_command", learner)
    monkeypatch.setattr(core, "generator_command", lambda config, index, **kw: SLEEPER)
    supervisor = Supervisor.for_run(_config(tmp_path), generators=1, evaluator=False)
    with pytest.raises(ComponentFailedError, match="another learner holds the run's lease"):
        supervisor.run()
    assert started == [False]  # never restarted: a take-over would displace the holder
    assert supervisor.result()["gen0"]["exit_code"] == -signal.SIGTERM


def test_an_unreachable_store_does_not_keep_the_run_from_stopping(tmp_path, monkeypatch):
    """Writing the stop marker fails with the S3 client's own error (not an OSError): the
    processes are stopped all the same."""
    from botocore.exceptions import EndpointConnectionError

    def unreachable(*args, **kwargs):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    failing = [sys.executable, "-c", "import sys; sys.exit(1)"]
    monkeypatch.setattr(core, "learner_command", lambda config, node=None, **kw: SLEEPER)
    monkeypatch.setattr(core, "generator_command", lambda config, index, **kw: failing)
    monkeypatch.setattr(core, "request_stop", unreachable)
    supervisor = Supervisor.for_run(_config(tmp_path), generators=1, max_restarts=0)
    started = time.monotonic()
    with pytest.raises(ComponentFailedError, match="gen0 failed for good"):
        supervisor.run()
    assert time.monotonic() - started < 60
    assert supervisor.result()["learner"]["exit_code"] == -signal.SIGTERM


def test_a_further_interrupt_while_stopping_is_answered_with_a_notice_not_an_exception(caplog):
    """An impatient second Ctrl-C (or SIGTERM) during a stop must not cut it short: inside
    `stopping_despite_interrupts` it logs a notice; outside, Ctrl-C interrupts again."""
    logger = "streamrl.supervision.supervisor"
    # A background job starts with Ctrl-C ignored: the test sets Python's own handler first.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with caplog.at_level("WARNING", logger=logger), stopping_despite_interrupts(25.0):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handlers run here; nothing is raised
        notices = [r.getMessage() for r in caplog.records]
        assert len(notices) == 2
        assert notices[0].startswith("still stopping: every process of the run ends within")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, inherited)


# A stand-in learner: on SIGTERM it takes a while (its step, its checkpoint), writes down that it
# finished, says so as a learner does, and exits as a stopped learner does.
SLOW_STOPPER = """
import pathlib, signal, sys, time
done = pathlib.Path(sys.argv[1])
stopped = []
signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
print("ready", flush=True)
while not stopped:
    time.sleep(0.05)
time.sleep(3)
done.write_text("checkpointed")
print("learner stopped from outside: stopped after step 2", flush=True)
sys.exit(143)
"""


def test_sigterm_to_the_supervisor_waits_for_the_learner_to_finish_its_stop(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised into `Thread.join` marked the learner's thread as ended
    (CPython 3.11): the supervisor said the run had stopped while the learner still ran, and
    the learner, its output pipe gone, died before its checkpoint."""
    done = tmp_path / "done"
    learner = [sys.executable, "-c", SLOW_STOPPER, str(done)]
    monkeypatch.setattr(core, "learner_command", lambda config, node=None, **kw: learner)
    monkeypatch.setattr(core, "generator_command", lambda config, index, **kw: SLEEPER)
    shown: list[str] = []
    supervisor = Supervisor.for_run(
        _config(tmp_path), generators=1, evaluator=False,
        on_line=lambda c, text: shown.append(f"{c}: {text}"),
    )  # fmt: skip

    def signal_once_ready() -> None:
        while "learner: ready" not in shown:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_ready, daemon=True).start()
    with pytest.raises(core.RunInterruptedError, match=r"interrupted \(SIGTERM\)"):
        supervisor.run()
    assert done.read_text() == "checkpointed"  # it was waited for
    assert supervisor.result()["learner"]["exit_code"] == 143
    assert "learner: learner stopped from outside: stopped after step 2" in shown


def test_a_learner_stopped_from_outside_stops_the_run_instead_of_restarting(tmp_path, monkeypatch):
    """SIGTERM to the learner alone (a user's `kill`): it checkpoints and stops, and so does
    the run — a restart would undo the stop someone asked for."""
    done = tmp_path / "done"
    starts: list[bool] = []

    def learner(config, node=None, *, take_over=False):
        starts.append(take_over)
        return [sys.executable, "-c", SLOW_STOPPER, str(done)]

    monkeypatch.setattr(core, "learner_command", learner)
    monkeypatch.setattr(core, "generator_command", lambda config, index, **kw: SLEEPER)
    supervisor = Supervisor.for_run(_config(tmp_path), generators=1, evaluator=False)

    def signal_the_learner() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if SLOW_STOPPER in child.cmdline():
                        time.sleep(1)  # its handler installed
                        child.send_signal(signal.SIGTERM)
                        return
            time.sleep(0.1)

    threading.Thread(target=signal_the_learner, daemon=True).start()
    with pytest.raises(core.RunInterruptedError, match="the learner was stopped from outside"):
        supervisor.run()
    assert starts == [False]  # not restarted
    assert done.read_text() == "checkpointed"
    assert stop_requested(supervisor.run_location)  # the generators were stopped too


# A stand-in generator that beats its heartbeat from its loop, as `streamrl generator` does.
BEATING = """
import sys, time
from storage.control.heartbeat import Heart
from storage.fs import open_location
heart = Heart(open_location(sys.argv[1]), sys.argv[2], every_s=0.2)
print("beating", flush=True)
while True:
    heart.beat("generating")
    time.sleep(0.1)
"""


def test_a_stopped_generator_is_noticed_ended_and_restarted_with_the_reason(tmp_path, monkeypatch):
    """SIGSTOP: the process neither exits nor fails, it only stops beating. Past
    `placement.liveness_timeout_s` it is ended (SIGCONT, SIGTERM, SIGKILL) and restarted,
    counted against its restart budget, the reason in the notice."""
    run_uri = str(tmp_path / "run")
    starts: list[bool] = []

    def generator(config, index, *, take_over=False):
        starts.append(take_over)
        return [sys.executable, "-c", BEATING, run_uri, f"gen{index}"]

    learner = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(core, "learner_command", lambda config, node=None, **kw: learner)
    monkeypatch.setattr(core, "generator_command", generator)
    config = load_config(["dapo", "tiny-cpu"], overrides=[
        f"storage.run_uri={run_uri}", "placement.liveness_timeout_s=3",
        "placement.learner_liveness_timeout_s=600",
    ])  # fmt: skip
    shown: list[str] = []
    supervisor = Supervisor.for_run(
        config, generators=1, evaluator=False, on_line=lambda c, text: shown.append(f"{c}: {text}")
    )

    def stop_gen0_then_the_run() -> None:
        while "gen0: beating" not in shown:
            time.sleep(0.1)
        time.sleep(1)
        gen0 = next(p for p in psutil.Process().children(recursive=True)
                    if BEATING in p.cmdline())  # fmt: skip
        gen0.suspend()  # SIGSTOP
        deadline = time.monotonic() + 60
        while shown.count("gen0: beating") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_gen0_then_the_run, daemon=True).start()
    with pytest.raises(core.RunInterruptedError):
        supervisor.run()
    assert starts == [False, True]  # restarted, taking its index over
    restarted = [line for line in shown if "restart 1 of 3" in line]
    assert len(restarted) == 1, shown
    assert "hung: no heartbeat for" in restarted[0]
    assert supervisor.result()["gen0"]["hung"] == 1


def test_a_generator_stopped_alone_from_outside_is_restarted(tmp_path, monkeypatch):
    """SIGTERM to a generator alone: it flushes and exits 0, but nothing asked the run or it to
    stop — the learner would starve. It is restarted (its index taken over)."""
    starts: list[bool] = []

    def generator(config, index, *, take_over=False):
        starts.append(take_over)
        return FLUSHER

    monkeypatch.setattr(core, "learner_command", lambda config, node=None, **kw: SLEEPER)
    monkeypatch.setattr(core, "generator_command", generator)
    shown: list[str] = []
    supervisor = Supervisor.for_run(
        _config(tmp_path), generators=1, evaluator=False,
        on_line=lambda c, text: shown.append(f"{c}: {text}"),
    )  # fmt: skip

    def stop_gen0_then_the_run() -> None:
        deadline = time.monotonic() + 120  # a generator starts at background priority
        while time.monotonic() < deadline and len(starts) < 2:
            if "gen0: ready" in shown:  # its handler installed
                for child in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if FLUSHER[-1] in child.cmdline() and len(starts) == 1:
                            child.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_gen0_then_the_run, daemon=True).start()
    with pytest.raises(core.RunInterruptedError):
        supervisor.run()
    assert starts == [False, True]
    assert any("stopped from outside with no stop marker" in line for line in shown) or any(
        "exited with code 0; restart 1 of 3" in line for line in shown
    ), shown


def test_a_learner_sharing_a_gpu_starts_once_the_generators_engine_is_up(tmp_path, monkeypatch):
    """On a GPU it shares, the learner waits for the generator's first heartbeat (its engine
    sized its KV cache from the free memory): stand-ins on a fake GPU, the generator beating
    after a few seconds, the learner noting when it starts."""
    from streamrl.placement import plan_placement
    from streamrl.placement.gpu_memory import GIB, ModelShape

    run = tmp_path / "run"
    beat_at, learner_at = tmp_path / "beat_at", tmp_path / "learner_at"
    generator = [sys.executable, "-c", _until_stop_marker(run, (
        "import time, signal; signal.signal(signal.SIGTERM, lambda *_: exit(0)); time.sleep(3)\n"
        "from storage.fs import open_location; from storage.control.heartbeat import Heart\n"
        f"Heart(open_location({str(run)!r}), 'gen0').beat('generating')\n"
        f"open({str(beat_at)!r}, 'w').write(repr(time.time()))"
    ))]  # fmt: skip
    learner = [
        sys.executable,
        "-c",
        f"import time; open({str(learner_at)!r}, 'w').write(repr(time.time()))\n{_completing(run)}",
    ]
    monkeypatch.setattr(core, "learner_command", lambda config, node=None, **kw: learner)
    monkeypatch.setattr(core, "generator_command", lambda config, index, **kw: generator)
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[f"storage.run_uri={run}", "learner.device=cuda", "generator.device=cuda"],
    )
    shape = ModelShape(parameters=10**6, hidden_size=64, layers=2, vocab_size=1000,
                       kv_bytes_per_token=512)  # fmt: skip
    plan = plan_placement(config, generators=1, evaluator=False, gpus=["0"],
                          gpu_memory={"0": 80 * GIB}, model=shape)  # fmt: skip
    assert plan.learner.gpus == plan.generators[0].gpus == ("0",)
    shown: list[str] = []
    supervisor = Supervisor.for_run(
        config, generators=1, placement=plan, on_line=lambda c, text: shown.append(f"{c}: {text}")
    )
    supervisor.run()
    assert float(learner_at.read_text()) >= float(beat_at.read_text())
    assert "learner: waiting for gen0 to start its engine on the GPU it shares" in shown
