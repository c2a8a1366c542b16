"""Where a run stands, read straight from its storage into typed records (`RunStatus`,
`StreamStatus`, `GeneratorStatus`): what `streamrl status RUN_URI` reports. Turning a record
into the console table or a JSON line is `streamrl.runs.status_format`'s job.

Nothing here talks to Prefect or to a process: every figure comes from the run's objects, so
the report is the same wherever it is read from, for a live run and for a finished one.

    run.json (+ control/config.json)   algorithm, model, total_steps (the current config,
                                       checked against run.json: `streamrl.config.stored`)
    checkpoints/                       latest committed step, its policy version and cursor
    weights/                           latest published version, the versions kept
    stream/log/                        commits and groups written, per generator (commit
                                       records carry group counts: no segment is read), and
                                       the generators' failed reward calls and dropped groups
    stream/quarantine/                 committed segments readers skip (not in the lag)
    metrics/learner*.json[l]           the learner's last step: version, consumed groups,
                                       staleness, rewards, throughput
    metrics/eval*.json[l]              the latest evaluation (val/* keys)
    control/STOP                       the stop marker and its reason
    control/learner.json + metrics     health warnings: a learner starved by dynamic sampling,
                                       the newest firing of each health condition
                                       (`streamrl.runs.health`)

State, decided in this order:
    finished     the stop marker is set and the learner's step (its last metrics line, or its
                 latest checkpoint when that is newer) has reached total_steps;
    stopping     the stop marker is set before total_steps (a user or a flow stopped the run;
                 its loops are stopping or have stopped);
    running      no stop marker, and the learner or a generator has written something;
    not started  nothing but the configuration.
Storage cannot tell a live process from a dead one: "running" means "started, not stopped",
and the ages of the newest commit and of the last learner step show whether it moves.

Reads are ordered learner first (metrics, checkpoint), stream log last, so on a live run the
groups written are never fewer than the groups the learner reports consumed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from storage.checkpoints.dcp import CheckpointStore, LearnerState
from storage.control.lease import lives
from storage.control.manifest import open_run
from storage.control.requests import stop_requested
from storage.fs import Location, StorageError
from storage.stream.records import CommitRecord, Cursor, RolloutSums
from storage.stream.writer import quarantined, read_log
from storage.weights.versions import WeightStore
from streamrl.config.stored import read_current_config
from streamrl.evaluation.records import read_eval_records
from streamrl.learner.metrics_records import latest_metrics
from streamrl.runs.health import health_warnings

__all__ = [
    "FINISHED",
    "NOT_STARTED",
    "RUNNING",
    "STOPPING",
    "GeneratorStatus",
    "RunStatus",
    "StreamStatus",
    "read_status",
    "read_stream",
]

NOT_STARTED, RUNNING, STOPPING, FINISHED = "not started", "running", "stopping", "finished"
STOP_MARKER = ("control", "STOP")  # written by `storage.control.requests.request_stop`


@dataclass(frozen=True)
class GeneratorStatus:
    """One generator id's share of the commit log. `incarnations`: the process lives that
    committed under this id, oldest first. `restarts` / `resumes`: the later starts of its
    index after a crash or kill / after a clean stop (from its index lease's epochs; None when
    it has none: then `incarnations` − 1 are counted as restarts). `reward_*`: its failed
    reward calls and the groups it dropped for them, summed over its commit records (see
    `storage.stream.records.CommitRecord`)."""

    writer_id: str
    commits: int
    groups: int
    incarnations: tuple[str, ...]
    last_commit_at: float
    policy_version: int  # newest version in its last commit
    reward_errors: int = 0
    reward_timeouts: int = 0
    reward_dropped_groups: int = 0
    restarts: int | None = None
    resumes: int = 0


@dataclass(frozen=True)
class StreamStatus:
    """The commit log up to its head when read. `groups` counts every committed group,
    `quarantined_groups` those in the `quarantined` segments (log numbers `quarantined_seqs`),
    which no reader yields. `reward_*`, `judge_*`: the generators' totals. `groups_before[s]`
    = groups committed at log numbers < s (length commits + 1): turns a cursor into a count of
    groups."""

    commits: int = 0
    groups: int = 0
    responses: int = 0
    tokens: int = 0
    newest_commit_at: float | None = None
    generators: tuple[GeneratorStatus, ...] = ()
    quarantined: int = 0
    quarantined_groups: int = 0
    quarantined_seqs: tuple[int, ...] = ()
    reward_errors: int = 0
    reward_timeouts: int = 0
    reward_dropped_groups: int = 0
    judge_verdicts: int = 0
    judge_unparsed: int = 0
    tasks: tuple[tuple[str, int, int], ...] = ()
    """Per task, in name order: (task, responses, correct ones), over every commit."""
    groups_before: tuple[int, ...] = field(default=(0,), repr=False)

    @property
    def readable_groups(self) -> int:
        """Committed groups outside quarantined segments: what readers can consume."""
        return self.groups - self.quarantined_groups

    def groups_at(self, cursor: Cursor) -> int:
        """Groups a reader standing at `cursor` has been given: those before it, less those
        of quarantined segments it skipped."""
        skipped = sum(
            self._segment_groups(seq) for seq in self.quarantined_seqs if seq < cursor.seq
        )
        return self.groups_before[min(cursor.seq, self.commits)] + cursor.offset - skipped

    def _segment_groups(self, seq: int) -> int:
        return self.groups_before[seq + 1] - self.groups_before[seq]


@dataclass(frozen=True)
class RunStatus:
    """Everything `streamrl status` reports; None (or empty) marks what does not exist yet.

    `step` is the learner's progress: its last metrics line, or its latest checkpoint if that
    is newer. `consumed_groups` comes from the last metrics line (`stream/consumed_total`) or
    else the checkpoint's stream cursor; `consumed_source` says which. `lag_groups` = groups
    written outside quarantined segments − consumed. `last_metrics` is the learner's last JSON
    line as logged. `health`: the run's health warnings (`streamrl.runs.health`), one
    sentence each."""

    uri: str
    read_at: float
    state: str
    state_reason: str
    algorithm: str
    model: str
    total_steps: int
    created_at: str
    step: int
    policy_version: int | None
    checkpoint_step: int | None
    checkpoint_version: int | None
    weight_version: int | None
    weight_versions: tuple[int, ...]
    stream: StreamStatus
    consumed_groups: int | None
    consumed_source: str
    lag_groups: int | None
    stop_reason: str | None
    last_metrics: dict[str, Any] | None
    last_eval: dict[str, Any] | None
    evaluations: int
    health: tuple[str, ...] = ()

    @property
    def newest_write_age_s(self) -> float | None:
        """Seconds between the newest commit and the moment the status was read."""
        newest = self.stream.newest_commit_at
        return None if newest is None else max(0.0, self.read_at - newest)


def read_status(run: Location, *, previous: RunStatus | None = None) -> RunStatus:
    """The status of the run at `run`, from storage alone.

    `previous`: an earlier status of the same run, whose commit-log tally is continued rather
    than re-read (the log is append-only), as `--watch` does.
    Raises `StorageError` naming the URI when no run is there.
    """
    manifest = open_run(run)
    config = read_current_config(run)  # a resume's record (it may extend total_steps), checked
    total_steps = int(config["learner"]["total_steps"])
    stop_reason = _stop_reason(run)
    last_metrics = latest_metrics(run)  # value pre-training records carry step 0
    checkpoint_step, checkpoint = _latest_checkpoint(CheckpointStore(run))
    weights = WeightStore(run)
    weight_versions = tuple(weights.versions())
    weight_version = weights.latest_version() if weight_versions else None
    stream = read_stream(run, since=previous.stream if previous is not None else None)
    stream = replace(stream, generators=tuple(_with_lives(run, g) for g in stream.generators))

    step = max(int(last_metrics["step"]) if last_metrics else 0, checkpoint_step or 0)
    policy_version, consumed, source = _learner_position(last_metrics, checkpoint, stream)
    started = bool(stream.commits or last_metrics or checkpoint_step is not None)
    state, reason = _decide_state(stop_reason, step, total_steps, started)
    evaluations = read_eval_records(run)
    return RunStatus(
        uri=run.uri,
        read_at=time.time(),
        state=state,
        state_reason=reason,
        algorithm="sft" if config.get("sft") else str(config["algorithm"]["name"]),
        model=str(config["model"]["path"]),
        total_steps=total_steps,
        created_at=manifest.created_at,
        step=step,
        policy_version=policy_version,
        checkpoint_step=checkpoint_step,
        checkpoint_version=None if checkpoint is None else checkpoint.policy_version,
        weight_version=weight_version,
        weight_versions=weight_versions,
        stream=stream,
        consumed_groups=consumed,
        consumed_source=source,
        lag_groups=None if consumed is None else stream.readable_groups - consumed,
        stop_reason=stop_reason,
        last_metrics=last_metrics,
        last_eval=evaluations[-1] if evaluations else None,
        evaluations=len(evaluations),
        health=tuple(health_warnings(run)),
    )


def _learner_position(
    last_metrics: dict[str, Any] | None, checkpoint: LearnerState | None, stream: StreamStatus
) -> tuple[int | None, int | None, str]:
    """(policy version, groups consumed, where the count comes from): the last metrics line
    unless the checkpoint is newer (metrics are written after the checkpoint of a step)."""
    policy_version, consumed, source = None, None, "nothing consumed yet"
    if checkpoint is not None:
        policy_version = checkpoint.policy_version
        consumed = stream.groups_at(Cursor.from_dict(checkpoint.stream_cursor))
        source = f"checkpoint step {checkpoint.step} cursor"
    checkpoint_step = -1 if checkpoint is None else checkpoint.step
    if last_metrics is not None and last_metrics.get("step", 0) >= checkpoint_step:
        policy_version = int(last_metrics.get("policy_version", policy_version or 0))
        if "stream/consumed_total" in last_metrics:
            consumed = int(last_metrics["stream/consumed_total"])
            source = f"learner metrics, step {last_metrics.get('step', 0)}"
    return policy_version, consumed, source


def _stop_reason(run: Location) -> str | None:
    """The stop marker's reason; None when no stop was requested."""
    if not stop_requested(run):
        return None
    try:
        body = json.loads(run.fs.cat_file(run.join(*STOP_MARKER)))
    except FileNotFoundError:  # cleared between the two reads (a resume)
        return None
    return str(body.get("reason") or "no reason given")


def _latest_checkpoint(store: CheckpointStore) -> tuple[int | None, LearnerState | None]:
    """The newest committed step and its learner state (no tensors are read)."""
    for _ in range(3):
        step = store.latest_committed()
        if step is None:
            return None, None
        try:
            return step, store.read_state(step)
        except StorageError:
            # A live learner's `retain` deleted it after a newer one was committed: list again.
            if step in store.committed_steps():
                raise
    raise StorageError(f"the checkpoints under {store.location.uri} kept vanishing while read")


def _decide_state(
    stop_reason: str | None, step: int, total_steps: int, started: bool
) -> tuple[str, str]:
    if stop_reason is not None and step >= total_steps:
        return FINISHED, f"stop marker set ({stop_reason}); learner at step {step}/{total_steps}"
    if stop_reason is not None:
        return STOPPING, (
            f"stop marker set ({stop_reason}) at step {step}/{total_steps}; the loops stop "
            "(or have stopped)"
        )
    if started:
        return RUNNING, "no stop marker; the learner or generators have written to the run"
    return NOT_STARTED, "no stream commit, learner step or checkpoint yet"


def read_stream(run: Location, *, since: StreamStatus | None = None) -> StreamStatus:
    """Tally the commit log (records only, never segments), continuing `since` if given."""
    tally = since or StreamStatus()
    records = list(read_log(run, start=tally.commits))
    generators = {g.writer_id: g for g in tally.generators}
    groups_before = list(tally.groups_before)
    for record in records:
        generators[record.writer_id] = _count(generators.get(record.writer_id), record)
        groups_before.append(groups_before[-1] + record.num_groups)
    newest = max((r.committed_at for r in records), default=None)
    if tally.newest_commit_at is not None:
        newest = max(tally.newest_commit_at, newest or 0.0)
    commits = tally.commits + len(records)
    # A segment quarantined after the log was read above is counted at the next read.
    skipped = tuple(seq for seq in quarantined(run) if seq < commits)
    return StreamStatus(
        commits=commits,
        groups=groups_before[-1],
        responses=tally.responses + sum(r.num_responses for r in records),
        tokens=tally.tokens + sum(r.num_tokens for r in records),
        newest_commit_at=newest,
        generators=tuple(sorted(generators.values(), key=lambda g: g.writer_id)),
        quarantined=len(skipped),
        quarantined_groups=sum(groups_before[s + 1] - groups_before[s] for s in skipped),
        quarantined_seqs=skipped,
        reward_errors=tally.reward_errors + sum(r.reward_errors for r in records),
        reward_timeouts=tally.reward_timeouts + sum(r.reward_timeouts for r in records),
        reward_dropped_groups=tally.reward_dropped_groups
        + sum(r.reward_dropped_groups for r in records),
        judge_verdicts=tally.judge_verdicts + sum(r.judge_verdicts for r in records),
        judge_unparsed=tally.judge_unparsed + sum(r.judge_unparsed for r in records),
        tasks=_tasks(tally.tasks, records),
        groups_before=tuple(groups_before),
    )


def _tasks(
    seen: tuple[tuple[str, int, int], ...], records: list[CommitRecord]
) -> tuple[tuple[str, int, int], ...]:
    """`seen`'s per-task counts with those of `records` added."""
    sums = RolloutSums(
        task_responses={task: n for task, n, _ in seen},
        task_correct={task: c for task, _, c in seen},
    )
    for record in records:
        if record.rollout is not None:
            sums.merge(record.rollout)
    return tuple(
        (task, n, sums.task_correct.get(task, 0)) for task, n in sorted(sums.task_responses.items())
    )


def _with_lives(run: Location, generator: GeneratorStatus) -> GeneratorStatus:
    """`generator` with its restarts and resumes, from its index lease
    (`storage.control.lease.lives`)."""
    counted = lives(run.child("generators", generator.writer_id))
    if counted is None:  # not a `streamrl generator` index: its commits' incarnations tell
        return generator
    return replace(generator, restarts=counted[0], resumes=counted[1])


def _count(seen: GeneratorStatus | None, record: CommitRecord) -> GeneratorStatus:
    if seen is None:
        seen = GeneratorStatus(record.writer_id, 0, 0, (), 0.0, 0)
    incarnations = seen.incarnations
    if record.incarnation not in incarnations:
        incarnations = (*incarnations, record.incarnation)
    return replace(
        seen,
        commits=seen.commits + 1,
        groups=seen.groups + record.num_groups,
        incarnations=incarnations,
        last_commit_at=max(seen.last_commit_at, record.committed_at),
        policy_version=record.max_policy_version,
        reward_errors=seen.reward_errors + record.reward_errors,
        reward_timeouts=seen.reward_timeouts + record.reward_timeouts,
        reward_dropped_groups=seen.reward_dropped_groups + record.reward_dropped_groups,
    )
