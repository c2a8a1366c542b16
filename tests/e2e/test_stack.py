"""The local stack (`scripts/stack.sh`, behind `make up` / `make down`), in a temporary stack dir
and Prefect home: `up` serves the deployments of deploy/prefect.yaml on the pools `local`,
`learner` and `generators`, with a worker each, and SeaweedFS; a second `up` is a no-op; `down`
leaves no process behind and is safe to repeat. Locked down: the stack dir is 0700, its key
files and the Prefect profiles 0600; the API refuses a request without the stack's basic-auth
credential (401), while the profile `up` made active (the CLI, the workers, the flow runs they
start) carries it; a flow-run parameter that holds a credential is refused by the server."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("server", "worker-local", "worker-learner", "worker-generators", "seaweedfs")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stack(action: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "scripts/stack.sh", action],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"stack.sh {action} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _status_without_credential(url: str, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _prefect(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The Prefect CLI as the user: the active profile, no PREFECT_API_URL."""
    prefect = ROOT / ".venv" / "bin" / "prefect"
    return subprocess.run(
        [str(prefect), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


async def _flow_runs(api_url: str, auth: str) -> dict[str, tuple[str, str]]:
    """Every flow run: name -> (state type, state message)."""
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
        async with get_client() as client:
            return {
                run.name: (run.state_type.value if run.state_type else "", run.state.message or "")
                for run in await client.read_flow_runs()
            }


async def _served(api_url: str, auth: str) -> tuple[dict[str, dict], list[str], dict]:
    """(parameters by deployment name, work pool names, generator/default's parameter schema)."""
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
        async with get_client() as client:
            flows = {flow.id: flow.name for flow in await client.read_flows()}
            deployments = {
                f"{flows[deployment.flow_id]}/{deployment.name}": deployment.parameters
                for deployment in await client.read_deployments()
            }
            pools = [pool.name for pool in await client.read_work_pools()]
            generator = await client.read_deployment_by_name("generator/default")
    return deployments, pools, generator.parameter_openapi_schema


def test_stack_serves_the_deployments_and_stops_without_leftovers(tmp_path: Path) -> None:
    stack_dir = tmp_path / "stack"
    port = _free_port()
    env = {
        **os.environ,
        "STREAMRL_STACK_DIR": str(stack_dir),
        "STREAMRL_PREFECT_PORT": str(port),
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "S3": "1",
    }
    for inherited in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE"):
        env.pop(inherited, None)
    env.pop("STREAMRL_ROOT", None)
    api = f"http://127.0.0.1:{port}/api"
    try:
        _stack("up", env)
        pids = {name: int((stack_dir / f"{name}.pid").read_text()) for name in COMPONENTS}
        assert all(_alive(pid) for pid in pids.values()), pids
        assert "AWS_ENDPOINT_URL=http://127.0.0.1:" in (stack_dir / "s3.env").read_text()

        # Locked down: private files, and the API only for holders of the credential.
        assert _mode(stack_dir) == 0o700
        for private in ("auth", "s3.env", "prefect.db", "server.log"):
            assert _mode(stack_dir / private) == 0o600, private
        assert _mode(tmp_path / "prefect-home" / "profiles.toml") == 0o600
        auth = (stack_dir / "auth").read_text()
        assert auth.startswith("admin:")
        assert len(auth) > 30
        assert auth in (tmp_path / "prefect-home" / "profiles.toml").read_text()
        assert _status_without_credential(f"{api}/health") == 200  # liveness stays open
        assert _status_without_credential(f"{api}/flows/filter", b"{}") == 401
        assert _status_without_credential(f"{api}/deployments/filter", b"{}") == 401

        deployments, pools, generator_schema = asyncio.run(_served(api, auth))
        assert set(deployments) == {
            "streamrl/dapo",
            "streamrl/vapo",
            "streamrl/grpo",
            "generator/default",
            "learner/default",
            "evaluator/default",
            "scorer/default",
            "scale/default",
            "recipe/calculator-agent",
            "recipe/sft-dpo-rl",
        }
        assert {"local", "learner", "generators"} <= set(pools)
        for preset in ("dapo", "vapo", "grpo"):
            assert deployments[f"streamrl/{preset}"]["preset"] == preset
            assert deployments[f"streamrl/{preset}"]["run_uri"] is None  # a fresh run each time
        assert "model.critic.init_from=policy" in deployments["streamrl/vapo"]["overrides"]
        assert deployments["recipe/calculator-agent"]["name"] == "calculator-agent"
        assert deployments["recipe/sft-dpo-rl"]["name"] == "sft-dpo-rl"
        assert generator_schema["required"] == ["run_uri"]

        # The profile carries the credential: the CLI starts a flow run, a worker runs it (its
        # flow-run process reports to the API: Failed by the flow itself, not Crashed).
        started = _prefect(
            env,
            *("deployment", "run", "scale/default", "--flow-run-name", "scale-nowhere"),
            *("-p", f"run_uri={tmp_path / 'no-such-run'}", "-p", "generators=1"),
        )
        assert started.returncode == 0, started.stdout + started.stderr
        deadline = time.monotonic() + 300
        while (state := asyncio.run(_flow_runs(api, auth))["scale-nowhere"])[0] not in (
            "COMPLETED",
            "FAILED",
            "CRASHED",
        ):
            assert time.monotonic() < deadline, f"the scale flow run is still {state}"
            time.sleep(3)
        assert state[0] == "FAILED", state

        # An override holding a credential never becomes a flow-run parameter.
        refused = _prefect(
            env,
            *("deployment", "run", "streamrl/dapo", "--flow-run-name", "leaky"),
            *("-p", 'overrides=["placement.env.HF_TOKEN=hunter2"]'),
        )
        assert refused.returncode != 0
        assert "leaky" not in asyncio.run(_flow_runs(api, auth))

        again = _stack("up", env)
        assert "already up" in again
        assert {n: int((stack_dir / f"{n}.pid").read_text()) for n in COMPONENTS} == pids
    finally:
        _stack("down", env)

    assert not [name for name, pid in pids.items() if _alive(pid)]
    assert not list(stack_dir.glob("*.pid"))
    assert "the stack is down" in _stack("down", env)
