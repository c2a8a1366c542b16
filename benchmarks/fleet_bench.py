"""Fleet simulation through the real storage code: waste, learner idle time, staleness and
generator pauses for 1, 4 and 16 generators at several generator:learner speed ratios, with
flow control on and off, on a local folder and on SeaweedFS (a real S3 server on 127.0.0.1).

    .venv/bin/python -m benchmarks.fleet_bench     # --backends local seaweedfs --generators 1 4 16
                                                   # --ratios 0.5 1 4 --steps 8 --train-s 2.0
    .venv/bin/python -m benchmarks.fleet_bench --quick     # smoke run: 8 configurations a backend

Only the model is simulated (by sleeping); everything between the processes is real. Each
generator is its own OS process with a `StreamWriter` committing real segments of random
groups (`tests.stream_data.random_group`) and a `FlowGate` deciding admission from the
learner's progress record and the commit log. The learner is one process reading with a
`StreamReader` into a `BatchCollector` (staleness filter; dynamic sampling off unless
`--dynamic-sampling`: random groups have all-equal scores 1 time in 8, a rejection no pacing
can avoid) and writing its progress with the real `StreamSource`'s own methods, after each step
and while it waits mid-step (the reader's `on_idle` hook). Settings are `dapo` + `tiny-cpu`
(max_staleness S = 4, publish_every K = 1, G = 4, segments of 4 groups or 2 s, weights polled
every 1 s) with batch_groups B = 8. With the default 2 s step, the segment deadline is one
learner step and the weight poll and flow control's refresh (`REFRESH_S`) half a step each:
far more than on a real fleet, whose steps take minutes, so staleness here is pessimistic.

The simulated model:
  * learner: a step collects B accepted groups, then sleeps `--train-s` T; the policy version
    goes up by one every K steps. It consumes B / T groups/s while batches are ready.
  * generator: an engine that holds up to P prompts and finishes one every `service_s`, oldest
    first (Little's law gives the latency of a continuously batched engine kept full, P ×
    service_s). A prompt is tagged with the version loaded when it was admitted (the engine's
    rule: the oldest weights behind any token). The loaded version is re-read from the
    learner's progress record every `weight_poll_s`, as the real loop polls LATEST (loading
    takes no time here). Prompts are admitted between engine steps (every 0.1 s) while
    `FlowGate.admits(version, in engine + in the open segment)`; a paused generator with an
    empty engine sleeps `PAUSED_SLEEP_S`, as `GeneratorLoop` does. On the learner's stop marker
    it aborts its engine and commits its open segment.
  * P = ⌈`--in-flight-batches` × B / N⌉: the fleet keeps one batch in flight by default, so a
    group's latency is about 1 / r learner steps whatever the fleet size.

Definitions (per configuration):
  * speed ratio r = fleet throughput / learner consumption = N × g / (B / T), g = groups/s one
    generator finishes with its engine full. It is the fleet's: at a given r each of N
    generators finishes a group every service_s = N × T / (r × B) seconds.
  * generated = groups committed before the learner's last step ended (`after_stop` counts
    those the fleet committed while it noticed the stop marker: an artefact of ending a run).
    trained = groups accepted into batches (steps × B).
  * waste = (generated − trained) / generated = `stale` (dropped by the staleness filter,
    skipped segments included) + `unconsumed` (the `backlog_end` groups after the learner's
    cursor when it stopped) + `zero_var` (dynamic sampling), each over generated. In a run this
    short the backlog left at the end weighs heavily; flow control bounds it by ~(S + 1) × B.
  * learner idle = time inside `BatchCollector.collect` (waiting for B usable groups) / the
    learner's wall time (start signal to the end of its last step); `idle_after_1st` leaves out
    the first step's wait (the fleet's start-up latency) from both.
  * staleness of each trained group = learner version at its step − its policy version.
  * generator paused = Σ `FlowGate.paused_s` / Σ generator wall time (start to stop marker).

All processes of a configuration start on one barrier; worker processes are started (and have
imported everything) once, before the first configuration. Prints one table per backend and a
side-by-side table of flow control off / on.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import product
from typing import Any

import numpy as np

from benchmarks.storage_bench import markdown_table
from storage.control.requests import request_stop, stop_requested
from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS
from storage.stream.learner_progress import read_learner_progress
from storage.stream.records import Cursor
from storage.stream.writer import StreamReader, StreamTimeoutError, StreamWriter, read_log
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.generator.flow_control import FlowGate
from streamrl.generator.loop import PAUSED_SLEEP_S
from streamrl.learner.batching import BatchCollector, FilterCounts
from streamrl.learner.checkpointing import TrainingState
from streamrl.learner.stream_source import StreamSource
from tests.stream_data import random_group

BATCH_GROUPS = 8
VOCAB = 50_000  # random_group's token ids lie below it
ENGINE_STEP_S = 0.1  # how often the simulated engine hands control back to the loop
BARRIER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class FleetCase:
    """One configuration: where the run lives, the fleet, the speeds, flow control."""

    backend: str
    root: str  # the backend's folder of runs; this configuration's run is `name` in it
    name: str
    storage_options: dict[str, Any]
    generators: int
    ratio: float
    flow_control: bool
    config: RunConfig
    steps: int
    train_s: float
    in_flight_batches: float
    stall_timeout_s: float

    @property
    def service_s(self) -> float:
        """Seconds per group of one generator: N × T / (r × B)."""
        return self.generators * self.train_s / (self.ratio * self.config.learner.batch_groups)

    @property
    def prompts_in_flight(self) -> int:
        learner = self.config.learner
        return max(1, math.ceil(self.in_flight_batches * learner.batch_groups / self.generators))

    def open(self) -> Location:
        """The run, through one filesystem instance per process and backend (an s3fs instance
        dropped by one task and collected during the next logs 'attached to a different
        loop' errors)."""
        if self.root not in _ROOTS:
            _ROOTS[self.root] = open_location(self.root, storage_options=self.storage_options)
        return _ROOTS[self.root].child(self.name)


_ROOTS: dict[str, Location] = {}


class SimulatedEngine:
    """Holds up to `capacity` prompts; finishes one every `service_s`, oldest first. Each
    prompt is just the policy version it was admitted with."""

    def __init__(self, capacity: int, service_s: float) -> None:
        self.capacity, self.service_s = capacity, service_s
        self.versions: deque[int] = deque()
        self.next_done = math.inf  # when the oldest prompt finishes

    def submit(self, version: int) -> None:
        if not self.versions:
            self.next_done = time.monotonic() + self.service_s
        self.versions.append(version)

    def finished(self) -> list[int]:
        """Versions of the prompts finished by now."""
        done = []
        while self.versions and time.monotonic() >= self.next_done:
            done.append(self.versions.popleft())
            self.next_done = self.next_done + self.service_s if self.versions else math.inf
        return done


def run_generator(case: FleetCase, index: int, barrier: Any) -> dict[str, float]:
    """One simulated generator until the stop marker (in a pool worker)."""
    run, cfg = case.open(), case.config.generator
    generator_id = f"gen{index}"
    writer = StreamWriter(run, generator_id)
    gate = FlowGate(run, case.config.learner, generator_id, enabled=case.flow_control)
    engine = SimulatedEngine(case.prompts_in_flight, case.service_s)
    rng = np.random.default_rng(index)
    version, next_poll, prompts = 0, 0.0, 0
    barrier.wait(BARRIER_TIMEOUT_S)
    started = time.monotonic()
    while True:
        if time.monotonic() >= next_poll:
            next_poll = time.monotonic() + cfg.weight_poll_s
            if stop_requested(run):
                break
            progress = read_learner_progress(run)
            version = max(version, 0 if progress is None else progress.policy_version)
        uncommitted = len(engine.versions) + writer.pending_groups
        while len(engine.versions) < engine.capacity and gate.admits(version, uncommitted):
            engine.submit(version)
            uncommitted += 1
        for admitted_version in engine.finished():
            prompts += 1
            writer.append(
                random_group(
                    rng,
                    prompt_id=f"{generator_id}-{prompts}",
                    group_size=cfg.group_size,
                    max_len=cfg.max_tokens,
                    policy_version=admitted_version,
                    generator_id=generator_id,
                )
            )
        if writer.pending_groups >= cfg.segment_groups or (
            writer.pending_groups and writer.pending_age_s >= cfg.segment_seconds
        ):
            gate.committed(writer.flush().num_groups)
        pause = ENGINE_STEP_S if engine.versions else PAUSED_SLEEP_S
        now = time.monotonic()
        time.sleep(max(0.0, min(now + pause, engine.next_done, next_poll) - now))
    wall = time.monotonic() - started
    record = writer.flush()
    if record is not None:
        gate.committed(record.num_groups)
    return {
        "groups": writer.stats.groups,
        "paused_s": gate.paused_s,
        "wall_s": wall,
        "commit_conflicts": writer.stats.commit_conflicts,
        "failed_refreshes": gate.failed_refreshes,
    }


@dataclass(frozen=True)
class _RankZero:
    is_main: bool = True


class SimulatedLearner:
    """The real learner's data side and progress records, with training replaced by a sleep.

    Consumes: the stream from the start. Produces: a policy version every K steps, its progress
    record after each step and while it waits mid-step. Waits for: B accepted groups."""

    # The real learner's own progress writers (after a step; mid-step, from the reader's idle
    # hook), so flow control sees exactly what it would see; they use the attributes below.
    write_progress = StreamSource.write_progress
    _report_waiting = StreamSource._report_waiting
    _write_waiting = StreamSource._write_waiting
    _progress_record = StreamSource._progress_record
    _check_lease = StreamSource._check_lease

    def __init__(self, case: FleetCase) -> None:
        learner = case.config.learner
        self.run_location, self.learner = case.open(), learner
        self.run, self.topology = self.run_location, _RankZero()
        self.state, self.lease, self._while_waiting = TrainingState(), None, lambda: None
        self._progress = None
        self._progress_lock = threading.Lock()
        collector = BatchCollector(
            batch_groups=learner.batch_groups,
            max_staleness=learner.max_staleness,
            dynamic_sampling=case.config.algorithm.dynamic_sampling,
            vocab_size=VOCAB,
            max_seq_len=case.config.model.max_model_len,
        )
        self.collector = collector
        self.reader = StreamReader(
            self.run_location,
            Cursor(),
            oldest_usable_version=lambda: collector.oldest_usable(self.state.version),
            on_idle=self._report_waiting,
        )
        self.groups = self.reader.groups(timeout_s=case.stall_timeout_s)

    def train_step(self, train_s: float) -> tuple[np.ndarray, float]:
        """One step: the trained groups' staleness and the seconds spent waiting for them."""
        started = time.monotonic()
        state = self.state
        batch = self.collector.collect(self.groups, lambda: self.reader.cursor, state.version)
        waited = time.monotonic() - started
        time.sleep(train_s)
        state.step += 1
        if state.step % self.learner.publish_every == 0:
            state.version += 1
        self.write_progress(batch)
        return batch.staleness, waited


def run_learner(case: FleetCase, barrier: Any) -> dict[str, Any]:
    """The simulated learner for `case.steps` steps, then the stop marker (in a pool worker).
    A stream that stays empty for `stall_timeout_s` (every generator paused) ends it early."""
    learner = SimulatedLearner(case)
    staleness, waited, first_wait, stalled = [], 0.0, 0.0, False
    barrier.wait(BARRIER_TIMEOUT_S)
    started = time.monotonic()
    try:
        while learner.state.step < case.steps:
            step_staleness, step_wait = learner.train_step(case.train_s)
            staleness.append(step_staleness)
            waited += step_wait
            first_wait = first_wait or step_wait
    except StreamTimeoutError:
        stalled = True
    finally:
        wall, ended_at = time.monotonic() - started, time.time()
        request_stop(learner.run_location, "fleet benchmark: learner done")
        learner.groups.close()
    totals: FilterCounts = learner.collector.totals
    return {
        "steps": learner.state.step,
        "stalled": stalled,
        "wait_s": waited,
        "first_wait_s": first_wait,
        "wall_s": wall,
        "ended_at": ended_at,
        "totals": totals,
        "staleness": np.concatenate(staleness) if staleness else np.zeros(0, np.int64),
    }


def run_case(pool: Any, manager: Any, case: FleetCase) -> dict[str, Any]:
    """Run one configuration and summarise it as a table row."""
    barrier = manager.Barrier(case.generators + 1)
    learner = pool.apply_async(run_learner, (case, barrier))
    fleet = [pool.apply_async(run_generator, (case, i, barrier)) for i in range(case.generators)]
    timeout = BARRIER_TIMEOUT_S + case.stall_timeout_s + case.steps * case.train_s * 20
    result = learner.get(timeout)
    gens = [g.get(timeout) for g in fleet]
    records = list(read_log(case.open()))
    committed = sum(r.num_groups for r in records)
    assert committed == sum(g["groups"] for g in gens), "the log and the writers disagree"
    # Groups committed after the learner stopped (the fleet notices the stop marker up to
    # weight_poll_s late, then commits its open segment) are an artefact of ending the run.
    generated = sum(r.num_groups for r in records if r.committed_at <= result["ended_at"])
    totals, staleness = result["totals"], result["staleness"]
    share = lambda n: n / max(generated, 1)  # noqa: E731
    first_wait, wall = result["first_wait_s"], result["wall_s"]
    stats = np.percentile(staleness, [50, 90]) if staleness.size else [math.nan] * 2
    return {
        "backend": case.backend,
        "gens": case.generators,
        "ratio": case.ratio,
        "flow": "on" if case.flow_control else "off",
        "steps": f"{result['steps']}" + (" STALLED" if result["stalled"] else ""),
        "generated": generated,
        "trained": totals.accepted,
        "waste": share(generated - totals.accepted),
        "stale": share(totals.dropped_stale),
        "unconsumed": share(generated - totals.consumed),
        "zero_var": share(totals.dropped_zero_var),
        "backlog_end": generated - totals.consumed,
        "after_stop": committed - generated,
        "learner_idle": result["wait_s"] / wall,
        "idle_after_1st": (result["wait_s"] - first_wait) / (wall - first_wait),
        "stale_mean": float(staleness.mean()) if staleness.size else math.nan,
        "stale_p50": float(stats[0]),
        "stale_p90": float(stats[1]),
        "stale_max": int(staleness.max()) if staleness.size else -1,
        "gen_paused": sum(g["paused_s"] for g in gens) / sum(g["wall_s"] for g in gens),
        "wall_s": result["wall_s"],
        # neither waiting nor training: progress writes, a starved CPU
        "other_s": wall - result["wait_s"] - result["steps"] * case.train_s,
        "conflicts": sum(g["commit_conflicts"] for g in gens),
        "gate_read_errors": sum(g["failed_refreshes"] for g in gens),
    }


def side_by_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flow control off vs on for each (backend, gens, ratio) that ran both."""
    by_key = {(r["backend"], r["gens"], r["ratio"], r["flow"]): r for r in rows}
    out = []
    for (backend, gens, ratio, flow), off in by_key.items():
        on = by_key.get((backend, gens, ratio, "on"))
        if flow != "off" or on is None:
            continue
        out.append(
            {
                "backend": backend,
                "gens": gens,
                "ratio": ratio,
                "waste off": off["waste"],
                "waste on": on["waste"],
                "stale off": off["stale"],
                "stale on": on["stale"],
                "idle off": off["learner_idle"],
                "idle on": on["learner_idle"],
                "idle after 1st off": off["idle_after_1st"],
                "idle after 1st on": on["idle_after_1st"],
                "p90 staleness off": off["stale_p90"],
                "p90 staleness on": on["stale_p90"],
                "paused on": on["gen_paused"],
            }
        )
    return out


def _warm(barrier: Any) -> None:
    """Occupies one pool worker until every worker has started and imported this module."""
    barrier.wait(BARRIER_TIMEOUT_S)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backends", nargs="+", default=["local", "seaweedfs"], choices=["local", "seaweedfs"]
    )
    parser.add_argument("--generators", type=int, nargs="+", help="default: 1 4 16")
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        help="fleet throughput / learner consumption (default: 0.5 1 4)",
    )
    parser.add_argument("--flow-control", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--steps", type=int, default=8, help="learner steps per configuration")
    parser.add_argument("--train-s", type=float, help="simulated train time a step, s (default: 2)")
    parser.add_argument(
        "--in-flight-batches",
        type=float,
        default=1.0,
        help="prompts the fleet keeps in its engines, in batches of B",
    )
    parser.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="reject groups with all-equal scores (1 in 8 random groups)",
    )
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=60.0,
        help="end a configuration whose learner got no group for this long",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 and 4 generators, ratios 0.5 and 4, steps of 0.5 s",
    )
    args = parser.parse_args()
    quick = args.quick
    args.generators = args.generators or ([1, 4] if quick else [1, 4, 16])
    args.ratios = args.ratios or ([0.5, 4.0] if quick else [0.5, 1.0, 4.0])
    args.train_s = args.train_s or (0.5 if quick else 2.0)

    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"learner.batch_groups={BATCH_GROUPS}",
            f"learner.mini_batch_groups={BATCH_GROUPS}",
            f"algorithm.dynamic_sampling={str(args.dynamic_sampling).lower()}",
        ],
    )
    learner, gen = config.learner, config.generator
    print(
        f"B={learner.batch_groups} S={learner.max_staleness} K={learner.publish_every} "
        f"G={gen.group_size} segment={gen.segment_groups} groups/{gen.segment_seconds:g}s "
        f"weight_poll={gen.weight_poll_s:g}s train={args.train_s:g}s steps={args.steps} "
        f"fleet in flight={args.in_flight_batches:g}×B "
        f"dynamic_sampling={config.algorithm.dynamic_sampling} cores={os.cpu_count()} "
        f"load={os.getloadavg()[0]:.1f}"
    )
    ctx = mp.get_context("spawn")
    workers = max(args.generators) + 1
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        manager = stack.enter_context(ctx.Manager())
        pool = stack.enter_context(ctx.Pool(workers))
        roots = {"local": (os.path.join(tmp, "runs"), {})}
        if "seaweedfs" in args.backends:
            server = stack.enter_context(SeaweedFS())
            roots["seaweedfs"] = (f"s3://{server.bucket}/fleet", server.storage_options)
        started = time.monotonic()
        pool.map(_warm, [manager.Barrier(workers)] * workers, chunksize=1)
        print(f"{workers} worker processes ready in {time.monotonic() - started:.0f}s")
        for backend in args.backends:
            backend_rows = []
            root, options = roots[backend]
            for n, ratio, flow in product(args.generators, args.ratios, args.flow_control):
                case = FleetCase(
                    backend=backend,
                    root=root,
                    name=f"n{n}-r{ratio:g}-{flow}",
                    storage_options=options,
                    generators=n,
                    ratio=ratio,
                    flow_control=flow == "on",
                    config=config,
                    steps=args.steps,
                    train_s=args.train_s,
                    in_flight_batches=args.in_flight_batches,
                    stall_timeout_s=args.stall_timeout_s,
                )
                backend_rows.append(run_case(pool, manager, case))
                row = backend_rows[-1]
                # The whole row at once, so a run cut short still shows what it measured.
                line = markdown_table([row]).splitlines()[-1]
                print(f"  P={case.prompts_in_flight} {line}", flush=True)
            print(f"\n## {backend}: per configuration\n")
            print(markdown_table(backend_rows))
            rows += backend_rows
    if compared := side_by_side(rows):
        print("\n## Flow control off vs on\n")
        print(markdown_table(compared))


if __name__ == "__main__":
    main()
