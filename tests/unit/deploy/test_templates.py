"""The Kubernetes work pools' base job templates (`deploy/k8s/*.json`), rendered as a worker
renders them and checked against the Kubernetes API schema, so that a typo in a job manifest
fails here rather than on a cluster.

Each template goes through what Prefect does with it:

* `prefect work-pool create`: the server's `WorkPoolCreate` refuses a placeholder that names no
  declared variable (the renderer would silently drop the field it stands for);
* a deployment and a flow run: their job variables are checked against the template's
  `variables` schema with the options the server uses;
* the worker: prefect-kubernetes renders the Job with
  `KubernetesWorkerJobConfiguration.from_template_and_values` (the variables' defaults overlaid
  by the deployment's and the flow run's job variables) and `prepare_for_flow_run`, as
  `BaseWorker._get_configuration` calls them.

The rendered `job_manifest`, the batch/v1 Job the worker submits, is then validated with
`kubernetes-validate` against the schemas it ships for `KUBERNETES_VERSION`, in strict mode: the
worker does not ask the API server for strict field validation, and the server drops unknown
fields with only a warning, so a misspelt `nodeSelector` would silently schedule the pod
anywhere. Nothing here reaches a network: the templates reference no Prefect blocks or
variables, so the client handed to the renderer (pointed at a closed port) is never called.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
from prefect.client.schemas.responses import DeploymentResponse
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.schema_tools.validation import is_valid_schema, validate
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

TEMPLATES = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"
UNREACHABLE_API = "http://127.0.0.1:9/api"  # the discard port: nothing listens there
CUDA_IMAGE = "registry.example.com/streamrl:cuda"
CPU_IMAGE = "registry.example.com/streamrl:cpu"
# prefect-kubernetes' own manifest check insists on these in the pod spec (as in its default
# template); the Job API has them one level up (spec.completions, spec.parallelism), and the API
# server drops them from the pod spec with a warning.
PREFECT_POD_SPEC_EXTRAS = {"completions": 1, "parallelism": 1}


@dataclass(frozen=True)
class PoolCase:
    """One pool as deploy/README.md sets it up: its deployment's job variables (`prefect deploy
    --job-variable image=...`) and those a run placed on work pools gives its flow runs
    (`flows.pools.job_variables`: `gpu_count`, `image` from placement.image, `env` from
    placement.env)."""

    template: str
    flow: str
    deployment: str
    flow_run: str
    deployment_variables: dict[str, Any]
    run_variables: dict[str, Any] = field(default_factory=dict)

    @property
    def image(self) -> str:
        return {**self.deployment_variables, **self.run_variables}["image"]


POOLS = {
    # a run's supervisor: no job variables per flow run
    "cpu": PoolCase("cpu-pool.json", "streamrl", "dapo", "qwen-7b-dapo", {"image": CPU_IMAGE}),
    "gpu": PoolCase(
        "gpu-pool.json",
        "learner",
        "default",
        "qwen-7b-dapo-learner-node0",
        {"image": CUDA_IMAGE},
        {"gpu_count": 8, "env": {"NCCL_DEBUG": "WARN"}},  # learner.nproc_per_node, placement.env
    ),
    "spot-gpu": PoolCase(
        "spot-gpu-pool.json",
        "generator",
        "default",
        "qwen-7b-dapo-gen3",
        {"image": CUDA_IMAGE},
        {  # generator.tensor_parallel_size, placement.image, placement.env
            "gpu_count": 2,
            "image": f"{CUDA_IMAGE}-pinned",
            "env": {"VLLM_LOGGING_LEVEL": "WARNING"},
        },
    ),
}


def _load(case: PoolCase) -> dict[str, Any]:
    return json.loads((TEMPLATES / case.template).read_text())


def _render(name: str, case: PoolCase, template: dict[str, Any]) -> dict[str, Any]:
    """The Job a worker of pool `name` submits for `case`'s flow run, after the checks the
    Prefect server makes on the template and on the job variables."""
    WorkPoolCreate(name=name, type="kubernetes", base_job_template=template)
    is_valid_schema(template["variables"], preprocess=False)
    # No deployment sets `env` here, so this plain merge is the worker's too.
    variables = {**case.deployment_variables, **case.run_variables}
    validate(
        variables,
        template["variables"],
        raise_on_error=True,
        preprocess=True,
        ignore_required=True,
        allow_none_with_default=True,
    )

    flow = Flow(name=case.flow)
    deployment = DeploymentResponse(
        name=case.deployment, flow_id=flow.id, job_variables=case.deployment_variables
    )
    flow_run = FlowRun(
        name=case.flow_run,
        flow_id=flow.id,
        deployment_id=deployment.id,
        job_variables=case.run_variables,
    )
    pool = WorkPool(name=name, type="kubernetes", base_job_template=template)

    async def configure() -> KubernetesWorkerJobConfiguration:
        return await KubernetesWorkerJobConfiguration.from_template_and_values(
            base_job_template=template, values=variables, client=PrefectClient(UNREACHABLE_API)
        )

    configuration = asyncio.run(configure())
    configuration.prepare_for_flow_run(
        flow_run=flow_run,
        deployment=deployment,
        flow=flow,
        work_pool=pool,
        worker_name=f"{name}-worker",
        worker_id=uuid.uuid4(),
    )
    return configuration.job_manifest


def _validate_job(manifest: dict[str, Any]) -> None:
    """Strict Kubernetes validation of the Job, less the pod-spec fields Prefect requires."""
    job = copy.deepcopy(manifest)
    pod_spec = job["spec"]["template"]["spec"]
    for key, value in PREFECT_POD_SPEC_EXTRAS.items():
        assert pod_spec.pop(key) == value
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(POOLS))
def test_template_renders_a_valid_job(name: str) -> None:
    """Every placeholder resolves, the job variables reach the Job, and the Job is valid."""
    case = POOLS[name]
    manifest = _render(name, case, _load(case))
    assert "{{" not in json.dumps(manifest)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == case.image
    env = {e["name"]: e for e in container["env"]}
    for key, value in case.run_variables.get("env", {}).items():
        assert env[key]["value"] == value
    if "gpu_count" in case.run_variables:
        gpus = case.run_variables["gpu_count"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    if name == "gpu":  # the address node 0 of a multi-node learner publishes
        assert env["STREAMRL_NODE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    _validate_job(manifest)


def _pod_spec(template: dict[str, Any]) -> dict[str, Any]:
    return template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]


def _misspell_node_selector(template: dict[str, Any]) -> None:
    spec = _pod_spec(template)
    spec["nodeSelecter"] = spec.pop("nodeSelector")


def _misspell_image_pull_policy(template: dict[str, Any]) -> None:
    container = _pod_spec(template)["containers"][0]
    container["imagePulPolicy"] = container.pop("imagePullPolicy")


def _tolerations_as_an_object(template: dict[str, Any]) -> None:
    _pod_spec(template)["tolerations"] = "{{ node_selector }}"


def _undeclared_placeholder(template: dict[str, Any]) -> None:
    _pod_spec(template)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = (
        "{{ gpu_cuont }}"
    )


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], type[Exception], str]] = {
    "misspelt pod field": (
        _misspell_node_selector,
        kubernetes_validate.ValidationError,
        "'nodeSelecter' was unexpected",
    ),
    "misspelt container field": (
        _misspell_image_pull_policy,
        kubernetes_validate.ValidationError,
        "'imagePulPolicy' was unexpected",
    ),
    "wrong type": (
        _tolerations_as_an_object,
        kubernetes_validate.ValidationError,
        "is not of type 'array'",
    ),
    "undeclared placeholder": (
        _undeclared_placeholder,
        pydantic.ValidationError,
        "undeclared variable\\(s\\): gpu_cuont",
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_typo_in_a_template_fails(mutation: str) -> None:
    """A copy of the GPU pool's template with one typo fails the checks above, at the step
    that should catch it."""
    mutate, error, message = MUTATIONS[mutation]
    case = POOLS["gpu"]
    template = _load(case)
    mutate(template)
    with pytest.raises(error, match=message):
        _validate_job(_render("gpu", case, template))
