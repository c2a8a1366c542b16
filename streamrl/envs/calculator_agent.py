"""The calculator task as an agent on the OpenAI client (`generator.env.agent =
"streamrl.envs.calculator_agent:solve"`): the same episodes as the `calculator` environment,
written the way agent code is written everywhere — a loop of chat completions with `tools=`,
the tool run by the agent, its result sent back as a `tool` message. Through the generator's
endpoint it records the same tokens as `CalculatorEnv` does.
"""

from __future__ import annotations

import json
from typing import Any

from streamrl.envs.base import Task
from streamrl.envs.calculator import CalculatorEnv, calculate

__all__ = ["TOOLS", "solve"]

TOOLS = [t.schema for t in CalculatorEnv.tools]
MAX_CALLS_PER_TURN = CalculatorEnv.max_tool_calls_per_turn


async def solve(client: Any, task: Task) -> None:
    """Answer `task`, calling `calculate` as the model asks; None: its last message is scored."""
    messages: list[Any] = list(task.messages)
    while True:
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return None
        for call in message.tool_calls[:MAX_CALLS_PER_TURN]:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except Exception as error:  # the model reads what its call did wrong
                result = f"Error: {type(error).__name__}: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
