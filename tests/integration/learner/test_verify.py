"""`streamrl verify` and the health warnings of `streamrl status` on a run the real learner
trained (tiny model, CPU): the audit's figures are the learner's own, the run is whole, and
the health conditions the learner recorded are what the status shows. (The damage cases are in
tests/unit/runs/test_audit.py, on runs built without a model.)"""

from __future__ import annotations

from storage.weights.versions import WeightStore
from streamrl.learner.loop import Learner
from streamrl.learner.metrics_records import read_metrics
from streamrl.learner.topology import Topology
from streamrl.runs.audit import audit_run
from streamrl.runs.health import health_warnings
from tests.unit.runs.built_runs import new_run, write_stream


def test_a_real_learners_run_verifies_whole_with_its_own_figures(tmp_path):
    run, config = new_run(
        tmp_path / "run",
        "learner.total_steps=3",
        "learner.checkpoint_every=2",
        "learner.max_staleness=2",
        "generator.max_tokens=24",
    )
    write_stream(run, 40)
    with Topology.from_env("cpu") as topology:
        learner = Learner(config, run, topology)
        assert learner.run() == 3
    totals = learner.stream.collector.totals

    audit = audit_run(run)
    assert audit.problems == ()
    assert (audit.groups_consumed, audit.groups_trained) == (totals.consumed, totals.accepted)
    assert audit.groups_dropped_stale == totals.dropped_stale
    assert audit.groups_dropped_no_signal == totals.dropped_zero_var
    assert (audit.last_step, audit.metrics_records, audit.checkpoint_step) == (3, 3, 3)
    assert audit.weight_versions == tuple(WeightStore(run).versions()) == (1, 2, 3)

    fired = [e["message"] for r in read_metrics(run) for e in r.get("health") or ()]
    assert fired  # random behaviour log-probs against the tiny model: mismatch-high fires
    newest = {message.split(" at step")[0]: message for message in fired}
    assert sorted(health_warnings(run)) == sorted(newest.values())
