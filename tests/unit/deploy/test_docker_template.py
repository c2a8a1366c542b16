"""The Docker work pools' base job template (`deploy/docker/pool.json`), rendered as the
prefect-docker worker renders it, down to the arguments of the Docker SDK's `containers.create`,
which are checked by the SDK's own argument builder (unknown or misspelt options fail there, as
they would on the daemon). The whole pool, with a daemon and containers, runs in
tests/e2e/test_docker.py (slow)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from docker.models.containers import _create_container_args
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
from prefect.client.schemas.responses import DeploymentResponse
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "docker" / "pool.json"
API = "http://172.18.0.1:4200/api"  # the stack's server on the containers' gateway
UNREACHABLE_API = "http://127.0.0.1:9/api"  # the renderer's client is never called
DOCKER_API = "1.41"  # Docker 20.10's, Debian bookworm's docker.io


def _container_args(template: dict, run_variables: dict) -> dict:
    """What the worker hands `docker.containers.create` for a generator's flow run."""
    WorkPoolCreate(name="generators", type="docker", base_job_template=template)
    flow = Flow(name="generator")
    deployment = DeploymentResponse(name="default", flow_id=flow.id)
    flow_run = FlowRun(
        name="dapo-gen1", flow_id=flow.id, deployment_id=deployment.id, job_variables=run_variables
    )

    async def configure() -> DockerWorkerJobConfiguration:
        return await DockerWorkerJobConfiguration.from_template_and_values(
            base_job_template=template, values=run_variables, client=PrefectClient(UNREACHABLE_API)
        )

    with temporary_settings({PREFECT_API_URL: API}):
        configuration = asyncio.run(configure())
        configuration.prepare_for_flow_run(
            flow_run=flow_run,
            deployment=deployment,
            flow=flow,
            work_pool=WorkPool(name="generators", type="docker", base_job_template=template),
            worker_name="streamrl-generators",
        )
        worker = DockerWorker(work_pool_name="generators")
        settings = worker._build_container_settings(None, configuration)
    return {**settings, "image": configuration.image}


def test_a_flow_run_becomes_a_container_on_the_internal_network_with_the_secret_volume():
    template = json.loads(TEMPLATE.read_text())
    args = _container_args(template, {"env": {"VLLM_LOGGING_LEVEL": "WARNING"}})
    assert args["image"] == "streamrl:cpu"
    assert args["network"] == "streamrl"
    assert args["network_mode"] is None  # not the host's network
    assert not args["extra_hosts"]  # the API is reached at its own address
    assert args["volumes"] == ["streamrl-secrets:/run/secrets/streamrl:ro"]
    env = args["environment"]
    assert env["PREFECT_API_URL"] == API
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"  # placement.env
    assert not any(name.startswith("AWS_") for name in env)  # credentials come by the volume
    assert args["labels"]["org.streamrl.stack"] == "local"  # what make down removes
    assert "io.prefect.flow-run-id" in args["labels"]  # how a flow run's container is found
    # The box for model-written code: bubblewrap as the container's root, with what it needs.
    assert args["user"] == "root"
    assert set(args["cap_add"]) == {"SYS_ADMIN", "NET_ADMIN"}
    assert args["security_opt"] == ["seccomp=unconfined"]
    assert args["init"] is True
    assert args["shm_size"] == "1g"

    create = _create_container_args({**args, "version": DOCKER_API})  # unknown options raise
    host = create["host_config"]
    assert host["ShmSize"] == 1 << 30
    assert host["CapAdd"] == args["cap_add"]
    assert host["Binds"] == ["streamrl-secrets:/run/secrets/streamrl:ro"]


def test_an_option_the_docker_sdk_does_not_know_fails():
    template = json.loads(TEMPLATE.read_text())
    template["job_configuration"]["container_create_kwargs"]["masked_paths"] = []
    with pytest.raises(TypeError, match="masked_paths"):
        _create_container_args({**_container_args(template, {}), "version": DOCKER_API})


def test_every_placeholder_names_a_declared_variable():
    template = json.loads(TEMPLATE.read_text())
    template["job_configuration"]["container_create_kwargs"]["shm_size"] = "{{ shm_sise }}"
    with pytest.raises(ValueError, match="shm_sise"):
        WorkPoolCreate(name="generators", type="docker", base_job_template=template)
