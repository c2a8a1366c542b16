"""The restart rules of a run's processes, in one place: `SupervisionPolicy`.

Two backends run a run's processes: `streamrl.supervision.supervisor.Supervisor` (processes on this
machine: `streamrl run`, the `streamrl` flow in `local` mode, the flows that run one component) and
`flows.pools.PoolSupervisor` (each process a child flow run on a work pool). A backend only starts,
watches and stops what the policy names; every decision — restart or not, which learner attempt
runs, when the run is finishing, when it has failed — is the policy's. The policy is pure: no clock
(every event says when), no storage, no processes; a backend with several threads hands it one event
at a time.

The rules:
- **Learner**: one that refused the run or lost it to another learner (`displaced`) aborts the
  run: a restart would take the run over from the learner that now holds it. One stopped from
  outside (`signalled`: SIGTERM or Ctrl-C sent to its process or to one of its ranks; it
  checkpointed before it exited) stops the run as an interrupt of the supervisor would: someone
  asked for the stop, and a restart would undo it.
  `learner_nodes` units per attempt, attempts numbered 1, 2, …. A node that ends
  without completing fails its attempt: one of `learner_retries` is spent, the attempt's other
  nodes are cancelled, and the next attempt (every node, resuming from the last committed
  checkpoint, taking the run's lease over) starts once every node of earlier attempts has ended,
  or `fence_after_s` after the failure (nodes still cancelling then are fenced by the take-over:
  they write nothing more). The end of a node of an earlier attempt changes nothing else, so an
  attempt fails once however many of its nodes end together. When every node of the current
  attempt has completed, the run is finishing.
- **Generators and the evaluator**: one that ends in failure is restarted (taking its index
  over) while its budget lasts (a generator: `generator_retries` within `generator_window_s`;
  the evaluator: `evaluator_retries`); one that completed, ended after it was asked to stop
  (scaled in, the run's stop marker), or was displaced (another generator holds its index),
  is not. One that failed as a restart would fail again (`deterministic`: the user code its
  configuration names cannot be resolved, `USER_CODE_EXIT_CODE`) aborts the run at once,
  its cause as the reason; so does a learner that cannot use its data (a supervised run's
  conversation that cannot be trained on). `TargetGenerators` scales out (new indexes) or in
  (the newest stop).
- **Scorers** (servers of the run's teacher, reward models, judges): restarted like the
  evaluator while `scorer_retries` last; they serve the others, so they end last: once the
  run is finishing and only scorers are left, they are cancelled.
- **Finishing**: nothing is restarted or scaled; the others flush; what still runs
  `finish_grace_s` after the learner completed is cancelled. `done` then.
- **Aborting**: a budget spent, or `Interrupted`: the run stops; later events are ignored.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storage.control.lease import DISPLACED
from streamrl.placement import Component as Kind

__all__ = [
    "FENCE_AFTER_S",
    "FINISH_GRACE_S",
    "NOT_RESTARTED",
    "STOPPED_FROM_OUTSIDE",
    "USER_CODE_EXIT_CODE",
    "Abort",
    "Action",
    "Cancel",
    "Ended",
    "Event",
    "Failure",
    "Finish",
    "Interrupted",
    "RestartBudget",
    "ScaleOut",
    "Start",
    "StopGenerator",
    "SupervisionPolicy",
    "TargetGenerators",
    "Tick",
    "Unit",
]

FINISH_GRACE_S = 180.0  # generators flush, the evaluator scores the last version
# A worker that lost its infrastructure may never report a cancelled node ended: after this
# long the next attempt starts anyway, and its lease take-over fences the old nodes.
FENCE_AFTER_S = 120.0
# A process whose user code fails as it would after a restart exits with this code (`streamrl
# generator`): code its configuration names that cannot be resolved (generator.reward.fn or
# generator.env.fn: a module, function or class that is not there), or code that fails the same
# way every time it runs (`streamrl.generator.failures`). Supervisors do not restart it.
USER_CODE_EXIT_CODE = 4
# How a backend says a unit failed so, in the failure it reports (a flow run's state message
# carries it to the supervisor of a run on work pools).
NOT_RESTARTED = "not restarted: a restart would fail the same way"
# What a learner prints when it stopped on SIGTERM or Ctrl-C (after its checkpoint on stop): under
# torchrun its exit code is lost, so a supervisor reads this.
STOPPED_FROM_OUTSIDE = "stopped from outside"


class RestartBudget:
    """How often a component may be restarted (or, on work pools, replaced): `allowed` times
    within any `window_s` seconds (default: over its whole life)."""

    def __init__(self, allowed: int, window_s: float = math.inf) -> None:
        self.allowed, self.window_s = allowed, window_s
        self.times: deque[float] = deque()
        self.total = 0

    def spend(self, now: float) -> bool:
        """Record one restart at `now`; False, recording nothing, when none is left."""
        while self.times and self.times[0] <= now - self.window_s:
            self.times.popleft()
        if len(self.times) >= self.allowed:
            return False
        self.times.append(now)
        self.total += 1
        return True


@dataclass(frozen=True)
class Unit:
    """One process (or flow run) as the policy knows it. A restart runs the same unit again; a
    new learner attempt runs new units (the same names, the next `attempt`)."""

    kind: Kind
    name: str  # learner (learner-node<k> of several nodes), gen<i>, eval, scorer-<name>
    index: int = 0  # the generator's index; the learner node's rank; the scorer's
    attempt: int = 0  # the learner attempt it belongs to (1, 2, …); 0 for the others


@dataclass(frozen=True)
class Failure:
    """A unit that ended in failure, and its restart budget after that."""

    unit: Unit
    cause: str  # how it ended, in the backend's words
    restarts: int  # restarts spent over its life (the learner's: attempts after the first)
    recent: int  # of those, within the window
    allowed: int  # restarts allowed within the window
    window_s: float
    deterministic: bool = False  # a restart would fail the same way: none was tried


# -- events: what a backend tells the policy ------------------------------------------------


@dataclass(frozen=True)
class Ended:
    """A unit's process or flow run ended: `completed` (exit code 0, Prefect's Completed) or
    not, at `at` (the backend's clock). `stop_requested`: the run's stop marker, or the unit's
    own, existed when it ended."""

    unit: Unit
    completed: bool
    at: float
    cause: str = ""  # "exit code 3", "gen0 (crashed: node lost)"
    stop_requested: bool = False
    # A learner that refused the run or stopped because another learner holds its lease
    # (`storage.control.lease`): restarting it (taking the run over) would displace that learner.
    displaced: bool = False
    # It failed as a restart would fail again (USER_CODE_EXIT_CODE, or NOT_RESTARTED in a flow
    # run's state message); `cause` says why, in the unit's own words.
    deterministic: bool = False
    # It stopped on a signal sent to it from outside (SIGTERM, Ctrl-C to its process or a rank),
    # its work saved (`STOPPED_FROM_OUTSIDE`).
    signalled: bool = False


@dataclass(frozen=True)
class Tick:
    """Time has passed: deadlines (fencing a failed attempt, the finishing grace) are due."""

    at: float


@dataclass(frozen=True)
class TargetGenerators:
    """The run is asked for `count` generators (`streamrl scale`)."""

    count: int


@dataclass(frozen=True)
class Interrupted:
    """The run is stopped from outside (Ctrl-C, SIGTERM, its flow run cancelled)."""

    reason: str


Event = Ended | Tick | TargetGenerators | Interrupted


# -- actions: what the policy asks a backend to do -------------------------------------------


@dataclass(frozen=True)
class Start:
    """Start `units`: the first ones, a restart (`restart`: the failure it replaces), or every
    node of a new learner attempt. `take_over`: the previous process of the unit has ended, so
    it takes that one's lease over at once (the learner's on the run, a generator's on its
    index) instead of waiting for it to lapse."""

    units: tuple[Unit, ...]
    take_over: bool = False
    restart: Failure | None = None


@dataclass(frozen=True)
class ScaleOut:
    """Start `count` generators on new indexes (scaling out to `wanted`): the backend claims
    each index and registers it with `SupervisionPolicy.add_generator`."""

    count: int
    wanted: int


@dataclass(frozen=True)
class StopGenerator:
    """Ask `unit` to flush its open segment and stop (its own stop marker): scaling in."""

    unit: Unit
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Stop `units` now; each one's end is still reported (`Ended`)."""

    units: tuple[Unit, ...]
    reason: str


@dataclass(frozen=True)
class Finish:
    """The learner completed: the others flush and end; a `Tick` at `deadline` cancels what is
    left (a backend with no poll loop of its own schedules one)."""

    deadline: float


@dataclass(frozen=True)
class Abort:
    """Stop the run now: its stop marker, then everything still running. `failure`: the unit
    that failed for good, when that is why; `interrupted`: a stop asked for from outside (a
    signal to a learner), not a failure."""

    reason: str
    failure: Failure | None = None
    interrupted: bool = False


Action = Start | ScaleOut | StopGenerator | Cancel | Finish | Abort


class SupervisionPolicy:
    """The restart rules (module docstring) for one supervisor's units: a learner of
    `learner_nodes` nodes (0: none), generators `generators`, the evaluator when `evaluator`,
    and the served scorers named `scorers` (process names; a scorer's index is its position).

    `start()` gives the first `Start` actions; then `handle(event)` consumes each `Event` as it
    happens and returns the `Action`s it calls for, in order. It owns every restart budget, the
    learner's attempt number and what is live (started, not yet reported ended); `done` says
    when the run has finished."""

    def __init__(
        self,
        *,
        learner_nodes: int = 0,
        generators: Iterable[int] = (),
        evaluator: bool = False,
        learner_retries: int = 0,
        generator_retries: int = 0,
        generator_window_s: float = math.inf,
        evaluator_retries: int = 0,
        scorers: Sequence[str] = (),
        scorer_retries: int = 0,
        finish_grace_s: float = FINISH_GRACE_S,
        fence_after_s: float = FENCE_AFTER_S,
    ) -> None:
        self.learner_nodes = learner_nodes
        self.generator_retries, self.generator_window_s = generator_retries, generator_window_s
        self.finish_grace_s, self.fence_after_s = finish_grace_s, fence_after_s
        self.attempt = 1
        self.learner_attempts = RestartBudget(learner_retries)
        self.budgets: dict[str, RestartBudget] = {}  # the generators' and the evaluator's
        self.live: set[Unit] = set()  # started, and not reported ended yet
        self.finish_deadline: float | None = None
        self.aborted = False
        self._stopping: set[Unit] = set()  # asked to stop or cancelled: their end is expected
        self._completed_nodes: set[Unit] = set()  # of the current attempt
        self._attempt_failure: Failure | None = None  # the next attempt is due, after it
        self._attempt_failed_at = 0.0
        self._awaited: set[Unit] = set()  # the failed attempt's nodes that the next one awaits
        self._leftovers_cancelled = False
        self._scorers_cancelled = False
        self._first: list[Start] = []
        for index, name in enumerate(scorers):  # first: the others call them
            self.budgets[name] = RestartBudget(scorer_retries)
            self._first.append(Start((self._live(Unit("scorer", name, index)),)))
        if learner_nodes:
            self._first.append(Start(self._learner_attempt()))
        self._first += [Start((self.add_generator(index),)) for index in generators]
        if evaluator:
            self.budgets["eval"] = RestartBudget(evaluator_retries)
            self._first.append(Start((self._live(Unit("evaluator", "eval")),)))

    def start(self) -> list[Start]:
        """The first starts: each scorer, the learner's first attempt, each generator, the
        evaluator."""
        return list(self._first)

    def add_generator(self, index: int) -> Unit:
        """Generator `index` (a first one, or one a backend started for `ScaleOut`), live with
        a restart budget of its own."""
        unit = Unit("generator", f"gen{index}", index)
        budget = RestartBudget(self.generator_retries, self.generator_window_s)
        self.budgets.setdefault(unit.name, budget)
        return self._live(unit)

    @property
    def done(self) -> bool:
        """The learner completed and everything else has ended or was cancelled at the
        finishing deadline."""
        return self.finish_deadline is not None and (not self.live or self._leftovers_cancelled)

    def restarts(self) -> dict[str, int]:
        """Restarts so far by name: "learner" (attempts after the first), gen<i>, eval,
        scorer-<name>."""
        learner = {"learner": self.learner_attempts.total} if self.learner_nodes else {}
        return learner | {name: budget.total for name, budget in self.budgets.items()}

    def handle(self, event: Event) -> list[Action]:
        """The actions `event` calls for, in order; none once the run is aborted or done."""
        if self.aborted or self.done:
            return []
        match event:
            case Ended():
                actions = self._ended(event)
            case Tick(at=at):
                actions = self._tick(at)
            case TargetGenerators(count=count):
                actions = self._target(count)
            case Interrupted(reason=reason):
                return self._abort(reason)
        return actions + self._scorers_done()

    def _scorers_done(self) -> list[Action]:
        """Once the run is finishing and only scorers are left, nothing will call them."""
        if self.finish_deadline is None or self.aborted or self._leftovers_cancelled:
            return []
        scorers = {u for u in self.live if u.kind == "scorer"}
        if not scorers or scorers != self.live or self._scorers_cancelled:
            return []
        self._scorers_cancelled = True
        return [Cancel(_ordered(scorers), "the run finished: nothing left to score for")]

    # -- rules ------------------------------------------------------------------------------

    def _ended(self, event: Ended) -> list[Action]:
        unit = event.unit
        if unit not in self.live:
            return []  # not ours, or reported before: every end is handled once
        self.live.remove(unit)
        asked = unit in self._stopping
        self._stopping.discard(unit)
        if unit.kind == "learner":
            return self._learner_node_ended(event)
        if event.displaced:  # another generator holds its index: that one serves it
            return []
        # A scorer serves until it is stopped: one that ends by itself has failed.
        completed = event.completed and unit.kind != "scorer"
        if completed or asked or event.stop_requested or self.finish_deadline is not None:
            return []
        if event.deterministic:
            budget = self.budgets[unit.name]
            failure = Failure(
                unit, event.cause, budget.total, len(budget.times), budget.allowed,
                budget.window_s, deterministic=True,
            )  # fmt: skip
            return self._abort(f"{unit.name} cannot run ({event.cause}); {NOT_RESTARTED}", failure)
        spent, failure = self._spend(self.budgets[unit.name], event)
        if not spent:
            return self._abort(f"{unit.name} failed for good", failure)
        return [Start((self._live(unit),), take_over=True, restart=failure)]

    def _learner_node_ended(self, event: Ended) -> list[Action]:
        node = event.unit
        if node.attempt != self.attempt:  # a node of a failed attempt: it has now ended
            return self._start_next_attempt(event.at)
        if event.displaced:
            cause = f"{event.cause}: {DISPLACED}, one learner per run"
            failure = Failure(node, cause, self.learner_attempts.total, 0, 0, math.inf)
            return self._abort(DISPLACED, failure)
        if event.signalled and not event.completed:
            self.aborted = True
            return [
                Abort(f"the learner was {STOPPED_FROM_OUTSIDE} ({event.cause})", interrupted=True)
            ]
        if event.deterministic:  # its data cannot be used: another attempt would fail the same
            failure = Failure(node, event.cause, self.learner_attempts.total, 0, 0, math.inf,
                              deterministic=True)  # fmt: skip
            return self._abort(f"the learner cannot run ({event.cause}); {NOT_RESTARTED}", failure)
        if event.completed:
            self._completed_nodes.add(node)
            if len(self._completed_nodes) < self.learner_nodes:
                return []
            self.finish_deadline = event.at + self.finish_grace_s
            self._stopping |= self.live
            return [Finish(self.finish_deadline)]
        spent, failure = self._spend(self.learner_attempts, event)
        if not spent:
            return self._abort("the learner failed for good", failure)
        self.attempt += 1
        self._completed_nodes.clear()
        self._attempt_failure, self._attempt_failed_at = failure, event.at
        self._awaited = {u for u in self.live if u.kind == "learner" and u not in self._stopping}
        self._stopping |= self._awaited
        reason = f"{node.name} of the same learner attempt ended"
        cancel: list[Action] = [Cancel(_ordered(self._awaited), reason)] if self._awaited else []
        return cancel + self._start_next_attempt(event.at)

    def _start_next_attempt(self, at: float) -> list[Action]:
        """The next learner attempt, once no node of an earlier one is live, or once
        `fence_after_s` have passed since the failure."""
        failure = self._attempt_failure
        if failure is None:
            return []
        if self._awaited & self.live and at < self._attempt_failed_at + self.fence_after_s:
            return []
        self._attempt_failure = None
        return [Start(self._learner_attempt(), take_over=True, restart=failure)]

    def _tick(self, at: float) -> list[Action]:
        if self.finish_deadline is None:
            return self._start_next_attempt(at)
        if at < self.finish_deadline:
            return []
        self._leftovers_cancelled = True
        reason = f"still running {self.finish_grace_s:.0f}s after the learner completed"
        return [Cancel(_ordered(self.live), reason)]

    def _target(self, count: int) -> list[Action]:
        if self.finish_deadline is not None:
            return []
        running = _ordered(u for u in self.live - self._stopping if u.kind == "generator")
        if count > len(running):
            return [ScaleOut(count - len(running), count)]
        newest = running[count:]
        self._stopping.update(newest)
        return [StopGenerator(unit, f"scaled in to {count} generators") for unit in newest]

    def _abort(self, reason: str, failure: Failure | None = None) -> list[Action]:
        self.aborted = True
        return [Abort(reason, failure)]

    # -- bookkeeping ------------------------------------------------------------------------

    def _learner_attempt(self) -> tuple[Unit, ...]:
        """Every node of the current attempt, live."""
        n = self.learner_nodes
        return tuple(
            self._live(
                Unit("learner", "learner" if n == 1 else f"learner-node{k}", k, self.attempt)
            )
            for k in range(n)
        )

    def _live(self, unit: Unit) -> Unit:
        self.live.add(unit)
        return unit

    @staticmethod
    def _spend(budget: RestartBudget, event: Ended) -> tuple[bool, Failure]:
        spent = budget.spend(event.at)
        failure = Failure(
            event.unit, event.cause, budget.total, len(budget.times), budget.allowed,
            budget.window_s,
        )  # fmt: skip
        return spent, failure


def _ordered(units: Iterable[Unit]) -> tuple[Unit, ...]:
    """Oldest attempt first, then by index: a stable order for actions."""
    return tuple(sorted(units, key=lambda u: (u.attempt, u.kind, u.index)))
