"""The Docker pools' API gate (deploy/docker/api_gate.py) decides as an attacker in a container
would probe it: credentials that are not a flow run's own, calls about other flow runs, writes
that name another flow run, events about others, a subscription to everyone's events. The gate
in front of a real Prefect server is tests/e2e/test_api_gate.py."""

from __future__ import annotations

import json
import uuid

import pytest

from deploy.docker.api_gate import (
    FlowRunScope,
    _checked_message,
    _own_event,
    allowed,
    flow_run_credential,
    flow_run_of,
)

KEY = b"k" * 32
OWN = uuid.uuid4()
OTHER = uuid.uuid4()
SCOPE = FlowRunScope(
    flow_run_id=OWN,
    deployment_id=str(uuid.uuid4()),
    flow_id=str(uuid.uuid4()),
    work_queue_id=str(uuid.uuid4()),
    work_pool_name="generators",
)


def test_a_credential_names_its_flow_run_and_cannot_be_forged_or_moved():
    credential = flow_run_credential(KEY, OWN)
    assert flow_run_of(KEY, credential) == OWN
    mac = credential.partition(":")[2]
    for forged in (
        f"{OTHER}:{mac}",  # another flow run's id with this one's mac
        flow_run_credential(b"x" * 32, OWN),  # another key
        f"{OWN}:{mac[:-1]}0" if mac[-1] != "0" else f"{OWN}:{mac[:-1]}1",
        f"{OWN}:",
        "admin:the-servers-credential",
        str(OWN),
        "",
        None,
        f"{credential}:extra",
    ):
        assert flow_run_of(KEY, forged) is None, forged


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/api/admin/version", None),
        ("GET", "/api/csrf-token", None),
        ("GET", f"/api/flow_runs/{OWN}", None),
        ("PATCH", f"/api/flow_runs/{OWN}", {"flow_version": "1"}),
        ("POST", f"/api/flow_runs/{OWN}/set_state", {"state": {"type": "RUNNING"}}),
        ("POST", "/api/flow_runs/filter", {"flow_runs": {"id": {"any_": [str(OWN)]}}}),
        ("POST", "/api/logs/", [{"flow_run_id": str(OWN), "message": "hi"}]),
        ("GET", f"/api/deployments/{SCOPE.deployment_id}", None),
        ("GET", f"/api/flows/{SCOPE.flow_id}", None),
        ("GET", f"/api/work_queues/{SCOPE.work_queue_id}", None),
        ("GET", "/api/work_pools/generators", None),
    ],
)
def test_what_a_flow_run_does_for_itself_is_allowed(method, path, body):
    assert allowed(SCOPE, method, path, body)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        # starting flow runs, anywhere: the `local` pool runs them on the host
        ("POST", f"/api/deployments/{SCOPE.deployment_id}/create_flow_run", {}),
        ("POST", f"/api/deployments/{uuid.uuid4()}/create_flow_run", {}),
        ("POST", "/api/flow_runs/", {"flow_id": SCOPE.flow_id}),
        ("POST", "/api/deployments/", {}),
        # other flow runs
        ("GET", f"/api/flow_runs/{OTHER}", None),
        ("PATCH", f"/api/flow_runs/{OTHER}", {}),
        ("POST", f"/api/flow_runs/{OTHER}/set_state", {"state": {"type": "CANCELLING"}}),
        ("DELETE", f"/api/flow_runs/{OWN}", None),
        # its own job variables: rescheduled, it would come back with the host's disk mounted
        ("PATCH", f"/api/flow_runs/{OWN}", {"job_variables": {"volumes": ["/:/host"]}}),
        ("PATCH", f"/api/flow_runs/{OWN}", {"flow_version": "1", "parameters": {}}),
        ("PATCH", f"/api/flow_runs/{OWN}", None),
        ("POST", "/api/flow_runs/filter", {}),
        ("POST", "/api/flow_runs/filter", {"flow_runs": {"id": {"any_": [str(OWN), str(OTHER)]}}}),
        (
            "POST",
            "/api/flow_runs/filter",
            {"flow_runs": {"id": {"any_": [str(OWN)]}}, "flows": {}}
            | {"deployments": {"id": {"any_": [SCOPE.deployment_id]}}},
        ),
        ("POST", "/api/logs/", [{"flow_run_id": str(OTHER), "message": "forged"}]),
        ("POST", "/api/logs/", [{"flow_run_id": str(OWN)}, {"flow_run_id": None}]),
        ("POST", "/api/logs/", {"flow_run_id": str(OWN)}),
        # what else the server's credential reaches
        ("GET", f"/api/deployments/{uuid.uuid4()}", None),
        ("POST", "/api/deployments/filter", {}),
        ("GET", "/api/work_pools/local", None),
        ("PATCH", "/api/work_pools/generators", {}),
        ("POST", "/api/block_documents/filter", {}),
        ("POST", "/api/variables/filter", {}),
        ("POST", "/api/automations/", {}),
        ("GET", "/api/admin/settings", None),
        # paths that only look like allowed ones
        ("GET", f"/api/flow_runs/{OWN}/../{OTHER}", None),
        ("GET", f"/api/flow_runs/{OWN}x", None),
        ("GET", f"/flow_runs/{OWN}", None),
        ("GET", f"/api/api/flow_runs/{OWN}", None),
    ],
)
def test_anything_else_is_refused(method, path, body):
    assert not allowed(SCOPE, method, path, body)


def _event(name: str, resource: str, related: list[str] = (), payload: dict | None = None):
    return {
        "event": name,
        "resource": {"prefect.resource.id": resource},
        "related": [{"prefect.resource.id": r, "prefect.resource.role": "x"} for r in related],
        "payload": payload or {},
    }


def test_events_about_this_flow_run_and_its_task_runs_pass_and_others_are_dropped():
    own, other = f"prefect.flow-run.{OWN}", f"prefect.flow-run.{OTHER}"
    task = f"prefect.task-run.{uuid.uuid4()}"
    mine = {"task_run": {"flow_run_id": str(OWN)}}
    assert _own_event(SCOPE, _event("prefect.flow-run.heartbeat", own))
    assert _own_event(SCOPE, _event("prefect.task-run.Running", task, [own], mine))
    runner = "prefect.runner.standalone"  # the runner in the container, cancelling its flow run
    assert _own_event(SCOPE, _event("prefect.runner.cancelled-flow-run", runner, [own]))
    assert not _own_event(SCOPE, _event("prefect.runner.cancelled-flow-run", runner, [other]))
    assert not _own_event(SCOPE, _event("prefect.runner.cancelled-flow-run", runner))
    assert not _own_event(SCOPE, _event("prefect.flow-run.Completed", runner, [own]))
    assert not _own_event(SCOPE, _event("prefect.flow-run.Completed", other))
    assert not _own_event(SCOPE, _event("prefect.flow-run.heartbeat", own, [other]))
    assert not _own_event(SCOPE, _event("prefect.task-run.Running", task, [other]))
    assert not _own_event(SCOPE, _event("prefect.task-run.Running", task))  # no flow run
    theirs = {"task_run": {"flow_run_id": str(OTHER)}}  # the recorder reads the payload
    assert not _own_event(SCOPE, _event("prefect.task-run.Running", task, [own], theirs))
    assert not _own_event(SCOPE, _event("prefect.deployment.triggered", own))
    assert not _own_event(SCOPE, _event("my.event", "my.resource", [own]))
    assert not _own_event(SCOPE, ["not", "an", "event"])
    assert _checked_message(SCOPE, "not json", inbound=True) is None


def test_a_subscription_sees_only_this_flow_runs_events():
    asked = {
        "type": "filter",
        "filter": {"event": {"name": ["prefect.flow-run.Cancelling"]}, "resource": None},
    }
    sent = json.loads(_checked_message(SCOPE, json.dumps(asked), inbound=False))
    assert sent["filter"]["resource"] == {"id": [f"prefect.flow-run.{OWN}"]}
    assert sent["filter"]["event"] == asked["filter"]["event"]
    widened = {"type": "filter", "filter": {"resource": {"id_prefix": ["prefect.flow-run."]}}}
    sent = json.loads(_checked_message(SCOPE, json.dumps(widened), inbound=False))
    assert sent["filter"]["resource"] == {"id": [f"prefect.flow-run.{OWN}"]}
    assert _checked_message(SCOPE, json.dumps({"type": "auth"}), inbound=False) is None
