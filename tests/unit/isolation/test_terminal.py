"""Model-written text on a terminal (`streamrl.isolation.terminal.printable`): every control
character a terminal acts on is shown as an escape; text, newlines and tabs stay."""

from __future__ import annotations

from streamrl.isolation.terminal import printable


def test_controls_are_shown_not_sent():
    text = "ok\x1b[2J\x1b]8;;http://x\x07link\r\x7f\x85\u202e\u2066 é 日本\n\tend"
    shown = printable(text)
    assert shown == "ok\\x1b[2J\\x1b]8;;http://x\\x07link\\r\\x7f\\x85\\u202e\\u2066 é 日本\n\tend"
