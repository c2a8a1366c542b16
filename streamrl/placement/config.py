"""The `placement` section: where a run's processes run, one class per mode.

- `local` (`LocalPlacement`): the learner, generators and evaluator are processes of the
  supervising process, placed on this machine's cores and GPUs (`streamrl.placement.planner`);
  `streamrl run` and the streamrl flow both run them so.
- `pools` (`PoolsPlacement`): the streamrl flow starts each as its own flow run of the
  learner, generator and evaluator deployments on work pools (`flows.pools`), and
  `streamrl scale` changes how many generators run.

What differs per mode is a method of its class (`check_on_this_machine`, `scaling_limit`), so
no caller compares mode names. The cores and GPUs of each process on one machine are fields of
its component (`learner.cpu_cores`, `generator.cpu_cores`, `eval.cpu_cores`, `learner.gpus`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from streamrl.config.base import MAX_WAIT_S, Section, tagged_classes

__all__ = [
    "PLACEMENT_CLASSES",
    "Liveness",
    "LocalPlacement",
    "PlacementConfig",
    "PlacementError",
    "PoolsPlacement",
    "placement_of_older_run",
]


class PlacementError(ValueError):
    """The run's processes cannot be placed as configured; the message names the numbers or
    the setting and the fix."""


class Liveness(Section):
    """When a supervisor counts a process of the run as hung (`streamrl.supervision.liveness`),
    wherever the processes run."""

    liveness_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="A generator whose loop has not beaten its heartbeat for this long (a storage "
        "call stuck, the process stopped) is ended and restarted as a crash is, the reason "
        "logged and counted (streamrl.supervision.liveness).",
    )
    learner_liveness_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="The same for the learner, which beats once per step and while it waits "
        "for data: longer than its longest step plus a checkpoint.",
    )
    startup_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="How long a started learner or generator may take to its first heartbeat "
        "(loading its model, starting its engine) before it counts as hung.",
    )


class LocalPlacement(Liveness):
    """Every process on this machine (`streamrl.placement.planner` shares its cores and GPUs)."""

    mode: Literal["local"] = Field(
        "local",
        description="local: the learner, generators and evaluator are processes of the "
        "supervising process, placed on this machine's cores and GPUs (streamrl.placement). "
        "pools: the streamrl flow starts each as its own flow run of the learner, generator "
        "and evaluator deployments on work pools (flows.pools).",
    )

    share_gpus: bool | None = Field(
        None,
        description="Whether the learner and the engines (generators, evaluator, served "
        "scorers) may share GPUs, concurrently, each with its planned share of the memory "
        "(streamrl.placement.gpu_memory). null (default): only when there are fewer GPUs than "
        "they need each to itself (one GPU: learner and generator on it). true: put the engines "
        "on the learner's GPUs. false: refuse a plan that would share.",
    )

    def check_on_this_machine(self) -> None:
        """Local runs are planned on this machine."""

    @property
    def runs_here(self) -> bool:
        """Whether the processes run on the machine that starts the run, so that the modules
        of the user's code they import are found there: yes."""
        return True

    def scaling_limit(self, run_uri: str) -> int:
        """The most generators `streamrl scale` may ask for: none, a local run is not scaled."""
        raise PlacementError(
            f"the run at {run_uri} runs its processes on one machine (placement.mode=local): "
            "only a run placed on work pools (placement.mode=pools) is scaled this way; add a "
            f"generator to it with: prefect deployment run generator/default -p run_uri={run_uri}"
        )


class PoolsPlacement(Liveness):
    """Each process its own flow run on a Prefect work pool (`flows.pools`)."""

    mode: Literal["pools"] = Field(
        "pools", description=LocalPlacement.model_fields["mode"].description
    )
    learner_pool: str = Field(
        "learner", min_length=1, description="Work pool of the learner's flow runs."
    )
    generator_pool: str = Field(
        "generators", min_length=1, description="Work pool of the generators' flow runs."
    )
    eval_pool: str | None = Field(
        None, description="Work pool of the evaluator's flow run; null: generator_pool."
    )
    scorer_pool: str | None = Field(
        None,
        description="Work pool of the served scorers' flow runs (scorers.<name> without a url: "
        "a teacher, reward model or judge), one flow run each; null: generator_pool. The "
        "generators' machines must reach a scorer's machine by its host name.",
    )
    image: str | None = Field(
        None,
        description="Container image passed to every flow run as the `image` job variable "
        "(pools whose template has one, such as Kubernetes); null: the pool's default.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables added to every flow run's `env` job variable. Not "
        "credentials (names such as AWS_*, *_KEY, *TOKEN*, *SECRET*, *PASSWORD*, *_PASS, "
        "*_PAT, *_CREDS, and URLs with a password, token or signature, are refused): those "
        "belong in the pool's Kubernetes secret or the worker's environment.",
    )
    retry_window_s: float = Field(
        3600.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="A generator's replacements are counted over this sliding window: "
        "generator_retries replacements within it fail the run, fewer spread over days do not "
        "(a spot fleet losing nodes now and then keeps going).",
    )
    max_generators: int = Field(
        64,
        ge=1,
        le=100_000,
        description="The most generators a scaling request (`streamrl scale`, "
        "control/fleet.json) may start; a larger request is refused by `streamrl scale` and "
        "capped at this by the supervising flow.",
    )

    @property
    def scorers_pool(self) -> str:
        """Where the served scorers' flow runs go."""
        return self.scorer_pool or self.generator_pool

    @property
    def evaluator_pool(self) -> str:
        return self.eval_pool or self.generator_pool

    def check_on_this_machine(self) -> None:
        """A run on work pools is placed by the streamrl flow, never on this machine."""
        raise PlacementError(
            "placement.mode=pools places each process on a Prefect work pool, which only the "
            "streamrl flow does (prefect deployment run streamrl/dapo ...); `streamrl run` runs "
            "them on this machine: leave placement.mode=local"
        )

    @property
    def runs_here(self) -> bool:
        """No: each process runs on a work pool's worker (in `image`), which imports the user's
        code there."""
        return False

    def scaling_limit(self, run_uri: str) -> int:
        """The most generators `streamrl scale` may ask for."""
        return self.max_generators


PlacementConfig = Annotated[LocalPlacement | PoolsPlacement, Field(discriminator="mode")]

PLACEMENT_CLASSES = tagged_classes(PlacementConfig, "mode")


def placement_of_older_run(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A stored configuration (run.json, control/config.json) as this version reads it.

    Runs created before placement modes were classes of their own store every pool field under
    `placement.mode: local` too; those fields never applied to a local run and are dropped."""
    config = dict(stored)
    placement = config.get("placement")
    if isinstance(placement, Mapping) and placement.get("mode", "local") == "local":
        config["placement"] = {k: v for k, v in placement.items() if k == "mode"}
    return config
