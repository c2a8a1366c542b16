"""The `openenv` environment: episodes played against an OpenEnv environment server
(`generator.env.openenv`), through the relay that holds their sessions
(`streamrl.envs.openenv_server`). Needs no openenv import: the relay speaks JSON over a Unix
socket, with httpx.

    reset(task)  -> the row's messages, then the server's first observation as a user message;
                    state {"reset": the reset's fields, "episode": None, "reward": 0.0, ...}
    step(text)   -> the model's turn sent as the action {action_field: text} (cut to
                    max_action_chars, as UTF-8); the observation's new text as a user message;
                    the server's reward for the turn (recorded), added to the state's sum;
                    done when the server says so.
    score        -> the summed server rewards mapped from `reward_range` onto [0, 1]; the
                    episode's session is closed (one the generator ended early holds one).

An observation's text: the `content` of its `messages` (TextArena's), else its `prompt`, else
the observation as JSON. A server that repeats the whole history in every observation (TextArena
does) shows the model only what is new: the state keeps the length and hash of the text shown,
and a text that starts with it is cut to the rest.

One reset answers a whole group: the generator samples G episodes from its state, and a
server session cannot be shared or copied. So reset opens a session only to show the first
observation and closes it; each episode's first step opens its own, resetting with the same
fields — with a `seed` (drawn at random unless the fields give one), so every episode of the
group plays the same game — and checks it shows the same observation (else env_error: the
server's reset is not reproducible). Only what is shown can be checked: a server that ignores
the seed (OpenEnv's TextArena server does) gives the group one prompt but each episode its own
hidden state (GuessTheNumber's number), a baseline over the game's draws. A session stays
open until its episode is done or scored; one whose episode failed is closed by the relay after
`episode_timeout_s` idle.

Failures are the environment's (env_error, counted, `generator.reward.on_error`): the relay or
server unreachable or failing a call, a reward that is missing, not a number or not finite, a sum
outside `reward_range`. The reset fields are `openenv.reset`, with the row's `openenv_reset`
object merged over them (a row's seed, a game's level).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Mapping
from typing import Any

import httpx

from streamrl.envs.base import EnvContext, Environment, Message, Reset, Step, Task

__all__ = ["OpenEnvEnvironment", "observation_text"]

_ROW_RESET_FIELD = "openenv_reset"


class OpenEnvError(RuntimeError):
    """The OpenEnv server (or the relay to it) failed a call; the message says how."""


class OpenEnvEnvironment(Environment):
    """An OpenEnv server's episodes (module docstring). Settings: `context.settings`, from
    `OpenEnvService.settings`."""

    def __init__(self, context: EnvContext) -> None:
        super().__init__(context)
        settings = context.settings
        if "relay" not in settings:
            raise ValueError(
                "the openenv environment runs with generator.env.openenv set (its server and "
                "relay are started by the generator); set that section instead of fn: openenv"
            )
        self.action_field: str = settings["action_field"]
        self.max_action_chars: int = settings["max_action_chars"]
        self.reward_low, self.reward_high = (float(x) for x in settings["reward_range"])
        self.reset_fields: dict[str, Any] = dict(settings["reset"])
        transport = httpx.HTTPTransport(uds=settings["relay"])
        # The worker's deadline (call_timeout_s) ends a hung call; this one only frees a
        # worker whose relay vanished.
        self._relay = httpx.Client(
            transport=transport, base_url="http://relay", timeout=context.call_timeout_s + 5
        )

    def reset(self, task: Task) -> Reset:
        row_fields = task.row.get(_ROW_RESET_FIELD)
        fields = {**self.reset_fields, **(row_fields if isinstance(row_fields, Mapping) else {})}
        fields.setdefault("seed", secrets.randbelow(2**31))  # the group's episodes share it
        answer = self._post("/episodes", {"reset": fields})
        self._close(answer["episode"])  # each of the group's episodes opens its own (docstring)
        text = observation_text(answer.get("observation"))
        state = {"reset": fields, "episode": None, "reward": 0.0, "seen": _seen(text)}
        messages = list(task.messages)
        if text:
            messages.append({"role": "user", "content": text})
        return Reset(messages, state)

    def step(self, task: Task, state: Any, text: str) -> Step:
        episode = state["episode"] or self._open(state)
        sent = text[: self.max_action_chars].encode("utf-8", "replace").decode("utf-8")
        action = {self.action_field: sent}  # a lone surrogate is no UTF-8: sent as "?"
        answer = self._post(f"/episodes/{episode}/step", {"action": action})
        reward = _reward(answer.get("reward"))
        done = answer.get("done") is True
        shown = observation_text(answer.get("observation"))
        new = _new_part(shown, state["seen"])
        total = state["reward"] + reward
        state = {**state, "episode": episode, "reward": total, "seen": _seen(shown)}
        if done:
            return Step(state=state, done=True, reward=reward)
        messages: list[Message] = [{"role": "user", "content": new or "(no new observation)"}]
        return Step(messages, state, reward=reward)

    def _open(self, state: dict[str, Any]) -> str:
        """This episode's own session: the reset replayed, which must show what it showed."""
        answer = self._post("/episodes", {"reset": state["reset"]})
        if _seen(observation_text(answer.get("observation"))) != state["seen"]:
            self._close(answer["episode"])
            raise OpenEnvError(
                f"the OpenEnv server's reset with {state['reset']!r:.200} showed another "
                "observation the second time: a group's episodes must play the same game, so "
                "reset must be reproducible from its fields (a seed)"
            )
        return answer["episode"]

    def score(self, task: Task, state: Any, final: str) -> float:
        # An episode the generator ended (max_turns, max_tokens) still holds its session.
        if state["episode"] is not None:
            self._close(state["episode"])
        total, low, high = float(state["reward"]), self.reward_low, self.reward_high
        if not low - 1e-9 <= total <= high + 1e-9:
            raise OpenEnvError(
                f"the episode's summed OpenEnv reward {total:g} is outside "
                f"generator.env.openenv.reward_range [{low:g}, {high:g}]; set the range the "
                "environment's rewards sum to"
            )
        return min(1.0, max(0.0, (total - low) / (high - low)))

    def _close(self, episode: str) -> None:
        try:
            self._relay.delete(f"/episodes/{episode}")
        except httpx.TransportError as error:
            raise OpenEnvError(f"OpenEnv relay unreachable: {error!r:.300}") from error

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._relay.post(path, json=body)
        except httpx.TransportError as error:  # the relay is gone: the generator is stopping
            raise OpenEnvError(f"OpenEnv relay unreachable: {error!r:.300}") from error
        answer = response.json() if response.headers.get("content-type", "").startswith(
            "application/json"
        ) else {"error": response.text[:500]}  # fmt: skip
        if response.status_code != 200 or not isinstance(answer, dict):
            why = answer.get("error") if isinstance(answer, dict) else answer
            raise OpenEnvError(f"OpenEnv: {why}")
        return answer


def observation_text(observation: object) -> str:
    """What the model is shown of an observation (module docstring)."""
    if not isinstance(observation, Mapping):
        return "" if observation is None else json.dumps(observation)[:1_000_000]
    messages = observation.get("messages")
    if isinstance(messages, list):
        parts = [m.get("content") for m in messages if isinstance(m, Mapping)]
        text = "\n".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
        if text:
            return text
    prompt = observation.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return prompt.strip()
    return json.dumps(observation, default=str)


def _reward(value: object) -> float:
    """A turn's reward: a finite number (a bool counts as 0/1); anything else is an error."""
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    raise OpenEnvError(f"the OpenEnv server answered a step with reward {value!r:.60}, no number")


def _seen(text: str) -> list[object]:
    return [len(text), hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()]


def _new_part(text: str, seen: list[object]) -> str:
    """`text` less the text shown before, when it starts with it."""
    length, digest = seen
    assert isinstance(length, int)
    if 0 < length <= len(text) and _seen(text[:length])[1] == digest:
        return text[length:].strip()
    return text
