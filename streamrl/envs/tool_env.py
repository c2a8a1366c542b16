"""`ToolEnvironment`: episodes in which the model may call tools before it answers.

Each model turn is read for tool calls in the configured format (`streamrl.envs.formats`):
a turn with calls is answered with their results and the episode goes on; a turn without
calls is the final answer, scored by `score` (by default the reward function on it). Calls
beyond `max_tool_calls_per_turn` in one turn are not run, and answered with one error for all.
A step's whole observation — the format's own text and every result — is at most
`observation_max_chars` characters: the results share what the format leaves (the short ones
whole, the long ones cut evenly, each saying what was cut), so a turn written full of calls
costs no more than one written with a few.

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
from dataclasses import replace
from typing import Any, ClassVar

from streamrl.envs.base import (
    MAX_OBSERVATION_MESSAGES,
    EnvContext,
    Environment,
    Message,
    Reset,
    Step,
    Task,
)
from streamrl.envs.limits import truncate_all
from streamrl.envs.tools import Tool, ToolResult, as_tool, run_tool_call

__all__ = ["ToolEnvironment"]


class ToolEnvironment(Environment):
    """An environment whose model may call `tools` (module docstring). Each step reports its
    turn's calls and failed calls (`Step.tool_calls`, `tool_errors`)."""

    tools: ClassVar[Sequence[Tool | Callable[..., Any]]] = ()
    max_tool_calls_per_turn: ClassVar[int] = 8

    def __init__(self, context: EnvContext) -> None:
        super().__init__(context)
        if not 1 <= self.max_tool_calls_per_turn < MAX_OBSERVATION_MESSAGES:
            raise ValueError(
                f"{type(self).__name__}.max_tool_calls_per_turn is "
                f"{self.max_tool_calls_per_turn}; it must be 1 to {MAX_OBSERVATION_MESSAGES - 1}"
                f": a step answers each call in a message of its own (hermes), plus one for the "
                f"calls not run, and at most {MAX_OBSERVATION_MESSAGES} messages in all"
            )
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

    @property
    def offers_tools(self) -> bool:
        return bool(self.toolbox)

    def reset(self, task: Task) -> Reset:
        messages = self.context.tool_format.prompt(list(task.messages), list(self.toolbox.values()))
        return Reset(messages)

    def step(self, task: Task, state: Any, text: str) -> Step:
        calls = self.context.tool_format.parse(text)
        if not calls:
            return Step(state=state, done=True)
        run = calls[: self.max_tool_calls_per_turn]
        results = [
            run_tool_call(self.toolbox, call, self.context.observation_max_chars) for call in run
        ]
        errors = sum(not r.ok for r in results) + len(calls) - len(run)
        if len(calls) > len(run):
            results.append(
                ToolResult(
                    "tool",
                    f"Error: {len(calls) - len(run)} more tool calls in this turn were not run: "
                    f"at most {self.max_tool_calls_per_turn} per turn",
                    ok=False,
                )
            )
        return Step(self._observe(results), state, tool_calls=len(calls), tool_errors=errors)

    def _observe(self, results: Sequence[ToolResult]) -> list[Message]:
        """`results` as the tool format answers them, at most `observation_max_chars` in all
        (module docstring): the format's own text around empty results is measured first, and
        the results share what is left (`truncate_all`)."""
        answer = self.context.tool_format.observe
        frame = sum(len(m["content"]) for m in answer([replace(r, content="") for r in results]))
        room = self.context.observation_max_chars - frame
        contents = truncate_all([r.content for r in results], room)
        return answer([replace(r, content=c) for r, c in zip(results, contents, strict=True)])
