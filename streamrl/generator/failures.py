"""Failures of the user's code that a restart would repeat: the generator stops on them.

A generator runs the user's code — an agent (`generator.env.agent`), an environment
(`generator.env.fn`), a reward function (`generator.reward.fn`) — and lives with its failures:
a failed episode is counted, and its group dropped or scored 0 (`generator.reward.on_error`).
Code that fails the same way every time it runs (a `TypeError` in an agent, every request an
agent sends refused for the same reason, an agent that never calls the endpoint) is a bug,
not noise: a restarted generator would run it again. So `IdenticalFailures` watches each piece
of code group by group: when in each of the first `generator.identical_failed_groups_to_stop`
groups it ran in, it failed every time it ran, all with the same reason, it raises
`UserCodeFailedError` naming the code and the reason. `streamrl generator` then exits with
`USER_CODE_EXIT_CODE` and that reason as its `error:` line, and the supervisors stop the run
instead of restarting it. Groups, not calls, are counted: a group's G calls share one prompt,
so code failing on one kind of input fails on all of them at once.

Once a piece of code succeeded (once in a group is enough) the check is off for it for good: a
failure that comes and goes never stops a generator this way (groups that all fail for long
stop it as `BrokenRewardError`, and it is restarted); a group whose failures differ breaks the
run of groups alike. A timeout is neither success nor failure: how long code takes depends on
the machine; nor is an error naming a service unreachable or slow for now (a connection or
timeout error, `_TRANSIENT`): the code may be right and the service down. A failure's reason
is the error of an agent's run or an environment's call (its exception and where it was
raised), or of a score call; for an agent's run that sampled nothing, that every request it
sent was refused (and why), or that it never called the endpoint
(`streamrl.generator.agent_episodes.RunEnd`).

`UserCodeWatch` is what the episode driver (`streamrl.generator.rollouts`) tells: each agent
group as it ends, each environment reset that failed, each scored group. It also stops a
generator whose agent runs sampled nothing in `MAX_UNSAMPLED_GROUPS_IN_A_ROW` groups in a row,
whatever the reasons (`AgentSamplesNothingError`): with nothing sampled there is nothing to
train on, and a restart would sample nothing alike.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from streamrl.envs.runner import Episode, Scored
from streamrl.generator.agent_episodes import RunEnd
from streamrl.generator.config import GeneratorConfig

__all__ = [
    "MAX_UNSAMPLED_GROUPS_IN_A_ROW",
    "AgentSamplesNothingError",
    "IdenticalFailures",
    "UserCodeFailedError",
    "UserCodeWatch",
]

MAX_UNSAMPLED_GROUPS_IN_A_ROW = 32
# Failures that say nothing about the code: what it called was unreachable or slow for now (a
# reward's service down at the start). However alike, they never stop a generator this way.
_TRANSIENT = re.compile(
    r"\b\w*(?:Connect|Timeout|TimedOut|Unavailable|Unreachable)\w*\b"  # exception class names
    r"|\b(?:OSError|BrokenPipeError|HTTP 5\d\d)\b"
)


class UserCodeFailedError(RuntimeError):
    """The user's code fails as it would again after a restart; the message (one line) names
    the code, how it fails and what to change. `streamrl generator` exits `USER_CODE_EXIT_CODE`
    on it (`streamrl.supervision.policy`): the run stops, not restarted."""


class AgentSamplesNothingError(UserCodeFailedError):
    """Many groups in a row, no agent run sampled a turn before it ended."""


@dataclass
class _Code:
    succeeded: bool = False
    reason: str = ""
    groups: int = 0  # groups in a row in which it failed with `reason` every time, the latest
    times: int = 0  # its failures in those groups


class IdenticalFailures:
    """How each piece of the user's code did, group by group, by name (module docstring): `ok`
    when it ran through at least once in a group, `failed` when it failed every time it ran
    in a group with one reason, `differed` when its failures in a group had several. `limit`:
    groups alike, before any success, that stop the generator."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be ≥ 1, got {limit}")
        self.limit = limit
        self._codes: dict[str, _Code] = {}

    def ok(self, code: str) -> None:
        self._codes.setdefault(code, _Code()).succeeded = True

    def differed(self, code: str) -> None:
        state = self._codes.setdefault(code, _Code())
        state.reason, state.groups, state.times = "", 0, 0

    def failed(self, code: str, reason: str, times: int = 1) -> None:
        """`code` (named as a user reads it: "agent 'pkg.mod:fn' (generator.env.agent)")
        failed `times` times in a group, each with `reason`.

        Raises:
            UserCodeFailedError: so it did in each of its first `limit` groups.
        """
        state = self._codes.setdefault(code, _Code())
        if state.succeeded:
            return
        if _TRANSIENT.search(reason):  # a service down for now: it may answer next time
            self.differed(code)
            return
        if reason != state.reason:
            self.differed(code)
            state.reason = reason
        state.groups += 1
        state.times += times
        if state.groups >= self.limit:
            raise UserCodeFailedError(
                f"{code} failed the same way every time it ran in its first {state.groups} "
                f"groups ({state.times} times), and never succeeded: {reason}. A restart would "
                "fail alike, so the generator stops and the run with it: fix the code and "
                "start the run again (generator.identical_failed_groups_to_stop sets how many "
                "such groups stop it)"
            )


class UserCodeWatch:
    """How one generator's user code does, as its groups end (module docstring): the agent or
    environment that runs the episodes, and what scores them."""

    def __init__(self, generator: GeneratorConfig) -> None:
        env, reward = generator.env, generator.reward
        self.agent = env.episode_agent
        self.environment = env.multi_turn and env.episode_agent is None
        if env.episode_agent is not None:
            self.episode_code = env.episode_agent
        else:
            self.episode_code = f"environment {env.fn!r} (generator.env.fn)"
        if self.environment:  # its own `score`: by default the reward, in its workers
            self.score_code = f"the score of environment {env.fn!r} (reward {reward.fn!r})"
        else:
            self.score_code = f"reward {reward.fn!r} (generator.reward.fn)"
        self.identical = IdenticalFailures(generator.identical_failed_groups_to_stop)
        self._unsampled_in_a_row = 0
        self._unsampled_why: Counter[str] = Counter()  # over those groups, per run

    def agent_group(self, runs: Sequence[RunEnd]) -> None:
        """An agent group ended with `runs`.

        Raises:
            UserCodeFailedError: the agent failed the same way from the start; or
                `AgentSamplesNothingError`: its runs sampled nothing in
                `MAX_UNSAMPLED_GROUPS_IN_A_ROW` groups in a row.
        """
        self._tell(self.episode_code, [run.why or None for run in runs if run.reason != "timeout"])
        if any(run.sampled for run in runs):
            self._unsampled_in_a_row = 0
            self._unsampled_why.clear()
            return
        self._unsampled_in_a_row += 1
        self._unsampled_why.update(run.why for run in runs)
        if self._unsampled_in_a_row >= MAX_UNSAMPLED_GROUPS_IN_A_ROW:
            whys = "; ".join(f"{n}× {why}" for why, n in self._unsampled_why.most_common(3))
            raise AgentSamplesNothingError(
                f"no run of {self.agent} sampled a turn in the last "
                f"{self._unsampled_in_a_row} groups ({whys}). An agent must call "
                "client.chat.completions.create on the client it is given, with requests the "
                "endpoint serves (docs/agents.md)"
            )

    def reset_failed(self, episode: Episode) -> None:
        """An environment's reset (one per group) failed: `episode` as it ended."""
        if episode.finish_reason == "env_error":
            self.identical.failed(self.episode_code, episode.error)

    def scored(self, episodes: Sequence[Episode], scores: Sequence[Scored]) -> None:
        """A scored group's episodes (an environment's: an agent's were told by `agent_group`)
        and their score calls: none for an episode that failed, nor for an agent's that
        returned its reward (`Episode.state`)."""
        if self.environment:
            self._tell(self.episode_code, [
                episode.error if episode.finish_reason == "env_error" else None
                for episode in episodes if episode.finish_reason != "timeout"
            ])  # fmt: skip
        called = [
            scored
            for episode, scored in zip(episodes, scores, strict=True)
            if episode.finish_reason not in ("env_error", "timeout")
            and not (self.agent is not None and episode.state is not None)
        ]
        self._tell(self.score_code, [
            scored.error if scored.failure else None
            for scored in called if scored.failure != "timeout"
        ])  # fmt: skip

    def _tell(self, code: str, outcomes: list[str | None]) -> None:
        """A group's outcomes of `code`: None where it ran through, else why it failed."""
        if not outcomes:
            return
        if None in outcomes:
            self.identical.ok(code)
        elif len(set(outcomes)) > 1:
            self.identical.differed(code)
        else:
            self.identical.failed(code, str(outcomes[0]), len(outcomes))
