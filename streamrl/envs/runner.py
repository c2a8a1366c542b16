"""`EnvRunner`: a generator's environment calls, run in isolated worker processes, one episode
at a time or thousands concurrently.

The generator drives each episode; the runner serves its calls and keeps the episode's
bookkeeping in an `Episode` record the generator holds between calls (plain, JSON-ready data:
any worker serves any call, and an episode outlives the worker that served it):

    reply = runner.reset(task).result()          # Reply: episode, messages, tools
    while not reply.episode.done:
        text = <sample a turn after reply.messages>   # the generator owns the tokens
        reply = runner.step(reply.episode, text).result()
    scored = runner.score(reply.episode).result()  # Scored: reward, turn rewards, failure

Every call returns a `concurrent.futures.Future` at once (`asyncio.wrap_future` makes it
awaitable), and calls from any number of threads share the workers, queued in the order
submitted; a future never raises for what the environment did.

The single-turn environment (`single_turn`, the default: every run's rollouts go through a
runner) runs no user code but the reward: its reset and step run inline, in the caller
(`SingleTurnEnv`: the row's prompt, done after the first turn), and its score is the reward
function in the reward scorer's workers (`generator.reward`: its workers, limits, messages and
counters), so a single-turn episode costs one reward call, as before environments existed.

Limits (`generator.env`, `streamrl.envs.config`): a reset or step call has `call_timeout_s`, and
no more than what is left of the episode's `episode_timeout_s` (the time its calls took so far,
`Episode.env_s`); a score call has `generator.reward.timeout_s`. A call that raises, answers
with something malformed (`streamrl.envs.worker`) or kills its worker ends the episode with
finish reason `env_error`, one past its limit with `timeout`; both are counted in
`EnvRunner.stats` and score 0 (`Scored.failure` says so: "error" or "timeout", as for a failed
reward call; the generator decides, as with rewards, whether to train on such a group:
`generator.reward.on_error`). A failed call is logged saying what becomes of its episode: a
failed reset's group is dropped (no turn was sampled), a failed step or score is `on_error`'s.
An agent's run that failed is counted here and reported by the generator, which alone knows
whether it sampled anything (`streamrl.generator.agent_episodes`). The runner ends an episode
after `max_turns` model turns (`max_turns`); the generator ends one that runs out of
`max_episode_tokens` (`Episode.finish("max_tokens")`). Isolation — spawned workers without
credentials, a memory limit, killed on a deadline — is the reward scorer's
(`streamrl.isolation.pool.IsolatedPool`); when a worker dies, every call in flight in that pool
at the moment fails with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

from streamrl.envs.agent import AgentResult, AgentSpec, call_agents, load_agent
from streamrl.envs.base import EnvContext, Environment, Message, SingleTurnEnv, Step, Task
from streamrl.envs.formats import TOOL_FORMATS, resolve_tool_format
from streamrl.envs.registry import EnvLoadError, EnvResolutionError, check_env_name
from streamrl.envs.verifiers_env import (
    VerifiersSpec,
    call_verifiers,
    check_verifiers_env,
    load_verifiers,
    verifiers_term_names,
)
from streamrl.envs.worker import (
    EnvSpec,
    EnvValueError,
    Started,
    call_reset,
    call_score,
    call_step,
    checked_reset,
    checked_step,
    load_environment,
)
from streamrl.isolation.pool import Failure, IsolatedPool, Outcome
from streamrl.rewards.config import RewardConfig
from streamrl.rewards.registry import check_reward_name
from streamrl.rewards.scoring import RewardScorer, Score
from streamrl.rewards.worker import RewardValueError

if TYPE_CHECKING:
    from streamrl.envs.config import EnvConfig
    from streamrl.envs.openenv_server import OpenEnvService

__all__ = ["EnvRunner", "EnvStats", "Episode", "FinishReason", "Reply", "Scored"]

log = logging.getLogger(__name__)

FinishReason = Literal["done", "max_turns", "max_tokens", "env_error", "timeout", "split"]
"""Why an episode (or an agent episode's segment) ended; `split`: an agent's segment that its
next request did not continue (`streamrl.generator.agent_chat`)."""
EnvFailure = Literal["env_error", "timeout"]
_T = TypeVar("_T")
_MALFORMED = (EnvValueError, RewardValueError)  # their message says it all: no traceback
AGENT_DEADLINE_GRACE_S = 10.0  # past episode_timeout_s, the pool kills a group's agents


@dataclass(frozen=True)
class Episode:
    """An episode between calls, held by the generator.

    `state`: the environment's own (JSON). `turns`: model turns answered so far. `env_s`:
    seconds its reset and step calls took, against `episode_timeout_s`. `final`: the model's
    latest turn. `turn_rewards[i]`: the reward `step` gave turn i, or None. `tool_calls`,
    `tool_errors`: the steps' counts, summed; `tools_offered`: whether its environment offered
    the model tools. `finish_reason`: None while it runs. `error`: why it failed (env_error,
    timeout).
    `dataclasses.asdict(episode)` is plain JSON.
    """

    task: Task
    state: Any = None
    turns: int = 0
    env_s: float = 0.0
    final: str = ""
    turn_rewards: tuple[float | None, ...] = ()
    tool_calls: int = 0
    tool_errors: int = 0
    tools_offered: bool = False
    finish_reason: FinishReason | None = None
    error: str = ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, error: str = "") -> Episode:
        """This episode ended for `reason` (the generator's: "max_tokens")."""
        if reason not in get_args(FinishReason):
            raise ValueError(f"finish reason must be one of {get_args(FinishReason)}")
        return dataclasses.replace(self, finish_reason=reason, error=error)


@dataclass(frozen=True)
class Reply:
    """The answer to a reset or step. `messages`: after a reset, the conversation to render for
    the first turn (with `tools` as the chat template's `tools=`, None for none); after a step,
    the observation to append before the next turn. Empty once `episode.done`."""

    episode: Episode
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Scored:
    """A finished episode's score. `failure` None: `reward` in [0, 1] is the environment's
    score. Else the episode ("error": finish reason env_error; "timeout") or its score call
    failed, and `reward` is 0.0; `error` says how."""

    reward: float
    turn_rewards: tuple[float | None, ...]
    finish_reason: FinishReason
    failure: Failure | None = None
    error: str = ""
    terms: dict[str, float] | None = None  # the reward's named parts (an agent's), unweighted


@dataclass
class EnvStats:
    """Counters since the runner opened. `episodes`: resets submitted; `finished`: episodes
    scored, by finish reason; `errors` / `timeouts`: calls (or episodes out of time) that
    failed so; `pool_restarts` / `failed_starts`: as for the reward scorer."""

    episodes: int = 0
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    timeouts: int = 0
    pool_restarts: int = 0
    failed_starts: int = 0


class EnvRunner:
    """Runs one environment's calls in `config.workers` isolated worker processes — or, for
    `single_turn`, inline with its scores in the reward scorer's workers (module docstring).
    Use as a context manager: the workers start and load the environment (and the reward) on
    entry, so one that cannot be loaded fails there; they stop on exit.

    `reward`: `generator.reward`, which scores episodes (by default; an environment may score
    them itself). `chat_template`: the tokenizer's, to resolve `tool_format: auto`
    (`self.tool_format`).
    """

    def __init__(
        self,
        config: EnvConfig,
        *,
        reward: RewardConfig | None = None,
        chat_template: str | None = None,
    ) -> None:
        reward = reward or RewardConfig()
        check_env_name(config.fn)  # unknown names fail here, in the caller
        check_reward_name(reward.fn)
        self.config = config
        self.reward_timeout_s = reward.timeout_s
        self.failed_call_outcome = reward.failed_call_outcome
        self.tool_format = resolve_tool_format(config.tool_format, chat_template)
        self._openenv = _openenv_service(config)  # the server and relay its workers call
        spec = EnvSpec(
            config.fn,
            reward.spec(),
            self.tool_format,
            config.observation_max_chars,
            config.call_timeout_s,
            config.memory_mb,
            self._openenv.settings if self._openenv else None,
        )
        self._inline: Environment | None = None
        self._scorer: RewardScorer | None = None
        self._pool: IsolatedPool | None = None
        if config.multi_turn:  # an agent (`streamrl.envs.agent`) or an environment
            agent, loader, what = config.agent, load_environment, spec
            if config.verifiers is not None:  # `streamrl.envs.verifiers_env`
                check_verifiers_env(config.verifiers)
                loader = load_verifiers
                what = VerifiersSpec.from_config(config.verifiers, config.startup_timeout_s)
            elif agent is not None:
                loader, what = load_agent, AgentSpec(agent)
            self._pool = IsolatedPool(
                loader,
                what,
                subject=config.episode_agent or f"environment {config.fn!r}",
                setting="generator.env",
                workers=config.workers,
                memory_mb=config.memory_mb,
                nice=config.nice,
                startup_timeout_s=config.startup_timeout_s,
                resolution_error=EnvResolutionError,
                load_error=EnvLoadError,
            )
        else:  # module docstring: inline, scored by the reward's workers
            self._inline = SingleTurnEnv(_inline_context(spec))
        if self._inline is not None or config.episode_agent is not None:  # the reward scores apart
            self._scorer = RewardScorer.from_config(reward)
        self._stats = EnvStats()
        self._term_names: tuple[str, ...] = ()  # a verifiers rubric's (`_verifiers_terms`)
        self.stopping = False  # set on stop: calls cut short by it are not failures to report
        self._lock = threading.Lock()
        self._tracebacks_logged: set[str] = set()

    @classmethod
    def from_config(
        cls, env: EnvConfig, reward: RewardConfig, chat_template: str | None
    ) -> EnvRunner:
        """A runner for `generator.env`, scoring with `generator.reward`."""
        return cls(env, reward=reward, chat_template=chat_template)

    @property
    def stats(self) -> EnvStats:
        """A snapshot of the counters."""
        with self._lock:
            snapshot = dataclasses.replace(self._stats, finished=Counter(self._stats.finished))
        if self._pool is not None:
            snapshot.pool_restarts = self._pool.restarts
            snapshot.failed_starts = self._pool.failed_starts
        else:
            assert self._scorer is not None
            scoring = self._scorer.stats
            snapshot.pool_restarts = scoring.pool_restarts
            snapshot.failed_starts = scoring.failed_starts
        return snapshot

    @property
    def worker_pids(self) -> list[int]:
        """The processes user code runs in: the environment's, or (single-turn) the reward's."""
        return [pid for w in self._workers() for pid in w.worker_pids]

    def __enter__(self) -> EnvRunner:
        with contextlib.ExitStack() as started:
            if self._openenv is not None:
                started.enter_context(self._openenv)
            for workers in self._workers():
                started.enter_context(workers)
            if self.config.verifiers is not None:
                self._term_names = self._verifiers_terms()
            started.pop_all()
        return self

    def _verifiers_terms(self) -> tuple[str, ...]:
        """The reward terms of the loaded verifiers environment's rubric: a failed episode
        scores 0 in each, so every group of the run has the same terms."""
        assert self._pool is not None
        limit = self.config.startup_timeout_s
        outcome = self._pool.submit(verifiers_term_names, timeout_s=limit).result()
        if outcome.failure is not None:
            raise EnvLoadError(f"the verifiers environment's rubric: {outcome.reason}")
        return tuple(outcome.value)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers, after the calls already submitted have ended."""
        for workers in self._workers():
            workers.close()
        if self._openenv is not None:
            self._openenv.close()

    def _workers(self) -> list[IsolatedPool | RewardScorer]:
        """The environment's (or agent's) workers, then the reward's when it scores apart."""
        return [w for w in (self._pool, self._scorer) if w is not None]

    # -- the three calls ---------------------------------------------------------------------

    def reset(self, task: Task) -> Future[Reply]:
        """Start an episode from `task`."""
        with self._lock:
            self._stats.episodes += 1
        return self._call(Episode(task), "reset", call_reset, (task,), self._started)

    def step(self, episode: Episode, text: str) -> Future[Reply]:
        """Answer the model's turn `text` in a running `episode`."""
        if episode.done:
            raise ValueError(f"step() on an episode that ended ({episode.finish_reason})")
        with self._lock:
            self._stats.steps += 1

        def stepped(episode: Episode, step: Step) -> Reply:
            return self._stepped(episode, step, text)

        args = (episode.task, episode.state, text)
        return self._call(episode, "step", call_step, args, stepped)

    def run_agents(self, task: Task, base_url: str, tokens: list[str]) -> list[Future[Episode]]:
        """Run the agent on `task` once per episode token, all at once in one worker, against
        the endpoint at `base_url` (`streamrl.envs.agent`), each within `episode_timeout_s`:
        each episode as it ended (`done`, its reward in `state["reward"]` when the agent
        returned one, its answer in `final`), or failed (`env_error`, `timeout`)."""
        assert self.config.episode_agent is not None, "run_agents() needs generator.env.agent"
        assert self._pool is not None
        with self._lock:
            self._stats.episodes += len(tokens)
        limit = self.config.episode_timeout_s
        # The runs time out in the worker first; the pool's deadline is for a worker that
        # cannot get there (a plain agent stuck in a thread, a worker that stopped answering).
        deadline = limit + AGENT_DEADLINE_GRACE_S
        call = call_verifiers if self.config.verifiers is not None else call_agents
        outcome = self._pool.submit(call, base_url, tokens, task, limit, timeout_s=deadline)
        futures: list[Future[Episode]] = [Future() for _ in tokens]

        def ended(outcome: Future[Outcome]) -> None:
            episodes = self._agent_episodes(task, len(tokens), outcome.result())
            for future, episode in zip(futures, episodes, strict=True):
                future.set_result(episode)

        outcome.add_done_callback(ended)
        return futures

    def _agent_episodes(self, task: Task, count: int, outcome: Outcome) -> list[Episode]:
        if outcome.failure is not None:  # the whole call: its worker died or never answered
            failure = "timeout" if outcome.failure == "timeout" else "env_error"
            episode = Episode(task, env_s=outcome.elapsed_s)
            return [self._agent_failed(episode, failure, _describe(outcome), count)] * count
        episodes = []
        for run in outcome.value:
            episode = Episode(task, env_s=run.elapsed_s)
            if run.failure is not None:
                episodes.append(self._agent_failed(episode, run.failure, run.error))
                continue
            result: AgentResult = run.result
            state = None if result.reward is None else {"reward": result.reward}
            if result.terms is not None:
                state = {"reward": result.reward, "terms": result.terms}
            done = dataclasses.replace(episode, state=state, final=result.final or "")
            episodes.append(done.finish("done"))
        return episodes

    def _agent_failed(self, episode: Episode, failure: str, error: str, runs: int = 1) -> Episode:
        """Count `runs` agent runs that failed alike (the generator reports them: module
        docstring)."""
        with self._lock:
            if failure == "timeout":
                self._stats.timeouts += runs
            else:
                self._stats.errors += runs
        return episode.finish("timeout" if failure == "timeout" else "env_error", error)

    def count_finished(self, reason: str) -> None:
        """Count an episode that ended without being scored (an agent's that sampled nothing:
        `no_request`, or its failure)."""
        with self._lock:
            self._stats.finished[reason] += 1

    def score(self, episode: Episode) -> Future[Scored]:
        """Score a finished `episode`: 0.0 and its failure if it failed, else the environment's
        score of its final turn."""
        if not episode.done:
            raise ValueError("score() takes a finished episode; this one is still running")
        assert episode.finish_reason is not None
        with self._lock:
            self._stats.finished[episode.finish_reason] += 1
        reason, rewards = episode.finish_reason, episode.turn_rewards
        if reason in ("env_error", "timeout"):
            failure: Failure = "timeout" if reason == "timeout" else "error"
            terms = dict.fromkeys(self._term_names, 0.0) if self._term_names else None
            return _resolved(Scored(0.0, rewards, reason, failure, episode.error, terms))
        if self.config.episode_agent is not None and episode.state is not None:  # its reward
            state = episode.state
            terms = state.get("terms")
            return _resolved(Scored(float(state["reward"]), rewards, reason, terms=terms))
        if self._scorer is not None:  # the reward function, in its workers (which log failures)
            task = episode.task
            score = self._scorer.submit(episode.final, task.ground_truth, task.prompt_text)

            def rewarded(score: Score) -> Scored:
                if score.failure is not None:
                    with self._lock:
                        if score.failure == "timeout":
                            self._stats.timeouts += 1
                        else:
                            self._stats.errors += 1
                return Scored(score.value, rewards, reason, score.failure, score.error)

            return _then(score, rewarded)
        outcome = self._pool.submit(
            call_score, episode.task, episode.state, episode.final,
            timeout_s=self.reward_timeout_s,
        )  # fmt: skip

        def scored(outcome: Outcome) -> Scored:
            if outcome.failure is None:
                return Scored(outcome.value, rewards, reason)
            failure = self._count(episode, "score", outcome)
            kind: Failure = "timeout" if failure == "timeout" else "error"
            return Scored(0.0, rewards, reason, kind, _describe(outcome))

        return _then(outcome, scored)

    # -- answers -----------------------------------------------------------------------------

    def _call(
        self,
        episode: Episode,
        what: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        answer: Callable[[Episode, Any], Reply],
    ) -> Future[Reply]:
        """Run `fn(*args)` within the episode's time left; a failure ends the episode. The
        single-turn environment answers inline."""
        if self._inline is not None:
            return _resolved(answer(episode, _inline_call(self._inline, what, args)))
        left = self.config.episode_timeout_s - episode.env_s
        if left <= 0:
            with self._lock:
                self._stats.timeouts += 1
            why = f"episode_timeout_s={self.config.episode_timeout_s:g} used up"
            return _resolved(Reply(episode.finish("timeout", why), []))
        outcome = self._pool.submit(fn, *args, timeout_s=min(self.config.call_timeout_s, left))

        def reply(outcome: Outcome) -> Reply:
            spent = dataclasses.replace(episode, env_s=episode.env_s + outcome.elapsed_s)
            if outcome.failure is None:
                return answer(spent, outcome.value)
            failure = self._count(spent, what, outcome)
            return Reply(spent.finish(failure, _describe(outcome)), [])

        return _then(outcome, reply)

    def _started(self, episode: Episode, started: Started) -> Reply:
        episode = dataclasses.replace(
            episode, state=started.state, tools_offered=started.offers_tools
        )
        return Reply(episode, started.messages, started.tools)

    def _stepped(self, episode: Episode, step: Step, text: str) -> Reply:
        episode = dataclasses.replace(
            episode,
            state=step.state,
            turns=episode.turns + 1,
            final=text,
            turn_rewards=(*episode.turn_rewards, step.reward),
            tool_calls=episode.tool_calls + step.tool_calls,
            tool_errors=episode.tool_errors + step.tool_errors,
        )
        if step.done:
            return Reply(episode.finish("done"), [])
        if episode.turns >= self.config.max_turns:
            return Reply(episode.finish("max_turns"), [])
        return Reply(episode, step.messages)

    def _count(self, episode: Episode, what: str, outcome: Outcome) -> EnvFailure:
        """Count and log a failed call; an exception's traceback is logged for the first
        failure of its type."""
        failure: EnvFailure = "timeout" if outcome.failure == "timeout" else "env_error"
        exc = outcome.exception
        with self._lock:
            if failure == "timeout":
                self._stats.timeouts += 1
            else:
                self._stats.errors += 1
            kind = type(exc).__name__
            with_traceback = exc is not None and not isinstance(exc, _MALFORMED)
            with_traceback = with_traceback and kind not in self._tracebacks_logged
            self._tracebacks_logged.add(kind)
        hint = ""
        if failure == "timeout":
            limits = "generator.reward.timeout_s" if what == "score" else (
                "generator.env.call_timeout_s / episode_timeout_s"
            )  # fmt: skip
            hint = f" Raise {limits} if such calls are legitimately slow."
        ended = {  # `streamrl.generator.rollouts`: a group whose reset failed sampled nothing
            "reset": "no turn was sampled, its group is dropped",
            "step": f"the episode ends ({failure}) and {self.failed_call_outcome}",
        }.get(what, self.failed_call_outcome)
        log.log(
            logging.DEBUG if self.stopping else logging.WARNING,
            "environment %r: a %s call failed (%s) at turn %d: %s; %s.%s",
            self.config.fn, what, failure, episode.turns, _describe(outcome), ended, hint,
            exc_info=exc if with_traceback else None,
        )  # fmt: skip
        return failure


def _openenv_service(config: EnvConfig) -> OpenEnvService | None:
    """The OpenEnv server and relay of `generator.env.openenv`, not started (imported only then:
    it needs aiohttp)."""
    if config.openenv is None:
        return None
    from streamrl.envs.openenv_server import OpenEnvService

    return OpenEnvService(
        config.openenv,
        call_timeout_s=config.call_timeout_s,
        episode_timeout_s=config.episode_timeout_s,
    )


def _inline_context(spec: EnvSpec) -> EnvContext:
    """The context of an environment run inline: its reward runs in the reward's workers."""

    def in_the_reward_workers(*args: object, **kwargs: object) -> float:
        raise RuntimeError("an inline environment scores in the reward's workers, not inline")

    return EnvContext(
        reward=in_the_reward_workers,
        reward_fn=spec.reward.fn,
        tool_format=TOOL_FORMATS[spec.tool_format],
        observation_max_chars=spec.observation_max_chars,
        call_timeout_s=spec.call_timeout_s,
        memory_mb=spec.memory_mb,
    )


def _inline_call(env: Environment, what: str, args: tuple[Any, ...]) -> Any:
    """A reset or step of an inline environment, checked as in a worker."""
    return checked_reset(env, *args) if what == "reset" else checked_step(env, *args)


def _describe(outcome: Outcome) -> str:
    exc = outcome.exception
    if isinstance(exc, _MALFORMED):
        return str(exc)
    if exc is not None:
        return f"{outcome.reason} {type(exc).__name__}: {exc}"
    return outcome.reason


def _then(outcome: Future[Outcome], convert: Callable[[Outcome], _T]) -> Future[_T]:
    """A future of `convert(outcome)`; an error in `convert` itself (a bug) is its exception."""
    result: Future[_T] = Future()

    def done(future: Future[Outcome]) -> None:
        try:
            result.set_result(convert(future.result()))
        except BaseException as error:
            result.set_exception(error)

    outcome.add_done_callback(done)
    return result


def _resolved(value: _T) -> Future[_T]:
    future: Future[_T] = Future()
    future.set_result(value)
    return future
