"""Check with a headless browser that the Prefect UI shows a flow run, its artifacts and children.

    python scripts/ui_check.py --flow-run FLOW_RUN_ID [--api http://127.0.0.1:4200/api] [--out DIR]

Renders the flow run's page and its metrics-table, curves and progress artifacts' pages in
headless Chromium (`chromium` on PATH, e.g. `apt-get install chromium`; driven over its DevTools
protocol), saves a screenshot of each into `--out`, and fails unless the rendered pages show the
flow run's name, its state and the artifacts' content within 30 s: the metrics table's rows, and
on the curves page an image (a PNG of at least 300×200 pixels in the rendered page). The API URL
and its basic-auth credential default to Prefect's own settings: the active profile's (the one
`make up` made active: the stack's server asks for its credential), or PREFECT_API_URL and
PREFECT_API_AUTH_STRING. With a credential the browser is logged in as after the UI's password
prompt (the UI keeps the credential in its local storage).

A run placed on work pools (`placement.mode=pools`) has child flow runs: its learner node(s),
generators and evaluator, each a run of its own deployment. When the flow run has children
(flow runs whose parent task run belongs to it: what the UI's "Subflow Runs" tab lists), the
script prints one line per child (name, state, work pool, deployment), renders the parent's
page on that tab (`/runs/flow-run/<id>?tab=Subflow%20Runs`) into `subflow-runs.png`, and fails
unless the children's names appear there (the tab lists 10 runs a page: with more children,
any 10 of them).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterId,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings
from websockets.sync.client import connect

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome")
LIST_LIMIT = 10  # runs per page in the UI's flow run lists (its default)
PAGE = 200  # flow runs per API request
MIN_IMAGE = (300, 200)  # the smallest curves image (pixels) that counts as shown
RENDER_S = 30.0  # how long a page may take to show what is expected
START_S = 60.0  # how long Chromium may take to start
COMMAND_S = 120.0  # how long one DevTools command may take (a navigation: the server's answer)


def _browser() -> str:
    for name in BROWSER_NAMES:
        if path := shutil.which(name):
            return path
    sys.exit(f"no headless browser found ({', '.join(BROWSER_NAMES)}); install chromium")


class _Browser:
    """Headless Chromium with one tab, driven over the DevTools protocol; a context manager.
    With `auth` (the API's `user:password`), every page starts logged in."""

    def __init__(self, executable: str, auth: str | None) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="ui-check-")
        self._process = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1440,1100",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._folder.name}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._ids = itertools.count(1)
        port, path = self._devtools_address()
        self._socket = connect(f"ws://127.0.0.1:{port}{path}", max_size=None)
        target = self._call("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = self._call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
        )
        self._session = attached["sessionId"]
        self._call("Page.enable")
        if auth:  # where the UI's password prompt keeps it (its API client sends it from there)
            stored = json.dumps(base64.b64encode(auth.encode()).decode())
            self._call(
                "Page.addScriptToEvaluateOnNewDocument",
                {"source": f"localStorage.setItem('prefect-password', {stored})"},
            )

    def _devtools_address(self) -> tuple[str, str]:
        """Chromium's DevTools port and browser path, from the file it writes once listening."""
        written = Path(self._folder.name) / "DevToolsActivePort"
        deadline = time.monotonic() + START_S
        while len(lines := (written.read_text().splitlines() if written.exists() else [])) < 2:
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                sys.exit(f"chromium did not start within {START_S:.0f} s")
            time.sleep(0.1)
        return lines[0], lines[1]

    def _call(self, method: str, params: dict[str, Any] | None = None, page: bool = True) -> Any:
        """Send one command (to the tab unless `page` is False) and return its result."""
        call = {"id": next(self._ids), "method": method, "params": params or {}}
        if page:
            call["sessionId"] = self._session
        self._socket.send(json.dumps(call))
        while True:  # events arrive in between; the answer carries the command's id
            message = json.loads(self._socket.recv(timeout=COMMAND_S))
            if message.get("id") == call["id"]:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def render(self, url: str, screenshot: Path, ready: Callable[[str], bool]) -> str:
        """The page's DOM once `ready(dom)` holds (or after RENDER_S); a screenshot of it
        into `screenshot`."""
        self._call("Page.navigate", {"url": "about:blank"})  # nothing of the last page is left
        self._call("Page.navigate", {"url": url})
        deadline = time.monotonic() + RENDER_S
        while True:
            time.sleep(0.5)
            loaded, dom = self._call(
                "Runtime.evaluate",
                {
                    "expression": "[document.readyState, document.documentElement.outerHTML]",
                    "returnByValue": True,
                },
            )["result"]["value"]
            if (loaded == "complete" and ready(dom)) or time.monotonic() > deadline:
                break
        shot = self._call("Page.captureScreenshot", {"format": "png"})["data"]
        screenshot.write_bytes(base64.b64decode(shot))
        return dom

    def close(self) -> None:
        if getattr(self, "_socket", None) is not None:
            self._socket.close()
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._folder.cleanup()

    def __enter__(self) -> _Browser:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


async def _flow_run(flow_run_id: str) -> tuple[Any, list[Any], list[Any], dict[Any, str]]:
    """The flow run, its artifacts, its child flow runs (oldest first) and the names
    (flow/deployment) of the children's deployments."""
    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
        children: list[Any] = []
        while True:  # the server links a child through a task run of the parent
            page = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])
                ),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                limit=PAGE,
                offset=len(children),
            )
            children.extend(page)
            if len(page) < PAGE:
                break
        deployments: dict[Any, str] = {}
        ids = list({c.deployment_id for c in children if c.deployment_id})
        if ids:
            found = await client.read_deployments(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids))
            )
            flow_ids = list({d.flow_id for d in found})
            flows = {
                f.id: f.name
                for f in await client.read_flows(
                    flow_filter=FlowFilter(id=FlowFilterId(any_=flow_ids))
                )
            }
            deployments = {d.id: f"{flows.get(d.flow_id, '?')}/{d.name}" for d in found}
    return run, artifacts, children, deployments


def _check(
    browser: _Browser, name: str, url: str, expected: list[str], out: Path, image: bool = False
) -> bool:
    """Render `url`; print whether every text of `expected` appears (and, with `image`, a
    PNG image of at least `MIN_IMAGE` pixels). True when all do."""

    def absent(dom: str) -> list[str]:
        missing = [text for text in expected if text not in dom]
        if image and not _shows_image(dom):
            missing.append(f"an image of at least {MIN_IMAGE[0]}x{MIN_IMAGE[1]} pixels")
        return missing

    missing = absent(browser.render(url, out / f"{name}.png", lambda dom: not absent(dom)))
    status = "ok" if not missing else f"MISSING {missing}"
    print(f"{name:14s} {url}\n{'':14s} screenshot {out / f'{name}.png'}: {status}")
    return not missing


def _shows_image(dom: str) -> bool:
    """Whether the rendered page holds an <img> whose PNG data decodes to a large enough image."""
    from PIL import Image

    for data in re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom):
        try:
            size = Image.open(io.BytesIO(base64.b64decode(data))).size
        except (OSError, ValueError):
            continue
        if size[0] >= MIN_IMAGE[0] and size[1] >= MIN_IMAGE[1]:
            return True
    return False


def _check_children(
    browser: _Browser,
    ui: str,
    run: Any,
    children: list[Any],
    deployments: dict[Any, str],
    out: Path,
) -> bool:
    """Render the parent's Subflow Runs tab and look for the children's names there."""
    name, url = "subflow-runs", f"{ui}/runs/flow-run/{run.id}?tab=Subflow%20Runs"
    wanted = min(len(children), LIST_LIMIT)

    def shown_in(dom: str) -> set[Any]:
        return {c.id for c in children if c.name in dom}

    dom = browser.render(url, out / f"{name}.png", lambda page: len(shown_in(page)) >= wanted)
    shown = shown_in(dom)
    status = "ok" if len(shown) >= wanted else f"MISSING (shown {len(shown)} of {wanted})"
    print(f"{name:14s} {url}\n{'':14s} screenshot {out / f'{name}.png'}: {status}")
    print(f"child flow runs of {run.name}: {len(children)}")
    for child in children:
        state = child.state.name if child.state else "unknown"
        where = deployments.get(child.deployment_id, "no deployment")
        seen = "shown" if child.id in shown else "not shown"
        pool = child.work_pool_name or "-"
        print(f"  {child.name:32s} {state:12s} pool {pool:12s} {where} ({seen})")
    return len(shown) >= wanted


def _newest(artifacts: list[Any], kind: str, key_suffix: str) -> Any | None:
    """The newest artifact of type `kind` whose key ends with `key_suffix`."""
    found = [a for a in artifacts if a.type == kind and (a.key or "").endswith(key_suffix)]
    return max(found, key=lambda a: a.created) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flow-run", required=True, help="the flow run's id")
    parser.add_argument(
        "--api",
        default=get_current_settings().api.url,
        help="Prefect API URL (default: the active Prefect profile's, or PREFECT_API_URL)",
    )
    parser.add_argument("--out", default="ui-check", help="folder for the screenshots")
    args = parser.parse_args()
    secret = get_current_settings().api.auth_string
    auth = secret.get_secret_value() if secret is not None else None
    if not args.api:
        sys.exit(
            "no Prefect API URL: start the stack (`make up` makes its profile active), or pass "
            "--api, or set PREFECT_API_URL"
        )
    ui = args.api.removesuffix("/").removesuffix("/api")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    executable = _browser()

    with temporary_settings({PREFECT_API_URL: args.api}):
        run, artifacts, children, deployments = asyncio.run(_flow_run(args.flow_run))
    pages = {"flow-run": (f"{ui}/runs/flow-run/{run.id}", [run.name, run.state.name, "learner"])}
    table = _newest(artifacts, "markdown", "-metrics")
    curves = _newest(artifacts, "markdown", "-curves")
    progress = _newest(artifacts, "progress", "-progress")
    if table is not None:
        pages["metrics-table"] = (
            f"{ui}/artifacts/artifact/{table.id}",
            ["reward (mean)", "accuracy"],
        )
    if curves is not None:
        pages["curves"] = (f"{ui}/artifacts/artifact/{curves.id}", ["Curves of"])
    if progress is not None:
        pages["progress"] = (f"{ui}/artifacts/artifact/{progress.id}", [progress.key, "100"])
    failures = []
    for kind, found in (("metrics-table", table), ("curves", curves), ("progress", progress)):
        if found is None:
            print(f"{kind:14s} MISSING: the flow run has no {kind} artifact")
            failures.append(kind)
    with _Browser(executable, auth) as browser:
        for name, (url, expected) in pages.items():
            if not _check(browser, name, url, expected, out, image=name == "curves"):
                failures.append(name)
        if children and not _check_children(browser, ui, run, children, deployments, out):
            failures.append("subflow-runs")
    print(f"flow run {run.name}: {run.state.name}; artifacts: {sorted({a.key for a in artifacts})}"
          f"; child flow runs: {len(children)}")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
