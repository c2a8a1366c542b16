"""Scores from models on stream records: a teacher's log-probs and time per group and a reward's
terms (`ScoredGroup.teacher_logprobs`, `teacher_seconds`, `reward_terms`), their invariants,
their segment encoding (format 4, absent where no group has them), format-3 segments read
without them, and the rollout sums that count them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.stream.records import CommitRecord, InvalidRecordError, RolloutSums, ScoredGroup
from storage.stream.segments import CorruptSegmentError, decode_segment, encode_segment
from tests.multi_turn_data import multi_turn_group
from tests.stream_data import random_group

TEACHER_ARRAYS = ("teacher_scored", "teacher_timed", "teacher_seconds", "teacher_logprobs")


def _with(group: ScoredGroup, **changes) -> ScoredGroup:
    return ScoredGroup(**{**group.__dict__, **changes})


def _teacher(rng: np.random.Generator, group: ScoredGroup) -> list[np.ndarray]:
    """Random teacher log-probs ≤ 0 for `group`'s responses, 0 at its environment tokens."""
    return [
        (-rng.exponential(1.0, size=len(m)) * m).astype(np.float32)
        for m in group.effective_loss_masks
    ]


def _terms(rng: np.random.Generator, group: ScoredGroup, *names: str) -> dict[str, np.ndarray]:
    return {name: rng.normal(size=group.group_size).astype(np.float32) for name in names}


def _scored(seed: int = 0) -> list[ScoredGroup]:
    """A multi-turn group (with environment tokens) and a single-turn one, both scored by a
    teacher and with reward terms."""
    rng = np.random.default_rng(seed)
    groups = [multi_turn_group(rng, prompt_id="multi"), random_group(rng, prompt_id="single")]
    return [
        _with(g, teacher_logprobs=_teacher(rng, g), teacher_seconds=0.1 + i,
              reward_terms=_terms(rng, g, "math", "judge"))
        for i, g in enumerate(groups)
    ]  # fmt: skip


def _root(objects: dict[str, bytes]) -> dict:
    return json.loads(objects["zarr.json"])


def _arrays_of(objects: dict[str, bytes]) -> set[str]:
    return {key.split("/")[0] for key in objects if "/" in key}


@pytest.mark.parametrize("compression", ["zstd", "blosc", "none"])
def test_teacher_logprobs_and_reward_terms_round_trip_through_a_segment(compression):
    groups = _scored()
    assert groups[0].is_multi_turn
    assert not groups[1].is_multi_turn
    objects = encode_segment(groups, compression)
    decoded = decode_segment(objects)
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    for original, got in zip(groups, decoded, strict=True):
        assert [lp.tolist() for lp in got.teacher_logprobs] == [
            lp.tolist() for lp in original.teacher_logprobs
        ]
        assert got.teacher_logprobs[0].dtype == np.float32
        assert got.teacher_seconds == original.teacher_seconds  # exact, not rounded to f32
        assert sorted(got.reward_terms) == ["judge", "math"]
        for name, values in original.reward_terms.items():
            assert got.reward_terms[name].tolist() == values.tolist()
            assert got.reward_terms[name].dtype == np.float32
    environment = decoded[0].effective_loss_masks[0] == 0
    assert environment.any()
    assert (decoded[0].teacher_logprobs[0][environment] == 0).all()
    root = _root(objects)
    assert root["attributes"]["format_version"] == 4
    assert root["attributes"]["reward_term_names"] == ["judge", "math"]
    assert set(TEACHER_ARRAYS) | {"reward_terms"} <= set(root["attributes"]["crc32"])
    terms = json.loads(objects["reward_terms/zarr.json"])
    responses = sum(g.group_size for g in groups)
    assert terms["shape"] == [responses, 2]


def test_a_segment_without_scores_from_models_stores_none_of_their_arrays():
    rng = np.random.default_rng(1)
    groups = [multi_turn_group(rng, prompt_id="m"), random_group(rng, prompt_id="s")]
    objects = encode_segment(groups)
    root = _root(objects)
    new = {*TEACHER_ARRAYS, "reward_terms"}
    assert not new & _arrays_of(objects)
    assert not new & set(root["attributes"]["crc32"])
    assert "reward_term_names" not in root["attributes"]
    for group in decode_segment(objects):
        assert group.teacher_logprobs is group.teacher_seconds is group.reward_terms is None
    scored = encode_segment([_with(groups[0], teacher_logprobs=_teacher(rng, groups[0])),
                             groups[1]])  # fmt: skip
    assert set(TEACHER_ARRAYS) <= _arrays_of(scored)
    assert "reward_terms" not in _arrays_of(scored)


def test_a_mixed_segment_decodes_none_for_the_groups_a_teacher_did_not_score():
    rng = np.random.default_rng(2)
    base = [multi_turn_group(rng, prompt_id=f"m{i}") for i in range(4)]
    groups = [
        _with(base[0], teacher_logprobs=_teacher(rng, base[0]), teacher_seconds=1.25),
        base[1],
        _with(base[2], teacher_logprobs=_teacher(rng, base[2])),  # scored, not timed
        _with(base[3], teacher_logprobs=_teacher(rng, base[3]), teacher_seconds=0.0),
    ]
    decoded = decode_segment(encode_segment(groups))
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    assert decoded[0].teacher_seconds == 1.25
    assert decoded[1].teacher_logprobs is None
    assert decoded[1].teacher_seconds is None
    assert decoded[2].teacher_logprobs is not None
    assert decoded[2].teacher_seconds is None
    assert decoded[3].teacher_seconds == 0.0
    assert [lp.tolist() for lp in decoded[2].teacher_logprobs] == [
        lp.tolist() for lp in groups[2].teacher_logprobs
    ]


def test_groups_of_one_segment_must_have_the_same_reward_terms():
    rng = np.random.default_rng(3)
    a, b = random_group(rng, prompt_id="a"), random_group(rng, prompt_id="b")
    math_judge = _with(a, reward_terms=_terms(rng, a, "math", "judge"))
    math_only = _with(b, reward_terms=_terms(rng, b, "math"))
    with pytest.raises(ValueError, match=r"'b' has reward terms \['math'\] .* 'a' .* \['judge', "
                                         r"'math'\]"):  # fmt: skip
        encode_segment([math_judge, math_only])
    with pytest.raises(ValueError, match=r"'b' has reward terms None .* \['judge', 'math'\]"):
        encode_segment([math_judge, b])
    reordered = _with(b, reward_terms=dict(reversed(_terms(rng, b, "math", "judge").items())))
    decoded = decode_segment(encode_segment([math_judge, reordered]))
    assert decoded[1].equals(reordered)


@pytest.mark.parametrize("name", [*TEACHER_ARRAYS, "reward_terms"])
def test_a_corrupted_scoring_array_fails_its_crc(name):
    objects = encode_segment(_scored(), compression="none")
    (key,) = [k for k in objects if k.startswith(f"{name}/c/")]  # reward_terms: 2-d, c/0/0
    chunk = bytearray(objects[key])
    chunk[-1] ^= 1
    with pytest.raises(CorruptSegmentError, match=f"array '{name}' fails its CRC32 check"):
        decode_segment({**objects, key: bytes(chunk)})


def test_a_segment_missing_a_scoring_array_is_corrupt():
    objects = encode_segment(_scored())
    root = _root(objects)
    del root["attributes"]["crc32"]["teacher_timed"]
    with pytest.raises(CorruptSegmentError, match="teacher log-probs lacks teacher_timed"):
        decode_segment({**objects, "zarr.json": json.dumps(root).encode()})
    root = _root(objects)
    del root["attributes"]["reward_term_names"]
    with pytest.raises(CorruptSegmentError, match="reward_term_names"):
        decode_segment({**objects, "zarr.json": json.dumps(root).encode()})
    root = _root(objects)
    root["attributes"]["reward_term_names"] = ["math"]
    with pytest.raises(CorruptSegmentError, match="responses and 1 reward terms"):
        decode_segment({**objects, "zarr.json": json.dumps(root).encode()})


def _as_format_3(objects: dict[str, bytes]) -> dict[str, bytes]:
    """The segment the encoder wrote before format 4: the same objects without the teacher and
    reward-term arrays and their names, `format_version` 3."""
    new = (*TEACHER_ARRAYS, "reward_terms")
    root = _root(objects)
    root["attributes"]["format_version"] = 3
    root["attributes"].pop("reward_term_names")
    for name in new:
        del root["attributes"]["crc32"][name]
    old = {k: v for k, v in objects.items() if k.split("/")[0] not in new}
    return {**old, "zarr.json": json.dumps(root, indent=2).encode()}


def test_a_format_3_segment_decodes_without_scores_from_models():
    groups = _scored()
    decoded = decode_segment(_as_format_3(encode_segment(groups)))
    for original, got in zip(groups, decoded, strict=True):
        assert got.teacher_logprobs is got.teacher_seconds is got.reward_terms is None
        assert not got.equals(original)
        unscored = _with(original, teacher_logprobs=None, teacher_seconds=None, reward_terms=None)
        assert got.equals(unscored)
    # a format-3 segment never has these arrays; if one did, format 3 would not read them
    objects = encode_segment(groups)
    root = _root(objects)
    root["attributes"]["format_version"] = 3
    stale = decode_segment({**objects, "zarr.json": json.dumps(root).encode()})
    assert all(g.teacher_logprobs is g.reward_terms is None for g in stale)


def test_validate_rejects_bad_teacher_logprobs():
    group = _scored()[0]  # multi-turn
    short = [lp[:-1] for lp in group.teacher_logprobs]
    with pytest.raises(InvalidRecordError, match=r"'multi'.*teacher_logprobs\[0\] has .* same "
                                                 "length"):  # fmt: skip
        _with(group, teacher_logprobs=short).validate()
    with pytest.raises(InvalidRecordError, match="teacher_logprobs has 2 entries but there are 3"):
        _with(group, teacher_logprobs=group.teacher_logprobs[:2]).validate()
    positive = [lp.copy() for lp in group.teacher_logprobs]
    positive[1][0] = 0.5
    with pytest.raises(InvalidRecordError, match=r"teacher_logprobs\[1\] must be finite and ≤ 0"):
        _with(group, teacher_logprobs=positive).validate()
    nan = [lp.copy() for lp in group.teacher_logprobs]
    nan[2][-1] = np.nan
    with pytest.raises(InvalidRecordError, match=r"teacher_logprobs\[2\] must be finite and ≤ 0"):
        _with(group, teacher_logprobs=nan).validate()
    i = next(i for i, m in enumerate(group.loss_masks) if not m.all())
    at_environment = [lp.copy() for lp in group.teacher_logprobs]
    at_environment[i][np.flatnonzero(group.loss_masks[i] == 0)[0]] = -0.5
    with pytest.raises(InvalidRecordError, match=rf"teacher_logprobs\[{i}\] must be exactly 0"):
        _with(group, teacher_logprobs=at_environment).validate()


def test_validate_rejects_a_bad_teacher_time():
    group = _scored()[1]
    for seconds in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRecordError, match="teacher_seconds must be finite and ≥ 0"):
            _with(group, teacher_seconds=seconds).validate()
    with pytest.raises(InvalidRecordError, match="teacher_seconds is given but teacher_logprobs"):
        _with(group, teacher_logprobs=None).validate()
    _with(group, teacher_seconds=None).validate()


@pytest.mark.parametrize("name", ["Math", "1st", "judge-score", "", "a" * 65, "é"])
def test_validate_rejects_a_bad_reward_term_name(name):
    group = _scored()[1]
    terms = {**group.reward_terms, name: group.reward_terms["math"]}
    with pytest.raises(InvalidRecordError, match=r"'single'.*reward_terms name .* lower-case"):
        _with(group, reward_terms=terms).validate()


def test_validate_accepts_reward_term_names_up_to_64_characters():
    group = _scored()[1]
    for name in ("a", "judge_2", "a" * 64):
        _with(group, reward_terms={name: group.reward_terms["math"]}).validate()


def test_validate_rejects_bad_reward_term_values():
    group = _scored()[1]
    g = group.group_size
    with pytest.raises(InvalidRecordError, match=r"reward_terms\['math'\] has shape \(3,\) but"):
        _with(group, reward_terms={"math": np.zeros(g - 1, np.float32)}).validate()
    with pytest.raises(InvalidRecordError, match=r"reward_terms\['math'\] has shape"):
        _with(group, reward_terms={"math": np.zeros((g, 1), np.float32)}).validate()
    nan = np.zeros(g, np.float32)
    nan[1] = np.nan
    with pytest.raises(InvalidRecordError, match=r"reward_terms\['judge'\] must be finite"):
        _with(group, reward_terms={"math": np.zeros(g), "judge": nan}).validate()
    with pytest.raises(InvalidRecordError, match="reward_terms names no term"):
        _with(group, reward_terms={}).validate()


def test_equals_sees_every_scoring_field():
    group = _scored()[0]
    shifted = [lp - 1.0 * m for lp, m in zip(group.teacher_logprobs, group.loss_masks,
                                               strict=True)]  # fmt: skip
    assert group.equals(_with(group))
    assert not group.equals(_with(group, teacher_logprobs=shifted))
    assert not group.equals(_with(group, teacher_logprobs=None, teacher_seconds=None))
    assert not _with(group, teacher_logprobs=None, teacher_seconds=None).equals(group)
    assert not group.equals(_with(group, teacher_seconds=group.teacher_seconds + 1))
    assert not group.equals(_with(group, teacher_seconds=None))
    terms = {**group.reward_terms, "math": group.reward_terms["math"] + 1}
    assert not group.equals(_with(group, reward_terms=terms))
    assert not group.equals(_with(group, reward_terms={"math": group.reward_terms["math"]}))
    assert not group.equals(_with(group, reward_terms=None))


def test_rollout_sums_sum_reward_terms_and_teacher_time_and_merge_them():
    a, b = _scored()
    b = _with(b, reward_terms={"math": b.reward_terms["math"]}, teacher_seconds=None)
    sums = RolloutSums.of([a, b])
    math_sum = float(a.reward_terms["math"].sum(dtype=np.float64)) + float(
        b.reward_terms["math"].sum(dtype=np.float64)
    )
    assert sums.reward_terms == pytest.approx(
        {"math": math_sum, "judge": float(a.reward_terms["judge"].sum(dtype=np.float64))}
    )
    assert (sums.teacher_groups, sums.teacher_s) == (2, pytest.approx(a.teacher_seconds))
    responses = a.group_size + b.group_size
    metrics = sums.metrics("rollout")
    assert metrics["reward/math_mean"] == pytest.approx(math_sum / responses)
    accepted = sums.metrics("rollout_accepted")
    assert accepted["reward_accepted/math_mean"] == pytest.approx(math_sum / responses)
    assert metrics["rollout/teacher_s_per_group"] == pytest.approx(a.teacher_seconds / 2)

    merged = RolloutSums.of([a])
    merged.merge(RolloutSums.of([b]))
    assert merged.reward_terms == pytest.approx(sums.reward_terms)
    assert (merged.teacher_groups, merged.teacher_s) == (sums.teacher_groups, sums.teacher_s)

    plain = _with(a, teacher_logprobs=None, teacher_seconds=None, reward_terms=None)
    metrics = RolloutSums.of([plain]).metrics("rollout")
    scoring = {k for k in metrics if "teacher" in k or k.startswith(("rollout/reward", "reward/"))}
    assert scoring == {"rollout/reward_mean"}


def _record(sums: RolloutSums) -> CommitRecord:
    return CommitRecord(
        seq=0, segment="gen0-abc-000000", writer_id="gen0", incarnation="abc", num_groups=2,
        num_responses=sums.responses, num_tokens=10, min_policy_version=0, max_policy_version=0,
        objects={"zarr.json": (10, 1)}, rollout=sums,
    )  # fmt: skip


def test_rollout_sums_of_scores_from_models_ride_on_a_commit_record():
    sums = RolloutSums.of(_scored())
    record = _record(sums)
    assert CommitRecord.from_json(record.to_json(), 0).rollout == sums
    stored = json.loads(record.to_json())
    old_rollout = {k: v for k, v in stored["rollout"].items()
                   if k not in ("reward_terms", "teacher_groups", "teacher_s")}  # fmt: skip
    old = CommitRecord.from_json(json.dumps({**stored, "rollout": old_rollout}).encode(), 0)
    assert (old.rollout.reward_terms, old.rollout.teacher_groups, old.rollout.teacher_s) == (
        {}, 0, 0.0,
    )  # fmt: skip
    assert RolloutSums.from_dict(old_rollout).responses == sums.responses
    for bad, match in (
        ({"math": "x"}, r"rollout.reward_terms\['math'\] must be a finite number"),
        ({"math": float("nan")}, r"rollout.reward_terms\['math'\] must be a finite number"),
        ([1.0], "rollout.reward_terms must map term names"),
    ):
        rollout = {**stored["rollout"], "reward_terms": bad}
        with pytest.raises(InvalidRecordError, match=match):
            CommitRecord.from_json(json.dumps({**stored, "rollout": rollout}).encode(), 0)
    rollout = {**stored["rollout"], "teacher_groups": -1}
    with pytest.raises(InvalidRecordError, match=r"rollout\.teacher_groups must be an integer"):
        CommitRecord.from_json(json.dumps({**stored, "rollout": rollout}).encode(), 0)
