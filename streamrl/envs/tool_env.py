"""`ToolEnvironment`: episodes in which the model may call tools before it answers.

Each model turn is read for tool calls in the configured format (`streamrl.envs.formats`):
a turn with calls is answered with their results and the episode goes on; a turn without
calls is the final answer, scored by `score` (by default the reward function on it). Calls
beyond `max_tool_calls_per_turn` in one turn are answered with an error and not run.

A user's tool environment subclasses it and lists its tools:

    def lookup(word: str) -> str:
        '''Look a word up in the dictionary.

        Args:
            word: The word, lower case.
        '''

    class DictionaryEnv(ToolEnvironment):
        tools = (lookup,)

Tools that need the environment's settings are built in `build_tools` instead (see
`streamrl.envs.python_env`). Tools run in the environment's worker process, inside the
step's time limit: a tool that hangs ends the episode as a timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from streamrl.envs.base import EnvContext, Environment, Reset, Step, Task
from streamrl.envs.tools import Tool, ToolResult, as_tool, run_tool_call

__all__ = ["ToolEnvironment"]


class ToolEnvironment(Environment):
    """An environment whose model may call `tools` (module docstring). Each step reports its
    turn's calls and failed calls (`Step.tool_calls`, `tool_errors`)."""

    tools: ClassVar[Sequence[Tool | Callable[..., Any]]] = ()
    max_tool_calls_per_turn: ClassVar[int] = 8

    def __init__(self, context: EnvContext) -> None:
        super().__init__(context)
        self.toolbox: dict[str, Tool] = {}
        for item in self.build_tools():
            t = as_tool(item)
            if t.name in self.toolbox:
                raise ValueError(f"{type(self).__name__} has two tools named {t.name!r}")
            self.toolbox[t.name] = t

    def build_tools(self) -> Sequence[Tool | Callable[..., Any]]:
        """The tools, as functions or `Tool`s; by default the class's `tools`."""
        return self.tools

    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.context.tool_format.template_tools(list(self.toolbox.values()))

    def reset(self, task: Task) -> Reset:
        messages = self.context.tool_format.prompt(list(task.messages), list(self.toolbox.values()))
        return Reset(messages)

    def step(self, task: Task, state: Any, text: str) -> Step:
        calls = self.context.tool_format.parse(text)
        if not calls:
            return Step(state=state, done=True)
        results = [
            run_tool_call(self.toolbox, call, self.context.observation_max_chars)
            for call in calls[: self.max_tool_calls_per_turn]
        ]
        results += [
            ToolResult(
                call.name,
                f"Error: more than {self.max_tool_calls_per_turn} tool calls in one turn; "
                "this one was not run",
                ok=False,
            )
            for call in calls[self.max_tool_calls_per_turn :]
        ]
        return Step(
            self.context.tool_format.observe(results),
            state,
            tool_calls=len(results),
            tool_errors=sum(not r.ok for r in results),
        )
