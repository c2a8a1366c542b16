"""The S3 server of tests and of the local stack serves on the address it is given: the stack's
Docker mode serves containers on their network's gateway address, since a container cannot
reach the host's 127.0.0.1. Its master, volume server and filer, which take no credential,
listen on 127.0.0.1 only, whatever that address is."""

from __future__ import annotations

import shlex
import socket
from urllib.parse import urlsplit

from storage.fs import open_location
from storage.seaweedfs import SeaweedFS, read_env_file

OTHER_LOOPBACK = "127.0.0.2"  # any 127/8 address is the host's own: a stand-in for a gateway


def test_the_server_serves_on_the_address_it_is_given(tmp_path):
    with SeaweedFS(data_dir=tmp_path / "s3", host=OTHER_LOOPBACK) as server:
        assert urlsplit(server.endpoint_url).hostname == OTHER_LOOPBACK
        run = open_location(f"s3://{server.bucket}/runs/x", storage_options=server.storage_options)
        run.fs.pipe_file(run.join("probe"), b"written")
        assert run.fs.cat_file(run.join("probe")) == b"written"


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex((host, port)) == 0


def test_on_that_address_only_the_s3_gateway_listens(tmp_path):
    with SeaweedFS(data_dir=tmp_path / "s3", host=OTHER_LOOPBACK) as server:
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = server._ports
        for port in (master, master_grpc, volume, volume_grpc, filer, filer_grpc):
            assert not _listening(OTHER_LOOPBACK, port), port
            assert _listening("127.0.0.1", port), port  # for the S3 gateway
        assert _listening(OTHER_LOOPBACK, s3)
        assert _listening(OTHER_LOOPBACK, s3_grpc)  # not movable: the stack's firewall refuses it


def test_the_stacks_env_file_reads_back_as_written(tmp_path):
    values = {"AWS_ACCESS_KEY_ID": "streamrl-1a2b", "AWS_SECRET_ACCESS_KEY": "a b'c$d"}
    path = tmp_path / "s3.env"
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items()))
    assert read_env_file(path) == values
