"""Scaling a run's generators: the control records (`storage.control.requests`), `streamrl scale`
and the refusal for a run whose processes run on one machine."""

from __future__ import annotations

import pytest

from storage.control.requests import (
    clear_stop,
    request_stop,
    requested_generators,
    set_requested_generators,
    stop_requested,
)
from storage.fs import open_location
from streamrl.cli.main import main
from streamrl.config.loading import load_config
from streamrl.config.stored import prepare_run


def _run(tmp_path, *overrides: str):
    config = load_config(
        ["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={tmp_path / 'run'}", *overrides]
    )
    return prepare_run(config)[1]


def test_a_generators_own_stop_marker_stops_only_it(tmp_path):
    run = open_location(str(tmp_path / "run"))
    request_stop(run, "scaled in", writer="gen3")
    assert stop_requested(run, "gen3")
    assert not stop_requested(run, "gen2")
    assert not stop_requested(run)
    request_stop(run, "learner done")
    assert stop_requested(run, "gen2")  # the run's marker stops every generator
    clear_stop(run, writer="gen3")
    clear_stop(run)
    assert not stop_requested(run, "gen3")


def test_the_requested_generator_count_is_the_latest_asked(tmp_path):
    run = open_location(str(tmp_path / "run"))
    assert requested_generators(run) is None
    set_requested_generators(run, 4)
    set_requested_generators(run, 2)
    assert requested_generators(run) == 2
    with pytest.raises(ValueError, match="ask for 0 or more"):
        set_requested_generators(run, -1)


def test_streamrl_scale_asks_a_run_on_pools_for_n_generators(tmp_path, capsys):
    run = _run(tmp_path, "placement.mode=pools")
    assert main(["scale", run.uri, "--generators", "5"]) == 0
    assert requested_generators(run) == 5
    assert "5 generator(s) asked for (not set before)" in capsys.readouterr().out
    assert main(["scale", run.uri, "--generators", "1"]) == 0
    assert "(was 5)" in capsys.readouterr().out


def test_streamrl_scale_refuses_a_run_on_one_machine_and_says_what_to_do(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["scale", run.uri, "--generators", "3"]) == 2
    error = capsys.readouterr().err
    assert "placement.mode=local" in error
    assert "prefect deployment run generator/default" in error
    assert requested_generators(run) is None
    with pytest.raises(SystemExit):
        main(["scale", run.uri, "--generators", "-2"])


def test_streamrl_run_refuses_placement_on_pools_before_creating_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["run", "--preset", "dapo", "--preset", "tiny-cpu", "placement.mode=pools",
            f"storage.run_uri={run_dir}"]  # fmt: skip
    assert main(argv) == 2
    assert "only the streamrl flow does" in capsys.readouterr().err
    assert not run_dir.exists()
