"""Random but valid multi-turn `ScoredGroup`s, and the same groups with their environment
tokens cut out, for the multi-turn tests."""

from __future__ import annotations

import numpy as np

from storage.stream.records import ScoredGroup
from tests.stream_data import random_group


def multi_turn_group(
    rng: np.random.Generator,
    *,
    prompt_id: str = "p0",
    group_size: int = 3,
    max_turns: int = 3,
    max_turn_len: int = 6,
    max_env_len: int = 4,
    policy_version: int = 2,
    vocab: int = 1000,
    with_turn_rewards: bool = True,
) -> ScoredGroup:
    """G responses of 1..max_turns model turns (the first: max_turns), each turn of
    1..max_turn_len sampled tokens and, between turns, 1..max_env_len environment tokens (loss
    mask 0, behaviour log-prob 0).
    Turn t of a response is sampled with version policy_version + t; an environment token
    carries the version of the turn before it. The last environment token before a turn
    repeats the last sampled token before it, so a model that looks only at the current token
    scores each sampled token the same with the environment tokens or without them."""
    base = random_group(
        rng, prompt_id=prompt_id, group_size=group_size, prompt_len=int(rng.integers(1, 6)),
        policy_version=policy_version, vocab=vocab,
    )  # fmt: skip
    tokens, logprobs, masks, versions, turn_rewards = [], [], [], [], []
    turns = rng.integers(1, max_turns + 1, size=group_size).astype(np.int32)
    turns[0] = max_turns  # at least one response with environment tokens (max_turns ≥ 2)
    for n_turns in turns:
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for t in range(n_turns):
            if t:  # the environment's answer to the previous turn
                n_env = int(rng.integers(1, max_env_len + 1))
                env = rng.integers(0, vocab, size=n_env, dtype=np.int32)
                env[-1] = parts[-1][0][-1]
                version = np.full(n_env, policy_version + t - 1, np.int64)
                parts.append((env, np.zeros(n_env, np.float32), np.zeros(n_env, np.uint8), version))
            n = int(rng.integers(1, max_turn_len + 1))
            sampled = rng.integers(0, vocab, size=n, dtype=np.int32)
            logp = -rng.exponential(1.0, size=n).astype(np.float32)
            version = np.full(n, policy_version + t, np.int64)
            parts.append((sampled, logp, np.ones(n, np.uint8), version))
        tokens.append(np.concatenate([p[0] for p in parts]))
        logprobs.append(np.concatenate([p[1] for p in parts]))
        masks.append(np.concatenate([p[2] for p in parts]))
        versions.append(np.concatenate([p[3] for p in parts]))
        n_rewards = int(n_turns) if with_turn_rewards and rng.random() < 0.5 else 0
        turn_rewards.append(rng.normal(size=n_rewards).astype(np.float32))
    fields = {**base.__dict__, "response_tokens": tokens, "behaviour_logprobs": logprobs}
    fields.update(loss_masks=masks, token_versions=versions, turns=turns)
    fields["turn_rewards"] = turn_rewards if with_turn_rewards else None
    return ScoredGroup(**fields).validate()


def without_environment_tokens(group: ScoredGroup) -> ScoredGroup:
    """The group as if its responses were only their sampled tokens: single-turn."""
    masks = [m.astype(bool) for m in group.effective_loss_masks]
    fields = {
        **group.__dict__,
        "response_tokens": [t[m] for t, m in zip(group.response_tokens, masks, strict=True)],
        "behaviour_logprobs": [
            lp[m] for lp, m in zip(group.behaviour_logprobs, masks, strict=True)
        ],
        "teacher_logprobs": None
        if group.teacher_logprobs is None
        else [lp[m] for lp, m in zip(group.teacher_logprobs, masks, strict=True)],
        "loss_masks": None,
        "token_versions": None,
        "turns": None,
        "turn_rewards": None,
    }
    return ScoredGroup(**fields).validate()
