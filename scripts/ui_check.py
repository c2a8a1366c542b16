"""Check that the Prefect UI shows a streamrl flow run and its artifacts, with a headless browser.

    python scripts/ui_check.py --flow-run FLOW_RUN_ID [--api http://127.0.0.1:4200/api] [--out DIR]

Renders the flow run's page and its metrics-table and progress artifacts' pages in headless
Chromium (`chromium` on PATH, e.g. `apt-get install chromium`), saves a screenshot of each into
`--out`, and fails unless the rendered pages show the flow run's name, its state and the
artifacts' content (the metrics table's rows). The API URL defaults to PREFECT_API_URL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> str:
    for name in BROWSER_NAMES:
        if path := shutil.which(name):
            return path
    sys.exit(f"no headless browser found ({', '.join(BROWSER_NAMES)}); install chromium")


def _render(browser: str, url: str, screenshot: Path) -> str:
    """The page's DOM after its scripts ran; a screenshot of it into `screenshot`."""
    common = [
        browser,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1440,1100",
        "--virtual-time-budget=20000",
    ]
    subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    done = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return done.stdout


async def _flow_run(flow_run_id: str):
    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    return run, artifacts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flow-run", required=True, help="the flow run's id")
    parser.add_argument("--api", default=os.environ.get("PREFECT_API_URL"), help="Prefect API URL")
    parser.add_argument("--out", default="ui-check", help="folder for the screenshots")
    args = parser.parse_args()
    if not args.api:
        sys.exit("no Prefect API URL: pass --api or set PREFECT_API_URL (make up prints it)")
    os.environ["PREFECT_API_URL"] = args.api
    ui = args.api.removesuffix("/").removesuffix("/api")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    browser = _browser()

    run, artifacts = asyncio.run(_flow_run(args.flow_run))
    table = max((a for a in artifacts if a.type == "markdown"), key=lambda a: a.created)
    progress = next(a for a in artifacts if a.type == "progress")
    pages = {
        "flow-run": (f"{ui}/runs/flow-run/{run.id}", [run.name, run.state.name, "learner"]),
        "metrics-table": (f"{ui}/artifacts/artifact/{table.id}", ["reward (mean)", "accuracy"]),
        "progress": (f"{ui}/artifacts/artifact/{progress.id}", [progress.key, "100"]),
    }
    failures = []
    for name, (url, expected) in pages.items():
        dom = _render(browser, url, out / f"{name}.png")
        missing = [text for text in expected if text not in dom]
        status = "ok" if not missing else f"MISSING {missing}"
        print(f"{name:14s} {url}\n{'':14s} screenshot {out / f'{name}.png'}: {status}")
        if missing:
            failures.append(name)
    print(f"flow run {run.name}: {run.state.name}; artifacts: {sorted({a.key for a in artifacts})}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
