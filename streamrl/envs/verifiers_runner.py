"""The verifiers runner: runs a `verifiers` environment's rollouts inside the verifiers worker
environment, for `streamrl.envs.verifiers_env`. Self-contained (the standard library and
`verifiers` only; it never imports streamrl, which is not installed there), run by file path:

    <worker env>/bin/python -I verifiers_runner.py <parent pid>

Protocol: one JSON object per line on stdin, one answer per line on the protocol channel
(the process's stdout as it started; whatever the environment prints goes to stderr instead).
Every answer is `{"ok": true, ...}` or `{"ok": false, "error": "..."}`.

- `{"op": "load", "env_id": str, "env_args": {...}}` (first, once): `verifiers.load_environment`
  → `{"ok": true, "version": str, "reward_names": [str, ...]}`, the rubric's function names.
- `{"op": "rows", "split": "train" | "eval"}`: the environment's dataset (`get_dataset`) or
  its eval split (`get_eval_dataset`) → `{"ok": true, "rows": [{"prompt": [message, ...],
  "answer": str, "info": {...}, "task": str}, ...], "held_out": bool}`; an environment without
  an eval split answers no rows and `held_out` false (verifiers itself would fall back to the
  training rows).
- `{"op": "run", "base_url": str, "tokens": [str, ...], "prompt": [message, ...],
  "answer": str, "info": {...}, "timeout_s": float}`: one rollout per token, all at once, each
  with its own `openai.AsyncOpenAI` client (base URL `base_url`, API key the token, no retries,
  no proxy), each bounded by `timeout_s`; then the rubric scores the group together
  (`Rubric.score_group`: group reward functions see the whole group) →
  `{"ok": true, "runs": [{"reward": float | null, "metrics": {name: float}, "error": str | null,
  "timeout": bool, "ended": bool}, ...]}` in the tokens' order. `error`: the rollout raised or
  recorded an error; `ended`: the endpoint ended the episode on a budget (not a failure). A
  rollout verifiers ended on an empty model answer (no content, no tool call:
  `EmptyModelResponseError`) is the policy's doing, not a failure: it is answered as the rubric
  scored it, with no error.

The answers are checked by the streamrl side, which trusts nothing here: a request line is at
most `MAX_REQUEST_BYTES`, and errors are cut to `MAX_ERROR_CHARS`. The runner exits when its
input closes, and (Linux) when its parent dies.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
import traceback
from typing import Any

MAX_REQUEST_BYTES = 64 * 2**20
MAX_ERROR_CHARS = 2000
EPISODE_ENDED = "episode_ended"  # the endpoint's error code for a budget that ended the episode
MODEL = "policy"  # the endpoint reads no model name


class RequestError(ValueError):
    """A request that breaks the protocol."""


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the environment's prints go to stderr, never into the protocol
    sys.stdout = sys.stderr
    if len(sys.argv) == 2 and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != int(sys.argv[1]):
            os._exit(1)
    loop = asyncio.new_event_loop()
    env = None
    while True:
        line = sys.stdin.buffer.readline(MAX_REQUEST_BYTES + 1)
        if not line:
            return
        try:
            request = _request(line)
            if request["op"] == "load":
                if env is not None:
                    raise RequestError("the environment is already loaded")
                env, answer = _load(request)
            elif env is None:
                raise RequestError("load the environment first")
            elif request["op"] == "rows":
                answer = _rows(env, request)
            else:
                answer = loop.run_until_complete(_run_group(env, request))
        except Exception as error:  # deliberate: every failure is answered, never a crash
            answer = {"ok": False, "error": _describe(error)}
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()


def _request(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_REQUEST_BYTES or not line.endswith(b"\n"):
        raise RequestError(f"a request line must end with a newline within {MAX_REQUEST_BYTES}")
    request = json.loads(line)
    if not isinstance(request, dict) or request.get("op") not in ("load", "rows", "run"):
        raise RequestError("a request is an object whose op is 'load', 'rows' or 'run'")
    return request


def _load(request: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import verifiers as vf

    if not callable(getattr(vf, "load_environment", None)):
        raise RequestError(
            f"verifiers {vf.__version__} has no load_environment (its environments are the v1 "
            "tasksets); streamrl runs verifiers' environments API (verifiers 0.3.x)"
        )
    env_id, env_args = request.get("env_id"), request.get("env_args")
    if not isinstance(env_id, str) or not isinstance(env_args, dict):
        raise RequestError("load takes env_id (str) and env_args (object)")
    env = vf.load_environment(env_id, **env_args)
    names = [str(name) for name in env.rubric._get_reward_func_names()]
    return env, {"ok": True, "version": vf.__version__, "reward_names": names}


def _rows(env: Any, request: dict[str, Any]) -> dict[str, Any]:
    split = request.get("split")
    if split not in ("train", "eval"):
        raise RequestError("rows takes split, 'train' or 'eval'")
    if split == "eval":
        env.build_eval_dataset()
        if env.eval_dataset is None:
            return {"ok": True, "rows": [], "held_out": False}
        dataset = env.get_eval_dataset()
    else:
        dataset = env.get_dataset()
    rows = []
    for example in dataset:
        prompt = example.get("prompt")
        if isinstance(prompt, list):
            prompt = [{"role": str(m.get("role")), "content": m.get("content")} for m in prompt]
        rows.append({
            "prompt": prompt,
            "answer": example.get("answer"),
            "info": example.get("info") or {},
            "task": example.get("task"),
        })  # fmt: skip
    return {"ok": True, "rows": rows, "held_out": split == "eval"}


async def _run_group(env: Any, request: dict[str, Any]) -> dict[str, Any]:
    tokens, timeout_s = request.get("tokens"), request.get("timeout_s")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise RequestError("run takes tokens, a non-empty list of strings")
    if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e6:
        raise RequestError("run takes timeout_s, a positive number")
    base_url = request.get("base_url")
    if not isinstance(base_url, str):
        raise RequestError("run takes base_url, a string")
    row: dict[str, Any] = {"prompt": request.get("prompt"), "example_id": 0}
    row["answer"] = str(request.get("answer") or "")
    if isinstance(request.get("info"), dict):
        row["info"] = request["info"]
    runs = [_rollout(env, dict(row), base_url, token, timeout_s) for token in tokens]
    outcomes = await asyncio.gather(*runs)
    states = [state for state, _ in outcomes if state is not None]
    if states:
        await env.rubric.score_group(states)
        for state in states:
            await env.rubric.cleanup(state)
    return {"ok": True, "runs": [_summary(state, failure) for state, failure in outcomes]}


async def _rollout(
    env: Any, row: dict[str, Any], base_url: str, token: str, timeout_s: float
) -> tuple[Any, dict[str, Any] | None]:
    """One rollout with its own client: its state, or (None, how it failed)."""
    import httpx
    import openai
    import verifiers as vf

    http = httpx.AsyncClient(trust_env=False, timeout=timeout_s)
    native = openai.AsyncOpenAI(
        base_url=base_url, api_key=token, max_retries=0, timeout=timeout_s, http_client=http
    )
    try:
        client = vf.OpenAIChatCompletionsClient(native)
        state = await asyncio.wait_for(env.rollout(row, client, MODEL, None), timeout_s)
        return state, None
    except TimeoutError:
        return None, {"error": f"it exceeded {timeout_s:g}s", "timeout": True}
    except Exception as error:  # deliberate: the environment's failure ends its rollout alone
        if _episode_ended(error):
            return None, {"error": None, "ended": True}
        return None, {"error": _describe(error)}
    finally:
        await native.close()


def _summary(state: Any, failure: dict[str, Any] | None) -> dict[str, Any]:
    if failure is not None:
        return {"reward": None, "metrics": {}, "timeout": False, "ended": False, **failure}
    error = state.get("error")
    ended = error is not None and _episode_ended(error)
    if error is not None and _empty_answer(error):
        error = None
    metrics = state.get("metrics") or {}
    return {
        "reward": state.get("reward"),
        "metrics": {str(k): v for k, v in metrics.items()},
        "error": None if error is None or ended else _describe(error),
        "timeout": False,
        "ended": ended,
    }


def _episode_ended(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 16:
        if getattr(error, "code", None) == EPISODE_ENDED:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _empty_answer(error: BaseException) -> bool:
    """The model answered nothing verifiers can use (module docstring): an output the policy
    may well sample, so the rubric's score of it stands."""
    import verifiers as vf

    return isinstance(error, vf.EmptyModelResponseError)


def _describe(error: BaseException) -> str:
    where = "".join(traceback.format_exception(error, limit=-3)).strip().splitlines()
    shown = " | ".join(line.strip() for line in where[-4:])
    return f"{type(error).__name__}: {shown}"[:MAX_ERROR_CHARS]


if __name__ == "__main__":
    main()
