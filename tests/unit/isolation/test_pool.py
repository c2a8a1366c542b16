"""Tests for the isolated call pool shared by the reward scorer and the environment runner
(`streamrl.isolation.pool`): calls from several threads share the workers without waiting for
each other's batches, and a closed pool takes no calls."""

from __future__ import annotations

import threading
import time

import pytest

from streamrl.isolation.pool import IsolatedPool
from streamrl.rewards import RewardResolutionError, RewardScorer
from streamrl.rewards.registry import resolve_reward
from streamrl.rewards.scoring import RewardLoadError
from streamrl.rewards.worker import call_reward

SCRIPTED = "tests.reward_fns:scripted"


def test_a_slow_batch_does_not_hold_up_another_threads_calls() -> None:
    finished: dict[str, float] = {}
    with RewardScorer(SCRIPTED, workers=2, timeout_s=10.0) as scorer:
        started = time.monotonic()

        def score(name: str, responses: list[str], truths: list[str]) -> None:
            assert scorer.score(responses, truths).failures == [None] * len(responses)
            finished[name] = time.monotonic() - started

        slow = threading.Thread(target=score, args=("slow", ["sleep:2"], ["sleep:2"]))
        slow.start()
        time.sleep(0.2)  # the slow call holds one worker; four quick ones share the other
        score("quick", ["7", "8", "7", "7"], ["7"] * 4)
        slow.join()
    assert finished["quick"] < 1.5 <= 2.0 <= finished["slow"]


def test_a_closed_pool_takes_no_calls_and_waits_for_those_it_took() -> None:
    pool = IsolatedPool(
        resolve_reward, SCRIPTED, subject="reward 'scripted'", setting="generator.reward",
        workers=1, memory_mb=4096, startup_timeout_s=60.0,
        resolution_error=RewardResolutionError, load_error=RewardLoadError,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="not open"):
        pool.submit(call_reward, "7", "7", None, timeout_s=1.0)
    with pool:
        pids = pool.worker_pids
        pending = [
            pool.submit(call_reward, "sleep:0.5", "sleep:0.5", None, timeout_s=5.0)
            for _ in range(2)
        ]
    assert [f.result().value for f in pending] == [1.0, 1.0]  # close() let them finish
    assert all(f.result().elapsed_s >= 0.5 for f in pending)
    assert pool.worker_pids == []
    assert len(pids) == 1
    with pytest.raises(RuntimeError, match="not open"):
        pool.submit(call_reward, "7", "7", None, timeout_s=1.0)
