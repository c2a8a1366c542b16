"""User environments for the environment tests, resolved by import path ('tests.env_fns:...')
in the spawned environment workers."""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

from streamrl.envs import Environment, Reset, Step, Task, ToolEnvironment


def crash() -> str:
    """End this worker process at once."""
    os._exit(3)


def hang() -> str:
    """Sleep for 100 seconds."""
    time.sleep(100)
    return "woke up"


def nap(seconds: float) -> str:
    """Sleep for a while.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"


def boom() -> str:
    """Raise ValueError('boom')."""
    raise ValueError("boom")


def getenv(name: str) -> str:
    """The value of an environment variable in the worker, or 'absent'.

    Args:
        name: The variable's name.
    """
    return os.environ.get(name, "absent")


def echo(text: str, times: int = 1) -> str:
    """Repeat a text.

    Args:
        text: What to repeat.
        times: How often.
    """
    return text * times


class ScriptedTools(ToolEnvironment):
    """Tools that crash, hang, nap, raise, read the environment, echo."""

    tools: ClassVar = (crash, hang, nap, boom, getenv, echo)


class Misbehaving(Environment):
    """Answers each turn as the turn says: 'state' returns a state that is not JSON, 'silent'
    goes on without an observation, 'raise' raises, 'score:X' ends and scores X, anything else
    goes on with an echo (its state counts the turns)."""

    def reset(self, task: Task) -> Any:
        if task.ground_truth == "bad reset":
            return {"not": "a Reset"}
        return Reset(list(task.messages), {"turns": 0})

    def step(self, task: Task, state: Any, text: str) -> Step:
        if text == "state":
            return Step([{"role": "user", "content": "ok"}], state={1, 2})
        if text == "silent":
            return Step([], state)
        if text == "raise":
            raise RuntimeError("environment bug")
        if text.startswith("score:"):
            return Step(state={"score": text.removeprefix("score:")}, done=True, reward=0.5)
        turns = state["turns"] + 1
        return Step([{"role": "user", "content": f"echo {text}"}], {"turns": turns}, reward=0.1)

    def score(self, task: Task, state: Any, final: str) -> object:
        values = {"1.5": 1.5, "text": "yes", "1": 1.0, "true": True}
        return values[state["score"]]


class NotAnEnvironment:
    """A class that is no Environment subclass."""


class KeepTalking(Environment):
    """Answers each turn with the user message 'go on' until three turns were taken (per-turn
    reward 0.25 each); scores 1 when the last turn says anything."""

    def reset(self, task: Task) -> Reset:
        return Reset(list(task.messages), {"turns": 0})

    def step(self, task: Task, state: Any, text: str) -> Step:
        turns = state["turns"] + 1
        if turns >= 3:
            return Step(state={"turns": turns}, done=True, reward=0.25)
        return Step([{"role": "user", "content": "go on"}], {"turns": turns}, reward=0.25)

    def score(self, task: Task, state: Any, final: str) -> float:
        return 1.0 if final.strip() else 0.0


class BreaksOnTurnTwo(KeepTalking):
    """KeepTalking whose reset raises for answers divisible by 5, and whose second step crashes
    its worker (other even answers) or hangs (other odd answers)."""

    def reset(self, task: Task) -> Reset:
        if int(task.ground_truth) % 5 == 0:
            raise RuntimeError("no episode for this one")
        return super().reset(task)

    def step(self, task: Task, state: Any, text: str) -> Step:
        if state["turns"] == 1:
            if int(task.ground_truth) % 2 == 0:
                os._exit(3)
            time.sleep(100)
        return super().step(task, state, text)
