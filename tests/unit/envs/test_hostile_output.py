"""Model output that would break an environment: the policy under RL writes anything, and a
degenerate one writes whitespace, brackets or digits by the thousand. Whatever it writes costs
only its own episode: it is read in linear time, answered with an error observation the model
can act on, and bounded in what it costs the step's observation (characters and tokens); an
environment whose state or messages grow out of bounds is refused with a message naming the
fix. (`streamrl.envs.guess`, `formats`, `tools`, `tool_env`, `worker`, `limits`, and
`streamrl.envs.chat`.)"""

from __future__ import annotations

import random
import time
from typing import Any, ClassVar

import pytest
from transformers import AutoTokenizer

from streamrl.envs import TOOL_FORMATS, EnvConfig, EnvContext, EnvRunner, Step, Task, tool
from streamrl.envs.base import Environment
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.formats import MAX_CALL_CHARS
from streamrl.envs.guess import GuessEnv, read_number
from streamrl.envs.limits import MAX_JSON_DEPTH, fair_shares, truncate
from streamrl.envs.tool_env import ToolEnvironment
from streamrl.envs.tools import MAX_TOOL_NAME_CHARS, run_tool_call
from streamrl.envs.worker import MAX_STATE_JSON_CHARS, EnvValueError, checked_step
from streamrl.models import resolve_model_path
from streamrl.rewards import math_reward
from tests.env_fns import echo

HERMES, TAGGED = TOOL_FORMATS["hermes"], TOOL_FORMATS["tagged"]
TASK = Task([{"role": "user", "content": "What is 3 * 4?"}], "12")


def power(base: int, exponent: int) -> int:
    """base ** exponent.

    Args:
        base: The base.
        exponent: The exponent.
    """
    return base**exponent


class Tools(ToolEnvironment):
    tools: ClassVar = (power, echo)


def _context(tool_format: str = "hermes", observation_max_chars: int = 4000) -> EnvContext:
    return EnvContext(
        math_reward, "math", TOOL_FORMATS[tool_format], observation_max_chars=observation_max_chars
    )


# -- guess: reading a number -----------------------------------------------------------------


def test_guess_reads_degenerate_turns_in_linear_time() -> None:
    """A backtracking regex for boxed answers takes cubic time on whitespace (~8 s for 3000
    spaces); each turn below must be read well within a second."""
    turns = {
        "\\boxed{" + " " * 3000: None,
        "\\boxed{" + " " * 200_000 + "12": 12,
        "\\boxed{" * 50_000: None,
        ("\\boxed{ " * 10) * 5_000 + "}": None,
        "1" * 200_000: None,
        "1 " * 100_000: 1,
    }
    for turn, expected in turns.items():
        began = time.perf_counter()
        assert read_number(turn) == expected
        assert time.perf_counter() - began < 1.0, turn[:20]


def test_guess_reads_only_numbers_of_bounded_length() -> None:
    env = GuessEnv(_context("tagged"))
    state = env.reset(TASK).state
    for turn in ["1" * 400 + ".5", "\\boxed{" + "9" * 5000 + "}", "-" + "1" * 65]:
        step = env.step(TASK, state, turn)  # 400 digits would overflow a float
        assert not step.done
        assert step.messages[0]["content"].startswith(
            "I could not find a number (of at most 64 characters) in your answer."
        )
    longest = "9" * 61 + ".5"  # 64 characters: read, compared and shown
    step = env.step(TASK, state, f"\\boxed{{{longest}}}")
    assert step.messages[0]["content"].startswith("1e+61 is too high.")
    assert read_number("12 and then " + "3" * 65) == 12  # a digit run that long is no number


# -- tool calls: parsing never raises --------------------------------------------------------

NESTED = 10_000  # within MAX_CALL_CHARS: the parsers themselves give up
HOSTILE_CALLS = [
    (HERMES, "[" * NESTED, "RecursionError while reading it: write arguments nested at most"),
    (HERMES, '{"name": "echo", "arguments": ' + "[" * NESTED, "RecursionError while reading"),
    (HERMES, '{"name": "echo", "arguments": "' + "[" * NESTED + '"}', "RecursionError"),
    (HERMES, '{"name": "power", "arguments": {"base": ' + "7" * 5000 + "}}", "ValueError"),
    (HERMES, "[" * 100_000, f"the call is 100000 characters long; at most {MAX_CALL_CHARS}"),
    (HERMES, '{"name": "echo", "arguments": {"text": "' + "a" * 20_000 + '"}}', "at most 16384"),
    (
        HERMES,
        '{"name": "echo", "arguments": {"text": ' + "[" * 70 + "]" * 70 + "}}",
        f"the arguments nest more than {MAX_JSON_DEPTH} levels deep",
    ),
    (TAGGED, '{"name": "echo", "arguments": ' + "[" * NESTED, "RecursionError while reading"),
    (TAGGED, "echo(text=" + "[" * NESTED + ")", "too many nested parentheses"),
    (TAGGED, "echo(text=" + "-" * NESTED + "1)", "MemoryError while reading"),
    (TAGGED, "echo(text=" + "not " * 2_000 + "1)", "arguments must be literals"),
    (TAGGED, "power(base=" + "7" * 5000 + ", exponent=1)", "4300 digits"),
    (TAGGED, "power(base=0x" + "f" * 5000 + ", exponent=1)", "longer than 4300 digits"),
    (TAGGED, "echo(text='" + "a" * 100_000 + "')", "the call is 100013 characters long"),
    (TAGGED, "echo(text=" + "[" * 70 + "]" * 70 + ")", "nest more than 64 levels deep"),
]


@pytest.mark.parametrize(("fmt", "body", "problem"), HOSTILE_CALLS)
def test_a_call_that_cannot_be_read_is_an_error_observation(fmt, body: str, problem: str) -> None:
    opening, closing = ("<tool_call>", "</tool_call>") if fmt is HERMES else ("<tool>", "</tool>")
    env = Tools(_context(fmt.name))
    (call,) = fmt.parse(f"Let me see. {opening}{body}{closing}")
    assert call.error is not None
    assert problem in call.error
    step = env.step(TASK, None, f"{opening}{body}{closing}")
    assert (step.done, step.tool_calls, step.tool_errors) == (False, 1, 1)
    assert "Error: the tool call could not be read" in step.messages[0]["content"]
    assert sum(len(m["content"]) for m in step.messages) <= 4000


def test_values_a_call_can_carry_do_not_break_the_tool_or_its_error() -> None:
    tools = {t.name: t for t in (tool(power), tool(echo))}
    # The tool's result is an integer too long for JSON: an error result, not an exception.
    result = run_tool_call(tools, HERMES.parse(_hermes("power", base=10, exponent=5000))[0], 500)
    assert (result.ok, result.content[:36]) == (False, "Error: ValueError: Exceeds the limit")
    # The largest integers JSON reads, and long strings, are echoed briefly in argument errors.
    digits = _hermes("echo", text=int("7" * 4300))
    result = run_tool_call(tools, HERMES.parse(digits)[0], 500)
    assert result.content.startswith("Error: argument 'text' must be string, got int 7777")
    assert len(result.content) < 200
    # An unknown tool's name is echoed cut short, in the result's name and its content.
    result = run_tool_call(tools, HERMES.parse(_hermes("x" * 10_000))[0], 100_000)
    assert len(result.name) == MAX_TOOL_NAME_CHARS
    assert result.content.startswith("Error: unknown tool 'xxx")
    assert len(result.content) < 200


def _hermes(name: str, **arguments: Any) -> str:
    return HERMES.format_call(name, arguments)


# -- a step's observation is bounded as a whole ----------------------------------------------


@pytest.mark.parametrize("tool_format", ["hermes", "tagged"])
def test_a_turn_full_of_calls_costs_one_bounded_observation(tool_format: str) -> None:
    """2000 calls in one turn: counted, answered in at most one message per call run plus one
    for the rest, within the step's character budget, the long tool name cut short."""
    env = Tools(_context(tool_format))
    fmt = TOOL_FORMATS[tool_format]
    turn = fmt.format_call("n" * 5000, {}) + fmt.format_call("nope", {}) * 2000
    step = env.step(TASK, None, turn)
    assert (step.tool_calls, step.tool_errors) == (2001, 2001)
    assert len(step.messages) <= Tools.max_tool_calls_per_turn + 1
    text = "\n".join(m["content"] for m in step.messages)
    assert sum(len(m["content"]) for m in step.messages) <= 4000
    assert "Error: 1993 more tool calls in this turn were not run: at most 8 per turn" in text
    assert "n" * (MAX_TOOL_NAME_CHARS + 1) not in text


def test_results_share_the_step_budget_short_ones_whole() -> None:
    env = Tools(_context("tagged", observation_max_chars=3000))
    calls = [
        TAGGED.format_call("echo", {"text": "a", "times": 5000}),
        TAGGED.format_call("echo", {"text": "b", "times": 5000}),
        TAGGED.format_call("power", {"base": 2, "exponent": 10}),
    ]
    (message,) = env.step(TASK, None, "".join(calls)).messages
    assert len(message["content"]) <= 3000
    blocks = message["content"].split("<tool_result")[1:]
    assert '="power">\n1024\n</tool_result>' in blocks[2]  # short: whole
    for block in blocks[:2]:  # long: an even share each, saying what was cut
        assert "more characters cut" in block
        assert 1300 < len(block) < 1500


def test_fair_shares_and_truncate_stay_within_their_budget() -> None:
    assert fair_shares([10, 5000, 3000], 4000) == [10, 1995, 1995]
    assert fair_shares([10, 20], 4000) == [10, 20]
    assert fair_shares([100, 100, 100], 10) == [3, 3, 4]
    assert truncate("x" * 100, 5) == "xxxxx"  # too small for the note: cut bare
    cut = truncate("x" * 100, 60)
    assert 59 <= len(cut) <= 60  # the note counts the cut with one digit to spare
    assert cut.endswith("more characters cut; limit 60]")


# -- what a user's environment answers -------------------------------------------------------


class Overflowing(Environment):
    """Answers a turn as the turn says: 'deep' nests its state 100 000 deep, 'huge' keeps 2 MiB
    in it, 'many' answers with 100 messages, 'long' with three messages of 3000 characters."""

    def step(self, task: Task, state: Any, text: str) -> Step:
        deep: list[Any] = []
        for _ in range(100_000 if text == "deep" else 0):
            deep = [deep]
        answers = {
            "deep": Step([{"role": "user", "content": "ok"}], {"board": deep}),
            "huge": Step([{"role": "user", "content": "ok"}], {"board": "x" * 2 * 2**20}),
            "many": Step([{"role": "user", "content": "ok"}] * 100, None),
            "long": Step([{"role": "user", "content": c * 3000} for c in "abc"], None),
        }
        return answers[text]


@pytest.mark.parametrize(
    ("turn", "problem"),
    [
        ("deep", f"step's state nests more than {MAX_JSON_DEPTH} levels deep"),
        (
            "huge",
            f"step's state is {2 * 2**20 + 13} characters as JSON; at most {MAX_STATE_JSON_CHARS}",
        ),
        ("many", "Overflowing.step gave 100 messages; at most 64: answer a turn in fewer"),
    ],
)
def test_state_and_messages_out_of_bounds_are_refused_naming_the_fix(turn, problem) -> None:
    with pytest.raises(EnvValueError) as refused:
        checked_step(Overflowing(_context()), TASK, None, turn)
    assert problem in str(refused.value)
    if turn != "many":
        assert "keep episode data small and shallow" in str(refused.value)


def test_a_steps_messages_share_the_observation_budget() -> None:
    step = checked_step(Overflowing(_context()), TASK, None, "long")
    contents = [m["content"] for m in step.messages]
    assert sum(map(len, contents)) <= 4000
    assert [c[0] for c in contents] == ["a", "b", "c"]
    assert all("more characters cut" in c and len(c) >= 1333 for c in contents)


def test_hostile_calls_cost_only_an_error_observation_in_the_worker() -> None:
    """Through the runner's worker: each unreadable call is answered with an error and the
    episode goes on (no env_error, no failed call counted)."""
    config = EnvConfig(fn="calculator", workers=1, tool_format="tagged")
    turns = [f"<tool>{body}</tool>" for _, body, _ in HOSTILE_CALLS]
    with EnvRunner(config) as runner:
        episode = runner.reset(TASK).result().episode
        for turn in turns:
            reply = runner.step(episode, turn).result()
            assert reply.episode.finish_reason is None, reply.episode.error
            assert "Error: the tool call could not be read" in reply.messages[0]["content"]
        assert runner.stats.errors == 0


# -- the observation's tokens ----------------------------------------------------------------


def test_an_observation_is_cut_to_its_token_budget() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(0)
    soup = "".join(chr(rng.randrange(0x4E00, 0xA000)) for _ in range(4000))  # ~3 tokens each
    messages = [
        {"role": "user", "content": soup},
        {"role": "user", "content": "short answer"},
    ]
    assert len(renderer.observation_ids(messages, True)) > 10_000
    ids = renderer.observation_ids_within(messages, True, 300)
    assert ids is not None
    assert len(ids) <= 300
    text = tokenizer.decode(ids)
    assert "more characters cut" in text
    assert "short answer" in text
    assert text.endswith("<|im_start|>assistant\n")
    small = [{"role": "user", "content": "short answer"}]
    assert renderer.observation_ids_within(small, True, 300) == renderer.observation_ids(
        small, True
    )
    assert renderer.observation_ids_within(messages, True, 5) is None  # the frame alone: ~20
    assert EnvConfig().observation_max_tokens == 2048
