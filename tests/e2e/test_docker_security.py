"""What a flow run's container of the Docker pools gets, read as an operator reads it (`docker
inspect`) and tried from inside as an attacker would: the local stack with Docker pools (`make up
DOCKER=1`), its real worker (deploy/docker/worker.py) and template (deploy/docker/pool.json).

- A generator's flow run runs as the image's unprivileged user, with no capability, no setuid,
  the box's seccomp profile (not `unconfined`), memory, process and CPU limits, and the API gate
  with a credential for its own flow run: the server's credential is nowhere in it.
- Inside such a container (the same flow run, its command a probe), the box for model-written
  code works as uid 65534 in a user namespace (`streamrl doctor` passes); the container's
  credential reads its own flow run but cannot start one of `streamrl/dapo` (the `local` pool,
  which runs on the host); and of the host's ports it reaches the gate and S3, nothing else:
  not the Prefect server, not SeaweedFS's master, volume, filer or S3 gRPC ports, not what the
  host serves on all its addresses.

Needs Docker and iptables (root) and the image: the fixture runs `scripts/image.sh` (cached).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Cancelled

from deploy.docker.api_gate import flow_run_credential
from deploy.docker.worker import SECCOMP_PROFILE
from tests.e2e.test_docker import _docker, docker_stack  # noqa: F401 - the stack fixture
from tests.e2e.test_pools import _wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MISSING_RUN = "s3://streamrl/runs/no-such-run"
# Runs in the container as its flow run's command: what it can do, as JSON on one line.
PROBE = r"""
import base64, json, os, socket, subprocess, urllib.error, urllib.request
from streamrl.isolation.box import BoxLimits, run_in_box

found = {"uid": os.getuid()}
boxed = run_in_box(["python", "/box/p.py"], limits=BoxLimits(wall_s=60),
                   files={"p.py": b"import os\nprint(os.getuid())\n"})
found["box"] = [boxed.returncode, boxed.stdout.decode().strip(), boxed.stderr.decode()[-500:]]
doctor = subprocess.run(["streamrl", "doctor"], capture_output=True, text=True)
found["doctor"] = [doctor.returncode, doctor.stdout[-800:]]
api, credential = os.environ["PREFECT_API_URL"], os.environ["PREFECT_API_AUTH_STRING"]

def status(method, path):
    basic = "Basic " + base64.b64encode(credential.encode()).decode()
    request = urllib.request.Request(
        api + path, method=method, data=b"{}" if method == "POST" else None,
        headers={"Authorization": basic, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code

found["own flow run"] = status("GET", "/flow_runs/" + os.environ["PREFECT__FLOW_RUN_ID"])
on_host = os.environ["PROBE_DEPLOYMENT"]
found["start on local"] = status("POST", f"/deployments/{on_host}/create_flow_run")
gateway = api.split("//")[1].split(":")[0]
found["reached"] = []
for port in map(int, os.environ["PROBE_PORTS"].split(",")):
    with socket.socket() as sock:
        sock.settimeout(5)
        if sock.connect_ex((gateway, port)) == 0:
            found["reached"].append(port)
print("PROBE " + json.dumps(found), flush=True)
"""


def _container_of(flow_run_id: UUID, exited: bool = True) -> dict | None:
    found = _docker("ps", "-aq", "--filter", f"label=io.prefect.flow-run-id={flow_run_id}")
    if not found:
        return None
    (inspected,) = json.loads(_docker("inspect", found.splitlines()[0]))
    return inspected if not exited or inspected["State"]["Status"] == "exited" else None


def _stack(env: dict) -> dict:
    folder = Path(env["STREAMRL_STACK_DIR"])
    gateway = (folder / "gateway").read_text()
    return {
        "folder": folder,
        "gateway": gateway,
        "gate": f"http://{gateway}:{(folder / 'gate-port').read_text()}/api",
        "key": (folder / "flow-run.key").read_bytes(),
    }


def _host_ports(stack: dict, env: dict) -> dict[int, str]:
    """Every port of the host a container could try on the gateway: what listens there."""
    weed = (stack["folder"] / "seaweedfs.pid").read_text()
    args = Path(f"/proc/{weed}/cmdline").read_bytes().decode().split("\0")
    names = {int(port): f"seaweedfs {flag}" for flag, _, port in (a.partition("=") for a in args)
             if "port" in flag and port.isdigit() and int(port)}  # fmt: skip
    names[int(env["STREAMRL_PREFECT_PORT"])] = "prefect server"
    names[int(stack["gate"].rsplit(":", 1)[1].split("/")[0])] = "gate"
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True)
    for line in listening.stdout.splitlines():  # what else listens where containers could try
        address, _, port = line.split()[3].rpartition(":")
        if address in ("0.0.0.0", "*", "[::]", stack["gateway"]):
            names.setdefault(int(port), f"host {address}:{port}")
    return names


def test_a_flow_runs_container_is_unprivileged_limited_and_holds_its_own_credential_only(
    docker_stack,  # noqa: F811
):
    stack = _stack(docker_stack)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("generator/default")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"run_uri": MISSING_RUN, "retries": 0}
        ).id
        state = _wait_for(
            "the flow run to end",
            lambda: (s := client.read_flow_run(flow_run).state).is_final() and s,
            600,
        )
    # It reported its own failure, through the gate, from the container.
    assert state.is_failed(), state
    assert "no streamrl run at" in state.message

    container = _wait_for("its container", lambda: _container_of(flow_run), 120)
    config, host = container["Config"], container["HostConfig"]
    assert config["User"] == "streamrl"
    assert not host["CapAdd"]
    assert host["CapDrop"] == ["ALL"]
    assert host["Privileged"] is False
    no_new_privileges, seccomp = host["SecurityOpt"]
    assert no_new_privileges == "no-new-privileges"
    assert json.loads(seccomp.removeprefix("seccomp=")) == json.loads(SECCOMP_PROFILE.read_text())
    # The one widening: nothing over /proc's files, so that the box may mount its own /proc.
    assert host["MaskedPaths"] == []
    assert host["ReadonlyPaths"] == []
    assert host["Memory"] == host["MemorySwap"] == 8 << 30
    assert host["PidsLimit"] == 4096
    assert host["NanoCpus"] == os.cpu_count() * 10**9
    env = dict(entry.split("=", 1) for entry in config["Env"])
    assert env["PREFECT_API_URL"] == stack["gate"]
    assert env["PREFECT_API_AUTH_STRING"] == flow_run_credential(stack["key"], flow_run)
    server_credential = docker_stack["PREFECT_API_AUTH_STRING"]
    assert not any(server_credential in value for value in env.values())
    assert not any(name.startswith("AWS_") for name in env)  # S3 keys come by the volume


def test_in_a_pool_container_the_box_works_and_the_host_is_reachable_only_at_gate_and_s3(
    docker_stack,  # noqa: F811
):
    stack = _stack(docker_stack)
    ports = _host_ports(stack, docker_stack)
    s3_port = int(docker_stack["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    script = base64.b64encode(PROBE.encode()).decode()
    with get_client(sync_client=True) as client:
        on_host = client.read_deployment_by_name("streamrl/dapo")
        deployment = client.read_deployment_by_name("generator/default")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={"run_uri": MISSING_RUN},
            job_variables={
                "command": f"python -c \"import base64; exec(base64.b64decode('{script}'))\"",
                "env": {
                    "PROBE_DEPLOYMENT": str(on_host.id),
                    "PROBE_PORTS": ",".join(str(port) for port in sorted(ports)),
                },
            },
        ).id
        try:
            container = _wait_for("the probe to end", lambda: _container_of(flow_run), 600)
            logs = _docker("logs", container["Id"])
        finally:
            client.set_flow_run_state(flow_run, Cancelled(), force=True)  # it reports nothing
        assert len(client.read_flow_runs()) == 2  # the probe started no flow run
    lines = [line for line in logs.splitlines() if line.startswith("PROBE ")]
    assert lines, logs[-3000:]
    found = json.loads(lines[-1].removeprefix("PROBE "))

    assert found["uid"] == 1000  # the image's user `streamrl`, not root
    assert found["box"][:2] == [0, "65534"], found["box"]  # uid 65534 in a user namespace
    assert found["doctor"][0] == 0, found["doctor"]
    assert found["own flow run"] == 200
    assert found["start on local"] == 403
    reached = {ports[port] for port in found["reached"]}
    assert reached == {"gate", "seaweedfs -s3.port"}, (reached, ports)
    assert ports[s3_port] == "seaweedfs -s3.port"
