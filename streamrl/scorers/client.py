"""Calling a scorer: JSON requests to its OpenAI-compatible endpoint, off the caller's thread.

`ScorerClient.post(path, body)` returns a `concurrent.futures.Future` at once; the request runs
on the client's own event loop (one thread), at most `max_concurrency` at a time, through the
OpenAI SDK's client, which owns the timeouts (`timeout_s`) and the retries of a request that
failed on a reachable server (`retries`: timeouts, 408/409/429/5xx, with backoff and
Retry-After). What the SDK gives up on fails the call — `ScorerCallError`, its `failure`
"timeout" or "error" — and the caller counts it (`generator.reward.on_error`); nothing fails
silently.

An unreachable server is not a failed call but one starting or restarting (the supervisor
restarts a served scorer that died): the call waits, looking up the server's address again
(a served scorer publishes it in the run's storage, `storage.control.endpoints`, and a restart
may move it), then fails once the server has been unreachable for `unavailable_s` — every
call waiting then, whenever it was submitted, so a dead scorer surfaces within `unavailable_s`
and not once per queued call. A waiting call holds no concurrency slot. Waiting calls keep
their groups in flight, so the generator's bound on groups in flight holds sampling back
meanwhile instead of piling up work.

Credentials: an external endpoint's key is read from the environment variable the config
names (`key_env`), when the client opens; it lives only in this process's memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

import openai

from storage.control.endpoints import Endpoint, read_endpoint
from storage.fs import Location
from streamrl.scorers.config import ScorerConfig, scorer_process_name

__all__ = ["ScorerCallError", "ScorerClient"]

log = logging.getLogger(__name__)
logging.getLogger("openai").setLevel(logging.WARNING)  # its debug lines carry request options
logging.getLogger("httpx").setLevel(logging.WARNING)

_T = TypeVar("_T")
UNAVAILABLE_POLL_S = (0.5, 10.0)  # backoff while a server is unreachable: first, longest


class ScorerCallError(RuntimeError):
    """A scorer call that failed for good: `failure` "timeout" (the server did not answer in
    time, after the retries, or stayed unreachable) or "error" (it answered with an error, or
    with something the caller could not use); `status`: the HTTP status it answered with."""

    def __init__(
        self,
        message: str,
        failure: Literal["timeout", "error"] = "error",
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.failure = failure
        self.status = status

    @property
    def refused(self) -> bool:
        """The server refused the request itself (HTTP 400: e.g. a prompt longer than its
        context), rather than failing to answer it."""
        return self.status == 400


class ScorerClient:
    """One generator's connection to scorer `name` (module docstring). Use as a context
    manager, or `open()` / `close()`."""

    def __init__(self, name: str, config: ScorerConfig, run: Location | None) -> None:
        if config.served and run is None:
            raise ValueError(f"scorer {name!r} is served by the run: its client needs the run")
        self.name, self.config, self.run = name, config, run
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._slots: asyncio.Semaphore | None = None
        self._client: openai.AsyncOpenAI | None = None
        self._retired: list[openai.AsyncOpenAI] = []  # clients of addresses that stopped answering
        self._address: str | None = None
        self._is_stale = False  # the server stopped answering at `_address`
        self._unreachable_since: float | None = None  # since when no call reached it
        self._api_key = "EMPTY"  # a vLLM server the run starts takes no key

    @property
    def model(self) -> str:
        """The model name requests carry: the served scorer's own name, or the external
        endpoint's model."""
        return self.name if self.config.served else self.config.model

    def open(self) -> ScorerClient:
        if self._loop is not None:
            return self
        env = self.config.key_env
        if env is not None:
            key = os.environ.get(env)
            if not key:
                raise ValueError(
                    f"scorers.{self.name}.key_env={env}, but that environment variable is "
                    "not set in this process; set it where the generators run (for work pools: "
                    "the worker's environment or the job's secret)"
                )
            self._api_key = key
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"scorer-{self.name}", daemon=True
        )
        self._thread.start()
        self._slots = asyncio.run_coroutine_threadsafe(self._make_slots(), self._loop).result()
        return self

    async def _make_slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.config.max_concurrency)

    def __enter__(self) -> ScorerClient:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the calls in flight (their futures fail) and stop the loop; never raises."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=30)
        except Exception as exc:  # a call that would not end: the loop stops anyway
            log.warning("scorer %s: its client did not shut down cleanly (%r)", self.name, exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not loop.is_running():
            loop.close()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in [*self._retired, *([self._client] if self._client else [])]:
            await client.close()
        self._client, self._retired = None, []

    def post(
        self, path: str, body: dict[str, Any], read: Callable[[Any], _T] = lambda answer: answer
    ) -> Future[_T]:
        """POST `body` (JSON) to `path` under the scorer's base URL (…/v1; a path starting with
        '/' under the server's root); a future of `read(the JSON answer)`, or of a
        `ScorerCallError` — also when `read` finds the answer unusable (raises)."""
        if self._loop is None:
            raise RuntimeError(f"the client of scorer {self.name!r} is not open")
        give_up = time.monotonic() + self.config.unavailable_s
        return asyncio.run_coroutine_threadsafe(self._post(path, body, read, give_up), self._loop)

    async def _post(
        self, path: str, body: dict[str, Any], read: Callable[[Any], _T], give_up: float
    ) -> _T:
        answer = await self._call(path, body, give_up)
        try:
            return read(answer)
        except Exception as exc:
            raise ScorerCallError(
                f"scorer {self.name!r} answered {path} with something unusable: "
                f"{_brief(f'{type(exc).__name__}: {exc}')}"
            ) from exc

    async def _call(self, path: str, body: dict[str, Any], give_up: float) -> Any:
        """The answer to one request. A request holds one of `max_concurrency` slots while it
        is sent, never while it waits for an unreachable server; every waiting call fails once
        the server has been unreachable for `unavailable_s` (or this call has waited as long
        since it was submitted)."""
        assert self._slots is not None
        pause = UNAVAILABLE_POLL_S[0]
        while True:
            client = await self._current_client()
            if client is not None:
                try:
                    async with self._slots:
                        answer = await client.post(self._url(path), cast_to=object, body=body)
                    self._unreachable_since = None
                    return answer
                except openai.APITimeoutError as exc:
                    raise ScorerCallError(
                        f"scorer {self.name!r} did not answer {path} within "
                        f"timeout_s={self.config.timeout_s:g} ({self.config.retries} retries)",
                        "timeout",
                    ) from exc
                except openai.APIStatusError as exc:
                    raise ScorerCallError(
                        f"scorer {self.name!r} answered {path} with HTTP {exc.status_code}: "
                        f"{_brief(exc.message)}",
                        status=exc.status_code,
                    ) from exc
                except openai.APIConnectionError:
                    self._stale(client)  # unreachable: look the address up again
                except openai.OpenAIError as exc:  # anything else the SDK could not use
                    raise ScorerCallError(
                        f"scorer {self.name!r} failed on {path}: {type(exc).__name__}: "
                        f"{_brief(str(exc))}"
                    ) from exc
            now = time.monotonic()
            if self._unreachable_since is None:
                self._unreachable_since = now
            if now >= min(give_up, self._unreachable_since + self.config.unavailable_s):
                raise ScorerCallError(
                    f"scorer {self.name!r} was unreachable for unavailable_s="
                    f"{self.config.unavailable_s:g}s ({self._where()})",
                    "timeout",
                )
            await asyncio.sleep(min(pause, max(0.0, give_up - now)))
            pause = min(2 * pause, UNAVAILABLE_POLL_S[1])

    async def _current_client(self) -> openai.AsyncOpenAI | None:
        """The SDK client for the scorer's address (None: a served scorer that has not
        published one yet). The address is looked up once, and again after the server could
        not be reached (`_stale`), off the loop (it may read remote storage): a restarted
        server may have moved; an unmoved one keeps its client."""
        if self._client is not None and not self._is_stale:
            return self._client
        address = await asyncio.to_thread(self._resolve)
        if address is None:
            return None
        if self._client is not None and address == self._address:
            self._is_stale = False
            return self._client
        if self._client is not None:
            self._retired.append(self._client)  # closed at shutdown: calls may still be on it
        self._client = openai.AsyncOpenAI(
            base_url=address,
            api_key=self._api_key,
            timeout=self.config.timeout_s,
            max_retries=self.config.retries,
        )
        self._address, self._is_stale = address, False
        return self._client

    def _stale(self, client: openai.AsyncOpenAI) -> None:
        if self._client is client:
            self._is_stale = True

    def _url(self, path: str) -> str:
        """`path` under the base URL (…/v1), or, starting with '/', under the server's root
        (vLLM's `/classify`)."""
        if not path.startswith("/"):
            return path
        assert self._address is not None
        root = self._address.removesuffix("/").removesuffix("/v1")
        return root + path

    def _resolve(self) -> str | None:
        if not self.config.served:
            return self.config.url
        assert self.run is not None
        try:
            endpoint: Endpoint | None = read_endpoint(self.run, scorer_process_name(self.name))
        except Exception as exc:  # storage unreachable (any backend's error): try again later
            log.warning("scorer %s: could not read its address (%r); retrying", self.name, exc)
            return None
        return endpoint.url if endpoint is not None else None

    def _where(self) -> str:
        if not self.config.served:
            return f"url {self.config.url}"
        return f"served by the run: see logs/{scorer_process_name(self.name)}.log"


def _brief(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "…"
