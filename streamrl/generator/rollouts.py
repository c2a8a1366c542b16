"""Multi-turn rollouts: a prompt's G episodes driven through the engine and the environment.

Consumes prompts (`start`) and the engine's finished requests (`advance`); produces finished,
scored groups (`Rollout`s whose every episode ended and was scored). Per prompt:

1. the environment's `reset` (in its worker) gives the conversation; `ChatRenderer` renders it
   (with the environment's tools) and the engine samples turn 1 G times: the group;
2. each episode then goes on by itself: its turn's text goes to the environment's `step`; the
   observation is rendered as the chat template's delta and appended to the episode's exact
   token history, which is the next request (n = 1, at most `turn_max_tokens` and what is left
   of `max_episode_tokens`); sampled tokens have loss mask 1 and the version of the weights
   the request started with (the oldest that produced them), observation tokens mask 0;
3. an episode ends when the environment says so, after `max_turns` turns (the runner), when a
   turn is cut at its token limit or the next one would not fit `max_episode_tokens`
   (`max_tokens`), or when an environment call failed (`env_error`, `timeout`);
4. once all G have ended, each is scored by the environment (`score`, in its worker).

A group waits for its slowest episode; the budgets above bound it. Nothing here blocks: the
engine steps while environment calls run in their workers.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np

from streamrl.config import RunConfig
from streamrl.data import Prompt
from streamrl.envs.base import Task
from streamrl.envs.runner import EnvRunner, Episode, Reply, Scored
from streamrl.generator.chat import ChatRenderer
from streamrl.generator.engine import Completion, Engine, FinishedGroup

log = logging.getLogger(__name__)

__all__ = ["EpisodeDriver", "PromptTooLongError", "Rollout", "Transcript"]

MAX_TOO_LONG_IN_A_ROW = 32


class PromptTooLongError(RuntimeError):
    """The environment's first prompts do not fit the episode's token budget."""


@dataclass
class Transcript:
    """One response across its turns: what the stream record stores for it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0

    def add_turn(self, completion: Completion, version: int) -> None:
        n = len(completion.token_ids)
        self.token_ids += completion.token_ids.tolist()
        self.logprobs += completion.logprobs.tolist()
        self.loss_mask += [1] * n
        self.versions += [version] * n
        self.turns += 1

    def add_observation(self, token_ids: list[int], version: int) -> None:
        n = len(token_ids)
        self.token_ids += token_ids
        self.logprobs += [0.0] * n
        self.loss_mask += [0] * n
        self.versions += [version] * n

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """tokens int32, log-probs float32, loss mask uint8, versions int64."""
        return (
            np.asarray(self.token_ids, dtype=np.int32),
            np.asarray(self.logprobs, dtype=np.float32),
            np.asarray(self.loss_mask, dtype=np.uint8),
            np.asarray(self.versions, dtype=np.int64),
        )


@dataclass
class Rollout:
    """One prompt's group in flight: its G episodes and, at the end, their scores."""

    prompt: Prompt
    key: str  # the generator's name for it (its prompt ledger's)
    prompt_ids: list[int]
    submitted_at: float
    episodes: list[Episode] = field(default_factory=list)
    transcripts: list[Transcript] = field(default_factory=list)
    last_eos: list[bool] = field(default_factory=list)
    scores: list[Future[Scored]] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return bool(self.episodes) and all(e.done for e in self.episodes)

    @property
    def scored(self) -> bool:
        return bool(self.scores) and all(f.done() for f in self.scores)

    @property
    def policy_version(self) -> int:
        """The oldest version that produced any of its sampled tokens."""
        sampled = [
            v for t in self.transcripts for v, m in zip(t.versions, t.loss_mask, strict=True) if m
        ]
        return min(sampled, default=0)


class EpisodeDriver:
    """Drives multi-turn episodes for one generator (module docstring)."""

    def __init__(
        self, config: RunConfig, engine: Engine, runner: EnvRunner, renderer: ChatRenderer
    ) -> None:
        self.env = config.generator.env
        self.turn_max_tokens = self.env.turn_max_tokens or config.generator.max_tokens
        self.max_episode_tokens = self.env.max_episode_tokens or config.model.max_model_len
        self.engine, self.runner, self.renderer = engine, runner, renderer
        self._resets: list[tuple[Prompt, str, Future[Reply], float]] = []
        self._first: dict[str, Rollout] = {}  # turn-1 request id → its group
        self._next: dict[str, tuple[Rollout, int]] = {}  # later turns: request → (group, i)
        self._steps: list[tuple[Rollout, int, Future[Reply]]] = []
        self._rollouts: list[Rollout] = []
        self.too_long = 0  # groups dropped: their first prompt did not fit the budget
        self.dropped: list[str] = []  # keys of groups dropped (too long, failed reset)
        self._too_long_in_a_row = 0

    @property
    def groups_in_flight(self) -> int:
        """Prompts started and not yet handed back scored."""
        return len(self._resets) + len(self._rollouts)

    def start(self, prompt: Prompt, key: str) -> None:
        """Begin a group, called `key`: reset the environment for `prompt` (its first turn
        follows)."""
        task = Task(list(prompt.messages), prompt.ground_truth, prompt.text)
        self._resets.append((prompt, key, self.runner.reset(task), time.time()))

    def advance(self, finished: list[FinishedGroup]) -> list[Rollout]:
        """Take the engine's finished requests and the environment's answers as far as they
        go; the groups now finished and scored, in the order they finished."""
        self._submit_first_turns()
        for group in finished:
            if group.request_id in self._first:
                self._begin_episodes(self._first.pop(group.request_id), group)
            else:
                rollout, i = self._next.pop(group.request_id)
                self._turn_done(rollout, i, group.completions[0], group.policy_version)
        self._take_observations()
        done = []
        for rollout in list(self._rollouts):
            if rollout.ended and not rollout.scores:
                rollout.scores = [self.runner.score(e) for e in rollout.episodes]
            if rollout.scored:
                self._rollouts.remove(rollout)
                done.append(rollout)
        return done

    def abort(self) -> None:
        """Drop every group in flight (the engine's requests are aborted by the caller)."""
        self._resets.clear()
        self._first.clear()
        self._next.clear()
        self._steps.clear()
        self._rollouts.clear()

    # -- the steps of a group -------------------------------------------------------------

    def _submit_first_turns(self) -> None:
        waiting = []
        for prompt, key, future, started in self._resets:
            if not future.done():
                waiting.append((prompt, key, future, started))
                continue
            reply = future.result()
            if reply.episode.done:  # the reset failed (counted and logged by the runner)
                self.dropped.append(key)  # no turn was sampled: nothing to train on
                continue
            ids = self.renderer.prompt_ids(reply.messages, reply.tools)
            if len(ids) >= self.max_episode_tokens:
                self._drop_too_long(prompt, key, len(ids))
                continue
            self._too_long_in_a_row = 0
            rollout = Rollout(prompt, key, ids, started)
            rollout.episodes = [reply.episode] * self.engine.generator.group_size
            self._first[self.engine.submit(ids, max_tokens=self._turn_budget(0))] = rollout
            self._rollouts.append(rollout)
        self._resets = waiting

    def _drop_too_long(self, prompt: Prompt, key: str, length: int) -> None:
        """A first prompt (the environment's conversation, rendered with its tools) that leaves
        no room for a turn: its group is dropped and counted; many in a row fail."""
        self.too_long += 1
        self._too_long_in_a_row += 1
        self.dropped.append(key)
        log.warning(
            "prompt %s: the environment's first prompt is %d tokens, no room within "
            "generator.env.max_episode_tokens=%d; dropped",
            prompt.prompt_id, length, self.max_episode_tokens,
        )  # fmt: skip
        if self._too_long_in_a_row >= MAX_TOO_LONG_IN_A_ROW:
            raise PromptTooLongError(
                f"the last {self._too_long_in_a_row} prompts, rendered by environment "
                f"{self.env.fn!r} with its tools, left no room for a turn within "
                f"generator.env.max_episode_tokens={self.max_episode_tokens} (the latest: "
                f"{length} tokens). Raise model.max_model_len and generator.env."
                "max_episode_tokens, or shorten the environment's system prompt"
            )

    def _begin_episodes(self, rollout: Rollout, group: FinishedGroup) -> None:
        rollout.transcripts = [Transcript() for _ in group.completions]
        rollout.last_eos = [False] * len(group.completions)
        for i, completion in enumerate(group.completions):
            self._turn_done(rollout, i, completion, group.policy_version)

    def _turn_done(self, rollout: Rollout, i: int, completion: Completion, version: int) -> None:
        transcript = rollout.transcripts[i]
        transcript.add_turn(completion, version)
        rollout.last_eos[i] = self.renderer.ended_with_eos(completion.token_ids)
        episode = rollout.episodes[i]
        if completion.truncated:  # cut at its token limit: the episode ends as it stands
            ended = replace(episode, turns=episode.turns + 1, final=completion.text)
            rollout.episodes[i] = ended.finish("max_tokens")
            return
        self._steps.append((rollout, i, self.runner.step(episode, completion.text)))

    def _take_observations(self) -> None:
        waiting = []
        for rollout, i, future in self._steps:
            if not future.done():
                waiting.append((rollout, i, future))
                continue
            reply = future.result()
            rollout.episodes[i] = reply.episode
            if reply.episode.done:
                continue
            transcript = rollout.transcripts[i]
            ids = self.renderer.observation_ids(reply.messages, rollout.last_eos[i])
            used = len(rollout.prompt_ids) + len(transcript.token_ids) + len(ids)
            if used >= self.max_episode_tokens:
                rollout.episodes[i] = reply.episode.finish("max_tokens")
                continue
            transcript.add_observation(ids, self.engine.policy_version)
            history = rollout.prompt_ids + transcript.token_ids
            request = self.engine.submit(history, n=1, max_tokens=self._turn_budget(used))
            self._next[request] = (rollout, i)
        self._steps = waiting

    def _turn_budget(self, used: int) -> int:
        return max(1, min(self.turn_max_tokens, self.max_episode_tokens - used))
