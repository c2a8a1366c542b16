"""Multi-turn stream records: the fields a multi-turn group adds to `ScoredGroup`, their
invariants, their segment encoding (format 3), format-1 segments read as single-turn and
format-2 ones without episode statistics, and the rollout sums that count sampled tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.stream.records import CommitRecord, InvalidRecordError, RolloutSums, ScoredGroup
from storage.stream.scored_group import EPISODE_STATS
from storage.stream.segments import CorruptSegmentError, decode_segment, encode_segment
from tests.multi_turn_data import multi_turn_group, without_environment_tokens
from tests.stream_data import random_group

MULTI_TURN_ARRAYS = ("loss_masks", "token_versions", "turns", "turn_reward_counts", "turn_rewards")


def _groups(seed: int = 0) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    multi = [multi_turn_group(rng, prompt_id=f"m{i}") for i in range(3)]
    return [*multi, random_group(rng, prompt_id="single", policy_version=1)]


def _with(group: ScoredGroup, **changes) -> ScoredGroup:
    return ScoredGroup(**{**group.__dict__, **changes})


@pytest.mark.parametrize("compression", ["zstd", "blosc", "none"])
def test_a_multi_turn_group_round_trips_through_a_segment(compression):
    groups = _groups()
    decoded = decode_segment(encode_segment(groups, compression))
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    for original, got in zip(groups, decoded, strict=True):
        for name in ("loss_masks", "token_versions", "turn_rewards"):
            want = getattr(original, f"effective_{name}")
            assert [a.tolist() for a in getattr(got, name)] == [a.tolist() for a in want]
        assert got.turns.tolist() == original.effective_turns.tolist()
    assert decoded[0].loss_masks[0].dtype == np.uint8
    assert decoded[0].token_versions[0].dtype == np.int64
    assert decoded[0].turns.dtype == np.int32
    assert not decoded[-1].is_multi_turn
    assert decoded[0].is_multi_turn


def test_equals_sees_every_multi_turn_field():
    group = _groups()[0]
    masks = [m.copy() for m in group.loss_masks]
    masks[0][0] = 0  # a sampled token turned environment token (its log-prob is not 0)
    rewards = [r + 1 for r in group.effective_turn_rewards]
    turns = group.turns + 1
    assert not group.equals(_with(group, loss_masks=masks))
    assert not group.equals(_with(group, turn_rewards=rewards))
    assert not group.equals(_with(group, turns=turns))
    versions = [v + 1 for v in group.token_versions]
    assert not group.equals(_with(group, token_versions=versions, policy_version=3))


def _as_format_1(objects: dict[str, bytes]) -> dict[str, bytes]:
    """The segment the encoder wrote before format 2: the same objects without the multi-turn
    arrays, `format_version` 1 (checked byte for byte against the old encoder's output when
    format 2 was introduced)."""
    root = json.loads(objects["zarr.json"])
    root["attributes"]["format_version"] = 1
    for name in MULTI_TURN_ARRAYS:
        del root["attributes"]["crc32"][name]
    old = {k: v for k, v in objects.items() if k.split("/")[0] not in MULTI_TURN_ARRAYS}
    return {**old, "zarr.json": json.dumps(root, indent=2).encode()}


def test_a_format_1_segment_decodes_as_single_turn_groups():
    rng = np.random.default_rng(3)
    groups = [random_group(rng, prompt_id=f"p{i}", policy_version=i) for i in range(3)]
    decoded = decode_segment(_as_format_1(encode_segment(groups)))
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    for group in decoded:
        assert group.loss_masks is group.token_versions is group.turns is None
        assert group.turn_rewards is None
        assert not group.is_multi_turn
        assert all(m.all() for m in group.effective_loss_masks)
        assert all((v == group.policy_version).all() for v in group.effective_token_versions)
        assert group.effective_turns.tolist() == [1] * group.group_size


def test_an_unknown_format_or_a_segment_without_its_arrays_is_corrupt():
    objects = encode_segment(_groups())
    root = json.loads(objects["zarr.json"])
    root["attributes"]["format_version"] = 5
    with pytest.raises(CorruptSegmentError, match="unknown segment format 5"):
        decode_segment({**objects, "zarr.json": json.dumps(root).encode()})
    root["attributes"]["format_version"] = 3
    del root["attributes"]["crc32"]["wait_seconds"]
    with pytest.raises(CorruptSegmentError, match="lacks wait_seconds"):
        decode_segment({**objects, "zarr.json": json.dumps(root).encode()})
    root["attributes"]["format_version"] = 2
    del root["attributes"]["crc32"]["loss_masks"]
    with pytest.raises(CorruptSegmentError, match="lacks loss_masks"):
        decode_segment({**objects, "zarr.json": json.dumps(root).encode()})


def _as_format_2(objects: dict[str, bytes]) -> dict[str, bytes]:
    """The segment the encoder wrote before format 3: the same objects without the episode
    statistics, `format_version` 2."""
    root = json.loads(objects["zarr.json"])
    root["attributes"]["format_version"] = 2
    for name in EPISODE_STATS:
        del root["attributes"]["crc32"][name]
    old = {k: v for k, v in objects.items() if k.split("/")[0] not in EPISODE_STATS}
    return {**old, "zarr.json": json.dumps(root, indent=2).encode()}


def test_episode_statistics_round_trip_and_a_format_2_segment_reads_none():
    groups = [
        _with(g, tool_calls=np.arange(g.group_size, dtype=np.int32), tool_errors=np.zeros(
            g.group_size, np.int32), env_seconds=np.full(g.group_size, 0.5, np.float32),
            wait_seconds=np.linspace(0, 2, g.group_size, dtype=np.float32))
        for g in _groups()
    ]  # fmt: skip
    decoded = decode_segment(encode_segment(groups))
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    assert decoded[0].tool_calls.tolist() == list(range(groups[0].group_size))
    assert not decoded[0].equals(_with(decoded[0], tool_calls=decoded[0].tool_calls * 0))
    old = decode_segment(_as_format_2(encode_segment(groups)))
    assert all(g.tool_calls is g.env_seconds is g.wait_seconds is None for g in old)
    assert RolloutSums.of(old).tool_calls == 0
    assert RolloutSums.of(decoded).tool_calls == sum(int(g.tool_calls.sum()) for g in groups)


def test_validate_rejects_bad_episode_statistics():
    group = _groups()[0]
    g = group.group_size
    with pytest.raises(InvalidRecordError, match="tool_calls has 2 entries"):
        _with(group, tool_calls=np.zeros(2, np.int32)).validate()
    with pytest.raises(InvalidRecordError, match="env_seconds must be finite and ≥ 0"):
        _with(group, env_seconds=np.full(g, -1.0, np.float32)).validate()
    with pytest.raises(InvalidRecordError, match="wait_seconds must be finite and ≥ 0"):
        _with(group, wait_seconds=np.full(g, np.nan, np.float32)).validate()
    with pytest.raises(InvalidRecordError, match="tool_errors must be ≤ tool_calls"):
        _with(
            group, tool_calls=np.ones(g, np.int32), tool_errors=np.full(g, 2, np.int32)
        ).validate()


def test_validate_rejects_a_loss_mask_of_another_length_or_value():
    group = _groups()[0]
    short = [m[:-1] for m in group.loss_masks]
    with pytest.raises(InvalidRecordError, match=r"loss_masks\[0\] has .* same length"):
        _with(group, loss_masks=short).validate()
    twos = [m * 2 for m in group.loss_masks]
    with pytest.raises(InvalidRecordError, match=r"loss_masks\[0\] must hold only 1"):
        _with(group, loss_masks=twos).validate()
    with pytest.raises(InvalidRecordError, match="loss_masks has 2 entries but there are 3"):
        _with(group, loss_masks=group.loss_masks[:2]).validate()
    versions = [v if i != 1 else v[1:] for i, v in enumerate(group.token_versions)]
    with pytest.raises(InvalidRecordError, match=r"token_versions\[1\] has .* same length"):
        _with(group, token_versions=versions).validate()


def test_validate_rejects_a_behaviour_logprob_at_an_environment_token():
    group = _groups()[0]
    i = next(i for i, m in enumerate(group.loss_masks) if not m.all())
    logprobs = [lp.copy() for lp in group.behaviour_logprobs]
    logprobs[i][np.flatnonzero(group.loss_masks[i] == 0)[0]] = -0.5
    with pytest.raises(InvalidRecordError, match=rf"behaviour_logprobs\[{i}\] must be exactly 0"):
        _with(group, behaviour_logprobs=logprobs).validate()


def test_validate_rejects_bad_versions_and_turns():
    group = _groups()[0]  # policy_version 2, turn t sampled with 2 + t
    negative = [v - 10 for v in group.token_versions]
    with pytest.raises(InvalidRecordError, match=r"token_versions\[0\] must be ≥ 0"):
        _with(group, token_versions=negative).validate()
    with pytest.raises(InvalidRecordError, match=r"policy_version is 1 but the oldest .* is 2"):
        _with(group, policy_version=1).validate()
    newer = [v + 1 for v in group.token_versions]
    with pytest.raises(InvalidRecordError, match=r"policy_version is 2 but the oldest .* is 3"):
        _with(group, token_versions=newer).validate()
    with pytest.raises(InvalidRecordError, match="turns must be ≥ 1"):
        _with(group, turns=group.turns * 0).validate()
    wrong = [np.zeros(int(t) + 1, np.float32) for t in group.turns]
    with pytest.raises(InvalidRecordError, match=r"turn_rewards\[0\] holds .* give one per turn"):
        _with(group, turn_rewards=wrong).validate()
    nan = [np.full(int(t), np.nan, np.float32) for t in group.turns]
    with pytest.raises(InvalidRecordError, match=r"turn_rewards\[0\] must be finite"):
        _with(group, turn_rewards=nan).validate()


def test_only_sampled_tokens_set_the_groups_version():
    group = _groups()[0]
    i = next(i for i, m in enumerate(group.loss_masks) if not m.all())
    versions = [v.copy() for v in group.token_versions]
    versions[i][group.loss_masks[i] == 0] = 0  # older than any sampled token: ignored
    assert _with(group, token_versions=versions).validate().policy_version == 2
    no_sampled = [np.zeros_like(m) for m in group.loss_masks]
    logprobs = [np.zeros_like(lp) for lp in group.behaviour_logprobs]
    empty = _with(group, loss_masks=no_sampled, behaviour_logprobs=logprobs, policy_version=7)
    assert empty.validate().sampled_lengths.tolist() == [0] * group.group_size


def test_rollout_sums_count_sampled_tokens_environment_tokens_and_turns():
    groups = _groups()
    sums = RolloutSums.of(groups)
    sampled = sum(int(m.sum()) for g in groups for m in g.effective_loss_masks)
    total = sum(len(t) for g in groups for t in g.response_tokens)
    responses = sum(g.group_size for g in groups)
    assert (sums.length, sums.env_tokens) == (sampled, total - sampled)
    assert sums.turns == sum(int(g.effective_turns.sum()) for g in groups)
    assert total > sampled
    metrics = sums.metrics("rollout")
    assert metrics["rollout/response_len_mean"] == pytest.approx(sampled / responses)
    assert metrics["rollout/env_tokens_mean"] == pytest.approx((total - sampled) / responses)
    assert metrics["rollout/turns_mean"] == pytest.approx(sums.turns / responses)
    single = [without_environment_tokens(g) for g in groups]
    assert RolloutSums.of(single).length == sums.length


def test_a_commit_record_written_before_multi_turn_sums_reads_one_turn_per_response():
    old = {  # as written before env_tokens and turns existed
        "seq": 3, "segment": "gen0-abc-000001", "writer_id": "gen0", "incarnation": "abc",
        "num_groups": 2, "num_responses": 8, "num_tokens": 100, "min_policy_version": 0,
        "max_policy_version": 1, "objects": {"zarr.json": [10, 123]}, "committed_at": 1.5,
        "rollout": {"responses": 8, "reward": 2.0, "correct": 5, "length": 100, "truncated": 1},
    }  # fmt: skip
    record = CommitRecord.from_json(json.dumps(old).encode(), 3)
    assert (record.rollout.env_tokens, record.rollout.turns) == (0, 8)
    assert CommitRecord.from_json(record.to_json(), 3) == record


def test_rollout_sums_count_finish_reasons_and_episode_statistics_through_a_commit_record():
    group = _with(
        _groups()[0],
        finish_reasons=["done", "max_tokens", "done"],
        tool_calls=np.array([2, 0, 1], np.int32),
        tool_errors=np.array([1, 0, 0], np.int32),
        env_seconds=np.array([0.5, 0.0, 0.25], np.float32),
        wait_seconds=np.array([0.0, 3.0, 1.0], np.float32),
    )
    sums = RolloutSums.of([group, group])
    assert sums.finished == {"done": 4, "max_tokens": 2}
    assert (sums.tool_calls, sums.tool_errors) == (6, 2)
    assert (sums.env_s, sums.wait_s) == pytest.approx((1.5, 8.0))
    metrics = sums.metrics("rollout")
    assert metrics["rollout/tool_calls_mean"] == pytest.approx(1.0)
    assert metrics["rollout/wait_s_mean"] == pytest.approx(8.0 / 6)
    assert metrics["rollout/finish_max_tokens_frac"] == pytest.approx(1 / 3)
    record = CommitRecord(
        seq=0, segment="gen0-abc-000000", writer_id="gen0", incarnation="abc", num_groups=2,
        num_responses=6, num_tokens=group.num_tokens * 2, min_policy_version=0,
        max_policy_version=0, objects={"zarr.json": (10, 1)}, rollout=sums,
    )  # fmt: skip
    assert CommitRecord.from_json(record.to_json(), 0).rollout == sums
    bad = json.loads(record.to_json())
    bad["rollout"]["finished"] = {"done": -1}
    with pytest.raises(InvalidRecordError, match=r"rollout.finished\['done'\] must be"):
        CommitRecord.from_json(json.dumps(bad).encode(), 0)


def test_rollout_sums_reward_each_turn_and_count_turns_to_the_first_full_reward():
    base = _groups()[0]
    turns = np.array([3, 1, 2], np.int32)
    rewards = [np.array([0.0, 0.5, 1.0], np.float32), np.array([1.0], np.float32),
               np.array([0.5, 0.5], np.float32)]  # fmt: skip
    group = _with(base, turns=turns, turn_rewards=rewards)
    sums = RolloutSums.of([group])
    assert sums.turn_reward == pytest.approx([1.5, 1.0, 1.0])
    assert sums.turn_rewarded == [3, 2, 1]
    assert (sums.full_episodes, sums.turns_to_full) == (2, 3 + 1)
    merged = RolloutSums.of([group])
    merged.merge(RolloutSums.of([_with(group, turn_rewards=[r[:1] for r in rewards])]))
    assert merged.turn_rewarded == [6, 2, 1]
    metrics = sums.metrics("rollout")
    assert metrics["rollout/turn1_reward_mean"] == pytest.approx(0.5)
    assert metrics["rollout/turn2_reward_mean"] == pytest.approx(0.5)
    assert metrics["rollout/turns_to_full_mean"] == pytest.approx(2.0)
    assert "rollout/turn1_reward_mean" not in RolloutSums.of([_groups()[3]]).metrics("rollout")
    record = CommitRecord(
        seq=0, segment="gen0-abc-000000", writer_id="gen0", incarnation="abc", num_groups=1,
        num_responses=3, num_tokens=group.num_tokens, min_policy_version=0,
        max_policy_version=0, objects={"zarr.json": (10, 1)}, rollout=sums,
    )  # fmt: skip
    assert CommitRecord.from_json(record.to_json(), 0).rollout == sums
    bad = json.loads(record.to_json())
    bad["rollout"]["turn_rewarded"] = [3, 2]
    with pytest.raises(InvalidRecordError, match="lists of one length"):
        CommitRecord.from_json(json.dumps(bad).encode(), 0)
    bad["rollout"]["turn_rewarded"], bad["rollout"]["turn_reward"] = [3, 2, 1], [1.5, "x", 1.0]
    with pytest.raises(InvalidRecordError, match=r"turn_reward\[1\] must be a finite number"):
        CommitRecord.from_json(json.dumps(bad).encode(), 0)
