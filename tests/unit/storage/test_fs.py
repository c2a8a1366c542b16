"""Run locations: URIs, create-if-absent, and the errors a user sees for storage mistakes."""

from __future__ import annotations

import pytest

from storage.fs import Location, StorageError, open_location, put_if_absent
from storage.seaweedfs import SeaweedFS


def test_put_if_absent_creates_once_and_never_overwrites(run_location: Location):
    path = run_location.join("log", "000000000000.json")
    assert put_if_absent(run_location.fs, path, b"first")
    assert not put_if_absent(run_location.fs, path, b"second")
    assert run_location.fs.cat_file(path) == b"first"


def test_local_put_if_absent_leaves_no_temporary_files(tmp_path):
    location = open_location(str(tmp_path / "run"))
    for _ in range(2):
        put_if_absent(location.fs, location.join("a", "x.json"), b"x")
    assert sorted(p.name for p in (tmp_path / "run" / "a").iterdir()) == ["x.json"]


def test_relative_local_uri_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = open_location("runs/demo")
    assert location.is_local
    assert location.path == str(tmp_path / "runs" / "demo")
    assert (tmp_path / "runs" / "demo").is_dir()


def test_location_repr_hides_credentials(seaweedfs: SeaweedFS):
    location = open_location("s3://streamrl/x", storage_options=seaweedfs.storage_options)
    assert seaweedfs.secret_key not in repr(location)
    assert location.is_s3
    assert location.uri == "s3://streamrl/x"


def test_bucket_that_does_not_exist(seaweedfs: SeaweedFS):
    with pytest.raises(StorageError, match=r"bucket .no-such-bucket. .* does not exist; create it"):
        open_location("s3://no-such-bucket/run", storage_options=seaweedfs.storage_options)


def test_wrong_credentials(seaweedfs: SeaweedFS):
    options = {**seaweedfs.storage_options, "secret": "wrong"}
    with pytest.raises(StorageError, match=r"denied.*AWS_ACCESS_KEY_ID"):
        open_location("s3://streamrl/run", storage_options=options)


def test_missing_credentials(seaweedfs: SeaweedFS, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageError, match=r"no S3 credentials .* AWS_ACCESS_KEY_ID"):
        open_location("s3://streamrl/run", endpoint_url=seaweedfs.endpoint_url)


def test_unreachable_endpoint():
    with pytest.raises(StorageError, match="cannot reach the S3 endpoint"):
        open_location(
            "s3://streamrl/run",
            endpoint_url="http://127.0.0.1:9",
            storage_options={
                "key": "k",
                "secret": "s",
                "config_kwargs": {"retries": {"max_attempts": 1}},
                "retries": 1,  # s3fs's own attempts at an unreachable endpoint (default ~1 min)
            },
        )


def test_unknown_protocol_and_empty_uri():
    with pytest.raises(StorageError, match="cannot open run URI 'nosuch://x'"):
        open_location("nosuch://x")
    with pytest.raises(StorageError, match="empty run URI"):
        open_location(" ")


def test_a_request_stuck_on_a_silent_connection_fails_instead_of_hanging(monkeypatch):
    """An endpoint that accepts and never answers (a connection whose other end is gone): the
    call fails within the read timeout and can be retried, instead of blocking its process
    for good (a generator that never produced again)."""
    import socket
    import time

    import storage.fs

    monkeypatch.setitem(storage.fs.S3_TIMEOUTS, "read_timeout", 2)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        location = open_location(
            "s3://streamrl/run",
            endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
            storage_options={"key": "k", "secret": "s", "retries": 1,
                             "config_kwargs": {"retries": {"max_attempts": 1}}},
            check=False,
        )  # fmt: skip
        started = time.monotonic()
        with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
            location.fs.cat_file("streamrl/run/x")
        assert time.monotonic() - started < 30
    finally:
        silent.close()
