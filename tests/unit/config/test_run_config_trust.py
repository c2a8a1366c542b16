"""The run's current configuration (`control/config.json`) is checked against run.json on every
load: fields that decide what code runs or what is trusted (`TRUSTED_FIELDS`: the reward
function, the model path, trust_remote_code, the storage endpoint, the pools' environment)
change only with an explicit `allow_trusted_changes` (`--allow-trusted-changes`); other fields
only where a resume may change them."""

from __future__ import annotations

import json

import pytest

from storage.fs import Location, StorageError
from streamrl.cli.main import main
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.config.stored import CURRENT_CONFIG, TRUSTED_FIELDS, load_run_config, prepare_run
from streamrl.runs.status import read_status

FLAG = "--allow-trusted-changes"


def _config(tmp_path, *overrides: str) -> RunConfig:
    return load_config(
        ["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={tmp_path / 'run'}", *overrides]
    )


def _tamper(run: Location, change) -> None:
    """Edit control/config.json as anyone able to write the run's storage could."""
    path = run.join(*CURRENT_CONFIG)
    body = json.loads(run.fs.cat_file(path))
    change(body.get("config", body))  # the config itself, whatever the file's layout
    run.fs.pipe_file(path, json.dumps(body).encode())


def _set_reward(config: dict, fn: str = "format") -> None:
    config["generator"]["reward"]["fn"] = fn


def test_the_trusted_fields_are_the_ones_the_issue_names():
    assert {
        "generator.reward.fn",
        "model.trust_remote_code",
        "storage.endpoint_url",
        "placement.env",
        "model.path",
    } <= set(TRUSTED_FIELDS)


def test_a_reward_fn_changed_in_the_stored_config_is_refused_on_load(tmp_path):
    config, run = prepare_run(_config(tmp_path))
    prepare_run(config, resume=True)  # writes control/config.json
    _tamper(run, _set_reward)
    with pytest.raises(StorageError) as error:
        load_run_config(run)
    message = str(error.value)
    assert "generator.reward.fn" in message
    assert '"math" → "format"' in message
    assert FLAG in message
    assert "allow_trusted_changes" in message
    with pytest.raises(StorageError, match=r"generator\.reward\.fn"):
        read_status(run)  # `streamrl status` reads the same checked configuration


def test_a_reward_fn_change_on_resume_needs_the_flag_and_is_then_kept(tmp_path):
    run = prepare_run(_config(tmp_path))[1]
    changed = _config(tmp_path, "generator.reward.fn=format")
    with pytest.raises(StorageError) as error:
        prepare_run(changed, resume=True)
    assert "generator.reward.fn" in str(error.value)
    assert FLAG in str(error.value)
    assert load_run_config(run).generator.reward.fn == "math"  # nothing was recorded

    prepare_run(changed, resume=True, allow_trusted_changes=True)
    assert load_run_config(run).generator.reward.fn == "format"
    prepare_run(changed, resume=True)  # the same change again: already allowed
    assert load_run_config(run).generator.reward.fn == "format"
    with pytest.raises(StorageError, match=r"generator\.reward\.fn"):
        prepare_run(_config(tmp_path, "generator.reward.fn=math_format"), resume=True)

    _tamper(run, lambda c: _set_reward(c, "math_format"))  # not the value that was allowed
    with pytest.raises(StorageError, match=r'"(math|format)" → "math_format"'):
        load_run_config(run)


@pytest.mark.parametrize(
    "overrides",
    [
        ["storage.endpoint_url=http://127.0.0.1:1"],
        ["placement.mode=pools", "placement.env={LD_PRELOAD: /tmp/x.so}"],
        ["model.trust_remote_code=true"],
        ["model.path=/elsewhere/model"],
    ],
)
def test_every_trusted_field_needs_the_flag_on_resume(tmp_path, overrides):
    prepare_run(_config(tmp_path))
    field = overrides[-1].split("=", 1)[0]
    with pytest.raises(StorageError, match=field.replace(".", r"\.")):
        prepare_run(_config(tmp_path, *overrides), resume=True)
    prepare_run(_config(tmp_path, *overrides), resume=True, allow_trusted_changes=True)


def test_other_fields_changed_in_the_stored_config_are_checked_too(tmp_path):
    run = prepare_run(_config(tmp_path))[1]
    prepare_run(_config(tmp_path, "learner.total_steps=12"), resume=True)
    assert load_run_config(run).learner.total_steps == 12  # resume-safe: fine

    _tamper(run, lambda c: c["learner"].update(lr=0.5))
    with pytest.raises(StorageError, match=r"learner\.lr"):
        load_run_config(run)


def test_a_config_recorded_before_the_check_still_loads(tmp_path):
    run = prepare_run(_config(tmp_path))[1]
    wanted = _config(tmp_path, "learner.total_steps=12").model_dump(mode="json")
    run.fs.makedirs(run.join("control"), exist_ok=True)
    run.fs.pipe_file(run.join(*CURRENT_CONFIG), json.dumps(wanted).encode())  # the old layout
    assert load_run_config(run).learner.total_steps == 12


def test_a_run_created_before_placement_modes_still_loads_and_resumes(tmp_path):
    """Older run.json files hold every pool field under `placement.mode: local`; the local
    placement class has none of them, so reading such a run drops them (they never applied)."""
    run = prepare_run(_config(tmp_path))[1]
    manifest = json.loads(run.fs.cat_file(run.join("run.json")))
    manifest["config"]["placement"] = {
        "mode": "local",
        "learner_pool": "learner",
        "generator_pool": "generators",
        "eval_pool": None,
        "image": None,
        "env": {},
        "retry_window_s": 3600.0,
        "max_generators": 64,
    }
    run.fs.pipe_file(run.join("run.json"), json.dumps(manifest).encode())
    assert load_run_config(run).placement.mode == "local"
    prepare_run(_config(tmp_path, "learner.total_steps=12"), resume=True)
    assert load_run_config(run).learner.total_steps == 12


def test_streamrl_run_resume_names_the_flag(tmp_path, capsys):
    prepare_run(_config(tmp_path))
    argv = ["run", "--resume", "--preset", "dapo", "--preset", "tiny-cpu",
            f"storage.run_uri={tmp_path / 'run'}", "generator.reward.fn=format"]  # fmt: skip
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "generator.reward.fn" in error
    assert FLAG in error


def _as_older_run(run: Location, importance: dict) -> None:
    """Rewrite run.json as a version before the correction block wrote it: importance
    {mode, cap} where the correction block is now."""
    body = json.loads(run.fs.cat_file(run.join("run.json")))
    algorithm = body["config"]["algorithm"]
    del algorithm["correction"]
    algorithm["importance"] = importance
    run.fs.pipe_file(run.join("run.json"), json.dumps(body).encode())


def test_a_run_stored_with_the_older_importance_block_resumes(tmp_path):
    older = _config(tmp_path, "algorithm.importance.mode=mask", "algorithm.importance.cap=1.5")
    _, run = prepare_run(older)
    _as_older_run(run, {"mode": "mask", "cap": 1.5})
    resumed, _ = prepare_run(older, resume=True)  # the same config, as a user still writes it
    assert resumed.algorithm.correction.rs_level == "token"
    same = _config(
        tmp_path,
        "algorithm.correction.rs_level=token",
        "algorithm.correction.rs_low=0.0",
        "algorithm.correction.rs_high=1.5",
        "algorithm.correction.is_cap=1.5",
    )
    prepare_run(same, resume=True)  # the new spelling of the same correction
    assert load_run_config(run).algorithm.correction == same.algorithm.correction
    with pytest.raises(StorageError, match=r"algorithm\.correction\.rs_high: 1\.5 → 2\.0"):
        prepare_run(_config(tmp_path, "algorithm.correction.rs_level=token"), resume=True)


def test_a_run_stored_before_fields_were_added_resumes_with_their_defaults(tmp_path):
    config = _config(tmp_path)
    _, run = prepare_run(config)
    body = json.loads(run.fs.cat_file(run.join("run.json")))
    del body["config"]["learner"]["batch_tokens"]  # fields this version added
    del body["config"]["algorithm"]["length_penalty"]
    del body["config"]["generator"]["adaptive_group"]
    run.fs.pipe_file(run.join("run.json"), json.dumps(body).encode())
    resumed, _ = prepare_run(config, resume=True)
    assert resumed.learner.batch_tokens is None
    assert load_run_config(run) == config
    with pytest.raises(StorageError, match=r"learner\.batch_tokens: null → 4096"):
        prepare_run(_config(tmp_path, "learner.batch_tokens=4096"), resume=True)


def test_a_critic_rate_changed_by_a_preset_blocks_no_resume_of_a_run_without_a_critic(tmp_path):
    """The size presets now set `learner.critic_lr`; a DAPO run created before (2e-6 stored)
    still resumes with the same command. A run with a value model is still refused."""
    _, run = prepare_run(_config(tmp_path, "learner.critic_lr=2e-6"))
    resumed, _ = prepare_run(_config(tmp_path), resume=True)  # the preset's 2e-4 now
    assert resumed.learner.critic_lr == 2e-6
    assert load_run_config(run).learner.critic_lr == 2e-6
    vapo = [f"storage.run_uri={tmp_path / 'vapo'}"]
    prepare_run(load_config(["vapo", "tiny-cpu"], overrides=[*vapo, "learner.critic_lr=2e-6"]))
    with pytest.raises(StorageError, match=r"learner\.critic_lr: 2e-06 → 0\.0002"):
        prepare_run(load_config(["vapo", "tiny-cpu"], overrides=vapo), resume=True)
