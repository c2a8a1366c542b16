"""Who runs where on one machine: the CPU cores and GPUs of the learner, each generator and the
evaluator, decided once before anything starts.

`plan_placement(config, generators=N)` partitions what this process may use — the cores in its
affinity (`os.sched_getaffinity(0)`) and the visible GPUs (`CUDA_VISIBLE_DEVICES`, else every
GPU torch sees) — between the run's processes, and refuses a plan that does not fit with an
error naming the numbers. Each process is then started from its `ProcessPlacement`: its
affinity (`cpus`) and its environment (`env()`: `CUDA_VISIBLE_DEVICES`, OpenMP / MKL thread
counts, vLLM's CPU thread binding, and OpenMP waits that sleep instead of spinning when idle).

Defaults (every choice can be pinned in the config: `learner.gpus`, `learner.cpu_cores`,
`generator.cpu_cores`, `eval.cpu_cores`; GPUs per engine are `generator.tensor_parallel_size`):

- GPUs: the learner takes one per rank (the first `learner.nproc_per_node`, or `learner.gpus`),
  then each generator and the evaluator take `tensor_parallel_size` each, in order. A component
  on CPU (`device: cpu`, or `auto` with no GPU visible) gets none: `CUDA_VISIBLE_DEVICES=""`.
- Cores: explicit core lists first, then explicit counts (the lowest free cores), then the
  automatic components share what is left: the learner half (at least one core), the
  generators and the evaluator equal disjoint blocks of the rest. With fewer free cores than
  automatic engines (2 cores, 2 generators) engines share cores round-robin, marked `shared`;
  explicit settings that do not fit are refused instead.

The plan is printed (`describe()`) and stored as `<run>/control/placement.json`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from storage.fs import Location
    from streamrl.config import RunConfig

__all__ = [
    "PLACED_VARIABLES",
    "PLACEMENT_FILE",
    "RANK_CORES_VARIABLE",
    "PlacementError",
    "PlacementPlan",
    "ProcessPlacement",
    "bind_rank",
    "format_cores",
    "machine_cpus",
    "parse_cores",
    "place_alone",
    "plan_placement",
    "read_placement",
    "visible_gpus",
    "write_placement",
]

PLACEMENT_FILE = ("control", "placement.json")
Component = Literal["learner", "generator", "evaluator"]

# OpenMP threads that wait for work sleep instead of spinning on a core another process needs
# (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT, Intel's runtime KMP_BLOCKTIME).
IDLE_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}

# A learner of several ranks: each rank's cores, ';'-separated in rank order (`bind_rank`).
RANK_CORES_VARIABLE = "STREAMRL_RANK_CORES"

# Every variable a placement decides: a planned process never inherits them from its supervisor.
PLACED_VARIABLES = frozenset(
    {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"}
    | {RANK_CORES_VARIABLE}
    | set(IDLE_WAIT_ENV)
)


class PlacementError(ValueError):
    """The configured processes do not fit on this machine; the message names the numbers."""


# -- core lists ------------------------------------------------------------------------------


def parse_cores(text: str) -> list[int]:
    """'0-3,8' → [0, 1, 2, 3, 8] (sorted, each core once)."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{text!r} is not a core list like '0-3,8'")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"core range {part!r} runs backwards; write {last}-{first}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"{text!r} names no core; write a core list like '0-3,8' or a count")
    return sorted(cores)


def format_cores(cores: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8] → '0-3,8' (the form taskset and VLLM_CPU_OMP_THREADS_BIND read)."""
    ranges: list[str] = []
    ordered = sorted(set(cores))
    start = prev = ordered[0] if ordered else 0
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(ranges) if ordered else ""


def machine_cpus() -> list[int]:
    """The cores this process may run on (its affinity), which the run's processes share."""
    return sorted(os.sched_getaffinity(0))


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as `CUDA_VISIBLE_DEVICES` names them for a child: that
    variable's entries when it is set (an empty value hides every GPU), else 0..N−1 for the N
    devices torch counts."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


# -- the plan --------------------------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProcessPlacement(_Record):
    """Where one process of the run (for the learner: its whole torchrun job) runs.

    Invariants: `cpus` is non-empty and within the machine's affinity; `gpus` are entries of
    the machine's visible GPU list (empty: on CPU); `threads` ≥ 1 OpenMP threads per process
    (for a learner of several ranks, its cores divided between them)."""

    name: str
    component: Component
    index: int = 0
    ranks: int = 1
    cpus: tuple[int, ...]
    gpus: tuple[str, ...] = ()
    threads: int = 1
    shared: bool = False  # cores shared with another process (too few for disjoint blocks)

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
        }
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

    @property
    def processes(self) -> list[ProcessPlacement]:
        evaluator = [self.evaluator] if self.evaluator is not None else []
        return [self.learner, *self.generators, *evaluator]

    def placement_of(self, component: Component, index: int = 0) -> ProcessPlacement:
        """The placement of the learner, generator `index` or the evaluator."""
        if component == "learner":
            return self.learner
        if component == "generator" and 0 <= index < len(self.generators):
            return self.generators[index]
        if component == "evaluator" and self.evaluator is not None:
            return self.evaluator
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
            f"  {'process':<10} {'cores':<14} {'threads':>7}  gpus",
        ]
        for p in self.processes:
            name = f"{p.name}×{p.ranks}" if p.ranks > 1 else p.name
            cores = format_cores(p.cpus) + (" shared" if p.shared else "")
            lines.append(f"  {name:<10} {cores:<14} {p.threads:>7}  {','.join(p.gpus) or 'cpu'}")
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


# -- planning --------------------------------------------------------------------------------


def plan_placement(
    config: RunConfig,
    *,
    generators: int | None = None,
    evaluator: bool = True,
    cpus: Sequence[int] | None = None,
    gpus: Sequence[str] | None = None,
) -> PlacementPlan:
    """Place the learner, `generators` generators (default `generator.count`) and, when
    `evaluator` and `eval.every_versions` > 0, the evaluator on this machine's `cpus` (default:
    this process's affinity) and `gpus` (default: `visible_gpus()`).

    Raises `PlacementError` naming the numbers when the processes do not fit."""
    cpus = sorted(set(machine_cpus() if cpus is None else cpus))
    gpus = list(visible_gpus() if gpus is None else gpus)
    count = config.generator.count if generators is None else generators
    with_eval = evaluator and config.eval.every_versions > 0
    names = ["learner", *(f"gen{i}" for i in range(count)), *(["eval"] if with_eval else [])]
    gpu_of = _place_gpus(config, count, with_eval, gpus)
    core_of, shared = _place_cores(config, count, with_eval, cpus)
    ranks = config.learner.nproc_per_node

    def process(name: str, component: Component, index: int = 0) -> ProcessPlacement:
        n_ranks = ranks if component == "learner" else 1
        cores = core_of[name]
        return ProcessPlacement(
            name=name,
            component=component,
            index=index,
            ranks=n_ranks,
            cpus=tuple(cores),
            gpus=tuple(gpu_of.get(name, ())),
            threads=max(1, len(cores) // n_ranks),
            shared=name in shared,
        )

    assert set(core_of) == set(names)
    return PlacementPlan(
        machine_cpus=tuple(cpus),
        machine_gpus=tuple(gpus),
        learner=process("learner", "learner"),
        generators=tuple(process(f"gen{i}", "generator", i) for i in range(count)),
        evaluator=process("eval", "evaluator") if with_eval else None,
    )


def place_alone(
    config: RunConfig,
    component: Component,
    index: int = 0,
    *,
    cpus: Sequence[int] | None = None,
    gpus: Sequence[str] | None = None,
) -> ProcessPlacement:
    """One process of a run on a machine of its own — a flow run on a work pool: a learner
    node, generator `index` or the evaluator. It takes every core of this process's affinity
    (`cpus`; the learner: `learner.cpu_cores` of them when set) and, on CUDA, the first
    `learner.nproc_per_node` (learner) or `tensor_parallel_size` (engines) visible GPUs.
    Raises `PlacementError` when there are fewer."""
    cpus = sorted(set(machine_cpus() if cpus is None else cpus))
    gpus = list(visible_gpus() if gpus is None else gpus)
    ranks = config.learner.nproc_per_node if component == "learner" else 1
    if component == "learner":
        field, device, wanted = "learner.nproc_per_node", config.learner.device, ranks
        cpus = _own_learner_cores(config.learner.cpu_cores, cpus)
    else:
        field, device = "generator.tensor_parallel_size", config.generator.device
        wanted = config.generator.tensor_parallel_size
    name = {"learner": "learner", "generator": f"gen{index}", "evaluator": "eval"}[component]
    mine: list[str] = []
    if _on_cuda(device, gpus, "learner.device" if component == "learner" else "generator.device"):
        if len(gpus) < wanted:
            raise PlacementError(
                f"{name} needs {wanted} GPUs ({field}) but this machine exposes {len(gpus)}"
            )
        mine = gpus[:wanted]
    return ProcessPlacement(
        name=name,
        component=component,
        index=index,
        ranks=ranks,
        cpus=tuple(cpus),
        gpus=tuple(mine),
        threads=max(1, len(cpus) // ranks),
    )


def _own_learner_cores(setting: int | list[int] | None, cpus: list[int]) -> list[int]:
    """A learner node's cores: `learner.cpu_cores` (a count from the lowest, or a list) within
    `cpus`, else all of them."""
    if setting is None:
        return cpus
    if isinstance(setting, int):
        if setting > len(cpus):
            raise PlacementError(
                f"learner.cpu_cores={setting} but this machine has {len(cpus)} cores; lower it"
            )
        return cpus[:setting]
    outside = sorted(set(setting) - set(cpus))
    if outside:
        raise PlacementError(
            f"learner.cpu_cores={format_cores(setting)} names cores {format_cores(outside)} "
            f"this process may not use (its affinity: {format_cores(cpus)})"
        )
    return sorted(setting)


def bind_rank(local_rank: int) -> tuple[int, ...] | None:
    """In a learner rank started from a placement of several ranks: move this process onto
    its own cores (`RANK_CORES_VARIABLE`) and return them; None when there is no such plan."""
    blocks = os.environ.get(RANK_CORES_VARIABLE)
    if not blocks:
        return None
    cores = tuple(parse_cores(blocks.split(";")[local_rank]))
    os.sched_setaffinity(0, cores)
    return cores


def _on_cuda(device: str, gpus: Sequence[str], field: str) -> bool:
    if device == "cuda" and not gpus:
        raise PlacementError(
            f"{field}=cuda but this machine exposes no GPU (CUDA_VISIBLE_DEVICES / "
            f"torch.cuda.device_count()); set {field}=cpu or auto"
        )
    return device == "cuda" or (device == "auto" and bool(gpus))


def _place_gpus(
    config: RunConfig, count: int, with_eval: bool, gpus: Sequence[str]
) -> dict[str, list[str]]:
    """GPU names per process name: the learner one per rank, each engine TP of them."""
    learner, tp = config.learner, config.generator.tensor_parallel_size
    engines = [f"gen{i}" for i in range(count)] + (["eval"] if with_eval else [])
    learner_on = _on_cuda(learner.device, gpus, "learner.device")
    engines_on = bool(engines) and _on_cuda(config.generator.device, gpus, "generator.device")
    if not learner_on and learner.gpus is not None:
        raise PlacementError(
            f"learner.gpus={learner.gpus} but the learner runs on CPU here (learner.device="
            f"{learner.device}, {len(gpus)} GPU(s) visible); remove learner.gpus"
        )
    parts, total = [], 0
    if engines_on:
        parts.append(f"{count} generators × {tp} GPU{'s' if tp > 1 else ''}")
        total += count * tp
    if learner_on:
        parts.append(f"learner {learner.nproc_per_node} GPUs")
        total += learner.nproc_per_node
    if engines_on and with_eval:
        parts.append(f"evaluator {tp} GPU{'s' if tp > 1 else ''}")
        total += tp
    if total > len(gpus):
        raise PlacementError(
            f"{' + '.join(parts)} = {total} GPUs, this machine has {len(gpus)}; lower "
            "generator.count, generator.tensor_parallel_size or learner.nproc_per_node, or run "
            "the generators on CPU (generator.device=cpu)"
        )
    free = list(range(len(gpus)))
    placed: dict[str, list[int]] = {}
    if learner_on:
        positions = learner.gpus if isinstance(learner.gpus, list) else free
        outside = [g for g in positions if g >= len(gpus)]
        if outside:
            raise PlacementError(
                f"learner.gpus={learner.gpus} names GPU positions {outside}, but this machine "
                f"exposes {len(gpus)} GPU(s) (positions 0..{len(gpus) - 1})"
            )
        placed["learner"] = list(positions[: learner.nproc_per_node])
        free = [g for g in free if g not in placed["learner"]]
    if engines_on:
        for name in engines:
            placed[name], free = free[:tp], free[tp:]
    return {name: [gpus[i] for i in at] for name, at in placed.items()}


class _Claim(NamedTuple):
    """A component's cores setting: who it covers and what it asks for."""

    label: str  # in messages: "learner", "generators", "evaluator"
    field: str  # its config field
    setting: int | list[int] | None  # a count, a core list, or None (automatic)
    members: list[str]  # the processes sharing its cores out between them


def _place_cores(
    config: RunConfig, count: int, with_eval: bool, cpus: Sequence[int]
) -> tuple[dict[str, list[int]], set[str]]:
    """Cores per process name, and the names whose cores are shared with another process."""
    claims = [
        _Claim("learner", "learner.cpu_cores", config.learner.cpu_cores, ["learner"]),
        _Claim(
            "generators",
            "generator.cpu_cores",
            config.generator.cpu_cores,
            [f"gen{i}" for i in range(count)],
        ),
    ]
    if with_eval:
        claims.append(_Claim("evaluator", "eval.cpu_cores", config.eval.cpu_cores, ["eval"]))
    claims = [c for c in claims if c.members]
    given = _explicit_cores(claims, cpus)
    placed: dict[str, list[int]] = {}
    for claim in claims:
        if claim.label in given:
            placed.update(_blocks(given[claim.label], claim.members))
    auto = [c for c in claims if c.label not in given]
    free = [c for c in cpus if not any(c in cores for cores in given.values())]
    shared: set[str] = set()
    if not auto:
        return placed, shared
    if not free:
        raise PlacementError(
            f"no cores left for the {', '.join(c.label for c in auto)}: the explicit settings "
            f"take all {len(cpus)}; leave some free or set theirs too"
        )
    engines = [name for c in auto if c.label != "learner" for name in c.members]
    if auto[0].label == "learner":
        if not engines:
            placed["learner"] = free
            return placed, shared
        if len(free) < 2:  # one core for everything: share it
            placed["learner"], shared = free, {"learner", *engines}
        else:  # the learner half (rounded down), the engines the rest
            half = len(free) // 2
            placed["learner"], free = free[:half], free[half:]
    if len(free) >= len(engines):
        placed.update(_blocks(free, engines))
    else:
        for i, name in enumerate(engines):
            placed[name] = [free[i % len(free)]]
        shared |= set(engines)
    return placed, shared


def _explicit_cores(claims: Sequence[_Claim], cpus: Sequence[int]) -> dict[str, list[int]]:
    """The cores of each claim with a setting: core lists as given (checked against the
    machine and each other), then counts from the lowest cores still free."""
    taken: dict[int, str] = {}
    given: dict[str, list[int]] = {}
    for claim in claims:
        if not isinstance(claim.setting, list):
            continue
        wanted = format_cores(claim.setting)
        outside = sorted(set(claim.setting) - set(cpus))
        if outside:
            raise PlacementError(
                f"{claim.field}={wanted} names cores {format_cores(outside)} this process may "
                f"not use (its affinity: {format_cores(cpus)})"
            )
        clash = [c for c in claim.setting if c in taken]
        if clash:
            raise PlacementError(
                f"{claim.field}={wanted} overlaps the cores of the {taken[clash[0]]} on "
                f"{format_cores(clash)}; give each component its own cores"
            )
        taken.update(dict.fromkeys(claim.setting, claim.label))
        given[claim.label] = list(claim.setting)
    counted = [c for c in claims if isinstance(c.setting, int)]
    free = [c for c in cpus if c not in taken]
    asked = sum(c.setting for c in counted)  # type: ignore[misc]
    if asked > len(free):
        parts = " + ".join(f"{c.label} {c.setting}" for c in counted)
        listed = f", {len(taken)} of them taken by core lists" if taken else ""
        raise PlacementError(
            f"{parts} = {asked} cores, but this machine has {len(cpus)}{listed}; lower the "
            f"counts ({', '.join(c.field for c in counted)})"
        )
    for claim in counted:
        given[claim.label], free = free[: claim.setting], free[claim.setting :]
    for claim in claims:
        cores = given.get(claim.label)
        if cores is not None and len(cores) < len(claim.members):
            raise PlacementError(
                f"{claim.field} gives {len(cores)} core(s) to {len(claim.members)} "
                f"{claim.label}: at least one core each; give it {len(claim.members)} or more"
            )
    return given


def _blocks(cores: Sequence[int], names: Sequence[str]) -> dict[str, list[int]]:
    """Contiguous, disjoint, near-equal blocks of `cores`, the first blocks one core larger."""
    size, extra = divmod(len(cores), len(names))
    blocks: dict[str, list[int]] = {}
    start = 0
    for i, name in enumerate(names):
        end = start + size + (1 if i < extra else 0)
        blocks[name] = list(cores[start:end])
        start = end
    return blocks
