"""The placement plan as a record: where each process of a run on one machine runs.

`PlacementPlan` is what `streamrl.placement.planner` decides, printed (`describe()`: the table
and the planner's reasons) and stored as `<run>/control/placement.json`; each process is started
from its `ProcessPlacement`: its affinity (`cpus`), its CPU priority (`priority`: a `background`
process runs only on what the `normal` ones leave, `streamrl.isolation.lifetime`) and its
environment (`env()`: `CUDA_VISIBLE_DEVICES`, OpenMP / MKL thread counts fixed for the run —
never adjusted to load, so the learner's bits depend on its thread count alone —, vLLM's CPU
thread binding, OpenMP waits that sleep instead of spinning when idle, and on a shared GPU the
share of its memory the process may take, and whether weight versions pass from the learner to
it through memory, `streamrl.placement.handoff`). A learner of several ranks binds each rank to
its own cores (`bind_rank`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from streamrl.config.base import format_cores, parse_cores

if TYPE_CHECKING:
    from storage.fs import Location

__all__ = [
    "GPU_SHARE_VARIABLE",
    "HANDOFF_VARIABLE",
    "PLACED_VARIABLES",
    "PLACEMENT_FILE",
    "RANK_CORES_VARIABLE",
    "Component",
    "PlacementPlan",
    "Priority",
    "ProcessPlacement",
    "bind_rank",
    "read_placement",
    "write_placement",
]

PLACEMENT_FILE = ("control", "placement.json")
Component = Literal["learner", "generator", "evaluator", "scorer"]
Priority = Literal["normal", "background"]

# OpenMP threads that wait for work sleep instead of spinning on a core another process needs
# (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT, Intel's runtime KMP_BLOCKTIME).
IDLE_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
# Thread counts stay what the plan says: OpenMP and MKL never lower them on a busy machine.
FIXED_THREADS_ENV = {"OMP_DYNAMIC": "FALSE", "MKL_DYNAMIC": "FALSE"}

# A process on a shared GPU: the fraction of the device's memory it may take (the learner caps
# its allocator at it; a vLLM engine's gpu_memory_utilization is set to it).
GPU_SHARE_VARIABLE = "STREAMRL_GPU_MEMORY_FRACTION"

# The learner and the generators beside it: versions go through the learner's memory
# (`streamrl.placement.handoff`).
HANDOFF_VARIABLE = "STREAMRL_WEIGHT_HANDOFF"

# A learner of several ranks: each rank's cores, ';'-separated in rank order (`bind_rank`).
RANK_CORES_VARIABLE = "STREAMRL_RANK_CORES"

# Every variable a placement decides: a planned process never inherits them from its supervisor.
PLACED_VARIABLES = frozenset(
    {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"}
    | {RANK_CORES_VARIABLE, GPU_SHARE_VARIABLE, HANDOFF_VARIABLE}
    | set(IDLE_WAIT_ENV)
    | set(FIXED_THREADS_ENV)
)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProcessPlacement(_Record):
    """Where one process of the run (for the learner: its whole torchrun job) runs.

    Invariants: `cpus` is non-empty and within the machine's affinity; `gpus` are entries of
    the machine's visible GPU list (empty: on CPU); `threads` ≥ 1 OpenMP threads per process
    (for a learner of several ranks, its cores divided between them); `gpu_memory_fraction`
    set only on a GPU another process of the run uses too."""

    name: str
    component: Component
    index: int = 0
    ranks: int = 1
    cpus: tuple[int, ...]
    gpus: tuple[str, ...] = ()
    threads: int = 1
    shared: bool = False  # cores shared with another process of the run
    priority: Priority = "normal"
    gpu_memory_fraction: float | None = None  # its share of each of its GPUs, when shared
    handoff: bool = False  # weight versions pass through the learner's memory, not storage

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpus)

    def env(self) -> dict[str, str]:
        """The environment variables this process starts with (over the supervisor's)."""
        env = {
            "CUDA_VISIBLE_DEVICES": ",".join(self.gpus),
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            **IDLE_WAIT_ENV,
            **FIXED_THREADS_ENV,
        }
        if self.gpu_memory_fraction is not None:
            env[GPU_SHARE_VARIABLE] = f"{self.gpu_memory_fraction:.4f}"
        if self.handoff:
            env[HANDOFF_VARIABLE] = "1"
        if self.component != "learner" and not self.on_gpu:
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_cores(self.cpus)
        if self.ranks > 1:
            env[RANK_CORES_VARIABLE] = ";".join(format_cores(c) for c in self.rank_cpus())
        return env

    def rank_cpus(self) -> list[tuple[int, ...]]:
        """Each rank's own cores: `cpus` in `ranks` consecutive blocks of `threads` (the last
        takes the remainder); all of `cpus` for every rank when there are fewer cores than
        ranks."""
        if len(self.cpus) < self.ranks:
            return [self.cpus] * self.ranks
        blocks = [self.cpus[r * self.threads : (r + 1) * self.threads] for r in range(self.ranks)]
        blocks[-1] = self.cpus[(self.ranks - 1) * self.threads :]
        return blocks


class PlacementPlan(_Record):
    """Every process of a run on this machine, and what the machine offered."""

    machine_cpus: tuple[int, ...]
    machine_gpus: tuple[str, ...]
    learner: ProcessPlacement
    generators: tuple[ProcessPlacement, ...]
    evaluator: ProcessPlacement | None = None
    scorers: tuple[ProcessPlacement, ...] = ()  # the served scorers, `RunConfig.served_scorers`
    reasons: tuple[str, ...] = ()  # the planner's decisions in words: who shares what, and why

    @property
    def processes(self) -> list[ProcessPlacement]:
        evaluator = [self.evaluator] if self.evaluator is not None else []
        return [self.learner, *self.generators, *evaluator, *self.scorers]

    def placement_of(self, component: Component, index: int = 0) -> ProcessPlacement:
        """The placement of the learner, generator `index`, the evaluator or served scorer
        `index`."""
        if component == "learner":
            return self.learner
        if component == "generator" and 0 <= index < len(self.generators):
            return self.generators[index]
        if component == "evaluator" and self.evaluator is not None:
            return self.evaluator
        if component == "scorer" and 0 <= index < len(self.scorers):
            return self.scorers[index]
        raise KeyError(f"the plan has no {component} {index}")

    def env_for(self, component: Component, index: int = 0) -> dict[str, str]:
        return self.placement_of(component, index).env()

    def cpus_for(self, component: Component, index: int = 0) -> tuple[int, ...]:
        return self.placement_of(component, index).cpus

    def describe(self) -> str:
        """A compact table for the console."""
        gpus = ",".join(self.machine_gpus) or "none"
        lines = [
            f"placement: {len(self.machine_cpus)} cores ({format_cores(self.machine_cpus)}), "
            f"GPUs: {gpus}",
            f"  {'process':<16} {'cores':<14} {'threads':>7}  {'priority':<10}  gpus",
        ]
        for p in self.processes:
            name = f"{p.name}×{p.ranks}" if p.ranks > 1 else p.name
            cores = format_cores(p.cpus) + (" shared" if p.shared else "")
            gpus = ",".join(p.gpus) or "cpu"
            if p.gpu_memory_fraction is not None:
                gpus += f" ({p.gpu_memory_fraction:.0%} of memory)"
            lines.append(f"  {name:<16} {cores:<14} {p.threads:>7}  {p.priority:<10}  {gpus}")
        lines += [f"  {reason}" for reason in self.reasons]
        return "\n".join(lines)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> PlacementPlan:
        return cls.model_validate_json(text)


def write_placement(run: Location, plan: PlacementPlan) -> None:
    """Store the plan as `<run>/control/placement.json` (each start of the run rewrites it)."""
    if run.is_local:
        run.fs.makedirs(run.join("control"), exist_ok=True)
    run.fs.pipe_file(run.join(*PLACEMENT_FILE), plan.to_json().encode())


def read_placement(run: Location) -> PlacementPlan:
    return PlacementPlan.from_json(run.fs.cat_file(run.join(*PLACEMENT_FILE)))


def bind_rank(local_rank: int) -> tuple[int, ...] | None:
    """In a learner rank started from a placement of several ranks: move this process onto
    its own cores (`RANK_CORES_VARIABLE`) and return them; None when there is no such plan."""
    blocks = os.environ.get(RANK_CORES_VARIABLE)
    if not blocks:
        return None
    cores = tuple(parse_cores(blocks.split(";")[local_rank]))
    os.sched_setaffinity(0, cores)
    return cores
