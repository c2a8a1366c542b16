"""Bounds on what the policy's text and an environment's answers may grow to: text cut to a
character budget (saying what was cut), one budget shared among several texts, and how deeply
a JSON value nests.

The policy under training can write anything, and a degenerate one repeats a token thousands
of times; these bounds keep what such text costs to its own episode. Tool calls
(`streamrl.envs.formats`), a step's observation (`tool_env`, `worker`, and the generator's
token budget in `streamrl.envs.chat`) and episode state (`worker`) use them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_JSON_DEPTH", "fair_shares", "nesting_depth", "truncate", "truncate_all"]

MAX_JSON_DEPTH = 64
"""Deepest nesting of lists and dicts accepted in a tool call's arguments and in an episode's
state and messages. Far more than any needs, and far from Python's recursion limit (~1000
frames), which printing, copying or pickling such a value walks one level per frame."""


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, saying how much was cut (a budget too small
    for the note alone gets the text's start without it)."""
    if len(text) <= max_chars:
        return text
    note = f"\n[... {{}} more characters cut; limit {max_chars}]"
    keep = max_chars - len(note.format(len(text)))
    if keep < 0:
        return text[: max(max_chars, 0)]
    return text[:keep] + note.format(len(text) - keep)


def fair_shares(lengths: Sequence[int], total: int) -> list[int]:
    """How many characters each of several texts of `lengths` keeps when together they may have
    `total`: texts shorter than an even split keep all they have, and the longer ones split
    what is left evenly (max-min fair). The shares sum to at most `total`."""
    shares = [0] * len(lengths)
    left = max(total, 0)
    by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
    for placed, i in enumerate(by_length):
        shares[i] = min(lengths[i], left // (len(lengths) - placed))
        left -= shares[i]
    return shares


def truncate_all(texts: Sequence[str], total: int) -> list[str]:
    """`texts` cut so that together they are at most `total` characters: each is cut to its
    `fair_shares` share by `truncate`, which says what was cut."""
    shares = fair_shares([len(text) for text in texts], total)
    return [truncate(text, share) for text, share in zip(texts, shares, strict=True)]


def nesting_depth(value: object, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply lists, tuples and dicts nest in `value` (a scalar: 0, `[1]`: 1), counted
    without recursion; the count stops at the first level deeper than `limit`. `value` must
    hold no cycles (a parsed or JSON round-tripped value holds none)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
