"""The Docker work pools' base job template (`deploy/docker/pool.json`), rendered as the pools'
worker (deploy/docker/worker.py, prefect-docker's worker and what it adds) renders it, down to
the arguments of the Docker SDK's `containers.create`, which are checked by the SDK's own
argument builder (unknown or misspelt options fail there, as they would on the daemon). The
containers themselves, with a daemon, are tests/e2e/test_docker_security.py (slow)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from docker.models.containers import _create_container_args
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
from prefect.client.schemas.responses import DeploymentResponse
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
from prefect_docker.worker import DockerWorkerJobConfiguration

from deploy.docker.api_gate import flow_run_of
from deploy.docker.worker import SECCOMP_PROFILE, StreamrlDockerWorker
from flows.pools import job_variables
from streamrl.config.run import RunConfig

TEMPLATE = Path(__file__).resolve().parents[3] / "deploy" / "docker" / "pool.json"
API = "http://127.0.0.1:4200/api"  # the stack's server, where the worker reaches it
GATE = "http://172.18.0.1:4201/api"  # the API gate on the containers' gateway
SERVER_CREDENTIAL = "admin:the-servers-one-credential"
KEY = b"k" * 32
UNREACHABLE_API = "http://127.0.0.1:9/api"  # the renderer's client is never called
DOCKER_API = "1.41"  # Docker 20.10's, Debian bookworm's docker.io


def _container_args(template: dict, run_variables: dict) -> tuple[dict, FlowRun]:
    """What the pools' worker hands `docker.containers.create` for a generator's flow run."""
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

    worker_settings = {PREFECT_API_URL: API, PREFECT_API_AUTH_STRING: SERVER_CREDENTIAL}
    with temporary_settings(worker_settings):
        configuration = asyncio.run(configure())
        configuration.prepare_for_flow_run(
            flow_run=flow_run,
            deployment=deployment,
            flow=flow,
            work_pool=WorkPool(name="generators", type="docker", base_job_template=template),
            worker_name="streamrl-generators",
        )
        worker = StreamrlDockerWorker(work_pool_name="generators", gate_url=GATE, gate_key=KEY)
        settings = worker._build_container_settings(None, configuration)
    return {**settings, "image": configuration.image}, flow_run


def test_a_flow_run_becomes_an_unprivileged_limited_container_with_its_own_credential():
    template = json.loads(TEMPLATE.read_text())
    args, flow_run = _container_args(template, {"env": {"VLLM_LOGGING_LEVEL": "WARNING"}})
    assert args["image"] == "streamrl:cpu"
    assert args["network"] == "streamrl"
    assert args["network_mode"] is None  # not the host's network
    assert not args["extra_hosts"]  # the API is reached at its own address
    assert args["volumes"] == ["streamrl-secrets:/run/secrets/streamrl:ro"]
    assert args["labels"]["org.streamrl.stack"] == "local"  # what make down removes
    assert "io.prefect.flow-run-id" in args["labels"]  # how a flow run's container is found
    # The API: the gate, with a credential for this flow run only; the server's is nowhere.
    env = args["environment"]
    assert env["PREFECT_API_URL"] == GATE
    assert flow_run_of(KEY, env["PREFECT_API_AUTH_STRING"]) == flow_run.id
    assert not any(SERVER_CREDENTIAL in value for value in env.values())
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"  # placement.env
    assert not any(name.startswith("AWS_") for name in env)  # credentials come by the volume
    # Least privilege: the image's own user, no capability, no setuid, the box's syscalls.
    assert args["user"] == "streamrl"
    assert args["cap_drop"] == ["ALL"]
    assert "cap_add" not in args
    assert args["privileged"] is False
    no_new_privileges, seccomp = args["security_opt"]
    assert no_new_privileges == "no-new-privileges"
    assert json.loads(seccomp.removeprefix("seccomp=")) == json.loads(SECCOMP_PROFILE.read_text())
    # Limits: memory without swap, processes, CPUs (all of this machine's unless the run says).
    assert args["mem_limit"] == args["memswap_limit"] == "8g"
    assert args["pids_limit"] == 4096
    assert args["nano_cpus"] == os.cpu_count() * 10**9
    assert args["init"] is True
    assert args["shm_size"] == "1g"

    create = _create_container_args({**args, "version": DOCKER_API})  # unknown options raise
    host = create["host_config"]
    assert host["Memory"] == host["MemorySwap"] == 8 << 30
    assert host["PidsLimit"] == 4096
    assert host["NanoCpus"] == os.cpu_count() * 10**9
    assert host["CapDrop"] == ["ALL"]
    assert "CapAdd" not in host
    assert host["SecurityOpt"] == args["security_opt"]
    assert host["ShmSize"] == 1 << 30
    assert create["user"] == "streamrl"


def test_the_seccomp_profile_is_dockers_default_plus_what_bwrap_needs():
    profile = json.loads(SECCOMP_PROFILE.read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    unconditional = {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("includes", {}).get("caps")
        and not rule.get("args") and not rule.get("includes", {}).get("arches")
        for name in rule["names"]
    }  # fmt: skip
    box = {"clone", "mount", "pivot_root", "sethostname", "umount2", "unshare"}
    assert box <= unconditional
    # Still refused to a container without the capability: what the box does not need.
    for refused in ("setns", "bpf", "init_module", "open_by_handle_at", "chroot", "keyctl"):
        assert refused not in unconditional, refused


def test_a_learner_node_gets_the_cpus_of_its_plan_and_an_engine_the_pools():
    template = json.loads(TEMPLATE.read_text())
    declared = set(template["variables"]["properties"])
    config = RunConfig.model_validate(
        {"placement": {"mode": "pools"}, "learner": {"cpu_cores": 2, "device": "cpu"}}
    )
    learner = job_variables(config, "learner", declared)
    assert learner["nano_cpus"] == 2 * 10**9
    args, _ = _container_args(template, learner)
    assert args["nano_cpus"] == 2 * 10**9
    assert "nano_cpus" not in job_variables(config, "generator", declared)
    listed = RunConfig.model_validate(
        {"placement": {"mode": "pools"}, "learner": {"cpu_cores": "0-2", "device": "cpu"}}
    )
    assert job_variables(listed, "learner", declared)["nano_cpus"] == 3 * 10**9


def test_an_option_the_docker_sdk_does_not_know_fails():
    template = json.loads(TEMPLATE.read_text())
    template["job_configuration"]["container_create_kwargs"]["masked_paths"] = []
    args, _ = _container_args(template, {})
    with pytest.raises(TypeError, match="masked_paths"):
        _create_container_args({**args, "version": DOCKER_API})


def test_every_placeholder_names_a_declared_variable():
    template = json.loads(TEMPLATE.read_text())
    template["job_configuration"]["container_create_kwargs"]["shm_size"] = "{{ shm_sise }}"
    with pytest.raises(ValueError, match="shm_sise"):
        WorkPoolCreate(name="generators", type="docker", base_job_template=template)
