"""`OpenEnvService`: an OpenEnv environment server for a generator's episodes, and the relay that
keeps each episode's session on it.

An OpenEnv server (`openenv.core.env_server.http_server`) keeps an episode only for the life of
one WebSocket connection to its `/ws` (its HTTP `/reset` and `/step` build a fresh environment
per request, so they cannot play more than one turn). streamrl's environment workers are
stateless — any worker serves any call, and an episode outlives the worker of its last call
(`streamrl.envs.base`) — so no worker can hold that connection. The relay holds them: it runs
in a thread of the generator's process and answers the workers on a Unix socket only they know
(`settings["relay"]`), one JSON request per call:

    POST   /episodes            {"reset": {...}}   -> {"episode", "observation", "reward", "done"}
    POST   /episodes/{id}/step  {"action": {...}}  -> {"observation", "reward", "done"}
    DELETE /episodes/{id}                          -> {}

Each reset opens a WebSocket session (`{"type": "reset" | "step", "data": ...}` → the server's
`{"type": "observation" | "error", "data": ...}`); a session's calls run one at a time, a
finished episode's session is closed, and one idle past the episode time limit (its worker was
killed mid-call) is closed by a reaper. Every failure — the server down, closing the session,
answering an error or nothing within `call_timeout_s` (and `RELAY_MARGIN_S`, so that the
worker's own deadline ends a hung call first, as a `timeout`) — is answered with status 502 and
`{"error": why}`; the environment raises it, an env_error of its episode.

The server: with `openenv.app`, the relay thread starts `python -m uvicorn <app>` from the
OpenEnv virtualenv (`openenv.python`) on a socket it bound to a free port of 127.0.0.1, with
only `openenv.server_env` and PATH/HOME/locale in its environment, dead with the generator
(SIGTERM from the kernel) and its process group killed on close. Its `MAX_CONCURRENT_ENVS`
(the OpenEnv apps' session capacity, 8 unless set) is `openenv.max_sessions` unless
`server_env` sets it. Before that, the package is
checked importable there; a missing one fails naming the install command. It must answer
`/health` within `startup_timeout_s`. With `openenv.url`, the relay uses that server as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from streamrl.envs.openenv_config import OpenEnvConfig
from streamrl.envs.registry import EnvLoadError, EnvResolutionError
from streamrl.envs.worker_envs import WORKER_ENV_TOOLS, worker_env_command
from streamrl.isolation.lifetime import dying_with_parent

__all__ = ["MAX_MESSAGE_BYTES", "RELAY_MARGIN_S", "OpenEnvService", "check_openenv"]

log = logging.getLogger(__name__)

RELAY_MARGIN_S = 5.0
"""How much longer than `call_timeout_s` the relay waits for the server: the worker's deadline
ends a hung call first (a `timeout`), the relay's only frees the session."""

MAX_MESSAGE_BYTES = 16 * 2**20
"""Largest message the relay takes from the server or a worker (an observation or an action)."""
_REAP_EVERY_S = 5.0
_STOP_GRACE_S = 5.0
_LOG_TAIL_CHARS = 2000
_KEPT_ENVIRONMENT = ("PATH", "HOME", "LANG", "TMPDIR")
_SESSIONS_VARIABLE = "MAX_CONCURRENT_ENVS"  # the OpenEnv apps' capacity setting (default 8)


class RelayError(Exception):
    """An episode's call the server failed (answered 502 with the message)."""


@dataclass
class _Session:
    ws: aiohttp.ClientWebSocketResponse
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used_at: float = field(default_factory=time.monotonic)


class OpenEnvService:
    """The relay and (with `config.app`) the server; a context manager (module docstring).
    `settings`: what environment workers are given (`EnvContext.settings`), known before start.
    """

    def __init__(self, config: OpenEnvConfig, *, call_timeout_s: float, episode_timeout_s: float):
        self.config = config
        self.call_timeout_s = call_timeout_s
        self.idle_timeout_s = episode_timeout_s + call_timeout_s
        name = f"streamrl-openenv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.socket_path = str(Path(tempfile.gettempdir()) / f"{name}.sock")
        self._log_path = Path(tempfile.gettempdir()) / f"{name}.log"
        self.base_url = config.url.rstrip("/") if config.url else ""
        self.server: subprocess.Popen[bytes] | None = None
        self._sessions: dict[str, _Session] = {}
        self._started: Future[None] = Future()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """The episode-side settings (`streamrl.envs.openenv_env`), plain JSON."""
        c = self.config
        return {
            "relay": self.socket_path,
            "reset": dict(c.reset),
            "action_field": c.action_field,
            "max_action_chars": c.max_action_chars,
            "reward_range": list(c.reward_range),
        }

    @property
    def open_episodes(self) -> int:
        return len(self._sessions)

    def __enter__(self) -> OpenEnvService:
        check_openenv(self.config)
        self._thread = threading.Thread(target=self._run, name="openenv-relay", daemon=True)
        self._thread.start()
        try:
            self._started.result(timeout=self.config.startup_timeout_s + 30)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every session, stop the relay and the server; no process is left behind."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._stop_server()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        with contextlib.suppress(FileNotFoundError):
            self._log_path.unlink()

    # -- the server process ------------------------------------------------------------------

    def _start_server(self) -> None:
        """Start the server on a socket bound here (no port race), in this thread (the kernel's
        parent-death signal follows the thread that started the child)."""
        assert self.config.app is not None
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        port = listener.getsockname()[1]
        argv = [self.config.interpreter, "-m", "uvicorn", self.config.app]
        argv += ["--fd", str(listener.fileno()), "--log-level", "warning", "--ws-max-size"]
        argv += [str(MAX_MESSAGE_BYTES)]
        env = {k: os.environ[k] for k in _KEPT_ENVIRONMENT if k in os.environ}
        env.update({k: v for k, v in os.environ.items() if k.startswith("LC_")})
        env[_SESSIONS_VARIABLE] = str(self.config.max_sessions)
        env.update(self.config.server_env)
        with self._log_path.open("wb") as output, listener:
            self.server = subprocess.Popen(
                dying_with_parent(argv, os.getpid()),
                pass_fds=(listener.fileno(),), env=env, stdin=subprocess.DEVNULL,
                stdout=output, stderr=subprocess.STDOUT, process_group=0,
            )  # fmt: skip
        self.base_url = f"http://127.0.0.1:{port}"

    async def _wait_healthy(self, http: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            if self.server is not None and self.server.poll() is not None:
                raise EnvLoadError(
                    f"the OpenEnv server {self.config.app!r} exited with status "
                    f"{self.server.returncode} before answering /health:\n{self._log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=5)
                async with http.get(f"{self.base_url}/health", timeout=timeout) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise EnvLoadError(
                    f"the OpenEnv server at {self.base_url} did not answer /health within "
                    f"generator.env.openenv.startup_timeout_s={self.config.startup_timeout_s:g}"
                    f":\n{self._log_tail()}"
                )
            await asyncio.sleep(0.2)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        return "(no output)"

    def _stop_server(self) -> None:
        server, self.server = self.server, None
        if server is None or server.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    # -- the relay ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.config.app is not None:
                self._start_server()
            asyncio.run(self._serve())
        except BaseException as error:
            if not self._started.done():
                self._started.set_exception(error)
            else:
                log.exception("the OpenEnv relay stopped")

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=MAX_MESSAGE_BYTES)
        app.router.add_post("/episodes", self._reset)
        app.router.add_post("/episodes/{id}/step", self._step)
        app.router.add_delete("/episodes/{id}", self._close)
        async with aiohttp.ClientSession() as self._http:
            await self._wait_healthy(self._http)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.UnixSite(runner, self.socket_path)
            await site.start()
            os.chmod(self.socket_path, 0o600)
            self._started.set_result(None)
            reaper = asyncio.create_task(self._reap())
            try:
                await self._stop.wait()
            finally:
                reaper.cancel()
                for episode in list(self._sessions):
                    await self._drop(episode)
                await runner.cleanup()

    async def _reset(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        if len(self._sessions) >= self.config.max_sessions:
            return _failed(f"generator.env.openenv.max_sessions={self.config.max_sessions} open")
        try:
            ws = await self._http.ws_connect(
                f"{self.base_url}/ws", max_msg_size=MAX_MESSAGE_BYTES,
                timeout=aiohttp.ClientWSTimeout(ws_close=1.0),
            )  # fmt: skip
        except (aiohttp.ClientError, OSError) as error:
            return _failed(f"cannot reach the OpenEnv server at {self.base_url}: {error}")
        episode, session = uuid.uuid4().hex, _Session(ws)
        self._sessions[episode] = session
        return await self._exchange(episode, session, "reset", body.get("reset") or {})

    async def _step(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        episode = request.match_info["id"]
        session = self._sessions.get(episode)
        if session is None:
            return _failed(
                f"no open OpenEnv session {episode[:40]!r}: it ended, was idle past "
                "episode_timeout_s, or its server failed", status=404,
            )  # fmt: skip
        return await self._exchange(episode, session, "step", body.get("action") or {})

    async def _close(self, request: web.Request) -> web.Response:
        await self._drop(request.match_info["id"])
        return web.json_response({})

    async def _exchange(
        self, episode: str, session: _Session, kind: str, data: object
    ) -> web.Response:
        """One call of the session; a failure closes it."""
        async with session.lock:
            session.used_at = time.monotonic()
            try:
                answer = await asyncio.wait_for(
                    _call(session.ws, kind, data), timeout=self.call_timeout_s + RELAY_MARGIN_S
                )
            except TimeoutError:
                await self._drop(episode)
                limit = self.call_timeout_s + RELAY_MARGIN_S
                return _failed(f"the OpenEnv server did not answer a {kind} in {limit:g} s")
            except (RelayError, aiohttp.ClientError, OSError) as error:
                await self._drop(episode)
                return _failed(f"the OpenEnv server failed a {kind}: {error}")
            session.used_at = time.monotonic()
        if answer.get("done") is True:
            await self._drop(episode)
        return web.json_response({"episode": episode, **answer})

    async def _drop(self, episode: str) -> None:
        session = self._sessions.pop(episode, None)
        if session is not None:
            with contextlib.suppress(Exception):  # closing a session the server already lost
                await session.ws.send_str('{"type": "close", "data": {}}')
                await asyncio.wait_for(session.ws.close(), timeout=2.0)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            now = time.monotonic()
            for episode, session in list(self._sessions.items()):
                if now - session.used_at > self.idle_timeout_s and not session.lock.locked():
                    log.warning("OpenEnv session idle for %.0f s closed", now - session.used_at)
                    await self._drop(episode)


async def _call(ws: aiohttp.ClientWebSocketResponse, kind: str, data: object) -> dict[str, Any]:
    await ws.send_str(json.dumps({"type": kind, "data": data}))
    message = await ws.receive()
    if message.type != aiohttp.WSMsgType.TEXT:
        raise RelayError(f"the session closed ({message.type.name})")
    answer = json.loads(message.data)
    body = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(body, dict):
        raise RelayError(f"an answer that is no OpenEnv message: {message.data[:200]!r}")
    if answer.get("type") == "error":
        raise RelayError(str(body.get("message", body))[:2000])
    if answer.get("type") != "observation":
        raise RelayError(f"an answer of type {answer.get('type')!r:.40}, not observation")
    return body


async def _json_object(request: web.Request) -> dict[str, Any]:
    body = await request.json()
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="a JSON object is expected")
    return body


def check_openenv(config: OpenEnvConfig) -> None:
    """Fail before start on a missing interpreter or package of a server the generator starts
    (`openenv.app`), naming the install command; a server at `openenv.url` is not checked."""
    if config.app is None:
        return
    python, module = config.interpreter, config.module
    location = None if config.python is None else Path(python).parent.parent
    install = worker_env_command(
        WORKER_ENV_TOOLS["openenv"][0], location, f"<the package of {module}>", "openenv"
    )
    if not os.access(python, os.X_OK):
        raise EnvResolutionError(
            f"generator.env.openenv: there is no OpenEnv worker environment with the Python "
            f"{python}; create it with `{install}`"
        )
    probe = (
        "import importlib.util as u, sys\n"
        "missing = [m for m in sys.argv[1:] if u.find_spec(m.split('.')[0]) is None\n"
        "           or u.find_spec(m) is None]\n"
        "print(' '.join(missing))"
    )
    found = subprocess.run(
        [python, "-c", probe, str(module), "uvicorn"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    missing = found.stdout.split()
    if found.returncode != 0 or missing:
        raise EnvResolutionError(
            f"generator.env.openenv: {', '.join(missing) or found.stderr[-300:]} not "
            f"importable by {python}; install it with `{install}`"
        )


def _failed(why: str, status: int = 502) -> web.Response:
    return web.json_response({"error": why}, status=status)
