"""A verifiers environment's own dataset as the run's prompts: `data.path: verifiers:train`
(its `dataset`) and `verifiers:eval` (its `eval_dataset`, the held-out split `streamrl eval`
and the run's evaluator read when no other validation set is named).

The environment is `generator.env.verifiers`'s. Its rows are read by the runner that runs its
rollouts (`streamrl.envs.verifiers_env`), in one isolated worker like theirs (no credentials,
`generator.env.memory_mb`, `startup_timeout_s` to load and answer), and become ordinary dataset
rows in the verl layout `streamrl.data.datasets` reads:

    {"prompt": <the row's chat messages, its system prompt included>,
     "reward_model": {"ground_truth": {"answer": <answer>, "info": <info>} as JSON},
     "data_source": <the row's task, else the environment's id>}

so a rollout gets the row's `answer` and `info` back (`verifiers_env.example_answer`), and the
row's task is recorded per group for per-task metrics. An environment without an eval split
has no held-out rows: its `verifiers:eval` is refused, naming what to set.
"""

from __future__ import annotations

import json
from typing import Any

from streamrl.data.rows import DatasetError
from streamrl.envs.config import EnvConfig
from streamrl.envs.registry import EnvLoadError, EnvResolutionError
from streamrl.envs.verifiers_env import (
    VerifiersSpec,
    check_verifiers_env,
    load_verifiers,
    verifiers_rows,
)
from streamrl.isolation.pool import IsolatedPool

__all__ = ["VERIFIERS_PREFIX", "environment_rows"]

VERIFIERS_PREFIX = "verifiers:"
SPLITS = ("train", "eval")


def environment_rows(path: str, env: EnvConfig) -> list[dict[str, Any]] | None:
    """The rows `path` names when it is `verifiers:<split>` (module docstring), else None.

    Raises:
        DatasetError: no verifiers environment is configured, the split is unknown or empty,
            or the environment's dataset could not be read (the message says why).
    """
    if not path.startswith(VERIFIERS_PREFIX):
        return None
    split = path.removeprefix(VERIFIERS_PREFIX)
    if split not in SPLITS:
        raise DatasetError(
            f"data.path {path!r} names no split of the verifiers environment; use "
            "verifiers:train (its dataset) or verifiers:eval (its eval_dataset)"
        )
    config = env.verifiers
    if config is None:
        raise DatasetError(
            f"data.path {path!r} reads the dataset of generator.env.verifiers, which is unset; "
            "set generator.env.verifiers.env_id"
        )
    try:
        check_verifiers_env(config)
        rows, held_out = _read(env, split)
    except (EnvResolutionError, TimeoutError) as error:
        raise DatasetError(
            f"the dataset of verifiers environment {config.env_id!r}: {error}"
        ) from None
    if split == "eval" and not held_out:
        raise DatasetError(
            f"verifiers environment {config.env_id!r} has no eval split (eval_dataset); set "
            "eval.dataset.path to a held-out file, or give the environment an eval_dataset"
        )
    if not rows:
        raise DatasetError(f"verifiers environment {config.env_id!r} has no {split} rows")
    return [_row(row, config.env_id) for row in rows]


def _read(env: EnvConfig, split: str) -> tuple[list[dict[str, Any]], bool]:
    assert env.verifiers is not None
    spec = VerifiersSpec.from_config(env.verifiers, env.startup_timeout_s)
    pool = IsolatedPool(
        load_verifiers,
        spec,
        subject=f"verifiers environment {env.verifiers.env_id!r}",
        setting="generator.env",
        workers=1,
        memory_mb=env.memory_mb,
        nice=env.nice,
        startup_timeout_s=env.startup_timeout_s,
        resolution_error=EnvResolutionError,
        load_error=EnvLoadError,
    )
    with pool:
        outcome = pool.submit(verifiers_rows, split, timeout_s=env.startup_timeout_s).result()
    if outcome.failure is not None:
        why = f"{outcome.reason}: {outcome.exception}" if outcome.exception else outcome.reason
        raise EnvResolutionError(f"reading its {split} rows failed: {why}")
    return outcome.value


def _row(row: dict[str, Any], env_id: str) -> dict[str, Any]:
    truth = json.dumps({"answer": row["answer"], "info": row["info"]}, sort_keys=True)
    return {
        "prompt": row["prompt"],
        "reward_model": {"ground_truth": truth, "style": "verifiers"},
        "data_source": row["task"] or env_id,
    }
