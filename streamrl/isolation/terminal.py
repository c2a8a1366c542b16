"""Text the model wrote, made safe to print on a terminal: `printable`.

What a generator's model writes reaches people's terminals — `streamrl samples` prints
transcripts, and warnings quote an agent's or a reward's error, which may quote model output.
Under RL the model is an adversary: control characters in its text (an ANSI escape that rewrites
the screen or sets the clipboard, a carriage return that hides a line, a bidi override that
reverses what is shown) must not act. `printable` shows each as a visible escape (`\\x1b`,
`\\u202e`) and keeps newlines and tabs.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 controls but tab and newline, DEL, C1 controls; bidi embeddings, overrides and isolates.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character that a terminal would act on shown as an escape."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
