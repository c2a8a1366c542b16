"""The local stack (`scripts/stack.sh`, behind `make up` / `make down`), in a temporary stack dir
and Prefect home: `up` serves the deployments of deploy/prefect.yaml on the pools `local`,
`learner` and `generators`, with a worker each, and SeaweedFS; a second `up` is a no-op; `down`
leaves no process behind and is safe to repeat."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

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


async def _served(api_url: str) -> tuple[dict[str, dict], list[str], dict]:
    """(parameters by deployment name, work pool names, generator/default's parameter schema)."""
    with temporary_settings({PREFECT_API_URL: api_url}):
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
    for inherited in ("PREFECT_API_URL", "PREFECT_PROFILE", "STREAMRL_ROOT"):
        env.pop(inherited, None)
    try:
        _stack("up", env)
        pids = {name: int((stack_dir / f"{name}.pid").read_text()) for name in COMPONENTS}
        assert all(_alive(pid) for pid in pids.values()), pids
        assert "AWS_ENDPOINT_URL=http://127.0.0.1:" in (stack_dir / "s3.env").read_text()

        deployments, pools, generator_schema = asyncio.run(_served(f"http://127.0.0.1:{port}/api"))
        assert set(deployments) == {
            "streamrl/dapo",
            "streamrl/vapo",
            "streamrl/grpo",
            "generator/default",
            "learner/default",
            "evaluator/default",
            "scale/default",
        }
        assert {"local", "learner", "generators"} <= set(pools)
        for preset in ("dapo", "vapo", "grpo"):
            assert deployments[f"streamrl/{preset}"]["preset"] == preset
            assert deployments[f"streamrl/{preset}"]["run_uri"] is None  # a fresh run each time
        assert "model.critic.init_from=policy" in deployments["streamrl/vapo"]["overrides"]
        assert generator_schema["required"] == ["run_uri"]

        again = _stack("up", env)
        assert "already up" in again
        assert {n: int((stack_dir / f"{n}.pid").read_text()) for n in COMPONENTS} == pids
    finally:
        _stack("down", env)

    assert not [name for name, pid in pids.items() if _alive(pid)]
    assert not list(stack_dir.glob("*.pid"))
    assert "the stack is down" in _stack("down", env)
