"""Bring your own agent: a user's agent function, run in an environment worker against the
generator's OpenAI-compatible endpoint (`streamrl.generator.endpoint`).

A user writes

    async def agent(client: openai.AsyncOpenAI, task: Task) -> str | float | None: ...

(or the same without `async`, taking an `openai.OpenAI`) at module level in an importable
module and names it by import path, `generator.env.agent = "my_pkg.agents:solve"`. `client`'s
base URL points at the generator for this one episode (its API key is the episode's token, so
no other process can sample through it); `task` is the dataset row (`Task`: `messages`,
`ground_truth`, `row`). The agent calls `client.chat.completions.create(...)` as often as it
likes (the `model` name is not read), with `tools=` for function calling; every token the
engine samples for it is recorded for training. Its return value:

- a string: its final answer, scored by the run's reward function (`generator.reward.fn`);
- None: its last assistant message is the final answer, scored so;
- a number or bool in [0, 1]: the episode's reward itself.

It runs like an environment (`streamrl.envs.base`), in one of `generator.env.workers` spawned
worker processes without credentials, under `memory_mb`: a group's G agents run in one worker
at once (async agents on one event loop, plain ones in threads: `call_agents`), so `workers`
bounds the groups whose agents run at a time. Each run is bounded by `episode_timeout_s`
(sampling included); an agent that raises, hangs or returns something else ends its episode as
`env_error` / `timeout` (left out of its group when it sampled nothing, else a failed call:
`streamrl.generator.agent_episodes`), without ending its group's other episodes. The client never
retries (a retry would sample again) and ignores proxy settings (the endpoint is on 127.0.0.1).

An episode's agent runs once: when a worker is killed (another call's deadline restarts the
pool) and the pool runs the call again, the endpoint refuses the second start and the
episodes end with what they sampled (`env_error`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import numbers
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamrl.envs.base import Task
from streamrl.envs.registry import EnvLoadError, EnvResolutionError, check_agent_name
from streamrl.envs.worker import EnvValueError
from streamrl.isolation.user_code import import_object
from streamrl.isolation.worker import loaded

__all__ = [
    "AgentResult",
    "AgentRun",
    "AgentSpec",
    "call_agents",
    "load_agent",
]

EPISODE_ENDED = "episode_ended"  # `streamrl.generator.agent_messages`'s error code for it
MAX_FINAL_CHARS = 2**20  # a returned answer is scored as text: bounded like a state


@dataclass(frozen=True)
class AgentSpec:
    """What an agent worker loads (picklable): the agent's import path."""

    fn: str


@dataclass(frozen=True)
class AgentResult:
    """What the agent returned, checked: its final answer (None: its last assistant message),
    or its reward; `terms`: named parts of that reward, stored as the group's reward terms (a
    verifiers rubric's functions: `streamrl.envs.verifiers_env`), None for none."""

    final: str | None = None
    reward: float | None = None
    terms: dict[str, float] | None = None


def load_agent(spec: AgentSpec) -> Callable[..., Any]:
    """The agent function `spec` names (the pool's loader; imports the user's module)."""
    check_agent_name(spec.fn)
    agent = import_object(spec.fn, "agent", EnvResolutionError, EnvLoadError)
    if isinstance(agent, type) or not callable(agent):
        raise EnvResolutionError(
            f"agent {spec.fn!r} is {type(agent).__name__} {agent!r:.60}, not a function; "
            "point generator.env.agent at `async def agent(client, task)` (or a plain def)"
        )
    return agent


def call_agents(base_url: str, tokens: list[str], task: Task, timeout_s: float) -> list[AgentRun]:
    """Run the loaded agent on `task` once per episode token, all at once, against the
    endpoint at `base_url` (in a worker): async agents on one event loop, plain ones in threads.
    Each run is bounded by `timeout_s` (an async agent is cancelled there; a plain one is left
    to finish in its thread, which the pool's own deadline ends with the worker). A request
    refused because a budget ended the episode ends that run as it stands."""
    agent = loaded()
    if inspect.iscoroutinefunction(agent):

        async def all_runs() -> list[AgentRun]:
            runs = [_async_run(agent, base_url, t, task, timeout_s) for t in tokens]
            return list(await asyncio.gather(*runs))

        return asyncio.run(all_runs())
    pool = concurrent.futures.ThreadPoolExecutor(len(tokens), thread_name_prefix="agent")
    try:
        futures = [pool.submit(_sync_run, agent, base_url, t, task, timeout_s) for t in tokens]
        deadline = time.monotonic() + timeout_s
        runs = []
        for future in futures:
            try:
                runs.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                runs.append(AgentRun(failure="timeout", error=f"it exceeded {timeout_s:g}s"))
        return runs
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class AgentRun:
    """One agent run's end: its `result`, or its `failure` ("env_error", "timeout") and why;
    `elapsed_s` its wall-clock time."""

    result: AgentResult | None = None
    failure: str | None = None
    error: str = ""
    elapsed_s: float = 0.0


async def _async_run(
    agent: Callable[..., Any], base_url: str, token: str, task: Task, timeout_s: float
) -> AgentRun:
    import openai

    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.to_thread(_start, base_url, token, timeout_s)
            http = openai.DefaultAsyncHttpxClient(trust_env=False)
            options = _client_options(base_url, token, timeout_s)
            async with openai.AsyncOpenAI(**options, http_client=http) as client:
                value = await agent(client, task)
        return AgentRun(_checked(value, agent), elapsed_s=time.monotonic() - started)
    except TimeoutError:
        failed = AgentRun(failure="timeout", error=f"it exceeded {timeout_s:g}s")
    except Exception as error:
        failed = _failed(error, agent)
    return dataclasses.replace(failed, elapsed_s=time.monotonic() - started)


def _sync_run(
    agent: Callable[..., Any], base_url: str, token: str, task: Task, timeout_s: float
) -> AgentRun:
    import openai

    started = time.monotonic()
    try:
        _start(base_url, token, timeout_s)
        http = openai.DefaultHttpxClient(trust_env=False)
        with openai.OpenAI(**_client_options(base_url, token, timeout_s), http_client=http) as c:
            value = agent(c, task)
        if inspect.isawaitable(value):
            raise EnvValueError(
                f"agent {_name(agent)} returned an awaitable from a plain function; make it "
                "`async def` so streamrl awaits it"
            )
        run = AgentRun(_checked(value, agent))
    except Exception as error:
        run = _failed(error, agent)
    return dataclasses.replace(run, elapsed_s=time.monotonic() - started)


def _client_options(base_url: str, token: str, timeout_s: float) -> dict[str, Any]:
    """The episode's client: its endpoint and token, no retries (a retry samples again)."""
    return {"base_url": base_url, "api_key": token, "max_retries": 0, "timeout": timeout_s}


def _failed(error: Exception, agent: Callable[..., Any]) -> AgentRun:
    if _episode_ended(error):
        return AgentRun(AgentResult())  # a budget ended the episode: scored as it stands
    if isinstance(error, EnvValueError):
        return AgentRun(failure="env_error", error=str(error))
    where = "".join(traceback.format_exception(error, limit=-3)).strip().splitlines()
    shown = " | ".join(line.strip() for line in where[-4:])
    return AgentRun(failure="env_error", error=f"it raised {type(error).__name__}: {shown}"[:2000])


def _episode_ended(error: BaseException | None) -> bool:
    """Whether `error` is (or was raised from) the endpoint's refusal of a request after a
    budget (max_turns, max_episode_tokens) ended the episode: not the agent's failure."""
    seen = 0
    while error is not None and seen < 16:
        if getattr(error, "code", None) == EPISODE_ENDED:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _start(base_url: str, token: str, timeout_s: float) -> None:
    """Claim the episode's one run at the endpoint (module docstring): a replay is refused."""
    request = urllib.request.Request(
        f"{base_url}/streamrl/start", method="POST", headers={"Authorization": f"Bearer {token}"}
    )
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        no_proxy.open(request, timeout=timeout_s).close()
    except urllib.error.HTTPError as refused:
        why = refused.read(300).decode(errors="replace")
        raise EnvValueError(f"the endpoint refused the agent's start: {why}") from None


def _checked(result: object, agent: Callable[..., Any]) -> AgentResult:
    if result is None:
        return AgentResult()
    if isinstance(result, str):
        if len(result) > MAX_FINAL_CHARS:
            raise EnvValueError(
                f"agent {_name(agent)} returned an answer of {len(result)} characters; at most "
                f"{MAX_FINAL_CHARS}"
            )
        return AgentResult(final=result)
    if isinstance(result, numbers.Real) and math.isfinite(result) and 0 <= result <= 1:
        return AgentResult(reward=float(result))
    raise EnvValueError(
        f"agent {_name(agent)} returned {type(result).__name__} {result!r:.60}; return its "
        "final answer (str, scored by generator.reward), None (its last message is scored) or "
        "a reward in [0, 1]"
    )


def _name(agent: Callable[..., Any]) -> str:
    return getattr(agent, "__qualname__", repr(agent))
