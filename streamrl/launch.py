"""Starting and supervising a run's processes: the one supervision core of `streamrl run`,
the `streamrl` Prefect flow and `make demo`.

A run is a learner (one process, or a torchrun job of `learner.nproc_per_node` ranks), N
generators and, when `eval.every_versions` > 0, an evaluator: each a `streamrl` subprocess of
this Python interpreter, sharing nothing but the run's storage.

Opening a run (`prepare_run`, `open_existing_run`, `load_run_config`) lives in
`streamrl.runs`, which the components import; nothing but supervisors imports this module.

- `learner_command`, `generator_command`, `evaluator_command`: their argv.
- `run_process`: run one to its exit, each output line to a callback; SIGTERM when asked to
  stop, SIGKILL after a grace period; SIGTERM too if the supervisor dies (however it dies); on
  the cores and with the environment of its `ProcessPlacement` (`streamrl.placement`).
- `Supervisor`: one run's processes from one placement plan (stored as
  `<run>/control/placement.json`): `keep_running(component)` runs one to its end, restarting it
  after a crash (the learner resumes from its checkpoint, a generator continues its prompts)
  until its restarts are spent; the learner's success lets the others finish; a component that
  failed for good, Ctrl-C or SIGTERM stops everything (`abort`). Each output line goes to the
  component's log file (`ComponentLogs`); `noteworthy(line)` picks what a terminal shows.
  `run()` supervises on threads (`streamrl run`); the flow runs `keep_running` as Prefect tasks.
- `claim_generator_index`: the next free generator index of a run, for generators that join
  later (scaling out).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from storage.control import request_stop, stop_requested
from storage.fs import Location, put_if_absent
from streamrl.config import RunConfig
from streamrl.placement import (
    PLACED_VARIABLES,
    PlacementPlan,
    ProcessPlacement,
    place_joining_generator,
    plan_placement,
    write_placement,
)
from streamrl.processes import die_with_parent
from streamrl.runs import open_run_location

__all__ = [
    "Component",
    "ComponentFailedError",
    "ComponentLogs",
    "RunInterruptedError",
    "Supervisor",
    "claim_generator_index",
    "evaluator_command",
    "format_summary",
    "generator_command",
    "learner_command",
    "noteworthy",
    "reserve_generator_indexes",
    "run_process",
    "run_summary",
]

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
FINISH_GRACE_S = 180.0  # generators flush, the evaluator scores the last version


class ComponentFailedError(RuntimeError):
    """A learner, generator or evaluator process failed for good; the message says which,
    how it exited and the last lines it printed."""


class RunInterruptedError(RuntimeError):
    """The run was stopped from outside (Ctrl-C, SIGTERM) and every process of it has ended."""


def _python() -> list[str]:
    return [sys.executable, "-m", "streamrl"]


def learner_command(config: RunConfig) -> list[str]:
    """The learner: `streamrl learner`, under torchrun when it has several ranks."""
    nproc = config.learner.nproc_per_node
    if nproc == 1:
        return [*_python(), "learner", "--run", config.storage.run_uri]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "streamrl",
        "learner",
        "--run",
        config.storage.run_uri,
    ]


def generator_command(config: RunConfig, index: int) -> list[str]:
    return [*_python(), "generator", "--run", config.storage.run_uri, "--index", str(index)]


def evaluator_command(config: RunConfig) -> list[str]:
    return [*_python(), "eval", "--run", config.storage.run_uri, "--follow"]


def run_process(
    argv: Sequence[str],
    on_line: Callable[[str], None],
    stop: threading.Event | None = None,
    *,
    env: dict[str, str] | None = None,
    placement: ProcessPlacement | None = None,
    grace_s: float = STOP_GRACE_S,
) -> int:
    """Run `argv` to its exit and return its exit code; each line it prints (stdout and
    stderr) goes to `on_line`. When `stop` is set: SIGTERM, then SIGKILL after `grace_s`.

    With `placement` the process starts on its cores (CPU affinity, inherited by every thread
    and child it creates) with its environment (`ProcessPlacement.env()`); `env` wins over
    both the supervisor's environment and the placement's. The process gets SIGTERM when the
    calling thread's process dies; call it from a thread that waits for it (it does)."""
    inherited, supervisor = dict(os.environ), os.getpid()
    planned: dict[str, str] = {}
    cpus = None
    if placement is not None:  # the plan decides its variables: none leaks from ours
        inherited = {k: v for k, v in inherited.items() if k not in PLACED_VARIABLES}
        planned, cpus = placement.env(), placement.cpus
    process = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**inherited, "PYTHONUNBUFFERED": "1", **planned, **(env or {})},
        start_new_session=True,  # a Ctrl-C in the terminal reaches us, and we stop it cleanly
        # Only system calls between fork and exec: safe with the supervisor's threads.
        preexec_fn=lambda: _in_child(supervisor, cpus),
    )
    stop = stop or threading.Event()
    watcher = threading.Thread(
        target=_stop_when_set, args=(process, stop, grace_s), daemon=True, name="stop-watcher"
    )
    reader = threading.Thread(
        target=_forward_lines, args=(process, on_line), daemon=True, name="output-reader"
    )
    watcher.start()
    reader.start()
    code = process.wait()
    # Its helpers (a reward worker pool, torchrun's ranks) may outlive it and hold the output
    # pipe open: a component's process group ends with it.
    _signal_group(process, signal.SIGKILL)
    reader.join(timeout=10)
    watcher.join()
    return code


def _in_child(supervisor: int, cpus: tuple[int, ...] | None) -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (its thread that started us
    waits for us, so it ends only with the supervisor); the planned cores."""
    die_with_parent(supervisor, signal.SIGTERM)
    if cpus:
        os.sched_setaffinity(0, cpus)


def _forward_lines(process: subprocess.Popen[str], on_line: Callable[[str], None]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        on_line(line.rstrip("\n"))


def _stop_when_set(process: subprocess.Popen[str], stop: threading.Event, grace_s: float) -> None:
    """Until the process exits: when `stop` is set, SIGTERM, then SIGKILL after `grace_s`."""
    while not stop.wait(0.2):
        if process.poll() is not None:
            return
    if process.poll() is not None:
        return
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[str], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)  # torchrun's ranks and vLLM's helpers too


def reserve_generator_indexes(run: Location, count: int, owner: str = "") -> None:
    """Mark indexes 0..count−1 as taken (the run's own generators); existing marks stay."""
    folder = run.child("control", "generators")
    for index in range(count):
        record = json.dumps({"index": index, "owner": owner, "at": time.time()}).encode()
        put_if_absent(folder.fs, folder.join(f"{index}.json"), record)


def claim_generator_index(run: Location, *, first: int = 0, owner: str = "") -> int:
    """Claim the lowest free generator index ≥ `first` for a generator joining `run`: an
    object `<run>/control/generators/<index>.json` created if absent, so two generators
    joining at once never get the same index. Claims are never released (an index names a
    writer whose segments are in the stream)."""
    folder = run.child("control", "generators")
    taken = set()
    if folder.fs.exists(folder.path):
        taken = {
            int(name.rsplit("/", 1)[-1].removesuffix(".json"))
            for name in folder.fs.ls(folder.path, detail=False)
            if name.endswith(".json")
        }
    index = first
    while True:
        if index not in taken:
            record = json.dumps({"index": index, "owner": owner, "at": time.time()}).encode()
            if put_if_absent(folder.fs, folder.join(f"{index}.json"), record):
                return index
        index += 1


# -- the supervision core ---------------------------------------------------------------------

# What a user's terminal shows of a component's output: the learner's step lines, streamrl's
# warnings and errors (as logged by `streamrl.cli`: "<date> <time> LEVEL logger: message"). The
# rest (engine start-up, progress bars, third-party warnings) goes to the log files only.
_OWN_LINE = re.compile(
    r"^\S+ \S+ (?P<level>INFO|WARNING|ERROR|CRITICAL) (?:streamrl|storage|flows)\.\S+: "
    r"(?P<message>.*)$"
)
_STEP = re.compile(r"^step \d+(/\d+)?:")


def noteworthy(line: str) -> str | None:
    """What a terminal shows of a component's output `line`: the learner's step line or one of
    streamrl's warnings or errors, without the timestamp and logger; None for the rest."""
    own = _OWN_LINE.match(line)
    if own is None:
        return None
    level, message = own["level"], own["message"]
    if level == "INFO":
        return message if _STEP.match(message) else None
    return f"{level}: {message}"


class ComponentLogs:
    """Each component's output, appended line by line to `<folder>/<component>.log`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run: Location) -> ComponentLogs:
        """`<run>/logs/` for a run on local disk, else `./streamrl-logs/<run name>/`."""
        if run.is_local:
            return cls(Path(run.path) / "logs")
        return cls(Path("streamrl-logs") / run.path.rstrip("/").rsplit("/", 1)[-1])

    def write(self, component: str, line: str) -> None:
        with self._lock:
            if component not in self._files:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._files[component] = open(  # noqa: SIM115 (closed by close())
                    self.folder / f"{component}.log", "a", buffering=1
                )
            self._files[component].write(line + "\n")

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()


@dataclass
class Component:
    """One process of the run and its history under supervision."""

    name: str  # learner, gen<i>, eval
    argv: list[str]
    restarts_allowed: int
    placement: ProcessPlacement | None = None
    restarts: int = 0
    exit_code: int | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))


class Supervisor:
    """The supervision core: a run's processes on this machine and their restarts.

    `Supervisor.for_run(config, generators=N)`: the learner, N generators and (when configured)
    the evaluator, each started from a placement plan (default: `plan_placement` for this
    machine). `Supervisor.for_joining_generator(config, index)`: one more generator for a run
    supervised elsewhere.

    `prepare()` stores the plan (`<run>/control/placement.json`) and reserves the generator
    indexes; then each component runs under `keep_running` — on threads (`run()`, for
    `streamrl run`) or as Prefect tasks (the `streamrl` and `generator` flows). Every output
    line goes to the component's log file, then to `on_line(component, line)`. When the learner
    finishes, the others get `FINISH_GRACE_S` to flush; when a component fails for good, or on
    `abort`, everything is stopped: the run's stop marker first when this supervisor owns the
    run (so nothing restarts into it), then SIGTERM, SIGKILL after `STOP_GRACE_S`."""

    def __init__(
        self,
        config: RunConfig,
        components: list[Component],
        *,
        plan: PlacementPlan | None = None,
        owns_run: bool = True,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "streamrl run",
    ) -> None:
        self.config = config
        self.components = components
        self.plan = plan
        self.owns_run = owns_run
        self.run_location = open_run_location(config)
        self.logs = ComponentLogs.for_run(self.run_location)
        self.on_line = on_line
        self.owner = owner
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.interrupted: str | None = None

    @classmethod
    def for_run(
        cls,
        config: RunConfig,
        *,
        generators: int,
        placement: PlacementPlan | None = None,
        evaluator: bool = True,
        max_restarts: int = 3,
        learner_restarts: int = 1,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "streamrl run",
    ) -> Supervisor:
        """The whole run: `max_restarts` restarts for each generator, `learner_restarts` for
        the learner (it resumes from its checkpoint), one for the evaluator."""
        plan = placement or plan_placement(config, generators=generators, evaluator=evaluator)
        components = [
            Component("learner", learner_command(config), learner_restarts, plan.learner),
            *(
                Component(f"gen{i}", generator_command(config, i), max_restarts, placed)
                for i, placed in enumerate(plan.generators)
            ),
        ]
        if plan.evaluator is not None:
            components.append(Component("eval", evaluator_command(config), 1, plan.evaluator))
        return cls(config, components, plan=plan, on_line=on_line, owner=owner)

    @classmethod
    def for_joining_generator(
        cls,
        config: RunConfig,
        index: int,
        *,
        max_restarts: int = 3,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "",
    ) -> Supervisor:
        """Generator `index` joining a run supervised elsewhere, on this whole machine
        (`place_joining_generator`). Its failure stops only itself."""
        placement = place_joining_generator(config, index)
        component = Component(
            f"gen{index}", generator_command(config, index), max_restarts, placement
        )
        return cls(config, [component], owns_run=False, on_line=on_line, owner=owner)

    def prepare(self) -> None:
        """Store the plan and reserve the generator indexes (before starting anything)."""
        if self.plan is not None:
            write_placement(self.run_location, self.plan)
            reserve_generator_indexes(self.run_location, len(self.plan.generators), self.owner)

    def keep_running(
        self, component: Component, on_line: Callable[[str], None] | None = None
    ) -> None:
        """Run `component` until it exits 0 or the run stops, restarting it after a crash
        while its restarts last. Each line goes to its log file, then to `on_line` (default:
        the supervisor's). Raises `ComponentFailedError` (after stopping the run) when it failed
        for good."""
        show = on_line or (lambda line: self.on_line(component.name, line))

        def line(text: str) -> None:
            component.tail.append(text)
            self.logs.write(component.name, text)
            show(text)

        while not self.stop.is_set():
            component.exit_code = run_process(
                component.argv, line, self.stop, placement=component.placement
            )
            if component.exit_code == 0 or self.stop.is_set():
                if component.name == "learner" and component.exit_code == 0:
                    self._finish()
                return
            if component.restarts >= component.restarts_allowed:
                tail = "\n    ".join(list(component.tail)[-10:])
                failure = (
                    f"{component.name} failed for good (exit code {component.exit_code} after "
                    f"{component.restarts} restarts); its last lines:\n    {tail}"
                )
                self.failures.append(failure)
                self.abort(f"{component.name} failed")
                raise ComponentFailedError(failure)
            component.restarts += 1
            show(
                f"exited with code {component.exit_code}; restart {component.restarts} of "
                f"{component.restarts_allowed} (log: {self.logs.folder / component.name}.log)"
            )

    def run(self) -> dict[str, Any]:
        """`streamrl run`: every component on a thread of this process until the learner is
        done. Ctrl-C or SIGTERM stops the run (`RunInterruptedError` once every process has
        ended); a component that failed for good raises `ComponentFailedError`. Returns each
        component's exit code and restarts."""
        self.prepare()
        threads = [
            threading.Thread(target=self._keep_running_quietly, args=(c,), name=c.name)
            for c in self.components
        ]
        with _sigterm_as_interrupt():
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    while thread.is_alive():
                        thread.join(timeout=0.5)
            except KeyboardInterrupt:
                self.abort("interrupted (Ctrl-C or SIGTERM)", interrupted=True)
                for thread in threads:
                    thread.join()
        self.logs.close()
        if self.failures:
            raise ComponentFailedError("; ".join(self.failures))
        if self.interrupted:
            raise RunInterruptedError(self.interrupted)
        return self.result()

    def result(self) -> dict[str, Any]:
        return {c.name: {"exit_code": c.exit_code, "restarts": c.restarts} for c in self.components}

    def _keep_running_quietly(self, component: Component) -> None:
        with contextlib.suppress(ComponentFailedError):  # recorded in self.failures
            self.keep_running(component)

    def _finish(self) -> None:
        """The learner is done and has set the stop marker: the generators flush and exit, the
        evaluator scores the last version; whatever still runs after a grace period is stopped."""
        deadline = threading.Timer(FINISH_GRACE_S, self.stop.set)
        deadline.daemon = True  # never keeps the supervisor alive once everything exited
        deadline.start()

    def abort(self, reason: str, *, interrupted: bool = False) -> None:
        """Stop everything now: the stop marker (so nothing restarts into the run), then
        SIGTERM to every process (SIGKILL after `STOP_GRACE_S`). `interrupted`: stopped from
        outside (Ctrl-C, SIGTERM), not by a failure."""
        if interrupted and self.interrupted is None:
            self.interrupted = reason
        try:
            if self.owns_run and not stop_requested(self.run_location):
                request_stop(self.run_location, reason)
        except OSError as exc:  # storage unreachable: the processes are stopped all the same
            log.warning("could not write the run's stop marker: %r", exc)
        self.stop.set()


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM to the supervisor stops the run as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- summaries -------------------------------------------------------------------------------


def run_summary(run: Location, window: int = 5) -> dict[str, Any]:
    """What a finished (or running) run achieved, from its learner metrics: reward and
    accuracy over the first and the last `window` steps, mean learner tokens/s, steps done."""
    from streamrl.learner.reporting import read_metrics

    steps = [m for m in read_metrics(run) if "value_pretrain_step" not in m]
    if not steps:
        return {"run_uri": run.uri, "steps": 0}

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        values = [float(r[key]) for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    first, last = steps[:window], steps[-window:]
    return {
        "run_uri": run.uri,
        "steps": int(steps[-1]["step"]),
        "policy_version": int(steps[-1].get("policy_version", 0)),
        "reward_first": mean(first, "rollout/reward_mean"),
        "reward_last": mean(last, "rollout/reward_mean"),
        "acc_first": mean(first, "rollout/acc"),
        "acc_last": mean(last, "rollout/acc"),
        "learner_tokens_per_s": mean(steps, "perf/learner_tokens_per_s"),
        "window": min(window, len(steps)),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few lines for the console."""
    if not summary.get("steps"):
        return f"run {summary['run_uri']}: no learner steps yet"
    n = summary["window"]
    return "\n".join(
        [
            f"run:       {summary['run_uri']}  ({summary['steps']} steps, weights "
            f"v{summary['policy_version']})",
            f"reward:    {summary['reward_first']:+.3f} (first {n} steps) → "
            f"{summary['reward_last']:+.3f} (last {n})",
            f"accuracy:  {summary['acc_first']:.3f} → {summary['acc_last']:.3f}",
            f"learner:   {summary['learner_tokens_per_s']:.0f} tokens/s",
        ]
    )
