"""`make image` installs and starts what Docker lacks (`ensure_docker` of scripts/image.sh): the
package `docker.io` when the client or the daemon (`dockerd`) is missing — a machine with the
client alone has no daemon to start — and `dockerd` when it is not running.

The script's own function runs, sourced, in a shell whose PATH holds only stand-ins for what a
test cannot do to its machine: `apt-get` (records the call and installs a `dockerd` that, run,
makes `docker info` answer), `docker`, `id` (root) and the few tools the function uses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "image.sh"
TOOLS = ("bash", "dirname", "rm", "setsid", "seq", "sleep", "touch", "cat", "chmod")

DOCKER = """#!/usr/bin/env bash
[[ "$1" == info && -f "$STATE/daemon-up" ]]
"""
DOCKERD = """#!/usr/bin/env bash
touch "$STATE/daemon-up"
"""
APT_GET = """#!/usr/bin/env bash
printf '%s\\n' "$*" >>"$STATE/apt-get.log"
if [[ " $* " == *" install "* && " $* " == *" docker.io "* ]]; then
    printf '%s' "$DOCKER_STUB" >"$BIN/docker" && chmod +x "$BIN/docker"
    printf '%s' "$DOCKERD_STUB" >"$BIN/dockerd" && chmod +x "$BIN/dockerd"
fi
"""
ROOT_ID = """#!/usr/bin/env bash
echo 0
"""


def _ensure_docker(tmp_path: Path, *, client: bool, daemon: bool, running: bool) -> list[str]:
    """Run `ensure_docker` on a machine with what is given; the apt-get commands it ran."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    stubs = {"apt-get": APT_GET, "id": ROOT_ID}
    stubs |= {"docker": DOCKER} if client else {}
    stubs |= {"dockerd": DOCKERD} if daemon else {}
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if running:
        (state / "daemon-up").touch()
    env = {
        "PATH": str(bin_dir),
        "BIN": str(bin_dir),
        "STATE": str(state),
        "DOCKER_STUB": DOCKER,
        "DOCKERD_STUB": DOCKERD,
        "DOCKERD_LOG": str(state / "dockerd.log"),
    }
    done = subprocess.run(
        [shutil.which("bash"), "-c", f'source "{SCRIPT}" && ensure_docker'],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert (state / "daemon-up").exists(), "no daemon runs"
    apt_get = (state / "apt-get.log").read_text() if (state / "apt-get.log").exists() else ""
    return [line for line in apt_get.splitlines() if "install" in line]


@pytest.mark.parametrize(
    ("client", "daemon", "running", "installs"),
    [
        (True, False, False, True),  # the client alone: nothing to start without installing
        (False, False, False, True),
        (True, True, False, False),  # both there: dockerd is started, nothing installed
        (True, True, True, False),
    ],
    ids=["client-without-daemon", "no-docker", "daemon-stopped", "daemon-running"],
)
def test_docker_is_installed_when_the_client_or_the_daemon_is_missing(
    tmp_path: Path, client: bool, daemon: bool, running: bool, installs: bool
) -> None:
    installed = _ensure_docker(tmp_path, client=client, daemon=daemon, running=running)
    assert installed == (["install -y -qq docker.io"] if installs else [])
