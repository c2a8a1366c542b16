"""Episode metrics as a user sees them: the status's episodes row and the learner's step line
show turns, tool calls, environment time, straggler wait and finish reasons for multi-turn
rollouts, and nothing more for single-turn ones."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from storage.fs import open_location
from storage.stream.records import RolloutSums
from storage.stream.segments import decode_segment, encode_segment
from streamrl.learner.config import LoggingConfig
from streamrl.learner.reporting import MetricsReporter
from streamrl.runs.status_format import episode_summary
from tests.multi_turn_data import multi_turn_group
from tests.stream_data import random_group


def _metrics(groups) -> dict[str, float]:
    return RolloutSums.of(groups).metrics("rollout")


def test_single_turn_rollouts_have_no_episode_row() -> None:
    rng = np.random.default_rng(0)
    assert episode_summary(_metrics([random_group(rng) for _ in range(3)])) is None
    assert episode_summary({}) is None


def test_multi_turn_rollouts_show_turns_tools_time_and_finish_reasons() -> None:
    rng = np.random.default_rng(1)
    group = multi_turn_group(rng)
    g = group.group_size
    group = type(group)(
        **{
            **group.__dict__,
            "finish_reasons": ["done"] * (g - 1) + ["max_turns"],
            "tool_calls": np.full(g, 2, np.int32),
            "tool_errors": np.ones(g, np.int32),
            "env_seconds": np.full(g, 0.25, np.float32),
            "wait_seconds": np.full(g, 1.5, np.float32),
        }
    )
    line = episode_summary(_metrics([group]))
    assert line is not None
    turns = float(np.mean(group.effective_turns))
    assert f"turns {turns:.2f}" in line
    assert "tool calls 2.00 (errors 1.00)" in line
    assert "env 0.25s" in line
    assert "straggler wait 1.50s" in line
    assert f"done {(g - 1) / g:.2f}" in line
    assert f"max_turns {1 / g:.2f}" in line


def test_the_learners_step_line_adds_turns_and_tools_for_agents(tmp_path, caplog) -> None:
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="disabled", log_every=1)
    base = {"step": 1, "policy_version": 1, "rollout/reward_mean": 0.5, "rollout/acc": 0.5}
    agent = {"rollout/turns_mean": 2.5, "rollout/tool_calls_mean": 1.25}
    single = {"rollout/turns_mean": 1.0, "rollout/tool_calls_mean": 0.0}
    unused = {**single, "rollout/tools_offered_frac": 1.0}  # tools offered, never called
    with (
        caplog.at_level("INFO", "streamrl.learner.reporting"),
        MetricsReporter(run, cfg, config={}, total_steps=3) as reporter,
    ):
        reporter.log({**base, **single})
        reporter.log({**base, **agent, "step": 2})
        reporter.log({**base, **unused, "step": 3})
    lines = [r.getMessage() for r in caplog.records if r.name == "streamrl.learner.reporting"]
    assert "turns" not in lines[0]
    assert "turns 2.50 tools 1.25" in lines[1]
    assert "turns 1.00 tools 0.00" in lines[2]


def test_an_agent_that_never_calls_its_tools_still_has_its_episode_row() -> None:
    # The case a user most needs to see: one turn, no call, in an environment with tools. The
    # segment carries the fact, so the row survives the stream's round trip.
    rng = np.random.default_rng(2)
    none = np.zeros(4, np.int32)
    offered = replace(random_group(rng), tools_offered=True, tool_calls=none, tool_errors=none)
    (decoded,) = decode_segment(encode_segment([offered, random_group(rng)]))[:1]
    assert decoded.tools_offered
    assert decoded.equals(offered)
    metrics = _metrics([decoded])
    assert metrics["rollout/tools_offered_frac"] == 1.0
    assert episode_summary(metrics).startswith("turns 1.00  tool calls 0.00 (errors 0.00)")
    assert "rollout/tools_offered_frac" not in _metrics([random_group(rng)])


def test_a_supervised_step_line_shows_its_loss_not_rollouts(tmp_path, caplog) -> None:
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="disabled", log_every=1)
    step = {"policy_version": 2, "sft/loss": 1.23456, "sft/epoch": 0.5, "actor/lr": 1e-5,
            "perf/learner_tokens_per_s": 900.0, "perf/step_s": 2.0}  # fmt: skip
    with (
        caplog.at_level("INFO", "streamrl.learner.reporting"),
        MetricsReporter(run, cfg, config={}, total_steps=4) as reporter,
    ):
        reporter.log({**step, "step": 1})
        reporter.log({**step, "step": 2, "sft/heldout_loss": 1.5})
    lines = [r.getMessage() for r in caplog.records if r.name == "streamrl.learner.reporting"]
    assert lines[0] == "step 1/4: loss 1.2346 epoch 0.50 lr 1.00e-05 900 tok/s 2s v2"
    assert lines[1].startswith("step 2/4: loss 1.2346 held-out 1.5000 epoch 0.50")
