"""Random but valid `ScoredGroup`s for stream tests, scripts and benchmarks; a local filesystem
that records which stream segments were read."""

from __future__ import annotations

import time

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from storage.stream.records import ScoredGroup


def random_group(
    rng: np.random.Generator,
    *,
    prompt_id: str = "p0",
    group_size: int = 4,
    min_len: int = 1,
    max_len: int = 32,
    prompt_len: int = 12,
    policy_version: int = 0,
    generator_id: str = "gen0",
    vocab: int = 50_000,
) -> ScoredGroup:
    """One group with random tokens, log-probs ≤ 0, mixed finish reasons and a random
    correctness per response: raw score 1 or 0, rule reward +1 or −1."""
    lengths = rng.integers(min_len, max_len + 1, size=group_size)
    truncated = lengths == max_len
    rewards = rng.choice([-1.0, 1.0], size=group_size).astype(np.float32)
    now = time.time()
    return ScoredGroup(
        prompt_id=prompt_id,
        prompt_tokens=rng.integers(0, vocab, size=prompt_len, dtype=np.int32),
        ground_truth=str(int(rng.integers(0, 100))),
        response_tokens=[rng.integers(0, vocab, size=n, dtype=np.int32) for n in lengths],
        behaviour_logprobs=[-rng.exponential(1.0, size=n).astype(np.float32) for n in lengths],
        rewards=rewards,
        raw_scores=(rewards > 0).astype(np.float32),
        truncated=truncated,
        finish_reasons=["length" if t else "stop" for t in truncated],
        policy_version=policy_version,
        generator_id=generator_id,
        created_at=now - 1.0,
        finished_at=now,
    )


class RecordingFS(LocalFileSystem):
    """The local filesystem, remembering every path it was asked to read."""

    cachable = False  # each instance keeps its own record

    def __init__(self) -> None:
        super().__init__()
        self.read_paths: list[str] = []

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.read_paths.append(path)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def segments_read(self) -> set[str]:
        """Names of the stream segments an object was read from."""
        return {
            p.split("/segments/")[1].split("/")[0] for p in self.read_paths if "/segments/" in p
        }
