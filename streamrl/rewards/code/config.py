"""The `generator.reward.code` section: how the `code` reward runs programs against tests
(`streamrl.rewards.code.reward`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from streamrl.config.base import Section
from streamrl.rewards.code.cases import Layout
from streamrl.rewards.code.runner import LANGUAGES, TestLimits

__all__ = ["CodeRewardConfig"]


class CodeRewardConfig(Section):
    """Programs run against a problem's tests in the box, one box per program."""

    score: Literal["all", "fraction"] = Field(
        "all",
        description="all: 1 when every test passes, else 0 (after a test that errs, times out "
        "or runs out of memory the rest are not run); fraction: the share of tests passed.",
    )
    layout: Layout = Field(
        "auto",
        description="Where the tests are in the ground truth: taco (TACO/APPS input_output), "
        "livecodebench (public_test_cases / private_test_cases), verl (a JSON string of "
        "either); auto tells them apart by shape.",
    )
    language: str = Field(
        "python",
        description="The program's language when its code fence names none: "
        + ", ".join(sorted(LANGUAGES))
        + ".",
    )
    test_timeout_s: float = Field(
        4.0,
        gt=0.0,
        le=600.0,
        description="CPU limit of each test, seconds (one waiting or sleeping is stopped after "
        "3 times it of wall clock).",
    )
    test_memory_mb: int = Field(
        512, ge=32, le=1024**2, description="Address-space limit of each test, MiB."
    )
    compile_timeout_s: float = Field(
        30.0, gt=0.0, le=600.0, description="Time to compile a program (compiled languages)."
    )

    @field_validator("language")
    @classmethod
    def _known_language(cls, value: str) -> str:
        if value not in LANGUAGES:
            raise ValueError(f"code language {value!r} is not one of {sorted(LANGUAGES)}")
        return value

    def limits(self) -> TestLimits:
        return TestLimits(self.test_timeout_s, self.test_memory_mb, 1024**2, self.compile_timeout_s)
