"""The supervision of a run placed on work pools (`flows.pools.PoolSupervisor`) against a real
Prefect server: which flow runs it starts, on which deployments, with which job variables, and
what it does when their states change. No worker runs here: the test moves the children's
states as a worker (or a lost spot node) would; the whole thing with workers and real processes
is tests/e2e/test_pools.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Completed, Crashed, Failed, Running
from prefect.testing.utilities import prefect_test_harness
from prefect.workers.process import ProcessWorker

from flows.pools import PoolError, PoolSupervisor, job_variables
from storage.control.requests import request_stop, set_requested_generators, stop_requested
from streamrl.config.loading import load_config
from streamrl.config.stored import prepare_run
from streamrl.supervision.policy import FENCE_AFTER_S, NOT_RESTARTED
from streamrl.supervision.supervisor import ComponentFailedError

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
K8S_TEMPLATE = json.loads((ROOT / "deploy" / "k8s" / "gpu-pool.json").read_text())


@pytest.fixture(scope="module")
def client():
    with (
        prefect_test_harness(server_startup_timeout=120),
        get_client(sync_client=True) as client,
    ):
        process = ProcessWorker.get_default_base_job_template()
        client.create_work_pool(WorkPoolCreate(name="generators", base_job_template=process))
        client.create_work_pool(
            WorkPoolCreate(name="k8s-gpu", type="kubernetes", base_job_template=K8S_TEMPLATE)
        )
        for flow, pool in (
            ("learner", "k8s-gpu"),
            ("generator", "generators"),
            ("scorer", "k8s-gpu"),
        ):
            client.create_deployment(
                client.create_flow_from_name(flow), "default", work_pool_name=pool
            )
        yield client


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fleet(client, tmp_path, *overrides: str, generators=2, retries=2, learner_retries=1):
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={tmp_path / 'run'}",
            "placement.mode=pools",
            "placement.learner_pool=k8s-gpu",
            "learner.device=cuda",
            "learner.nproc_per_node=4",
            "placement.retry_window_s=100",
            "placement.env={STREAMRL_TEST: 'yes'}",
            *overrides,
        ],
    )
    config, _ = prepare_run(config)
    clock = Clock()
    fleet = PoolSupervisor(
        config,
        client,
        generators=generators,
        generator_retries=retries,
        learner_retries=learner_retries,
        clock=clock,
    )
    return fleet, clock


def _set(client, child, state) -> None:
    client.set_flow_run_state(child.flow_run_id, state, force=True)


def _named(fleet, name: str):
    """The newest child called `name`."""
    return [c for c in fleet.children if c.name == name][-1]


def test_job_variables_are_those_the_pool_declares():
    config = load_config(
        overrides=["placement.mode=pools", "placement.image=registry/streamrl:cuda",
                   "generator.tensor_parallel_size=2",
                   "learner.nproc_per_node=8", "placement.env={A: b}"]
    )  # fmt: skip
    k8s = set(K8S_TEMPLATE["variables"]["properties"])
    assert job_variables(config, "learner", k8s) == {
        "gpu_count": 8,
        "image": "registry/streamrl:cuda",
        "env": {"A": "b"},
    }
    assert job_variables(config, "generator", k8s)["gpu_count"] == 2
    process = set(ProcessWorker.get_default_base_job_template()["variables"]["properties"])
    assert job_variables(config, "generator", process) == {"env": {"A": "b"}}
    on_cpu = load_config(overrides=["placement.mode=pools", "generator.device=cpu"])
    assert job_variables(on_cpu, "evaluator", {"gpu_count"}) == {"gpu_count": 0}


def test_children_start_on_their_pools_and_a_lost_generator_is_replaced_until_its_budget(
    client, tmp_path
):
    fleet, clock = _fleet(client, tmp_path)
    fleet.start()
    assert [c.name for c in fleet.children] == ["learner", "gen0", "gen1"]
    learner = client.read_flow_run(_named(fleet, "learner").flow_run_id)
    assert learner.job_variables == {"gpu_count": 4, "env": {"STREAMRL_TEST": "yes"}}
    assert learner.parameters["node_rank"] == 0
    assert learner.parameters["attempt"]
    gen1 = client.read_flow_run(_named(fleet, "gen1").flow_run_id)
    assert gen1.parameters == {"run_uri": str(tmp_path / "run"), "index": 1, "retries": 0}
    assert gen1.job_variables == {"env": {"STREAMRL_TEST": "yes"}}  # a process pool: no GPUs
    assert not fleet.poll()

    first = _named(fleet, "gen0")
    _set(client, first, Crashed(message="node lost"))
    assert not fleet.poll()
    replacement = _named(fleet, "gen0")
    assert replacement.flow_run_id != first.flow_run_id
    assert fleet.restarts() == {"gen0": 1}

    clock.now = 50.0
    _set(client, replacement, Failed())
    fleet.poll()
    clock.now = 60.0  # a third loss within 100 s: gen0 failed for good, the run with it
    _set(client, _named(fleet, "gen0"), Crashed())
    with pytest.raises(ComponentFailedError, match=r"gen0 failed for good \(2 replacements"):
        fleet.poll()
    assert stop_requested(fleet.run)
    for child in fleet.children:
        state = client.read_flow_run(child.flow_run_id).state
        assert state.is_final() or state.type == StateType.CANCELLING, (child.name, state)
    assert client.read_flow_run(_named(fleet, "learner").flow_run_id).state.is_cancelled()


def test_a_generator_that_would_fail_the_same_way_again_is_not_replaced(client, tmp_path):
    """Its own supervisor (flows.generator) says so in the flow run's state message: the
    reward it was configured with cannot be resolved (USER_CODE_EXIT_CODE)."""
    fleet, _ = _fleet(client, tmp_path)
    fleet.start()
    error = "reward 'x.y:z': no module named 'x'; check the spelling"
    failed = f"ComponentFailedError: gen0 cannot run (exit code 4: {error}); {NOT_RESTARTED}"
    _set(client, _named(fleet, "gen0"), Failed(message=failed))
    with pytest.raises(ComponentFailedError, match=r"gen0 cannot run: gen0 \(failed: .*no module"):
        fleet.poll()
    assert [c.name for c in fleet.children].count("gen0") == 1  # not replaced
    assert fleet.restarts() == {}
    assert stop_requested(fleet.run)


def test_losses_spread_beyond_the_window_keep_the_fleet_going(client, tmp_path):
    fleet, clock = _fleet(client, tmp_path, generators=1, retries=1)
    fleet.start()
    for hour in range(1, 4):  # one spot loss an hour, for three hours
        clock.now = hour * 3600.0
        _set(client, _named(fleet, "gen0"), Crashed())
        fleet.poll()
    assert fleet.restarts() == {"gen0": 3}
    assert fleet.failure is None


def test_scaling_out_starts_new_indexes_and_scaling_in_stops_the_newest(client, tmp_path):
    fleet, _ = _fleet(client, tmp_path)
    fleet.start()
    set_requested_generators(fleet.run, 4)
    fleet.poll()
    assert sorted(c.name for c in fleet.live("generator")) == ["gen0", "gen1", "gen2", "gen3"]

    set_requested_generators(fleet.run, 1)
    fleet.poll()
    assert [stop_requested(fleet.run, f"gen{i}") for i in range(4)] == [False, True, True, True]
    assert not stop_requested(fleet.run)  # the run goes on
    for name in ("gen1", "gen2", "gen3"):  # each flushes and completes
        _set(client, _named(fleet, name), Completed())
    fleet.poll()
    assert [c.name for c in fleet.live("generator")] == ["gen0"]
    assert fleet.restarts() == {}  # a generator asked to stop is not replaced


def test_the_learner_completing_lets_the_generators_finish_and_ends_the_run(client, tmp_path):
    fleet, clock = _fleet(client, tmp_path)
    fleet.start()
    request_stop(fleet.run, "learner reached its steps")  # as the learner does
    _set(client, _named(fleet, "learner"), Completed())
    _set(client, _named(fleet, "gen0"), Running())
    assert not fleet.poll()
    _set(client, _named(fleet, "gen1"), Completed())
    assert not fleet.poll()  # gen0 still flushing
    clock.now = 10_000.0  # past the finish grace: gen0 is cancelled
    assert fleet.poll()
    assert client.read_flow_run(_named(fleet, "gen0").flow_run_id).state.type in (
        StateType.CANCELLING,
        StateType.CANCELLED,
    )
    assert fleet.restarts() == {}


def test_a_learner_node_lost_fails_its_attempt_and_the_next_attempt_starts_every_node(
    client, tmp_path
):
    fleet, _ = _fleet(client, tmp_path, "learner.nnodes=2", generators=0)
    fleet.start()
    nodes = fleet.live("learner")
    assert [c.name for c in nodes] == ["learner-node0", "learner-node1"]
    first_attempt = nodes[0].parameters["attempt"]
    assert nodes[1].parameters == {**nodes[0].parameters, "node_rank": 1}

    _set(client, nodes[1], Crashed(message="pod evicted"))
    fleet.poll()
    assert client.read_flow_run(nodes[0].flow_run_id).state.is_cancelled()
    retry = [c for c in fleet.live("learner") if c.parameters["attempt"] != first_attempt]
    assert [c.name for c in retry] == ["learner-node0", "learner-node1"]
    assert fleet.restarts() == {"learner": 1}

    _set(client, retry[0], Failed())
    with pytest.raises(ComponentFailedError, match="the learner failed for good"):
        fleet.poll()


def test_both_nodes_of_a_learner_ending_before_one_poll_spend_one_attempt(client, tmp_path):
    """gloo fails node 0 within seconds of node 1: both ends reach the same poll."""
    fleet, _ = _fleet(client, tmp_path, "learner.nnodes=2", generators=0)
    fleet.start()
    first = fleet.live("learner")
    for node in first:
        _set(client, node, Crashed(message="peer lost"))
    assert not fleet.poll()
    retry = fleet.live("learner")
    assert [c.name for c in retry] == ["learner-node0", "learner-node1"]
    assert len({c.parameters["attempt"] for c in first + retry}) == 2
    assert [c.parameters["take_over"] for c in first + retry] == [False, False, True, True]
    assert fleet.restarts() == {"learner": 1}
    assert fleet.failure is None


def test_the_next_learner_attempt_waits_until_the_old_nodes_have_ended(client, tmp_path):
    fleet, _ = _fleet(client, tmp_path, "learner.nnodes=2", generators=0)
    fleet.start()
    node0, node1 = fleet.live("learner")
    _set(client, node0, Running())
    _set(client, node1, Crashed(message="pod evicted"))
    fleet.poll()
    assert client.read_flow_run(node0.flow_run_id).state.type == StateType.CANCELLING
    assert fleet.live("learner") == [node0]  # still cancelling: nothing new starts beside it
    assert fleet.restarts() == {"learner": 1}

    _set(client, node0, Cancelled())
    fleet.poll()
    retry = fleet.live("learner")
    assert [c.name for c in retry] == ["learner-node0", "learner-node1"]
    assert all(c.parameters["take_over"] for c in retry)
    assert fleet.restarts() == {"learner": 1}


def test_a_node_that_never_reports_its_end_is_fenced_by_the_next_attempt(client, tmp_path):
    fleet, clock = _fleet(client, tmp_path, "learner.nnodes=2", generators=0)
    fleet.start()
    node0, node1 = fleet.live("learner")
    _set(client, node0, Running())
    _set(client, node1, Failed())
    fleet.poll()  # node 0 is cancelled; its worker never reports it cancelled
    clock.now = FENCE_AFTER_S - 1.0
    fleet.poll()
    assert fleet.live("learner") == [node0]
    clock.now = FENCE_AFTER_S
    fleet.poll()
    retry = [c for c in fleet.live("learner") if c is not node0]
    assert [c.parameters["node_rank"] for c in retry] == [0, 1]
    assert all(c.parameters["take_over"] for c in retry)  # node 0 is fenced by the take-over


def test_a_pool_without_the_deployment_is_refused_with_the_command_that_adds_it(client, tmp_path):
    fleet, _ = _fleet(client, tmp_path, "placement.generator_pool=spot")
    refused = r"`generator` flow on work pool 'spot'.*-n join_run/default --pool spot"
    with pytest.raises(PoolError, match=refused):
        fleet.start()
    assert fleet.children == []


def test_a_served_scorer_runs_on_its_pool_is_replaced_when_lost_and_ends_last(client, tmp_path):
    """A teacher the run serves: its own flow run on placement.scorer_pool with its GPUs, the
    learner's index-free parameters; replaced when its node is lost; cancelled once the
    learner completed and the generators have flushed (nothing left to score for)."""
    teacher = (
        "algorithm.opd.lambda_rl=1.0", "generator.teacher=teacher",
        "scorers.teacher.model=tiny-qwen2", "scorers.teacher.device=cuda",
        "scorers.teacher.tensor_parallel_size=2", "placement.scorer_pool=k8s-gpu",
    )  # fmt: skip
    fleet, _ = _fleet(client, tmp_path, *teacher, generators=1)
    fleet.start()
    assert [c.name for c in fleet.children] == ["scorer-teacher", "learner", "gen0"]
    scorer = client.read_flow_run(_named(fleet, "scorer-teacher").flow_run_id)
    assert scorer.parameters == {"run_uri": str(tmp_path / "run"), "index": 0}
    assert scorer.job_variables == {"gpu_count": 2, "env": {"STREAMRL_TEST": "yes"}}

    _set(client, _named(fleet, "scorer-teacher"), Crashed(message="node lost"))
    fleet.poll()
    assert fleet.restarts() == {"scorer-teacher": 1}
    replacement = _named(fleet, "scorer-teacher")
    assert replacement.flow_run_id != scorer.id

    request_stop(fleet.run, "learner reached its steps")
    _set(client, _named(fleet, "learner"), Completed())
    _set(client, replacement, Running())
    assert not fleet.poll()  # gen0 still flushes: the teacher keeps serving
    assert client.read_flow_run(replacement.flow_run_id).state.type == StateType.RUNNING
    _set(client, _named(fleet, "gen0"), Completed())
    fleet.poll()
    assert client.read_flow_run(replacement.flow_run_id).state.type in (
        StateType.CANCELLING,
        StateType.CANCELLED,
    )
    assert fleet.restarts() == {"scorer-teacher": 1}
