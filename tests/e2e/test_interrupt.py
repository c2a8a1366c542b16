"""Stopping a run from outside: SIGTERM to `streamrl run`, Ctrl-C (SIGINT) to the demo's command
(whose terminal shows a short header, then step lines) and a terminal's Ctrl-C to `make demo`
(SIGINT to the whole foreground process group). Every process of the run ends (the generator
flushes, the learner stops with its last checkpoint intact), nothing is left running, and the
terminal says how to resume."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from storage.checkpoints.dcp import CheckpointStore
from storage.control.requests import stop_requested
from storage.fs import open_location

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "generator.max_tokens=16",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "learner.checkpoint_every=1",
    "algorithm.dynamic_sampling=false",
    "learner.total_steps=500",  # interrupted long before
]

# Slow (~45 s each: a whole run is started, then stopped); the suite keeps to its 15-minute aim.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _processes_of(run_dir: Path) -> list[str]:
    """Command lines of the live processes that name `run_dir` (the run's components)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run_dir) in argv and state != "Z":
            found.append(f"{entry.name}: {argv}")
    return found


def _alive(processes: list[psutil.Process]) -> list[str]:
    """Those of `processes` still running (a zombie is not), by pid and command line."""
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid}: {' '.join(process.cmdline())}")
    return alive


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt_after_a_checkpoint(
    argv: list[str],
    run_dir: Path,
    sig: int,
    *,
    whole_group: bool = False,
    sigint_ignored: bool = False,
    twice: bool = False,
) -> tuple[int, str]:
    """Start `argv`, wait for the run's first committed checkpoint, send `sig` and return the
    exit code and output, once every process `argv` had started by then has ended.
    `whole_group`: to every process of `argv`'s process group at once, as a terminal's Ctrl-C
    does; otherwise to `argv`'s process alone. `sigint_ignored`: `argv` starts with SIGINT
    ignored, as a shell starts a command in the background. `twice`: `sig` again a moment later,
    as an impatient user presses Ctrl-C twice."""
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=whole_group,  # its own group, standing for the terminal's
        preexec_fn=_ignore_sigint if sigint_ignored else None,
    )
    try:
        run = open_location(str(run_dir))
        deadline = time.monotonic() + 400
        while not (run_dir.exists() and CheckpointStore(run).committed_steps()):
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(1)
        assert _processes_of(run_dir), "the run's components should be running"
        started = psutil.Process(process.pid).children(recursive=True)  # Prefect's server too
        if whole_group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
        if twice:  # while the first one's stop is under way
            time.sleep(0.1)
            process.send_signal(sig)
        output, _ = process.communicate(timeout=200)
        deadline = time.monotonic() + 10
        while (left := _alive(started)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, left
    finally:
        if process.poll() is None:  # no run left behind by a failed test
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            process.kill()
    return process.returncode, output


def _assert_stopped_cleanly(run_dir: Path) -> None:
    deadline = time.monotonic() + 10
    while (left := _processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    run = open_location(str(run_dir))
    store = CheckpointStore(run)
    latest = store.latest_committed()
    assert latest is not None
    assert store.read_state(latest).step == latest
    assert stop_requested(run)  # nothing restarts into a stopped run


def test_sigterm_to_streamrl_run_stops_every_process_and_says_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "streamrl", "run", "--preset", "dapo", "--preset", "tiny-cpu",
            f"storage.run_uri={run_dir}", *TINY]  # fmt: skip
    code, output = _interrupt_after_a_checkpoint(argv, run_dir, signal.SIGTERM)
    assert code == 130, output
    assert "Resume with:" in output
    resume = f"streamrl run --resume --preset dapo --preset tiny-cpu storage.run_uri={run_dir}"
    assert resume in output
    _assert_stopped_cleanly(run_dir)


def test_ctrl_c_twice_still_stops_every_process_and_keeps_the_checkpoint(tmp_path):
    """The second Ctrl-C, while the run stops, gets a notice; it does not cut the stop short
    (which left the learner and generators running, the checkpoint on stop unmade)."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "streamrl", "run", "--preset", "dapo", "--preset", "tiny-cpu",
            f"storage.run_uri={run_dir}", *TINY]  # fmt: skip
    code, output = _interrupt_after_a_checkpoint(argv, run_dir, signal.SIGINT, twice=True)
    assert code == 130, output
    assert "still stopping: every process of the run ends within" in output
    assert "Resume with:" in output
    _assert_stopped_cleanly(run_dir)


def test_ctrl_c_to_the_demo_stops_every_process_and_says_how_to_resume(tmp_path):
    """Pressed twice, as an impatient user does: the second one, reaching the flow while it
    stops the run, does not cut that stop short."""
    run_dir = tmp_path / "demo"
    argv = [sys.executable, "-m", "flows.demo", "--size", "tiny-cpu", "--run-uri", str(run_dir),
            *TINY]  # fmt: skip
    code, output = _interrupt_after_a_checkpoint(argv, run_dir, signal.SIGINT, twice=True)
    assert code == 130, output
    assert "stopping: generators commit what they sampled; the learner finishes" in output
    assert "committed: the run resumes from step" in output  # checkpointed on stop
    assert f"flows.demo --resume --run-uri {run_dir}" in output
    # A quiet terminal: a short header and a few progress lines, then step lines; the chatter
    # is in the log files.
    lines = output.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/500:"))
    assert first_step <= 20, output
    assert "starting Prefect's temporary server" in output
    assert any(re.match(r"\[gen0\] engine up in \d+ s", line) for line in lines), output
    assert "Starting temporary server" in (run_dir / "logs" / "demo.log").read_text()
    assert not [line for line in lines if "| INFO" in line or "Traceback" in line], output
    _assert_stopped_cleanly(run_dir)


def test_ctrl_c_in_the_terminal_of_make_demo_stops_every_process_and_says_how_to_resume(tmp_path):
    """A terminal's Ctrl-C reaches make and the demo's command at once. Were Prefect's
    temporary server in their group, it would stop at once and the flow hang reporting the
    run's end to it; the flow and its server run in a session of their own, which the command
    passes the Ctrl-C on to. Every process ends and the terminal tells how to resume."""
    run_dir = tmp_path / "demo"
    demo_args = shlex.join(["--size", "tiny-cpu", "--run-uri", str(run_dir), *TINY])
    argv = ["make", "--no-print-directory", "demo", "STEPS=500", f"DEMO_ARGS={demo_args}"]
    code, output = _interrupt_after_a_checkpoint(argv, run_dir, signal.SIGINT, whole_group=True)
    assert code == -signal.SIGINT, output  # make dies of the signal, after its child ended
    assert f"flows.demo --resume --run-uri {run_dir}" in output
    assert "Traceback" not in output
    _assert_stopped_cleanly(run_dir)


def test_sigterm_to_the_demo_started_in_the_background_stops_every_process(tmp_path):
    """`make demo &` in a script, then `kill`: the command, started with SIGINT ignored, passes
    SIGTERM on to its flow as Ctrl-C, and the flow stops on it all the same."""
    run_dir = tmp_path / "demo"
    argv = [sys.executable, "-m", "flows.demo", "--size", "tiny-cpu", "--run-uri", str(run_dir),
            *TINY]  # fmt: skip
    code, output = _interrupt_after_a_checkpoint(argv, run_dir, signal.SIGTERM, sigint_ignored=True)
    assert code == 130, output
    assert f"flows.demo --resume --run-uri {run_dir}" in output
    _assert_stopped_cleanly(run_dir)


def test_ctrl_c_to_a_recipe_keeps_its_finished_stage_and_resumes_the_running_one(tmp_path):
    """Ctrl-C during a recipe's RL stage: every process ends, the terminal says how to resume;
    the resume skips the finished warm start (not trained again) and continues the RL stage
    from its checkpoint (no step trained twice), then the recipe finishes."""
    train = tmp_path / "train.jsonl"
    conversations = [[{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": f"\\boxed{{{2 * i}}}"}]
                     for i in range(8)]  # fmt: skip
    train.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    recipe = tmp_path / "tiny-recipe.yaml"
    recipe.write_text(yaml.safe_dump({"overrides": ["logging.wandb_mode=disabled"], "stages": [
        {"name": "warm", "presets": ["tiny-cpu", "sft"],
         "overrides": [f"data.path={train}", "data.val_path=null", "learner.total_steps=2",
                       "learner.warmup_steps=0", "learner.batch_groups=4",
                       "learner.mini_batch_groups=4"]},
        {"name": "rl", "presets": ["dapo", "tiny-cpu"],
         "overrides": [*TINY[:-1], "learner.total_steps=6", "eval.every_versions=0"]},
    ]}))  # fmt: skip
    root = tmp_path / "recipe"
    argv = [sys.executable, "-m", "flows.demo", "--recipe", str(recipe), "--run-uri", str(root)]
    code, output = _interrupt_after_a_checkpoint(argv, root / "rl", signal.SIGINT)
    assert code == 130, output
    resume = f"flows.demo --recipe {recipe} --resume --run-uri {root}"
    assert "finished stages are kept" in output, output
    assert resume in output, output
    _assert_stopped_cleanly(root / "rl")
    warm_steps = (root / "warm" / "metrics" / "learner.jsonl").read_text()
    saved = CheckpointStore(open_location(str(root / "rl"))).latest_committed()

    resumed = subprocess.run([*argv, "--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=500, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (root / "warm" / "metrics" / "learner.jsonl").read_text() == warm_steps
    lines = (root / "rl" / "metrics" / "learner.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"step"' in line]
    assert steps[-1] == 6
    assert f"step {saved + 1}/6:" in resumed.stdout, resumed.stdout  # from its checkpoint on
    assert "step 1/6:" not in resumed.stdout, resumed.stdout
