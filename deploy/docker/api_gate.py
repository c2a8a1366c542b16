"""The Prefect API as a flow run's container sees it: a gate that lets each flow run act on
itself and on nothing else.

Open-source Prefect has one credential, the server's basic-auth string, and it can do anything:
start a flow run on any pool (the `local` pool runs its flow runs as the host's user). So the
Docker pools' containers never get it. The stack's Prefect server listens on 127.0.0.1; this
gate listens on the containers' gateway (scripts/stack.sh) and forwards to it, with the
server's credential, only what a flow run does for itself, as `prefect flow-run execute` does it
(read its flow run, deployment, flow, work queue and pool; set its own state; write its own
logs; send and receive events about itself). Everything else is refused with 403.

Each container's credential is its own (`flow_run_credential`, which the Docker pools' worker,
deploy/docker/worker.py, puts in the container's `PREFECT_API_AUTH_STRING`):
`<flow run id>:<HMAC-SHA256 of the id under the gate's key>`. The key (<stack>/flow-run.key)
never leaves the host. A container that reads its environment, or code that runs in it, can
so act only on its own flow run: set its state, log, rename it, or reschedule it on its own
pool, with the job variables it was given. It cannot start, cancel or read other flow runs,
change its job variables, read deployments, blocks or variables, or touch work pools.

    python -m deploy.docker.api_gate --listen 172.18.0.1:4201 \\
        --upstream http://127.0.0.1:4200 --auth-file .stack/auth --key-file .stack/flow-run.key
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

__all__ = ["FlowRunScope", "allowed", "create_app", "flow_run_credential", "flow_run_of"]

log = logging.getLogger("api_gate")

# Hop-by-hop and per-connection headers are the gate's own; the credential is replaced.
_NOT_FORWARDED = {"host", "authorization", "content-length", "connection", "transfer-encoding"}
_ID = r"([0-9a-fA-F-]{36})"


def flow_run_credential(key: bytes, flow_run_id: UUID) -> str:
    """The `PREFECT_API_AUTH_STRING` of flow run `flow_run_id`'s container."""
    mac = hmac.new(key, str(flow_run_id).encode(), hashlib.sha256).hexdigest()
    return f"{flow_run_id}:{mac}"


def flow_run_of(key: bytes, credential: str | None) -> UUID | None:
    """The flow run a credential was made for, or None when it is not one of ours."""
    if not credential:
        return None
    run, _, _ = credential.partition(":")
    try:
        flow_run_id = UUID(run)
    except ValueError:
        return None
    expected = flow_run_credential(key, flow_run_id).encode()
    return flow_run_id if hmac.compare_digest(expected, credential.encode()) else None


def _basic_credential(header: str | None) -> str | None:
    scheme, _, encoded = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class FlowRunScope:
    """What a flow run may read besides itself: what it was created from."""

    flow_run_id: UUID
    deployment_id: str | None
    flow_id: str
    work_queue_id: str | None
    work_pool_name: str | None


def _own_logs(scope: FlowRunScope, body: Any) -> bool:
    return isinstance(body, list) and all(
        isinstance(entry, dict) and entry.get("flow_run_id") == str(scope.flow_run_id)
        for entry in body
    )


# What the engine updates on its flow run. Not `job_variables`: a container that set its own
# (a host folder in `volumes`, another network) and rescheduled itself would come back with them.
_UPDATABLE = {"flow_version", "empirical_policy", "name", "tags"}


def _own_update(scope: FlowRunScope, body: Any) -> bool:
    return isinstance(body, dict) and set(body) <= _UPDATABLE


def _own_flow_run_filter(scope: FlowRunScope, body: Any) -> bool:
    """The cancellation observer's poll: flow runs filtered to this one's id."""
    if not isinstance(body, dict):
        return False
    ids = ((body.get("flow_runs") or {}).get("id") or {}).get("any_")
    others = ("flows", "task_runs", "deployments", "work_pools", "work_pool_queues")
    return ids == [str(scope.flow_run_id)] and not any(body.get(k) for k in others)


_Check = Callable[[FlowRunScope, Any], bool]
_ANY: _Check = lambda scope, body: True  # noqa: E731


def _rules(scope: FlowRunScope) -> list[tuple[str, str, _Check]]:
    """(method, path under /api, check of the JSON body): the calls a flow run makes."""
    own = re.escape(str(scope.flow_run_id))
    named = [
        ("GET", r"/admin/version", _ANY),
        ("GET", r"/csrf-token", _ANY),
        ("GET", rf"/flow_runs/{own}", _ANY),
        ("PATCH", rf"/flow_runs/{own}", _own_update),
        ("POST", rf"/flow_runs/{own}/set_state", _ANY),
        ("POST", r"/flow_runs/filter", _own_flow_run_filter),
        ("POST", r"/logs/?", _own_logs),
        ("GET", rf"/flows/{re.escape(scope.flow_id)}", _ANY),
    ]
    for path, value in (
        ("deployments", scope.deployment_id),
        ("work_queues", scope.work_queue_id),
        ("work_pools", scope.work_pool_name),
    ):
        if value is not None:
            named.append(("GET", rf"/{path}/{re.escape(value)}", _ANY))
    return named


def allowed(scope: FlowRunScope, method: str, path: str, body: Any) -> bool:
    """Whether the flow run of `scope` may make this call (`path` as sent, `/api/...`)."""
    if not path.startswith("/api/"):
        return False
    tail = path.removeprefix("/api")
    return any(
        method == want and re.fullmatch(pattern, tail) and check(scope, body)
        for want, pattern, check in _rules(scope)
    )


def _own_event(scope: FlowRunScope, event: Any) -> bool:
    """An event about this flow run, one of its task runs or its runner acting on it (the runner
    in the container says when it cancelled the flow run), naming no other flow run."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    own = f"prefect.flow-run.{scope.flow_run_id}"
    resource = event.get("resource") or {}
    related = event.get("related") or []
    if not isinstance(resource, dict) or not isinstance(related, list):
        return False
    ids = [r.get("prefect.resource.id", "") for r in (resource, *related) if isinstance(r, dict)]
    if any(i.startswith("prefect.flow-run.") and i != own for i in ids):
        return False
    subject = resource.get("prefect.resource.id", "")
    if subject == own:
        return event["event"].startswith("prefect.flow-run.")
    if subject.startswith("prefect.runner."):
        return event["event"].startswith("prefect.runner.") and own in ids
    if not subject.startswith("prefect.task-run.") or own not in ids:
        return False
    task_run = (event.get("payload") or {}).get("task_run") or {}
    return task_run.get("flow_run_id") in (None, str(scope.flow_run_id))


def create_app(upstream: str, server_credential: str, key: bytes) -> Starlette:
    """The gate in front of the Prefect server at `upstream` (`http://127.0.0.1:4200`)."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(60.0))
    server_auth = "Basic " + base64.b64encode(server_credential.encode()).decode()
    scopes: dict[UUID, FlowRunScope] = {}

    async def scope_of(flow_run_id: UUID) -> FlowRunScope | None:
        """The flow run's scope (None: no such flow run); a server that fails raises."""
        if flow_run_id not in scopes:
            response = await client.get(
                f"/api/flow_runs/{flow_run_id}", headers={"Authorization": server_auth}
            )
            if response.status_code == 404:
                return None
            response.raise_for_status()
            run = response.json()
            scopes[flow_run_id] = FlowRunScope(
                flow_run_id=flow_run_id,
                deployment_id=run.get("deployment_id"),
                flow_id=run["flow_id"],
                work_queue_id=run.get("work_queue_id"),
                work_pool_name=run.get("work_pool_name"),
            )
        return scopes[flow_run_id]

    def refuse(what: str, why: str) -> JSONResponse:
        log.warning("refused %r: %s", what, why)
        return JSONResponse(
            {"detail": f"{what} refused: {why} (the Docker pools' API gate, deploy/docker)"},
            status_code=403,
        )

    async def forward(request: Request) -> Response:
        what = f"{request.method} {request.url.path}"
        content = await request.body()
        if what != "GET /api/health":  # as on the server, the one call without a credential
            flow_run_id = flow_run_of(key, _basic_credential(request.headers.get("authorization")))
            if flow_run_id is None:
                return refuse(what, "not a flow run's credential")
            scope = await scope_of(flow_run_id)
            if scope is None:
                return refuse(what, f"flow run {flow_run_id} does not exist")
            try:
                body = json.loads(content) if content else None
            except ValueError:
                return refuse(what, "the body is not JSON")
            if not allowed(scope, request.method, request.url.path, body):
                return refuse(what, f"flow run {flow_run_id} may act only on itself")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        query = f"?{request.url.query}" if request.url.query else ""
        response = await client.request(
            request.method,
            request.url.path + query,
            content=content,
            headers={**headers, "Authorization": server_auth},
        )
        kept = {k: v for k, v in response.headers.items() if k.lower() == "content-type"}
        return Response(response.content, response.status_code, headers=kept)

    async def events(websocket: WebSocket) -> None:
        """/api/events/in (the flow run's events) and /api/events/out (its cancellation)."""
        path = websocket.url.path
        await websocket.accept(subprotocol="prefect")
        try:
            message = await websocket.receive_json()
        except (WebSocketDisconnect, ValueError):
            return
        flow_run_id = flow_run_of(key, message.get("token") if isinstance(message, dict) else None)
        scope = await scope_of(flow_run_id) if flow_run_id else None
        if scope is None:
            log.warning("refused websocket %s: not a flow run's credential", path)
            await websocket.close(1008, "not a flow run's credential")
            return
        url = upstream.replace("http", "ws", 1) + path
        inbound = path.endswith("/events/in")
        async with websockets.connect(url, subprotocols=["prefect"]) as server:
            await server.send(json.dumps({"type": "auth", "token": server_credential}))
            await server.recv()
            await websocket.send_json({"type": "auth_success"})

            async def from_client() -> None:
                while True:
                    text = await websocket.receive_text()
                    sent = _checked_message(scope, text, inbound)
                    if sent is None:
                        log.warning("dropped a message of flow run %s: %r", flow_run_id, text[:300])
                    else:
                        await server.send(sent)

            async def to_client() -> None:
                async for message in server:
                    text = message if isinstance(message, str) else message.decode()
                    await websocket.send_text(text)

            relays = [asyncio.create_task(from_client()), asyncio.create_task(to_client())]
            done, pending = await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
            for relay in pending:
                relay.cancel()
            for relay in done:  # either side hanging up ends both
                if isinstance(relay.exception(), Exception) and not isinstance(
                    relay.exception(), WebSocketDisconnect | websockets.ConnectionClosed
                ):
                    log.warning("events relay of flow run %s: %r", flow_run_id, relay.exception())
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the client hung up
            await websocket.close()

    return Starlette(
        routes=[
            WebSocketRoute("/api/events/in", events),
            WebSocketRoute("/api/events/out", events),
            Route("/{path:path}", forward, methods=["GET", "POST", "PATCH", "PUT", "DELETE"]),
        ],
        lifespan=lambda app: _closing(client),
    )


@contextlib.asynccontextmanager
async def _closing(client: httpx.AsyncClient) -> AsyncIterator[None]:
    yield
    await client.aclose()


def _checked_message(scope: FlowRunScope, text: str, inbound: bool) -> str | None:
    """An event sent in, if it is about this flow run; a subscription's filter, narrowed to
    this flow run's events."""
    try:
        message = json.loads(text)
    except ValueError:
        return None
    if inbound:
        return text if _own_event(scope, message) else None
    if not isinstance(message, dict) or message.get("type") != "filter":
        return None
    narrowed = dict(message.get("filter") or {})
    narrowed["resource"] = {"id": [f"prefect.flow-run.{scope.flow_run_id}"]}
    return json.dumps({**message, "filter": narrowed})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT the containers reach")
    parser.add_argument("--upstream", required=True, help="the server, http://127.0.0.1:PORT")
    parser.add_argument("--auth-file", required=True, type=Path, help="the server's credential")
    parser.add_argument("--key-file", required=True, type=Path, help="the flow runs' key")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded call
    host, _, port = args.listen.rpartition(":")
    app = create_app(
        args.upstream.rstrip("/"), args.auth_file.read_text().strip(), args.key_file.read_bytes()
    )
    uvicorn.run(app, host=host, port=int(port), log_level="warning")


if __name__ == "__main__":
    main()
