"""On-policy pairs from a run's own stream (`streamrl.learner.stream_pairs`): the highest- and
lowest-reward responses of each group, ties and multi-turn groups left out, and the same pairs on
every life of the run while the source stream grows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from storage.fs import open_location
from storage.stream.writer import StreamWriter
from streamrl.data.rows import DatasetError
from streamrl.learner.stream_pairs import pairs_stop, stream_pairs
from tests.stream_data import random_group


def _location(path):
    location = open_location(str(path))
    location.fs.makedirs(location.path, exist_ok=True)
    return location


def _segment(source, rng, start: int, n: int = 6):
    groups = [random_group(rng, prompt_id=f"p{start + i}", vocab=200) for i in range(n)]
    StreamWriter(source, "gen0").write(groups)
    return groups


def test_each_group_gives_its_best_and_worst_response(tmp_path):
    source, run = _location(tmp_path / "source"), _location(tmp_path / "run")
    rng = np.random.default_rng(0)
    groups = _segment(source, rng, 0) + _segment(source, rng, 6)
    multi = random_group(rng, prompt_id="agent", vocab=200)
    multi = dataclasses.replace(  # one response holds environment tokens (mask 0)
        multi, loss_masks=[np.ones(len(r), np.uint8) for r in multi.response_tokens]
    )
    multi.loss_masks[0][:1] = 0
    multi.behaviour_logprobs[0][:1] = 0.0  # as the stream requires of environment tokens
    StreamWriter(source, "gen1").write([multi])

    stop = pairs_stop(source, run)
    assert stop == 3  # three commit records, recorded for later lives
    found = stream_pairs(source, stop, max_tokens=1000)
    expected = []
    for ordinal, group in enumerate(groups):
        rewards = np.asarray(group.rewards)
        if rewards.max() == rewards.min():
            continue
        best, worst = int(np.argmax(rewards)), int(np.argmin(rewards))
        expected.append((f"source:{ordinal}", group, best, worst))
    assert (found.groups, found.multi_turn) == (13, 1)
    assert found.ties == 12 - len(expected)
    assert [p.pair_id for p in found.pairs.pairs] == [e[0] for e in expected]
    for pair, (_, group, best, worst) in zip(found.pairs.pairs, expected, strict=True):
        assert pair.prompt.tolist() == group.prompt_tokens.tolist()
        assert pair.chosen.tolist() == group.response_tokens[best].tolist()
        assert pair.rejected.tolist() == group.response_tokens[worst].tolist()


def test_a_resumed_run_reads_the_stream_as_far_as_its_first_life(tmp_path):
    source, run = _location(tmp_path / "source"), _location(tmp_path / "run")
    rng = np.random.default_rng(1)
    _segment(source, rng, 0)
    first = stream_pairs(source, pairs_stop(source, run), max_tokens=1000)
    _segment(source, rng, 6)  # the source run goes on
    again = stream_pairs(source, pairs_stop(source, run), max_tokens=1000)
    assert [p.pair_id for p in again.pairs.pairs] == [p.pair_id for p in first.pairs.pairs]
    assert again.groups == 6
    with pytest.raises(DatasetError, match="cannot change on resume"):
        pairs_stop(_location(tmp_path / "other"), run)


def test_a_stream_without_a_reward_difference_is_refused(tmp_path):
    source, run = _location(tmp_path / "source"), _location(tmp_path / "run")
    rng = np.random.default_rng(2)
    group = random_group(rng, vocab=200)
    tie = dataclasses.replace(group, rewards=np.ones(group.group_size, np.float32))
    StreamWriter(source, "gen0").write([tie])
    with pytest.raises(DatasetError, match="gives no pair: 1 groups, 1 without a reward"):
        stream_pairs(source, pairs_stop(source, run), max_tokens=1000)
