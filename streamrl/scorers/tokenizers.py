"""A teacher must share the student's tokenizer: its log-probs are read at the student's token
ids, so one id must mean one string to both. `tokenizer_difference` names the first difference
(vocabulary, special tokens) or returns None."""

from __future__ import annotations

from typing import Any

__all__ = ["TokenizerMismatchError", "check_teacher_tokenizer", "tokenizer_difference"]

_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


class TokenizerMismatchError(ValueError):
    """The teacher's tokenizer differs from the policy's; the message names the difference."""


def _load(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def tokenizer_difference(
    student: str, teacher: str, *, trust_remote_code: bool = False
) -> str | None:
    """The first difference between the tokenizers in directories `student` and `teacher`, in
    words, or None when they map every id to the same token and agree on the special tokens."""
    a, b = _load(student, trust_remote_code), _load(teacher, trust_remote_code)
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        return f"the policy's vocabulary has {len(va)} tokens, the teacher's {len(vb)}"
    by_id_a = {i: t for t, i in va.items()}
    by_id_b = {i: t for t, i in vb.items()}
    for i in sorted(by_id_a):
        if by_id_b.get(i) != by_id_a[i]:
            return (
                f"token id {i} is {by_id_a[i]!r} for the policy but {by_id_b.get(i)!r} for the "
                "teacher"
            )
    for field in _SPECIAL:
        if getattr(a, field, None) != getattr(b, field, None):
            return (
                f"{field} is {getattr(a, field, None)} for the policy but "
                f"{getattr(b, field, None)} for the teacher"
            )
    return None


def check_teacher_tokenizer(
    name: str, policy: str, teacher: str, *, trust_remote_code: bool = False
) -> None:
    """Raise `TokenizerMismatchError` unless the tokenizer in `teacher` (scorer `name`, the
    run's teacher) is the one in `policy` — naming the first difference, or why it could not
    be loaded. Either way a restart would fail the same way."""
    try:
        difference = tokenizer_difference(policy, teacher, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise TokenizerMismatchError(
            f"the teacher's tokenizer ({teacher}, scorers.{name}) cannot be loaded: {exc}"
        ) from None
    if difference is not None:
        raise TokenizerMismatchError(
            f"scorer {name!r} is the run's teacher (generator.teacher), but its tokenizer is not "
            f"the policy's: {difference}. On-policy distillation reads the teacher's log-probs "
            "at the policy's token ids; distil from a teacher of the same tokenizer family"
        )
