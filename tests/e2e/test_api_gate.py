"""The Docker pools' API gate (deploy/docker/api_gate.py) in front of a real Prefect server with
basic auth, as the local stack runs them: a flow run executed the way a flow-run container
executes it (`prefect flow-run execute`, its API the gate, its credential its own) completes with
its logs and task run recorded; the same credential cannot start a flow run on the `local` pool,
read or cancel another flow run or change its own job variables, and the server's credential is
refused at the gate. No Docker needed: the containers themselves are
tests/e2e/test_docker_security.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from deploy.docker.api_gate import flow_run_credential
from tests.e2e.test_pools import free_port

ROOT = Path(__file__).resolve().parents[2]
FLOW = """
from prefect import flow, get_run_logger, task


@task(name="component")
def component(name: str) -> None:
    get_run_logger().warning("component %s ran", name)


@flow(name="gated", log_prints=True)
def gated() -> None:
    print("hello from the container")
    component("gen0")
"""


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} not healthy after {timeout_s:.0f} s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def gated_server(tmp_path_factory):
    """A Prefect server with basic auth on 127.0.0.1 and the gate in front of it; yields the
    server's API, its credential, the gate's API and the gate's key."""
    home = tmp_path_factory.mktemp("gate")
    credential = "admin:" + secrets.token_urlsafe(16)
    key = secrets.token_bytes(32)
    (home / "auth").write_text(credential)
    (home / "flow-run.key").write_bytes(key)
    port, gate_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    server_env = {
        **env,
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_API_AUTH_STRING": credential,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
    }
    prefect = str(Path(sys.executable).parent / "prefect")
    started = []
    try:
        with open(home / "server.log", "wb") as log:
            server = subprocess.Popen(
                [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                env=server_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        started.append(server)
        api = f"http://127.0.0.1:{port}/api"
        _wait_healthy(api, server, home / "server.log")
        with open(home / "gate.log", "wb") as log:
            gate = subprocess.Popen(
                [sys.executable, "-m", "deploy.docker.api_gate",
                 "--listen", f"127.0.0.1:{gate_port}", "--upstream", f"http://127.0.0.1:{port}",
                 "--auth-file", str(home / "auth"), "--key-file", str(home / "flow-run.key")],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        started.append(gate)
        gate_api = f"http://127.0.0.1:{gate_port}/api"
        _wait_healthy(gate_api, gate, home / "gate.log")
        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: credential}):
            yield {"api": api, "credential": credential, "gate": gate_api, "key": key,
                   "home": home, "env": env}  # fmt: skip
    finally:
        for process in started:
            process.kill()
            process.wait(timeout=30)


def _deployment(client, name: str, pool: str, folder: Path):
    client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    flow_id = client.create_flow_from_name("gated")
    pull = {"prefect.deployments.steps.set_working_directory": {"directory": str(folder)}}
    return client.create_deployment(
        flow_id=flow_id, name=name, entrypoint="flow.py:gated", work_pool_name=pool,
        pull_steps=[pull],
    )  # fmt: skip


def test_a_flow_run_behind_the_gate_runs_and_can_act_on_itself_only(gated_server, tmp_path):
    (tmp_path / "flow.py").write_text(FLOW)
    with get_client(sync_client=True) as client:
        on_pool = _deployment(client, "pooled", "generators", tmp_path)
        on_host = _deployment(client, "on-host", "local", tmp_path)
        mine = client.create_flow_run_from_deployment(on_pool).id
        other = client.create_flow_run_from_deployment(on_pool).id

    # As the flow run's container runs it: the gate and its own credential, nothing else.
    own_credential = flow_run_credential(gated_server["key"], mine)
    executed = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "flow-run", "execute", str(mine)],
        env={**gated_server["env"], "PREFECT_HOME": str(tmp_path / "home"),
             "PREFECT_API_URL": gated_server["gate"], "PREFECT_API_AUTH_STRING": own_credential},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert executed.returncode == 0, executed.stdout[-3000:] + executed.stderr[-3000:]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(mine).state.is_completed()
        messages = [log.message for log in client.read_logs()]
        assert "hello from the container" in messages
        assert "component gen0 ran" in messages
        deadline = time.monotonic() + 120
        while not (tasks := client.read_task_runs()) and time.monotonic() < deadline:
            time.sleep(1)  # the server records task runs from the flow run's events
        assert [t.flow_run_id for t in tasks] == [mine]
        assert tasks[0].state.is_completed()

    # What code in that container could try with the same credential.
    gate = httpx.Client(base_url=gated_server["gate"], auth=tuple(own_credential.split(":")))
    attempts = {
        "start a flow run on the local pool": gate.post(
            f"/deployments/{on_host}/create_flow_run", json={}
        ),
        "start a flow run on its own pool": gate.post(
            f"/deployments/{on_pool}/create_flow_run", json={}
        ),
        "create a flow run": gate.post("/flow_runs/", json={"flow_id": str(on_pool)}),
        "read another flow run": gate.get(f"/flow_runs/{other}"),
        "mount the host's disk when rescheduled": gate.patch(
            f"/flow_runs/{mine}", json={"job_variables": {"volumes": ["/:/host"]}}
        ),
        "cancel another flow run": gate.post(
            f"/flow_runs/{other}/set_state", json={"state": {"type": "CANCELLING"}}
        ),
        "list flow runs": gate.post("/flow_runs/filter", json={}),
        "read the host's deployment": gate.get(f"/deployments/{on_host}"),
        "read the local pool": gate.get("/work_pools/local"),
    }
    for what, response in attempts.items():
        assert response.status_code == 403, (what, response.status_code, response.text)
    assert gate.get(f"/flow_runs/{mine}").status_code == 200  # its own, still
    server_credential = tuple(gated_server["credential"].split(":", 1))
    as_admin = httpx.get(f"{gated_server['gate']}/flow_runs/{mine}", auth=server_credential)
    assert as_admin.status_code == 403  # the gate takes flow runs' credentials only
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(other).state.is_scheduled()
        assert not client.read_flow_run(mine).job_variables
        assert len(client.read_flow_runs()) == 2  # nothing was started
