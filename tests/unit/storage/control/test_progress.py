"""Progress records: a generator's prompts (committed ones are never redone, lost ones always
are) and the learner's position after each step."""

from __future__ import annotations

import json
from typing import Any

import pytest

from storage.control.progress import (
    GeneratorProgress,
    read_all_progress,
    read_progress,
    write_progress,
)
from storage.fs import Location, open_location
from storage.stream.learner_progress import (
    LearnerProgress,
    read_learner_progress,
    write_learner_progress,
)
from storage.stream.records import Cursor
from streamrl.data import DatasetError, PromptPosition, PromptSource
from streamrl.data.config import DataConfig
from streamrl.generator.progress import PromptLedger, resume_prompts
from streamrl.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def source() -> PromptSource:
    return PromptSource(DataConfig(path="builtin:math"), tokenizer=build_tokenizer())


def test_progress_record_round_trips_and_is_replaced(run_location: Location):
    assert read_progress(run_location, "gen0") is None
    first = GeneratorProgress("gen0", 1, (0, 2), ((0, 3), (1, 0)), 1.5)
    write_progress(run_location, first)
    assert read_progress(run_location, "gen0") == first
    second = GeneratorProgress("gen0", 2, (1, 1))
    write_progress(run_location, second)
    assert read_progress(run_location, "gen0") == second
    assert read_progress(run_location, "gen1") is None


def test_progress_record_rejects_committed_positions_before_the_next_prompt():
    with pytest.raises(ValueError, match="committed_after"):
        GeneratorProgress("gen0", 1, (0, 5), ((0, 4),))
    with pytest.raises(ValueError, match="committed_after"):
        GeneratorProgress("gen0", 1, (0, 1), ((0, 4), (0, 3)))


def _start(run: Location, source: PromptSource) -> tuple[Any, PromptLedger, GeneratorProgress]:
    prompts, progress = resume_prompts(
        run, "gen0", source, shard=0, num_shards=2, first_start=PromptPosition()
    )
    return prompts, PromptLedger(prompts, run=run, progress=progress), progress


def _take(prompts, ledger: PromptLedger, count: int, first_id: int) -> dict[str, str]:
    """Submit `count` prompts as requests r<first_id>...; request id → prompt id."""
    taken = {}
    for n in range(first_id, first_id + count):
        position = prompts.position
        taken[f"r{n}"] = next(prompts).prompt_id
        ledger.take(f"r{n}", position)
    return taken


def test_a_restart_redoes_exactly_the_uncommitted_prompts(tmp_path, source: PromptSource):
    run = open_location(str(tmp_path / "run"))
    walk = source.iterate(0, 2)
    order = [next(walk).prompt_id for _ in range(12)]
    prompts, ledger, progress = _start(run, source)
    assert progress.starts == 1
    taken = _take(prompts, ledger, 8, 0)
    assert list(taken.values()) == order[:8]
    for request in ("r0", "r1", "r3", "r4", "r6"):  # groups finish out of order
        ledger.collected(request)
    ledger.committed()
    ledger.collected("r2")  # collected, but its segment is never committed: lost
    assert read_progress(run, "gen0").next_prompt == (0, 2)
    assert read_progress(run, "gen0").committed_after == ((0, 3), (0, 4), (0, 6))

    # The process dies here. The next start redoes r2, r5, r7, then goes on from position 8.
    prompts, ledger, progress = _start(run, source)
    assert progress.starts == 2
    taken = _take(prompts, ledger, 5, 100)
    assert list(taken.values()) == [order[2], order[5], order[7], order[8], order[9]]
    for request in ("r101", "r100", "r103"):
        ledger.collected(request)
    ledger.committed()
    assert read_progress(run, "gen0").next_prompt == (0, 7)
    assert read_progress(run, "gen0").committed_after == ((0, 8),)

    prompts, _, progress = _start(run, source)
    assert progress.starts == 3
    assert [next(prompts).prompt_id for _ in range(3)] == [order[7], order[9], order[10]]


def test_with_nothing_in_flight_the_next_prompt_is_the_iterators(tmp_path, source):
    run = open_location(str(tmp_path / "run"))
    prompts, ledger, _ = _start(run, source)
    _take(prompts, ledger, 3, 0)
    for request in ("r2", "r0", "r1"):
        ledger.collected(request)
    ledger.committed()
    assert read_progress(run, "gen0").next_prompt == (0, 3)
    assert read_progress(run, "gen0").committed_after == ()


def test_learner_progress_record_round_trips_and_is_replaced(run_location: Location):
    assert read_learner_progress(run_location) is None
    first = LearnerProgress(1, 1, Cursor(2, 3), 6, 4, 1, 6, 4, 1, 10.5)
    write_learner_progress(run_location, first)
    assert read_learner_progress(run_location) == first
    second = LearnerProgress(2, 2, Cursor(4), 5, 4, 0, 11, 8, 1, 11.0)
    write_learner_progress(run_location, second)
    assert read_learner_progress(run_location) == second
    assert run_location.fs.exists(run_location.join("control", "learner.json"))


@pytest.mark.parametrize(
    "fields",
    [
        {"consumed": 3, "accepted": 3, "dropped_stale": 1},  # more filtered than consumed
        {"consumed": 4, "consumed_total": 3},  # a total below the step's count
        {"step": -1},
        {"pending_accepted": -1},
    ],
)
def test_learner_progress_record_rejects_broken_counts(fields: dict[str, int]):
    with pytest.raises(ValueError, match="learner progress"):
        LearnerProgress(**{"step": 1, "policy_version": 1, **fields})


def test_paused_and_cpu_seconds_add_up_over_a_generators_lives(tmp_path, source):
    run = open_location(str(tmp_path / "run"))
    prompts, ledger, _ = _start(run, source)
    _take(prompts, ledger, 1, 0)
    ledger.collected("r0")
    ledger.committed(paused_s=2.5, cpu_s=40.0)
    assert (read_progress(run, "gen0").paused_s, read_progress(run, "gen0").cpu_s) == (2.5, 40.0)
    prompts, ledger, _ = _start(run, source)  # a restart: its pauses and CPU count on top
    _take(prompts, ledger, 1, 10)
    ledger.collected("r10")
    ledger.committed(paused_s=1.0, cpu_s=5.0)
    assert (read_progress(run, "gen0").paused_s, read_progress(run, "gen0").cpu_s) == (3.5, 45.0)
    assert [p.paused_s for p in read_all_progress(run)] == [3.5]


def _jsonl_source(path, answers: list[str]) -> PromptSource:
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": a}) + "\n"
                            for i, a in enumerate(answers)))  # fmt: skip
    config = DataConfig(path=str(path), answer_field="answer")
    return PromptSource(config, tokenizer=build_tokenizer())


def test_a_restart_refuses_a_dataset_whose_prompts_changed_and_writes_nothing(tmp_path):
    run, data = open_location(str(tmp_path / "run")), tmp_path / "data.jsonl"
    prompts, ledger, _ = _start(run, _jsonl_source(data, ["1", "2", "3", "4"]))
    _take(prompts, ledger, 2, 0)
    ledger.collected("r0")
    ledger.committed()
    before = read_progress(run, "gen0")
    assert before.dataset.startswith("4 prompts, sha256:")

    changed = _jsonl_source(data, ["1", "2", "30", "4"])  # one answer edited in place
    with pytest.raises(DatasetError, match=r"gen0 .* as 4 prompts, sha256:.*; they are now 4 "
                                           r"prompts, sha256:.*start a new run"):  # fmt: skip
        _start(run, changed)
    assert read_progress(run, "gen0") == before  # not counted as a start, position kept

    prompts, _, progress = _start(run, _jsonl_source(data, ["1", "2", "3", "4"]))  # restored
    assert progress.starts == 2
    assert prompts.position == PromptPosition(0, 1)


def test_a_record_from_before_fingerprints_takes_the_datasets_on_its_next_start(tmp_path, source):
    run = open_location(str(tmp_path / "run"))
    write_progress(run, GeneratorProgress("gen0", starts=3, next_prompt=(0, 5)))
    prompts, _, progress = _start(run, source)
    assert progress.dataset == source.fingerprint == read_progress(run, "gen0").dataset
    assert progress.starts == 4
    assert prompts.position == PromptPosition(0, 5)
