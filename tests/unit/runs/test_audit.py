"""`streamrl verify` (`streamrl.runs.audit`) on runs built with the project's own writers
(`built_runs`): a whole run passes with the learner's own figures, and each kind of damage is
found and named — a missing log number, a segment committed twice, a corrupted or missing
segment object, a missing metrics step, metrics of two trainings mixed, a checkpoint cursor that
disagrees with its counts, an altered weight file, LATEST naming a version without manifest.
What is expected is reported and passes: a segment the learner quarantined, a dead writer's
open segment, a resumed learner's rewritten and abandoned metrics records."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from torch import nn

from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState
from storage.fs import open_location, put_if_absent
from storage.stream.log import log_path
from storage.stream.records import Cursor
from storage.stream.writer import StreamWriter, read_log
from streamrl.cli.main import main
from streamrl.runs.audit import audit_run
from tests.unit.runs.built_runs import SEGMENT_GROUPS, group, new_run, train, write_stream

GROUPS, STEPS = 40, 4


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A run trained to STEPS steps (checkpoints at 2 and 4), and the learner's own totals."""
    root = tmp_path_factory.mktemp("audit") / "whole"
    run, config = new_run(root)
    write_stream(run, GROUPS)
    collector = train(run, config, STEPS)
    return root, asdict(collector.totals)


@pytest.fixture
def whole(built: tuple[Path, dict], tmp_path: Path) -> Path:
    """A copy of the built run, for a test to damage."""
    shutil.copytree(built[0], tmp_path / "run")
    return tmp_path / "run"


def _problems(root: Path) -> list[str]:
    return list(audit_run(open_location(str(root))).problems)


def _segment(root: Path, seq: int) -> Path:
    record = list(read_log(open_location(str(root))))[seq]
    return root / "stream" / "segments" / record.segment


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_whole_run_passes_with_the_learners_own_figures(built, capsys):
    root, totals = built
    audit = audit_run(open_location(str(root)))
    assert audit.problems == ()
    assert audit.whole
    assert totals["dropped_stale"] > 0  # both filters ran
    assert totals["dropped_zero_var"] > 0
    assert (audit.commits, audit.groups_committed) == (-(-GROUPS // SEGMENT_GROUPS), GROUPS)
    assert audit.segments_verified == audit.commits
    assert audit.groups_consumed == totals["consumed"]
    assert audit.groups_trained == totals["accepted"] == STEPS * 2
    assert audit.groups_dropped_stale == totals["dropped_stale"]
    assert audit.groups_dropped_no_signal == totals["dropped_zero_var"]
    assert audit.groups_unconsumed == GROUPS - totals["consumed"]
    assert (audit.last_step, audit.metrics_records, audit.checkpoint_step) == (STEPS, STEPS, STEPS)
    assert audit.weight_versions == (1, 2, 3, 4)
    assert (audit.segments_quarantined, audit.segments_lost_uncommitted) == (0, 0)

    assert main(["verify", str(root)]) == 0
    assert "verdict    whole" in capsys.readouterr().out
    assert main(["verify", str(root), "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["whole"] is True
    assert reported["groups_consumed"] == totals["consumed"]


def test_no_run_exits_2_and_creates_nothing(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_a_missing_log_number_strands_the_records_after_it(whole, capsys):
    (whole / "stream" / "log" / f"{5:012d}.json").unlink()
    (problem,) = _problems(whole)
    assert problem.startswith(
        "the commit log has no record 5 but 8 after it (log numbers 6-13): every reader stops "
        f"at the gap, so their {GROUPS - 6 * SEGMENT_GROUPS} groups are never read"
    )
    assert main(["verify", str(whole)]) == 1
    out = capsys.readouterr().out
    assert "NOT whole: 1 problem" in out
    assert "has no record 5" in out


def test_a_segment_committed_twice_is_found(whole):
    run = open_location(str(whole))
    records = list(read_log(run))
    again = replace(records[1], seq=len(records))  # a retried commit that landed twice
    assert put_if_absent(run.fs, log_path(run.child("stream"), again.seq), again.to_json())
    problems = _problems(whole)
    assert (
        f"segment {records[1].segment} is committed 2 times (log numbers 1, {again.seq}): its "
        "groups are read once per commit"
    ) in problems


def test_the_same_bytes_committed_under_two_segment_names_are_found(whole):
    """A segment uploaded again past its commit deadline and then committed twice."""
    run = open_location(str(whole))
    records = list(read_log(run))
    original = records[2]
    name = original.segment[: -len("000002")] + "000099"
    shutil.copytree(
        whole / "stream" / "segments" / original.segment, _segment(whole, 0).parent / name
    )
    again = replace(original, seq=len(records), segment=name)
    assert put_if_absent(run.fs, log_path(run.child("stream"), again.seq), again.to_json())
    (problem,) = _problems(whole)
    assert problem == (
        f"segments {original.segment} (log 2), {name} (log {again.seq}) hold the same bytes "
        "(every object's size and CRC32): the same groups were committed twice"
    )


def test_a_corrupted_or_missing_segment_object_is_found(whole):
    _flip_byte(_segment(whole, 12) / "response_tokens" / "c" / "0")
    (_segment(whole, 11) / "rewards" / "c" / "0").unlink()
    problems = _problems(whole)
    assert len(problems) == 2
    corrupt, missing = sorted(problems, key=lambda p: "(log 12)" in p, reverse=True)
    assert "(log 12) fails its checks: object 'response_tokens/c/0' fails its size/CRC32" in corrupt
    assert "no quarantine note explains it" in corrupt
    assert "(log 11) fails its checks: object 'rewards/c/0' has been missing" in missing
    assert f"its {SEGMENT_GROUPS} groups are lost to every reader" in missing


def test_a_segment_the_learner_quarantined_is_reported_not_a_failure(tmp_path):
    run, config = new_run(tmp_path / "run")
    write_stream(run, GROUPS)
    _flip_byte(_segment(tmp_path / "run", 1) / "rewards" / "c" / "0")
    totals = train(run, config, STEPS).totals
    audit = audit_run(run)
    assert audit.problems == ()
    assert (audit.segments_quarantined, audit.groups_quarantined) == (1, SEGMENT_GROUPS)
    # The checkpoint's cursor is past the quarantined segment: its groups are not counted.
    assert audit.groups_consumed == totals.consumed
    assert audit.groups_unconsumed == GROUPS - SEGMENT_GROUPS - totals.consumed
    (note,) = audit.notes
    assert "(log 1) was quarantined by a reader (object 'rewards/c/0' fails its size" in note


def test_a_missing_metrics_step_is_found(whole):
    jsonl = whole / "metrics" / "learner.jsonl"
    lines = jsonl.read_text().splitlines(keepends=True)
    jsonl.write_text("".join(line for line in lines if json.loads(line)["step"] != 2))
    assert _problems(whole) == [
        "no learner metrics record of step(s) 2 of 1..4: what those steps did is lost"
    ]


def test_metrics_of_two_trainings_mixed_are_found(whole):
    """A record of step 4 whose totals do not follow step 3 (another learner wrote it)."""
    jsonl = whole / "metrics" / "learner.jsonl"
    last = json.loads(jsonl.read_text().splitlines()[-1])
    other = {**last, "stream/consumed_total": last["stream/consumed_total"] + 1}
    other["stream/dropped_stale_total"] += 1
    with jsonl.open("a") as f:
        f.write(json.dumps(other) + "\n")
    problems = _problems(whole)
    assert len(problems) == 2
    assert problems[0].startswith("the checkpoint of step 4 and the learner metrics of that step")
    step3 = json.loads(jsonl.read_text().splitlines()[-3])
    consumed = [round(r[k]) for r, k in ((other, "stream/consumed_total"),
                (step3, "stream/consumed_total"), (other, "stream/consumed"))]  # fmt: skip
    stale = [round(r[k]) for r, k in ((other, "stream/dropped_stale_total"),
             (step3, "stream/dropped_stale_total"), (other, "stream/dropped_stale"))]  # fmt: skip
    assert problems[1] == (
        "learner metrics of step 4 do not follow step 3: stream/consumed_total {} ≠ {} + {}, "
        "stream/dropped_stale_total {} ≠ {} + {} (the total before + this step's count): records "
        "of different trainings are mixed, or two learners wrote this run"
    ).format(*consumed, *stale)


def test_a_checkpoint_whose_cursor_disagrees_with_its_counts_is_found(whole):
    run = open_location(str(whole))
    state = CheckpointStore(run).read_state(STEPS)
    cursor = Cursor.from_dict(state.stream_cursor)
    skipped_one = Cursor(cursor.seq, cursor.offset + 1)  # one group more than counted
    CheckpointStore(run).save(
        {"policy": ModelState(nn.Linear(2, 2))},
        LearnerState(STEPS + 1, state.policy_version, skipped_one.to_dict(), extra=state.extra),
    )
    problems = _problems(whole)
    consumed = state.extra["filter_totals"]["consumed"]
    assert (
        f"the checkpoint of step 5 counts {consumed} groups consumed, but its stream cursor "
        f"{skipped_one.seq}:{skipped_one.offset} stands after {consumed + 1} readable groups: "
        "groups were lost or read twice"
    ) in problems
    assert (
        "no learner metrics record of step(s) 5 of 1..5 (the checkpoint is at step 5)"
        in (problems[-1])
    )


def test_a_damaged_checkpoint_is_found_and_the_one_a_resume_uses_is_audited(whole):
    (shard,) = (whole / "checkpoints" / "step-00000004").glob("*.distcp")
    _flip_byte(shard)
    audit = audit_run(open_location(str(whole)))
    assert audit.problems == (
        "checkpoint step 4 is damaged (a file fails its size or xxh3 check against COMMITTED; "
        "the error is logged above): a resume passes over it and starts from step 2",
    )
    assert (audit.checkpoint_step, audit.last_step) == (2, STEPS)


def test_an_altered_weight_file_fails_its_version_and_those_built_on_it(whole):
    (piece,) = (whole / "weights" / "v00000002").glob("*.safetensors")
    _flip_byte(piece)
    audit = audit_run(open_location(str(whole)))
    assert audit.weight_versions == (1,)
    assert [p.split(":")[0] for p in audit.problems] == [
        "weight version 2 does not verify",
        "weight version 3 does not verify",
        "weight version 4 does not verify",
    ]
    assert f"file {piece.name} is corrupt" in audit.problems[0]


def test_latest_naming_a_version_without_manifest_is_found(whole):
    (whole / "weights" / "v00000004" / "manifest.json").unlink()
    assert _problems(whole) == [
        "weights/LATEST names version 4, which has no manifest: generators following LATEST "
        "cannot load it",
        "the checkpoint of step 4 records policy version 4, but the newest committed weight "
        "version is 3",
    ]


def test_a_dead_writers_open_segment_is_counted_not_a_failure(whole):
    run = open_location(str(whole))
    uploaded = StreamWriter(run, "gen1").upload([group(100, 9, [1.0, 0.0, 1.0, 0.0])])
    folder = whole / "stream" / "segments" / uploaded.record.segment
    old = time.time() - 3600  # its writer died an hour ago
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (old, old))
    audit = audit_run(run)
    assert audit.whole
    assert audit.segments_lost_uncommitted == 1
    assert uploaded.record.segment in audit.notes[0]


def test_a_resumed_learners_metrics_count_once(tmp_path):
    """Life 1 logs steps 1-5 and dies (checkpoint at 3); life 2 resumes at 3 and dies after
    step 4: step 4 is rewritten, step 5 abandoned — expected, reported, whole."""
    run, config = new_run(tmp_path / "run")
    write_stream(run, GROUPS)
    train(run, config, 5, checkpoint_every=3, crash=True)
    train(run, config, 4, checkpoint_every=3, crash=True)
    audit = audit_run(run)
    assert audit.problems == ()
    assert (audit.last_step, audit.checkpoint_step, audit.metrics_records) == (4, 3, 4)
    assert (audit.metrics_rewritten, audit.metrics_abandoned) == (1, (5,))
    assert audit.consumed_source == "learner metrics, step 4"
    assert any("metrics records of step(s) 5 belong to training a resume discarded" in n
               for n in audit.notes)  # fmt: skip
