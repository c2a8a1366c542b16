"""The Docker pools' worker: prefect-docker's `DockerWorker` with what a flow run's container
needs for the box and nothing of the worker's own credential.

Each container it creates from deploy/docker/pool.json also gets:

- **the box's seccomp profile** (`seccomp.json` beside this file): Docker's default profile plus
  what bubblewrap needs to make the box as an unprivileged user (`unshare`, `clone` with
  namespace flags, `mount`, `umount2`, `pivot_root`, `chroot`, `sethostname`), which Docker's
  default allows only to a container holding `CAP_SYS_ADMIN`. The box's own filter refuses them
  again to the program it runs (streamrl.isolation.seccomp).
- **an unmasked /proc** (`MaskedPaths` and `ReadonlyPaths` empty, what `docker run
  --security-opt systempaths=unconfined` sends, which the Docker SDK cannot ask for): the kernel
  lets a user namespace mount a new /proc (the box's) only where the container's /proc has
  nothing mounted over its files. The container's user is not root and holds no capability,
  so what Docker masks stays unreadable or unwritable to it (`/proc/kcore`, `/proc/sysrq-trigger`
  and `/proc/sys` are root's).
- **its flow run's own API credential**: `PREFECT_API_URL` is the gate on the containers'
  gateway (`STREAMRL_GATE_URL`) and `PREFECT_API_AUTH_STRING` a credential good for this flow run
  only (deploy/docker/api_gate.py, keyed by `STREAMRL_GATE_KEY_FILE`), instead of the server's.
- **a CPU limit**: `nano_cpus` null (no `cpus` from the run's plan) is every CPU of this machine.

    STREAMRL_GATE_URL=http://172.18.0.1:4201/api STREAMRL_GATE_KEY_FILE=.stack/flow-run.key \\
        python -m deploy.docker.worker --pool learner --name streamrl-learner

from the project root (scripts/stack.sh starts one per Docker pool).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import warnings
from pathlib import Path
from typing import Any
from uuid import UUID

import docker
from prefect.utilities.processutils import setup_signal_handlers_worker
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

from deploy.docker.api_gate import flow_run_credential

__all__ = ["SECCOMP_PROFILE", "StreamrlDockerWorker"]

SECCOMP_PROFILE = Path(__file__).resolve().parent / "seccomp.json"


class _UnmaskedProcAPI(docker.APIClient):
    """Docker's API client, creating containers with nothing mounted over /proc's files."""

    def create_container_from_config(self, config: dict, name=None, platform=None):  # type: ignore[no-untyped-def]
        config.setdefault("HostConfig", {}).update(MaskedPaths=[], ReadonlyPaths=[])
        return super().create_container_from_config(config, name, platform)


class _DockerClient(docker.DockerClient):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.api = _UnmaskedProcAPI(*args, **kwargs)


with warnings.catch_warnings():  # it takes over the `docker` worker type, in this process only
    warnings.simplefilter("ignore")

    class StreamrlDockerWorker(DockerWorker):
        """prefect-docker's worker, creating containers as the module docstring says."""

        def __init__(self, *args: Any, gate_url: str, gate_key: bytes, **kwargs: Any) -> None:
            self._gate_url = gate_url
            self._gate_key = gate_key
            self._seccomp = json.dumps(json.loads(SECCOMP_PROFILE.read_text()))
            super().__init__(*args, **kwargs)

        def _get_client(self) -> docker.DockerClient:
            timeout = int(os.environ.get("DOCKER_CLIENT_TIMEOUT", 60))
            return _DockerClient.from_env(timeout=timeout)

        def _build_container_settings(
            self, docker_client: Any, configuration: DockerWorkerJobConfiguration
        ) -> dict[str, Any]:
            env = {  # no credential of the worker's own (its profile's, its environment's)
                name: value
                for name, value in configuration.env.items()
                if not (name.startswith("PREFECT_") and name.endswith(("AUTH_STRING", "API_KEY")))
            }
            flow_run_id = UUID(env["PREFECT__FLOW_RUN_ID"])
            env["PREFECT_API_URL"] = self._gate_url  # not the worker's 127.0.0.1: no host alias
            env["PREFECT_API_AUTH_STRING"] = flow_run_credential(self._gate_key, flow_run_id)
            configuration.env = env
            settings = super()._build_container_settings(docker_client, configuration)
            settings["security_opt"] = [
                *settings.get("security_opt", []),
                f"seccomp={self._seccomp}",
            ]
            if settings.get("nano_cpus") is None:
                settings["nano_cpus"] = (os.cpu_count() or 1) * 10**9
            return settings


async def _serve(pool: str, name: str) -> None:
    gate_url = os.environ.get("STREAMRL_GATE_URL")
    key_file = os.environ.get("STREAMRL_GATE_KEY_FILE")
    if not gate_url or not key_file:
        raise SystemExit(
            "the Docker pools' worker needs STREAMRL_GATE_URL (the API gate on the containers' "
            "gateway) and STREAMRL_GATE_KEY_FILE (its key); scripts/stack.sh sets both"
        )
    setup_signal_handlers_worker(os.getpid(), "the docker worker", print)
    worker = StreamrlDockerWorker(
        name=name,
        work_pool_name=pool,
        gate_url=gate_url,
        gate_key=Path(key_file).read_bytes(),
    )
    await worker.start(printer=print)


def main() -> None:
    parser = argparse.ArgumentParser(description="A worker of one of the Docker pools.")
    parser.add_argument("--pool", required=True, help="the Docker work pool")
    parser.add_argument("--name", required=True, help="the worker's name")
    args = parser.parse_args()
    asyncio.run(_serve(args.pool, args.name))


if __name__ == "__main__":
    main()
