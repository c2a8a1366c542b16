"""REINFORCE++ (Hu, 2501.03262): no critic and no group baseline; the token reward is
−β·KL_t (the behaviour policy's KL to the reference) plus R_i on the last token, its
reward-to-go is whitened over every loss token of the global batch.

REINFORCE++-baseline (`baseline: true`) subtracts the group mean reward first. Whitening uses
the unbiased variance and ε = 1e-8 inside the square root (`masked_whiten`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from streamrl.algorithms.advantages import reinforce_pp_returns
from streamrl.algorithms.base import ClippedAlgorithmBase, Responses
from streamrl.algorithms.masked import group_centred, masked_whiten_jointly

__all__ = ["ReinforcePPConfig"]


class ReinforcePPConfig(ClippedAlgorithmBase):
    """REINFORCE++ (Hu, 2501.03262): KL in the token reward, global advantage normalisation."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    baseline: bool = Field(
        False, description="REINFORCE++-baseline: subtract the group mean reward first."
    )
    paper_defaults: ClassVar[dict[str, Any]] = {
        "kl": {"estimator": "k1", "coef": 0.01, "placement": "reward"},
    }
    kl_in_reward: ClassVar[bool] = True

    @property
    def needs_groups(self) -> bool:
        return self.baseline

    @property
    def per_token_advantages(self) -> str | None:
        if self.kl is not None and self.kl.placement == "reward":
            return "the reward-to-go of its per-token KL penalty, kl.placement=reward"
        return None

    def response_outcomes(self, responses: Responses) -> Tensor:
        """R_i, less the group mean for REINFORCE++-baseline."""
        rewards = responses.rewards.float()
        if not self.baseline:
            return rewards
        return group_centred(rewards, responses.group_index, responses.num_groups)

    def token_advantages(
        self,
        outcomes: Tensor,
        mask: Tensor,
        *,
        ref_kl: Tensor | None = None,
        values: Tensor | None = None,
        policy_values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Reward-to-go of R_i − β·KL_t (`reinforce_pp_returns`; the KL only when it is placed
        in the reward), before `normalise_advantages` whitens it."""
        kl = self.kl
        if kl is None or kl.placement != "reward":
            return reinforce_pp_returns(outcomes, mask), None
        if ref_kl is None:
            raise ValueError("REINFORCE++ with the KL in the reward needs the reference's KL")
        return reinforce_pp_returns(outcomes, mask, ref_kl, kl.coef), None

    def normalise_advantages(
        self,
        advantages: Sequence[Tensor],
        masks: Sequence[Tensor],
        process_group: torch.distributed.ProcessGroup | None = None,
    ) -> list[Tensor]:
        """Whitened over the loss tokens of the whole batch, on all ranks."""
        return masked_whiten_jointly(advantages, masks, process_group=process_group)
