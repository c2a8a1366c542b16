"""Each prompt's earlier rewards, for the framework guide's temporal groups (Alg. 5): learner
state, kept on every rank alike (every rank trains on the same batches) and saved in each
checkpoint, so that a resumed learner pools exactly what an uninterrupted one would.

Consumes each trained batch's groups (`record`); produces, for a new batch, the rewards of its
prompts from earlier batches (`past`): for each group, the last H rewards recorded for its
prompt (`prompt_id`) whose group was sampled at most `max_age` weight versions before the
learner's current one. Rewards that can never qualify again are dropped as the version moves
on, so the state holds at most H rewards for each prompt trained on in the last `max_age`
versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from storage.stream.records import ScoredGroup

__all__ = ["PastRewards", "RewardHistory"]


@dataclass(frozen=True)
class PastRewards:
    """Earlier rewards of a batch's prompts, `[M]` each: `rewards` float32 and `group` int64
    (the batch group whose prompt each belongs to)."""

    rewards: Tensor = field(default_factory=lambda: torch.zeros(0))
    group: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


@dataclass
class RewardHistory:
    """The last `depth` rewards of each prompt, with the policy version that sampled each."""

    depth: int
    max_age: int
    rewards: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """prompt_id → [(policy_version, reward)], oldest first."""

    def past(self, groups: Sequence[ScoredGroup], learner_version: int) -> PastRewards:
        """What each of `groups` may pool from earlier batches at `learner_version`."""
        rewards: list[float] = []
        owner: list[int] = []
        for g, group in enumerate(groups):
            usable = [
                reward
                for version, reward in self.rewards.get(group.prompt_id, ())
                if learner_version - version <= self.max_age
            ][-self.depth :]
            rewards.extend(usable)
            owner.extend([g] * len(usable))
        return PastRewards(
            torch.tensor(rewards, dtype=torch.float32), torch.tensor(owner, dtype=torch.long)
        )

    def record(self, groups: Sequence[ScoredGroup], learner_version: int) -> None:
        """Remember the rewards of `groups` (a batch just trained on, in batch order) and
        forget what is older than `max_age` versions at `learner_version`."""
        for group in groups:
            kept = self.rewards.setdefault(group.prompt_id, [])
            kept.extend((int(group.policy_version), float(r)) for r in group.rewards)
            del kept[: -self.depth]
        for prompt in list(self.rewards):
            fresh = [e for e in self.rewards[prompt] if learner_version - e[0] <= self.max_age]
            if fresh:
                self.rewards[prompt] = fresh
            else:
                del self.rewards[prompt]

    def to_record(self) -> dict[str, Any]:
        """A JSON-able record of the state; `from_record` reads it back exactly (float32
        rewards survive a float64 round trip)."""
        return {
            "depth": self.depth,
            "max_age": self.max_age,
            "rewards": {p: [list(e) for e in kept] for p, kept in self.rewards.items()},
        }

    @classmethod
    def from_record(cls, record: Any, depth: int, max_age: int) -> RewardHistory:
        """The state `to_record` wrote, checked, for a learner keeping `depth` rewards of at
        most `max_age` versions; a record of another depth or age keeps what still applies."""
        if not isinstance(record, dict) or not isinstance(record.get("rewards"), dict):
            raise ValueError(f"the reward history in the checkpoint is malformed: {record!r:.200}")
        history = cls(depth, max_age)
        for prompt, kept in record["rewards"].items():
            entries = []
            for entry in kept:
                if not (
                    isinstance(entry, list)
                    and len(entry) == 2
                    and isinstance(entry[0], int)
                    and isinstance(entry[1], int | float)
                ):
                    raise ValueError(
                        f"the reward history in the checkpoint holds {entry!r} for prompt "
                        f"{prompt!r}; expected [policy_version, reward]"
                    )
                entries.append((entry[0], float(entry[1])))
            history.rewards[str(prompt)] = entries[-depth:]
        return history
