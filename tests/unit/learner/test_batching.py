"""The learner's group selection (`streamrl.learner.batching`): stream filters, counts and
cursor. References are written independently here (plain loops over groups). The tensor packing
is tested in test_mini_batches.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from storage.fs import Location, open_location
from storage.stream.records import Cursor, RolloutSums, ScoredGroup
from storage.stream.writer import SkippedSegment, StreamReader, StreamWriter, read_log
from streamrl.algorithms import groups_with_signal, grpo_advantages
from streamrl.algorithms.shaping import overlong_penalty, scale_rule_reward
from streamrl.learner.batching import BatchCollector, IncompatibleGroupError
from streamrl.learner.mini_batches import TrainBatch
from tests.stream_data import RecordingFS, random_group

VOCAB = 1000


def _group(rng, i: int, version: int = 0, rewards=None, scores=None, **kwargs) -> ScoredGroup:
    """A random group; `rewards` (shaped) and `scores` (raw correctness, default: reward > 0)
    replace the random ones when given."""
    kwargs = {"vocab": VOCAB, "prompt_len": int(rng.integers(1, 9)), **kwargs}
    group = random_group(rng, prompt_id=f"p{i}", policy_version=version, **kwargs)
    if rewards is not None:
        rewards = np.asarray(rewards, np.float32)
        scores = (rewards > 0).astype(np.float32) if scores is None else scores
        group = ScoredGroup(
            **{**group.__dict__, "rewards": rewards, "raw_scores": np.asarray(scores, np.float32)}
        )
    return group


def _groups(n: int, seed: int = 0, **kwargs) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    return [_group(rng, i, **kwargs) for i in range(n)]


class _ListStream:
    """A finite stand-in for StreamReader: `cursor` is past the last group yielded."""

    def __init__(self, groups: list[ScoredGroup]) -> None:
        self.items, self.cursor = groups, Cursor(0, 0)

    def groups(self) -> Iterator[ScoredGroup]:
        for i, group in enumerate(self.items):
            self.cursor = Cursor(0, i + 1)
            yield group


def _collector(batch_groups: int, **kwargs) -> BatchCollector:
    defaults = {"max_staleness": 4, "dynamic_sampling": False, "vocab_size": VOCAB}
    return BatchCollector(batch_groups=batch_groups, **{**defaults, "max_seq_len": 64, **kwargs})


def _collect(collector: BatchCollector, groups: list[ScoredGroup], version: int = 0):
    stream = _ListStream(groups)
    return collector.collect(stream.groups(), lambda: stream.cursor, version)


# -- filters and counts ----------------------------------------------------------------------


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_staleness_filter_drops_exactly_groups_older_than_max_staleness(max_staleness):
    current = 5
    versions = [5, 0, 3, 4, 5, 2, 1, 3, 5]
    rng = np.random.default_rng(1)
    groups = [_group(rng, i, v, rewards=[1, -1, 1, 1]) for i, v in enumerate(versions)]
    kept = [i for i, v in enumerate(versions) if current - v <= max_staleness]
    collector = _collector(len(kept), max_staleness=max_staleness)
    batch = _collect(collector, groups, current)
    assert [g.prompt_id for g in batch.groups] == [f"p{i}" for i in kept]
    if max_staleness == 0:
        assert all(g.policy_version == current for g in batch.groups)
    else:
        assert "p2" in [g.prompt_id for g in batch.groups]  # staleness == max_staleness is kept
    dropped = sum(current - v > max_staleness for v in versions[: kept[-1] + 1])
    assert (batch.counts.dropped_stale, batch.counts.dropped_zero_var) == (dropped, 0)
    assert batch.counts.accepted == len(kept)
    assert batch.counts.consumed == kept[-1] + 1
    staleness = [current - versions[i] for i in kept]
    metrics = batch.metrics()
    assert metrics["stream/staleness_max"] == max(staleness)
    assert metrics["stream/staleness_mean"] == pytest.approx(np.mean(staleness))
    assert metrics["stream/dropped_stale"] == dropped


@pytest.mark.parametrize("enabled", [True, False])
def test_dynamic_sampling_drops_exactly_the_all_equal_groups_when_enabled(enabled):
    patterns = [[1, 1, 1], [1, -1, 1], [-1, -1, -1], [0.5, 0.5, 0.5], [0, 0, 0.25], [1, 1, 1]]
    rng = np.random.default_rng(2)
    groups = [_group(rng, i, group_size=3, rewards=r) for i, r in enumerate(patterns)]
    scores = torch.tensor(np.concatenate([g.raw_scores for g in groups]))
    signal = groups_with_signal(scores, torch.arange(len(patterns)).repeat_interleave(3), 6)
    expected = [i for i in range(6) if signal[i] or not enabled]
    collector = _collector(len(expected), dynamic_sampling=enabled)
    batch = _collect(collector, groups + _groups(3, seed=9))  # spare groups left unread
    assert [g.prompt_id for g in batch.groups] == [f"p{i}" for i in expected]
    dropped = (expected[-1] + 1 - len(expected)) if enabled else 0
    assert (batch.counts.dropped_zero_var, batch.counts.dropped_stale) == (dropped, 0)
    assert batch.cursor_after == Cursor(0, expected[-1] + 1)


def test_dynamic_sampling_decides_on_correctness_not_on_overlong_shaped_rewards():
    """DAPO keeps a group iff 0 < #correct < G. With overlong shaping on, an all-wrong group
    whose answers got different length penalties has unequal rewards but no signal: dropped.
    A mixed group whose rewards are shaped is kept, with its shaped rewards."""
    max_tokens, cache = 20, 4
    lengths = np.array([20, 12, 18, 5])  # penalties 0, 0, −0.5 (18 > 16), 0 … −1 for > 20
    penalty = overlong_penalty(torch.tensor(lengths), max_tokens, cache).numpy()
    rng = np.random.default_rng(5)
    all_wrong = scale_rule_reward(torch.zeros(4)).numpy() + penalty
    mixed = scale_rule_reward(torch.tensor([1.0, 0, 0, 1])).numpy() + penalty
    all_right = scale_rule_reward(torch.ones(4)).numpy() + penalty
    groups = [
        _group(rng, 0, rewards=all_wrong, scores=np.zeros(4)),
        _group(rng, 1, rewards=all_right, scores=np.ones(4)),
        _group(rng, 2, rewards=mixed, scores=np.array([1.0, 0, 0, 1])),
    ]
    assert np.ptp(all_wrong) > 0  # the shaped rewards do differ
    assert np.ptp(all_right) > 0
    batch = _collect(_collector(1, dynamic_sampling=True), groups)
    assert [g.prompt_id for g in batch.groups] == ["p2"]
    assert batch.counts.dropped_zero_var == 2
    np.testing.assert_array_equal(batch.groups[0].rewards, mixed)
    # GRPO on the kept group uses the shaped rewards; on the all-wrong group it would have
    # turned a −0.5 length penalty into advantages of order one.
    train = TrainBatch.from_groups(batch.groups)
    advantages = grpo_advantages(train.rewards, train.group_index, 1)
    expected = (mixed - mixed.mean()) / (mixed.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-5)


def test_a_learner_starved_by_groups_without_signal_warns_naming_the_cause(caplog):
    """Every group all correct (data too easy for the model): no batch fills, and the learner
    says why after STARVED_BATCHES batches' worth of such groups, then at each doubling —
    not on every group, and not at all once a group with signal resets the count."""
    rng = np.random.default_rng(3)
    easy = [_group(rng, i, group_size=4, rewards=[1, 1, 1, 1]) for i in range(63)]
    collector = _collector(2, dynamic_sampling=True)
    with caplog.at_level("WARNING", logger="streamrl.learner.batching"), pytest.raises(EOFError):
        _collect(collector, easy)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3  # at 8, 16 and 32 groups (4 batches of 2, then doubling), not 64
    assert warnings[0].startswith("no signal in the last 8 groups: 8 had every response correct")
    assert "too easy for the model now" in warnings[0]
    assert "algorithm.dynamic_sampling=false" in warnings[0]
    caplog.clear()
    hard = [_group(rng, i, group_size=4, rewards=[0, 0, 0, 0]) for i in range(7)]
    mixed = [_group(rng, 99, group_size=4, rewards=[1, 0, 0, 0])] * 2
    with caplog.at_level("WARNING", logger="streamrl.learner.batching"):
        _collect(_collector(2, dynamic_sampling=True), [*hard, mixed[0], *hard, mixed[1]])
    assert caplog.records == []  # 7 alike, then signal: the count starts again


def test_rollout_metrics_cover_every_consumed_group_and_the_accepted_ones_apart():
    """rollout/* over every group consumed within max_staleness (accepted or dropped by dynamic
    sampling: what the generators produce); rollout_accepted/* over the groups trained on."""
    rng = np.random.default_rng(6)
    groups = [
        _group(rng, 0, rewards=[1, 1, 1, 1]),  # all right: dropped
        _group(rng, 1, rewards=[-1, -1, -1, -1]),  # all wrong: dropped
        _group(rng, 2, rewards=[1, -1, -1, -1]),  # kept
    ]
    batch = _collect(_collector(1, dynamic_sampling=True), groups)
    metrics = batch.metrics()
    assert metrics["rollout/acc"] == pytest.approx(5 / 12)
    assert metrics["rollout_accepted/acc"] == pytest.approx(1 / 4)
    assert metrics["rollout/reward_mean"] == pytest.approx(-2 / 12)
    assert metrics["rollout_accepted/reward_mean"] == pytest.approx(-0.5)
    lengths = [len(t) for g in groups for t in g.response_tokens]
    assert metrics["rollout/response_len_mean"] == pytest.approx(np.mean(lengths))
    assert metrics["rollout_accepted/response_len_mean"] == pytest.approx(np.mean(lengths[8:]))
    truncated = np.concatenate([g.truncated for g in groups])
    assert metrics["rollout/truncated_frac"] == pytest.approx(truncated.mean())


def test_stale_groups_read_or_skipped_unread_count_as_stale_and_in_rollout_metrics():
    """A stale group read and a stale segment skipped unread both count as consumed and stale;
    rollout/* covers both (the skipped one through its commit record's sums)."""
    rng = np.random.default_rng(7)
    fresh = _group(rng, 1, version=5, rewards=[1, -1, -1, -1])
    unread = RolloutSums(responses=4, reward=-4.0, correct=0, length=40, truncated=1)
    stale = _group(rng, 0, version=0, rewards=[1, 1, 1, 1])
    items = [stale, SkippedSegment(3, 4, 0, unread), fresh]
    batch = _collect(_collector(1, max_staleness=4), items, version=5)
    assert (batch.counts.consumed, batch.counts.dropped_stale) == (6, 5)
    assert batch.counts.skipped_segments == 1
    metrics = batch.metrics()
    assert metrics["rollout/acc"] == pytest.approx(5 / 12)
    assert metrics["rollout/reward_mean"] == pytest.approx((4 - 4 - 2) / 12)
    lengths = sum(len(t) for g in (stale, fresh) for t in g.response_tokens) + 40
    assert metrics["rollout/response_len_mean"] == pytest.approx(lengths / 12)
    assert metrics["rollout_accepted/acc"] == pytest.approx(1 / 4)
    assert metrics["stream/waste_frac"] == pytest.approx(5 / 6)  # consumed 6, trained 1
    assert metrics["stream/stale_frac"] == pytest.approx(5 / 6)
    still_usable = SkippedSegment(3, 4, 1, unread)  # version 1 is usable at 5 − 4
    with pytest.raises(ValueError, match="skipped segment 3"):
        _collect(_collector(1, max_staleness=4), [still_usable, fresh], version=5)


def test_a_stale_zero_variance_group_counts_as_stale_and_totals_accumulate():
    rng = np.random.default_rng(3)
    groups = [
        _group(rng, 0, version=0, rewards=[1, 1, 1, 1]),  # stale and zero-variance
        _group(rng, 1, version=9, rewards=[1, 1, 1, 1]),
        _group(rng, 2, version=9, rewards=[1, -1, 1, 1]),
        _group(rng, 3, version=9, rewards=[-1, -1, 1, 1]),
    ]
    collector = _collector(1, max_staleness=1, dynamic_sampling=True)
    stream = _ListStream(groups)
    iterator = stream.groups()
    first = collector.collect(iterator, lambda: stream.cursor, 9)
    second = collector.collect(iterator, lambda: stream.cursor, 9)
    assert (first.counts.dropped_stale, first.counts.dropped_zero_var) == (1, 1)
    assert (second.counts.consumed, second.cursor_after) == (1, Cursor(0, 4))
    assert (collector.totals.accepted, collector.totals.consumed) == (2, 4)
    assert second.metrics()["stream/dropped_stale_total"] == 1
    with pytest.raises(EOFError, match="0/1 accepted"):
        collector.collect(iterator, lambda: stream.cursor, 9)


def test_collector_reads_a_real_stream_until_b_accepted_and_resumes_at_its_cursor(tmp_path):
    run = open_location(str(tmp_path / "run"))
    rng = np.random.default_rng(4)
    versions = [3, 0, 3, 3, 1, 3, 3, 3, 3, 2, 3, 3]
    zero_var = {2, 6}
    groups = [
        _group(rng, i, v, rewards=[1, 1, 1, 1] if i in zero_var else [1, -1, -1, 1])
        for i, v in enumerate(versions)
    ]
    writer = StreamWriter(run, "gen0")
    writer.write(groups[:5])
    writer.write(groups[5:])
    collector = _collector(3, max_staleness=1, dynamic_sampling=True)

    reader = StreamReader(run, prefetch_rounds=1)
    iterator = reader.groups(timeout_s=5)
    first = collector.collect(iterator, lambda: reader.cursor, 3)
    second = collector.collect(iterator, lambda: reader.cursor, 3)
    iterator.close()
    # p0 kept; p1 stale; p2 zero-var; p3 kept; p4 stale; p5 kept (last of segment 0 is p4).
    assert [g.prompt_id for g in first.groups] == ["p0", "p3", "p5"]
    assert first.cursor_after == Cursor(1, 1)
    assert (first.counts.dropped_stale, first.counts.dropped_zero_var) == (2, 1)
    assert [g.prompt_id for g in second.groups] == ["p7", "p8", "p9"]
    assert second.cursor_after == Cursor(1, 5)

    resumed = StreamReader(run, first.cursor_after, prefetch_rounds=0)
    iterator = resumed.groups(timeout_s=5)
    again = _collector(3, max_staleness=1, dynamic_sampling=True)
    replay = again.collect(iterator, lambda: resumed.cursor, 3)
    iterator.close()
    assert [g.prompt_id for g in replay.groups] == ["p7", "p8", "p9"]
    assert replay.cursor_after == second.cursor_after


def _collect_all(run: Location, start: Cursor, versions: list[int], skip: bool, prefetch: int):
    """Batches of 2 collected at successive learner `versions` from `start`, by a reader that
    skips stale segments unread or not."""
    collector = _collector(2, max_staleness=1, dynamic_sampling=True)
    version = [versions[0]]
    bound = (lambda: collector.oldest_usable(version[0])) if skip else None
    reader = StreamReader(
        run, start, records_per_round=3, prefetch_rounds=prefetch, oldest_usable_version=bound
    )
    iterator = reader.groups(timeout_s=5)
    batches = []
    for v in versions:
        version[0] = v
        batches.append(collector.collect(iterator, lambda: reader.cursor, v))
    iterator.close()
    return batches, collector.totals


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("start", [Cursor(0, 0), Cursor(1, 1)])  # inside a stale segment
def test_stale_segments_are_skipped_unread_with_the_same_batches_cursors_and_counts(
    tmp_path, prefetch, start
):
    """A segment whose commit record says every group is older than the oldest usable version
    is not downloaded; the learner sees the same batches, cursors and filter counts."""
    rng = np.random.default_rng(11)
    segment_versions = [[5, 5, 5], [2, 3, 1, 3], [5, 4], [2, 2], [3, 5, 5], [6, 6, 6], [4, 3]]
    groups = [
        [_group(rng, 10 * s + i, v, rewards=[1, -1, -1, 1]) for i, v in enumerate(vs)]
        for s, vs in enumerate(segment_versions)
    ]
    groups[2][0] = _group(rng, 20, 5, rewards=[1, 1, 1, 1])  # zero variance: still counted
    path = str(tmp_path / "run")
    writer = StreamWriter(open_location(path), "gen0")
    records = [writer.write(g) for g in groups]
    versions = [5, 5, 6]  # learner version per batch: usable from 4, then from 5
    runs = {}
    for skip in (False, True):
        fs = RecordingFS()
        batches, totals = _collect_all(Location(fs, path, path), start, versions, skip, prefetch)
        runs[skip] = batches, totals, fs.segments_read()

    (plain, plain_totals, plain_read), (fast, fast_totals, fast_read) = runs[False], runs[True]
    for a, b in zip(plain, fast, strict=True):
        assert [g.prompt_id for g in a.groups] == [g.prompt_id for g in b.groups]
        assert a.cursor_after == b.cursor_after
        assert replace(a.counts, skipped_segments=0) == replace(b.counts, skipped_segments=0)
        np.testing.assert_array_equal(a.staleness, b.staleness)
        assert a.consumed == b.consumed  # rollout/*: the skipped segments' record sums
    assert replace(plain_totals, skipped_segments=0) == replace(fast_totals, skipped_segments=0)
    assert plain_totals.skipped_segments == 0
    # Segments 1 and 3 (versions ≤ 3) are stale from the first batch on: never downloaded
    # (segment 1 only when whole: a cursor inside it reads it as usual).
    stale = {records[3].segment} | ({records[1].segment} if start == Cursor(0, 0) else set())
    assert stale <= plain_read
    assert not stale & fast_read
    assert fast_totals.skipped_segments == len(stale)
    assert fast_totals.dropped_stale == plain_totals.dropped_stale
    # Segment 4 mixes versions 3 and 5: read, and only its version-3 group dropped.
    assert records[4].segment in fast_read


def test_poll_passes_over_a_stale_record_only_when_given_a_bound(tmp_path):
    run = open_location(str(tmp_path / "run"))
    rng = np.random.default_rng(12)
    reader_groups = [_group(rng, i, 0) for i in range(3)]
    StreamWriter(run, "gen0").write(reader_groups)
    reader = StreamReader(run, prefetch_rounds=0)
    assert [type(g) for _, g in reader.poll()] == [ScoredGroup] * 3
    reader.oldest_usable_version = lambda: 1
    (record,) = read_log(run)
    assert record.rollout == RolloutSums.of(reader_groups)
    assert reader.poll() == [(Cursor(1), SkippedSegment(0, 3, 0, record.rollout))]
    assert reader.poll(Cursor(0, 3)) == [(Cursor(1), None)]  # nothing left of it


def test_out_of_vocabulary_tokens_and_overlong_sequences_are_rejected_naming_the_group():
    rng = np.random.default_rng(5)
    group = _group(rng, 7, generator_id="genX", vocab=VOCAB + 10, max_len=40, prompt_len=8)
    group.response_tokens[1][0] = VOCAB  # one id past the model's vocabulary
    with pytest.raises(IncompatibleGroupError, match=r"'p7' from generator 'genX'.*tokenizer"):
        _collect(_collector(1, max_staleness=100), [group], version=200)  # stale, still checked
    long = _group(rng, 8, min_len=60, max_len=60, prompt_len=5)
    with pytest.raises(IncompatibleGroupError, match=r"'p8'.*65-token.*max_seq_len 64"):
        _collect(_collector(1), [long])


# -- length-aware batches (the framework guide's Alg. 3) --------------------------------------


@pytest.mark.parametrize("batch_tokens", [1, 40, 95, 10**6])
def test_a_length_aware_batch_closes_at_b_groups_or_at_batch_tokens(batch_tokens):
    groups = _groups(12, seed=3, max_len=16)
    stale = replace(groups[1], policy_version=-10)  # dropped: its tokens never count
    groups[1] = stale
    collector = _collector(5, batch_tokens=batch_tokens)
    batch = _collect(collector, groups, version=0)
    expected, tokens = [], 0  # reference: a plain loop over the accepted groups
    for group in groups:
        if group is stale:
            continue
        expected.append(group.prompt_id)
        tokens += sum(len(t) for t in group.response_tokens)
        if len(expected) == 5 or tokens >= batch_tokens:
            break
    assert [g.prompt_id for g in batch.groups] == expected
    assert 1 <= len(expected) <= 5
    assert batch.cursor_after == Cursor(0, groups.index(batch.groups[-1]) + 1)
    assert batch.counts.accepted == len(expected)


def test_a_stream_ending_before_batch_tokens_is_reached_is_an_eof():
    with pytest.raises(EOFError, match="2/5 accepted"):
        _collect(_collector(5, batch_tokens=10**6), _groups(2, max_len=8))
