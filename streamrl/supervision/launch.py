"""Starting a run's processes: their command lines, and running one under a placement. The
supervision core that keeps them running is `streamrl.supervision.supervisor`.

A run is a learner (one process, or a torchrun job of `learner.nproc_per_node` ranks; on work
pools, one such job per node, `streamrl.supervision.rendezvous`), N generators and, when
`eval.every_versions` > 0, an evaluator: each a `streamrl` subprocess of this Python
interpreter, sharing nothing but the run's storage.

Opening a run (`prepare_run`, `open_existing_run`, `load_run_config`) lives in
`streamrl.config.stored` and a generator's index in `streamrl.generator.index`, which the
components import; only supervisors import this module.

- `learner_command`, `generator_command`, `evaluator_command`: their argv.
- `run_process`: run one to its exit, each output line to a callback; SIGTERM when asked to
  stop — to every process of it, a torchrun job's ranks included (`ProcessTree`) — SIGKILL after
  a grace period; SIGTERM too if the supervisor dies (however it dies); on the cores and with the
  environment of its `ProcessPlacement` (`streamrl.placement`). It returns once every process
  the component started has ended.
- `learner_env`: what torchrun needs to give its ranks the learner's stop grace.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from streamrl.config.run import RunConfig
from streamrl.isolation.lifetime import dying_with_parent
from streamrl.placement import PLACED_VARIABLES, ProcessPlacement
from streamrl.supervision.processes import ProcessTree
from streamrl.supervision.rendezvous import LearnerNode

__all__ = [
    "STOP_GRACE_S",
    "evaluator_command",
    "generator_command",
    "learner_command",
    "learner_env",
    "run_process",
    "scorer_command",
]


STOP_GRACE_S = 30.0
TREE_REFRESH_S = 2.0  # how often a running component's processes are looked up
WATCH_EVERY_S = 10.0  # how often a watched component's heartbeat is read
STALLED_GRACE_S = 10.0  # a hung process's time to end on SIGTERM before SIGKILL

log = logging.getLogger(__name__)


def _python() -> list[str]:
    return [sys.executable, "-m", "streamrl"]


def learner_command(
    config: RunConfig, node: LearnerNode | None = None, *, take_over: bool = False
) -> list[str]:
    """The learner: `streamrl learner`, under torchrun when it has several ranks; with `node`, this
    node's ranks of a learner of several nodes (`streamrl.supervision.rendezvous`). `take_over`: it
    takes the run's learner lease over from an earlier holder (`--take-over`), fencing it — for a
    restart, whose supervisor knows the previous attempt's processes ended or are fenced."""
    learner = ["learner", "--run", config.storage.run_uri, *(["--take-over"] if take_over else [])]
    nproc = config.learner.nproc_per_node
    if nproc == 1 and node is None:
        return [*_python(), *learner]
    where = ["--standalone"] if node is None else node.torchrun_args()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc_per_node={nproc}",
        "-m",
        # The end of torchrun's options: its parser would otherwise take the learner's `--run`
        # for an ambiguous abbreviation of its own `--run-path`/`--run_path` (as in torch 2.13).
        "--",
        "streamrl",
        *learner,
    ]


def learner_env(config: RunConfig) -> dict[str, str]:
    """The learner's environment: torchrun, stopped, waits this long for its ranks (each
    committing its checkpoint on stop within `learner.stop_grace_s`) before it kills them; its
    default, 30 s, would cut a longer grace short."""
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(config.learner.stop_grace_s) + 5)}


def generator_command(config: RunConfig, index: int, *, take_over: bool = False) -> list[str]:
    """Generator `index`; `take_over` when restarting it after its previous process ended (it
    takes the index at once instead of waiting for that process's lease to lapse)."""
    argv = [*_python(), "generator", "--run", config.storage.run_uri, "--index", str(index)]
    return [*argv, "--take-over"] if take_over else argv


def scorer_command(config: RunConfig, name: str) -> list[str]:
    """Served scorer `name` (`streamrl scorer`: vLLM's server for it)."""
    return [*_python(), "scorer", "--run", config.storage.run_uri, "--name", name]


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
    stalled: Callable[[], str | None] | None = None,
) -> int:
    """Run `argv` to its exit and return its exit code; each line it prints (stdout and
    stderr) goes to `on_line`. When `stop` is set: SIGTERM to every process of it, then SIGKILL
    after `grace_s` (each of its processes has it, even once the first one ended). Returns once
    every process it started has ended (what is left when the first one exits is killed, at
    once unless it was stopped). `stalled`, asked every `WATCH_EVERY_S`: a reason when the
    process is hung (`streamrl.supervision.liveness`); it is then ended (`STALLED_GRACE_S` for
    SIGTERM, a stopped process continued to get it, then SIGKILL).

    With `placement` the process starts on its cores (CPU affinity, inherited by every thread
    and child it creates) at its priority, with its environment (`ProcessPlacement.env()`);
    `env` wins over both the supervisor's environment and the placement's. The process gets
    SIGTERM when the calling thread's process dies; call it from a thread that waits for it (it
    does)."""
    inherited, supervisor = dict(os.environ), os.getpid()
    planned: dict[str, str] = {}
    cpus, background = None, False
    if placement is not None:  # the plan decides its variables: none leaks from ours
        inherited = {k: v for k, v in inherited.items() if k not in PLACED_VARIABLES}
        planned, cpus = placement.env(), placement.cpus
        background = placement.priority == "background"
    process = subprocess.Popen(
        # No Python between fork and exec (the supervisor has threads): an exec wrapper sets
        # the parent-death signal, the cores and the priority.
        dying_with_parent(
            list(argv), supervisor, signal.SIGTERM, cpus or (), background=background
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**inherited, "PYTHONUNBUFFERED": "1", **planned, **(env or {})},
        stdin=subprocess.DEVNULL,
        # A process group of its own: a Ctrl-C in the terminal (sent to its foreground group)
        # reaches only us, and we stop it cleanly. In our session, not one of its own: where
        # the kernel schedules each session as one group (autogroup), a background process
        # then yields to the run's other processes alone, not to everything on the machine.
        process_group=0,
    )
    stop = stop or threading.Event()
    tree = ProcessTree(process.pid)
    watcher = threading.Thread(
        target=_stop_when_set, args=(process, tree, stop, grace_s, stalled), daemon=True,
        name="stop-watcher",
    )  # fmt: skip
    reader = threading.Thread(
        target=_forward_lines, args=(process, on_line), daemon=True, name="output-reader"
    )
    watcher.start()
    reader.start()
    code = process.wait()
    if stop.is_set():  # told to stop: what it leaves (a rank committing its checkpoint) has the
        tree.wait_ended(grace_s)  # same grace, though the first process ended at once
    # Its helpers (a reward worker pool, torchrun's ranks) may outlive it and hold the output
    # pipe open: every process of a component ends with it.
    if left := tree.end_leftovers():
        log.warning("%s: processes that could not be ended: %s", argv[-1], "; ".join(left))
    reader.join(timeout=10)
    watcher.join()
    return code


def _forward_lines(process: subprocess.Popen[str], on_line: Callable[[str], None]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        on_line(line.rstrip("\n"))


def _stop_when_set(
    process: subprocess.Popen[str],
    tree: ProcessTree,
    stop: threading.Event,
    grace_s: float,
    stalled: Callable[[], str | None] | None = None,
) -> None:
    """Until the process exits: its tree remembered every `TREE_REFRESH_S`, whether it is hung
    asked every `WATCH_EVERY_S`; when `stop` is set, SIGTERM to every process of it, then
    SIGKILL after `grace_s`; when hung, the same after `STALLED_GRACE_S`."""
    next_refresh = next_watch = time.monotonic() + TREE_REFRESH_S
    tree.refresh()
    while not stop.wait(0.2):
        if process.poll() is not None:
            return
        now = time.monotonic()
        if now >= next_refresh:
            tree.refresh()
            next_refresh = now + TREE_REFRESH_S
        if stalled is not None and now >= next_watch:
            next_watch = now + WATCH_EVERY_S
            if stalled() is not None:
                tree.terminate(signal.SIGCONT)  # a stopped process gets the SIGTERM that follows
                grace_s = STALLED_GRACE_S
                break
    if process.poll() is not None:
        return
    tree.terminate(signal.SIGTERM)  # each torchrun rank too: whichever is signalled first
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        tree.terminate(signal.SIGKILL)
