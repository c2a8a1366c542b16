"""The `python` environment: math word problems (builtin:math) where the model may run Python
code (`python(code)`) before it answers, scored by the reward function on its answer.

Each call runs in a fresh box (`streamrl.isolation.box`: a bubblewrap sandbox with a read-only
system, a private scratch directory, no network, its own PID namespace, an unprivileged uid
and limits on time, memory, processes and output); nothing carries over between calls, so the
model prints what it wants to see. The environment refuses to start where the box cannot be
made, naming the fix. The code's limits stay inside the step's: at most
`max_tool_calls_per_turn` calls a turn, each given at most `code_timeout_s` and an equal share
of `generator.env.call_timeout_s` (with room to spare), and at most `code_memory_mb` and
`generator.env.memory_mb` of address space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from streamrl.envs.base import EnvContext
from streamrl.envs.tool_env import ToolEnvironment
from streamrl.envs.tools import Tool, tool, truncate
from streamrl.isolation.box import BoxLimits, check_box, run_in_box

__all__ = ["PythonEnv"]


class PythonEnv(ToolEnvironment):
    """Math with a boxed Python tool (`python`); the episode ends with the first turn that
    runs no code, scored by the reward function."""

    max_tool_calls_per_turn: ClassVar[int] = 2
    code_timeout_s: ClassVar[float] = 10.0
    code_memory_mb: ClassVar[int] = 1024

    def __init__(self, context: EnvContext) -> None:
        check_box()  # no box, no python tool: BoxUnavailableError names the fix
        super().__init__(context)

    def build_tools(self) -> Sequence[Tool | Callable[..., Any]]:
        return [tool(self.run_code, name="python", example={"code": "print(2**10 - 1)"})]

    @property
    def code_limit_s(self) -> float:
        """Each call's time limit: within its share of the step's, with room to spare for
        starting the boxes."""
        share = self.context.call_timeout_s / (self.max_tool_calls_per_turn + 1)
        return min(self.code_timeout_s, share)

    def run_code(self, code: str) -> str:
        """Run Python code in a fresh interpreter and return what it prints (print() the
        results you want to see). No network access; nothing persists between calls.

        Args:
            code: The Python source to run.
        """
        limit = self.code_limit_s
        max_chars = self.context.observation_max_chars
        limits = BoxLimits(
            wall_s=limit,
            memory_mb=min(self.code_memory_mb, self.context.memory_mb),
            output_bytes=4 * max_chars,  # a UTF-8 character is at most 4 bytes
        )
        result = run_in_box(
            ["python", "/box/main.py"], limits=limits, files={"main.py": code.encode()}
        )
        if result.timed_out:
            return f"Error: the code ran past its time limit of {limit:g}s and was stopped"
        stdout = result.stdout.decode(errors="replace")
        stderr = result.stderr.decode(errors="replace")
        parts = [truncate(stdout, max_chars)] if stdout else []
        if stderr:  # an error's last line says what it was: keep the end
            parts.append(f"stderr:\n{_tail(stderr, max_chars)}")
        if result.returncode != 0:
            parts.append(f"(exit code {result.returncode})")
        return "\n".join(parts) or "(no output: print() the values you want to see)"


def _tail(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"[... output cut to its last {max_chars} characters]\n" + text[-max_chars:]
