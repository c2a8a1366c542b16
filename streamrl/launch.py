"""Starting a run's processes: their command lines, running one under a placement, and
generator indexes. The supervision core that keeps them running is `streamrl.supervisor`.

A run is a learner (one process, or a torchrun job of `learner.nproc_per_node` ranks; on work
pools, one such job per node, `streamrl.rendezvous`), N generators and, when
`eval.every_versions` > 0, an evaluator: each a `streamrl` subprocess of this Python
interpreter, sharing nothing but the run's storage.

Opening a run (`prepare_run`, `open_existing_run`, `load_run_config`) lives in
`streamrl.runs`, which the components import; but for a generator holding its index
(`hold_generator_index`), only supervisors import this module.

- `learner_command`, `generator_command`, `evaluator_command`: their argv.
- `run_process`: run one to its exit, each output line to a callback; SIGTERM when asked to
  stop, SIGKILL after a grace period; SIGTERM too if the supervisor dies (however it dies); on
  the cores and with the environment of its `ProcessPlacement` (`streamrl.placement`).
- `reserve_generator_indexes`, `claim_generator_index`: the run's own generator indexes, and
  the next free one for a generator that joins later (scaling out); `hold_generator_index`:
  the index a generator process runs as, held by it alone while it lives.
- `run_summary`, `format_summary`: what a run achieved, for the console.
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
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from storage.fs import Location, create_once
from storage.lease import LeaseHeldError, LeaseLostError, RunLease
from streamrl.config import RunConfig
from streamrl.placement import PLACED_VARIABLES, ProcessPlacement
from streamrl.processes import dying_with_parent
from streamrl.rendezvous import LearnerNode

__all__ = [
    "GENERATOR_LEASE_TTL_S",
    "STOP_GRACE_S",
    "GeneratorIndex",
    "GeneratorIndexHeldError",
    "GeneratorIndexLostError",
    "claim_generator_index",
    "evaluator_command",
    "format_summary",
    "generator_command",
    "hold_generator_index",
    "learner_command",
    "reserve_generator_indexes",
    "run_process",
    "run_summary",
]

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0


def _python() -> list[str]:
    return [sys.executable, "-m", "streamrl"]


def learner_command(
    config: RunConfig, node: LearnerNode | None = None, *, take_over: bool = False
) -> list[str]:
    """The learner: `streamrl learner`, under torchrun when it has several ranks; with `node`,
    this node's ranks of a learner of several nodes (`streamrl.rendezvous`). `take_over`: it
    takes the run's learner lease over from an earlier holder (`--take-over`), fencing it — for
    a restart, whose supervisor knows the previous attempt's processes ended or are fenced."""
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


def generator_command(config: RunConfig, index: int, *, take_over: bool = False) -> list[str]:
    """Generator `index`; `take_over` when restarting it after its previous process ended (it
    takes the index at once instead of waiting for that process's lease to lapse)."""
    argv = [*_python(), "generator", "--run", config.storage.run_uri, "--index", str(index)]
    return [*argv, "--take-over"] if take_over else argv


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
        # No Python between fork and exec (the supervisor has threads): an exec wrapper sets
        # the parent-death signal and the cores.
        dying_with_parent(list(argv), supervisor, signal.SIGTERM, cpus or ()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env={**inherited, "PYTHONUNBUFFERED": "1", **planned, **(env or {})},
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
    for index in range(count):
        _claim(run, index, owner)


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
        if index not in taken and _claim(run, index, owner):
            return index
        index += 1


def _claim(run: Location, index: int, owner: str) -> bool:
    """Create index `index`'s claim record unless it exists; True if this call created it (a
    retried request of its own included: the record carries a nonce and is read back)."""
    folder = run.child("control", "generators")
    record = {"index": index, "owner": owner, "at": time.time(), "nonce": uuid.uuid4().hex}
    return create_once(folder.fs, folder.join(f"{index}.json"), json.dumps(record).encode())


# -- the index a generator process runs as ---------------------------------------------------

GENERATOR_LEASE_TTL_S = 30.0


class GeneratorIndexHeldError(RuntimeError):
    """Another live generator holds the index; the message names it and what to do."""


class GeneratorIndexLostError(RuntimeError):
    """This generator's index was taken over: it must commit nothing more."""


class GeneratorIndex:
    """Generator `index` of a run, held by this process (`hold_generator_index`) until
    `release()` (also as a context manager). `check()` guards every commit."""

    def __init__(self, index: int, lease: RunLease) -> None:
        self.index, self.lease = index, lease

    def check(self) -> None:
        """Raises `GeneratorIndexLostError` when another generator took the index over, or
        this one's renewals lapsed (stopped, or cut off from storage) so that one may have."""
        try:
            self.lease.check()
        except LeaseLostError as exc:
            raise GeneratorIndexLostError(
                f"generator {self.index} no longer holds its index, so it commits nothing "
                f"more ({exc})"
            ) from exc

    def release(self) -> None:
        self.lease.release()

    def __enter__(self) -> GeneratorIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def hold_generator_index(
    run: Location, index: int, *, take_over: bool = False, ttl_s: float = GENERATOR_LEASE_TTL_S
) -> GeneratorIndex:
    """Hold generator `index` of `run` for this process: an explicit index, or one claimed for
    it (`claim_generator_index`), goes through the same steps.

    1. The index is claimed as a joining generator's would be (its claim record is created if
       absent), so `claim_generator_index` never hands it out afterwards.
    2. Its lease — `storage.lease` on `<run>/generators/gen<index>/`: an epoch record that the
       holder renews every `ttl_s`/3 and releases when it ends — is taken. If another process
       holds it, this one watches the record for up to `ttl_s` on its own clock: renewed, the
       holder is alive and this refuses; not renewed, it lapsed and this takes it. `take_over`
       takes it at once: for a supervisor restarting the index, which saw the previous process
       end.

    Raises:
        GeneratorIndexHeldError: a live generator holds the index (the message names it).
    """
    if index < 0:
        raise ValueError(f"generator index must be ≥ 0, got {index}")
    _claim(run, index, owner=f"streamrl generator --index {index}")
    where = run.child("generators", f"gen{index}")
    kind = ("generator", f"generator index {index} of run {run.uri}")
    try:
        lease = RunLease.acquire(where, ttl_s=ttl_s, take_over=take_over, kind=kind)
    except LeaseHeldError as exc:
        raise GeneratorIndexHeldError(f"{exc}. {_HELD_ADVICE}") from exc
    return GeneratorIndex(index, lease)


_HELD_ADVICE = (
    "Two generators must never run one index (they would generate its data shard twice): stop "
    "that generator first, or start this one with another --index; if that process has ended "
    "(its machine is gone), its lease lapses by itself, or pass --take-over"
)


# -- summaries -------------------------------------------------------------------------------


def run_summary(run: Location, window: int = 5) -> dict[str, Any]:
    """What a finished (or running) run achieved, from its learner metrics: reward and
    accuracy over the first and the last `window` steps, mean learner tokens/s, steps done,
    and the reward and accuracy curves as text charts (`charts`)."""
    from streamrl.curves import curve_data, text_charts
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
        "charts": text_charts(curve_data(steps), titles=("reward (mean)", "accuracy")),
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
            *(f"  {line}" for line in summary.get("charts", ())),
        ]
    )
