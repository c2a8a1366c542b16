"""The reward call inside an isolated worker (`streamrl.isolation.worker` boxes the worker in
and loads the reward): a value that is not a score in [0, 1] is turned into
`RewardValueError` here, in the worker, so only floats come back to the scorer."""

from __future__ import annotations

import numbers

from streamrl.isolation.worker import loaded, loaded_from

__all__ = ["RewardValueError", "call_reward", "check_score"]


class RewardValueError(ValueError):
    """A reward function returned something other than a score in [0, 1] or a bool."""


def check_score(value: object, fn_spec: str) -> float:
    """`value` as a float score in [0, 1]; bools and 0-d numpy/torch scalars are accepted.

    Raises:
        RewardValueError: anything else (a string, None, NaN, ±inf, 1.5, −1, 10**400).
    """
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0:
        value = value.item()  # type: ignore[attr-defined]
    # Compared as returned, before float(): a huge int would overflow. NaN fails both bounds.
    if isinstance(value, numbers.Real) and 0 <= value <= 1:
        return float(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise RewardValueError(
        f"reward {fn_spec!r} returned {shown} of type {type(value).__name__}; a reward must "
        "return a score in [0, 1] or a bool (rescale other ranges inside the function)"
    )


def call_reward(response: str, ground_truth: str, prompt: str | None) -> float:
    """One reward call; raises whatever the reward raises, or `RewardValueError`."""
    return check_score(loaded()(response, ground_truth, prompt=prompt), loaded_from())
