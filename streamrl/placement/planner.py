"""Who runs where on one machine: the CPU cores and GPUs of the learner, each generator and the
evaluator, decided once before anything starts.

`plan_placement(config, generators=N)` partitions what this process may use — the cores in its
affinity (`os.sched_getaffinity(0)`) and the visible GPUs (`CUDA_VISIBLE_DEVICES`, else every
GPU torch sees) — between the run's processes, and refuses a plan that does not fit with an
error naming the numbers. `place_alone` places one process on a machine of its own (a flow run
on a work pool).

The served scorers (`scorers.<name>` without a url: vLLM servers of a teacher, reward model or
judge) are engines too, one process each, named `scorer-<name>`.

Defaults (every choice can be pinned in the config: `learner.gpus`, `learner.cpu_cores`,
`generator.cpu_cores`, `eval.cpu_cores`, `scorers.<name>.cpu_cores`; GPUs per engine are
`generator.tensor_parallel_size`, a scorer's its own `tensor_parallel_size`):

- GPUs: the learner takes one per rank (the first `learner.nproc_per_node`, or `learner.gpus`),
  then each generator, the evaluator and each scorer take their tensor-parallel size, in order,
  the least used GPUs first. With fewer GPUs than that (or `placement.share_gpus: true`, which
  puts the engines on the learner's GPUs) processes share GPUs, concurrently: the memory of a
  shared GPU is planned for all its users together (`streamrl.placement.gpu_memory`) and the
  plan refused with the numbers when they do not fit; `placement.share_gpus: false` refuses
  instead of sharing. A component on CPU (`device: cpu`, or `auto` with no GPU visible) gets
  none: `CUDA_VISIBLE_DEVICES=""`.
- Cores: explicit core lists first, then explicit counts (the lowest free cores), then the
  automatic components share what is left, work-conserving: the learner takes every free core,
  and the engines run on the same cores at `background` priority (`ProcessPlacement.priority`,
  applied by the exec wrapper of `streamrl.isolation.lifetime`), so they get only what the
  learner leaves — its Python between kernels, the whole machine while it waits for data — and
  a core never idles while anyone has work. Generators and scorers, which always have work,
  split the free cores into disjoint blocks between them (round-robin when there are fewer
  cores than they); the evaluator, idle between versions, runs on all of them. Explicit
  settings that do not fit are refused.
- Threads: each process gets one OpenMP thread per core it has (per rank for the learner),
  fixed for the run and recorded in the plan: the learner's results depend on that count,
  never on how busy the machine is.
- Weights: the generators beside the learner take each version from its memory, not from
  storage (`weights.handoff`; by default those on one of its GPUs, `streamrl.placement.handoff`).
- The plan's `reasons` say in words who shares what, and why (the run header prints them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from streamrl.config.base import format_cores
from streamrl.placement.config import PlacementError
from streamrl.placement.cores import machine_cpus, visible_gpus
from streamrl.placement.gpu_memory import ModelShape, share_gpu_memory
from streamrl.placement.records import Component, PlacementPlan, ProcessPlacement
from streamrl.scorers.config import scorer_process_name

if TYPE_CHECKING:
    from streamrl.config.run import RunConfig

__all__ = ["PlacementError", "place_alone", "plan_placement"]


def plan_placement(
    config: RunConfig,
    *,
    generators: int | None = None,
    evaluator: bool = True,
    cpus: Sequence[int] | None = None,
    gpus: Sequence[str] | None = None,
    gpu_memory: dict[str, int] | None = None,
    model: ModelShape | None = None,
) -> PlacementPlan:
    """Place the learner, `generators` generators (default `generator.count`; none for a
    supervised run), when `evaluator` and `eval.every_versions` > 0 the evaluator (not for a
    supervised run: its held-out loss is the learner's), and the served scorers on this
    machine's `cpus` (default: this process's affinity) and `gpus` (default: `visible_gpus()`).
    A shared GPU's memory is planned from each GPU's size in bytes (`gpu_memory`, default: read
    from the devices) and the policy's shape (`model`, default: read from `model.path`).

    Raises `PlacementError` naming the numbers when the processes do not fit, or when the run
    is placed on work pools (`placement.mode=pools`)."""
    config.placement.check_on_this_machine()
    cpus = sorted(set(machine_cpus() if cpus is None else cpus))
    gpus = list(visible_gpus() if gpus is None else gpus)
    count = config.generators_to_start(generators)
    with_eval = evaluator and config.eval.every_versions > 0 and not config.learner_only
    scorers = [scorer_process_name(name) for name in config.served_scorers]
    names = [
        "learner", *(f"gen{i}" for i in range(count)), *(["eval"] if with_eval else []), *scorers
    ]  # fmt: skip
    gpu_of = _place_gpus(config, count, with_eval, gpus)
    handing = _handoff_targets(config, gpu_of, count)
    memory_of, gpu_reasons = share_gpu_memory(
        config, gpu_of, gpu_memory, model, handoff=bool(handing)
    )
    core_of, reasons = _place_cores(config, count, with_eval, cpus)
    assert set(core_of) == set(names)
    ranks = config.learner.nproc_per_node
    learner_cores = set(core_of["learner"])
    yielding = [n for n in names[1:] if learner_cores & set(core_of[n])]

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
            shared=any(set(cores) & set(core_of[other]) for other in names if other != name),
            priority="background" if name in yielding else "normal",
            gpu_memory_fraction=memory_of.get(name),
            handoff=name in handing or (name == "learner" and bool(handing)),
        )

    if yielding:
        threads = max(1, len(learner_cores) // ranks)
        one = len(yielding) == 1
        reasons.insert(
            0,
            f"{', '.join(yielding)} {'runs' if one else 'run'} on the learner's cores at "
            f"background priority: {'it takes' if one else 'they take'} what the learner "
            "leaves, all of it while it waits for data; the learner keeps "
            f"{threads} thread{'s' if threads > 1 else ''} per rank for the whole run (its "
            "results depend on that count, never on load)",
        )
    if handing:
        reasons.append(_handoff_reason(handing, gpu_of))
    return PlacementPlan(
        machine_cpus=tuple(cpus),
        machine_gpus=tuple(gpus),
        learner=process("learner", "learner"),
        generators=tuple(process(f"gen{i}", "generator", i) for i in range(count)),
        evaluator=process("eval", "evaluator") if with_eval else None,
        scorers=tuple(process(name, "scorer", i) for i, name in enumerate(scorers)),
        reasons=(*gpu_reasons, *reasons),
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
    node, generator `index`, the evaluator or served scorer `index`. It takes every core of
    this process's affinity (`cpus`; the learner: `learner.cpu_cores` of them when set) and, on
    CUDA, the first `learner.nproc_per_node` (learner) or `tensor_parallel_size` (engines)
    visible GPUs. Raises `PlacementError` when there are fewer."""
    cpus = sorted(set(machine_cpus() if cpus is None else cpus))
    gpus = list(visible_gpus() if gpus is None else gpus)
    ranks = config.learner.nproc_per_node if component == "learner" else 1
    if component == "learner":
        field, device, wanted = "learner.nproc_per_node", config.learner.device, ranks
        cpus = _own_learner_cores(config.learner.cpu_cores, cpus)
    elif component == "scorer":
        scorer_name = config.served_scorers[index]
        scorer = config.scorers[scorer_name]
        field = f"scorers.{scorer_name}.tensor_parallel_size"
        device, wanted = scorer.device, scorer.tensor_parallel_size
    else:
        field, device = "generator.tensor_parallel_size", config.generator.device
        wanted = config.generator.tensor_parallel_size
    if component == "scorer":
        name = scorer_process_name(config.served_scorers[index])
    else:
        name = {"learner": "learner", "generator": f"gen{index}", "evaluator": "eval"}[component]
    device_field = field.rsplit(".", 1)[0] + ".device"
    mine: list[str] = []
    if _on_cuda(device, gpus, "learner.device" if component == "learner" else device_field):
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


def _handoff_targets(config: RunConfig, gpu_of: dict[str, list[str]], count: int) -> list[str]:
    """The generators that take weight versions from the learner's memory
    (`weights.handoff`): by default those that hold one of the learner's GPUs."""
    learner_gpus = set(gpu_of.get("learner", ()))
    return [
        name
        for name in (f"gen{i}" for i in range(count))
        if config.weights.hands_off(config.model, bool(learner_gpus & set(gpu_of.get(name, ()))))
    ]


def _handoff_reason(handing: list[str], gpu_of: dict[str, list[str]]) -> str:
    learner_gpus = set(gpu_of.get("learner", ()))
    on_gpu = [n for n in handing if learner_gpus & set(gpu_of.get(n, ()))]
    on_host = [n for n in handing if n not in on_gpu]
    parts = []
    if on_gpu:
        parts.append(f"{', '.join(on_gpu)} from its GPU memory (CUDA IPC, device to device)")
    if on_host:
        parts.append(f"{', '.join(on_host)} from its host memory (shared memory)")
    return (
        f"weight versions go from the learner to {' and '.join(parts)}, not through storage "
        "(still written, for resume and the other readers)"
    )


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
    """GPU names per process name: the learner one per rank, each engine TP of them; engines
    share GPUs (the learner's first when `placement.share_gpus` asks for it) when the machine
    has too few for each its own."""
    learner, tp = config.learner, config.generator.tensor_parallel_size
    engines = [f"gen{i}" for i in range(count)] + (["eval"] if with_eval else [])
    learner_on = _on_cuda(learner.device, gpus, "learner.device")
    engines_on = bool(engines) and _on_cuda(config.generator.device, gpus, "generator.device")
    scorers = {  # a served scorer on CUDA: its process name → its GPU count
        scorer_process_name(name): config.scorers[name].tensor_parallel_size
        for name in config.served_scorers
        if _on_cuda(config.scorers[name].device, gpus, f"scorers.{name}.device")
    }
    if not learner_on and learner.gpus is not None:
        raise PlacementError(
            f"learner.gpus={learner.gpus} but the learner runs on CPU here (learner.device="
            f"{learner.device}, {len(gpus)} GPU(s) visible); remove learner.gpus"
        )
    wanted = dict.fromkeys(engines, tp) if engines_on else {}
    wanted |= scorers
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
    for name, n in scorers.items():
        parts.append(f"{name} {n} GPU{'s' if n > 1 else ''}")
        total += n
    share = config.placement.share_gpus
    widest = max([*wanted.values(), learner.nproc_per_node if learner_on else 0, 0])
    if total > len(gpus) and (share is False or widest > len(gpus)):
        fix = "" if share is False else " (sharing cannot help: one process needs more)"
        raise PlacementError(
            f"{' + '.join(parts)} = {total} GPUs, this machine has {len(gpus)}{fix}; lower "
            "generator.count, generator.tensor_parallel_size, learner.nproc_per_node or a "
            "scorer's tensor_parallel_size, run the generators or scorers on CPU "
            "(generator.device=cpu, scorers.<name>.device=cpu)"
            + ("" if share is not False else ", or let them share GPUs (placement.share_gpus)")
        )
    users = dict.fromkeys(range(len(gpus)), 0)
    placed: dict[str, list[int]] = {}
    if learner_on:
        positions = learner.gpus if isinstance(learner.gpus, list) else list(users)
        outside = [g for g in positions if g >= len(gpus)]
        if outside:
            raise PlacementError(
                f"learner.gpus={learner.gpus} names GPU positions {outside}, but this machine "
                f"exposes {len(gpus)} GPU(s) (positions 0..{len(gpus) - 1})"
            )
        placed["learner"] = list(positions[: learner.nproc_per_node])
        for g in placed["learner"]:
            users[g] += 1
    hosts = placed["learner"] if share and learner_on else list(users)
    for name, n in wanted.items():  # the least used GPUs first, in order
        pool = hosts if len(hosts) >= n else list(users)
        placed[name] = sorted(sorted(pool, key=lambda g: (users[g], g))[:n])
        for g in placed[name]:
            users[g] += 1
    return {name: [gpus[i] for i in at] for name, at in placed.items()}


class _Claim(NamedTuple):
    """A component's cores setting: who it covers and what it asks for."""

    label: str  # in messages: "learner", "generators", "evaluator"
    field: str  # its config field
    setting: int | list[int] | None  # a count, a core list, or None (automatic)
    members: list[str]  # the processes sharing its cores out between them


def _place_cores(
    config: RunConfig, count: int, with_eval: bool, cpus: Sequence[int]
) -> tuple[dict[str, list[int]], list[str]]:
    """Cores per process name, and the reasons for what is shared."""
    generators = [f"gen{i}" for i in range(count)]
    scorers = [scorer_process_name(name) for name in config.served_scorers]
    claims = [
        _Claim("learner", "learner.cpu_cores", config.learner.cpu_cores, ["learner"]),
        _Claim("generators", "generator.cpu_cores", config.generator.cpu_cores, generators),
    ]
    if with_eval:
        claims.append(_Claim("evaluator", "eval.cpu_cores", config.eval.cpu_cores, ["eval"]))
    for name, process in zip(config.served_scorers, scorers, strict=True):
        field = f"scorers.{name}.cpu_cores"
        claims.append(_Claim(process, field, config.scorers[name].cpu_cores, [process]))
    claims = [c for c in claims if c.members]
    given = _explicit_cores(claims, cpus)
    placed: dict[str, list[int]] = {}
    for claim in claims:
        if claim.label in given:
            placed.update(_blocks(given[claim.label], claim.members))
    auto = [c for c in claims if c.label not in given]
    free = [c for c in cpus if not any(c in cores for cores in given.values())]
    if not auto:
        return placed, []
    if not free:
        raise PlacementError(
            f"no cores left for the {', '.join(c.label for c in auto)}: the explicit settings "
            f"take all {len(cpus)}; leave some free or set theirs too"
        )
    reasons: list[str] = []
    if auto[0].label == "learner":  # every free core, whoever else runs on them
        placed["learner"] = free
    # Engines that always have work (generators, scorers) split the free cores between them;
    # the evaluator, idle between versions, runs on all of them.
    steady = [name for c in auto if c.label != "learner" for name in c.members if name != "eval"]
    if steady:
        if len(free) >= len(steady):
            placed.update(_blocks(free, steady))
        else:
            placed.update({name: [free[i % len(free)]] for i, name in enumerate(steady)})
            reasons.append(f"{len(steady)} engines on {len(free)} core(s): they take turns on them")
    if any(c.label == "evaluator" for c in auto):
        placed["eval"] = free
    return placed, reasons


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
