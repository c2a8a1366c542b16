"""The generator's OpenAI-compatible chat-completions endpoint, for its agent episodes.

An HTTP server (uvicorn, one thread of the generator process) on 127.0.0.1 at a free port.
Each agent episode has its own bearer token (its client's API key): a request with any other
is refused (401), so no other process can sample through it. The server only validates and
hands requests over: the generator loop's thread, which owns the engine, takes them
(`take`), samples, and answers each through its future (`Pending.answer`). Routes:

- `POST /v1/chat/completions`: a chat completion (`streamrl.generator.agent_chat` says how it
  is recorded, `streamrl.generator.agent_messages` what is served); errors come back as OpenAI
  error objects;
- `GET /v1/models`: the one model, for clients that list models first;
- `POST /v1/streamrl/start`: an episode's agent claims its one run (`streamrl.envs.agent`).

A request is checked as it arrives (`streamrl.generator.agent_requests`: JSON nesting, tool
schemas; 400 naming the field), so the loop's thread is handed only requests it can render
(and, for its episode's record, why one was refused).
One episode has at most one request in sampling at a time (a second one is refused, 409,
rather than racing the first for the history). On close every request still waiting is
answered 503.

Whoever connects is bounded before any token is read: a connection must send a whole
request's headers (at most 16 KiB, h11's limit) within `HEADER_TIMEOUT_S` of opening or of its
last answer, else it is closed — idle keep-alive connections too; a body must arrive whole
within `BODY_TIMEOUT_S` of its headers (408) and be at most `MAX_REQUEST_BYTES` (413); and past
`max_connections` open connections a request is answered 503 at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from streamrl.generator.agent_requests import parsed_request

__all__ = ["BODY_TIMEOUT_S", "HEADER_TIMEOUT_S", "MAX_REQUEST_BYTES", "AgentEndpoint", "Pending"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 * 2**20
HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 1024
STARTUP_TIMEOUT_S = 30.0
_CLOSES = frozenset({401, 404, 408, 413})  # answered with the body perhaps unread: close


@dataclass
class Pending:
    """A validated request waiting for the loop: the episode's `token`, the parsed `request`
    (vLLM's `ChatCompletionRequest`), or `start` for an agent's start. Or, `refused` set, a
    request the endpoint refused itself (already answered): why, for its episode's record."""

    token: str
    request: Any = None
    start: bool = False
    refused: str = ""
    future: Future[tuple[int, dict[str, Any]]] = field(default_factory=Future)

    def answer(self, status: int, body: dict[str, Any]) -> None:
        if not self.future.done():
            self.future.set_result((status, body))

    def refuse(self, status: int, message: str, code: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.answer(status, {"error": {"message": message, "type": kind, "code": code}})


class AgentEndpoint:
    """The server (module docstring). `open()` an episode's token, `close_episode` it; `take()`
    the requests that came in. Use as a context manager. `max_connections`: open connections
    past which a request is answered 503."""

    def __init__(
        self,
        model_name: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.model_name = model_name
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.base_url = ""
        self._tokens: set[str] = set()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def open(self) -> str:
        """A new episode's token."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens.add(token)
        return token

    def close_episode(self, token: str) -> None:
        with self._lock:
            self._tokens.discard(token)

    def take(self) -> list[Pending]:
        """The requests that came in since the last call, in order."""
        taken = []
        while True:
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                return taken

    def __enter__(self) -> AgentEndpoint:
        import uvicorn

        config = uvicorn.Config(
            self._app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
            interface="asgi3", access_log=False, http=_protocol(self.header_timeout_s),
            timeout_keep_alive=max(1, int(self.header_timeout_s)),
            limit_concurrency=self.max_connections,
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="agent-endpoint", daemon=True)
        self._thread.start()
        for _ in range(int(STARTUP_TIMEOUT_S / 0.01)):
            if self._server.started or not self._thread.is_alive():
                break
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError("the agent endpoint did not start on 127.0.0.1")
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving; requests still waiting are answered 503."""
        if self._server is not None:
            self._server.should_exit = True
        for pending in self.take():  # before the server waits for them to be answered
            pending.refuse(503, "the generator is stopping")
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the ASGI app --------------------------------------------------------------------------

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        status, body = await self._serve(scope, receive)
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        if status in _CLOSES:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _serve(self, scope: dict[str, Any], receive: Any) -> tuple[int, dict[str, Any]]:
        path, method = scope["path"].rstrip("/"), scope["method"]
        if path == "/v1/models" and method == "GET":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        routes = {"/v1/chat/completions", "/v1/streamrl/start"}
        if path not in routes or method != "POST":
            return _error(404, f"{method} {path} is not served here; POST /v1/chat/completions")
        token = _bearer(scope)
        with self._lock:
            known = token in self._tokens
        if not known:
            return _error(401, "unknown or ended episode token")
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await _body(receive)
        except TimeoutError:
            return _error(408, f"the request body did not arrive within {self.body_timeout_s:g}s")
        if body is None:
            return _error(413, f"the request body is larger than {MAX_REQUEST_BYTES} bytes")
        if path == "/v1/streamrl/start":
            pending = Pending(token, start=True)
        else:
            try:
                pending = Pending(token, parsed_request(body))
            except ValueError as invalid:
                message = str(invalid)[:2000]
                self._queue.put(Pending(token, refused=f"400: {message}"))
                return _error(400, message)
        self._queue.put(pending)
        return await asyncio.wrap_future(pending.future)


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    pending = Pending("")
    pending.refuse(status, message)
    return pending.future.result()


def _bearer(scope: dict[str, Any]) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            text = value.decode("latin-1")
            return text[7:] if text[:7].lower() == "bearer " else ""
    return ""


async def _body(receive: Any) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's headers
    within `header_timeout_s` of opening or of its last answer. uvicorn's own keep-alive timer
    is cancelled by any byte received, so a client sending half a request would hold its
    connection for ever; this deadline is not."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _expire(self) -> None:
            # A request being served (headers in, answer not yet sent) is the app's to bound.
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol
