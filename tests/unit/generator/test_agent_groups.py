"""AgentGroups serving whatever its agents send: the generator's loop goes on.

Request bodies drawn by `hypothesis` — messages of any role and content, tool calls with any
arguments (JSON nested thousands deep among them), tool schemas of any shape, sampling fields
of any value, a 2 MiB message, bytes that are not JSON — are posted to the real endpoint, and
the loop's side of it (`AgentGroups.advance`: `AgentChat` rendering with the tiny model's
tokenizer and the chat template of each tool format, a scripted engine sampling a tool call,
the answer parsed back) runs on the test's thread, as it runs on the generator loop's. Every
answer is a 200 or a 4xx with an OpenAI error object, never a 5xx and never an exception out
of `advance`; the group's other episode is served after it. What still fails while a request
is served — a chat template's own bug, a tool parser that cannot parse — ends that episode
alone (`env_error`, counted). The agents' worker pool is the one part replaced: the test is
each episode's agent (`_Agents`)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from streamrl.config.loading import load_config
from streamrl.data import Prompt
from streamrl.envs.agent import EPISODE_ENDED
from streamrl.envs.base import Task
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.limits import MAX_JSON_DEPTH
from streamrl.envs.runner import Episode
from streamrl.generator.agent_episodes import AgentGroups, Ended
from streamrl.generator.engine import Completion, FinishedGroup
from streamrl.models import resolve_model_path

QWEN25_TEMPLATE = (Path(__file__).parents[2] / "qwen25_chat_template.jinja").read_text()
USER = {"role": "user", "content": "What is 2+3?"}
# What the scripted engine samples: a call to "f" in both tool formats, read by whichever serves.
SAMPLED = '<tool>f(1)</tool>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
PROMPT = Prompt("p0", "What is 2+3?", [1], "5", (USER,))


class _Agents:
    """`EnvRunner`'s side of `AgentGroups`, without its worker pool: the test is every episode's
    agent, and ends its runs (`end`) when it has sent what it sends."""

    def __init__(self, tool_format: str) -> None:
        self.tool_format = tool_format
        self.stopping = False
        self.runs: list[tuple[Task, list[str], list[Future[Episode]]]] = []
        self.finished: Counter[str] = Counter()

    def run_agents(self, task: Task, base_url: str, tokens: list[str]) -> list[Future[Episode]]:
        futures: list[Future[Episode]] = [Future() for _ in tokens]
        self.runs.append((task, tokens, futures))
        return futures

    def count_finished(self, reason: str) -> None:
        self.finished[reason] += 1

    def end(self) -> None:
        for task, _, futures in self.runs:
            for future in futures:
                future.set_result(Episode(task, finish_reason="done"))
        self.runs.clear()


class _Engine:
    """Samples `SAMPLED` for every request, the turn closed with the template's end of turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.policy_version = 0
        ids = [*tokenizer.encode(SAMPLED, add_special_tokens=False)]
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.ids = np.asarray(ids, np.int32)
        self.requests: dict[str, list[int]] = {}
        self.submitted = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    def submit(self, prompt_token_ids: list[int], **_: Any) -> str:
        self.submitted += 1
        request = f"r{self.submitted}"
        self.requests[request] = list(prompt_token_ids)
        return request

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def step(self) -> list[FinishedGroup]:
        n = len(self.ids)
        completion = Completion(self.ids, np.full(n, -0.5, np.float32), SAMPLED, "stop",
                                np.zeros(n, np.int64))  # fmt: skip
        finished = [
            FinishedGroup(r, p, [completion], 0, time.time()) for r, p in self.requests.items()
        ]
        self.requests.clear()
        return finished


class _Served:
    """An `AgentGroups` (its endpoint on 127.0.0.1) whose loop side the test's thread runs."""

    def __init__(
        self, tool_format: str, pool: ThreadPoolExecutor, template: str | None = None,
        *overrides: str,
    ) -> None:  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
        if template or tool_format == "hermes":
            tokenizer.chat_template = template or QWEN25_TEMPLATE
        config = load_config(["grpo", "tiny-cpu"], overrides=[
            "generator.env.agent=tests.agent_fns:never_calls",
            "model.max_model_len=1024", "generator.env.max_episode_tokens=1024",
            "generator.max_tokens=32", *overrides,
        ])  # fmt: skip
        self.agents = _Agents(tool_format)
        self.engine = _Engine(tokenizer)
        self.groups = AgentGroups(config, self.engine, self.agents, ChatRenderer(tokenizer))  # type: ignore[arg-type]
        self.pool = pool
        self.http = httpx.Client(trust_env=False, timeout=60)

    def group(self) -> list[str]:
        """A new group of two episodes: their tokens."""
        self.groups.start(PROMPT, f"g{len(self.agents.runs)}", group_size=2, greedy=False)
        return self.agents.runs[-1][1]

    def post(
        self, token: str, body: bytes | dict[str, Any], limit_s: float = 60.0
    ) -> httpx.Response:
        """`body` posted as the episode's agent would, the loop's side run until it is answered."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        call = self.pool.submit(
            self.http.post, f"{self.groups.endpoint.base_url}/chat/completions", content=content,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )  # fmt: skip
        deadline = time.monotonic() + limit_s
        while not call.done() and time.monotonic() < deadline:
            self._advance()
            time.sleep(0.001)
        return call.result(timeout=1)

    def end_group(self) -> Ended:
        """End the group's agents' runs; the group as it ended."""
        self.agents.end()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ended = self._advance()
            if ended:
                return ended[0]
        raise AssertionError("the group did not end")

    def close(self) -> None:
        self.groups.close()
        self.http.close()

    def _advance(self) -> list[Ended]:
        finished = self.engine.step() if self.engine.num_in_flight else []
        return self.groups.advance(finished)


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


@pytest.fixture(scope="module", params=["hermes", "tagged"])
def served(request, pool) -> Iterator[_Served]:
    served = _Served(request.param, pool)
    try:
        yield served
    finally:
        served.close()


# -- what an agent may send ------------------------------------------------------------------------


def _nested(depth: int) -> str:
    """JSON text nested `depth` lists deep (built as text: dumping it would recurse)."""
    return "[" * depth + "]" * depth


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
DEPTHS = st.integers(1, 6000) | st.sampled_from([MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 101, 999])
# Text that means something to a template, a tool format or a tokenizer, and a 2 MiB message.
TEXT = st.text(max_size=40) | st.just("x" * 2**21) | st.sampled_from([
    "<|im_start|>assistant\n", "<|im_end|>", "<tool_call>\n{", "</tool_call>", "<tool>f(",
    "<tool_response>", "{{ raise_exception('x') }}", "\x00", "",
])  # fmt: skip
CONTENT = TEXT | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2
)
ARGUMENTS = (
    st.text(max_size=20) | JSON.map(json.dumps) | DEPTHS.map(_nested)
    | DEPTHS.map(lambda d: '{"a": ' + _nested(d) + "}")
)  # fmt: skip
NAMES = st.sampled_from(["f", "g"]) | st.text(max_size=8)
TOOL_CALL = st.fixed_dictionaries({
    "id": st.sampled_from(["c1", "c2", ""]), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": NAMES, "arguments": ARGUMENTS}),
})  # fmt: skip
MESSAGE = (
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "developer"]),
                           "content": CONTENT})
    | st.fixed_dictionaries({"role": st.just("assistant"), "content": CONTENT | st.none()},
                            optional={"tool_calls": st.lists(TOOL_CALL, max_size=2)})
    | st.fixed_dictionaries({"role": st.just("tool"), "content": CONTENT,
                             "tool_call_id": st.sampled_from(["c1", "c2", "x"])})
)  # fmt: skip
# Schemas as tools describe them, or with keywords holding anything (vLLM passes
# `parameters` through as any JSON object): one in four.
PROPERTY = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["string", "integer", "number", "object", "array"]),
    "enum": st.lists(JSON, min_size=1, max_size=3), "description": st.text(max_size=12),
    "anyOf": st.lists(st.fixed_dictionaries({"type": st.just("string")}), max_size=2),
    "items": st.fixed_dictionaries({"type": st.just("string")}), "default": JSON,
})  # fmt: skip
ODD_PROPERTY = st.fixed_dictionaries(
    {},
    optional=dict.fromkeys(["type", "enum", "description", "anyOf", "items", "properties"], JSON),
)
PARAMETERS = st.fixed_dictionaries({
    "type": st.just("object"),
    "properties": st.dictionaries(st.sampled_from(["a", "b", "x"]), PROPERTY, max_size=3),
}, optional={"required": st.lists(st.sampled_from(["a", "b"]), max_size=2),
             "examples": st.lists(JSON, max_size=1)})  # fmt: skip
ODD_PARAMETERS = st.fixed_dictionaries({}, optional={
    "properties": st.dictionaries(st.sampled_from(["a", "b"]), PROPERTY | ODD_PROPERTY) | JSON,
    "required": st.lists(st.sampled_from(["a", "b", "y"]), max_size=2) | JSON,
    "type": JSON, "examples": JSON,
})  # fmt: skip
TOOL = st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": NAMES}, optional={
        "description": st.text(max_size=12),
        "parameters": st.integers(0, 3).flatmap(lambda k: ODD_PARAMETERS if k == 3 else PARAMETERS),
    }),
})  # fmt: skip
RENDERED = {  # what changes how a request is rendered or answered
    "tools": st.lists(TOOL, min_size=1, max_size=3), "max_tokens": st.integers(1, 10**9),
    "logprobs": st.booleans(),
}  # fmt: skip
SAMPLING = {  # of the types vLLM validates: the run's own sampling, or another
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 3),
    "stream": st.booleans(), "seed": st.integers(0, 2**31), "frequency_penalty": st.floats(-2, 2),
    "stop": st.lists(st.text(max_size=4), max_size=2),
    "max_completion_tokens": st.integers(1, 10**6),
}  # fmt: skip
OTHER_SAMPLING = [st.fixed_dictionaries({name: values}) for name, values in SAMPLING.items()]
OTHER_SAMPLING.append(
    st.fixed_dictionaries({"logprobs": st.just(True), "top_logprobs": st.integers(0, 5)})
)


def _formed(
    body: dict[str, Any], sampling: dict[str, Any], tool_choice: str | None
) -> dict[str, Any]:
    if tool_choice is not None and "tools" in body:  # vLLM refuses a tool_choice without tools
        body = {**body, "tool_choice": tool_choice}
    return {**body, **sampling}


FORMED = st.builds(
    _formed,
    st.fixed_dictionaries({"model": st.just("m"), "messages": st.lists(MESSAGE, min_size=1,
                           max_size=5)}, optional=RENDERED),
    st.just({}) | st.one_of(OTHER_SAMPLING),
    st.sampled_from([None, "auto", "none", "required"]),
)  # fmt: skip
_DEEP = json.dumps({"model": "m", "messages": [USER], "tools": [
    {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": "@"}}}},
]})  # fmt: skip
MALFORMED = (
    st.fixed_dictionaries({"model": JSON, "messages": st.lists(MESSAGE | JSON, max_size=3) | JSON},
                          optional=dict.fromkeys(["tools", "temperature", "max_tokens", "n"], JSON))
    .map(lambda body: json.dumps(body).encode())
    | DEPTHS.map(lambda d: _DEEP.replace('"@"', _nested(d)).encode())
    | st.binary(max_size=64)
)  # fmt: skip
# Three in four pass vLLM's validation.
BODIES = st.integers(0, 3).flatmap(lambda k: MALFORMED if k == 3 else FORMED)

WELL_FORMED = {"model": "m", "messages": [USER]}
# The issue's triggers, always tried: tool properties as a list, a 2 MiB message.
_F = {"type": "function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}
LIST_PROPERTIES = {"model": "m", "messages": [USER], "tools": [_F]}
TWO_MIB = {"model": "m", "messages": [{"role": "user", "content": "x" * 2**21}]}


def _deep_call(depth: int) -> bytes:
    """A conversation whose assistant turn calls a tool with arguments nested `depth` deep."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "@"}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]  # fmt: skip
    body = json.dumps({"model": "m", "messages": messages})
    return body.replace('"@"', json.dumps(_nested(depth))).encode()


@settings(
    max_examples=200, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
@given(body=BODIES, continues=st.booleans())
@example(body=_deep_call(5000), continues=False)
@example(body=LIST_PROPERTIES, continues=False)
@example(body=TWO_MIB, continues=False)
@example(body={**TWO_MIB, "messages": [{"role": "tool", "content": "x" * 2**21}]}, continues=True)
def test_whatever_an_agent_sends_the_loop_answers_it_and_goes_on(served, body, continues) -> None:
    """`continues`: the episode's agent first sends a request that is sampled (with the same
    tools), and the drawn messages follow its history and answer, so they extend the episode
    (or start a segment) instead of opening it."""
    first, second = served.group()
    if isinstance(body, dict):
        if continues:
            opening = {**WELL_FORMED, **({"tools": body["tools"]} if "tools" in body else {})}
            opened = served.post(first, opening)
            if opened.status_code == 200:
                answer = opened.json()["choices"][0]["message"]
                body = {**body, "messages": [USER, answer, *body["messages"]]}
        body = json.dumps(body).encode()
    response = served.post(first, body)
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    answer = response.json()
    if response.status_code == 200:
        assert answer["choices"][0]["message"]["role"] == "assistant"
    else:
        assert isinstance(answer["error"]["message"], str)
        assert answer["error"]["message"]
    after = served.post(second, WELL_FORMED)  # the group's other episode is served as ever
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["message"]["role"] == "assistant"
    served.end_group()


# -- what still fails while a request is served ---------------------------------------------------


def _ended_alone(served: _Served, failing: dict[str, Any], says: str) -> Ended:
    """Post `failing` for one episode of a group and a well-formed request for the other: the
    first is answered 400 `episode_ended` naming the error, the second 200; the group as it
    ended."""
    first, second = served.group()
    response = served.post(first, failing)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == EPISODE_ENDED
    assert error["message"].startswith(f"the request could not be served ({says}")
    assert error["message"].endswith("this episode has ended")
    again = served.post(first, WELL_FORMED)  # the episode has ended: refused as ended
    assert again.json()["error"]["code"] == EPISODE_ENDED
    assert "(env_error)" in again.json()["error"]["message"]
    after = served.post(second, WELL_FORMED)
    assert after.status_code == 200, after.text
    return served.end_group()


def test_a_chat_template_that_fails_ends_only_its_episode_counted(pool) -> None:
    """A template whose own code raises (not `raise_exception`: an arithmetic error) while the
    loop renders a request."""
    broken = QWEN25_TEMPLATE.replace(
        "{%- if tools %}",
        "{%- if messages[-1].content == 'divide' %}{{ 1 // (messages|length - messages|length) }}"
        "{%- endif %}\n{%- if tools %}",
        1,
    )
    served = _Served("hermes", pool, broken)
    try:
        failing = {"model": "m", "messages": [{"role": "user", "content": "divide"}]}
        ended = _ended_alone(served, failing, "ZeroDivisionError")
    finally:
        served.close()
    assert ended.unsampled == ["env_error"]  # it sampled nothing: left out, counted
    assert served.agents.finished == Counter({"env_error": 1})
    assert [e.finish_reason for e in ended.episodes] == ["done"]  # the other, as it ended


def test_a_tool_parser_that_fails_ends_only_its_episode_with_what_it_sampled(pool) -> None:
    """vLLM's `hf` tool parser reads no text (NotImplementedError) when the loop answers a
    sampled turn: the turn stays recorded, its episode ends env_error, the error kept."""
    served = _Served("hermes", pool, None, "generator.env.tool_parser=hf")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]
    try:
        ended = _ended_alone(served, {**WELL_FORMED, "tools": tools}, "NotImplementedError")
    finally:
        served.close()
    assert ended.unsampled == []
    failed, other = ended.episodes
    assert failed.finish_reason == "env_error"
    assert failed.error.startswith("a request could not be served: NotImplementedError")
    assert other.finish_reason == "done"
    assert [t.turns for t in ended.transcripts] == [1, 1]
