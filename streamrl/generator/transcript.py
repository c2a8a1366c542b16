"""`Transcript`: one response's exact token history across its turns, as the stream record
stores it — sampled turns (loss mask 1, behaviour log-probs, the version that sampled each
token) and the environment's tokens between them (mask 0, log-prob 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streamrl.generator.engine import Completion

__all__ = ["Transcript"]

Chunk = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass
class Transcript:
    """One response across its turns: what the stream record stores for it. `length`: its
    tokens, `sampled`: those the policy sampled (loss mask 1; the rest are the environment's).
    `ended_at`: when its episode ended (time.time())."""

    chunks: list[Chunk] = field(default_factory=list)
    length: int = 0
    sampled: int = 0
    turns: int = 0
    ended_at: float | None = None

    def add_turn(self, completion: Completion) -> None:
        n = len(completion.token_ids)
        mask = np.ones(n, np.uint8)
        self.chunks.append((completion.token_ids, completion.logprobs, mask, completion.versions))
        self.length += n
        self.sampled += n
        self.turns += 1

    def add_observation(self, token_ids: list[int]) -> None:
        """Environment tokens, with the version of the last sampled token before them."""
        n = len(token_ids)
        version = next((int(c[3][-1]) for c in reversed(self.chunks) if len(c[3])), 0)
        self.chunks.append(
            (
                np.asarray(token_ids, np.int32),
                np.zeros(n, np.float32),
                np.zeros(n, np.uint8),
                np.full(n, version, np.int64),
            )
        )
        self.length += n

    def token_ids(self) -> list[int]:
        return np.concatenate([c[0] for c in self.chunks]).tolist() if self.chunks else []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """tokens int32, log-probs float32, loss mask uint8, versions int64."""
        dtypes = (np.int32, np.float32, np.uint8, np.int64)
        if not self.chunks:
            return tuple(np.zeros(0, d) for d in dtypes)  # type: ignore[return-value]
        return tuple(  # type: ignore[return-value]
            np.concatenate([c[k] for c in self.chunks]).astype(d, copy=False)
            for k, d in enumerate(dtypes)
        )

    def without_prefix(self, n: int) -> Transcript:
        """This transcript less its first `n` tokens, which must all be environment tokens
        (an agent's conversation less its group's shared prompt)."""
        chunks, cut = [], n
        for chunk in self.chunks:
            if cut >= len(chunk[0]):
                if chunk[2].any():
                    raise ValueError("only environment tokens may be cut from a transcript")
                cut -= len(chunk[0])
                continue
            if cut and chunk[2][:cut].any():
                raise ValueError("only environment tokens may be cut from a transcript")
            chunks.append(tuple(a[cut:] for a in chunk))
            cut = 0
        return Transcript(chunks, self.length - n, self.sampled, self.turns, self.ended_at)  # type: ignore[arg-type]
