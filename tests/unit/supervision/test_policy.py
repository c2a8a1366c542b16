"""The restart rules (`streamrl.supervision.policy.SupervisionPolicy`) as plain functions: events
in, actions out, carried out by a fake backend that only starts, cancels and reports ends, as the
process and work-pool backends do."""

from __future__ import annotations

import pytest

from streamrl.supervision.policy import (
    FENCE_AFTER_S,
    FINISH_GRACE_S,
    NOT_RESTARTED,
    Abort,
    Action,
    Cancel,
    Ended,
    Event,
    Finish,
    Interrupted,
    RestartBudget,
    ScaleOut,
    Start,
    StopGenerator,
    SupervisionPolicy,
    TargetGenerators,
    Tick,
    Unit,
)


class FakeBackend:
    """What runs (`running`), every action in order (`actions`); a `ScaleOut` is given the
    next free indexes, as `claim_generator_index` would."""

    def __init__(self, policy: SupervisionPolicy, next_index: int = 100) -> None:
        self.policy, self.next_index = policy, next_index
        self.running: set[Unit] = set()
        self.actions: list[Action] = []
        self.carry_out(policy.start())

    def feed(self, event: Event) -> list[Action]:
        actions = self.policy.handle(event)
        self.carry_out(actions)
        return actions

    def end(self, unit: Unit, at: float = 0.0, *, completed: bool = False, **kw) -> list[Action]:
        self.running.discard(unit)
        return self.feed(Ended(unit, completed, at, f"{unit.name} ended", **kw))

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            self.actions.append(action)
            match action:
                case Start(units=units):
                    self.running.update(units)
                case ScaleOut(count=count):
                    for _ in range(count):
                        self.running.add(self.policy.add_generator(self.next_index))
                        self.next_index += 1

    def learner(self) -> list[Unit]:
        return sorted((u for u in self.running if u.kind == "learner"), key=lambda u: u.index)

    def starts(self) -> list[Start]:
        return [a for a in self.actions if isinstance(a, Start)]


def _two_node_learner(retries: int = 1) -> FakeBackend:
    return FakeBackend(SupervisionPolicy(learner_nodes=2, learner_retries=retries))


def test_a_restart_budget_counts_restarts_within_its_window():
    window = RestartBudget(2, window_s=10.0)
    assert window.spend(0.0)
    assert window.spend(5.0)
    assert not window.spend(9.0)  # two within 10 s already
    assert window.spend(10.5)  # the first has left the window
    assert window.total == 3


def test_the_first_starts_are_the_learners_attempt_every_generator_and_the_evaluator():
    policy = SupervisionPolicy(learner_nodes=2, generators=[0, 1], evaluator=True)
    assert [[u.name for u in start.units] for start in policy.start()] == [
        ["learner-node0", "learner-node1"],
        ["gen0"],
        ["gen1"],
        ["eval"],
    ]
    assert {u.attempt for u in policy.start()[0].units} == {1}
    assert not any(start.take_over or start.restart for start in policy.start())


def test_both_nodes_failing_before_one_poll_spend_one_attempt():
    backend = _two_node_learner(retries=1)
    node0, node1 = backend.learner()
    backend.end(node1, at=1.0)  # gloo: node 0 fails within seconds of node 1
    backend.end(node0, at=1.0)
    (_, retry) = backend.starts()
    assert [u.attempt for u in retry.units] == [2, 2]
    assert retry.take_over
    assert retry.restart.unit == node1
    assert backend.policy.restarts() == {"learner": 1}
    assert not [a for a in backend.actions if isinstance(a, Abort)]
    assert not [a for a in backend.actions if isinstance(a, Cancel) and set(a.units) - {node0}]


def test_every_node_of_a_failed_attempt_is_handled_once_and_stale_ends_change_nothing():
    backend = _two_node_learner(retries=2)
    node0, node1 = backend.learner()
    backend.end(node1)
    assert backend.feed(Ended(node1, False, 1.0)) == []  # reported twice
    backend.end(node0)  # cancelled: it has ended
    assert backend.feed(Ended(node0, True, 2.0)) == []  # an old attempt's late report
    assert [u.attempt for u in backend.learner()] == [2, 2]
    assert backend.policy.restarts() == {"learner": 1}


def test_a_new_attempt_starts_only_once_the_old_nodes_have_ended():
    backend = _two_node_learner()
    node0, node1 = backend.learner()
    assert backend.end(node1, at=10.0) == [
        Cancel((node0,), "learner-node1 of the same learner attempt ended")
    ]
    assert backend.feed(Tick(10.0 + FENCE_AFTER_S / 2)) == []  # node 0 is still cancelling
    (started,) = backend.end(node0, at=20.0)
    assert isinstance(started, Start)
    assert [u.name for u in started.units] == ["learner-node0", "learner-node1"]
    assert started.take_over


def test_nodes_still_cancelling_after_the_fencing_delay_are_fenced_by_the_next_attempt():
    backend = _two_node_learner(retries=2)
    node0, node1 = backend.learner()
    backend.end(node1, at=10.0)
    assert backend.feed(Tick(10.0 + FENCE_AFTER_S - 0.1)) == []
    (started,) = backend.feed(Tick(10.0 + FENCE_AFTER_S))
    assert isinstance(started, Start)
    assert started.take_over
    # Fenced, node 0 is not awaited again: when attempt 2 fails, attempt 3 waits for its nodes.
    second0, second1 = started.units
    assert backend.end(second0, at=200.0) == [
        Cancel((second1,), "learner-node0 of the same learner attempt ended")
    ]
    (third,) = backend.end(second1, at=201.0)
    assert isinstance(third, Start)
    assert [u.attempt for u in third.units] == [3, 3]
    assert backend.end(node0, at=500.0) == []  # the fenced node's end, when it comes


def test_a_learner_out_of_attempts_aborts_the_run_and_nothing_follows():
    backend = _two_node_learner(retries=1)
    node0, node1 = backend.learner()
    backend.end(node0)
    backend.end(node1)
    (abort,) = backend.end(backend.learner()[0], at=5.0)
    assert isinstance(abort, Abort)
    assert abort.failure.unit.attempt == 2
    assert abort.failure.restarts == 1
    assert backend.feed(Tick(1e6)) == []
    assert backend.feed(TargetGenerators(3)) == []


def test_a_learner_displaced_by_another_learner_aborts_without_a_take_over():
    """A restart would take the run's lease over from the learner that now holds it."""
    backend = _two_node_learner(retries=3)
    node0, _ = backend.learner()
    (abort,) = backend.end(node0, at=1.0, displaced=True)
    assert isinstance(abort, Abort)
    assert "another learner holds the run's lease" in abort.reason
    assert abort.failure.unit == node0
    assert len(backend.starts()) == 1  # the first start only: no take-over attempt


def test_a_learner_stopped_from_outside_stops_the_run_as_an_interrupt_not_a_failure():
    """SIGTERM to a learner rank alone: it checkpointed and stopped; another attempt would undo
    the stop someone asked for, and nothing failed."""
    backend = _two_node_learner(retries=3)
    node0, _ = backend.learner()
    (abort,) = backend.end(node0, at=1.0, signalled=True)
    assert isinstance(abort, Abort)
    assert abort.interrupted
    assert abort.failure is None
    assert abort.reason.startswith("the learner was stopped from outside (")
    assert len(backend.starts()) == 1
    assert backend.end(backend.learner()[0], at=2.0) == []  # aborted: nothing follows


def test_a_learner_that_cannot_use_its_data_aborts_without_another_attempt():
    """A supervised run's conversation that cannot be trained on fails every attempt alike."""
    backend = _two_node_learner(retries=3)
    node0, _ = backend.learner()
    (abort,) = backend.end(node0, at=1.0, deterministic=True)
    assert isinstance(abort, Abort)
    assert abort.reason.startswith("the learner cannot run (")
    assert abort.failure.deterministic
    assert len(backend.starts()) == 1  # the first start only


def test_a_generator_is_restarted_until_its_window_is_full():
    policy = SupervisionPolicy(generators=[0], generator_retries=2, generator_window_s=100.0)
    backend = FakeBackend(policy)
    (gen0,) = backend.running
    for at in (0.0, 50.0):
        (restart,) = backend.end(gen0, at)
        assert isinstance(restart, Start)
        assert restart.units == (gen0,)
    assert restart.restart.restarts == 2
    assert restart.restart.recent == 2
    (abort,) = backend.end(gen0, 60.0)  # a third loss within 100 s
    assert isinstance(abort, Abort)
    assert abort.failure.allowed == 2


def test_a_generator_that_completed_or_was_asked_to_stop_is_not_restarted():
    backend = FakeBackend(SupervisionPolicy(generators=[0, 1, 2], generator_retries=3))
    gen0, gen1, gen2 = sorted(backend.running, key=lambda u: u.index)
    assert backend.end(gen0, completed=True) == []
    assert backend.end(gen1, stop_requested=True) == []  # the run's stop marker, or its own
    (stop,) = backend.feed(TargetGenerators(0))  # scaled in: gen2 flushes and stops
    assert stop == StopGenerator(gen2, "scaled in to 0 generators")
    assert backend.end(gen2) == []
    assert backend.policy.restarts() == {"gen0": 0, "gen1": 0, "gen2": 0}


def test_a_generator_that_would_fail_the_same_way_again_stops_the_run_at_once():
    """Its reward or environment cannot be resolved (a module not found): restarting it
    `generator_retries` times would print the same error each time."""
    backend = FakeBackend(SupervisionPolicy(generators=[0, 1], generator_retries=3))
    gen0, _ = sorted(backend.running, key=lambda u: u.index)
    (abort,) = backend.end(gen0, at=1.0, deterministic=True)
    assert isinstance(abort, Abort)
    assert abort.reason == f"gen0 cannot run (gen0 ended); {NOT_RESTARTED}"  # its cause
    assert abort.failure.unit == gen0
    assert abort.failure.deterministic
    assert len(backend.starts()) == 2  # the first starts only
    assert backend.policy.restarts() == {"gen0": 0, "gen1": 0}
    assert backend.feed(Tick(1e6)) == []  # the run is stopping: nothing follows


def test_a_generator_ending_so_after_the_learner_completed_changes_nothing():
    backend = FakeBackend(SupervisionPolicy(learner_nodes=1, generators=[0]))
    (learner,) = backend.learner()
    (gen0,) = (u for u in backend.running if u.kind == "generator")
    backend.end(learner, completed=True)
    assert backend.end(gen0, deterministic=True) == []


def test_scaling_out_adds_new_indexes_and_scaling_in_stops_the_newest():
    backend = FakeBackend(SupervisionPolicy(generators=[0, 1]), next_index=5)
    assert backend.feed(TargetGenerators(4)) == [ScaleOut(2, 4)]
    assert sorted(u.index for u in backend.running) == [0, 1, 5, 6]
    assert backend.feed(TargetGenerators(4)) == []
    stops = backend.feed(TargetGenerators(1))
    assert [a.unit.name for a in stops if isinstance(a, StopGenerator)] == ["gen1", "gen5", "gen6"]
    assert backend.feed(TargetGenerators(1)) == []  # those stopping are not counted twice


def test_the_learner_completing_finishes_with_grace_then_cancels_what_is_left():
    policy = SupervisionPolicy(learner_nodes=1, generators=[0, 1], evaluator=True,
                               generator_retries=3)  # fmt: skip
    backend = FakeBackend(policy)
    (learner,) = backend.learner()
    assert backend.end(learner, at=10.0, completed=True) == [Finish(10.0 + FINISH_GRACE_S)]
    gen0, gen1 = sorted((u for u in backend.running if u.kind == "generator"), key=lambda u: u.name)
    assert backend.end(gen0, at=11.0) == []  # failing while finishing: not restarted
    assert backend.end(gen1, at=12.0, completed=True) == []
    assert backend.feed(Tick(10.0 + FINISH_GRACE_S - 1)) == []
    assert not policy.done
    (cancel,) = backend.feed(Tick(10.0 + FINISH_GRACE_S))
    assert isinstance(cancel, Cancel)
    assert [u.name for u in cancel.units] == ["eval"]
    assert policy.done


def test_the_run_is_done_as_soon_as_everything_ended_after_the_learner():
    policy = SupervisionPolicy(learner_nodes=1, generators=[0])
    backend = FakeBackend(policy)
    (learner,) = backend.learner()
    backend.end(learner, completed=True)
    assert not policy.done
    backend.end(next(iter(backend.running)), completed=True)
    assert policy.done


@pytest.mark.parametrize("retries", [0, 3])
def test_an_interrupted_run_aborts_and_restarts_nothing_after(retries):
    backend = FakeBackend(SupervisionPolicy(generators=[0], generator_retries=retries))
    assert backend.feed(Interrupted("Ctrl-C")) == [Abort("Ctrl-C")]
    assert backend.end(next(iter(backend.running))) == []


# -- served scorers ---------------------------------------------------------------------------


def _with_scorer(retries: int = 1) -> FakeBackend:
    return FakeBackend(
        SupervisionPolicy(
            learner_nodes=1, generators=[0], scorers=["scorer-teacher"], scorer_retries=retries
        )
    )


def _unit(backend: FakeBackend, kind: str) -> Unit:
    return next(u for u in backend.running if u.kind == kind)


def test_scorers_start_first_and_a_failed_one_is_restarted_within_its_budget():
    backend = _with_scorer(retries=1)
    assert [u.name for u in backend.starts()[0].units] == ["scorer-teacher"]
    scorer = _unit(backend, "scorer")
    (restart,) = backend.end(scorer, at=1.0)
    assert isinstance(restart, Start)
    assert restart.units == (scorer,)
    assert backend.policy.restarts()["scorer-teacher"] == 1
    (abort,) = backend.end(scorer, at=2.0)
    assert isinstance(abort, Abort)
    assert "scorer-teacher failed for good" in abort.reason


def test_a_scorer_that_cannot_run_aborts_the_run_at_once():
    backend = _with_scorer(retries=3)
    (abort,) = backend.end(_unit(backend, "scorer"), deterministic=True)
    assert isinstance(abort, Abort)
    assert NOT_RESTARTED in abort.reason


def test_scorers_serve_until_nothing_else_runs_once_the_learner_completed():
    backend = _with_scorer()
    scorer, generator = _unit(backend, "scorer"), _unit(backend, "generator")
    actions = backend.end(_unit(backend, "learner"), at=10.0, completed=True)
    assert [type(a) for a in actions] == [Finish]  # the generator still flushes: keep serving
    (cancel,) = backend.end(generator, at=12.0, completed=True)
    assert cancel == Cancel((scorer,), "the run finished: nothing left to score for")
    assert not backend.policy.done
    assert backend.end(scorer, at=13.0) == []  # cancelled: not restarted
    assert backend.policy.done


def test_a_scorer_that_ends_by_itself_is_restarted_even_with_exit_code_zero():
    """vLLM's server exits 0 when its engine died: a scorer's end is a failure until the run
    is finishing or stops it."""
    backend = _with_scorer(retries=2)
    scorer = _unit(backend, "scorer")
    (restart,) = backend.end(scorer, at=1.0, completed=True)
    assert isinstance(restart, Start)
    assert restart.units == (scorer,)
