"""Prompt datasets: JSONL / Parquet reading, field mapping, dropping, sharding, bundled sets."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
import sympy
from math_verify import parse, verify

from streamrl.data import (
    DatasetError,
    PromptPosition,
    PromptSource,
    builtin_rows,
    load_rows,
)
from streamrl.data.builtin import HELD_OUT_FACTS, MATH_PROBLEMS
from streamrl.data.config import DataConfig
from streamrl.models.tiny import build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer (ChatML template), saved on its own."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as file:
        file.write("\n".join(json.dumps(row) for row in rows) + "\n\n")
    return str(path)


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _verl_rows(count: int) -> list[dict[str, Any]]:
    """The DAPO-Math-17k / verl Parquet layout."""
    return [
        {
            "data_source": "math_dapo",
            "prompt": [
                {"role": "system", "content": "Think."},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in range(count)
    ]


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
def test_verl_layout_reads_with_default_mapping(
    fmt: str, tmp_path: Path, tokenizer_dir: Path, tokenizer: Any
) -> None:
    rows = _verl_rows(5)
    file = tmp_path / f"train.{fmt}"
    path = _write_parquet(file, rows) if fmt == "parquet" else _write_jsonl(file, rows)
    source = PromptSource(DataConfig(path=path), tokenizer_path=str(tokenizer_dir))
    assert source.num_rows == len(source) == 5
    assert source.num_dropped_too_long == 0
    for i, prompt in enumerate(source.prompts):
        assert prompt.prompt_id == f"train:{i}"
        assert prompt.ground_truth == str(2 * i)
        assert prompt.text == _chat(tokenizer, rows[i]["prompt"])
        assert prompt.token_ids == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


def test_a_prompt_carries_the_rows_other_fields_for_its_environment(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """`Prompt.row` (an environment's `Task.row`): every field but the prompt's and the
    answer's, which the prompt holds already."""
    rows = [{**row, "openenv_reset": {"seed": i}} for i, row in enumerate(_verl_rows(2))]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    source = PromptSource(DataConfig(path=path), tokenizer_path=str(tokenizer_dir))
    for i, prompt in enumerate(source.prompts):
        assert prompt.row == {
            "data_source": "math_dapo",
            "ability": "MATH",
            "extra_info": {"index": f"id-{i}"},
            "openenv_reset": {"seed": i},
        }


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_several_answer_fields_give_the_reward_an_object_of_them(
    tmp_path: Path, tokenizer: Any, fmt: str
) -> None:
    """LiveCodeBench keeps public and private tests in two columns and the function's name in
    a third: a list of answer fields joins them, by path, into one JSON ground truth."""
    rows = [{"question": "Write f.", "public_test_cases": "[1]", "private_test_cases": "[2]",
             "metadata": {"func_name": "f"}}]  # fmt: skip
    file = tmp_path / f"lcb.{fmt}"
    path = _write_parquet(file, rows) if fmt == "parquet" else _write_jsonl(file, rows)
    fields = ["public_test_cases", "private_test_cases", "metadata.func_name"]
    config = DataConfig(path=path, prompt_field="question", answer_field=fields)
    source = PromptSource(config, tokenizer=tokenizer)
    assert json.loads(source.prompts[0].ground_truth) == {
        "public_test_cases": "[1]", "private_test_cases": "[2]", "metadata.func_name": "f"
    }  # fmt: skip
    with pytest.raises(DatasetError, match=r"'hidden'.*data.answer_field"):
        PromptSource(config.model_copy(update={"answer_field": ["public_test_cases", "hidden"]}),
                     tokenizer=tokenizer)  # fmt: skip


def test_field_mapping_system_prompt_and_plain_text(tmp_path: Path, tokenizer: Any) -> None:
    rows = [
        {"question": "Add 2 and 3.", "meta": {"answers": [5, "five"]}},
        {"question": "Add 4 and 4.", "meta": {"answers": [8]}},
    ]
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    mapping = {"path": path, "prompt_field": "question", "answer_field": "meta.answers.0"}
    chat = PromptSource(DataConfig(**mapping, system_prompt="Be exact."), tokenizer=tokenizer)
    assert [p.ground_truth for p in chat.prompts] == ["5", "8"]  # non-strings as JSON
    assert chat.prompts[0].text == _chat(
        tokenizer,
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Add 2 and 3."}],
    )
    plain = PromptSource(
        DataConfig(**mapping, system_prompt="Be exact.", apply_chat_template=False),
        tokenizer=tokenizer,
    )
    assert plain.prompts[1].text == "Be exact.\n\nAdd 4 and 4."
    assert plain.prompts[1].token_ids == tokenizer(plain.prompts[1].text)["input_ids"]

    # a configured system prompt replaces the one a verl row brings
    verl = _write_jsonl(tmp_path / "verl.jsonl", _verl_rows(1))
    source = PromptSource(DataConfig(path=verl, system_prompt="Be exact."), tokenizer=tokenizer)
    assert source.prompts[0].text.count("<|im_start|>system") == 1
    assert "Be exact." in source.prompts[0].text
    assert "Think." not in source.prompts[0].text


def test_prompts_longer_than_max_prompt_len_are_dropped_and_counted(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [{"prompt": "apples " * n, "answer": str(n)} for n in range(1, 41)]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    limit = 30
    lengths = [
        len(tokenizer(_chat(tokenizer, [{"role": "user", "content": row["prompt"]}]))["input_ids"])
        for row in rows
    ]
    expected_dropped = sum(length > limit for length in lengths)
    assert 0 < expected_dropped < len(rows)
    config = DataConfig(path=path, answer_field="answer", max_prompt_len=limit)
    source = PromptSource(config, tokenizer=tokenizer)
    assert source.num_dropped_too_long == expected_dropped
    assert len(source) == len(rows) - expected_dropped
    assert all(len(p.token_ids) <= limit for p in source.prompts)
    kept = {f"long:{i}" for i, length in enumerate(lengths) if length <= limit}
    assert {p.prompt_id for p in source.prompts} == kept

    with pytest.raises(DatasetError, match=r"raise data\.max_prompt_len"):
        PromptSource(
            DataConfig(path=path, answer_field="answer", max_prompt_len=5), tokenizer=tokenizer
        )


def test_the_fingerprint_names_the_kept_prompts_and_changes_with_any_of_them(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [{"prompt": "apples " * n, "answer": str(n)} for n in range(1, 41)]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)

    def fingerprint(rows: list[dict[str, Any]], **options: Any) -> str:
        _write_jsonl(tmp_path / "long.jsonl", rows)
        config = DataConfig(path=path, answer_field="answer", **options)
        return PromptSource(config, tokenizer=tokenizer).fingerprint

    first = fingerprint(rows)
    assert first.startswith("40 prompts, sha256:")
    assert fingerprint(rows) == first  # a restart on the same file
    assert fingerprint([*rows[:-1], {**rows[-1], "answer": "41"}]) != first  # an answer
    assert fingerprint([*rows[:-1], {**rows[-1], "prompt": "pears"}]) != first  # a prompt
    assert not fingerprint(rows, max_prompt_len=30).startswith("40 prompts")  # fewer kept


def _take(iterator: Any, count: int) -> list[str]:
    return [next(iterator).prompt_id for _ in range(count)]


def test_shards_are_disjoint_cover_each_epoch_and_reshuffle(tokenizer: Any) -> None:
    config = DataConfig(path="builtin:math", shuffle_seed=7)
    source = PromptSource(config, tokenizer=tokenizer)
    n, shards = len(source), 3
    every = {p.prompt_id for p in source.prompts}
    iterators = [source.iterate(shard, shards) for shard in range(shards)]
    sizes = [len(range(shard, n, shards)) for shard in range(shards)]
    epochs = []
    for epoch in range(3):
        taken = [_take(it, size) for it, size in zip(iterators, sizes, strict=True)]
        flat = [pid for part in taken for pid in part]
        assert len(flat) == len(set(flat)) == n
        assert set(flat) == every
        assert all(it.position == PromptPosition(epoch + 1, 0) for it in iterators)
        epochs.append(taken)
    assert epochs[0] != epochs[1] != epochs[2]  # a fresh order every epoch

    # the same order after a restart; another seed gives another
    restarted = PromptSource(config, tokenizer=tokenizer).iterate(1, shards)
    assert _take(restarted, 2 * sizes[1]) == epochs[0][1] + epochs[1][1]
    reseeded = PromptSource(DataConfig(path="builtin:math", shuffle_seed=8), tokenizer=tokenizer)
    assert _take(reseeded.iterate(1, shards), sizes[1]) != epochs[0][1]


def test_iteration_resumes_from_a_position(tokenizer: Any) -> None:
    source = PromptSource(DataConfig(path="builtin:math"), tokenizer=tokenizer)
    shard_size = len(range(1, len(source), 2))
    iterator = source.iterate(1, 2)
    _take(iterator, shard_size - 3)
    position = iterator.position
    assert position == PromptPosition(0, shard_size - 3)
    ahead = _take(iterator, 10)  # crosses into epoch 1
    assert iterator.position == PromptPosition(1, 7)
    assert _take(source.iterate(1, 2, start=position), 10) == ahead
    assert _take(source.iterate(1, 2, start=PromptPosition(1, 7)), 5) == _take(iterator, 5)
    with pytest.raises(ValueError, match="past the"):
        source.iterate(1, 2, start=PromptPosition(0, shard_size + 1))


def test_iteration_passes_over_skipped_positions(tokenizer: Any) -> None:
    source = PromptSource(DataConfig(path="builtin:math"), tokenizer=tokenizer)
    shard_size = len(range(1, len(source), 2))
    walk = source.iterate(1, 2, start=PromptPosition(0, shard_size - 4))
    positions, ids = [], []
    for _ in range(8):  # crosses into epoch 1
        positions.append(walk.position)
        ids.append(next(walk).prompt_id)
    skip = {positions[0], positions[2], positions[3], positions[4]}  # (1, 0) is positions[4]
    resumed = source.iterate(1, 2, start=positions[0], skip=skip)
    assert resumed.position == positions[1]
    kept = []
    for _ in range(4):
        kept.append((resumed.position, next(resumed).prompt_id))
    expected = [(p, i) for p, i in zip(positions, ids, strict=True) if p not in skip]
    assert kept == expected
    assert resumed.position == walk.position


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic-test"])
def test_builtin_arithmetic_answers_are_right(tokenizer: Any, name: str) -> None:
    rows = builtin_rows(name)
    assert rows == builtin_rows(name)  # deterministic
    assert len(rows) >= 250
    kinds = {("word", "+"): 0, ("word", "*"): 0, ("direct", "+"): 0, ("direct", "*"): 0}
    for row in rows:
        question = row["prompt"][0]["content"].split("\n")[0]
        match = re.search(r"(\d+) ([+*×]) (\d+)\?$", question)
        assert match, question
        a, b = int(match[1]), int(match[3])
        assert 2 <= a <= 9
        assert 2 <= b <= 9
        multiply = match[2] in "*×"
        assert row["reward_model"]["ground_truth"] == str(a * b if multiply else a + b)
        story = question[: match.start()]
        if story.startswith("What is"):
            kinds["direct", "*" if multiply else "+"] += 1
        else:
            assert [int(n) for n in re.findall(r"\d+", story)] == [a, b]
            assert ("each" in story) == multiply
            kinds["word", "*" if multiply else "+"] += 1
        assert "\\boxed{}" in row["prompt"][0]["content"]
    assert min(kinds.values()) > 0.2 * len(rows)
    # every prompt fits the tiny-cpu preset's data.max_prompt_len with the tiny tokenizer
    source = PromptSource(
        DataConfig(path=f"builtin:{name}", max_prompt_len=96), tokenizer=tokenizer
    )
    assert source.num_dropped_too_long == 0


def _facts(rows: list[dict[str, Any]]) -> set[tuple[str, int, int]]:
    """(op, min, max) of each row, read from its question text (not from extra_info)."""
    facts = set()
    for row in rows:
        match = re.search(r"(\d+) ([+*×]) (\d+)\?\n", row["prompt"][0]["content"])
        assert match, row
        a, b = int(match[1]), int(match[3])
        facts.add(("+" if match[2] == "+" else "*", min(a, b), max(a, b)))
    return facts


def test_builtin_arithmetic_test_split_is_held_out_by_fact(tokenizer: Any) -> None:
    """No training prompt asks a fact of the held-out split, in either order or wording, and
    together the splits cover every single-digit fact."""
    train = PromptSource(DataConfig(path="builtin:arithmetic"), tokenizer=tokenizer)
    train_facts = _facts([{"prompt": [{"content": p.text}]} for p in train.prompts])
    test_facts = _facts(builtin_rows("arithmetic-test"))
    assert train_facts.isdisjoint(test_facts)
    every = {(op, a, b) for op in "+*" for a in range(2, 10) for b in range(a, 10)}
    assert train_facts | test_facts == every
    assert test_facts == set(HELD_OUT_FACTS)
    assert len(test_facts) == 18  # a quarter of the 72 facts: 9 per op
    assert len(train.prompts) == len(builtin_rows("arithmetic")) > 1400


x = sympy.Symbol("x")
# Each MATH_PROBLEMS answer, computed independently (same order).
MATH_EXPECTED = [
    sympy.Rational(1, 2) + sympy.Rational(1, 3),
    7 * 8 - 6,
    sympy.Rational(15, 100) * 80,
    sympy.solve(3 * x + 5 - 20, x)[0],
    sympy.ilcm(4, 6),
    sympy.igcd(18, 24),
    sympy.Rational(12, 18),
    7 * 4,
    2**10,
    sympy.sqrt(144),
    sympy.Rational(3, 4) * sympy.Rational(8, 9),
    sum(range(1, 11)),
    sympy.solve(x / 4 - 7, x)[0],
    20 * (1 - sympy.Rational(25, 100)),
    4 * 9,
    (-3) ** 3,
    sympy.Rational(5, 6) - sympy.Rational(1, 4),
    sympy.Rational(3, 2) * 4,
    2 * 3**2 - 3,
    sympy.Rational(4 + 8 + 15 + 16 + 23, 5),
    sympy.Rational(7, 2) * 60,
    sympy.sqrt(50),
    100 % 7,
    min(sympy.solve(x**2 - 49, x)),
    sympy.prod(sympy.solve(x**2 - 5 * x + 6, x)),
    180 - 50 - 60,
    sympy.Rational(2, 5),
    sympy.factorial(3) + sympy.factorial(4),
    sympy.Rational(8 - 2, 3 - 1),
    sympy.expand((x + 2) * (x + 3)),
    sympy.expand(2 * (x + 4) - 3 * x),
    sympy.pi * 3**2,
    sympy.Rational(7, 8) * 64,
    len(list(sympy.primerange(1, 20))),
    10 - sympy.Rational(4, 2) + 3,
    sympy.solve(2 * (x - 3) - (x + 4), x)[0],
    sympy.log(32, 2),
    sympy.Rational(75, 100),
    sympy.Rational(1, 3) * sympy.Rational(3, 7),
    sympy.Rational(2, 3) / sympy.Rational(4, 9),
]


def test_builtin_math_answers_are_right(tokenizer: Any) -> None:
    assert len(MATH_PROBLEMS) == len(MATH_EXPECTED) >= 30
    for (question, answer), expected in zip(MATH_PROBLEMS, MATH_EXPECTED, strict=True):
        gold = parse(f"${answer}$")
        assert gold, f"math-verify cannot parse the answer of {question!r}"
        assert verify(gold, parse(f"${sympy.latex(sympy.nsimplify(expected))}$")), question
        assert not verify(gold, parse(f"${sympy.latex(expected + 1)}$")), question
    source = PromptSource(DataConfig(path="builtin:math"), tokenizer=tokenizer)
    assert [p.ground_truth for p in source.prompts] == [a for _, a in MATH_PROBLEMS]


def test_bad_input_names_the_fix(tmp_path: Path, tokenizer: Any) -> None:
    def source(**fields: Any) -> PromptSource:
        return PromptSource(DataConfig(**fields), tokenizer=tokenizer)

    with pytest.raises(DatasetError, match=r"does not exist; set data.path"):
        source(path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"'\.csv'.*set data.format=jsonl"):
        source(path=str(tmp_path / "data.csv"))
    with pytest.raises(
        DatasetError, match=r"unknown bundled dataset 'builtin:algebra'.*builtin:math"
    ):
        load_rows("builtin:algebra")

    rows = [*_verl_rows(2), {"question": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DatasetError) as missing:
        source(path=path)
    message = str(missing.value)
    assert "row 2 (0-based)" in message
    assert "'prompt'" in message
    assert "question, reward_model" in message
    assert "data.prompt_field=" in message

    path = _write_jsonl(tmp_path / "nested.jsonl", _verl_rows(1))
    with pytest.raises(DatasetError, match=r"keys of 'reward_model' are: ground_truth, style"):
        source(path=path, answer_field="reward_model.answer")

    path = _write_jsonl(
        tmp_path / "number.jsonl", [{"prompt": 3, "reward_model": {"ground_truth": "3"}}]
    )
    with pytest.raises(DatasetError, match="must be a string or a list"):
        source(path=path)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match="line 2 is not valid JSON"):
        source(path=str(tmp_path / "broken.jsonl"))
    with pytest.raises(DatasetError, match="use fewer generators"):
        source(path="builtin:math").iterate(0, 41)
