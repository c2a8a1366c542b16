"""run.json: written once, versions recorded, resume compatibility, no credentials stored."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from storage.control.manifest import MANIFEST_NAME, RESUME_SAFE_FIELDS, create_run, open_run
from storage.fs import Location, StorageError, open_location
from streamrl.config.run import RunConfig


def _config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A valid RunConfig as JSON, with some fields changed per section."""
    data = RunConfig().model_dump(mode="json")
    for section, fields in sections.items():
        data[section].update(fields)
    return RunConfig.model_validate(data).model_dump(mode="json")


def test_create_then_open_round_trip(run_location: Location) -> None:
    config = _config(learner={"lr": 3e-6})
    created = create_run(run_location, config)
    opened = open_run(run_location, config)
    assert opened.config == config == created.config
    assert opened.created_at == created.created_at
    assert opened.versions == created.versions
    # A fresh handle on the same URI (another process) sees the same run.
    again = open_location(run_location.uri, storage_options=run_location.storage_options())
    assert open_run(again).config == config


def test_versions_recorded(run_location: Location) -> None:
    versions = create_run(run_location, _config()).versions
    for name in ("python", "streamrl", "torch", "zarr", "fsspec", "s3fs", "prefect"):
        assert versions[name], name
    assert "no-such-package" not in versions


def test_create_twice_keeps_the_first(run_location: Location) -> None:
    first = create_run(run_location, _config(learner={"total_steps": 10}))
    stored_bytes = run_location.fs.cat_file(run_location.join(MANIFEST_NAME))
    second = create_run(run_location, _config(learner={"total_steps": 99}))  # resume-safe
    assert second.config["learner"]["total_steps"] == 10
    assert second.created_at == first.created_at
    assert run_location.fs.cat_file(run_location.join(MANIFEST_NAME)) == stored_bytes


def test_incompatible_config_lists_every_field(run_location: Location) -> None:
    create_run(run_location, _config())
    changed = _config(learner={"lr": 5e-6}, model={"dtype": "float32"}, data={"shuffle_seed": 7})
    changed["algorithm"]["policy_loss"]["clip_high"] = 0.3
    with pytest.raises(StorageError, match="cannot change on resume") as info:
        open_run(run_location, changed)
    message = str(info.value)
    for line in (
        "learner.lr: 1e-06 → 5e-06",
        'model.dtype: "bfloat16" → "float32"',
        "data.shuffle_seed: 0 → 7",
        "algorithm.policy_loss.clip_high: 0.28 → 0.3",
    ):
        assert line in message
    # create_run on an existing run checks the same way.
    with pytest.raises(StorageError, match=re.escape("learner.lr: 1e-06 → 5e-06")):
        create_run(run_location, changed)


def test_resume_safe_changes_are_accepted(run_location: Location) -> None:
    original = _config()
    create_run(run_location, original)
    resumed = _config(
        learner={
            "total_steps": 500,
            "checkpoint_every": 5,
            "keep_checkpoints": 4,
            "stop_grace_s": 240.0,  # a demo run made before its preset's grace was raised
        },
        generator={"count": 8, "weight_poll_s": 1.0, "prompts_in_flight": 64},
        logging={"wandb_mode": "disabled", "level": "DEBUG"},
        storage={"run_uri": "/elsewhere/run", "sweep_grace_s": 900.0},
        weights={"keep_versions": 9, "full_every": 4},
    )
    manifest = open_run(run_location, resumed)
    assert manifest.config == original  # the stored config is never rewritten
    assert "logging" in RESUME_SAFE_FIELDS


def test_added_or_removed_field_is_reported(run_location: Location) -> None:
    create_run(run_location, _config())
    changed = copy.deepcopy(_config())
    del changed["model"]["tokenizer"]
    changed["algorithm"]["new_knob"] = 1
    with pytest.raises(StorageError) as info:
        open_run(run_location, changed)
    assert "model.tokenizer: null → (absent)" in str(info.value)
    assert "algorithm.new_knob: (absent) → 1" in str(info.value)


def test_unknown_run_uri(run_location: Location) -> None:
    with pytest.raises(StorageError, match=r"no streamrl run at .*run\.json not found.*run_uri"):
        open_run(run_location)


def test_credentials_never_written(
    run_location: Location, run_uri_and_options: tuple[str, dict]
) -> None:
    _, options = run_uri_and_options
    config = _config()
    # Bypass RunConfig's own check: storage must strip them whatever the caller passes.
    config["storage"]["storage_options"] = {
        **copy.deepcopy(options),
        "key": "AKIAFAKEACCESSKEY",
        "secret": "fake-secret-value",
        "client_kwargs": {"aws_session_token": "fake-session-token", "region_name": "x"},
        "anon": False,
    }
    manifest = create_run(run_location, config)
    stored = run_location.fs.cat_file(run_location.join(MANIFEST_NAME))
    for secret in ("AKIAFAKEACCESSKEY", "fake-secret-value", "fake-session-token"):
        assert secret.encode() not in stored
    for value in options.values():  # the S3 server's real keys, on the s3 backend
        if isinstance(value, str):
            assert value.encode() not in stored
    kept = json.loads(stored)["config"]["storage"]["storage_options"]
    assert kept["anon"] is False
    assert kept["client_kwargs"]["region_name"] == "x"
    assert manifest.config == json.loads(stored)["config"]
    open_run(run_location, config)  # the same config, secrets and all, still matches
