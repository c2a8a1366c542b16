"""`streamrl run`'s supervisor starts each process from the placement plan and stores the plan;
a plan that does not fit is refused before the run is created."""

from __future__ import annotations

import json
import os
import sys

import pytest

from streamrl.cli import main as cli
from streamrl.config.loading import load_config
from streamrl.config.stored import open_run_location
from streamrl.placement import machine_cpus, read_placement
from streamrl.supervision import supervisor

# Stands in for a component (a real learner or vLLM engine is minutes of start-up here): it
# reports the cores it may run on and the variables the plan sets, then exits 0.
REPORT = (
    "import json, os; print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), 'env': "
    "{k: os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'OMP_NUM_THREADS', "
    "'OMP_WAIT_POLICY', 'VLLM_CPU_OMP_THREADS_BIND')}, "
    "'nice': os.getpriority(os.PRIO_PROCESS, 0)}))"
)


@pytest.mark.skipif(len(machine_cpus()) < 2, reason="needs two cores to tell affinity apart")
def test_local_run_starts_every_process_on_its_planned_cores(tmp_path, monkeypatch):
    reporter = [sys.executable, "-c", REPORT]
    monkeypatch.setattr(supervisor, "learner_command", lambda config, node=None, **kw: reporter)
    monkeypatch.setattr(supervisor, "generator_command", lambda config, index, **kw: reporter)
    # Set in the supervisor (e.g. by a vLLM engine it ran): the plan's values win, and a
    # variable the plan leaves unset for a process (the learner's vLLM binding) is not inherited.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-63")
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    config = load_config(overrides=[f"storage.run_uri={tmp_path / 'run'}"])
    lines: dict[str, list[str]] = {}
    supervised = supervisor.Supervisor.for_run(
        config, generators=1, on_line=lambda name, line: lines.setdefault(name, []).append(line)
    )
    supervised.run()
    plan = read_placement(open_run_location(config))
    nice: dict[str, int] = {}
    for name, placement in (("learner", plan.learner), ("gen0", plan.generators[0])):
        seen = json.loads(lines[name][-1])
        assert seen["cpus"] == list(placement.cpus), name
        assert seen["env"] == {k: placement.env().get(k) for k in seen["env"]}, name
        nice[name] = seen["nice"]
    # Work-conserving: the generator on the learner's cores, beneath it.
    assert plan.generators[0].cpus == plan.learner.cpus
    assert (nice["learner"], nice["gen0"]) == (os.getpriority(os.PRIO_PROCESS, 0), 19)


def test_streamrl_run_refuses_a_plan_that_does_not_fit_before_creating_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cores = len(machine_cpus())
    code = cli.main(
        [
            "run",
            "--preset",
            "dapo",
            "--preset",
            "tiny-cpu",
            f"storage.run_uri={run_dir}",
            f"learner.cpu_cores={cores}",
            "generator.cpu_cores=1",
        ]
    )
    assert code == 2
    assert f"learner {cores} + generators 1 = {cores + 1} cores" in capsys.readouterr().err
    assert not run_dir.exists()
