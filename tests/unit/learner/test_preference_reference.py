"""The stored reference log-probs of a preference run (`streamrl.learner.preference_reference`):
read back only when whole and made for the same pairs; anything else is scored again."""

from __future__ import annotations

import json
import logging

import pytest

from storage.fs import open_location
from streamrl.learner.preference_reference import REFERENCE_FILE, _fingerprint, _read, _write


@pytest.fixture
def run(tmp_path):
    location = open_location(str(tmp_path / "run"))
    location.fs.makedirs(location.path, exist_ok=True)
    return location


def test_stored_sums_read_back_exactly(run):
    values = [(-12.345678, -13.5), (-0.1, -7.25)]
    fingerprint = _fingerprint("pairs.jsonl|None|model", ["pairs:0", "pairs:1"])
    _write(run, fingerprint, values)
    assert _read(run, fingerprint, 2) == values


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (lambda r: r["sums"][0].__setitem__(0, -1.0), "fail their checksum"),
        (lambda r: r.__setitem__("sums", r["sums"][:1]), "fail their checksum"),
        (lambda r: r.__setitem__("fingerprint", "0" * 64), "other pairs or another model"),
        (lambda r: r.__setitem__("format", "v0"), "an unknown format"),
    ],
)
def test_a_tampered_or_foreign_file_is_scored_again(run, caplog, tamper, says):
    fingerprint = _fingerprint("pairs", ["a", "b"])
    _write(run, fingerprint, [(-1.5, -2.5), (-3.0, -4.0)])
    path = run.join(*REFERENCE_FILE)
    record = json.loads(run.fs.cat_file(path))
    tamper(record)
    run.fs.pipe_file(path, json.dumps(record).encode())
    with caplog.at_level(logging.WARNING):
        assert _read(run, fingerprint, 2) is None
    assert says in caplog.text


def test_a_file_that_is_not_json_is_scored_again(run, caplog):
    run.fs.makedirs(run.join("preference"), exist_ok=True)
    run.fs.pipe_file(run.join(*REFERENCE_FILE), b"\x00garbage")
    with caplog.at_level(logging.WARNING):
        assert _read(run, "x", 1) is None
    assert "cannot be read" in caplog.text
    assert _read(open_location(run.uri + "-none"), "x", 1) is None  # absent: silently none
