"""Agent functions the agent tests run (`generator.env.agent`): each is imported by its
environment workers, as a user's would be."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from streamrl.envs.base import Task
from streamrl.envs.calculator import calculate

GO_ON = {"role": "user", "content": "go on"}


async def keep_talking(client: Any, task: Task) -> None:
    """Three turns of plain chat: the task, then "go on" twice."""
    messages: list[Any] = list(task.messages)
    for _ in range(3):
        response = await client.chat.completions.create(model="policy", messages=messages)
        if response.choices[0].finish_reason == "length":
            return None
        messages += [response.choices[0].message, GO_ON]
    return None


def keep_talking_sync(client: Any, task: Task) -> str:
    """`keep_talking` on the plain client, returning its own answer."""
    messages: list[Any] = list(task.messages)
    content = ""
    for _ in range(2):
        response = client.chat.completions.create(model="policy", messages=messages)
        content = response.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": content}, GO_ON]
    return content


async def rewrites_history(client: Any, task: Task) -> float:
    """Asks, then asks again with its first answer edited: two segments; returns a reward."""
    first = await client.chat.completions.create(model="policy", messages=list(task.messages))
    edited = {"role": "assistant", "content": f"(edited) {first.choices[0].message.content}"}
    await client.chat.completions.create(model="policy", messages=[*task.messages, edited, GO_ON])
    return 0.5


async def never_stops(client: Any, task: Task) -> None:
    """Requests for ever (max_turns ends it)."""
    messages: list[Any] = list(task.messages)
    while True:
        response = await client.chat.completions.create(model="policy", messages=messages)
        messages += [response.choices[0].message, GO_ON]


async def asks_too_much(client: Any, task: Task) -> None:
    """A first request far over the episode's token budget."""
    huge = {"role": "user", "content": "word " * 20_000}
    await client.chat.completions.create(model="policy", messages=[*task.messages, huge])


_started = itertools.count()


async def hangs(client: Any, task: Task) -> None:
    """Samples once, then every other run never returns (episode_timeout_s ends it); the
    others, in the same worker, end normally."""
    hang = next(_started) % 2 == 0
    await client.chat.completions.create(model="policy", messages=list(task.messages))
    if hang:
        await asyncio.sleep(3600)


_malformed = itertools.count()


async def sends_malformed_tools(client: Any, task: Task) -> None:
    """Samples a turn; then every other run offers a tool whose `properties` is a list (refused,
    so it fails), the others go on."""
    messages: list[Any] = list(task.messages)
    response = await client.chat.completions.create(model="policy", messages=messages)
    messages += [response.choices[0].message, GO_ON]
    malformed = {}
    if next(_malformed) % 2 == 0:
        parameters = {"type": "object", "properties": ["expression"]}
        tool = {"type": "function", "function": {"name": "calculate", "parameters": parameters}}
        malformed["tools"] = [tool]
    await client.chat.completions.create(model="policy", messages=messages, **malformed)


def never_calls(client: Any, task: Task) -> str:
    """Answers without sampling anything."""
    time.sleep(0.1)
    return "42"


async def other_temperature(client: Any, task: Task) -> None:
    """Asks for a temperature the run does not sample at."""
    await client.chat.completions.create(
        model="policy", messages=list(task.messages), temperature=0.2
    )


async def agents_sdk_calculator(client: Any, task: Task) -> str:
    """The calculator agent written with the OpenAI Agents SDK, unchanged but for its client."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, for example "(3 + 4) * 5".
        """
        return calculate(expression)

    agent = Agent(
        name="calculator",
        instructions="Answer the question. Use the calculator for arithmetic.",
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    result = await Runner.run(agent, task.messages[-1]["content"], max_turns=3)
    return str(result.final_output)


async def raises_type_error(client: Any, task: Task) -> None:
    """A bug of the user's: every run raises the same TypeError before it sends a request."""
    int(task.messages)  # type: ignore[call-overload]


_one_in_three = itertools.count()


async def fails_one_in_three(client: Any, task: Task) -> None:
    """Every third run (in its worker) raises TypeError before it sends a request; the others
    sample a turn."""
    if next(_one_in_three) % 3 == 1:
        raise TypeError("every third run fails")
    await client.chat.completions.create(model="policy", messages=list(task.messages))
