"""On-policy preference pairs: a run's own scored groups turned into pairs
(`preference.pairs_from`).

Within each committed group of the source run's replay stream (read with the project's stream
reader, every segment's sizes and CRC32s checked; a segment that fails is skipped, no note
written into a run this one does not own), the chosen response is the highest-reward one and
the rejected the lowest (the first of equals, in the group's order); a group whose rewards are
all equal gives no pair. Tokens are the stream's own: the prompt as the generator sent it, each
response as the policy sampled it, every token a loss token — so multi-turn groups (whose
responses hold environment tokens) are left out, and counted. Pair ids are
`<source run>:<ordinal in the stream>`.

The pairs a run trains on must not change when it resumes, while the source run may still be
writing: the first life records how far it read (`<run>/preference/pairs_from.json`: the source
and the commit record it stopped at) and every later life reads exactly that far.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

from storage.fs import Location
from storage.stream.log import read_log
from storage.stream.reader import StreamReader
from storage.stream.records import Cursor, ScoredGroup
from streamrl.data.preference import Pair, Pairs
from streamrl.data.rows import DatasetError

__all__ = ["PAIRS_FROM_FILE", "StreamPairs", "pairs_stop", "stream_pairs"]

log = logging.getLogger(__name__)

PAIRS_FROM_FILE = ("preference", "pairs_from.json")
FORMAT = "streamrl.preference.pairs_from.v1"


@dataclass(frozen=True)
class StreamPairs:
    """The pairs of a source run, and what was left out: groups without a reward difference,
    multi-turn groups, pairs too long."""

    pairs: Pairs
    groups: int
    ties: int
    multi_turn: int


def pairs_stop(source: Location, run: Location) -> int:
    """How far `run` reads `source`'s stream: the commit record an earlier life recorded, or on
    the first life the end of its commit log now (recorded). Called on one rank, its answer
    given to all."""
    stop = _recorded_stop(run, source)
    if stop is None:
        stop = sum(1 for _ in read_log(source))
        _record_stop(run, source, stop)
    return stop


def stream_pairs(source: Location, stop: int, max_tokens: int) -> StreamPairs:
    """The pairs of `source`'s stream (module docstring) up to commit record `stop`."""
    groups, _ = _groups(source, stop)
    name = source.uri.rstrip("/").rsplit("/", 1)[-1]
    pairs, ties, multi, dropped = [], 0, 0, 0
    for ordinal, group in enumerate(groups):
        if group.loss_masks is not None and any(
            not np.all(m) for m in group.loss_masks
        ):  # environment tokens: not a pair of plain responses
            multi += 1
            continue
        rewards = np.asarray(group.rewards, np.float64)
        best, worst = int(np.argmax(rewards)), int(np.argmin(rewards))
        if rewards[best] == rewards[worst]:
            ties += 1
            continue
        chosen, rejected = group.response_tokens[best], group.response_tokens[worst]
        prompt = np.asarray(group.prompt_tokens, np.int32)
        if len(prompt) + max(len(chosen), len(rejected)) > max_tokens:
            dropped += 1
            continue
        pairs.append(Pair(f"{name}:{ordinal}", prompt, np.asarray(chosen, np.int32),
                          np.asarray(rejected, np.int32)))  # fmt: skip
    if not pairs:
        raise DatasetError(
            f"the stream of {source.uri} (preference.pairs_from) gives no pair: {len(groups)} "
            f"groups, {ties} without a reward difference, {multi} multi-turn, {dropped} too long"
        )
    return StreamPairs(Pairs(pairs, dropped), len(groups), ties, multi)


def _groups(source: Location, stop: int) -> tuple[list[ScoredGroup], int]:
    """Every committed group of `source`'s stream before commit record `stop`."""
    reader = StreamReader(source, write_notes=False, max_poll_s=0.0)
    position, groups = Cursor(), []
    while position.seq < stop:
        reader.records_per_round = max(1, min(16, stop - position.seq))
        items = reader.poll(position)
        if not items:
            break
        groups.extend(g for _, g in items if isinstance(g, ScoredGroup))
        position = items[-1][0]
    return groups, position.seq


def _recorded_stop(run: Location, source: Location) -> int | None:
    """The commit record an earlier life of `run` read `source` to; None on the first life.
    A record for another source, or one that does not read, is refused naming the file."""
    path = run.join(*PAIRS_FROM_FILE)
    try:
        record = json.loads(run.fs.cat_file(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"{path} cannot be read ({exc!r}); it records how far this run read "
            "preference.pairs_from: restore it or start a new run"
        ) from None
    stop = record.get("stop") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(stop, int):
        raise DatasetError(f"{path} is not a pairs_from record; restore it or start a new run")
    if record.get("source") != source.uri:
        raise DatasetError(
            f"this run's pairs came from {record.get('source')}, not {source.uri}: "
            "preference.pairs_from cannot change on resume"
        )
    return stop


def _record_stop(run: Location, source: Location, stop: int) -> None:
    if run.is_local:
        run.fs.makedirs(run.join(PAIRS_FROM_FILE[0]), exist_ok=True)
    record = {"format": FORMAT, "source": source.uri, "stop": stop}
    run.fs.pipe_file(run.join(*PAIRS_FROM_FILE), json.dumps(record).encode())
