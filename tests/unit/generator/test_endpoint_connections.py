"""The agent endpoint against clients that hold connections, over raw sockets: connections that
never finish their headers (or dribble them a byte at a time) are closed at the header
deadline while whole requests are served; a body that stops arriving is answered 408; past
`max_connections` open connections a request is answered 503. Short deadlines, generous waits:
nothing here depends on how fast an idle machine is."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from streamrl.generator.endpoint import AgentEndpoint

DEADLINE_S = 2.0
WAIT_S = 30.0  # how long a test waits for what should happen after DEADLINE_S
HALF_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[AgentEndpoint]:
    with AgentEndpoint(
        "m", max_connections=64, header_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S
    ) as served:
        with ThreadPoolExecutor(1) as pool:  # once served, requests are read without imports
            assert _served(served, pool, served.open()).status_code == 200
        yield served


@pytest.fixture(scope="module")
def calls() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as pool:
        yield pool


def _connect(endpoint: AgentEndpoint) -> socket.socket:
    url = urlsplit(endpoint.base_url)
    return socket.create_connection((url.hostname, url.port), timeout=WAIT_S)


def _until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    return received


def _served(endpoint: AgentEndpoint, calls: ThreadPoolExecutor, token: str) -> httpx.Response:
    """A whole request, answered (as the loop would) once it reaches the queue."""
    call = calls.submit(
        httpx.post, f"{endpoint.base_url}/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {token}"}, trust_env=False, timeout=WAIT_S,
    )  # fmt: skip
    deadline = time.monotonic() + WAIT_S
    while not call.done() and time.monotonic() < deadline:
        for pending in endpoint.take():
            pending.answer(200, {"answered": pending.token == token})
        time.sleep(0.005)
    return call.result(timeout=WAIT_S)


def test_half_sent_requests_are_closed_while_whole_ones_are_served(endpoint, calls) -> None:
    held = []
    for k in range(40):  # nothing at all, or headers cut off
        sock = _connect(endpoint)
        if k % 2:
            sock.sendall(HALF_HEADERS)
        held.append(sock)
    response = _served(endpoint, calls, endpoint.open())
    assert response.status_code == 200
    assert response.json() == {"answered": True}
    for sock in held:
        assert _until_closed(sock) == b""


def test_headers_dribbled_a_byte_at_a_time_are_cut_off_at_the_deadline(endpoint) -> None:
    sock = _connect(endpoint)
    request = HALF_HEADERS * 1000  # far longer than the deadline allows at this pace
    closed = threading.Event()

    def dribble() -> None:
        try:
            for byte in request:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:  # the server closed it
            closed.set()

    sender = threading.Thread(target=dribble, daemon=True)
    sender.start()
    sender.join(WAIT_S)
    assert closed.is_set(), "still open after the header deadline"


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(endpoint) -> None:
    token = endpoint.open()
    sock = _connect(endpoint)
    body = b'{"model": "m"}'  # refused on arrival (no messages), the connection kept alive
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (token.encode(), len(body), body)
    )
    answer = _until_closed(sock)  # answered, then left idle: closed at the deadline
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"connection: close" not in answer.lower()
    # The refusal reaches the loop, for the episode's record (and is taken here: the endpoint
    # is shared by the module's tests).
    assert [p.refused for p in endpoint.take()] == [
        "400: messages must be a list of message objects"
    ]


def test_a_body_that_stops_arriving_is_answered_408_and_closed(endpoint) -> None:
    token = endpoint.open()
    sock = _connect(endpoint)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": ' % token.encode()
    )
    answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 2s" in answer
    assert endpoint.take() == []


def test_past_max_connections_a_request_is_answered_503(calls) -> None:
    with AgentEndpoint("m", max_connections=4) as small:
        token = small.open()
        held = [_connect(small) for _ in range(4)]
        try:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:  # until the server has accepted all four
                response = _served(small, calls, token)
                if response.status_code == 503:
                    break
            assert response.status_code == 503
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # until the server has seen them go
            response = _served(small, calls, token)
            if response.status_code == 200:
                break
        assert response.status_code == 200
