"""AgentEndpoint as a real uvicorn server on 127.0.0.1, without vLLM's engine: the real `openai`
client calls it from a thread while the test thread answers the `Pending` requests it takes —
as the generator loop does. Per-episode tokens (401), the model list, body size (413) and
validation (400: JSON, tool schemas, nesting) limits, answers reaching the client, 503 on
close; and the worker side's reading of refusals (`streamrl.envs.agent`). Connections held
open: `test_endpoint_connections`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from streamrl.envs.agent import (
    EPISODE_ENDED,
    MAX_FINAL_CHARS,
    AgentResult,
    _checked,
    _episode_ended,
    _start,
)
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.config import EnvConfig
from streamrl.envs.worker import EnvValueError
from streamrl.generator.agent_chat import AgentChat, AgentEpisode
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.endpoint import MAX_REQUEST_BYTES, AgentEndpoint, Pending
from streamrl.generator.engine import Completion
from streamrl.models import resolve_model_path

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
QWEN25_TEMPLATE = (Path(__file__).parents[2] / "qwen25_chat_template.jinja").read_text()
CALLS = {
    "tagged": '<tool>calculate(expression="2+3")</tool>',
    "hermes": (
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    ),
}


def _body(content: str = "It is 5.", **message: Any) -> dict[str, Any]:
    """A minimal chat.completion answer."""
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


@pytest.fixture(scope="module")
def endpoint() -> Iterator[AgentEndpoint]:
    with AgentEndpoint("m") as served:
        yield served


@pytest.fixture(scope="module")
def calls() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


def _client(endpoint: AgentEndpoint, token: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=endpoint.base_url,
        api_key=token,
        max_retries=0,
        timeout=30,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def _create(client: openai.OpenAI, **fields: Any) -> Callable[[], Any]:
    return lambda: client.chat.completions.create(model="m", messages=MESSAGES, **fields)


def _take_one(endpoint: AgentEndpoint, timeout_s: float = 20.0) -> Pending:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        taken = endpoint.take()
        if taken:
            assert len(taken) == 1
            return taken[0]
        time.sleep(0.005)
    raise AssertionError("no request reached the endpoint's queue")


def _post(endpoint: AgentEndpoint, token: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{endpoint.base_url}/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        trust_env=False,
        timeout=30,
    )


# -- tokens, routes and limits -----------------------------------------------------------------


def test_an_unknown_token_is_refused_401(endpoint) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        _create(_client(endpoint, "not-a-token"))()
    assert refused.value.status_code == 401
    assert endpoint.take() == []


def test_a_closed_episodes_token_is_refused_401(endpoint) -> None:
    token = endpoint.open()
    endpoint.close_episode(token)
    with pytest.raises(openai.AuthenticationError):
        _create(_client(endpoint, token))()
    response = httpx.post(  # and a request without any token
        f"{endpoint.base_url}/chat/completions", json={"messages": MESSAGES}, trust_env=False
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert endpoint.take() == []


def test_the_model_is_listed(endpoint) -> None:
    models = _client(endpoint, endpoint.open()).models.list()
    assert [m.id for m in models.data] == ["m"]


def test_other_routes_are_404(endpoint) -> None:
    token = endpoint.open()
    response = httpx.post(
        f"{endpoint.base_url}/completions",
        json={"prompt": "x"},
        headers={"Authorization": f"Bearer {token}"},
        trust_env=False,
    )
    assert response.status_code == 404
    response = httpx.get(f"{endpoint.base_url}/chat/completions", trust_env=False)
    assert response.status_code == 404


def test_a_body_over_the_limit_is_refused_413(endpoint) -> None:
    token = endpoint.open()
    padding = b"a" * (MAX_REQUEST_BYTES + 1)
    response = _post(endpoint, token, b'{"model": "m", "x": "' + padding + b'"}')
    assert response.status_code == 413
    assert str(MAX_REQUEST_BYTES) in response.json()["error"]["message"]
    assert endpoint.take() == []


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"model": "m", "messages": [', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b'[{"role": "user"}]', "JSON object"),
        (b'{"model": "m"}', "messages"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
            b'"function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}]}',
            "tools[0] (f): parameters.properties must be an object of schemas",
        ),
        (b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests more than"),
        (
            b'{"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c", '
            b'"type": "function", "function": {"name": "f", "arguments": "'
            + b"[" * 5000
            + b"]" * 5000
            + b'"}}]}]}',
            "messages[0].tool_calls[0].function.arguments nests more than 64 levels deep",
        ),
    ],
    ids=["truncated", "not-utf8", "array", "no-messages", "tool-schema", "deep", "deep-call"],
)
def test_an_invalid_body_is_refused_400(endpoint, content, says) -> None:
    token = endpoint.open()
    response = _post(endpoint, token, content)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert says in message
    # The loop is handed nothing to render: only the refusal, for its episode's record.
    (refused,) = endpoint.take()
    assert (refused.token, refused.request, refused.refused) == (token, None, f"400: {message}")


# -- requests and answers ----------------------------------------------------------------------


def test_a_request_is_handed_over_and_its_answer_reaches_the_client(endpoint, calls) -> None:
    token = endpoint.open()
    call = calls.submit(_create(_client(endpoint, token), temperature=1.0))
    pending = _take_one(endpoint)
    assert pending.token == token
    assert not pending.start
    assert isinstance(pending.request, ChatCompletionRequest)
    assert pending.request.messages == MESSAGES
    assert pending.request.temperature == 1.0
    assert not call.done()  # it waits for the loop's answer

    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculate", "arguments": '{"expression": "2+3"}'},
    }
    pending.answer(200, _body(None, tool_calls=[tool_call]))
    completion = call.result(timeout=20)
    message = completion.choices[0].message
    assert message.content is None
    assert message.tool_calls[0].function.name == "calculate"
    assert message.tool_calls[0].function.arguments == '{"expression": "2+3"}'
    assert completion.usage.total_tokens == 7
    pending.answer(500, {})  # a second answer is ignored, not raised


def test_requests_of_two_episodes_are_told_apart(endpoint, calls) -> None:
    first, second = endpoint.open(), endpoint.open()
    one = calls.submit(_create(_client(endpoint, first)))
    pending_one = _take_one(endpoint)
    two = calls.submit(_create(_client(endpoint, second)))
    pending_two = _take_one(endpoint)
    assert (pending_one.token, pending_two.token) == (first, second)
    pending_two.answer(200, _body("two"))
    pending_one.answer(200, _body("one"))
    assert two.result(timeout=20).choices[0].message.content == "two"
    assert one.result(timeout=20).choices[0].message.content == "one"


def test_a_refusal_reaches_the_client_as_an_openai_error(endpoint, calls) -> None:
    call = calls.submit(_create(_client(endpoint, endpoint.open())))
    _take_one(endpoint).refuse(400, "this episode used its 3 requests", EPISODE_ENDED)
    with pytest.raises(openai.BadRequestError) as refused:
        call.result(timeout=20)
    assert refused.value.code == EPISODE_ENDED
    assert "3 requests" in str(refused.value)
    assert _episode_ended(refused.value)


def test_an_agents_start_is_handed_over(endpoint, calls) -> None:
    token = endpoint.open()
    started = calls.submit(_start, endpoint.base_url, token, 20.0)
    pending = _take_one(endpoint)
    assert pending.start
    assert pending.token == token
    assert pending.request is None
    pending.answer(200, {})
    assert started.result(timeout=20) is None

    again = calls.submit(_start, endpoint.base_url, token, 20.0)
    _take_one(endpoint).refuse(409, "this episode's agent already ran")
    with pytest.raises(EnvValueError, match="already ran"):
        again.result(timeout=20)


# -- closing -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def closed_while_waiting() -> tuple[Future, float, float]:
    """An endpoint closed while a request waits in its queue: the client's call, how long
    close() took, and when (after close() began) the client had its answer."""
    with ThreadPoolExecutor(1) as pool:
        endpoint = AgentEndpoint("m").__enter__()
        try:
            call = pool.submit(_create(_client(endpoint, endpoint.open())))
            deadline = time.monotonic() + 20
            while endpoint._queue.empty() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not endpoint._queue.empty(), "the request never reached the queue"
            began = time.monotonic()
            answered: list[float] = []
            call.add_done_callback(lambda _: answered.append(time.monotonic() - began))
        finally:
            endpoint.close()
        close_s = time.monotonic() - began
        call.exception(timeout=20)
        return call, close_s, answered[0]


def test_closing_answers_waiting_requests_503(closed_while_waiting) -> None:
    call, _, _ = closed_while_waiting
    with pytest.raises(openai.InternalServerError) as refused:
        call.result()
    assert refused.value.status_code == 503
    assert "stopping" in str(refused.value)


def test_closing_with_a_waiting_request_is_prompt(closed_while_waiting) -> None:
    _, close_s, answered_s = closed_while_waiting
    assert answered_s < 5.0
    assert close_s < 5.0


# -- the worker side: refusals and results -------------------------------------------------------


class _RefusedError(Exception):
    def __init__(self, code: str | None) -> None:
        super().__init__(f"refused ({code})")
        self.code = code


def _wrapped(suppress: bool) -> BaseException:
    """An error an agent's framework raised while handling the endpoint's refusal: `from` it,
    or `from None` (the refusal is then only its context)."""
    with pytest.raises(RuntimeError) as raised:
        _raise_while_handling(suppress)
    return raised.value


def _raise_while_handling(suppress: bool) -> None:
    try:
        raise _RefusedError(EPISODE_ENDED)
    except _RefusedError as refused:
        if suppress:
            raise RuntimeError("raised while handling it") from None
        raise RuntimeError("the agent's framework wrapped it") from refused


def test_episode_ended_is_read_through_the_exception_chain() -> None:
    assert _episode_ended(_RefusedError(EPISODE_ENDED))
    wrapped = _wrapped(suppress=False)
    assert isinstance(wrapped.__cause__, _RefusedError)
    assert _episode_ended(wrapped)
    suppressed = _wrapped(suppress=True)
    assert suppressed.__cause__ is None
    assert isinstance(suppressed.__context__, _RefusedError)
    assert _episode_ended(suppressed)


def test_other_errors_are_not_an_ended_episode() -> None:
    assert not _episode_ended(None)
    assert not _episode_ended(ValueError("boom"))
    assert not _episode_ended(_RefusedError(None))
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = _RefusedError("rate_limited")
    assert not _episode_ended(wrapped)


def test_episode_ended_stops_on_a_cyclic_chain() -> None:
    first, second = ValueError("a"), ValueError("b")
    first.__cause__, second.__cause__ = second, first
    assert not _episode_ended(first)


def test_episode_ended_looks_only_16_deep() -> None:
    error: BaseException = _RefusedError(EPISODE_ENDED)
    for k in range(20):
        outer = RuntimeError(f"level {k}")
        outer.__cause__ = error
        error = outer
    assert not _episode_ended(error)


def _agent(client: Any, task: Any) -> None:
    return None


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (None, AgentResult()),
        ("42", AgentResult(final="42")),
        ("", AgentResult(final="")),
        (0.5, AgentResult(reward=0.5)),
        (0, AgentResult(reward=0.0)),
        (1, AgentResult(reward=1.0)),
        (True, AgentResult(reward=1.0)),
    ],
)
def test_checked_results(result, expected) -> None:
    checked = _checked(result, _agent)
    assert checked == expected
    if checked.reward is not None:
        assert type(checked.reward) is float


@pytest.mark.parametrize(
    "result",
    [2.0, -0.1, float("nan"), float("inf"), object(), [0.5], {"reward": 1}, b"42"],
    ids=["2.0", "negative", "nan", "inf", "object", "list", "dict", "bytes"],
)
def test_checked_refuses_other_results(result) -> None:
    with pytest.raises(EnvValueError, match="_agent"):
        _checked(result, _agent)


def test_checked_refuses_an_answer_too_long_to_score() -> None:
    with pytest.raises(EnvValueError, match="characters"):
        _checked("x" * (MAX_FINAL_CHARS + 1), _agent)
    assert _checked("x" * MAX_FINAL_CHARS, _agent).final is not None


# -- the endpoint and AgentChat together ---------------------------------------------------------


@pytest.mark.parametrize("tool_format", ["tagged", "hermes"])
def test_an_openai_agent_loop_is_one_segment(endpoint, calls, tool_format) -> None:
    """The real client's own echo of a tool-calling answer (its message object appended to the
    conversation, as agents do) continues the episode's token history, sampled tokens kept."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    if tool_format == "hermes":
        tokenizer.chat_template = QWEN25_TEMPLATE
    renderer = ChatRenderer(tokenizer)
    chat = AgentChat(renderer, GeneratorConfig(), EnvConfig(), tool_format, 4096, "m")
    token = endpoint.open()
    episode = AgentEpisode(token)
    tools = [{"type": "function", "function": {
        "name": "calculate", "description": "Arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }}]  # fmt: skip

    def agent() -> str:
        client = _client(endpoint, token)
        messages: list[Any] = list(MESSAGES)
        for _ in range(3):
            answer = client.chat.completions.create(model="m", messages=messages, tools=tools)
            message = answer.choices[0].message
            messages.append(message)  # the pydantic object, as the openai docs show
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        raise AssertionError("the agent did not finish")

    run = calls.submit(agent)
    sampled = []
    call = CALLS[tool_format]
    for text in (call, "It is 5."):
        pending = _take_one(endpoint)
        ids, _ = chat.prompt(episode, pending.request)
        end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        token_ids = [*tokenizer.encode(text, add_special_tokens=False), end_of_turn]
        n = len(token_ids)
        completion = Completion(
            np.asarray(token_ids, np.int32), np.full(n, -0.5, np.float32), text, "stop",
            np.zeros(n, np.int64),
        )  # fmt: skip
        if sampled:
            assert ids[: len(sampled)] == sampled  # the history so far, as sampled
        sampled = ids + token_ids
        pending.answer(200, chat.reply(episode, pending.request, completion))
    assert run.result(timeout=20) == "It is 5."
    assert len(episode.segments) == 1
    assert episode.segments[0].turns == 2
    assert episode.segments[0].token_ids() == sampled
