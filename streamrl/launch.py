"""Starting and supervising a run's processes on one machine.

A run is a learner (one process, or a torchrun job of `learner.nproc_per_node` ranks), N
generators and, when `eval.every_versions` > 0, an evaluator: each a `streamrl` subprocess of
this Python interpreter, sharing nothing but the run's storage.

- `prepare_run`: create `run.json`, or check it on resume (incompatible fields listed);
  `load_run_config`: the configuration every process of the run uses.
- `learner_command`, `generator_command`, `evaluator_command`: their argv.
- `run_process`: run one to its exit, each output line to a callback; SIGTERM when asked to
  stop, SIGKILL after a grace period.
- `claim_generator_index`: the next free generator index of a run, for generators that join
  later (scaling out).
- `LocalRun`: `streamrl run` — the whole run without Prefect: restarts a crashed generator
  (up to `max_restarts`), stops the generators when the learner finishes, and fails (stopping
  everything) when a component fails for good. The Prefect flows (`flows/`) do the same with
  tasks and retries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.control import clear_stop, request_stop, stop_requested
from storage.fs import Location, StorageError, open_location, put_if_absent
from storage.manifest import create_run, open_run
from streamrl.config import RunConfig, validate_config

__all__ = [
    "ComponentFailedError",
    "LocalRun",
    "claim_generator_index",
    "evaluator_command",
    "format_summary",
    "generator_command",
    "learner_command",
    "load_run_config",
    "open_existing_run",
    "open_run_location",
    "prepare_run",
    "reserve_generator_indexes",
    "run_process",
    "run_summary",
    "stop_on_sigterm",
]

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0
FINISH_GRACE_S = 180.0  # generators flush, the evaluator scores the last version
CURRENT_CONFIG = ("control", "config.json")


class ComponentFailedError(RuntimeError):
    """A learner, generator or evaluator process failed for good; the message says which,
    how it exited and the last lines it printed."""


def open_run_location(config: RunConfig) -> Location:
    """The run's root, with the storage endpoint and options of its configuration."""
    storage = config.storage
    return open_location(
        storage.run_uri,
        endpoint_url=storage.endpoint_url,
        storage_options=storage.storage_options,
    )


def prepare_run(config: RunConfig, *, resume: bool = False) -> tuple[RunConfig, Location]:
    """Create the run at `config.storage.run_uri`, or (with `resume`) reopen it.

    Resuming checks `config` against the stored one (only resume-safe fields may differ, such
    as `learner.total_steps` to extend a run; see `storage.manifest.open_run`), records it as
    the run's current configuration (`<run>/control/config.json`: run.json is written once)
    and clears the stop marker a finished or stopped life left behind. Without `resume`, an
    existing run is refused: pass `resume=True` or choose another `storage.run_uri`."""
    run = open_run_location(config)
    wanted = config.model_dump(mode="json")
    if resume:
        open_run(run, wanted)
        run.fs.makedirs(run.join("control"), exist_ok=True)
        run.fs.pipe_file(run.join(*CURRENT_CONFIG), json.dumps(wanted, indent=2).encode())
        clear_stop(run)
    elif run.fs.exists(run.join("run.json")):
        raise StorageError(
            f"a run already exists at {run.uri}; resume it (--resume, or the flow's resume "
            "parameter) or choose another storage.run_uri"
        )
    else:
        create_run(run, wanted)
    return config, run


def open_existing_run(
    run_uri: str, storage_options: dict[str, Any] | None = None, *, check: bool = True
) -> tuple[RunConfig, Location]:
    """An existing run's configuration and its root, reopened with the storage endpoint and
    options of that configuration (`storage_options` win): what every run process starts
    with."""
    config = load_run_config(open_location(run_uri, storage_options=storage_options, check=check))
    run = open_location(
        run_uri,
        endpoint_url=config.storage.endpoint_url,
        storage_options={**config.storage.storage_options, **(storage_options or {})},
        check=check,
    )
    return config, run


def stop_on_sigterm(stop: threading.Event | None = None) -> threading.Event:
    """`stop`, or a new event, set by SIGTERM when called from the main thread: a process
    that watches it finishes its work in hand and exits 0."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def load_run_config(run: Location) -> RunConfig:
    """The configuration of the run at `run`: its current one when a resume recorded it
    (`prepare_run`), else run.json's."""
    current = run.join(*CURRENT_CONFIG)
    if run.fs.exists(current):
        return validate_config(json.loads(run.fs.cat_file(current)), source=current)
    return validate_config(open_run(run).config, source=f"{run.uri}/run.json")


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
    grace_s: float = STOP_GRACE_S,
) -> int:
    """Run `argv` to its exit and return its exit code; each line it prints (stdout and
    stderr) goes to `on_line`. When `stop` is set: SIGTERM, then SIGKILL after `grace_s`."""
    process = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,  # a Ctrl-C in the terminal reaches us, and we stop it cleanly
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


# -- a whole run without Prefect ---------------------------------------------------------------


@dataclass
class _Component:
    name: str
    argv: list[str]
    restarts_allowed: int
    restarts: int = 0
    exit_code: int | None = None
    tail: list[str] = field(default_factory=list)


@dataclass
class LocalRun:
    """`streamrl run`: one learner, `generators` generators (and the evaluator) on this
    machine, supervised until the learner reaches its step budget.

    `on_line(component, line)` receives every output line; `max_restarts` bounds the restarts
    of each generator (the learner gets `learner_restarts`: it resumes from its checkpoint).
    `run()` returns when everything stopped; it raises `ComponentFailedError` after stopping the
    others when a component failed for good."""

    config: RunConfig
    generators: int
    on_line: Callable[[str, str], None]
    max_restarts: int = 3
    learner_restarts: int = 1
    evaluator: bool = True
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[str] = field(default_factory=list)

    def run(self) -> dict[str, Any]:
        run = open_run_location(self.config)
        reserve_generator_indexes(run, self.generators, owner="streamrl run")
        components = [
            _Component("learner", learner_command(self.config), self.learner_restarts),
            *(
                _Component(f"gen{i}", generator_command(self.config, i), self.max_restarts)
                for i in range(self.generators)
            ),
        ]
        if self.evaluator and self.config.eval.every_versions > 0:
            components.append(_Component("eval", evaluator_command(self.config), 1))
        threads = [
            threading.Thread(target=self._supervise, args=(c, run), name=c.name, daemon=True)
            for c in components
        ]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)
        except KeyboardInterrupt:
            self.failures.append("interrupted (Ctrl-C)")
            self._abort(run, "interrupted")
            for thread in threads:
                thread.join()
        if self.failures:
            raise ComponentFailedError("; ".join(self.failures))
        return {c.name: {"exit_code": c.exit_code, "restarts": c.restarts} for c in components}

    def _supervise(self, component: _Component, run: Location) -> None:
        def line(text: str) -> None:
            component.tail = [*component.tail[-19:], text]
            self.on_line(component.name, text)

        while True:
            component.exit_code = run_process(component.argv, line, self.stop)
            if component.exit_code == 0 or self.stop.is_set():
                if component.name == "learner" and component.exit_code == 0:
                    self._finish()
                return
            if component.restarts >= component.restarts_allowed:
                tail = "\n    ".join(component.tail[-10:])
                self.failures.append(
                    f"{component.name} failed for good (exit code {component.exit_code} after "
                    f"{component.restarts} restarts); its last lines:\n    {tail}"
                )
                self._abort(run, f"{component.name} failed")
                return
            component.restarts += 1
            self.on_line(
                component.name,
                f"exited with code {component.exit_code}; restart {component.restarts} of "
                f"{component.restarts_allowed}",
            )

    def _finish(self) -> None:
        """The learner is done and has set the stop marker: the generators flush and exit, the
        evaluator scores the last version; whatever still runs after a grace period is stopped."""
        deadline = threading.Timer(FINISH_GRACE_S, self.stop.set)
        deadline.daemon = True  # never keeps `streamrl run` alive once everything exited
        deadline.start()

    def _abort(self, run: Location, reason: str) -> None:
        """Stop everything now: the stop marker (so nothing restarts into the run), then
        SIGTERM to every process."""
        if not stop_requested(run):
            request_stop(run, reason)
        self.stop.set()


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
