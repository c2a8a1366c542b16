"""Algorithm configuration: one pydantic model per algorithm, joined as a discriminated union.

Each class's defaults are its paper's; `name` selects the variant.
Fields an algorithm does not use do not exist on its class, so setting one is an error that
names the field (GPG has no clip range, GRPO no value model).

Each class also carries what differs per algorithm in a learner step (its models, advantages,
loss terms and denominators): the interface is `AlgorithmBase` (`streamrl.algorithms.base`),
the algorithms live by family in `outcome`, `reinforce_pp` and `vapo`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from streamrl.algorithms.base import AlgorithmBase, KLConfig, OverlongConfig
from streamrl.algorithms.correction_config import CorrectionConfig
from streamrl.algorithms.outcome import (
    DAPOConfig,
    DrGRPOConfig,
    GPGConfig,
    GRPOConfig,
    RLOOConfig,
)
from streamrl.algorithms.reinforce_pp import ReinforcePPConfig
from streamrl.algorithms.vapo import PPOConfig, VAPOConfig
from streamrl.config.base import tagged_classes

__all__ = [
    "ALGORITHM_CLASSES",
    "ALGORITHM_NAMES",
    "AlgorithmBase",
    "AlgorithmConfig",
    "CorrectionConfig",
    "DAPOConfig",
    "DrGRPOConfig",
    "GPGConfig",
    "GRPOConfig",
    "KLConfig",
    "OverlongConfig",
    "PPOConfig",
    "RLOOConfig",
    "ReinforcePPConfig",
    "VAPOConfig",
]


AlgorithmConfig = Annotated[
    GRPOConfig
    | DrGRPOConfig
    | DAPOConfig
    | VAPOConfig
    | PPOConfig
    | RLOOConfig
    | ReinforcePPConfig
    | GPGConfig,
    Field(discriminator="name"),
]

ALGORITHM_CLASSES = tagged_classes(AlgorithmConfig, "name")
ALGORITHM_NAMES: tuple[str, ...] = tuple(ALGORITHM_CLASSES)
