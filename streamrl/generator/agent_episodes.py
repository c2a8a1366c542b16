"""Agent groups: a prompt's G episodes, each driven by the user's agent function through the
generator's endpoint (`generator.env.agent`; `streamrl.envs.agent`).

Consumes prompts (`start`), the endpoint's requests and the engine's finished requests
(`advance`); produces ended groups as `Rollout`s, which `EpisodeDriver` scores like any other.
Per prompt, G agents run at once in one environment worker (`EnvRunner.run_agents`), each with
its own episode token; each request is matched to its episode's token history and sampled with
n = 1 (`streamrl.generator.agent_chat`); the answer goes back once sampled. Nothing here blocks:
the loop's thread serves requests between engine steps.

A group ends when all G agent runs have ended. Each episode's segments become responses of
the group (most episodes are one), whose prompt is the longest token prefix their first
requests share (the whole first request when the G agents asked alike, as they usually do).
An episode that sampled nothing (its agent never called the endpoint, every request it sent
was refused, or it failed first) has nothing to train on: it is left out and counted
(`no_request`, or its failure); a group left with no response is dropped, as a failed reset
drops an environment's. How each agent run ended is handed on with the group (`RunEnd`: why it
failed or sampled nothing, for `streamrl.generator.failures`), and one warning per group says
what became of the runs that failed or sampled nothing: left out of the group, the group
dropped, or — failed after sampling — what `generator.reward.on_error` does with them.

Whatever an agent sends, serving it never raises into the generator loop: a request refused
for a reason (`RequestRefusedError`) is answered with it; any other error while a request is
rendered, or its sampled turn answered, is answered 400 (code `episode_ended`, naming the
error), logged, and ends that episode alone as `env_error` (counted with the finish reasons;
what it sampled before is kept). The other episodes go on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np

from streamrl.config.run import RunConfig
from streamrl.data import Prompt
from streamrl.envs.agent import EPISODE_ENDED
from streamrl.envs.base import Task
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.runner import EnvRunner, Episode
from streamrl.generator.agent_chat import AgentChat, AgentEpisode
from streamrl.generator.agent_messages import RequestRefusedError
from streamrl.generator.endpoint import AgentEndpoint, Pending
from streamrl.generator.engine import Engine, FinishedGroup
from streamrl.generator.transcript import Transcript

__all__ = ["AgentGroups", "Ended", "RunEnd"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Group:
    prompt: Prompt
    key: str
    started: float
    first_version: int
    greedy: bool
    episodes: list[AgentEpisode]
    runs: list[Future[Episode]]


@dataclass(frozen=True)
class RunEnd:
    """How one agent run ended: its finish reason; `why` it failed or sampled nothing (every
    request it sent refused, and why; its error; that it never called the endpoint), "" when
    it ran through; whether it `sampled` a turn."""

    reason: str
    why: str
    sampled: bool


@dataclass(frozen=True)
class Ended:
    """A group whose agents have all ended: its responses (one per segment) and, for each, its
    episode as the runner ended it; `prompt_ids`: what they share. No response: dropped."""

    prompt: Prompt
    key: str
    started: float
    first_version: int
    greedy: bool
    prompt_ids: list[int]
    transcripts: list[Transcript]
    episodes: list[Episode]
    last_eos: list[bool]
    unsampled: list[str]  # why each episode that sampled nothing ended
    runs: list[RunEnd]  # how each agent run ended, in the group's order


class AgentGroups:
    """One generator's agent groups in flight (module docstring). Close it to stop the
    endpoint."""

    def __init__(
        self, config: RunConfig, engine: Engine, runner: EnvRunner, renderer: ChatRenderer
    ) -> None:
        self.engine, self.runner = engine, runner
        env = config.generator.env
        self.agent = (  # as warnings name it
            f"agent {env.agent!r}" if env.verifiers is None
            else f"verifiers environment {env.verifiers.env_id!r}"
        )  # fmt: skip
        self.failed_call_outcome = config.generator.reward.failed_call_outcome
        # Each agent's client holds a connection; twice the episodes that may run at once leaves
        # room for those closing, and for the agents' starts.
        generator = config.generator
        episodes = generator.prompts_in_flight * generator.largest_group_size
        self.endpoint = AgentEndpoint(config.model.path, max_connections=2 * episodes + 64)
        max_episode_tokens = config.generator.env.max_episode_tokens or config.model.max_model_len
        self.chat = AgentChat(
            renderer, config.generator, config.generator.env, runner.tool_format,
            max_episode_tokens, config.model.path,
        )  # fmt: skip
        self._groups: list[_Group] = []
        self._episodes: dict[str, AgentEpisode] = {}  # token → its episode, while it runs
        self._sampling: dict[str, tuple[AgentEpisode, Pending]] = {}  # by engine request
        self.endpoint.__enter__()

    def __len__(self) -> int:
        return len(self._groups)

    def close(self) -> None:
        """Answer every request in flight (their agents end at once, not at their timeout),
        then stop the endpoint."""
        self.drain()
        self.endpoint.close()

    def start(self, prompt: Prompt, key: str, group_size: int, greedy: bool) -> None:
        """Start `group_size` agents on `prompt` (one, greedy, for an evaluation's answer)."""
        task = Task(list(prompt.messages), prompt.ground_truth, prompt.text, prompt.row)
        episodes = [AgentEpisode(self.endpoint.open(), greedy) for _ in range(group_size)]
        for episode in episodes:
            self._episodes[episode.token] = episode
        url = self.endpoint.base_url
        runs = self.runner.run_agents(task, url, [e.token for e in episodes])
        group = _Group(prompt, key, time.time(), self.engine.policy_version, greedy, episodes, runs)
        self._groups.append(group)

    def owns(self, request_id: str) -> bool:
        return request_id in self._sampling

    def advance(self, finished: list[FinishedGroup]) -> list[Ended]:
        """Answer the requests sampled (`finished`: the engine's, of this object's requests),
        submit those that came in; the groups whose agents have all ended."""
        for group in finished:
            episode, pending = self._sampling.pop(group.request_id)
            episode.waiting = False
            try:
                answer = self.chat.reply(episode, pending.request, group.completions[0])
            except Exception as error:  # deliberate: an agent's request never stops the loop
                self._failed(episode, pending, error)
                continue
            pending.answer(200, answer)
        for pending in self.endpoint.take():
            self._serve(pending)
        ended = [g for g in self._groups if all(run.done() for run in g.runs)]
        self._groups = [g for g in self._groups if g not in ended]
        return [self._ended(g) for g in ended]

    def drain(self) -> None:
        """On stop: every group in flight is dropped (the engine's requests are aborted)."""
        self.runner.stopping = True  # its agents' runs end with the endpoint: not failures
        self._groups.clear()
        for _, pending in self._sampling.values():
            pending.refuse(503, "the generator is stopping")
        self._sampling.clear()
        for token in list(self._episodes):
            self.endpoint.close_episode(token)
        self._episodes.clear()
        for pending in self.endpoint.take():
            pending.refuse(503, "the generator is stopping")

    def _serve(self, pending: Pending) -> None:
        episode = self._episodes.get(pending.token)
        if pending.refused:  # the endpoint refused it (and answered): recorded
            if episode is not None:
                episode.refused = pending.refused
        elif episode is None:
            pending.refuse(401, "this episode has ended")
        elif pending.start:
            if episode.started:  # `streamrl.envs.agent`: a replayed call
                _refuse(episode, pending, 409, "this episode's agent already ran; a second run "
                        "is refused")  # fmt: skip
            else:
                episode.started = True
                pending.answer(200, {})
        elif episode.waiting:
            _refuse(episode, pending, 409, "one request at a time per episode: await the one in "
                    "flight")  # fmt: skip
        else:
            try:
                ids, budget = self.chat.prompt(episode, pending.request)
            except RequestRefusedError as refused:
                _refuse(episode, pending, refused.status, str(refused), refused.code)
                return
            except Exception as error:  # deliberate: an agent's request never stops the loop
                self._failed(episode, pending, error)
                return
            request = self.engine.submit(ids, greedy=episode.greedy, n=1, max_tokens=budget)
            episode.waiting = True
            self._sampling[request] = (episode, pending)

    def _failed(self, episode: AgentEpisode, pending: Pending, error: Exception) -> None:
        """A request that raised while it was served (module docstring): its episode ends as
        `env_error`, its agent is told why."""
        why = f"{type(error).__name__}: {error}"[:1000]
        log.warning("an agent's request could not be served; its episode ends (env_error): %s",
                    why, exc_info=error)  # fmt: skip
        episode.finish_reason = "env_error"
        episode.error = f"a request could not be served: {why}"
        pending.refuse(
            400, f"the request could not be served ({why}); this episode has ended", EPISODE_ENDED
        )

    def _ended(self, group: _Group) -> Ended:
        transcripts, episodes, last_eos, unsampled, runs = [], [], [], [], []
        for agent, run in zip(group.episodes, group.runs, strict=True):
            self.endpoint.close_episode(agent.token)
            self._episodes.pop(agent.token, None)
            for request, (episode, pending) in list(self._sampling.items()):
                if episode is agent:  # its agent ended while this was sampled: unseen
                    self.engine.abort(request)
                    del self._sampling[request]
                    pending.refuse(410, "this episode has ended")
            ended = run.result()
            segments = _sampled_segments(agent)
            if not segments:
                reason = ended.finish_reason or "env_error"
                if reason == "done":  # a budget refused its first request, or it sent none
                    reason = agent.finish_reason or "no_request"
                self.runner.count_finished(reason)
                unsampled.append(reason)
                runs.append(RunEnd(reason, _unsampled_why(agent, ended), sampled=False))
                continue
            reason, error = ended.finish_reason, ended.error
            if reason == "done" and agent.finish_reason is not None:
                reason, error = agent.finish_reason, agent.error  # a budget, or a failure, ended it
            failed = reason in ("env_error", "timeout")
            runs.append(RunEnd(reason or "", (error or str(reason)) if failed else "", True))
            for i, (segment, calls) in enumerate(segments):
                # The G runs start together in one worker call: their ends, so measured,
                # differ as they really did (the group's waits, `Rollout.wait_seconds`).
                segment.ended_at = group.started + ended.env_s
                last = i == len(segments) - 1
                episode = replace(
                    ended,
                    turns=segment.turns,
                    tool_calls=calls,
                    tools_offered=agent.tools_offered,
                    final=ended.final or agent.final,
                    finish_reason=reason if last else "split",
                    error=error if last else "",
                )
                transcripts.append(segment)
                episodes.append(episode)
                last_eos.append(agent.last_eos if last else True)
        prompt_ids = _shared_prefix([t.chunks[0][0] for t in transcripts])
        transcripts = [t.without_prefix(len(prompt_ids)) for t in transcripts]
        self._report(group.prompt, runs)
        return Ended(
            group.prompt, group.key, group.started, group.first_version, group.greedy,
            prompt_ids, transcripts, episodes, last_eos, unsampled, runs,
        )  # fmt: skip

    def _report(self, prompt: Prompt, runs: list[RunEnd]) -> None:
        """One warning for a group's runs that failed or sampled nothing, saying what becomes
        of them (module docstring); none when every run sampled and ran through."""
        if not any(run.sampled for run in runs):
            log.warning("%s: no run on prompt %s sampled a turn, so its group is dropped "
                        "(%s)", self.agent, prompt.prompt_id, _tally(runs))  # fmt: skip
            return
        parts = []
        if left_out := [run for run in runs if not run.sampled]:
            parts.append(f"{len(left_out)} of its runs sampled nothing and are left out of the "
                         f"group ({_tally(left_out)})")  # fmt: skip
        if failed := [run for run in runs if run.sampled and run.why]:
            parts.append(f"{len(failed)} failed after sampling ({_tally(failed)}): "
                         f"{self.failed_call_outcome}")  # fmt: skip
        if parts:
            log.warning("%s, prompt %s: %s", self.agent, prompt.prompt_id, "; ".join(parts))


def _refuse(
    episode: AgentEpisode, pending: Pending, status: int, message: str, code: str | None = None
) -> None:
    """Refuse a request of `episode`, and record why."""
    episode.refused = f"{status}: {message}"
    pending.refuse(status, message, code)


def _unsampled_why(agent: AgentEpisode, ended: Episode) -> str:
    """Why an agent run sampled nothing: every request it sent was refused, it failed (or a
    request could not be served), or it never called the endpoint."""
    if agent.refused and not agent.requests:
        return f"every request it sent was refused ({agent.refused})"
    return ended.error or agent.error or "it returned without calling the endpoint"


def _tally(runs: list[RunEnd]) -> str:
    """The runs' ends, alike ones counted: "8× env_error: it raised TypeError: ..."."""
    ends = Counter(f"{run.reason}: {run.why}" if run.why else run.reason for run in runs)
    return "; ".join(end if n == 1 else f"{n}× {end}" for end, n in ends.most_common())


def _sampled_segments(agent: AgentEpisode) -> list[tuple[Transcript, int]]:
    """The episode's segments that sampled a turn, with their tool calls, each ending on its
    last sampled turn (environment tokens after it were never followed by a sample)."""
    kept = []
    for segment, calls in zip(agent.segments, agent.segment_tool_calls, strict=True):
        if not segment.turns:
            continue
        while not segment.chunks[-1][2].any():
            dropped = segment.chunks.pop()
            segment.length -= len(dropped[0])
        kept.append((segment, calls))
    return kept


def _shared_prefix(contexts: list[np.ndarray]) -> list[int]:
    """The longest token prefix all `contexts` share (each response's first, environment
    chunk: its first request)."""
    if not contexts:
        return []
    shortest = min(len(c) for c in contexts)
    first = contexts[0][:shortest]
    for other in contexts[1:]:
        differs = np.flatnonzero(first != other[: len(first)])
        if len(differs):
            first = first[: differs[0]]
    return first.tolist()
