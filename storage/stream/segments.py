"""Replay-stream segments: many `ScoredGroup`s as one immutable Zarr v3 group.

A segment is built entirely in memory (`encode_segment` → {object key: bytes}) and uploaded
as plain objects, so it is either complete or, before its commit record exists, invisible.
Arrays are plain numeric, one chunk each; ragged data is stored flat with lengths:

    per group     [n_groups]     prompt_lengths i32, group_sizes i32, policy_versions i64,
                                 created_at f64, finished_at f64
    flat prompts  [Σ P]          prompt_tokens i32
    per response  [n_responses]  response_lengths i32, rewards f32, raw_scores f32,
                                 truncated bool, finish_reasons u8 (codes into an attribute
                                 vocabulary), turns i32, turn_reward_counts i32, tool_calls
                                 i32, tool_errors i32, env_seconds f32, wait_seconds f32
    flat tokens   [Σ L]          response_tokens i32, behaviour_logprobs f32, loss_masks u8,
                                 token_versions i64
    flat turns    [Σ T]          turn_rewards f32 (T_i = turn_reward_counts[i]: 0 or turns[i])

and, only in a segment where some group has teacher log-probs (otherwise absent):

    per group     [n_groups]     teacher_scored bool, teacher_timed bool (teacher_seconds
                                 given), teacher_seconds f64 (0 where not timed)
    flat tokens   [Σ L]          teacher_logprobs f32 (0 for a group no teacher scored)

and, only in a segment where a group's environment offered tools, the attribute
`tools_offered` (one bool per group; absent: none was), only in a segment where a group has a
task, the attributes `tasks` and `task_levels` (one string or null, one int or null per group),
and, only in a segment whose groups
have reward terms (then all of them, with the same names: one generator writes a segment with
one reward config), their names, sorted, in the attribute `reward_term_names` and

    per response  [n_responses, K]  reward_terms f32 (column k: term reward_term_names[k])

Every group is stored with its multi-turn arrays, a single-turn one with their single-turn
values (`ScoredGroup.effective_*`), and its episode statistics (0 where not recorded); decoded
groups carry them as arrays. A group's fields of scores from models decode as None where its
segment stores none for it.

Strings (prompt ids, ground truths, generator ids, the finish-reason vocabulary) live in the
group attributes, next to a CRC32 of every array's uncompressed bytes (`crc32`), checked on
decode. (The commit record separately carries a CRC32 of every stored object, checked before
decoding, so storage corruption is caught even where it breaks decompression.)

Formats: 4 (written now) as above; 3 lacks the teacher and reward-term arrays (those fields
decoded as None); 2 also lacks the episode statistics (`tool_calls`,
`tool_errors`, `env_seconds`, `wait_seconds`: decoded as None); 1, written before multi-turn
rollouts, also lacks `loss_masks`, `token_versions`, `turns`, `turn_reward_counts` and
`turn_rewards` and decodes as single-turn groups (their multi-turn fields None), so a run
written before resumes. Any other `format_version` is a `CorruptSegmentError`.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.codecs import BloscCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import MemoryStore

from storage.stream.records import ScoredGroup
from storage.stream.scored_group import EPISODE_STATS

__all__ = [
    "FORMAT_VERSION",
    "Compression",
    "CorruptSegmentError",
    "decode_segment",
    "encode_segment",
]

FORMAT_VERSION = 4
READABLE_FORMATS = (1, 2, 3, 4)
_MULTI_TURN_ARRAYS = ("loss_masks", "token_versions", "turns", "turn_reward_counts", "turn_rewards")
_TEACHER_ARRAYS = ("teacher_scored", "teacher_timed", "teacher_seconds", "teacher_logprobs")
_EPISODE_STAT_DTYPES = (np.int32, np.int32, np.float32, np.float32)
Compression = Literal["zstd", "blosc", "none"]


class CorruptSegmentError(RuntimeError):
    """A committed segment cannot be decoded or fails its checksums."""


def _compressors(compression: Compression, level: int) -> Any:
    if compression == "zstd":
        return ZstdCodec(level=level)
    if compression == "blosc":  # byte shuffle groups the high bytes of ids and log-probs
        return BloscCodec(cname="zstd", clevel=min(level, 9), shuffle="shuffle")
    if compression == "none":
        return None
    raise ValueError(f"unknown compression {compression!r}; use zstd, blosc or none")


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)


def _flat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _columns(groups: Sequence[ScoredGroup]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Flatten groups into the segment's arrays and string attributes."""
    vocab: dict[str, int] = {}
    reasons = [vocab.setdefault(r, len(vocab)) for g in groups for r in g.finish_reasons]
    if len(vocab) > 255:
        raise ValueError("more than 255 distinct finish reasons in one segment")

    responses = [t for g in groups for t in g.response_tokens]
    arrays = {
        "prompt_lengths": np.array([len(g.prompt_tokens) for g in groups], np.int32),
        "group_sizes": np.array([g.group_size for g in groups], np.int32),
        "policy_versions": np.array([g.policy_version for g in groups], np.int64),
        "created_at": np.array([g.created_at for g in groups], np.float64),
        "finished_at": np.array([g.finished_at for g in groups], np.float64),
        "prompt_tokens": _flat([np.asarray(g.prompt_tokens) for g in groups], np.int32),
        "response_lengths": np.array([len(t) for t in responses], np.int32),
        "rewards": _flat([np.asarray(g.rewards) for g in groups], np.float32),
        "raw_scores": _flat([np.asarray(g.raw_scores) for g in groups], np.float32),
        "truncated": _flat([np.asarray(g.truncated) for g in groups], np.bool_),
        "finish_reasons": np.array(reasons, np.uint8),
        "response_tokens": _flat([np.asarray(t) for t in responses], np.int32),
        "behaviour_logprobs": _flat(
            [np.asarray(lp) for g in groups for lp in g.behaviour_logprobs], np.float32
        ),
        **_multi_turn_columns(groups),
        **_teacher_columns(groups),
    }
    attrs = {
        "format_version": FORMAT_VERSION,
        "prompt_ids": [g.prompt_id for g in groups],
        "ground_truths": [g.ground_truth for g in groups],
        "generator_ids": [g.generator_id for g in groups],
        "finish_reason_vocab": list(vocab),
    }
    if any(g.reward_terms is not None for g in groups):
        attrs["reward_term_names"], arrays["reward_terms"] = _reward_term_columns(groups)
    if any(g.tools_offered for g in groups):
        attrs["tools_offered"] = [bool(g.tools_offered) for g in groups]
    if any(g.task is not None for g in groups):
        attrs["tasks"] = [g.task for g in groups]
        attrs["task_levels"] = [g.task_level for g in groups]
    return arrays, attrs


def _multi_turn_columns(groups: Sequence[ScoredGroup]) -> dict[str, np.ndarray]:
    """The multi-turn arrays; a single-turn group's as one array per group, not per response."""
    masks, versions, turn_rewards, counts = [], [], [], []
    for g in groups:
        if g.loss_masks is None:
            masks.append(np.ones(g.num_tokens, np.uint8))
        else:
            masks.extend(np.asarray(m) for m in g.loss_masks)
        if g.token_versions is None:
            versions.append(np.full(g.num_tokens, g.policy_version, np.int64))
        else:
            versions.extend(np.asarray(v) for v in g.token_versions)
        if g.turn_rewards is None:
            counts.append(np.zeros(g.group_size, np.int32))
        else:
            turn_rewards.extend(np.asarray(r) for r in g.turn_rewards)
            counts.append(np.array([len(r) for r in g.turn_rewards], np.int32))
    return {
        "loss_masks": _flat(masks, np.uint8),
        "token_versions": _flat(versions, np.int64),
        "turns": _flat([g.effective_turns for g in groups], np.int32),
        "turn_reward_counts": _flat(counts, np.int32),
        "turn_rewards": _flat(turn_rewards, np.float32),
        **{
            name: _flat([g.episode_stat(name) for g in groups], dtype)
            for name, dtype in zip(EPISODE_STATS, _EPISODE_STAT_DTYPES, strict=True)
        },
    }


def _teacher_columns(groups: Sequence[ScoredGroup]) -> dict[str, np.ndarray]:
    """The teacher arrays, when a group has teacher log-probs; none otherwise."""
    if all(g.teacher_logprobs is None for g in groups):
        return {}
    logprobs = []
    for g in groups:
        if g.teacher_logprobs is None:
            logprobs.append(np.zeros(g.num_tokens, np.float32))
        else:
            logprobs.extend(np.asarray(lp) for lp in g.teacher_logprobs)
    return {
        "teacher_scored": np.array([g.teacher_logprobs is not None for g in groups], np.bool_),
        "teacher_timed": np.array([g.teacher_seconds is not None for g in groups], np.bool_),
        "teacher_seconds": np.array([g.teacher_seconds or 0.0 for g in groups], np.float64),
        "teacher_logprobs": _flat(logprobs, np.float32),
    }


def _reward_term_columns(groups: Sequence[ScoredGroup]) -> tuple[list[str], np.ndarray]:
    """The sorted term names and `[n_responses, K]` values of groups that all have the same
    reward terms; raises ValueError naming two groups whose terms differ."""
    first = next(g for g in groups if g.reward_terms is not None)
    names = sorted(first.reward_terms)
    for g in groups:
        theirs = None if g.reward_terms is None else sorted(g.reward_terms)
        if theirs != names:
            raise ValueError(
                f"group {g.prompt_id!r} has reward terms {theirs} but group "
                f"{first.prompt_id!r} of the same segment has {names}; a segment holds groups "
                "of one reward config"
            )
    rows = [np.stack([np.asarray(g.reward_terms[n]) for n in names], axis=1) for g in groups]
    return names, np.concatenate(rows).astype(np.float32)


def encode_segment(
    groups: Sequence[ScoredGroup], compression: Compression = "blosc", level: int = 3
) -> dict[str, bytes]:
    """Validate `groups` and build their segment: {object key relative to the segment: bytes}."""
    if not groups:
        raise ValueError("a segment needs at least one group")
    for group in groups:
        group.validate()
    arrays, attrs = _columns(groups)
    attrs["crc32"] = {name: _crc(values) for name, values in arrays.items()}
    store = MemoryStore()
    sync(_write_arrays(store, arrays, attrs, _compressors(compression, level)))
    return {key: buffer.to_bytes() for key, buffer in store._store_dict.items()}


async def _write_arrays(
    store: MemoryStore, arrays: dict[str, np.ndarray], attrs: dict[str, Any], compressors: Any
) -> None:
    """All arrays in one event-loop call, compressed concurrently."""
    root = await zarr.api.asynchronous.open_group(
        store=store, mode="w", zarr_format=3, attributes=attrs
    )

    async def write(name: str, values: np.ndarray) -> None:
        array = await root.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=(max(len(values), 1), *values.shape[1:]),
            compressors=compressors,
        )
        if len(values):
            await array.setitem(slice(None), values)

    await asyncio.gather(*(write(name, values) for name, values in arrays.items()))


async def _read_arrays(store: MemoryStore) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    root = await zarr.api.asynchronous.open_group(store=store, mode="r", zarr_format=3)
    attrs = dict(root.attrs)
    if attrs.get("format_version") not in READABLE_FORMATS:
        raise CorruptSegmentError(f"unknown segment format {attrs.get('format_version')}")

    async def read(name: str) -> np.ndarray:
        array = await root.getitem(name)
        return np.asarray(await array.getitem(slice(None)))

    names = list(attrs["crc32"])
    values = await asyncio.gather(*(read(name) for name in names))
    return dict(zip(names, values, strict=True)), attrs


def decode_segment(objects: Mapping[str, bytes]) -> list[ScoredGroup]:
    """Rebuild the groups of a segment, verifying every array's CRC32 and every invariant.

    Raises `CorruptSegmentError` when anything does not decode or check out.
    """
    try:
        prototype = default_buffer_prototype()
        store = MemoryStore({k: prototype.buffer.from_bytes(v) for k, v in objects.items()})
        arrays, attrs = sync(_read_arrays(store))
    except CorruptSegmentError:
        raise
    except Exception as exc:
        raise CorruptSegmentError(f"segment does not decode: {type(exc).__name__}: {exc}") from exc
    for name, expected in attrs["crc32"].items():
        if _crc(arrays[name]) != expected:
            raise CorruptSegmentError(f"array {name!r} fails its CRC32 check")
    try:
        return _groups(arrays, attrs)
    except (ValueError, IndexError, KeyError) as exc:
        raise CorruptSegmentError(f"segment is inconsistent: {exc}") from exc


def _split(values: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    if int(lengths.sum()) != len(values):
        raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(values)} values stored")
    return np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []


def _multi_turn_fields(arrays: dict[str, np.ndarray], format_version: int) -> dict[str, Any]:
    """Per response: each multi-turn field of the segment's groups (none from format 1, whose
    groups are single-turn) and their episode statistics (from format 3)."""
    if format_version == 1:
        return {}
    expected = (*_MULTI_TURN_ARRAYS, *(EPISODE_STATS if format_version >= 3 else ()))
    missing = [name for name in expected if name not in arrays]
    if missing:
        raise KeyError(f"a format-{format_version} segment lacks {', '.join(missing)}")
    lengths = arrays["response_lengths"]
    fields = {
        "loss_masks": _split(arrays["loss_masks"], lengths),
        "token_versions": _split(arrays["token_versions"], lengths),
        "turns": arrays["turns"],
        "turn_rewards": _split(arrays["turn_rewards"], arrays["turn_reward_counts"]),
    }
    if format_version >= 3:
        fields.update((name, arrays[name]) for name in EPISODE_STATS)
    return fields


def _scores_from_models(
    arrays: dict[str, np.ndarray], attrs: dict[str, Any], bounds: np.ndarray
) -> list[dict[str, Any]]:
    """Per group: its teacher log-probs, teacher seconds and reward terms, those the segment
    stores for it (none from formats 1–3); `bounds`: each group's first response, then the end."""
    fields: list[dict[str, Any]] = [{} for _ in range(len(bounds) - 1)]
    if attrs["format_version"] < 4:
        return fields
    if any(name in arrays for name in _TEACHER_ARRAYS):
        missing = [name for name in _TEACHER_ARRAYS if name not in arrays]
        if missing:
            raise KeyError(f"a segment with teacher log-probs lacks {', '.join(missing)}")
        logprobs = _split(arrays["teacher_logprobs"], arrays["response_lengths"])
        for i, group in enumerate(fields):
            if arrays["teacher_scored"][i]:
                group["teacher_logprobs"] = logprobs[bounds[i] : bounds[i + 1]]
            if arrays["teacher_timed"][i]:
                group["teacher_seconds"] = float(arrays["teacher_seconds"][i])
    if "reward_term_names" in attrs or "reward_terms" in arrays:
        names, terms = attrs["reward_term_names"], arrays["reward_terms"]
        if terms.shape != (bounds[-1], len(names)):
            raise ValueError(
                f"reward_terms has shape {terms.shape} but the segment has {bounds[-1]} "
                f"responses and {len(names)} reward terms"
            )
        for i, group in enumerate(fields):
            rows = terms[bounds[i] : bounds[i + 1]]
            group["reward_terms"] = {name: rows[:, k] for k, name in enumerate(names)}
    return fields


def _groups(arrays: dict[str, np.ndarray], attrs: dict[str, Any]) -> list[ScoredGroup]:
    sizes = arrays["group_sizes"]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    vocab = attrs["finish_reason_vocab"]
    prompts = _split(arrays["prompt_tokens"], arrays["prompt_lengths"])
    tokens = _split(arrays["response_tokens"], arrays["response_lengths"])
    logprobs = _split(arrays["behaviour_logprobs"], arrays["response_lengths"])
    multi_turn = _multi_turn_fields(arrays, attrs["format_version"])
    scores = _scores_from_models(arrays, attrs, bounds)
    offered = attrs.get("tools_offered", [False] * len(sizes))
    if len(offered) != len(sizes) or not all(isinstance(o, bool) for o in offered):
        raise ValueError(
            f"tools_offered must be one bool per group ({len(sizes)}), got {offered!r:.80}"
        )
    tasks = _per_group(attrs, "tasks", len(sizes), str)
    levels = _per_group(attrs, "task_levels", len(sizes), int)
    groups = []
    for i in range(len(sizes)):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        group = ScoredGroup(
            prompt_id=attrs["prompt_ids"][i],
            prompt_tokens=prompts[i],
            ground_truth=attrs["ground_truths"][i],
            response_tokens=tokens[lo:hi],
            behaviour_logprobs=logprobs[lo:hi],
            rewards=arrays["rewards"][lo:hi],
            raw_scores=arrays["raw_scores"][lo:hi],
            truncated=arrays["truncated"][lo:hi],
            finish_reasons=[vocab[c] for c in arrays["finish_reasons"][lo:hi]],
            policy_version=int(arrays["policy_versions"][i]),
            generator_id=attrs["generator_ids"][i],
            created_at=float(arrays["created_at"][i]),
            finished_at=float(arrays["finished_at"][i]),
            **{name: values[lo:hi] for name, values in multi_turn.items()},
            **scores[i],
            tools_offered=offered[i],
            task=tasks[i],
            task_level=levels[i],
        )
        groups.append(group.validate())
    return groups


def _per_group(attrs: dict[str, Any], name: str, n: int, kind: type) -> list[Any]:
    """Attribute `name`: one value of `kind` or null per group (all null when absent)."""
    values = attrs.get(name, [None] * n)
    if (
        not isinstance(values, list)
        or len(values) != n
        or not all(v is None or (isinstance(v, kind) and not isinstance(v, bool)) for v in values)
    ):
        raise ValueError(f"{name} must be one {kind.__name__} or null per group ({n})")
    return values
