"""The demo's Prefect temporary server gets the time a busy machine needs to start it, and
starts without its telemetry write (`flows.demo.flow_environment`): checked by Prefect's own
settings read from that environment, so a misspelt setting, which Prefect would ignore, fails
here. The slow test starts the server itself with every core busy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prefect.settings import Settings

from flows.demo import flow_environment
from tests.load import busy_loops

DEFAULT_STARTUP_TIMEOUT_S = 20  # Prefect's own: too short on a busy machine


def _prefect_settings(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [n for n in os.environ if n.startswith("PREFECT_")]:
        monkeypatch.delenv(name)
    for name, value in environ.items():
        if name.startswith("PREFECT_"):
            monkeypatch.setenv(name, value)
    return Settings()


def test_the_flow_process_gives_the_temporary_server_time_and_no_telemetry(monkeypatch) -> None:
    default = _prefect_settings({}, monkeypatch).server.ephemeral.startup_timeout_seconds
    assert default == DEFAULT_STARTUP_TIMEOUT_S
    settings = _prefect_settings(flow_environment({"HOME": "/home/someone"}), monkeypatch)
    assert settings.server.ephemeral.startup_timeout_seconds >= 120
    assert settings.server.analytics_enabled is False


def test_the_users_own_prefect_settings_win(monkeypatch) -> None:
    own = {
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "true",
    }
    settings = _prefect_settings(flow_environment(own), monkeypatch)
    assert settings.server.ephemeral.startup_timeout_seconds == 600
    assert settings.server.analytics_enabled is True


START_THE_SERVER = """
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer()
server.start()
print("up", flush=True)
server.stop()
"""


@pytest.mark.slow
def test_the_temporary_server_starts_with_every_core_busy(tmp_path) -> None:
    """As `make demo` on a loaded machine: a fresh database (its migrations run at start) and
    one busy process a core."""
    clean = {n: v for n, v in os.environ.items() if not n.startswith("PREFECT_")}
    env = {**flow_environment(clean), "PREFECT_HOME": str(tmp_path / "prefect")}
    with busy_loops():
        done = subprocess.run(
            [sys.executable, "-c", START_THE_SERVER],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "up"
