"""A verifiers environment, run unchanged as the agent of a generator's episodes
(`generator.env.verifiers`): its own client, multi-turn logic and tools, against the
generator's OpenAI-compatible endpoint, its rubric's reward the episode's.

verifiers and the environment's package bring dependency sets of their own, which must not
change streamrl's, so they run in a worker environment (`streamrl.envs.worker_envs`): each of
`generator.env.workers` isolated environment workers (`streamrl.envs.runner`, as for
`generator.env.agent`: no credentials, `memory_mb`, which the runner inherits) starts that
environment's Python on the self-contained `streamrl.envs.verifiers_runner`, has it
`load_environment` within `startup_timeout_s` (`load_verifiers`), and asks it to run each group
(`call_verifiers`): the G episode tokens are claimed at the endpoint here (a replayed call is
refused, as for an agent), then the runner runs one rollout per token, each with its own
client, and scores the group with the rubric (group reward functions see the whole group).

What comes back is checked; nothing from the runner is trusted. A rollout's reward must be a
finite number within `reward_range` and is mapped linearly onto [0, 1] (the agent reward that
`algorithm.reward_scale` then scales); its rubric's functions' values (`metrics`, weighted 0 or
not) become the group's reward terms, named `vf_<function>` (`AgentResult.terms`). A rollout
that raised or recorded an error (but an empty model answer: the policy's, scored as it stands,
`streamrl.envs.verifiers_runner`), a reward that is None, NaN, infinite or out of range, or
metrics that do not match the rubric's functions end that episode as `env_error` (a rollout past
`episode_timeout_s`: `timeout`), counted like any agent failure. A runner that answers
something that is no answer (not JSON, past `MAX_ANSWER_BYTES`, the wrong shape), dies, or does
not answer by the group's deadline fails the whole call (`env_error` / `timeout`) and is killed;
the next call starts a new one. A runner never outlives its worker (it dies with it, and exits
when its input closes).
"""

from __future__ import annotations

import json
import math
import numbers
import re
import selectors
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.stream.scored_group import REWARD_TERM_NAME
from streamrl.envs import verifiers_runner
from streamrl.envs.agent import AgentResult, AgentRun, _start
from streamrl.envs.base import Task
from streamrl.envs.registry import EnvLoadError, EnvResolutionError
from streamrl.envs.verifiers_config import VerifiersConfig
from streamrl.envs.worker import EnvValueError
from streamrl.envs.worker_envs import interpreter, probe_verifiers_env, worker_env_command
from streamrl.isolation.worker import loaded

__all__ = [
    "VerifiersRunner",
    "VerifiersSpec",
    "call_verifiers",
    "check_verifiers_env",
    "example_answer",
    "load_verifiers",
    "term_name",
    "verifiers_rows",
    "verifiers_term_names",
]

RUNNER = Path(verifiers_runner.__file__)
MAX_ANSWER_BYTES = 8 * 2**20
ANSWER_GRACE_S = 5.0  # past the rollouts' own limit, the runner's scoring and answer


@dataclass(frozen=True)
class VerifiersSpec:
    """What a verifiers worker loads (picklable): the worker environment's Python, the
    environment and its arguments, the reward's range, the time to load; `runner`: the
    script it runs (the shipped one)."""

    python: str
    env_id: str
    env_args: dict[str, Any] = field(default_factory=dict)
    reward_range: tuple[float, float] = (0.0, 1.0)
    startup_timeout_s: float = 120.0
    runner: str = str(RUNNER)

    @classmethod
    def from_config(cls, config: VerifiersConfig, startup_timeout_s: float) -> VerifiersSpec:
        python = str(interpreter(config.location))
        return cls(python, config.env_id, dict(config.env_args), config.reward_range,
                   startup_timeout_s)  # fmt: skip


def check_verifiers_env(config: VerifiersConfig) -> None:
    """Refuse a worker environment that is missing, holds another verifiers or lacks the
    environment's package, before anything starts; the message names the command that makes
    it."""
    location = None if config.worker_env is None else config.location
    command = worker_env_command(config.version, location, "<the environment's package>")
    found = probe_verifiers_env(config.location, config.env_id)
    if isinstance(found, str):
        raise EnvResolutionError(f"generator.env.verifiers: {found}; create it with `{command}`")
    if found.get("verifiers") != config.version:
        raise EnvResolutionError(
            f"generator.env.verifiers: the worker environment {config.location} holds verifiers "
            f"{found.get('verifiers')}, not {config.version}; install it with `{command}`"
        )
    if not found.get("module"):
        raise EnvResolutionError(
            f"generator.env.verifiers: environment {config.env_id!r} is not installed in the "
            f"worker environment {config.location}; install its package with `{command}`"
        )


def term_name(function: str) -> str:
    """The reward term a rubric function's value is stored as: `vf_` and its name, lower
    case, anything but letters, digits and '_' made '_' (`REWARD_TERM_NAME`)."""
    name = "vf_" + re.sub(r"[^a-z0-9_]", "_", function.lower())
    return name[:64]


class VerifiersRunner:
    """One worker's verifiers runner process (module docstring); `load_verifiers` makes it."""

    def __init__(self, spec: VerifiersSpec) -> None:
        self.spec = spec
        self.names: dict[str, str] = {}  # rubric function → its term
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the runner and load the environment within `startup_timeout_s`."""
        import os

        self._process = subprocess.Popen(
            [self.spec.python, "-I", self.spec.runner, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
        )  # fmt: skip
        request = {"op": "load", "env_id": self.spec.env_id, "env_args": self.spec.env_args}
        answer = self._ask(request, self.spec.startup_timeout_s)
        names = answer.get("reward_names")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise EnvValueError("the runner's load answer names no reward functions")
        terms = {name: term_name(name) for name in names}
        if len(set(terms.values())) != len(terms) or not all(
            REWARD_TERM_NAME.fullmatch(t) for t in terms.values()
        ):
            raise EnvValueError(
                f"the rubric's functions {names} do not make distinct reward term names "
                f"({sorted(terms.values())}); rename them"
            )
        self.names = terms

    def close(self) -> None:
        """Kill the runner (it holds nothing to save) and reap it."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                if pipe is not None:
                    pipe.close()
            self._process = None

    def run(self, base_url: str, tokens: list[str], task: Task, timeout_s: float) -> list[AgentRun]:
        """Run the group's rollouts (module docstring): one `AgentRun` per token, in order."""
        started = time.monotonic()
        if self._process is None:  # the last call killed it
            self.start()
        for token in tokens:
            _start(base_url, token, timeout_s)
        answer, info = example_answer(task.ground_truth)
        request = {
            "op": "run", "base_url": base_url, "tokens": tokens, "prompt": task.messages,
            "answer": answer, "info": info, "timeout_s": timeout_s,
        }  # fmt: skip
        answer = self._ask(request, timeout_s + ANSWER_GRACE_S)
        runs = answer.get("runs")
        if not isinstance(runs, list) or len(runs) != len(tokens):
            self.close()
            raise EnvValueError(f"the runner answered {len(tokens)} rollouts with {runs!r:.80}")
        elapsed = time.monotonic() - started
        return [self._checked(run, elapsed) for run in runs]

    def rows(self, split: str) -> tuple[list[dict[str, Any]], bool]:
        """The environment's training rows (`split` "train") or eval rows ("eval"), checked,
        and whether they are held out (an environment without an eval split has none)."""
        if self._process is None:
            self.start()
        answer = self._ask({"op": "rows", "split": split}, self.spec.startup_timeout_s)
        rows, held_out = answer.get("rows"), answer.get("held_out")
        if not isinstance(rows, list) or not isinstance(held_out, bool):
            raise EnvValueError(f"the runner answered rows with {rows!r:.80}")
        return [_checked_row(row, i) for i, row in enumerate(rows)], held_out

    def _ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `request`, read its answer line within `timeout_s`; a runner that fails to
        answer is killed (the next call starts another)."""
        process = self._process
        assert process is not None
        assert process.stdin is not None
        assert process.stdout is not None
        try:
            process.stdin.write(json.dumps(request, allow_nan=False).encode() + b"\n")
            process.stdin.flush()
            line = _read_line(process.stdout, timeout_s)
            answer = json.loads(line)
        except TimeoutError:
            self.close()
            raise
        except (OSError, ValueError, EOFError) as error:
            self.close()
            raise EnvValueError(f"the verifiers runner failed: {error}"[:2000]) from None
        if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
            self.close()
            raise EnvValueError(f"the verifiers runner answered {line[:80]!r}, not an answer")
        if not answer["ok"]:
            raise EnvValueError(f"the verifiers environment failed: {answer.get('error')}"[:2000])
        return answer

    def _checked(self, run: object, elapsed: float) -> AgentRun:
        if not isinstance(run, dict):
            return AgentRun(failure="env_error", error=f"a rollout's answer is {run!r:.80}")
        if run.get("timeout") is True:
            return AgentRun(
                failure="timeout", error=str(run.get("error"))[:2000], elapsed_s=elapsed
            )
        if run.get("error") is not None:
            error = f"the rollout failed: {run['error']}"[:2000]
            return AgentRun(failure="env_error", error=error, elapsed_s=elapsed)
        if run.get("ended") is True and run.get("reward") is None:  # a budget ended it: lowest
            return AgentRun(AgentResult(reward=0.0, terms=dict.fromkeys(self.names.values(), 0.0)))
        try:
            reward, terms = self._reward(run.get("reward")), self._terms(run.get("metrics"))
        except EnvValueError as error:
            return AgentRun(failure="env_error", error=str(error), elapsed_s=elapsed)
        return AgentRun(AgentResult(reward=reward, terms=terms), elapsed_s=elapsed)

    def _reward(self, value: object) -> float:
        low, high = self.spec.reward_range
        if not (isinstance(value, numbers.Real) and not isinstance(value, bool)):
            raise EnvValueError(f"the rubric's reward is {value!r:.60}, not a number")
        if not math.isfinite(value):
            raise EnvValueError(f"the rubric's reward is {value!r}, not a finite number")
        if not low <= value <= high:
            raise EnvValueError(
                f"the rubric's reward {value!r} lies outside generator.env.verifiers."
                f"reward_range [{low:g}, {high:g}]; set reward_range to the rubric's range"
            )
        return (float(value) - low) / (high - low)

    def _terms(self, metrics: object) -> dict[str, float]:
        if not isinstance(metrics, Mapping) or set(metrics) != set(self.names):
            shown = sorted(metrics) if isinstance(metrics, Mapping) else metrics
            raise EnvValueError(
                f"the rollout's metrics {shown!r:.200} are not the rubric's functions "
                f"{sorted(self.names)}"
            )
        terms = {}
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise EnvValueError(f"the rubric's {name!r} is {value!r:.60}, not a number")
            if not math.isfinite(value):
                raise EnvValueError(f"the rubric's {name!r} is {value!r}, not a finite number")
            terms[self.names[name]] = float(value)
        return terms


def load_verifiers(spec: VerifiersSpec) -> VerifiersRunner:
    """Start the worker's runner and load the environment (the pool's loader)."""
    runner = VerifiersRunner(spec)
    try:
        runner.start()
    except TimeoutError:
        runner.close()
        raise EnvLoadError(
            f"verifiers environment {spec.env_id!r} did not load within "
            f"{spec.startup_timeout_s:g}s (generator.env.startup_timeout_s)"
        ) from None
    except EnvValueError as error:
        runner.close()
        raise EnvLoadError(f"verifiers environment {spec.env_id!r}: {error}") from None
    return runner


def call_verifiers(
    base_url: str, tokens: list[str], task: Task, timeout_s: float
) -> list[AgentRun]:
    """Run the loaded environment's rollouts of one group (in a worker): every run fails alike
    when the runner does (module docstring)."""
    runner: VerifiersRunner = loaded()
    try:
        return runner.run(base_url, tokens, task, timeout_s)
    except TimeoutError:
        failed = AgentRun(failure="timeout", error=f"the runner did not answer in {timeout_s:g}s")
    except EnvValueError as error:
        failed = AgentRun(failure="env_error", error=str(error))
    return [failed] * len(tokens)


def verifiers_term_names() -> list[str]:
    """The reward terms of the loaded environment's rubric, sorted (in a worker)."""
    runner: VerifiersRunner = loaded()
    return sorted(runner.names.values())


def verifiers_rows(split: str) -> tuple[list[dict[str, Any]], bool]:
    """The loaded environment's rows of `split` (in a worker; `VerifiersRunner.rows`)."""
    runner: VerifiersRunner = loaded()
    return runner.rows(split)


def example_answer(ground_truth: str) -> tuple[str, dict[str, Any]]:
    """A rollout's `answer` and `info`: those of an environment's row (its ground truth is
    `{"answer": ..., "info": ...}` as `streamrl.envs.verifiers_data` writes it), else the ground
    truth itself, with no info."""
    if ground_truth.startswith("{"):
        try:
            record = json.loads(ground_truth)
        except ValueError:
            return ground_truth, {}
        if (
            isinstance(record, dict)
            and set(record) == {"answer", "info"}
            and isinstance(record["answer"], str)
            and isinstance(record["info"], dict)
        ):
            return record["answer"], record["info"]
    return ground_truth, {}


def _checked_row(row: object, index: int) -> dict[str, Any]:
    """One row of the environment's dataset, as the runner gave it, checked."""
    where = f"row {index} of the environment's dataset"
    if not isinstance(row, dict):
        raise EnvValueError(f"{where} is {row!r:.80}, not an object")
    prompt, answer, info, task = (row.get(k) for k in ("prompt", "answer", "info", "task"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, list) and prompt and all(_text_message(m) for m in prompt)):
        raise EnvValueError(f"{where}: its prompt must be chat messages with text contents")
    if not isinstance(info, dict):
        raise EnvValueError(f"{where}: its info is {info!r:.80}, not an object")
    answer = "" if answer is None else str(answer)
    return {"prompt": prompt, "answer": answer, "info": info, "task": str(task or "")}


def _text_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _read_line(pipe: Any, timeout_s: float) -> bytes:
    """One line from `pipe` within `timeout_s` and `MAX_ANSWER_BYTES`."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise TimeoutError(f"no answer within {timeout_s:g}s")
            chunk = pipe.read1(65536)
            if not chunk:
                raise EOFError("the runner exited")
            newline = chunk.find(b"\n")
            size += len(chunk)
            if newline >= 0 and size - len(chunk) + newline < MAX_ANSWER_BYTES:
                if newline != len(chunk) - 1:
                    raise ValueError("the runner wrote past its answer")
                chunks.append(chunk)
                return b"".join(chunks)
            if size >= MAX_ANSWER_BYTES:
                raise ValueError(f"the runner's answer exceeds {MAX_ANSWER_BYTES} bytes")
            chunks.append(chunk)
