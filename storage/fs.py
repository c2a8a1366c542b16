"""Where a run lives: a folder on fsspec (local directory or `s3://bucket/prefix`).

Every persisted object of streamrl goes through a `Location`: a filesystem plus a root path.
The local filesystem is also the test backend; S3 is exercised against a real S3 server
(SeaweedFS) in tests.

Credentials and endpoints come from the standard places only — AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_PROFILE / AWS_ENDPOINT_URL in the environment, or fsspec/s3fs
options — and are never logged or written into a run. Transient S3 errors are retried by
s3fs/botocore themselves; a call that cannot reach the endpoint at all (refused, timed out:
the store restarting, a network cut) is retried for about a minute (`S3_RETRIES`, the
storage option `retries`), so every process of a run waits out a short outage instead of
failing. A request stuck on a dead connection fails within `S3_TIMEOUTS` and is retried the
same way (a generator whose container got a new address goes on). What still fails reaches
the caller (the stream reader then retries for as long as it waits: `storage.stream.reader`).

`put_if_absent` is the one coordination primitive the run layout needs: create an object
only if no object of that name exists (S3 `If-None-Match: *`; locally a complete temporary
file hard-linked into place, which fails if the name is taken). `replace_object` rewrites a
small record (a progress record) so that readers see the old bytes or the new, never a part.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

__all__ = [
    "S3_RETRIES",
    "S3_TIMEOUTS",
    "Location",
    "StorageError",
    "open_location",
    "put_if_absent",
    "replace_object",
]


S3_TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60, "tcp_keepalive": True}
"""botocore's limits on one S3 request: seconds to connect, seconds without a byte of the
answer; TCP keep-alive probes find a connection whose other end is gone."""
S3_RETRIES = 12
"""Attempts of an S3 call that cannot reach the endpoint (each with botocore's own few
retries); s3fs waits 0.1 * 1.7**i s (at most 15 s) after failure i: about 59 s in all."""


class StorageError(RuntimeError):
    """A storage problem the user must fix (bucket, credentials, URI), named in the message."""


@dataclass(frozen=True)
class Location:
    """A folder: `fs` and its root `path` (protocol stripped). Paths below join with '/'."""

    fs: AbstractFileSystem
    path: str
    uri: str

    def join(self, *parts: str) -> str:
        """Path of an object below this folder."""
        return posixpath.join(self.path, *parts)

    def child(self, *parts: str) -> Location:
        """The sub-folder `parts` as a Location of its own."""
        return Location(self.fs, self.join(*parts), posixpath.join(self.uri, *parts))

    @property
    def is_local(self) -> bool:
        return _is_local(self.fs)

    @property
    def is_s3(self) -> bool:
        protocol = self.fs.protocol
        names = protocol if isinstance(protocol, tuple | list) else (protocol,)
        return "s3" in names or "s3a" in names

    def storage_options(self) -> dict[str, Any]:
        """The options this filesystem was built with (for libraries that open their own)."""
        return dict(self.fs.storage_options)

    def __repr__(self) -> str:  # never show storage options: they may hold credentials
        return f"Location({self.uri!r})"


def _is_local(fs: AbstractFileSystem) -> bool:
    protocol = fs.protocol
    names = protocol if isinstance(protocol, tuple | list) else (protocol,)
    return "file" in names or "local" in names


def open_location(
    uri: str,
    *,
    endpoint_url: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    check: bool = True,
) -> Location:
    """Resolve a run URI (`./runs/x`, `/abs/path`, `file://...`, `s3://bucket/prefix`).

    Args:
        endpoint_url: S3 endpoint of an S3-compatible store (SeaweedFS, MinIO); default: AWS,
            or AWS_ENDPOINT_URL from the environment.
        storage_options: extra fsspec/s3fs options; on S3 also `retries`, the attempts of a
            call that cannot reach the endpoint (default `S3_RETRIES`).
        check: make sure the location is reachable now (bucket exists, credentials work, local
            folder creatable), so a mistake fails before anything starts.

    Raises `StorageError` naming what is wrong and how to fix it.
    """
    if not uri or not uri.strip():
        raise StorageError("empty run URI; use ./runs/<name> or s3://bucket/prefix/<name>")
    options: dict[str, Any] = dict(storage_options or {})
    protocol, _, rest = uri.partition("://")
    if not rest:
        protocol, rest = "file", uri
    if protocol in {"s3", "s3a"}:
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            client_kwargs = dict(options.pop("client_kwargs", {}) or {})
            client_kwargs.setdefault("endpoint_url", endpoint)
            options["client_kwargs"] = client_kwargs
        # A streaming reader must never see a cached listing, and a forked or spawned process
        # must not share another's event loop: fresh instance, no listing cache.
        options.setdefault("use_listings_cache", False)
        options.setdefault("skip_instance_cache", True)
        # A connection stuck on an address that no longer answers (a container that got a new
        # one, a cut network) fails within these and is retried on a fresh connection.
        options["config_kwargs"] = S3_TIMEOUTS | dict(options.get("config_kwargs") or {})
    retries = options.pop("retries", S3_RETRIES) if protocol in {"s3", "s3a"} else None
    try:
        fs = fsspec.filesystem(protocol, **options)
    except (ValueError, ImportError) as exc:
        raise StorageError(
            f"cannot open run URI {uri!r}: {exc}. Use a local path or s3://bucket/prefix"
        ) from None
    if retries is not None:
        _retry_unreachable(fs, retries)
    path = fs._strip_protocol(rest if protocol != "file" else os.path.abspath(rest))
    path = path.rstrip("/") or "/"
    shown = path if _is_local(fs) else f"{protocol}://{path}"
    location = Location(fs, path, shown)
    if check:
        _check_reachable(location)
    return location


def _retry_unreachable(fs: AbstractFileSystem, retries: int) -> None:
    """Have s3fs retry a call that could not reach the endpoint `retries` times in all (s3fs
    keeps its list of retryable errors module-wide; botocore's connection errors join it)."""
    import botocore.exceptions
    import s3fs.core

    if botocore.exceptions.ConnectionError not in s3fs.core.S3_RETRYABLE_ERRORS:
        s3fs.core.add_retryable_error(botocore.exceptions.ConnectionError)
    fs.retries = retries


def _check_reachable(location: Location) -> None:
    fs = location.fs
    if location.is_local:
        try:
            fs.makedirs(location.path, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create run folder {location.uri}: {exc.strerror or exc}"
            ) from None
        return
    bucket = location.path.split("/", 1)[0]
    try:
        fs.ls(bucket, detail=False)
    except Exception as exc:
        raise describe_error(exc, location.uri) from None


def describe_error(exc: BaseException, uri: str) -> Exception:
    """Turn a filesystem exception into a `StorageError` that says what to do.

    Unknown errors are returned unchanged (never swallowed)."""
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        bucket = uri.removeprefix("s3://").split("/", 1)[0]
        return StorageError(
            f"bucket {bucket!r} of {uri} does not exist; create it (e.g. `aws s3 mb "
            f"s3://{bucket}`) or fix storage.run_uri"
        )
    if name == "NoCredentialsError" or "credentials" in text.lower():
        return StorageError(
            f"no S3 credentials for {uri}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) in the environment"
        )
    if isinstance(exc, PermissionError):
        return StorageError(
            f"access to {uri} was denied ({text or name}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's permissions"
        )
    if name in {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"} or (
        isinstance(exc, ConnectionError | TimeoutError)
    ):
        return StorageError(
            f"cannot reach the S3 endpoint for {uri} ({text or name}); check "
            "storage.endpoint_url / AWS_ENDPOINT_URL and that the server is up"
        )
    return exc if isinstance(exc, Exception) else RuntimeError(text)


def _is_precondition_failure(exc: BaseException) -> bool:
    """S3 answered 412 (the object exists) or 409 (a concurrent conditional write)."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in {"PreconditionFailed", "ConditionalRequestConflict"} or status in {
                409,
                412,
            }:
                return True
    return isinstance(exc, FileExistsError)


def put_if_absent(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create `path` holding `data` unless an object of that name exists; True if created.

    Readers never see a partial object: locally the bytes go to a temporary file in the same
    folder that is then hard-linked to `path` (atomic, fails if the name is taken); on S3 the
    PUT carries `If-None-Match: *`. False means the name was taken — possibly by this very
    request, if a retried S3 request had succeeded the first time: callers that must know read
    the object back and compare.
    """
    if _is_local(fs):
        folder = posixpath.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = posixpath.join(folder, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    try:
        fs.pipe_file(path, data, mode="create")
        return True
    except Exception as exc:
        if _is_precondition_failure(exc):
            return False
        raise


def create_once(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """`put_if_absent`, telling a retried request of this call's own apart from another
    writer's: True if `path` now holds exactly `data` (so `data` must be unique to the caller:
    a holder id, a nonce)."""
    if put_if_absent(fs, path, data):
        return True
    try:
        return bool(fs.cat_file(path) == data)
    except FileNotFoundError:  # a concurrent conditional write lost without a winner
        return False


_honours_conditional_writes: set[tuple[str, str]] = set()
_probe_lock = threading.Lock()


def check_conditional_writes(location: Location) -> None:
    """Make sure the store refuses a second create of one name (`put_if_absent`), which one
    learner per run and the stream's gap-free commit log rely on. Probed once per process and
    bucket with a scratch object under `location` that is created twice and removed; local
    folders (hard links) always refuse.

    Raises:
        StorageError: the store let the second create through (it ignores `If-None-Match`).
    """
    if location.is_local:
        return
    store = (str(location.fs.protocol), location.path.lstrip("/").split("/", 1)[0])
    with _probe_lock:
        if store in _honours_conditional_writes:
            return
        path = location.join(f".conditional-write-probe-{uuid.uuid4().hex}")
        try:
            first = put_if_absent(location.fs, path, b"first")
            second = put_if_absent(location.fs, path, b"second")
        finally:
            with contextlib.suppress(FileNotFoundError):
                location.fs.rm_file(path)
        if first and not second:
            _honours_conditional_writes.add(store)
            return
    raise StorageError(
        f"the store of {location.uri} ignores conditional writes: creating one object twice "
        f"with If-None-Match succeeded {'twice' if second else 'neither time'}. streamrl needs "
        "them to keep one learner per run and the stream's commit log gap-free; use a store "
        "that honours them (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...) or a local folder"
    )


def replace_object(location: Location, path: str, data: bytes) -> None:
    """Write `data` to `path`, replacing any object there; a reader sees the old object or the
    new one, never a partial one (on S3 one PUT; locally a temporary file renamed into place)."""
    if not location.is_local:
        location.fs.pipe_file(path, data)
        return
    folder = posixpath.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = posixpath.join(folder, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
