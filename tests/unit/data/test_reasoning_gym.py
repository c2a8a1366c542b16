"""reasoning-gym tasks as a prompt dataset (`data.path: reasoning_gym:<task>,...`): the training
split shared by weight, the held-out split that never repeats a training question, rows that
interleave the tasks, refused settings, `PromptSource` over the rows (ids, task, level,
fingerprint), the `data.source` alias, and the task of a file's rows (`data.task_field`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from storage.stream.scored_group import TASK_NAME
from streamrl.data import DatasetError, PromptSource
from streamrl.data.config import DataConfig
from streamrl.data.datasets import task_name
from streamrl.data.reasoning_gym import (
    GymAnswer,
    ReasoningGymConfig,
    reasoning_gym_rows,
    system_prompt,
)
from streamrl.models.tiny import build_tokenizer

pytest.importorskip("reasoning_gym")

TWO = "reasoning_gym:leg_counting,basic_arithmetic"
TINY_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
"""Single-digit sums of two terms: a few hundred questions, so two seeds' draws collide."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _config(**settings: Any) -> ReasoningGymConfig:
    return ReasoningGymConfig.model_validate(settings)


def _tasks(rows: list[dict[str, Any]]) -> list[str]:
    return [row["data_source"] for row in rows]


def _questions(rows: list[dict[str, Any]]) -> list[str]:
    return [row["prompt"][-1]["content"] for row in rows]


# --- splits -----------------------------------------------------------------------------------


def test_the_training_prompts_are_shared_by_weight_by_largest_remainders():
    # 7 left after one each: 7·1/3.001 = 2.33, 7·2/3.001 = 4.67, 0.002; floors 2, 4, 0 and the
    # one left goes to the largest remainder (chain_sum's 0.67), not in path order
    path = "reasoning_gym:leg_counting,chain_sum,basic_arithmetic"
    weights = {"leg_counting": 1.0, "chain_sum": 2.0, "basic_arithmetic": 0.001}
    config = _config(size=10, tasks={t: {"weight": w} for t, w in weights.items()})
    counts = Counter(_tasks(reasoning_gym_rows(path, config)))
    assert counts == {"leg_counting": 3, "chain_sum": 6, "basic_arithmetic": 1}
    # every task gets one even when its weight rounds to nothing
    counts = Counter(_tasks(reasoning_gym_rows(path, config.model_copy(update={"size": 3}))))
    assert counts == {"leg_counting": 1, "chain_sum": 1, "basic_arithmetic": 1}
    with pytest.raises(DatasetError, match=r"size \(2\) is smaller than the number of tasks \(3\)"):
        reasoning_gym_rows(path, config.model_copy(update={"size": 2}))


def test_the_held_out_split_leaves_out_every_training_question():
    path = "reasoning_gym:basic_arithmetic"
    train_config = _config(size=300, eval_size=300, tasks={"basic_arithmetic": {
        "config": TINY_ARITHMETIC}})  # fmt: skip
    train = reasoning_gym_rows(path, train_config)
    held_out = reasoning_gym_rows(path, train_config.model_copy(update={"split": "eval"}))
    assert len(train) == 300
    assert 0 < len(held_out) < 300  # the tiny space repeats training questions: left out
    assert not set(_questions(held_out)) & set(_questions(train))
    train_seed = GymAnswer.from_json(train[0]["reward_model"]["ground_truth"]).seed
    truths = [GymAnswer.from_json(r["reward_model"]["ground_truth"]) for r in held_out]
    assert {t.seed for t in truths} != {train_seed}
    assert len({t.index for t in truths}) == len(held_out)
    assert max(t.index for t in truths) > len(held_out) - 1  # indices of the kept entries
    assert all(t.size == 300 and t.config["max_digits"] == 1 for t in truths)
    # a training split that covers the whole space leaves no held-out prompt: refused
    sums = {**TINY_ARITHMETIC, "operators": ["+"], "allow_negation": False,
            "allow_parentheses": False}  # fmt: skip
    covered = _config(size=2000, eval_size=20, tasks={"basic_arithmetic": {"config": sums}})
    covered = covered.model_copy(update={"split": "eval"})
    with pytest.raises(DatasetError, match=r"no held-out prompt.*lower data\.reasoning_gym\.size"):
        reasoning_gym_rows(path, covered)


def test_rows_interleave_the_tasks_so_the_first_held_out_prompts_cover_every_task():
    config = _config(size=6, eval_size=3, tasks={"leg_counting": {"weight": 3.0}})
    rows = reasoning_gym_rows(TWO, config)
    assert _tasks(rows) == ["leg_counting", "basic_arithmetic"] * 2 + ["leg_counting"] * 2
    held_out = reasoning_gym_rows(TWO, config.model_copy(update={"split": "eval"}))
    assert set(_tasks(held_out[:2])) == {"leg_counting", "basic_arithmetic"}
    assert Counter(_tasks(held_out)) == {"leg_counting": 3, "basic_arithmetic": 3}


def test_a_row_is_the_verl_layout_with_a_ground_truth_naming_its_entry():
    (row,) = list(reasoning_gym_rows("reasoning_gym:leg_counting", _config(size=2)))[:1]
    assert row["prompt"][0] == {"role": "system", "content": system_prompt("default")}
    assert "<answer>" in row["prompt"][0]["content"]
    assert row["data_source"] == "leg_counting"
    assert row["extra_info"] == {"index": 0, "task": "leg_counting", "level": 0}
    truth = GymAnswer.from_json(row["reward_model"]["ground_truth"])
    assert (truth.task, truth.index, truth.size, truth.answer) == ("leg_counting", 0, 2, "tag")
    assert "seed" not in truth.config
    assert "max_animals" in truth.config
    assert truth.expected is not None
    assert truth.expected.isdigit()
    plain = reasoning_gym_rows("reasoning_gym:leg_counting", _config(size=1, system_prompt=None))
    assert [m["role"] for m in plain[0]["prompt"]] == ["user"]
    custom = reasoning_gym_rows("reasoning_gym:leg_counting", _config(size=1, system_prompt="Hi."))
    assert custom[0]["prompt"][0] == {"role": "system", "content": "Hi."}


def test_the_rows_depend_on_the_seed_alone():
    config = _config(size=4)
    assert reasoning_gym_rows(TWO, config) == reasoning_gym_rows(TWO, config)
    other = reasoning_gym_rows(TWO, config.model_copy(update={"seed": 1}))
    assert _questions(other) != _questions(reasoning_gym_rows(TWO, config))


# --- refused settings -------------------------------------------------------------------------


def test_an_unknown_task_is_refused_naming_the_closest():
    with pytest.raises(DatasetError, match=r"no task 'basic_arithmetc' \(did you mean "
                                           r"basic_arithmetic"):  # fmt: skip
        reasoning_gym_rows("reasoning_gym:leg_counting,basic_arithmetc", _config())
    for path in ("reasoning_gym:", "reasoning_gym:leg_counting,", TWO + ",leg_counting"):
        with pytest.raises(DatasetError, match="distinct reasoning-gym tasks separated by commas"):
            reasoning_gym_rows(path, _config())


def test_a_tasks_entry_the_path_does_not_name_is_refused():
    config = _config(tasks={"chain_sum": {"weight": 2.0}})
    refusal = r"tasks sets up chain_sum, which data.path \(reasoning_gym:leg_counting\) does not"
    with pytest.raises(DatasetError, match=refusal):
        reasoning_gym_rows("reasoning_gym:leg_counting", config)


@pytest.mark.parametrize("reserved", ["seed", "size"])
def test_seed_and_size_in_a_tasks_settings_are_refused(reserved: str):
    config = _config(size=2, tasks={"leg_counting": {"config": {reserved: 3}}})
    with pytest.raises(DatasetError, match=rf"tasks.leg_counting.config sets '{reserved}', which "
                                           rf"data.reasoning_gym.{reserved} decides"):  # fmt: skip
        reasoning_gym_rows("reasoning_gym:leg_counting", config)


@pytest.mark.parametrize(
    "settings",
    [{"max_animalz": 4}, {"min_animals": 5, "max_animals": 2}, {"max_animals": "many"}],
    ids=["unknown field", "inverted range", "wrong type"],
)
def test_settings_the_task_refuses_are_refused_naming_the_task(settings: dict[str, Any]):
    config = _config(size=2, tasks={"leg_counting": {"config": settings}})
    refusal = r"refused the settings of task 'leg_counting' \(data.reasoning_gym.tasks.leg_c"
    with pytest.raises(DatasetError, match=refusal):
        reasoning_gym_rows("reasoning_gym:leg_counting", config)


@pytest.mark.parametrize("task", ["word_sorting", "time_intervals"])
def test_a_task_whose_settings_json_does_not_keep_is_refused(task: str):
    """The reward rebuilds the task from the ground truth's JSON settings: a task holding an
    enum or a date there would build its prompts and then fail every reward call."""
    with pytest.raises(DatasetError, match=rf"task '{task}' cannot be used: the reward rebuilds"):
        reasoning_gym_rows(f"reasoning_gym:{task}", _config(size=2))


def test_a_weight_must_be_positive():
    for weight in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="weight"):
            _config(tasks={"leg_counting": {"weight": weight}})


# --- PromptSource and the data section -----------------------------------------------------------


def test_prompt_source_reads_the_tasks_with_their_names_and_level(tokenizer: Any):
    data = DataConfig(path=TWO, reasoning_gym={"size": 4, "eval_size": 2})
    source = PromptSource(data, tokenizer=tokenizer)
    assert source.num_rows == len(source) == 4
    assert source.num_dropped_too_long == 0
    assert [p.prompt_id for p in source.prompts] == [f"reasoning_gym-train:{i}" for i in range(4)]
    assert [p.task for p in source.prompts] == ["leg_counting", "basic_arithmetic"] * 2
    assert [p.task_level for p in source.prompts] == [0] * 4
    assert source.prompts[0].messages[0]["content"] == system_prompt("default")
    assert GymAnswer.from_json(source.prompts[1].ground_truth).task == "basic_arithmetic"
    again = PromptSource(data, tokenizer=tokenizer)
    assert again.fingerprint == source.fingerprint
    reseeded = data.model_copy(update={"reasoning_gym": data.reasoning_gym.model_copy(
        update={"seed": 7})})  # fmt: skip
    assert PromptSource(reseeded, tokenizer=tokenizer).fingerprint != source.fingerprint
    held_out = data.model_copy(update={"reasoning_gym": data.reasoning_gym.model_copy(
        update={"split": "eval"})})  # fmt: skip
    ids = [p.prompt_id for p in PromptSource(held_out, tokenizer=tokenizer).prompts]
    assert ids[0] == "reasoning_gym-eval:0"
    no_tasks = data.model_copy(update={"task_field": None})
    assert {p.task for p in PromptSource(no_tasks, tokenizer=tokenizer).prompts} == {None}


def test_data_source_is_read_as_data_path():
    data = DataConfig.model_validate({"source": TWO, "reasoning_gym": {"size": 2}})
    assert data.path == TWO
    assert data.procedural
    assert "source" not in data.model_dump()
    assert not DataConfig(source="train.jsonl").procedural
    # a preset's path beside the user's source: the source is the dataset
    assert DataConfig.model_validate({"path": "train.jsonl", "source": TWO}).path == TWO


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("leg_counting", "leg_counting"),
        ("openai/gsm8k", "openai_gsm8k"),
        ("lighteval/MATH v2", "lighteval_MATH_v2"),
        ("math-dapo.v1", "math-dapo.v1"),
        ("_private", "t_private"),
        ("é", "t_"),
        ("", "t"),
        ("x" * 100, "x" * 64),
        ("-" * 80, "t" + "-" * 63),
    ],
)
def test_task_names_are_made_metric_safe(value: str, expected: str):
    assert task_name(value) == expected
    assert TASK_NAME.fullmatch(task_name(value))


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _file_rows(sources: list[str | None]) -> list[dict[str, Any]]:
    rows = []
    for i, source in enumerate(sources):
        row = {"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}
        if source is not None:
            row["data_source"] = source
        rows.append(row)
    return rows


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_files_rows_take_their_task_from_data_source_when_they_have_one(
    tmp_path: Path, tokenizer: Any, fmt: str
):
    write = _write_parquet if fmt == "parquet" else _write_jsonl
    with_tasks = write(tmp_path / f"a.{fmt}", _file_rows(["openai/gsm8k", "math", None]))
    source = PromptSource(DataConfig(path=with_tasks, answer_field="answer"), tokenizer=tokenizer)
    # a row without a value (absent in JSONL, null in Parquet) has no task
    assert [p.task for p in source.prompts] == ["openai_gsm8k", "math", None]
    assert [p.task_level for p in source.prompts] == [None] * 3
    without = write(tmp_path / f"b.{fmt}", _file_rows([None, None]))
    source = PromptSource(DataConfig(path=without, answer_field="answer"), tokenizer=tokenizer)
    assert [p.task for p in source.prompts] == [None, None]
    assert [p.ground_truth for p in source.prompts] == ["0", "2"]


def test_a_dotted_task_field_reaches_into_a_parquet_column(tmp_path: Path, tokenizer: Any):
    rows = [{"prompt": "1 + 1?", "answer": "2", "extra_info": {"subject": "algebra"}}]
    path = _write_parquet(tmp_path / "nested.parquet", rows)
    data = DataConfig(path=path, answer_field="answer", task_field="extra_info.subject")
    assert [p.task for p in PromptSource(data, tokenizer=tokenizer).prompts] == ["algebra"]
