"""`scripts/ui_check.py` against a real Prefect server and its UI, protected by basic auth as
the local stack's is: with the server's profile active (as `make up` leaves it: URL and
credential) and no PREFECT_API_URL, it finds the server, logs the browser in, renders the flow
run's curves artifact in headless Chromium and sees the image; a page without one fails."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.torchrun import free_port

REPO = Path(__file__).resolve().parents[2]
PREFECT = Path(sys.executable).with_name("prefect")

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium on PATH"),
]

_FLOW = textwrap.dedent(
    """
    import json, sys
    from prefect import flow, task
    from prefect.context import get_run_context
    from flows.artifacts import RunArtifacts
    from storage.fs import open_location
    from storage.control.manifest import create_run
    from streamrl.config.loading import load_config

    @task
    def learner(run_uri: str) -> None:
        config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_uri}"])
        RunArtifacts(config, open_location(run_uri)).refresh(final=True)

    @flow
    def streamrl(run_uri: str) -> str:
        learner(run_uri)
        return str(get_run_context().flow_run.id)

    run_uri = sys.argv[1]
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_uri}"])
    create_run(open_location(run_uri), config.model_dump(mode="json"))
    metrics = open_location(run_uri).join("metrics")
    open_location(run_uri).fs.makedirs(metrics, exist_ok=True)
    with open(metrics + "/learner.jsonl", "w") as f:
        for step in range(1, 9):
            record = {"step": step, "rollout/reward_mean": -1 + step / 8, "rollout/acc": step / 10}
            f.write(json.dumps(record) + "\\n")
    print(streamrl(run_uri))
    """
)


@pytest.fixture(scope="module")
def prefect_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A Prefect server with its UI on a free port, behind basic auth, and the environment of a
    user whose active profile points at it with the credential (PREFECT_API_URL unset)."""
    home = tmp_path_factory.mktemp("prefect-home")
    api = f"http://127.0.0.1:{free_port()}/api"
    auth = f"admin:{secrets.token_urlsafe(16)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(REPO))
    server_env = {
        **env,
        "PREFECT_SERVER_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_AUTH_STRING": auth,
    }
    port = api.split(":")[2].split("/")[0]
    with (home / "server.log").open("w") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", port],
            env=server_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_healthy(api, server, home / "server.log")
        for command in (
            ["profile", "create", "ui-check"],
            ["--profile", "ui-check", "config", "set", f"PREFECT_API_URL={api}"],
            ["--profile", "ui-check", "config", "set", f"PREFECT_API_AUTH_STRING={auth}"],
            ["profile", "use", "ui-check"],
        ):
            subprocess.run([PREFECT, *command], env=env, check=True, capture_output=True)
        yield env
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def _wait_healthy(api: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"prefect server exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"prefect server not healthy in {timeout_s}s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow  # ~90 s on 2 cores: a Prefect server with its UI, eight Chromium renders
def test_ui_check_uses_the_active_profile_and_sees_the_curves_image(prefect_ui, tmp_path):
    made = subprocess.run(
        [sys.executable, "-c", _FLOW, str(tmp_path / "runs" / "ui-run")],
        env=prefect_ui,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    flow_run_id = made.stdout.strip().splitlines()[-1]
    shots = tmp_path / "shots"

    check = subprocess.run(
        [sys.executable, REPO / "scripts/ui_check.py", "--flow-run", flow_run_id, "--out", shots],
        env=prefect_ui,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]
    assert "curves" in check.stdout
    assert "streamrl-ui-run-curves" in check.stdout
    assert (shots / "curves.png").stat().st_size > 10_000


def _ui_check_module():
    spec = importlib.util.spec_from_file_location("ui_check", REPO / "scripts" / "ui_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_page_shows_an_image_only_with_a_large_enough_png():
    import base64
    import io

    from PIL import Image

    def page(size: tuple[int, int]) -> str:
        buffer = io.BytesIO()
        Image.new("RGB", size, "white").save(buffer, format="PNG")
        data = base64.b64encode(buffer.getvalue()).decode()
        return f'<div><img src="data:image/png;base64,{data}" alt="curves"></div>'

    ui_check = _ui_check_module()
    assert ui_check._shows_image(page((900, 600)))
    assert not ui_check._shows_image(page((20, 20)))  # an icon is not the curves
    assert not ui_check._shows_image('<div><img src="data:image/png;base64,AAAA"></div>')
    assert not ui_check._shows_image("<h3>Curves of run</h3><p>no image</p>")
