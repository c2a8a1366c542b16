"""Preference pairs from the layouts people have (`streamrl.data.preference`): TRL's standard
and conversational layouts, UltraFeedback-binarized, HH-RLHF (text and messages), JSONL and
Parquet; malformed rows refused naming the row and the field; and the bundled pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from streamrl.data.preference import PairFields, load_pairs, pair_messages
from streamrl.data.rows import DatasetError, load_rows
from streamrl.envs.chat import ChatRenderer
from streamrl.models import resolve_model_path

FIELDS = PairFields()
USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def chat() -> ChatRenderer:
    path = resolve_model_path("tiny-qwen2")
    return ChatRenderer(AutoTokenizer.from_pretrained(path), "tiny-qwen2")


def _pair(row, fields=FIELDS):
    return pair_messages(row, fields, "row 0 of t.jsonl")


def test_every_layout_gives_the_same_pair():
    expected = (USER, "5", "6")
    assert _pair({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}) == expected
    conversational = {
        "prompt": USER,
        "chosen": [{"role": "assistant", "content": "5"}],
        "rejected": [{"role": "assistant", "content": "6"}],
    }
    assert _pair(conversational) == expected
    ultrafeedback = {  # chosen / rejected hold the whole conversation
        "prompt": "What is 2 + 3?",
        "chosen": [*USER, {"role": "assistant", "content": "5"}],
        "rejected": [*USER, {"role": "assistant", "content": "6"}],
    }
    assert _pair(ultrafeedback) == expected
    no_prompt = PairFields(prompt=None)
    hh_text = {
        "chosen": "\n\nHuman: What is 2 + 3?\n\nAssistant: 5",
        "rejected": "\n\nHuman: What is 2 + 3?\n\nAssistant: 6",
    }
    assert _pair(hh_text, no_prompt) == expected
    hh_messages = {"chosen": ultrafeedback["chosen"], "rejected": ultrafeedback["rejected"]}
    assert _pair(hh_messages, no_prompt) == expected


def test_a_multi_turn_prompt_keeps_its_earlier_turns():
    history = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: What is 2 + 3?\n\nAssistant: "
    prompt, chosen, rejected = _pair(
        {"chosen": history + "5", "rejected": history + "six"}, PairFields(prompt=None)
    )
    assert [m["role"] for m in prompt] == ["user", "assistant", "user"]
    assert (chosen, rejected) == ("5", "six")


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "q", "rejected": "b"}, "has no 'chosen' (preference.chosen_field)"),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' must be a string or"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "are the same answer"),
        ({"prompt": "q", "chosen": " ", "rejected": "b"}, "one non-empty assistant answer"),
        (
            {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
             "chosen": "a", "rejected": "b"},
            "must end with a user message",
        ),
        ({"prompt": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"},
         "'prompt'[0] must be a message with a role"),
    ],
)  # fmt: skip
def test_a_malformed_row_is_refused_naming_the_row_and_the_field(row, says):
    with pytest.raises(DatasetError, match=r"row 0 of t\.jsonl") as refused:
        _pair(row)
    assert says in str(refused.value)


def test_hh_text_that_is_not_a_conversation_is_refused():
    with pytest.raises(DatasetError, match="HH-RLHF"):
        _pair({"chosen": "just text", "rejected": "other"}, PairFields(prompt=None))


def test_pairs_are_tokens_as_the_generator_and_the_policy_see_them(chat, tmp_path: Path):
    rows = [
        {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
        {"prompt": "x " * 400, "chosen": "long", "rejected": "longer"},  # past max_tokens
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = load_pairs(str(path), FIELDS, chat, max_tokens=128)
    assert (len(pairs), pairs.dropped) == (1, 1)
    (pair,) = pairs.pairs
    assert pair.pair_id == "pairs:0"
    assert pair.prompt.tolist() == chat.prompt_ids(USER)  # with the generation prompt
    eos = chat.encode(chat.eos_text())
    assert pair.chosen.tolist() == chat.encode("5") + eos
    assert pair.rejected.tolist() == chat.encode("6") + eos
    # Parquet reads the same.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "pairs.parquet")
    again = load_pairs(str(tmp_path / "pairs.parquet"), FIELDS, chat, max_tokens=128)
    assert again.pairs[0].chosen.tolist() == pair.chosen.tolist()


def test_the_bundled_pairs_differ_only_in_a_wrong_result():
    train, test = load_rows("builtin:arithmetic-pairs"), load_rows("builtin:arithmetic-pairs-test")
    assert (len(train), len(test)) == (1526, 256)
    for row in train[:200]:
        truth = row["ground_truth"]
        assert row["chosen"].endswith(f"\\boxed{{{truth}}}.")
        assert not row["rejected"].endswith(f"\\boxed{{{truth}}}.")
        assert row["chosen"].split("=")[0] == row["rejected"].split("=")[0]
    assert load_rows("builtin:arithmetic-pairs")[:5] == train[:5]  # the same every time
