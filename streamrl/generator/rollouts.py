"""Rollouts: a prompt's G episodes driven through the engine and the environment — every group
a generator writes, single-turn or multi-turn, goes this one way.

Consumes prompts (`start`) and the engine's finished requests (`advance`); produces finished,
scored groups (`Rollout`s whose every episode ended and was scored). Per prompt:

1. the environment's `reset` gives the conversation; the engine samples turn 1 G times: the
   group. G is the generator's group-size rule's (`generator.group_size`, or adaptive:
   `streamrl.generator.group_size`) when turn 1 is submitted, and each group keeps its own. Its
   prompt is the data source's tokens when the environment kept the row's messages
   and gives no tools (always so for `single_turn`), else `ChatRenderer` renders it;
2. each episode then goes on by itself: its turn's text goes to the environment's `step`; the
   observation is rendered as the chat template's delta (its contents cut to fit
   `observation_max_tokens`) and appended to the episode's exact token history, which is the
   next request (n = 1, at most `turn_max_tokens` and what is left of `max_episode_tokens`);
   sampled tokens have loss mask 1 and the weight version that sampled each
   (`Completion.versions`), observation tokens mask 0 and the version of the turn before them;
3. an episode ends when the environment says so (`single_turn`: after its first turn, answered
   inline: `streamrl.envs.runner`), after `max_turns` turns (the runner), when a turn is cut at
   its token limit, the next one would not fit `max_episode_tokens` or an observation would
   not fit `observation_max_tokens` even with its messages emptied (`max_tokens`), or when an
   environment call failed (`env_error`, `timeout`);
4. once all G have ended, each is scored by the environment (`score`: by default the reward
   function, in isolated workers) and, with a teacher (`generator.teacher`), the group's exact
   token histories are sent to it for its log-probs (`streamrl.scorers.teacher`); the group's
   responses' sampled lengths then go to the rule.

A group waits for its slowest episode; the budgets above bound it, and the time each episode's
result waited is recorded (`Transcript.ended_at` → the record's `wait_seconds`). Nothing here
blocks: the engine steps while environment and reward calls run in their workers.

How the user's code did — each agent run, environment episode and score call — is told to
`UserCodeWatch` (`streamrl.generator.failures`): `advance` raises its `UserCodeFailedError`
when that code fails as a restart would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace

import numpy as np

from streamrl.config.run import RunConfig
from streamrl.data import Prompt
from streamrl.envs.base import Task
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.runner import EnvRunner, Episode, Reply, Scored
from streamrl.generator.agent_episodes import AgentGroups, Ended
from streamrl.generator.engine import Completion, Engine, FinishedGroup
from streamrl.generator.failures import UserCodeWatch
from streamrl.generator.transcript import Transcript
from streamrl.scorers.teacher import Teacher, TeacherScores
from streamrl.scorers.terms import ModelTermScorer, TermInput

log = logging.getLogger(__name__)

__all__ = [
    "EpisodeDriver",
    "PromptTooLongError",
    "Rollout",
    "Transcript",
]

MAX_TOO_LONG_IN_A_ROW = 32
DRAIN_SCORERS_S = 10.0  # on stop, how long the groups ended wait for their models' scores


class PromptTooLongError(RuntimeError):
    """The environment's first prompts do not fit the episode's token budget."""


@dataclass
class Rollout:
    """One prompt's group in flight: its G episodes and, at the end, their scores.
    `first_version`: the engine's weights when turn 1 was submitted (the group's version if no
    token was sampled at all)."""

    prompt: Prompt
    key: str  # the generator's name for it (its prompt ledger's)
    prompt_ids: list[int]
    submitted_at: float
    first_version: int = 0
    greedy: bool = False  # every turn sampled greedily (an evaluation's greedy answer)
    episodes: list[Episode] = field(default_factory=list)
    transcripts: list[Transcript] = field(default_factory=list)
    last_eos: list[bool] = field(default_factory=list)
    scores: list[Future[Scored]] = field(default_factory=list)
    teacher: Future[TeacherScores] | None = None  # with a teacher, once the episodes ended
    terms: dict[str, list[Future[float]]] = field(default_factory=dict)  # model reward terms

    @property
    def ended(self) -> bool:
        return bool(self.episodes) and all(e.done for e in self.episodes)

    @property
    def scored(self) -> bool:
        return bool(self.scores) and all(f.done() for f in self.calls())

    def calls(self) -> list[Future]:
        """Every scoring call of the group: its rewards, its teacher, its model terms."""
        teacher = [self.teacher] if self.teacher is not None else []
        return [*self.scores, *teacher, *(f for futures in self.terms.values() for f in futures)]

    @property
    def policy_version(self) -> int:
        """The oldest version that sampled any of its tokens."""
        sampled = [
            int(versions[mask == 1].min())
            for t in self.transcripts
            for _, _, mask, versions in t.chunks
            if mask.any()
        ]
        return min(sampled, default=self.first_version)

    def sampled_lengths(self) -> list[int]:
        """Each response's tokens sampled by the policy (environment tokens left out)."""
        return [t.sampled for t in self.transcripts]

    def wait_seconds(self) -> np.ndarray:
        """`[G]` how long each episode's result waited for the group's slowest episode."""
        ended = np.array([t.ended_at or 0.0 for t in self.transcripts], np.float64)
        return (ended.max() - ended).astype(np.float32) if len(ended) else ended


@dataclass(frozen=True)
class _Reset:
    """A group whose environment is being reset: its first turn follows."""

    prompt: Prompt
    key: str
    reply: Future[Reply]
    started: float
    group_size: int | None
    greedy: bool


class EpisodeDriver:
    """Drives one generator's rollouts (module docstring). `group_sizes`: the rule giving each
    group's G, fed every group whose episodes have ended (before its scores come back).
    `teacher`: the run's teacher, when it distils; `terms`: the reward's model terms."""

    def __init__(
        self,
        config: RunConfig,
        engine: Engine,
        runner: EnvRunner,
        teacher: Teacher | None = None,
        terms: Sequence[ModelTermScorer] = (),
    ) -> None:
        self.env = config.generator.env
        self.group_sizes = config.generator.group_size_rule()
        self.turn_max_tokens = self.env.turn_max_tokens or config.generator.max_tokens
        self.max_episode_tokens = self.env.max_episode_tokens or config.model.max_model_len
        self.engine, self.runner, self.teacher, self.terms = engine, runner, teacher, terms
        self.renderer = (
            ChatRenderer(engine.tokenizer, config.model.path) if self.env.multi_turn else None
        )
        self.agents: AgentGroups | None = None  # a user's agent drives the episodes
        if self.env.episode_agent is not None:
            assert self.renderer is not None
            self.agents = AgentGroups(config, engine, runner, self.renderer)
        self._resets: list[_Reset] = []
        self._first: dict[str, Rollout] = {}  # turn-1 request id → its group
        self._next: dict[str, tuple[Rollout, int]] = {}  # later turns: request → (group, i)
        self._steps: list[tuple[Rollout, int, Future[Reply]]] = []
        self._rollouts: list[Rollout] = []
        self.too_long = 0  # groups dropped: their first prompt did not fit the budget
        self.dropped: list[str] = []  # keys of groups dropped (too long, failed reset)
        self._too_long_in_a_row = 0
        self.user_code = UserCodeWatch(config.generator)  # failures a restart would repeat

    @property
    def groups_in_flight(self) -> int:
        """Prompts started and not yet handed back scored."""
        return len(self._resets) + len(self._rollouts) + len(self.agents or ())

    def close(self) -> None:
        """Stop the agent endpoint, if any."""
        if self.agents is not None:
            self.agents.close()

    @property
    def groups_scoring(self) -> int:
        """Groups whose episodes have all ended, waiting for their scores."""
        return sum(rollout.ended for rollout in self._rollouts)

    @property
    def groups_sampling(self) -> int:
        """Groups being reset, sampled or stepped in their environment: `groups_in_flight`
        less `groups_scoring`."""
        return self.groups_in_flight - self.groups_scoring

    def start(
        self, prompt: Prompt, key: str, *, group_size: int | None = None, greedy: bool = False
    ) -> None:
        """Begin a group, called `key`: reset the environment for `prompt` (its first turn
        follows). `group_size`: its G, instead of the rule's; `greedy`: one episode, every turn
        sampled greedily (an evaluation's greedy answer)."""
        if self.agents is not None:
            size = 1 if greedy else group_size or self.group_sizes.size()
            self.agents.start(prompt, key, size, greedy)
            return
        task = Task(list(prompt.messages), prompt.ground_truth, prompt.text, prompt.row)
        reset = self.runner.reset(task)
        self._resets.append(_Reset(prompt, key, reset, time.time(), group_size, greedy))

    def advance(self, finished: list[FinishedGroup]) -> list[Rollout]:
        """Take the engine's finished requests and the environment's answers as far as they
        go; the groups now finished and scored, in the order they finished."""
        self._submit_first_turns()
        if self.agents is not None:
            mine = [g for g in finished if self.agents.owns(g.request_id)]
            finished = [g for g in finished if not self.agents.owns(g.request_id)]
            for ended in self.agents.advance(mine):
                self._agent_group_ended(ended)
        for group in finished:
            if group.request_id in self._first:
                self._begin_episodes(self._first.pop(group.request_id), group)
            else:
                rollout, i = self._next.pop(group.request_id)
                self._turn_done(rollout, i, group.completions[0])
        self._take_observations()
        for rollout in self._rollouts:
            if rollout.ended and not rollout.scores:
                rollout.scores = [self.runner.score(e) for e in rollout.episodes]
                if self.teacher is not None:
                    arrays = [t.arrays() for t in rollout.transcripts]
                    rollout.teacher = self.teacher.score(
                        rollout.prompt_ids, [a[0] for a in arrays], [a[2] for a in arrays]
                    )
                for term in self.terms:
                    rollout.terms[term.name] = [
                        term.score(_term_input(rollout.prompt, e.final)) for e in rollout.episodes
                    ]
                # Its lengths are known now: the next group's G need not wait for its scores.
                self.group_sizes.observe(rollout.sampled_lengths())
        return self._take_scored()

    def drain(self) -> list[Rollout]:
        """On stop (the engine's requests already aborted): the groups whose episodes have all
        ended, once scored (by the models that score within `DRAIN_SCORERS_S`); every other
        group in flight is dropped."""
        if self.agents is not None:
            self.agents.drain()
        self._resets.clear()
        self._first.clear()
        self._next.clear()
        self._steps.clear()
        self._rollouts = [r for r in self._rollouts if r.scores]
        for rollout in self._rollouts:
            for future in rollout.scores:
                future.result()
        # Models that score are servers that may be down: what they have not scored by then is
        # dropped.
        wait([f for r in self._rollouts for f in r.calls()], DRAIN_SCORERS_S)
        return self._take_scored(observe=False)  # a stop asked for is not the code's failure

    def _take_scored(self, *, observe: bool = True) -> list[Rollout]:
        done = [r for r in self._rollouts if r.scored]
        self._rollouts = [r for r in self._rollouts if not r.scored]
        for rollout in done if observe else ():
            self.user_code.scored(rollout.episodes, [f.result() for f in rollout.scores])
        return done

    # -- the steps of a group -------------------------------------------------------------

    def _submit_first_turns(self) -> None:
        waiting = []
        for pending in self._resets:
            prompt, key, future = pending.prompt, pending.key, pending.reply
            if not future.done():
                waiting.append(pending)
                continue
            reply = future.result()
            if reply.episode.done:  # the reset failed (counted and logged by the runner)
                self.dropped.append(key)  # no turn was sampled: nothing to train on
                self.user_code.reset_failed(reply.episode)
                continue
            ids = self._first_prompt_ids(prompt, reply)
            if len(ids) >= self.max_episode_tokens:
                self._drop_too_long(prompt, key, len(ids))
                continue
            self._too_long_in_a_row = 0
            version = self.engine.policy_version
            rollout = Rollout(prompt, key, ids, pending.started, version, greedy=pending.greedy)
            group_size = 1 if pending.greedy else pending.group_size or self.group_sizes.size()
            rollout.episodes = [reply.episode] * group_size
            budget = self._turn_budget(len(ids))
            request = self.engine.submit(
                ids, greedy=pending.greedy, n=group_size, max_tokens=budget
            )
            self._first[request] = rollout
            self._rollouts.append(rollout)
        self._resets = waiting

    def _first_prompt_ids(self, prompt: Prompt, reply: Reply) -> list[int]:
        """The data source's tokens when the environment kept the row's conversation and gives
        no tools (so a single-turn group's prompt is exactly the data's); else the messages
        rendered with the tools."""
        if reply.tools is None and reply.messages == list(prompt.messages):
            return list(prompt.token_ids)
        assert self.renderer is not None  # a multi-turn environment: `__init__`
        return self.renderer.prompt_ids(reply.messages, reply.tools)

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
            self._turn_done(rollout, i, completion)

    def _turn_done(self, rollout: Rollout, i: int, completion: Completion) -> None:
        transcript = rollout.transcripts[i]
        transcript.add_turn(completion)
        if self.renderer is not None:
            rollout.last_eos[i] = self.renderer.ended_with_eos(completion.token_ids)
        episode = rollout.episodes[i]
        if completion.truncated:  # cut at its token limit: the episode ends as it stands
            ended = replace(episode, turns=episode.turns + 1, final=completion.text)
            self._ended(rollout, i, ended.finish("max_tokens"))
            return
        self._steps.append((rollout, i, self.runner.step(episode, completion.text)))

    def _ended(self, rollout: Rollout, i: int, episode: Episode) -> None:
        rollout.episodes[i] = episode
        rollout.transcripts[i].ended_at = time.time()

    def _take_observations(self) -> None:
        waiting = []
        for rollout, i, future in self._steps:
            if not future.done():
                waiting.append((rollout, i, future))
                continue
            reply = future.result()
            if reply.episode.done:
                self._ended(rollout, i, reply.episode)
                continue
            rollout.episodes[i] = reply.episode
            transcript = rollout.transcripts[i]
            assert self.renderer is not None  # only a multi-turn environment goes on
            ids = self.renderer.observation_ids_within(
                reply.messages, rollout.last_eos[i], self.env.observation_max_tokens
            )
            used = len(rollout.prompt_ids) + transcript.length + len(ids or ())
            if ids is None or used >= self.max_episode_tokens:
                self._ended(rollout, i, reply.episode.finish("max_tokens"))
                continue
            transcript.add_observation(ids)
            history = rollout.prompt_ids + transcript.token_ids()
            budget = self._turn_budget(used)
            request = self.engine.submit(history, greedy=rollout.greedy, n=1, max_tokens=budget)
            self._next[request] = (rollout, i)
        self._steps = waiting

    def _agent_group_ended(self, ended: Ended) -> None:
        """A group of agent episodes, all ended (`AgentGroups` logged what failed): scored like
        any other (`advance`), or dropped when no agent sampled anything. Raises
        `UserCodeFailedError` when the agent fails as a restart would (`UserCodeWatch`)."""
        self.user_code.agent_group(ended.runs)
        if not ended.transcripts:
            self.dropped.append(ended.key)
            return
        rollout = Rollout(
            ended.prompt, ended.key, ended.prompt_ids, ended.started, ended.first_version,
            greedy=ended.greedy,
        )  # fmt: skip
        rollout.episodes = ended.episodes
        rollout.transcripts = ended.transcripts
        rollout.last_eos = ended.last_eos
        self._rollouts.append(rollout)

    def _turn_budget(self, used: int) -> int:
        """Tokens the next turn may sample, with `used` tokens of the episode already used."""
        return max(1, min(self.turn_max_tokens, self.max_episode_tokens - used))


def _term_input(prompt: Prompt, response: str) -> TermInput:
    """What a model reward term sees of a response to `prompt`."""
    asked = next((m["content"] for m in reversed(prompt.messages) if m.get("role") == "user"), None)
    return TermInput(tuple(prompt.messages), asked or prompt.text, response, prompt.ground_truth)
