"""Placement plans: who gets which cores and GPUs, checked against hand-made expectations for
CPU-only machines and a fake 8-GPU machine; the environment a started process really gets."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from storage.fs import open_location
from streamrl.config.base import ConfigError, format_cores, parse_cores
from streamrl.config.loading import load_config
from streamrl.placement import (
    PlacementError,
    PlacementPlan,
    machine_cpus,
    place_alone,
    plan_placement,
    read_placement,
    visible_gpus,
    write_placement,
)
from streamrl.supervision.launch import run_process

EIGHT_GPUS = [str(i) for i in range(8)]


def config(*overrides: str):
    return load_config(overrides=list(overrides))


def cores_of(plan: PlacementPlan) -> dict[str, list[int]]:
    return {p.name: list(p.cpus) for p in plan.processes}


def gpus_of(plan: PlacementPlan) -> dict[str, str]:
    return {p.name: p.env()["CUDA_VISIBLE_DEVICES"] for p in plan.processes}


# -- core lists ------------------------------------------------------------------------------


def test_core_lists_parse_and_format():
    assert parse_cores("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cores(" 5, 2-3,2") == [2, 3, 5]
    assert format_cores([8, 0, 1, 2, 3]) == "0-3,8"
    assert format_cores([1, 3, 5, 6]) == "1,3,5-6"
    for bad in ("a-3", "3-1", ",", "1-"):
        with pytest.raises(ValueError, match="core"):
            parse_cores(bad)


def test_core_settings_in_the_config():
    cfg = config("learner.cpu_cores=0-3,8", "generator.cpu_cores=3")
    assert cfg.learner.cpu_cores == [0, 1, 2, 3, 8]
    assert cfg.generator.cpu_cores == 3  # a bare number is a count
    assert config("eval.cpu_cores=[7, 6]").eval.cpu_cores == [6, 7]
    for bad in ("learner.cpu_cores=0", "generator.cpu_cores=4-2", "learner.cpu_cores=[]"):
        with pytest.raises(ConfigError, match="cpu_cores"):
            config(bad)


def test_learner_gpus_must_give_one_per_rank():
    assert config("learner.nproc_per_node=2", "learner.gpus=[6, 7]").learner.gpus == [6, 7]
    with pytest.raises(ConfigError, match=r"2 GPU.*nproc_per_node is 4"):
        config("learner.nproc_per_node=4", "learner.gpus=2")
    with pytest.raises(ConfigError, match="twice"):
        config("learner.nproc_per_node=2", "learner.gpus=[1, 1]")


# -- CPU-only machines -----------------------------------------------------------------------


def test_two_cores_learner_on_both_and_the_generator_beneath_it():
    plan = plan_placement(config(), generators=1, cpus=[0, 1], gpus=[])
    assert cores_of(plan) == {"learner": [0, 1], "gen0": [0, 1]}
    learner, gen = plan.env_for("learner"), plan.env_for("generator", 0)
    assert learner["CUDA_VISIBLE_DEVICES"] == gen["CUDA_VISIBLE_DEVICES"] == ""
    assert learner["OMP_NUM_THREADS"] == gen["OMP_NUM_THREADS"] == "2"
    assert learner["OMP_WAIT_POLICY"] == gen["OMP_WAIT_POLICY"] == "PASSIVE"
    assert learner["OMP_DYNAMIC"] == learner["MKL_DYNAMIC"] == "FALSE"  # never fewer on load
    assert gen["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in learner
    assert (plan.learner.priority, plan.generators[0].priority) == ("normal", "background")
    assert plan.learner.shared
    assert plan.generators[0].shared
    assert "gen0 runs on the learner's cores at background priority" in plan.describe()
    assert "keeps 2 threads per rank for the whole run" in plan.describe()


def test_sixteen_cores_to_the_learner_engines_split_them_beneath_it():
    cfg = config("eval.every_versions=2", "learner.nproc_per_node=2")
    plan = plan_placement(cfg, generators=3, cpus=range(16), gpus=[])
    assert cores_of(plan) == {
        "learner": list(range(16)),
        "gen0": [0, 1, 2, 3, 4, 5],
        "gen1": [6, 7, 8, 9, 10],
        "gen2": [11, 12, 13, 14, 15],
        "eval": list(range(16)),  # idle between versions: all of them while it evaluates
    }
    assert plan.learner.threads == 8  # 16 cores between 2 ranks
    assert plan.env_for("evaluator")["VLLM_CPU_OMP_THREADS_BIND"] == "0-15"
    assert plan.env_for("generator", 2)["OMP_NUM_THREADS"] == "5"
    assert [p.priority for p in plan.processes] == ["normal", *["background"] * 4]


def test_the_evaluator_is_planned_only_when_evaluation_is_on():
    assert plan_placement(config(), cpus=range(4), gpus=[]).evaluator is None
    off = plan_placement(config("eval.every_versions=1"), evaluator=False, cpus=[0, 1], gpus=[])
    assert off.evaluator is None
    with pytest.raises(KeyError):
        off.placement_of("evaluator")


def test_more_engines_than_free_cores_take_turns_on_them():
    plan = plan_placement(config(), generators=3, cpus=[0, 1], gpus=[])
    assert cores_of(plan) == {"learner": [0, 1], "gen0": [0], "gen1": [1], "gen2": [0]}
    assert all(p.shared for p in plan.processes)
    assert "3 engines on 2 core(s): they take turns on them" in plan.reasons
    one = plan_placement(config(), generators=1, cpus=[5], gpus=[])
    assert cores_of(one) == {"learner": [5], "gen0": [5]}
    assert one.learner.shared
    assert one.generators[0].shared


def test_explicit_core_lists_and_counts():
    cfg = config("learner.cpu_cores=0-3,8", "generator.cpu_cores=4-7")
    plan = plan_placement(cfg, generators=2, cpus=range(16), gpus=[])
    assert cores_of(plan) == {"learner": [0, 1, 2, 3, 8], "gen0": [4, 5], "gen1": [6, 7]}
    assert plan.learner.threads == 5
    # Cores of their own: nobody yields to the learner, nothing is said about sharing.
    assert {p.priority for p in plan.processes} == {"normal"}
    assert not any(p.shared for p in plan.processes)
    assert not plan.reasons
    counted = plan_placement(config("learner.cpu_cores=3"), generators=2, cpus=range(8), gpus=[])
    assert cores_of(counted) == {"learner": [0, 1, 2], "gen0": [3, 4, 5], "gen1": [6, 7]}
    listed_first = config("learner.cpu_cores=2", "generator.cpu_cores=0-1")
    plan = plan_placement(listed_first, generators=1, cpus=range(4), gpus=[])
    assert cores_of(plan) == {"learner": [2, 3], "gen0": [0, 1]}


def test_overlapping_core_lists_are_refused():
    cfg = config("learner.cpu_cores=0-3", "generator.cpu_cores=3-5")
    with pytest.raises(PlacementError, match=r"generator.cpu_cores=3-5 overlaps .*learner on 3"):
        plan_placement(cfg, generators=1, cpus=range(8), gpus=[])


def test_too_many_cores_are_refused_with_the_numbers():
    cfg = config("learner.cpu_cores=2", "generator.cpu_cores=2")
    with pytest.raises(PlacementError, match="learner 2 \\+ generators 2 = 4 cores, but this "):
        plan_placement(cfg, generators=1, cpus=[0, 1], gpus=[])
    with pytest.raises(PlacementError, match=r"names cores 8-9 .*affinity: 0-7"):
        plan_placement(config("learner.cpu_cores=6-9"), cpus=range(8), gpus=[])
    with pytest.raises(PlacementError, match=r"1 core.* to 2 generators"):
        plan_placement(config("generator.cpu_cores=[1]"), generators=2, cpus=range(4), gpus=[])
    with pytest.raises(PlacementError, match="no cores left for the generators"):
        plan_placement(config("learner.cpu_cores=0-1"), cpus=[0, 1], gpus=[])


# -- a machine with 8 GPUs -------------------------------------------------------------------


def test_four_rank_learner_and_four_generators_on_eight_gpus():
    cfg = config("learner.nproc_per_node=4")
    plan = plan_placement(cfg, generators=4, cpus=range(32), gpus=EIGHT_GPUS)
    assert gpus_of(plan) == {
        "learner": "0,1,2,3",
        "gen0": "4",
        "gen1": "5",
        "gen2": "6",
        "gen3": "7",
    }
    assert "VLLM_CPU_OMP_THREADS_BIND" not in plan.env_for("generator", 0)
    assert cores_of(plan)["learner"] == list(range(32))
    assert plan.learner.threads == 8


def test_tensor_parallel_generators_get_tp_gpus_each():
    cfg = config("learner.nproc_per_node=2", "generator.tensor_parallel_size=2")
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"every_versions": 1})})
    plan = plan_placement(cfg, generators=2, cpus=range(8), gpus=EIGHT_GPUS)
    assert gpus_of(plan) == {"learner": "0,1", "gen0": "2,3", "gen1": "4,5", "eval": "6,7"}


def test_an_eight_rank_learner_plus_generators_is_refused_with_the_numbers():
    cfg = config("learner.nproc_per_node=8", "placement.share_gpus=false")
    message = "8 generators × 1 GPU + learner 8 GPUs = 16 GPUs, this machine has 8"
    with pytest.raises(PlacementError, match=re.escape(message)):
        plan_placement(cfg, generators=8, cpus=range(64), gpus=EIGHT_GPUS)
    tp2 = config(
        "learner.nproc_per_node=4", "generator.tensor_parallel_size=2", "placement.share_gpus=false"
    )
    with pytest.raises(PlacementError, match="3 generators × 2 GPUs \\+ learner 4 GPUs = 10"):
        plan_placement(tp2, generators=3, cpus=range(64), gpus=EIGHT_GPUS)
    # Sharing cannot help a process wider than the machine.
    wide = config("generator.tensor_parallel_size=16")
    with pytest.raises(PlacementError, match="sharing cannot help: one process needs more"):
        plan_placement(wide, generators=1, cpus=range(64), gpus=EIGHT_GPUS)


def test_pinned_learner_gpus_and_generators_on_cpu():
    cfg = config("learner.nproc_per_node=4", "learner.gpus=[4, 5, 6, 7]")
    plan = plan_placement(cfg, generators=4, cpus=range(8), gpus=EIGHT_GPUS)
    assert gpus_of(plan) == {
        "learner": "4,5,6,7",
        "gen0": "0",
        "gen1": "1",
        "gen2": "2",
        "gen3": "3",
    }
    on_cpu = config("learner.nproc_per_node=8", "generator.device=cpu")
    plan = plan_placement(on_cpu, generators=8, cpus=range(16), gpus=EIGHT_GPUS)
    assert plan.env_for("generator", 7)["CUDA_VISIBLE_DEVICES"] == ""
    assert plan.env_for("generator", 7)["VLLM_CPU_OMP_THREADS_BIND"] == "14-15"
    with pytest.raises(PlacementError, match=r"learner\.device=cuda but this machine exposes no"):
        plan_placement(config("learner.device=cuda"), cpus=[0, 1], gpus=[])


def test_visible_gpus_honour_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    plan = plan_placement(config(), generators=1, cpus=[0, 1])
    assert gpus_of(plan) == {"learner": "3", "gen0": "5"}  # names as the parent sees them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


# -- stored and applied ----------------------------------------------------------------------


def test_the_plan_round_trips_through_the_run(tmp_path):
    cfg = config("eval.every_versions=1", "learner.nproc_per_node=2")
    plan = plan_placement(cfg, generators=2, cpus=range(16), gpus=EIGHT_GPUS)
    assert PlacementPlan.from_json(plan.to_json()) == plan
    run = open_location(str(tmp_path / "run"))
    write_placement(run, plan)
    stored = json.loads((tmp_path / "run" / "control" / "placement.json").read_text())
    assert stored["learner"]["gpus"] == ["0", "1"]
    assert read_placement(run) == plan
    described = plan.describe()
    assert "gen1" in described
    assert "eval" in described


CHILD = (
    "import json, os; print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), "
    "'env': {k: os.environ.get(k) for k in %r}, 'nice': os.getpriority(os.PRIO_PROCESS, 0), "
    "'policy': os.sched_getscheduler(0), 'session': os.getsid(0)}))"
)


@pytest.mark.skipif(len(machine_cpus()) < 2, reason="needs two cores to tell affinity apart")
def test_a_process_started_from_the_plan_gets_its_cores_environment_and_priority():
    cpus = machine_cpus()
    plan = plan_placement(config(), generators=2, cpus=cpus, gpus=[])
    lines: list[str] = []
    seen = {}
    for placement in (plan.learner, plan.generators[1]):
        wanted = placement.env()
        code = run_process(
            [sys.executable, "-c", CHILD % sorted(wanted)], lines.append, placement=placement
        )
        assert code == 0, lines
        seen[placement.name] = json.loads(lines[-1])
        assert seen[placement.name]["cpus"] == list(placement.cpus)
        assert seen[placement.name]["env"] == wanted
    gen = seen["gen1"]
    assert gen["cpus"] != cpus
    assert gen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == format_cores(plan.generators[1].cpus)
    # The generator yields to the learner: nice 19, in the supervisor's session (where the
    # kernel schedules each session as one group, nice ranks it against that session alone).
    assert (gen["policy"], gen["nice"]) == (os.SCHED_OTHER, 19)
    assert gen["session"] == seen["learner"]["session"] == os.getsid(0)
    learner = seen["learner"]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert (learner["policy"], learner["nice"]) == (os.SCHED_OTHER, ours)
    # The supervisor itself keeps every core.
    assert sorted(os.sched_getaffinity(0)) == cpus


def test_each_learner_rank_gets_its_own_block_of_cores():
    cfg = config("learner.nproc_per_node=4")
    plan = plan_placement(cfg, generators=4, cpus=range(16), gpus=EIGHT_GPUS)
    assert plan.learner.rank_cpus() == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        (12, 13, 14, 15),
    ]
    assert plan.learner.env()["STREAMRL_RANK_CORES"] == "0-3;4-7;8-11;12-15"
    assert "STREAMRL_RANK_CORES" not in plan.generators[0].env()
    odd = plan.learner.model_copy(update={"cpus": (0, 1, 2, 3, 4), "ranks": 2, "threads": 2})
    assert odd.rank_cpus() == [(0, 1), (2, 3, 4)]  # the last rank takes the remainder


@pytest.mark.skipif(len(machine_cpus()) < 2, reason="needs two cores to tell affinity apart")
def test_a_learner_rank_binds_itself_to_its_block():
    cpus = machine_cpus()
    blocks = f"{cpus[0]};{format_cores(cpus[1:])}"
    probe = (
        "import json, os; from streamrl.placement import bind_rank; "
        "print(json.dumps([bind_rank(int(os.environ['LOCAL_RANK'])), "
        "sorted(os.sched_getaffinity(0))]))"
    )
    for rank, wanted in ((0, cpus[:1]), (1, cpus[1:])):
        lines: list[str] = []
        env = {"STREAMRL_RANK_CORES": blocks, "LOCAL_RANK": str(rank)}
        assert run_process([sys.executable, "-c", probe], lines.append, env=env) == 0, lines
        assert json.loads(lines[-1]) == [wanted, wanted]


def test_a_generator_alone_takes_this_machine():
    cfg = config("generator.tensor_parallel_size=2")
    joining = place_alone(cfg, "generator", 5, cpus=range(8), gpus=EIGHT_GPUS)
    assert (joining.name, joining.cpus, joining.gpus) == ("gen5", tuple(range(8)), ("0", "1"))
    assert joining.env()["OMP_WAIT_POLICY"] == "PASSIVE"
    on_cpu = place_alone(config(), "generator", 0, cpus=[2, 3], gpus=[])
    assert on_cpu.env()["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert on_cpu.env()["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(PlacementError, match=r"gen0 needs 2 GPUs .* exposes 1"):
        place_alone(
            config("generator.tensor_parallel_size=2", "generator.device=cuda"),
            "generator",
            0,
            cpus=[0],
            gpus=["0"],
        )


def test_a_learner_node_alone_takes_its_ranks_gpus_and_its_configured_cores():
    node = place_alone(
        config("learner.nproc_per_node=4", "learner.device=cuda"), "learner", cpus=range(16),
        gpus=EIGHT_GPUS,
    )  # fmt: skip
    assert (node.name, node.ranks, node.gpus, node.threads) == (
        "learner", 4, ("0", "1", "2", "3"), 4,
    )  # fmt: skip
    assert node.env()["STREAMRL_RANK_CORES"] == "0-3;4-7;8-11;12-15"
    counted = place_alone(config("learner.cpu_cores=2"), "learner", cpus=[4, 5, 6], gpus=[])
    assert (counted.cpus, counted.gpus) == ((4, 5), ())
    listed = place_alone(config("learner.cpu_cores=5-6"), "learner", cpus=[4, 5, 6], gpus=[])
    assert listed.cpus == (5, 6)
    with pytest.raises(PlacementError, match=r"learner.cpu_cores=4 but this machine has 3"):
        place_alone(config("learner.cpu_cores=4"), "learner", cpus=[4, 5, 6], gpus=[])
    with pytest.raises(PlacementError, match=r"learner needs 4 GPUs .* exposes 2"):
        place_alone(
            config("learner.nproc_per_node=4", "learner.device=cuda"), "learner",
            cpus=range(8), gpus=["0", "1"],
        )  # fmt: skip
    evaluator = place_alone(config(), "evaluator", cpus=[0, 1], gpus=[])
    assert (evaluator.name, evaluator.component) == ("eval", "evaluator")
