"""Control files are input from anyone able to write the run's storage: a malformed
`control/fleet.json` is reported (a warning naming the file and the problem) and ignored, a
requested generator count is bounded by `placement.max_generators`, and `streamrl scale`
refuses a count above it."""

from __future__ import annotations

import json
import logging

import pytest

from storage.control.requests import DEFAULT_MAX_GENERATORS, requested_generators
from storage.fs import Location, open_location
from streamrl.cli.main import main
from streamrl.config.loading import load_config
from streamrl.config.stored import prepare_run


def _fleet(run: Location, body: bytes) -> None:
    run.fs.makedirs(run.join("control"), exist_ok=True)
    run.fs.pipe_file(run.join("control", "fleet.json"), body)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[4]", "not a JSON object"),
        (b'{"at": 1}', "no 'generators'"),
        (b'{"generators": "many"}', "not a whole number"),
        (b'{"generators": 2.5}', "not a whole number"),
        (b'{"generators": true}', "not a whole number"),
        (b'{"generators": -3}', "negative"),
    ],
)
def test_a_malformed_fleet_file_is_reported_and_ignored(
    tmp_path, caplog: pytest.LogCaptureFixture, body: bytes, problem: str
):
    run = open_location(str(tmp_path / "run"))
    _fleet(run, body)
    with caplog.at_level(logging.WARNING, logger="storage.control.requests"):
        assert requested_generators(run, maximum=8) is None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "fleet.json" in warning
    assert problem in warning
    assert "ignored" in warning


def test_a_huge_generator_count_is_bounded_by_the_maximum(tmp_path, caplog):
    run = open_location(str(tmp_path / "run"))
    _fleet(run, json.dumps({"generators": 10**9, "at": 0.0}).encode())
    with caplog.at_level(logging.WARNING, logger="storage.control.requests"):
        assert requested_generators(run, maximum=8) == 8
        assert requested_generators(run) == DEFAULT_MAX_GENERATORS
    assert "placement.max_generators" in caplog.text
    assert len(caplog.records) == 2  # once per maximum, not once per poll
    with caplog.at_level(logging.WARNING, logger="storage.control.requests"):
        requested_generators(run, maximum=8)
    assert len(caplog.records) == 2


def test_streamrl_scale_refuses_more_than_the_maximum(tmp_path, capsys):
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={tmp_path / 'run'}",
            "placement.mode=pools",
            "placement.max_generators=4",
        ],
    )
    run = prepare_run(config)[1]
    assert main(["scale", run.uri, "--generators", "5"]) == 2
    error = capsys.readouterr().err
    assert "placement.max_generators" in error
    assert "4" in error
    assert requested_generators(run) is None
    assert main(["scale", run.uri, "--generators", "4"]) == 0
    assert requested_generators(run) == 4
