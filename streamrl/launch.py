"""Starting and supervising a run's processes on one machine.

A run is a learner (one process, or a torchrun job of `learner.nproc_per_node` ranks), N
generators and, when `eval.every_versions` > 0, an evaluator: each a `streamrl` subprocess of
this Python interpreter, sharing nothing but the run's storage.

Opening a run (`prepare_run`, `open_existing_run`, `load_run_config`) lives in
`streamrl.runs`, which the components import; nothing but supervisors imports this module.

- `learner_command`, `generator_command`, `evaluator_command`: their argv.
- `run_process`: run one to its exit, each output line to a callback; SIGTERM when asked to
  stop, SIGKILL after a grace period; on the cores and with the environment of its
  `ProcessPlacement` (`streamrl.placement`: one plan per run, made before anything starts).
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

from storage.control import request_stop, stop_requested
from storage.fs import Location, put_if_absent
from streamrl.config import RunConfig
from streamrl.placement import (
    PLACED_VARIABLES,
    PlacementPlan,
    ProcessPlacement,
    plan_placement,
    write_placement,
)
from streamrl.runs import open_run_location

__all__ = [
    "ComponentFailedError",
    "LocalRun",
    "claim_generator_index",
    "evaluator_command",
    "format_summary",
    "generator_command",
    "learner_command",
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
    both the supervisor's environment and the placement's."""
    inherited = dict(os.environ)
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
        # Only a system call between fork and exec: safe with the supervisor's threads.
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
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
    placement: ProcessPlacement | None = None
    restarts: int = 0
    exit_code: int | None = None
    tail: list[str] = field(default_factory=list)


@dataclass
class LocalRun:
    """`streamrl run`: one learner, `generators` generators (and the evaluator) on this
    machine, supervised until the learner reaches its step budget.

    `on_line(component, line)` receives every output line; `max_restarts` bounds the restarts
    of each generator (the learner gets `learner_restarts`: it resumes from its checkpoint).
    Every process starts from `placement` (default: `plan_placement` for this machine), which
    `run()` stores as `<run>/control/placement.json`.
    `run()` returns when everything stopped; it raises `ComponentFailedError` after stopping the
    others when a component failed for good."""

    config: RunConfig
    generators: int
    on_line: Callable[[str, str], None]
    max_restarts: int = 3
    learner_restarts: int = 1
    evaluator: bool = True
    placement: PlacementPlan | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[str] = field(default_factory=list)

    def run(self) -> dict[str, Any]:
        plan = self.placement or plan_placement(
            self.config, generators=self.generators, evaluator=self.evaluator
        )
        run = open_run_location(self.config)
        write_placement(run, plan)
        reserve_generator_indexes(run, self.generators, owner="streamrl run")
        components = [
            _Component(
                "learner", learner_command(self.config), self.learner_restarts, plan.learner
            ),
            *(
                _Component(f"gen{i}", generator_command(self.config, i), self.max_restarts, placed)
                for i, placed in enumerate(plan.generators)
            ),
        ]
        if plan.evaluator is not None:
            components.append(_Component("eval", evaluator_command(self.config), 1, plan.evaluator))
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
            component.exit_code = run_process(
                component.argv, line, self.stop, placement=component.placement
            )
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
