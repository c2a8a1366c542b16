"""The generator's OpenAI-compatible chat-completions endpoint, for its agent episodes.

An HTTP server (uvicorn, one thread of the generator process) on 127.0.0.1 at a free port.
Each agent episode has its own bearer token (its client's API key): a request with any other
is refused (401), so no other process can sample through it. The server only validates and
hands requests over: the generator loop's thread, which owns the engine, takes them
(`take`), samples, and answers each through its future (`Pending.answer`). Routes:

- `POST /v1/chat/completions`: a chat completion (`streamrl.generator.agent_chat` says what is
  served and how it is recorded); errors come back as OpenAI error objects;
- `GET /v1/models`: the one model, for clients that list models first;
- `POST /v1/streamrl/start`: an episode's agent claims its one run (`streamrl.envs.agent`).

A request body is at most `MAX_REQUEST_BYTES`; one episode has at most one request in
sampling at a time (a second one is refused, 409, rather than racing the first for the
history). On close every request still waiting is answered 503.
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

__all__ = ["MAX_REQUEST_BYTES", "AgentEndpoint", "Pending"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 * 2**20
STARTUP_TIMEOUT_S = 30.0


@dataclass
class Pending:
    """A validated request waiting for the loop: the episode's `token`, the parsed `request`
    (vLLM's `ChatCompletionRequest`), or `start` for an agent's start."""

    token: str
    request: Any = None
    start: bool = False
    future: Future[tuple[int, dict[str, Any]]] = field(default_factory=Future)

    def answer(self, status: int, body: dict[str, Any]) -> None:
        if not self.future.done():
            self.future.set_result((status, body))

    def refuse(self, status: int, message: str, code: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.answer(status, {"error": {"message": message, "type": kind, "code": code}})


class AgentEndpoint:
    """The server (module docstring). `open()` an episode's token, `close_episode` it; `take()`
    the requests that came in. Use as a context manager."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
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
            interface="asgi3", access_log=False, timeout_keep_alive=30,
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
        body = await _body(receive)
        if body is None:
            return _error(413, f"the request body is larger than {MAX_REQUEST_BYTES} bytes")
        if path == "/v1/streamrl/start":
            pending = Pending(token, start=True)
        else:
            try:
                pending = Pending(token, _parsed(body))
            except ValueError as invalid:
                return _error(400, str(invalid)[:2000])
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


def _parsed(body: bytes) -> Any:
    """The body as vLLM's `ChatCompletionRequest`. Raises ValueError naming what is wrong."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"the request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as invalid:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in invalid.errors()[:5]
        )
        raise ValueError(f"invalid chat completion request: {problems}") from None
